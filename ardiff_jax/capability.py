"""The pipeline capability: KV geometry specs and the protocols a pipeline implements.

A pipeline opts into the AR-Diffusion runtime by implementing
:class:`SupportsARDiffusionPipeline`. Its :class:`ARDiffusionKVCacheSpec` is the only
thing the runtime reads from the model: worker-local KV geometry (layers, KV heads,
head size, tokens per latent frame), the block/window/sink policy, the logical KV
branches and the worker-local slots they map to, named fixed-length cross-attention
caches, scratch geometry and a requested session-capacity upper bound.

Validation follows the reference runtime (``docs/reference_behaviour.md``, "Capability
spec") check for check and in the same order, plus cross-field checks the reference lacks:
a block longer than the window would push its own oldest frames out of the visible
context, and a ``max_model_len`` below one block could never commit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ardiff_jax._checks import is_integer

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ardiff_jax.runtime import ARDiffusionKVBatch, ARDiffusionKVState
    from ardiff_jax.types import DiffusionRequest, StepResult

__all__ = [
    "ARDiffusionKVBranchSpec",
    "ARDiffusionCrossAttentionKVSpec",
    "ARDiffusionKVCacheSpec",
    "SupportsARDiffusionPipeline",
    "SupportsARDiffusionWarmup",
    "SupportsARDiffusionRequestValidation",
    "SupportsStepExecution",
    "SupportsARDiffusionSessionExport",
    "SupportsARDiffusionWeightsFingerprint",
    "SupportsARDiffusionMesh",
    "SupportsARDiffusionBatch",
    "SupportsARDiffusionCompileTwin",
    "SupportsARDiffusionSessionFork",
]


def _require_int(owner: str, field: str, value: Any) -> int:
    # bool is an int subclass; True layers or a 1.0 head size are bugs, not geometry. numpy
    # integers are integers (returned as Python ints, so the spec hashes and prints plainly).
    if not is_integer(value):
        raise ValueError(f"{owner} {field} must be an integer, got {value!r}")
    return int(value)


def _as_tuple(owner: str, field: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{owner} {field} must be a sequence, got {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class ARDiffusionKVBranchSpec:
    """One logical KV branch and the worker-local storage slot it uses.

    Several logical branches may share a ``local_index`` when the distribution layout
    guarantees only one of them executes on a worker (CFG-parallel: positive and negative
    both at 0, each on its own worker). Cross-attention caches stay per *logical* branch.
    """

    name: str
    local_index: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"AR-Diffusion KV branch names must be non-blank strings, got {self.name!r}")
        object.__setattr__(self, "local_index", _require_int("AR-Diffusion KV branch", "local_index",
                                                             self.local_index))
        if self.local_index < 0:
            raise ValueError(
                f"AR-Diffusion KV branch {self.name!r} local_index must be non-negative, got {self.local_index}"
            )


@dataclasses.dataclass(frozen=True)
class ARDiffusionCrossAttentionKVSpec:
    """A fixed-length, per-layer cross-attention KV cache (e.g. ``"text"``, ``"image"``).

    ``num_kv_heads=None`` means "as many heads as self-attention"; a value lets a model keep
    more (or fewer) heads for cross-attention than its self-attention share.
    """

    name: str
    num_tokens: int
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(
                f"AR-Diffusion cross-attention cache names must be non-blank strings, got {self.name!r}"
            )
        object.__setattr__(self, "num_tokens", _require_int(f"AR-Diffusion cross-attention cache {self.name!r}",
                                                            "num_tokens", self.num_tokens))
        if self.num_tokens <= 0:
            raise ValueError(
                f"AR-Diffusion cross-attention cache {self.name!r} num_tokens must be positive, "
                f"got {self.num_tokens}"
            )
        if self.num_kv_heads is not None:
            object.__setattr__(self, "num_kv_heads", _require_int(
                f"AR-Diffusion cross-attention cache {self.name!r}", "num_kv_heads", self.num_kv_heads))
            if self.num_kv_heads <= 0:
                raise ValueError(
                    f"AR-Diffusion cross-attention cache {self.name!r} num_kv_heads must be positive, "
                    f"got {self.num_kv_heads}"
                )


_POSITIVE_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_size",
    "tokens_per_frame",
    "frames_per_block",
    "window_frames",
    "session_capacity",
)
_NON_NEGATIVE_FIELDS = ("sink_frames", "max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session")


@dataclasses.dataclass(frozen=True)
class ARDiffusionKVCacheSpec:
    """Immutable, worker-local KV geometry and policy reported by a pipeline.

    Units: a *frame* is ``tokens_per_frame`` tokens and is also the page size; an *AR
    block* is ``frames_per_block`` frames (what one committing forward adds); the window is
    the recent tail of ``window_frames`` frames and the sink the protected prefix of
    ``sink_frames`` frames. The largest video context any forward reads, current frames
    included, is ``sink_frames + window_frames`` frames.

    ``max_scratch_tokens_per_branch`` declares model-specific non-video tokens (action and
    state registers) that must coexist with an uncommitted block;
    ``model_owned_state_bytes_per_session`` is an upper bound of the pipeline's own
    persistent device memory per session (latents, RNG, VAE caches), charged in the memory
    plan; ``session_capacity`` is an upper bound: the runtime may keep fewer.

    ``kv_branches`` and ``cross_attention`` accept any iterable and are stored as tuples so
    the spec stays hashable.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_block: int
    window_frames: int
    kv_branches: tuple[ARDiffusionKVBranchSpec, ...]
    session_capacity: int
    sink_frames: int = 0
    reset_at_boundary: bool = False
    cross_attention: tuple[ARDiffusionCrossAttentionKVSpec, ...] = ()
    max_model_len: int | None = None
    max_scratch_tokens_per_branch: int = 0
    model_owned_state_bytes_per_session: int = 0

    def __post_init__(self) -> None:
        # Normalise sequences to tuples before validating (hashability, stable equality).
        object.__setattr__(self, "kv_branches", _as_tuple("AR-Diffusion", "kv_branches", self.kv_branches))
        object.__setattr__(self, "cross_attention", _as_tuple("AR-Diffusion", "cross_attention",
                                                              self.cross_attention))
        for field in _POSITIVE_FIELDS + _NON_NEGATIVE_FIELDS:
            object.__setattr__(self, field, _require_int("AR-Diffusion", field, getattr(self, field)))
        # 1. positive fields
        for field in _POSITIVE_FIELDS:
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"AR-Diffusion {field} must be positive, got {value}")
        # 2-4. non-negative fields
        for field in _NON_NEGATIVE_FIELDS:
            value = getattr(self, field)
            if value < 0:
                raise ValueError(f"AR-Diffusion {field} must be non-negative, got {value}")
        if self.max_model_len is not None:
            # Optional cap on a branch's committed length. The ring stores a bounded window, so
            # sessions are unbounded by default; a cap below one block could never commit.
            object.__setattr__(self, "max_model_len", _require_int("AR-Diffusion", "max_model_len",
                                                                   self.max_model_len))
            block_tokens = self.frames_per_block * self.tokens_per_frame
            if self.max_model_len < block_tokens:
                raise ValueError(
                    f"AR-Diffusion max_model_len ({self.max_model_len} tokens) must hold at least one block "
                    f"({self.frames_per_block} frames x {self.tokens_per_frame} tokens = {block_tokens}), or be None "
                    "(unbounded)")
        if not isinstance(self.reset_at_boundary, bool):
            raise ValueError(f"AR-Diffusion reset_at_boundary must be a bool, got {self.reset_at_boundary!r}")
        # 5. at least one branch
        if not self.kv_branches:
            raise ValueError("AR-Diffusion KV cache spec requires at least one KV branch")
        for branch in self.kv_branches:
            if not isinstance(branch, ARDiffusionKVBranchSpec):
                raise ValueError(f"AR-Diffusion kv_branches must hold ARDiffusionKVBranchSpec, got {branch!r}")
        # 6. unique branch names
        names = [branch.name for branch in self.kv_branches]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"AR-Diffusion KV branch names must be unique, got duplicates {duplicates}")
        # 7. local indices contiguous from zero
        indices = sorted({branch.local_index for branch in self.kv_branches})
        if indices != list(range(len(indices))):
            raise ValueError(
                f"AR-Diffusion KV branch local indices must be contiguous from zero, got {indices}"
            )
        # 8. unique cross-attention names
        for cache in self.cross_attention:
            if not isinstance(cache, ARDiffusionCrossAttentionKVSpec):
                raise ValueError(
                    f"AR-Diffusion cross_attention must hold ARDiffusionCrossAttentionKVSpec, got {cache!r}"
                )
        cross_names = [cache.name for cache in self.cross_attention]
        cross_duplicates = sorted({name for name in cross_names if cross_names.count(name) > 1})
        if cross_duplicates:
            raise ValueError(
                f"AR-Diffusion cross-attention cache names must be unique, got duplicates {cross_duplicates}"
            )
        # Cross-field check (not in the reference): the current block is part of the visible
        # context, so a block longer than the window would evict its own oldest frames.
        if self.frames_per_block > self.window_frames:
            raise ValueError(
                f"AR-Diffusion frames_per_block ({self.frames_per_block}) must not exceed window_frames "
                f"({self.window_frames}): the current block would fall out of its own visible context"
            )

    # -- derived properties ---------------------------------------------------------------
    @functools.cached_property  # read on every forward; the spec is frozen, so computing it once is exact
    def num_local_kv_branches(self) -> int:
        """Worker-local storage slots per session: ``max(local_index) + 1``."""
        return max(branch.local_index for branch in self.kv_branches) + 1

    @functools.cached_property
    def kv_branch_names(self) -> tuple[str, ...]:
        return tuple(branch.name for branch in self.kv_branches)

    @property
    def cross_attention_lengths(self) -> dict[str, int]:
        """``{cache name: num_tokens}`` for every configured cross-attention cache."""
        return {cache.name: cache.num_tokens for cache in self.cross_attention}

    @property
    def cross_attention_kv_heads(self) -> dict[str, int]:
        """``{cache name: heads}`` only for caches that set their own ``num_kv_heads``."""
        return {cache.name: cache.num_kv_heads for cache in self.cross_attention if cache.num_kv_heads is not None}

    @property
    def max_visible_frames(self) -> int:
        """The largest video context one forward reads, current frames included."""
        return self.sink_frames + self.window_frames

    def branch(self, name: str) -> ARDiffusionKVBranchSpec:
        for branch in self.kv_branches:
            if branch.name == name:
                return branch
        raise KeyError(f"Unknown AR-Diffusion KV branch {name!r}; configured: {list(self.kv_branch_names)}")

    def cross_attention_heads(self, name: str) -> int:
        """Heads stored for cross-attention cache ``name`` (self-attention heads by default)."""
        for cache in self.cross_attention:
            if cache.name == name:
                return cache.num_kv_heads if cache.num_kv_heads is not None else self.num_kv_heads
        raise KeyError(
            f"Unknown AR-Diffusion cross-attention cache {name!r}; configured: {list(self.cross_attention_lengths)}"
        )


