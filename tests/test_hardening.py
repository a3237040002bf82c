"""What a hostile or careless user broke, one test each (the hardening issue; ``docs/guarantees.md``).

Every refusal is checked twice: the error names the problem, and nothing changed (resident
sessions, hook calls, cursors, pool bytes).
"""

from __future__ import annotations

import copy
import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.runtime import ARDiffusionKVCache
from ardiff_jax.types import StepSchedulerOutput

from runner_pipelines import RecordingPipeline, block_values, small_spec

F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)


def make_engine(pipeline=None, **config):
    return ARDiffusionEngine(RecordingPipeline() if pipeline is None else pipeline, EngineConfig(**{**F32, **config}))


def request(session_id="s", **extra):
    return DiffusionRequest("r", extra_args={"session_id": session_id, **extra})


def fingerprint(engine):
    """Everything a refused call must leave untouched."""
    cache = engine.runner.kv_cache
    states = {sid: engine.runner.session_table.get(sid) for sid in engine.sessions}
    return (engine.sessions, list(engine.runner.pipeline.log),
            {sid: state.describe() for sid, state in states.items()},
            np.asarray(cache.pools.k).tobytes(), np.asarray(cache.pools.v).tobytes())


@pytest.fixture
def primed():
    engine = make_engine()
    engine.generate(request("a"))
    engine.generate(request("b"))  # capacity 2: full
    return engine


# -- sessions lost or mixed -------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["reset", "close_session"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, np.int64(1)])
def test_lifecycle_flags_must_be_real_bools(primed, flag, value):
    before = fingerprint(primed)
    with pytest.raises(ValueError, match=rf"extra_args\['{flag}'\] must be a bool"):
        primed.generate(request("a", **{flag: value}))
    assert fingerprint(primed) == before


@pytest.mark.parametrize("session_id", [0, False, None, "", " ", 5, b"a", ("a",)])
def test_present_session_ids_must_be_non_blank_strings(primed, session_id):
    before = fingerprint(primed)
    with pytest.raises(ValueError, match="non-blank string"):
        primed.generate(DiffusionRequest("r", extra_args={"session_id": session_id}))
    for call in (primed.close_session, primed.reset_session):
        with pytest.raises(ValueError, match="non-blank string"):
            call(session_id)
    assert fingerprint(primed) == before
    # A missing key still means "default", as the reference does.
    primed.generate(DiffusionRequest("r"))
    assert "default" in primed.sessions


def test_states_refuse_copy_deepcopy_and_pickle():
    cache = ARDiffusionKVCache(small_spec(), **{k: v for k, v in F32.items()})
    state = cache.create_state("s")
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            duplicate(state)
    state.close()
    state.close()  # idempotent on the one handle
    assert cache.num_free_slots == cache.session_capacity
    a, b = cache.create_state("a"), cache.create_state("b")
    assert a.slot != b.slot


def test_runtime_calls_refuse_tracers_and_keep_working(primed):
    before = fingerprint(primed)

    @jax.jit
    def generate_inside_jit(x):
        primed.generate(DiffusionRequest("r", extra_args={"session_id": "a"}, inputs={"x": x}))
        return x

    with pytest.raises(TypeError, match="traced value"):
        generate_inside_jit(jnp.ones(3))
    assert fingerprint(primed) == before

    cache = ARDiffusionKVCache(small_spec(), **F32)
    state = cache.create_state("s")
    spec = cache.spec
    state.get_kv_caches("main", seq_len=spec.frames_per_block * spec.tokens_per_frame, commit_current=True)

    @jax.jit
    def commit_inside_jit(kv):
        state.commit_paged_context("main", kv=(kv, kv))
        return kv

    with pytest.raises(TypeError, match="traced value"):
        commit_inside_jit(block_values(spec, spec.frames_per_block, seed=0))
    kv = block_values(spec, spec.frames_per_block, seed=0)
    state.commit_paged_context("main", kv=(kv, kv))  # the pending context survived; the manager is clean
    assert state.adapter("main").committed_frames == spec.frames_per_block
    primed.generate(request("a"))  # every later request still works


