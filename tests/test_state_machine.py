"""A hypothesis state machine over the engine, checked after every step against a plain float64 model.

Rules: tick requests on a few session ids (committing and probe forwards, ``reset`` and
``close_session`` flags, forwards that fail before or after committing), ``reset_session``
/ ``close_session`` calls, stepwise requests (denoise steps, the last one commits and
finishes) and aborts, pipeline hooks that fail, batches (one failing row, or the whole batch
failing only when its outputs are awaited, as an asynchronous device error does: the rerun
one by one equals the unbatched outcome), and LRU pressure (four ids, capacity two).
A close hook that fails (``close_session``, or ``engine.close()`` at stop) followed by a
newcomer: the closed session is gone and its slot free, the newcomer evicts nobody (or is
refused, "closed", after a stop).

After every step: resident <= capacity, free + resident == capacity, distinct slots, the
LRU order, exactly one close-or-reset hook per release (in order), and every resident
session's attention output equal to a float64 softmax over its sink + newest window frames
+ current block. A deliberately broken model (it forgets the sink) must be caught.

``ARDIFF_STATE_MACHINE_EXAMPLES`` raises the example count (default 200 in CI).

A second machine drives the host tier and session files with injected faults: requests on
more ids than slots (offload, restore, host-tier drops), saves and loads, closes, batches
(generate_batch), and faults at a restore's page write, at the pipeline's import (restore,
also inside a batch: only that request fails, with a SessionRestoreError) and export (save),
at the await of a batch's outputs (the rerun one by one starts from the model state before
the batch: each session's block count moves once),
at the file write, and in close hooks (then a newcomer that needs room evicts only the least
recently used session, to the tier; at stop every held session still gets its hook).
After every step the resident and offloaded sessions, their order, the hooks and the tier's
bytes equal a model of the policy, every resident session's attention equals the float64
model, and no session but the ones the step hit changed by a byte (pages of its slot or host
record, cursors, run owners, model state; a batch's session whose restore failed before the
import is not hit: it must be exactly as before).
``ARDIFF_HOST_MACHINE_EXAMPLES`` raises its example count (default 30).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ardiff_jax import ARDiffusionEngine, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec, DiffusionRequest, EngineConfig
from ardiff_jax.kv import PagedKVCaches
from ardiff_jax.runtime import ARDiffusionBatchError, branch_cursor_array
from ardiff_jax.runtime._batch import SessionRestoreError
from ardiff_jax.runtime import _session_files as session_files_module
from ardiff_jax.types import StepResult, StepSchedulerOutput

EXAMPLES = int(os.environ.get("ARDIFF_STATE_MACHINE_EXAMPLES", "200"))
SINK, WINDOW, FRAMES, D, CAPACITY = 1, 3, 2, 2, 2
TICK_IDS = ("s0", "s1", "s2")
STEP_IDS = ("q0", "q1")
QUERY = np.array([[0.7, -0.4]], np.float32)  # [S=1, D]: one query token, one head

SPEC = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=D, tokens_per_frame=1,
                              frames_per_block=FRAMES, window_frames=WINDOW, sink_frames=SINK,
                              kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=CAPACITY)


@pytest.fixture(autouse=True)
def _runtime_log_level_restored():
    """The machines quiet the runtime's logger (their faults log warnings on purpose); a level left at ERROR
    would hide the warnings later tests in the same worker assert on (tests/test_batch_compile.py)."""
    logger = logging.getLogger("ardiff_jax.runtime")
    level = logger.level
    yield
    logger.setLevel(level)


@jax.jit
def _attend(caches: PagedKVCaches, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``caches.attend`` at layer 0 as one compiled program (as a model calls it, inside its jit): run eagerly it is
    dozens of op-by-op dispatches, about half of the machines' time; the view (pools, cursor) is an argument, so each
    call reads the engine's current KV, and one geometry compiles once."""
    return caches.attend(0, q, k, v)