# -- protocols --------------------------------------------------------------------------------


@runtime_checkable
class SupportsARDiffusionPipeline(Protocol):
    """A pipeline that keeps AR attention KV across requests through the runtime.

    The runtime reads only the spec. It binds an :class:`~ardiff_jax.ARDiffusionKVState`
    around exactly one runner invocation; the pipeline must not retain it afterwards. The
    pipeline owns all non-KV per-session state and drops it in the reset/close hooks, which
    the runtime calls *after* releasing the session's KV.
    """

    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec: ...

    def bind_ar_diffusion_state(
        self, session_id: str, state: ARDiffusionKVState
    ) -> AbstractContextManager[None]: ...

    def reset_ar_diffusion_session(self, session_id: str) -> None: ...

    def close_ar_diffusion_session(self, session_id: str) -> None: ...

    def forward(self, request: DiffusionRequest) -> Any: ...


@runtime_checkable
class SupportsARDiffusionWarmup(Protocol):
    """Optional: yields model-valid requests that cover the compiled shapes.

    Every yielded request must carry ``session_id`` in its ``extra_args``; the runtime runs
    them in order at load and releases the warmup session afterwards.
    """

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterable[DiffusionRequest]: ...


@runtime_checkable
class SupportsARDiffusionRequestValidation(Protocol):
    """Optional: reject a malformed request before the runner touches any session.

    The runner calls ``validate_ar_diffusion_request(session_id, request)`` before the
    reset, the session lookup and the bind. An exception raised here propagates with the
    session, its KV and the pipeline's hooks untouched; the same error raised inside
    ``forward`` would fail the session closed (its KV released).
    """

    def validate_ar_diffusion_request(self, session_id: str, request: DiffusionRequest) -> None: ...


