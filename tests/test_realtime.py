"""The realtime control plane (``ardiff_jax.realtime``): event queues, floors, ticks, failure paths.

Session-level behaviour runs against small fakes (a tick consumer and a lifecycle that record
calls and fail on demand); the in-process consumer and lifecycle run against a real engine around
the tiny ``WorldPipeline``. See ``docs/reference_behaviour.md``, "Ticks".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.realtime import (
    ARDiffusionChunkMetadataError,
    ARDiffusionEventAcceptanceStatus,
    ARDiffusionEventQueueFullError,
    ARDiffusionPreparedControls,
    ARDiffusionSession,
    ARDiffusionSessionError,
    ARDiffusionSessionEvent,
    ARDiffusionSessionManager,
    ARDiffusionSessionStateError,
    ARDiffusionSessionStatus,
    ARDiffusionStaleEventError,
    EngineSessionLifecycle,
    EngineTickConsumer,
)
from ardiff_jax.types import ARDiffusionChunkMetadata, ARDiffusionControlInput, ARDiffusionTickRequest

ACCEPTED = ARDiffusionEventAcceptanceStatus.ACCEPTED
DUPLICATE = ARDiffusionEventAcceptanceStatus.DUPLICATE
#: Upper bound for any single await in these tests: a broken implementation fails, never hangs.
AWAIT_TIMEOUT_S = 10.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def camera(yaw: float) -> ARDiffusionControlInput:
    return ARDiffusionControlInput("camera", "pose6d", {"yaw": yaw})


def event(event_id: int, prompt: str | None = None, *controls: ARDiffusionControlInput) -> ARDiffusionSessionEvent:
    return ARDiffusionSessionEvent(event_id, prompt=prompt, controls=tuple(controls))


class TickFailed(RuntimeError):
    pass


class CleanupFailed(RuntimeError):
    pass


class FakeConsumer:
    """Records every tick; answers with the tick's exact metadata unless told otherwise.

    ``fail_ticks``: how many of the next ticks raise ``TickFailed``. ``gate``: when set, each
    tick signals ``started`` and then waits for the gate (so events can arrive mid-tick).
    ``bad_metadata``: report metadata for another request id.
    """

    def __init__(self, *, gate: asyncio.Event | None = None) -> None:
        self.ticks: list[ARDiffusionTickRequest] = []
        self.fail_ticks = 0
        self.bad_metadata = False
        self.gate = gate
        self.started = asyncio.Event()
        self.in_flight = 0
        self.max_in_flight = 0

    async def execute_tick(self, tick: ARDiffusionTickRequest) -> dict[str, Any]:
        self.ticks.append(tick)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.started.set()
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
            if self.fail_ticks:
                self.fail_ticks -= 1
                raise TickFailed(f"tick {tick.request_id} exploded")
            return {"tick": tick}
        finally:
            self.in_flight -= 1

    def chunk_metadata(self, output: Mapping[str, Any]) -> ARDiffusionChunkMetadata:
        metadata = ARDiffusionChunkMetadata.from_tick(output["tick"])
        if self.bad_metadata:
            return dataclasses.replace(metadata, request_id=metadata.request_id + "-other")
        return metadata


class FakeLifecycle:
    """Records ``("reset" | "close", session_id)``; ``fail_resets`` / ``fail_closes`` count down."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_resets = 0
        self.fail_closes = 0

    async def reset_session(self, session_id: str) -> None:
        self.calls.append(("reset", session_id))
        if self.fail_resets:
            self.fail_resets -= 1
            raise CleanupFailed(f"reset of {session_id} failed")

    async def close_session(self, session_id: str) -> None:
        self.calls.append(("close", session_id))
        if self.fail_closes:
            self.fail_closes -= 1
            raise CleanupFailed(f"close of {session_id} failed")


class RecordingReducer:
    """Applies events like the default rule (last value per track wins) and records every call."""

    def __init__(self) -> None:
        self.prepared: list[tuple[list[ARDiffusionControlInput], list[int]]] = []
        self.chunk_indices: list[int] = []
        self.commits: list[ARDiffusionPreparedControls] = []
        self.resets = 0
        self.fail_commits = 0

    # Keyword-only, the reference's call shape: a positional call from the session raises TypeError.
    def prepare(self, *, current_controls: dict[str, ARDiffusionControlInput],
                events: tuple[ARDiffusionSessionEvent, ...], chunk_index: int) -> ARDiffusionPreparedControls:
        assert type(current_controls) is dict and type(events) is tuple and type(chunk_index) is int
        committed = list(current_controls.values())
        self.prepared.append((committed, [ev.event_id for ev in events]))
        self.chunk_indices.append(chunk_index)
        by_track = {control.track: control for control in committed}
        for ev in events:
            for control in ev.controls:
                by_track[control.track] = control
        # The reducer's own rule: a "zoom" track doubles what the events asked for.
        if "zoom" in by_track and by_track["zoom"] in [c for ev in events for c in ev.controls]:
            zoom = by_track["zoom"]
            by_track["zoom"] = ARDiffusionControlInput("zoom", zoom.schema, {"level": zoom.data["level"] * 2})
        return ARDiffusionPreparedControls(controls=tuple(by_track.values()))

    def commit(self, prepared: ARDiffusionPreparedControls) -> None:
        if self.fail_commits:
            self.fail_commits -= 1
            raise TickFailed("reducer commit failed")
        self.commits.append(prepared)

    def reset(self) -> None:
        self.resets += 1


