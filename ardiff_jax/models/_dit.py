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

Matrix-Game 2.0 (``config.action``, ``input_channels``, ``context_embedding="image"``): the
patch embedding reads extra condition channels, the context is CLIP image tokens through
Wan I2V's MLPProj, and an :class:`ActionModule` (keyboard/mouse, with its own per-session
key/value ring, :class:`ActionKV`) runs between cross-attention and FFN in the first blocks.
The training-mode :meth:`CausalDiT.forward_blocks` runs them over many block instances at once
(:func:`block_causal_action_mask` plays the ring).
A config without these builds and computes exactly what it did before.

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

from ardiff_jax.models._attention import MaskedAttention, SelfAttentionBackend, dot_attention, teacher_forcing_mask
from ardiff_jax.models._config import ActionConfig, CausalDiTConfig

__all__ = ["CausalDiT", "DiTOutput", "ByteTextEncoder", "tokenize_prompt", "patchify", "unpatchify",
           "rope_rotation", "apply_rope", "timestep_embedding", "ActionModule", "ActionInputs", "ActionKV",
           "init_action_cache", "commit_action_cache", "action_history_mask", "action_cache_nbytes",
           "block_causal_action_mask", "ActionStateInputs", "CategorySpecificLinear", "action_state_rotation"]

_F32 = jnp.float32


class DiTOutput(NamedTuple):
    """One forward of :class:`CausalDiT`.

    Attributes:
      video: ``f32[f, C, H, W]`` the flow (velocity) prediction of the block.
      registers: ``f32[E, register_dim]`` the register-token head output, or ``None``.
      k: ``[L, f*T, H, D]`` the block's self-attention keys (RoPE applied), every layer.
      v: ``[L, f*T, H, D]`` the block's self-attention values.
      action_kv: with action modules, the block's action keys/values (:class:`ActionKV`,
        ``[A, f, ...]``), what :func:`commit_action_cache` stores once the block is clean.
    """

    video: jax.Array
    registers: jax.Array | None
    k: jax.Array
    v: jax.Array
    action_kv: ActionKV | None = None


class ActionInputs(NamedTuple):
    """One block's action windows (Matrix-Game 2.0), one per latent frame; built by
    :func:`ardiff_jax.models.matrix_game.action_windows` from the raw per-video-frame rows.

    Attributes:
      keyboard: ``f32[f, rows, keyboard_dim]`` each latent frame's window of keyboard rows.
      mouse: ``f32[f, rows, mouse_dim]`` the same for the mouse, or None (no mouse path).
    """

    keyboard: jax.Array
    mouse: jax.Array | None


class ActionKV(NamedTuple):
    """Action keys/values, stacked over the action blocks ``A``: for a block (``[A, f, ...]``) or a
    session's ring of the last ``window_frames`` latent frames (``[A, W, ...]``; frame ``g`` in slot
    ``g % W``). Keys are stored normalised and rotated at their absolute latent frame.

    Attributes:
      mouse_k, mouse_v: ``[A, n, S, Hm, Dm]`` per spatial token (S tokens per frame), or None.
      keyboard_k, keyboard_v: ``[A, n, Hk, Dk]``: one key/value per latent frame, shared by its tokens.
    """

    mouse_k: jax.Array | None
    mouse_v: jax.Array | None
    keyboard_k: jax.Array
    keyboard_v: jax.Array


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


class ReleaseRMSNorm(nnx.Module):
    """Matrix-Game 2.0's action q/k RMS norm: it has a ``weight`` but its forward ignores it.

    The released ``ActionModule`` normalises ``x * rsqrt(mean(x^2) + eps)`` and never
    multiplies by the stored scale, so that scale never received a gradient and the
    released networks were trained (and distilled) without it. We keep the parameter
    (checkpoints map one to one) and compute what the release computes.
    """

    def __init__(self, dim: int, eps: float, param_dtype: str) -> None:
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_F32)
        return (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)).astype(x.dtype)


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
        rotation: tuple[jax.Array, jax.Array],  # (cos, sin) f32[V, D/2] or f32[V + E, D/2] each
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
        # frame positions, so history never needs re-rotation when the window slides. The
        # rotation covers the video tokens, or the video tokens and the registers (DreamZero's
        # 1-D register RoPE, action_state_rotation); registers past it stay unrotated.
        rotated = rotation[0].shape[0]
        q = jnp.concatenate([apply_rope(q[:rotated], rotation), q[rotated:]]) if rotated < s else apply_rope(q, rotation)
        k = jnp.concatenate([apply_rope(k[:rotated], rotation), k[rotated:]]) if rotated < s else apply_rope(k, rotation)
        k_video, v_video = k[:num_video], v[:num_video]
        if s > num_video:
            q_all, extra_k, extra_v = q, k[num_video:], v[num_video:]
        else:
            q_all, extra_k, extra_v = q, None, None
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
        x, block_kv = self.attend(x, e0, num_video, rotation, layer, attention, text_kv, image_kv)
        return self.feed_forward(x, e0), block_kv

    def attend(self, x: jax.Array, e0: jax.Array, num_video: int, rotation: tuple[jax.Array, jax.Array],
               layer: jax.Array, attention: SelfAttentionBackend, text_kv: tuple[jax.Array, jax.Array],
               image_kv: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The block up to its FFN: modulated self-attention, then cross-attention (Matrix-Game's
        action module runs between this and :meth:`feed_forward`)."""
        cfg = self.config
        mod = self.modulation[...].astype(_F32) + e0
        shift_msa, scale_msa, gate_msa = (mod[..., i, :] for i in range(3))
        h = (_layer_norm(x, cfg.eps) * (1 + scale_msa) + shift_msa).astype(cfg.dtype)
        y, block_kv = self.self_attn(h, num_video, rotation, layer, attention)
        x = x + y.astype(_F32) * gate_msa
        x = x + self.cross_attn(self.norm3(x).astype(cfg.dtype), text_kv, image_kv).astype(_F32)
        return x, block_kv

    def feed_forward(self, x: jax.Array, e0: jax.Array) -> jax.Array:
        """The modulated GELU FFN with its residual."""
        cfg = self.config
        mod = self.modulation[...].astype(_F32) + e0
        shift_mlp, scale_mlp, gate_mlp = (mod[..., i, :] for i in range(3, 6))
        h = (_layer_norm(x, cfg.eps) * (1 + scale_mlp) + shift_mlp).astype(cfg.dtype)
        y = self.ffn_out(jax.nn.gelu(self.ffn_in(h), approximate=True))
        return x + y.astype(_F32) * gate_mlp


def _plain_linear(din: int, dout: int, dtype: str, param_dtype: str, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    # The action modules are small and replicated (no tensor-parallel annotations).
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)


def _rotate_leading(x: jax.Array, cos: jax.Array, sin: jax.Array, rope_dim: int) -> jax.Array:
    """Rotate the interleaved pairs of the first ``rope_dim`` channels of ``x [f, ..., H, D]`` by the per-frame
    ``(cos, sin) f32[f, rope_dim/2]``; the other channels pass (the action RoPE's row/column axes are
    degenerate, 1x1, so only the frame axis rotates)."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rope_dim // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    head = x[..., :rope_dim].astype(_F32).reshape(*x.shape[:-1], rope_dim // 2, 2)
    a, b = head[..., 0], head[..., 1]
    rotated = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(*x.shape[:-1], rope_dim)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rope_dim:]], axis=-1)


