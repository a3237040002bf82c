"""Replicas in Ray actors (the ``[ray]`` extra): ``RayReplica``, ``RayEngineProxy``, ``ray_replicas``.

A :class:`RayReplica` actor builds one :class:`~ardiff_jax.runtime.ARDiffusionEngine` in its
own process from a picklable ``engine_factory()`` and answers the engine's calls. A
:class:`RayEngineProxy` is the engine on the client side, so
``ARDiffusionRouter([RayEngineProxy(actor), ...])`` routes across processes and hosts
exactly as across local engines.

Every call returns what the engine returned, with jax arrays turned into numpy arrays in
the actor (a client needs no device, and a jax array would otherwise come back committed
to the client's default device), together with the session events the call produced. The
proxy delivers those events to its listeners before it returns, so the router's
bookkeeping follows the remote engine exactly as it follows a local one. An exception the
engine raised is raised by the proxy as the same exception (same type and message, the
actor's traceback attached as a note).

A replica that spans hosts (one engine on a mesh over several hosts' devices) is one
actor per host, each running the same engine on its process of the multi-host JAX
program; one proxy over all of them sends every call to every host and answers with
process 0's reply (see :class:`RayEngineProxy`).

Ray is imported only when one of these is used: importing :mod:`ardiff_jax` never imports it.
``RayReplica`` (the actor class, ``ray.remote(EngineReplica)``) is therefore made on first
access, by :func:`ray_replica_class`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ardiff_jax._checks import check_positive_int, check_session_id
from ardiff_jax.runtime._router import _add_listener
from ardiff_jax.runtime._runner import SessionEvent
from ardiff_jax.types import DiffusionRequest, StepResult, StepSchedulerOutput

__all__ = ["EngineReplica", "RayEngineProxy", "Reply", "host_values", "ray_replica_class", "ray_replicas"]

logger = logging.getLogger("ardiff_jax.runtime")

#: Engine attributes a proxy reads from its actor, and the engine methods it calls.
_ATTRIBUTES = ("sessions", "offloaded_sessions", "session_capacity", "memory_plan")
_METHODS = ("generate", "step", "reset_session", "close_session", "fork_session", "save_session", "load_session",
            "close")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError("Ray replicas need the ray package: pip install 'ardiff_jax[ray]'") from error
    return ray


class Reply(NamedTuple):
    """One engine call's answer from an actor: its value or the exception it raised, and its session events."""

    value: Any
    error: BaseException | None
    events: tuple[SessionEvent, ...]


def host_values(value: Any) -> Any:
    """``value`` with every jax array (in a pytree, or a :class:`StepResult`'s output) as a numpy array."""
    import jax

    if isinstance(value, StepResult):
        return dataclasses.replace(value, output=host_values(value.output))
    return jax.tree_util.tree_map(lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf, value)


def _portable(error: Exception) -> Exception:
    """``error`` with the actor's traceback as a note, or a RuntimeError naming it when it cannot be pickled."""
    ray = _import_ray()
    error.add_note("raised in the Ray replica:\n" + "".join(traceback.format_exception(error)).rstrip())
    try:
        ray.cloudpickle.loads(ray.cloudpickle.dumps(error))
    except Exception:  # an exception that cannot travel still has to say what happened
        return RuntimeError(f"{type(error).__name__}: {error} (in the Ray replica; the exception could not be "
                            "sent back)\n" + "\n".join(error.__notes__))
    return error


class EngineReplica:
    """What a :class:`RayReplica` actor runs: one engine, built in the actor by ``engine_factory()``.

    :meth:`call` runs one engine method and answers a :class:`Reply`: an exception of the
    engine is caught and sent back as the reply's ``error`` (Ray would otherwise wrap it),
    and the session events of the engine's runner go back with the reply of the call that
    caused them.
    """

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        if not callable(engine_factory):
            raise TypeError(f"engine_factory must be callable, got {engine_factory!r}")
        engine = engine_factory()
        self._events: list[SessionEvent] = []
        if not _add_listener(engine, self._events.append):
            close = getattr(engine, "close", None)
            if callable(close):
                close()
            raise TypeError(f"engine_factory must build an ARDiffusionEngine, got {type(engine).__name__} "
                            "(no runner.add_session_listener)")
        self._engine = engine

    def ready(self) -> bool:
        """True once the engine is built (the constructor's error otherwise)."""
        return True

    def read(self, name: str) -> Any:
        """The engine's ``sessions``, ``offloaded_sessions``, ``session_capacity`` or ``memory_plan``."""
        if name not in _ATTRIBUTES:
            raise ValueError(f"an engine replica exposes {', '.join(_ATTRIBUTES)}, not {name!r}")
        return getattr(self._engine, name)

    def call(self, method: str, args: tuple[Any, ...], send_value: bool = True,
             kwargs: dict[str, Any] | None = None) -> Reply:
        """``engine.<method>(*args, **kwargs)``; without ``send_value`` the reply has no value (a follower host's)."""
        if method not in _METHODS:
            raise ValueError(f"an engine replica runs {', '.join(_METHODS)}, not {method!r}")
        try:
            value, error = getattr(self._engine, method)(*args, **(kwargs or {})), None
            value = host_values(value) if send_value else None
        except Exception as raised:
            value, error = None, _portable(raised)
        events = tuple(self._events)
        self._events.clear()  # in place: the engine's listener appends to this very list
        return Reply(value, error, events)


@functools.cache
def ray_replica_class() -> Any:
    """The Ray actor class over :class:`EngineReplica` (made on first use; imports ray)."""
    return _import_ray().remote(EngineReplica)


