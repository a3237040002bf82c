"""The batch runner and the warmup / bucket compiler of an ``ARDiffusionModelRunner``.

:class:`BatchRunner` runs the admitted sessions of one batch: it picks the bucket (the padded
batch size whose program runs), runs one batched forward through the gate, rolls every
session's bookkeeping back when that forward fails and reruns the requests one by one (the
fallback), and records which buckets' programs have run. What a failure costs a session
(fail-closed) is the runner's policy, handed in as ``fail_closed``; one request runs through
the runner's ``run_one``.

:class:`Warmup` runs the pipeline's warmup requests at load, compiles the batch buckets
(eagerly at load, or on a background thread: on a twin pipeline when the pipeline offers
one, else bucket by bucket under the runner lock) and stops that thread on close. At load and
under the lock it drives the runner's own entry points, so warmup runs exactly the code a
request runs. On a twin it drives a :class:`BucketCompiler`: a gate over the twin pipeline,
pools of the runner's layout and a :class:`BatchRunner` (the batched run a request's batch
runs), and nothing else of a runner.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax  # noqa: F401 - imported before the atexit registration below (see stop_every_compiler)

from ardiff_jax.runtime._batch import ARDiffusionKVBatch, batch_buckets, bucket_for
from ardiff_jax.runtime._events import WARMUP_SESSION_ID
from ardiff_jax.runtime._gate import PipelineGate, kv_cache_spec
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._loading import check_loadable
from ardiff_jax.runtime._requests import request_session
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.types import DiffusionRequest

__all__ = ["BatchRunner", "BucketCompiler", "Warmup", "stop_every_compiler"]

logger = logging.getLogger("ardiff_jax.runtime")

#: How long ``close()`` (and interpreter exit) waits for the bucket compiler: it stops at its
#: next bucket, so this bounds one bucket's compile; past it, close goes on and logs.
_COMPILER_JOIN_TIMEOUT_S = 600.0

#: Warmups whose background bucket compiler may still run (weakly held: a dropped runner is not kept).
_COMPILING: weakref.WeakSet[Warmup] = weakref.WeakSet()


def stop_every_compiler() -> None:
    """At interpreter exit: stop every background bucket compiler and wait for it.

    A daemon thread still inside an XLA compile when the interpreter tears the backend down
    aborts the process (SIGABRT). Registered after ``import jax`` above, so it runs before
    jax's own exit handlers (atexit runs last-registered first).
    """
    for warmup in list(_COMPILING):
        warmup.stop()


atexit.register(stop_every_compiler)


class BatchRunner:
    """Bucket choice, the batched run, its rollback, the one-by-one fallback and the compiled-bucket record.

    Args:
      gate: the runner's pipeline gate.
      kv_cache: the runner's cache (the batch's pools).
      run_one: ``run_one(session_id, request) -> output``: one admitted request, fail-closed.
      fail_closed: ``fail_closed(session_id, error)``: the runner's release of a failed session.
    """

    def __init__(self, gate: PipelineGate, kv_cache: ARDiffusionKVCache, *,
                 run_one: Callable[[str, DiffusionRequest], Any],
                 fail_closed: Callable[[str, BaseException], None]) -> None:
        self._gate = gate
        self._kv_cache = kv_cache
        self._run_one = run_one
        self._fail_closed = fail_closed
        self.buckets: tuple[int, ...] = batch_buckets(kv_cache.session_capacity)
        # Batch buckets whose programs are compiled (batch_compile: eager at load, background by
        # the compiler thread, lazy on first use); only "background" routes around the others.
        # Changed under the runner lock only, by rebinding a new frozenset: a reader outside the lock
        # (compiled_batch_buckets) iterates a value nobody changes.
        self.compiled: frozenset[int] = frozenset()
        self.forced_bucket: int | None = None  # the bucket a background warmup batch is padded to
        self.background = False  # a background compiler builds the buckets: never wait for a compile

    def bucket_to_run(self, size: int) -> int | None:
        """The bucket a batch of ``size`` runs in; None: run it one by one.

        Eager and lazy: the smallest bucket holding it (lazy compiles it on first use). In
        background mode, while the compiler thread has not built that bucket, the smallest
        compiled one that holds it, else None: a request never waits for its own compile.
        """
        smallest = bucket_for(size, self.buckets)
        if not self.background or smallest in self.compiled:
            return smallest
        ready = [bucket for bucket in self.compiled if bucket >= size]
        return min(ready) if ready else None

    def run(self, session_ids: list[str], requests: list[DiffusionRequest],
            states: list[ARDiffusionKVState]) -> tuple[list[Any], dict[str, BaseException]]:
        """``(outputs, errors)``: one batched forward, or one by one when it cannot run or raised."""
        if not self._gate.can_batch or len(requests) == 1:
            return self.run_one_by_one(session_ids, requests)
        before = [state.checkpoint() for state in states]
        bucket = self.forced_bucket or self.bucket_to_run(len(states))
        if bucket is None:  # background mode: no compiled bucket holds it yet, and one session's program is built
            return self.run_one_by_one(session_ids, requests)
        batch = ARDiffusionKVBatch(self._kv_cache, states, bucket)
        try:
            outputs = self._gate.batched_forward(session_ids, states, batch, requests)
            # An asynchronous device error surfaces here, not in forward_batch: the staged model
            # state (batch.defer_publish) is awaited too and installed only after this returned.
            self._gate.synchronize((outputs, batch._deferred_arrays()))
        except Exception as error:
            batch._drop_deferred()  # never installed: the rerun starts from the model state before the batch
            logger.warning("AR-Diffusion batched forward of sessions %s failed (%r); rerunning them one by one",
                           session_ids, error)
            if self._kv_cache.pools.is_deleted():  # nothing to rerun on: every session's KV is gone
                self._fail_closed(session_ids[0], error)  # releases every resident session ("pools_lost")
                return [None] * len(requests), dict.fromkeys(session_ids, error)
            for state, checkpoint in zip(states, before, strict=True):
                if not state.closed:  # resident still: pipeline code cannot release a session
                    state.rollback(checkpoint)
            return self.run_one_by_one(session_ids, requests)
        except BaseException as error:  # KeyboardInterrupt and the like: fail every session of the batch closed
            for session_id in session_ids:
                self._fail_closed(session_id, error)
            raise
        try:
            batch._publish_deferred()
        except BaseException as error:  # model state half installed beside committed KV: nothing to rerun from
            for session_id in session_ids:
                self._fail_closed(session_id, error)
            if not isinstance(error, Exception):
                raise
            return [None] * len(requests), dict.fromkeys(session_ids, error)
        self.compiled |= {bucket}
        return outputs, {}

    def run_one_by_one(self, session_ids: list[str], requests: list[DiffusionRequest]
                       ) -> tuple[list[Any], dict[str, BaseException]]:
        outputs: list[Any] = []
        errors: dict[str, BaseException] = {}
        for session_id, request in zip(session_ids, requests, strict=True):
            try:
                outputs.append(self._run_one(session_id, request))
            except Exception as error:
                outputs.append(None)
                errors[session_id] = error
        return outputs, errors


class BucketCompiler:
    """The batch buckets' programs built on a compile twin, with what that needs and nothing else of a runner.

    A gate over the twin pipeline, a KV cache planned as the serving runner's and a
    :class:`BatchRunner`; its warmup sessions are KV states it holds itself and releases
    (close hook) after each bucket: no session table, host tier, events, files, stepwise runs
    or lock, and nothing the serving runner holds. Why real pools of the serving layout, not
    shapes: a bucket's programs are built by running the pipeline's batched forward (pipeline
    code, calling its jitted programs on the bound pools' buffers), and those programs are
    keyed by the pools' shapes, so only pools of the same layout build the programs the
    serving runner's batches then run.

    Args:
      pipeline: the twin pipeline (``ar_diffusion_compile_twin()``).
      like: the serving runner's cache; this one is planned against its memory budget,
        device, KV dtype, storage dtype and attention backend.

    Raises what the twin's load-time checks, its spec or the pool allocation raise (e.g. no
    room for a second set of pools), and TypeError for a twin without the batch or warmup
    protocol; nothing is kept then. :attr:`fits`: whether the pools came out in ``like``'s
    layout (only then do its programs serve the runner). Close it to free its pools.
    """

    def __init__(self, pipeline: Any, like: ARDiffusionKVCache) -> None:
        check_loadable(pipeline, None)
        plan = like.plan
        self._kv_cache = ARDiffusionKVCache(
            kv_cache_spec(pipeline), dtype=like.dtype, available_memory_bytes=plan.available_bytes,
            gpu_memory_fraction=plan.gpu_memory_fraction, device=like.device,
            storage_dtype=like.layout.storage_dtype, attention_backend=like.attention_backend)
        self._gate = PipelineGate(pipeline, self._kv_cache, batched=True)
        if not (self._gate.can_batch and self._gate.can_warm_up):
            self._kv_cache.close()
            raise TypeError(f"the compile twin {self._gate.name} must implement SupportsARDiffusionBatch and "
                            "SupportsARDiffusionWarmup")
        self.fits = self._kv_cache.layout == like.layout
        self._states: dict[str, ARDiffusionKVState] = {}  # the open warmup sessions, by id
        self._batches = BatchRunner(self._gate, self._kv_cache, run_one=self._run_one, fail_closed=self._fail_closed)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self._batches.buckets

    @property
    def kv_cache(self) -> ARDiffusionKVCache:
        return self._kv_cache

    def compile(self, stop: threading.Event) -> frozenset[int]:
        """Each bucket, smallest first, until ``stop`` is set (checked between buckets); the buckets built.

        A bucket runs the warmup requests of two warmup sessions as batches padded to it (padded
        rows change the data, not the program: this builds the program a full batch runs), so
        batch ``k`` holds both sessions' ``k``-th request and the programs of a first block and
        of a later one are both built. A failed batch is logged and its bucket counted anyway
        (it then compiles on first use, as under ``"lazy"``); a warmup provider that gives
        requests for other sessions (or no requests) stops the compile there.
        """
        built: frozenset[int] = frozenset()
        for bucket in self.buckets:
            if stop.is_set():
                logger.info("AR-Diffusion batch warmup stopped before bucket %d (the runner closed)", bucket)
                break
            if not self._warm_up_bucket(bucket):
                break
            built |= {bucket}
        return built

    def close(self) -> None:
        """Release the warmup sessions left (close hooks, errors logged) and free the pools. Idempotent."""
        for session_id in list(self._states):
            self._release(session_id, reset=False)
        self._kv_cache.close()

    def _warm_up_bucket(self, bucket: int) -> bool:
        """Two warmup sessions' warmup requests as batches padded to ``bucket``, then released; False: provider unfit."""
        session_ids = [f"{WARMUP_SESSION_ID}{index}" for index in range(2)]
        self._batches.forced_bucket = bucket
        try:
            sequences = [list(self._gate.warmup_requests(session_id)) for session_id in session_ids]
            for requests in zip(*sequences, strict=False):
                flags = [request_session(request) if isinstance(request, DiffusionRequest) else None
                         for request in requests]
                bad = [(request, session_id) for request, session_id, flag in zip(requests, session_ids, flags,
                                                                                   strict=True)
                       if flag is None or flag[0] != session_id]
                if bad:
                    logger.warning("AR-Diffusion batch warmup skipped: the warmup provider gave %r for session %r",
                                   *bad[0])
                    return False
                self._run_batch(session_ids, list(requests), [flag[1:3] for flag in flags])
        except Exception as error:
            logger.warning("AR-Diffusion batch warmup of bucket %d failed: %r", bucket, error)
        finally:
            self._batches.forced_bucket = None
            for session_id in session_ids:
                self._release(session_id, reset=False)
        return True

    def _run_batch(self, session_ids: list[str], requests: list[DiffusionRequest],
                   flags: list[tuple[bool, bool]]) -> None:
        """One batch as ``execute_model_batch`` runs it: validate, reset, admit, run, close; the first error raised."""
        for session_id, request in zip(session_ids, requests, strict=True):
            self._gate.validate(session_id, request)
        for session_id, (reset, _) in zip(session_ids, flags, strict=True):
            if reset:
                self._release(session_id, reset=True)
        states = [self._admit(session_id) for session_id in session_ids]
        _, errors = self._batches.run(session_ids, requests, states)
        if errors:
            raise next(iter(errors.values()))
        for session_id, (_, close_after) in zip(session_ids, flags, strict=True):
            if close_after:
                self._release(session_id, reset=False)

    def _admit(self, session_id: str) -> ARDiffusionKVState:
        state = self._states.get(session_id)
        if state is None:  # not adopted as a runner's: this compiler is its only holder, and closes it itself
            state = self._states[session_id] = self._kv_cache.create_state(session_id)
        return state

    def _run_one(self, session_id: str, request: DiffusionRequest) -> Any:
        """One request (the batch's fallback), fail-closed as the runner's."""
        state = self._states[session_id]
        try:
            output = self._gate.forward(session_id, state, request)
            self._gate.synchronize(output)
        except BaseException as error:
            self._fail_closed(session_id, error)
            raise
        return output

    def _fail_closed(self, session_id: str, error: BaseException) -> None:
        """Release the failed session; pools lost: every session, and fresh pools for the next bucket."""
        logger.info("AR-Diffusion twin warmup of session %r failed (%r); releasing it", session_id, error)
        self._release(session_id, reset=False)
        if self._kv_cache.pools.is_deleted():
            for other in list(self._states):
                self._release(other, reset=False)
            self._kv_cache.reallocate_pools()

    def _release(self, session_id: str, *, reset: bool) -> None:
        """KV first, then the pipeline's reset or close hook (its error logged: warmup cleanup)."""
        state = self._states.pop(session_id, None)
        if state is not None:
            state.close()
        try:
            self._gate.hook(session_id, reset=reset)
        except Exception as error:
            logger.warning("AR-Diffusion cleanup of twin warmup session %r failed: %r", session_id, error)


