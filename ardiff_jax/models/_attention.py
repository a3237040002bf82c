"""Attention backends of the causal DiT: the paged runtime view or a dense, cache-free reference.

The transformer never touches KV storage itself. Its self-attention calls
``attention.attend(layer, q, k, v, extra_k=..., extra_v=..., scale=...)`` on whatever
backend it was handed: the runtime's :class:`~ardiff_jax.PagedKVCaches` (history read from
the paged pools) or :class:`DenseAttention` (history passed in as plain arrays, textbook
float32 softmax). The same module code therefore serves the engine and a from-scratch
reference rollout, which is what the equivalence tests compare.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ardiff_jax.kv import ref_attention

__all__ = ["SelfAttentionBackend", "DenseAttention", "dot_attention"]


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