def __getattr__(name: str) -> Any:
    # ``RayReplica`` is the actor class; building it imports ray, so it is made when first asked for.
    if name == "RayReplica":
        return ray_replica_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RayEngineProxy:
    """An engine in :class:`RayReplica` actors, with the engine's API (each call one ``ray.get``).

    Args:
      actor: a ``RayReplica`` actor handle, or the handles of one replica that spans hosts,
        process 0's first: each host runs the same engine on its share of one multi-host
        mesh, and multi-controller JAX needs every process to run every call, in the same
        order. Every call goes to all of them at once; the answer (value, exception,
        session events) is process 0's, and a host that disagrees with it (one raised, the
        other did not) is a RuntimeError: that replica's hosts have diverged. Attributes
        (``sessions``, ...) are read from process 0.
      owns_actor: kill the actors in :meth:`close` (after closing their engines);
        :func:`ray_replicas` hands out proxies that own their actors.
    """

    def __init__(self, actor: Any, *, owns_actor: bool = False) -> None:
        actors = tuple(actor) if isinstance(actor, (list, tuple)) else (actor,)
        if not actors:
            raise ValueError("RayEngineProxy needs at least one RayReplica actor handle, got none")
        for handle in actors:
            if not callable(getattr(getattr(handle, "call", None), "remote", None)):
                raise TypeError(f"RayEngineProxy needs RayReplica actor handles, got {handle!r}")
        self._actors = actors
        self._owns_actor = bool(owns_actor)
        self._listeners: list[Callable[[SessionEvent], None]] = []
        self._closed = False

    @property
    def actor(self) -> Any:
        """Process 0's actor (the only one of a single-host replica)."""
        return self._actors[0]

    @property
    def actors(self) -> tuple[Any, ...]:
        return self._actors

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ray = _import_ray()
        # Every host's call is submitted before waiting on any: their collectives meet in the middle.
        lead = self._actors[0].call.remote(method, args, True, kwargs)
        follow = [actor.call.remote(method, args, False, kwargs) for actor in self._actors[1:]]
        reply, followers = ray.get(lead), ray.get(follow)
        for event in reply.events:
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:  # as in the runner: a listener must never break the call
                    logger.exception("AR-Diffusion session listener failed on %s", event)
        diverged = [process for process, other in enumerate(followers, 1)
                    if (other.error is None) != (reply.error is None)]
        if diverged:
            errors = {0: reply.error, **{p: followers[p - 1].error for p in diverged}}
            raise RuntimeError(f"the hosts of this replica disagree on {method}: errors by process {errors}; their "
                               "engines may have diverged, close this replica")
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _read(self, name: str) -> Any:
        return _import_ray().get(self._actors[0].read.remote(name))

    @property
    def sessions(self) -> tuple[str, ...]:
        return self._read("sessions")

    @property
    def offloaded_sessions(self) -> tuple[str, ...]:
        return self._read("offloaded_sessions")

    @property
    def session_capacity(self) -> int:
        return self._read("session_capacity")

    @property
    def memory_plan(self) -> Any:
        return self._read("memory_plan")

    def add_session_listener(self, listener: Callable[[SessionEvent], None]) -> None:
        """Call ``listener(SessionEvent)`` for the remote engine's events, before the call that caused them returns."""
        if not callable(listener):
            raise TypeError(f"session listeners must be callable, got {type(listener).__name__}")
        self._listeners.append(listener)

    def generate(self, request: DiffusionRequest) -> Any:
        return self._call("generate", request)

    def step(self, scheduler_output: StepSchedulerOutput) -> StepResult | None:
        return self._call("step", scheduler_output)

    def reset_session(self, session_id: str) -> None:
        self._call("reset_session", check_session_id(session_id))

    def close_session(self, session_id: str) -> None:
        self._call("close_session", check_session_id(session_id))

    def fork_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        """Fork on the actor (the fork's pages are the source's, in the actor's pools)."""
        self._call("fork_session", check_session_id(source_id), check_session_id(new_id), noise_seed=noise_seed)

    def save_session(self, session_id: str, path: str | os.PathLike[str]) -> Path:
        """Save on the actor's host: ``path`` is a path there."""
        return self._call("save_session", check_session_id(session_id), os.fspath(path))

    def load_session(self, path: str | os.PathLike[str], session_id: str | None = None, *,
                     allow_other_weights: bool = False) -> str:
        """Load on the actor's host: ``path`` is a path there."""
        return self._call("load_session", os.fspath(path), session_id, allow_other_weights=allow_other_weights)

    def close(self) -> None:
        """Close the remote engine (and kill the actor when this proxy owns it). Idempotent."""
        if self._closed:
            return
        try:
            self._call("close")
        finally:
            self._closed = True
            if self._owns_actor:
                for actor in self._actors:
                    _import_ray().kill(actor)

    def __enter__(self) -> RayEngineProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def ray_replicas(engine_factory: Callable[[], Any], num_replicas: int, **actor_options: Any) -> list[RayEngineProxy]:
    """Start ``num_replicas`` :class:`RayReplica` actors, each building its engine with ``engine_factory()``.

    ``actor_options`` go to ``RayReplica.options`` (``num_gpus=1``, ``runtime_env=...``,
    ``scheduling_strategy=...``). Waits until every engine is built; if one fails, every
    actor started here is killed and the error raised. Returns proxies that own their actors.
    """
    ray = _import_ray()
    check_positive_int("num_replicas", num_replicas)
    if not callable(engine_factory):
        raise TypeError(f"engine_factory must be callable, got {engine_factory!r}")
    actor_class = ray_replica_class().options(**actor_options)
    actors = [actor_class.remote(engine_factory) for _ in range(num_replicas)]
    try:
        ray.get([actor.ready.remote() for actor in actors])
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return [RayEngineProxy(actor, owns_actor=True) for actor in actors]
