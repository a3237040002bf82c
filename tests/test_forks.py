"""Forks: copy-on-write sessions that share their history (``engine.fork_session``).

Every fork test compares frames with a *replay*: the same actions from the same observation
in a fresh session of the same engine, one program, so equal means bit-equal. The sprite
world's geometry (sink 1, window 3, one frame a block) wraps the ring every three blocks, so
the tests run far past the window on both sides of the fork.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import count_compiles

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, SpriteWorldPipelineConfig, dit_preset

CONFIG = dict(dtype="float32", available_memory_bytes=1 << 30, gpu_memory_fraction=1.0, warmup=False)
OBSERVATION = SpriteWorld(seed=3).reset()
PREFIX = [1, 2, 3, 4, 0, 1, 2]  # seven blocks before the fork: the ring (3 frames) wrapped twice
SUFFIX = [3, 3, 1, 4, 2, 0]
OTHER = [4, 4, 2, 2, 1, 0]


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules, capacity=5, **fields) -> ARDiffusionEngine:
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity),
                                   modules=modules)
    return ARDiffusionEngine(pipeline, EngineConfig(**CONFIG, **fields))


def _request(sid: str, action: int, first: bool = False) -> DiffusionRequest:
    inputs = {"actions": np.array([action])}
    if first:  # the noise seed is explicit: by default it derives from the session id, which a replay changes
        inputs["observation"], inputs["seed"] = OBSERVATION, 7
    return DiffusionRequest(f"{sid}-{action}", extra_args={"session_id": sid}, inputs=inputs)


def _play(engine, sid: str, actions, *, first: bool = False) -> np.ndarray:
    frames = []
    for i, action in enumerate(actions):
        frames.append(np.asarray(engine.generate(_request(sid, action, first and i == 0)).latents))
    return np.stack(frames)


def _replay(engine, sid: str, actions) -> np.ndarray:
    """The frames a fresh session plays for ``actions`` (its first request carries the observation)."""
    return _play(engine, sid, actions, first=True)


def _check_counts(engine) -> None:
    """The page counts are exactly the resident sessions' tables (no leak, no double count)."""
    runner = engine.runner
    tables = [runner.session_table.get(sid)._value.pages for sid in runner.sessions]
    runner.kv_cache.page_pool.check_tables(table for value in tables for table in value)


@pytest.fixture(scope="module")
def replayed(modules):
    engine = _engine(modules)
    with engine:
        suffix = _replay(engine, "r1", PREFIX + SUFFIX)[len(PREFIX):]
        # "after": the same fresh session continued with OTHER (a second fresh replay of PREFIX + SUFFIX would
        # only recompute r1's thirteen blocks; one program, so bit-equal either way).
        return {"suffix": suffix, "after": _play(engine, "r1", OTHER),
                "other": _replay(engine, "r2", PREFIX + OTHER)[len(PREFIX):]}


def test_a_fork_is_free_and_both_sessions_continue_exactly(modules, replayed):
    with _engine(modules) as engine:
        _replay(engine, "a", PREFIX)
        kv = engine.runner.kv_cache
        pools, in_use = kv.pools, kv.pages_in_use
        with count_compiles() as compiles:
            engine.fork_session("a", "b")
        assert compiles == [] and kv.pools is pools and kv.pages_in_use == in_use  # no compile, no copy, no page
        assert kv.page_pool.shared_pages == in_use == 4  # sink + window pages, all shared
        np.testing.assert_array_equal(_play(engine, "b", OTHER), replayed["other"])
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX), replayed["suffix"])
        _check_counts(engine)


def test_n_forks_cost_the_pages_they_write_not_n_windows(modules):
    with _engine(modules) as engine:
        _replay(engine, "live", PREFIX)
        kv = engine.runner.kv_cache
        base = kv.pages_in_use
        for i in range(4):
            engine.fork_session("live", f"f{i}")
        assert kv.pages_in_use == base  # five sessions, one history
        for i in range(4):
            engine.generate(_request(f"f{i}", i))  # each writes one frame: one fresh page each
        assert kv.pages_in_use == base + 4 < 5 * base
        _check_counts(engine)


