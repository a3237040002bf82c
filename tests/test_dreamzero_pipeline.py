"""DreamZero's episode loop on the engine (``DreamZeroPipeline``) against the release's own free-running episode.

The fixtures (``tests/fixtures/dreamzero*``, made by the release's code; their ``README.md`` documents every
array) hold a 4-call closed-loop episode from stored noise and encoder outputs: every sample of both UniPC
solvers per step (``xt_video``, ``xt_action``), the returned chunks, and three loop variants. Here the same
episode runs through ``ARDiffusionEngine`` with the pipeline on the paged runtime and is compared at float32,
atol 1e-4, per step: errors may compound here (this is the free run), and still stay at about 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models.dreamzero import DreamZeroPipeline, DreamZeroPipelineConfig, unipc_schedule
from ardiff_jax.models.dreamzero import _pipeline as dz_pipeline

FIXTURES = Path(__file__).parent / "fixtures"
ATOL = 1e-4
ENGINE = EngineConfig(dtype="float32", available_memory_bytes=10**10, gpu_memory_fraction=1.0, warmup=False)


def _fixture(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / name / "reference_rollout.npz"))


def episode_inputs(ref: dict[str, np.ndarray], chunk: int) -> dict:
    """The release's call ``chunk`` as a request: the stored encoder outputs, state and noise."""
    inputs = {"state": ref["state"][chunk][:8], "noise": (ref["noise_video"], ref["noise_action"])}
    if chunk == 0:
        ys = ref["ys"]
        inputs.update(latents=ys[0:1, 4:], condition=ys, clip=ref["clip"],
                      prompt_embeds=ref["context_pos"][: int(ref["prompt_len"][0])],
                      negative_prompt_embeds=ref["context_neg"][: int(ref["prompt_len"][1])])
    else:
        inputs.update(latents=ref["obs_latents"][chunk - 1])
    return inputs


def request(session: str, chunk: int, inputs: dict) -> DiffusionRequest:
    return DiffusionRequest(f"{session}-{chunk}", extra_args={"session_id": session}, inputs=inputs)


class Episode:
    """A fixture's checkpoint in a pipeline and engine (one per pipeline config)."""

    def __init__(self, name: str, pipeline_config: DreamZeroPipelineConfig | None = None, dtype: str = "float32"):
        self.ref = _fixture(name)
        self.pipeline = DreamZeroPipeline.from_checkpoint(FIXTURES / name / "DreamZero-DROID-tiny",
                                                          pipeline_config=pipeline_config, dtype=dtype)
        config = ENGINE if dtype == "float32" else EngineConfig(dtype=dtype, available_memory_bytes=10**10,
                                                                gpu_memory_fraction=1.0, warmup=False)
        self.engine = ARDiffusionEngine(self.pipeline, config)

    def call(self, session: str, chunk: int, **extra):
        return self.engine.generate(request(session, chunk, {**episode_inputs(self.ref, chunk), **extra}))


@pytest.fixture(scope="module", params=["dreamzero", "dreamzero_seed11"])
def episode(request) -> Episode:
    return Episode(request.param)


def test_the_schedules_are_the_releases() -> None:
    ref = _fixture("dreamzero")
    schedule = unipc_schedule()
    np.testing.assert_array_equal(schedule.sigmas, ref["sigmas"])
    np.testing.assert_array_equal(schedule.timesteps, ref["timesteps"])
    decoupled = unipc_schedule(final_sigma=0.8)
    np.testing.assert_array_equal(decoupled.sigmas, ref["decoupled_sigmas_video"])
    np.testing.assert_array_equal(decoupled.timesteps, ref["decoupled_timesteps_video"])
    np.testing.assert_array_equal(np.flatnonzero(DreamZeroPipelineConfig().dit_step_mask), ref["eval_step"])


