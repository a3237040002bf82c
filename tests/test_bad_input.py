"""Bad input at every public entry point: the right error, a message naming the problem, nothing changed.

One table per layer. Each row is (entry point, call, error type, message pattern). Before
and after every call the test takes a fingerprint of everything a refused call must not
touch: the pool bytes, every session's bookkeeping (cursors, pending contexts, cross
caches, slot), the resident sessions in LRU order and the pipeline's hook log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionEngine,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    DiffusionRequest,
    EngineConfig,
    plan_memory,
)
from ardiff_jax.rollout import rollout_sessions
from ardiff_jax.runtime import ARDiffusionKVCache
from ardiff_jax.types import ARDiffusionTickRequest, StepSchedulerOutput

from runner_pipelines import RecordingPipeline

L, H, D, T, F = 2, 2, 4, 2, 2
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
SPEC = ARDiffusionKVCacheSpec(num_layers=L, num_kv_heads=H, head_size=D, tokens_per_frame=T, frames_per_block=F,
                              window_frames=4, sink_frames=1, kv_branches=CFG, session_capacity=3,
                              cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 3),),
                              max_scratch_tokens_per_branch=2)
F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)


def block(seed, frames=F, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(L, frames * T, H, D)), dtype)


def text_pairs(n=L, shape=(3, H, D)):
    return [(jnp.ones(shape), jnp.ones(shape)) for _ in range(n)]


@pytest.fixture
def world():
    """A KV cache with two populated sessions (one mid-forward) and an engine with two sessions."""
    cache = ARDiffusionKVCache(SPEC, **F32)
    a, b = cache.create_state("a"), cache.create_state("b")
    for state, seed in ((a, 1), (b, 2)):
        state.populate_cross_attention("positive", "text", text_pairs())
        state.get_kv_caches("positive", seq_len=F * T, commit_current=True)
        state.commit_paged_context("positive", kv=(block(seed), block(seed + 10)))
    b.get_kv_caches("negative", seq_len=F * T, commit_current=True)  # b has a pending committing context
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32))
    for sid in ("x", "y"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": sid}))
    return dict(cache=cache, a=a, b=b, engine=engine)


def fingerprint(world):
    cache, engine = world["cache"], world["engine"]
    runner = engine.runner

    def pools(c):
        return np.asarray(c.pools.k).tobytes(), np.asarray(c.pools.v).tobytes()

    def state_view(state):
        view = dict(state.describe())
        view["cross"] = {key: (np.asarray(kv.k).tobytes(), np.asarray(kv.v).tobytes())
                         for key, kv in state._value.cross_attention.items()}
        return view

    return (pools(cache), [state_view(cache.get_state(sid)) for sid in cache.session_ids], cache.num_free_slots,
            pools(runner.kv_cache), engine.sessions, list(runner.pipeline.log),
            [state_view(runner.session_table.get(sid)) for sid in engine.sessions])


def _engine_req(**extra):
    return DiffusionRequest("r", extra_args=extra)


KV_MANAGER_CASES = [
    # (name, call, error, message)
    ("get_kv_caches unknown branch", lambda w: w["a"].get_kv_caches("nope", seq_len=4), KeyError, "nope"),
    ("get_kv_caches seq_len None", lambda w: w["a"].get_kv_caches("positive"), ValueError, "requires seq_len"),
    ("get_kv_caches seq_len float", lambda w: w["a"].get_kv_caches("positive", seq_len=4.0), ValueError,
     "seq_len must be an integer"),
    ("get_kv_caches seq_len bool", lambda w: w["a"].get_kv_caches("positive", seq_len=True), ValueError,
     "seq_len must be an integer"),
    ("get_kv_caches not frame aligned", lambda w: w["a"].get_kv_caches("positive", seq_len=3), ValueError,
     "frame-aligned"),
    ("get_kv_caches negative", lambda w: w["a"].get_kv_caches("positive", seq_len=-2), ValueError, "frame-aligned"),
    ("get_kv_caches longer than the window", lambda w: w["a"].get_kv_caches("positive", seq_len=10 * T), ValueError,
     "exceeds window_frames"),
    ("get_kv_caches commit_current str", lambda w: w["a"].get_kv_caches("positive", seq_len=4,
                                                                        commit_current="yes"), ValueError,
     "commit_current must be a bool"),
    ("get_kv_caches replaces a committing context", lambda w: w["b"].get_kv_caches("negative", seq_len=4),
     RuntimeError, "replaced before"),
    ("commit without pending but with kv", lambda w: w["a"].commit_paged_context("negative", kv=(block(0), block(0))),
     ValueError, "no pending context"),
    ("commit kv not a pair", lambda w: w["b"].commit_paged_context("negative", kv=(block(0),)), ValueError,
     "must be a \\(k, v\\) pair"),
    ("commit kv wrong shape", lambda w: w["b"].commit_paged_context("negative", kv=(block(0, 1), block(0, 1))),
     ValueError, "must have shape"),
    ("commit kv integer dtype", lambda w: w["b"].commit_paged_context("negative", kv=(block(0, dtype=jnp.int32),) * 2),
     ValueError, "floating dtype"),
    ("commit kv numpy object", lambda w: w["b"].commit_paged_context("negative", kv=("k", "v")), ValueError,
     "must be an array"),
    ("commit committing context without kv", lambda w: w["b"].commit_paged_context("negative"), ValueError,
     "must be committed with kv"),
    ("populate None iterable", lambda w: w["a"].populate_cross_attention("positive", "text", None), TypeError,
     "layer_kv must be an iterable"),
    ("populate too few layers", lambda w: w["a"].populate_cross_attention("positive", "text", text_pairs(1)),
     ValueError, "expected 2 layers, got 1"),
    ("populate too many layers", lambda w: w["a"].populate_cross_attention("positive", "text", text_pairs(3)),
     ValueError, "got more than 2"),
    ("populate wrong shape", lambda w: w["a"].populate_cross_attention("positive", "text",
                                                                       text_pairs(shape=(4, H, D))),
     ValueError, "expected k/v shape"),
    ("populate unknown cache", lambda w: w["a"].populate_cross_attention("positive", "image", text_pairs()),
     KeyError, "image"),
    ("populate raising iterator", lambda w: w["a"].populate_cross_attention(
        "positive", "text", (pair if i == 0 else 1 / 0 for i, pair in enumerate(text_pairs()))),
     ZeroDivisionError, "division"),
    ("read unpopulated cross cache", lambda w: w["a"].get_cross_attention_kv("negative", "text"), RuntimeError,
     "before it was populated"),
    ("reset keep None", lambda w: w["a"].reset(keep_cross_attention=None), TypeError, "keep_cross_attention"),
    ("reset keep unknown", lambda w: w["a"].reset(keep_cross_attention=("image",)), KeyError, "image"),
    ("restore not a value", lambda w: w["a"].restore({"cursors": {}}), TypeError, "SessionKV"),
    ("restore another session", lambda w: w["a"].restore(w["a"].snapshot().__class__(
        session_id="zzz", slot=0, cursors=w["a"].snapshot().cursors, cross_attention={})), ValueError,
     "cannot restore"),
    ("create_state duplicate", lambda w: w["cache"].create_state("a"), ValueError, "already has an open state"),
    ("create_state blank id", lambda w: w["cache"].create_state(" "), ValueError, "non-blank"),
    ("create_state int id", lambda w: w["cache"].create_state(5), ValueError, "non-blank"),
    ("rollout unknown branch", lambda w: rollout_sessions(w["cache"], [w["a"]], lambda c, x: (x, x, x),
                                                          jnp.ones((1, L, F * T, H, D)), [0], branch="nope",
                                                          num_frames=F), KeyError, "nope"),
    ("rollout bad index", lambda w: rollout_sessions(w["cache"], [w["a"]], lambda c, x: (x, x, x),
                                                     jnp.ones((1, L, F * T, H, D)), [1], branch="positive",
                                                     num_frames=F), ValueError, "session_index"),
    ("rollout float index", lambda w: rollout_sessions(w["cache"], [w["a"]], lambda c, x: (x, x, x),
                                                       jnp.ones((1, L, F * T, H, D)), [0.0], branch="positive",
                                                       num_frames=F), ValueError, "integers"),
    ("rollout bad num_frames", lambda w: rollout_sessions(w["cache"], [w["a"]], lambda c, x: (x, x, x),
                                                          jnp.ones((1, L, F * T, H, D)), [0], branch="positive",
                                                          num_frames=9), ValueError, "num_frames"),
    ("rollout pending context", lambda w: rollout_sessions(w["cache"], [w["b"]], lambda c, x: (x, x, x),
                                                           jnp.ones((1, L, F * T, H, D)), [0], branch="negative",
                                                           num_frames=F), RuntimeError, "pending context"),
    ("rollout same state twice", lambda w: rollout_sessions(w["cache"], [w["a"], w["a"]], lambda c, x: (x, x, x),
                                                            jnp.ones((1, L, F * T, H, D)), [0], branch="positive",
                                                            num_frames=F), ValueError, "distinct"),
]

ENGINE_CASES = [
    ("generate not a request", lambda w: w["engine"].generate({"request_id": "r"}), TypeError, "DiffusionRequest"),
    ("generate reset 'false'", lambda w: w["engine"].generate(_engine_req(session_id="x", reset="false")),
     ValueError, "reset"),
    ("generate close 1", lambda w: w["engine"].generate(_engine_req(session_id="x", close_session=1)), ValueError,
     "close_session"),
    ("generate id None", lambda w: w["engine"].generate(_engine_req(session_id=None)), ValueError, "session_id"),
    ("generate id 0", lambda w: w["engine"].generate(_engine_req(session_id=0)), ValueError, "session_id"),
    ("generate malformed tick", lambda w: w["engine"].generate(_engine_req(ar_diffusion_tick={"session_id": "x"})),
     ValueError, "missing"),
    ("generate tick not a mapping", lambda w: w["engine"].generate(_engine_req(ar_diffusion_tick=[1])), ValueError,
     "must be a mapping"),
    ("generate tick reset str", lambda w: w["engine"].generate(_engine_req(ar_diffusion_tick=dict(
        session_id="x", request_id="t", chunk_index=0, reset="no"))), ValueError, "reset must be a bool"),
    ("generate traced input", lambda w: jax.jit(lambda v: w["engine"].generate(DiffusionRequest(
        "r", extra_args={"session_id": "x"}, inputs={"v": v})))(jnp.ones(2)), TypeError, "traced value"),
    ("step not scheduler output", lambda w: w["engine"].step(["r"]), TypeError, "StepSchedulerOutput"),
    ("step without step execution", lambda w: w["engine"].step(StepSchedulerOutput()), RuntimeError,
     "step execution"),
    ("close_session None", lambda w: w["engine"].close_session(None), ValueError, "non-blank"),
    ("reset_session blank", lambda w: w["engine"].reset_session(" "), ValueError, "non-blank"),
    ("engine second load of the pipeline", lambda w: ARDiffusionEngine(w["engine"].runner.pipeline,
                                                                        EngineConfig(**F32)), ValueError,
     "already loaded"),
    ("engine config not a config", lambda w: ARDiffusionEngine(RecordingPipeline(), {"dtype": "float32"}),
     TypeError, "EngineConfig"),
    ("engine pipeline without capability", lambda w: ARDiffusionEngine(object(), EngineConfig(**F32)), TypeError,
     "SupportsARDiffusionPipeline"),
    ("engine memory too small", lambda w: ARDiffusionEngine(RecordingPipeline(), EngineConfig(
        dtype="float32", available_memory_bytes=10)), ValueError, "10"),
    ("plan_memory bad dtype", lambda w: plan_memory(SPEC, dtype="int8", available_memory_bytes=10**7), ValueError,
     "int8"),
    ("plan_memory bad fraction", lambda w: plan_memory(SPEC, dtype="float32", available_memory_bytes=10**7,
                                                       gpu_memory_fraction=float("nan")), ValueError,
     "gpu_memory_fraction"),
    ("plan_memory negative bytes", lambda w: plan_memory(SPEC, dtype="float32", available_memory_bytes=-1),
     ValueError, "available_memory_bytes"),
    ("request blank id", lambda w: DiffusionRequest(" "), ValueError, "request_id"),
    ("request extra_args list", lambda w: DiffusionRequest("r", extra_args=[("a", 1)]), TypeError, "mapping"),
    ("tick negative chunk", lambda w: ARDiffusionTickRequest("s", "t", -1), ValueError, "chunk_index"),
    ("tick event ids unsorted", lambda w: ARDiffusionTickRequest("s", "t", 0, applied_event_ids=(2, 1)), ValueError,
     "strictly increasing"),
]


@pytest.mark.parametrize("name, call, error, message", KV_MANAGER_CASES + ENGINE_CASES,
                         ids=[case[0] for case in KV_MANAGER_CASES + ENGINE_CASES])
def test_bad_input_is_refused_and_changes_nothing(world, name, call, error, message):
    before = fingerprint(world)
    with pytest.raises(error, match=message):
        call(world)
    assert fingerprint(world) == before, f"{name} changed state"
