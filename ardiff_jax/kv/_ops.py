"""Pure pool operations: block write (scatter), ordered gather, contiguous run read.

All functions are pure and jittable; ``layout`` is the static argument. The jitted
writer :func:`commit_block` donates the pools, so a commit costs the bytes of the block,
not a copy of the pool.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from ardiff_jax.kv._layout import KVLayout, KVPools, from_storage, to_storage

__all__ = ["write_block", "commit_block", "gather_pages", "read_run"]


def write_block(
    layout: KVLayout,
    pools: KVPools,
    pages: jax.Array,  # i32[f]: distinct destination pages; an id >= P (null page) drops the frame
    k: jax.Array,  # [L, f*T, H, D]
    v: jax.Array,  # [L, f*T, H, D]
) -> KVPools:
    """Write ``f`` frames of K/V for every layer into ``pages`` with one scatter per pool.

    Inside one jitted program (a device-side rollout), write a block *before* attending to
    the same pools, not after: XLA cannot order an earlier read of a buffer before an
    in-place scatter into it and copies the whole pool (measured on XLA:CPU, jax 0.10.2:
    temporaries = pool bytes for read-then-write, one block for write-then-read). Writing
    first is exact: :func:`~ardiff_jax.kv.block_pages` are never visible to the forward
    that commits them (its cursor still holds the old committed count).
    """
    num_frames = pages.shape[0]
    block_shape = (layout.num_layers, num_frames, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    k_pages = to_storage(layout, k.reshape(block_shape))
    v_pages = to_storage(layout, v.reshape(block_shape))
    # Pages of one commit are distinct (f <= window), which lets XLA skip conflict handling;
    # callers that drop several frames must use distinct out-of-range ids (P, P+1, ...).
    new_k = pools.k.at[:, pages].set(k_pages, mode="drop", unique_indices=True)
    new_v = pools.v.at[:, pages].set(v_pages, mode="drop", unique_indices=True)
    return KVPools(k=new_k, v=new_v)


#: ``write_block`` jitted with the pools donated: the only writer of the runtime's pools.
#: DONATES ``pools``: the caller must drop its references and use the returned pools.
commit_block = jax.jit(write_block, static_argnums=0, donate_argnums=1)


def gather_pages(
    layout: KVLayout,
    pools: KVPools,
    layer: jax.Array | int,  # i32[]
    pages: jax.Array,  # i32[n], null page P allowed
) -> tuple[jax.Array, jax.Array]:
    """Gather ``n`` pages of one layer in table order: ``(k, v)``, each ``dtype[n*T, H, D]``.

    Null pages read as zeros (``mode="fill"``), so padded tables are safe to gather.
    """
    n = pages.shape[0]
    out_shape = (n * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)

    def gather(pool: jax.Array) -> jax.Array:
        rows = pool.at[layer, pages].get(mode="fill", fill_value=0)
        return from_storage(layout, rows).reshape(out_shape)

    return gather(pools.k), gather(pools.v)


def read_run(
    layout: KVLayout,
    pools: KVPools,
    layer: jax.Array | int,  # i32[]
    run_base: jax.Array | int,  # i32[]: first page of the run
) -> tuple[jax.Array, jax.Array]:
    """Read one run (sink + ring pages) of one layer contiguously: ``dtype[(K+W)*T, H, D]`` each.

    A contiguous ``dynamic_slice`` instead of a gather: the run's pages are adjacent, and
    attention masks the invisible ones (see :func:`~ardiff_jax.kv.run_visibility`).
    """
    sizes = (1, layout.run_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    out_shape = (layout.run_pages * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    start = (layer, run_base, 0, 0, 0)

    def read(pool: jax.Array) -> jax.Array:
        run = jax.lax.dynamic_slice(pool, start, sizes)
        return from_storage(layout, run).reshape(out_shape)

    return read(pools.k), read(pools.v)


