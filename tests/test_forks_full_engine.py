"""Forks on a full engine and ``offload_session`` (issue 47, item 4).

With host offload on, a fork on a full engine makes room as a new session does: the least
recently used sessions other than the source move to the host tier, and every session continues
exactly (compared with a replay, as ``test_forks.py`` does). Without offload the fork is refused
and nothing changes. ``engine.offload_session(id)`` moves the session the user chooses.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_forks import OTHER, PREFIX, SUFFIX, _check_counts, _engine, _play, _replay, modules, replayed  # noqa: F401

from ardiff_jax.runtime._router import ARDiffusionRouter

OFFLOAD = 1 << 26  # 82 sprite sessions


def _snapshot(engine) -> tuple:
    kv = engine.runner.kv_cache
    return engine.sessions, engine.offloaded_sessions, kv.pages_in_use, kv.num_free_slots, engine.runner.host_tier.bytes_used


def test_a_fork_on_a_full_engine_with_offload_moves_the_least_recently_used_session_to_host(modules, replayed):
    with _engine(modules, capacity=2, host_offload_bytes=OFFLOAD) as engine:
        events = []
        engine.runner.add_session_listener(events.append)
        _replay(engine, "x", PREFIX)
        _replay(engine, "a", PREFIX)  # x is the least recently used; a the source
        engine.fork_session("a", "b")
        assert set(engine.sessions) == {"a", "b"} and engine.offloaded_sessions == ("x",)
        assert [(e.kind, e.session_id, e.reason) for e in events[-2:]] == [
            ("offloaded", "x", "lru_eviction"), ("created", "b", "fork")]
        _check_counts(engine)
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX[:2]), replayed["suffix"][:2])
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX), replayed["suffix"])  # restored: nothing lost
        _check_counts(engine)


def test_the_least_recently_used_session_goes_even_when_it_is_the_source_that_was_used_last_but_one(modules,
                                                                                                  replayed):
    # The source is the least recently used: it stays resident and the next one goes instead.
    with _engine(modules, capacity=2, host_offload_bytes=OFFLOAD) as engine:
        _replay(engine, "a", PREFIX)
        _replay(engine, "x", PREFIX)
        engine.fork_session("a", "b")
        assert set(engine.sessions) == {"a", "b"} and engine.offloaded_sessions == ("x",)
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX), replayed["suffix"])


def test_an_offloaded_source_on_a_full_engine_is_restored_beside_its_fork(modules, replayed):
    with _engine(modules, capacity=2, host_offload_bytes=OFFLOAD) as engine:
        _replay(engine, "a", PREFIX)
        _replay(engine, "x", PREFIX)
        _replay(engine, "y", PREFIX)  # a goes to host; x and y fill the engine
        assert engine.offloaded_sessions == ("a",)
        engine.fork_session("a", "b")  # two slots: x and y both go to host
        assert set(engine.sessions) == {"a", "b"} and set(engine.offloaded_sessions) == {"x", "y"}
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])
        np.testing.assert_array_equal(_play(engine, "y", SUFFIX[:3]), replayed["suffix"][:3])
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX), replayed["suffix"])
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX), replayed["suffix"])
        _check_counts(engine)


def test_without_offload_a_fork_on_a_full_engine_is_still_refused_and_changes_nothing(modules, replayed):
    with _engine(modules, capacity=2) as engine:
        _replay(engine, "x", PREFIX)
        _replay(engine, "a", PREFIX)
        before = _snapshot(engine)
        with pytest.raises(RuntimeError, match="free slot.*host offload"):
            engine.fork_session("a", "b")
        assert _snapshot(engine) == before
        with pytest.raises(RuntimeError, match="host offload is off"):
            engine.offload_session("x")
        assert _snapshot(engine) == before
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX[:2]), replayed["suffix"][:2])
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX[:2]), replayed["suffix"][:2])


def test_a_fork_whose_room_would_drop_a_host_session_is_refused_and_changes_nothing(modules, replayed):
    with _engine(modules, capacity=2) as probe:
        one_session = probe.memory_plan.offload_bytes_per_session
    with _engine(modules, capacity=2, host_offload_bytes=one_session) as engine:
        _replay(engine, "x", PREFIX)
        _replay(engine, "a", PREFIX)
        _replay(engine, "y", PREFIX)  # x to host: the tier is full
        assert engine.offloaded_sessions == ("x",)
        before = _snapshot(engine)
        with pytest.raises(RuntimeError, match="would drop sessions it holds"):
            engine.fork_session("a", "b")
        with pytest.raises(RuntimeError, match="would drop sessions it holds"):
            engine.offload_session("y")
        assert _snapshot(engine) == before
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX), replayed["suffix"])  # the new session's way


def test_offload_session_moves_the_chosen_session_and_it_continues_exactly(modules, replayed):
    with _engine(modules, capacity=3, host_offload_bytes=OFFLOAD) as engine:
        events = []
        engine.runner.add_session_listener(events.append)
        _replay(engine, "a", PREFIX)
        _replay(engine, "x", PREFIX)  # a is the least recently used; the user picks x instead
        engine.offload_session("x")
        assert engine.sessions == ("a",) and engine.offloaded_sessions == ("x",)
        assert (events[-1].kind, events[-1].session_id, events[-1].reason) == ("offloaded", "x", "requested")
        assert engine.runner.kv_cache.num_free_slots == 2
        _check_counts(engine)
        np.testing.assert_array_equal(_play(engine, "x", SUFFIX), replayed["suffix"])
        assert engine.offloaded_sessions == ()
        engine.fork_session("x", "b")
        engine.offload_session("x")  # a source whose fork shares its pages: both stay exact
        np.testing.assert_array_equal(_play(engine, "b", OTHER), replayed["after"])
        np.testing.assert_array_equal(_play(engine, "x", OTHER), replayed["after"])
        _check_counts(engine)


def test_offload_session_refusals_name_the_problem_and_change_nothing(modules):
    with _engine(modules, capacity=2, host_offload_bytes=OFFLOAD) as engine:
        _replay(engine, "a", PREFIX[:2])
        _replay(engine, "x", PREFIX[:2])
        engine.offload_session("x")
        before = _snapshot(engine)
        with pytest.raises(KeyError, match="'nobody' is not resident"):
            engine.offload_session("nobody")
        with pytest.raises(ValueError, match="offloaded already"):
            engine.offload_session("x")
        with pytest.raises(ValueError, match="session id"):
            engine.offload_session(" ")
        engine.runner._residency.stepwise_started["a"] = 0.0  # as execute_stepwise marks a chunk in flight
        try:
            with pytest.raises(RuntimeError, match="'a' has a block in flight"):
                engine.offload_session("a")
        finally:
            del engine.runner._residency.stepwise_started["a"]
        assert _snapshot(engine) == before
    with pytest.raises(RuntimeError, match="closed"):
        engine.offload_session("a")


def test_the_router_offloads_a_session_on_its_replica(modules):
    engines = [_engine(modules, capacity=2, host_offload_bytes=OFFLOAD) for _ in range(2)]
    with ARDiffusionRouter(engines) as router:
        _replay(router, "a", PREFIX[:2])
        router.offload_session("a")
        assert router.offloaded_sessions == ("a",) and router.sessions == ()
        with pytest.raises(KeyError, match="not resident"):
            router.offload_session("nobody")
        _play(router, "a", SUFFIX[:1])
        assert router.sessions == ("a",)
