"""Pipeline sessions are frozen values: every ``PipelineSession`` subclass of the shipped models (and the nested
dataclasses they hold) refuses field assignment, and a fork shares its source's value except for the fields a
program donates, of which it gets its own device copy (issue 48 section 4)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import jax
import numpy as np
import pytest

import ardiff_jax.models
from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import SpriteWorldPipeline, dit_preset
from ardiff_jax.models._common import PipelineSession
from ardiff_jax.models.matrix_game import MatrixGamePipeline
from ardiff_jax.models.wan import WanVAEConfig, random_vae


def _session_types() -> list[type]:
    """Every PipelineSession subclass defined in ardiff_jax.models (all its modules imported first)."""
    for module in pkgutil.walk_packages(ardiff_jax.models.__path__, "ardiff_jax.models."):
        importlib.import_module(module.name)
    found, todo = [], [PipelineSession]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("ardiff_jax.models"):
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_pipeline_session_type_is_frozen():
    types = _session_types()
    names = {cls.__name__ for cls in types}
    assert {"PipelineSession", "_WorldSession", "_WanSession", "_MatrixGameSession", "_CFGSession",
            "_DreamZeroSession"} <= names, names
    key = jax.random.key(0, impl="rbg")
    for cls in types:
        session = cls(key=key, prompt="p")
        for field in dataclasses.fields(cls):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(session, field.name, getattr(session, field.name))
        for nested in cls.nested_fields.values():  # e.g. the world session's in-flight block
            assert nested.__dataclass_params__.frozen, nested
        assert dataclasses.replace(session, block_index=3).block_index == 3 and session.block_index == 0


def _engine(pipeline):
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                    gpu_memory_fraction=1.0, warmup=False))


def _copied_fields(pipeline, source: str, fork: str) -> set[str]:
    """The fields whose device arrays the fork does not share with the source (compared buffer by buffer)."""
    a, b = pipeline._sessions[source], pipeline._sessions[fork]
    copied = set()
    for field in dataclasses.fields(a):
        left = [x for x in jax.tree.leaves(getattr(a, field.name)) if isinstance(x, jax.Array)]
        right = [x for x in jax.tree.leaves(getattr(b, field.name)) if isinstance(x, jax.Array)]
        assert len(left) == len(right), field.name
        if any(x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer() for x, y in zip(left, right, strict=True)):
            copied.add(field.name)
    return copied


def test_a_world_fork_shares_the_source_value_and_a_new_seed_replaces_only_the_key():
    pipeline = SpriteWorldPipeline("sprite_world")
    engine = _engine(pipeline)
    observation = SpriteWorld(0, size=pipeline.frame_size).reset()
    actions = np.zeros(pipeline.config.frames_per_block, np.int64)
    engine.generate(DiffusionRequest("r", inputs={"observation": observation, "actions": actions},
                                     extra_args={"session_id": "S"}))
    engine.fork_session("S", "F")
    assert pipeline._sessions["F"] is pipeline._sessions["S"]  # nothing donated: the value itself is shared
    engine.fork_session("S", "G", noise_seed=5)
    assert _copied_fields(pipeline, "S", "G") == {"key"}
    source = engine.generate(DiffusionRequest("r", inputs={"actions": actions}, extra_args={"session_id": "S"}))
    fork = engine.generate(DiffusionRequest("r", inputs={"actions": actions}, extra_args={"session_id": "F"}))
    np.testing.assert_array_equal(source.frames, fork.frames)
    assert pipeline._sessions["F"] is not pipeline._sessions["S"] and pipeline._sessions["S"].block_index == 2


def test_a_matrix_game_fork_copies_only_its_donated_caches():
    """The decode and encode steps donate the VAE caches and the ring commit the action ring: the fork copies those
    three and shares every other field, and after the source's next block (which donates its own caches) the fork
    generates that same block (the exact continuation over several blocks:
    ``test_matrix_game_pipeline.py::test_a_fork_continues_exactly_with_its_decoder_and_action_caches``)."""
    config = dit_preset("matrix-game-tiny", dtype="float32", param_dtype="float32")
    vae = random_vae(WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.1, -0.2, 0.0, 0.3),
                                       latents_std=(1.5, 0.5, 1.0, 2.0)), 3)
    pipeline = MatrixGamePipeline(config, vae=vae)
    engine = _engine(pipeline)
    action, rng = config.action, np.random.default_rng(0)

    def rows(count):
        return {"keyboard": np.eye(action.keyboard_dim, dtype=np.float32)[rng.integers(0, action.keyboard_dim, count)],
                "mouse": (0.1 * rng.standard_normal((count, action.mouse_dim))).astype(np.float32)}

    first = {"image": rng.integers(0, 256, (config.latent_height * 8, config.latent_width * 8, 3), dtype=np.uint8),
             "image_embeds": rng.standard_normal((config.text_len, config.text_dim)).astype(np.float32),
             **rows(action.num_rows(config.frames_per_block))}
    engine.generate(DiffusionRequest("r", inputs=first, extra_args={"session_id": "S"}))
    engine.fork_session("S", "F")
    donated = set(type(pipeline._sessions["S"]).donated_fields)
    assert donated == {"vae_cache", "encode_cache", "action_cache"}
    assert _copied_fields(pipeline, "S", "F") == donated
    later = rows(action.frames_per_latent * config.frames_per_block)
    source = engine.generate(DiffusionRequest("r", inputs=later, extra_args={"session_id": "S"}))
    fork = engine.generate(DiffusionRequest("r", inputs=later, extra_args={"session_id": "F"}))
    np.testing.assert_array_equal(np.asarray(source.latents), np.asarray(fork.latents))
    np.testing.assert_array_equal(np.asarray(source.video), np.asarray(fork.video))
