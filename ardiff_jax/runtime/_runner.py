"""``ARDiffusionModelRunner``: sessions, LRU, lifecycle hooks, fail-closed cleanup, stepwise path, warmup.

Behaviour follows the reference runner (CONTRACTS.md sections 6.1-6.5 and 8):

* load: capability checks in the reference order, memory plan, pool allocation, warmup;
* ``execute_model``: session from the request (a typed tick is authoritative), ``reset``
  releases first (reset hook, even for an id never seen), get-or-create moves the id to
  most-recent and LRU-evicts with the close hook when full, bind -> forward -> unbind ->
  wait for the device, all inside a fail-closed scope that releases the session (close
  hook) and re-raises the original error; ``close_session`` releases after success;
* release order is always KV first, then the pipeline hook; reset/close/eviction cleanup
  errors are raised, failure/stepwise/warmup cleanup errors are logged and suppressed.

The runner serialises its entry points with a lock, so a serving layer may call it from
several threads; one request executes at a time (``max_num_seqs == 1``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ardiff_jax.capability import (
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionRequestValidation,
    SupportsARDiffusionWarmup,
    SupportsStepExecution,
    spec_summary,
)
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._memory import MemoryPlan
from ardiff_jax.runtime._requests import DiffusionRequest, EngineConfig, StepResult, StepSchedulerOutput
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.runtime._tick import ARDiffusionTickRequest

__all__ = ["ARDiffusionModelRunner", "SessionEvent", "WARMUP_SESSION_ID"]

logger = logging.getLogger("ardiff_jax.runtime")

#: Session id under which warmup requests run; released after warmup.
WARMUP_SESSION_ID = "__ardiffusion_warmup__"

_PIPELINE_METHODS = (
    "ar_diffusion_kv_cache_spec",
    "bind_ar_diffusion_state",
    "reset_ar_diffusion_session",
    "close_ar_diffusion_session",
    "forward",
)


@dataclasses.dataclass(frozen=True)
class SessionEvent:
    """A session lifecycle event, delivered to listeners added with ``add_session_listener``.

    ``kind`` is ``"created"`` or ``"released"`` (KV released, before the pipeline hook);
    ``reason`` is one of ``"reset"``, ``"close"``, ``"lru_eviction"``,
    ``"forward_exception"``, ``"warmup_complete"``, ``"pools_lost"`` for releases.
    """

    kind: str
    session_id: str
    reason: str | None = None


class ARDiffusionModelRunner:
    """Owns the KV pools and the resident sessions of one pipeline.

    Args:
      pipeline: implements :class:`~ardiff_jax.SupportsARDiffusionPipeline`.
      config: :class:`~ardiff_jax.EngineConfig`.
    """

    def __init__(self, pipeline: Any, config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        # Load-time checks, in the reference order (CONTRACTS.md section 8).
        if config.step_execution and not _step_capable(pipeline):
            raise ValueError(
                "step_execution=True requires a pipeline that implements SupportsStepExecution "
                "(supports_step_execution = True and step(request)); otherwise stepwise calls would bypass "
                "per-request KV binding"
            )
        if config.max_num_seqs != 1:
            raise ValueError(f"ARDiffusionModelRunner supports max_num_seqs=1, got {config.max_num_seqs}")
        if not isinstance(pipeline, SupportsARDiffusionPipeline):
            missing = [name for name in _PIPELINE_METHODS if not callable(getattr(pipeline, name, None))]
            raise TypeError(
                f"{type(pipeline).__name__} does not implement SupportsARDiffusionPipeline "
                f"({', '.join(_PIPELINE_METHODS)}); missing: {', '.join(missing)}. Use a plain (non-AR) engine for "
                "pipelines without the AR-Diffusion capability"
            )
        if getattr(pipeline, "supports_request_batch", False):
            raise ValueError("ARDiffusionModelRunner does not support request-batch execution pipelines")
        spec = pipeline.ar_diffusion_kv_cache_spec()
        if not isinstance(spec, ARDiffusionKVCacheSpec):
            raise TypeError(
                f"ar_diffusion_kv_cache_spec() must return an ARDiffusionKVCacheSpec, got {type(spec).__name__}"
            )
        self._pipeline = pipeline
        self._config = config
        # Decided once: a runtime-checkable isinstance costs ~7 us, half of a trivial tick.
        self._request_validator = (pipeline.validate_ar_diffusion_request
                                   if isinstance(pipeline, SupportsARDiffusionRequestValidation) else None)
        self._lock = threading.RLock()
        self._sessions: collections.OrderedDict[str, ARDiffusionKVState] = collections.OrderedDict()
        self._listeners: list[Callable[[SessionEvent], None]] = []
        self._perf_e2e_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._stepwise_started: dict[str, float] = {}
        self._closed = False
        logger.info("AR-Diffusion geometry: %s", spec_summary(spec))
        self._kv_cache = ARDiffusionKVCache(
            spec, dtype=config.dtype, available_memory_bytes=config.available_memory_bytes,
            gpu_memory_fraction=config.gpu_memory_fraction,
        )
        logger.info("%s", self._kv_cache.plan)
        self._warmup()

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
    def sessions(self) -> tuple[str, ...]:
        """Resident session ids, least recently used first."""
        return tuple(self._sessions)

    @property
    def e2e_times(self) -> tuple[float, ...]:
        """Wall times (seconds) of successful requests (tick mode) and emitted chunks (stepwise)."""
        return tuple(self._perf_e2e_times)

    def add_session_listener(self, listener: Callable[[SessionEvent], None]) -> None:
        """Call ``listener(SessionEvent)`` on every session creation and release."""
        self._listeners.append(listener)

    def _emit(self, kind: str, session_id: str, reason: str | None = None) -> None:
        event = SessionEvent(kind, session_id, reason)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a metrics hook must never break the runtime
                logger.exception("AR-Diffusion session listener failed on %s", event)

    # -- request / tick mode -------------------------------------------------------------------
    @staticmethod
    def _request_session(request: DiffusionRequest) -> tuple[str, bool, bool, ARDiffusionTickRequest | None]:
        """``(session_id, reset, close_session, tick)``; a typed tick is authoritative."""
        extra_args = request.extra_args or {}
        tick = ARDiffusionTickRequest.from_extra_args(extra_args)
        if tick is not None:
            return tick.session_id, tick.reset, tick.close_session, tick
        session_id = str(extra_args.get("session_id") or "default")
        return session_id, bool(extra_args.get("reset", False)), bool(extra_args.get("close_session", False)), None

    def execute_model(self, request: DiffusionRequest) -> Any:
        """Run one request on its session; returns what ``pipeline.forward`` returned."""
        if not isinstance(request, DiffusionRequest):
            raise TypeError(f"execute_model expects a DiffusionRequest, got {type(request).__name__}")
        with self._lock:
            self._check_open()
            session_id, reset, close_after, _ = self._request_session(request)
            self._validate_request(session_id, request)
            if reset:
                self.reset_session(session_id)
            start = time.perf_counter()
            state = self._get_or_create_session(session_id)
            try:
                with self._bound(session_id, state):
                    output = self._pipeline.forward(request)
                self._synchronize(output)
            except BaseException as error:
                self._fail_closed(session_id, error)
                raise
            self._perf_e2e_times.append(time.perf_counter() - start)
            if close_after:
                self.close_session(session_id)
            return output

    def execute_model_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ARDiffusionModelRunner does not support request-batch execution")

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
        with self._lock:
            self._check_open()
            if not self._config.step_execution:
                raise RuntimeError(
                    "ARDiffusionModelRunner does not support step execution here: load with "
                    "EngineConfig(step_execution=True) and a SupportsStepExecution pipeline"
                )
            for request_id in sorted(scheduler_output.finished_req_ids):
                self._stepwise_started.pop(request_id, None)
                if request_id in self._sessions:
                    self._release_session(request_id, reset_model=False, reason="close", suppress_errors=True)
            if not scheduler_output.scheduled:
                return None
            if len(scheduler_output.scheduled) > 1:
                raise RuntimeError(
                    "ARDiffusionModelRunner stepwise execution supports one request at a time, got "
                    f"{len(scheduler_output.scheduled)}"
                )
            request = scheduler_output.scheduled[0]
            session_id = request.request_id
            self._validate_request(session_id, request)
            self._stepwise_started.setdefault(session_id, time.perf_counter())
            state = self._get_or_create_session(session_id)
            try:
                with self._bound(session_id, state):
                    result = self._pipeline.step(request)
                if not isinstance(result, StepResult):
                    raise TypeError(f"pipeline.step must return a StepResult, got {type(result).__name__}")
                if result.chunk_emitted:
                    self._synchronize(result.output)
            except BaseException as error:
                self._stepwise_started.pop(session_id, None)
                self._fail_closed(session_id, error)
                raise
            if result.chunk_emitted:
                started = self._stepwise_started.pop(session_id, None)
                if started is not None:
                    self._perf_e2e_times.append(time.perf_counter() - started)
            if result.finished or result.error:
                self._stepwise_started.pop(session_id, None)
                self._release_session(
                    session_id, reset_model=False, reason="forward_exception" if result.error else "close",
                    suppress_errors=True,
                )
            return result

    # -- serving-layer lifecycle -------------------------------------------------------------
    def reset_session(self, session_id: str) -> None:
        """Release the session's KV (if resident), then call the pipeline's reset hook. Errors raise."""
        _check_session_id(session_id)
        with self._lock:
            self._release_session(session_id, reset_model=True, reason="reset")

    def close_session(self, session_id: str) -> None:
        """Release the session's KV (if resident), then call the pipeline's close hook. Errors raise."""
        _check_session_id(session_id)
        with self._lock:
            self._release_session(session_id, reset_model=False, reason="close")

    def close(self) -> None:
        """Release every session (close hooks; errors logged) and free the pools. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for session_id in list(self._sessions):
                self._release_session(session_id, reset_model=False, reason="close", suppress_errors=True)
            self._kv_cache.close()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ARDiffusionModelRunner is closed")

    # -- internals -----------------------------------------------------------------------------
    def _validate_request(self, session_id: str, request: DiffusionRequest) -> None:
        """The pipeline's optional host-side check, before any session or KV changes."""
        if self._request_validator is not None:
            self._request_validator(session_id, request)

    def _get_or_create_session(self, session_id: str) -> ARDiffusionKVState:
        state = self._sessions.get(session_id)
        if state is not None:
            self._sessions.move_to_end(session_id)
            return state
        while len(self._sessions) >= self.session_capacity:
            oldest = next(iter(self._sessions))
            self._release_session(oldest, reset_model=False, reason="lru_eviction")
        state = self._kv_cache.create_state(session_id)
        state._runner_managed = True
        self._sessions[session_id] = state
        logger.info("AR-Diffusion session %r created (slot %s; %d resident)", session_id, state.slot,
                    len(self._sessions))
        self._emit("created", session_id)
        return state

    def _release_session(self, session_id: str, *, reset_model: bool, reason: str,
                         suppress_errors: bool = False) -> None:
        """KV first, then the pipeline hook (even when nothing was resident)."""
        errors: list[BaseException] = []
        state = self._sessions.pop(session_id, None)
        if state is not None:
            try:
                state.close()
            except Exception as error:  # pragma: no cover - close only touches host bookkeeping
                errors.append(error)
            self._emit("released", session_id, reason)
        hook = self._pipeline.reset_ar_diffusion_session if reset_model else self._pipeline.close_ar_diffusion_session
        try:
            hook(session_id)
        except Exception as error:
            errors.append(error)
        log = logger.info if reason in ("lru_eviction", "forward_exception", "pools_lost") else logger.debug
        log("AR-Diffusion session %r released (%s; was resident: %s)", session_id, reason, state is not None)
        if errors:
            if suppress_errors:
                for error in errors:
                    logger.warning("AR-Diffusion cleanup of session %r (%s) failed: %r", session_id, reason, error)
            else:
                raise errors[0]

    @contextlib.contextmanager
    def _bound(self, session_id: str, state: ARDiffusionKVState) -> Iterator[None]:
        """Bind ``state`` to the pipeline for exactly one invocation, then check what the pipeline left."""
        state._bound = True
        try:
            with self._pipeline.bind_ar_diffusion_state(session_id, state):
                yield
        finally:
            state._bound = False
        for name, value in vars(self._pipeline).items() if hasattr(self._pipeline, "__dict__") else ():
            if value is state:
                raise RuntimeError(
                    f"pipeline {type(self._pipeline).__name__} retained the bound ARDiffusionKVState of session "
                    f"{session_id!r} in attribute {name!r} past its invocation; clear it when the bind context exits"
                )
        self._kv_cache.check_pools()

    def _synchronize(self, output: Any) -> None:
        """Wait for the pool writes and the output, so device errors surface inside the fail-closed scope."""
        self._kv_cache.block_until_ready()
        for leaf in jax.tree_util.tree_leaves(output):
            if isinstance(leaf, jax.Array):
                leaf.block_until_ready()

    def _fail_closed(self, session_id: str, error: BaseException) -> None:
        logger.info("AR-Diffusion request on session %r failed (%r); releasing it", session_id, error)
        self._release_session(session_id, reset_model=False, reason="forward_exception", suppress_errors=True)
        if self._kv_cache.pools.is_deleted():
            # A model donated or deleted the pools: every resident session's KV is gone.
            # Release them all (close hooks) and start from fresh zeroed pools.
            for other in list(self._sessions):
                self._release_session(other, reset_model=False, reason="pools_lost", suppress_errors=True)
            self._kv_cache.reallocate_pools()
            logger.error("AR-Diffusion KV pools were lost during session %r; all sessions were released",
                         session_id)

    def _warmup(self) -> None:
        if not self._config.warmup:
            logger.info("AR-Diffusion warmup disabled by config")
            return
        if not isinstance(self._pipeline, SupportsARDiffusionWarmup):
            logger.info("AR-Diffusion pipeline %s has no warmup provider; skipping warmup",
                        type(self._pipeline).__name__)
            return
        free_before = self._kv_cache.num_free_slots
        executed = 0
        try:
            for request in self._pipeline.ar_diffusion_warmup_requests(WARMUP_SESSION_ID):
                if not isinstance(request, DiffusionRequest):
                    logger.warning("AR-Diffusion warmup yielded %r, not a DiffusionRequest; skipped", request)
                    continue
                session_id = self._request_session(request)[0]
                if session_id != WARMUP_SESSION_ID:
                    logger.warning("AR-Diffusion warmup request %r targets session %r instead of %r; skipped",
                                   request.request_id, session_id, WARMUP_SESSION_ID)
                    continue
                try:
                    self.execute_model(request)
                    executed += 1
                except Exception as error:
                    logger.warning("AR-Diffusion warmup request %r failed: %r", request.request_id, error)
        except Exception as error:
            logger.warning("AR-Diffusion warmup provider failed: %r", error)
        finally:
            self._release_session(WARMUP_SESSION_ID, reset_model=False, reason="warmup_complete",
                                  suppress_errors=True)
            self._perf_e2e_times.clear()
        logger.info("AR-Diffusion warmup ran %d request(s)", executed)
        if self._kv_cache.num_free_slots != free_before:  # pragma: no cover - defensive
            logger.warning("AR-Diffusion warmup left %d slot(s) in use",
                           free_before - self._kv_cache.num_free_slots)


def _step_capable(pipeline: Any) -> bool:
    return isinstance(pipeline, SupportsStepExecution) and bool(getattr(pipeline, "supports_step_execution", False))


def _check_session_id(session_id: Any) -> None:
    if not isinstance(session_id, str) or not session_id.strip():
        raise ValueError(f"AR-Diffusion session ids must be non-blank strings, got {session_id!r}")
