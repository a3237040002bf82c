"""A hypothesis state machine over the engine, checked after every step against a plain float64 model.

Rules: tick requests on a few session ids (committing and probe forwards, ``reset`` and
``close_session`` flags, forwards that fail before or after committing), ``reset_session``
/ ``close_session`` calls, stepwise requests (denoise steps, the last one commits and
finishes) and aborts, pipeline hooks that fail, and LRU pressure (four ids, capacity two).

After every step: resident <= capacity, free + resident == capacity, distinct slots, the
LRU order, exactly one close-or-reset hook per release (in order), and every resident
session's attention output equal to a float64 softmax over its sink + newest window frames
+ current block. A deliberately broken model (it forgets the sink) must be caught.

``ARDIFF_STATE_MACHINE_EXAMPLES`` raises the example count (default 200 in CI).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from ardiff_jax import ARDiffusionEngine, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec, DiffusionRequest, EngineConfig
from ardiff_jax.kv import PagedKVCaches
from ardiff_jax.runtime import branch_cursor_array
from ardiff_jax.types import StepResult, StepSchedulerOutput

EXAMPLES = int(os.environ.get("ARDIFF_STATE_MACHINE_EXAMPLES", "200"))
SINK, WINDOW, FRAMES, D, CAPACITY = 1, 3, 2, 2, 2
TICK_IDS = ("s0", "s1", "s2")
STEP_IDS = ("q0", "q1")
QUERY = np.array([[0.7, -0.4]], np.float32)  # [S=1, D]: one query token, one head

SPEC = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=D, tokens_per_frame=1,
                              frames_per_block=FRAMES, window_frames=WINDOW, sink_frames=SINK,
                              kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=CAPACITY)


class HookFailure(RuntimeError):
    pass


class MachinePipeline:
    """Tick: ``inputs["kind"]`` in commit/probe/fail_before/fail_after; stepwise: probes, then one commit."""

    supports_step_execution = True

    def __init__(self) -> None:
        self.state = None
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

    def _run(self, kv: np.ndarray, commit: bool) -> jnp.ndarray:
        k = jnp.asarray(kv[0][:, None, :])  # [FRAMES*T, H=1, D]
        v = jnp.asarray(kv[1][:, None, :])
        caches = self.state.get_kv_caches("main", seq_len=FRAMES, commit_current=commit)
        out = caches.attend(0, jnp.asarray(QUERY[:, None, :]), k, v)
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


class EngineMachine(RuleBasedStateMachine):
    """The engine next to a model of what it must do."""

    forget_sink = False  # the negative control sets this

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = MachinePipeline()
        self.engine = ARDiffusionEngine(self.pipeline, EngineConfig(
            dtype="float32", available_memory_bytes=10**6, gpu_memory_fraction=1.0, step_execution=True))
        self.resident: collections.OrderedDict[str, list[np.ndarray]] = collections.OrderedDict()
        self.hooks: list[tuple[str, str]] = []
        self.fail_pending = False
        self.step_plan: dict[str, list[int]] = {}  # stepwise request id -> [steps, steps done]
        self.counter = 0

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

    @rule()
    def next_hook_fails(self) -> None:
        self.pipeline.fail_next_hook = True
        self.fail_pending = True

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
            out = caches.attend(0, jnp.asarray(QUERY[:, None, :]), k, v)
            expected = float64_attention(frames, current, forget_sink=self.forget_sink)
            np.testing.assert_allclose(np.asarray(out, np.float64).reshape(-1), expected, rtol=2e-5, atol=2e-6)


class BrokenModelMachine(EngineMachine):
    forget_sink = True


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def test_engine_matches_the_float64_model():
    run_state_machine_as_test(EngineMachine, settings=_settings(EXAMPLES))


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
