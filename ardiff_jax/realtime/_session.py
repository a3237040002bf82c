"""The per-session control plane: events in, one typed tick per chunk out, commit only on success.

A session owns transport-level identity, event ordering, backpressure and the chunk-boundary
snapshot; what a control *means* stays with the model (and an optional reducer). The order
of every step follows the reference runtime (``docs/reference_behaviour.md``, "Ticks").

Concurrency model: everything runs on one asyncio event loop. State changes happen only
between ``await`` points, so each of them is atomic without a lock; the one lock serialises
``next_chunk`` / ``reset`` / ``close``, whose work spans awaits (the tick, the lifecycle call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import types
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ardiff_jax._checks import check_non_negative_int, check_positive_int, check_session_id
from ardiff_jax.types import ARDiffusionChunkMetadata, ARDiffusionControlInput, ARDiffusionTickRequest

__all__ = [
    "ARDiffusionChunkMetadataError",
    "ARDiffusionControlReducer",
    "ARDiffusionEventAcceptance",
    "ARDiffusionEventAcceptanceStatus",
    "ARDiffusionEventQueueFullError",
    "ARDiffusionPreparedControls",
    "ARDiffusionSession",
    "ARDiffusionSessionError",
    "ARDiffusionSessionEvent",
    "ARDiffusionSessionLifecycle",
    "ARDiffusionSessionManager",
    "ARDiffusionSessionStateError",
    "ARDiffusionSessionStatus",
    "ARDiffusionStaleEventError",
    "ARDiffusionTickConsumer",
]


# -- errors and statuses -----------------------------------------------------------------------------


class ARDiffusionSessionError(RuntimeError):
    """Base error of the realtime control plane (also raised when a failed tick's cleanup fails too)."""


class ARDiffusionSessionStateError(ARDiffusionSessionError):
    """The operation is not allowed in the session's current status (or the id is unknown / taken)."""


class ARDiffusionEventQueueFullError(ARDiffusionSessionError):
    """Accepting the event would exceed ``max_pending_events``; the client should retry later."""


class ARDiffusionStaleEventError(ARDiffusionSessionError):
    """The event id is at or below the event floor: a newer chunk already decided without it."""


class ARDiffusionChunkMetadataError(ARDiffusionSessionError):
    """The consumer reported metadata for another chunk than the tick it was given."""


class ARDiffusionSessionStatus(str, enum.Enum):
    """Lifecycle of one session. Values are lowercase so messages read ``"... is failed"``."""

    ACTIVE = "active"
    RESETTING = "resetting"
    FAILED = "failed"
    CLOSING = "closing"
    CLEANUP_FAILED = "cleanup_failed"
    CLOSED = "closed"


class ARDiffusionEventAcceptanceStatus(str, enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"


# -- values ------------------------------------------------------------------------------------------


def _checked_controls(owner: str, controls: Any) -> tuple[ARDiffusionControlInput, ...]:
    """A tuple of controls that updates each track at most once."""
    if isinstance(controls, (str, bytes, Mapping)) or not isinstance(controls, Sequence):
        raise ValueError(f"{owner} controls must be a sequence of ARDiffusionControlInput, got {controls!r}")
    controls = tuple(controls)
    seen: set[str] = set()
    for control in controls:
        if not isinstance(control, ARDiffusionControlInput):
            raise ValueError(f"{owner} controls must be ARDiffusionControlInput, got {control!r}")
        if control.track in seen:
            raise ValueError(f"{owner} updates control track {control.track!r} more than once; "
                             "each track may be updated at most once")
        seen.add(control.track)
    return controls


@dataclasses.dataclass(frozen=True)
class ARDiffusionSessionEvent:
    """One atomic prompt and/or control update from a client.

    ``prompt=None`` leaves the prompt as it is; each control replaces its ``track`` from the
    chunk that applies the event on. Schema and data are opaque to the session.
    """

    event_id: int
    prompt: str | None = None
    controls: tuple[ARDiffusionControlInput, ...] = ()

    def __post_init__(self) -> None:
        event_id = check_non_negative_int("ARDiffusionSessionEvent event_id", self.event_id)
        object.__setattr__(self, "event_id", event_id)
        owner = f"ARDiffusionSessionEvent {event_id}"
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"{owner} prompt must be a string or None, got {self.prompt!r}")
        object.__setattr__(self, "controls", _checked_controls(owner, self.controls))
        if self.prompt is None and not self.controls:
            raise ValueError(f"{owner} changes nothing: give a prompt, controls, or both")


@dataclasses.dataclass(frozen=True)
class ARDiffusionEventAcceptance:
    """What ``accept_event`` decided. ACCEPTED means queued, not applied: a later chunk applies it."""

    status: ARDiffusionEventAcceptanceStatus
    event_id: int
    pending_count: int


@dataclasses.dataclass(frozen=True)
class ARDiffusionPreparedControls:
    """A reducer's controls for one chunk (at most one per track) and its opaque state for that chunk.

    ``private_state`` is the reducer's own; the session hands this object back to
    ``commit`` only after the chunk succeeded, so the state becomes durable with the chunk.
    """

    controls: tuple[ARDiffusionControlInput, ...] = ()
    private_state: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "controls", _checked_controls("ARDiffusionPreparedControls", self.controls))


