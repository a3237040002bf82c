"""Functional core: static layout, device pools and pure jittable KV operations.

Everything here is a pure function of pytrees plus a static, hashable :class:`KVLayout`;
it runs eagerly, under ``jax.jit``, inside ``lax.scan`` carries and in device-side
rollouts. Host bookkeeping (which session owns which run, cursors, LRU) lives in
:mod:`ardiff_jax.runtime`.

Shapes
------
Every public function, class and method here that takes or returns arrays lists them in a
``Shapes:`` section of its docstring, one line per argument (or group of arguments that
share a shape) and one ``returns:`` line, each ``name: dtype[dims]``::

    Shapes:
      pages: i32[f]
      k, v: float[L, f*T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]

A pytree result (``KVPools``, a tuple, ``VisibleHistory``) names its type; every array in
it has the one shape given. Optional arguments are listed with the shape they have when
given. ``tests/test_kv_shapes.py`` reads these sections and checks them against the code.

dtypes:
  ``i32``, ``f32``, ``bool``: exactly that dtype;
  ``int``, ``float``: any integer / any floating dtype (``int`` where host numpy code
  keeps the caller's integer type);
  ``dtype``: the layout's logical KV dtype (``layout.dtype``);
  ``storage``: the pools' dtype (``layout.storage_dtype``: the logical dtype, or ``uint16``
  bit patterns of a 16-bit float on CPU);
  ``q.dtype``: the dtype of argument ``q``.

dims (sizes from the :class:`KVLayout` or from the call):
  ``L`` layers, ``P`` real pages per pool (page id ``P`` is the null page), ``T`` tokens
  per frame (one page), ``H`` KV heads, ``Hq`` query heads (a multiple of ``H``), ``D``
  head size, ``K`` sink frames, ``W`` window (ring) frames, ``f`` current frames of one
  forward or commit, ``E`` extra (action/state) tokens, ``S`` query tokens, ``n`` pages in
  a table, ``N`` keys, ``V`` visible history frames (at most ``K + W``), ``B`` rows (sessions)
  of a batched tick. ``[]`` is a
  scalar; ``[...]`` is any shape, the same on both sides; ``f*T``, ``(K+W)*T`` are
  products of those sizes. A scalar such as ``layer: i32[]`` may also be a Python int.
  The attention functions also accept a leading batch axis of size 1 on ``q``, ``k``,
  ``v`` and the extras (``[1, S, Hq, D]``); the output then keeps it.
"""

from ardiff_jax.kv._attention import paged_attention, ref_attention, ref_paged_attention
from ardiff_jax.kv._backends import (
    AttentionBackend,
    attention_backend,
    attention_backends,
    check_attention_backend,
    register_attention_backend,
    unregister_attention_backend,
)
from ardiff_jax.kv._caches import LayerKVCache, PagedKVCaches
from ardiff_jax.kv._cudnn import (
    cudnn_paged_attention,
    cudnn_support,
    ordered_window_attention,
    select_attention_backend,
)
from ardiff_jax.kv._layout import (
    KVLayout,
    KVPools,
    allocate_pools,
    default_storage_dtype,
    from_storage,
    to_storage,
)
from ardiff_jax.kv._ops import (
    commit_block,
    commit_blocks,
    gather_pages,
    gather_table_pages,
    read_pages,
    read_run,
    restore_pages,
    scatter_table_pages,
    write_block,
    write_blocks,
    write_pages,
)
from ardiff_jax.kv._sharding import (
    KVSharding,
    check_mesh,
    shard_zeros,
    sharded_attention,
    sharded_read_runs,
    sharded_write_block,
    sharded_write_runs,
)
from ardiff_jax.kv._tables import (
    CURSOR_FIELDS,
    VisibleHistory,
    advance_cursor,
    advance_frames,
    contiguous_table_cursor,
    cursor_block_pages,
    cursor_pages,
    make_table_cursor,
    run_visibility,
    slot_of_frame,
    visible_history,
    visible_table,
)

__all__ = [
    "AttentionBackend",
    "attention_backend",
    "attention_backends",
    "check_attention_backend",
    "cudnn_paged_attention",
    "cudnn_support",
    "ordered_window_attention",
    "select_attention_backend",
    "register_attention_backend",
    "unregister_attention_backend",
    "CURSOR_FIELDS",
    "KVLayout",
    "KVPools",
    "KVSharding",
    "check_mesh",
    "shard_zeros",
    "sharded_attention",
    "sharded_write_block",
    "sharded_read_runs",
    "sharded_write_runs",
    "LayerKVCache",
    "PagedKVCaches",
    "VisibleHistory",
    "advance_cursor",
    "advance_frames",
    "allocate_pools",
    "contiguous_table_cursor",
    "cursor_block_pages",
    "cursor_pages",
    "commit_block",
    "commit_blocks",
    "default_storage_dtype",
    "from_storage",
    "gather_pages",
    "gather_table_pages",
    "make_table_cursor",
    "paged_attention",
    "read_pages",
    "read_run",
    "restore_pages",
    "ref_attention",
    "ref_paged_attention",
    "run_visibility",
    "scatter_table_pages",
    "slot_of_frame",
    "to_storage",
    "visible_history",
    "visible_table",
    "write_block",
    "write_blocks",
    "write_pages",
]