def new_session(consumer=None, lifecycle=None, *, session_id="s1", max_pending_events=8, **kwargs):
    consumer = FakeConsumer() if consumer is None else consumer
    lifecycle = FakeLifecycle() if lifecycle is None else lifecycle
    session = ARDiffusionSession(session_id, tick_consumer=consumer, lifecycle=lifecycle,
                                 max_pending_events=max_pending_events, **kwargs)
    return session, consumer, lifecycle


async def within(awaitable):
    return await asyncio.wait_for(awaitable, timeout=AWAIT_TIMEOUT_S)


# -- construction and event validation -----------------------------------------------------------


@pytest.mark.parametrize("session_id, max_pending, match", [
    ("", 4, "session"),
    ("   ", 4, "session"),
    ("s1", 0, "max_pending_events"),
    ("s1", -1, "max_pending_events"),
    ("s1", True, "max_pending_events"),
])
def test_session_rejects_blank_id_and_non_positive_queue_bound(session_id, max_pending, match):
    with pytest.raises(ValueError, match=match):
        ARDiffusionSession(session_id, tick_consumer=FakeConsumer(), lifecycle=FakeLifecycle(),
                           max_pending_events=max_pending)


@pytest.mark.parametrize("kwargs, match", [
    (dict(event_id=-1, prompt="p"), "event_id"),
    (dict(event_id=True, prompt="p"), "event_id"),
    (dict(event_id=1.0, prompt="p"), "event_id"),
    (dict(event_id=1, prompt=3), "prompt"),
    (dict(event_id=1, controls=({"track": "camera"},)), "ARDiffusionControlInput"),
    (dict(event_id=1), "prompt"),  # neither a prompt nor controls
    (dict(event_id=1, controls=(camera(0.1), camera(0.2))), "at most once"),
])
def test_event_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ARDiffusionSessionEvent(**kwargs)


def test_duplicate_track_and_non_transport_payload_are_refused():
    with pytest.raises(ValueError, match="at most once"):
        event(1, None, camera(0.1), ARDiffusionControlInput("zoom", "z", {"level": 1}), camera(0.2))
    with pytest.raises(ValueError, match="transport-safe"):
        event(1, None, ARDiffusionControlInput("camera", "pose6d", {"obj": object()}))

    # A control whose payload escaped freezing (mutable, holding a non-transport value) is refused
    # when the event is made or accepted, and nothing is queued.
    smuggled = camera(0.1)
    object.__setattr__(smuggled, "data", {"yaw": 0.1, "obj": object()})

    async def scenario():
        session, _, _ = new_session()
        with pytest.raises(ValueError, match="transport-safe"):
            await session.accept_event(event(1, None, smuggled))
        assert session.pending_event_count == 0

    run(scenario())


def test_accept_event_requires_an_event():
    async def scenario():
        session, _, _ = new_session()
        with pytest.raises(TypeError):
            await session.accept_event({"event_id": 1, "prompt": "p"})
        assert session.pending_event_count == 0

    run(scenario())


# -- acceptance, snapshot and commit -------------------------------------------------------------


def test_events_accepted_out_of_order_apply_sorted_and_applied_ids_become_duplicates():
    async def scenario():
        session, consumer, _ = new_session(session_id="world-1")
        assert session.session_id == "world-1"
        assert session.status is ARDiffusionSessionStatus.ACTIVE and session.chunk_index == 0
        second = await session.accept_event(event(2, "second prompt", camera(2.0)))
        assert (second.status, second.event_id, second.pending_count) == (ACCEPTED, 2, 1)
        first = await session.accept_event(
            event(1, "first prompt", camera(1.0), ARDiffusionControlInput("action", "keys", {"w": True})))
        assert (first.status, first.event_id, first.pending_count) == (ACCEPTED, 1, 2)
        dup = await session.accept_event(event(1, "again"))
        assert (dup.status, dup.event_id, dup.pending_count) == (DUPLICATE, 1, 2)
        assert session.pending_event_count == 2

        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert tick.session_id == "world-1" and tick.chunk_index == 0
        assert tick.applied_event_ids == (1, 2)
        assert tick.prompt == "second prompt"  # the highest id's prompt wins, not the last accepted
        assert [c.track for c in tick.controls] == ["action", "camera"]
        assert tick.controls[1].data["yaw"] == 2.0 and tick.controls[0].data["w"] is True
        assert re.fullmatch(r"ar-world-1-0-[0-9a-f]{32}", tick.request_id), tick.request_id
        assert session.chunk_index == 1 and session.pending_event_count == 0

        # An applied id sent again is a duplicate, not an error, and queues nothing.
        again = await session.accept_event(event(2, "replayed"))
        assert again.status is DUPLICATE and session.pending_event_count == 0

        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert tick.chunk_index == 1 and tick.applied_event_ids == ()
        assert tick.prompt == "second prompt"
        assert [(c.track, dict(c.data)) for c in tick.controls] == [("action", {"w": True}), ("camera", {"yaw": 2.0})]
        assert re.fullmatch(r"ar-world-1-1-[0-9a-f]{32}", tick.request_id), tick.request_id
        assert consumer.ticks[0].request_id != consumer.ticks[1].request_id

    run(scenario())


