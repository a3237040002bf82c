"""The realtime control plane's lifecycles, cancellation, reducer failures and wiring checks.

Scenario 84 of the reference suite (the worker lifecycle's RPC, exactly), cancellation of a
chunk before and after its tick succeeded, the executor the in-process consumer and
lifecycle share, and the refusals of wrongly wired collaborators.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from ardiff_jax.realtime import (
    ARDiffusionPreparedControls,
    ARDiffusionSession,
    ARDiffusionSessionError,
    ARDiffusionSessionEvent,
    ARDiffusionSessionManager,
    ARDiffusionSessionStatus,
    ARDiffusionWorkerLifecycle,
    EngineSessionLifecycle,
    EngineTickConsumer,
)
from ardiff_jax.types import ARDiffusionChunkMetadata


class RPC:
    def __init__(self, reply):
        self.reply = reply
        self.calls = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None, stage_ids=None):
        self.calls.append({"method": method, "timeout": timeout, "args": args, "stage_ids": stage_ids})
        return self.reply


class Lifecycle:
    def __init__(self):
        self.calls = []

    async def reset_session(self, session_id):
        self.calls.append(("reset", session_id))

    async def close_session(self, session_id):
        self.calls.append(("close", session_id))


class EchoConsumer:
    """Returns the tick itself; reports its exact metadata."""

    def __init__(self):
        self.ticks = []

    async def execute_tick(self, tick):
        self.ticks.append(tick)
        await asyncio.sleep(0)
        return tick

    def chunk_metadata(self, output):
        return ARDiffusionChunkMetadata.from_tick(output)


def test_worker_lifecycle_calls_collective_rpc_exactly():
    async def scenario():
        rpc = RPC([True, [True], {"result": True}])
        lifecycle = ARDiffusionWorkerLifecycle(rpc, stage_ids=[0, 2], timeout=3.5)
        await lifecycle.reset_session("s")
        await lifecycle.close_session("s")
        assert rpc.calls == [
            {"method": "reset_ar_diffusion_session", "timeout": 3.5, "args": ("s",), "stage_ids": [0, 2]},
            {"method": "close_ar_diffusion_session", "timeout": 3.5, "args": ("s",), "stage_ids": [0, 2]},
        ]

    asyncio.run(scenario())


@pytest.mark.parametrize("reply, match", [
    ({"supported": False, "error": "not an AR stage"}, "close_ar_diffusion_session failed: not an AR stage"),
    ([True, False], "not supported by every selected worker"),
    ([], "not supported by every selected worker"),
    ({"supported": True}, "not supported by every selected worker"),
])
def test_worker_lifecycle_refuses_anything_but_every_worker_succeeding(reply, match):
    async def scenario():
        with pytest.raises(ARDiffusionSessionError, match=match):
            await ARDiffusionWorkerLifecycle(RPC(reply), stage_ids=[1]).close_session("s")

    asyncio.run(scenario())


@pytest.mark.parametrize("stage_ids", [[], [-1], [True], "0", [1.0]])
def test_worker_lifecycle_refuses_bad_stage_ids(stage_ids):
    with pytest.raises(ValueError, match="stage"):
        ARDiffusionWorkerLifecycle(RPC([True]), stage_ids=stage_ids)


def test_worker_lifecycle_refuses_a_client_without_collective_rpc():
    with pytest.raises(TypeError, match="collective_rpc"):
        ARDiffusionWorkerLifecycle(object(), stage_ids=[0])


def test_a_cancel_after_the_tick_succeeded_still_commits():
    class CancelledAsItReturns(EchoConsumer):
        async def execute_tick(self, tick):
            await asyncio.sleep(0)
            asyncio.current_task().cancel()  # the transport goes away as the chunk comes back
            return tick

    async def scenario():
        lifecycle = Lifecycle()
        session = ARDiffusionSession("s", tick_consumer=CancelledAsItReturns(), lifecycle=lifecycle,
                                     max_pending_events=2)
        await session.accept_event(ARDiffusionSessionEvent(1, prompt="p"))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(session.next_chunk())
        assert (session.status, session.chunk_index, session.pending_event_count) == (
            ARDiffusionSessionStatus.ACTIVE, 1, 0)
        assert lifecycle.calls == []

    asyncio.run(scenario())


def test_a_cancel_during_the_tick_fails_the_session_and_closes_it():
    class Hang(EchoConsumer):
        def __init__(self):
            super().__init__()
            self.started = asyncio.Event()

        async def execute_tick(self, tick):
            self.started.set()
            await asyncio.Event().wait()

    async def scenario():
        consumer, lifecycle = Hang(), Lifecycle()
        session = ARDiffusionSession("s", tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=2)
        await session.accept_event(ARDiffusionSessionEvent(1, prompt="p"))
        task = asyncio.create_task(session.next_chunk())
        await asyncio.wait_for(consumer.started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert session.status == ARDiffusionSessionStatus.FAILED
        assert session.chunk_index == 0 and session.pending_event_count == 1
        assert lifecycle.calls == [("close", "s")]
        await session.reset()
        assert session.status == ARDiffusionSessionStatus.ACTIVE

    asyncio.run(scenario())


class Reducer:
    def __init__(self, fail_prepare=False, fail_reset=False):
        self.fail_prepare, self.fail_reset = fail_prepare, fail_reset
        self.resets = 0

    def prepare(self, *, current_controls, events, chunk_index):
        if self.fail_prepare:
            raise RuntimeError("prepare failed")
        return ARDiffusionPreparedControls(controls=())

    def commit(self, prepared):
        pass

    def reset(self):
        self.resets += 1
        if self.fail_reset:
            raise RuntimeError("reducer reset failed")


def test_a_failing_reducer_prepare_changes_nothing():
    async def scenario():
        consumer, lifecycle = EchoConsumer(), Lifecycle()
        session = ARDiffusionSession("s", tick_consumer=consumer, lifecycle=lifecycle, max_pending_events=2,
                                     control_reducer=Reducer(fail_prepare=True))
        await session.accept_event(ARDiffusionSessionEvent(1, prompt="p"))
        with pytest.raises(RuntimeError, match="prepare failed"):
            await session.next_chunk()
        assert (session.status, session.chunk_index, session.pending_event_count) == (
            ARDiffusionSessionStatus.ACTIVE, 0, 1)
        assert consumer.ticks == [] and lifecycle.calls == []

    asyncio.run(scenario())


def test_a_failing_reducer_reset_leaves_the_session_failed_and_retryable():
    async def scenario():
        reducer = Reducer(fail_reset=True)
        session = ARDiffusionSession("s", tick_consumer=EchoConsumer(), lifecycle=Lifecycle(), max_pending_events=2,
                                     control_reducer=reducer)
        await session.accept_event(ARDiffusionSessionEvent(1, prompt="p"))
        with pytest.raises(RuntimeError, match="reducer reset failed"):
            await session.reset()
        assert session.status == ARDiffusionSessionStatus.FAILED
        reducer.fail_reset = False
        await session.reset()
        assert session.status == ARDiffusionSessionStatus.ACTIVE and session.pending_event_count == 0

    asyncio.run(scenario())


def test_wrongly_wired_collaborators_are_refused():
    with pytest.raises(TypeError):
        ARDiffusionSession("s", tick_consumer=object(), lifecycle=Lifecycle(), max_pending_events=2)
    with pytest.raises(TypeError):
        ARDiffusionSession("s", tick_consumer=EchoConsumer(), lifecycle=object(), max_pending_events=2)
    with pytest.raises(TypeError):
        ARDiffusionSessionManager(tick_consumer=EchoConsumer(), lifecycle=object(), max_pending_events=2)
    with pytest.raises(TypeError, match="generate"):
        EngineTickConsumer(object())
    with pytest.raises(TypeError, match="reset_session"):
        EngineSessionLifecycle(object())
    with pytest.raises(TypeError, match="Executor"):
        EngineSessionLifecycle(_FakeEngine(), executor="threads")


class _FakeEngine:
    """Records which thread each call ran on."""

    def __init__(self):
        self.calls = []

    def generate(self, request):
        raise NotImplementedError

    def reset_session(self, session_id):
        self.calls.append(("reset", session_id, threading.current_thread().name))

    def close_session(self, session_id):
        self.calls.append(("close", session_id, threading.current_thread().name))


def test_the_engine_lifecycle_runs_off_the_event_loop_and_a_shared_executor_stays_open():
    async def scenario(lifecycle):
        await lifecycle.reset_session("a")
        await lifecycle.close_session("a")

    engine = _FakeEngine()
    shared = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shared-engine")
    lifecycle = EngineSessionLifecycle(engine, executor=shared)
    asyncio.run(scenario(lifecycle))
    assert [(kind, sid) for kind, sid, _ in engine.calls] == [("reset", "a"), ("close", "a")]
    assert all(name.startswith("shared-engine") for _, _, name in engine.calls)
    lifecycle.close()
    assert shared.submit(lambda: 1).result() == 1  # a shared executor is the caller's to shut down
    shared.shutdown()
    own = EngineSessionLifecycle(engine)
    asyncio.run(scenario(own))
    assert engine.calls[-1][2] != threading.current_thread().name
    own.close()
    with pytest.raises(RuntimeError):
        own.executor.submit(lambda: 1)  # its own executor is shut down