@pytest.mark.parametrize("finished", ["abc", b"ab", {"a": 1}, [3], None])
def test_scheduler_output_types_are_validated(finished):
    with pytest.raises(TypeError):
        StepSchedulerOutput(finished_req_ids=finished)
    with pytest.raises(TypeError):
        StepSchedulerOutput(scheduled="abc")


@pytest.mark.parametrize("dtype", ["int8", "int32", "bool", "complex64", None, "nope", "float64", True])
def test_engine_config_accepts_only_floating_kv_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype=dtype)


def test_engine_config_normalises_good_dtypes():
    assert EngineConfig(dtype=jnp.bfloat16).dtype == "bfloat16"
    assert EngineConfig(dtype=np.float16).dtype == "float16"
    assert EngineConfig(dtype="float32").dtype == "float32"


class ForgetfulPipeline(RecordingPipeline):
    """A tick-mode forward that asks for a committing context and returns without committing."""

    def forward(self, request):
        if request.inputs.get("forget"):
            state = self.current_state
            self.log.append(("forward", state.session_id))
            state.get_kv_caches("main", seq_len=self.spec.frames_per_block * self.spec.tokens_per_frame,
                                commit_current=True)
            return None
        return super().forward(request)


def test_forward_that_forgets_to_commit_fails_that_request():
    engine = make_engine(ForgetfulPipeline())
    engine.generate(request("s"))
    with pytest.raises(RuntimeError, match="returned without commit_paged_context"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": "s"}, inputs={"forget": True}))
    assert engine.sessions == ()  # failed closed: the session was released with the close hook
    assert engine.runner.pipeline.log[-1] == ("close_hook", "s")
    engine.generate(request("s"))  # the next correct request on that id works
    assert engine.runner.session_table.get("s").describe()["branches"]["main"]["committed_frames"] == 3


# -- inconsistent state and unclear errors ------------------------------------------------------------


def test_reports_are_safe_while_another_thread_drives_the_engine():
    engine = make_engine(RecordingPipeline(spec=small_spec(session_capacity=3)))
    stop = threading.Event()
    errors = []

    def drive():
        i = 0
        while not stop.is_set():
            engine.generate(DiffusionRequest("r", extra_args={"session_id": f"s{i % 5}"}, inputs={"commit": False}))
            i += 1

    worker = threading.Thread(target=drive)
    worker.start()
    try:
        for _ in range(300):
            try:
                engine.runner.kv_cache.memory_report()
                for sid in engine.sessions:
                    state = engine.runner.session_table.get(sid)
                    if state is not None:
                        state.describe()
            except Exception as error:  # noqa: BLE001 - any exception is the failure we look for
                errors.append(error)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert errors == []


class ClosingPipeline(RecordingPipeline):
    def forward(self, request):
        if request.inputs.get("close_state"):
            self.current_state.close()
        if request.inputs.get("reenter"):
            self.engine.generate(DiffusionRequest("inner", extra_args={"session_id": "other"}))
        return super().forward(request)


def test_pipelines_cannot_release_runner_managed_states():
    engine = make_engine(ClosingPipeline())
    engine.generate(request("s"))
    with pytest.raises(RuntimeError, match="managed by the runner"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": "s"}, inputs={"close_state": True}))
    cache = engine.runner.kv_cache
    assert engine.sessions == () and cache.num_free_slots == cache.session_capacity  # failed closed, consistent
    assert engine.runner.pipeline.log.count(("close_hook", "s")) == 1


class HoardingPipeline(RecordingPipeline):
    """Keeps every bound state in a list (a container the runner's attribute check does not see)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hoard = []

    def forward(self, request):
        self.hoard.append(self.current_state)
        return super().forward(request)


def test_a_state_kept_in_a_container_cannot_close_a_live_session():
    engine = make_engine(HoardingPipeline())
    engine.generate(request("s"))
    kept = engine.runner.pipeline.hoard[0]
    before = fingerprint(engine)
    with pytest.raises(RuntimeError, match="managed by the runner"):
        kept.close()
    with pytest.raises(RuntimeError, match="outside its runner invocation"):
        kept.get_kv_caches("main", seq_len=3)
    assert fingerprint(engine) == before and engine.sessions == ("s",)
    engine.generate(request("s"))  # the session is alive and keeps its history
    assert engine.runner.session_table.get("s").describe()["branches"]["main"]["committed_frames"] == 6


def test_reentering_the_engine_from_forward_is_refused():
    pipeline = ClosingPipeline(spec=small_spec(session_capacity=1))
    engine = make_engine(pipeline)
    pipeline.engine = engine
    with pytest.raises(RuntimeError, match="inside the forward of session 's'"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": "s"}, inputs={"reenter": True}))
    assert pipeline.log.count(("close_hook", "s")) == 1  # released once, by the fail-closed path
    assert ("close_hook", "other") not in pipeline.log and engine.sessions == ()


def test_one_pipeline_instance_serves_one_open_engine():
    pipeline = RecordingPipeline()
    first = make_engine(pipeline)
    with pytest.raises(ValueError, match="already loaded by another open engine"):
        make_engine(pipeline)
    first.close()
    second = make_engine(pipeline)  # free again once the first engine closed
    second.generate(request("s"))


def test_closed_engine_and_cache_refuse_everything():
    engine = make_engine()
    engine.generate(request("s"))
    engine.close()
    log = list(engine.runner.pipeline.log)
    for call in (lambda: engine.close_session("s"), lambda: engine.reset_session("s"),
                 lambda: engine.generate(request("s"))):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert engine.runner.pipeline.log == log  # no hook ran after close
    cache = engine.runner.kv_cache
    with pytest.raises(RuntimeError, match="ARDiffusionKVCache is closed"):
        cache.create_state("t")
    with pytest.raises(RuntimeError, match="ARDiffusionKVCache is closed"):
        cache.reallocate_pools()
    assert cache.memory_report()["pool_bytes"] == 0


@pytest.mark.parametrize("field, value, match", [
    ("step_execution", "false", "step_execution must be a bool"),
    ("warmup", "no", "warmup must be a bool"),
    ("max_num_seqs", 1.0, "max_num_seqs must be an integer"),
    ("max_num_seqs", True, "max_num_seqs must be an integer"),
    ("available_memory_bytes", -1, "available_memory_bytes must be a non-negative integer"),
    ("available_memory_bytes", 1.5, "available_memory_bytes must be a non-negative integer"),
    ("attention_backend", "", "attention_backend"),
])
def test_engine_config_field_types(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_numpy_integers_are_integers():
    spec = small_spec(num_layers=np.int64(2), session_capacity=np.int32(2))
    assert spec.num_layers == 2 and type(spec.num_layers) is int and spec == small_spec()
    EngineConfig(max_num_seqs=np.int64(1), available_memory_bytes=np.int64(10**7))


@pytest.mark.parametrize("overrides, match", [
    (dict(kv_branches=None), "kv_branches must be a sequence"),
    (dict(cross_attention=None), "cross_attention must be a sequence"),
    (dict(max_model_len=2), "must hold at least one block"),
])
def test_spec_refuses_none_and_impossible_values_clearly(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_spec(**overrides)


# -- reference gaps ------------------------------------------------------------------------------------


def _scratch_state():
    # scratch pages = frames_per_block 2 + ceil(3 declared extra tokens / 2 tokens per frame) = 4
    spec = small_spec(tokens_per_frame=2, frames_per_block=2, window_frames=6, max_scratch_tokens_per_branch=3,
                      num_kv_heads=1, head_size=4)
    cache = ARDiffusionKVCache(spec, **F32)
    assert cache.layout.scratch_pages == 4
    return cache, cache.create_state("s")


def test_committing_forwards_charge_scratch_only_for_their_extra_tokens():
    cache, state = _scratch_state()
    rng = np.random.default_rng(0)
    frames = 4  # 4 frames + 2 pages of extra tokens = 6 > 4 scratch pages: refused before, accepted now
    kv = jnp.asarray(rng.normal(size=(2, frames * 2, 1, 4)), jnp.float32)
    extra = jnp.asarray(rng.normal(size=(3, 1, 4)), jnp.float32)
    caches = state.get_kv_caches("main", seq_len=frames * 2, commit_current=True)
    out = caches.attend(0, kv[0], kv[0], kv[0], extra_k=extra, extra_v=extra)
    np.testing.assert_allclose(np.asarray(out), np.asarray(caches.ref_attend(0, kv[0], kv[0], kv[0], extra_k=extra,
                                                                             extra_v=extra)), rtol=1e-5, atol=1e-6)
    state.commit_paged_context("main", kv=(kv, kv))
    assert state.adapter("main").committed_frames == frames


def test_non_committing_forwards_charge_frames_and_extra_tokens():
    cache, state = _scratch_state()
    before = state.snapshot()
    with pytest.raises(RuntimeError, match="non-committing forward of 3 frames"):
        state.get_kv_caches("main", seq_len=6, commit_current=False)  # 3 + 2 > 4
    assert state.snapshot() == before and not state.has_pending_context("main")
    state.get_kv_caches("main", seq_len=4, commit_current=False)  # 2 + 2 = 4 fits


# -- found by review: each case failed before its fix ---------------------------------------------------


def test_device_rollout_under_jit_is_refused_and_the_cache_keeps_working():
    from ardiff_jax.rollout import rollout_sessions

    cache = ARDiffusionKVCache(small_spec(), **F32)
    state = cache.create_state("s")
    spec = cache.spec
    kv = block_values(spec, spec.frames_per_block, seed=0)

    def block_fn(caches, x):
        return x, kv, kv

    for traced_xs in (True, False):
        @jax.jit
        def inside(x):
            xs = x if traced_xs else jnp.ones((2, 3))
            return rollout_sessions(cache, [state], jax.tree_util.Partial(block_fn), xs, [0, 0], branch="main",
                                    num_frames=spec.frames_per_block)

        with pytest.raises(TypeError, match="traced value"):
            inside(jnp.ones((2, 3)))
    assert state.adapter("main").committed_frames == 0 and not isinstance(cache.pools.k, jax.core.Tracer)
    state.get_kv_caches("main", seq_len=spec.frames_per_block * spec.tokens_per_frame, commit_current=True)
    state.commit_paged_context("main", kv=(kv, kv))  # the cache still works


def test_restore_refuses_inconsistent_values_and_accepts_reordered_ones():
    import dataclasses as dc

    from ardiff_jax import ARDiffusionKVBranchSpec
    from ardiff_jax.runtime import BranchCursor

    shared = small_spec(kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0)),
                        max_model_len=30)
    cache = ARDiffusionKVCache(shared, **F32)
    state = cache.create_state("s")
    kv = block_values(shared, shared.frames_per_block, seed=1)
    state.get_kv_caches("positive", seq_len=3, commit_current=True)
    state.commit_paged_context("positive", kv=(kv, kv))
    snap = state.snapshot()
    bad = {
        "owner dropped": dc.replace(snap, run_owners=()),
        "owner unknown": dc.replace(snap, run_owners=((0, "nope"),)),
        "owner at another index": dc.replace(snap, run_owners=((1, "positive"),)),
        "visible start in sliding mode": dc.replace(snap, cursors={**snap.cursors,
                                                                   "positive": BranchCursor(3, 1)}),
        "beyond max_model_len": dc.replace(snap, cursors={**snap.cursors, "positive": BranchCursor(31, 0)}),
        "negative frames": dc.replace(snap, cursors={**snap.cursors, "positive": BranchCursor(-3, 0)}),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError):
            state.restore(value)
        assert state.snapshot() == snap, name
    reordered = jax.tree_util.tree_map(lambda x: x, snap)  # jax sorts the dict keys
    assert list(reordered.cursors) != list(snap.cursors)
    state.restore(reordered)
    assert list(state.snapshot().cursors) == ["positive", "negative"] and state.snapshot() == snap


def test_snapshots_cannot_change_the_session():
    cache = ARDiffusionKVCache(small_spec(), **F32)
    state = cache.create_state("s")
    snap = state.snapshot()
    with pytest.raises(TypeError):
        snap.cursors["main"] = snap.cursors["main"]  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.cross_attention[("text", "main")] = None  # type: ignore[index]


def test_reset_cannot_reopen_a_state_of_a_closed_cache():
    cache = ARDiffusionKVCache(small_spec(), **F32)
    state = cache.create_state("s")
    state.close()
    cache.close()
    with pytest.raises(RuntimeError, match="ARDiffusionKVCache is closed"):
        state.reset()
    assert state.closed and cache.memory_report()["open_sessions"] == 0


def test_listeners_see_events_in_order_even_when_a_listener_calls_the_engine():
    engine = make_engine()
    seen_by_second = []

    def first(event):
        if (event.kind, event.session_id) == ("created", "s1"):
            engine.close_session("s1")  # nested call: its event is queued behind this one

    engine.runner.add_session_listener(first)
    engine.runner.add_session_listener(lambda event: seen_by_second.append((event.kind, event.session_id)))
    engine.generate(request("s1"))
    assert seen_by_second == [("created", "s1"), ("released", "s1")]


def test_the_kv_cache_of_an_engine_is_closed_through_the_engine():
    engine = make_engine()
    engine.generate(request("a"))
    with pytest.raises(RuntimeError, match="close the engine"):
        engine.runner.kv_cache.close()
    assert engine.sessions == ("a",)
    engine.generate(request("a"))  # untouched
    engine.close()
    assert engine.runner.kv_cache.closed


def test_a_runner_whose_warmup_is_interrupted_frees_its_pipeline():
    from runner_pipelines import WarmupPipeline

    class Interrupted(WarmupPipeline):
        def ar_diffusion_warmup_requests(self, session_id):
            raise KeyboardInterrupt

    pipeline = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        make_engine(pipeline)
    pipeline.ar_diffusion_warmup_requests = lambda session_id: iter(())  # type: ignore[method-assign]
    make_engine(pipeline).generate(request("s"))  # the interrupted runner no longer holds the pipeline


class ReenteringHooks(RecordingPipeline):
    engine = None

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        if self.engine is not None and session_id == "a":
            self.engine.generate(request("z"))


def test_pipeline_hooks_cannot_call_back_into_the_engine():
    pipeline = ReenteringHooks()
    engine = make_engine(pipeline)
    pipeline.engine = engine
    engine.generate(request("a"))
    with pytest.raises(RuntimeError, match="inside the close hook of session 'a'"):
        engine.close_session("a")
    assert engine.sessions == ()  # the KV went first, and "z" was never created
    engine.generate(request("a"))
    engine.close()  # the nested call fails inside close() too; its error is logged, nothing is left resident
    assert engine.sessions == () and ("close_hook", "z") not in pipeline.log


def test_a_refused_stepwise_tick_releases_nothing():
    from runner_pipelines import StepPipeline

    class Validating(StepPipeline):
        def validate_ar_diffusion_request(self, session_id, request):
            if request.inputs.get("bad"):
                raise ValueError("bad request")

    engine = make_engine(Validating(), step_execution=True)
    engine.step(StepSchedulerOutput(scheduled=(DiffusionRequest("old", inputs={"results": ("none", "none")}),)))
    log = list(engine.runner.pipeline.log)
    with pytest.raises(ValueError, match="bad request"):
        engine.step(StepSchedulerOutput(scheduled=(DiffusionRequest("new", inputs={"bad": True}),),
                                        finished_req_ids={"old"}))
    assert engine.sessions == ("old",) and engine.runner.pipeline.log == log


def test_legacy_staged_layers_do_not_survive_reset():
    import warnings

    cache = ARDiffusionKVCache(small_spec(), **F32)
    state = cache.create_state("s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for layer in range(2):
            state.write_cross_attention_kv("text", layer, "main", jnp.ones((8, 1, 4)), jnp.ones((8, 1, 4)))
        state.reset()
        with pytest.raises(ValueError, match="never written"):
            state.mark_cross_attention_populated("main", "text")
    assert not state.is_cross_attention_populated("main", "text")
