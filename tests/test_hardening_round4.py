"""Hardening, round four (issue 43): refused forks leave no model state behind (item 6)."""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, SpriteWorldPipelineConfig, dit_preset

CONFIG = dict(dtype="float32", available_memory_bytes=1 << 30, gpu_memory_fraction=1.0, warmup=False)
OBSERVATION = SpriteWorld(seed=3).reset()


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules, capacity=3) -> ARDiffusionEngine:
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity),
                                   modules=modules)
    return ARDiffusionEngine(pipeline, EngineConfig(**CONFIG))


def _request(sid: str, action: int, first: bool = False) -> DiffusionRequest:
    inputs = {"actions": np.array([action])}
    if first:
        inputs["observation"], inputs["seed"] = OBSERVATION, 7
    return DiffusionRequest(f"{sid}-{action}", extra_args={"session_id": sid}, inputs=inputs)


@pytest.mark.parametrize("seed", [2**64, 2**31, np.uint64(2**63)])
def test_a_fork_seed_out_of_the_request_seed_range_is_refused_and_changes_nothing(modules, seed):
    with _engine(modules) as engine:
        engine.generate(_request("a", 1, first=True))
        pipeline = engine.runner.pipeline
        with pytest.raises(ValueError, match=r"noise_seed must be an integer in \[0, 2\*\*31\)"):
            engine.fork_session("a", "b", noise_seed=seed)
        assert engine.runner.sessions == ("a",) and "b" not in pipeline._sessions
        engine.fork_session("a", "b", noise_seed=2**31 - 1)  # the id is free; the largest request seed forks
        assert sorted(engine.runner.sessions) == ["a", "b"]


def test_a_pipeline_fork_hook_refusing_a_seed_after_its_import_leaves_no_state(modules):
    """The pipeline alone (the runner's check bypassed): its own bound, checked before it imports."""
    with _engine(modules) as engine:
        engine.generate(_request("a", 1, first=True))
        pipeline = engine.runner.pipeline
        with pytest.raises(ValueError, match="noise_seed"):
            pipeline.fork_ar_diffusion_session("a", "b", noise_seed=2**64)
        assert "b" not in pipeline._sessions


def test_the_runner_undoes_the_pipelines_import_when_the_fork_hook_fails_after_it(modules, monkeypatch):
    """A hook that imports the fork's state and then fails: the runner closes new_id in the pipeline,
    so the id forks again and a new session under it starts fresh, not from the source's state."""
    with _engine(modules) as engine:
        engine.generate(_request("a", 1, first=True))
        pipeline = engine.runner.pipeline
        original = SpriteWorldPipeline.fork_ar_diffusion_session

        def fails_after_import(self, source_id, new_id, **kwargs):
            original(self, source_id, new_id, **kwargs)
            raise OverflowError("the hook failed after importing")

        monkeypatch.setattr(SpriteWorldPipeline, "fork_ar_diffusion_session", fails_after_import)
        with pytest.raises(OverflowError):
            engine.fork_session("a", "b")
        assert engine.runner.sessions == ("a",)
        assert "b" not in pipeline._sessions  # the import is undone
        fresh = np.asarray(engine.generate(_request("b", 2, first=True)).latents)  # starts fresh, not from "a"
        expected = np.asarray(engine.generate(_request("c", 2, first=True)).latents)
        np.testing.assert_array_equal(fresh, expected)
        engine.close_session("b")
        monkeypatch.setattr(SpriteWorldPipeline, "fork_ar_diffusion_session", original)
        engine.fork_session("a", "b")  # not refused as "already holds model state"
        assert sorted(engine.runner.sessions) == ["a", "b", "c"]


def test_a_fork_hook_failing_after_the_pages_are_shared_gives_back_its_slot_and_pages(modules, monkeypatch):
    """The fork's KV is made (pages shared, counted) before the pipeline's hook runs; when the hook fails
    the slot and the page references go back, and the source continues exactly as if no fork was tried."""
    with _engine(modules) as engine, _engine(modules) as untouched:
        for target in (engine, untouched):
            target.generate(_request("a", 1, first=True))
            target.generate(_request("a", 2))
        cache = engine.runner.kv_cache
        before = (cache.pages_in_use, cache.num_free_slots)

        def fails(self, source_id, new_id, **kwargs):
            raise OverflowError("the hook failed")

        monkeypatch.setattr(SpriteWorldPipeline, "fork_ar_diffusion_session", fails)
        with pytest.raises(OverflowError):
            engine.fork_session("a", "b")
        assert (cache.pages_in_use, cache.num_free_slots) == before
        assert engine.runner.sessions == ("a",)
        for action in (3, 4):  # the source writes the pages the fork shared: no copy-on-write is owed any more
            np.testing.assert_array_equal(np.asarray(engine.generate(_request("a", action)).latents),
                                          np.asarray(untouched.generate(_request("a", action)).latents))
        assert cache.pages_in_use == untouched.runner.kv_cache.pages_in_use  # written in place, as if never shared
