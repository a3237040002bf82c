"""SpriteWorldPipeline: request schema, observation prefill, decoded frames, stepwise = tick, weight files."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig, StepSchedulerOutput
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models._pretrained import _digest
from ardiff_jax.models import (
    PRETRAINED_MODELS,
    DiTModules,
    SpriteBlock,
    SpriteWorldPipeline,
    SpriteWorldPipelineConfig,
    dit_preset,
    frames_to_latents,
    latents_to_frames,
    load_weights,
    pretrained,
    pretrained_metadata,
    save_weights,
)

#: No warmup unless a test asks for it (test_warmup_runs_a_real_observation): it would compile the batch
#: bucket no test here runs and replay its warmup in every engine; each program used compiles on first use.
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=2**28, gpu_memory_fraction=1.0, warmup=False)


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules, **engine_fields):
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=2), modules=modules)
    config = CONFIG if not engine_fields else EngineConfig(**{**CONFIG.__dict__, **engine_fields})
    return pipeline, ARDiffusionEngine(pipeline, config)


def _request(sid, actions, **inputs):
    return DiffusionRequest(f"{sid}-r", extra_args={"session_id": sid}, inputs={"actions": actions, **inputs})


def test_observation_then_actions_give_decoded_frames(modules):
    pipeline, engine = _engine(modules)
    world = SpriteWorld(4)
    out = engine.generate(_request("p", [4], observation=world.reset()))
    assert isinstance(out, SpriteBlock)
    assert out.frames.dtype == np.uint8 and out.frames.shape == (1, 32, 32, 3)
    assert out.first_frame == 1 and out.block_index == 0
    # The block is committed and returned as the decoded frame (quantised latents).
    np.testing.assert_allclose(np.asarray(out.latents), frames_to_latents(out.frames), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(latents_to_frames(np.asarray(out.latents)), out.frames)
    out = engine.generate(_request("p", np.array([2])))  # observation + block 0 committed before it
    assert out.first_frame == 2 and out.block_index == 1


def test_multi_frame_observation_is_committed_frame_by_frame(modules):
    _, engine = _engine(modules)
    world = SpriteWorld(5)
    frames = [world.reset(), world.step(4), world.step(4)]
    out = engine.generate(_request("p", [0], observation=np.stack(frames), observation_actions=[0, 4, 4]))
    assert out.first_frame == 3
    assert engine.generate(_request("p", [0])).first_frame == 4


@pytest.mark.parametrize("inputs,message", [
    ({"actions": [1]}, "no observation yet"),
    ({"actions": [5], "observation": "OBS"}, r"actions in \[0, 5\)"),
    ({"actions": [1, 2], "observation": "OBS"}, r"int\[1\]"),
    ({"actions": [0.5], "observation": "OBS"}, r"int\[1\]"),
    ({"observation": "OBS"}, "need inputs\\['actions'\\]"),
    ({"actions": [1], "observation": np.zeros((32, 32, 3), np.float32)}, "uint8"),
    ({"actions": [1], "observation": np.zeros((16, 16, 3), np.uint8)}, "uint8"),
    ({"actions": [1], "observation": "OBS", "observation_actions": [0, 1]}, r"int\[1\]"),
])
def test_bad_first_requests_fail_clearly_and_change_nothing(modules, inputs, message):
    pipeline, engine = _engine(modules)
    if isinstance(inputs.get("observation"), str):
        inputs = {**inputs, "observation": SpriteWorld(0).reset()}
    with pytest.raises(ValueError, match=message):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": "p"}, inputs=inputs))
    assert engine.sessions == () and pipeline.session_ids == ()


def test_later_requests_refuse_an_observation_and_a_prompt(modules):
    pipeline, engine = _engine(modules)
    first = SpriteWorld(1).reset()
    engine.generate(_request("p", [1], observation=first))
    with pytest.raises(ValueError, match="already started"):
        engine.generate(_request("p", [1], observation=first))
    with pytest.raises(ValueError, match="not text-conditioned"):
        engine.generate(DiffusionRequest("r", prompt="a cat", extra_args={"session_id": "p"}, inputs={"actions": [1]}))
    assert engine.generate(_request("p", [1])).first_frame == 2  # the refused requests committed nothing
    # After a reset the session needs an observation again.
    engine.reset_session("p")
    with pytest.raises(ValueError, match="no observation yet"):
        engine.generate(_request("p", [1]))


def test_stepwise_equals_tick_bitwise(modules):
    first = SpriteWorld(2).reset()
    actions = np.array([[4], [4], [1]])
    _, tick_engine = _engine(modules)
    tick = [tick_engine.generate(_request("s", actions[0], observation=first, seed=3)).frames]
    tick += [tick_engine.generate(_request("s", actions[b], seed=3)).frames for b in (1, 2)]
    _, step_engine = _engine(modules, step_execution=True)
    request = DiffusionRequest("s", inputs={"actions": actions, "observation": first, "seed": 3, "num_blocks": 3})
    emitted = []
    for _ in range(50):
        result = step_engine.step(StepSchedulerOutput(scheduled=(request,)))
        if result.output is not None:
            emitted.append(result.output.frames)
        if result.finished:
            break
    assert len(emitted) == 3
    for a, b in zip(emitted, tick, strict=True):
        np.testing.assert_array_equal(a, b)


def test_warmup_runs_a_real_observation(modules):
    pipeline, engine = _engine(modules, warmup=True)
    assert engine.sessions == () and pipeline.session_ids == ()
    out = engine.generate(_request("p", [3], observation=SpriteWorld(9).reset()))
    assert out.frames.shape == (1, 32, 32, 3)


def test_incompatible_config_is_refused_before_weights():
    with pytest.raises(ValueError, match="one-hot actions"):
        SpriteWorldPipeline(dit_preset("sprite_world").replace(control_dim=4))
    with pytest.raises(ValueError, match="no register tokens"):
        SpriteWorldPipeline(dit_preset("sprite_world").replace(num_register_tokens=1, register_dim=5))
    with pytest.raises(ValueError, match="RGB"):
        SpriteWorldPipeline("tiny")


# -- weight files ---------------------------------------------------------------------------------


def test_weights_round_trip_exactly(modules, tmp_path):
    path = save_weights(modules, tmp_path / "w", {"note": "test"})
    loaded = load_weights(dit_preset("sprite_world"), path)
    for a, b in zip(jax.tree.leaves(nnx.split(loaded)[1]), jax.tree.leaves(nnx.split(modules)[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["training"] == {"note": "test"} and sidecar["num_params"] == sum(
        x.size for x in jax.tree.leaves(nnx.split(modules)[1]))


def test_weights_written_before_a_config_field_existed_load_with_its_default(modules, tmp_path):
    from ardiff_jax.models._pretrained import _digest

    path = save_weights(modules, tmp_path / "w")
    sidecar_path = path.with_suffix(".json")
    sidecar = json.loads(sidecar_path.read_text())
    config = dit_preset("sprite_world")
    # A field this model leaves at its default, as every field added after the model was trained does.
    newest = [f for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING
              and getattr(config, f.name) == f.default][-1]
    del sidecar["config"][newest.name]  # as a file written before that field existed
    sidecar["sha256"] = _digest(path.read_bytes(), sidecar)
    sidecar_path.write_text(json.dumps(sidecar))
    loaded = load_weights(dit_preset("sprite_world"), path)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), nnx.split(loaded)[1], nnx.split(modules)[1]))
    # A field the file states must still match: the default fills only what is missing.
    with pytest.raises(ValueError, match="another CausalDiTConfig .*num_layers"):
        load_weights(dit_preset("sprite_world").replace(num_layers=2), path)


def test_weights_are_validated_before_use(modules, tmp_path):
    path = save_weights(modules, tmp_path / "w")
    with pytest.raises(ValueError, match="another CausalDiTConfig .*num_layers"):
        load_weights(dit_preset("sprite_world").replace(num_layers=2), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        load_weights(dit_preset("sprite_world"), path)
    # A file with an object array (which would need pickle) is refused even with a matching digest.
    bad = tmp_path / "bad.npz"
    arrays = dict(np.load(save_weights(modules, tmp_path / "ok")))
    arrays["transformer/head/bias"] = np.array([object()], dtype=object)
    np.savez(bad, **arrays)
    sidecar = json.loads((tmp_path / "ok.json").read_text())
    sidecar["sha256"] = _digest(bad.read_bytes(), sidecar)
    bad.with_suffix(".json").write_text(json.dumps(sidecar))
    with pytest.raises(ValueError):
        load_weights(dit_preset("sprite_world"), bad)


@pytest.mark.parametrize("edit", [
    lambda sidecar: sidecar["config"].update(num_heads=2),  # same parameter shapes, other numerics
    lambda sidecar: sidecar["sampling"].update(prediction="flow"),
    lambda sidecar: sidecar["sampling"].update(schedule=[1000.0, 100.0]),
    lambda sidecar: sidecar["training"].update(steps=1),
])
def test_an_edited_sidecar_is_refused(modules, tmp_path, edit):
    # The digest covers the sidecar as well as the arrays: an edit that keeps every parameter's
    # shape (and so would load) changes every frame, and is refused naming the file.
    path = save_weights(modules, tmp_path / "w", sampling={"schedule": [1000.0], "prediction": "delta",
                                                           "decoder": "cells"})
    sidecar = json.loads(path.with_suffix(".json").read_text())
    edit(sidecar)
    path.with_suffix(".json").write_text(json.dumps(sidecar))
    with pytest.raises(ValueError, match=r"w\.json do not match their SHA-256"):
        load_weights(dit_preset("sprite_world"), path)


@pytest.mark.parametrize("text,reason", [
    ('{"format_version": 2, "config"', "truncated or malformed"),
    ("[" * 100_000, "truncated or malformed"),
    ("[1, 2]", "a JSON object is expected"),
    ('{"format_version": 2, "config": {}, "sampling": [], "training": {}, "sha256": ""}', "'sampling' must be"),
    (b'{"format_version": 2, "\xff\xfe"}', "truncated or malformed"),  # not UTF-8
])
def test_a_malformed_sidecar_names_the_file(modules, tmp_path, text, reason):
    path = save_weights(modules, tmp_path / "w")
    sidecar = path.with_suffix(".json")
    sidecar.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"w\\.json .*{re.escape(reason)}"):
        load_weights(dit_preset("sprite_world"), path)


def test_pretrained_names_and_metadata():
    assert PRETRAINED_MODELS == ("sprite_world",)
    with pytest.raises(ValueError, match="unknown pretrained model"):
        pretrained("nope")
    meta = pretrained_metadata("sprite_world")
    training = meta["training"]
    for key in ("command", "steps", "wall_seconds", "train_config"):
        assert key in training
    assert training["command"].startswith("ardiff-jax train")
    pipeline = pretrained("sprite_world")
    assert isinstance(pipeline, SpriteWorldPipeline)
    assert list(pipeline.schedule.timesteps) == meta["sampling"]["schedule"]
    assert pipeline.prediction == meta["sampling"]["prediction"] == training["train_config"]["prediction"]
    assert pipeline.pipeline_config.decoder == meta["sampling"]["decoder"]


def test_pretrained_loads_an_exported_weights_file_instead(modules, tmp_path):
    sampling = {"schedule": [1000.0], "prediction": "x0", "decoder": "levels"}
    path = save_weights(modules, tmp_path / "mine", {"note": "test"}, sampling=sampling)
    pipeline = pretrained("sprite_world", weights=path, session_capacity=2)
    assert pipeline.prediction == "x0" and pipeline.pipeline_config.decoder == "levels"
    assert pipeline.pipeline_config.session_capacity == 2
    for a, b in zip(jax.tree.leaves(nnx.split(pipeline.modules)[1]), jax.tree.leaves(nnx.split(modules)[1]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pretrained("sprite_world", weights=tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="unknown pretrained model"):
        pretrained("nope", weights=path)


def test_cell_decoder_snaps_every_cell_to_a_valid_look():
    from ardiff_jax.envs import cell_codes
    from ardiff_jax.models import snap_to_cells

    rng = np.random.default_rng(0)
    frames = np.stack([SpriteWorld(seed).reset() for seed in range(4)])
    latents = frames_to_latents(frames)
    # A frame a little off everywhere decodes to itself, with numpy and with jax.numpy.
    noisy = latents + rng.normal(0, 0.3, latents.shape).astype(np.float32)
    np.testing.assert_array_equal(latents_to_frames(snap_to_cells(noisy)), frames)
    np.testing.assert_array_equal(latents_to_frames(np.asarray(snap_to_cells(jax.numpy.asarray(noisy), jax.numpy))),
                                  frames)
    # Anything at all decodes to cells a SpriteWorld frame can show; it cannot invent a right answer:
    # a ball painted into the wrong cell stays in the wrong cell.
    garbage = latents_to_frames(snap_to_cells(rng.uniform(-1, 1, latents.shape).astype(np.float32)))
    assert all((cell_codes(frame) >= 0).all() for frame in garbage)


def test_the_pipeline_commits_the_decoded_frame(modules):
    # With the cell decoder (the default) what is returned and committed is made of valid cells.
    from ardiff_jax.envs import cell_codes

    pipeline, engine = _engine(modules)
    out = engine.generate(_request("d", [3], observation=SpriteWorld(2).reset()))
    assert pipeline.pipeline_config.decoder == "cells" and (cell_codes(out.frames[0]) >= 0).all()
    np.testing.assert_array_equal(latents_to_frames(np.asarray(out.latents)), out.frames)
    with pytest.raises(ValueError, match="decoder must be one of"):
        SpriteWorldPipelineConfig(decoder="vae")


def test_a_session_compiles_its_step_program_once_from_its_first_block(modules):
    """Without warmup: the observation's prefill and every later block run one compiled step program.

    The "delta" prediction's previous frame starts as zeros; an uncommitted zeros array there (every later
    previous frame is committed to the device) made jit compile the same step a second time."""
    from helpers import count_compiles

    from ardiff_jax.models._world import world_step

    _, engine = _engine(modules)
    world_step.clear_cache()  # so this session's compiles happen here, whatever ran before in this process
    with count_compiles() as compiled:
        engine.generate(_request("p", [4], observation=SpriteWorld(4).reset()))
        for action in (1, 2, 3):
            engine.generate(_request("p", [action]))
    steps = [program for program in compiled if "world_step" in str(program)]
    assert len(steps) == len(set(steps)), steps
