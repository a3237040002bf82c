"""Self-Forcing's rollout on the transformers we ship: causal Wan (text) and Matrix-Game (image, I2V, actions).

* forward: with the pipeline session's noise and the exit at the last step, :func:`self_rollout`
  commits exactly the blocks the engine serves, past the attention window: the causal Wan
  pipeline (LongLive's sink + window policy, 3-frame blocks, the warped 4-step schedule, text
  K/V from the prompt embeddings) and the Matrix-Game pipeline (CLIP-token context, mask +
  image-latent condition channels, keyboard/mouse windows per block, the action ring carried
  and committed, the warped 3-step schedule);
* training mode: ``CausalDiT.forward_blocks`` runs I2V and action-module networks: one
  teacher-forced pass over [clean context at t = 0; noisy blocks] under ``block_causal_mask``
  and ``block_causal_action_mask`` equals block-by-block cached inference (``__call__`` with
  ``DenseAttention`` and the action ring), outputs, K/V and action keys/values;
* gradient: through the Matrix-Game rollout (exit steps differing per block) it equals the
  gradient of the same loss recomputed without pools on that path (clean context by
  ``forward_blocks`` with frozen parameters, the action ring from its action keys/values,
  each exit forward by ``__call__`` with ``DenseAttention``).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import DenseAttention, MaskedAttention, block_causal_mask, dit_preset
from ardiff_jax.models._dit import (
    ActionInputs,
    ActionKV,
    action_history_mask,
    block_causal_action_mask,
    commit_action_cache,
    init_action_cache,
)
from ardiff_jax.models.matrix_game import MatrixGamePipeline, MatrixGamePipelineConfig, action_windows
from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig, WanModules, WanVAEConfig, random_vae
from ardiff_jax.models.wan._pipeline import wan_text_kv
from ardiff_jax.training import RolloutConditioning, pipeline_noise, self_rollout

#: float32 end to end: only the summation order of the paged attention differs (measured ~1e-6).
TOLERANCE = 1e-5
ENGINE = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)
WAN = dit_preset("wan-tiny")  # LongLive's policy at CI size: 3-frame blocks, a 3-frame sink, a 9-frame window
MG = dit_preset("matrix-game-tiny", dtype="float32", param_dtype="float32")  # window 4, no sink
ACTION = MG.action
F = MG.frames_per_block
MG_VAE = WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.1, -0.2, 0.0, 0.3),
                           latents_std=(1.5, 0.5, 1.0, 2.0))
MG_BLOCKS = 4  # 12 latent frames through a 4-frame window


def _rows(a):
    return jax.tree.map(lambda x: x[None], a)


def test_wan_rollout_commits_exactly_the_engines_blocks_past_sink_and_window():
    pipeline = CausalWanPipeline(WAN, CausalWanPipelineConfig(session_capacity=1))
    engine = ARDiffusionEngine(pipeline, ENGINE)
    embeds = np.random.default_rng(0).standard_normal((5, WAN.text_dim)).astype(np.float32)
    n = 6  # 18 frames: past the 3 + 9 visible frames twice over
    blocks = np.stack([np.asarray(engine.generate(DiffusionRequest(
        f"r{i}", extra_args={"session_id": "w"}, inputs={"prompt_embeds": embeds} if i == 0 else {})).latents)
        for i in range(n)])
    schedule = pipeline.schedule  # Self-Forcing's warped [1000, 937.5, 833.3, 625], flow prediction
    # The conditioning a trainer passes: the prompt embeddings zero-padded to text_len, projected per layer.
    text_kv = wan_text_kv(pipeline._graphdef, pipeline._params, jnp.asarray(pipeline._padded_embeds(embeds)))
    noise = pipeline_noise(pipeline._sessions["w"].key, 0, n, schedule.num_steps, WAN.block_shape)[None]
    out = self_rollout(pipeline._graphdef, pipeline._params, jnp.zeros((1, n) + WAN.block_shape),
                       jnp.zeros((1, n), bool), RolloutConditioning(text_kv=_rows(text_kv)), noise,
                       jnp.full((n,), schedule.num_steps - 1, jnp.int32), schedule=schedule, prediction="flow")
    np.testing.assert_allclose(np.asarray(out.committed[0]), blocks, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(out.generated[0]), blocks, rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def mg_modules():
    return WanModules.create(MG, 0)


class _Recording(MatrixGamePipeline):
    """Keeps each block's condition channels and action windows as the session fed them to the network."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fed = []

    def _start_block(self, state, session, block, *, staged=False):
        session = super()._start_block(state, session, block, staged=staged)
        self.fed.append((np.asarray(session.block_condition), np.asarray(session.block_keyboard),
                         np.asarray(session.block_mouse)))
        return session