@jax.jit
def _attend_rows(caches: PagedKVCaches, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A batched view's rows attended under ``jax.vmap`` (one session per row), as one program per bucket."""
    return jax.vmap(lambda c, q, k, v: c.attend(0, q, k, v), in_axes=(caches.vmap_axes(), 0, 0, 0))(caches, q, k, v)


class HookFailure(RuntimeError):
    pass


class MachinePipeline:
    """Tick: ``inputs["kind"]`` in commit/probe/fail_before/fail_after; stepwise: probes, then one commit."""

    supports_step_execution = True

    def __init__(self) -> None:
        self.state = None
        self.batch = None
        self.hooks: list[tuple[str, str]] = []
        self.fail_next_hook = False
        self.steps_done: dict[str, int] = {}

    def ar_diffusion_kv_cache_spec(self):
        return SPEC

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.state = state
        try:
            yield
        finally:
            self.state = None

    def _hook(self, kind: str, session_id: str) -> None:
        self.hooks.append((kind, session_id))
        self.steps_done.pop(session_id, None)
        if self.fail_next_hook:
            self.fail_next_hook = False
            raise HookFailure(f"{kind} hook of {session_id} failed")

    def reset_ar_diffusion_session(self, session_id):
        self._hook("reset", session_id)

    def close_ar_diffusion_session(self, session_id):
        self._hook("close", session_id)

    def fork_ar_diffusion_session(self, source_id, new_id, *, noise_seed=None):
        """No model state to fork: the engine shares the KV, which is what the machine checks."""

    def _run(self, kv: np.ndarray, commit: bool) -> jnp.ndarray:
        k = jnp.asarray(kv[0][:, None, :])  # [FRAMES*T, H=1, D]
        v = jnp.asarray(kv[1][:, None, :])
        caches = self.state.get_kv_caches("main", seq_len=FRAMES, commit_current=commit)
        out = _attend(caches, jnp.asarray(QUERY[:, None, :]), k, v)
        if commit:
            self.state.commit_paged_context("main", kv=(k[None], v[None]))
        else:
            self.state.commit_paged_context("main")
        return out

    def forward(self, request):
        kind, kv = request.inputs["kind"], request.inputs["kv"]
        if kind == "fail_before":
            raise RuntimeError("forward failed before KV")
        out = self._run(kv, commit=kind in ("commit", "fail_after"))
        if kind == "fail_after":
            raise RuntimeError("forward failed after its commit")
        return out

    @contextlib.contextmanager
    def bind_ar_diffusion_batch(self, batch):
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    def forward_batch(self, requests):
        """All rows in one vmapped attend and one commit; any failing row fails the whole batch (then rerun)."""
        kinds = [request.inputs["kind"] for request in requests]
        if "fail_before" in kinds:
            raise RuntimeError("batched forward failed before KV")
        commit = any(kind in ("commit", "fail_after") for kind in kinds)
        rows = [request.inputs["kv"] for request in requests]
        rows += [rows[0]] * (self.batch.bucket_size - len(rows))  # padding rows
        k = jnp.asarray(np.stack([kv[0][:, None, :] for kv in rows]))  # [B, FRAMES*T, H=1, D]
        v = jnp.asarray(np.stack([kv[1][:, None, :] for kv in rows]))
        caches = self.batch.get_kv_caches("main", seq_len=FRAMES, commit_current=commit)
        q = jnp.broadcast_to(jnp.asarray(QUERY[:, None, :]), (len(rows), 1, 1, D))
        out = _attend_rows(caches, q, k, v)
        if commit:
            self.batch.commit_paged_context("main", kv=(k[:, None], v[:, None]))
        else:
            self.batch.commit_paged_context("main")
        if "fail_after" in kinds:
            raise RuntimeError("batched forward failed after its commit")
        return [out[i] for i in range(len(requests))]

    def step(self, request):
        done = self.steps_done.get(request.request_id, 0) + 1
        self.steps_done[request.request_id] = done
        last = done == request.inputs["steps"]
        out = self._run(request.inputs["kv"], commit=last)
        return StepResult(finished=True, output=out) if last else StepResult(finished=False)


def float64_attention(frames: list[np.ndarray], current: np.ndarray, *, forget_sink: bool = False) -> np.ndarray:
    """Softmax attention of QUERY over [sink][newest window - f history][current] in float64."""
    committed = len(frames)
    sink = [] if forget_sink else frames[:min(committed, SINK)]
    start = max(SINK, committed - (WINDOW - FRAMES)) if not forget_sink else max(0, committed - (WINDOW - FRAMES))
    visible = sink + frames[start:]
    keys = np.array([f[0] for f in visible] + list(current[0]), np.float64).reshape(-1, D)
    values = np.array([f[1] for f in visible] + list(current[1]), np.float64).reshape(-1, D)
    scores = keys @ QUERY[0].astype(np.float64) / np.sqrt(D)
    weights = np.exp(scores - scores.max())
    return (weights / weights.sum()) @ values


class AsyncDeviceError(RuntimeError):
    """An error the device reports only when its work is awaited (an out-of-memory at execution time)."""


@contextlib.contextmanager
def failing_batch_await(engine: ARDiffusionEngine, armed: bool):
    """While armed, the runner's first await (a batch's outputs: the device ran, the await reports an error).

    Yields the list of awaits that failed, so a rule can check the fault was hit.
    """
    runner, fired = engine.runner, []
    if armed:
        real = runner._gate.synchronize

        def synchronize(output):
            real(output)
            if not fired:
                fired.append(output)
                raise AsyncDeviceError("batch failed when awaited")

        runner._gate.synchronize = synchronize
    try:
        yield fired
    finally:
        runner._gate.__dict__.pop("synchronize", None)


class EngineMachine(RuleBasedStateMachine):
    """The engine next to a model of what it must do."""

    forget_sink = False  # the negative control sets this

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = MachinePipeline()
        self.engine = self._new_engine()
        self.resident: collections.OrderedDict[str, list[np.ndarray]] = collections.OrderedDict()
        self.hooks: list[tuple[str, str]] = []
        self.fail_pending = False
        self.step_plan: dict[str, list[int]] = {}  # stepwise request id -> [steps, steps done]
        self.counter = 0

    def _new_engine(self) -> ARDiffusionEngine:
        return ARDiffusionEngine(self.pipeline, EngineConfig(
            dtype="float32", available_memory_bytes=10**6, gpu_memory_fraction=1.0, step_execution=True))

    def teardown(self) -> None:
        self.engine.close()

    # -- the model ------------------------------------------------------------------------------
    def _fresh_kv(self) -> np.ndarray:
        self.counter += 1
        return np.random.default_rng(self.counter).normal(size=(2, FRAMES, D)).astype(np.float32)

    def _release(self, session_id: str, kind: str, *, suppress: bool) -> bool:
        """Model of the runner's release path; True when a hook error reaches the caller."""
        self.resident.pop(session_id, None)
        self.step_plan.pop(session_id, None)
        self.hooks.append((kind, session_id))
        failed, self.fail_pending = self.fail_pending, False
        return failed and not suppress

    def _admit(self, session_id: str) -> bool:
        """Get-or-create with LRU eviction; True when an eviction hook error aborts the request."""
        if session_id in self.resident:
            self.resident.move_to_end(session_id)
            return False
        while len(self.resident) >= CAPACITY:
            if self._release(next(iter(self.resident)), "close", suppress=False):
                return True
        self.resident[session_id] = []
        return False

    def _expect_output(self, session_id: str, kv: np.ndarray) -> np.ndarray:
        return float64_attention(self.resident[session_id], kv, forget_sink=self.forget_sink)

    # -- rules ----------------------------------------------------------------------------------
    @initialize()
    def quiet_logs(self) -> None:
        logging.getLogger("ardiff_jax.runtime").setLevel(logging.ERROR)

    @rule(session_id=st.sampled_from(TICK_IDS), kind=st.sampled_from(["commit", "commit", "probe", "fail_before",
                                                                     "fail_after"]),
          reset=st.booleans(), close=st.sampled_from([False, False, False, True]))
    def tick(self, session_id: str, kind: str, reset: bool, close: bool) -> None:
        kv = self._fresh_kv()
        request = DiffusionRequest("r", extra_args={"session_id": session_id, "reset": reset, "close_session": close},
                                   inputs={"kind": kind, "kv": kv})
        expect_error: type[BaseException] | None = None
        expected = None
        if reset and self._release(session_id, "reset", suppress=False):
            expect_error = HookFailure
        elif self._admit(session_id):
            expect_error = HookFailure
        elif kind.startswith("fail"):
            self._release(session_id, "close", suppress=True)
            expect_error = RuntimeError
        else:
            expected = self._expect_output(session_id, kv)
            if kind == "commit":
                self.resident[session_id].extend(zip(kv[0], kv[1]))
            if close and self._release(session_id, "close", suppress=False):
                expect_error = HookFailure
        if expect_error is None:
            out = self.engine.generate(request)
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)
        else:
            with pytest.raises(expect_error):
                self.engine.generate(request)

    @precondition(lambda self: not self.fail_pending)
    @rule(session_ids=st.lists(st.sampled_from(TICK_IDS), min_size=1, max_size=3, unique=True),
          kind=st.sampled_from(["commit", "probe"]),
          fault=st.sampled_from([None, None, "fail_before", "fail_after", "async"]), fault_at=st.integers(0, 2))
    def batch(self, session_ids: list[str], kind: str, fault: str | None, fault_at: int) -> None:
        """generate_batch: admission without evicting the batch's own sessions, one forward, a fault reruns.

        ``async``: the batch fails only when its outputs are awaited (its KV was written); the rerun
        one by one gives exactly the unbatched outcome, with no error.
        """
        kinds = [kind] * len(session_ids)
        if fault in ("fail_before", "fail_after"):
            kinds[fault_at % len(session_ids)] = fault
        awaited_fault = fault == "async" and 2 <= len(session_ids) <= CAPACITY  # a batch of one runs unbatched
        kvs = [self._fresh_kv() for _ in session_ids]
        requests = [DiffusionRequest(f"b{i}", extra_args={"session_id": sid}, inputs={"kind": k, "kv": kv})
                    for i, (sid, k, kv) in enumerate(zip(session_ids, kinds, kvs, strict=True))]
        if len(session_ids) > CAPACITY:
            with pytest.raises(ValueError, match="exceeds the session capacity"):
                self.engine.generate_batch(requests)
            return
        for session_id in session_ids:  # admission: the batch's sessions are pinned, older others evicted
            if session_id in self.resident:
                self.resident.move_to_end(session_id)
                continue
            while len(self.resident) >= CAPACITY:
                victim = next(sid for sid in self.resident if sid not in session_ids)
                self._release(victim, "close", suppress=False)
            self.resident[session_id] = []
        expected, failed = {}, set()
        for session_id, k, kv in zip(session_ids, kinds, kvs, strict=True):  # the one-by-one outcome
            if k.startswith("fail"):
                self._release(session_id, "close", suppress=True)
                failed.add(session_id)
                continue
            expected[session_id] = self._expect_output(session_id, kv)
            if k == "commit":
                self.resident[session_id].extend(zip(kv[0], kv[1]))
        with failing_batch_await(self.engine, awaited_fault) as fired:
            if failed:
                with pytest.raises(ARDiffusionBatchError) as raised:
                    self.engine.generate_batch(requests)
                assert set(raised.value.errors) == failed
                outputs = raised.value.outputs
            else:
                outputs = self.engine.generate_batch(requests)
        assert len(fired) == awaited_fault
        for session_id, out in zip(session_ids, outputs, strict=True):
            if session_id in failed:
                assert out is None
            else:
                np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected[session_id], rtol=2e-5,
                                           atol=2e-6)

    @rule(session_id=st.sampled_from(TICK_IDS + STEP_IDS), kind=st.sampled_from(["close", "reset"]))
    def release_by_call(self, session_id: str, kind: str) -> None:
        call = self.engine.close_session if kind == "close" else self.engine.reset_session
        if self._release(session_id, kind, suppress=False):
            with pytest.raises(HookFailure):
                call(session_id)
        else:
            call(session_id)

    @rule(request_id=st.sampled_from(STEP_IDS), steps=st.integers(1, 3))
    def step(self, request_id: str, steps: int) -> None:
        if request_id in self.resident:
            steps = self.step_plan[request_id][0]  # a streaming request keeps its length
        kv = self._fresh_kv()
        output = StepSchedulerOutput(scheduled=(DiffusionRequest(request_id, inputs={"steps": steps, "kv": kv}),))
        if self._admit(request_id):
            with pytest.raises(HookFailure):
                self.engine.step(output)
            return
        plan = self.step_plan.setdefault(request_id, [steps, 0])
        plan[1] += 1
        finished = plan[1] >= plan[0]
        expected = self._expect_output(request_id, kv)
        result = self.engine.step(output)
        if finished:
            self._release(request_id, "close", suppress=True)
            assert result.finished
            np.testing.assert_allclose(np.asarray(result.output, np.float64).reshape(-1), expected, rtol=2e-5,
                                       atol=2e-6)
        else:
            assert not result.finished and result.output is None

    @rule(request_id=st.sampled_from(STEP_IDS))
    def abort(self, request_id: str) -> None:
        if request_id in self.resident:
            self._release(request_id, "close", suppress=True)
        self.engine.step(StepSchedulerOutput(finished_req_ids={request_id}))

    @rule(source=st.sampled_from(TICK_IDS + STEP_IDS + ("nobody",)), new_id=st.sampled_from(TICK_IDS))
    def fork(self, source: str, new_id: str) -> None:
        """A fork shares the source's history: from here on the invariant checks every session's frames
        after every write of every other, so a write that reached a shared page would show."""
        if source not in self.resident:
            with pytest.raises(KeyError):
                self.engine.fork_session(source, new_id)
        elif new_id in self.resident:
            with pytest.raises(ValueError, match="taken"):
                self.engine.fork_session(source, new_id)
        elif source in STEP_IDS:  # a stepwise chunk in flight (checked before the room a fork needs)
            with pytest.raises(RuntimeError, match="in flight"):
                self.engine.fork_session(source, new_id)
        elif len(self.resident) >= CAPACITY:  # no host offload here: a fork never evicts
            with pytest.raises(RuntimeError, match="free slot"):
                self.engine.fork_session(source, new_id)
        else:
            self.engine.fork_session(source, new_id)
            self.resident[new_id] = list(self.resident[source])
            self.resident.move_to_end(source)

    @rule()
    def next_hook_fails(self) -> None:
        self.pipeline.fail_next_hook = True
        self.fail_pending = True

    @precondition(lambda self: self.resident and not self.fail_pending)
    @rule(pick=st.integers(0, CAPACITY - 1), newcomer=st.sampled_from(TICK_IDS),
          at_stop=st.sampled_from([False, False, False, True]))
    def failing_close_hook_then_newcomer(self, pick: int, newcomer: str, at_stop: bool) -> None:
        """A close hook that raises (``close_session``, or ``engine.close()`` at stop), then a newcomer.

        The engine drops a session's KV before its hook, so after the failed close the session is gone
        and its slot free: the newcomer takes it and evicts no session the caller still serves. At stop
        every session still gets its hook (errors logged), and the newcomer is refused with a clear error
        (the engine is closed; nothing is evicted); a fresh engine on the same pipeline then starts empty.
        """
        self.pipeline.fail_next_hook = True
        self.fail_pending = True
        request = DiffusionRequest("n", extra_args={"session_id": newcomer},
                                   inputs={"kind": "commit", "kv": self._fresh_kv()})
        if at_stop:
            for session_id in list(self.resident):  # LRU order, every hook error logged, none raised
                self._release(session_id, "close", suppress=True)
            self.engine.close()
            assert self.engine.sessions == () and self.pipeline.hooks == self.hooks
            with pytest.raises(RuntimeError, match="closed"):
                self.engine.generate(request)
            assert self.pipeline.hooks == self.hooks  # the refused newcomer released nothing
            self.engine = self._new_engine()
            return
        closed = list(self.resident)[pick % len(self.resident)]
        kept = [sid for sid in self.resident if sid != closed]
        self._release(closed, "close", suppress=False)
        with pytest.raises(HookFailure):
            self.engine.close_session(closed)
        assert list(self.engine.sessions) == kept
        assert self.engine.runner.kv_cache.num_free_slots == CAPACITY - len(kept)
        if newcomer in self.resident:
            return
        self._admit(newcomer)  # a free slot: evicts nobody
        kv = request.inputs["kv"]
        expected = self._expect_output(newcomer, kv)
        self.resident[newcomer].extend(zip(kv[0], kv[1]))
        out = self.engine.generate(request)
        np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)
        assert list(self.engine.sessions) == kept + [newcomer]  # nobody the caller serves was evicted for it

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def bookkeeping(self) -> None:
        runner = self.engine.runner
        cache = runner.kv_cache
        assert self.engine.sessions == tuple(self.resident)  # resident set and LRU order
        assert len(self.engine.sessions) <= CAPACITY
        assert cache.num_free_slots + len(self.engine.sessions) == CAPACITY
        slots = [runner.session_table.get(sid).slot for sid in self.engine.sessions]
        assert len(set(slots)) == len(slots) and None not in slots
        assert self.pipeline.hooks == self.hooks  # exactly one close-or-reset hook per release, in order
        # Page counts are exactly the resident sessions' tables: forks share, nothing leaks.
        cache.page_pool.check_tables(table for sid in self.engine.sessions
                                     for table in runner.session_table.get(sid)._value.pages)

    @invariant()
    def attention_of_every_session(self) -> None:
        runner = self.engine.runner
        cache = runner.kv_cache
        current = np.stack([np.full((FRAMES, D), 0.5, np.float32), np.full((FRAMES, D), -0.25, np.float32)])
        k = jnp.asarray(current[0][:, None, :])
        v = jnp.asarray(current[1][:, None, :])
        for session_id, frames in self.resident.items():
            state = runner.session_table.get(session_id)
            cursor = branch_cursor_array(cache.spec, cache.layout, state._value, "main")
            caches = PagedKVCaches(pools=cache.pools, cursor=cursor, layout=cache.layout, seq_len=FRAMES)
            out = _attend(caches, jnp.asarray(QUERY[:, None, :]), k, v)
            expected = float64_attention(frames, current, forget_sink=self.forget_sink)
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)