def test_composite_event_is_isolated_queue_bound_holds_and_controls_sort_by_track():
    async def scenario():
        session, consumer, _ = new_session(max_pending_events=1)
        payload = {"yaw": 0.5, "path": [1, 2]}
        zoom = ARDiffusionControlInput("zoom", "level", {"level": 3})
        cam = ARDiffusionControlInput("camera", "pose6d", payload)
        # A control whose payload stayed mutable: the session must copy it at acceptance.
        loose = ARDiffusionControlInput("light", "rgb", {})
        loose_payload = {"rgb": [1, 2, 3]}
        object.__setattr__(loose, "data", loose_payload)
        composite = event(7, "a red car", zoom, cam, loose)
        assert (await session.accept_event(composite)).status is ACCEPTED
        payload["yaw"] = 9.0
        payload["path"].append(3)
        loose_payload["rgb"].append(4)
        loose_payload["extra"] = True

        full = ARDiffusionSessionEvent(8, prompt="overflow")
        with pytest.raises(ARDiffusionEventQueueFullError, match="queue is full"):
            await session.accept_event(full)
        assert (await session.accept_event(event(7, "same id"))).status is DUPLICATE
        assert session.pending_event_count == 1

        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert tick.applied_event_ids == (7,) and tick.prompt == "a red car"
        assert [c.track for c in tick.controls] == ["camera", "light", "zoom"]
        assert tick.controls[0].data["yaw"] == 0.5 and list(tick.controls[0].data["path"]) == [1, 2]
        assert list(tick.controls[1].data["rgb"]) == [1, 2, 3] and "extra" not in tick.controls[1].data
        # The refused event was never stored: after the commit it can be sent and applied.
        assert (await session.accept_event(full)).status is ACCEPTED

    run(scenario())


def test_recent_id_memory_is_bounded_by_the_queue_bound():
    async def scenario():
        session, _, _ = new_session(max_pending_events=2)
        for first in (1, 3, 5):
            await session.accept_event(event(first, f"p{first}"))
            await session.accept_event(event(first + 1, f"p{first + 1}"))
            await session.next_chunk()
        assert (await session.accept_event(event(6, "again"))).status is DUPLICATE
        # Id 1 fell out of the bounded memory: it is below the floor, so stale rather than duplicate.
        with pytest.raises(ARDiffusionStaleEventError, match="event floor is 6"):
            await session.accept_event(event(1, "old"))

    run(scenario())


def test_events_accepted_during_a_tick_go_to_the_next_chunk_and_the_in_flight_floor_holds():
    async def scenario():
        gate = asyncio.Event()
        session, consumer, _ = new_session(FakeConsumer(gate=gate))
        await session.accept_event(event(5, "five", camera(5.0)))
        await session.accept_event(event(10, "ten"))
        in_flight = asyncio.create_task(session.next_chunk())
        await within(consumer.started.wait())
        tick = consumer.ticks[0]
        assert tick.applied_event_ids == (5, 10) and tick.prompt == "ten"

        accepted = await within(session.accept_event(event(11, "eleven", camera(11.0))))
        assert accepted.status is ACCEPTED
        with pytest.raises(ARDiffusionStaleEventError, match="event floor is 10"):
            await session.accept_event(event(7, "late"))
        assert (await session.accept_event(event(10, "ten again"))).status is DUPLICATE
        # The in-flight snapshot is immutable: the tick already handed out is unchanged.
        assert consumer.ticks[0] == tick and tick.applied_event_ids == (5, 10) and tick.prompt == "ten"

        gate.set()
        await within(in_flight)
        assert session.chunk_index == 1 and session.pending_event_count == 1
        with pytest.raises(ARDiffusionStaleEventError, match="event floor is 10"):
            await session.accept_event(event(9, "late"))

        await within(session.next_chunk())
        tick = consumer.ticks[1]
        assert tick.chunk_index == 1 and tick.applied_event_ids == (11,) and tick.prompt == "eleven"
        assert [(c.track, c.data["yaw"]) for c in tick.controls] == [("camera", 11.0)]

    run(scenario())


