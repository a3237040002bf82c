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

from ardiff_jax.kv import KVLayout, ref_attention, visible_history
from ardiff_jax.models._config import CausalDiTConfig

__all__ = ["SelfAttentionBackend", "DenseAttention", "MaskedAttention", "block_causal_mask", "dot_attention"]


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
