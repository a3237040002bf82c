"""The pure functional core: cursor arithmetic, pool writes/reads, paged attention.

Tolerances: where the fast path (shared log-sum-exp over the run in physical order) is
compared with a dense reference (softmax over the ordered concatenation), both run in
float32 with different summation orders; observed differences are ~1e-7 on O(1) values,
so ``atol = rtol = 1e-5`` (``F32_TOL``). Writes and gathers are pure copies and are
compared exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax.kv import (
    KVLayout,
    advance_cursor,
    allocate_pools,
    commit_block,
    contiguous_table_cursor,
    cursor_block_pages,
    cursor_pages,
    from_storage,
    gather_pages,
    make_table_cursor,
    paged_attention,
    read_run,
    ref_attention,
    ref_paged_attention,
    run_visibility,
    visible_table,
    write_block,
)
from helpers import contract_resident, contract_visible, make_cache, randn

#: The dense reference as one program per shape (eagerly each of its ops compiles a program per shape).
_ref_attention = jax.jit(ref_attention)
_dot_product_attention = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))

F32_TOL = dict(rtol=1e-5, atol=1e-5)


def small_layout(sink: int, window: int, reset: bool = False, *, runs: int = 3, tokens: int = 1, layers: int = 1,
                 heads: int = 1, head_size: int = 2, scratch: int | None = None, dtype: str = "float32",
                 storage: str | None = None) -> KVLayout:
    return KVLayout(
        num_layers=layers, num_pages=runs * (sink + window), tokens_per_frame=tokens, num_kv_heads=heads,
        head_size=head_size, sink_frames=sink, window_frames=window, frames_per_block=window,
        scratch_pages=window + 2 if scratch is None else scratch, reset_at_boundary=reset, dtype=dtype,
        storage_dtype=dtype if storage is None else storage,
    )


LAYOUT_CASES = [  # (sink, window, reset_at_boundary)
    (0, 1, False), (0, 3, False), (1, 5, False), (2, 3, False), (3, 2, False), (3, 5, False),
    (0, 2, True), (1, 5, True), (2, 3, True),
]


# -- cursors and the pages they name -----------------------------------------------------------------


def page_of(layout: KVLayout, run_base: int, frames, xp=np):
    """Pages of ``frames`` in the run on its home pages from ``run_base`` (the contiguous table)."""
    return cursor_pages(layout, contiguous_table_cursor(layout, run_base, 0, 0), frames, xp)


def test_cursor_pages_hand_values():
    layout = small_layout(2, 3, runs=4)
    frames = np.arange(10)
    expected = [10, 11, 12, 13, 14, 12, 13, 14, 12, 13]  # sink 10, 11; ring 12..14 wraps every 3 frames
    cursor = contiguous_table_cursor(layout, 10, 0, 0)
    assert cursor.dtype == np.int32 and cursor.tolist() == [10, 0, 0, 10, 11, 12, 13, 14]
    np.testing.assert_array_equal(cursor_pages(layout, cursor, frames, np), expected)
    got = jax.jit(lambda cur, f: cursor_pages(layout, cur, f, jnp))(cursor, frames.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(got), expected)
    no_sink = small_layout(0, 1, runs=4)
    np.testing.assert_array_equal(page_of(no_sink, 3, frames), [3] * 10)
    # A table is looked up, not added to: the same slots on pages in another order.
    table = np.array([7, 2, 19, 0, 5], np.int32)
    scattered = make_table_cursor(10, 0, 0, table)
    np.testing.assert_array_equal(cursor_pages(layout, scattered, frames, np), table[[0, 1, 2, 3, 4, 2, 3, 4, 2, 3]])


@pytest.mark.parametrize("length", [3, 2 + 5, 4 + 5])
def test_a_cursor_without_its_whole_table_is_refused(length):
    """Only ``3 + K + W`` entries is a cursor: the old ``i32[3]`` form would look pages up in an empty table."""
    layout = small_layout(2, 3, runs=4)
    cursor = np.zeros(length, np.int32)
    with pytest.raises(ValueError, match="page table: last axis 8"):
        cursor_pages(layout, cursor, np.arange(2), np)
    with pytest.raises(ValueError, match="page table: last axis 8"):
        cursor_block_pages(layout, cursor, 2, np)
    with pytest.raises(ValueError, match="page table: last axis 8"):
        advance_cursor(layout, cursor, 2, np)
    with pytest.raises(ValueError, match="page table: last axis 8"):
        jax.jit(lambda cur: visible_table(layout, cur, 1, jnp))(cursor)
    pools = allocate_pools(layout)
    q = jnp.zeros((1, 1, 2), jnp.float32)
    with pytest.raises(ValueError, match="page table: last axis 8"):
        paged_attention(layout, pools, cursor, 0, q, q, q)


def test_advance_cursor_keeps_the_table():
    layout = small_layout(1, 3, reset=True, runs=2)
    cursor = make_table_cursor(4, 2, 2, [6, 4, 5, 7])
    for xp in (np, jnp):
        advanced = np.asarray(advance_cursor(layout, xp.asarray(cursor), 2, xp))
        assert advanced.dtype == np.int32 and advanced.tolist() == [4, 4, 4, 6, 4, 5, 7]


# -- visible_table / run_visibility ---------------------------------------------------------------------


def _cursor_grid(layout: KVLayout, run_base: int) -> np.ndarray:
    """Every (committed, visible_start) with visible_start <= committed, up to three ring laps."""
    limit = 3 * layout.run_pages + 2
    rows = [contiguous_table_cursor(layout, run_base, c, s) for c in range(limit) for s in range(c + 1)]
    return np.stack(rows)


@pytest.mark.parametrize("sink,window,reset", LAYOUT_CASES)
def test_visible_table_and_run_visibility_agree_numpy_and_jit(sink, window, reset):
    layout = small_layout(sink, window, reset)
    run_base = layout.run_pages  # run 1 of 3: pages must stay inside it
    cursors = _cursor_grid(layout, run_base)

    @jax.jit
    def device_tables(cursors):
        out = []
        for f in range(1, window + 1):
            pages, frames = jax.vmap(lambda cur: visible_table(layout, cur, f, jnp))(cursors)
            vis = jax.vmap(lambda cur: run_visibility(layout, cur[1], cur[2], f, jnp))(cursors)
            out.append((pages, frames, vis))
        return out

    device = jax.device_get(device_tables(cursors))
    for f in range(1, window + 1):
        dev_pages, dev_frames, dev_vis = device[f - 1]
        for row, cursor in enumerate(cursors):
            committed, visible_start = int(cursor[1]), int(cursor[2])
            pages, frames = visible_table(layout, cursor, f, np)
            vis = run_visibility(layout, committed, visible_start, f, np)
            # The same function, numpy on the host vs jnp inside jit: identical.
            np.testing.assert_array_equal(pages, dev_pages[row])
            np.testing.assert_array_equal(frames, dev_frames[row])
            np.testing.assert_array_equal(vis, dev_vis[row])
            assert pages.dtype == frames.dtype == np.int32 and pages.shape == (layout.run_pages,)
            # Docstring formula: sink [0, min(c, K)) then [lo, c), lo = max(K, s, c - (W - f)).
            lo = max(sink, visible_start, committed - (window - f))
            want = list(range(min(committed, sink))) + list(range(lo, committed))
            count = len(want)
            assert frames[:count].tolist() == want
            assert (frames[count:] == -1).all() and (pages[count:] == layout.null_page).all()
            np.testing.assert_array_equal(pages[:count], page_of(layout, run_base, np.asarray(want)))
            assert len(set(pages[:count].tolist())) == count  # no page visible twice
            # run_visibility marks exactly the pages of the table, in physical order.
            assert set((np.flatnonzero(vis) + run_base).tolist()) == set(pages[:count].tolist())
            # Reachable cursors (s = 0 sliding, s = c under reset_at_boundary) match the reference
            # (docs/reference_behaviour.md, "Visible window").
            if visible_start == (committed if reset else 0):
                assert want == contract_visible(sink, window, reset, committed, f)


def test_visible_table_worked_example():
    # docs/reference_behaviour.md, "Visible window": sink 1, window 5, 8 committed single frames,
    # 1-frame forward -> sink, frames 4-7.
    layout = small_layout(1, 5)
    pages, frames = visible_table(layout, contiguous_table_cursor(layout, 0, 8, 0), 1, np)
    assert frames.tolist() == [0, 4, 5, 6, 7, -1]
    assert pages.tolist() == [0, 4, 5, 1, 2, layout.null_page]
    # A 2-frame forward gives up one more history frame (the current frames use window slots).
    assert visible_table(layout, contiguous_table_cursor(layout, 0, 8, 0), 2, np)[1].tolist() == [0, 5, 6, 7, -1, -1]


# -- cursor_block_pages -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sink,window,reset", LAYOUT_CASES)
def test_cursor_block_pages_write_only_evicted_pages(sink, window, reset):
    layout = small_layout(sink, window, reset)
    run_base = 2 * layout.run_pages
    run = set(range(run_base, run_base + layout.run_pages))
    for f in range(1, window + 1):
        jitted = jax.jit(lambda cur, f=f: cursor_block_pages(layout, cur, f, jnp))
        for committed in range(3 * layout.run_pages):
            cursor = contiguous_table_cursor(layout, run_base, committed, committed if reset else 0)
            written = cursor_block_pages(layout, cursor, f, np)
            assert written.dtype == np.int32
            np.testing.assert_array_equal(written, np.asarray(jitted(cursor)))
            written_set = set(written.tolist())
            assert len(written_set) == f and written_set <= run
            assert written.tolist() == page_of(layout, run_base, np.arange(committed, committed + f)).tolist()
            before = contract_resident(sink, window, reset, committed)
            after = contract_resident(sink, window, reset, committed + f)
            pages_of = lambda frames: set(page_of(layout, run_base, np.asarray(frames, int)).tolist())
            evicted = [g for g in before if g not in after]
            surviving = [g for g in before if g in after]
            # No surviving frame is overwritten, every evicted page that gets reused is in the block.
            assert not written_set & pages_of(surviving)
            assert pages_of(evicted) <= written_set or reset
            # None of the written pages is visible to the committing forward itself.
            pages, frames = visible_table(layout, cursor, f, np)
            assert not written_set & set(pages[frames >= 0].tolist())
            if not reset and committed >= layout.run_pages:
                # Steady state: the block lands exactly on the pages its commit evicts.
                assert written_set == pages_of(evicted)


# -- writes and reads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_gather_round_trip_with_null_pages(dtype):
    storage = "uint16" if dtype == "bfloat16" else dtype
    layout = small_layout(1, 3, runs=2, tokens=2, layers=2, heads=2, head_size=4, dtype=dtype, storage=storage)
    null = layout.null_page
    rng = np.random.default_rng(0)
    pools = allocate_pools(layout)
    assert pools.k.dtype == jnp.dtype(storage)
    frames = 4
    k = randn(rng, 2, frames * 2, 2, 4)  # float32 in: written as the logical dtype
    v = randn(rng, 2, frames * 2, 2, 4)
    pages = np.array([3, null, 5, null], np.int32)  # two frames dropped on the null page
    old = pools
    pools = commit_block(layout, pools, pages, k, v)
    assert old.is_deleted() and not pools.is_deleted()  # donated
    logical = jnp.dtype(dtype)
    k_logical = np.asarray(jnp.asarray(k).astype(logical)).reshape(2, frames, 2, 2, 4)
    v_logical = np.asarray(jnp.asarray(v).astype(logical)).reshape(2, frames, 2, 2, 4)
    for layer in range(2):
        got_k, got_v = gather_pages(layout, pools, layer, np.array([5, null, 3, 0], np.int32))
        assert got_k.dtype == logical and got_k.shape == (4 * 2, 2, 4)
        got_k = np.asarray(got_k).reshape(4, 2, 2, 4)
        got_v = np.asarray(got_v).reshape(4, 2, 2, 4)
        # Exact round trip (bf16: the uint16 bit pattern of the cast value).
        np.testing.assert_array_equal(got_k[0], k_logical[layer, 2])
        np.testing.assert_array_equal(got_k[2], k_logical[layer, 0])
        np.testing.assert_array_equal(got_v[0], v_logical[layer, 2])
        np.testing.assert_array_equal(got_v[2], v_logical[layer, 0])
        assert not got_k[1].any() and not got_v[1].any()  # the null page reads as zeros
        assert not got_k[3].any()  # page 0 was never written
    if dtype == "bfloat16":
        np.testing.assert_array_equal(np.asarray(pools.k)[:, 3], k_logical[:, 0].view(np.uint16))
    # Only pages 3 and 5 were touched.
    written = np.asarray(pools.k).reshape(2, layout.num_pages, -1).any(axis=(0, 2))
    assert np.flatnonzero(written).tolist() == [3, 5]


def test_bf16_uint16_storage_round_trip_is_exact_bitwise():
    layout = small_layout(0, 2, runs=1, tokens=4, heads=1, head_size=8, dtype="bfloat16", storage="uint16")
    bits = np.random.default_rng(1).integers(0, 2**16, size=(1, 2 * 4, 1, 8), dtype=np.uint16)
    finite = np.asarray(jnp.asarray(bits).view(jnp.bfloat16))
    finite = np.where(np.isfinite(finite.astype(np.float32)), finite, np.zeros((), finite.dtype))  # NaN != NaN
    pools = write_block(layout, allocate_pools(layout), np.array([1, 0], np.int32), jnp.asarray(finite),
                        jnp.asarray(finite))
    k, _ = gather_pages(layout, pools, 0, np.array([1, 0], np.int32))
    np.testing.assert_array_equal(np.asarray(k).view(np.uint16), finite.reshape(-1, 1, 8).view(np.uint16))


def test_read_run_equals_ordered_gather_of_the_run():
    layout = small_layout(2, 3, runs=3, tokens=2, layers=2, heads=2, head_size=4)
    rng = np.random.default_rng(2)
    pools = allocate_pools(layout)
    pools = write_block(layout, pools, np.arange(layout.num_pages, dtype=np.int32),
                        randn(rng, 2, layout.num_pages * 2, 2, 4), randn(rng, 2, layout.num_pages * 2, 2, 4))
    for layer in range(2):
        for run in range(layout.num_runs):
            base = layout.run_base(run)
            got = read_run(layout, pools, layer, np.int32(base))
            want = gather_pages(layout, pools, layer, np.arange(base, base + layout.run_pages, dtype=np.int32))
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- attention through the runtime ------------------------------------------------------------------------


def _commit_frames(state, branch, rng, num_frames, layout, fill=None):
    """Commit ``num_frames`` single frames; returns the per-frame (k, v) arrays ``[L, T, H, D]``."""
    T, H, D, L = layout.tokens_per_frame, layout.num_kv_heads, layout.head_size, layout.num_layers
    frames = []
    for _ in range(num_frames):
        state.get_kv_caches(branch, seq_len=T, commit_current=True)
        if fill is None:
            k, v = randn(rng, L, T, H, D), randn(rng, L, T, H, D)
        else:
            k = v = np.full((L, T, H, D), fill, np.float32)
        state.commit_paged_context(branch, kv=(k, v))
        frames.append((k, v))
    return frames


def _dense(frames, visible, layer, cur_k, cur_v, extra_k=None, extra_v=None):
    keys = [frames[g][0][layer] for g in visible] + [cur_k] + ([extra_k] if extra_k is not None else [])
    values = [frames[g][1][layer] for g in visible] + [cur_v] + ([extra_v] if extra_v is not None else [])
    return np.concatenate(keys), np.concatenate(values)


def test_worked_example_sink_plus_newest_frames():
    cache = make_cache(sink_frames=1, window_frames=5, frames_per_block=1, tokens_per_frame=2)
    layout = cache.layout
    state = cache.create_state("s")
    rng = np.random.default_rng(3)
    frames = _commit_frames(state, "main", rng, 8, layout)
    caches = state.get_kv_caches("main", seq_len=2)
    assert caches.visible_frames().tolist() == [0, 4, 5, 6, 7]
    q, k, v = randn(rng, 3, 2, 4), randn(rng, 2, 2, 4), randn(rng, 2, 2, 4)
    for layer in range(layout.num_layers):
        keys, values = _dense(frames, [0, 4, 5, 6, 7], layer, k, v)
        want = np.asarray(_ref_attention(q, keys, values))
        np.testing.assert_allclose(np.asarray(caches.attend(layer, q, k, v)), want, **F32_TOL)
        np.testing.assert_allclose(np.asarray(caches.ref_attend(layer, q, k, v)), want, **F32_TOL)
    # Sanity: the evicted frames 1-3 would change the result (the comparison can fail).
    keys, values = _dense(frames, [0, 1, 4, 5, 6, 7], 0, k, v)
    assert not np.allclose(np.asarray(_ref_attention(q, keys, values)), np.asarray(caches.attend(0, q, k, v)),
                           **F32_TOL)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_gqa_grouping_matches_dot_product_attention(groups):
    cache = make_cache(sink_frames=1, window_frames=3, frames_per_block=1, tokens_per_frame=2, num_kv_heads=2,
                       max_scratch_tokens_per_branch=2)
    layout = cache.layout
    state = cache.create_state("s")
    rng = np.random.default_rng(4)
    frames = _commit_frames(state, "main", rng, 5, layout)
    caches = state.get_kv_caches("main", seq_len=2)
    visible = caches.visible_frames().tolist()
    assert visible == [0, 3, 4]
    q = randn(rng, 5, 2 * groups, 4)
    k, v, ek, ev = randn(rng, 2, 2, 4), randn(rng, 2, 2, 4), randn(rng, 2, 2, 4), randn(rng, 2, 2, 4)
    keys, values = _dense(frames, visible, 1, k, v, ek, ev)
    want = np.asarray(_dot_product_attention(q[None], keys[None], values[None]))[0]
    got = np.asarray(caches.attend(1, q, k, v, extra_k=ek, extra_v=ev))
    np.testing.assert_allclose(got, want, **F32_TOL)
    np.testing.assert_allclose(np.asarray(_ref_attention(q, keys, values)), want, **F32_TOL)
    # Query head h reads KV head h // groups: attending each query head alone to that KV head agrees.
    for h in range(2 * groups):
        kv_head = slice(h // groups, h // groups + 1)
        alone = _ref_attention(q[:, h:h + 1], keys[:, kv_head], values[:, kv_head])
        np.testing.assert_allclose(got[:, h:h + 1], np.asarray(alone), **F32_TOL)


def test_batched_layout_is_kept():
    cache = make_cache(max_scratch_tokens_per_branch=2)
    state = cache.create_state("s")
    rng = np.random.default_rng(5)
    _commit_frames(state, "main", rng, 3, cache.layout)
    caches = state.get_kv_caches("main", seq_len=4)
    q, k, v, ek = randn(rng, 3, 4, 4), randn(rng, 4, 2, 4), randn(rng, 4, 2, 4), randn(rng, 2, 2, 4)
    flat = np.asarray(caches.attend(0, q, k, v, extra_k=ek, extra_v=ek))
    batched = caches.attend(0, q[None], k[None], v[None], extra_k=ek[None], extra_v=ek[None])
    assert batched.shape == (1, 3, 4, 4) and flat.shape == (3, 4, 4)
    # Different programs (the batch axis is dropped inside), so compare with the float32 tolerance.
    np.testing.assert_allclose(np.asarray(batched)[0], flat, **F32_TOL)
    ref_batched = caches.ref_attend(0, q[None], k[None], v[None], extra_k=ek[None], extra_v=ek[None])
    assert ref_batched.shape == (1, 3, 4, 4)
    np.testing.assert_allclose(np.asarray(ref_batched)[0], flat, **F32_TOL)
    # bf16 queries come back as bf16.
    out = caches.attend(0, jnp.asarray(q, jnp.bfloat16), k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape


def _shape_error_cases():
    T, H, D = 2, 2, 4
    ok = dict(q=(3, 4, D), k=(T, H, D), v=(T, H, D))
    return [
        ("q head size", dict(ok, q=(3, 4, D + 1)), "head size"),
        ("q heads not a multiple", dict(ok, q=(3, 3, D)), "multiple"),
        ("k heads", dict(ok, k=(T, 1, D), v=(T, 1, D)), "KV heads"),
        ("k/v differ", dict(ok, v=(2 * T, H, D)), "differ"),
        ("not frame aligned", dict(ok, k=(T + 1, H, D), v=(T + 1, H, D)), "frame-aligned"),
        ("more frames than window", dict(ok, k=(6 * T, H, D), v=(6 * T, H, D)), "exceeds window_frames"),
        ("batch 2", dict(ok, q=(2, 3, 4, D)), "batch size 1"),
        ("q 2-d", dict(ok, q=(3, 4 * D)), r"\[N, H, D\]"),
        ("extra_k alone", dict(ok, extra_k=(1, H, D)), "together"),
        ("extra heads", dict(ok, extra_k=(1, 1, D), extra_v=(1, 1, D)), "KV heads"),
        ("extra k/v differ", dict(ok, extra_k=(1, H, D), extra_v=(2, H, D)), "differ"),
    ]


@pytest.mark.parametrize("fn", [paged_attention, ref_paged_attention], ids=["paged", "ref"])
@pytest.mark.parametrize("name,shapes,match", _shape_error_cases(), ids=[c[0] for c in _shape_error_cases()])
def test_shape_errors_raise_at_trace_time(fn, name, shapes, match):
    cache = make_cache(tokens_per_frame=2, num_kv_heads=2, head_size=4, max_scratch_tokens_per_branch=4)
    layout, pools = cache.layout, cache.pools
    args = {key: jax.ShapeDtypeStruct(shape, jnp.float32) for key, shape in shapes.items()}
    cursor = jax.ShapeDtypeStruct((3,), jnp.int32)
    jitted = jax.jit(fn, static_argnums=0)
    # .lower() traces without running anything: the error is a trace-time error.
    with pytest.raises(ValueError, match=match):
        jitted.lower(layout, pools, cursor, 0, args["q"], args["k"], args["v"], args.get("extra_k"),
                     args.get("extra_v"))
    assert not pools.is_deleted()


def test_attend_rejects_wrong_current_length_and_layer():
    cache = make_cache()
    state = cache.create_state("s")
    caches = state.get_kv_caches("main", seq_len=2)
    rng = np.random.default_rng(6)
    q, k = randn(rng, 2, 2, 4), randn(rng, 4, 2, 4)
    with pytest.raises(ValueError, match="seq_len=2"):
        caches.attend(0, q, k, k)
    with pytest.raises(IndexError):
        caches[cache.layout.num_layers]
    with pytest.raises(TypeError):
        caches[0.0]
    assert len(caches) == cache.layout.num_layers
    np.testing.assert_array_equal(np.asarray(caches[-1].attend(q, k[:2], k[:2])),
                                  np.asarray(caches.attend(1, q, k[:2], k[:2])))


@pytest.mark.parametrize("fn", ["attend", "ref_attend"])
def test_too_many_extra_tokens_exhaust_scratch(fn):
    # scratch pages = frames_per_block 2 + ceil(3 extra tokens / 2 tokens per frame) = 4.
    # (The current frames' share of scratch is checked on the host by get_kv_caches: tests/test_hardening.py.)
    cache = make_cache(tokens_per_frame=2, frames_per_block=2, max_scratch_tokens_per_branch=3)
    assert cache.layout.scratch_pages == 4
    state = cache.create_state("s")
    rng = np.random.default_rng(7)
    caches = state.get_kv_caches("main", seq_len=4)
    q, k = randn(rng, 2, 2, 4), randn(rng, 4, 2, 4)
    ok = getattr(caches, fn)(0, q, k, k, extra_k=randn(rng, 4, 2, 4), extra_v=randn(rng, 4, 2, 4))  # 2 + 2 pages
    assert ok.shape == q.shape
    # Extra tokens use scratch from offset 0 of a committing forward: 9 tokens = 5 pages never fit 4.
    with pytest.raises(RuntimeError, match="scratch blocks exhausted"):
        getattr(caches, fn)(0, q, k, k, extra_k=randn(rng, 9, 2, 4), extra_v=randn(rng, 9, 2, 4))
    assert not cache.pools.is_deleted()


@pytest.mark.parametrize("sink,reset,dtype", [(0, False, "float32"), (2, False, "float32"), (1, True, "float32"),
                                              (2, False, "bfloat16")])
def test_released_pages_never_leak_into_a_new_session(sink, reset, dtype):
    cache = make_cache(sink_frames=sink, window_frames=3, frames_per_block=1, tokens_per_frame=2,
                       reset_at_boundary=reset, session_capacity=1, dtype=dtype)
    layout = cache.layout
    rng = np.random.default_rng(8)
    old = cache.create_state("old")
    _commit_frames(old, "main", rng, 2 * layout.run_pages, layout, fill=np.nan)
    run = slice(old.slot * layout.run_pages, (old.slot + 1) * layout.run_pages)
    slot = old.slot
    old.close()
    assert cache.num_free_slots == 1
    new = cache.create_state("new")
    assert new.slot == slot
    pools_k = np.asarray(from_storage(layout, cache.pools.k)).astype(np.float32)
    assert np.isnan(pools_k[:, run]).all()  # the previous owner's pages are all NaN: the test can fail
    q, k, v = randn(rng, 3, 2, 4), randn(rng, 2, 2, 4), randn(rng, 2, 2, 4)
    tol = F32_TOL if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)  # bf16 storage of k/v: ~3 digits
    caches = new.get_kv_caches("main", seq_len=2)
    assert caches.visible_frames().tolist() == []
    for fn in (caches.attend, caches.ref_attend):
        out = np.asarray(fn(0, q, k, v)).astype(np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, np.asarray(_ref_attention(q, k, v)), **tol)
    # After a few real commits the remaining NaN pages (and the masked ring) still contribute nothing.
    frames = _commit_frames(new, "main", rng, 2, layout)
    frames = [(np.asarray(jnp.asarray(a).astype(dtype)).astype(np.float32),
               np.asarray(jnp.asarray(b).astype(dtype)).astype(np.float32)) for a, b in frames]
    caches = new.get_kv_caches("main", seq_len=2)
    visible = caches.visible_frames().tolist()
    assert visible == contract_visible(sink, 3, reset, 2, 1)
    for layer in range(layout.num_layers):
        keys, values = _dense(frames, visible, layer, k, v)
        want = np.asarray(_ref_attention(q, keys, values))
        for fn in (caches.attend, caches.ref_attend):
            out = np.asarray(fn(layer, q, k, v)).astype(np.float32)
            assert np.isfinite(out).all()
            np.testing.assert_allclose(out, want, **tol)


def test_paged_attention_reads_only_its_own_run():
    # Fill every other run with NaN; a cursor on run 1 must not see them (functional core directly).
    layout = small_layout(1, 3, runs=3, tokens=2, layers=1, heads=2, head_size=4)
    rng = np.random.default_rng(9)
    pools = allocate_pools(layout)
    nan_pages = np.array([p for p in range(layout.num_pages) if not 4 <= p < 8], np.int32)
    nan = np.full((1, 2 * len(nan_pages), 2, 4), np.nan, np.float32)
    pools = write_block(layout, pools, nan_pages, nan, nan)
    hist_k, hist_v = randn(rng, 1, 8, 2, 4), randn(rng, 1, 8, 2, 4)
    pools = write_block(layout, pools, np.arange(4, 8, dtype=np.int32), hist_k, hist_v)
    q, k, v = randn(rng, 3, 2, 4), randn(rng, 2, 2, 4), randn(rng, 2, 2, 4)
    cursor = contiguous_table_cursor(layout, 4, 4, 0)  # frames 0..3 committed into run 1: frame g at page 4 + g
    pages, frames = visible_table(layout, cursor, 1, np)
    assert frames.tolist() == [0, 2, 3, -1]  # frame 1 (page 5, finite) is masked too: window 3 - 1 current
    rows = np.concatenate([np.arange(2 * g, 2 * g + 2) for g in (0, 2, 3)])
    keys = np.concatenate([hist_k[0][rows], k])
    values = np.concatenate([hist_v[0][rows], v])
    want = np.asarray(_ref_attention(q, keys, values))
    fast = jax.jit(functools.partial(paged_attention, layout))(pools, cursor, 0, q, k, v)
    ref = jax.jit(functools.partial(ref_paged_attention, layout))(pools, cursor, 0, q, k, v)
    np.testing.assert_allclose(np.asarray(fast), want, **F32_TOL)
    np.testing.assert_allclose(np.asarray(ref), want, **F32_TOL)


def test_query_chunking_bounds_scores_and_keeps_results():
    """Past max_score_bytes the queries run in chunks: same rows, bounded temporaries."""
    from ardiff_jax.kv._attention import paged_attention as fast

    layout = KVLayout(num_layers=2, num_pages=10, tokens_per_frame=8, num_kv_heads=2, head_size=8, sink_frames=1,
                      window_frames=4, frames_per_block=2, scratch_pages=3)
    rng = np.random.default_rng(3)
    pools = allocate_pools(layout)
    block = jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32)
    pools = commit_block(layout, pools, cursor_block_pages(layout, contiguous_table_cursor(layout, 5, 0, 0), 2), block,
                         block)
    cursor = contiguous_table_cursor(layout, 5, 2, 0)
    q = jnp.asarray(rng.standard_normal((300, 4, 8)), jnp.float32)
    cur = jnp.asarray(rng.standard_normal((16, 2, 8)), jnp.float32)
    attend = jax.jit(fast, static_argnums=0, static_argnames="max_score_bytes")
    keys = layout.run_pages * layout.tokens_per_frame + 16
    full_scores = 4 * 4 * keys * 300
    whole = attend(layout, pools, cursor, 1, q, cur, cur)
    budget = full_scores // 10
    chunked = attend(layout, pools, cursor, 1, q, cur, cur, max_score_bytes=budget)
    # Per-row arithmetic is unchanged; only XLA's fusion of the chunked loop may round differently.
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-6)
    temp_whole = attend.lower(layout, pools, cursor, 1, q, cur, cur).compile().memory_analysis().temp_size_in_bytes
    temp_chunked = attend.lower(layout, pools, cursor, 1, q, cur, cur, max_score_bytes=budget
                                ).compile().memory_analysis().temp_size_in_bytes
    assert temp_whole >= full_scores
    assert temp_chunked < full_scores // 2, (temp_chunked, full_scores)