def action_rotation(action: ActionConfig, frame_start: jax.Array, num_frames: int) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin) f32[f, rope_dim/2]``: the action RoPE of latent frames ``frame_start ..`` (absolute)."""
    positions = jnp.asarray(frame_start, jnp.int32) + jnp.arange(num_frames)
    return _rotation_at(positions, action.rope_dim, action.rope_theta)


def _window_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, spec: str) -> jax.Array:
    """Softmax attention (float32) over a key axis; ``visible bool[n]`` masks ring slots of the history."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores_spec, out_spec = spec.split("|")
    scores = jnp.einsum(scores_spec, q, k.astype(q.dtype), preferred_element_type=_F32) * scale
    scores = jnp.where(visible, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum(out_spec, weights.astype(v.dtype), v, preferred_element_type=_F32)


class ActionModule(nnx.Module):
    """Matrix-Game 2.0's action module of one block: the mouse path then the keyboard path, each a residual.

    Mouse: every video token is concatenated with its latent frame's mouse window (flattened
    ``rows * mouse_dim``), mapped by an MLP (Linear, GELU(tanh), Linear, LayerNorm) to
    q/k/v; each spatial token attends over the latent frames the block sees (its own keys
    in the session's ring plus the block's), q/k RMS-normalised and rotated by latent frame.
    Keyboard: each raw row is embedded (Linear, SiLU, Linear), a frame's window is flattened
    and projected to one key/value per latent frame; every token's query cross-attends to
    the visible frames' keys. History frames are those the block's self-attention sees:
    ``[max(0, start + f - W), start)``.
    """

    def __init__(self, config: CausalDiTConfig, rngs: nnx.Rngs) -> None:
        action = config.action
        assert action is not None
        self.config = config
        dt, pdt, dim = config.dtype, config.param_dtype, config.dim
        self.keyboard_embed_in = _plain_linear(action.keyboard_dim, action.keyboard_embed_dim, dt, pdt, rngs)
        self.keyboard_embed_out = _plain_linear(action.keyboard_embed_dim, action.keyboard_embed_dim, dt, pdt, rngs)
        if action.mouse_dim:
            hidden = action.mouse_hidden_dim
            self.mouse_mlp_in = _plain_linear(action.rows * action.mouse_dim + dim, hidden, dt, pdt, rngs)
            self.mouse_mlp_out = _plain_linear(hidden, hidden, dt, pdt, rngs)
            self.mouse_mlp_norm = AffineLayerNorm(hidden, action.mlp_norm_eps, pdt)
            self.mouse_qkv = _plain_linear(hidden, 3 * hidden, dt, pdt, rngs, bias=False)
            self.mouse_q_norm = ReleaseRMSNorm(action.mouse_head_dim, action.norm_eps, pdt)
            self.mouse_k_norm = ReleaseRMSNorm(action.mouse_head_dim, action.norm_eps, pdt)
            self.mouse_proj = _plain_linear(hidden, dim, dt, pdt, rngs, bias=False)
        hidden = action.keyboard_hidden_dim
        self.keyboard_q = _plain_linear(dim, hidden, dt, pdt, rngs, bias=False)
        self.keyboard_kv = _plain_linear(action.rows * action.keyboard_embed_dim, 2 * hidden, dt, pdt, rngs,
                                         bias=False)
        self.keyboard_q_norm = ReleaseRMSNorm(action.keyboard_head_dim, action.norm_eps, pdt)
        self.keyboard_k_norm = ReleaseRMSNorm(action.keyboard_head_dim, action.norm_eps, pdt)
        self.keyboard_proj = _plain_linear(hidden, dim, dt, pdt, rngs, bias=False)

    def __call__(
        self,
        x: jax.Array,  # f32[f*S, dim]: the block's video tokens (frame-major) after cross-attention
        inputs: ActionInputs,  # the block's windows: keyboard f32[f, rows, K], mouse f32[f, rows, M] or None
        rotation: tuple[jax.Array, jax.Array],  # action RoPE (cos, sin) f32[f, rope_dim/2]
        history: ActionKV,  # this layer's ring: mouse [W, S, Hm, Dm], keyboard [W, Hk, Dk]
        visible: jax.Array,  # bool[W]: ring slots the block sees (action_history_mask)
    ) -> tuple[jax.Array, ActionKV]:
        """``(x + mouse + keyboard residuals, this block's keys/values [f, ...])``."""
        action = self.config.action
        frames = inputs.keyboard.shape[0]
        mouse_k = mouse_v = None
        mask = jnp.concatenate([visible, jnp.ones((frames,), bool)])
        if action.mouse_dim:
            q, mouse_k, mouse_v = self._mouse_qkv(x, inputs, rotation)
            # Per spatial token, over frames: the ring's (masked) frames, then the block's own.
            keys = jnp.concatenate([history.mouse_k.astype(mouse_k.dtype), mouse_k])
            values = jnp.concatenate([history.mouse_v.astype(mouse_v.dtype), mouse_v])
            x = self._mouse_out(x, _window_attention(q, keys, values, mask, _MOUSE_SPEC))
        keyboard_k, keyboard_v = self._keyboard_kv(inputs, rotation)
        q = self._keyboard_query(x, rotation)
        keys = jnp.concatenate([history.keyboard_k.astype(keyboard_k.dtype), keyboard_k])
        values = jnp.concatenate([history.keyboard_v.astype(keyboard_v.dtype), keyboard_v])
        x = self._keyboard_out(x, _window_attention(q, keys, values, mask, _KEYBOARD_SPEC))
        return x, ActionKV(mouse_k, mouse_v, keyboard_k, keyboard_v)

    def attend_frames(
        self,
        x: jax.Array,  # f32[n*S, dim]: the video tokens of n latent frames (frame-major) after cross-attention
        inputs: ActionInputs,  # each frame's windows: keyboard f32[n, rows, K], mouse f32[n, rows, M] or None
        rotation: tuple[jax.Array, jax.Array],  # action RoPE of each frame (cos, sin) f32[n, rope_dim/2]
        visible: jax.Array,  # bool[n, n]: visible[i, j] iff frame i's tokens see frame j's keys
    ) -> tuple[jax.Array, ActionKV]:
        """:meth:`__call__` over the frames of many block instances at once (training mode): every frame's
        keys/values come from these frames themselves and ``visible`` says which each frame attends over
        (:func:`block_causal_action_mask`: its own block and the clean frames its ring would hold), instead
        of a ring plus the block's own. Returns ``(x, keys/values [n, ...])``."""
        action = self.config.action
        mouse_k = mouse_v = None
        if action.mouse_dim:
            q, mouse_k, mouse_v = self._mouse_qkv(x, inputs, rotation)
            x = self._mouse_out(x, _window_attention(q, mouse_k, mouse_v, visible, _MOUSE_SPEC))
        keyboard_k, keyboard_v = self._keyboard_kv(inputs, rotation)
        q = self._keyboard_query(x, rotation)
        x = self._keyboard_out(x, _window_attention(q, keyboard_k, keyboard_v, visible[:, None, None, :],
                                                    _KEYBOARD_SPEC))
        return x, ActionKV(mouse_k, mouse_v, keyboard_k, keyboard_v)

    # The pieces both forwards share (one latent frame's tokens, keys and values at a time along axis 0).
    def _mouse_qkv(self, x: jax.Array, inputs: ActionInputs, rotation: tuple[jax.Array, jax.Array]
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Mouse ``q, k, v [f, S, Hm, Dm]``: every token with its frame's mouse window through the MLP, q/k
        normalised and rotated at the token's latent frame."""
        cfg, action = self.config, self.config.action
        frames = inputs.keyboard.shape[0]
        tokens = cfg.tokens_per_frame
        cos, sin = rotation
        if inputs.mouse is None:
            raise ValueError("this action module has a mouse path: inputs.mouse is required")
        h = x.reshape(frames, tokens, cfg.dim)
        window = jnp.broadcast_to(inputs.mouse.reshape(frames, 1, -1).astype(_F32),
                                  (frames, tokens, action.rows * action.mouse_dim))
        feats = jnp.concatenate([h, window], axis=-1).astype(cfg.dtype)
        feats = self.mouse_mlp_out(jax.nn.gelu(self.mouse_mlp_in(feats), approximate=True))
        feats = self.mouse_mlp_norm(feats)
        qkv = self.mouse_qkv(feats).reshape(frames, tokens, 3, action.heads, action.mouse_head_dim)
        q = _rotate_leading(self.mouse_q_norm(qkv[:, :, 0]), cos, sin, action.rope_dim)
        mouse_k = _rotate_leading(self.mouse_k_norm(qkv[:, :, 1]), cos, sin, action.rope_dim)
        return q, mouse_k, qkv[:, :, 2]

    def _mouse_out(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """``x`` plus the projected mouse attention output ``out [f, S, Hm, Dm]``."""
        cfg, action = self.config, self.config.action
        out = self.mouse_proj(out.reshape(x.shape[0], action.mouse_hidden_dim).astype(cfg.dtype))
        return x + out.astype(_F32)

    def _keyboard_kv(self, inputs: ActionInputs, rotation: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Keyboard ``k, v [f, Hk, Dk]``: one per latent frame from its window of rows (k rotated at the frame)."""
        cfg, action = self.config, self.config.action
        frames = inputs.keyboard.shape[0]
        cos, sin = rotation
        embedded = self.keyboard_embed_out(jax.nn.silu(self.keyboard_embed_in(inputs.keyboard.astype(cfg.dtype))))
        kv = self.keyboard_kv(embedded.reshape(frames, action.rows * action.keyboard_embed_dim))
        kv = kv.reshape(frames, 2, action.heads, action.keyboard_head_dim)
        keyboard_k = _rotate_leading(self.keyboard_k_norm(kv[:, 0]), cos, sin, action.rope_dim)
        return keyboard_k, kv[:, 1]

    def _keyboard_query(self, x: jax.Array, rotation: tuple[jax.Array, jax.Array]) -> jax.Array:
        """Keyboard queries ``[f, S, Hk, Dk]`` of the tokens (after the mouse residual), rotated at their frame."""
        cfg, action = self.config, self.config.action
        cos, sin = rotation
        frames = cos.shape[0]
        q = self.keyboard_q(x.astype(cfg.dtype)).reshape(frames, cfg.tokens_per_frame, action.heads,
                                                         action.keyboard_head_dim)
        return _rotate_leading(self.keyboard_q_norm(q), cos, sin, action.rope_dim)

    def _keyboard_out(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """``x`` plus the projected keyboard attention output ``out [f, S, Hk, Dk]``."""
        cfg, action = self.config, self.config.action
        out = self.keyboard_proj(out.reshape(x.shape[0], action.keyboard_hidden_dim).astype(cfg.dtype))
        return x + out.astype(_F32)


#: The einsum specs of the two action attentions (scores | output): the mouse path attends per spatial token
#: over frames, the keyboard path from every token to one key per frame.
_MOUSE_SPEC = "fshd,gshd->shfg|shfg,gshd->fshd"
_KEYBOARD_SPEC = "fshd,ghd->fshg|fshg,ghd->fshd"


def _action_shapes(config: CausalDiTConfig, frames: int) -> ActionKV:
    """Shapes of :class:`ActionKV` over ``frames`` latent frames (``[A, frames, ...]``)."""
    action = config.action
    assert action is not None
    a, s = action.num_blocks, config.tokens_per_frame
    mouse = (a, frames, s, action.heads, action.mouse_head_dim) if action.mouse_dim else None
    keyboard = (a, frames, action.heads, action.keyboard_head_dim)
    return ActionKV(mouse, mouse, keyboard, keyboard)


def init_action_cache(config: CausalDiTConfig, dtype: Any = None) -> ActionKV:
    """A session's empty action ring: :class:`ActionKV` of ``[A, window_frames, ...]`` zeros (``config.dtype``)."""
    dtype = config.dtype if dtype is None else dtype
    shapes = _action_shapes(config, config.window_frames)
    return ActionKV(*(None if shape is None else jnp.zeros(shape, dtype) for shape in shapes))


def action_cache_nbytes(config: CausalDiTConfig, dtype: Any = None) -> int:
    """Bytes of one session's action ring (0 without action modules)."""
    if config.action is None:
        return 0
    itemsize = jnp.dtype(config.dtype if dtype is None else dtype).itemsize
    return sum(int(np.prod(shape)) * itemsize for shape in _action_shapes(config, config.window_frames)
               if shape is not None)


def action_history_mask(config: CausalDiTConfig, frame_start: jax.Array) -> jax.Array:
    """``bool[W]``: the ring slots a block starting at latent frame ``frame_start`` sees.

    Slot ``j`` holds the newest committed frame ``g <= start - 1`` with ``g % W == j``; the block
    sees frames ``[max(0, start + f - W), start)`` (its self-attention window, current block
    included in the ``W`` frames).
    """
    window, frames = config.window_frames, config.frames_per_block
    last = jnp.asarray(frame_start, jnp.int32) - 1
    held = last - jnp.mod(last - jnp.arange(window), window)
    return (held >= 0) & (held >= last + 1 + frames - window)


def commit_action_cache(config: CausalDiTConfig, cache: ActionKV, block: ActionKV, frame_start: jax.Array) -> ActionKV:
    """``cache`` with the clean block's action keys/values (``[A, f, ...]``) written at slots ``(start + i) % W``."""
    slots = jnp.mod(jnp.asarray(frame_start, jnp.int32) + jnp.arange(block.keyboard_k.shape[1]), config.window_frames)

    def write(ring: jax.Array | None, new: jax.Array | None) -> jax.Array | None:
        return None if ring is None else ring.at[:, slots].set(new.astype(ring.dtype))

    return ActionKV(*(write(r, n) for r, n in zip(cache, block, strict=True)))


def block_causal_action_mask(
    config: CausalDiTConfig,
    frame_starts: Any,  # int[B]: each block instance's absolute first frame
    clean: Any,  # bool[B]: which instances are clean context (committed at inference)
) -> jax.Array:
    """``bool[B, B*f]``: which instance frames each instance's action modules attend to in
    :meth:`CausalDiT.forward_blocks` (``mask[i, j * f + g]``: instance ``i`` sees frame ``g`` of instance ``j``).

    The action counterpart of :func:`~ardiff_jax.models.block_causal_mask`: instance ``i`` at
    frame ``p`` sees its own frames and the frames ``[p + f - W, p)`` of every clean instance,
    exactly the ring slots :func:`action_history_mask` shows a block at ``p`` (the action ring
    holds the last ``W`` committed frames and has no sink). Traceable.
    """
    if config.action is None:
        raise ValueError(f"config {config.name!r} has no action modules")
    f, window = config.frames_per_block, config.window_frames
    starts = jnp.asarray(frame_starts, jnp.int32)
    clean = jnp.asarray(clean, bool)
    num_instances = starts.shape[0]
    key_frames = starts[:, None] + jnp.arange(f, dtype=jnp.int32)[None, :]  # [Bk, f]
    query = starts[:, None, None]  # [Bq, 1, 1]
    history = (key_frames[None] >= query + f - window) & (key_frames[None] < query) & clean[None, :, None]
    itself = jnp.eye(num_instances, dtype=bool)[:, :, None]
    return (history | itself).reshape(num_instances, num_instances * f)


class ActionStateInputs(NamedTuple):
    """One denoising call's action/state register (DreamZero, ``config.action_register``).

    Attributes:
      actions: ``f32[A, action_dim]`` the noisy action chunk (A = actions_per_block).
      action_timesteps: ``f32[A]`` each action token's diffusion time (integers in DreamZero).
      state: ``f32[S, state_dim]`` the robot state (S = states_per_block), zero-padded.
    """

    actions: jax.Array
    action_timesteps: jax.Array
    state: jax.Array


class CategorySpecificLinear(nnx.Module):
    """A linear map per embodiment category: ``x @ W[c] + b[c]`` with ``W [categories, in, out]``
    (the release's layout, not torch's ``[out, in]``). DreamZero forces one category."""

    def __init__(self, categories: int, din: int, dout: int, param_dtype: str, rngs: nnx.Rngs) -> None:
        self.W = nnx.Param((jax.random.normal(rngs.params(), (categories, din, dout), _F32) / math.sqrt(din))
                           .astype(param_dtype))
        self.b = nnx.Param(jnp.zeros((categories, dout), param_dtype))

    def __call__(self, x: jax.Array, category: int = 0) -> jax.Array:
        out = jnp.matmul(x, self.W[category].astype(x.dtype), preferred_element_type=_F32)
        return out + self.b[category].astype(_F32)


class CategorySpecificMLP(nnx.Module):
    """``layer2(relu(layer1(x)))``, both category-specific (DreamZero's state encoder and action decoder)."""

    def __init__(self, categories: int, din: int, hidden: int, dout: int, param_dtype: str, rngs: nnx.Rngs) -> None:
        self.layer1 = CategorySpecificLinear(categories, din, hidden, param_dtype, rngs)
        self.layer2 = CategorySpecificLinear(categories, hidden, dout, param_dtype, rngs)

    def __call__(self, x: jax.Array, dtype: Any) -> jax.Array:
        h = jax.nn.relu(self.layer1(x.astype(dtype)))
        return self.layer2(h.astype(dtype))


class ActionEncoder(nnx.Module):
    """DreamZero's ``MultiEmbodimentActionEncoder``: ``W3(swish(W2([W1 a, sinusoid(t)])))``, width ``dim``.

    The sinusoid is ``[sin, cos](t * exp(-k ln(10000) / (dim/2)))`` in float32, as the release's
    ``SinusoidalPositionalEncoding`` computes it (not Wan's ``[cos, sin]`` of the modulation).
    """

    def __init__(self, categories: int, action_dim: int, dim: int, param_dtype: str, rngs: nnx.Rngs) -> None:
        self.W1 = CategorySpecificLinear(categories, action_dim, dim, param_dtype, rngs)
        self.W2 = CategorySpecificLinear(categories, 2 * dim, dim, param_dtype, rngs)
        self.W3 = CategorySpecificLinear(categories, dim, dim, param_dtype, rngs)

    def __call__(self, actions: jax.Array, timesteps: jax.Array, dtype: Any) -> jax.Array:
        dim = self.W3.W.shape[-1]
        embedded = self.W1(actions.astype(dtype))
        angles = jnp.asarray(timesteps, _F32)[:, None] * jnp.asarray(_action_sinusoid_freqs(dim))
        tau = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
        h = self.W2(jnp.concatenate([embedded, tau], axis=-1).astype(dtype))
        return self.W3(jax.nn.silu(h).astype(dtype))


@functools.lru_cache(maxsize=8)
def _action_sinusoid_freqs(dim: int) -> np.ndarray:
    """``f32[dim/2]``: ``exp(-k ln(10000) / (dim/2))``, rounded once from float64 (the release builds it in float32)."""
    half = dim // 2
    return np.exp(-np.arange(half, dtype=np.float64) * (math.log(10000.0) / half)).astype(np.float32)


def action_state_rotation(config: CausalDiTConfig, frame_start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin) f32[A + S, D/2]``: DreamZero's 1-D RoPE of a denoising call's register tokens.

    Over the whole head (base ``rope_theta``): action ``j`` at ``i * A + j``, state ``k`` at
    ``i * S + k``, where ``i = (frame_start - 1) // frames_per_block`` is the register block (the
    first block after the conditioning frame is 0). The release slices its 10240- and 1024-row
    tables there, so positions past them are outside what it can run.
    """
    register = config.action_register
    assert register is not None
    block = jnp.floor_divide(jnp.asarray(frame_start, jnp.int32) - 1, config.frames_per_block)
    positions = jnp.concatenate([block * register.actions_per_block + jnp.arange(register.actions_per_block),
                                 block * register.states_per_block + jnp.arange(register.states_per_block)])
    return _rotation_at(positions, config.head_dim, config.rope_theta)


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
        self.patch_embedding = _linear(config, config.input_patch_dim, dim, rngs)
        if config.context_embedding == "text":
            self.text_in = _linear(config, config.text_dim, dim, rngs)
            self.text_out = _linear(config, dim, dim, rngs)
        else:
            # Wan I2V's img_emb MLPProj over CLIP tokens (torch LayerNorm's default eps 1e-5).
            self.context_norm_in = AffineLayerNorm(config.text_dim, 1e-5, config.param_dtype)
            self.context_in = _linear(config, config.text_dim, config.text_dim, rngs)
            self.context_out = _linear(config, config.text_dim, dim, rngs)
            self.context_norm_out = AffineLayerNorm(dim, 1e-5, config.param_dtype)
        self.time_in = _linear(config, config.freq_dim, dim, rngs)
        self.time_out = _linear(config, dim, dim, rngs)
        self.time_projection = _linear(config, dim, 6 * dim, rngs)
        if config.image_len and config.image_dim:
            # Wan I2V's img_emb MLPProj over CLIP tokens (torch LayerNorm's default eps 1e-5).
            self.image_norm_in = AffineLayerNorm(config.image_dim, 1e-5, config.param_dtype)
            self.image_in = _linear(config, config.image_dim, config.image_dim, rngs)
            self.image_out = _linear(config, config.image_dim, dim, rngs)
            self.image_norm_out = AffineLayerNorm(dim, 1e-5, config.param_dtype)
        elif config.image_len:
            # Wan's MLPProj over CLIP features; here over the stand-in image features (patch features).
            self.image_norm_in = AffineLayerNorm(config.patch_dim, config.eps, config.param_dtype)
            self.image_in = _linear(config, config.patch_dim, dim, rngs)
            self.image_out = _linear(config, dim, dim, rngs)
            self.image_norm_out = AffineLayerNorm(dim, config.eps, config.param_dtype)
        if config.action_register is not None:
            register, pdt = config.action_register, config.param_dtype
            self.state_encoder = CategorySpecificMLP(register.categories, register.state_dim, register.hidden_size,
                                                     dim, pdt, rngs)
            self.action_encoder = ActionEncoder(register.categories, register.action_dim, dim, pdt, rngs)
            self.action_decoder = CategorySpecificMLP(register.categories, dim, register.hidden_size,
                                                      register.action_dim, pdt, rngs)
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
        if config.action is not None:
            # Stacked over the first action.num_blocks layers only: the release has action
            # modules in those blocks alone (blocks.{i}.action_model for i < num_blocks).
            @nnx.split_rngs(splits=config.action.num_blocks)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def make_action_blocks(rngs: nnx.Rngs) -> ActionModule:
                return ActionModule(config, rngs)

            self.action_blocks = make_action_blocks(rngs)
        self.head_modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (2, dim), _F32) / math.sqrt(dim)).astype(config.param_dtype))
        self.head = _linear(config, dim, config.patch_dim, rngs)

    # -- context projections (run once per prompt / conditioning image) ----------------------
    def embed_text(self, text_features: jax.Array) -> jax.Array:
        """``[N, text_dim]`` -> ``[N, dim]``: Wan's text_embedding MLP, or for an image context
        (``context_embedding == "image"``, Matrix-Game's CLIP tokens) Wan I2V's MLPProj."""
        if self.config.context_embedding == "image":
            h = self.context_in(self.context_norm_in(text_features))
            return self.context_norm_out(self.context_out(jax.nn.gelu(h, approximate=False)))
        return self.text_out(jax.nn.gelu(self.text_in(text_features), approximate=True))

    def embed_image(self, image_features: jax.Array) -> jax.Array:
        """``[Ni, image_dim or patch_dim]`` -> ``[Ni, dim]`` (Wan's img_emb MLPProj)."""
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
        """Every layer's image cross-attention K/V: ``[Ni, image_dim or patch_dim]`` -> ``[L, Ni, H, D]`` x 2."""
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

    def _action_layers(self, x: jax.Array, e0: jax.Array, num_video: int, rotation: tuple[jax.Array, jax.Array],
                       attention: SelfAttentionBackend, text_kv: tuple[jax.Array, jax.Array],
                       actions: ActionInputs, history: ActionKV, frame_start: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array, ActionKV]:
        """:meth:`_layers` with the action module of block ``i < A`` between its cross-attention and FFN.

        One scan over all layers (compile time stays flat); the action parameters and ring of
        layer ``i`` are indexed dynamically inside a ``cond`` (no copy of either stack), and the
        block's action keys/values come back ``[A, f, ...]``.
        """
        cfg = self.config
        frames = actions.keyboard.shape[0]
        action_rot = action_rotation(cfg.action, frame_start, frames)
        visible = action_history_mask(cfg, frame_start)

        def run(module: ActionModule, x: jax.Array, pick: Any) -> tuple[jax.Array, ActionKV]:
            layer_history = ActionKV(*(None if h is None else pick(h) for h in history))
            return module(x, actions, action_rot, layer_history, visible)

        return self._scan_action_layers(x, e0, num_video, rotation, attention, text_kv, frames, run)

    def _scan_action_layers(self, x: jax.Array, e0: jax.Array, num_video: int,
                            rotation: tuple[jax.Array, jax.Array], attention: SelfAttentionBackend,
                            text_kv: tuple[jax.Array, jax.Array], frames: int, run: Any
                            ) -> tuple[jax.Array, jax.Array, jax.Array, ActionKV]:
        """The layer scan of :meth:`_action_layers`; ``run(module, x, pick)`` is one action module's forward
        (``pick`` indexes a layer-stacked array at the current layer) returning ``(x, keys/values [frames, ...])``."""
        cfg = self.config
        num_action = cfg.action.num_blocks
        graphdef, stacked = nnx.split(self.blocks)
        action_graphdef, action_stacked = nnx.split(self.action_blocks)
        empty = ActionKV(*(None if shape is None else jnp.zeros(shape[1:], cfg.dtype)
                           for shape in _action_shapes(cfg, frames)))

        def with_action(x: jax.Array, layer: jax.Array) -> tuple[jax.Array, ActionKV]:
            pick = functools.partial(jax.lax.dynamic_index_in_dim, index=layer, axis=0, keepdims=False)
            module = nnx.merge(action_graphdef, jax.tree.map(pick, action_stacked))
            x, new = run(module, x, pick)
            return x, ActionKV(*(None if n is None else n.astype(cfg.dtype) for n in new))

        def layer_step(x: jax.Array, xs: Any) -> tuple[jax.Array, tuple[Any, ...]]:
            layer, state, layer_text = xs
            block = nnx.merge(graphdef, state)
            x, block_kv = block.attend(x, e0, num_video, rotation, layer, attention, layer_text, None)
            x, action_kv = jax.lax.cond(layer < num_action, with_action, lambda x, _: (x, empty), x, layer)
            return block.feed_forward(x, e0), (block_kv, action_kv)

        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        x, ((block_k, block_v), action_kv) = jax.lax.scan(layer_step, x, (layers, stacked, text_kv))
        action_kv = ActionKV(*(None if a is None else a[:num_action] for a in action_kv))
        return x, block_k, block_v, action_kv

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
        condition: jax.Array | None = None,  # f32[f, in_channels - C, H, W]: I2V channels after the latent's
        actions: ActionInputs | None = None,  # the block's action windows (config.action)
        action_history: ActionKV | None = None,  # the session's action ring [A, W, ...] (config.action)
        action_state: ActionStateInputs | None = None,  # the register of a denoising call (config.action_register)
    ) -> DiTOutput:
        """One AR block (inference): history comes from ``attention`` (the paged view or a dense reference).

        A per-frame ``timestep [f]`` modulates each frame's tokens by its own time (Wan's
        ``t [B, F]``; Wan2.2-TI2V keeps a conditioning frame at ``t = 0``). An I2V network
        (``input_channels > latent_channels``) reads ``concat([latents, condition])`` over
        channels (Matrix-Game: 4 mask + 16 image-condition channels). With action modules
        (``config.action``) ``actions`` and ``action_history`` are required; the output's
        ``action_kv`` is what :func:`commit_action_cache` stores for the clean block.

        With an action/state register (``config.action_register``, DreamZero) a denoising call
        passes ``action_state``: its tokens follow the video tokens with their own per-token
        timesteps and 1-D RoPE, and the output's ``registers`` is the action flow
        ``f32[A, action_dim]`` (the decoder on the last block's hidden states). A commit call
        passes none (video tokens only).
        """
        cfg = self.config
        self._check_latents(latents, 1)
        frames = latents.shape[0]
        self._check_controls(controls, (frames,))
        if jnp.ndim(timestep) not in (0, 1) or (jnp.ndim(timestep) == 1 and jnp.shape(timestep)[0] != frames):
            raise ValueError(f"timestep must be a scalar or one per frame [{frames}], got shape {jnp.shape(timestep)}")
        self._check_action_args(frames, condition, actions, action_history, image_kv, registers)
        num_video = frames * cfg.tokens_per_frame
        if condition is not None:
            latents = jnp.concatenate([latents.astype(_F32), condition.astype(_F32)], axis=1)
        x = self.patch_embedding(patchify(latents.astype(cfg.dtype), cfg.patch_size)).astype(_F32)
        if cfg.action_register is not None:
            return self._call_action_state(x, frames, timestep, frame_start, text_kv, image_kv, registers, controls,
                                           attention, action_state)
        if action_state is not None:
            raise ValueError("this CausalDiT has no action/state register (config.action_register is None); "
                             "action_state must be None")
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
        action_kv = None
        if cfg.action is None:
            x, block_k, block_v = self._layers(x, e0, num_video, rotation, attention, text_kv, image_kv)
        else:
            x, block_k, block_v, action_kv = self._action_layers(x, e0, num_video, rotation, attention, text_kv,
                                                                 actions, action_history, frame_start)
        h = self._head(x, e)
        video = unpatchify(self.head(h[:num_video]).astype(_F32), frames, cfg.latent_channels, cfg.latent_height,
                           cfg.latent_width, cfg.patch_size)
        reg_out = self.register_head(h[num_video:]).astype(_F32) if registers is not None else None
        return DiTOutput(video=video, registers=reg_out, k=block_k, v=block_v, action_kv=action_kv)

    def _encode_action_state(self, inputs: ActionStateInputs) -> jax.Array:
        """``[A + S, dim]`` (or every block's: ``[N*A + N*S, dim]``): the action encoder's tokens, then the
        state encoder's (category 0, as the release)."""
        cfg = self.config
        actions = self.action_encoder(inputs.actions, inputs.action_timesteps, cfg.dtype)
        state = self.state_encoder(inputs.state, cfg.dtype)
        return jnp.concatenate([actions, state]).astype(_F32)

    def _check_action_state(self, inputs: Any, registers: Any, controls: Any) -> None:
        register = self.config.action_register
        if registers is not None or controls is not None:
            raise ValueError("a CausalDiT with an action/state register takes no registers or controls")
        if inputs is None:
            return
        if not isinstance(inputs, ActionStateInputs):
            raise TypeError(f"action_state must be an ActionStateInputs, got {type(inputs).__name__}")
        a, s = register.actions_per_block, register.states_per_block
        want = {"actions": (a, register.action_dim), "action_timesteps": (a,), "state": (s, register.state_dim)}
        for field, shape in want.items():
            got = tuple(jnp.shape(getattr(inputs, field)))
            if got != shape:
                raise ValueError(f"action_state.{field} must be {list(shape)}, got {list(got)}")

    def _call_action_state(self, x: jax.Array, frames: int, timestep: jax.Array, frame_start: jax.Array,
                           text_kv: tuple[jax.Array, jax.Array], image_kv: tuple[jax.Array, jax.Array] | None,
                           registers: Any, controls: Any, attention: SelfAttentionBackend,
                           action_state: ActionStateInputs | None) -> DiTOutput:
        """:meth:`__call__` of a network with DreamZero's action/state register (``x`` the patch-embedded video).

        Every token has its own timestep (video tokens their frame's, action tokens their own, a
        state token its block's first action's) and the register is rotated by its 1-D RoPE
        after the video tokens' 3-D one (:func:`action_state_rotation`).
        """
        cfg = self.config
        register = cfg.action_register
        self._check_action_state(action_state, registers, controls)
        num_video = frames * cfg.tokens_per_frame
        times = jnp.broadcast_to(jnp.asarray(timestep, _F32), (frames,))
        rotation = rope_rotation(cfg, frame_start, frames)
        counts = [cfg.tokens_per_frame] * frames
        if action_state is not None:
            x = jnp.concatenate([x, self._encode_action_state(action_state)])
            action_times = jnp.asarray(action_state.action_timesteps, _F32)
            # The release's timestep_action[:, ::stride]: each state token takes its block's first action time.
            state_times = action_times[:: register.actions_per_block // register.states_per_block]
            times = jnp.concatenate([times, action_times, state_times])
            counts += [1] * register.num_tokens
            reg_cos, reg_sin = action_state_rotation(cfg, frame_start)
            rotation = (jnp.concatenate([rotation[0], reg_cos]), jnp.concatenate([rotation[1], reg_sin]))
        e, e0 = self._time(times)
        counts = np.array(counts)
        e = jnp.repeat(e, counts, axis=0, total_repeat_length=int(counts.sum()))
        e0 = jnp.repeat(e0, counts, axis=0, total_repeat_length=int(counts.sum()))
        x, block_k, block_v = self._layers(x, e0, num_video, rotation, attention, text_kv, image_kv)
        h = self._head(x[:num_video], e[:num_video])
        video = unpatchify(self.head(h).astype(_F32), frames, cfg.latent_channels, cfg.latent_height,
                           cfg.latent_width, cfg.patch_size)
        action_flow = None
        if action_state is not None:  # the decoder reads the residual stream itself: no head norm
            action_flow = self.action_decoder(x[num_video: num_video + register.actions_per_block], cfg.dtype)
        return DiTOutput(video=video, registers=action_flow, k=block_k, v=block_v)

    def _check_action_args(self, frames: int, condition: jax.Array | None, actions: ActionInputs | None,
                           history: ActionKV | None, image_kv: Any, registers: Any) -> None:
        cfg = self.config
        extra = cfg.in_channels - cfg.latent_channels
        if extra:
            want = (frames, extra, cfg.latent_height, cfg.latent_width)
            if condition is None or tuple(condition.shape) != want:
                raise ValueError(f"this CausalDiT reads {cfg.in_channels} channels: condition must be {list(want)} "
                                 f"(the channels after the {cfg.latent_channels} latent ones), got "
                                 f"{None if condition is None else list(condition.shape)}")
        elif condition is not None:
            raise ValueError("this CausalDiT reads the latent channels only; condition must be None")
        if cfg.action is None:
            if actions is not None or history is not None:
                raise ValueError("this CausalDiT has no action modules; actions and action_history must be None")
            return
        if image_kv is not None or registers is not None:
            raise ValueError("a CausalDiT with action modules takes no image_kv or registers")
        action = cfg.action
        if actions is None or history is None:
            raise ValueError("this CausalDiT has action modules: actions (ActionInputs) and action_history "
                             "(init_action_cache) are required")
        if tuple(actions.keyboard.shape) != (frames, action.rows, action.keyboard_dim):
            raise ValueError(f"actions.keyboard must be [{frames}, {action.rows}, {action.keyboard_dim}], got "
                             f"{list(actions.keyboard.shape)}")
        mouse_shape = None if actions.mouse is None else tuple(actions.mouse.shape)
        if mouse_shape != ((frames, action.rows, action.mouse_dim) if action.mouse_dim else None):
            raise ValueError(f"actions.mouse must be {[frames, action.rows, action.mouse_dim] if action.mouse_dim else None}"
                             f", got {mouse_shape}")
        want = _action_shapes(cfg, cfg.window_frames)
        got = tuple(None if h is None else tuple(h.shape) for h in history)
        if got != tuple(want):
            raise ValueError(f"action_history must be shaped {tuple(want)} (init_action_cache), got {got}")

    def _check_instance_action_args(self, num_instances: int, frames: int, condition: jax.Array | None,
                                    actions: ActionInputs | None, action_mask: jax.Array | None, image_kv: Any,
                                    registers: Any) -> None:
        """:meth:`_check_action_args` for :meth:`forward_blocks`' ``B`` instances (no ring: ``action_mask``)."""
        cfg = self.config
        extra = cfg.in_channels - cfg.latent_channels
        if extra:
            want = (num_instances, frames, extra, cfg.latent_height, cfg.latent_width)
            if condition is None or tuple(condition.shape) != want:
                raise ValueError(f"this CausalDiT reads {cfg.in_channels} channels: condition must be {list(want)} "
                                 f"(each instance's channels after the {cfg.latent_channels} latent ones), got "
                                 f"{None if condition is None else list(condition.shape)}")
        elif condition is not None:
            raise ValueError("this CausalDiT reads the latent channels only; condition must be None")
        if cfg.action is None:
            if actions is not None or action_mask is not None:
                raise ValueError("this CausalDiT has no action modules; actions and action_mask must be None")
            return
        if image_kv is not None or registers is not None:
            raise ValueError("a CausalDiT with action modules takes no image_kv or registers")
        action = cfg.action
        if actions is None or action_mask is None:
            raise ValueError("this CausalDiT has action modules: actions (ActionInputs [B, f, rows, ...]) and "
                             "action_mask (block_causal_action_mask) are required")
        want = (num_instances, frames, action.rows, action.keyboard_dim)
        if tuple(actions.keyboard.shape) != want:
            raise ValueError(f"actions.keyboard must be {list(want)}, got {list(actions.keyboard.shape)}")
        mouse_shape = None if actions.mouse is None else tuple(actions.mouse.shape)
        want = (num_instances, frames, action.rows, action.mouse_dim) if action.mouse_dim else None
        if mouse_shape != want:
            raise ValueError(f"actions.mouse must be {None if want is None else list(want)}, got "
                             f"{None if mouse_shape is None else list(mouse_shape)}")
        if tuple(jnp.shape(action_mask)) != (num_instances, num_instances * frames):
            raise ValueError(f"action_mask must be bool[{num_instances}, {num_instances * frames}] "
                             f"(block_causal_action_mask), got {list(jnp.shape(action_mask))}")

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
        condition: jax.Array | None = None,  # f32[B, f, in_channels - C, H, W]: each instance's I2V channels
        actions: ActionInputs | None = None,  # each instance's windows: keyboard [B, f, rows, K], mouse [B, f, rows, M]
        action_mask: jax.Array | None = None,  # bool[B, B*f]: block_causal_action_mask (config.action)
    ) -> DiTOutput:
        """Many block instances in one pass (training mode): the same modules as :meth:`__call__`.

        Tokens are laid out as every instance's video tokens (instance-major), then every
        instance's register tokens; each token is modulated by its own instance's timestep
        and rotated at its own frame position. Which token sees which is entirely the
        backend's business: with :class:`~ardiff_jax.models.MaskedAttention` built by
        :func:`~ardiff_jax.models.block_causal_mask`, instance ``i`` sees exactly what the
        paged runtime shows block ``i`` at inference (sink, sliding window, itself, its
        registers), which is what makes training and cached inference agree.

        An I2V network (``input_channels``) reads each instance's ``condition`` after its
        latent channels, as :meth:`__call__` does per block. A network with action modules
        (Matrix-Game) runs them over every instance's frames at once: each instance's keys
        and values come from its own windows (``actions``, leading ``[B]``) and its own tokens,
        and ``action_mask[i, j * f + g]`` says whether instance ``i`` attends to frame ``g``
        of instance ``j``: :func:`block_causal_action_mask` shows it its own block and the
        frames of the clean instances its action ring would hold at inference (the window
        ``[start + f - W, start)``, no sink), so a clean instance's keys play the committed
        block's ring entries.

        Shapes:
          returns: DiTOutput with ``video f32[B, f, C, H, W]``, ``registers f32[B, E, R]`` or
          None, ``k, v [L, B*f*T, H, D]``; with action modules ``action_kv`` ``[A, B*f, ...]``
          (every instance's frames, instance-major: a clean instance's entries are what
          :func:`commit_action_cache` stores for that block).
        """
        cfg = self.config
        self._check_latents(latents, 2)
        num_instances, frames = latents.shape[:2]
        self._check_controls(controls, (num_instances, frames))
        self._check_instance_action_args(num_instances, frames, condition, actions, action_mask, image_kv, registers)
        tokens = frames * cfg.tokens_per_frame
        num_video = num_instances * tokens
        if condition is None:
            flat = latents.reshape(num_instances * frames, *latents.shape[2:]).astype(cfg.dtype)
        else:  # as __call__: the latent channels, then the condition's
            flat = jnp.concatenate([latents.astype(_F32), condition.astype(_F32)], axis=2)
            flat = flat.reshape(num_instances * frames, *flat.shape[2:]).astype(cfg.dtype)
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
        action_kv = None
        if cfg.action is None:
            x, block_k, block_v = self._layers(x, e0_tokens, num_video, rotation, attention,
                                               text_kv, image_kv)
        else:
            n = num_instances * frames
            flat_actions = ActionInputs(actions.keyboard.reshape(n, *actions.keyboard.shape[2:]),
                                        None if actions.mouse is None else
                                        actions.mouse.reshape(n, *actions.mouse.shape[2:]))
            action_cos, action_sin = jax.vmap(lambda start: action_rotation(cfg.action, start, frames))(
                jnp.asarray(frame_starts))
            action_rot = (action_cos.reshape(n, -1), action_sin.reshape(n, -1))
            visible = jnp.repeat(jnp.asarray(action_mask, bool), frames, axis=0)  # [B*f query frames, B*f]

            def run(module: ActionModule, x: jax.Array, pick: Any) -> tuple[jax.Array, ActionKV]:
                return module.attend_frames(x, flat_actions, action_rot, visible)

            x, block_k, block_v, action_kv = self._scan_action_layers(x, e0_tokens, num_video, rotation, attention,
                                                                      text_kv, n, run)
        h = self._head(x, e_tokens)
        patches = self.head(h[:num_video]).astype(_F32).reshape(num_instances, tokens, cfg.patch_dim)
        video = jax.vmap(lambda p: unpatchify(p, frames, cfg.latent_channels, cfg.latent_height, cfg.latent_width,
                                              cfg.patch_size))(patches)
        reg_out = None
        if registers is not None:
            reg_out = self.register_head(h[num_video:]).astype(_F32).reshape(num_instances, -1, cfg.register_dim)
        return DiTOutput(video=video, registers=reg_out, k=block_k, v=block_v, action_kv=action_kv)

    def forward_teacher_forcing(
        self,
        noisy: jax.Array,  # f32[F, C, H, W]: noisy latents, F = 1 + N * frames_per_block
        clean: jax.Array,  # f32[F, C, H, W]: the clean latents of the same frames (the context)
        timesteps: jax.Array,  # f32[F]: each noisy frame's diffusion time
        text_kv: tuple[jax.Array, jax.Array],  # [L, N_text, H, D] each
        image_kv: tuple[jax.Array, jax.Array] | None,  # [L, 257, H, D] each
        action_state: ActionStateInputs,  # actions [N*A, action_dim], action_timesteps [N*A], state [N*S, state_dim]
        *,
        condition: jax.Array | None = None,  # f32[F, in_channels - C, H, W]: the I2V channels of every frame
        state_attends_like_inference: bool = False,
    ) -> DiTOutput:
        """DreamZero's training-mode whole-sequence forward (teacher forcing, the release's ``_forward_train``).

        The clean frames (timestep 0), the noisy frames, every block's action tokens and state tokens go
        through the network at once under :func:`~ardiff_jax.models.teacher_forcing_mask`; video and
        register tokens are rotated and modulated exactly as in the cached inference (clean and noisy
        frame ``g`` at frame ``g``, register block ``i`` at ``i``). The release's state token attends only
        to itself here, unlike in inference (``state_attends_like_inference=True`` gives the inference
        visibility, which makes this forward equal the cached rollout).

        Shapes:
          returns: DiTOutput with ``video f32[F, C, H, W]`` (the noisy frames' flow) and ``registers
          f32[N*A, action_dim]`` (the action flow); ``k``, ``v`` are the whole sequence's video keys.
        """
        cfg = self.config
        register = cfg.action_register
        if register is None:
            raise ValueError("forward_teacher_forcing needs a network with an action/state register")
        self._check_latents(noisy, 1)
        self._check_latents(clean, 1)
        frames = noisy.shape[0]
        blocks = (frames - 1) // cfg.frames_per_block
        if clean.shape != noisy.shape or jnp.shape(timesteps) != (frames,) or frames < 1 + cfg.frames_per_block \
                or (frames - 1) % cfg.frames_per_block:
            raise ValueError(f"noisy and clean must be the same [1 + N * {cfg.frames_per_block}, C, H, W] frames "
                             f"and timesteps [F]; got {noisy.shape}, {clean.shape}, {jnp.shape(timesteps)}")
        want = {"actions": (blocks * register.actions_per_block, register.action_dim),
                "action_timesteps": (blocks * register.actions_per_block,),
                "state": (blocks * register.states_per_block, register.state_dim)}
        for field, shape in want.items():
            if tuple(jnp.shape(getattr(action_state, field))) != shape:
                raise ValueError(f"action_state.{field} must be {list(shape)} for {blocks} blocks, got "
                                 f"{list(jnp.shape(getattr(action_state, field)))}")
        extra = cfg.in_channels - cfg.latent_channels
        if extra and (condition is None or tuple(condition.shape) != (frames, extra, cfg.latent_height,
                                                                     cfg.latent_width)):
            raise ValueError(f"condition must be [{frames}, {extra}, {cfg.latent_height}, {cfg.latent_width}]")

        def embed(latents: jax.Array) -> jax.Array:
            if extra:
                latents = jnp.concatenate([latents.astype(_F32), condition.astype(_F32)], axis=1)
            return self.patch_embedding(patchify(latents.astype(cfg.dtype), cfg.patch_size)).astype(_F32)

        num_video = 2 * frames * cfg.tokens_per_frame
        x = jnp.concatenate([embed(clean), embed(noisy), self._encode_action_state(action_state)])
        action_times = jnp.asarray(action_state.action_timesteps, _F32)
        state_times = action_times[:: register.actions_per_block // register.states_per_block]
        times = jnp.concatenate([jnp.zeros((frames,), _F32), jnp.asarray(timesteps, _F32), action_times, state_times])
        counts = np.array([cfg.tokens_per_frame] * (2 * frames) + [1] * (blocks * register.num_tokens))
        e, e0 = self._time(times)
        e = jnp.repeat(e, counts, axis=0, total_repeat_length=int(counts.sum()))
        e0 = jnp.repeat(e0, counts, axis=0, total_repeat_length=int(counts.sum()))
        video_cos, video_sin = rope_rotation(cfg, jnp.int32(0), frames)
        # Register block i's action j at i * A + j and its state k at i * S + k (the inference positions).
        positions = jnp.concatenate([jnp.arange(blocks * register.actions_per_block),
                                     jnp.arange(blocks * register.states_per_block)])
        reg_cos, reg_sin = _rotation_at(positions, cfg.head_dim, cfg.rope_theta)
        rotation = (jnp.concatenate([video_cos, video_cos, reg_cos]), jnp.concatenate([video_sin, video_sin, reg_sin]))
        mask = teacher_forcing_mask(cfg, frames, state_attends_like_inference=state_attends_like_inference)
        x, block_k, block_v = self._layers(x, e0, num_video, rotation, MaskedAttention(jnp.asarray(mask)), text_kv,
                                           image_kv)
        noisy_tokens = slice(num_video // 2, num_video)
        h = self._head(x[noisy_tokens], e[noisy_tokens])
        video = unpatchify(self.head(h).astype(_F32), frames, cfg.latent_channels, cfg.latent_height,
                           cfg.latent_width, cfg.patch_size)
        action_flow = self.action_decoder(x[num_video: num_video + blocks * register.actions_per_block], cfg.dtype)
        return DiTOutput(video=video, registers=action_flow, k=block_k, v=block_v)

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
