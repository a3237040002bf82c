"""``ARDiffusionRouter``: several engines (one per device group) behind one engine-shaped API.

A session's KV lives in exactly one replica's pools, so every call for a session must
reach that replica. The router keeps a sticky map session id -> replica that follows the
replicas' session events:

* a session id the router has not placed goes to the least loaded replica (load: the
  sessions a replica holds, resident or offloaded, plus those placed there by a call now
  running; ties -> the lowest index), and stays there while the replica holds it;
* a session the replica offloads to its host tier stays placed: its next request is
  restored there;
* a session the replica releases leaves the map, whatever the reason (``SessionEvent``
  ``"released"``: closed, LRU-evicted without a host tier, dropped from a host tier, lost
  with the pools, failed): the replica holds nothing of it any more, so its next request
  starts it anew on the least loaded replica, as a new session there exactly as the
  reference's evicted session would (``docs/reference_behaviour.md``, "Runner"). The one
  exception is a reset (``"reset"``): the pipeline's reset hook may keep model state for
  the id, so the session stays placed, but counts as no load until it is resident again;
* a session a replica makes resident (``"created"``, ``"restored"``) while it is unplaced
  is placed there: a stepwise tick that finishes a request id and schedules it again
  releases it (``"close"``) and starts it anew within one call.

A replica without session events keeps the placements of the sessions it released
(LRU, failures) until they are closed through the router: the router cannot know.

Policy and execution are apart, as in the runner: :class:`ReplicaAssignments` decides
(host only); the router executes. Each replica is called by one router thread at a time
(its lock), so the replica's session events reach the router inside that call, before
the call returns, and no placement can change under a call that is running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_jax._checks import check_int, check_positive_int, check_session_id
from ardiff_jax.runtime._engine import ARDiffusionEngine
from ardiff_jax.runtime._memory import MemoryPlan
from ardiff_jax.runtime._persist import _read_manifest
from ardiff_jax.runtime._batch import ARDiffusionBatchError
from ardiff_jax.runtime._runner import ARDiffusionModelRunner, SessionEvent, check_distinct_sessions
from ardiff_jax.types import DiffusionRequest, EngineConfig, StepResult, StepSchedulerOutput

__all__ = ["PLACED_RELEASE_REASONS", "ARDiffusionRouter", "ReplicaAssignments", "RouterMemoryPlan"]

#: ``SessionEvent("released", reason=...)`` reasons after which a session id stays placed (holding no load).
PLACED_RELEASE_REASONS = frozenset({"reset"})

#: What a replica must offer (methods, then attributes read without calling them here).
_REPLICA_METHODS = ("generate", "step", "reset_session", "close_session", "save_session", "load_session", "close")
_REPLICA_ATTRIBUTES = ("sessions", "offloaded_sessions", "session_capacity", "memory_plan")


class ReplicaAssignments:
    """Which replica owns each placed session id, and each replica's load (host only; decides, never executes).

    A placed session is *active* (it counts towards its replica's load: resident or
    offloaded there, or about to be) or *idle* (reset: placed, holding nothing).

    Args:
      num_replicas: how many replicas there are (``>= 1``).
    """

    def __init__(self, num_replicas: int) -> None:
        self._owner: dict[str, int] = {}
        self._idle: set[str] = set()
        self._loads = [0] * check_positive_int("ReplicaAssignments num_replicas", num_replicas)

    @property
    def loads(self) -> tuple[int, ...]:
        """Active sessions placed on each replica."""
        return tuple(self._loads)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._owner

    def replica_of(self, session_id: str) -> int | None:
        return self._owner.get(session_id)

    def least_loaded(self) -> int:
        """The replica a new session goes to: the smallest load, the lowest index on a tie."""
        return min(range(len(self._loads)), key=self._loads.__getitem__)

    def check_replica(self, index: Any) -> int:
        index = check_int("replica", index)
        if not 0 <= index < len(self._loads):
            raise ValueError(f"replica must be an index in [0, {len(self._loads)}), got {index}")
        return index

    def assign(self, session_id: str, index: int) -> None:
        """Place an unplaced session on replica ``index``, active."""
        if session_id in self._owner:
            raise ValueError(f"AR-Diffusion session {session_id!r} is placed on replica {self._owner[session_id]} "
                             "already")
        index = self.check_replica(index)
        self._owner[session_id] = index
        self._loads[index] += 1

    def unassign(self, session_id: str, index: int) -> bool:
        """Forget ``session_id`` if replica ``index`` owns it; whether it did."""
        if self._owner.get(session_id) != index:
            return False
        del self._owner[session_id]
        if session_id in self._idle:
            self._idle.discard(session_id)
        else:
            self._loads[index] -= 1
        return True

    def set_idle(self, session_id: str, index: int, idle: bool) -> None:
        """Mark a session replica ``index`` owns idle (holding nothing) or active again; others are left alone."""
        if self._owner.get(session_id) != index or (session_id in self._idle) == idle:
            return
        if idle:
            self._idle.add(session_id)
            self._loads[index] -= 1
        else:
            self._idle.discard(session_id)
            self._loads[index] += 1

    def placed_on(self, index: int) -> tuple[str, ...]:
        return tuple(session_id for session_id, owner in self._owner.items() if owner == index)


@dataclasses.dataclass(frozen=True)
class RouterMemoryPlan:
    """The replicas' memory plans, and the totals a serving layer sizes its admission with."""

    replicas: tuple[MemoryPlan, ...]

    @property
    def session_capacity(self) -> int:
        """Resident sessions all replicas hold at once."""
        return sum(plan.session_capacity for plan in self.replicas)

    @property
    def host_offload_bytes(self) -> int:
        return sum(plan.host_offload_bytes for plan in self.replicas)

    @property
    def host_session_capacity(self) -> int:
        """Offloaded sessions all replicas' host tiers hold at once (each tier is bounded on its own)."""
        return sum(plan.host_session_capacity for plan in self.replicas)