def _player(seed, blocks):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (MG.latent_height * 8, MG.latent_width * 8, 3), dtype=np.uint8)
    embeds = rng.standard_normal((MG.text_len, MG.text_dim)).astype(np.float32)
    rows = ACTION.num_rows(blocks * F)
    keyboard = np.eye(ACTION.keyboard_dim, dtype=np.float32)[rng.integers(0, ACTION.keyboard_dim, rows)]
    mouse = (0.1 * rng.standard_normal((rows, ACTION.mouse_dim))).astype(np.float32)
    return image, embeds, keyboard, mouse


def _windows(keyboard, mouse, blocks):
    """``ActionInputs [n, f, rows, ...]``: every block's windows from the session's whole row arrays."""
    windows = [action_windows(MG, keyboard, mouse, i * F) for i in range(blocks)]
    return ActionInputs(jnp.asarray(np.stack([w.keyboard for w in windows])),
                        jnp.asarray(np.stack([w.mouse for w in windows])))


@pytest.fixture(scope="module")
def mg_session(mg_modules):
    """A Matrix-Game session of ``MG_BLOCKS`` blocks through the engine: its blocks and what fed them."""
    pipeline = _Recording(MG, MatrixGamePipelineConfig(session_capacity=1), modules=mg_modules,
                          vae=random_vae(MG_VAE, 3))
    engine = ARDiffusionEngine(pipeline, ENGINE)
    image, embeds, keyboard, mouse = _player(5, MG_BLOCKS)
    first, per = ACTION.num_rows(F), ACTION.frames_per_latent * F
    blocks = []
    for i in range(MG_BLOCKS):
        part = slice(0, first) if i == 0 else slice(first + per * (i - 1), first + per * i)
        inputs = {"keyboard": keyboard[part], "mouse": mouse[part]}
        if i == 0:
            inputs.update(image=image, image_embeds=embeds, seed=7)
        blocks.append(np.asarray(engine.generate(DiffusionRequest(
            f"r{i}", inputs=inputs, extra_args={"session_id": "m"})).latents))
    return pipeline, np.stack(blocks), embeds, _windows(keyboard, mouse, MG_BLOCKS)


def _mg_conditioning(pipeline, embeds, actions):
    """The rollout's conditioning of one Matrix-Game session (a leading row axis of 1)."""
    # The CLIP tokens' K/V, the embeddings committed to the device as the pipeline's own call has them (an
    # uncommitted argument compiled wan_text_kv a second time).
    context_kv = wan_text_kv(pipeline._graphdef, pipeline._params, jax.device_put(embeds, jax.devices()[0]))
    condition = jnp.asarray(np.stack([fed[0] for fed in pipeline.fed]))  # [n, f, 4 mask + C image latent, H, W]
    return RolloutConditioning(text_kv=_rows(context_kv), condition=condition[None], actions=_rows(actions))


