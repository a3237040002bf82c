"""WorldPipeline through the engine: equals a cache-free reference; isolation, lifecycle, stepwise, compiles."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import count_compiles
from models_reference import ReferenceLRU, ReferenceWorld, visible_history_frames

from ardiff_jax import (
    ARDiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    StepSchedulerOutput,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionWarmup,
    SupportsStepExecution,
)
from ardiff_jax.models import WorldPipeline, dit_preset

#: float32 end to end. The paged path reads the ring in physical (not time) order and merges
#: history and current block with a shared log-sum-exp; the reference concatenates in time
#: order and runs one softmax. Only float summation order differs (~1e-7 relative per
#: attention), carried through 2 layers x 5 forwards per block and fed back through the
#: committed history of later blocks; 1e-5 absolute on O(1) latents leaves ~10x headroom
#: over the largest difference measured (see the test's assertion message).
TOLERANCE = 1e-5

#: Warmup only where a test is about it (WARMUP): elsewhere it would compile the batch buckets (2, 3)
#: no test here runs and replay its warmup blocks for every engine; each program used compiles on
#: first use and is cached for the process.
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)
WARMUP = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


@pytest.fixture(scope="module")
def pipeline_factory():
    base = WorldPipeline("tiny")

    def make(**kwargs):
        return WorldPipeline("tiny", modules=base.modules, **kwargs)

    return make


def _action(rng: np.random.Generator, cfg) -> np.ndarray:
    return rng.standard_normal((cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)


def _request(session: str, prompt: str | None = "a red car", action=None, seed: int | None = None,
             **extra) -> DiffusionRequest:
    inputs = {} if action is None else {"action": action}
    if seed is not None:
        inputs["seed"] = seed
    return DiffusionRequest(f"r-{session}", prompt=prompt, extra_args={"session_id": session, **extra}, inputs=inputs)


def test_visible_history_model_matches_the_contract_example():
    # The worked example of docs/reference_behaviour.md, "Visible window": sink 1, window 5, 8 committed
    # single frames, 1 current.
    assert visible_history_frames(8, 1, sink=1, window=5) == [0, 4, 5, 6, 7]
    assert visible_history_frames(0, 2, sink=1, window=5) == []
    assert visible_history_frames(3, 2, sink=1, window=5) == [0, 1, 2]


def test_rollout_matches_cache_free_reference(pipeline_factory):
    """Interleaved sessions, LRU eviction, a prompt change and a reset, ring wrapping 3x+."""
    pipeline = pipeline_factory()
    cfg = pipeline.config
    engine = ARDiffusionEngine(pipeline, CONFIG)
    assert engine.session_capacity == 3
    events = []
    engine.runner.add_session_listener(events.append)
    reference = ReferenceWorld(pipeline)
    lru = ReferenceLRU(engine.session_capacity)
    rng = np.random.default_rng(0)
    prompts = {"A": "a red car", "B": "a blue boat", "C": "rain", "D": "snow", "E": "fog"}
    churn = ["C", "D", "E"]
    worst = 0.0
    rounds = 10
    for r in range(rounds):
        # A and B run every round; the third slot churns through C, D, E, so each of them is
        # evicted (LRU) before it comes back and restarts empty.
        for sid in ("A", "B", churn[r % 3]):
            if sid == "A" and r == 4:
                prompts["A"] = "a green tram"  # prompt change: text cache repopulated, history kept
            reset = sid == "B" and r == 6
            action = _action(rng, cfg)
            ref_session = lru.touch(sid, lambda s=sid: reference.new_session(s, prompts[s]), reset=reset)
            expected = reference.generate(ref_session, prompts[sid], action)
            extra = {"reset": True} if reset else {}
            out = engine.generate(_request(sid, prompts[sid], action, **extra))
            assert out.first_frame == ref_session.committed[-1].frame_start
            assert engine.sessions == tuple(lru.order), (engine.sessions, tuple(lru.order))
            diff = float(np.max(np.abs(np.asarray(out.latents) - expected)))
            worst = max(worst, diff)
            assert diff <= TOLERANCE, f"round {r} session {sid}: max |paged - reference| = {diff:.3g}"
    # The long sessions wrapped their ring several times; evictions really happened.
    a_frames = rounds * cfg.frames_per_block
    assert a_frames >= 3 * cfg.window_frames + cfg.sink_frames
    assert lru.evicted and [e.session_id for e in events if e.reason == "lru_eviction"] == lru.evicted
    print(f"world rollout: worst |paged - reference| = {worst:.3g} (tolerance {TOLERANCE})")


def _run(engine: ARDiffusionEngine, schedule: list[str], seed_of: dict[str, int]) -> dict[str, list[np.ndarray]]:
    outs: dict[str, list[np.ndarray]] = {}
    for sid in schedule:
        request = DiffusionRequest(f"r-{sid}", prompt=f"prompt {sid}", extra_args={"session_id": sid},
                                   inputs={"seed": seed_of[sid]})
        outs.setdefault(sid, []).append(np.asarray(engine.generate(request).latents))
    return outs


def test_interleaved_sessions_equal_each_alone_bitwise(pipeline_factory):
    seeds = {"X": 11, "Y": 12}
    alone = {}
    for sid in seeds:
        alone.update(_run(ARDiffusionEngine(pipeline_factory(), CONFIG), [sid] * 4, seeds))
    together = _run(ARDiffusionEngine(pipeline_factory(), CONFIG), ["X", "Y", "Y", "X", "X", "Y", "X", "Y"], seeds)
    for sid in seeds:
        for block, (a, b) in enumerate(zip(alone[sid], together[sid], strict=True)):
            assert np.array_equal(a, b), f"session {sid} block {block} differs when interleaved"
    assert not np.array_equal(alone["X"][0], alone["Y"][0])  # the sessions really differ


def test_reset_equals_fresh_and_close_starts_empty(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    fresh = [np.asarray(engine.generate(_request("F", seed=9)).latents) for _ in range(2)]
    for _ in range(3):
        engine.generate(_request("S", seed=9))
    after_reset = engine.generate(_request("S", seed=9, reset=True))
    assert after_reset.first_frame == 0
    assert np.array_equal(np.asarray(after_reset.latents), fresh[0])
    assert np.array_equal(np.asarray(engine.generate(_request("S")).latents), fresh[1])

    engine.close_session("S")
    assert "S" not in engine.sessions and "S" not in pipeline.session_ids
    reopened = engine.generate(_request("S", seed=9))
    assert reopened.first_frame == 0 and reopened.block_index == 0
    assert np.array_equal(np.asarray(reopened.latents), fresh[0])


def test_stepwise_equals_tick_bitwise(pipeline_factory):
    cfg = dit_preset("tiny")
    blocks = 3
    actions = np.random.default_rng(5).standard_normal(
        (blocks, cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)
    tick_engine = ARDiffusionEngine(pipeline_factory(), CONFIG)
    tick = [np.asarray(tick_engine.generate(DiffusionRequest(
        "t", prompt="a street", extra_args={"session_id": "stream"}, inputs={"action": actions[b], "seed": 3}
    )).latents) for b in range(blocks)]

    pipeline = pipeline_factory()
    step_engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                           gpu_memory_fraction=1.0, step_execution=True,
                                                           warmup=False))
    request = DiffusionRequest("stream", prompt="a street", inputs={"action": actions, "seed": 3, "num_blocks": blocks})
    emitted, calls = [], 0
    while True:
        result = step_engine.step(StepSchedulerOutput(scheduled=(request,)))
        calls += 1
        if result.output is not None:
            emitted.append((calls, np.asarray(result.output.latents)))
        if result.finished:
            break
        assert calls < 100
    steps = pipeline.schedule.num_steps
    assert [c for c, _ in emitted] == [steps * (b + 1) for b in range(blocks)]  # one denoise step per call
    for b, (_, latents) in enumerate(emitted):
        assert np.array_equal(latents, tick[b]), f"block {b}: stepwise differs from tick"
    # The finished streaming request released its session and its model-owned state.
    assert step_engine.sessions == () and pipeline.session_ids == ()


def test_no_recompilation_across_sessions_fill_levels_resets(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, WARMUP)  # warmup compiles every program a block needs
    engine.generate(_request("first"))
    rng = np.random.default_rng(1)
    with count_compiles() as compiled:
        for r in range(8):  # fills and wraps the window, evicts (5 ids > capacity 3), resets, new prompts
            for sid in ("first", "p", "q", "s", "t")[: 2 + r % 4]:
                engine.generate(_request(sid, f"prompt {r % 3}", _action(rng, pipeline.config), reset=(r == 5)))
    assert compiled == [], f"recompiled after the first block: {compiled}"


def test_model_owned_state_within_declared_bound_and_dropped(pipeline_factory):
    pipeline = pipeline_factory()
    spec = pipeline.ar_diffusion_kv_cache_spec()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    engine.generate(_request("m"))
    assert 0 < pipeline.model_owned_bytes("m") <= spec.model_owned_state_bytes_per_session
    engine.reset_session("m")
    assert pipeline.model_owned_bytes("m") == 0


def test_bad_inputs_fail_with_clear_errors_and_change_nothing(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    with pytest.raises(ValueError, match="first request needs one"):
        engine.generate(_request("n", prompt=None))
    assert engine.sessions == () and pipeline.session_ids == ()  # rejected before any session existed
    first = engine.generate(_request("n"))
    assert first.first_frame == 0
    with pytest.raises(ValueError, match=r"inputs\['action'\] must have shape \(3, 16\)"):
        engine.generate(_request("n", action=np.zeros((2, 16), np.float32)))
    with pytest.raises(ValueError, match="finite"):
        engine.generate(_request("n", action=np.full((3, 16), np.nan, np.float32)))
    # The pipeline validates before the runner touches the session: the healthy session
    # survives the bad requests and continues where it was.
    assert engine.sessions == ("n",)
    assert engine.generate(_request("n")).first_frame == first.latents.shape[0]


def test_spec_matches_the_sketch_geometry(pipeline_factory):
    pipeline = pipeline_factory()
    assert isinstance(pipeline, SupportsARDiffusionPipeline)
    assert isinstance(pipeline, SupportsARDiffusionWarmup)
    assert isinstance(pipeline, SupportsStepExecution) and pipeline.supports_step_execution
    pipeline_spec = WorldPipeline.kv_spec_for(dit_preset("tiny"))
    assert pipeline_spec.kv_branch_names == ("main",)
    assert pipeline_spec.cross_attention_lengths == {"text": 8}
    assert pipeline_spec.max_scratch_tokens_per_branch == 3
    assert (pipeline_spec.sink_frames, pipeline_spec.window_frames, pipeline_spec.frames_per_block) == (1, 5, 2)


#: What ``json.loads`` makes of a client's ``"\ud800"``: a ``str`` no UTF-8 encoder accepts.
LONE_SURROGATE = json.loads('"a \\ud800 car"')

BAD_NEW_SESSION_REQUESTS = [
    (LONE_SURROGATE, {}, "lone surrogate"),
    ("a red car", {"seed": -1}, r"inputs\['seed'\]"),
    ("a red car", {"seed": 2**31}, r"inputs\['seed'\]"),
    ("a red car", {"seed": "7"}, r"inputs\['seed'\]"),
    ("a red car", {"seed": True}, r"inputs\['seed'\]"),
]


def _watch_releases(engine: ARDiffusionEngine, pipeline) -> list:
    """Record every session event and every pipeline close/reset hook call."""
    calls: list = []
    engine.runner.add_session_listener(calls.append)
    for hook in ("close_ar_diffusion_session", "reset_ar_diffusion_session"):
        original = getattr(pipeline, hook)
        setattr(pipeline, hook, lambda sid, original=original, hook=hook: (calls.append((hook, sid)), original(sid)))
    return calls


@pytest.mark.parametrize("prompt, inputs, message", BAD_NEW_SESSION_REQUESTS)
def test_bad_request_for_a_new_session_evicts_nobody(pipeline_factory, prompt, inputs, message):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    for sid in ("a", "b", "c"):
        engine.generate(_request(sid))
    resident, owned = engine.sessions, pipeline.session_ids
    assert len(resident) == engine.session_capacity  # a newcomer would evict "a"
    calls = _watch_releases(engine, pipeline)
    with pytest.raises(ValueError, match=message):
        engine.generate(DiffusionRequest("bad", prompt=prompt, extra_args={"session_id": "new"}, inputs=inputs))
    assert engine.sessions == resident and pipeline.session_ids == owned
    assert calls == []  # no eviction, no close hook, no session created


def test_unencodable_prompt_keeps_an_established_session(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    first = engine.generate(_request("s"))
    calls = _watch_releases(engine, pipeline)
    with pytest.raises(ValueError, match="WorldPipeline prompt .* lone surrogate"):
        engine.generate(_request("s", prompt=LONE_SURROGATE))
    assert calls == [] and engine.sessions == ("s",)
    assert engine.generate(_request("s")).first_frame == first.latents.shape[0]  # continues its history


def test_tick_mode_accepts_what_validation_accepts(pipeline_factory):
    """A per-block action stack passes the validator, so forward must take it too (not fail after admission)."""
    cfg = dit_preset("tiny")
    engine = ARDiffusionEngine(pipeline_factory(), CONFIG)
    actions = np.random.default_rng(2).standard_normal(
        (2, cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)
    stacked = engine.generate(DiffusionRequest("r", prompt="p", extra_args={"session_id": "x"},
                                               inputs={"action": actions, "num_blocks": 2, "seed": 1}))
    single = engine.generate(DiffusionRequest("r", prompt="p", extra_args={"session_id": "y"},
                                              inputs={"action": actions[0], "seed": 1}))
    assert np.array_equal(np.asarray(stacked.latents), np.asarray(single.latents))
    assert engine.sessions == ("x", "y")


def test_per_frame_controls_condition_the_block_and_are_validated():
    # A control-conditioned transformer (control_dim > 0): inputs["controls"] is one vector per frame,
    # validated on the host, part of the exported session state while a block is in flight.
    config = dit_preset("tiny").replace(control_dim=2)
    pipeline = WorldPipeline(config)
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        f = config.frames_per_block

        def block(sid, **inputs):
            return np.asarray(engine.generate(DiffusionRequest(sid, prompt="a car", extra_args={"session_id": sid},
                                                               inputs={"seed": 3, **inputs})).latents)

        zero = block("a")
        np.testing.assert_array_equal(zero, block("b", controls=np.zeros((f, 2), np.float32)))  # the default
        assert not np.allclose(zero, block("c", controls=np.ones((f, 2), np.float32)))
        for bad in (np.zeros((f, 3), np.float32), np.zeros((f + 1, 2), np.float32), np.full((f, 2), np.nan)):
            with pytest.raises(ValueError, match="inputs\\['controls'\\]"):
                block("d", controls=bad)
        assert "d" not in engine.sessions
    with ARDiffusionEngine(WorldPipeline("tiny"), CONFIG) as engine:
        with pytest.raises(ValueError, match="not control-conditioned"):
            engine.generate(DiffusionRequest("e", prompt="x", extra_args={"session_id": "e"},
                                             inputs={"controls": np.zeros((2, 2), np.float32)}))