def test_next_chunk_calls_are_serialised():
    async def scenario():
        session, consumer, _ = new_session()
        await session.accept_event(event(1, "p"))
        await within(asyncio.gather(session.next_chunk(), session.next_chunk(), session.next_chunk()))
        assert consumer.max_in_flight == 1
        assert [t.chunk_index for t in consumer.ticks] == [0, 1, 2]
        assert [t.applied_event_ids for t in consumer.ticks] == [(1,), (), ()]
        assert session.chunk_index == 3

    run(scenario())


# -- failure paths ---------------------------------------------------------------------------------


def test_failed_tick_fails_and_closes_the_session_until_reset():
    async def scenario():
        session, consumer, lifecycle = new_session()
        await session.accept_event(event(1, "p", camera(1.0)))
        consumer.fail_ticks = 1
        with pytest.raises(TickFailed, match="exploded"):
            await session.next_chunk()
        assert session.status is ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 0 and session.pending_event_count == 1
        assert lifecycle.calls == [("close", "s1")]
        with pytest.raises(ARDiffusionSessionStateError, match="is failed"):
            await session.next_chunk()
        with pytest.raises(ARDiffusionSessionStateError, match="is failed"):
            await session.accept_event(event(2, "q"))
        assert len(consumer.ticks) == 1

        await session.reset()
        assert session.status is ARDiffusionSessionStatus.ACTIVE
        assert session.pending_event_count == 0 and session.chunk_index == 0
        assert lifecycle.calls == [("close", "s1"), ("reset", "s1")]
        # The floor rose to the highest pending id, and old ids stay remembered.
        assert (await session.accept_event(event(1, "p"))).status is DUPLICATE
        assert (await session.accept_event(event(2, "new"))).status is ACCEPTED
        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert tick.chunk_index == 0 and tick.applied_event_ids == (2,)
        assert tick.prompt == "new" and tick.controls == ()
        assert session.chunk_index == 1

    run(scenario())


def test_failed_tick_whose_close_also_fails_raises_a_session_error_chained_to_the_tick_error():
    async def scenario():
        session, consumer, lifecycle = new_session()
        await session.accept_event(event(1, "p"))
        consumer.fail_ticks = 1
        lifecycle.fail_closes = 1
        with pytest.raises(ARDiffusionSessionError) as raised:
            await session.next_chunk()
        assert isinstance(raised.value.__cause__, TickFailed)
        assert session.status is ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 0 and session.pending_event_count == 1
        assert lifecycle.calls == [("close", "s1")]

    run(scenario())


def test_chunk_metadata_mismatch_commits_nothing_and_fails_the_session():
    async def scenario():
        session, consumer, lifecycle = new_session()
        await session.accept_event(event(1, "p"))
        consumer.bad_metadata = True
        with pytest.raises(ARDiffusionChunkMetadataError) as raised:
            await session.next_chunk()
        expected = ARDiffusionChunkMetadata.from_tick(consumer.ticks[-1])
        reported = dataclasses.replace(expected, request_id=expected.request_id + "-other")
        message = str(raised.value)
        assert "does not match" in message
        assert repr(reported) in message and repr(expected) in message
        assert message.index(repr(reported)) < message.index("does not match") < message.rindex(repr(expected))
        assert session.status is ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 0 and session.pending_event_count == 1
        assert lifecycle.calls == [("close", "s1")]

    run(scenario())


def test_chunk_metadata_error_is_a_session_error():
    assert issubclass(ARDiffusionChunkMetadataError, ARDiffusionSessionError)
    assert issubclass(ARDiffusionSessionError, RuntimeError)
    for error in (ARDiffusionSessionStateError, ARDiffusionEventQueueFullError, ARDiffusionStaleEventError):
        assert issubclass(error, ARDiffusionSessionError)
    assert [status.value for status in ARDiffusionSessionStatus] == [
        "active", "resetting", "failed", "closing", "cleanup_failed", "closed"]


def test_reducer_prepares_the_controls_and_commits_after_the_tick():
    async def scenario():
        reducer = RecordingReducer()
        session, consumer, _ = new_session(control_reducer=reducer)
        await session.accept_event(event(2, None, ARDiffusionControlInput("zoom", "level", {"level": 3})))
        await session.accept_event(event(1, "p", camera(1.0)))
        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert [(c.track, dict(c.data)) for c in tick.controls] == [("camera", {"yaw": 1.0}), ("zoom", {"level": 6})]
        assert reducer.prepared == [([], [1, 2])]
        assert len(reducer.commits) == 1

        await session.accept_event(event(3, None, camera(3.0)))
        await session.next_chunk()
        committed, ids = reducer.prepared[-1]
        assert ids == [3]
        assert sorted((c.track, dict(c.data)) for c in committed) == [("camera", {"yaw": 1.0}), ("zoom", {"level": 6})]
        tick = consumer.ticks[-1]
        assert [(c.track, dict(c.data)) for c in tick.controls] == [("camera", {"yaw": 3.0}), ("zoom", {"level": 6})]
        assert reducer.chunk_indices == [0, 1]

    run(scenario())


