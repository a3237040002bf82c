"""The functional core on a mesh: sharded pools, commits and attention equal the one-device ones.

Every mesh of the issue ((tp=2, cfg=2), (tp=4), (tp=8), (cfg=2)) writes the same blocks and
attends the same queries as an unsharded pool; the compiled programs move no pool between
devices (checked in the HLO), each device holds ``1 / (tp * cfg)`` of the pool bytes, and
the commit donates its pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax.kv import (
    KVLayout,
    KVPools,
    KVSharding,
    PagedKVCaches,
    advance_cursor,
    allocate_pools,
    contiguous_table_cursor,
    cursor_block_pages,
    paged_attention,
    read_pages,
    ref_paged_attention,
    shard_zeros,
    sharded_attention,
    sharded_read_runs,
    sharded_write_block,
    sharded_write_runs,
    write_block,
    write_pages,
)
from helpers import count_compiles
from meshes import MESH_SHAPES, assert_no_pool_collective, collectives, make_mesh

LAYOUT = KVLayout(num_layers=2, num_pages=4 * 5, tokens_per_frame=4, num_kv_heads=8, head_size=8, sink_frames=1,
                  window_frames=4, frames_per_block=2, scratch_pages=3)
commit_sharded = jax.jit(sharded_write_block, static_argnums=(0, 1), donate_argnums=2)


def _sharded_pools(layout: KVLayout, sharding: KVSharding) -> KVPools:
    return KVPools(k=shard_zeros(layout.pool_shape, layout.storage_dtype, sharding.pool_sharding),
                   v=shard_zeros(layout.pool_shape, layout.storage_dtype, sharding.pool_sharding))


def _fill(layout: KVLayout, sharding: KVSharding, steps: int = 5, dtype=jnp.float32):
    """The same blocks written into an unsharded and a sharded pool; cursors of runs 0 and 3."""
    rng = np.random.default_rng(0)
    pools, sharded = allocate_pools(layout), _sharded_pools(layout, sharding)
    cursors = {run: contiguous_table_cursor(layout, layout.run_base(run), 0, 0) for run in (0, 3)}
    shape = (layout.num_layers, layout.frames_per_block * layout.tokens_per_frame, layout.num_kv_heads,
             layout.head_size)
    for _ in range(steps):
        for run, cursor in cursors.items():
            k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
            pages = cursor_block_pages(layout, cursor, layout.frames_per_block, np)
            pools = write_block(layout, pools, pages, k, v)
            sharded = commit_sharded(layout, sharding, sharded, pages, k, v)
            cursors[run] = advance_cursor(layout, cursor, layout.frames_per_block, np)
    return pools, sharded, cursors


@pytest.mark.parametrize("mesh_name", list(MESH_SHAPES))
def test_sharded_commits_write_the_same_pages_and_split_the_bytes(mesh_name):
    sharding = KVSharding(make_mesh(MESH_SHAPES[mesh_name]))
    pools, sharded, _ = _fill(LAYOUT, sharding)
    np.testing.assert_array_equal(np.asarray(pools.k), np.asarray(sharded.k))
    np.testing.assert_array_equal(np.asarray(pools.v), np.asarray(sharded.v))
    assert sharded.k.sharding.spec == sharding.pool_spec
    per_device = {shard.device: shard.data.nbytes for shard in sharded.k.addressable_shards}
    assert len(per_device) == sharding.num_shards
    assert set(per_device.values()) == {LAYOUT.pool_bytes // 2 // sharding.num_shards}


@pytest.mark.parametrize("mesh_name", list(MESH_SHAPES))
def test_sharded_commit_donates_and_moves_no_pool(mesh_name):
    shape = MESH_SHAPES[mesh_name]
    sharding = KVSharding(make_mesh(shape))
    pools = _sharded_pools(LAYOUT, sharding)
    pages = np.array([5, 6], np.int32)
    block = jnp.ones((2, 8, 8, 8), jnp.float32)
    hlo = commit_sharded.lower(LAYOUT, sharding, pools, pages, block, block).compile().as_text()
    assert_no_pool_collective(hlo, LAYOUT.num_pages, shape[0])
    assert not [c for c in collectives(hlo) if c[0] == "all-gather"]
    new = commit_sharded(LAYOUT, sharding, pools, pages, block, block)
    assert pools.k.is_deleted() and pools.v.is_deleted()  # donation took effect: updated in place
    assert float(new.k[:, 5:7].sum()) == 2 * 2 * 4 * 8 * 8


@pytest.mark.parametrize("mesh_name", list(MESH_SHAPES))
def test_sharded_attention_equals_the_dense_reference(mesh_name):
    shape = MESH_SHAPES[mesh_name]
    sharding = KVSharding(make_mesh(shape))
    pools, sharded, cursors = _fill(LAYOUT, sharding)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(6, 16, 8)), jnp.float32)  # GQA: 16 query heads on 8 KV heads
    k = jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32)
    extra = jnp.asarray(rng.normal(size=(3, 8, 8)), jnp.float32)

    @jax.jit
    def attend(view, q, k, extra):
        return view.attend(1, q, k, k, extra_k=extra, extra_v=extra)

    for cursor in cursors.values():
        view = PagedKVCaches(pools=sharded, cursor=cursor, layout=LAYOUT, seq_len=8, sharding=sharding)
        out = attend(view, q, k, extra)
        ref = ref_paged_attention(LAYOUT, pools, cursor, 1, q, k, k, extra, extra)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=1e-5)
    hlo = attend.lower(view, q, k, extra).compile().as_text()
    assert_no_pool_collective(hlo, LAYOUT.num_pages, shape[0])
    # Only the attention output crosses "cfg" groups (one all-reduce of q's size); tp needs nothing.
    reduced = [shapes for kind, shapes in collectives(hlo) if kind == "all-reduce"]
    assert len(reduced) == (1 if shape[0] > 1 else 0)


def test_branches_batched_over_cfg_groups_attend_without_any_exchange():
    sharding = KVSharding(make_mesh((2, 2)))
    # Runs 0 (group 0) and 3 (group 1): the branch-major layout's positive and negative runs.
    pools, sharded, cursors = _fill(LAYOUT, sharding)
    q = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 8, 8)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(3).normal(size=(8, 8, 8)), jnp.float32)

    def one_branch(cursor, q):
        view = PagedKVCaches(pools=sharded, cursor=cursor, layout=LAYOUT, seq_len=8, sharding=sharding)
        return view.attend(0, q, k, k)

    both = jax.jit(jax.vmap(one_branch))
    stacked = jnp.stack([cursors[0], cursors[3]])
    out = both(stacked, q)
    for i, run in enumerate((0, 3)):
        ref = ref_paged_attention(LAYOUT, pools, cursors[run], 0, q[i], k, k)
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(ref), atol=2e-6, rtol=1e-5)
    assert out.sharding.spec[0] == "cfg"
    assert collectives(both.lower(stacked, q).compile().as_text()) == []
    # A branch whose run is on the other group is NaN, never another branch's answer.
    swapped = both(jnp.stack([cursors[3], cursors[0]]), q)
    assert bool(jnp.isnan(swapped).all())


def test_batched_attention_off_the_cfg_layout_falls_back_to_one_branch_at_a_time():
    sharding = KVSharding(make_mesh((2, 2)))
    pools, sharded, cursors = _fill(LAYOUT, sharding)
    q = jnp.asarray(np.random.default_rng(4).normal(size=(3, 6, 8, 8)), jnp.float32)  # 3 branches, 2 groups
    k = jnp.asarray(np.random.default_rng(5).normal(size=(8, 8, 8)), jnp.float32)
    runs = (0, 3, 0)
    stacked = jnp.stack([cursors[r] for r in runs])

    def one(cursor, q):
        return PagedKVCaches(pools=sharded, cursor=cursor, layout=LAYOUT, seq_len=8, sharding=sharding).attend(
            1, q, k, k)

    out = jax.jit(jax.vmap(one))(stacked, q)
    for i, run in enumerate(runs):
        ref = ref_paged_attention(LAYOUT, pools, cursors[run], 1, q[i], k, k)
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(ref), atol=2e-6, rtol=1e-5)


def test_bfloat16_pools_stored_as_bits_shard_the_same():
    layout = KVLayout(num_layers=2, num_pages=20, tokens_per_frame=4, num_kv_heads=8, head_size=8, sink_frames=1,
                      window_frames=4, frames_per_block=2, scratch_pages=3, dtype="bfloat16", storage_dtype="uint16")
    sharding = KVSharding(make_mesh((2, 2)))
    pools, sharded, cursors = _fill(layout, sharding, steps=3, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(pools.k), np.asarray(sharded.k))
    q = jnp.ones((4, 8, 8), jnp.bfloat16)
    k = jnp.ones((8, 8, 8), jnp.bfloat16)
    out = sharded_attention(paged_attention, layout, sharding, sharded, cursors[3], 0, q, k, k)
    ref = paged_attention(layout, pools, cursors[3], 0, q, k, k)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=1e-2)


def test_geometry_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="8 KV heads do not split over tp=3"):
        KVSharding(jax.sharding.Mesh(np.array(jax.devices()[:3]).reshape(1, 3), ("cfg", "tp"))).check_layout(LAYOUT)
    odd_runs = KVLayout(num_layers=1, num_pages=15, tokens_per_frame=2, num_kv_heads=2, head_size=4, sink_frames=1,
                        window_frames=4, frames_per_block=1, scratch_pages=1)
    with pytest.raises(ValueError, match="3 runs .* do not split over cfg=2"):
        KVSharding(make_mesh((2, 1))).check_layout(odd_runs)
    with pytest.raises(ValueError, match="axes .*'data'"):
        KVSharding(jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tp")))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        KVSharding("tp=2")


def test_the_check_catches_the_pool_gather_a_naive_program_makes():
    """Why the shard_map paths exist: the one-device write, left to XLA on a cfg-split pool, gathers it.

    The one-device read gathers only the pages that can be visible (``paged_attention`` reads the
    ordered visible table, not the whole ring), so XLA no longer moves the pool for it: the check
    must pass on it, and still catches the write's gather."""
    sharding = KVSharding(make_mesh((2, 2)))
    pools = _sharded_pools(LAYOUT, sharding)
    block = jnp.ones((2, 8, 8, 8), jnp.float32)
    naive_write = jax.jit(write_block, static_argnums=0).lower(LAYOUT, pools, jnp.array([5, 6], jnp.int32), block,
                                                               block).compile().as_text()
    cursor = jnp.asarray(contiguous_table_cursor(LAYOUT, 5, 3, 0))
    naive_read = jax.jit(paged_attention, static_argnums=0).lower(
        LAYOUT, pools, cursor, 0, jnp.ones((4, 8, 8)), block[0], block[0]).compile().as_text()
    with pytest.raises(AssertionError):
        assert_no_pool_collective(naive_write, LAYOUT.num_pages, 2)
    assert_no_pool_collective(naive_read, LAYOUT.num_pages, 2)


