"""``CausalDiT``: a Wan-style block-causal video transformer in Flax NNX.

Architecture (Wan2.1, as the causal variants of Self-Forcing/CausVid/LongLive run it):

* latent frames ``[f, C, H, W]`` -> tokens with a ``p x p`` spatial patch (Wan's Conv3d with
  kernel ``(1, p, p)`` is a linear map of each patch);
* per block: adaLN modulation from the timestep (shift/scale/gate for self-attention and
  FFN), self-attention with q/k RMS-norm and 3-D rotary positions, cross-attention to the
  text tokens (plus image tokens for I2V, summed as in Wan I2V), GELU FFN;
* a modulated final head back to latent patches.

Causal-specific parts:

* RoPE is applied to q and k **before** the block's K/V leave the layer, with the frame
  axis at the *absolute* frame index (``frame_start + i``), so cached keys never need
  re-rotation when the window slides (Self-Forcing caches rotated keys the same way);
* self-attention goes through an attention backend (:mod:`ardiff_jax.models._attention`):
  the runtime's paged view or the dense reference; the current block's per-layer K/V are
  returned (``[L, f*T, H, D]``) so a committing forward can hand them to the runtime;
* optional register tokens (action/state/control) travel with the block through every
  layer: their queries see the same keys as the video tokens and their K/V are passed as
  ``extra_k/extra_v`` (scratch, never cached). They are not rotated (no spatial position).
* optional per-frame **controls** (``config.control_dim``, e.g. a one-hot action) condition
  every token of their frame through the adaLN modulation: an MLP embedding of the control
  is added to the timestep embedding before the block and head modulations are projected
  from it, so each token reads the action from its own modulation, independent of where it
  sits. Registers cannot offer that: a token's attention score to an unrotated register
  depends on the token's own RoPE rotation, i.e. on its position (``docs/models.md``
  measures the difference).

The layers are stacked (``nnx.vmap`` at construction) and run with ``jax.lax.scan``, so
compile time does not grow with depth. Cross-attention K/V are projected once per prompt
(:meth:`CausalDiT.text_cross_kv`) and passed in per call, stacked ``[L, N, H, D]``.

Departures from Wan made on purpose: random init everywhere (there are no checkpoints on
this machine; Wan zero-initialises the output head, which would make every prediction 0),
and a fixed, deterministic byte-level "text encoder" (:class:`ByteTextEncoder`) instead of
umT5, so prompts matter without downloads.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.models._attention import SelfAttentionBackend, dot_attention
from ardiff_jax.models._config import CausalDiTConfig

__all__ = ["CausalDiT", "DiTOutput", "ByteTextEncoder", "tokenize_prompt", "patchify", "unpatchify",
           "rope_rotation", "apply_rope", "timestep_embedding"]

_F32 = jnp.float32


class DiTOutput(NamedTuple):
    """One forward of :class:`CausalDiT`.

    Attributes:
      video: ``f32[f, C, H, W]`` the flow (velocity) prediction of the block.
      registers: ``f32[E, register_dim]`` the register-token head output, or ``None``.
      k: ``[L, f*T, H, D]`` the block's self-attention keys (RoPE applied), every layer.
      v: ``[L, f*T, H, D]`` the block's self-attention values.
    """

    video: jax.Array
    registers: jax.Array | None
    k: jax.Array
    v: jax.Array


# -- pure helpers ------------------------------------------------------------------------------


def patchify(latents: jax.Array, patch: int) -> jax.Array:
    """``[f, C, H, W]`` -> ``[f * (H/p) * (W/p), C*p*p]`` (frame-major, then row, then column)."""
    f, c, h, w = latents.shape
    x = latents.reshape(f, c, h // patch, patch, w // patch, patch)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(f * (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: jax.Array, frames: int, channels: int, height: int, width: int, patch: int) -> jax.Array:
    """Inverse of :func:`patchify`: ``[f*T, C*p*p]`` -> ``[f, C, H, W]``."""
    x = tokens.reshape(frames, height // patch, width // patch, channels, patch, patch)
    x = x.transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(frames, channels, height, width)


#: Rows of the host-built float64 tables below: one level of a base-1024 position (or timestep) split.
_TABLE_ROWS = 1024


@functools.lru_cache(maxsize=64)
def _sinusoid_table(dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(freqs f32[dim/2], cos f32[1024, dim/2], sin f32[1024, dim/2])``: the angles ``n * freq`` of
    integer timesteps ``n`` evaluated in float64 on the host, as Wan evaluates its sinusoid."""
    half = dim // 2
    freqs = np.power(10000.0, -np.arange(half, dtype=np.float64) / half)
    angles = np.outer(np.arange(_TABLE_ROWS, dtype=np.float64), freqs)
    return freqs.astype(np.float32), np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def timestep_embedding(dim: int, timestep: jax.Array) -> jax.Array:
    """Wan's sinusoidal embedding: ``f32[...]`` timesteps -> ``f32[..., dim]`` = ``[cos, sin]``.

    Wan evaluates ``cos(t * freq)`` in float64; in float32 the angle alone is off by up to
    ``6e-5`` at ``t = 1000``. Here ``t = n + r`` with ``n = floor(t)``: the angles of ``n``
    come from a float64 table built on the host and the small remainder ``r * freq`` is
    exact enough in float32, combined by the angle-addition formula, so the result is
    float64's within 3e-7 (``tests/test_wan_numerics.py``).
    """
    freqs, cos_table, sin_table = _sinusoid_table(dim)
    t = jnp.asarray(timestep, _F32)
    whole = jnp.clip(jnp.floor(t), 0, _TABLE_ROWS - 1)
    rest = (t - whole)[..., None] * freqs
    index = whole.astype(jnp.int32)
    cos_n, sin_n = jnp.take(cos_table, index, axis=0), jnp.take(sin_table, index, axis=0)
    cos_r, sin_r = jnp.cos(rest), jnp.sin(rest)
    return jnp.concatenate([cos_n * cos_r - sin_n * sin_r, sin_n * cos_r + cos_n * sin_r], axis=-1)


