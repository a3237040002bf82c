"""A server connection's lifecycle is one state machine (``ardiff_jax/serve/_connection.py``).

Pure tests of the transition table, the one ``transition`` method that makes its moves, the
derived facts (a slot taken) and the per-session record; the server's use of it is pinned by
the serve tests (and, for an illegal move inside the server, ``test_serve_hardening.py``).
"""

from __future__ import annotations

import collections
import itertools

import pytest

pytest.importorskip("starlette")

from ardiff_jax.serve._connection import (
    ADMITTED,
    TRANSITIONS,
    Connection,
    ConnectionState,
    ConnectionStateError,
    Stream,
)
from ardiff_jax.serve._send_queue import SendQueue

S = ConnectionState


def connection() -> Connection:
    return Connection(websocket=None, queue=SendQueue(max_media=2, max_control=2), order=0)


def path_to(state: ConnectionState) -> list[ConnectionState]:
    """The shortest list of legal moves from ``waiting`` to ``state`` (breadth first over the table)."""
    parents: dict[ConnectionState, ConnectionState | None] = {S.WAITING: None}
    todo = collections.deque([S.WAITING])
    while todo:
        here = todo.popleft()
        for there in sorted(TRANSITIONS[here], key=lambda s: s.value):
            if there not in parents:
                parents[there] = here
                todo.append(there)
    assert state in parents, f"{state.value} cannot be reached from waiting"
    moves = []
    while parents[state] is not None:
        moves.append(state)
        state = parents[state]  # type: ignore[assignment]
    return moves[::-1]


def connection_in(state: ConnectionState) -> Connection:
    conn = connection()
    for move in path_to(state):
        conn.transition(move)
    assert conn.state is state
    return conn


def test_the_table_has_every_state_each_is_reachable_and_every_live_state_can_be_released():
    assert set(TRANSITIONS) == set(S)
    for state in S:
        assert state is S.WAITING or path_to(state)
    # From every state but closed a path leads to closed: no connection is stuck short of its release.
    for state in S:
        seen, todo = {state}, [state]
        while todo:
            for there in TRANSITIONS[todo.pop()]:
                if there not in seen:
                    seen.add(there)
                    todo.append(there)
        assert S.CLOSED in seen
    assert TRANSITIONS[S.CLOSED] == frozenset()


@pytest.mark.parametrize(("start", "to"), [(a, b) for a in S for b in sorted(TRANSITIONS[a], key=lambda s: s.value)],
                         ids=lambda s: s.value)
def test_every_move_of_the_table_is_allowed(start, to):
    conn = connection_in(start)
    conn.transition(to)
    assert conn.state is to


@pytest.mark.parametrize(("start", "to"), [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]],
                         ids=lambda s: s.value)
def test_every_move_outside_the_table_is_refused_and_changes_nothing(start, to):
    conn = connection_in(start)
    record = conn.record
    with pytest.raises(ConnectionStateError, match=f"illegal move {start.value} -> {to.value}"):
        conn.transition(to)
    assert conn.state is start and conn.record is record


def test_a_few_illegal_moves_are_refused_by_name():
    closed = connection_in(S.CLOSED)
    with pytest.raises(ConnectionStateError, match=r"illegal move closed -> streaming \(from closed it may go to "
                                                   r"nothing: it is final\)"):
        closed.transition(S.STREAMING)
    waiting = connection()
    # Streaming needs a start (its slot, its stream); closing a connection needs its session ended first.
    with pytest.raises(ConnectionStateError, match=r"waiting -> streaming \(from waiting it may go to ended, "
                                                   r"starting\)"):
        waiting.transition(S.STREAMING)
    with pytest.raises(ConnectionStateError, match="streaming -> closed"):
        connection_in(S.STREAMING).transition(S.CLOSED)
    with pytest.raises(ConnectionStateError, match="closing -> waiting"):  # a slot is freed only by the close
        connection_in(S.CLOSING).transition(S.WAITING)


def test_a_slot_is_taken_exactly_from_the_start_until_the_engine_close_returned():
    assert ADMITTED == {S.STARTING, S.STREAMING, S.FINISHING, S.CLOSING}
    for state in S:
        assert connection_in(state).admitted is (state in ADMITTED)


def test_session_done_starts_over_with_a_fresh_record_and_a_failed_start_keeps_it():
    conn = connection_in(S.STARTING)
    first = conn.record
    conn.transition(S.WAITING)  # the start failed: nothing was attached, the same request id is offered again
    assert conn.record is first
    conn = connection_in(S.ENDED)
    ended = conn.record
    ended.remember("e1", 1, ("prompt",))
    conn.transition(S.WAITING)  # session.done: another session may start on the socket
    assert conn.record is not ended and conn.request_id != ended.request_id
    assert conn.record.stream is None and not conn.record.wire_ids and conn.record.next_event_id == 1
    conn.transition(S.ENDED)
    conn.transition(S.CLOSED)  # released: the record stays for the release's cleanup
    assert conn.record.request_id == conn.request_id


def test_a_stream_is_attached_once_and_only_while_starting():
    stream = Stream(plan=object(), session=object(), playback=object())  # type: ignore[arg-type]
    with pytest.raises(ConnectionStateError, match="while starting"):
        connection().attach(stream, encoder=None)
    conn = connection_in(S.STARTING)
    conn.attach(stream, encoder="enc")
    assert conn.record.stream is stream and conn.record.encoder == "enc"
    with pytest.raises(ConnectionStateError, match="with a stream"):
        conn.attach(stream, encoder="other")
    assert conn.record.encoder == "enc"
    with pytest.raises(AttributeError):
        stream.plan = None  # type: ignore[misc]


def test_the_architecture_docs_table_is_the_transition_table():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text("utf-8")
    rows = text.split("| from | to |\n|---|---|\n", 1)[1].split("\n\n", 1)[0].splitlines()
    names = {state.value for state in S}
    documented = {}
    for row in rows:
        source, targets = row.strip("|").split("|")
        documented[S(re.findall(r"`([^`]+)`", source)[0])] = frozenset(
            S(name) for name in re.findall(r"`([^`]+)`", targets) if name in names)
    assert documented == dict(TRANSITIONS)