@runtime_checkable
class SupportsStepExecution(Protocol):
    """Optional: the pipeline advances one denoise step per ``step`` call.

    ``supports_step_execution`` must be ``True``. ``step`` runs with the session state bound
    exactly as ``forward`` does and returns a :class:`~ardiff_jax.StepResult`.
    """

    supports_step_execution: bool

    def step(self, request: DiffusionRequest) -> StepResult: ...


@runtime_checkable
class SupportsARDiffusionSessionExport(Protocol):
    """Optional: the pipeline can hand over a session's model-owned state, so the runtime can keep it.

    With it, a session the runner evicts is offloaded to host memory
    (``EngineConfig(host_offload_bytes=...)``) instead of forgotten, and
    ``engine.save_session`` / ``engine.load_session`` can write it to disk and bring it back.
    Without it, eviction releases the session as it always did (close hook).

    ``export_ar_diffusion_session(session_id)`` *moves* the state out: it returns a pytree
    (possibly empty) and the pipeline forgets the session, exactly as after its close hook,
    until ``import_ar_diffusion_session(session_id, state)`` moves a pytree it exported back
    in. The runtime never looks inside the tree except to copy its arrays to host memory
    and back (as they were: same dtype, same device on return). For ``save_session`` the
    tree must be made of dicts with string keys, lists, tuples, ``None``, ``bool``,
    ``int``, ``float``, ``str`` and arrays (typed PRNG keys included). ``import`` validates
    what it receives and raises (changing nothing) on a tree it could not have exported.
    """

    def export_ar_diffusion_session(self, session_id: str) -> Any: ...

    def import_ar_diffusion_session(self, session_id: str, state: Any) -> None: ...


