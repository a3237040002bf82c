"""ardiff_jax: a JAX/XLA runtime for autoregressive video diffusion with KV kept across requests.

What a user starts with (``ardiff_jax.__all__``):

* the capability a pipeline implements: :class:`ARDiffusionKVCacheSpec`,
  :class:`ARDiffusionKVBranchSpec`, :class:`ARDiffusionCrossAttentionKVSpec` and the
  protocols :class:`SupportsARDiffusionPipeline`, :class:`SupportsARDiffusionWarmup`,
  :class:`SupportsStepExecution`, :class:`SupportsARDiffusionSessionExport` (offload and
  saved sessions);
* serving it: :class:`ARDiffusionEngine`, :class:`EngineConfig`, :class:`DiffusionRequest`;
* inside a pipeline: :class:`ARDiffusionKVState` (the bound session) and
  :class:`PagedKVCaches` (what the model's jit receives);
* planning memory: :class:`MemoryPlan`, :func:`plan_memory`.

Everything else is documented under its subpackage: :mod:`ardiff_jax.kv` (the functional
core), :mod:`ardiff_jax.runtime` (KV manager, session value, runner, session table),
:mod:`ardiff_jax.types` (requests, results, ticks), :mod:`ardiff_jax.rollout` (device-side
rollouts), :mod:`ardiff_jax.models` (reference models) and :mod:`ardiff_jax.envs` (procedural
worlds to train them on). Names that earlier releases
exported from here stay importable from here.
"""

# Compatibility names (COMPAT_NAMES below) are imported here on purpose, outside __all__.
from ardiff_jax.capability import (  # noqa: F401
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionRequestValidation,
    SupportsARDiffusionSessionExport,
    SupportsARDiffusionWarmup,
    SupportsStepExecution,
)
from ardiff_jax.kv import KVLayout, KVPools, LayerKVCache, PagedKVCaches  # noqa: F401
from ardiff_jax.runtime import (  # noqa: F401
    SCRATCH_BLOCKS_ENV,
    WARMUP_SESSION_ID,
    ARDiffusionEngine,
    ARDiffusionKVCache,
    ARDiffusionKVState,
    ARDiffusionModelRunner,
    ARDiffusionRequestAdapter,
    CrossAttentionKV,
    MemoryPlan,
    SessionEvent,
    plan_memory,
)
from ardiff_jax.types import (  # noqa: F401
    AR_DIFFUSION_TICK_KEY,
    ARDiffusionChunkMetadata,
    ARDiffusionControlInput,
    ARDiffusionTickRequest,
    DiffusionRequest,
    EngineConfig,
    StepResult,
    StepSchedulerOutput,
)

__version__ = "0.1.0"

__all__ = [
    "ARDiffusionCrossAttentionKVSpec",
    "ARDiffusionEngine",
    "ARDiffusionKVBranchSpec",
    "ARDiffusionKVCacheSpec",
    "ARDiffusionKVState",
    "DiffusionRequest",
    "EngineConfig",
    "MemoryPlan",
    "PagedKVCaches",
    "SupportsARDiffusionPipeline",
    "SupportsARDiffusionSessionExport",
    "SupportsARDiffusionWarmup",
    "SupportsStepExecution",
    "plan_memory",
]

#: Names importable from ``ardiff_jax`` for compatibility, documented under their subpackages.
COMPAT_NAMES = (
    "AR_DIFFUSION_TICK_KEY", "SCRATCH_BLOCKS_ENV", "WARMUP_SESSION_ID", "ARDiffusionChunkMetadata",
    "ARDiffusionControlInput", "ARDiffusionKVCache", "ARDiffusionModelRunner", "ARDiffusionRequestAdapter",
    "ARDiffusionTickRequest", "CrossAttentionKV", "KVLayout", "KVPools", "LayerKVCache", "SessionEvent",
    "StepResult", "StepSchedulerOutput", "SupportsARDiffusionRequestValidation",
)