def test_forks_of_one_session_run_as_one_batched_forward_and_equal_one_by_one(modules, monkeypatch):
    with _engine(modules) as engine, _engine(modules) as reference:
        for e in (engine, reference):
            _replay(e, "live", PREFIX)
            for i in range(3):
                e.fork_session("live", f"f{i}")
        pipeline = engine.runner.pipeline
        calls = []
        original = pipeline.forward_batch
        monkeypatch.setattr(pipeline, "forward_batch", lambda requests: calls.append(len(requests))
                            or original(requests))
        for step, actions in enumerate(([1, 2, 3], [4, 0, 1], [2, 2, 2], [3, 1, 0])):
            batched = engine.generate_batch([_request(f"f{i}", a) for i, a in enumerate(actions)])
            alone = [reference.generate(_request(f"f{i}", a)) for i, a in enumerate(actions)]
            for got, want in zip(batched, alone, strict=True):
                np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), atol=1e-5)
        assert calls == [3, 3, 3, 3]
        _check_counts(engine)


@pytest.mark.parametrize("what", ["close", "reset"])
def test_closing_or_resetting_the_source_leaves_the_fork_intact_and_vice_versa(modules, replayed, what):
    with _engine(modules) as engine:
        _replay(engine, "a", PREFIX)
        engine.fork_session("a", "b")
        getattr(engine, f"{what}_session")("a")
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])
        engine.fork_session("b", "c")
        getattr(engine, f"{what}_session")("b")
        _check_counts(engine)
        _replay(engine, "d", [0, 1, 2, 3])  # a newcomer takes a freed slot: its pages are never the fork's
        np.testing.assert_array_equal(_play(engine, "c", OTHER), replayed["after"])
        _check_counts(engine)


def test_a_newcomer_in_the_sources_old_slot_never_writes_the_forks_pages(modules, replayed):
    with _engine(modules, capacity=2) as engine:
        _replay(engine, "a", PREFIX)
        engine.fork_session("a", "b")
        engine.close_session("a")
        _replay(engine, "c", [0, 1, 2, 3, 4])  # slot 0 again: its own pages are the fork's history
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])
        _check_counts(engine)


def test_evicting_offloading_and_saving_a_fork_keeps_both_exact(modules, replayed, tmp_path):
    with _engine(modules, capacity=2, host_offload_bytes=1 << 26) as engine:
        _replay(engine, "a", PREFIX)
        engine.fork_session("a", "b")
        _replay(engine, "c", [0])  # capacity 2: the least recently used, the fork, is offloaded with its shared pages
        assert engine.offloaded_sessions == ("b",)
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX[:2]), replayed["suffix"][:2])
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])  # restored: stands alone
        path = engine.save_session("a", tmp_path / "source.session")
        for sid in ("a", "b", "c"):
            engine.close_session(sid)
        engine.load_session(path, session_id="a2")
        np.testing.assert_array_equal(_play(engine, "a2", SUFFIX[2:]), replayed["suffix"][2:])
        engine.fork_session("a2", "b2")
        path = engine.save_session("b2", tmp_path / "fork.session")  # a fork's file holds its shared pages
        engine.close_session("a2")
        engine.close_session("b2")
        engine.load_session(path, session_id="b3")
        np.testing.assert_array_equal(_play(engine, "b3", OTHER), replayed["after"])
        _check_counts(engine)


def test_an_offloaded_source_is_restored_and_forked(modules, replayed):
    with _engine(modules, capacity=2, host_offload_bytes=1 << 26) as engine:
        _replay(engine, "a", PREFIX)
        _replay(engine, "x", [0])
        _replay(engine, "y", [0])  # a is offloaded
        engine.close_session("x")
        engine.close_session("y")
        engine.fork_session("a", "b")
        assert {"a", "b"} <= set(engine.sessions)
        np.testing.assert_array_equal(_play(engine, "b", SUFFIX), replayed["suffix"])


def test_a_fresh_noise_seed_gives_the_fork_another_future(modules, replayed):
    with _engine(modules) as engine:
        _replay(engine, "a", PREFIX)
        engine.fork_session("a", "same")
        engine.fork_session("a", "fresh", noise_seed=12345)
        np.testing.assert_array_equal(_play(engine, "same", SUFFIX[:2]), replayed["suffix"][:2])
        assert not np.array_equal(_play(engine, "fresh", SUFFIX[:2]), replayed["suffix"][:2])