@pytest.fixture(scope="module")
def mg_rollout(mg_session):
    """The session's ``MG_BLOCKS``-block Matrix-Game rollout, jitted once as the value and gradient of a probe loss
    with the noise, the exit steps and the targets as arguments: the engine comparison runs it at the session's
    noise with every exit at the last step, the gradient check at fresh noise with exits differing per block (a
    forward rollout and a differentiated one compiled separately cost both tests most of their time; the
    primal of the differentiated program is the rollout itself)."""
    pipeline, _, embeds, actions = mg_session
    graphdef, n = pipeline._graphdef, MG_BLOCKS
    cond = _mg_conditioning(pipeline, embeds, actions)
    probe = jax.random.uniform(jax.random.key(5), MG.block_shape)

    def paged(p, noise, exits, targets):
        out = self_rollout(graphdef, p, jnp.zeros((1, n) + MG.block_shape), jnp.zeros((1, n), bool), cond, noise,
                           exits, schedule=pipeline.schedule, prediction="flow")
        return jnp.sum(jnp.square(out.generated[0] - targets) * probe), out

    # Jitted: eagerly, the rollout's scans and their backward pass were traced and compiled op by op.
    value_and_grad = jax.jit(jax.value_and_grad(paged, has_aux=True))
    device = jax.devices()[0]

    def run(noise, exits, targets):
        """``((loss, RolloutBlocks), gradient)``; every argument committed, so both calls hit one compile."""
        return value_and_grad(pipeline._params, *jax.device_put((noise, exits, targets), device))

    return types.SimpleNamespace(cond=cond, probe=probe, run=run)


def test_matrix_game_rollout_commits_exactly_the_engines_blocks(mg_session, mg_rollout):
    pipeline, blocks, _, actions = mg_session
    n = MG_BLOCKS
    # The windows a trainer builds from a clip's whole row arrays are those the session fed block by block.
    for i, (_, keyboard, mouse) in enumerate(pipeline.fed):
        np.testing.assert_array_equal(np.asarray(actions.keyboard[i]), keyboard)
        np.testing.assert_array_equal(np.asarray(actions.mouse[i]), mouse)
    schedule = pipeline.schedule  # the warped [1000, 908.8, 714.0]
    noise = pipeline_noise(pipeline._sessions["m"].key, 0, n, schedule.num_steps, MG.block_shape)[None]
    (_, out), _ = mg_rollout.run(noise, jnp.full((n,), schedule.num_steps - 1, jnp.int32),
                                 jnp.zeros((n,) + MG.block_shape))
    np.testing.assert_allclose(np.asarray(out.committed[0]), blocks, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(out.generated[0]), blocks, rtol=0, atol=TOLERANCE)


def test_the_action_mask_is_the_rings_window():
    """Instance frames a block's action modules see in training mode = the ring slots it sees at inference."""
    n = 5
    starts = jnp.arange(n) * F
    mask = np.asarray(block_causal_action_mask(MG, jnp.concatenate([starts, starts]), jnp.arange(2 * n) < n))
    for i in range(n):
        slots = np.asarray(action_history_mask(MG, starts[i]))
        # Slot g % W holds frame g when g is the newest of its residue before the block.
        frames = [g for g in range(n * F) if i * F - MG.window_frames <= g < i * F and slots[g % MG.window_frames]]
        seen = [g for g in range(n * F) if mask[n + i, g]]
        assert seen == frames, (i, seen, frames)
        assert mask[n + i, n * F:].tolist() == [j == i for j in range(n) for _ in range(F)]  # itself only


@functools.partial(jax.jit, static_argnums=0)
def _dense_call(graphdef, params, x, t, start, context, history_k, history_v, history_mask, condition, actions,
                ring):
    out = nnx.merge(graphdef, params).transformer(
        x, t, start, context, attention=DenseAttention(history_k, history_v, history_mask), condition=condition,
        actions=actions, action_history=ring)
    return out.video, out.k, out.v, out.action_kv


def _block_kv(kv, i):
    """Block ``i``'s entries ``[A, f, ...]`` of an instance-major ``[A, B*f, ...]`` :class:`ActionKV`."""
    return ActionKV(*(None if a is None else a[:, i * F:(i + 1) * F] for a in kv))