class BrokenModelMachine(EngineMachine):
    forget_sink = True


# -- the host tier and session files, with faults -----------------------------------------------------

HOST_EXAMPLES = int(os.environ.get("ARDIFF_HOST_MACHINE_EXAMPLES", "30"))
#: Host bytes of one offloaded session: K and V pages (1 layer, sink + window pages of one token, one
#: head, D float32 values) and the model state (one float32).
RECORD_BYTES = 2 * (SINK + WINDOW) * D * 4 + 4
HOST_RECORDS = 2  # the tier holds two records, not three
HOST_IDS = ("h0", "h1", "h2", "h3")
LOAD_IDS = ("l0", "l1")


def ring_of(frames: list, index: int) -> np.ndarray:
    """What a session's host copy holds of K (``index`` 0) or V (1): each frame in its ring slot, zeros elsewhere."""
    ring = np.zeros((SINK + WINDOW, D), np.float32)
    for frame, kv in enumerate(frames):
        ring[frame if frame < SINK else SINK + (frame - SINK) % WINDOW] = kv[index]
    return ring


class InjectedFault(RuntimeError):
    pass


class ExportingMachinePipeline(MachinePipeline):
    """MachinePipeline with model state (its committed blocks, float32[1]) it can export and import, with faults."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, np.ndarray] = {}
        self.fail_next_export = False
        self.fail_next_import = False

    def _hook(self, kind: str, session_id: str) -> None:
        self.model.pop(session_id, None)
        super()._hook(kind, session_id)

    def forward(self, request):
        session_id = self.state.session_id
        out = super().forward(request)
        blocks = self.model.get(session_id, np.zeros(1, np.float32))
        self.model[session_id] = blocks + np.float32(request.inputs["kind"] == "commit")
        return out

    def forward_batch(self, requests):
        """Staged model state, installed by the runner once the batch is known good (batch.defer_publish)."""
        outs = super().forward_batch(requests)
        staged = {}
        for state, request in zip(self.batch.states, requests, strict=True):
            blocks = self.model.get(state.session_id, np.zeros(1, np.float32))
            staged[state.session_id] = blocks + np.float32(request.inputs["kind"] == "commit")
        self.batch.defer_publish(lambda: self.model.update(staged))
        return outs

    def export_ar_diffusion_session(self, session_id):
        if self.fail_next_export:
            self.fail_next_export = False
            raise InjectedFault(f"export of {session_id} failed")
        return {"blocks": self.model.pop(session_id, np.zeros(1, np.float32))}

    def import_ar_diffusion_session(self, session_id, state):
        if self.fail_next_import:
            self.fail_next_import = False
            raise InjectedFault(f"import of {session_id} failed")
        if session_id in self.model or not isinstance(state, dict) or set(state) != {"blocks"} \
                or np.asarray(state["blocks"]).shape != (1,):
            raise ValueError(f"not a state this pipeline exported for {session_id}: {state!r}")
        self.model[session_id] = np.asarray(state["blocks"])

    def fork_ar_diffusion_session(self, source_id, new_id, *, noise_seed=None):
        """The fork continues from its source's model state (its block count)."""
        self.model[new_id] = np.array(self.model.get(source_id, np.zeros(1, np.float32)))