@runtime_checkable
class SupportsARDiffusionWeightsFingerprint(Protocol):
    """Optional: the pipeline names the weights it computes with, so a session file can tell them apart.

    ``ar_diffusion_weights_fingerprint()`` returns the SHA-256 hex digest (64 lowercase hex
    characters) of the weights: of the parameters, or of the weights file they came from.
    Equal weights must give equal digests, in any process. ``save_session`` records it in
    the file; ``load_session`` refuses a file recorded under another digest unless called
    with ``allow_other_weights=True`` (a session's KV and model state were computed by the
    weights it ran under). It is asked at every save and load, so compute it once.
    """

    def ar_diffusion_weights_fingerprint(self) -> str: ...


@runtime_checkable
class SupportsARDiffusionMesh(Protocol):
    """Optional: the pipeline can run its model on a ``jax.sharding.Mesh`` (``EngineConfig(mesh=...)``).

    ``shard_ar_diffusion_model(mesh)`` is called once at load, after the runtime created
    its pools on the mesh and before any request: the pipeline places its parameters
    sharded (attention heads and FFN hidden over ``"tp"``) and its inputs replicated on the
    mesh, so its jitted forwards run as one SPMD program next to the sharded pools. It must
    raise (changing nothing) for a mesh its model cannot split over (e.g. heads that do not
    divide by ``tp``). A runner refuses a mesh for a pipeline without this method.
    """

    def shard_ar_diffusion_model(self, mesh: Any) -> None: ...


