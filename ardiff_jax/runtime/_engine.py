"""``ARDiffusionEngine``: the user-facing entry point.

The engine's only decision is routing: it selects :class:`ARDiffusionModelRunner` (or a
subclass given as ``runner_cls``), which owns pools, sessions, capacity, LRU and failure
cleanup. Everything else is delegation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ardiff_jax.runtime._memory import MemoryPlan
from ardiff_jax.types import DiffusionRequest, EngineConfig, StepResult, StepSchedulerOutput
from ardiff_jax.runtime._runner import ARDiffusionModelRunner

__all__ = ["ARDiffusionEngine"]


class ARDiffusionEngine:
    """Load a pipeline with the AR-Diffusion runner and drive it.

    Example::

        engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32"))
        out = engine.generate(DiffusionRequest("r1", prompt="a cat", extra_args={"session_id": "s1"}))
        engine.close_session("s1")
    """

    runner_cls: type[ARDiffusionModelRunner] = ARDiffusionModelRunner

    def __init__(self, pipeline: Any, config: EngineConfig | None = None, *,
                 runner_cls: type[ARDiffusionModelRunner] | None = None) -> None:
        runner_cls = self.runner_cls if runner_cls is None else runner_cls
        if not (isinstance(runner_cls, type) and issubclass(runner_cls, ARDiffusionModelRunner)):
            raise TypeError(f"runner_cls must be an ARDiffusionModelRunner subclass, got {runner_cls!r}")
        self._runner = runner_cls(pipeline, config)

    @property
    def runner(self) -> ARDiffusionModelRunner:
        return self._runner

    @property
    def memory_plan(self) -> MemoryPlan:
        return self._runner.memory_plan

    @property
    def session_capacity(self) -> int:
        return self._runner.session_capacity

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident session ids, least recently used first."""
        return self._runner.sessions

    @property
    def offloaded_sessions(self) -> tuple[str, ...]:
        """Session ids held in host memory (``EngineConfig(host_offload_bytes=...)``), oldest first."""
        return self._runner.offloaded_sessions

    def generate(self, request: DiffusionRequest) -> Any:
        """Run one request (one AR block in tick mode) on its session."""
        return self._runner.execute_model(request)

    def generate_batch(self, requests: Sequence[DiffusionRequest]) -> list[Any]:
        """Run the next request of several distinct sessions, as one batched forward where the pipeline can.

        Returns one output per request, in request order, equal (to float32 tolerance) to
        what :meth:`generate` returns for each request run alone, one after the other.

        Refused before anything runs or changes (ValueError / TypeError): a session id that
        appears twice; more requests than :attr:`session_capacity`; a request ``generate``
        would refuse (its checks and the pipeline's validator run for every request first).

        The sessions of a batch are never evicted by the batch itself: each one is made
        resident (created, or restored from the host tier) and older sessions outside the
        batch are evicted as ``generate`` would. A pipeline implementing
        :class:`~ardiff_jax.capability.SupportsARDiffusionBatch` runs the batch as one jitted
        forward per denoise step, padded to a bucket size (``engine.runner.batch_buckets``:
        2, 4, 8, ... up to the capacity; compiled by warmup, so no batch composition
        recompiles); a batch of one, a pipeline without the protocol, or pools on a mesh run
        the requests one by one.

        Failures: a request that fails fails alone; the other requests complete, and
        :class:`~ardiff_jax.runtime.ARDiffusionBatchError` is raised once all ran, with
        ``.outputs`` (``None`` for the failed) and ``.errors`` (``{session_id: exception}``).
        A failed forward releases its own session only (as ``generate``: KV dropped, close
        hook); a batched forward that raises is rerun one request at a time, so only the bad
        session fails. A session whose restore from the host tier fails (its pages cannot be
        written back, or the pipeline refuses its model state, at the restore or already when
        its request is validated) is left as ``generate`` leaves it (still offloaded, or
        released with its close hook) and its error is a
        :class:`~ardiff_jax.runtime._batch.SessionRestoreError` naming it, the cause and where
        it is now. The batch's offloaded sessions are restored before its new sessions are
        created, so an eviction into a full host tier never drops one of the batch's own.
        Thread-safe like ``generate`` (one engine call at a time).
        """
        return self._runner.execute_model_batch(requests)

    def validate_batch(self, requests: Sequence[DiffusionRequest]) -> None:
        """Raise what :meth:`generate_batch` would refuse ``requests`` with, running and changing nothing."""
        self._runner.validate_batch(requests)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """The padded batch sizes :meth:`generate_batch` compiles (see :func:`~ardiff_jax.runtime.batch_buckets`)."""
        return self._runner.batch_buckets

    def step(self, scheduler_output: StepSchedulerOutput) -> StepResult | None:
        """One stepwise tick (requires ``EngineConfig(step_execution=True)``)."""
        return self._runner.execute_stepwise(scheduler_output)

    def reset_session(self, session_id: str) -> None:
        self._runner.reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        self._runner.close_session(session_id)

    def fork_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        """Start ``new_id`` from exactly where ``source_id`` stands; nothing is copied.

        The fork shares the source's KV pages (copy-on-write: a shared page is never
        written, the writer gets a fresh page), its cross-attention caches and, through the
        pipeline, its model state; with the same requests it produces what the source would,
        unless ``noise_seed`` gives it a fresh noise stream. Closing, resetting, evicting or
        offloading either leaves the other intact. On a full engine with host offload on, the
        least recently used sessions other than the source move to the host tier to make room
        (as for a new session; each continues exactly at its next request); nothing is lost: a
        fork that would need to drop a session is refused. Refused (nothing changes) for an
        unknown source, a taken id, a block in flight, or no free slot without host offload.
        See :meth:`ARDiffusionModelRunner.fork_session`.
        """
        self._runner.fork_session(source_id, new_id, noise_seed=noise_seed)

    def offload_session(self, session_id: str) -> None:
        """Move resident ``session_id`` to host memory now (you choose what leaves the device).

        Its next request restores it and it continues exactly. Needs host offload
        (``EngineConfig(host_offload_bytes=...)``); refused, changing nothing, for an unknown
        or already offloaded id, a session in use (a block or stepwise request in flight), or a
        host tier that would have to drop a session it holds. See
        :meth:`ARDiffusionModelRunner.offload_session`.
        """
        self._runner.offload_session(session_id)

    def save_session(self, session_id: str, path: str | os.PathLike[str]) -> Path:
        """Write a resident or offloaded session to ``path`` (a new directory); it keeps running here.

        The file holds the session's KV pages, cross-attention caches, cursors and the
        pipeline's model state (orbax-checkpoint arrays plus a JSON manifest; needs the
        ``[sessions]`` extra), and the fingerprint of the pipeline's weights when it reports
        one. Any engine with the same geometry, pipeline class and weights can
        :meth:`load_session` it, in this process or another, and continue exactly.
        """
        return self._runner.save_session(session_id, path)

    def load_session(self, path: str | os.PathLike[str], session_id: str | None = None, *,
                     allow_other_weights: bool = False) -> str:
        """Make a saved session resident (as ``session_id``, default its saved id); returns the id.

        Raises :class:`~ardiff_jax.runtime.SessionFileError` (a ValueError) naming the problem
        when the file is corrupt, truncated, or saved by an engine with another geometry or
        pipeline, or under other weights (unless ``allow_other_weights=True``); nothing
        changes then.
        """
        return self._runner.load_session(path, session_id, allow_other_weights=allow_other_weights)

    def close(self) -> None:
        """Release every session and free the device pools."""
        self._runner.close()

    def __enter__(self) -> ARDiffusionEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
