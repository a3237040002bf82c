"""CFGWorldActionPipeline (DreamZero-style) through the engine: reference equality, warmup, layouts, lifecycle."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import count_compiles
from models_reference import ReferenceCFG, ReferenceLRU

from ardiff_jax import WARMUP_SESSION_ID, ARDiffusionEngine, DiffusionRequest, EngineConfig, SupportsARDiffusionWarmup
from ardiff_jax.geometries import medium as medium_geometry
from ardiff_jax.geometries import tiny as tiny_geometry
from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline, dit_preset

#: float32; as for the world pipeline only the summation order of attention differs, but the
#: guidance ``neg + 5 * (pos - neg)`` amplifies branch differences 5x (worst measured value in
#: the assertion message; the bound keeps ~10x headroom).
TOLERANCE = 5e-5

#: Warmup only where a test is about it (WARMUP): elsewhere it would compile the batch buckets (2, 3)
#: no test here runs and replay its warmup blocks for every engine; each program used compiles on
#: first use and is cached for the process.
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)
WARMUP = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


@pytest.fixture(scope="module")
def pipeline_factory():
    base = CFGWorldActionPipeline("tiny")

    def make(pipeline_config: CFGPipelineConfig | None = None):
        return CFGWorldActionPipeline("tiny", pipeline_config, modules=base.modules)

    return make


def _request(pipeline, session: str, frames: int, seed: int, prompt: str | None = "pick up the cup", **extra):
    observation = pipeline.schema.example(frames, seed=seed)
    return DiffusionRequest(f"r-{session}", prompt=prompt, extra_args={"session_id": session, **extra},
                            inputs={"observation": observation}), observation


def test_rollout_matches_cache_free_reference(pipeline_factory):
    """Observation commits on both branches, CFG denoising, LRU churn, prompt change; ring wraps 3x+."""
    pipeline = pipeline_factory()
    cfg = pipeline.config
    engine = ARDiffusionEngine(pipeline, CONFIG)
    reference = ReferenceCFG(pipeline)
    lru = ReferenceLRU(engine.session_capacity)
    prompts = {"A": "pick up the cup", "B": "open the drawer", "C": "wave", "D": "push", "E": "pull"}
    churn = ["C", "D", "E"]
    seen: set[str] = set()
    worst = 0.0
    rounds = 3 * cfg.window_frames + 1  # one latent frame committed per request after the first
    for r in range(rounds):
        for sid in ("A", "B") + ((churn[r % 3],) if r % 2 else ()):
            reset = False
            if sid == "B" and r == 9:
                prompts["B"] = "close the drawer"
                reset = True  # DreamZero resets the session on a prompt change
            if sid not in lru.order:
                seen.discard(sid)
            frames = 4 if sid in seen else 1  # the conditioning image first, then 4-frame chunks
            seen.add(sid)
            request, observation = _request(pipeline, sid, frames, seed=100 * r + ord(sid), prompt=prompts[sid])
            ref_session = lru.touch(sid, lambda s=sid: reference.new_session(s, prompts[s]), reset=reset)
            if reset:
                ref_session.prompt = prompts[sid]
            expected_video, expected_actions = reference.generate(ref_session, observation)
            out = engine.generate(request)
            assert engine.sessions == tuple(lru.order)
            diff = max(float(np.max(np.abs(np.asarray(out["video"]) - expected_video))),
                       float(np.max(np.abs(np.asarray(out["actions"]) - expected_actions))))
            worst = max(worst, diff)
            assert diff <= TOLERANCE, f"round {r} session {sid}: max |paged - reference| = {diff:.3g}"
    assert lru.evicted  # the churn sessions were evicted and restarted
    a_frames = sum(obs.shape[0] for _, obs in lru.order["A"].observations)
    assert a_frames >= 3 * cfg.window_frames
    print(f"cfg rollout: worst |paged - reference| = {worst:.3g} (tolerance {TOLERANCE})")


def test_prompt_change_equals_fresh_session_bitwise(pipeline_factory):
    engine = ARDiffusionEngine(pipeline_factory(), CONFIG)
    for r in range(3):
        engine.generate(_request(engine.runner.pipeline, "S", 1 if r == 0 else 4, seed=r, prompt="first")[0])
    changed = engine.generate(DiffusionRequest("x", prompt="second", extra_args={"session_id": "S"}, inputs={
        "observation": engine.runner.pipeline.schema.example(1, seed=7), "seed": 5}))
    fresh = engine.generate(DiffusionRequest("y", prompt="second", extra_args={"session_id": "F"}, inputs={
        "observation": engine.runner.pipeline.schema.example(1, seed=7), "seed": 5}))
    assert np.array_equal(np.asarray(changed["video"]), np.asarray(fresh["video"]))
    assert np.array_equal(np.asarray(changed["actions"]), np.asarray(fresh["actions"]))


def test_warmup_provider_schema_and_load():
    pipeline = CFGWorldActionPipeline("tiny")
    assert isinstance(pipeline, SupportsARDiffusionWarmup)
    cfg = pipeline.config
    requests = list(pipeline.ar_diffusion_warmup_requests("w"))
    assert len(requests) == 1 + math.ceil((cfg.window_frames - 1) / cfg.frames_per_block)
    for index, request in enumerate(requests):
        assert request.request_id == f"ardiffusion-warmup-{index}" and request.prompt == "warmup"
        assert dict(request.extra_args) == {"reset": index == 0, "session_id": "w"}
        view = request.inputs["observation"]["observation/wrist_image_left"]
        assert view.shape[0] == (1 if index == 0 else 4)
    engine = ARDiffusionEngine(pipeline, WARMUP)  # runs the warmup under the warmup session id
    assert engine.sessions == () and WARMUP_SESSION_ID not in pipeline.session_ids
    with count_compiles() as compiles:  # new sessions, LRU eviction (4 ids > capacity 3), the window filling and wrapping
        for r in range(8):
            for sid in ("a", "b", "c", "d")[: 2 + r % 3]:
                first = sid not in engine.sessions
                engine.generate(_request(pipeline, sid, 1 if first else 4, seed=r)[0])
    assert compiles == [], f"warmup did not cover the rollout's programs: {compiles}"


def test_interleaved_sessions_equal_each_alone_bitwise(pipeline_factory):
    def run(schedule):
        engine = ARDiffusionEngine(pipeline_factory(), CONFIG)
        outs, counts = {}, {}
        for sid in schedule:
            counts[sid] = counts.get(sid, 0) + 1
            request = DiffusionRequest(f"r-{sid}", prompt=f"task {sid}", extra_args={"session_id": sid}, inputs={
                "observation": engine.runner.pipeline.schema.example(1 if counts[sid] == 1 else 4,
                                                                     seed=10 * counts[sid] + ord(sid))})
            out = engine.generate(request)
            outs.setdefault(sid, []).append((np.asarray(out["video"]), np.asarray(out["actions"])))
        return outs

    alone = {**run(["X"] * 3), **run(["Y"] * 3)}
    together = run(["X", "Y", "Y", "X", "Y", "X"])
    for sid in ("X", "Y"):
        for block, (a, b) in enumerate(zip(alone[sid], together[sid], strict=True)):
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), f"{sid} block {block} differs"
    assert not np.array_equal(alone["X"][0][0], alone["Y"][0][0])


def test_cfg_parallel_layout_is_refused_on_one_worker(pipeline_factory):
    pipeline = pipeline_factory(CFGPipelineConfig(cfg_parallel_layout=True))
    spec = pipeline.ar_diffusion_kv_cache_spec()
    assert {b.name: b.local_index for b in spec.kv_branches} == {"positive": 0, "negative": 0}
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, warmup=False))
    with pytest.raises(RuntimeError, match="share local_index 0"):
        engine.generate(_request(pipeline, "s", 1, seed=0)[0])
    assert engine.sessions == () and pipeline.session_ids == ()  # failed closed


def test_bad_observation_fails_before_device_work(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    request, observation = _request(pipeline, "s", 1, seed=0)
    engine.generate(request)
    committed = engine.runner.session_table.get("s")._adapters["positive"].committed_frames
    broken = dict(observation)
    del broken["observation/joint_position"]
    with pytest.raises(ValueError, match="missing 'observation/joint_position'"):
        engine.generate(DiffusionRequest("r", prompt="p", extra_args={"session_id": "s"},
                                         inputs={"observation": broken}))
    broken = dict(pipeline.schema.example(3, seed=0))
    with pytest.raises(ValueError, match="1 or a multiple of 4"):
        engine.generate(DiffusionRequest("r", prompt="p", extra_args={"session_id": "s"},
                                         inputs={"observation": broken}))
    with pytest.raises(ValueError, match="inputs\\['observation'\\]"):
        engine.generate(DiffusionRequest("r", prompt="p", extra_args={"session_id": "s"}))
    # Rejected by the pipeline's validation hook before the runner touched the session.
    assert engine.sessions == ("s",)
    assert engine.runner.session_table.get("s")._adapters["positive"].committed_frames == committed


def test_specs_equal_the_shipped_geometries():
    def geometry(spec):
        fields = {name: getattr(spec, name) for name in (
            "num_layers", "num_kv_heads", "head_size", "tokens_per_frame", "frames_per_block", "window_frames",
            "sink_frames", "reset_at_boundary", "kv_branches", "cross_attention", "max_scratch_tokens_per_branch",
            "session_capacity")}
        return fields

    assert geometry(CFGWorldActionPipeline.kv_spec_for(dit_preset("tiny"))) == geometry(tiny_geometry())
    medium_spec = CFGWorldActionPipeline.kv_spec_for(dit_preset("medium"), CFGPipelineConfig(session_capacity=4))
    assert geometry(medium_spec) == geometry(medium_geometry())
    pipeline_spec = CFGWorldActionPipeline.kv_spec_for(dit_preset("tiny"))
    assert pipeline_spec.model_owned_state_bytes_per_session > 0


def test_model_owned_state_within_declared_bound(pipeline_factory):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    engine.generate(_request(pipeline, "m", 1, seed=0)[0])
    declared = pipeline.ar_diffusion_kv_cache_spec().model_owned_state_bytes_per_session
    assert 0 < pipeline.model_owned_bytes("m") <= declared
    engine.close_session("m")
    assert pipeline.model_owned_bytes("m") == 0


#: What ``json.loads`` makes of a client's ``"\ud800"``: a ``str`` no UTF-8 encoder accepts.
LONE_SURROGATE = json.loads('"pick up the \\ud800"')


@pytest.mark.parametrize("prompt, observation_prompt, seed, message", [
    (LONE_SURROGATE, None, None, "lone surrogate"),
    (None, LONE_SURROGATE, None, "lone surrogate"),  # the prompt may ride in the observation
    ("pick up the cup", None, -1, r"inputs\['seed'\]"),
    ("pick up the cup", None, 2**31, r"inputs\['seed'\]"),
    ("pick up the cup", None, 1.0, r"inputs\['seed'\]"),
])
def test_bad_request_for_a_new_session_evicts_nobody(pipeline_factory, prompt, observation_prompt, seed, message):
    pipeline = pipeline_factory()
    engine = ARDiffusionEngine(pipeline, CONFIG)
    for sid in ("a", "b", "c"):
        engine.generate(_request(pipeline, sid, 1, seed=0)[0])
    resident, owned = engine.sessions, pipeline.session_ids
    assert len(resident) == engine.session_capacity  # a newcomer would evict "a"
    calls: list = []
    engine.runner.add_session_listener(calls.append)
    close = pipeline.close_ar_diffusion_session
    pipeline.close_ar_diffusion_session = lambda sid: (calls.append(("close", sid)), close(sid))
    observation = dict(pipeline.schema.example(1, seed=1))
    if observation_prompt is not None:
        observation["prompt"] = observation_prompt
    inputs = {"observation": observation} if seed is None else {"observation": observation, "seed": seed}
    with pytest.raises(ValueError, match=message):
        engine.generate(DiffusionRequest("bad", prompt=prompt, extra_args={"session_id": "new"}, inputs=inputs))
    assert engine.sessions == resident and pipeline.session_ids == owned
    assert calls == []  # no eviction, no close hook, no session created


def test_unencodable_negative_prompt_is_refused_by_the_config():
    with pytest.raises(ValueError, match="negative_prompt .* lone surrogate"):
        CFGPipelineConfig(negative_prompt=LONE_SURROGATE)