def test_the_free_running_episode_equals_the_release_step_by_step(episode: Episode) -> None:
    """4 calls through the engine: every solver sample of every step, the action chunk and the video per call."""
    ref, pipeline = episode.ref, episode.pipeline
    pipeline.record_steps = True
    worst = {"xt_video": 0.0, "xt_action": 0.0, "action_pred": 0.0, "video_out": 0.0}
    try:
        for chunk in range(4):
            out = episode.call("robot", chunk)
            for step, (x, a) in enumerate(pipeline.last_steps):
                worst["xt_video"] = max(worst["xt_video"], float(np.abs(np.asarray(x) - ref["xt_video"][chunk, step]).max()))
                worst["xt_action"] = max(worst["xt_action"],
                                         float(np.abs(np.asarray(a) - ref["xt_action"][chunk, step]).max()))
            assert len(pipeline.last_steps) == 17
            assert [i for i, ran in enumerate(pipeline.last_ran) if ran] == list(ref["eval_step"])
            video = np.asarray(out["video"])
            if chunk == 0:  # the conditioning frame first, as the release returns its first chunk
                np.testing.assert_array_equal(video[0], ref["ys"][0, 4:])
                video = video[1:]
            worst["video_out"] = max(worst["video_out"], float(np.abs(video - ref["video_out"][chunk]).max()))
            worst["action_pred"] = max(worst["action_pred"],
                                       float(np.abs(np.asarray(out["actions"]) - ref["action_pred"][chunk]).max()))
        assert pipeline._sessions["robot"].frames == 7  # 1 + 3 x 2 observed frames in the caches
    finally:
        pipeline.record_steps = False
        episode.engine.close_session("robot")
    print(f"free run worst |diff|: {worst}")
    assert all(value < ATOL for value in worst.values()), worst


@pytest.mark.parametrize("variant", ["allsteps", "decoupled", "dynamic"])
def test_the_release_loop_variants(variant: str) -> None:
    """All 16 DiT steps, the decoupled video schedule, the similarity-driven schedule (its skip decisions too)."""
    config = {"allsteps": DreamZeroPipelineConfig(dit_steps=16),
              "decoupled": DreamZeroPipelineConfig(video_final_noise=0.8),
              "dynamic": DreamZeroPipelineConfig(dynamic_schedule=True)}[variant]
    episode = Episode("dreamzero", config)
    ref = episode.ref
    episode.pipeline.record_steps = True
    for chunk in range(4):
        out = episode.call("robot", chunk)
        video = np.asarray(out["video"])[1 if chunk == 0 else 0:]
        np.testing.assert_allclose(np.asarray(out["actions"]), ref[f"{variant}_action_pred"][chunk], atol=ATOL, rtol=0)
        np.testing.assert_allclose(video, ref[f"{variant}_video_out"][chunk], atol=ATOL, rtol=0)
        if variant == "dynamic":
            assert episode.pipeline.last_ran == list(ref["dynamic_ran"][chunk])


def test_a_wrong_loop_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """CFG applied to the actions too (a typical porting mistake) moves the action chunk far past the tolerance,
    so the comparison above can fail."""
    original = dz_pipeline._evaluate

    def guided_actions(*args):
        guided, pos_action, pos_video, neg_video, neg_action = original(*args)
        scale = args[-1]
        return guided, neg_action + scale * (pos_action - neg_action), pos_video, neg_video, neg_action

    monkeypatch.setattr(dz_pipeline, "dreamzero_evaluate", jax.jit(guided_actions, static_argnums=0))
    episode = Episode("dreamzero")
    worst = 0.0
    for chunk in range(2):
        out = episode.call("robot", chunk)
        worst = max(worst, float(np.abs(np.asarray(out["actions"]) - episode.ref["action_pred"][chunk]).max()))
    assert worst > 0.1, worst


