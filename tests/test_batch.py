"""Batched ticks: one forward serves many sessions (``engine.generate_batch``).

Every batched result is compared with the same requests run one by one on a second engine
(same weights): sessions at mixed fill levels, ring wrap, resets, new sessions, and
sessions evicted to the host tier and restored into a batch. Also: the kernels under the
batch (one write for many rows, padded rows that read and write nothing), no compilation
after warmup across batch compositions, a fault injected into one session of a batch, a
sabotaged restore of one offloaded session of a batch (only it fails, left as ``generate``
leaves it), a full host tier that never drops one of the batch's own sessions, and the
refusals (a repeated session, a batch over capacity) that change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.capability import SupportsARDiffusionBatch
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.kv import (
    KVLayout,
    KVPools,
    PagedKVCaches,
    contiguous_table_cursor,
    make_table_cursor,
    paged_attention,
    ref_paged_attention,
    write_block,
    write_blocks,
)
from ardiff_jax.models import (
    DiTModules,
    SpriteWorldPipeline,
    SpriteWorldPipelineConfig,
    dit_preset,
)
from ardiff_jax.runtime import ARDiffusionBatchError, batch_buckets, bucket_for
from ardiff_jax.runtime._batch import SessionRestoreError

CONFIG = {"dtype": "float32", "available_memory_bytes": 2**28, "gpu_memory_fraction": 1.0}
OBSERVATIONS = [SpriteWorld(seed, size=32).reset() for seed in range(6)]


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules, capacity=3, pipeline_cls=SpriteWorldPipeline, warmup=False, **fields):
    pipeline = pipeline_cls("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity), modules=modules)
    return pipeline, ARDiffusionEngine(pipeline, EngineConfig(**CONFIG, warmup=warmup, **fields))


def _request(sid, action, *, new=False, reset=False, close=False):
    inputs = {"actions": np.array([action % 5])}
    if new:
        inputs["observation"] = OBSERVATIONS[ord(sid[-1]) % len(OBSERVATIONS)]
    return DiffusionRequest(f"{sid}-{action}", extra_args={"session_id": sid, "reset": reset, "close_session": close},
                            inputs=inputs)


def _assert_same(batched, sequential):
    assert len(batched) == len(sequential)
    for got, want in zip(batched, sequential, strict=True):
        np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(got.frames, want.frames)
        assert (got.first_frame, got.block_index) == (want.first_frame, want.block_index)


def _cursors(engine):
    table = engine.runner.session_table
    return {sid: table.get(sid).describe()["branches"] for sid in engine.sessions}


# -- the kernels under a batch ---------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=2, num_pages=12, tokens_per_frame=2, num_kv_heads=2, head_size=4, sink_frames=1,
                  window_frames=3, frames_per_block=1, scratch_pages=2)


def _pools(seed=0):
    rng = np.random.default_rng(seed)
    return KVPools(k=jnp.asarray(rng.normal(size=LAYOUT.pool_shape), jnp.float32),
                   v=jnp.asarray(rng.normal(size=LAYOUT.pool_shape), jnp.float32))


def test_buckets_are_powers_of_two_up_to_capacity():
    assert batch_buckets(1) == ()
    assert batch_buckets(2) == (2,)
    assert batch_buckets(8) == (2, 4, 8)
    assert batch_buckets(12) == (2, 4, 8, 12)
    assert [bucket_for(n, batch_buckets(12)) for n in (2, 3, 5, 9, 12)] == [2, 4, 8, 12, 12]
    with pytest.raises(ValueError, match="exceeds the largest batch bucket"):
        bucket_for(13, batch_buckets(12))


def test_write_blocks_equals_one_write_per_row_and_padded_rows_write_nothing():
    pools = _pools()
    rng = np.random.default_rng(1)
    # Host inputs and jitted writes: eagerly every slice and scatter op compiled a program of its own.
    k = rng.normal(size=(3, 2, 2, 2, 4)).astype(np.float32)  # [B, L, f*T, H, D]
    v = rng.normal(size=(3, 2, 2, 2, 4)).astype(np.float32)
    pages = np.array([[5], [9], [LAYOUT.null_page]], np.int32)  # the third row is padding
    batched = jax.jit(write_blocks, static_argnums=0)(LAYOUT, pools, pages, k, v)
    expected = pools
    for row in range(2):
        expected = jax.jit(write_block, static_argnums=0)(LAYOUT, expected, pages[row], k[row], v[row])
    np.testing.assert_array_equal(np.asarray(batched.k), np.asarray(expected.k))
    np.testing.assert_array_equal(np.asarray(batched.v), np.asarray(expected.v))


@pytest.mark.parametrize("rowwise", [False, True], ids=["vmapped", "row-by-row"])
def test_batched_view_attends_each_row_to_its_own_run_and_padding_reads_nothing(rowwise, monkeypatch):
    from ardiff_jax.kv import _caches

    # Large rows run one after another (lax.map), small ones vmapped: force each path.
    monkeypatch.setattr(_caches, "ROWWISE_SCORE_BYTES", 0 if rowwise else 2**62)
    pools = _pools(2)
    rng = np.random.default_rng(3)
    # Row 0: fresh; row 1: partly filled; row 2: wrapped ring; row 3: padding (reads nothing).
    padding = make_table_cursor(0, 0, 0, [LAYOUT.null_page] * LAYOUT.run_pages)  # the runtime's padding row
    cursors = np.stack([contiguous_table_cursor(LAYOUT, 0, 0, 0), contiguous_table_cursor(LAYOUT, 4, 2, 0),
                        contiguous_table_cursor(LAYOUT, 8, 7, 0), padding])
    q = jnp.asarray(rng.normal(size=(4, 2, 4, 4)), jnp.float32)  # [B, S, Hq, D]
    k = jnp.asarray(rng.normal(size=(4, 2, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(4, 2, 2, 4)), jnp.float32)
    caches = PagedKVCaches(pools=pools, cursor=cursors, layout=LAYOUT, seq_len=2)
    assert caches.batch_size == 4
    out = jax.jit(jax.vmap(lambda c, q, k, v: c.attend(1, q, k, v), in_axes=(caches.vmap_axes(), 0, 0, 0)))(
        caches, q, k, v)
    # The references jitted (static layout): eagerly each of their ops compiled a program of its own.
    ref_jit, alone_jit = jax.jit(ref_paged_attention, static_argnums=0), jax.jit(paged_attention, static_argnums=0)
    for row in range(4):
        want = ref_jit(LAYOUT, pools, cursors[row], 1, q[row], k[row], v[row])
        np.testing.assert_allclose(np.asarray(out[row]), np.asarray(want), rtol=1e-5, atol=1e-5)
        alone = np.asarray(alone_jit(LAYOUT, pools, cursors[row], 1, q[row], k[row], v[row]))
        if rowwise:  # each row is exactly the unbatched program
            np.testing.assert_array_equal(np.asarray(out[row]), alone)
        else:
            np.testing.assert_allclose(np.asarray(out[row]), alone, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="batched view"):
        caches.attend(1, q[0], k[0], v[0])


# -- generate_batch == generate, one by one ----------------------------------------------------------

#: (session, new, reset) rows per tick: mixed fill levels, new sessions joining, ring wrap (window 3),
#: a reset, more sessions than the capacity of 3 (eviction to the host tier and restore into a batch).
SCHEDULE = [
    [("s0", True, False)],
    [("s0", False, False), ("s1", True, False)],
    [("s1", False, False), ("s2", True, False), ("s0", False, False)],
    [("s2", False, False), ("s0", False, False), ("s1", False, False)],
    [("s3", True, False), ("s0", False, False)],  # s3 evicts s2 (least recent outside the batch) to the host
    [("s2", False, False), ("s1", False, False), ("s3", False, False)],  # s2 restored into the batch
    [("s0", True, True), ("s2", False, False)],  # s0 (offloaded) reset by the engine, restarted with reset=True
    [("s0", False, False), ("s2", False, False), ("s3", False, False)],
    [("s3", False, False), ("s0", False, False), ("s2", False, False)],
]


def test_batches_equal_the_same_requests_one_by_one(modules):
    _, sequential = _engine(modules, host_offload_bytes=2**26)
    pipeline, batched = _engine(modules, host_offload_bytes=2**26)
    assert batched.runner.supports_batched_forward and isinstance(pipeline, SupportsARDiffusionBatch)
    offloaded_at_some_point = set()
    for tick, rows in enumerate(SCHEDULE):
        for sid, _, reset in rows:
            if reset:  # the sprite world takes a new observation only on a fresh session
                sequential.reset_session(sid)
                batched.reset_session(sid)
        requests = [_request(sid, tick + i, new=new, reset=reset) for i, (sid, new, reset) in enumerate(rows)]
        want = [sequential.generate(request) for request in requests]
        got = batched.generate_batch(requests)
        _assert_same(got, want)
        assert set(batched.sessions) >= {sid for sid, _, _ in rows}
        offloaded_at_some_point |= set(batched.offloaded_sessions)
    assert {"s2", "s0"} <= offloaded_at_some_point  # restored into later batches
    # Every session's KV went through the ring several times and still matches.
    assert max(c["main"]["committed_frames"] for c in _cursors(batched).values()) > 5
    sequential.close()
    batched.close()


class _NotBatchable(SpriteWorldPipeline):
    """Changes forward without a forward_batch of its own: the engine must run its batches one by one."""

    def forward(self, request):
        return super().forward(request)


def test_a_pipeline_without_the_protocol_runs_batches_one_by_one(modules):
    assert _NotBatchable.forward_batch is None and not _NotBatchable.supports_batched_forward
    pipeline, engine = _engine(modules, pipeline_cls=_NotBatchable)
    _, sequential = _engine(modules)
    assert not isinstance(pipeline, SupportsARDiffusionBatch) and not engine.runner.supports_batched_forward
    for tick in range(3):
        requests = [_request(sid, tick, new=tick == 0) for sid in ("s1", "s2")]
        _assert_same(engine.generate_batch(requests), [sequential.generate(r) for r in requests])
    engine.close()
    sequential.close()


def test_no_compilation_after_warmup_across_batch_compositions(modules):
    pipeline, engine = _engine(modules, capacity=3, warmup=True)
    assert engine.batch_buckets == (2, 3)
    assert not engine.sessions and not pipeline.session_ids  # warmup sessions released
    ticks = [  # sizes 1-3 in buckets 2 and 3; new sessions evict the least recent one outside the batch
        [("a", True)],
        [("a", False), ("b", True)],
        [("b", False), ("c", True), ("a", False)],
        [("d", True), ("c", False), ("b", False)],  # evicts a
        [("a", True), ("d", False)],  # a starts over; evicts c
        [("e", True), ("b", False), ("a", False)],  # evicts d
        [("c", True), ("e", False)],
    ]
    with count_compiles() as compiles:
        for tick, rows in enumerate(ticks):
            engine.generate_batch([_request(sid, tick, new=new, reset=new) for sid, new in rows])
    assert compiles == []
    engine.close()


# -- failures -------------------------------------------------------------------------------------


class _Faulty(SpriteWorldPipeline):
    """Fails a block of a chosen session *after* its commit, batched or not."""

    bad: frozenset[str] = frozenset()

    def forward_batch(self, requests):
        return super().forward_batch(requests)

    def _advance_batch(self, batch, sessions):
        blocks = super()._advance_batch(batch, sessions)  # committed every row already
        if self.bad & set(batch.session_ids):
            raise RuntimeError("injected fault in the batch")
        return blocks

    def _advance(self, state, session):
        block = super()._advance(state, session)
        if state.session_id in self.bad:
            raise RuntimeError(f"injected fault in session {state.session_id}")
        return block


def test_a_fault_in_one_session_releases_it_only_and_the_others_equal_unbatched(modules):
    pipeline, engine = _engine(modules, pipeline_cls=_Faulty)
    reference, sequential = _engine(modules, pipeline_cls=_Faulty)
    events = []
    engine.runner.add_session_listener(events.append)
    ids = ("s1", "s2", "s3")
    for tick in range(2):
        requests = [_request(sid, tick, new=tick == 0) for sid in ids]
        _assert_same(engine.generate_batch(requests), [sequential.generate(r) for r in requests])
    pipeline.bad = reference.bad = frozenset({"s2"})
    requests = [_request(sid, 2) for sid in ids]
    with pytest.raises(ARDiffusionBatchError) as raised:
        engine.generate_batch(requests)
    error = raised.value
    assert set(error.errors) == {"s2"} and "injected fault in session s2" in str(error.errors["s2"])
    assert error.outputs[1] is None
    want = [sequential.generate(requests[0]), None, sequential.generate(requests[2])]
    with pytest.raises(RuntimeError, match="injected fault in session s2"):
        sequential.generate(requests[1])
    _assert_same([error.outputs[0], error.outputs[2]], [want[0], want[2]])
    assert set(engine.sessions) == {"s1", "s3"} and "s2" not in pipeline.session_ids
    assert any(e.kind == "released" and e.session_id == "s2" and e.reason == "forward_exception" for e in events)
    assert _cursors(engine) == _cursors(sequential)
    # The survivors go on exactly as their unbatched twins; the failed session starts over.
    pipeline.bad = reference.bad = frozenset()
    for tick in (3, 4):
        requests = [_request("s1", tick), _request("s2", tick, new=tick == 3), _request("s3", tick)]
        _assert_same(engine.generate_batch(requests), [sequential.generate(r) for r in requests])
    engine.close()
    sequential.close()


@pytest.mark.parametrize("sabotage", ["page_write", "restore_import", "validation_import"])
def test_a_failed_restore_in_a_batch_fails_its_session_only(modules, monkeypatch, sabotage):
    """s2 is offloaded and its restore is sabotaged: s1 and s3 complete as if run alone, s2 alone fails.

    ``page_write``: its pages cannot be written back (before the import): it stays offloaded, unchanged, and
    continues exactly later. ``restore_import`` / ``validation_import``: the pipeline refuses its model state
    (at the restore, or already when its request is validated): it is released with its close hook, as
    ``generate`` leaves it.
    """
    pipeline, engine = _engine(modules, capacity=3, host_offload_bytes=2**26)
    _, sequential = _engine(modules, capacity=4)
    events = []
    engine.runner.add_session_listener(events.append)

    def run(requests):
        _assert_same(engine.generate_batch(requests), [sequential.generate(r) for r in requests])

    run([_request(sid, 0, new=True) for sid in ("s1", "s2", "s3")])
    run([_request("s1", 1), _request("s3", 1), _request("s4", 1, new=True)])  # s4 evicts s2 to the host tier
    assert engine.offloaded_sessions == ("s2",) and engine.sessions == ("s1", "s3", "s4")
    cache = engine.runner.kv_cache
    if sabotage == "page_write":
        monkeypatch.setattr(cache, "write_slot", lambda slot, pages: (_ for _ in ()).throw(RuntimeError("H2D failed")))
    else:
        real_import, imports = pipeline.import_ar_diffusion_session, []

        def import_(sid, state):  # the validation's import comes first, the restore's second
            imports.append(sid)
            if len(imports) == (1 if sabotage == "validation_import" else 2):
                raise ValueError("not a state this pipeline exported")
            real_import(sid, state)

        monkeypatch.setattr(pipeline, "import_ar_diffusion_session", import_)
    requests = [_request(sid, 2) for sid in ("s1", "s2", "s3")]
    with pytest.raises(ARDiffusionBatchError) as raised:
        engine.generate_batch(requests)
    monkeypatch.undo()
    error = raised.value
    assert list(error.errors) == ["s2"] and error.outputs[1] is None
    failure = error.errors["s2"]
    assert isinstance(failure, SessionRestoreError) and failure.session_id == "s2"
    assert "'s2' could not be restored" in str(failure) and "'s2'" in str(error)
    assert ("H2D failed" if sabotage == "page_write" else "not a state this pipeline exported") in str(failure)
    _assert_same([error.outputs[0], error.outputs[2]], [sequential.generate(requests[0]),
                                                        sequential.generate(requests[2])])
    released = [(e.session_id, e.reason) for e in events if e.kind == "released"]
    if sabotage == "page_write":  # offloaded as before, no close hook; s4 made room for it and stays offloaded
        assert failure.offloaded and "still offloaded" in str(failure)
        assert engine.sessions == ("s1", "s3") and set(engine.offloaded_sessions) == {"s2", "s4"}
        assert released == [] and "s2" not in pipeline.session_ids
        run([_request(sid, 3) for sid in ("s1", "s2", "s3")])  # s2 continues exactly (its failed block never ran)
    else:  # released with its close hook; its next request starts it anew
        assert not failure.offloaded and "released" in str(failure)
        assert "s2" not in engine.sessions + engine.offloaded_sessions and "s2" not in pipeline.session_ids
        assert released == [("s2", "restore_failed")]
        assert engine.sessions[-2:] == ("s1", "s3")
        sequential.close_session("s2")
        run([_request("s1", 3), _request("s2", 3, new=True), _request("s3", 3)])
    assert _cursors(engine)["s1"] == _cursors(sequential)["s1"] and _cursors(engine)["s3"] == _cursors(sequential)["s3"]
    engine.close()
    sequential.close()


def test_a_batch_never_drops_its_own_offloaded_session_from_a_full_host_tier(modules):
    """A new session's eviction fills the host tier: the record it displaces is never one of the batch's own.

    Capacity 2, a host tier of one record. The batch [s4 (new), s1 (offloaded)] must restore s1 (its record
    leaves the tier first) rather than let s4's eviction drop s1's record and start s1 anew.
    """
    _, probe = _engine(modules, capacity=2)
    record_bytes = probe.memory_plan.offload_bytes_per_session  # the tier holds one record, not two
    probe.close()
    pipeline, engine = _engine(modules, capacity=2, host_offload_bytes=record_bytes + record_bytes // 2)
    _, sequential = _engine(modules, capacity=4)
    closed = []
    close = pipeline.close_ar_diffusion_session
    pipeline.close_ar_diffusion_session = lambda sid: (closed.append(sid), close(sid))[-1]

    def run(requests):
        _assert_same(engine.generate_batch(requests), [sequential.generate(r) for r in requests])

    run([_request(sid, 0, new=True) for sid in ("s1", "s2")])
    run([_request("s3", 1, new=True)])  # s1 offloaded: the tier is full
    assert engine.offloaded_sessions == ("s1",) and engine.sessions == ("s2", "s3")
    run([_request("s4", 2, new=True), _request("s1", 2)])  # s1 continues; s2 dropped from the tier, s3 offloaded
    assert engine.sessions == ("s4", "s1") and engine.offloaded_sessions == ("s3",) and closed == ["s2"]
    engine.close()
    sequential.close()


def test_refused_batches_change_nothing(modules):
    pipeline, engine = _engine(modules, capacity=3)
    engine.generate_batch([_request(sid, 0, new=True) for sid in ("s1", "s2", "s3")])
    before = (engine.sessions, _cursors(engine), pipeline.session_ids)
    with pytest.raises(ValueError, match="repeated"):
        engine.generate_batch([_request("s1", 1), _request("s2", 1), _request("s1", 2)])
    with pytest.raises(ValueError, match="exceeds the session capacity 3"):
        engine.generate_batch([_request(sid, 1, new=True) for sid in ("s4", "s5", "s6", "s7")])
    with pytest.raises(ValueError, match="observation"):  # the pipeline's validator, for every request first
        engine.generate_batch([_request("s1", 1), _request("s4", 1)])  # s4 is new and has no observation
    with pytest.raises(TypeError):
        engine.generate_batch(_request("s1", 1))
    assert (engine.sessions, _cursors(engine), pipeline.session_ids) == before
    assert engine.generate_batch([]) == []
    engine.close()


# -- device-side batched rollouts ----------------------------------------------------------------------


@pytest.mark.parametrize("reset_at_boundary", [False, True])
def test_batched_rollout_equals_the_runner_path(reset_at_boundary):
    from test_rollout import block_fn, make_cache, make_params

    from ardiff_jax.rollout import rollout_sessions

    params = make_params()
    steps, sessions = 6, 3  # 12 frames per session: the 4-frame ring wraps
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(steps, sessions, 4, 8)), jnp.float32)
    host_cache = make_cache(reset_at_boundary)
    host_states = [host_cache.create_state(f"s{i}") for i in range(sessions)]
    step_fn = jax.jit(block_fn)
    host_ys = np.zeros(xs.shape, np.float32)
    for t in range(steps):
        for s, state in enumerate(host_states):
            caches = state.get_kv_caches("main", seq_len=4, commit_current=True)
            y, k, v = step_fn(params, caches, xs[t, s])
            state.commit_paged_context("main", kv=(k, v))
            host_ys[t, s] = np.asarray(y)
    dev_cache = make_cache(reset_at_boundary)
    dev_states = [dev_cache.create_state(f"s{i}") for i in range(sessions)]
    with pytest.raises(ValueError, match="session_index=None"):
        rollout_sessions(dev_cache, dev_states, jax.tree_util.Partial(block_fn, params), xs, [0],
                         branch="main", num_frames=2, batched=True)
    dev_ys = rollout_sessions(dev_cache, dev_states, jax.tree_util.Partial(block_fn, params), xs, None,
                              branch="main", num_frames=2, batched=True)
    assert dev_ys.shape == xs.shape
    np.testing.assert_allclose(np.asarray(dev_ys), host_ys, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dev_cache.pools.k), np.asarray(host_cache.pools.k), rtol=2e-5, atol=2e-6)
    for host, dev in zip(host_states, dev_states, strict=True):
        assert dev.adapter("main").committed_frames == host.adapter("main").committed_frames == 2 * steps
        assert dev.adapter("main").visible_start_frame == host.adapter("main").visible_start_frame


def test_the_demo_drive_batched_equals_one_by_one(modules):
    from ardiff_jax.demo import drive_sessions

    _, batched = _engine(modules, capacity=3)
    _, sequential = _engine(modules, capacity=3)
    got = drive_sessions(batched, [1, 2, 3], 4, action_seed=2, batched=True)
    want = drive_sessions(sequential, [1, 2, 3], 4, action_seed=2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.frames, w.frames)
        assert g.restarts == w.restarts == 0
    batched.close()
    sequential.close()


# -- the CFG pipeline: sessions x branches in one program ------------------------------------------


def test_cfg_batches_equal_the_same_requests_one_by_one():
    from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline

    base = CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=2))
    engines = [ARDiffusionEngine(CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=2),
                                                        modules=base.modules),
                                 EngineConfig(**CONFIG, warmup=False)) for _ in range(2)]
    sequential, batched = engines
    assert batched.runner.supports_batched_forward
    schedule = [  # (session, prompt, observed frames): new sessions, a 4-frame prefill, a prompt switch (a reset)
        [("c0", "pick up the cup", 1), ("c1", "open the door", 1)],
        [("c1", None, 1), ("c0", None, 4)],
        [("c0", "put it down", 1), ("c1", None, 1)],
    ]
    pipeline = sequential.runner.pipeline
    for tick, rows in enumerate(schedule):
        requests = [DiffusionRequest(f"{sid}-{tick}", prompt=prompt, extra_args={"session_id": sid},
                                     inputs={"observation": pipeline.schema.example(frames, seed=10 * tick + i)})
                    for i, (sid, prompt, frames) in enumerate(rows)]
        want = [sequential.generate(request) for request in requests]
        got = batched.generate_batch(requests)
        for g, w in zip(got, want, strict=True):
            for key in ("video", "actions"):
                np.testing.assert_allclose(np.asarray(g[key]), np.asarray(w[key]), rtol=0, atol=1e-5)
    assert _cursors(batched) == _cursors(sequential)
    for engine in engines:
        engine.close()
