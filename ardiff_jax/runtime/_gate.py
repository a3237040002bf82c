"""``PipelineGate``: the one place in the runtime that calls pipeline code.

Every call into a pipeline (the capability methods of :mod:`ardiff_jax.capability`: bind and
forward, step, the batched forward, the reset/close hooks, export/import, validation, the
fork hook, warmup requests, the compile twin, the weights fingerprint, the kv-cache spec and
mesh sharding) goes through here, marked as running so that a pipeline calling back into the
runner is refused, and followed by the checks of what the pipeline left behind (a retained
state handle, forgotten commits, lost pools). The device wait (:meth:`PipelineGate.synchronize`)
lives here too: it is where a pipeline's asynchronous errors surface.

The gate decides nothing: which session runs, when a session is released and what a failure
costs are the runner's and its policy objects' (``tests/test_architecture.py`` checks that no
other runtime module calls a capability method).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax

from ardiff_jax.capability import (
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionBatch,
    SupportsARDiffusionCompileTwin,
    SupportsARDiffusionRequestValidation,
    SupportsARDiffusionSessionExport,
    SupportsARDiffusionSessionFork,
    SupportsARDiffusionWarmup,
    SupportsARDiffusionWeightsFingerprint,
)
from ardiff_jax.runtime._batch import ARDiffusionKVBatch
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._offload import to_host
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.types import DiffusionRequest, StepResult

__all__ = ["PipelineGate", "kv_cache_spec", "shard_model"]


def kv_cache_spec(pipeline: Any) -> ARDiffusionKVCacheSpec:
    """The pipeline's geometry (a load-time call: no runner exists yet)."""
    spec = pipeline.ar_diffusion_kv_cache_spec()
    if not isinstance(spec, ARDiffusionKVCacheSpec):
        raise TypeError(
            f"ar_diffusion_kv_cache_spec() must return an ARDiffusionKVCacheSpec, got {type(spec).__name__}"
        )
    return spec


def shard_model(pipeline: Any, mesh: Any) -> None:
    """Place the pipeline's model on ``mesh`` (a load-time call)."""
    pipeline.shard_ar_diffusion_model(mesh)