#: Base-1024 levels of a frame position: frames up to ``1024**3`` rotate exactly.
_ROPE_LEVELS = 3


@functools.lru_cache(maxsize=64)
def _rope_table(axis_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin) f32[levels, 1024, axis_dim/2]``: RoPE angles of ``n * 1024**level`` in float64.

    Wan builds its rotary table in float64 (complex128) on the host; position ``p`` is
    rotated by the product of its base-1024 digits' rotations, each exact to float32.
    """
    inv_freq = 1.0 / np.power(float(theta), np.arange(0, axis_dim, 2, dtype=np.float64) / axis_dim)
    digits = np.arange(_TABLE_ROWS, dtype=np.float64)
    angles = np.stack([np.outer(digits * float(_TABLE_ROWS) ** level, inv_freq) for level in range(_ROPE_LEVELS)])
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotation_at(positions: jax.Array, axis_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``i32[N]`` positions -> ``(cos, sin) f32[N, axis_dim/2]`` from the float64 tables."""
    cos_table, sin_table = _rope_table(axis_dim, theta)
    positions = jnp.asarray(positions, jnp.int32)
    cos, sin = None, None
    for level in range(_ROPE_LEVELS):
        digit = (positions // (_TABLE_ROWS ** level)) % _TABLE_ROWS
        c, s = jnp.take(cos_table[level], digit, axis=0), jnp.take(sin_table[level], digit, axis=0)
        cos, sin = (c, s) if cos is None else (cos * c - sin * s, sin * c + cos * s)
    return cos, sin


def rope_rotation(config: CausalDiTConfig, frame_start: jax.Array, num_frames: int) -> tuple[jax.Array, jax.Array]:
    """The rotation ``(cos, sin)``, each ``f32[f*T, D/2]``, of a block's tokens.

    Token ``(i, r, c)`` of the block is at frame ``frame_start + i`` (absolute: keys are
    cached rotated), row ``r``, column ``c``; each axis rotates its own slice of the head
    (Wan's ``d - 4*(d//6)``, ``2*(d//6)``, ``2*(d//6)`` channel split).
    """
    rows, cols = config.grid
    d_t, d_h, d_w = config.rope_axes
    theta = config.rope_theta
    frame_cos, frame_sin = _rotation_at(jnp.asarray(frame_start, jnp.int32) + jnp.arange(num_frames), d_t, theta)
    row_cos, row_sin = _rotation_at(jnp.arange(rows), d_h, theta)
    col_cos, col_sin = _rotation_at(jnp.arange(cols), d_w, theta)

    def grid(frame: jax.Array, row: jax.Array, col: jax.Array) -> jax.Array:
        shape = (num_frames, rows, cols)
        parts = [jnp.broadcast_to(frame[:, None, None, :], (*shape, frame.shape[-1])),
                 jnp.broadcast_to(row[None, :, None, :], (*shape, row.shape[-1])),
                 jnp.broadcast_to(col[None, None, :, :], (*shape, col.shape[-1]))]
        return jnp.concatenate(parts, axis=-1).reshape(num_frames * rows * cols, -1)

    return grid(frame_cos, row_cos, col_cos), grid(frame_sin, row_sin, col_sin)


def apply_rope(x: jax.Array, rotation: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate consecutive (interleaved) channel pairs of ``x [N, H, D]`` by ``rotation = (cos, sin)``,
    each ``[N, D/2]`` (Wan's complex multiply of pairs)."""
    n, h, d = x.shape
    pairs = x.astype(_F32).reshape(n, h, d // 2, 2)
    cos, sin = rotation[0][:, None, :], rotation[1][:, None, :]
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(n, h, d).astype(x.dtype)


def _layer_norm(x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm without affine parameters, in float32 (Wan's norm1/norm2/head norm)."""
    xf = x.astype(_F32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return (xf - mean) * jax.lax.rsqrt(var + eps)


# -- modules -------------------------------------------------------------------------------


#: Mesh axis of tensor parallelism: attention heads and the FFN hidden layer split over it.
TP = "tp"


def _partitioned(init: Any, names: tuple[str | None, ...] | None) -> Any:
    # Annotations only (no mesh needed at construction): a pipeline places the weights on a
    # mesh later (PipelineBase.shard_ar_diffusion_model), reading them with nnx.get_partition_spec.
    return init if names is None else nnx.with_partitioning(init, names, eager_sharding=False)


def _linear(config: CausalDiTConfig, din: int, dout: int, rngs: nnx.Rngs, split: str | None = None) -> nnx.Linear:
    """A Wan linear layer; ``split`` is its tensor-parallel role.

    ``"column"``: outputs (heads, FFN hidden) split over ``"tp"``; ``"row"``: inputs split,
    so XLA sums the partial products across ``"tp"`` (Megatron's pairing: one all-reduce
    per attention and per FFN).
    """
    # Wan initialises linear layers with Xavier-uniform weights and zero biases.
    kernel_names, bias_names = {None: (None, None), "column": ((None, TP), (TP,)), "row": ((TP, None), None)}[split]
    return nnx.Linear(din, dout, dtype=config.dtype, param_dtype=config.param_dtype,
                      kernel_init=_partitioned(nnx.initializers.xavier_uniform(), kernel_names),
                      bias_init=_partitioned(nnx.initializers.zeros_init(), bias_names), rngs=rngs)


class RMSNorm(nnx.Module):
    """RMS norm over the last axis with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float, param_dtype: str, split: bool = False) -> None:
        self.eps = eps
        # A norm over q or k (heads x head_dim) is split with the heads; XLA reduces across "tp".
        annotation = {"out_sharding": (TP,), "eager_sharding": False} if split else {}
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), **annotation)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_F32)
        out = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return (out * self.weight[...].astype(_F32)).astype(x.dtype)


class AffineLayerNorm(nnx.Module):
    """LayerNorm with scale and bias (Wan's ``norm3`` before cross-attention, the image MLP norms)."""

    def __init__(self, dim: int, eps: float, param_dtype: str) -> None:
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        out = _layer_norm(x, self.eps) * self.scale[...].astype(_F32) + self.bias[...].astype(_F32)
        return out.astype(x.dtype)


class SelfAttention(nnx.Module):
    """Block-causal self-attention: q/k RMS-norm, 3-D RoPE on video tokens, attention via a backend."""

    def __init__(self, config: CausalDiTConfig, rngs: nnx.Rngs) -> None:
        dim = config.dim
        self.config = config
        self.q = _linear(config, dim, dim, rngs, "column")
        self.k = _linear(config, dim, dim, rngs, "column")
        self.v = _linear(config, dim, dim, rngs, "column")
        self.o = _linear(config, dim, dim, rngs, "row")
        self.norm_q = RMSNorm(dim, config.eps, config.param_dtype, split=True)
        self.norm_k = RMSNorm(dim, config.eps, config.param_dtype, split=True)

    def __call__(
        self,
        x: jax.Array,  # [V + E, dim]: video tokens then register tokens
        num_video: int,  # V (static)
        rotation: tuple[jax.Array, jax.Array],  # (cos, sin) f32[V, D/2] each
        layer: jax.Array,  # i32[]
        attention: SelfAttentionBackend,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        cfg = self.config
        s = x.shape[0]
        heads, head_dim = cfg.num_heads, cfg.head_dim
        q = self.norm_q(self.q(x)).reshape(s, heads, head_dim)
        k = self.norm_k(self.k(x)).reshape(s, heads, head_dim)
        v = self.v(x).reshape(s, heads, head_dim)
        # Rotate before the K/V leave the layer: the cache holds rotated keys at absolute
        # frame positions, so history never needs re-rotation when the window slides.
        q_video = apply_rope(q[:num_video], rotation)
        k_video = apply_rope(k[:num_video], rotation)
        v_video = v[:num_video]
        if s > num_video:
            q_all = jnp.concatenate([q_video, q[num_video:]])
            extra_k, extra_v = k[num_video:], v[num_video:]
        else:
            q_all, extra_k, extra_v = q_video, None, None
        out = attention.attend(layer, q_all, k_video, v_video, extra_k=extra_k, extra_v=extra_v,
                               scale=1.0 / math.sqrt(head_dim))
        return self.o(out.reshape(s, cfg.dim)), (k_video, v_video)


class CrossAttention(nnx.Module):
    """Cross-attention to precomputed text (and optional image) K/V; Wan I2V sums the two."""

    def __init__(self, config: CausalDiTConfig, rngs: nnx.Rngs) -> None:
        dim = config.dim
        self.config = config
        self.q = _linear(config, dim, dim, rngs, "column")
        self.k = _linear(config, dim, dim, rngs, "column")
        self.v = _linear(config, dim, dim, rngs, "column")
        self.o = _linear(config, dim, dim, rngs, "row")
        self.norm_q = RMSNorm(dim, config.eps, config.param_dtype, split=True)
        self.norm_k = RMSNorm(dim, config.eps, config.param_dtype, split=True)
        if config.image_len:
            self.k_img = _linear(config, dim, dim, rngs, "column")
            self.v_img = _linear(config, dim, dim, rngs, "column")
            self.norm_k_img = RMSNorm(dim, config.eps, config.param_dtype, split=True)

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[0], self.config.num_heads, self.config.head_dim)

    def project_text(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``context [N, dim]`` -> ``(k, v)`` each ``[N, H, D]``: what the text cache stores."""
        return self._heads(self.norm_k(self.k(context))), self._heads(self.v(context))

    def project_image(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``context [Ni, dim]`` -> ``(k, v)`` each ``[Ni, H, D]``: what the image cache stores."""
        return self._heads(self.norm_k_img(self.k_img(context))), self._heads(self.v_img(context))

    def __call__(self, x: jax.Array, text_kv: tuple[jax.Array, jax.Array],
                 image_kv: tuple[jax.Array, jax.Array] | None) -> jax.Array:
        q = self._heads(self.norm_q(self.q(x)))
        out = dot_attention(q, *text_kv)
        if image_kv is not None:
            out = out + dot_attention(q, *image_kv)
        return self.o(out.reshape(x.shape[0], self.config.dim))


class DiTBlock(nnx.Module):
    """One Wan attention block with adaLN modulation (shift/scale/gate for attention and FFN)."""

    def __init__(self, config: CausalDiTConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        scale = 1.0 / math.sqrt(config.dim)
        self.modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (6, config.dim), _F32) * scale).astype(config.param_dtype))
        self.self_attn = SelfAttention(config, rngs)
        self.norm3 = AffineLayerNorm(config.dim, config.eps, config.param_dtype)
        self.cross_attn = CrossAttention(config, rngs)
        self.ffn_in = _linear(config, config.dim, config.ffn_dim, rngs, "column")
        self.ffn_out = _linear(config, config.ffn_dim, config.dim, rngs, "row")

    def __call__(
        self,
        x: jax.Array,  # f32[V + E, dim]: the residual stream stays float32, as in Wan
        e0: jax.Array,  # f32[6, dim] (one timestep) or f32[V + E, 6, dim] (one per token)
        num_video: int,
        rotation: tuple[jax.Array, jax.Array],  # (cos, sin) f32[V, D/2] each
        layer: jax.Array,  # i32[]
        attention: SelfAttentionBackend,
        text_kv: tuple[jax.Array, jax.Array],  # [N, H, D] each
        image_kv: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        cfg = self.config
        eps = cfg.eps
        mod = self.modulation[...].astype(_F32) + e0
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (mod[..., i, :] for i in range(6))
        h = (_layer_norm(x, eps) * (1 + scale_msa) + shift_msa).astype(cfg.dtype)
        y, block_kv = self.self_attn(h, num_video, rotation, layer, attention)
        x = x + y.astype(_F32) * gate_msa
        x = x + self.cross_attn(self.norm3(x).astype(cfg.dtype), text_kv, image_kv).astype(_F32)
        h = (_layer_norm(x, eps) * (1 + scale_mlp) + shift_mlp).astype(cfg.dtype)
        y = self.ffn_out(jax.nn.gelu(self.ffn_in(h), approximate=True))
        x = x + y.astype(_F32) * gate_mlp
        return x, block_kv


class CausalDiT(nnx.Module):
    """Wan-style block-causal video DiT (see the module docstring).

    Example::

        model = CausalDiT(dit_preset("tiny"), rngs=nnx.Rngs(0))
        text_kv = model.text_cross_kv(text_features)                       # [L, N, H, D] x 2
        out = model(latents, jnp.float32(500.0), jnp.int32(0), text_kv,
                    attention=DenseAttention.empty(L, H, D))
        out.video, out.k  # flow prediction [f, C, H, W]; block keys [L, f*T, H, D]
    """

    def __init__(self, config: CausalDiTConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, CausalDiTConfig):
            raise TypeError(f"config must be a CausalDiTConfig, got {type(config).__name__}")
        self.config = config
        dim = config.dim
        self.patch_embedding = _linear(config, config.patch_dim, dim, rngs)
        self.text_in = _linear(config, config.text_dim, dim, rngs)
        self.text_out = _linear(config, dim, dim, rngs)
        self.time_in = _linear(config, config.freq_dim, dim, rngs)
        self.time_out = _linear(config, dim, dim, rngs)
        self.time_projection = _linear(config, dim, 6 * dim, rngs)
        if config.image_len:
            # Wan's MLPProj over CLIP features; here over the stand-in image features (patch features).
            self.image_norm_in = AffineLayerNorm(config.patch_dim, config.eps, config.param_dtype)
            self.image_in = _linear(config, config.patch_dim, dim, rngs)
            self.image_out = _linear(config, dim, dim, rngs)
            self.image_norm_out = AffineLayerNorm(dim, config.eps, config.param_dtype)
        if config.control_dim:
            self.control_in = _linear(config, config.control_dim, dim, rngs)
            self.control_out = _linear(config, dim, dim, rngs)
        if config.num_register_tokens:
            self.register_in = _linear(config, config.register_dim, dim, rngs)
            self.register_pos = nnx.Param(
                (jax.random.normal(rngs.params(), (config.num_register_tokens, dim), _F32) / math.sqrt(dim))
                .astype(config.param_dtype))
            self.register_head = _linear(config, dim, config.register_dim, rngs)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})  # layers: not split
        def make_blocks(rngs: nnx.Rngs) -> DiTBlock:
            return DiTBlock(config, rngs)

        self.blocks = make_blocks(rngs)
        self.head_modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (2, dim), _F32) / math.sqrt(dim)).astype(config.param_dtype))
        self.head = _linear(config, dim, config.patch_dim, rngs)

    # -- context projections (run once per prompt / conditioning image) ----------------------
    def embed_text(self, text_features: jax.Array) -> jax.Array:
        """``[N, text_dim]`` -> ``[N, dim]`` (Wan's text_embedding MLP)."""
        return self.text_out(jax.nn.gelu(self.text_in(text_features), approximate=True))

    def embed_image(self, image_features: jax.Array) -> jax.Array:
        """``[Ni, patch_dim]`` -> ``[Ni, dim]`` (Wan's img_emb MLPProj)."""
        if not self.config.image_len:
            raise ValueError("this CausalDiT has no image branch (config.image_len == 0)")
        h = self.image_in(self.image_norm_in(image_features))
        return self.image_norm_out(self.image_out(jax.nn.gelu(h, approximate=False)))

    def _per_layer(self, fn: Any) -> tuple[jax.Array, jax.Array]:
        graphdef, stacked = nnx.split(self.blocks)
        return jax.vmap(lambda state: fn(nnx.merge(graphdef, state).cross_attn))(stacked)

    def text_cross_kv(self, text_features: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's text cross-attention K/V: ``[N, text_dim]`` -> ``([L, N, H, D], [L, N, H, D])``."""
        context = self.embed_text(text_features)
        return self._per_layer(lambda attn: attn.project_text(context))

    def image_cross_kv(self, image_features: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's image cross-attention K/V: ``[Ni, patch_dim]`` -> ``[L, Ni, H, D]`` x 2."""
        context = self.embed_image(image_features)
        return self._per_layer(lambda attn: attn.project_image(context))

    # -- the pieces every forward shares ---------------------------------------------------------
    def _time(self, timestep: jax.Array, controls: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Timesteps (and controls) -> ``(e f32[..., dim], e0 f32[..., 6, dim])``: head and block modulation.

        ``timestep`` is ``f32[...]``; ``controls`` (control-conditioned models only) is
        ``f32[..., control_dim]`` with the same leading shape or one that broadcasts
        against it: its embedding is added to the timestep embedding, so the controls
        reach every modulation the timestep does.
        """
        cfg = self.config
        e = self.time_out(jax.nn.silu(self.time_in(timestep_embedding(cfg.freq_dim, timestep).astype(cfg.dtype))))
        e = e.astype(_F32)
        if controls is not None:
            e = e + self._embed_controls(controls)
        e0 = self.time_projection(jax.nn.silu(e).astype(cfg.dtype)).astype(_F32)
        return e, e0.reshape(*e.shape[:-1], 6, cfg.dim)

    def _embed_controls(self, controls: jax.Array) -> jax.Array:
        """``f32[..., control_dim]`` -> ``f32[..., dim]`` (an MLP like the timestep's)."""
        cfg = self.config
        h = jax.nn.silu(self.control_in(controls.astype(cfg.dtype)))
        return self.control_out(h).astype(_F32)

    def _check_controls(self, controls: jax.Array | None, leading: tuple[int, ...]) -> None:
        cfg = self.config
        expected = (*leading, cfg.control_dim)
        if not cfg.control_dim:
            if controls is not None:
                raise ValueError("this CausalDiT has no control conditioning (config.control_dim == 0); "
                                 "controls must be None")
            return
        if controls is None or tuple(controls.shape) != expected:
            got = None if controls is None else tuple(controls.shape)
            raise ValueError(f"this CausalDiT is control-conditioned: controls must be {list(expected)} "
                             f"(one control vector per frame), got {got}")

    def _check_latents(self, latents: jax.Array, leading: int) -> None:
        cfg = self.config
        expected = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        if latents.ndim != leading + 3 or tuple(latents.shape[leading:]) != expected:
            lead = "B, f" if leading == 2 else "f"
            raise ValueError(f"latents must be [{lead}, {expected[0]}, {expected[1]}, {expected[2]}], "
                             f"got {latents.shape}")

    def _embed_registers(self, registers: jax.Array) -> jax.Array:
        """``[..., E, register_dim]`` -> ``f32[..., E, dim]`` (linear map plus a learned per-slot position)."""
        cfg = self.config
        if not cfg.num_register_tokens:
            raise ValueError("this CausalDiT has no register tokens (config.num_register_tokens == 0)")
        if registers.shape[-2:] != (cfg.num_register_tokens, cfg.register_dim):
            raise ValueError(
                f"registers must be [..., {cfg.num_register_tokens}, {cfg.register_dim}], got {registers.shape}")
        return self.register_in(registers.astype(cfg.dtype)).astype(_F32) + self.register_pos[...].astype(_F32)

    def _layers(self, x: jax.Array, e0: jax.Array, num_video: int, rotation: tuple[jax.Array, jax.Array],
                attention: SelfAttentionBackend, text_kv: tuple[jax.Array, jax.Array],
                image_kv: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Every DiT block over the token stream ``x [V + E, dim]``; returns ``(x, k [L, V, H, D], v)``."""
        graphdef, stacked = nnx.split(self.blocks)

        def layer_step(x: jax.Array, xs: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            layer, state, layer_text, layer_image = xs
            block = nnx.merge(graphdef, state)
            return block(x, e0, num_video, rotation, layer, attention, layer_text, layer_image)

        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        x, (block_k, block_v) = jax.lax.scan(layer_step, x, (layers, stacked, text_kv, image_kv))
        return x, block_k, block_v

    def _head(self, x: jax.Array, e: jax.Array) -> jax.Array:
        """The modulated output head: ``x [S, dim]``, ``e [dim]`` or ``[S, dim]`` -> ``f32[S, C*p*p]``."""
        cfg = self.config
        mod = self.head_modulation[...].astype(_F32) + e[..., None, :]
        shift, scale = mod[..., 0, :], mod[..., 1, :]
        h = (_layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(cfg.dtype)
        return h

    # -- forward -------------------------------------------------------------------------------
    def __call__(
        self,
        latents: jax.Array,  # [f, C, H, W]: noisy (or clean, t = 0) latent frames of the block
        timestep: jax.Array,  # f32[] or f32[f]: diffusion time in [0, 1000], one for the block or one per frame
        frame_start: jax.Array,  # i32[]: absolute index of the block's first frame (RoPE)
        text_kv: tuple[jax.Array, jax.Array],  # [L, N, H, D] each
        image_kv: tuple[jax.Array, jax.Array] | None = None,  # [L, Ni, H, D] each
        registers: jax.Array | None = None,  # [E, register_dim]: action/state/control features
        controls: jax.Array | None = None,  # f32[f, control_dim]: per-frame controls (control_dim > 0)
        *,
        attention: SelfAttentionBackend,
    ) -> DiTOutput:
        """One AR block (inference): history comes from ``attention`` (the paged view or a dense reference).

        A per-frame ``timestep [f]`` modulates each frame's tokens by its own time (Wan's
        ``t [B, F]``; Wan2.2-TI2V keeps a conditioning frame at ``t = 0``).
        """
        cfg = self.config
        self._check_latents(latents, 1)
        frames = latents.shape[0]
        self._check_controls(controls, (frames,))
        if jnp.ndim(timestep) not in (0, 1) or (jnp.ndim(timestep) == 1 and jnp.shape(timestep)[0] != frames):
            raise ValueError(f"timestep must be a scalar or one per frame [{frames}], got shape {jnp.shape(timestep)}")
        num_video = frames * cfg.tokens_per_frame
        x = self.patch_embedding(patchify(latents.astype(cfg.dtype), cfg.patch_size)).astype(_F32)
        if registers is not None:
            if registers.ndim != 2:
                raise ValueError(
                    f"registers must be [{cfg.num_register_tokens}, {cfg.register_dim}], got {registers.shape}")
            x = jnp.concatenate([x, self._embed_registers(registers)])
        if controls is None and jnp.ndim(timestep) == 0:
            e, e0 = self._time(timestep)  # one modulation for every token
        else:
            # Every video token takes its frame's conditioning; register tokens the block's
            # mean (they belong to the block, not to one frame).
            times = jnp.broadcast_to(jnp.asarray(timestep, _F32), (frames,))
            per_frame = None if controls is None else jnp.asarray(controls, _F32)
            if registers is not None:
                times = jnp.concatenate([times, times.mean(keepdims=True)])
                if per_frame is not None:
                    per_frame = jnp.concatenate([per_frame, per_frame.mean(0, keepdims=True)])
            e, e0 = self._time(times, per_frame)
            counts = np.array([cfg.tokens_per_frame] * frames + ([registers.shape[0]] if registers is not None else []))
            e = jnp.repeat(e, counts, axis=0, total_repeat_length=int(counts.sum()))
            e0 = jnp.repeat(e0, counts, axis=0, total_repeat_length=int(counts.sum()))
        rotation = rope_rotation(cfg, frame_start, frames)
        x, block_k, block_v = self._layers(x, e0, num_video, rotation, attention, text_kv, image_kv)
        h = self._head(x, e)
        video = unpatchify(self.head(h[:num_video]).astype(_F32), frames, cfg.latent_channels, cfg.latent_height,
                           cfg.latent_width, cfg.patch_size)
        reg_out = self.register_head(h[num_video:]).astype(_F32) if registers is not None else None
        return DiTOutput(video=video, registers=reg_out, k=block_k, v=block_v)

    def forward_blocks(
        self,
        latents: jax.Array,  # [B, f, C, H, W]: B block instances (e.g. clean context copies and noisy targets)
        timesteps: jax.Array,  # f32[B]: each instance's diffusion time
        frame_starts: jax.Array,  # i32[B]: each instance's absolute first frame (RoPE)
        text_kv: tuple[jax.Array, jax.Array],  # [L, N, H, D] each
        image_kv: tuple[jax.Array, jax.Array] | None = None,  # [L, Ni, H, D] each
        registers: jax.Array | None = None,  # [B, E, register_dim]
        controls: jax.Array | None = None,  # f32[B, f, control_dim]
        *,
        attention: SelfAttentionBackend,
    ) -> DiTOutput:
        """Many block instances in one pass (training mode): the same modules as :meth:`__call__`.

        Tokens are laid out as every instance's video tokens (instance-major), then every
        instance's register tokens; each token is modulated by its own instance's timestep
        and rotated at its own frame position. Which token sees which is entirely the
        backend's business: with :class:`~ardiff_jax.models.MaskedAttention` built by
        :func:`~ardiff_jax.models.block_causal_mask`, instance ``i`` sees exactly what the
        paged runtime shows block ``i`` at inference (sink, sliding window, itself, its
        registers), which is what makes training and cached inference agree.

        Shapes:
          returns: DiTOutput with ``video f32[B, f, C, H, W]``, ``registers f32[B, E, R]`` or
          None, ``k, v [L, B*f*T, H, D]``.
        """
        cfg = self.config
        self._check_latents(latents, 2)
        num_instances, frames = latents.shape[:2]
        self._check_controls(controls, (num_instances, frames))
        tokens = frames * cfg.tokens_per_frame
        num_video = num_instances * tokens
        flat = latents.reshape(num_instances * frames, *latents.shape[2:]).astype(cfg.dtype)
        x = self.patch_embedding(patchify(flat, cfg.patch_size)).astype(_F32)
        times = jnp.asarray(timesteps, _F32)
        if controls is None:
            e, e0 = self._time(times)  # [B, dim], [B, 6, dim]
            e_frames, e0_frames = jnp.repeat(e, frames, axis=0), jnp.repeat(e0, frames, axis=0)
        else:
            controls = jnp.asarray(controls, _F32)
            e_frames, e0_frames = self._time(jnp.repeat(times, frames), controls.reshape(-1, cfg.control_dim))
            if registers is not None:  # the block's mean control, as in __call__
                e, e0 = self._time(times, controls.mean(1))
        e_tokens = jnp.repeat(e_frames, cfg.tokens_per_frame, axis=0)
        e0_tokens = jnp.repeat(e0_frames, cfg.tokens_per_frame, axis=0)
        if registers is not None:
            if registers.ndim != 3 or registers.shape[0] != num_instances:
                raise ValueError(f"registers must be [{num_instances}, {cfg.num_register_tokens}, {cfg.register_dim}], "
                                 f"got {registers.shape}")
            reg = self._embed_registers(registers)  # [B, E, dim]
            x = jnp.concatenate([x, reg.reshape(-1, cfg.dim)])
            num_reg = registers.shape[1]
            e_tokens = jnp.concatenate([e_tokens, jnp.repeat(e, num_reg, axis=0)])
            e0_tokens = jnp.concatenate([e0_tokens, jnp.repeat(e0, num_reg, axis=0)])
        cos, sin = jax.vmap(lambda start: rope_rotation(cfg, start, frames))(jnp.asarray(frame_starts))
        rotation = (cos.reshape(num_video, -1), sin.reshape(num_video, -1))
        x, block_k, block_v = self._layers(x, e0_tokens, num_video, rotation, attention,
                                           text_kv, image_kv)
        h = self._head(x, e_tokens)
        patches = self.head(h[:num_video]).astype(_F32).reshape(num_instances, tokens, cfg.patch_dim)
        video = jax.vmap(lambda p: unpatchify(p, frames, cfg.latent_channels, cfg.latent_height, cfg.latent_width,
                                              cfg.patch_size))(patches)
        reg_out = None
        if registers is not None:
            reg_out = self.register_head(h[num_video:]).astype(_F32).reshape(num_instances, -1, cfg.register_dim)
        return DiTOutput(video=video, registers=reg_out, k=block_k, v=block_v)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(self, nnx.Param)))


# -- the stand-in text encoder -----------------------------------------------------------------


def tokenize_prompt(prompt: str, text_len: int) -> np.ndarray:
    """``i32[text_len]``: UTF-8 bytes + 1, truncated, zero-padded (0 = padding)."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    data = prompt.encode("utf-8")[:text_len]
    ids = np.zeros((text_len,), np.int32)
    ids[: len(data)] = np.frombuffer(data, np.uint8).astype(np.int32) + 1
    return ids


class ByteTextEncoder(nnx.Module):
    """Deterministic stand-in for umT5: a byte embedding table, zeroed at padding positions.

    Wan feeds the DiT umT5 features zero-padded to ``text_len``; this keeps that contract
    (``[text_len, text_dim]``, padding rows zero) with a seeded random table, so different
    prompts give different conditioning without any download.
    """

    def __init__(self, config: CausalDiTConfig, *, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(
            jax.random.normal(rngs.params(), (257, config.text_dim), _F32).astype(config.param_dtype))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        """``i32[N]`` -> ``f32[N, text_dim]``."""
        emb = jnp.take(self.table[...], token_ids, axis=0).astype(_F32)
        return emb * (token_ids > 0)[:, None]
