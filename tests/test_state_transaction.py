"""The commit transaction owned by the state (issue 48 §2): plan (pure), dispatch, publish after the write returned;
reference counts change in one method; every public entry checks the session's page tables against the pool."""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_cache, pool_snapshot

from ardiff_jax.runtime import (
    ARDiffusionKVState,
    SessionKV,
    commit_planned,
    dispatch_commit,
    fork_session_kv,
    plan_commits,
    plan_rollout,
    publish_commit,
)

RUNTIME = pathlib.Path(__file__).resolve().parent.parent / "ardiff_jax" / "runtime"
L, H, D, T = 2, 2, 4, 2


def block(seed: int, frames: int = 2) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(L, frames * T, H, D)), jnp.float32)


def commit(state: ARDiffusionKVState, seed: int) -> None:
    state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
    state.commit_paged_context("main", kv=(block(seed), block(seed + 100)))


def fork(cache, source: ARDiffusionKVState, new_id: str) -> ARDiffusionKVState:
    """A fork as the residency makes one: a new slot holding the source's tables (shared pages)."""
    value = source.snapshot()
    state = cache.create_state(new_id)
    state.restore(SessionKV(session_id=new_id, slot=state.slot, cursors=value.cursors,
                            cross_attention=value.cross_attention, run_owners=value.run_owners, pages=value.pages))
    return state


