"""Functional core: static layout, device pools and pure jittable KV operations.

Everything here is a pure function of pytrees plus a static, hashable :class:`KVLayout`;
it runs eagerly, under ``jax.jit``, inside ``lax.scan`` carries and in device-side
rollouts. Host bookkeeping (which session owns which run, cursors, LRU) lives in
:mod:`ardiff_jax.runtime`.
"""

from ardiff_jax.kv._attention import paged_attention, ref_attention, ref_paged_attention
from ardiff_jax.kv._backends import (
    AttentionBackend,
    attention_backend,
    attention_backends,
    check_attention_backend,
    register_attention_backend,
)
from ardiff_jax.kv._caches import LayerKVCache, PagedKVCaches
from ardiff_jax.kv._layout import (
    KVLayout,
    KVPools,
    allocate_pools,
    default_storage_dtype,
    from_storage,
    to_storage,
)
from ardiff_jax.kv._ops import commit_block, gather_pages, read_run, write_block
from ardiff_jax.kv._tables import (
    CURSOR_FIELDS,
    VisibleHistory,
    advance_cursor,
    block_pages,
    make_cursor,
    page_of_frame,
    run_visibility,
    visible_history,
    visible_table,
)

__all__ = [
    "AttentionBackend",
    "attention_backend",
    "attention_backends",
    "check_attention_backend",
    "register_attention_backend",
    "CURSOR_FIELDS",
    "KVLayout",
    "KVPools",
    "LayerKVCache",
    "PagedKVCaches",
    "VisibleHistory",
    "advance_cursor",
    "allocate_pools",
    "block_pages",
    "commit_block",
    "default_storage_dtype",
    "from_storage",
    "gather_pages",
    "make_cursor",
    "page_of_frame",
    "paged_attention",
    "read_run",
    "ref_attention",
    "ref_paged_attention",
    "run_visibility",
    "to_storage",
    "visible_history",
    "visible_table",
    "write_block",
]