def test_reducer_prepare_is_called_with_the_reference_keywords_and_cannot_change_committed_controls():
    class MutatingReducer(RecordingReducer):
        def prepare(self, *, current_controls, events, chunk_index):
            prepared = super().prepare(current_controls=current_controls, events=events, chunk_index=chunk_index)
            current_controls.clear()  # a reducer scribbling on its argument must not reach the session
            current_controls["camera"] = camera(99.0)
            return prepared

    async def scenario():
        reducer = MutatingReducer()
        session, consumer, _ = new_session(control_reducer=reducer)
        await session.accept_event(event(1, "p", camera(1.0)))
        await session.next_chunk()
        await session.accept_event(event(2, "q"))
        await session.next_chunk()
        assert reducer.chunk_indices == [0, 1]
        committed, ids = reducer.prepared[-1]
        assert ids == [2] and [(c.track, dict(c.data)) for c in committed] == [("camera", {"yaw": 1.0})]
        assert [(c.track, dict(c.data)) for c in consumer.ticks[-1].controls] == [("camera", {"yaw": 1.0})]

    run(scenario())


def test_reducer_commit_failure_fails_the_session_and_reset_resets_the_reducer_once():
    async def scenario():
        reducer = RecordingReducer()
        session, consumer, lifecycle = new_session(control_reducer=reducer)
        await session.accept_event(event(1, "p", camera(1.0)))
        reducer.fail_commits = 1
        with pytest.raises(TickFailed, match="reducer commit failed"):
            await session.next_chunk()
        assert session.status is ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 0 and session.pending_event_count == 1
        assert lifecycle.calls == [("close", "s1")]
        assert reducer.resets == 0

        await session.reset()
        assert reducer.resets == 1
        assert session.status is ARDiffusionSessionStatus.ACTIVE

    run(scenario())


def test_failed_reset_leaves_the_session_failed():
    async def scenario():
        session, consumer, lifecycle = new_session()
        await session.accept_event(event(1, "p"))
        lifecycle.fail_resets = 1
        with pytest.raises(CleanupFailed):
            await session.reset()
        assert session.status is ARDiffusionSessionStatus.FAILED
        await session.reset()
        assert session.status is ARDiffusionSessionStatus.ACTIVE and session.pending_event_count == 0

    run(scenario())


def test_close_is_final_and_idempotent():
    async def scenario():
        session, consumer, lifecycle = new_session()
        await session.accept_event(event(1, "p"))
        await session.close()
        assert session.status is ARDiffusionSessionStatus.CLOSED
        assert session.pending_event_count == 0
        await session.close()
        await session.disconnect()
        assert lifecycle.calls == [("close", "s1")]
        with pytest.raises(ARDiffusionSessionStateError, match="is closed"):
            await session.next_chunk()
        with pytest.raises(ARDiffusionSessionStateError, match="is closed"):
            await session.accept_event(event(2, "q"))
        with pytest.raises(ARDiffusionSessionStateError, match="is closed"):
            await session.reset()
        assert consumer.ticks == []

    run(scenario())


# -- the manager -----------------------------------------------------------------------------------


def new_manager(consumer=None, lifecycle=None, **kwargs):
    consumer = FakeConsumer() if consumer is None else consumer
    lifecycle = FakeLifecycle() if lifecycle is None else lifecycle
    kwargs.setdefault("max_pending_events", 8)
    return ARDiffusionSessionManager(tick_consumer=consumer, lifecycle=lifecycle, **kwargs), consumer, lifecycle


def test_manager_reset_close_and_disconnect():
    async def scenario():
        manager, consumer, lifecycle = new_manager()
        session = await manager.create_session("s1")
        assert session.session_id == "s1" and await within(manager.get_session("s1")) is session
        with pytest.raises(ARDiffusionSessionStateError, match="already exists"):
            await manager.create_session("s1")
        await session.accept_event(event(1, "p", camera(1.0)))
        await session.next_chunk()

        await manager.reset_session("s1")
        assert session.status is ARDiffusionSessionStatus.ACTIVE and session.chunk_index == 0
        assert lifecycle.calls == [("reset", "s1")]
        assert (await session.accept_event(event(1, "p"))).status is DUPLICATE
        await session.next_chunk()
        tick = consumer.ticks[-1]
        assert tick.chunk_index == 0 and tick.applied_event_ids == ()
        assert tick.prompt is None and tick.controls == ()

        await manager.close_session("s1")
        assert session.status is ARDiffusionSessionStatus.CLOSED
        assert lifecycle.calls[-1] == ("close", "s1")
        with pytest.raises(ARDiffusionSessionStateError, match="does not exist"):
            await within(manager.get_session("s1"))

        generated = await manager.create_session()
        assert re.fullmatch(r"[0-9a-f]{32}", generated.session_id), generated.session_id
        await manager.disconnect(generated.session_id)
        assert generated.status is ARDiffusionSessionStatus.CLOSED
        assert lifecycle.calls[-1] == ("close", generated.session_id)
        with pytest.raises(ARDiffusionSessionStateError, match="does not exist"):
            await within(manager.get_session(generated.session_id))
        # A closed id may be created again.
        assert (await manager.create_session("s1")).status is ARDiffusionSessionStatus.ACTIVE

    run(scenario())