def test_plan_commits_changes_nothing_and_commit_planned_is_the_state_commit_bit_for_bit():
    via_state, via_plan = make_cache(), make_cache()
    a, b = via_state.create_state("s"), via_plan.create_state("s")
    for seed in range(3):
        commit(a, seed)
        b.get_kv_caches("main", seq_len=2 * T, commit_current=True)
        before = (b.checkpoint(), via_plan.page_pool.version, via_plan.pools)
        plan = plan_commits([b], "main", 2)
        assert (b.checkpoint(), via_plan.page_pool.version, via_plan.pools) == before  # pure: nothing moved
        assert [f.tolist() for f in plan.frames] == [[2 * seed, 2 * seed + 1]]
        commit_planned(plan, block(seed), block(seed + 100))
    assert a.snapshot() == b.snapshot()
    for x, y in zip(pool_snapshot(via_state), pool_snapshot(via_plan), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_write_that_raises_publishes_nothing():
    cache = make_cache()
    state = cache.create_state("s")
    commit(state, 0)
    state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
    before = state.checkpoint()
    plan = plan_commits([state], "main", 2)
    with pytest.raises(Exception):  # noqa: B017 - whatever the device write raises, nothing is published
        commit_planned(plan, block(1)[:, :1], block(2)[:, :1])  # one token short of the planned block
    assert state.checkpoint() == before and state.has_pending_context("main")
    publish_commit(plan)  # the same plan, published by hand: the cursor moves, the context is cleared
    assert state.adapter("main").committed_frames == 4 and not state.has_pending_context("main")


def test_a_batched_plan_of_a_session_and_its_fork_keeps_each_shared_page_once():
    cache = make_cache(session_capacity=3)
    source = cache.create_state("s")
    commit(source, 0)
    copy = fork(cache, source, "f")
    for state in (source, copy):
        state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
    plan = plan_commits([source, copy], "main", 2)
    assert len({int(p) for pages in plan.pages for p in pages}) == 4  # no page written twice
    k = jnp.stack([block(1), block(2)])
    dispatch_commit(plan, k, k)
    publish_commit(plan)
    cache.page_pool.check_tables(table for state in (source, copy) for table in state.snapshot().pages)
    with pytest.raises(ValueError, match="needs batched k, v"):
        dispatch_commit(plan, block(1), block(1))
    other = make_cache().create_state("x")
    with pytest.raises(ValueError, match="one ARDiffusionKVCache"):
        plan_commits([source, other], "main", 2)


def test_plan_rollout_refuses_indices_outside_the_states_before_anything_moves():
    cache = make_cache()
    state = cache.create_state("s")
    before = state.checkpoint()
    for index in ([-1], [1], [[0]]):
        with pytest.raises(ValueError, match="session_index"):
            plan_rollout([state], "main", np.asarray(index), 2)
    plan = plan_rollout([state], "main", np.asarray([0, 0]), 2)
    assert plan.frames[0].tolist() == [0, 1, 2, 3] and state.checkpoint() == before


def test_a_table_naming_a_page_the_pool_does_not_hold_is_refused_at_every_public_entry_before_anything_moves():
    cache = make_cache()
    state = cache.create_state("s")
    commit(state, 0)
    value = state.snapshot()
    page = value.pages[0][0]
    cache.page_pool.exchange((), [page])  # a count lost behind the state's back (a bug elsewhere)
    pools, described = cache.pools, state.describe()
    entries = [
        lambda: state.get_kv_caches("main", seq_len=2 * T, commit_current=True),
        lambda: state.commit_paged_context("main", kv=(block(1), block(1))),
        lambda: state.rewrite_committed_context("main", 0, (block(1, 1), block(1, 1))),
        lambda: state.snapshot(),
        lambda: state.restore(value),
        lambda: state.has_pending_context("main"),
        lambda: state.clear_cross_attention(),
        lambda: state.checkpoint(),
    ]
    for entry in entries:
        with pytest.raises(RuntimeError, match=rf"names pages \[{page}\] the page pool does not hold"):
            entry()
        assert cache.pools is pools and state.describe() == described and cache.page_pool.count(page) == 0
    cache.page_pool.exchange([page], ())  # the count back: the same state is usable again
    commit(state, 1)
    assert state.adapter("main").committed_frames == 4


def test_reference_counts_change_in_one_method_called_from_one_place():
    """Only ``PagePool.exchange`` assigns the counts; only ``ARDiffusionKVState._publish`` calls it."""
    pages = ast.parse((RUNTIME / "_pages.py").read_text(encoding="utf-8"))
    assigners = {fn.name for fn in ast.walk(pages) if isinstance(fn, ast.FunctionDef)
                 for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AugAssign))
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 for sub in ast.walk(target) if isinstance(sub, ast.Attribute) and sub.attr == "_counts"}
    assert assigners == {"__init__", "exchange"}
    callers = set()
    for path in sorted(RUNTIME.glob("*.py")) + [RUNTIME.parent / "rollout.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                            and node.func.attr in ("exchange", "hold", "drop"):
                        callers.add(f"{path.name}:{fn.name}")
    assert callers == {"_state.py:_publish"}


def test_a_fork_is_planned_from_the_source_value_and_made_by_one_cache_call():
    cache = make_cache(session_capacity=3)
    source = cache.create_state("s")
    commit(source, 0)
    source.get_kv_caches("main", seq_len=2 * T, commit_current=False)  # a pending probe: the fork starts without
    value = source.checkpoint().value
    planned = fork_session_kv(value, "f", 2)
    assert (planned.session_id, planned.slot, planned.pages, planned.cursors) == ("f", 2, value.pages, value.cursors)
    copy = cache.fork_state(source, "f")
    assert copy.snapshot() == fork_session_kv(value, "f", copy.slot) and not copy.has_pending_context("main")
    assert all(cache.page_pool.count(page) == 2 for table in value.pages for page in table if page != cache.layout.null_page)
    # Refused, changing nothing: an id taken; a fork whose source's tables the pool no longer holds frees its slot.
    free = cache.num_free_slots
    with pytest.raises(ValueError, match="already has an open state"):
        cache.fork_state(source, "f")
    page = value.pages[0][0]
    cache.page_pool.exchange((), [page, page])
    with pytest.raises(RuntimeError, match="the page pool does not hold"):
        cache.fork_state(source, "g")
    assert cache.num_free_slots == free and cache.get_state("g") is None