class HostTierMachine(RuleBasedStateMachine):
    """The engine with a host tier of two records, next to a model of its policy; faults are injected per step."""

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = ExportingMachinePipeline()
        self.engine = self._new_engine()
        self.directory = Path(tempfile.mkdtemp(prefix="ardiff-host-machine-"))
        self.resident: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.offloaded: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.hooks: list[tuple[str, str]] = []
        self.files: list[tuple[Path, list]] = []
        self.snapshots: dict[str, tuple] = {}
        self.hit: set[str] = set()
        self.counter = 0

    def _new_engine(self) -> ARDiffusionEngine:
        return ARDiffusionEngine(self.pipeline, EngineConfig(
            dtype="float32", available_memory_bytes=10**6, gpu_memory_fraction=1.0,
            host_offload_bytes=HOST_RECORDS * RECORD_BYTES + RECORD_BYTES // 2))

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- the model of the policy ---------------------------------------------------------------------
    def _fresh_kv(self) -> np.ndarray:
        self.counter += 1
        return np.random.default_rng(self.counter).normal(size=(2, FRAMES, D)).astype(np.float32)

    def _drop(self, session_id: str) -> None:
        """A session leaves for good: its close hook runs."""
        self.resident.pop(session_id, None)
        self.offloaded.pop(session_id, None)
        self.hooks.append(("close", session_id))

    def _to_tier(self, session_id: str, frames: list) -> None:
        """Admission: the least recently offloaded records give way until the new one fits."""
        while len(self.offloaded) >= HOST_RECORDS:
            self._drop(next(iter(self.offloaded)))
        self.offloaded[session_id] = frames

    def _lru_victims(self) -> list[tuple[str, list]]:
        return [self.resident.popitem(last=False)] if len(self.resident) >= CAPACITY else []

    @contextlib.contextmanager
    def _failing_page_write(self, armed: bool, *, once: bool = False):
        """While armed, a restore's page write raises (``once``: only the first write, later ones run).

        Hooked where every restore and load writes its pages (``restore_session_pages``), whichever way it
        writes them: into the slot's own runs in one write, or into free pages when a fork of the slot's
        previous occupant still reads some of them (hooking only the first way let a load into such a slot
        pass the fault by)."""
        cache = self.engine.runner.kv_cache
        if armed:
            real_write = cache.restore_session_pages

            def failing_write(slot, pages):
                if once:
                    cache.restore_session_pages = real_write
                raise InjectedFault("page write failed")

            cache.restore_session_pages = failing_write
        try:
            yield
        finally:
            cache.__dict__.pop("restore_session_pages", None)

    # -- rules ---------------------------------------------------------------------------------------
    @initialize()
    def quiet_logs(self) -> None:
        logging.getLogger("ardiff_jax.runtime").setLevel(logging.ERROR)

    @rule(session_id=st.sampled_from(HOST_IDS), kind=st.sampled_from(["commit", "commit", "probe"]),
          fault=st.sampled_from(["none", "none", "page_write", "import"]))
    def tick(self, session_id: str, kind: str, fault: str) -> None:
        kv = self._fresh_kv()
        request = DiffusionRequest("r", extra_args={"session_id": session_id}, inputs={"kind": kind, "kv": kv})
        self.hit = {session_id}
        if session_id in self.resident:
            fault = "none"  # nothing is restored: no fault to inject
            self.resident.move_to_end(session_id)
        elif session_id in self.offloaded:
            frames = self.offloaded.pop(session_id)
            held = self._lru_victims()  # enter the tier only once the restore is over
            if fault == "page_write":  # back to the tier; a held record that does not fit displaces it
                self.offloaded[session_id] = frames
                for victim, victim_frames in held:
                    if len(self.offloaded) >= HOST_RECORDS and session_id in self.offloaded:
                        self._drop(session_id)
                    self._to_tier(victim, victim_frames)
            elif fault == "import":  # released with its close hook
                self.hooks.append(("close", session_id))
                for victim, victim_frames in held:
                    self._to_tier(victim, victim_frames)
            else:
                self.resident[session_id] = frames
                for victim, victim_frames in held:
                    self._to_tier(victim, victim_frames)
        else:
            fault = "none"
            for victim, victim_frames in self._lru_victims():
                self._to_tier(victim, victim_frames)
            self.resident[session_id] = []
        if fault != "none":
            self.pipeline.fail_next_import = fault == "import"
            with self._failing_page_write(fault == "page_write"), pytest.raises(InjectedFault):
                self.engine.generate(request)
            self.pipeline.fail_next_import = False
            return
        expected = float64_attention(self.resident[session_id], kv)
        out = self.engine.generate(request)
        np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)
        if kind == "commit":
            self.resident[session_id].extend(zip(kv[0], kv[1]))

    @rule(session_ids=st.lists(st.sampled_from(HOST_IDS), min_size=1, max_size=CAPACITY, unique=True),
          kind=st.sampled_from(["commit", "commit", "probe"]),
          fault=st.sampled_from(["none", "page_write", "import", "async"]))
    def batch(self, session_ids: list[str], kind: str, fault: str) -> None:
        """generate_batch with the restore of its first offloaded session failing: only that session fails.

        Admission restores the batch's offloaded sessions first (so an eviction that fills the tier never
        drops one of them), then creates the new ones; victims are the least recently used sessions outside
        the batch; the LRU order is then the request order. The failed session ends as ``generate`` leaves
        it: offloaded, byte for byte as before (page write), or released with its close hook (import).
        ``async``: no restore fails, the batch fails when its outputs are awaited: the rerun one by one
        starts from the model state before the batch (the invariant counts each session's blocks).
        """
        kvs = [self._fresh_kv() for _ in session_ids]
        requests = [DiffusionRequest(f"b{i}", extra_args={"session_id": sid}, inputs={"kind": kind, "kv": kv})
                    for i, (sid, kv) in enumerate(zip(session_ids, kvs, strict=True))]
        restores = [sid for sid in session_ids if sid in self.offloaded]
        target = restores[0] if restores and fault in ("page_write", "import") else None
        admitted = []
        for session_id in restores + [sid for sid in session_ids if sid not in restores]:
            victims = []
            if session_id not in self.resident and len(self.resident) >= CAPACITY:
                victim = next(sid for sid in self.resident if sid not in session_ids)
                victims = [(victim, self.resident.pop(victim))]
            if session_id in self.resident:
                admitted.append(session_id)
            elif session_id == target:  # the restore fails; the victim made room all the same
                frames = self.offloaded.pop(session_id)
                if fault == "page_write":
                    self.offloaded[session_id] = frames
                    for victim, victim_frames in victims:
                        if len(self.offloaded) >= HOST_RECORDS and session_id in self.offloaded:
                            self._drop(session_id)
                        self._to_tier(victim, victim_frames)
                else:
                    self.hooks.append(("close", session_id))
                    for victim, victim_frames in victims:
                        self._to_tier(victim, victim_frames)
            else:
                frames = self.offloaded.pop(session_id, [])
                for victim, victim_frames in victims:
                    self._to_tier(victim, victim_frames)
                self.resident[session_id] = frames
                admitted.append(session_id)
        for session_id in session_ids:
            if session_id in admitted:
                self.resident.move_to_end(session_id)
        expected = {sid: float64_attention(self.resident[sid], kv)
                    for sid, kv in zip(session_ids, kvs, strict=True) if sid in admitted}
        for session_id, kv in zip(session_ids, kvs, strict=True):
            if session_id in admitted and kind == "commit":
                self.resident[session_id].extend(zip(kv[0], kv[1]))
        # A failed page write leaves its session exactly as it was: the invariant checks it byte for byte.
        self.hit = set(session_ids) - ({target} if fault == "page_write" and target in self.offloaded else set())
        self.pipeline.fail_next_import = fault == "import" and target is not None
        awaited_fault = fault == "async" and len(admitted) >= 2  # a batch of one runs unbatched
        try:
            with self._failing_page_write(fault == "page_write" and target is not None, once=True), \
                    failing_batch_await(self.engine, awaited_fault) as fired:
                if target is None:
                    outputs = self.engine.generate_batch(requests)
                else:
                    with pytest.raises(ARDiffusionBatchError) as raised:
                        self.engine.generate_batch(requests)
                    error = raised.value
                    assert list(error.errors) == [target]
                    failure = error.errors[target]
                    assert isinstance(failure, SessionRestoreError) and failure.session_id == target
                    assert failure.offloaded == (target in self.offloaded)
                    assert isinstance(failure.__cause__, InjectedFault) and repr(target) in str(failure)
                    outputs = error.outputs
        finally:
            self.pipeline.fail_next_import = False
        assert len(fired) == awaited_fault
        for session_id, out in zip(session_ids, outputs, strict=True):
            if session_id not in admitted:
                assert out is None
            else:
                np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected[session_id],
                                           rtol=2e-5, atol=2e-6)

    @rule(session_id=st.sampled_from(HOST_IDS + LOAD_IDS), newcomer=st.sampled_from(HOST_IDS),
          at_stop=st.sampled_from([False, False, False, True]))
    def failing_close_hook_then_newcomer(self, session_id: str, newcomer: str, at_stop: bool) -> None:
        """A close hook that raises, then a newcomer that needs room.

        ``close_session``: the closed session is gone (its slot or record freed) and the newcomer evicts
        (offloads, never drops) only the least recently used sessions, and only if the device is full.
        ``engine.close()`` at stop: every resident and offloaded session still gets its hook once, the
        newcomer is refused with a clear error, and a fresh engine starts empty.
        """
        if at_stop:
            self.pipeline.fail_next_hook = True
            for held in list(self.resident) + list(self.offloaded):  # resident, then the tier; LRU order
                self._drop(held)
            self.engine.close()
            self.pipeline.fail_next_hook = False  # still armed when nothing was held: no hook ran
            assert self.pipeline.hooks == self.hooks and self.engine.runner.closed
            with pytest.raises(RuntimeError, match="closed"):
                self.engine.generate(DiffusionRequest("n", extra_args={"session_id": newcomer},
                                                      inputs={"kind": "commit", "kv": self._fresh_kv()}))
            assert self.pipeline.hooks == self.hooks and not self.pipeline.model
            self.engine = self._new_engine()
            self.snapshots, self.hit = {}, set()
            return
        self.close(session_id, hook_fails=True)
        assert session_id not in self.engine.sessions + self.engine.offloaded_sessions
        assert self.engine.runner.kv_cache.num_free_slots + len(self.engine.sessions) == CAPACITY
        if newcomer in self.resident or newcomer in self.offloaded:
            return
        before = list(self.resident)
        self.tick(newcomer, "commit", "none")
        evicted = [sid for sid in before if sid not in self.engine.sessions]
        assert evicted == before[:len(evicted)] and len(evicted) == max(0, len(before) + 1 - CAPACITY)
        assert all(sid in self.engine.offloaded_sessions for sid in evicted)  # offloaded, never dropped

    @rule(session_id=st.sampled_from(HOST_IDS + LOAD_IDS), hook_fails=st.booleans())
    def close(self, session_id: str, hook_fails: bool) -> None:
        self.hit = {session_id}
        self._drop(session_id)  # the hook runs even for an id that is not held
        self.pipeline.fail_next_hook = hook_fails
        if hook_fails:
            with pytest.raises(HookFailure):
                self.engine.close_session(session_id)
        else:
            self.engine.close_session(session_id)

    @rule(session_id=st.sampled_from(HOST_IDS), fault=st.sampled_from(["none", "none", "export", "file_write"]))
    def save(self, session_id: str, fault: str) -> None:
        path = self.directory / f"file-{len(self.files)}-{self.counter}"
        self.counter += 1
        if session_id not in self.resident and session_id not in self.offloaded:
            with pytest.raises(KeyError, match="neither resident nor offloaded"):
                self.engine.save_session(session_id, path)
            return
        if fault == "export" and session_id in self.resident:  # released, as a failed offload would be
            self.hit = {session_id}
            self._drop(session_id)
            self.pipeline.fail_next_export = True
            with pytest.raises(InjectedFault):
                self.engine.save_session(session_id, path)
            self.pipeline.fail_next_export = False
            return
        frames = list(self.resident[session_id] if session_id in self.resident else self.offloaded[session_id])
        if fault == "file_write":  # the disk fails: nothing changes
            def failing_write(*args, **kwargs):
                raise InjectedFault("disk full")

            real_write = session_files_module.write_session_file
            session_files_module.write_session_file = failing_write
            try:
                with pytest.raises(InjectedFault):
                    self.engine.save_session(session_id, path)
            finally:
                session_files_module.write_session_file = real_write
            assert not path.exists()
            return
        self.engine.save_session(session_id, path)  # invisible to the session: it is not hit
        self.files.append((path, frames))
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()  # the file holds what the session wrote, zeros elsewhere
        arrays = checkpointer.restore(path / "arrays")
        checkpointer.close()
        for index, name in enumerate(("pages_k", "pages_v")):
            np.testing.assert_array_equal(np.asarray(arrays[name]).reshape(SINK + WINDOW, D), ring_of(frames, index))

    @precondition(lambda self: self.files)
    @rule(index=st.integers(0, 20), session_id=st.sampled_from(LOAD_IDS), page_write_fails=st.booleans())
    def load(self, index: int, session_id: str, page_write_fails: bool) -> None:
        path, frames = self.files[index % len(self.files)]
        if session_id in self.resident or session_id in self.offloaded:
            with pytest.raises(ValueError, match="already exists"):
                self.engine.load_session(path, session_id=session_id)
            return
        self.hit = {session_id}
        held = self._lru_victims()
        if not page_write_fails:
            self.resident[session_id] = list(frames)
        for victim, victim_frames in held:
            self._to_tier(victim, victim_frames)
        with self._failing_page_write(page_write_fails):
            if page_write_fails:
                with pytest.raises(InjectedFault):
                    self.engine.load_session(path, session_id=session_id)
            else:
                assert self.engine.load_session(path, session_id=session_id) == session_id

    # -- invariants ------------------------------------------------------------------------------------
    @rule(source=st.sampled_from(HOST_IDS + LOAD_IDS), new_id=st.sampled_from(HOST_IDS))
    def fork(self, source: str, new_id: str) -> None:
        """A fork shares its source's pages: later restores go into slots whose pages a fork still reads (the records
        in pinned host memory, as the runtime offloads them), and forks are offloaded and saved standing alone."""
        if source not in self.resident and source not in self.offloaded:
            with pytest.raises(KeyError):
                self.engine.fork_session(source, new_id)
            return
        if new_id == source or new_id in self.resident or new_id in self.offloaded:
            with pytest.raises(ValueError, match="taken"):
                self.engine.fork_session(source, new_id)
            return
        short = (2 if source in self.offloaded else 1) - (CAPACITY - len(self.resident))
        if short > 0:
            # Host offload is on: a fork makes room as a new session does, moving the least recently used
            # sessions (never the source) to the host tier, or is refused, moving nothing, when the tier could
            # take them only by dropping a session it holds (issue 47, item 4).
            victims = [sid for sid in self.resident if sid != source][:short]
            try:
                self.engine.fork_session(source, new_id)
            except RuntimeError as error:
                assert "host tier" in str(error), error  # the bookkeeping invariant checks nothing moved
                return
            for victim in victims:
                self.offloaded[victim] = self.resident.pop(victim)
        self.hit = {source, new_id}
        if source in self.offloaded:  # restored first, into a free slot
            self.resident[source] = self.offloaded.pop(source)
        if short <= 0:
            self.engine.fork_session(source, new_id)
        self.resident[new_id] = list(self.resident[source])
        self.resident.move_to_end(source)

    def _session_bytes(self, session_id: str) -> tuple:
        """Everything of a session: its pages (slot or host record), cursors, run owners and model state."""
        runner = self.engine.runner
        state = runner.session_table.get(session_id)
        if state is not None:
            # By page table: a fork's pages are not its slot's, and its slot's own pages may hold others' frames.
            pages, value = runner.kv_cache.offload_session(state._value), state._value
            model = self.pipeline.model[session_id]
        else:
            record = runner.host_tier.get(session_id)
            pages, value, model = record.pages, record.session, record.pipeline_state["blocks"]
        cursors = tuple((name, c.committed_frames, c.visible_start_frame) for name, c in sorted(value.cursors.items()))
        return (np.asarray(pages.k).tobytes(), np.asarray(pages.v).tobytes(), cursors, value.run_owners,
                np.asarray(model).tobytes())

    @invariant()
    def bookkeeping(self) -> None:
        runner = self.engine.runner
        assert self.engine.sessions == tuple(self.resident)
        assert self.engine.offloaded_sessions == tuple(self.offloaded)
        assert runner.kv_cache.num_free_slots + len(self.resident) == CAPACITY
        assert runner.host_tier.bytes_used == RECORD_BYTES * len(self.offloaded)
        assert self.pipeline.hooks == self.hooks  # one close hook per session gone, in order
        assert sorted(self.pipeline.model) == sorted(self.resident)  # offloaded state lives in the records

    @invariant()
    def no_session_but_the_one_hit_changed(self) -> None:
        held = list(self.resident) + list(self.offloaded)
        current = {session_id: self._session_bytes(session_id) for session_id in held}
        for session_id, now in current.items():
            if session_id not in self.hit and session_id in self.snapshots:
                assert now == self.snapshots[session_id], f"session {session_id} changed, hit: {self.hit}"
        self.snapshots, self.hit = current, set()

    @invariant()
    def host_copies_hold_only_what_their_session_wrote(self) -> None:
        """Every offload record holds its session's frames in their ring slots and zeros in the slots it never
        wrote, never a previous occupant's frames (issue 43, item 3); records are in pinned host memory."""
        for session_id, frames in self.offloaded.items():
            record = self.engine.runner.host_tier.get(session_id)
            assert record.pages.k.sharding.memory_kind == "pinned_host"
            for index, pages in enumerate((record.pages.k, record.pages.v)):
                np.testing.assert_array_equal(np.asarray(pages).reshape(SINK + WINDOW, D), ring_of(frames, index))

    @invariant()
    def attention_and_model_state_of_every_session(self) -> None:
        runner = self.engine.runner
        cache = runner.kv_cache
        current = np.stack([np.full((FRAMES, D), 0.5, np.float32), np.full((FRAMES, D), -0.25, np.float32)])
        k, v = jnp.asarray(current[0][:, None, :]), jnp.asarray(current[1][:, None, :])
        for session_id, frames in self.resident.items():
            state = runner.session_table.get(session_id)
            cursor = branch_cursor_array(cache.spec, cache.layout, state._value, "main")
            caches = PagedKVCaches(pools=cache.pools, cursor=cursor, layout=cache.layout, seq_len=FRAMES)
            out = _attend(caches, jnp.asarray(QUERY[:, None, :]), k, v)
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), float64_attention(frames, current),
                                       rtol=2e-5, atol=2e-6)
            assert self.pipeline.model[session_id][0] == len(frames) // FRAMES
        for session_id, frames in self.offloaded.items():
            record = runner.host_tier.get(session_id)
            assert record.session.cursors["main"].committed_frames == len(frames)
            assert np.asarray(record.pipeline_state["blocks"])[0] == len(frames) // FRAMES