# -- protocols ---------------------------------------------------------------------------------------

TickOutputT = TypeVar("TickOutputT")


@runtime_checkable
class ARDiffusionTickConsumer(Protocol[TickOutputT]):
    """Runs one tick (one AR block) and reports which chunk its output belongs to."""

    async def execute_tick(self, tick: ARDiffusionTickRequest) -> TickOutputT: ...

    def chunk_metadata(self, output: TickOutputT) -> ARDiffusionChunkMetadata: ...


@runtime_checkable
class ARDiffusionSessionLifecycle(Protocol):
    """Releases a session's model-side state: ``reset_session`` (start over) or ``close_session`` (gone)."""

    async def reset_session(self, session_id: str) -> None: ...

    async def close_session(self, session_id: str) -> None: ...


@runtime_checkable
class ARDiffusionControlReducer(Protocol):
    """Optional model adapter for stateful controls (e.g. held keys integrated over frames).

    The reference's call shape, keyword-only, so a reducer written for it runs unchanged:
    ``prepare(*, current_controls, events, chunk_index)`` receives the committed controls (a
    fresh dict track -> control per call: changing it changes nothing in the session), the
    chunk's pending events sorted by id (a tuple) and the index of the chunk being prepared,
    and returns the chunk's controls without changing anything durable. ``commit(prepared)``
    makes that chunk's state durable; it runs only after the tick succeeded and may fail (the
    session then fails). ``reset()`` forgets everything.
    """

    def prepare(self, *, current_controls: dict[str, ARDiffusionControlInput],
                events: tuple[ARDiffusionSessionEvent, ...], chunk_index: int) -> ARDiffusionPreparedControls: ...

    def commit(self, prepared: ARDiffusionPreparedControls) -> None: ...

    def reset(self) -> None: ...


# -- the session -------------------------------------------------------------------------------------


def _transport_copy(value: Any, where: str) -> Any:
    """A deep, plain copy of a transport-safe value; ValueError naming the first value that is not."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        copied = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: mapping key {key!r} is not transport-safe (keys must be strings)")
            copied[key] = _transport_copy(item, f"{where}.{key}")
        return copied
    if isinstance(value, (list, tuple)):
        return [_transport_copy(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where}: {type(value).__name__} value {value!r} is not transport-safe "
                     "(only str, bool, int, float, None, str-keyed mappings, lists and tuples)")


def _stored_event(event: ARDiffusionSessionEvent) -> ARDiffusionSessionEvent:
    """The session's own copy: later changes to anything the caller holds cannot reach a queued event."""
    controls = tuple(
        ARDiffusionControlInput(control.track, control.schema,
                                _transport_copy(control.data, f"event {event.event_id} control {control.track!r}"))
        for control in event.controls)
    return ARDiffusionSessionEvent(event.event_id, event.prompt, controls)