def test_eager_calls_compile_once_and_equal_the_jitted_ones():
    # An eager shard_map runs op by op (seconds a call): the sharded functions jit their program.
    sharding = KVSharding(make_mesh((2, 2)))
    pools, sharded, cursors = _fill(LAYOUT, sharding)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(6, 16, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32)
    pages = np.array([5, 6], np.int32)
    block = jnp.asarray(rng.normal(size=(2, 8, 8, 8)), jnp.float32)
    cursor = cursors[3]

    def both():
        return (sharded_attention(paged_attention, LAYOUT, sharding, sharded, cursor, 1, q, k, k),
                sharded_write_block(LAYOUT, sharding, sharded, pages, block, block))

    both()  # compiles
    with count_compiles() as compiled:
        out, written = both()
    assert compiled == []
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_paged_attention(LAYOUT, pools, cursor, 1, q, k, k)),
                               atol=2e-6, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(written.k), np.asarray(write_block(LAYOUT, pools, pages, block, block).k))


@pytest.mark.parametrize("mesh_name", list(MESH_SHAPES))
def test_slot_copies_of_split_pools_equal_the_one_device_copies_bit_for_bit(mesh_name):
    shape = MESH_SHAPES[mesh_name]
    sharding = KVSharding(make_mesh(shape))
    pools, sharded, _ = _fill(LAYOUT, sharding)
    # Bits a float sum would change: -0.0 and a NaN payload (the copy moves stored bits, not values).
    odd = np.array([-0.0, np.float32(np.nan)], np.float32)
    odd[1] = np.frombuffer(np.uint32(0x7FC0_1234).tobytes(), np.float32)[0]
    pools = KVPools(k=pools.k.at[0, 15, 0, 0, :2].set(odd), v=pools.v)
    sharded = jax.device_put(pools, sharded.k.sharding)
    runs = LAYOUT.num_runs
    starts = np.array([3, 0], np.int32) * LAYOUT.run_pages if shape[0] == 1 else \
        np.array([1, runs // 2 + 1], np.int32) * LAYOUT.run_pages  # two runs on different cfg groups
    want = [read_pages(LAYOUT, pools, int(start), LAYOUT.run_pages) for start in starts]
    read = jax.jit(sharded_read_runs, static_argnums=(0, 1))
    copy = read(LAYOUT, sharding, sharded, starts)
    for name in ("k", "v"):
        expected = np.concatenate([np.asarray(getattr(w, name)) for w in want], axis=1)
        assert np.asarray(getattr(copy, name)).tobytes() == expected.tobytes()
    # Heads over tp, layers over cfg: one copy of the session across all devices, none duplicated.
    assert copy.k.sharding.is_equivalent_to(sharding.copy_sharding(LAYOUT), 5)
    assert copy.k.addressable_shards[0].data.nbytes == copy.k.nbytes // sharding.num_shards
    hlo = read.lower(LAYOUT, sharding, sharded, starts).compile().as_text()
    # What crosses cfg groups is the copy (one reduce-scatter per pool into each device's share), never a pool.
    exchanged = [(kind, shape_) for kind, shapes in collectives(hlo) for shape_ in shapes]
    share = copy.k.addressable_shards[0].data.shape
    assert exchanged == ([("reduce-scatter", share)] * 2 if shape[0] > 1 else []), exchanged
    # Written back into empty split pools: exactly those runs, every other page untouched.
    empty = _sharded_pools(LAYOUT, sharding)
    written = jax.jit(sharded_write_runs, static_argnums=(0, 1), donate_argnums=2)(LAYOUT, sharding, empty, starts,
                                                                                    copy)
    expected = allocate_pools(LAYOUT)
    for start, run in zip(starts, want):
        expected = write_pages(LAYOUT, expected, int(start), run)
    for name in ("k", "v"):
        assert np.asarray(getattr(written, name)).tobytes() == np.asarray(getattr(expected, name)).tobytes()
    assert written.k.sharding.is_equivalent_to(sharding.pool_sharding, 5)
