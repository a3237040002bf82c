"""Attention backends of the causal DiT: the paged runtime view or a dense, cache-free reference.

The transformer never touches KV storage itself. Its self-attention calls
``attention.attend(layer, q, k, v, extra_k=..., extra_v=..., scale=...)`` on whatever
backend it was handed: the runtime's :class:`~ardiff_jax.PagedKVCaches` (history read from
the paged pools) or :class:`DenseAttention` (history passed in as plain arrays, textbook
float32 softmax). The same module code therefore serves the engine and a from-scratch
reference rollout, which is what the equivalence tests compare. Training runs many block
instances in one pass through :class:`MaskedAttention`, whose token mask
(:func:`block_causal_mask`) reproduces what the paged view shows each block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax.kv import KVLayout, ref_attention, visible_history
from ardiff_jax.models._config import CausalDiTConfig

__all__ = ["SelfAttentionBackend", "DenseAttention", "MaskedAttention", "block_causal_mask", "dot_attention",
           "teacher_forcing_mask"]


@runtime_checkable
class SelfAttentionBackend(Protocol):
    """What the DiT's self-attention needs: non-causal attention over ``[history][current][extra]``.

    ``layer`` may be a traced ``i32[]`` (the transformer scans over its layers). ``q`` is
    ``[S, Hq, D]``; ``k, v`` the current block ``[f*T, H, D]``; ``extra_k, extra_v`` the
    register tokens ``[E, H, D]`` (never cached). Returns ``[S, Hq, D]``. Implementations
    must be pytrees so they can be passed into ``jax.jit``.
    """

    def attend(self, layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
               extra_v: jax.Array | None = None, scale: Any = None) -> jax.Array: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Cache-free backend: history K/V handed in explicitly, attention by dense float32 softmax.

    Attributes:
      k: ``[L, N, H, D]`` visible history keys of every layer, in reference order
        ``[sink][history oldest to newest]``, padded to a fixed ``N`` (padding is masked).
      v: ``[L, N, H, D]``
      mask: ``bool[N]``: which history entries are real. A fixed ``N`` with a mask keeps one
        compiled program for every fill level, as the paged path does.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_size: int, capacity_tokens: int = 0,
              dtype: Any = jnp.float32) -> DenseAttention:
        """No history: ``capacity_tokens`` masked entries (0 = none at all)."""
        shape = (num_layers, capacity_tokens, num_kv_heads, head_size)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), mask=jnp.zeros((capacity_tokens,), bool))

    def attend(self, layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
               extra_v: jax.Array | None = None, scale: Any = None) -> jax.Array:
        keys = [self.k[layer].astype(jnp.float32), k.astype(jnp.float32)]
        values = [self.v[layer].astype(jnp.float32), v.astype(jnp.float32)]
        mask = [self.mask, jnp.ones((k.shape[0],), bool)]
        if extra_k is not None:
            keys.append(extra_k.astype(jnp.float32))
            values.append(extra_v.astype(jnp.float32))
            mask.append(jnp.ones((extra_k.shape[0],), bool))
        return ref_attention(q, jnp.concatenate(keys), jnp.concatenate(values), mask=jnp.concatenate(mask),
                             scale=scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskedAttention:
    """Training backend: every token of a multi-block sequence attends under an explicit mask.

    Used with :meth:`~ardiff_jax.models.CausalDiT.forward_blocks`, where the current
    "block" is the whole sequence: ``q, k, v`` are all video tokens and ``extra_k, extra_v``
    all register tokens, in the layout that method documents.

    Attributes:
      mask: ``bool[S, S]``: ``mask[i, j]`` iff query token ``i`` sees key token ``j`` (keys
        in the same order as queries: video tokens, then register tokens). Every row must
        see at least its own token.
    """

    mask: jax.Array

    def attend(self, layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
               extra_v: jax.Array | None = None, scale: Any = None) -> jax.Array:
        del layer  # one mask serves every layer
        if extra_k is not None:
            k, v = jnp.concatenate([k, extra_k]), jnp.concatenate([v, extra_v])
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = jnp.einsum("shd,nhd->hsn", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
        scores = jnp.where(self.mask, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("hsn,nhd->shd", weights, v.astype(jnp.float32)).astype(q.dtype)


def block_causal_mask(
    config: CausalDiTConfig,
    frame_starts: Any,  # int[B]: each block instance's absolute first frame
    clean: Any,  # bool[B]: which instances are clean context (committed at inference)
) -> jax.Array:
    """``bool[S, S]``: the token mask under which a multi-block pass equals block-by-block inference.

    ``S = B * f * T + B * E`` (video tokens of every instance, then register tokens, the
    layout of :meth:`~ardiff_jax.models.CausalDiT.forward_blocks`). Instance ``i`` at frame
    ``p`` sees

    * its own video and register tokens (the current block and its scratch);
    * the video tokens of every *clean* instance whose frames the runtime's visible-window
      rule shows a forward at ``committed = p``: the sink frames and the newest
      ``window - f`` frames before ``p`` (``ardiff_jax.kv.visible_history``, the rule the
      paged view uses, so the two cannot drift apart).

    Register tokens of other instances are never visible: the runtime never caches them.
    Traceable: ``frame_starts`` and ``clean`` may be traced arrays.
    """
    f, tokens, num_reg = config.frames_per_block, config.tokens_per_frame, config.num_register_tokens
    starts = jnp.asarray(frame_starts, jnp.int32)
    clean = jnp.asarray(clean, bool)
    num_instances = starts.shape[0]
    layout = KVLayout(num_layers=config.num_layers, num_pages=config.sink_frames + config.window_frames,
                      tokens_per_frame=tokens, num_kv_heads=config.num_heads, head_size=config.head_dim,
                      sink_frames=config.sink_frames, window_frames=config.window_frames, frames_per_block=f,
                      scratch_pages=1)
    hist = visible_history(layout, starts, jnp.zeros_like(starts), f, jnp)  # per query instance
    key_frames = starts[:, None] + jnp.arange(f, dtype=jnp.int32)[None, :]  # [B, f]
    in_sink = key_frames[None, :, :] < hist.num_sink[:, None, None]  # [Bq, Bk, f]
    in_window = ((key_frames[None, :, :] >= hist.window_start[:, None, None])
                 & (key_frames[None, :, :] < starts[:, None, None]))
    history = (in_sink | in_window) & clean[None, :, None]
    itself = jnp.eye(num_instances, dtype=bool)
    video = history | itself[:, :, None]  # [Bq, Bk, f]: query instance sees key frame
    video = jnp.repeat(video, tokens, axis=2).reshape(num_instances, num_instances * f * tokens)
    registers = jnp.repeat(itself, num_reg, axis=1)  # [Bq, Bk * E]
    per_instance = jnp.concatenate([video, registers], axis=1)  # [Bq, S]
    rows = jnp.concatenate([jnp.repeat(per_instance, f * tokens, axis=0), jnp.repeat(per_instance, num_reg, axis=0)])
    return rows


def teacher_forcing_mask(config: CausalDiTConfig, num_frames: int, *, state_attends_like_inference: bool = False
                         ) -> np.ndarray:
    """``bool[S, S]``: DreamZero's teacher-forcing token mask (:meth:`~ardiff_jax.models.CausalDiT.
    forward_teacher_forcing`), ``S = 2 F T + N (A + S_r)``.

    Tokens: the ``F = 1 + N f`` clean frames, the ``F`` noisy frames, the ``N`` blocks' actions,
    then their states. As the release's training forward:

    * clean frame 0 and noisy frame 0 (the conditioning frame) see only themselves;
    * clean block ``i`` sees clean frame 0, the clean frames of its window up to itself
      (``window_frames`` frames ending with the block, frame 0 excluded from the count);
    * noisy block ``i`` and its actions see every clean frame before the block, the block's noisy
      frames, its actions and its state;
    * a state token sees its block's state tokens only (``state_attends_like_inference``: what an
      action token sees, which is what the cached inference shows it).
    """
    register = config.action_register
    if register is None:
        raise ValueError(f"config {config.name!r} has no action/state register")
    f, tokens, window = config.frames_per_block, config.tokens_per_frame, config.window_frames
    a, s = register.actions_per_block, register.states_per_block
    if num_frames < 1 + f or (num_frames - 1) % f:
        raise ValueError(f"num_frames must be 1 + a positive multiple of {f}, got {num_frames}")
    blocks = (num_frames - 1) // f
    video = num_frames * tokens
    size = 2 * video + blocks * (a + s)
    mask = np.zeros((size, size), bool)

    def clean(first: int, last: int) -> slice:
        return slice(first * tokens, last * tokens)

    def noisy(first: int, last: int) -> slice:
        return slice(video + first * tokens, video + last * tokens)

    def actions(i: int) -> slice:
        return slice(2 * video + i * a, 2 * video + (i + 1) * a)

    def states(i: int) -> slice:
        return slice(2 * video + blocks * a + i * s, 2 * video + blocks * a + (i + 1) * s)

    mask[clean(0, 1), clean(0, 1)] = True
    mask[noisy(0, 1), noisy(0, 1)] = True
    for i in range(blocks):
        first, end = 1 + i * f, 1 + (i + 1) * f
        mask[clean(first, end), clean(0, 1)] = True
        mask[clean(first, end), clean(max(1, end - window), end)] = True
        rows = [noisy(first, end), actions(i)] + ([states(i)] if state_attends_like_inference else [])
        for row in rows:
            for col in (clean(0, first), noisy(first, end), actions(i), states(i)):
                mask[row, col] = True
        if not state_attends_like_inference:
            mask[states(i), states(i)] = True
    return mask


def dot_attention(
    q: jax.Array,  # [S, H, D]
    k: jax.Array,  # [N, H, D]
    v: jax.Array,  # [N, H, D]
) -> jax.Array:
    """Plain non-causal softmax attention for cross-attention (text/image context), float32 softmax."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("shd,nhd->hsn", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hsn,nhd->shd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)