class PipelineGate:
    """Calls the pipeline, marks it running, checks what it left; decides nothing.

    Args:
      pipeline: the runner's pipeline.
      kv_cache: the runner's cache (pool checks, the device wait).
      batched: whether batched forwards may run (the pipeline's protocol and pools on one
        device; a mesh runs batches one by one).
    """

    def __init__(self, pipeline: Any, kv_cache: ARDiffusionKVCache, *, batched: bool) -> None:
        self.pipeline = pipeline
        self._kv_cache = kv_cache
        # Decided once: a runtime-checkable isinstance check is a large share of a trivial tick (bench_host).
        self._validator = (pipeline.validate_ar_diffusion_request
                           if isinstance(pipeline, SupportsARDiffusionRequestValidation) else None)
        self.can_export = isinstance(pipeline, SupportsARDiffusionSessionExport)
        self.can_batch = batched and isinstance(pipeline, SupportsARDiffusionBatch)
        self.can_fork = isinstance(pipeline, SupportsARDiffusionSessionFork)
        self.can_warm_up = isinstance(pipeline, SupportsARDiffusionWarmup)
        self.has_compile_twin = isinstance(pipeline, SupportsARDiffusionCompileTwin)
        self.executing: Any = None  # the pipeline call now running (its str() names it), or None

    @property
    def validates(self) -> bool:
        """Whether the pipeline checks requests on the host (``SupportsARDiffusionRequestValidation``)."""
        return self._validator is not None

    @property
    def name(self) -> str:
        return type(self.pipeline).__name__

    def check_not_reentrant(self, entry_point: str) -> None:
        if self.executing is not None:
            raise RuntimeError(
                f"{entry_point} was called from inside {self.executing}; the runner runs one request at a time and "
                "a nested call could release the session that is running. Return from the pipeline call first")

    @contextlib.contextmanager
    def _running(self, what: Any) -> Iterator[None]:
        """Mark pipeline code as running so that calls back into the runner are refused."""
        previous, self.executing = self.executing, what
        try:
            yield
        finally:
            self.executing = previous

    # -- session hooks -----------------------------------------------------------------------------
    def validate(self, session_id: str, request: DiffusionRequest) -> None:
        """The pipeline's host-side check of a request (nothing when it has none)."""
        if self._validator is None:
            return
        with self._running(_SessionCall("request validation", session_id)):
            self._validator(session_id, request)

    def hook(self, session_id: str, *, reset: bool) -> None:
        """The reset or close hook of ``session_id``; its error is raised."""
        hook = self.pipeline.reset_ar_diffusion_session if reset else self.pipeline.close_ar_diffusion_session
        previous, self.executing = self.executing, _SessionCall("reset hook" if reset else "close hook", session_id)
        try:
            hook(session_id)
        finally:
            self.executing = previous

    def import_session(self, session_id: str, pipeline_state: Any) -> None:
        """Hand the pipeline a session's model state (it validates it)."""
        with self._running(_SessionCall("import", session_id)):
            self.pipeline.import_ar_diffusion_session(session_id, pipeline_state)

    def export_session(self, session_id: str) -> Any:
        """Take a session's model state out of the pipeline (it no longer holds it)."""
        with self._running(_SessionCall("export", session_id)):
            return self.pipeline.export_ar_diffusion_session(session_id)

    def export_to_host(self, session_id: str, device: Any, *, keep: bool) -> Any:
        """A session's model state, exported and copied to host memory.

        With ``keep`` it is imported straight back (the pipeline's only way to hand over its
        state is to move it), also when the host copy fails.
        """
        with self._running(_SessionCall("export", session_id)):
            exported = self.pipeline.export_ar_diffusion_session(session_id)
            try:
                return to_host(exported, device)
            finally:
                if keep:
                    self.pipeline.import_ar_diffusion_session(session_id, exported)

    def fork(self, source_id: str, new_id: str, noise_seed: int | None) -> None:
        """The pipeline's fork hook (model-owned state of ``new_id`` from ``source_id``)."""
        with self._running(_ForkCall(source_id, new_id)):
            self.pipeline.fork_ar_diffusion_session(source_id, new_id, noise_seed=noise_seed)

    # -- runs ---------------------------------------------------------------------------------------
    def forward(self, session_id: str, state: ARDiffusionKVState, request: DiffusionRequest) -> Any:
        """One ``forward`` with ``state`` bound for exactly its duration, then the checks; no device wait."""
        with self._bound(session_id, state, stepwise=False):
            return self.pipeline.forward(request)

    def step(self, session_id: str, state: ARDiffusionKVState, request: Any) -> StepResult:
        """One ``step`` with ``state`` bound (a stepwise chunk's pending contexts survive it)."""
        with self._bound(session_id, state, stepwise=True):
            result = self.pipeline.step(request)
        if not isinstance(result, StepResult):
            raise TypeError(f"pipeline.step must return a StepResult, got {type(result).__name__}")
        return result

    def batched_forward(self, session_ids: list[str], states: list[ARDiffusionKVState], batch: ARDiffusionKVBatch,
                      requests: list[DiffusionRequest]) -> list[Any]:
        """One ``forward_batch`` with the batch (and every state in it) bound; one output per request."""
        with self._bound_batch(session_ids, states, batch):
            outputs = self.pipeline.forward_batch(list(requests))
        if not isinstance(outputs, Sequence) or len(outputs) != len(requests):
            raise TypeError(f"forward_batch must return one output per request ({len(requests)}), got "
                            f"{type(outputs).__name__}")
        return list(outputs)

    def synchronize(self, output: Any) -> None:
        """Wait for the pool writes and the output, so device errors surface inside the fail-closed scope."""
        self._kv_cache.block_until_ready()
        for leaf in jax.tree_util.tree_leaves(output):
            if isinstance(leaf, jax.Array):
                leaf.block_until_ready()

    @contextlib.contextmanager
    def _bound(self, session_id: str, state: ARDiffusionKVState, *, stepwise: bool) -> Iterator[None]:
        """Bind ``state`` to the pipeline for exactly one invocation, then check what the pipeline left."""
        # No pin needed here: while pipeline code runs, every runner entry point is refused, so
        # nothing can evict the bound session (pins are for a serving layer's own use).
        state._set_bound(True)
        previous, self.executing = self.executing, _SessionCall("forward", session_id)
        try:
            with self.pipeline.bind_ar_diffusion_state(session_id, state):
                yield
        finally:
            state._set_bound(False)
            self.executing = previous
        where = _find_retained(self.pipeline, state)
        if where is not None:
            raise RuntimeError(
                f"pipeline {self.name} retained the bound ARDiffusionKVState of session "
                f"{session_id!r} in {where} past its invocation; clear it when the bind context exits"
            )
        self._kv_cache.check_pools()
        if not stepwise:
            forgotten = state.committing_branches()
            if forgotten:
                raise RuntimeError(
                    f"forward of session {session_id!r} requested committing contexts on {list(forgotten)} "
                    "(get_kv_caches(..., commit_current=True)) and returned without commit_paged_context; the block "
                    "was not committed")

    @contextlib.contextmanager
    def _bound_batch(self, session_ids: list[str], states: list[ARDiffusionKVState],
                     batch: ARDiffusionKVBatch) -> Iterator[None]:
        """Bind the batch (and every state in it) for exactly one ``forward_batch``, then check what was left."""
        for state in states:
            state._set_bound(True)
        batch._set_bound(True)
        previous, self.executing = self.executing, _BatchCall(tuple(session_ids))
        try:
            with self.pipeline.bind_ar_diffusion_batch(batch):
                yield
        finally:
            for state in states:
                state._set_bound(False)
            batch._set_bound(False)
            self.executing = previous
        for held, name in [(batch, "ARDiffusionKVBatch")] + [(state, f"ARDiffusionKVState of session "
                                                                       f"{state.session_id!r}") for state in states]:
            where = _find_retained(self.pipeline, held)
            if where is not None:
                raise RuntimeError(f"pipeline {self.name} retained the bound {name} in {where} "
                                   "past its invocation; clear it when the bind context exits")
        self._kv_cache.check_pools()
        forgotten = [state.session_id for state in states if committing(state)]
        if forgotten:
            raise RuntimeError(f"forward_batch left committing contexts of sessions {forgotten} uncommitted; the "
                               "blocks were not committed")

    # -- load time ----------------------------------------------------------------------------------
    def warmup_requests(self, session_id: str) -> Iterator[Any]:
        """The pipeline's warmup requests for ``session_id`` (an iterable it may build lazily)."""
        return iter(self.pipeline.ar_diffusion_warmup_requests(session_id))

    def compile_twin(self) -> Any:
        """A second pipeline of the same layout (the background bucket compiler's)."""
        return self.pipeline.ar_diffusion_compile_twin()

    def weights_fingerprint(self) -> Any:
        """The pipeline's weights fingerprint, or None when it reports none."""
        if not isinstance(self.pipeline, SupportsARDiffusionWeightsFingerprint):
            return None
        return self.pipeline.ar_diffusion_weights_fingerprint()