def test_every_manager_method_is_a_coroutine_as_in_the_reference():
    for name in ("create_session", "get_session", "reset_session", "close_session", "disconnect"):
        assert inspect.iscoroutinefunction(getattr(ARDiffusionSessionManager, name)), name


@pytest.mark.parametrize("close_method", ["close_session", "disconnect"])
def test_failed_close_keeps_a_cleanup_failed_tombstone_until_a_retry_succeeds(close_method):
    async def scenario():
        manager, _, lifecycle = new_manager()
        session = await manager.create_session("s1")
        await session.accept_event(event(1, "p"))
        lifecycle.fail_closes = 1
        with pytest.raises(CleanupFailed):
            await getattr(manager, close_method)("s1")
        assert session.status is ARDiffusionSessionStatus.CLEANUP_FAILED
        assert await within(manager.get_session("s1")) is session
        with pytest.raises(ARDiffusionSessionStateError, match="already exists"):
            await manager.create_session("s1")
        with pytest.raises(ARDiffusionSessionStateError, match="is cleanup_failed"):
            await manager.reset_session("s1")
        with pytest.raises(ARDiffusionSessionStateError, match="is cleanup_failed"):
            await session.next_chunk()

        await getattr(manager, close_method)("s1")
        assert session.status is ARDiffusionSessionStatus.CLOSED
        assert lifecycle.calls == [("close", "s1"), ("close", "s1")]
        with pytest.raises(ARDiffusionSessionStateError, match="does not exist"):
            await within(manager.get_session("s1"))
        assert (await manager.create_session("s1")).status is ARDiffusionSessionStatus.ACTIVE

    run(scenario())


def test_a_slow_tick_of_one_session_does_not_block_another():
    async def scenario():
        class SlowForA(FakeConsumer):
            async def execute_tick(self, tick):
                if tick.session_id == "a":
                    self.a_started.set()
                    await never_set.wait()
                return await super().execute_tick(tick)

        never_set = asyncio.Event()
        consumer = SlowForA()
        consumer.a_started = asyncio.Event()
        manager, _, _ = new_manager(consumer)
        a = await manager.create_session("a")
        b = await manager.create_session("b")
        await a.accept_event(event(1, "slow"))
        slow = asyncio.create_task(a.next_chunk())
        try:
            await within(consumer.a_started.wait())
            assert (await within(a.accept_event(event(2, "queued on a")))).status is ACCEPTED
            assert (await within(b.accept_event(event(1, "fast")))).status is ACCEPTED
            await within(b.next_chunk())
            assert b.chunk_index == 1 and b.pending_event_count == 0
            assert (await within(b.accept_event(event(2, "fast again")))).status is ACCEPTED
            await within(b.next_chunk())
            assert b.chunk_index == 2
            assert not slow.done() and a.chunk_index == 0
        finally:
            slow.cancel()
            with contextlib.suppress(BaseException):
                await slow

    run(scenario())


# -- the in-process consumer and lifecycle on a real engine ----------------------------------------

#: No warmup: each test gets a fresh engine and submits its ticks one by one; warmup would replay its
#: blocks in every engine and compile the batch buckets no test here runs (programs used compile on first use).
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)
REGISTER_SHAPE = (3, 16)  # the tiny WorldPipeline's (num_register_tokens, register_dim)


@pytest.fixture(scope="module")
def world_modules():
    from ardiff_jax.models import WorldPipeline

    return WorldPipeline("tiny").modules


@pytest.fixture
def engine(world_modules):
    from ardiff_jax.models import WorldPipeline

    with ARDiffusionEngine(WorldPipeline("tiny", modules=world_modules), CONFIG) as engine:
        yield engine


def action_inputs(tick: ARDiffusionTickRequest) -> dict[str, Any]:
    """Map the tick's ``action`` control to the pipeline's register features."""
    for control in tick.controls:
        if control.track == "action":
            return {"action": np.full(REGISTER_SHAPE, control.data["level"], np.float32)}
    return {}


class GenerateRecorder:
    """Wraps ``engine.generate``: records each request, its thread, and the output; can rewrite outputs."""

    def __init__(self, engine: ARDiffusionEngine) -> None:
        self.requests: list[Any] = []
        self.threads: list[int] = []
        self.outputs: list[Any] = []
        self.rewrite = None
        self.error: Exception | None = None
        self._generate = engine.generate
        engine.generate = self

    def __call__(self, request):
        self.requests.append(request)
        self.threads.append(threading.get_ident())
        if self.error is not None:
            raise self.error
        output = self._generate(request)
        if self.rewrite is not None:
            output = self.rewrite(output)
        self.outputs.append(output)
        return output


