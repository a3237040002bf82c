"""Pure pool operations: block write, ordered gather, contiguous run read, page-range copy.

All functions are pure and jittable; ``layout`` is the static argument. The jitted
writers :func:`commit_block` and :func:`restore_pages` donate the pools, so a commit or a
restore costs the bytes it writes, not a copy of the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ardiff_jax.kv._layout import KVLayout, KVPools, checked_layer, from_storage, to_storage

__all__ = ["write_block", "commit_block", "write_blocks", "commit_blocks", "gather_pages", "read_run", "read_pages",
           "write_pages", "restore_pages", "gather_table_pages", "scatter_table_pages"]


def write_block(
    layout: KVLayout,
    pools: KVPools,
    pages: jax.Array,  # destination page per frame; an id outside [0, P) drops the frame
    k: jax.Array,
    v: jax.Array,
) -> KVPools:
    """Write ``f`` frames of K/V for every layer into ``pages``: one in-place update per frame.

    Why not one scatter (``pool.at[:, pages].set``): its update window keeps the layer axis,
    so XLA:CPU first transposes the block into a block-sized temporary and then runs a
    generic scatter loop. A ``dynamic_update_slice`` per frame writes ``L`` contiguous runs
    straight from the block with no temporary, at about the cost of the bytes it moves
    (measured in ``benchmarks/bench_kv.py``).

    ``dynamic_update_slice`` clamps an out-of-range start where a scatter would drop it, so a
    dropped frame writes the clamped page's *current* contents back: a no-op that XLA fuses
    into the in-place update. The updates are chained, so this stays exact even when a real
    frame of the same block targets the clamped page.

    Inside one jitted program (a device-side rollout), write a block *before* attending to
    the same pools, not after: XLA cannot order an earlier read of a buffer before an
    in-place update of it and copies the whole pool (measured in ``benchmarks/bench_kv.py``).
    Writing first is exact: :func:`~ardiff_jax.kv.cursor_block_pages` are never visible to the
    forward that commits them (its cursor still holds the old committed count).

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      pages: i32[f]
      k, v: float[L, f*T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    num_frames = pages.shape[0]
    block_shape = (layout.num_layers, num_frames, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    page_shape = (layout.num_layers, 1) + block_shape[2:]

    def write(pool: jax.Array, block: jax.Array) -> jax.Array:
        block = to_storage(layout, block.reshape(block_shape))
        for i in range(num_frames):
            page = pages[i]
            start = (0, jnp.clip(page, 0, layout.num_pages - 1), 0, 0, 0)
            keep = jax.lax.dynamic_slice(pool, start, page_shape)
            frame = jnp.where((page >= 0) & (page < layout.num_pages), block[:, i:i + 1], keep)
            pool = jax.lax.dynamic_update_slice(pool, frame, start)
        return pool

    return KVPools(k=write(pools.k, k), v=write(pools.v, v))


#: ``write_block`` jitted with the pools donated: the only writer of the runtime's pools.
#: DONATES ``pools``: the caller must drop its references and use the returned pools.
commit_block = jax.jit(write_block, static_argnums=0, donate_argnums=1)


def write_blocks(
    layout: KVLayout,
    pools: KVPools,
    pages: jax.Array,  # destination page per (row, frame); an id outside [0, P) drops that frame
    k: jax.Array,
    v: jax.Array,
) -> KVPools:
    """Write the blocks of ``B`` sessions (one row each) in one program: a batched tick's commit.

    The same per-frame in-place update as :func:`write_block`, chained over every row, so
    the rows of a batch cost what their bytes cost and no block-sized temporary is made.
    A padded row (a batch bucket larger than the batch) carries the null page ``P`` for
    every frame and writes nothing; distinct sessions own distinct runs, so real rows never
    target the same page.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      pages: i32[B, f]
      k, v: float[B, L, f*T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    num_rows, num_frames = pages.shape
    block_shape = (num_rows, layout.num_layers, num_frames, layout.tokens_per_frame, layout.num_kv_heads,
                   layout.head_size)
    page_shape = (layout.num_layers, 1) + block_shape[3:]

    def write(pool: jax.Array, blocks: jax.Array) -> jax.Array:
        blocks = to_storage(layout, blocks.reshape(block_shape))
        for row in range(num_rows):
            for i in range(num_frames):
                page = pages[row, i]
                start = (0, jnp.clip(page, 0, layout.num_pages - 1), 0, 0, 0)
                keep = jax.lax.dynamic_slice(pool, start, page_shape)
                frame = jnp.where((page >= 0) & (page < layout.num_pages), blocks[row, :, i:i + 1], keep)
                pool = jax.lax.dynamic_update_slice(pool, frame, start)
        return pool

    return KVPools(k=write(pools.k, k), v=write(pools.v, v))


#: ``write_blocks`` jitted with the pools donated: a batched tick's one commit.
#: DONATES ``pools``: the caller must drop its references and use the returned pools.
commit_blocks = jax.jit(write_blocks, static_argnums=0, donate_argnums=1)


def gather_pages(
    layout: KVLayout,
    pools: KVPools,
    layer: jax.Array | int,  # may be traced; a concrete layer is range-checked
    pages: jax.Array,  # page ids in key order; the null page P is allowed
) -> tuple[jax.Array, jax.Array]:
    """Gather ``n`` pages of one layer in table order: ``(k, v)`` in the logical dtype.

    Null pages read as zeros (``mode="fill"``), so padded tables are safe to gather.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      layer: i32[]
      pages: i32[n]
      returns: (k, v), each dtype[n*T, H, D]
    """
    layer = checked_layer(layout, layer)
    n = pages.shape[0]
    out_shape = (n * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)

    def gather(pool: jax.Array) -> jax.Array:
        rows = pool.at[layer, pages].get(mode="fill", fill_value=0)
        return from_storage(layout, rows).reshape(out_shape)

    return gather(pools.k), gather(pools.v)


def read_run(
    layout: KVLayout,
    pools: KVPools,
    layer: jax.Array | int,  # may be traced; a concrete layer is range-checked
    run_base: jax.Array | int,  # first page of the run
    page_mask: jax.Array | None = None,  # pages to keep, in physical order; the others read as zeros
) -> tuple[jax.Array, jax.Array]:
    """Read one run (sink + ring pages) of one layer contiguously: ``(k, v)`` in the logical dtype.

    A contiguous ``dynamic_slice`` instead of a gather: the run's pages are adjacent, and
    attention masks the invisible ones (see :func:`~ardiff_jax.kv.run_visibility`).
    ``page_mask`` zeroes whole pages in the *storage* dtype, before the bitcast: a select on
    bf16 is widened to f32 by XLA:CPU (the run materialised at twice its size), a select on
    the uint16 bits fuses into the read.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      layer: i32[]
      run_base: i32[]
      page_mask: bool[K+W]
      returns: (k, v), each dtype[(K+W)*T, H, D]
    """
    layer = checked_layer(layout, layer)
    sizes = (1, layout.run_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    out_shape = (layout.run_pages * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    start = (layer, run_base, 0, 0, 0)

    def read(pool: jax.Array) -> jax.Array:
        run = jax.lax.dynamic_slice(pool, start, sizes)
        if page_mask is not None:
            run = jnp.where(page_mask[None, :, None, None, None], run, jnp.zeros((), run.dtype))
        return from_storage(layout, run).reshape(out_shape)

    return read(pools.k), read(pools.v)


def read_pages(
    layout: KVLayout,
    pools: KVPools,
    start: jax.Array | int,  # first page; the runtime checks start + num_pages <= P on the host
    num_pages: int,  # static
) -> KVPools:
    """Copy ``num_pages`` consecutive pages of every layer: one session's runs, for offload.

    A session's runs are adjacent (its slot's local branches, each sink + ring), so its KV
    is one contiguous ``dynamic_slice`` of each pool: the copy costs the session's bytes,
    never the pool's. Like ``dynamic_slice``, a range past the end is clamped; callers
    validate ``start`` first.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      start: i32[]
      returns: KVPools; k, v: storage[L, n, T, H, D]
    """
    sizes = (layout.num_layers, num_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    begin = (0, start, 0, 0, 0)
    return KVPools(k=jax.lax.dynamic_slice(pools.k, begin, sizes), v=jax.lax.dynamic_slice(pools.v, begin, sizes))


def write_pages(
    layout: KVLayout,
    pools: KVPools,
    start: jax.Array | int,  # first page; the runtime checks start + n <= P on the host
    pages: KVPools,  # what read_pages returned (same layout)
) -> KVPools:
    """Write consecutive pages of every layer back at ``start``: the inverse of :func:`read_pages`.

    One ``dynamic_update_slice`` per pool, in place under donation (:data:`restore_pages`).
    The pages are stored bits, written as they are: a round trip is bit-exact.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      start: i32[]
      pages: KVPools; k, v: storage[L, n, T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    begin = (0, start, 0, 0, 0)
    return KVPools(k=jax.lax.dynamic_update_slice(pools.k, pages.k, begin),
                   v=jax.lax.dynamic_update_slice(pools.v, pages.v, begin))


#: :func:`write_pages` jitted with the pools donated: restoring a session is one in-place write.
#: DONATES ``pools``: the caller must drop its references and use the returned pools.
restore_pages = jax.jit(write_pages, static_argnums=0, donate_argnums=1)


def _gather_table_pages(layout: KVLayout, pools: KVPools, pages: jax.Array) -> KVPools:
    """Copy the pages ``pages`` names, of every layer, in that order (null entries read as zeros).

    A session whose runs were remapped (a fork's shared or fresh pages) is not one contiguous
    slice; this gives the same array :func:`read_pages` gives for a contiguous session, so an
    offloaded or saved fork stands alone.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      pages: i32[n]
      returns: KVPools; k, v: storage[L, n, T, H, D]
    """
    def take(pool: jax.Array) -> jax.Array:
        return jnp.take(pool, pages, axis=1, mode="fill", fill_value=0)

    return KVPools(k=take(pools.k), v=take(pools.v))


def _scatter_table_pages(layout: KVLayout, pools: KVPools, pages: jax.Array, data: KVPools) -> KVPools:
    """Write ``data``'s pages to the pages ``pages`` names (null entries dropped): the inverse of the gather.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      pages: i32[n]
      data: KVPools; k, v: storage[L, n, T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    return KVPools(k=pools.k.at[:, pages].set(data.k, mode="drop"), v=pools.v.at[:, pages].set(data.v, mode="drop"))


#: A copy of a session's pages by page table (the pools are not donated).
gather_table_pages = jax.jit(_gather_table_pages, static_argnums=0)
#: Pages written back by page table, in place: DONATES ``pools``.
scatter_table_pages = jax.jit(_scatter_table_pages, static_argnums=0, donate_argnums=1)

