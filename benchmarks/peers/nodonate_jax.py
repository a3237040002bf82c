"""The ardiff_jax ring-page layout with the write jitted WITHOUT donation.

Same pools ``[L, P, T, H, D]`` (storage dtype per backend), same pages
(``cursor_block_pages`` of the run's table cursor), same writer (``ardiff_jax.kv.write_block``: one ``dynamic_update_slice``
per frame) and the same read as the runtime; the only difference is
``jax.jit(write_block)`` instead of the donated ``commit_block``. XLA must then return a
fresh pool per commit, so every commit copies the whole pool (``K + W`` pages of every
layer, K and V) before writing the block: the cost that donation removes, and it grows
linearly with the window.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.peers import PeerCache, PeerGeometry
from benchmarks.peers.ardiff import ring_read_all_layers, ring_visible_kv

__all__ = ["NoDonateJaxCache"]


def _write_no_donate() -> Any:
    from ardiff_jax.kv import write_block

    return jax.jit(write_block, static_argnums=0)  # no donate_argnums: the point of this peer


class NoDonateJaxCache(PeerCache):
    name = "nodonate_jax"

    def __init__(self, geometry: PeerGeometry) -> None:
        super().__init__(geometry)
        from ardiff_jax.kv import KVLayout, allocate_pools, default_storage_dtype

        g = geometry
        run_pages = g.sink_frames + g.window_frames
        self.layout = KVLayout(
            num_layers=g.num_layers, num_pages=run_pages, tokens_per_frame=g.tokens_per_frame,
            num_kv_heads=g.num_kv_heads, head_size=g.head_size, sink_frames=g.sink_frames,
            window_frames=g.window_frames, frames_per_block=g.frames_per_block, scratch_pages=g.frames_per_block,
            dtype=g.dtype, storage_dtype=default_storage_dtype(g.dtype, jax.default_backend()),
        )
        self.pools = allocate_pools(self.layout)
        self.committed = 0
        self._write = _write_no_donate()

    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        dtype = jnp.dtype(self.geometry.dtype)
        return jnp.asarray(k, dtype), jnp.asarray(v, dtype)

    def _cursor(self) -> np.ndarray:
        from ardiff_jax.kv import contiguous_table_cursor

        return contiguous_table_cursor(self.layout, 0, self.committed, 0)

    def commit_block(self, k: Any, v: Any) -> None:
        from ardiff_jax.kv import cursor_block_pages

        pages = cursor_block_pages(self.layout, self._cursor(), self.geometry.frames_per_block, np)
        self.pools = self._write(self.layout, self.pools, pages, k, v)
        self.committed += self.geometry.frames_per_block

    def read_visible(self) -> Any:
        return ring_read_all_layers(self.layout, self.pools, self._cursor())

    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return ring_visible_kv(self.layout, self.pools, self._cursor(), layer)

    def sync(self, out: Any = None) -> None:
        jax.block_until_ready((self.pools, out) if out is not None else self.pools)

    def close(self) -> None:
        self.pools.delete()
