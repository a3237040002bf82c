"""The ardiff_jax runtime as a peer: the real path a pipeline takes per block.

``commit_block`` is ``state.get_kv_caches(..., commit_current=True)`` followed by
``state.commit_paged_context(..., kv=(k, v))`` (host bookkeeping + the core's donated
writer, one ``dynamic_update_slice`` per frame, into the ring pages the commit evicts).
``read_visible`` gets a fresh view with ``get_kv_caches(..., commit_current=False)`` (what
the next forward does) and, layer by layer, produces exactly the history ``paged_attention``
reads (:func:`benchmarks.bench_kv.history_read`: ``run_visibility`` +
``read_run(..., page_visible)``, invisible pages zeroed in the storage dtype) and hands it
to the shared float32 sum, like every other peer hands its attention input.

What that costs beyond the other peers, and why it overstates attention's read: the
history is a slice of the pools with a page mask, so it exists as an array only once a
program produces it (here the jitted read's output: one write and one more read of the
run). The other peers hand arrays that already exist (views, a stacked cache). Inside the
compiled ``attend`` the same slice and mask fuse into the copy that lays the keys out for
the score einsum, a copy XLA:CPU makes for dense contiguous keys too
(``results/hlo/medium/attend.hlo.txt`` vs ``dense_dpa.hlo.txt``). Fusing the read into the
sum instead does not help on XLA:CPU: reductions are YNN custom fusions that take no fused
producer, so the masked run is materialised either way (measured at medium, all layers in
one ``fori_loop`` program: 0.64x of this at W=6, 1.2x at W=24 and W=48).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.peers import PeerCache, PeerGeometry

__all__ = ["ArdiffRuntimeCache", "ring_attention_input", "ring_read_all_layers"]


def _ring_attention_input(layout: Any, pools: Any, cursor: jax.Array, layer: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
    from benchmarks.bench_kv import history_read

    return history_read(layout, pools, cursor, layer, layout.frames_per_block)


#: ``(layout, pools, cursor, layer) -> (k, v)``: the history ``paged_attention`` reads for one layer.
ring_attention_input = jax.jit(_ring_attention_input, static_argnums=0)


def ring_read_all_layers(layout: Any, pools: Any, cursor: Any) -> list[jax.Array]:
    """Every layer's attention input, reduced by the shared ``sum_f32`` (one call per layer)."""
    from benchmarks.peers import sum_f32

    out = []
    for layer in range(layout.num_layers):
        k, v = ring_attention_input(layout, pools, cursor, np.int32(layer))
        out.append(sum_f32(k, v))
    return out


def ring_visible_kv(layout: Any, pools: Any, cursor: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The visible history of one layer in time order, float32 numpy (for checks)."""
    from ardiff_jax.kv import gather_pages, visible_table

    pages, frames = visible_table(layout, cursor, layout.frames_per_block, np)
    pages = pages[frames >= 0]
    k, v = gather_pages(layout, pools, np.int32(layer), pages)
    return np.asarray(k, np.float32), np.asarray(v, np.float32)


class ArdiffRuntimeCache(PeerCache):
    name = "ardiff_jax"

    def __init__(self, geometry: PeerGeometry) -> None:
        super().__init__(geometry)
        from ardiff_jax.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
        from ardiff_jax.runtime import ARDiffusionKVCache

        g = geometry
        spec = ARDiffusionKVCacheSpec(
            num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_size=g.head_size,
            tokens_per_frame=g.tokens_per_frame, frames_per_block=g.frames_per_block,
            window_frames=g.window_frames, sink_frames=g.sink_frames,
            kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=1,
            max_model_len=2**30,  # long steady-state runs must not hit the session limit
        )
        self.cache = ARDiffusionKVCache(spec, dtype=geometry.dtype, available_memory_bytes=64 * 2**30,
                                        gpu_memory_fraction=1.0)
        self.layout = self.cache.layout
        self.state = self.cache.create_state("peer")
        self.branch = spec.kv_branches[0].name

    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        dtype = jnp.dtype(self.geometry.dtype)
        return jnp.asarray(k, dtype), jnp.asarray(v, dtype)

    def commit_block(self, k: Any, v: Any) -> None:
        self.state.get_kv_caches(self.branch, seq_len=self.geometry.block_tokens, commit_current=True)
        self.state.commit_paged_context(self.branch, kv=(k, v))

    def _view(self) -> Any:
        return self.state.get_kv_caches(self.branch, seq_len=self.geometry.block_tokens, commit_current=False)

    def read_visible(self) -> Any:
        caches = self._view()
        return ring_read_all_layers(self.layout, caches.pools, caches.cursor)

    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        caches = self._view()
        return ring_visible_kv(self.layout, caches.pools, np.asarray(caches.cursor), layer)

    def sync(self, out: Any = None) -> None:
        jax.block_until_ready((self.cache.pools, out) if out is not None else self.cache.pools)

    def close(self) -> None:
        self.cache.close()