def test_a_full_episode_restarts_from_the_last_frame_as_the_release_does() -> None:
    """The fifth call finds the window full (start frame 9): without restart inputs it is refused and nothing
    changes; with them it starts a new episode from that frame, keeping the instruction, and equals a fresh
    session's first call with the same inputs exactly."""
    episode = Episode("dreamzero")
    ref = episode.ref
    for chunk in range(4):
        episode.call("robot", chunk)
    engine, pipeline = episode.engine, episode.pipeline
    before = pipeline._sessions["robot"]
    assert before.frames == 7
    fifth = {"state": ref["state"][3][:8], "noise": (ref["noise_video"], ref["noise_action"]),
             "latents": ref["obs_latents"][2]}
    with pytest.raises(ValueError, match="filled its attention window"):
        engine.generate(request("robot", 4, fifth))
    assert pipeline._sessions["robot"] is before
    rng = np.random.default_rng(5)
    last_frame = rng.standard_normal(ref["ys"][0:1, 4:].shape).astype(np.float32)
    condition = rng.standard_normal(ref["ys"].shape).astype(np.float32)
    clip = rng.standard_normal(ref["clip"].shape).astype(np.float32)
    restarted = engine.generate(request("robot", 4, {**fifth, "restart": {"latents": last_frame,
                                                                          "condition": condition, "clip": clip}}))
    assert pipeline._sessions["robot"].frames == 1 and pipeline._sessions["robot"].prompt == before.prompt
    fresh = engine.generate(request("fresh", 0, {**episode_inputs(ref, 0), "latents": last_frame,
                                                 "condition": condition, "clip": clip, "state": ref["state"][3][:8]}))
    np.testing.assert_array_equal(np.asarray(restarted["actions"]), np.asarray(fresh["actions"]))
    np.testing.assert_array_equal(np.asarray(restarted["video"]), np.asarray(fresh["video"]))
    assert np.asarray(restarted["video"]).shape[0] == 3


def test_bf16_stays_within_the_releases_own_bf16_error() -> None:
    """bf16 weights, activations and pools over the free-running episode: within 0.3 of the float32 release
    (the release itself in bf16 is 0.10-0.17 (video) and 0.06-0.08 (actions) away at the end)."""
    episode = Episode("dreamzero", dtype="bfloat16")
    ref = episode.ref
    video_err = action_err = 0.0
    for chunk in range(4):
        out = episode.call("robot", chunk)
        video = np.asarray(out["video"], np.float32)[1 if chunk == 0 else 0:]
        video_err = max(video_err, float(np.abs(video - ref["video_out"][chunk]).max()))
        action_err = max(action_err, float(np.abs(np.asarray(out["actions"], np.float32) - ref["action_pred"][chunk]).max()))
    print(f"bf16 free run: video {video_err:.3f}, actions {action_err:.3f}")
    assert video_err < 0.3 and action_err < 0.3, (video_err, action_err)
    assert video_err > 1e-3  # bf16 really ran


def test_bad_requests_are_refused_and_change_nothing(episode: Episode) -> None:
    ref = episode.ref
    engine, pipeline = episode.engine, episode.pipeline
    episode.call("probe", 0)
    before = pipeline._sessions["probe"]
    good = episode_inputs(ref, 1)
    cases = [({**good, "latents": good["latents"][:, :3]}, "latents"),
             ({**good, "state": np.full((8,), np.nan, np.float32)}, "state"),
             ({**good, "state": np.zeros((65,), np.float32)}, "state"),
             ({**good, "noise": (ref["noise_video"], ref["noise_action"][:3])}, "noise"),
             ({**good, "unknown": 1}, "does not take"),
             ({**good, "latents": good["latents"][:1]}, "condition")]
    for inputs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.generate(request("probe", 1, inputs))
        assert pipeline._sessions["probe"] is before
    with pytest.raises(ValueError, match="no episode yet"):
        engine.generate(request("nobody", 1, good))
    engine.close_session("probe")


def _robot_inputs(ref: dict[str, np.ndarray], robot: int, chunk: int) -> dict:
    """Robot ``robot``'s call ``chunk``: the fixture's episode with its own state (and, for robot 2, its own
    observations), so the rows of a batch differ."""
    inputs = episode_inputs(ref, chunk)
    inputs["state"] = ref["state"][chunk][:8] + 0.1 * robot
    if robot == 2 and chunk:
        inputs["latents"] = inputs["latents"][::-1].copy()
    return inputs