# -- forks on other geometries: Matrix-Game's (no sink, a 4-frame window, 3-frame blocks) ---------------------

FORK_EXAMPLES = int(os.environ.get("ARDIFF_FORK_MACHINE_EXAMPLES", "40"))
FORK_IDS = ("f0", "f1", "f2", "f3")


class GeometryPipeline:
    """Tick and batch forwards on any geometry (one token per frame, one head): attend, then commit the block."""

    def __init__(self, spec: ARDiffusionKVCacheSpec) -> None:
        self.spec, self.state, self.batch = spec, None, None
        self.forward_calls = 0  # single-session forwards: a batch rerun one by one shows here

    def ar_diffusion_kv_cache_spec(self):
        return self.spec

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.state = state
        try:
            yield
        finally:
            self.state = None

    @contextlib.contextmanager
    def bind_ar_diffusion_batch(self, batch):
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    def reset_ar_diffusion_session(self, session_id):
        pass

    def close_ar_diffusion_session(self, session_id):
        pass

    def fork_ar_diffusion_session(self, source_id, new_id, *, noise_seed=None):
        pass

    def forward(self, request):
        self.forward_calls += 1
        kv, commit = request.inputs["kv"], request.inputs["kind"] == "commit"
        k, v = jnp.asarray(kv[0][:, None, :]), jnp.asarray(kv[1][:, None, :])
        caches = self.state.get_kv_caches("main", seq_len=len(kv[0]), commit_current=commit)
        out = _attend(caches, jnp.asarray(QUERY[:, None, :]), k, v)
        self.state.commit_paged_context("main", kv=(k[None], v[None]) if commit else None)
        return out

    def forward_batch(self, requests):
        commit = requests[0].inputs["kind"] == "commit"
        rows = [request.inputs["kv"] for request in requests]
        rows += [rows[0]] * (self.batch.bucket_size - len(rows))
        k = jnp.asarray(np.stack([kv[0][:, None, :] for kv in rows]))
        v = jnp.asarray(np.stack([kv[1][:, None, :] for kv in rows]))
        caches = self.batch.get_kv_caches("main", seq_len=len(rows[0][0]), commit_current=commit)
        q = jnp.broadcast_to(jnp.asarray(QUERY[:, None, :]), (len(rows), 1, 1, D))
        out = _attend_rows(caches, q, k, v)
        self.batch.commit_paged_context("main", kv=(k[:, None], v[:, None]) if commit else None)
        return [out[i] for i in range(len(requests))]