def _check_collaborators(tick_consumer: Any, lifecycle: Any, request_id_factory: Any) -> None:
    if not isinstance(tick_consumer, ARDiffusionTickConsumer):
        raise TypeError(f"tick_consumer must implement execute_tick and chunk_metadata, got {tick_consumer!r}")
    if not isinstance(lifecycle, ARDiffusionSessionLifecycle):
        raise TypeError(f"lifecycle must implement reset_session and close_session, got {lifecycle!r}")
    if request_id_factory is not None and not callable(request_id_factory):
        raise TypeError(f"request_id_factory must be callable, got {request_id_factory!r}")


def _default_request_id(session_id: str, chunk_index: int) -> str:
    """``"ar-{session}-{chunk}-{uuid hex}"``: unique per tick, readable in logs."""
    return f"ar-{session_id}-{chunk_index}-{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """What one in-flight chunk will commit if its tick succeeds."""

    tick: ARDiffusionTickRequest
    controls: Mapping[str, ARDiffusionControlInput]
    prepared: ARDiffusionPreparedControls | None


class ARDiffusionSession(Generic[TickOutputT]):
    """Transactional event queue and chunk snapshots for one realtime session.

    Clients ``accept_event`` at any time; each ``next_chunk`` applies every pending event (in
    id order) to one tick, runs it on ``tick_consumer`` and commits only when the consumer
    succeeded and reported exactly this tick's metadata. Event ids are monotonic per session:
    an id at or below the *event floor* (the last applied id, or the highest id of the chunk
    in flight) is stale; the last ``max_pending_events`` accepted ids are remembered so that a
    client's retry is answered DUPLICATE instead of an error.

    A failed chunk leaves the session FAILED (its events stay queued, its chunk index
    unchanged) and closes the model-side session through ``lifecycle``; only :meth:`reset`
    (or :meth:`close`) moves on from there.

    ``request_id_factory(session_id, chunk_index) -> str`` names each tick (default
    ``"ar-{session}-{chunk}-{uuid hex}"``); ``control_reducer`` replaces the default
    "each event's control replaces its track" rule.
    """

    def __init__(self, session_id: str, *, tick_consumer: ARDiffusionTickConsumer[TickOutputT],
                 lifecycle: ARDiffusionSessionLifecycle, max_pending_events: int,
                 request_id_factory: Callable[[str, int], str] | None = None,
                 control_reducer: ARDiffusionControlReducer | None = None) -> None:
        self._session_id = check_session_id(session_id)
        self._max_pending = check_positive_int("max_pending_events", max_pending_events)
        _check_collaborators(tick_consumer, lifecycle, request_id_factory)
        if control_reducer is not None and not isinstance(control_reducer, ARDiffusionControlReducer):
            raise TypeError(f"control_reducer must implement prepare, commit and reset, got {control_reducer!r}")
        self._consumer = tick_consumer
        self._lifecycle = lifecycle
        self._request_id = request_id_factory or _default_request_id
        self._reducer = control_reducer

        self._status = ARDiffusionSessionStatus.ACTIVE
        self._pending: dict[int, ARDiffusionSessionEvent] = {}
        # Bounded like the queue: a retry arrives soon after the original, and an id that has
        # fallen out of this memory is at or below the floor anyway (stale, not silently re-applied).
        self._recent_ids: OrderedDict[int, None] = OrderedDict()
        self._floor: int | None = None
        self._in_flight_floor: int | None = None
        self._chunk_index = 0
        self._prompt: str | None = None
        self._controls: dict[str, ARDiffusionControlInput] = {}
        self._lock = asyncio.Lock()

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def status(self) -> ARDiffusionSessionStatus:
        return self._status

    @property
    def chunk_index(self) -> int:
        """Index of the next chunk (the number of chunks committed since creation or the last reset)."""
        return self._chunk_index

    @property
    def pending_event_count(self) -> int:
        return len(self._pending)

    def _require(self, *allowed: ARDiffusionSessionStatus) -> None:
        if self._status not in allowed:
            raise ARDiffusionSessionStateError(f"AR-Diffusion session {self._session_id!r} is {self._status.value}")

    def _event_floor(self) -> int | None:
        floors = [floor for floor in (self._floor, self._in_flight_floor) if floor is not None]
        return max(floors) if floors else None

    # -- events ----------------------------------------------------------------------------------

    async def accept_event(self, event: ARDiffusionSessionEvent) -> ARDiffusionEventAcceptance:
        """Queue ``event`` for the next chunk, or answer DUPLICATE for an id already seen.

        Raises StateError unless ACTIVE, StaleEventError for an id at or below the event floor,
        QueueFullError at ``max_pending_events``, ValueError for a control payload that is not
        transport-safe. A duplicate's payload is ignored: the first copy wins.
        """
        if not isinstance(event, ARDiffusionSessionEvent):
            raise TypeError(f"accept_event expects an ARDiffusionSessionEvent, got {event!r}")
        self._require(ARDiffusionSessionStatus.ACTIVE)
        event_id = event.event_id
        if event_id in self._pending or event_id in self._recent_ids:
            return ARDiffusionEventAcceptance(ARDiffusionEventAcceptanceStatus.DUPLICATE, event_id, len(self._pending))
        floor = self._event_floor()
        if floor is not None and event_id <= floor:
            raise ARDiffusionStaleEventError(
                f"AR-Diffusion session {self._session_id!r} rejected event {event_id}: the event floor is {floor}")
        if len(self._pending) >= self._max_pending:
            raise ARDiffusionEventQueueFullError(
                f"AR-Diffusion session {self._session_id!r} event queue is full ({self._max_pending} pending); "
                f"event {event_id} was not accepted")
        stored = _stored_event(event)
        self._pending[event_id] = stored
        self._recent_ids[event_id] = None
        while len(self._recent_ids) > self._max_pending:
            self._recent_ids.popitem(last=False)
        return ARDiffusionEventAcceptance(ARDiffusionEventAcceptanceStatus.ACCEPTED, event_id, len(self._pending))

    # -- chunks ----------------------------------------------------------------------------------

    def _snapshot(self) -> _Snapshot:
        """The next chunk's tick from the committed state and the pending events; changes nothing."""
        events = tuple(self._pending[event_id] for event_id in sorted(self._pending))
        prompt = self._prompt
        for event in events:
            if event.prompt is not None:
                prompt = event.prompt
        prepared = None
        if self._reducer is None:
            controls = dict(self._controls)
            for event in events:
                controls.update((control.track, control) for control in event.controls)
        else:
            prepared = self._reducer.prepare(current_controls=dict(self._controls), events=events,
                                             chunk_index=self._chunk_index)
            if not isinstance(prepared, ARDiffusionPreparedControls):
                raise TypeError(f"control reducer prepare() must return ARDiffusionPreparedControls, got {prepared!r}")
            controls = {control.track: control for control in prepared.controls}
        tick = ARDiffusionTickRequest(
            session_id=self._session_id,
            request_id=self._request_id(self._session_id, self._chunk_index),
            chunk_index=self._chunk_index,
            applied_event_ids=tuple(event.event_id for event in events),
            prompt=prompt,
            controls=tuple(controls[track] for track in sorted(controls)),
        )
        return _Snapshot(tick, types.MappingProxyType(controls), prepared)

    def _commit(self, snapshot: _Snapshot) -> None:
        # The reducer's commit is the only fallible step, so it runs before anything else changes.
        if snapshot.prepared is not None:
            assert self._reducer is not None
            self._reducer.commit(snapshot.prepared)
        tick = snapshot.tick
        for event_id in tick.applied_event_ids:
            del self._pending[event_id]
        if tick.applied_event_ids:
            self._floor = tick.applied_event_ids[-1]
        self._prompt = tick.prompt
        self._controls = dict(snapshot.controls)
        self._chunk_index += 1
        self._in_flight_floor = None

    async def _fail(self, tick_error: BaseException) -> None:
        """FAILED, then close the model-side session: a failed forward may have left it half-advanced."""
        self._in_flight_floor = None
        self._status = ARDiffusionSessionStatus.FAILED
        try:
            await self._lifecycle.close_session(self._session_id)
        except Exception as cleanup_error:
            raise ARDiffusionSessionError(
                f"AR-Diffusion session {self._session_id!r} chunk failed ({type(tick_error).__name__}: {tick_error}) "
                f"and closing it also failed ({type(cleanup_error).__name__}: {cleanup_error})") from tick_error

    async def next_chunk(self) -> TickOutputT:
        """Run the next chunk with every pending event applied; returns the consumer's output.

        Serialised: concurrent calls run one after another. The commit (events dropped, floor
        raised, prompt/controls stored, chunk index advanced) follows the consumer's success
        with no ``await`` in between, so a cancellation can interrupt the tick (which then
        fails the session) but never a commit half-way. A reducer's ``prepare`` that raises
        changes nothing; a consumer, metadata or reducer-``commit`` failure fails the session.
        """
        async with self._lock:
            self._require(ARDiffusionSessionStatus.ACTIVE)
            snapshot = self._snapshot()
            tick = snapshot.tick
            self._in_flight_floor = tick.applied_event_ids[-1] if tick.applied_event_ids else None
            try:
                output = await self._consumer.execute_tick(tick)
                metadata = self._consumer.chunk_metadata(output)
                expected = ARDiffusionChunkMetadata.from_tick(tick)
                if metadata != expected:
                    raise ARDiffusionChunkMetadataError(
                        f"AR-Diffusion session {self._session_id!r}: the tick consumer's reported chunk metadata "
                        f"{metadata!r} does not match the tick's expected metadata {expected!r}")
                self._commit(snapshot)
            except BaseException as tick_error:
                await self._fail(tick_error)
                raise
            return output

    # -- lifecycle -------------------------------------------------------------------------------

    async def reset(self) -> None:
        """Start over from chunk 0 (from ACTIVE or FAILED): the model-side session is reset, pending
        events are dropped and the floor rises past them; remembered ids stay DUPLICATE.

        If the lifecycle (or the reducer's ``reset``) fails the session is FAILED and the
        error propagates; calling ``reset`` again retries.
        """
        async with self._lock:
            self._require(ARDiffusionSessionStatus.ACTIVE, ARDiffusionSessionStatus.FAILED)
            self._status = ARDiffusionSessionStatus.RESETTING
            try:
                await self._lifecycle.reset_session(self._session_id)
                if self._reducer is not None:
                    self._reducer.reset()
            except BaseException:
                self._status = ARDiffusionSessionStatus.FAILED
                raise
            if self._pending:
                # Every pending id is above the floor (acceptance guarantees it): the floor moves to the newest.
                self._floor = max(self._pending)
            self._pending.clear()
            self._in_flight_floor = None
            self._prompt = None
            self._controls = {}
            self._chunk_index = 0
            self._status = ARDiffusionSessionStatus.ACTIVE

    async def close(self) -> None:
        """Close the model-side session; a no-op once CLOSED.

        A failed close leaves the session CLEANUP_FAILED (a tombstone: it refuses everything but
        another ``close``) and re-raises, so the id cannot be reused while the model-side
        session may still exist.
        """
        async with self._lock:
            if self._status is ARDiffusionSessionStatus.CLOSED:
                return
            self._status = ARDiffusionSessionStatus.CLOSING
            try:
                await self._lifecycle.close_session(self._session_id)
            except BaseException:
                self._status = ARDiffusionSessionStatus.CLEANUP_FAILED
                raise
            self._pending.clear()
            self._in_flight_floor = None
            self._prompt = None
            self._controls = {}
            self._status = ARDiffusionSessionStatus.CLOSED

    async def disconnect(self) -> None:
        """A transport went away: the same cleanup as :meth:`close`."""
        await self.close()