def test_forward_blocks_runs_i2v_and_action_networks_as_cached_inference(mg_modules):
    graphdef, params = nnx.split(mg_modules)
    n, tokens = 3, F * MG.tokens_per_frame
    rng = np.random.default_rng(1)

    # The inputs and the history on the host, the K/V by the jitted wan_text_kv: eagerly, every slice, update and
    # layer-norm op compiled its own small program.
    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    clean, noisy = randn(n, *MG.block_shape), randn(n, *MG.block_shape)
    times = np.asarray([1000.0, 714.0, 250.0], np.float32)
    condition = randn(n, F, MG.in_channels - MG.latent_channels, MG.latent_height, MG.latent_width)
    actions = ActionInputs(randn(n, F, ACTION.rows, ACTION.keyboard_dim), randn(n, F, ACTION.rows, ACTION.mouse_dim))
    context = wan_text_kv(graphdef, params, randn(MG.text_len, MG.text_dim))
    starts = np.arange(n, dtype=np.int32) * F
    # Block by block: the clean block's K/V join the history and its action keys/values the ring.
    layers = (MG.num_layers, n * tokens, MG.num_heads, MG.head_dim)
    history_k, history_v = np.zeros(layers, np.float32), np.zeros(layers, np.float32)
    ring = init_action_cache(MG)
    want_clean, want_noisy = [], []
    for i in range(n):
        frame = np.arange(n * F)
        visible = (frame < i * F) & (frame >= i * F + F - MG.window_frames)  # no sink: the sliding window
        mask = np.repeat(visible, MG.tokens_per_frame)
        block = (starts[i], context, history_k, history_v, mask, condition[i],
                 ActionInputs(actions.keyboard[i], actions.mouse[i]), ring)
        want_noisy.append(_dense_call(graphdef, params, noisy[i], times[i], *block))
        want_clean.append(_dense_call(graphdef, params, clean[i], np.float32(0.0), *block))
        _, k, v, action_kv = want_clean[-1]
        history_k, history_v = history_k.copy(), history_v.copy()  # the earlier blocks' calls keep theirs
        history_k[:, i * tokens:(i + 1) * tokens] = np.asarray(k)
        history_v[:, i * tokens:(i + 1) * tokens] = np.asarray(v)
        ring = commit_action_cache(MG, ring, action_kv, starts[i])
    want_clean, want_noisy = jax.device_get((want_clean, want_noisy))
    # One teacher-forced pass: [clean context at t = 0; noisy blocks].
    both = jnp.concatenate([starts, starts])
    is_clean = jnp.arange(2 * n) < n
    out = jax.jit(lambda p: nnx.merge(graphdef, p).transformer.forward_blocks(
        jnp.concatenate([clean, noisy]), jnp.concatenate([jnp.zeros(n), times]), both, context,
        attention=MaskedAttention(block_causal_mask(MG, both, is_clean)),
        condition=jnp.concatenate([condition, condition]), actions=jax.tree.map(lambda a: jnp.concatenate([a, a]),
                                                                                 actions),
        action_mask=block_causal_action_mask(MG, both, is_clean)))(params)
    out = jax.device_get(out)  # compared on the host: no slice, abs or max program per shape
    for i in range(n):
        for copy, want in ((i, want_clean[i]), (n + i, want_noisy[i])):
            video, k, v, action_kv = want
            np.testing.assert_allclose(np.asarray(out.video[copy]), np.asarray(video), rtol=0, atol=TOLERANCE)
            part = slice(copy * tokens, (copy + 1) * tokens)
            np.testing.assert_allclose(np.asarray(out.k[:, part]), np.asarray(k), rtol=0, atol=TOLERANCE)
            np.testing.assert_allclose(np.asarray(out.v[:, part]), np.asarray(v), rtol=0, atol=TOLERANCE)
            for got, expected in zip(_block_kv(out.action_kv, copy), action_kv, strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=TOLERANCE)
    assert float(np.abs(out.video[n:] - out.video[:n]).max()) > 1e-2  # the noisy blocks are not the clean ones