class ForkGeometryMachine(RuleBasedStateMachine):
    """Sessions, forks of forks and batches mixing a session with its forks, on one geometry, next to the float64
    model: every session attends to exactly its own frames, the page counts are the tables, and a batch of
    sessions that share pages runs as one batched forward (issue 43, item 8: Matrix-Game's geometry ran out of
    pages and reran one by one)."""

    sink, window, frames, capacity = 0, 4, 3, 2  # matrix-game-tiny and gta-drive

    def __init__(self) -> None:
        super().__init__()
        self.spec = ARDiffusionKVCacheSpec(
            num_layers=1, num_kv_heads=1, head_size=D, tokens_per_frame=1, frames_per_block=self.frames,
            window_frames=self.window, sink_frames=self.sink, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
            session_capacity=self.capacity)
        self.pipeline = GeometryPipeline(self.spec)
        self.engine = ARDiffusionEngine(self.pipeline, EngineConfig(
            dtype="float32", available_memory_bytes=10**6, gpu_memory_fraction=1.0, warmup=False))
        self.resident: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.counter = 0

    def teardown(self) -> None:
        self.engine.close()

    def _fresh_kv(self) -> np.ndarray:
        self.counter += 1
        return np.random.default_rng(self.counter).normal(size=(2, self.frames, D)).astype(np.float32)

    def _expected(self, frames: list, current: np.ndarray) -> np.ndarray:
        committed = len(frames)
        visible = frames[:min(committed, self.sink)] + frames[max(self.sink, committed - (self.window - self.frames)):]
        keys = np.array([f[0] for f in visible] + list(current[0]), np.float64).reshape(-1, D)
        values = np.array([f[1] for f in visible] + list(current[1]), np.float64).reshape(-1, D)
        scores = keys @ QUERY[0].astype(np.float64) / np.sqrt(D)
        weights = np.exp(scores - scores.max())
        return (weights / weights.sum()) @ values

    def _request(self, session_id: str, kind: str, kv: np.ndarray) -> DiffusionRequest:
        return DiffusionRequest("r", extra_args={"session_id": session_id}, inputs={"kind": kind, "kv": kv})

    def _admit(self, session_ids: list[str]) -> None:
        """LRU admission without a host tier: the least recently used session outside the request is released."""
        for session_id in session_ids:
            if session_id in self.resident:
                self.resident.move_to_end(session_id)
                continue
            while len(self.resident) >= self.capacity:
                del self.resident[next(sid for sid in self.resident if sid not in session_ids)]
            self.resident[session_id] = []

    @initialize()
    def quiet_logs(self) -> None:
        logging.getLogger("ardiff_jax.runtime").setLevel(logging.ERROR)

    @rule(session_id=st.sampled_from(FORK_IDS), kind=st.sampled_from(["commit", "commit", "probe"]))
    def tick(self, session_id: str, kind: str) -> None:
        kv = self._fresh_kv()
        self._admit([session_id])
        expected = self._expected(self.resident[session_id], kv)
        out = self.engine.generate(self._request(session_id, kind, kv))
        np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)
        if kind == "commit":
            self.resident[session_id].extend(zip(kv[0], kv[1]))

    @rule(session_ids=st.lists(st.sampled_from(FORK_IDS), min_size=2, max_size=3, unique=True),
          kind=st.sampled_from(["commit", "commit", "probe"]))
    def batch(self, session_ids: list[str], kind: str) -> None:
        if len(session_ids) > self.capacity:
            return
        kvs = [self._fresh_kv() for _ in session_ids]
        self._admit(session_ids)
        expected = [self._expected(self.resident[sid], kv) for sid, kv in zip(session_ids, kvs, strict=True)]
        calls = self.pipeline.forward_calls
        outputs = self.engine.generate_batch([self._request(sid, kind, kv)
                                              for sid, kv in zip(session_ids, kvs, strict=True)])
        assert self.pipeline.forward_calls == calls, "the batch was rerun one by one"
        for sid, kv, out, want in zip(session_ids, kvs, outputs, expected, strict=True):
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), want, rtol=2e-5, atol=2e-6)
            if kind == "commit":
                self.resident[sid].extend(zip(kv[0], kv[1]))

    @rule(source=st.sampled_from(FORK_IDS), new_id=st.sampled_from(FORK_IDS))
    def fork(self, source: str, new_id: str) -> None:
        if source not in self.resident:
            with pytest.raises(KeyError):
                self.engine.fork_session(source, new_id)
        elif new_id in self.resident:
            with pytest.raises(ValueError, match="taken"):
                self.engine.fork_session(source, new_id)
        elif len(self.resident) >= self.capacity:
            with pytest.raises(RuntimeError, match="free slot"):
                self.engine.fork_session(source, new_id)
        else:
            self.engine.fork_session(source, new_id)
            self.resident[new_id] = list(self.resident[source])
            self.resident.move_to_end(source)

    @rule(source=st.sampled_from(FORK_IDS), new_id=st.sampled_from(FORK_IDS),
          kind=st.sampled_from(["commit", "probe"]))
    def fork_then_batch_with_it(self, source: str, new_id: str, kind: str) -> None:
        """The case the issue names: ``generate_batch([S, fork of S])`` while every page of the fork is S's."""
        self.fork(source, new_id)
        if source in self.resident and new_id in self.resident and source != new_id:
            self.batch([source, new_id], kind)

    @rule(session_id=st.sampled_from(FORK_IDS))
    def close(self, session_id: str) -> None:
        self.resident.pop(session_id, None)
        self.engine.close_session(session_id)

    @invariant()
    def every_session_reads_its_own_frames(self) -> None:
        runner = self.engine.runner
        cache = runner.kv_cache
        assert self.engine.sessions == tuple(self.resident)
        cache.page_pool.check_tables(table for sid in self.engine.sessions
                                     for table in runner.session_table.get(sid)._value.pages)
        current = np.stack([np.full((self.frames, D), 0.5, np.float32), np.full((self.frames, D), -0.25, np.float32)])
        k, v = jnp.asarray(current[0][:, None, :]), jnp.asarray(current[1][:, None, :])
        for session_id, frames in self.resident.items():
            cursor = branch_cursor_array(cache.spec, cache.layout, runner.session_table.get(session_id)._value, "main")
            caches = PagedKVCaches(pools=cache.pools, cursor=cursor, layout=cache.layout, seq_len=self.frames)
            out = _attend(caches, jnp.asarray(QUERY[:, None, :]), k, v)
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), self._expected(frames, current),
                                       rtol=2e-5, atol=2e-6)


