"""Structural guarantees: one program for every fill level, no pool copies.

a. Compile counting: filling, wrapping the ring several times, resetting and a second
   session reuse the programs compiled for the first block of each kind.
b. A commit donates the pools and writes in place: the old arrays are deleted, the output
   aliases the input, and the compiled scatter needs at most one block of temporaries.
c. Pools never ride in a ``lax.scan`` as ``xs``/``ys`` (a jaxpr walk; shown to catch a bad scan).
d. The attention program reads the pool without copying it: temporaries are bounded by a few
   times (visible window + current block + scores), far below the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import PagedKVCaches
from ardiff_jax.kv import (
    KVPools,
    commit_block,
    contiguous_table_cursor,
    cursor_block_pages,
    paged_attention,
    ref_attention,
    write_block,
)
from helpers import count_compiles, iter_eqns, make_cache, randn, scan_pool_operands

# -- a. one compiled program for all fill levels -----------------------------------------------------------


@jax.jit
def tiny_model(caches: PagedKVCaches, q, k, v, extra_k, extra_v):
    """A stand-in DiT: one attention per layer over the paged context (layers as Python ints)."""
    out = q
    for layer in range(len(caches)):
        out = caches.attend(layer, out, k[layer], v[layer], extra_k=extra_k[layer], extra_v=extra_v[layer])
    return out


@jax.jit
def tiny_model_scanned(caches: PagedKVCaches, q, k, v, extra_k, extra_v):
    """The same model with the layer index traced (a ``lax.scan`` over layers)."""

    def body(out, xs):
        layer, k_l, v_l, ek_l, ev_l = xs
        return caches.attend(layer, out, k_l, v_l, extra_k=ek_l, extra_v=ev_l), None

    layers = jnp.arange(len(caches), dtype=jnp.int32)
    out, _ = jax.lax.scan(body, q, (layers, k, v, extra_k, extra_v))
    return out


@pytest.mark.parametrize("model", [tiny_model, tiny_model_scanned], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("reset_at_boundary", [False, True])
def test_no_recompile_across_fill_levels_wrap_reset_and_sessions(model, reset_at_boundary):
    # head_size 6: a geometry no other test compiles, so the first block really compiles.
    cache = make_cache(sink_frames=1, window_frames=4, frames_per_block=2, tokens_per_frame=2, num_layers=2,
                       head_size=6, session_capacity=2, max_scratch_tokens_per_branch=2,
                       reset_at_boundary=reset_at_boundary)
    layout = cache.layout
    L, T, H, D, F = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size, 2
    rng = np.random.default_rng(0)

    def block(state):
        """Two denoise probes (one cleared, one replaced) then the committing forward and its commit."""
        q = randn(rng, 3, 2 * H, D)
        k, v = randn(rng, L, F * T, H, D), randn(rng, L, F * T, H, D)
        ek, ev = randn(rng, L, 2, H, D), randn(rng, L, 2, H, D)
        outs = []
        for commit_current in (False, False, True):
            caches = state.get_kv_caches("main", seq_len=F * T, commit_current=commit_current)
            outs.append(np.asarray(model(caches, q, k, v, ek, ev)))
            if not commit_current and len(outs) == 1:
                state.commit_paged_context("main")
        state.commit_paged_context("main", kv=(k, v))
        return outs, caches

    state = cache.create_state("first")
    with count_compiles() as first:
        block(state)
    assert any("model" in name for name in first), first  # the counter sees compiles
    with count_compiles() as later:
        frames_seen = set()
        for _ in range(8):  # 16 frames: the 4-frame ring wraps 3+ times
            outs, caches = block(state)
            frames_seen.update(caches.visible_frames().tolist())
        assert state.adapter("main").committed_frames == 18 >= 3 * layout.window_frames + layout.run_pages
        state.reset()
        for _ in range(3):
            block(state)
        other = cache.create_state("second")  # another slot, same programs
        assert other.slot == 1
        for _ in range(3):
            block(other)
        state.close()
        third = cache.create_state("third")  # reuses slot 0
        block(third)
    assert later == [], later
    if not reset_at_boundary:
        assert max(frames_seen) >= 15  # the ring really wrapped
    # The counter does see a new shape (a 1-frame block compiles a new attention program).
    with count_compiles() as new_shape:
        caches = third.get_kv_caches("main", seq_len=T)
        k = randn(rng, L, T, H, D)
        model(caches, randn(rng, 3, 2 * H, D), k, k, randn(rng, L, 2, H, D), randn(rng, L, 2, H, D))
    assert new_shape


def test_tiny_model_equals_layerwise_reference():
    # The compile test's model really computes paged attention (unrolled and scanned agree with a reference).
    cache = make_cache(sink_frames=1, window_frames=4, frames_per_block=2, tokens_per_frame=2,
                       max_scratch_tokens_per_branch=2)
    layout = cache.layout
    L, T, H, D = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    state = cache.create_state("s")
    rng = np.random.default_rng(1)
    for _ in range(3):
        state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
        state.commit_paged_context("main", kv=(randn(rng, L, 2 * T, H, D), randn(rng, L, 2 * T, H, D)))
    caches = state.get_kv_caches("main", seq_len=2 * T)
    q, k, v = randn(rng, 3, 2 * H, D), randn(rng, L, 2 * T, H, D), randn(rng, L, 2 * T, H, D)
    ek, ev = randn(rng, L, 2, H, D), randn(rng, L, 2, H, D)
    want = q
    for layer in range(L):
        want = caches.ref_attend(layer, want, k[layer], v[layer], extra_k=ek[layer], extra_v=ev[layer])
    # float32, different summation orders: 1e-5.
    np.testing.assert_allclose(np.asarray(tiny_model(caches, q, k, v, ek, ev)), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tiny_model_scanned(caches, q, k, v, ek, ev)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)


# -- b. a commit costs no pool copy -------------------------------------------------------------------------


def _block_bytes(layout, frames):
    """Bytes of the K and V of one block (all layers) in the storage dtype."""
    return 2 * layout.num_layers * frames * layout.tokens_per_frame * layout.num_kv_heads * layout.head_size * \
        layout.itemsize


#: Index vectors and scalars XLA keeps beside the block in the scatter.
SCALAR_SLACK = 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_commit_donates_and_writes_in_place(dtype):
    cache = make_cache(sink_frames=1, window_frames=5, frames_per_block=2, tokens_per_frame=4, num_kv_heads=2,
                       head_size=8, session_capacity=8, dtype=dtype)
    layout = cache.layout
    L, T, H, D = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    state = cache.create_state("s")
    rng = np.random.default_rng(2)
    k, v = randn(rng, L, 2 * T, H, D), randn(rng, L, 2 * T, H, D)

    # The compiled scatter: output aliases both pools; temporaries at most one block.
    pages = np.array([1, 2], np.int32)
    stats = commit_block.lower(layout, cache.pools, pages, k, v).compile().memory_analysis()
    assert stats.alias_size_in_bytes == layout.pool_bytes
    assert stats.temp_size_in_bytes <= _block_bytes(layout, 2) + SCALAR_SLACK, stats
    assert layout.pool_bytes >= 20 * _block_bytes(layout, 2)  # so a pool copy could not hide in the bound

    for _ in range(3):
        old = cache.pools
        old_k, old_v = old.k, old.v
        pointers = (old_k.unsafe_buffer_pointer(), old_v.unsafe_buffer_pointer())
        state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
        state.commit_paged_context("main", kv=(k, v))
        new = cache.pools
        assert old_k.is_deleted() and old_v.is_deleted() and old.is_deleted()
        assert not new.is_deleted()
        assert (new.k.unsafe_buffer_pointer(), new.v.unsafe_buffer_pointer()) == pointers  # same buffers
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(old_k)


def test_stale_caches_view_after_commit_fails_clearly():
    cache = make_cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(3)
    L, T, H, D = 2, 2, 2, 4
    caches = state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
    state.commit_paged_context("main", kv=(randn(rng, L, 2 * T, H, D), randn(rng, L, 2 * T, H, D)))
    with pytest.raises(RuntimeError, match="get_kv_caches"):
        caches.attend(0, randn(rng, 2, H, D), randn(rng, 2 * T, H, D), randn(rng, 2 * T, H, D))


# -- c. pools never as scan xs/ys -------------------------------------------------------------------------


#: 64 sessions: the pool is large next to one step's temporaries, so a pool-sized temporary shows.
ROLLOUT_GEOMETRY = dict(sink_frames=1, window_frames=4, frames_per_block=2, tokens_per_frame=2, num_layers=2,
                        session_capacity=64)


def _rollout_setup():
    cache = make_cache(**ROLLOUT_GEOMETRY)
    layout = cache.layout
    rng = np.random.default_rng(4)
    L, T, H, D = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    steps = 6
    qs = randn(rng, steps, 3, H, D)
    ks, vs = randn(rng, steps, L, 2 * T, H, D), randn(rng, steps, L, 2 * T, H, D)
    return cache, layout, qs, ks, vs


def _rollout(layout, pools, cursor, qs, ks, vs):
    """Device-side rollout with the pools in the scan carry: write each block, then attend.

    Writing first is exact (the block's pages are invisible to its own forward: the cursor
    still has the old committed count) and keeps XLA in place; attending to the pools and
    then writing them inside one program makes XLA:CPU copy the whole pool every step (see
    the note in ``ardiff_jax.kv.write_block``).
    """

    def step(carry, xs):
        pools, cursor = carry
        q, k, v = xs
        pages = cursor_block_pages(layout, cursor, 2, jnp)
        pools = write_block(layout, pools, pages, k, v)
        out = paged_attention(layout, pools, cursor, 0, q, k[0], v[0])
        return (pools, cursor.at[1].add(2)), out

    (pools, cursor), outs = jax.lax.scan(step, (pools, cursor), (qs, ks, vs))
    return pools, cursor, outs


def _bad_layer_scan(layout, pools, k):
    """Deliberately wrong: scans over the pool (xs) and stacks a new pool (ys)."""

    def per_layer(carry, pool_layer):
        return carry, pool_layer.at[0].set(k[0, :layout.tokens_per_frame].astype(pool_layer.dtype))

    _, new_k = jax.lax.scan(per_layer, None, pools.k)
    return KVPools(k=new_k, v=pools.v)


def test_pools_never_scan_xs_or_ys():
    cache, layout, qs, ks, vs = _rollout_setup()
    pools, shape = cache.pools, layout.pool_shape
    cursor = contiguous_table_cursor(layout, 0, 0, 0)
    k = ks[0]
    jaxprs = {
        "commit_block": jax.make_jaxpr(commit_block, static_argnums=0)(layout, pools, np.array([1, 2], np.int32), k,
                                                                       k),
        "paged_attention": jax.make_jaxpr(functools.partial(paged_attention, layout))(
            pools, cursor, 0, qs[0], k[0], k[0], k[0, :2], k[0, :2]),
        "rollout": jax.make_jaxpr(jax.jit(functools.partial(_rollout, layout)))(pools, cursor, qs, ks, vs),
    }
    for name, jaxpr in jaxprs.items():
        assert scan_pool_operands(jaxpr, shape) == [], name
    # The walker does reach the rollout's scan (inside the jit) and sees the pools in its carry.
    scans = [eqn for eqn in iter_eqns(jaxprs["rollout"]) if eqn.primitive.name == "scan"]
    assert len(scans) == 1
    scan = scans[0]
    carry = scan.invars[scan.params["num_consts"]:scan.params["num_consts"] + scan.params["num_carry"]]
    assert [tuple(var.aval.shape) for var in carry].count(shape) == 2
    # A scan over the pool IS caught, also nested in jit and cond.
    bad = functools.partial(_bad_layer_scan, layout)
    assert len(scan_pool_operands(jax.make_jaxpr(bad)(pools, k), shape)) == 2
    nested = jax.jit(lambda p, k, flag: jax.lax.cond(flag, lambda: bad(p, k), lambda: p))
    found = scan_pool_operands(jax.make_jaxpr(nested)(pools, k, True), shape)
    assert len(found) == 2 and "xs" in found[0] and "ys" in found[1]


def test_rollout_in_carry_is_in_place_and_matches_the_runtime():
    cache, layout, qs, ks, vs = _rollout_setup()
    cursor = contiguous_table_cursor(layout, 0, 0, 0)
    rollout = jax.jit(functools.partial(_rollout, layout), donate_argnums=0)
    stats = rollout.lower(cache.pools, cursor, qs, ks, vs).compile().memory_analysis()
    assert stats.alias_size_in_bytes == layout.pool_bytes
    assert stats.temp_size_in_bytes < layout.pool_bytes // 4, stats  # no pool-sized temporary
    # Same result as the runtime path (a session in slot 0, layer 0), block by block.
    state = cache.create_state("s")
    T = layout.tokens_per_frame
    expected = []
    for q, k, v in zip(qs, ks, vs):
        caches = state.get_kv_caches("main", seq_len=2 * T, commit_current=True)
        expected.append(np.asarray(caches.ref_attend(0, q, k[0], v[0])))
        state.commit_paged_context("main", kv=(k, v))
    runtime_pools = jax.tree_util.tree_map(np.asarray, cache.pools)
    fresh = make_cache(**ROLLOUT_GEOMETRY)
    pools, cursor, outs = rollout(fresh.pools, cursor, qs, ks, vs)
    assert int(cursor[1]) == 2 * len(qs)
    np.testing.assert_allclose(np.asarray(outs), np.stack(expected), rtol=1e-5, atol=1e-5)  # f32, summation order
    np.testing.assert_array_equal(np.asarray(pools.k), runtime_pools.k)  # the same pages hold the same bytes
    np.testing.assert_array_equal(np.asarray(pools.v), runtime_pools.v)


# -- d. the attention program does not copy the pool ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("frames,extra", [(1, 0), (2, 4)])
def test_attend_memory_is_bounded_by_window_not_pool(dtype, frames, extra):
    cache = make_cache(sink_frames=1, window_frames=5, frames_per_block=2, tokens_per_frame=4, num_kv_heads=2,
                       head_size=8, session_capacity=128, max_scratch_tokens_per_branch=4, dtype=dtype)
    layout = cache.layout
    T, H, D = layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    S, Hq = 8, 2 * H
    q = jnp.zeros((S, Hq, D), dtype)
    k = jnp.zeros((frames * T, H, D), dtype)
    ek = jnp.zeros((extra, H, D), dtype) if extra else None
    attend = jax.jit(paged_attention, static_argnums=0)
    stats = attend.lower(layout, cache.pools, contiguous_table_cursor(layout, 0, 3, 0), np.int32(1), q, k, k, ek, ek).compile() \
        .memory_analysis()
    f32 = 4
    window_tokens = layout.run_pages * T
    current_tokens = frames * T + extra
    window_kv = 2 * window_tokens * H * D * f32  # one layer's run, K and V, at compute precision
    current_kv = 2 * current_tokens * H * D * f32
    scores = Hq * S * (window_tokens + current_tokens) * f32
    bound = 3 * (window_kv + current_kv + scores)
    assert stats.argument_size_in_bytes >= layout.pool_bytes  # the pools are arguments ...
    assert stats.alias_size_in_bytes == 0  # ... read only ...
    assert stats.temp_size_in_bytes <= bound, (stats, bound)  # ... and never copied
    assert bound < layout.pool_bytes // 2 // 2  # the bound is far below one pool: a copy would fail it
    assert stats.output_size_in_bytes == q.size * q.dtype.itemsize


def test_ref_attention_sanity_against_numpy():
    # ref_attention (the oracle of the other tests) against a float64 numpy softmax.
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, 3, 4, 8), randn(rng, 7, 2, 8), randn(rng, 7, 2, 8)
    mask = np.array([1, 1, 0, 1, 0, 1, 1], bool)
    kq, vq = np.repeat(k, 2, axis=1).astype(np.float64), np.repeat(v, 2, axis=1).astype(np.float64)
    scores = np.einsum("shd,nhd->hsn", q.astype(np.float64), kq) / np.sqrt(8)
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("hsn,nhd->shd", weights, vq)
    np.testing.assert_allclose(np.asarray(ref_attention(q, k, v, mask=mask)), want, rtol=1e-5, atol=1e-6)