def committing(state: ARDiffusionKVState) -> bool:
    """Whether a committing forward is pending: its block is not in the pages yet, so the session cannot leave.

    A non-committing context (a stepwise denoise step between calls) holds no KV of its
    own; it is dropped with the slot and the next step asks for a new one.
    """
    return bool(state.committing_branches())


def _find_retained(pipeline: Any, state: Any) -> str | None:
    """The pipeline attribute that still refers to ``state``, if any.

    Only direct attributes are checked (cheap, every tick). A state kept anywhere else is
    harmless all the same: outside its invocation every use of it raises, and only the
    runner can release it.
    """
    attributes = vars(pipeline) if hasattr(pipeline, "__dict__") else {}
    for name, value in attributes.items():
        if value is state:
            return f"attribute {name!r}"
    return None


class _ForkCall(NamedTuple):
    source_id: str
    new_id: str

    def __str__(self) -> str:
        return f"the fork of session {self.source_id!r} into {self.new_id!r}"


class _BatchCall(NamedTuple):
    session_ids: tuple[str, ...]

    def __str__(self) -> str:
        return f"the batched forward of sessions {list(self.session_ids)}"


class _SessionCall(NamedTuple):
    """What pipeline code is running for one session (``what``: "forward", "reset hook", "export", ...), named
    lazily (formatting a string on every tick costs time)."""

    what: str
    session_id: str

    def __str__(self) -> str:
        return f"the {self.what} of session {self.session_id!r}"