# -- the manager -------------------------------------------------------------------------------------


class ARDiffusionSessionManager(Generic[TickOutputT]):
    """Creates and owns the sessions that share one tick consumer and one lifecycle.

    Every method is a coroutine, as in the reference (``await manager.get_session(id)``), so
    a caller written for it runs unchanged. A session whose close failed stays registered as a
    CLEANUP_FAILED tombstone (``get_session`` returns it) until a retried close succeeds, so
    its id cannot be taken again meanwhile.
    """

    def __init__(self, *, tick_consumer: ARDiffusionTickConsumer[TickOutputT],
                 lifecycle: ARDiffusionSessionLifecycle, max_pending_events: int,
                 request_id_factory: Callable[[str, int], str] | None = None,
                 session_id_factory: Callable[[], str] | None = None,
                 control_reducer_factory: Callable[[], ARDiffusionControlReducer] | None = None) -> None:
        # Checked here, not at the first create_session, so a wrong wiring fails at startup.
        check_positive_int("max_pending_events", max_pending_events)
        _check_collaborators(tick_consumer, lifecycle, request_id_factory)
        for name, factory in (("session_id_factory", session_id_factory),
                              ("control_reducer_factory", control_reducer_factory)):
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be callable, got {factory!r}")
        self._session_kwargs: dict[str, Any] = {
            "tick_consumer": tick_consumer, "lifecycle": lifecycle, "max_pending_events": max_pending_events,
            "request_id_factory": request_id_factory}
        self._session_id_factory = session_id_factory or (lambda: uuid.uuid4().hex)
        self._reducer_factory = control_reducer_factory
        self._sessions: dict[str, ARDiffusionSession[TickOutputT]] = {}

    async def create_session(self, session_id: str | None = None) -> ARDiffusionSession[TickOutputT]:
        """A new ACTIVE session (id from ``session_id_factory``, default a uuid4 hex, when None).

        StateError "already exists" if the id is registered, tombstones included.
        """
        if session_id is None:
            session_id = self._session_id_factory()
        check_session_id(session_id)
        if session_id in self._sessions:
            raise ARDiffusionSessionStateError(f"AR-Diffusion session {session_id!r} already exists "
                                               f"(status {self._sessions[session_id].status.value})")
        reducer = self._reducer_factory() if self._reducer_factory is not None else None
        session = ARDiffusionSession(session_id, control_reducer=reducer, **self._session_kwargs)
        self._sessions[session_id] = session
        return session

    def _registered(self, session_id: str) -> ARDiffusionSession[TickOutputT]:
        try:
            return self._sessions[session_id]
        except (KeyError, TypeError):
            raise ARDiffusionSessionStateError(f"AR-Diffusion session {session_id!r} does not exist") from None

    async def get_session(self, session_id: str) -> ARDiffusionSession[TickOutputT]:
        """The registered session (a CLEANUP_FAILED tombstone included); StateError "does not exist" otherwise."""
        return self._registered(session_id)

    async def reset_session(self, session_id: str) -> None:
        await self._registered(session_id).reset()

    async def close_session(self, session_id: str) -> None:
        """Close the session and forget it; if the close fails it stays as a CLEANUP_FAILED tombstone."""
        session = self._registered(session_id)
        await session.close()
        if self._sessions.get(session_id) is session:
            del self._sessions[session_id]

    async def disconnect(self, session_id: str) -> None:
        """A transport went away: the same as :meth:`close_session`."""
        await self.close_session(session_id)