@pytest.mark.parametrize("dynamic", [False, True])
def test_many_robots_in_one_forward_equal_one_by_one(dynamic: bool) -> None:
    """``generate_batch`` over robots at different points of their episodes (one starting, two continuing)
    runs as one batched forward and equals each robot run alone, the per-row dynamic schedule included (to
    float32 rounding: the batched program is another compiled program; measured 7e-7)."""
    # The default capacity (3) holds the three robots, and its pools are the other tests' here: the single-session
    # programs are theirs, and bucket 3's batched ones are what the warmup test builds.
    config = DreamZeroPipelineConfig(dynamic_schedule=dynamic)
    alone = Episode("dreamzero", config)
    together = Episode("dreamzero", config)
    ref = alone.ref
    plan = {0: [0, 1, 2], 1: [0, 1], 2: [0]}  # robot -> its calls; the batch then runs each robot's next call
    expected = {}
    for robot, calls in plan.items():
        for chunk in calls:
            out = alone.engine.generate(request(f"r{robot}", chunk, _robot_inputs(ref, robot, chunk)))
        expected[robot] = out
    for robot, calls in plan.items():
        for chunk in calls[:-1]:
            together.engine.generate(request(f"r{robot}", chunk, _robot_inputs(ref, robot, chunk)))
    batched_calls = []
    original = dz_pipeline.DreamZeroPipeline.forward_batch

    def counted(self, requests):
        batched_calls.append(len(requests))
        return original(self, requests)

    dz_pipeline.DreamZeroPipeline.forward_batch = counted
    try:
        outs = together.engine.generate_batch([request(f"r{robot}", calls[-1], _robot_inputs(ref, robot, calls[-1]))
                                               for robot, calls in plan.items()])
    finally:
        dz_pipeline.DreamZeroPipeline.forward_batch = original
    assert batched_calls == [3]
    for robot, out in zip(plan, outs):
        np.testing.assert_allclose(np.asarray(out["actions"]), np.asarray(expected[robot]["actions"]), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(out["video"]), np.asarray(expected[robot]["video"]), atol=1e-5, rtol=0)


def _offload_engine(name: str = "dreamzero") -> Episode:
    episode = Episode.__new__(Episode)
    episode.ref = _fixture(name)
    episode.pipeline = DreamZeroPipeline.from_checkpoint(FIXTURES / name / "DreamZero-DROID-tiny", dtype="float32",
                                                         pipeline_config=DreamZeroPipelineConfig(session_capacity=1))
    episode.engine = ARDiffusionEngine(episode.pipeline, EngineConfig(
        dtype="float32", available_memory_bytes=10**10, gpu_memory_fraction=1.0, warmup=False,
        host_offload_bytes=1 << 28))
    return episode


def test_a_forked_robot_and_its_source_both_continue_the_release_episode() -> None:
    """A fork of a robot session mid-episode (KV pages shared, model state copied) and its source each continue
    exactly as the release's episode does; neither sees the other's later frames."""
    episode = Episode("dreamzero")
    ref = episode.ref
    episode.call("robot", 0)
    episode.call("robot", 1)
    episode.engine.fork_session("robot", "twin")
    for chunk in (2, 3):
        for session in ("robot", "twin"):
            out = episode.call(session, chunk)
            np.testing.assert_allclose(np.asarray(out["actions"]), ref["action_pred"][chunk], atol=ATOL, rtol=0)
            np.testing.assert_allclose(np.asarray(out["video"]), ref["video_out"][chunk], atol=ATOL, rtol=0)
    # The twin diverges on its own observation; the source is unaffected.
    other = {**episode_inputs(ref, 3), "latents": ref["obs_latents"][0]}
    episode.engine.close_session("robot")
    episode.engine.close_session("twin")
    episode.call("robot", 0)
    episode.call("robot", 1)
    episode.engine.fork_session("robot", "twin")
    episode.engine.generate(request("twin", 2, other))
    out = episode.call("robot", 2)
    np.testing.assert_allclose(np.asarray(out["actions"]), ref["action_pred"][2], atol=ATOL, rtol=0)


