"""Training: training-mode forward = cached inference, the loss falls, checkpoints round-trip, resume continues."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax.envs import cell_codes, sprite_world_clips
from ardiff_jax.models import (
    DiTModules,
    MaskedAttention,
    SpriteWorldPipeline,
    WorldPipeline,
    action_registers,
    block_causal_mask,
    dit_preset,
    frames_to_latents,
    save_weights,
    tokenize_prompt,
)
from ardiff_jax.runtime import ARDiffusionKVCache
from helpers import count_compiles
from ardiff_jax.training import (
    TrainConfig,
    batch_loss,
    deepen,
    encounters,
    init_train_state,
    make_train_step,
    restore_checkpoint,
    sample_training_batch,
    save_checkpoint,
    teacher_forced_outputs,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _text_kv(modules, cfg):
    return modules.transformer.text_cross_kv(modules.text_encoder(jnp.asarray(tokenize_prompt("", cfg.text_len))))


@nnx.jit
def _forward(transformer, video, t, start, text_kv, registers, controls, attention):
    # Jitted: one compile per geometry instead of the eager op-by-op forward.
    return transformer(video, t, start, text_kv, None, registers, controls, attention=attention)


@nnx.jit
def _forward_blocks(transformer, *args, mask):
    # Module level, so the two timesteps of a geometry share one compile (a jit made per call compiles anew).
    return transformer.forward_blocks(*args, attention=MaskedAttention(mask))


def _conditioning(cfg, num_blocks, rng):
    """Random registers ``[num_blocks, E, R]`` and controls ``[num_blocks, f, C]`` (``None`` where the config has none)."""
    registers = controls = None
    if cfg.num_register_tokens:
        registers = jnp.asarray(rng.standard_normal((num_blocks, cfg.num_register_tokens, cfg.register_dim)),
                                jnp.float32)
    if cfg.control_dim:
        controls = jnp.asarray(rng.standard_normal((num_blocks, cfg.frames_per_block, cfg.control_dim)), jnp.float32)
    return registers, controls


def _at(array, index):
    return None if array is None else array[index]


def _cached_prediction(modules, cfg, spec, latents, registers, controls, x_t, t):
    """Commit blocks 0..k-1 through the paged runtime at t = 0, then predict block k from x_t."""
    cache = ARDiffusionKVCache(spec, dtype=jnp.float32, available_memory_bytes=10**8, gpu_memory_fraction=1.0)
    state = cache.create_state("s")
    f = cfg.frames_per_block
    seq_len = f * cfg.tokens_per_frame
    text_kv = _text_kv(modules, cfg)
    num_blocks = latents.shape[0] // f
    for j in range(num_blocks):
        caches = state.get_kv_caches("main", seq_len=seq_len, commit_current=True)
        out = _forward(modules.transformer, latents[j * f:(j + 1) * f], jnp.float32(0.0), jnp.int32(j * f), text_kv,
                       _at(registers, j), _at(controls, j), caches)
        state.commit_paged_context("main", kv=(out.k, out.v))
    caches = state.get_kv_caches("main", seq_len=seq_len, commit_current=False)
    out = _forward(modules.transformer, x_t, jnp.float32(t), jnp.int32(num_blocks * f), text_kv,
                   _at(registers, num_blocks), _at(controls, num_blocks), caches)
    cache.close()
    return np.asarray(out.video)


def _training_prediction(modules, cfg, latents, registers, controls, x_t, t):
    """The same prediction from one training-mode pass: clean instances 0..k-1 and the noisy instance k."""
    f = cfg.frames_per_block
    num_blocks = latents.shape[0] // f
    clean = latents.reshape(num_blocks, f, *latents.shape[1:])
    instances = jnp.concatenate([clean, x_t[None]])
    starts = jnp.arange(num_blocks + 1, dtype=jnp.int32) * f
    is_clean = jnp.arange(num_blocks + 1) < num_blocks
    timesteps = jnp.concatenate([jnp.zeros((num_blocks,)), jnp.full((1,), t)])
    out = _forward_blocks(modules.transformer, instances, timesteps, starts, _text_kv(modules, cfg), None,
                          _at(registers, slice(0, num_blocks + 1)), _at(controls, slice(0, num_blocks + 1)),
                          mask=block_causal_mask(cfg, starts, is_clean))
    return np.asarray(out.video[-1])


@pytest.mark.parametrize("preset,pipeline_cls,num_blocks,overrides", [
    # 1 frame/block, sink 1 + window 3: slid four times; per-frame controls, no registers.
    ("sprite_world", SpriteWorldPipeline, 7, {}),
    # 2 frames/block, sink 1 + window 5: a window cut mid-block; registers, no controls.
    ("tiny", WorldPipeline, 5, {}),
    # Registers and per-frame controls together (registers take the block's mean control).
    ("tiny", WorldPipeline, 4, {"control_dim": 3}),
])
@pytest.mark.parametrize("t", [1000.0, 350.0])
def test_training_forward_equals_cached_inference(preset, pipeline_cls, num_blocks, overrides, t):
    cfg = dit_preset(preset).replace(image_len=0, **overrides)
    modules = DiTModules.create(cfg, 3)
    spec = pipeline_cls.kv_spec_for(cfg)
    rng = np.random.default_rng(0)
    f = cfg.frames_per_block
    latents = jnp.asarray(rng.standard_normal((num_blocks * f, *cfg.block_shape[1:])), jnp.float32)
    registers, controls = _conditioning(cfg, num_blocks + 1, rng)
    x_t = jnp.asarray(rng.standard_normal(cfg.block_shape), jnp.float32)
    cached = _cached_prediction(modules, cfg, spec, latents, registers, controls, x_t, t)
    trained = _training_prediction(modules, cfg, latents, registers, controls, x_t, t)
    np.testing.assert_allclose(trained, cached, rtol=1e-4, atol=1e-4)


def test_block_causal_mask_follows_the_window_rule():
    # sink 1, window 3, one frame per block, one register token
    cfg = dit_preset("sprite_world").replace(num_register_tokens=1, register_dim=5)
    starts = jnp.array([0, 1, 2, 3, 4, 5, 5])  # six clean frames, then the noisy copy of frame 5
    clean = jnp.array([True] * 6 + [False])
    mask = np.asarray(block_causal_mask(cfg, starts, clean))
    tokens = cfg.tokens_per_frame
    num_video = 7 * tokens

    def sees(query_instance, key_instance):
        return bool(mask[query_instance * tokens, key_instance * tokens])

    # The noisy frame 5 sees the sink (0), the newest window - 1 = 2 frames (3, 4) and itself.
    assert [k for k in range(7) if sees(6, k)] == [0, 3, 4, 6]
    assert [k for k in range(7) if sees(2, k)] == [0, 1, 2]
    # Registers: each instance sees only its own; a register row sees what its instance's video sees.
    registers = mask[:, num_video:]
    assert registers.sum(axis=1).tolist() == [1] * mask.shape[0]
    np.testing.assert_array_equal(mask[num_video + 6], mask[6 * tokens])
    # Every token of an instance has the same row.
    assert (mask[6 * tokens:7 * tokens] == mask[6 * tokens]).all()


def _tiny_train_config(**overrides):
    fields = dict(steps=8, batch_size=4, sequence_frames=3, max_gap=6, warmup_steps=0, learning_rate=3e-3,
                  checkpoint_every=4)
    fields.update(overrides)
    return TrainConfig(**fields)


#: One config for the loss, checkpoint and resume tests: they share one compiled step. They test
#: the loop (gradients, updates, checkpoints), so they use the x0 objective: a delta model starts
#: from a zero head at the "nothing moves" loss and needs ~100 steps to leave it
#: (docs/models.md), far more than a test should run.
SHARED_CONFIG = dict(steps=12, prediction="x0")


class SharedRuns(NamedTuple):
    config: TrainConfig
    straight: Any  # TrainResult of the whole run
    interrupted: Any  # TrainResult of the same run stopped after 4 steps (a checkpoint every 4)
    interrupted_dir: Path  # its directory: a test that continues it continues a copy


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """The SHARED_CONFIG run trained once for the file: the loss, resume and refusal tests read it, and continue
    copies of the interrupted one (training is the bulk of their cost, the claims do not need a run each)."""
    config = _tiny_train_config(**SHARED_CONFIG)
    root = tmp_path_factory.mktemp("shared_runs")
    straight = train(config, root / "straight", progress=False)
    interrupted = train(config, root / "interrupted", progress=False, stop_after=4)
    return SharedRuns(config, straight, interrupted, root / "interrupted")


def _continue_in(tmp_path, shared_runs, name):
    target = tmp_path / name
    shutil.copytree(shared_runs.interrupted_dir, target)
    return target


def test_loss_falls(shared_runs):
    config = shared_runs.config
    graphdef, state = init_train_state(config)
    held_out = sample_training_batch(999, 0, 8, config.sequence_frames, config.max_gap)
    key = jax.random.key(7)
    # Jitted: one compile instead of the eager op-by-op forward (~15 s on CPU).
    held_out_loss = jax.jit(lambda params: batch_loss(graphdef, params, config.model_config, held_out, key,
                                                      config.objective))
    before = float(held_out_loss(state.params))
    # The run's 12 steps (train's batches are sample_training_batch(seed, step, ...)).
    after = float(held_out_loss(nnx.split(shared_runs.straight.modules)[1]))
    assert after < 0.6 * before, (before, after)


def test_checkpoint_round_trips_bit_exactly(tmp_path):
    config = _tiny_train_config(**SHARED_CONFIG)
    graphdef, state = init_train_state(config)
    step = make_train_step(config, graphdef)
    state, _ = step(state, sample_training_batch(0, 0, config.batch_size, config.sequence_frames, config.max_gap))
    expected = jax.tree.map(np.asarray, state)
    save_checkpoint(tmp_path, state, [(0, 1.5)], wall_seconds=3.0)
    _, restored, losses, wall = restore_checkpoint(tmp_path, config)
    assert losses == [(0, 1.5)] and wall == 3.0
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)


def test_resumed_run_continues_the_same_run(tmp_path, capsys, shared_runs):
    config, straight, interrupted = shared_runs.config, shared_runs.straight, shared_runs.interrupted
    assert len(interrupted.losses) == 4 and interrupted.resumed_from is None
    resumed_dir = _continue_in(tmp_path, shared_runs, "resumed")
    with count_compiles() as compiled:
        resumed = train(config, resumed_dir, progress=True)
    assert resumed.resumed_from == 4
    assert "step" not in compiled, compiled  # the same config and graph reuse the compiled step
    assert resumed.losses == straight.losses
    for a, b in zip(jax.tree.leaves(nnx.split(resumed.modules)[1]), jax.tree.leaves(nnx.split(straight.modules)[1]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "train" in capsys.readouterr().err  # the tqdm bar
    record = json.loads((resumed_dir / "losses.json").read_text())
    assert len(record["losses"]) == 12 and record["wall_seconds"] > 0
    png = (resumed_dir / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_under_another_config_is_refused_naming_the_fields(tmp_path, shared_runs):
    config = shared_runs.config
    run = _continue_in(tmp_path, shared_runs, "run")  # the run stopped after 4 steps
    other = _tiny_train_config(**(SHARED_CONFIG | {"seed": 1, "batch_size": 8}))
    with pytest.raises(ValueError, match=r"another TrainConfig \(batch_size: 4 -> 8; seed: 0 -> 1\)"):
        train(other, run, progress=False)
    record = json.loads((run / "losses.json").read_text())
    assert record["config"] == config.as_dict() and len(record["losses"]) == 4  # nothing relabelled
    longer = _tiny_train_config(**(SHARED_CONFIG | {"steps": 14}))
    with pytest.raises(ValueError, match="steps: 12 -> 14"):
        train(longer, run, progress=False)
    # A bookkeeping field may change; force continues a changed run and says so in losses.json. The change is one
    # to the data (longer gaps), not to the compiled step (steps would change its schedule): the step is shared.
    wider = _tiny_train_config(**(SHARED_CONFIG | {"max_gap": 9}))
    with pytest.raises(ValueError, match="max_gap: 6 -> 9"):
        train(wider, run, progress=False)
    resumed = train(wider, run, progress=False, force=True, stop_after=1)
    assert resumed.resumed_from == 4 and len(resumed.losses) == 5
    record = json.loads((run / "losses.json").read_text())
    assert record["config"] == wider.as_dict() and record["resumed_from_config"] == config.as_dict()


def test_the_evaluation_seed_is_refused_for_training():
    from ardiff_jax.training import EVALUATION_SEED

    with pytest.raises(ValueError, match="evaluation clips' seed"):
        TrainConfig(seed=EVALUATION_SEED)


def test_sink_distance_placement_keeps_the_simulated_frames():
    near = sample_training_batch(3, 5, 8, 4, 10)
    far = sample_training_batch(3, 5, 8, 4, 10, max_sink_distance=500)
    np.testing.assert_array_equal(near.frames, far.frames)
    np.testing.assert_array_equal(near.weights, far.weights)
    gapped = near.positions[:, 1] > 1
    assert (far.positions[~gapped] == near.positions[~gapped]).all()  # contiguous clips stay put
    assert (far.positions[gapped, 1] >= near.positions[gapped, 1]).all() and far.positions.max() <= 502
    assert (np.diff(far.positions[:, 1:], axis=1) == 1).all()


def test_training_batches_are_a_function_of_seed_and_step():
    a = sample_training_batch(3, 5, 6, 4, 10)
    b = sample_training_batch(3, 5, 6, 4, 10)
    c = sample_training_batch(3, 6, 6, 4, 10)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.frames, c.frames)
    # Frame 0 is each clip's reset frame; a gap zeroes the first target's weight.
    assert (a.positions[:, 0] == 0).all() and (a.actions[:, 0] == 0).all()
    gaps = a.positions[:, 1]
    np.testing.assert_array_equal(a.weights[:, 0], (gaps == 1).astype(np.float32))
    assert (np.diff(a.positions[:, 1:], axis=1) == 1).all()
    # The frames are the clips' frames at those positions.
    frames, actions = sprite_world_clips(int(np.random.default_rng([3, 5]).integers(0, 2**62)), 6,
                                         int(gaps.max()) + 3)
    rows = np.arange(6)[:, None]
    np.testing.assert_array_equal(a.frames, frames[rows, a.positions])


@pytest.mark.parametrize("bad", [dict(steps=0), dict(sequence_frames=1), dict(learning_rate=float("nan")),
                                 dict(preset="nope"), dict(batch_size=True)])
def test_train_config_refuses_bad_values(bad):
    with pytest.raises((ValueError, KeyError)):
        TrainConfig(**bad)


def test_action_registers_and_pixel_round_trip():
    frames, actions = sprite_world_clips(1, 2, 5)
    latents = frames_to_latents(frames)
    assert latents.shape == (2, 5, 3, 32, 32) and latents.min() >= -1 and latents.max() <= 1
    from ardiff_jax.models import latents_to_frames

    np.testing.assert_array_equal(latents_to_frames(latents), frames)
    np.testing.assert_array_equal(np.asarray(latents_to_frames(jnp.asarray(latents), jnp)), frames)
    regs = action_registers(actions, 5)
    assert regs.shape == (2, 5, 5) and (regs.sum(-1) == 1).all() and (regs.argmax(-1) == actions).all()


def test_encounters_are_the_steps_where_the_agent_ends_next_to_the_ball():
    frames, _ = sprite_world_clips(11, 8, 40)
    codes = np.array([[cell_codes(frame) for frame in clip] for clip in frames])  # the env's own decoder
    ball = np.array([[np.argwhere(c >= 3)[0] for c in clip] for clip in codes])  # [B, n, 2]
    agent = np.array([[np.argwhere(c == 2)[0] for c in clip] for clip in codes])
    expected = np.abs(agent[:, 1:] - ball[:, :-1]).max(axis=-1) <= 1  # the agent after its move, the ball before
    got = encounters(frames)
    np.testing.assert_array_equal(got, expected)
    assert 0.02 < got.mean() < 0.5  # both kinds of step occur
    np.testing.assert_array_equal(encounters(frames[3]), expected[3])  # one clip works too


def test_encounter_sampling_and_weighting():
    def gapped_with_encounter(share):
        hits = rows = 0
        for step in range(6):
            batch = sample_training_batch(2, step, 16, 4, 48, encounter_share=share)
            met = encounters(batch.frames[:, 1:])  # the steps into the weighted targets 2 .. n - 1
            gapped = batch.positions[:, 1] > 1
            hits += int(met[gapped].any(axis=1).sum())
            rows += int(gapped.sum())
        return hits / rows

    # A clip in which the agent never meets the ball keeps its uniform start (about a quarter of them).
    focused, uniform = gapped_with_encounter(1.0), gapped_with_encounter(0.0)
    assert focused >= 0.7 and focused >= 3 * uniform, (focused, uniform)
    # No option, no change: the default batch is the original sampler's.
    plain, zero = sample_training_batch(2, 3, 16, 4, 48), sample_training_batch(2, 3, 16, 4, 48, encounter_share=0.0)
    for x, y in zip(plain, zero, strict=True):
        np.testing.assert_array_equal(x, y)
    # The weight multiplies exactly the targets that follow an encounter, by 1 + weight.
    base = sample_training_batch(2, 3, 16, 4, 48, encounter_share=1.0)
    weighted = sample_training_batch(2, 3, 16, 4, 48, encounter_share=1.0, encounter_weight=2.0)
    np.testing.assert_array_equal(weighted.frames, base.frames)
    np.testing.assert_array_equal(weighted.weights, base.weights * (1 + 2 * encounters(base.frames)))
    assert (weighted.weights > base.weights).any()


def test_a_fine_tune_starts_from_exported_weights_and_resumes(tmp_path):
    # The file holds seed 1's weights and the fine-tune runs under seed 0, the shared runs' seed: its step differs
    # from theirs only in how batches are drawn (numpy), so it is the same program (one compile per suite run).
    base = _tiny_train_config(**SHARED_CONFIG, seed=1)
    graphdef, state = init_train_state(base)
    path = save_weights(nnx.merge(graphdef, state.params), tmp_path / "start.npz", {"note": "a test run"})
    tune = _tiny_train_config(**SHARED_CONFIG, seed=0, init_weights=str(path), encounter_share=1.0,
                              encounter_weight=2.0)
    _, start = init_train_state(tune)
    for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the file's weights, not seed 0's
    fresh = init_train_state(dataclasses.replace(tune, init_weights=""))[1]
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(start.params), strict=True))
    # Six steps straight, or four and a resume from the checkpoint at 4 for two more (the full 12-step resume is
    # test_resumed_run_continues_the_same_run's): the same losses.
    straight = train(tune, tmp_path / "straight", progress=False, stop_after=6)
    train(tune, tmp_path / "resumed", progress=False, stop_after=4)
    resumed = train(tune, tmp_path / "resumed", progress=False, stop_after=2)
    assert resumed.resumed_from == 4 and len(straight.losses) == 6 and resumed.losses == straight.losses
    # The starting point is part of what defines the run.
    with pytest.raises(ValueError, match="init_weights"):
        train(dataclasses.replace(tune, init_weights=""), tmp_path / "resumed", progress=False)
    with pytest.raises(ValueError, match="encounter_share"):
        TrainConfig(encounter_share=1.5)


def test_deepen_adds_layers_that_change_nothing_until_trained(tmp_path):
    config = _tiny_train_config(**SHARED_CONFIG)
    graphdef, state = init_train_state(config)
    modules = nnx.merge(graphdef, state.params)
    cfg = modules.transformer.config
    batch = sample_training_batch(5, 0, 1, 4, 10)
    latents = frames_to_latents(batch.frames[0], jnp)
    controls = action_registers(batch.actions[0], 5, jnp)[:, None]
    x_t = jax.random.normal(jax.random.key(0), latents[1:].shape)

    @jax.jit
    def outputs(params, graphdef=graphdef):
        m = nnx.merge(graphdef, params)
        c = m.transformer.config
        return teacher_forced_outputs(m, c, latents, controls, jnp.asarray(batch.positions[0]), x_t, jnp.ones(3),
                                      _text_kv(m, c))

    deeper = deepen(modules, cfg.num_layers + 2)
    assert deeper.transformer.config.num_layers == cfg.num_layers + 2
    deeper_graphdef, deeper_params = nnx.split(deeper)
    np.testing.assert_array_equal(np.asarray(jax.jit(outputs, static_argnames="graphdef")(
        deeper_params, graphdef=deeper_graphdef)), np.asarray(outputs(state.params)))
    # The copies of the middle layers (1 and 2 of 4) follow them; only their residual writers are zero.
    old, new = modules.transformer.blocks, deeper.transformer.blocks
    def array(param):
        return np.asarray(param[...])

    np.testing.assert_array_equal(array(new.ffn_in.kernel), array(old.ffn_in.kernel)[[0, 1, 1, 2, 2, 3]])
    assert not array(new.ffn_out.kernel)[[2, 4]].any() and not array(new.self_attn.o.bias)[[2, 4]].any()
    np.testing.assert_array_equal(array(new.ffn_out.kernel)[[0, 1, 3, 5]], array(old.ffn_out.kernel))
    for bad in (cfg.num_layers - 1, 2 * cfg.num_layers + 1, 5.0):
        with pytest.raises(ValueError, match="num_layers"):
            deepen(modules, bad)
    # A fine-tune with more layers than its starting file deepens it; one with fewer is refused.
    path = save_weights(modules, tmp_path / "start.npz")
    _, start = init_train_state(_tiny_train_config(**SHARED_CONFIG, init_weights=str(path), num_layers=6))
    for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(deeper_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="keep or add layers"):
        init_train_state(_tiny_train_config(**SHARED_CONFIG, init_weights=str(path), num_layers=3))


def test_chasing_players_meet_the_ball_more_and_follow_the_rules():
    from ardiff_jax.envs import transition

    plain = sprite_world_clips(5, 32, 40)
    for x, y in zip(plain, sprite_world_clips(5, 32, 40, chase_probability=0.0), strict=True):
        np.testing.assert_array_equal(x, y)  # no option, the original clips
    frames, actions = sprite_world_clips(5, 32, 40, chase_probability=0.8)
    assert encounters(frames).mean() >= 3 * encounters(plain[0]).mean()
    for clip in (0, 7):  # every frame is the simulator's step of the one before under its action
        for t in range(1, 40):
            np.testing.assert_array_equal(transition(frames[clip, t - 1], int(actions[clip, t])), frames[clip, t])
    with pytest.raises(ValueError, match="chase_probability"):
        sprite_world_clips(5, 2, 4, chase_probability=1.5)
    with pytest.raises(ValueError, match="chase_probability"):
        TrainConfig(chase_probability=2.0)
    batch = sample_training_batch(2, 3, 8, 4, 20, chase_probability=0.5)
    assert batch.frames.shape == (8, 4, 32, 32, 3)


def test_a_checkpoint_from_before_a_config_field_existed_resumes_as_its_default():
    from ardiff_jax.training import config_differences

    config = TrainConfig()
    old = {name: value for name, value in config.as_dict().items()
           if name not in ("encounter_share", "encounter_weight", "chase_probability", "init_weights", "num_layers")}
    assert config_differences(old, config) == []
    assert config_differences(old, TrainConfig(num_layers=6)) == ["num_layers: 0 -> 6"]
