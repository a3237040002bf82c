"""``EngineTickConsumer``: runs a session's ticks on an in-process engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ardiff_jax.realtime._lifecycle import _check_engine_methods, _check_executor, _engine_executor
from ardiff_jax.types import ARDiffusionChunkMetadata, ARDiffusionTickRequest, DiffusionRequest

if TYPE_CHECKING:
    from ardiff_jax.runtime import ARDiffusionEngine

__all__ = ["EngineTickConsumer"]

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
        output = await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.generate, request)
        metadata = self.chunk_metadata(output)
        if metadata.request_id != tick.request_id:
            raise ValueError(f"engine output reports chunk metadata for request {metadata.request_id!r}, "
                             f"but the tick's request id is {tick.request_id!r}")
        return output

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