def test_matrix_game_gradient_equals_a_dense_recomputation_on_forward_blocks(mg_session, mg_rollout):
    """A loss through the rollout (exits at different steps) and the same loss without pools: clean context by
    ``forward_blocks`` with frozen parameters (so it carries no gradient and is computed once), its action
    keys/values as each block's ring, each exit forward by ``__call__`` with ``DenseAttention``."""
    pipeline = mg_session[0]
    graphdef, params = pipeline._graphdef, pipeline._params
    n, tokens = MG_BLOCKS, F * MG.tokens_per_frame
    schedule = pipeline.schedule
    cond, probe = mg_rollout.cond, mg_rollout.probe
    noise = jax.random.normal(jax.random.key(3), (1, n, schedule.num_steps) + MG.block_shape)
    exits = np.asarray([2, 0, 1, 0], np.int32)  # after, at and before the other blocks' exits
    targets = jax.random.normal(jax.random.key(4), (n,) + MG.block_shape)
    (paged_value, out), paged_grad = mg_rollout.run(noise, exits, targets)
    committed, exit_input = out.committed[0], out.exit_input[0]

    starts = jnp.arange(n, dtype=jnp.int32) * F
    context = jax.tree.map(lambda a: a[0], cond.text_kv)
    condition, block_actions = cond.condition[0], jax.tree.map(lambda a: a[0], cond.actions)
    everything = jnp.ones(n, bool)
    clean = jax.jit(lambda p: nnx.merge(graphdef, p).transformer.forward_blocks(
        committed, jnp.zeros(n), starts, context, attention=MaskedAttention(block_causal_mask(MG, starts, everything)),
        condition=condition, actions=block_actions, action_mask=block_causal_action_mask(MG, starts, everything)))(
        jax.lax.stop_gradient(params))
    # Block i's visible clean tokens: the mask's row for a noisy copy of block i.
    full = block_causal_mask(MG, jnp.concatenate([starts, starts]), jnp.arange(2 * n) < n)

    @jax.jit
    @jax.value_and_grad
    def exit_loss(p, x, t, sigma, start, mask, block_condition, block_inputs, ring, target):
        y = nnx.merge(graphdef, p).transformer(x, t, start, context, attention=DenseAttention(clean.k, clean.v, mask),
                                               condition=block_condition, actions=block_inputs, action_history=ring)
        return jnp.sum(jnp.square(x - sigma * y.video - target) * probe)

    ring = init_action_cache(MG)
    # Sliced and summed on the host: eagerly, every slice and every leaf shape's zeros, add, abs and max compiled
    # its own program.
    host = jax.device_get((exit_input, starts, full, condition, block_actions, targets, clean.action_kv))
    exit_input, starts, full, condition, block_actions, targets, clean_action_kv = host
    dense_value, dense_grad = 0.0, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), params)
    device = jax.devices()[0]
    for i in range(n):
        t = schedule.timesteps[int(exits[i])]
        # Committed to the device: the first block's fresh ring (and host slices) are uncommitted, later rings
        # committed, and that difference alone compiled exit_loss a second time.
        args = jax.device_put((exit_input[i], np.float32(t), np.float32(t / schedule.num_train_timesteps),
                               starts[i], full[(n + i) * tokens, :n * tokens], condition[i],
                               jax.tree.map(lambda a: a[i], block_actions), ring, targets[i]), device)
        value, grad = exit_loss(params, *args)
        dense_value, dense_grad = dense_value + float(value), jax.tree.map(np.add, dense_grad, jax.device_get(grad))
        ring = commit_action_cache(MG, ring, _block_kv(clean_action_kv, i), starts[i])

    np.testing.assert_allclose(float(dense_value), float(paged_value), rtol=1e-5)
    leaves = list(zip(jax.tree.leaves(dense_grad), jax.device_get(jax.tree.leaves(paged_grad)), strict=True))
    assert sum(float(np.abs(b).max()) > 0 for _, b in leaves) > len(leaves) // 2  # the gradient reaches the network
    for a, b in leaves:  # gradients up to ~30: float32 summation order gives ~2e-6
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_forward_blocks_refuses_action_networks_without_their_inputs(mg_modules):
    model = mg_modules.transformer
    x = jnp.zeros((2,) + MG.block_shape)
    context = (jnp.zeros((MG.num_layers, MG.text_len, MG.num_heads, MG.head_dim)),) * 2
    condition = jnp.zeros((2, F, MG.in_channels - MG.latent_channels, MG.latent_height, MG.latent_width))
    attention = MaskedAttention(jnp.ones((2 * F * MG.tokens_per_frame,) * 2, bool))
    with pytest.raises(ValueError, match="condition must be"):
        model.forward_blocks(x, jnp.zeros(2), jnp.zeros(2, jnp.int32), context, attention=attention)
    with pytest.raises(ValueError, match="action_mask"):
        model.forward_blocks(x, jnp.zeros(2), jnp.zeros(2, jnp.int32), context, attention=attention,
                             condition=condition)