def test_engine_consumer_submits_the_tick_with_its_request_id_prompt_and_inputs(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine, inputs_provider=action_inputs,
                                  prompt_provider=lambda tick: f"provided for {tick.chunk_index}")
    try:
        tick = ARDiffusionTickRequest("world-1", "tick-req-0", 0, applied_event_ids=(3,), prompt="tick prompt",
                                      controls=(ARDiffusionControlInput("action", "level", {"level": 0.5}),))
        loop_thread = threading.get_ident()
        output = run(consumer.execute_tick(tick))
        (request,) = recorder.requests
        assert request.request_id == tick.request_id
        assert ARDiffusionTickRequest.from_extra_args(request.extra_args) == tick
        assert request.prompt == "provided for 0"
        np.testing.assert_array_equal(request.inputs["action"], np.full(REGISTER_SHAPE, 0.5, np.float32))
        assert recorder.threads[0] != loop_thread  # the engine runs off the event loop
        assert output is recorder.outputs[0]
        assert consumer.chunk_metadata(output) == ARDiffusionChunkMetadata.from_tick(tick)
        assert engine.sessions == ("world-1",)
    finally:
        consumer.close()


def test_engine_consumer_without_providers_uses_the_tick_prompt_and_no_inputs(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine)
    try:
        tick = ARDiffusionTickRequest("world-2", "tick-req-1", 0, prompt="from the tick")
        output = run(consumer.execute_tick(tick))
        (request,) = recorder.requests
        assert request.prompt == "from the tick" and dict(request.inputs) == {}
        assert output.ar_diffusion == ARDiffusionChunkMetadata.from_tick(tick)
    finally:
        consumer.close()


def test_engine_consumer_chunk_metadata_parsing(engine):
    from ardiff_jax.models import WorldBlock

    consumer = EngineTickConsumer(engine)
    try:
        metadata = ARDiffusionChunkMetadata("s", "r", 2, (4, 5))
        latents = np.zeros((2, 4, 8, 8), np.float32)
        assert consumer.chunk_metadata(WorldBlock(latents, 0, 0, metadata)) == metadata
        assert consumer.chunk_metadata({"ar_diffusion": metadata}) == metadata
        assert consumer.chunk_metadata({"ar_diffusion": metadata.to_dict()}) == metadata
        with pytest.raises(ValueError, match="ar_diffusion"):
            consumer.chunk_metadata(WorldBlock(latents, 0, 0))  # a request without a tick
        with pytest.raises(ValueError, match="ar_diffusion"):
            consumer.chunk_metadata({"latents": latents})
        with pytest.raises(ValueError, match="ar_diffusion"):
            consumer.chunk_metadata(object())
        with pytest.raises(ValueError):
            consumer.chunk_metadata({"ar_diffusion": "not metadata"})
        with pytest.raises(ValueError, match="strictly increasing"):
            consumer.chunk_metadata({"ar_diffusion": {**metadata.to_dict(), "applied_event_ids": [5, 4]}})
        with pytest.raises(ValueError, match="request_id"):
            consumer.chunk_metadata({"ar_diffusion": {**metadata.to_dict(), "request_id": " "}})
    finally:
        consumer.close()


def test_engine_consumer_refuses_metadata_for_another_request_id(engine):
    recorder = GenerateRecorder(engine)
    recorder.rewrite = lambda out: out._replace(
        ar_diffusion=dataclasses.replace(out.ar_diffusion, request_id="someone-else"))
    consumer = EngineTickConsumer(engine)
    try:
        tick = ARDiffusionTickRequest("world-3", "tick-req-3", 0, prompt="p")
        with pytest.raises(ValueError, match="someone-else"):
            run(consumer.execute_tick(tick))
    finally:
        consumer.close()


def test_engine_error_surfaces_before_metadata_validation(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine)
    try:
        # A real engine error: a new session's first tick without a prompt.
        with pytest.raises(ValueError, match="no prompt"):
            run(consumer.execute_tick(ARDiffusionTickRequest("world-4", "tick-req-4", 0)))
        boom = RuntimeError("engine exploded")
        recorder.error = boom
        with pytest.raises(RuntimeError, match="engine exploded") as raised:
            run(consumer.execute_tick(ARDiffusionTickRequest("world-4", "tick-req-5", 0, prompt="p")))
        assert raised.value is boom
    finally:
        consumer.close()


def test_session_on_the_engine_commits_only_after_valid_metadata(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine, inputs_provider=action_inputs)
    lifecycle = EngineSessionLifecycle(engine)

    async def scenario():
        session = ARDiffusionSession("world-5", tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=4)
        await session.accept_event(event(1, "a red car", ARDiffusionControlInput("action", "level", {"level": 1.0})))
        await session.next_chunk()
        assert session.chunk_index == 1 and session.pending_event_count == 0
        assert recorder.outputs[-1].ar_diffusion.applied_event_ids == (1,)

        # Metadata that does not match the tick: nothing commits and the engine session is released.
        recorder.rewrite = lambda out: out._replace(ar_diffusion=dataclasses.replace(out.ar_diffusion, chunk_index=7))
        await session.accept_event(event(2, "a blue car"))
        with pytest.raises(ARDiffusionChunkMetadataError):
            await session.next_chunk()
        assert session.status is ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 1 and session.pending_event_count == 1
        assert "world-5" not in engine.sessions

    try:
        run(scenario())
    finally:
        consumer.close()
        lifecycle.close()


