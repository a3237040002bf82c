"""Imperative shell: the KV manager, per-session state, memory plan (and, later, the runner)."""

from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._memory import (
    SCRATCH_BLOCKS_ENV,
    MemoryPlan,
    free_memory_bytes,
    plan_memory,
    scratch_blocks_override,
)
from ardiff_jax.runtime._state import ARDiffusionKVState, ARDiffusionRequestAdapter, CrossAttentionKV

__all__ = [
    "SCRATCH_BLOCKS_ENV",
    "ARDiffusionKVCache",
    "ARDiffusionKVState",
    "ARDiffusionRequestAdapter",
    "CrossAttentionKV",
    "MemoryPlan",
    "free_memory_bytes",
    "plan_memory",
    "scratch_blocks_override",
]