class MatrixGameForkMachine3(ForkGeometryMachine):
    capacity = 3


class SpriteForkMachine(ForkGeometryMachine):
    sink, window, frames, capacity = 1, 3, 1, 2  # the sprite world's


@pytest.mark.parametrize("machine", [ForkGeometryMachine, MatrixGameForkMachine3, SpriteForkMachine],
                         ids=["matrix-game-capacity-2", "matrix-game-capacity-3", "sprite-capacity-2"])
def test_forks_and_batches_on_matrix_game_and_sprite_geometries(machine):
    run_state_machine_as_test(machine, settings=_settings(FORK_EXAMPLES))


def test_a_session_and_its_fork_batch_as_one_forward_on_matrix_games_geometry_a_fixed_story():
    """The shortest story of issue 43, item 8, as the machine plays it (fails without the joint page plan)."""
    machine = ForkGeometryMachine()
    try:
        machine.quiet_logs()
        for _ in range(2):  # six frames: the 4-frame ring wrapped, every page of the slot written
            machine.tick("f0", "commit")
        machine.fork_then_batch_with_it("f0", "f1", "commit")
        machine.every_session_reads_its_own_frames()
        machine.batch(["f1", "f0"], "commit")
        machine.every_session_reads_its_own_frames()
    finally:
        machine.teardown()


