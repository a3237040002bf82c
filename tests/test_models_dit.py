"""CausalDiT building blocks, configs and presets (shape-only for the 1.3B preset)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ardiff_jax import ARDiffusionKVCacheSpec
from ardiff_jax.geometries import wan_1_3b as wan_geometry
from ardiff_jax.models import (
    CausalDiT,
    CausalDiTConfig,
    DenseAttention,
    WorldPipeline,
    WorldPipelineConfig,
    dit_preset,
    tokenize_prompt,
)
from ardiff_jax.models._common import DiTModules
from ardiff_jax.models._dit import apply_rope, patchify, rope_rotation, unpatchify

GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_size", "tokens_per_frame", "frames_per_block", "window_frames",
                   "sink_frames", "reset_at_boundary", "kv_branches", "cross_attention",
                   "max_scratch_tokens_per_branch", "session_capacity")


def test_wan_1_3b_shape_only_params_and_spec():
    config = dit_preset("wan_1_3b")
    assert (config.tokens_per_frame, config.head_dim) == (1560, 128)
    abstract = nnx.eval_shape(lambda: CausalDiT(config, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params))
    # Wan2.1-T2V-1.3B: 30 blocks of (8 dim^2 attention + 2 dim*ffn) plus embeddings ~ 1.42e9.
    assert 1.38e9 < abstract.num_params < 1.46e9
    assert nnx.state(abstract.blocks, nnx.Param)["self_attn"]["q"]["kernel"].shape == (30, 1536, 1536)
    spec = WorldPipeline.kv_spec_for(config, WorldPipelineConfig(session_capacity=8))
    expected = wan_geometry()
    assert {f: getattr(spec, f) for f in GEOMETRY_FIELDS} == {f: getattr(expected, f) for f in GEOMETRY_FIELDS}
    assert isinstance(spec, ARDiffusionKVCacheSpec)


def test_medium_preset_geometry():
    config = dit_preset("medium")
    assert (config.num_layers, config.num_heads, config.head_dim, config.tokens_per_frame) == (8, 4, 128, 220)
    assert config.grid == (11, 20)


@pytest.mark.parametrize("field, value, message", [
    ("dim", 33, "multiple of num_heads"),
    ("latent_height", 7, "multiple of patch_size"),
    ("frames_per_block", 6, "must not exceed window_frames"),
    ("num_register_tokens", 0, "both be zero or both positive"),
    ("num_layers", 0, "num_layers must be a positive integer"),
    ("num_layers", True, "num_layers must be a positive integer"),
    ("sink_frames", -1, "sink_frames must be a non-negative integer"),
    ("dtype", "not-a-dtype", "is not a dtype"),
])
def test_config_rejects_bad_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(dit_preset("tiny"), **{field: value})


def test_patchify_round_trip():
    x = jnp.arange(2 * 4 * 8 * 6, dtype=jnp.float32).reshape(2, 4, 8, 6)
    tokens = patchify(x, 2)
    assert tokens.shape == (2 * 4 * 3, 16)
    assert jnp.array_equal(unpatchify(tokens, 2, 4, 8, 6, 2), x)
    # Token (frame 1, row 0, col 2) holds channel 0's 2x2 patch at rows 0-1, cols 4-5.
    assert jnp.array_equal(tokens[12 + 2, :4], x[1, 0, 0:2, 4:6].reshape(-1))


@settings(max_examples=25, deadline=None)
@given(shift=st.integers(0, 3_000_000), qi=st.integers(0, 15), ki=st.integers(0, 15))
def test_rope_scores_depend_only_on_relative_frame(shift, qi, ki):
    """Keys are cached rotated at absolute frames: shifting every frame index leaves q.k unchanged."""
    config = dit_preset("tiny")
    rng = np.random.default_rng(qi * 16 + ki)
    q = jnp.asarray(rng.standard_normal((2 * config.tokens_per_frame, 2, config.head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2 * config.tokens_per_frame, 2, config.head_dim)), jnp.float32)

    def scores(start):
        rotation = rope_rotation(config, jnp.int32(start), 2)
        return jnp.einsum("hd,hd->h", apply_rope(q, rotation)[qi], apply_rope(k, rotation)[16 + ki])

    np.testing.assert_allclose(scores(0), scores(shift), rtol=2e-4, atol=2e-4)
    # ... and it is not position-blind: the frame axis rotates something.
    cos, _ = rope_rotation(config, jnp.int32(0), 2)
    assert not np.allclose(cos[0], cos[config.tokens_per_frame])


def test_tokenizer_truncates_pads_and_distinguishes_prompts():
    assert tokenize_prompt("ab", 4).tolist() == [98, 99, 0, 0]
    assert tokenize_prompt("abcdef", 4).tolist() == [98, 99, 100, 101]
    with pytest.raises(TypeError):
        tokenize_prompt(None, 4)


def test_module_forward_shapes_and_conditioning():
    config = dit_preset("tiny")
    graphdef, params = nnx.split(DiTModules.create(config, 0))
    latents = jnp.asarray(np.random.default_rng(0).standard_normal(config.block_shape), jnp.float32)
    registers = jnp.zeros((config.num_register_tokens, config.register_dim))

    @jax.jit
    def forward(params, text_sign, frame_start):
        model = nnx.merge(graphdef, params).transformer
        text_kv = model.text_cross_kv(text_sign * jnp.ones((config.text_len, config.text_dim)))
        image_kv = model.image_cross_kv(jnp.ones((config.image_len, config.patch_dim)))
        attention = DenseAttention.empty(config.num_layers, config.num_heads, config.head_dim,
                                         2 * config.tokens_per_frame)
        return model(latents, jnp.float32(500.0), frame_start, text_kv, image_kv, registers, attention=attention)

    out = forward(params, 1.0, 3)
    assert out.video.shape == config.block_shape
    assert out.registers.shape == (config.num_register_tokens, config.register_dim)
    assert out.k.shape == (config.num_layers, config.frames_per_block * config.tokens_per_frame, config.num_heads,
                           config.head_dim)
    # Conditioning matters: another prompt or another frame offset changes the prediction.
    assert not np.allclose(out.video, forward(params, -1.0, 3).video)
    assert not np.allclose(out.video, forward(params, 1.0, 4).video)
    model = nnx.merge(graphdef, params).transformer
    with pytest.raises(ValueError, match="latents must be"):
        model(latents[:, :2], jnp.float32(0.0), jnp.int32(0), (out.k, out.v),
              attention=DenseAttention.empty(config.num_layers, config.num_heads, config.head_dim))


def test_config_is_frozen_and_hashable():
    config = dit_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dim = 64  # type: ignore[misc]
    assert hash(config) == hash(dit_preset("tiny"))
    assert isinstance(config, CausalDiTConfig)
    with pytest.raises(KeyError, match="unknown CausalDiT preset"):
        dit_preset("huge")


def test_controls_condition_every_token_of_their_frame_through_the_modulation():
    # A control-conditioned model (the SpriteWorld preset's design): per-frame controls reach
    # every token through adaLN, so different controls change the prediction everywhere a
    # token could read them, independent of its position; missing or unexpected controls are refused.
    config = dit_preset("tiny").replace(control_dim=3, image_len=0)
    graphdef, params = nnx.split(DiTModules.create(config, 0))
    latents = jnp.asarray(np.random.default_rng(0).standard_normal(config.block_shape), jnp.float32)
    registers = jnp.zeros((config.num_register_tokens, config.register_dim))

    @jax.jit
    def forward(params, controls):
        model = nnx.merge(graphdef, params).transformer
        text_kv = model.text_cross_kv(jnp.ones((config.text_len, config.text_dim)))
        attention = DenseAttention.empty(config.num_layers, config.num_heads, config.head_dim)
        return model(latents, jnp.float32(500.0), jnp.int32(0), text_kv, None, registers, controls,
                     attention=attention).video

    f = config.frames_per_block
    base = forward(params, jnp.zeros((f, 3)))
    changed = forward(params, jnp.zeros((f, 3)).at[:, 1].set(1.0))
    assert base.shape == config.block_shape
    # Every token (every frame, every patch) sees the control.
    per_token = np.abs(np.asarray(changed - base)).reshape(f, config.latent_channels, *config.grid, -1).max(
        axis=(1, -1))
    assert (per_token > 1e-4).all()
    model = nnx.merge(graphdef, params).transformer
    text_kv = model.text_cross_kv(jnp.ones((config.text_len, config.text_dim)))
    attention = DenseAttention.empty(config.num_layers, config.num_heads, config.head_dim)
    with pytest.raises(ValueError, match=r"controls must be \[2, 3\]"):
        model(latents, jnp.float32(0.0), jnp.int32(0), text_kv, None, registers, attention=attention)
    with pytest.raises(ValueError, match=r"controls must be \[2, 3\]"):
        model(latents, jnp.float32(0.0), jnp.int32(0), text_kv, None, registers, jnp.zeros((1, 3)),
              attention=attention)
    plain = nnx.merge(*nnx.split(DiTModules.create(dit_preset("tiny").replace(image_len=0), 0))).transformer
    with pytest.raises(ValueError, match="no control conditioning"):
        plain(latents, jnp.float32(0.0), jnp.int32(0), text_kv, None, registers, jnp.zeros((f, 3)),
              attention=attention)


def test_clean_estimate_of_each_prediction():
    from ardiff_jax.models import clean_estimate

    rng = np.random.default_rng(1)
    out, x_t, previous = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4, 4), (2, 3, 4, 4), (3, 4, 4)))
    np.testing.assert_allclose(clean_estimate(out, x_t, 0.25, None, "flow"), x_t - 0.25 * out)
    np.testing.assert_array_equal(clean_estimate(out, x_t, 0.25, None, "x0"), out)
    np.testing.assert_allclose(clean_estimate(out, x_t, 1.0, previous, "delta"), previous[None] + out)
    with pytest.raises(ValueError, match="needs the previous frame"):
        clean_estimate(out, x_t, 1.0, None, "delta")
    with pytest.raises(ValueError, match="prediction must be one of"):
        clean_estimate(out, x_t, 1.0, previous, "eps")
