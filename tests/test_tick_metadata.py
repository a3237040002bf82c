"""The reference pipelines report a typed tick's chunk metadata, and only for typed ticks.

The realtime control plane commits a chunk only when the pipeline's output reports exactly
``ARDiffusionChunkMetadata.from_tick(tick)``; a request without a tick returns what it
always did.
"""

from __future__ import annotations

import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig, StepSchedulerOutput
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import (
    CFGWorldActionPipeline,
    DiTModules,
    SpriteWorldPipeline,
    WorldPipeline,
    dit_preset,
)
from ardiff_jax.types import ARDiffusionChunkMetadata, ARDiffusionTickRequest

#: No warmup: these tests check the metadata blocks carry, one request at a time; warmup would compile the
#: batch buckets of three pipelines that no test runs (each program used compiles on first use).
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)


def _tick(session: str, chunk: int, events=()) -> ARDiffusionTickRequest:
    return ARDiffusionTickRequest(session, f"{session}-chunk-{chunk}", chunk, tuple(events))


@pytest.fixture(scope="module")
def world_engine():
    return ARDiffusionEngine(WorldPipeline("tiny"), CONFIG)


def test_world_blocks_carry_the_ticks_metadata(world_engine):
    for chunk, events in enumerate([(1, 2), (), (5,)]):
        tick = _tick("w", chunk, events)
        out = world_engine.generate(DiffusionRequest(tick.request_id, prompt="a red car" if chunk == 0 else None,
                                                     extra_args=tick.to_extra_args()))
        assert out.ar_diffusion == ARDiffusionChunkMetadata.from_tick(tick)
        assert out.first_frame == 2 * chunk
    plain = world_engine.generate(DiffusionRequest("plain", prompt="a boat", extra_args={"session_id": "p"}))
    assert plain.ar_diffusion is None


def test_a_tick_and_a_plain_request_generate_the_same_block():
    ticked = ARDiffusionEngine(WorldPipeline("tiny"), CONFIG)
    plain = ARDiffusionEngine(WorldPipeline("tiny", modules=ticked.runner.pipeline.modules), CONFIG)
    for chunk in range(2):
        tick = _tick("s", chunk)
        a = ticked.generate(DiffusionRequest(tick.request_id, prompt="p", extra_args=tick.to_extra_args()))
        b = plain.generate(DiffusionRequest(f"r{chunk}", prompt="p", extra_args={"session_id": "s"}))
        assert np.array_equal(np.asarray(a.latents), np.asarray(b.latents))


def test_stepwise_emitted_blocks_carry_the_metadata():
    pipeline = WorldPipeline("tiny")
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, step_execution=True, warmup=False))
    tick = _tick("stream", 0, (3,))
    request = DiffusionRequest("stream", prompt="a street", extra_args=tick.to_extra_args(), inputs={"num_blocks": 1})
    result = None
    for _ in range(pipeline.schedule.num_steps):
        result = engine.step(StepSchedulerOutput(scheduled=(request,)))
    assert result is not None and result.output is not None
    assert result.output.ar_diffusion == ARDiffusionChunkMetadata.from_tick(tick)


def test_cfg_outputs_carry_the_metadata_under_its_key():
    pipeline = CFGWorldActionPipeline("tiny")
    engine = ARDiffusionEngine(pipeline, CONFIG)
    tick = _tick("robot", 0, (7,))
    out = engine.generate(DiffusionRequest(tick.request_id, prompt="pick up the cup", extra_args=tick.to_extra_args(),
                                           inputs={"observation": pipeline.schema.example(1)}))
    assert out["ar_diffusion"] == ARDiffusionChunkMetadata.from_tick(tick)
    plain = engine.generate(DiffusionRequest("x", prompt="pick", extra_args={"session_id": "q"},
                                             inputs={"observation": pipeline.schema.example(1)}))
    assert "ar_diffusion" not in plain


def test_sprite_blocks_carry_the_metadata():
    pipeline = SpriteWorldPipeline("sprite_world", modules=DiTModules.create(dit_preset("sprite_world"), 1))
    engine = ARDiffusionEngine(pipeline, CONFIG)
    tick = _tick("player", 0, (1,))
    out = engine.generate(DiffusionRequest(tick.request_id, extra_args=tick.to_extra_args(),
                                           inputs={"observation": SpriteWorld(0).reset(), "actions": [3]}))
    assert out.ar_diffusion == ARDiffusionChunkMetadata.from_tick(tick)
    assert out.frames.shape == (1, 32, 32, 3)