class Warmup:
    """Load-time warmup, the eager bucket compile and the background bucket compiler of one runner.

    Args:
      runner: the ``ARDiffusionModelRunner`` it warms up (its entry points run the warmup
        requests; its lock guards every change).
      batches: the runner's batch runner (the buckets and their record).
    """

    def __init__(self, runner: Any, batches: BatchRunner) -> None:
        self._runner = runner
        self._batches = batches
        # Set by close() (and at interpreter exit): the background compiler, on a twin or under the
        # lock, checks it between buckets.
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # -- at load ------------------------------------------------------------------------------------
    def run(self) -> None:
        """The pipeline's warmup requests on the warmup session, then (``"eager"``) every batch bucket."""
        runner = self._runner
        config, gate, kv_cache = runner.config, runner._gate, runner.kv_cache
        if not config.warmup:
            logger.info("AR-Diffusion warmup disabled by config")
            return
        if not gate.can_warm_up:
            logger.info("AR-Diffusion pipeline %s has no warmup provider; skipping warmup", gate.name)
            return
        free_before = kv_cache.num_free_slots
        executed = 0
        try:
            for request in gate.warmup_requests(WARMUP_SESSION_ID):
                if not isinstance(request, DiffusionRequest):
                    logger.warning("AR-Diffusion warmup yielded %r, not a DiffusionRequest; skipped", request)
                    continue
                try:
                    session_id = runner._request_session(request)[0]
                except ValueError as error:
                    logger.warning("AR-Diffusion warmup request %r is malformed (%s); skipped", request.request_id,
                                   error)
                    continue
                if session_id != WARMUP_SESSION_ID:
                    logger.warning("AR-Diffusion warmup request %r targets session %r instead of %r; skipped",
                                   request.request_id, session_id, WARMUP_SESSION_ID)
                    continue
                try:
                    runner.execute_model(request)
                    executed += 1
                except Exception as error:
                    logger.warning("AR-Diffusion warmup request %r failed: %r", request.request_id, error)
        except Exception as error:
            logger.warning("AR-Diffusion warmup provider failed: %r", error)
        finally:
            self._release([WARMUP_SESSION_ID])
        logger.info("AR-Diffusion warmup ran %d request(s)", executed)
        if config.batch_compile == "eager":
            self._compile_every_bucket()
        if kv_cache.num_free_slots != free_before:  # pragma: no cover - defensive
            logger.warning("AR-Diffusion warmup left %d slot(s) in use", free_before - kv_cache.num_free_slots)

    def _compile_every_bucket(self) -> None:
        """Compile every batch bucket: per bucket, a batch of warmup sessions runs the warmup requests in turn.

        Batch ``k`` of a bucket holds every warmup session's ``k``-th warmup request, so the
        programs of a session's first block and of its later ones (which differ, e.g. for a
        streaming VAE) are both compiled at every bucket. After it, batches of any
        composition (sizes, fill levels, fresh and restored sessions) reuse the compiled
        programs. Failures are logged, as any warmup's.
        """
        batches = self._batches
        if not self._runner._gate.can_batch or not batches.buckets:
            return
        for bucket in batches.buckets:
            if not self.warm_up_bucket(bucket):
                return
            batches.compiled |= {bucket}
        logger.info("AR-Diffusion warmup compiled batch buckets %s", batches.buckets)

    def warm_up_bucket(self, bucket: int, num_sessions: int | None = None) -> bool:
        """Run warmup sessions' warmup requests as batches, then release them; False: provider unfit.

        ``num_sessions`` (default ``bucket``) warmup sessions take part; the caller holds that
        many free slots (the load, or the compiler thread under the lock).
        """
        runner = self._runner
        session_ids = [f"{WARMUP_SESSION_ID}{index}" for index in range(num_sessions or bucket)]
        try:
            sequences = [list(runner._gate.warmup_requests(session_id)) for session_id in session_ids]
            for requests in zip(*sequences, strict=False):
                bad = [(request, session_id) for request, session_id in zip(requests, session_ids, strict=True)
                       if not isinstance(request, DiffusionRequest)
                       or runner._request_session(request)[0] != session_id]
                if bad:
                    logger.warning("AR-Diffusion batch warmup skipped: the warmup provider gave %r for session %r",
                                   *bad[0])
                    return False
                runner.execute_model_batch(list(requests))
        except Exception as error:
            logger.warning("AR-Diffusion batch warmup of bucket %d failed: %r", bucket, error)
        finally:
            self._release(session_ids)
        return True

    def _release(self, session_ids: list[str]) -> None:
        """Release warmup sessions (close hooks, errors logged) and forget the warmup's wall times."""
        runner = self._runner
        with runner._locked():
            for session_id in session_ids:
                runner._residency.release(session_id, reset_model=False, reason="warmup_complete",
                                          suppress_errors=True)
        runner._forget_e2e_times()

    # -- the background compiler ----------------------------------------------------------------------
    def start_background(self) -> None:
        """Start the compiler thread when ``batch_compile="background"`` has buckets to build."""
        config, gate = self._runner.config, self._runner._gate
        if not (config.batch_compile == "background" and config.warmup and gate.can_batch
                and bool(self._batches.buckets) and gate.can_warm_up):
            return
        self._batches.background = True
        self.thread = threading.Thread(target=self._compile_in_background, name="ardiff-jax bucket compiler",
                                       daemon=True)
        _COMPILING.add(self)
        self.thread.start()

    def wait(self, timeout: float | None) -> bool:
        """Wait for the compiler thread; whether it is done (True at once without one)."""
        thread = self.thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def stop(self) -> None:
        """Stop the background compiler and wait for it (it checks the flag between buckets).

        Not from the compiler thread itself, nor while this thread holds the runner lock (the
        compiler under the lock takes it per bucket): then only the flag is set.
        """
        self._stop.set()
        thread = self.thread
        if thread is None or thread is threading.current_thread() or self._runner._lock._is_owned():
            return
        thread.join(_COMPILER_JOIN_TIMEOUT_S)
        if thread.is_alive():  # pragma: no cover - a compile that outlasts the bound
            logger.warning("AR-Diffusion background bucket compiler still running %.0f s after close; going on",
                           _COMPILER_JOIN_TIMEOUT_S)

    def _compile_in_background(self) -> None:
        """The compiler thread: on a twin pipeline when the pipeline offers one and it fits, else under the lock."""
        try:
            if self._runner._gate.has_compile_twin and self._compile_on_a_twin():
                return
            self._compile_under_the_lock()
        finally:
            _COMPILING.discard(self)

    def _compile_on_a_twin(self) -> bool:
        """Every bucket built on the pipeline's compile twin, outside this runner's lock; False: fall back.

        A :class:`BucketCompiler` over the twin pipeline (its own pools, planned against this
        runner's memory budget, so of this runner's layout: the programs it builds are the ones
        this runner's batches run) compiles the buckets and is closed; its pools are the plan's
        bytes again until then. Nothing of this runner changes but the record of compiled buckets.
        """
        runner, batches = self._runner, self._batches
        if self._stop.is_set():  # closed before the thread got here: no twin, no fallback
            return True
        try:
            compiler = BucketCompiler(runner._gate.compile_twin(), runner.kv_cache)
        except Exception as error:  # e.g. no room for a second set of pools: compile under the lock instead
            logger.warning("AR-Diffusion background compilation cannot use a twin pipeline (%r); compiling under "
                           "the runner lock", error)
            return False
        try:
            if not compiler.fits or compiler.buckets != batches.buckets:
                logger.warning("AR-Diffusion twin pipeline planned another layout; compiling under the runner lock")
                return False
            built = compiler.compile(self._stop)
            if self._stop.is_set():  # stopped between the twin's buckets: its buckets are not adopted
                return True
            with runner._locked():  # every change under the lock (no compile here: the twin built them)
                batches.compiled |= built
        finally:
            compiler.close()
            del compiler  # the twin's pipeline and pools are freed with the thread, not kept by its frame
        logger.info("AR-Diffusion background compilation built batch buckets %s on a twin pipeline", batches.buckets)
        return True

    def _compile_under_the_lock(self) -> None:
        """Each bucket, smallest first, under the runner lock while two slots are free.

        Each bucket runs the warmup requests of two warmup sessions as batches padded to the
        bucket (padded rows change the data, not the program, so this builds exactly the
        program a full batch runs) and releases them before it lets go of the lock, so no
        caller ever sees them; while players hold all but one slot it waits. Errors are
        logged and the bucket is marked anyway (its batches then compile on first use, as
        under ``"lazy"``).
        """
        runner, batches = self._runner, self._batches
        for bucket in batches.buckets:
            while not self._stop.is_set():
                with runner._locked():
                    if runner.closed:
                        return
                    if runner.kv_cache.num_free_slots >= 2:
                        batches.forced_bucket = bucket
                        try:
                            self.warm_up_bucket(bucket, num_sessions=2)
                        finally:
                            batches.forced_bucket = None
                        batches.compiled |= {bucket}
                        break
                self._stop.wait(0.2)
            if self._stop.is_set():
                return
        logger.info("AR-Diffusion background compilation built batch buckets %s", batches.buckets)
