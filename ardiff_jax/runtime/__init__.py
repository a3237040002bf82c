"""Imperative shell: the KV manager, per-session state, memory plan, session table, runner and engine.

Power-user names live here; :mod:`ardiff_jax` re-exports what most users start with.

* session value: :class:`SessionKV`, :class:`BranchCursor`, :class:`CrossAttentionKV` and the
  pure functions over it (:func:`commit_frames` is the one commit rule);
* policy: :class:`SessionTable` (LRU order, capacity, eviction choice, pins; host only) and
  :class:`HostSessionTier` (offloaded sessions, LRU by bytes);
* sessions off the device: :class:`OffloadedSession` (a session's pages, caches, cursors and
  model state in host memory) and, on disk, :class:`SessionFileError`,
  :data:`SESSION_FORMAT_VERSION`;
* KV manager: :class:`ARDiffusionKVCache`, :class:`ARDiffusionKVState`,
  :class:`ARDiffusionRequestAdapter`, :class:`StateCheckpoint` (``state.checkpoint()`` /
  ``state.rollback()``); the commit transaction (:class:`CommitPlan`: :func:`plan_commits`,
  :func:`plan_rollout`, :func:`own_rollout_pages`, :func:`dispatch_commit`, :func:`publish_commit`,
  :func:`commit_planned`, :func:`prepare_forwards`); memory plan: :class:`MemoryPlan`, :func:`plan_memory`;
* execution: :class:`ARDiffusionModelRunner`, :class:`ARDiffusionEngine`, :class:`SessionEvent`;
  batched ticks: :class:`ARDiffusionKVBatch` (one paged view over a batch's slots),
  :class:`ARDiffusionBatchError`, :func:`batch_buckets`, :func:`bucket_for`;
* replicas: :class:`ARDiffusionRouter` (sessions sticky to one engine, new ones to the least
  loaded), and with the ``[ray]`` extra :func:`ray_replicas` / :class:`RayEngineProxy`
  (each replica a Ray actor owning its engine; ``RayReplica`` is built on first use).
"""

from ardiff_jax.runtime._batch import (
    ARDiffusionBatchError,
    ARDiffusionKVBatch,
    SessionRestoreError,
    batch_buckets,
    bucket_for,
)
from ardiff_jax.runtime._engine import ARDiffusionEngine
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._memory import (
    SCRATCH_BLOCKS_ENV,
    MemoryPlan,
    free_memory_bytes,
    plan_memory,
    scratch_blocks_override,
)
from ardiff_jax.runtime._offload import HostSessionTier, OffloadedSession
from ardiff_jax.runtime._persist import SESSION_FORMAT_VERSION, SessionFileError
from ardiff_jax.runtime._ray import EngineReplica, RayEngineProxy, ray_replica_class, ray_replicas
from ardiff_jax.runtime._router import ARDiffusionRouter, ReplicaAssignments, RouterMemoryPlan
from ardiff_jax.runtime._runner import WARMUP_SESSION_ID, ARDiffusionModelRunner, SessionEvent
from ardiff_jax.runtime._session import (
    BranchCursor,
    CrossAttentionKV,
    SessionKV,
    branch_cursor_array,
    check_session_kv,
    clear_cross_attention,
    commit_frames,
    fork_session_kv,
    new_session_kv,
    publish_cross_attention,
    reset_session_kv,
    run_base,
    session_kv_from_saved,
)
from ardiff_jax.runtime._session_table import SessionTable
from ardiff_jax.runtime._state import (
    ARDiffusionKVState,
    ARDiffusionRequestAdapter,
    CommitPlan,
    StateCheckpoint,
    commit_planned,
    dispatch_commit,
    own_rollout_pages,
    plan_commits,
    plan_rollout,
    prepare_forwards,
    publish_commit,
)
from ardiff_jax.types import (  # noqa: F401 - re-exported for code written before ardiff_jax.types
    AR_DIFFUSION_TICK_KEY,
    ARDiffusionChunkMetadata,
    ARDiffusionControlInput,
    ARDiffusionTickRequest,
    DiffusionRequest,
    EngineConfig,
    StepResult,
    StepSchedulerOutput,
)

__all__ = [
    "ARDiffusionRouter",
    "EngineReplica",
    "RayEngineProxy",
    "ReplicaAssignments",
    "RouterMemoryPlan",
    "ray_replica_class",
    "ray_replicas",
    "SCRATCH_BLOCKS_ENV",
    "SESSION_FORMAT_VERSION",
    "WARMUP_SESSION_ID",
    "ARDiffusionBatchError",
    "SessionRestoreError",
    "ARDiffusionEngine",
    "ARDiffusionKVBatch",
    "batch_buckets",
    "bucket_for",
    "ARDiffusionKVCache",
    "ARDiffusionKVState",
    "ARDiffusionModelRunner",
    "ARDiffusionRequestAdapter",
    "BranchCursor",
    "CommitPlan",
    "CrossAttentionKV",
    "HostSessionTier",
    "MemoryPlan",
    "OffloadedSession",
    "SessionEvent",
    "SessionFileError",
    "SessionKV",
    "SessionTable",
    "StateCheckpoint",
    "branch_cursor_array",
    "check_session_kv",
    "clear_cross_attention",
    "commit_frames",
    "commit_planned",
    "dispatch_commit",
    "fork_session_kv",
    "free_memory_bytes",
    "new_session_kv",
    "own_rollout_pages",
    "plan_commits",
    "plan_memory",
    "plan_rollout",
    "prepare_forwards",
    "publish_commit",
    "publish_cross_attention",
    "reset_session_kv",
    "run_base",
    "scratch_blocks_override",
    "session_kv_from_saved",
]


def __getattr__(name: str):  # RayReplica is built on first use: importing ardiff_jax never imports ray
    if name == "RayReplica":
        return ray_replica_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
