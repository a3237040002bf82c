"""One server connection: its lifecycle as one state machine, and its session's data in one record.

A connection is in exactly one :class:`ConnectionState`; every other per-connection fact the
server needs (is a slot taken, may the generation loop serve it, may it start a session) is
derived from that state, never kept beside it. The moves allowed are the rows of
:data:`TRANSITIONS`, made only through :meth:`Connection.transition`, which refuses any other
move with a :class:`ConnectionStateError` (a server bug: the server logs it and closes that
connection with 1011; no other connection is touched).

The session's data (its request id, its stream once created, its encoder, its event
bookkeeping, its last chunk's delivery and its engine close) is one :class:`SessionRecord`,
replaced by a fresh one when the connection starts over after ``session.done``; what a created
session streams with (plan, control-plane session, playback clock) is a frozen :class:`Stream`,
attached once, while the start holds its slot.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ardiff_jax.realtime import ARDiffusionSession
from ardiff_jax.serve._pacing import PlaybackClock
from ardiff_jax.serve._send_queue import SendQueue
from ardiff_jax.serve._world import StartPlan

__all__ = [
    "ADMITTED",
    "REMEMBERED_EVENT_IDS",
    "TRANSITIONS",
    "Connection",
    "ConnectionState",
    "ConnectionStateError",
    "SessionRecord",
    "Stream",
]

#: Wire event ids a connection remembers to answer repeats as duplicates (older ones count as new).
REMEMBERED_EVENT_IDS = 4096


class ConnectionState(enum.Enum):
    WAITING = "waiting"  # connected, no session: the start clock runs
    STARTING = "starting"  # a start holds a slot: its picture decodes, its session is created, video.start queued
    STREAMING = "streaming"  # the generation loop serves it
    FINISHING = "finishing"  # no more chunks (the last was made, or session.stop): session.done follows the close
    CLOSING = "closing"  # the engine session is being closed; its slot stays taken until it is
    ENDED = "ended"  # no session and no slot: session.done starts over (waiting), or the connection is closing
    CLOSED = "closed"  # released: every resource dropped


_S = ConnectionState

#: The allowed moves, ``from -> {to, ...}``; no other move is made (see :meth:`Connection.transition`).
TRANSITIONS: Mapping[ConnectionState, frozenset[ConnectionState]] = {
    _S.WAITING: frozenset({_S.STARTING, _S.ENDED}),  # a start admitted; closed before any start
    # streams; the start failed (slot back); ended once its session exists; ended before it did
    _S.STARTING: frozenset({_S.STREAMING, _S.WAITING, _S.CLOSING, _S.ENDED}),
    _S.STREAMING: frozenset({_S.FINISHING, _S.CLOSING}),  # last chunk made or stopped; an error or disconnect
    _S.FINISHING: frozenset({_S.CLOSING}),
    _S.CLOSING: frozenset({_S.ENDED}),  # the engine close returned (or failed and is retried: see the server)
    _S.ENDED: frozenset({_S.WAITING, _S.CLOSED}),  # session.done queued (a fresh record); released
    _S.CLOSED: frozenset(),
}

#: States in which the connection's session holds a slot (``/healthz`` ``admitted``, the capacity count).
ADMITTED = frozenset({_S.STARTING, _S.STREAMING, _S.FINISHING, _S.CLOSING})


class ConnectionStateError(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow: a server bug, never the client's (the connection closes 1011)."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """What a created session streams with: set once, while its start holds the slot."""

    plan: StartPlan
    session: ARDiffusionSession
    playback: PlaybackClock


@dataclasses.dataclass(frozen=True)
class _EventRecord:
    wire_id: str
    fields: tuple[str, ...]


@dataclasses.dataclass(eq=False)
class SessionRecord:
    """One session's data on its connection; a fresh record per session (its request id included)."""

    request_id: str = dataclasses.field(default_factory=lambda: f"rt-{uuid.uuid4().hex}")
    stream: Stream | None = None
    encoder: Any = None  # closed once (then None: nothing more is delivered)
    frames_generated: int = 0
    tail: asyncio.Task | None = None  # the last chunk's encode-and-queue task (chunks stay in order)
    closing: asyncio.Task | None = None  # the control-plane close, once begun
    # Wire ids: remembered (duplicates), the integer id each became, what each event set.
    wire_ids: collections.OrderedDict[str, int] = dataclasses.field(default_factory=collections.OrderedDict)
    events: dict[int, _EventRecord] = dataclasses.field(default_factory=dict)
    pending: set[int] = dataclasses.field(default_factory=set)
    owners: dict[str, int] = dataclasses.field(default_factory=dict)  # field (prompt, a control track) -> event
    active: set[int] = dataclasses.field(default_factory=set)
    next_event_id: int = 1
    server_ids: int = 0

    def remember(self, wire_id: str, event_id: int, fields: tuple[str, ...]) -> None:
        self.wire_ids[wire_id] = event_id
        while len(self.wire_ids) > REMEMBERED_EVENT_IDS:
            self.wire_ids.popitem(last=False)
        self.events[event_id] = _EventRecord(wire_id, fields)
        self.pending.add(event_id)

    def chunk_events(self, applied: tuple[int, ...]) -> tuple[list[str], list[str], list[str]]:
        """``(started, active, completed)`` wire ids after a chunk that applied ``applied`` (see the package doc)."""
        for event_id in applied:
            self.pending.discard(event_id)
            for field in self.events[event_id].fields:
                self.owners[field] = event_id
        active = set(self.owners.values())
        completed = sorted((self.active | set(applied)) - active)
        started = [self.events[i].wire_id for i in applied]
        completed_wire = [self.events[i].wire_id for i in completed]
        for event_id in completed:
            del self.events[event_id]
        self.active = active
        return started, [self.events[i].wire_id for i in sorted(active)], completed_wire