@runtime_checkable
class SupportsARDiffusionBatch(Protocol):
    """Optional: the pipeline runs the next block of several sessions as one batched forward.

    ``engine.generate_batch(requests)`` binds an :class:`~ardiff_jax.runtime.ARDiffusionKVBatch`
    (one paged view over the batch's slots, every session's state bound too) around exactly
    one ``forward_batch(requests)`` call, which returns one output per request, in order,
    equal (to float32 tolerance) to what ``forward`` returns for each request run alone.
    Requests hold distinct sessions, are validated like ``forward``'s
    (``validate_ar_diffusion_request``) and are admitted before the call. Without this
    protocol the engine runs the requests one by one.

    Contract for ``forward_batch``: **all or nothing on the pipeline's side.** It changes no
    session's model state itself: it stages it and hands its installation to
    ``batch.defer_publish``, which the runtime runs only once it has awaited the batch's
    outputs and pool writes (a device error can surface only then, e.g. an out-of-memory at
    execution time). If it raises, or the batch fails when awaited, every session's model
    state is as before the call. The runtime then restores every session's
    KV bookkeeping to its value before the batch (pages written by the batch sit where the
    restored cursors do not read: a commit writes only pages its forward could not see) and
    reruns the requests one by one, so only a failing session is released.
    """

    def bind_ar_diffusion_batch(self, batch: ARDiffusionKVBatch) -> AbstractContextManager[None]: ...

    def forward_batch(self, requests: Sequence[DiffusionRequest]) -> list[Any]: ...


def spec_summary(spec: ARDiffusionKVCacheSpec) -> Mapping[str, Any]:
    """A flat, JSON-friendly description of a spec (for logs and the CLI)."""
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "tokens_per_frame": spec.tokens_per_frame,
        "frames_per_block": spec.frames_per_block,
        "window_frames": spec.window_frames,
        "sink_frames": spec.sink_frames,
        "reset_at_boundary": spec.reset_at_boundary,
        "kv_branches": {branch.name: branch.local_index for branch in spec.kv_branches},
        "cross_attention": spec.cross_attention_lengths,
        "cross_attention_kv_heads": spec.cross_attention_kv_heads,
        "max_scratch_tokens_per_branch": spec.max_scratch_tokens_per_branch,
        "model_owned_state_bytes_per_session": spec.model_owned_state_bytes_per_session,
        "session_capacity": spec.session_capacity,
    }


@runtime_checkable
class SupportsARDiffusionCompileTwin(Protocol):
    """Optional: a twin pipeline on which batch programs can be compiled beside the serving one.

    ``ar_diffusion_compile_twin()`` returns a pipeline with the same weights, configs and
    device and none of this one's sessions, whose calls share nothing mutable with it. With
    ``EngineConfig(batch_compile="background")`` the runtime binds the twin to pools of the
    same layout and runs its batch warmup on a thread, outside the serving runner's lock, so
    compiling never holds up a request; the twin and its pools are freed afterwards.
    """

    def ar_diffusion_compile_twin(self) -> Any: ...


@runtime_checkable
class SupportsARDiffusionSessionFork(Protocol):
    """Optional: the pipeline can fork a session's model-owned state (``engine.fork_session``).

    ``fork_ar_diffusion_session(source_id, new_id, *, noise_seed=None)`` gives ``new_id``
    the state ``source_id`` has now (prompt, noise stream, decoder and action caches), so
    that with the same requests the fork produces what the source would; ``noise_seed`` gives
    the fork a fresh noise stream instead. Share the arrays, except those a pipeline program
    donates (updates in place, as a streaming VAE's caches): the fork needs its own copy of
    those, or one session's step would delete the other's. The runtime shares the KV itself. Raise (changing nothing) when ``new_id`` has state already.
    """

    def fork_ar_diffusion_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None: ...