class ARDiffusionRouter:
    """Route every request, tick, reset and close of a session to the replica that owns it.

    Args:
      replicas: engines (:class:`~ardiff_jax.runtime.ARDiffusionEngine`, or anything with its
        methods, e.g. :class:`~ardiff_jax.runtime.RayEngineProxy`), each with its own pools.
        The router owns them: :meth:`close` closes every one.

    The engine's API, routed (see the module docstring for the placement rules)::

        router = ARDiffusionRouter.from_devices(make_pipeline, EngineConfig(), jax.devices())
        out = router.generate(DiffusionRequest("r1", extra_args={"session_id": "player-7"}))
        router.close_session("player-7")

    Replicas that offer ``add_session_listener`` (on themselves or their ``runner``) tell the
    router which sessions they hold; without it a released session simply stays placed and
    re-enters on its replica. Calling a replica directly bypasses the router's checks.
    """

    def __init__(self, replicas: Sequence[Any]) -> None:
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
            raise TypeError(f"replicas must be a sequence of engines, got {type(replicas).__name__}")
        replicas = tuple(replicas)
        if not replicas:
            raise ValueError("ARDiffusionRouter needs at least one replica, got none")
        for index, replica in enumerate(replicas):
            missing = [name for name in _REPLICA_METHODS if not callable(getattr(replica, name, None))]
            missing += [name for name in _REPLICA_ATTRIBUTES if name not in dir(replica)]
            if missing:
                raise TypeError(f"replica {index} ({type(replica).__name__}) is not engine-like: it has no "
                                f"{', '.join(missing)}")
        if len({id(replica) for replica in replicas}) != len(replicas):
            raise ValueError("ARDiffusionRouter replicas must be distinct engines; one appears twice")
        self._replicas = replicas
        self._assignments = ReplicaAssignments(len(replicas))
        self._lock = threading.Lock()  # guards the assignments; never held while a replica runs
        # Reentrant: a session listener may call back into the router on the replica it listens to.
        self._replica_locks = tuple(threading.RLock() for _ in replicas)
        self._closed = False
        self._listening = tuple(_add_listener(replica, self._listener(index)) for index, replica in enumerate(replicas))

    @classmethod
    def from_devices(cls, pipeline_factory: Callable[[Any], Any], config: EngineConfig | None,
                     devices_or_meshes: Sequence[Any]) -> ARDiffusionRouter:
        """One :class:`~ardiff_jax.runtime.ARDiffusionEngine` per device (or per ``jax.sharding.Mesh``).

        ``pipeline_factory(device_or_mesh)`` builds each replica's pipeline (one pipeline
        instance per engine; share weights between them through the pipeline's own means).
        A plain device becomes a one-device mesh, so the replica's pools, weights and
        inputs live on that device (``EngineConfig(mesh=...)``; the pipeline must implement
        :class:`~ardiff_jax.capability.SupportsARDiffusionMesh`, as the reference pipelines
        do); a mesh becomes the replica's ``EngineConfig(mesh=...)`` as given. If a replica fails to build, the ones
        built already are closed and the error is raised.
        """
        import jax  # local: the router itself needs no backend

        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if not callable(pipeline_factory):
            raise TypeError(f"pipeline_factory must be callable, got {pipeline_factory!r}")
        items = tuple(devices_or_meshes)
        if not items:
            raise ValueError("from_devices needs at least one device or mesh, got none")
        configs = []
        for item in items:
            if isinstance(item, jax.sharding.Mesh):
                configs.append(dataclasses.replace(config, mesh=item))
            elif isinstance(item, jax.Device):
                one_device = jax.sharding.Mesh(np.array([item]).reshape(1, 1), ("cfg", "tp"))
                configs.append(dataclasses.replace(config, mesh=one_device))
            else:
                raise TypeError(f"from_devices takes jax devices or jax.sharding.Mesh objects, got {item!r}")
        engines: list[ARDiffusionEngine] = []
        try:
            for item, replica_config in zip(items, configs):
                engines.append(ARDiffusionEngine(pipeline_factory(item), replica_config))
            return cls(engines)
        except BaseException:
            for engine in engines:
                engine.close()
            raise

    # -- views ------------------------------------------------------------------------------------------
    @property
    def replicas(self) -> tuple[Any, ...]:
        return self._replicas

    @property
    def replica_loads(self) -> tuple[int, ...]:
        """Sessions each replica holds, resident or offloaded (plus any a running call placed there)."""
        with self._lock:
            return self._assignments.loads

    def replica_of(self, session_id: str) -> int | None:
        """The replica that owns ``session_id``, or ``None`` when the router has not placed it."""
        check_session_id(session_id)
        with self._lock:
            return self._assignments.replica_of(session_id)

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident session ids: replica 0's (least recently used first), then replica 1's, ..."""
        return tuple(session_id for replica in self._replicas for session_id in replica.sessions)

    @property
    def offloaded_sessions(self) -> tuple[str, ...]:
        """Session ids held in the replicas' host tiers, replica by replica."""
        return tuple(session_id for replica in self._replicas for session_id in replica.offloaded_sessions)

    @property
    def session_capacity(self) -> int:
        """Resident sessions all replicas hold at once (the sum of theirs)."""
        return sum(replica.session_capacity for replica in self._replicas)

    @property
    def memory_plan(self) -> RouterMemoryPlan:
        return RouterMemoryPlan(tuple(replica.memory_plan for replica in self._replicas))

    @property
    def runner(self) -> ARDiffusionRouter:
        """The router itself: serving code that subscribes through ``engine.runner.add_session_listener`` works."""
        return self

    @property
    def closed(self) -> bool:
        return self._closed

    def add_session_listener(self, listener: Callable[[SessionEvent], None]) -> None:
        """Call ``listener(SessionEvent)`` on every replica's session events (TypeError where a replica has none)."""
        if not callable(listener):
            raise TypeError(f"session listeners must be callable, got {type(listener).__name__}")
        silent = [index for index, listening in enumerate(self._listening) if not listening]
        if silent:
            raise TypeError(f"replicas {silent} do not report session events (no add_session_listener)")
        for replica in self._replicas:
            _add_listener(replica, listener)

    # -- requests -----------------------------------------------------------------------------------------
    def generate(self, request: DiffusionRequest) -> Any:
        """Run one request on the replica that owns its session (placing a new session first)."""
        if not isinstance(request, DiffusionRequest):
            raise TypeError(f"execute_model expects a DiffusionRequest, got {type(request).__name__}")
        # The runner's own rule: a typed tick is authoritative, a missing id means "default".
        session_id, _, close_after, _ = ARDiffusionModelRunner._request_session(request)
        with self._owning(session_id, place=True) as index:
            output = self._replicas[index].generate(request)
            if close_after:
                self._forget(index, (session_id,))
        return output

    def generate_batch(self, requests: Sequence[DiffusionRequest]) -> list[Any]:
        """The next request of several distinct sessions: each replica's share is one ``generate_batch`` there.

        Sessions are placed as :meth:`generate` places them (a new one on the least loaded
        replica, counting the batch's own new sessions, so a batch of new players spreads).
        A share larger than its replica's ``session_capacity`` runs as several batches there.
        Shares on different replicas run concurrently, one thread per replica, each under its
        replica's lock (so a multi-device router keeps every device busy).

        Refused before anything runs anywhere (TypeError / ValueError): a request that is
        not a :class:`~ardiff_jax.DiffusionRequest`, a session id appearing twice, or a share
        its replica refuses (``validate_batch``, where the replica offers it). Outputs come in
        request order. Failures are as :meth:`ARDiffusionEngine.generate_batch`'s: a failed
        request releases its own session, the others complete, and
        :class:`~ardiff_jax.runtime.ARDiffusionBatchError` carries every output and the
        errors. A replica without ``generate_batch`` runs its share one request at a time.
        """
        requests = ARDiffusionModelRunner._checked_batch_types(requests)  # the engine's own type checks
        parsed = [ARDiffusionModelRunner._request_session(request) for request in requests]
        session_ids = [entry[0] for entry in parsed]
        check_distinct_sessions(session_ids)
        if not requests:
            return []
        shares, placed_here = self._place_batch(session_ids)
        try:
            for index, positions in shares.items():
                validate = getattr(self._replicas[index], "validate_batch", None)
                if callable(validate):
                    capacity = max(1, int(self._replicas[index].session_capacity))
                    for part in _chunks(positions, capacity):
                        validate([requests[i] for i in part])
        except BaseException:
            self._forget_unheld(placed_here)
            raise
        outputs: list[Any] = [None] * len(requests)
        errors: dict[str, BaseException] = {}

        def run_share(index: int, positions: list[int]) -> None:
            replica = self._replicas[index]
            done: set[int] = set()
            try:
                with self._replica_locks[index]:
                    for part in _chunks(positions, max(1, int(replica.session_capacity))):
                        results, failed = _run_on(replica, [requests[i] for i in part])
                        for position, result in zip(part, results, strict=True):
                            outputs[position] = result
                            done.add(position)
                        for position in part:
                            session_id = session_ids[position]
                            if session_id in failed:
                                errors[session_id] = failed[session_id]
                            elif parsed[position][2]:  # close_session after success: gone from the replica
                                self._forget(index, (session_id,))
            except Exception as error:  # the share could not go on (e.g. its replica closed): the rest of it failed
                for position in positions:
                    if position not in done:
                        errors[session_ids[position]] = error

        if len(shares) == 1:
            ((index, positions),) = shares.items()
            run_share(index, positions)
        else:
            threads = [threading.Thread(target=run_share, args=(index, positions), name=f"ardiff-router-{index}")
                       for index, positions in shares.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        self._forget_unheld(placed_here & set(errors))
        if errors:
            raise ARDiffusionBatchError(outputs, errors) from next(iter(errors.values()))
        return outputs

    def _place_batch(self, session_ids: list[str]) -> tuple[dict[int, list[int]], set[str]]:
        """``({replica: [positions]}, new placements)``: every session placed, new ones on the least loaded."""
        shares: dict[int, list[int]] = {}
        placed_here: set[str] = set()
        with self._lock:
            self._check_open()
            for position, session_id in enumerate(session_ids):
                index = self._assignments.replica_of(session_id)
                if index is None:
                    index = self._assignments.least_loaded()
                    self._assignments.assign(session_id, index)
                    placed_here.add(session_id)
                shares.setdefault(index, []).append(position)
        return shares, placed_here

    def _forget_unheld(self, session_ids: Iterable[str]) -> None:
        """Undo placements this call made for sessions no replica holds (refused or failed: nothing was kept)."""
        for session_id in session_ids:
            with self._lock:
                index = self._assignments.replica_of(session_id)
            if index is not None and not self._holds(index, session_id):
                self._forget(index, (session_id,))

    def step(self, scheduler_output: StepSchedulerOutput) -> StepResult | None:
        """One stepwise tick, split by owner.

        The scheduled request (at most one; its session id is its request id) runs on its
        replica together with the ``finished_req_ids`` that replica owns; then every other
        replica owning finished ids gets a tick with only those. The result is the scheduled
        request's (``None`` when nothing was scheduled). If the scheduled request raises, the
        other replicas' finished ids are not released by this call: name them again in the
        next tick. Finished ids the router never placed are ignored (nothing holds them).
        """
        if not isinstance(scheduler_output, StepSchedulerOutput):
            raise TypeError(
                f"execute_stepwise expects a StepSchedulerOutput, got {type(scheduler_output).__name__}")
        if len(scheduler_output.scheduled) > 1:
            raise RuntimeError("ARDiffusionModelRunner stepwise execution supports one request at a time, got "
                               f"{len(scheduler_output.scheduled)}")
        with self._lock:
            self._check_open()
        finished = scheduler_output.finished_req_ids
        result: StepResult | None = None
        ran_on: int | None = None
        if scheduler_output.scheduled:
            request = scheduler_output.scheduled[0]
            session_id = request.request_id
            with self._owning(session_id, place=True) as index:
                own = self._placed_among(finished, index)
                result = self._replicas[index].step(StepSchedulerOutput(scheduled=(request,), finished_req_ids=own))
                # A scheduled id that is also finished was released and then started again: it stays.
                gone = own - {session_id}
                if result is not None and (result.finished or result.error):
                    gone |= {session_id}
                self._forget(index, gone)
                ran_on = index
        for index, replica in enumerate(self._replicas):
            if index == ran_on:
                continue
            with self._replica_locks[index]:
                own = self._placed_among(finished, index)
                if own:
                    replica.step(StepSchedulerOutput(finished_req_ids=own))
                    self._forget(index, own)
        return result

    def reset_session(self, session_id: str) -> None:
        """Reset the session on its replica (it stays placed there); nothing for an id the router never placed."""
        check_session_id(session_id)
        with self._owning(session_id, place=False) as index:
            if index is not None:
                self._replicas[index].reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        """Close the session on its replica and forget its placement; nothing for an id the router never placed.

        A close whose pipeline hook raises still released the session there (an engine drops
        the KV before the hook): the placement is forgotten unless the replica still holds the
        session, and the error is raised. So a replica's load never counts a session it let go,
        with or without session events.
        """
        check_session_id(session_id)
        with self._owning(session_id, place=False) as index:
            if index is not None:
                try:
                    self._replicas[index].close_session(session_id)
                except BaseException:
                    with contextlib.suppress(Exception):  # a replica that cannot answer keeps the placement
                        if not self._holds(index, session_id):
                            self._forget(index, (session_id,))
                    raise
                self._forget(index, (session_id,))

    def fork_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        """Fork ``source_id`` on its own replica (the fork shares its pages there) and place ``new_id`` with it.

        Refused like the replica's fork, and for a source the router never placed or a
        ``new_id`` it has placed already; a refused fork leaves no placement behind.
        """
        check_session_id(source_id)
        check_session_id(new_id, "fork session id")
        with self._owning(source_id, place=False) as index:
            if index is None:
                raise KeyError(f"AR-Diffusion session {source_id!r} is neither resident nor offloaded")
            with self._lock:
                if new_id in self._assignments:
                    raise ValueError(f"AR-Diffusion session id {new_id!r} is taken; a fork needs a new id")
                self._assignments.assign(new_id, index)
            try:
                self._replicas[index].fork_session(source_id, new_id, noise_seed=noise_seed)
            except BaseException:
                with contextlib.suppress(Exception):
                    if not self._holds(index, new_id):
                        self._forget(index, (new_id,))
                raise

    def offload_session(self, session_id: str) -> None:
        """Move the session to its replica's host tier (it stays placed there); refused like the replica's.

        A session the router never placed is a ``KeyError``; a replica without
        ``offload_session`` a ``TypeError``.
        """
        check_session_id(session_id)
        with self._owning(session_id, place=False) as index:
            if index is None:
                raise KeyError(f"AR-Diffusion session {session_id!r} is not resident")
            offload = getattr(self._replicas[index], "offload_session", None)
            if not callable(offload):
                raise TypeError(f"replica {index} ({type(self._replicas[index]).__name__}) cannot offload a "
                                "session: it has no offload_session")
            offload(session_id)

    def save_session(self, session_id: str, path: str | os.PathLike[str]) -> Path:
        """Write the session (resident or offloaded on its replica) to ``path``; it keeps running there."""
        check_session_id(session_id)
        with self._owning(session_id, place=False) as index:
            if index is None:
                raise KeyError(f"AR-Diffusion session {session_id!r} is neither resident nor offloaded")
            return self._replicas[index].save_session(session_id, path)

    def load_session(self, path: str | os.PathLike[str], session_id: str | None = None, *,
                     replica: int | None = None, allow_other_weights: bool = False) -> str:
        """Make a saved session resident (as ``session_id``, default its saved id) and place it; returns the id.

        A new id goes to ``replica`` when given, else to the least loaded one. An id the
        router has placed already loads on its own replica (which refuses it while the
        session is resident or offloaded there); naming another ``replica`` for it is a
        ValueError. The saved id is read from the file's manifest here, so the file must be
        readable where the router runs. ``allow_other_weights`` reaches the replica's
        ``load_session``.
        """
        if replica is not None:
            with self._lock:
                replica = self._assignments.check_replica(replica)
        if session_id is None:
            session_id = check_session_id(_read_manifest(Path(path))["session_id"], "saved session id")
        else:
            check_session_id(session_id)
        with self._owning(session_id, place=True, replica=replica) as index:
            return self._replicas[index].load_session(path, session_id, allow_other_weights=allow_other_weights)

    # -- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every replica (their sessions get close hooks) and forget every placement. Idempotent.

        Every replica is closed even when one fails; the first error is raised afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors: list[BaseException] = []
        for index, replica in enumerate(self._replicas):
            with self._replica_locks[index]:
                try:
                    replica.close()
                except Exception as error:
                    errors.append(error)
                with self._lock:
                    for session_id in self._assignments.placed_on(index):
                        self._assignments.unassign(session_id, index)
        if errors:
            raise errors[0]

    def __enter__(self) -> ARDiffusionRouter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ARDiffusionRouter is closed")

    @contextlib.contextmanager
    def _owning(self, session_id: str, *, place: bool, replica: int | None = None) -> Iterator[Any]:
        """Hold the lock of the session's replica and yield its index (``None``: unplaced and not ``place``).

        An unplaced session is placed first (on ``replica``, else the least loaded one) when
        ``place``. The placement is checked again once the replica's lock is held: a close on
        another thread may have removed it meanwhile, and then the session is placed anew. A
        call that placed the session and raised has its placement undone unless the replica
        holds the session after all (a load whose evicted neighbour's hook failed afterwards):
        a refused request created nothing, a failed one was released.
        """
        while True:
            with self._lock:
                self._check_open()
                index = self._assignments.replica_of(session_id)
                if replica is not None and index is not None and index != replica:
                    raise ValueError(f"AR-Diffusion session {session_id!r} is placed on replica {index}, not "
                                     f"{replica}; close it first or use another session_id")
                placed_here = index is None and place
                if placed_here:
                    index = self._assignments.least_loaded() if replica is None else replica
                    self._assignments.assign(session_id, index)
            if index is None:
                yield None
                return
            with self._replica_locks[index]:
                with self._lock:
                    current = None if self._closed else self._assignments.replica_of(session_id)
                if current != index:
                    continue  # closed meanwhile: look again (a closed router raises there)
                try:
                    yield index
                except BaseException:
                    if placed_here and not self._holds(index, session_id):
                        self._forget(index, (session_id,))
                    raise
                return

    def _holds(self, index: int, session_id: str) -> bool:
        """Whether replica ``index`` holds ``session_id``, resident or offloaded (asks the replica)."""
        replica = self._replicas[index]
        return session_id in replica.sessions or session_id in replica.offloaded_sessions

    def _placed_among(self, session_ids: frozenset[str], index: int) -> frozenset[str]:
        with self._lock:
            return frozenset(s for s in session_ids if self._assignments.replica_of(s) == index)

    def _forget(self, index: int, session_ids: Iterable[str]) -> None:
        """Drop the placements of ``session_ids`` on replica ``index`` (gone for good); others are left alone."""
        with self._lock:
            for session_id in session_ids:
                self._assignments.unassign(session_id, index)

    def _listener(self, index: int) -> Callable[[SessionEvent], None]:
        def on_event(event: SessionEvent) -> None:
            session_id = event.session_id
            with self._lock:
                if event.kind == "released":
                    if event.reason in PLACED_RELEASE_REASONS:
                        self._assignments.set_idle(session_id, index, True)
                    else:  # the replica holds nothing of it any more
                        self._assignments.unassign(session_id, index)
                elif session_id not in self._assignments:
                    # Held here means owned here: a session released and started again within one call
                    # (a stepwise tick that schedules a finished id) is placed again where it now lives.
                    self._assignments.assign(session_id, index)
                else:  # created, restored or offloaded: it holds KV on its replica again
                    self._assignments.set_idle(session_id, index, False)

        return on_event


def _chunks(positions: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(positions), size):
        yield positions[start:start + size]


def _run_on(replica: Any, requests: list[DiffusionRequest]) -> tuple[list[Any], dict[str, BaseException]]:
    """``(outputs, errors by session)`` of ``requests`` on one replica: one ``generate_batch``, else one by one."""
    generate_batch = getattr(replica, "generate_batch", None)
    if callable(generate_batch):
        try:
            return list(generate_batch(requests)), {}
        except ARDiffusionBatchError as error:
            return list(error.outputs), dict(error.errors)
        except Exception as error:  # refused after validation (the replica changed meanwhile): nothing ran
            return [None] * len(requests), {ARDiffusionModelRunner._request_session(r)[0]: error for r in requests}
    outputs: list[Any] = []
    errors: dict[str, BaseException] = {}
    for request in requests:
        try:
            outputs.append(replica.generate(request))
        except Exception as error:
            outputs.append(None)
            errors[ARDiffusionModelRunner._request_session(request)[0]] = error
    return outputs, errors


def _add_listener(replica: Any, listener: Callable[[SessionEvent], None]) -> bool:
    """Subscribe ``listener`` to the replica's session events (engine: its runner's); whether it could."""
    add = getattr(replica, "add_session_listener", None)
    if not callable(add):
        add = getattr(getattr(replica, "runner", None), "add_session_listener", None)
    if not callable(add):
        return False
    add(listener)
    return True
