"""Imperative shell: the KV manager, per-session state, memory plan, runner and engine."""

from ardiff_jax.runtime._engine import ARDiffusionEngine
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._memory import (
    SCRATCH_BLOCKS_ENV,
    MemoryPlan,
    free_memory_bytes,
    plan_memory,
    scratch_blocks_override,
)
from ardiff_jax.runtime._requests import DiffusionRequest, EngineConfig, StepResult, StepSchedulerOutput
from ardiff_jax.runtime._runner import WARMUP_SESSION_ID, ARDiffusionModelRunner, SessionEvent
from ardiff_jax.runtime._state import ARDiffusionKVState, ARDiffusionRequestAdapter, CrossAttentionKV
from ardiff_jax.runtime._tick import (
    AR_DIFFUSION_TICK_KEY,
    ARDiffusionChunkMetadata,
    ARDiffusionControlInput,
    ARDiffusionTickRequest,
)

__all__ = [
    "AR_DIFFUSION_TICK_KEY",
    "SCRATCH_BLOCKS_ENV",
    "WARMUP_SESSION_ID",
    "ARDiffusionChunkMetadata",
    "ARDiffusionControlInput",
    "ARDiffusionEngine",
    "ARDiffusionModelRunner",
    "ARDiffusionTickRequest",
    "DiffusionRequest",
    "EngineConfig",
    "SessionEvent",
    "StepResult",
    "StepSchedulerOutput",
    "ARDiffusionKVCache",
    "ARDiffusionKVState",
    "ARDiffusionRequestAdapter",
    "CrossAttentionKV",
    "MemoryPlan",
    "free_memory_bytes",
    "plan_memory",
    "scratch_blocks_override",
]