def test_an_offloaded_robot_session_continues_its_episode() -> None:
    """With one device slot and host offload, a second robot pushes the first to the host; the first comes back
    (KV, cross caches, condition, frame count) and continues the release's episode."""
    episode = _offload_engine()
    ref = episode.ref
    episode.call("robot", 0)
    episode.call("robot", 1)
    episode.call("other", 0)  # the only slot: "robot" goes to the host tier
    assert "robot" in episode.engine.offloaded_sessions
    out = episode.call("robot", 2)
    np.testing.assert_allclose(np.asarray(out["actions"]), ref["action_pred"][2], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out["video"]), ref["video_out"][2], atol=ATOL, rtol=0)
    out = episode.call("robot", 3)
    np.testing.assert_allclose(np.asarray(out["actions"]), ref["action_pred"][3], atol=ATOL, rtol=0)


def test_after_warmup_an_episode_and_its_restart_compile_nothing() -> None:
    """The warmup provider (one episode start, then continuing calls until the window is full, as the release
    warms up: one frame first, then full observations) compiles every program a robot's episode uses."""
    from helpers import count_compiles

    name = "dreamzero"
    # One robot slot: the warmup then compiles the one-robot programs only (no batch buckets, whose warmup would run
    # two sessions' episodes per bucket), and those are the offloaded-robot test's (the same one-slot pools).
    pipeline = DreamZeroPipeline.from_checkpoint(FIXTURES / name / "DreamZero-DROID-tiny", dtype="float32",
                                                 pipeline_config=DreamZeroPipelineConfig(session_capacity=1))
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**10,
                                                      gpu_memory_fraction=1.0))
    ref = _fixture(name)
    requests = list(pipeline.ar_diffusion_warmup_requests("w"))
    assert [r.inputs["latents"].shape[0] for r in requests] == [1, 2, 2, 2]
    with count_compiles() as compiled:
        for chunk in range(4):
            engine.generate(request("robot", chunk, episode_inputs(ref, chunk)))
        restart = {"latents": ref["ys"][0:1, 4:], "condition": ref["ys"], "clip": ref["clip"]}
        engine.generate(request("robot", 4, {**episode_inputs(ref, 1), "restart": restart}))
    assert compiled == [], compiled


def test_robots_in_one_forward_compile_their_solver_step_once() -> None:
    """Without warmup, the batched solver step of two robots is one compiled program from their first batch on.

    The fresh solver states of a call are committed to the device like every later step's: left uncommitted
    (vmapped zeros), jit compiled the step a second time at each batched call's first step."""
    from helpers import count_compiles

    episode = Episode("dreamzero")  # the default capacity (3): two robots run bucket 2, as the warmup test builds it
    for robot in (0, 1):
        episode.engine.generate(request(f"r{robot}", 0, _robot_inputs(episode.ref, robot, 0)))
    dz_pipeline._solver_step_batch.clear_cache()  # this test's compiles happen here, whatever ran before
    with count_compiles() as compiled:
        for chunk in (1, 2):
            episode.engine.generate_batch([request(f"r{robot}", chunk, _robot_inputs(episode.ref, robot, chunk))
                                           for robot in (0, 1)])
    assert [name for name in compiled if "_solver_step" in name] == ["jit(_solver_step)"], compiled


def test_the_documented_droid_memory_figures_are_the_memory_plans() -> None:
    """docs/models.md and benchmarks/README.md quote these (KV per robot and robots per device, bf16)."""
    from benchmarks.bench_dreamzero import memory_plan

    plan = memory_plan(dtype="bfloat16")
    assert plan["parameters"] == 16_484_292_448
    assert round(plan["session_bytes"] / 1e9, 2) == 14.24
    assert round(plan["scratch_bytes_per_device"] / 1e9, 2) == 4.33
    assert plan["robots_per_device"] == {"80 GB (H100)": 2, "141 GB (H200)": 6}
