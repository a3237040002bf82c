"""ardiff_jax: a JAX/XLA runtime for autoregressive video diffusion with KV kept across requests.

Public API (import from here):

* capability: :class:`ARDiffusionKVBranchSpec`, :class:`ARDiffusionCrossAttentionKVSpec`,
  :class:`ARDiffusionKVCacheSpec`, protocols :class:`SupportsARDiffusionPipeline`,
  :class:`SupportsARDiffusionWarmup`, :class:`SupportsStepExecution`;
* engine and runner: :class:`ARDiffusionEngine`, :class:`ARDiffusionModelRunner`,
  :class:`EngineConfig`, :class:`DiffusionRequest`, :class:`StepResult`,
  :class:`StepSchedulerOutput`, typed ticks :class:`ARDiffusionTickRequest`,
  :class:`ARDiffusionControlInput`, :class:`ARDiffusionChunkMetadata`;
* KV manager: :class:`ARDiffusionKVCache`, :class:`ARDiffusionKVState`, :class:`MemoryPlan`,
  :class:`PagedKVCaches`, :class:`CrossAttentionKV`;
* functional core: :mod:`ardiff_jax.kv`.
"""

from ardiff_jax.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionRequestValidation,
    SupportsARDiffusionWarmup,
    SupportsStepExecution,
)
from ardiff_jax.kv import KVLayout, KVPools, LayerKVCache, PagedKVCaches
from ardiff_jax.runtime import (
    AR_DIFFUSION_TICK_KEY,
    SCRATCH_BLOCKS_ENV,
    WARMUP_SESSION_ID,
    ARDiffusionChunkMetadata,
    ARDiffusionControlInput,
    ARDiffusionEngine,
    ARDiffusionModelRunner,
    ARDiffusionTickRequest,
    DiffusionRequest,
    EngineConfig,
    SessionEvent,
    StepResult,
    StepSchedulerOutput,
    ARDiffusionKVCache,
    ARDiffusionKVState,
    ARDiffusionRequestAdapter,
    CrossAttentionKV,
    MemoryPlan,
    plan_memory,
)

__version__ = "0.1.0"

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
    "ARDiffusionCrossAttentionKVSpec",
    "ARDiffusionKVBranchSpec",
    "ARDiffusionKVCache",
    "ARDiffusionKVCacheSpec",
    "ARDiffusionKVState",
    "ARDiffusionRequestAdapter",
    "CrossAttentionKV",
    "KVLayout",
    "KVPools",
    "LayerKVCache",
    "MemoryPlan",
    "PagedKVCaches",
    "SupportsARDiffusionPipeline",
    "SupportsARDiffusionRequestValidation",
    "SupportsARDiffusionWarmup",
    "SupportsStepExecution",
    "plan_memory",
]