def test_bad_forks_are_refused_and_change_nothing(modules):
    with _engine(modules, capacity=2) as engine:
        _replay(engine, "a", PREFIX)
        kv = engine.runner.kv_cache
        before = (engine.sessions, kv.pages_in_use, kv.num_free_slots)
        with pytest.raises(KeyError, match="neither resident nor offloaded"):
            engine.fork_session("nobody", "b")
        with pytest.raises(ValueError, match="is taken"):
            engine.fork_session("a", "a")
        with pytest.raises(ValueError, match="fork session id"):
            engine.fork_session("a", " ")
        with pytest.raises(ValueError, match="noise_seed"):
            engine.fork_session("a", "b", noise_seed=-1)
        assert (engine.sessions, kv.pages_in_use, kv.num_free_slots) == before
        engine.fork_session("a", "b")
        with pytest.raises(RuntimeError, match="free slot"):
            engine.fork_session("a", "c")  # full: forks never evict
        with pytest.raises(ValueError, match="is taken"):
            engine.fork_session("a", "b")
        assert set(engine.sessions) == {"a", "b"}
        _check_counts(engine)


def test_a_device_rollout_of_a_fork_copies_its_shared_slots_first_and_leaves_the_source_exact():
    """A device rollout writes through constant page tables, so the fork's shared slots get pages of their own
    (the still-visible history copied) before the scan: the source reads exactly what it read before."""
    import jax
    import jax.numpy as jnp

    from ardiff_jax import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
    from ardiff_jax.kv import gather_table_pages, visible_table
    from ardiff_jax.rollout import rollout_sessions
    from ardiff_jax.runtime import ARDiffusionKVCache, SessionKV, branch_cursor_array

    L, T, H, D = 2, 2, 2, 4
    spec = ARDiffusionKVCacheSpec(num_layers=L, num_kv_heads=H, head_size=D, tokens_per_frame=T, frames_per_block=2,
                                  window_frames=4, sink_frames=1, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=2)
    cache = ARDiffusionKVCache(spec, dtype=jnp.float32, available_memory_bytes=10**7, gpu_memory_fraction=1.0)
    layout = cache.layout
    rng = np.random.default_rng(0)

    def block() -> jax.Array:
        return jnp.asarray(rng.normal(size=(L, 2 * T, H, D)), jnp.float32)

    source = cache.create_state("a")
    for _ in range(3):  # six frames: the sink and a wrapped ring of four
        source.get_kv_caches("main", seq_len=2 * T, commit_current=True)
        source.commit_paged_context("main", kv=(block(), block()))
    value = source.snapshot()
    fork = cache.create_state("b")
    fork.restore(SessionKV(session_id="b", slot=fork.slot, cursors=value.cursors, cross_attention={},
                           run_owners=value.run_owners, pages=value.pages))

    def visible(state) -> np.ndarray:
        cursor = branch_cursor_array(spec, layout, state.snapshot(), "main")
        pages, _ = visible_table(layout, cursor, 2)
        return np.asarray(gather_table_pages(layout, cache.pools, pages).k)

    before = visible(source)
    np.testing.assert_array_equal(visible(fork), before)
    xs = jnp.stack([block() for _ in range(3)])

    def write(caches, x):
        return x, x, x

    rollout_sessions(cache, [fork], jax.tree_util.Partial(write), xs, [0, 0, 0], branch="main", num_frames=2)
    np.testing.assert_array_equal(visible(source), before)
    sink, *ring = fork.snapshot().pages[0]
    assert sink == value.pages[0][0] and not set(ring) & set(value.pages[0])  # only the unwritten sink is shared
    cache.page_pool.check_tables([table for state in (source, fork) for table in state.snapshot().pages])


def test_an_offloaded_source_restores_into_its_old_slot_while_its_fork_reads_those_pages(modules, replayed):
    """Issue 43, item 2: the host record (pinned host memory) goes back into free pages around the fork's shared
    ones; before the fix every try failed (``Memory kind mismatch``) for as long as the fork lived."""
    with _engine(modules, capacity=2, host_offload_bytes=1 << 26) as engine:
        _replay(engine, "a", PREFIX)
        engine.fork_session("a", "b")
        other = [_play(engine, "b", OTHER[:1])]  # b most recent: a is the one evicted next
        _replay(engine, "c", [0])  # a offloaded; c takes slot 0, whose pages b still reads
        assert engine.offloaded_sessions == ("a",)
        record = engine.runner.host_tier.get("a")
        assert record.pages.k.sharding.memory_kind == "pinned_host"  # the record the runtime makes, not numpy
        other.append(_play(engine, "b", OTHER[1:2]))  # c is now the least recently used
        np.testing.assert_array_equal(_play(engine, "a", SUFFIX), replayed["suffix"])  # c offloaded, a in slot 0
        state = engine.runner.session_table.get("a")
        homes = engine.runner.kv_cache.home_tables(state.slot)
        assert state.slot == 0 and state._value.pages != homes  # restored around the fork's pages
        other.append(_play(engine, "b", OTHER[2:]))
        np.testing.assert_array_equal(np.concatenate(other), replayed["other"])
        _check_counts(engine)