def test_the_host_machine_restores_into_slots_a_fork_reads_a_fixed_story():
    """Issue 43, item 2, as the host-tier machine plays it: a source offloaded (its record in pinned host memory)
    while its fork lives, then restored into its old slot, whose pages the fork still reads; then saved and loaded.
    Every invariant (the float64 model, no session but the one hit changed, host copies) after every step."""
    machine = HostTierMachine()

    def check() -> None:
        machine.bookkeeping()
        machine.no_session_but_the_one_hit_changed()
        machine.host_copies_hold_only_what_their_session_wrote()
        machine.attention_and_model_state_of_every_session()

    try:
        machine.quiet_logs()
        for step in (lambda: machine.tick("h0", "commit", "none"), lambda: machine.tick("h0", "commit", "none"),
                     lambda: machine.fork("h0", "h1"), lambda: machine.tick("h1", "commit", "none"),
                     lambda: machine.tick("h2", "probe", "none"),  # h0 offloaded; h2 takes slot 0, h1 reads its pages
                     lambda: machine.tick("h1", "commit", "none"),
                     lambda: machine.tick("h0", "commit", "none"),  # h2 offloaded; h0 back into slot 0
                     lambda: machine.save("h0", "none"), lambda: machine.close("h1", False),
                     lambda: machine.load(0, "l0", False)):
            step()
            check()
        assert machine.engine.offloaded_sessions == ("h2",) and set(machine.engine.sessions) == {"h0", "l0"}
    finally:
        machine.teardown()


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def test_engine_matches_the_float64_model():
    run_state_machine_as_test(EngineMachine, settings=_settings(EXAMPLES))


def test_host_tier_and_session_files_match_the_model_under_faults():
    run_state_machine_as_test(HostTierMachine, settings=_settings(HOST_EXAMPLES))


def test_negative_control_a_broken_model_is_caught():
    with pytest.raises(AssertionError):
        run_state_machine_as_test(BrokenModelMachine, settings=_settings(50))


def test_the_model_agrees_with_the_machine_on_a_fixed_story():
    """A readable walk through the rules, so a failure of the property test has a simple twin."""
    machine = EngineMachine()
    try:
        machine.quiet_logs()
        for _ in range(3):
            machine.tick("s0", "commit", reset=False, close=False)  # 6 frames: the ring wraps
            machine.bookkeeping()
            machine.attention_of_every_session()
        machine.tick("s1", "probe", reset=False, close=False)
        machine.tick("s2", "commit", reset=False, close=False)  # evicts s0 (LRU)
        machine.next_hook_fails()
        machine.release_by_call("s1", "close")  # the hook error reaches the caller; KV was released first
        machine.step("q0", 2)
        machine.step("q0", 2)  # second step commits and finishes
        machine.bookkeeping()
        machine.attention_of_every_session()
        assert [kind for kind, _ in machine.pipeline.hooks] == ["close", "close", "close"]
    finally:
        machine.teardown()
