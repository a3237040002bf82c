"""Session lifecycles: where a session's ``reset`` / ``close`` reach the model.

* :class:`ARDiffusionWorkerLifecycle`: through a serving frontend's collective RPC to the
  workers of the selected stages (the reference runtime's worker methods
  ``reset_ar_diffusion_session`` / ``close_ar_diffusion_session``);
* :class:`EngineSessionLifecycle`: straight into an in-process
  :class:`~ardiff_jax.runtime.ARDiffusionEngine`, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ardiff_jax._checks import check_session_id, is_integer
from ardiff_jax.realtime._session import ARDiffusionSessionError

if TYPE_CHECKING:
    from ardiff_jax.runtime import ARDiffusionEngine

__all__ = ["ARDiffusionCollectiveRPCClient", "ARDiffusionWorkerLifecycle", "EngineSessionLifecycle"]


@runtime_checkable
class ARDiffusionCollectiveRPCClient(Protocol):
    """The part of a serving frontend's control surface the worker lifecycle uses."""

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None,
                             stage_ids: list[int] | None = None) -> Any: ...


def _collect(value: Any, errors: list[str], supported: list[bool]) -> None:
    """Flatten worker replies: bools, lists of replies, ``{"supported": False, "error": ...}``, ``{"result": ...}``."""
    if isinstance(value, bool):
        supported.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, errors, supported)
    elif isinstance(value, Mapping):
        if value.get("supported") is False:
            errors.append(str(value.get("error") or "the stage does not support this lifecycle RPC"))
        elif "result" in value:
            _collect(value["result"], errors, supported)


class ARDiffusionWorkerLifecycle:
    """Reset and close sessions on the workers of ``stage_ids`` via ``rpc_client.collective_rpc``.

    Each call is ``collective_rpc(method=..., timeout=timeout, args=(session_id,),
    stage_ids=[...])``. A reply that reports an error raises ARDiffusionSessionError
    ``"{method} failed: ..."``; replies without any ``True``, or with a ``False``, raise
    ``"{method} is not supported by every selected worker"``: a worker that could not release
    the session must not look like one that did. Errors of the RPC itself propagate unchanged.
    """

    def __init__(self, rpc_client: ARDiffusionCollectiveRPCClient, *, stage_ids: Sequence[int],
                 timeout: float | None = None) -> None:
        if not isinstance(rpc_client, ARDiffusionCollectiveRPCClient):
            raise TypeError(f"rpc_client must have an async collective_rpc method, got {rpc_client!r}")
        if isinstance(stage_ids, (str, bytes)) or not isinstance(stage_ids, Sequence):
            raise ValueError(f"stage_ids must be a sequence of stage indices, got {stage_ids!r}")
        if not stage_ids:
            raise ValueError("stage_ids must select at least one AR-Diffusion stage, got an empty sequence")
        for stage_id in stage_ids:
            if not is_integer(stage_id) or stage_id < 0:
                raise ValueError(f"stage_ids must be non-negative integers, got {stage_id!r} in {list(stage_ids)!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self._rpc_client = rpc_client
        self._stage_ids = tuple(int(stage_id) for stage_id in stage_ids)
        self._timeout = timeout

    async def _invoke(self, method: str, session_id: str) -> None:
        check_session_id(session_id)
        replies = await self._rpc_client.collective_rpc(method=method, timeout=self._timeout, args=(session_id,),
                                                        stage_ids=list(self._stage_ids))
        errors: list[str] = []
        supported: list[bool] = []
        _collect(replies, errors, supported)
        if errors:
            raise ARDiffusionSessionError(f"{method} failed: {'; '.join(errors)}")
        if not supported or not all(supported):
            raise ARDiffusionSessionError(f"{method} is not supported by every selected worker "
                                          f"(stages {list(self._stage_ids)}, replies {replies!r})")

    async def reset_session(self, session_id: str) -> None:
        await self._invoke("reset_ar_diffusion_session", session_id)

    async def close_session(self, session_id: str) -> None:
        await self._invoke("close_ar_diffusion_session", session_id)


def _engine_executor() -> concurrent.futures.ThreadPoolExecutor:
    """A single-thread executor: the engine sees one call at a time, in submission order."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ardiff-engine")


def _check_executor(executor: Any) -> concurrent.futures.Executor | None:
    if executor is not None and not isinstance(executor, concurrent.futures.Executor):
        raise TypeError(f"executor must be a concurrent.futures.Executor or None, got {executor!r}")
    return executor


def _check_engine_methods(owner: str, engine: Any, *methods: str) -> None:
    missing = [method for method in methods if not callable(getattr(engine, method, None))]
    if missing:
        raise TypeError(f"{owner} needs an ARDiffusionEngine (methods {', '.join(methods)}); "
                        f"{engine!r} has no {', '.join(missing)}")


class EngineSessionLifecycle:
    """The lifecycle of sessions served by an in-process :class:`~ardiff_jax.runtime.ARDiffusionEngine`.

    ``reset_session`` / ``close_session`` call the engine's methods of the same name on
    ``executor``, never on the event loop: a release waits for the device, and other sessions'
    transports must keep running meanwhile. Pass the executor of the
    :class:`~ardiff_jax.realtime.EngineTickConsumer` serving the same engine so that ticks and
    releases reach the engine one at a time and in order (a close queued behind a tick runs
    after it)::

        consumer = EngineTickConsumer(engine)
        lifecycle = EngineSessionLifecycle(engine, executor=consumer.executor)

    Without ``executor`` it makes its own single-thread executor, which :meth:`close` shuts down.
    """

    def __init__(self, engine: ARDiffusionEngine, *, executor: concurrent.futures.Executor | None = None) -> None:
        _check_engine_methods("EngineSessionLifecycle", engine, "reset_session", "close_session")
        self._engine = engine
        self._owns_executor = _check_executor(executor) is None
        self._executor = _engine_executor() if executor is None else executor

    @property
    def executor(self) -> concurrent.futures.Executor:
        return self._executor

    async def reset_session(self, session_id: str) -> None:
        check_session_id(session_id)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.reset_session, session_id)

    async def close_session(self, session_id: str) -> None:
        check_session_id(session_id)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.close_session, session_id)

    def close(self) -> None:
        """Shut down the executor this lifecycle made (waiting for queued calls); a shared one is left alone."""
        if self._owns_executor:
            self._executor.shutdown(wait=True)