def drive_script(session_id: str) -> list[list[ARDiffusionSessionEvent]]:
    """Per chunk, the events sent before it: prompts and action levels that differ per session."""
    level = 0.25 if session_id == "alpha" else -0.5

    def act(value):
        return ARDiffusionControlInput("action", "level", {"level": value})

    return [
        [event(1, f"{session_id} in a forest", act(level))],
        [],
        [event(3, None, act(2 * level)), event(2, f"{session_id} by the sea")],
        [event(4, f"{session_id} at night")],
    ]


async def drive(manager: ARDiffusionSessionManager, session_id: str) -> None:
    session = await manager.create_session(session_id)
    for events in drive_script(session_id):
        for ev in events:
            assert (await session.accept_event(ev)).status is ACCEPTED
        await session.next_chunk()
    assert session.chunk_index == len(drive_script(session_id)) and session.pending_event_count == 0


def test_two_engine_sessions_driven_concurrently_equal_each_driven_alone(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine, inputs_provider=action_inputs)
    lifecycle = EngineSessionLifecycle(engine)

    def session_of(request) -> str:
        return ARDiffusionTickRequest.from_extra_args(request.extra_args).session_id

    def by_session() -> dict[str, list[tuple[Any, Any]]]:
        grouped: dict[str, list[tuple[Any, Any]]] = {}
        for request, output in zip(recorder.requests, recorder.outputs, strict=True):
            grouped.setdefault(session_of(request), []).append((request, output))
        return grouped

    async def concurrently():
        manager = ARDiffusionSessionManager(tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=8)
        await asyncio.gather(drive(manager, "alpha"), drive(manager, "beta"))
        assert set(engine.sessions) == {"alpha", "beta"}
        await manager.close_session("alpha")
        assert engine.sessions == ("beta",)
        await manager.close_session("beta")
        assert engine.sessions == ()

    async def alone(session_id):
        manager = ARDiffusionSessionManager(tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=8)
        await drive(manager, session_id)
        await manager.close_session(session_id)
        assert session_id not in engine.sessions

    try:
        run(concurrently())
        together = by_session()
        assert {session_of(request) for request in recorder.requests[:2]} == {"alpha", "beta"}, \
            "the sessions' ticks did not interleave: a tick blocked the event loop"
        recorder.requests.clear()
        recorder.outputs.clear()
        run(alone("alpha"))
        run(alone("beta"))
        separately = by_session()

        for session_id in ("alpha", "beta"):
            assert len(together[session_id]) == len(separately[session_id]) == 4
            for chunk, ((_, mixed), (_, solo)) in enumerate(zip(together[session_id], separately[session_id],
                                                                strict=True)):
                assert mixed.block_index == solo.block_index == chunk
                assert np.array_equal(np.asarray(mixed.latents), np.asarray(solo.latents)), (session_id, chunk)
        # The events reached the pipeline: prompts per chunk, and the sessions' blocks differ.
        assert [request.prompt for request, _ in separately["alpha"]] == [
            "alpha in a forest", "alpha in a forest", "alpha by the sea", "alpha at night"]
        levels = [float(np.asarray(request.inputs["action"]).flat[0]) for request, _ in separately["beta"]]
        assert levels == [-0.5, -0.5, -1.0, -1.0]
        assert not np.array_equal(np.asarray(together["alpha"][0][1].latents),
                                  np.asarray(together["beta"][0][1].latents))
    finally:
        consumer.close()
        lifecycle.close()


def test_manager_reset_on_the_engine_restarts_the_session_from_its_first_block(engine):
    recorder = GenerateRecorder(engine)
    consumer = EngineTickConsumer(engine)
    lifecycle = EngineSessionLifecycle(engine)

    async def scenario():
        manager = ARDiffusionSessionManager(tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=4)
        session = await manager.create_session("world-6")
        await session.accept_event(event(1, "a red car"))
        await session.next_chunk()
        await session.next_chunk()
        assert engine.sessions == ("world-6",)
        await manager.reset_session("world-6")
        assert "world-6" not in engine.sessions and session.chunk_index == 0
        await session.accept_event(event(2, "a red car"))
        await session.next_chunk()
        await manager.disconnect("world-6")
        assert engine.sessions == ()

    try:
        run(scenario())
        first, second, restarted = recorder.outputs
        assert (first.block_index, second.block_index, restarted.block_index) == (0, 1, 0)
        assert np.array_equal(np.asarray(first.latents), np.asarray(restarted.latents))
        assert not np.array_equal(np.asarray(first.latents), np.asarray(second.latents))
    finally:
        consumer.close()
        lifecycle.close()