class Connection:
    """One WebSocket: its state, its current session's record, its send queue and its clocks."""

    def __init__(self, websocket: Any, queue: SendQueue, order: int) -> None:
        self.websocket = websocket
        self.queue = queue
        self.order = order  # connection order: breaks ties between sessions due at the same time
        self._state = ConnectionState.WAITING
        self.record = SessionRecord()
        # Start clock while waiting or starting, stall clock while streaming, close clock once the close is
        # queued (see the server's _watch).
        self.clock = time.monotonic()
        self.sent_at = self.clock  # when a send to the client last completed (the client took a frame)
        self.sessions_done = 0  # sessions this connection finished (session.done sent): it may start another

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def admitted(self) -> bool:
        """Whether this connection's session holds a slot (derived from the state, see :data:`ADMITTED`)."""
        return self._state in ADMITTED

    def transition(self, to: ConnectionState) -> None:
        """Move to ``to`` if :data:`TRANSITIONS` allows it, else raise :class:`ConnectionStateError` (nothing changes).

        ``ended -> waiting`` (``session.done`` queued) replaces the session record with a fresh one: the
        connection may start another session, with a new request id and no event of the last.
        """
        allowed = TRANSITIONS[self._state]
        if to not in allowed:
            choices = ", ".join(sorted(s.value for s in allowed)) or "nothing: it is final"
            raise ConnectionStateError(f"connection {self.request_id}: illegal move {self._state.value} -> "
                                       f"{to.value} (from {self._state.value} it may go to {choices})")
        if self._state is ConnectionState.ENDED and to is ConnectionState.WAITING:
            self.record = SessionRecord()
        self._state = to

    def attach(self, stream: Stream, encoder: Any) -> None:
        """Record the created session's stream and encoder: only while starting, and only once."""
        if self._state is not ConnectionState.STARTING or self.record.stream is not None:
            raise ConnectionStateError(f"connection {self.request_id}: a stream is attached once, while starting "
                                       f"(it is {self._state.value}"
                                       f"{', with a stream' if self.record.stream is not None else ''})")
        self.record.stream = stream
        self.record.encoder = encoder
