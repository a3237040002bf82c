"""A naive functional JAX cache: concatenate the new block, slice the last window.

K and V are each one array ``[L, n*T, H, D]`` (all layers stacked: the few-leaves rule
is kept, so only the cache policy is naive) holding the sink frames followed by the newest
committed frames. A commit is ``concatenate([cache, block])`` and, once longer than the
history the next forward may see (``K + W - F`` frames), ``concatenate([sink, last
W - F frames])``. It is jitted per call with no donation; the shape changes while the
window fills, so it compiles once per length (``(K + W - F) / F + 1`` programs), then
reuses one program in the steady state. Each commit writes a whole new window
(read + write of ``K + W - F`` frames per layer, K and V): linear in the window.

The arrays hold the logical dtype (bf16 on CPU too): concatenation and slicing are data
movement, which XLA:CPU does not widen to f32 (only arithmetic and scatter are).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.peers import PeerCache, PeerGeometry

__all__ = ["NaiveJaxCache"]


def _append(cache_k: jax.Array, cache_v: jax.Array, k: jax.Array, v: jax.Array, *, sink_tokens: int,
            history_tokens: int) -> tuple[jax.Array, jax.Array]:
    def append(cache: jax.Array, new: jax.Array) -> jax.Array:
        out = jnp.concatenate([cache, new], axis=1)
        if out.shape[1] > history_tokens:  # static: decided per compiled length
            keep = history_tokens - sink_tokens
            out = jnp.concatenate([out[:, :sink_tokens], out[:, out.shape[1] - keep:]], axis=1)
        return out

    return append(cache_k, k), append(cache_v, v)


_append_jit = jax.jit(_append, static_argnames=("sink_tokens", "history_tokens"))


class NaiveJaxCache(PeerCache):
    name = "naive_jax"

    def __init__(self, geometry: PeerGeometry) -> None:
        super().__init__(geometry)
        g = geometry
        shape = (g.num_layers, 0, g.num_kv_heads, g.head_size)
        self.k = jnp.zeros(shape, g.dtype)
        self.v = jnp.zeros(shape, g.dtype)
        self.sink_tokens = g.sink_frames * g.tokens_per_frame
        self.history_tokens = g.history_frames * g.tokens_per_frame

    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        dtype = jnp.dtype(self.geometry.dtype)
        return jnp.asarray(k, dtype), jnp.asarray(v, dtype)

    def commit_block(self, k: Any, v: Any) -> None:
        self.k, self.v = _append_jit(self.k, self.v, k, v, sink_tokens=self.sink_tokens,
                                     history_tokens=self.history_tokens)

    def read_visible(self) -> Any:
        from benchmarks.peers import sum_f32

        # The whole stacked cache is the visible history of every layer: one reduction call.
        return sum_f32(self.k, self.v)

    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.k[layer], np.float32), np.asarray(self.v[layer], np.float32)

    def sync(self, out: Any = None) -> None:
        jax.block_until_ready((self.k, self.v, out) if out is not None else (self.k, self.v))

    def close(self) -> None:
        self.k.delete()
        self.v.delete()