@pytest.mark.parametrize("capacity", [2, 3])
def test_a_session_and_its_fork_commit_as_one_batch_on_matrix_games_geometry(capacity):
    """Issue 43, item 8: no sink, a 4-frame window, 3-frame blocks (matrix-game-tiny, gta-drive). A session and
    its fork overwrite the same three shared pages; planned row by row each wanted three fresh pages (six) and the
    batch ran out ("no free page for a remapped slot"). Planned together, one keeps the pages and one batched write
    commits both, each row's frames in its own pages, the history neither overwrote still shared."""
    import jax.numpy as jnp

    from ardiff_jax import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
    from ardiff_jax.kv import gather_table_pages
    from ardiff_jax.runtime import ARDiffusionKVCache, SessionKV
    from ardiff_jax.runtime._batch import ARDiffusionKVBatch

    L, T, H, D, F = 2, 2, 1, 4, 3
    spec = ARDiffusionKVCacheSpec(num_layers=L, num_kv_heads=H, head_size=D, tokens_per_frame=T, frames_per_block=F,
                                  window_frames=4, sink_frames=0, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=capacity)
    cache = ARDiffusionKVCache(spec, dtype=jnp.float32, available_memory_bytes=10**7, gpu_memory_fraction=1.0)
    layout = cache.layout
    assert layout.num_pages == 4 * capacity
    rng = np.random.default_rng(0)

    def block() -> np.ndarray:
        return rng.normal(size=(L, F * T, H, D)).astype(np.float32)

    source = cache.create_state("S")
    for _ in range(2):  # six frames: the ring wrapped
        source.get_kv_caches("main", seq_len=F * T, commit_current=True)
        source.commit_paged_context("main", kv=(block(), block()))
    value = source.snapshot()
    fork = cache.create_state("F")
    fork.restore(SessionKV(session_id="F", slot=fork.slot, cursors=value.cursors, cross_attention={},
                           run_owners=value.run_owners, pages=value.pages))
    others = [cache.create_state(f"other{i}") for i in range(capacity - 2)]
    for other in others:  # every slot taken, each holding a block of its own
        other.get_kv_caches("main", seq_len=F * T, commit_current=True)
        other.commit_paged_context("main", kv=(block(), block()))
    ks, vs = [block(), block()], [block(), block()]
    batch = ARDiffusionKVBatch(cache, [source, fork], 2)
    batch._bound = True  # as the runner binds it for forward_batch
    batch.get_kv_caches("main", seq_len=F * T, commit_current=True)
    batch.commit_paged_context("main", kv=(jnp.stack(ks), jnp.stack(vs)))
    written = [int(s) for s in (6 % 4, 7 % 4, 8 % 4)]  # frames 6, 7, 8
    for state, k, v in ((source, ks[0], vs[0]), (fork, ks[1], vs[1])):
        assert state.adapter("main").committed_frames == 9
        table = state.snapshot().pages[0]
        got = gather_table_pages(layout, cache.pools, np.array([table[s] for s in written], np.int32))
        np.testing.assert_array_equal(np.asarray(got.k), k.reshape(L, F, T, H, D))
        np.testing.assert_array_equal(np.asarray(got.v), v.reshape(L, F, T, H, D))
    shared = 5 % 4  # frame 5: neither session overwrote it
    assert source.snapshot().pages[0][shared] == fork.snapshot().pages[0][shared] == value.pages[0][shared]
    assert cache.pages_in_use == 4 + F + F * (capacity - 2)  # the fork's three: all it wrote
    cache.page_pool.check_tables([table for state in (source, fork, *others) for table in state.snapshot().pages])
