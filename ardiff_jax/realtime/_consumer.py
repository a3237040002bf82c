"""``EngineTickConsumer``: runs a session's ticks on an in-process engine, one by one or batched."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ardiff_jax.realtime._lifecycle import _check_engine_methods, _check_executor, _engine_executor
from ardiff_jax.types import ARDiffusionChunkMetadata, ARDiffusionTickRequest, DiffusionRequest

if TYPE_CHECKING:
    from ardiff_jax.runtime import ARDiffusionEngine

__all__ = ["EngineTickConsumer", "TickBatch"]

#: Where a pipeline puts a tick's chunk metadata: a field of its output, or a key of a mapping output.
CHUNK_METADATA_KEY = "ar_diffusion"


class EngineTickConsumer:
    """Run each tick as one ``engine.generate`` request, off the event loop.

    A tick becomes ``DiffusionRequest(request_id=tick.request_id, prompt=...,
    extra_args=tick.to_extra_args(), inputs=...)``: the prompt is
    ``prompt_provider(tick)`` when given, else ``tick.prompt``; the inputs are
    ``inputs_provider(tick)`` when given, else empty. The providers run on the event loop
    and should be quick; ``engine.generate`` runs on ``executor`` (default: a single-thread
    executor of its own), so one slow chunk never blocks other sessions' transports. Share
    that executor with :class:`~ardiff_jax.realtime.EngineSessionLifecycle` so that ticks and
    releases reach the engine in order.

    **Batched ticks.** Inside :meth:`batch` (``with consumer.batch(session_ids): ...``), the
    ticks of those sessions are held until every one of them has arrived (or its caller gave up,
    see :class:`TickBatch`), then run as one ``engine.generate_batch`` call: one forward for all
    of them where the pipeline batches. A session whose request fails gets its own exception
    (the engine released it, as ``generate`` would); the others get their outputs. An engine
    without ``generate_batch`` (a router) runs the held requests one by one.

    The pipeline reports the chunk it produced as :class:`~ardiff_jax.types.ARDiffusionChunkMetadata`
    in its output (field or mapping key ``"ar_diffusion"``). :meth:`execute_tick` checks that
    it parses and names this tick's request id (ValueError otherwise); the session then
    compares all of it with the tick. Unlike a consumer behind a multi-replica serving
    frontend there is no replica count to check: one engine serves every tick.
    """

    def __init__(self, engine: ARDiffusionEngine, *,
                 inputs_provider: Callable[[ARDiffusionTickRequest], Mapping[str, Any]] | None = None,
                 prompt_provider: Callable[[ARDiffusionTickRequest], Any] | None = None,
                 executor: concurrent.futures.Executor | None = None) -> None:
        _check_engine_methods("EngineTickConsumer", engine, "generate")
        for name, provider in (("inputs_provider", inputs_provider), ("prompt_provider", prompt_provider)):
            if provider is not None and not callable(provider):
                raise TypeError(f"EngineTickConsumer {name} must be callable, got {provider!r}")
        self._engine = engine
        self._inputs_provider = inputs_provider
        self._prompt_provider = prompt_provider
        self._owns_executor = _check_executor(executor) is None
        self._executor = _engine_executor() if executor is None else executor
        self._batch: TickBatch | None = None

    @property
    def executor(self) -> concurrent.futures.Executor:
        return self._executor

    def _request(self, tick: ARDiffusionTickRequest) -> DiffusionRequest:
        if not isinstance(tick, ARDiffusionTickRequest):
            raise TypeError(f"EngineTickConsumer expects an ARDiffusionTickRequest, got {tick!r}")
        prompt = self._prompt_provider(tick) if self._prompt_provider is not None else tick.prompt
        inputs = self._inputs_provider(tick) if self._inputs_provider is not None else {}
        return DiffusionRequest(request_id=tick.request_id, prompt=prompt, extra_args=tick.to_extra_args(),
                                inputs=inputs)

    async def execute_tick(self, tick: ARDiffusionTickRequest) -> Any:
        """Generate the tick's chunk; returns the pipeline's output.

        ValueError when the output carries no parseable chunk metadata or metadata for another
        request id (checked here so that a wrong output never reaches the session's commit).
        """
        request = self._request(tick)
        batch = self._batch
        if batch is not None and batch.expects(tick.session_id):
            output = await batch.submit(tick.session_id, request)
        else:
            output = await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.generate, request)
        metadata = self.chunk_metadata(output)
        if metadata.request_id != tick.request_id:
            raise ValueError(f"engine output reports chunk metadata for request {metadata.request_id!r}, "
                             f"but the tick's request id is {tick.request_id!r}")
        return output

    def batch(self, session_ids: Iterable[str]) -> TickBatch:
        """A :class:`TickBatch` for the next tick of each of ``session_ids`` (one open at a time); use it with ``with``."""
        if self._batch is not None:
            raise RuntimeError("a tick batch is already open on this consumer")
        return TickBatch(self, session_ids)

    def chunk_metadata(self, output: Any) -> ARDiffusionChunkMetadata:
        """The chunk metadata in ``output`` (its ``ar_diffusion`` field or ``"ar_diffusion"`` key)."""
        if isinstance(output, Mapping):
            if CHUNK_METADATA_KEY not in output:
                raise ValueError(f"engine output mapping has no {CHUNK_METADATA_KEY!r} key (keys {list(output)}); "
                                 "the pipeline must report ARDiffusionChunkMetadata for typed ticks")
            value = output[CHUNK_METADATA_KEY]
        else:
            value = getattr(output, CHUNK_METADATA_KEY, None)
            if value is None:
                raise ValueError(f"engine output {type(output).__name__} has no {CHUNK_METADATA_KEY} chunk metadata; "
                                 "the pipeline must report ARDiffusionChunkMetadata for typed ticks")
        if isinstance(value, ARDiffusionChunkMetadata):
            return value
        if isinstance(value, Mapping):
            return ARDiffusionChunkMetadata.from_dict(value)
        raise ValueError(f"engine output {CHUNK_METADATA_KEY} must be ARDiffusionChunkMetadata or its dict form, "
                         f"got {value!r}")

    def close(self) -> None:
        """Shut down the executor this consumer made (waiting for queued calls); a shared one is left alone."""
        if self._owns_executor:
            self._executor.shutdown(wait=True)


class TickBatch:
    """The next tick of each of a set of sessions, run as one ``engine.generate_batch`` call.

    Open with ``with consumer.batch(session_ids) as batch:``, then start each session's
    ``next_chunk()``; the consumer holds each tick until every expected session has submitted
    one, then runs them together on the engine's executor and resolves each caller with its
    own output or exception. A session that will not submit (its ``next_chunk`` failed or
    returned before reaching the engine) must be :meth:`withdraw`-n, so the rest do not wait
    for it: call ``withdraw(session_id)`` when that session's task ends (withdrawing a session
    that already submitted does nothing). Leaving the ``with`` block closes the batch: ticks
    arriving later run alone.
    """

    def __init__(self, consumer: EngineTickConsumer, session_ids: Iterable[str]) -> None:
        self._consumer = consumer
        self._expected = set(session_ids)
        self._submitted: dict[str, tuple[DiffusionRequest, asyncio.Future]] = {}
        self._dispatched = False

    def __enter__(self) -> TickBatch:
        self._consumer._batch = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._consumer._batch is self:
            self._consumer._batch = None

    def expects(self, session_id: str) -> bool:
        return not self._dispatched and session_id in self._expected and session_id not in self._submitted

    async def submit(self, session_id: str, request: DiffusionRequest) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._submitted[session_id] = (request, future)
        self._maybe_dispatch()
        return await future

    def withdraw(self, session_id: str) -> None:
        """``session_id`` will not submit a tick to this batch (no-op once it has)."""
        if session_id in self._submitted or self._dispatched:
            return
        self._expected.discard(session_id)
        self._maybe_dispatch()

    def _maybe_dispatch(self) -> None:
        if self._dispatched or not self._submitted or set(self._submitted) != self._expected:
            return
        self._dispatched = True
        self.task = asyncio.get_running_loop().create_task(self._run(list(self._submitted.items())))

    async def _run(self, submitted: list[tuple[str, tuple[DiffusionRequest, asyncio.Future]]]) -> None:
        engine, executor = self._consumer._engine, self._consumer._executor
        requests = [request for _, (request, _) in submitted]
        loop = asyncio.get_running_loop()
        results: list[Any]
        if len(requests) == 1 or not hasattr(engine, "generate_batch"):
            results = [await _outcome(loop.run_in_executor(executor, engine.generate, r)) for r in requests]
        else:
            try:
                results = list(await loop.run_in_executor(executor, engine.generate_batch, requests))
            except _batch_error_type() as error:  # some sessions failed (each released); the rest completed
                results = [error.errors.get(session_id, output)
                           for (session_id, _), output in zip(submitted, error.outputs, strict=True)]
            except (ValueError, TypeError):
                # Refused before anything ran (one request generate would refuse): each alone, so only that one fails.
                results = [await _outcome(loop.run_in_executor(executor, engine.generate, r)) for r in requests]
            except Exception as error:  # noqa: BLE001 - every waiting session learns why its chunk failed
                results = [error] * len(requests)
        for (_, (_, future)), result in zip(submitted, results, strict=True):
            if future.done():
                continue  # its caller was cancelled meanwhile
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


async def _outcome(awaitable: Any) -> Any:
    """The result of ``awaitable``, or the exception it raised."""
    try:
        return await awaitable
    except Exception as error:  # noqa: BLE001 - returned to the one caller it belongs to
        return error


def _batch_error_type() -> type[Exception]:
    from ardiff_jax.runtime import ARDiffusionBatchError

    return ARDiffusionBatchError
