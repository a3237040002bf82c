"""``ARDiffusionModelRunner``: sessions, LRU, lifecycle hooks, fail-closed cleanup, stepwise path, warmup.

Behaviour follows the reference runner (``docs/reference_behaviour.md``, "Runner"):

* load: capability checks in the reference order, memory plan, pool allocation, warmup;
* ``execute_model``: session from the request (a typed tick is authoritative), ``reset``
  releases first (reset hook, even for an id never seen), get-or-create moves the id to
  most-recent and LRU-evicts with the close hook when full, bind -> forward -> unbind ->
  wait for the device, all inside a fail-closed scope that releases the session (close
  hook) and re-raises the original error; ``close_session`` releases after success;
* release order is always KV first, then the pipeline hook; reset/close/eviction cleanup
  errors are raised, failure/stepwise/warmup cleanup errors are logged and suppressed.

The runner serialises its entry points with a lock, so a serving layer may call it from
several threads; one call executes at a time (``max_num_seqs == 1``). A call may be a
*batch* (``execute_model_batch``): the next block of several distinct sessions as one
batched forward, for a pipeline that implements ``SupportsARDiffusionBatch``. Listeners are
called after the lock is released, so a slow or re-entrant listener cannot stall or
deadlock the runner.

The runner is a shell: it keeps the lock, the entry points, the fail-closed policy and
construction, and composes collaborators that each own one thing (``docs/architecture.md``,
"The runner as a shell"): :class:`~ardiff_jax.runtime._gate.PipelineGate` (the only caller of
pipeline code), :class:`~ardiff_jax.runtime._events.EventLog`,
:class:`~ardiff_jax.runtime._residency.Residency` (session table, host tier and every move),
:class:`~ardiff_jax.runtime._batch_runner.BatchRunner` and ``Warmup``,
:class:`~ardiff_jax.runtime._stepwise.StepwiseRuns` (the stepwise path's steps) and
:class:`~ardiff_jax.runtime._session_files.SessionFiles`; pure functions read a request's
session and flags (``_requests.py``) and what can be loaded (``_loading.py``). Every refusal
of a call is checked before anything moves: the residency's ``admission_refusal``,
``fork_refusal`` and ``offload_refusal`` read only and name what the call raises.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ardiff_jax._checks import check_flag, check_not_traced, check_session_id
from ardiff_jax.capability import spec_summary
from ardiff_jax.runtime._batch import (
    ARDiffusionBatchError,
    SessionRestoreError,
)
from ardiff_jax.runtime._batch_runner import BatchRunner, Warmup
from ardiff_jax.runtime._events import WARMUP_SESSION_ID, EventLog, SessionEvent
from ardiff_jax.runtime._gate import PipelineGate, kv_cache_spec, shard_model
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._loading import check_loadable
from ardiff_jax.runtime._memory import MemoryPlan
from ardiff_jax.runtime._offload import HostSessionTier
from ardiff_jax.runtime._requests import (
    check_distinct_sessions,
    checked_batch_types,
    request_session,
    request_values,
)
from ardiff_jax.runtime._residency import Residency
from ardiff_jax.runtime._session_files import SessionFiles
from ardiff_jax.runtime._session_table import SessionTable
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.runtime._stepwise import StepwiseRuns
from ardiff_jax.types import (
    DiffusionRequest,
    EngineConfig,
    StepResult,
    StepSchedulerOutput,
)

#: ``check_distinct_sessions`` (``_requests.py``) is the router's, from here.
__all__ = ["ARDiffusionModelRunner", "SessionEvent", "WARMUP_SESSION_ID", "check_distinct_sessions"]

logger = logging.getLogger("ardiff_jax.runtime")

#: Pipelines bound to an open runner (by id; the runner keeps its pipeline alive, so ids stay unique).
_BOUND_PIPELINES: weakref.WeakValueDictionary[int, ARDiffusionModelRunner] = weakref.WeakValueDictionary()

#: Exclusive bound of a fork's ``noise_seed``: the request seeds' (``inputs["seed"]`` in the
#: pipelines, ``seed`` in the server protocol), so a fork's seed is one a request could give.
_MAX_NOISE_SEED = 2**31


class ARDiffusionModelRunner:
    """Owns the KV pools and the resident sessions of one pipeline.

    Args:
      pipeline: implements :class:`~ardiff_jax.SupportsARDiffusionPipeline`. One pipeline
        instance serves one open runner: its per-session model state is keyed by session
        id, so a second runner would share (and corrupt) it.
      config: :class:`~ardiff_jax.EngineConfig`.
    """

    def __init__(self, pipeline: Any, config: EngineConfig | None = None) -> None:
        config = check_loadable(pipeline, config)  # the load-time checks, in the reference order
        other = _BOUND_PIPELINES.get(id(pipeline))
        if other is not None and not other._closed:
            raise ValueError(
                f"this {type(pipeline).__name__} instance is already loaded by another open engine; its per-session "
                "model state would be shared between the two. Close that engine first, or build a second pipeline "
                "(share weights with modules=first.modules)")
        spec = kv_cache_spec(pipeline)
        self._pipeline = pipeline
        self._config = config
        self._lock = threading.RLock()
        self._events = EventLog()
        self._runner_lock = _RunnerLock(self._lock, self._events)  # one instance serves every call
        self._perf_e2e_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._closed = False
        logger.info("AR-Diffusion geometry: %s", spec_summary(spec))
        self._kv_cache = ARDiffusionKVCache(
            spec, dtype=config.dtype, available_memory_bytes=config.available_memory_bytes,
            gpu_memory_fraction=config.gpu_memory_fraction, attention_backend=config.attention_backend,
            host_offload_bytes=config.host_offload_bytes, mesh=config.mesh,
        )
        if config.mesh is not None:
            try:
                shard_model(pipeline, config.mesh)
            except BaseException:
                self._kv_cache.close()
                raise
        # Batched forwards need the pipeline's protocol and pools on one device (a mesh runs batches one by one).
        self._gate = PipelineGate(pipeline, self._kv_cache, batched=config.mesh is None)
        self._files = SessionFiles(self._gate, self._kv_cache)
        self._batches = BatchRunner(self._gate, self._kv_cache, run_one=self._execute_admitted,
                                    fail_closed=self._fail_closed)
        self._residency = Residency(self._kv_cache, self._gate, self._events,
                                    config.host_offload_bytes if self._gate.can_export else 0)
        self._stepwise = StepwiseRuns(self._gate, self._residency, fail_closed=self._fail_closed,
                                      record_e2e=self._perf_e2e_times.append)
        # The policy objects, read by the entry points (the residency changes them).
        self._table, self._host = self._residency.table, self._residency.host
        if config.host_offload_bytes and not self._gate.can_export:
            logger.warning("AR-Diffusion host offload is configured (%d bytes) but %s does not implement "
                           "SupportsARDiffusionSessionExport; evicted sessions are released as without offload",
                           config.host_offload_bytes, type(pipeline).__name__)
        logger.info("%s", self._kv_cache.plan)
        _BOUND_PIPELINES[id(pipeline)] = self
        self._warmup = Warmup(self, self._batches)
        try:
            self._warmup.run()
        except BaseException:  # e.g. KeyboardInterrupt while compiling: free the pools and the pipeline
            self.close()
            raise
        self._warmup.start_background()

    # -- read-only views ---------------------------------------------------------------------
    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def kv_cache(self) -> ARDiffusionKVCache:
        return self._kv_cache

    @property
    def memory_plan(self) -> MemoryPlan:
        return self._kv_cache.plan

    @property
    def session_capacity(self) -> int:
        return self._kv_cache.session_capacity

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """Padded batch sizes of batched forwards (:func:`~ardiff_jax.runtime.batch_buckets` of the capacity)."""
        return self._batches.buckets

    @property
    def compiled_batch_buckets(self) -> tuple[int, ...]:
        """The batch buckets whose programs have run (all of them after an eager warmup)."""
        return tuple(sorted(self._batches.compiled))

    def wait_for_batch_compilation(self, timeout: float | None = None) -> bool:
        """Wait until the background bucket compiler is done (``batch_compile="background"``).

        Returns whether it is (True at once in the other modes). After it, no batch of any
        size compiles anything, as after an eager warmup.
        """
        return self._warmup.wait(timeout)

    @property
    def supports_batched_forward(self) -> bool:
        """Whether ``execute_model_batch`` runs one batched forward (else it runs the requests one by one)."""
        return self._gate.can_batch

    @property
    def session_table(self) -> SessionTable[ARDiffusionKVState]:
        """The policy object: LRU order, capacity, pins (read it; the runner changes it)."""
        return self._table

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident session ids, least recently used first."""
        return self._table.lru_order

    @property
    def offloaded_sessions(self) -> tuple[str, ...]:
        """Session ids held in the host tier, least recently offloaded first."""
        return self._host.lru_order

    @property
    def host_tier(self) -> HostSessionTier:
        """The host tier's policy object: offloaded records, bytes used (read it; the runner changes it)."""
        return self._host

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def e2e_times(self) -> tuple[float, ...]:
        """Wall times (seconds) of successful requests (tick mode) and emitted chunks (stepwise)."""
        return tuple(self._perf_e2e_times)

    def add_session_listener(self, listener: Callable[[SessionEvent], None]) -> None:
        """Call ``listener(SessionEvent)`` on every session creation and release.

        Listeners run after the runner released its lock, one event at a time and in the order
        the runner produced the events (whichever thread happens to deliver them); one that
        raises is logged and does not affect the runtime or the other listeners.
        """
        self._events.add_listener(listener)

    def _forget_e2e_times(self) -> None:
        """Drop the recorded wall times (the warmup's are no request's)."""
        self._perf_e2e_times.clear()

    # -- locking and events ----------------------------------------------------------------------
    def _locked(self) -> _RunnerLock:
        """The runner lock; events queued inside are delivered once the outermost holder let go."""
        return self._runner_lock

    # -- request / tick mode -------------------------------------------------------------------
    #: ``(session_id, reset, close_session, tick)`` of a request (the router and the warmup parse with it too).
    _request_session = staticmethod(request_session)

    def execute_model(self, request: DiffusionRequest) -> Any:
        """Run one request on its session; returns what ``pipeline.forward`` returned."""
        if not isinstance(request, DiffusionRequest):
            raise TypeError(f"execute_model expects a DiffusionRequest, got {type(request).__name__}")
        check_not_traced("engine.generate / execute_model", *request_values(request))
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("execute_model")
            session_id, reset, close_after, _ = self._request_session(request)
            self._residency.validate_request(session_id, request)
            if reset:
                self._residency.release(session_id, reset_model=True, reason="reset")
            start = time.perf_counter()
            output = self._execute_admitted(session_id, request)
            self._perf_e2e_times.append(time.perf_counter() - start)
            if close_after:
                self._residency.release(session_id, reset_model=False, reason="close")
            return output

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> list[Any]:
        """Run the next request of several distinct sessions; returns their outputs in request order.

        Before anything runs (nothing changes when one of these raises):

        * every request is checked as :meth:`execute_model` checks it (type, session id,
          flags, the pipeline's ``validate_ar_diffusion_request``);
        * a session id appearing twice is a ValueError;
        * more requests than ``session_capacity`` is a ValueError, and so is a batch that
          cannot be resident together beside the sessions a serving layer pinned.

        Then ``reset`` requests release their session (reset hook), every session is made
        resident (created, or restored from the host tier) without evicting another session
        of the batch (they are pinned while the batch runs), and:

        * with a ``SupportsARDiffusionBatch`` pipeline (and pools on one device) the
          requests run as **one** ``forward_batch`` call over a batch padded to the smallest
          of :attr:`batch_buckets` that holds it; a batch of one runs ``forward``;
        * otherwise they run one by one, in order, exactly as :meth:`execute_model` runs each.

        If the batched forward raises, it cannot say which session was bad: every session's
        KV bookkeeping is restored and the requests rerun one by one. A request that fails
        (batched or not) releases its own session only (fail-closed, as ``execute_model``);
        the others complete, and :class:`~ardiff_jax.runtime.ARDiffusionBatchError` is raised
        at the end with every output (``None`` for the failed) and the errors by session.
        A session that cannot be made resident fails alone the same way, left as
        ``execute_model`` leaves it: a failed restore from the host tier (at the validation's
        import of its model state, the page write or the import) is a
        :class:`~ardiff_jax.runtime._batch.SessionRestoreError`, the session still offloaded or
        released (``"restore_failed"``); a failed eviction for a new session raises its error
        for that session only. ``close_session`` requests release their session after success.
        """
        requests = self._checked_batch_types(requests)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("execute_model_batch")
            restore_failures: dict[str, BaseException] = {}
            parsed = self._checked_batch(requests, restore_failures)
            session_ids = [entry[0] for entry in parsed]
            if not requests:
                return []
            failures = {sid: SessionRestoreError.wrap(sid, error, offloaded=sid in self._host)
                        for sid, error in restore_failures.items()}
            for session_id, (_, reset, _, _) in zip(session_ids, parsed, strict=True):
                if reset and session_id not in failures:
                    self._residency.release(session_id, reset_model=True, reason="reset")
            start = time.perf_counter()
            admitting = [sid for sid in session_ids if sid not in failures]
            states, admission_failures = self._residency.admit_batch(admitting)
            failures.update(admission_failures)
            running = [i for i, sid in enumerate(session_ids) if sid not in failures]
            ran_outputs, errors = self._batches.run([session_ids[i] for i in running], [requests[i] for i in running],
                                                  [states[session_ids[i]] for i in running]) if running else ([], {})
            outputs: list[Any] = [None] * len(requests)
            for i, output in zip(running, ran_outputs, strict=True):
                outputs[i] = output
            errors = {sid: failures[sid] if sid in failures else errors[sid] for sid in session_ids
                      if sid in failures or sid in errors}  # request order
            elapsed = time.perf_counter() - start
            for session_id, (_, _, close_after, _) in zip(session_ids, parsed, strict=True):
                if session_id not in errors:
                    self._perf_e2e_times.append(elapsed)
                    if close_after:
                        self._residency.release(session_id, reset_model=False, reason="close")
            if errors:
                raise ARDiffusionBatchError(outputs, errors) from next(iter(errors.values()))
            return outputs

    def validate_batch(self, requests: Sequence[DiffusionRequest]) -> None:
        """Every check :meth:`execute_model_batch` makes before it runs anything, and nothing else.

        Raises what ``execute_model_batch`` would raise for ``requests`` now (TypeError /
        ValueError); changes nothing. A router calls it on every replica's share of a batch
        before running any share, so a refused batch runs nowhere. An offloaded session whose
        model state cannot be imported for its validation is not a refusal (the batch would
        fail that request alone): it is left offloaded here, and the batch reports it.
        """
        requests = self._checked_batch_types(requests)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("validate_batch")
            self._checked_batch(requests, dry_run=True)

    _checked_batch_types = staticmethod(checked_batch_types)

    def _checked_batch(self, requests: list[DiffusionRequest], restore_failures: dict[str, BaseException] | None = None,
                       *, dry_run: bool = False) -> list[tuple[Any, ...]]:
        """The requests' parsed session flags, after the batch's admission and every request's validation.

        An offloaded session whose model state cannot be imported for its validation is a
        restore failure of that request only (recorded in ``restore_failures``; see
        :meth:`~ardiff_jax.runtime._residency.Residency.validate_request`), never a refusal of the batch.
        """
        parsed = [self._request_session(request) for request in requests]
        session_ids = [entry[0] for entry in parsed]
        refusal = self._residency.admission_refusal(session_ids)  # before anything moves
        if refusal is not None:
            raise ValueError(refusal)
        for session_id, request in zip(session_ids, requests, strict=True):
            self._residency.validate_request(session_id, request, restore_failures, dry_run=dry_run)
        return parsed

    def _execute_admitted(self, session_id: str, request: DiffusionRequest) -> Any:
        """Bind, forward, wait, inside the fail-closed scope (the request is validated and reset already)."""
        state = self._residency.admit(session_id)
        try:
            output = self._gate.forward(session_id, state, request)
            self._gate.synchronize(output)
        except BaseException as error:
            self._fail_closed(session_id, error)
            raise
        return output

    # -- stepwise path ---------------------------------------------------------------------------
    def execute_stepwise(self, scheduler_output: StepSchedulerOutput) -> StepResult | None:
        """Advance the one scheduled request by one ``pipeline.step``; ``None`` when nothing is scheduled.

        The session id is the request id. The in-flight chunk (pending contexts, committed
        pages) survives between calls; the session is released (close hook) when the
        request finishes, errors, raises, or appears in ``finished_req_ids``.
        """
        if not isinstance(scheduler_output, StepSchedulerOutput):
            raise TypeError(
                f"execute_stepwise expects a StepSchedulerOutput, got {type(scheduler_output).__name__}"
            )
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("execute_stepwise")
            if not self._config.step_execution:
                raise RuntimeError(
                    "ARDiffusionModelRunner does not support step execution here: load with "
                    "EngineConfig(step_execution=True) and a SupportsStepExecution pipeline"
                )
            if len(scheduler_output.scheduled) > 1:
                raise RuntimeError(
                    "ARDiffusionModelRunner stepwise execution supports one request at a time, got "
                    f"{len(scheduler_output.scheduled)}"
                )
            for request in scheduler_output.scheduled:
                check_not_traced("engine.step / execute_stepwise", *request_values(request))
                self._residency.validate_request(request.request_id, request)  # a refused tick changes nothing
            self._stepwise.finish(scheduler_output.finished_req_ids)
            if not scheduler_output.scheduled:
                return None
            return self._stepwise.step(scheduler_output.scheduled[0])

    # -- serving-layer lifecycle -------------------------------------------------------------
    def reset_session(self, session_id: str) -> None:
        """Release the session's KV (if resident), then call the pipeline's reset hook. Errors raise."""
        check_session_id(session_id)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("reset_session")
            self._residency.release(session_id, reset_model=True, reason="reset")

    def close_session(self, session_id: str) -> None:
        """Release the session's KV (if resident), then call the pipeline's close hook. Errors raise."""
        check_session_id(session_id)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("close_session")
            self._residency.release(session_id, reset_model=False, reason="close")

    def close(self) -> None:
        """Release every session (close hooks; errors logged) and free the pools. Idempotent.

        A background bucket compiler is stopped first and waited for (it stops at its next
        bucket, its twin's pools freed), outside the lock: it takes the lock per bucket.
        """
        self._warmup.stop()
        with self._locked():
            if self._closed:
                return
            self._gate.check_not_reentrant("close")
            for session_id in self._table.lru_order + self._host.lru_order:
                self._residency.release(session_id, reset_model=False, reason="close", suppress_errors=True)
            self._kv_cache.close()
            self._closed = True
            if _BOUND_PIPELINES.get(id(self._pipeline)) is self:
                del _BOUND_PIPELINES[id(self._pipeline)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ARDiffusionModelRunner is closed")

    # -- sessions on disk ------------------------------------------------------------------------
    def fork_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        """Start session ``new_id`` from exactly where ``source_id`` stands, copying nothing.

        The fork's KV page tables are the source's (the pages are shared, reference-counted:
        whichever session next writes a shared slot writes a fresh page instead, so neither
        ever sees the other's new frames); its cross-attention caches are the source's arrays;
        the pipeline forks the model-owned state (``SupportsARDiffusionSessionFork``), with the
        same noise stream unless ``noise_seed`` gives a fresh one. Host work only: no device
        copy, no compile. An offloaded source is restored first (it needs its own slot).

        A full engine with host offload on makes room as a new session does: the least recently
        used sessions other than the source (and not in use) move to the host tier, each to
        continue exactly at its next request. Nothing is lost: when the tier cannot hold them
        without dropping a session it holds, or one of them has a block in flight, the fork is
        refused before anything moves (see :meth:`offload_session`).

        Refused, changing nothing: an unknown source; ``new_id`` already resident or
        offloaded; a source with a forward context pending (a stepwise block in flight); no
        free slot for the fork with host offload off (close or :meth:`offload_session` one
        first); a pipeline without the fork hook; pools on a mesh.
        """
        check_session_id(source_id)
        check_session_id(new_id, "fork session id")
        if noise_seed is not None and (isinstance(noise_seed, (bool, np.bool_))
                                       or not isinstance(noise_seed, (int, np.integer))
                                       or not 0 <= int(noise_seed) < _MAX_NOISE_SEED):
            raise ValueError(f"noise_seed must be an integer in [0, 2**31) (as request seeds) or None, "
                             f"got {noise_seed!r}")
        if not self._gate.can_fork:
            raise TypeError(f"{type(self._pipeline).__name__} cannot fork sessions: it does not implement "
                            "SupportsARDiffusionSessionFork (fork_ar_diffusion_session)")
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("fork_session")
            if self._config.mesh is not None:
                raise RuntimeError("AR-Diffusion forks need pools on one device (EngineConfig(mesh=None))")
            refusal = self._residency.fork_refusal(source_id, new_id)  # every check before anything moves
            if refusal is not None:
                raise refusal.exception()
            self._residency.fork(source_id, new_id, noise_seed)

    def offload_session(self, session_id: str) -> None:
        """Move resident ``session_id`` to the host tier now; its next request restores it and it continues exactly.

        The user's choice of what leaves the device (instead of the least recently used one, as
        a new session or a fork on a full engine would). Refused, changing nothing: host
        offload off (``EngineConfig(host_offload_bytes=0)``) or a pipeline without the export
        hooks; an unknown or already offloaded id; a session in use (a block or a stepwise
        request in flight); a host tier that could hold it only by dropping a session it holds.
        """
        check_session_id(session_id)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("offload_session")
            refusal = self._residency.offload_refusal(session_id)
            if refusal is not None:
                raise refusal.exception()
            self._residency.offload([session_id], reason="requested", what=f"offload {session_id!r}")

    def save_session(self, session_id: str, path: Any) -> Any:
        """Write a resident or offloaded session to the new directory ``path`` (orbax arrays + JSON manifest).

        The session stays where it is and its LRU position does not change. A resident
        session's model state is exported and imported straight back; if the pipeline fails
        at that, the session is released (close hook) and the error raised. The pipeline's
        weights fingerprint, when it reports one, is recorded. Returns the path.
        """
        check_session_id(session_id)
        self._check_open()
        self._files.require_exporter("save_session")
        identity = self._files.identity()  # outside the lock: the first call may hash the weights
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("save_session")
            record = self._residency.host_copy(session_id)
        # Outside the lock: the record is an immutable host value; writing it may take a while.
        return self._files.write(path, record, identity)

    def load_session(self, path: Any, session_id: str | None = None, *, allow_other_weights: bool = False) -> str:
        """Load a saved session (as ``session_id``, default the saved id) and make it resident; returns its id.

        The file is validated completely before any pool is touched (SessionFileError, a
        ValueError, naming what is wrong). A file saved under other weights than the
        pipeline's (both fingerprints recorded and different) is refused unless
        ``allow_other_weights``: its KV and model state would continue under weights that did
        not compute them. The session must not exist here yet. Making it resident may evict
        (offload) the least recently used session, as a new session would.
        """
        if session_id is not None:
            check_session_id(session_id)
        allow_other_weights = check_flag("allow_other_weights", allow_other_weights)
        self._check_open()
        self._files.require_exporter("load_session")
        identity = self._files.identity()
        record = self._files.read(path, identity, session_id=session_id, allow_other_weights=allow_other_weights)
        with self._locked():
            self._check_open()
            self._gate.check_not_reentrant("load_session")
            target = record.session_id
            if target in self._table or target in self._host:
                raise ValueError(f"AR-Diffusion session {target!r} already exists here; close it first or load "
                                 "under another session_id")
            self._files.check_importable(record, path)
            self._residency.restore_making_room(record, reason="load")
        return target

    def _fail_closed(self, session_id: str, error: BaseException) -> None:
        logger.info("AR-Diffusion request on session %r failed (%r); releasing it", session_id, error)
        self._residency.release(session_id, reset_model=False, reason="forward_exception", suppress_errors=True)
        if self._kv_cache.pools.is_deleted():
            # A model donated or deleted the pools: every resident session's KV is gone.
            # Release them all (close hooks) and start from fresh zeroed pools.
            for other in self._table.lru_order:
                self._residency.release(other, reset_model=False, reason="pools_lost", suppress_errors=True)
            try:
                self._kv_cache.reallocate_pools()
            except Exception:  # the caller re-raises the original error; this one is only logged
                logger.exception("AR-Diffusion could not reallocate the KV pools after losing them")
            logger.error("AR-Diffusion KV pools were lost during session %r; all sessions were released",
                         session_id)


class _RunnerLock:
    """``with runner._locked():``: the runner lock; queued events are delivered once the outermost holder let go.

    A class, not a generator: it is entered on every tick.
    """

    __slots__ = ("_depth", "_events", "_lock")

    def __init__(self, lock: threading.RLock, events: EventLog) -> None:
        self._lock = lock
        self._events = events
        self._depth = 0  # changed under the lock only

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        pending = self._depth == 0 and bool(self._events.queued)
        if pending:
            self._events.hand_over()  # still under the runner lock: the delivery queue keeps lock order
        self._lock.release()
        if pending:
            self._events.deliver()

