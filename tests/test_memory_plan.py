"""Memory plan arithmetic reproduces the reference's formulas and worked numbers.

Both are in ``docs/reference_behaviour.md``, "Memory plan".
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ardiff_jax import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    plan_memory,
)
from ardiff_jax.cli import main as cli_main
from ardiff_jax.geometries import EXAMPLE_GEOMETRIES, example_spec
from ardiff_jax.runtime import SCRATCH_BLOCKS_ENV, ARDiffusionKVCache

MAIN = (ARDiffusionKVBranchSpec("main", 0),)
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def tiny_spec(**overrides):
    """The reference's tiny geometry: P = 8 bytes, C = 16 bytes per session."""
    fields = dict(num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_block=3,
                  window_frames=3, sink_frames=3, kv_branches=MAIN,
                  cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 2),), session_capacity=2)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def test_tiny_geometry_one_and_two_sessions():
    plan = plan_memory(tiny_spec(), dtype=jnp.float32, available_memory_bytes=192, gpu_memory_fraction=1.0)
    assert plan.page_bytes == 8
    assert plan.scratch_blocks_per_branch == 3 and plan.scratch_bytes == 24
    assert plan.cross_attention_bytes_per_session == 16
    assert plan.required_bytes(1) == 128
    assert plan.required_bytes(2) == 192
    assert plan.session_capacity == 2
    assert plan.managed_pages == 17  # N(2)
    assert plan.planned_bytes == plan.budget_bytes == 192
    plan_one = plan_memory(tiny_spec(), dtype=jnp.float32, available_memory_bytes=128, gpu_memory_fraction=1.0)
    assert plan_one.session_capacity == 1


def test_one_byte_short_names_both_numbers():
    with pytest.raises(ValueError, match=r"cannot fit one session.*available=127 bytes.*required=128 bytes"):
        plan_memory(tiny_spec(), dtype=jnp.float32, available_memory_bytes=127, gpu_memory_fraction=1.0)
    # The manager raises the same error before allocating anything.
    with pytest.raises(ValueError, match=r"available=127.*required=128"):
        ARDiffusionKVCache(tiny_spec(), dtype=jnp.float32, available_memory_bytes=127)


def test_fraction_is_a_soft_floor():
    plan = plan_memory(tiny_spec(), dtype=jnp.float32, available_memory_bytes=1280, gpu_memory_fraction=0.05)
    assert plan.configured_budget_bytes == 64
    assert plan.budget_bytes == 128
    assert plan.session_capacity == 1
    assert plan.budget_raised


def test_requested_capacity_caps_and_model_owned_bytes():
    plan = plan_memory(tiny_spec(session_capacity=64), dtype=jnp.float32, available_memory_bytes=192,
                       gpu_memory_fraction=1.0)
    assert plan.session_capacity == 2  # requested 64, memory for 2
    assert plan.requested_session_capacity == 64
    assert plan.cross_attention_reserved_bytes == 32
    owned = plan_memory(tiny_spec(model_owned_state_bytes_per_session=16), dtype=jnp.float32,
                        available_memory_bytes=200, gpu_memory_fraction=1.0)
    assert owned.session_capacity == 1 and owned.model_owned_reserved_bytes == 16
    assert owned.planned_bytes <= owned.budget_bytes


def test_dreamzero_like_capacity():
    # The reference's DreamZero-like example: float32, tokens 16, heads 4, head 64, 2 layers -> P = 65,536; 44 pages available.
    spec = ARDiffusionKVCacheSpec(num_layers=2, num_kv_heads=4, head_size=64, tokens_per_frame=16,
                                  frames_per_block=4, window_frames=6, kv_branches=CFG,
                                  cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 8),), session_capacity=64)
    page = 65_536
    plan = plan_memory(spec, dtype=jnp.float32, available_memory_bytes=44 * page, gpu_memory_fraction=1.0)
    assert plan.page_bytes == page
    assert plan.session_capacity == 2
    assert plan.managed_pages == 34
    assert plan.scratch_bytes == 8 * page
    assert plan.cross_attention_reserved_bytes == 2 * page


def test_cross_bytes_count_every_logical_branch():
    # Two branches sharing slot 0, f16, text 512 -> 2*2*512*4*64*2*2 bytes.
    spec = ARDiffusionKVCacheSpec(num_layers=2, num_kv_heads=4, head_size=64, tokens_per_frame=16,
                                  frames_per_block=1, window_frames=2,
                                  kv_branches=(ARDiffusionKVBranchSpec("positive", 0),
                                               ARDiffusionKVBranchSpec("negative", 0)),
                                  cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512),), session_capacity=64)
    plan = plan_memory(spec, dtype=jnp.float16, available_memory_bytes=2**30, gpu_memory_fraction=0.5)
    assert plan.cross_attention_bytes_per_session == 2 * 2 * 512 * 4 * 64 * 2 * 2
    assert plan.num_local_kv_branches == 1


def test_lingbot_budgets():
    spec = example_spec("lingbot_world")
    plan = plan_memory(spec, dtype="bfloat16", available_memory_bytes=100 * 2**30, gpu_memory_fraction=0.1)
    assert plan.configured_budget_bytes == 10 * 2**30
    assert plan.budget_bytes == 33_653_670_400
    assert plan.session_capacity == 1
    plan = plan_memory(spec, dtype="bfloat16", available_memory_bytes=100 * 2**30, gpu_memory_fraction=0.6)
    assert plan.budget_bytes == 60 * 2**30
    assert plan.session_capacity == 2


def test_pool_floor_per_local_branch_count():
    # Sink + window = 9 run pages, F 2 -> one local slot 1*(9+2)+2 = 13, two slots 24.
    one = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_block=2,
                                 window_frames=9, sink_frames=0, kv_branches=MAIN, session_capacity=1)
    plan = plan_memory(one, dtype=jnp.float32, available_memory_bytes=10**6, gpu_memory_fraction=1.0)
    assert plan.managed_pages == 1 * (9 + 2) + 2
    two = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_block=2,
                                 window_frames=9, kv_branches=CFG, session_capacity=1)
    plan = plan_memory(two, dtype=jnp.float32, available_memory_bytes=10**6, gpu_memory_fraction=1.0)
    assert plan.managed_pages == 2 * (9 + 2) + 2
    assert plan.scratch_bytes == 2 * plan.scratch_blocks_per_branch * plan.page_bytes
    assert plan.scratch_blocks_per_branch == 2


def test_scratch_env_raises_never_lowers(monkeypatch):
    spec = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=16,
                                  frames_per_block=6, window_frames=6, kv_branches=MAIN, session_capacity=1,
                                  max_scratch_tokens_per_branch=17)
    kwargs = dict(dtype=jnp.float32, available_memory_bytes=10**7, gpu_memory_fraction=1.0)
    assert plan_memory(spec, **kwargs).scratch_blocks_per_branch == 8  # 6 + ceil(17 / 16)
    monkeypatch.setenv(SCRATCH_BLOCKS_ENV, "1")
    assert plan_memory(spec, **kwargs).scratch_blocks_per_branch == 8
    monkeypatch.setenv(SCRATCH_BLOCKS_ENV, "11")
    assert plan_memory(spec, **kwargs).scratch_blocks_per_branch == 11
    for bad in ("-1", "2.5", "many"):
        monkeypatch.setenv(SCRATCH_BLOCKS_ENV, bad)
        with pytest.raises(ValueError, match=SCRATCH_BLOCKS_ENV):
            plan_memory(spec, **kwargs)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_invalid_fraction(fraction):
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        plan_memory(tiny_spec(), dtype=jnp.float32, available_memory_bytes=1000, gpu_memory_fraction=fraction)


def test_manager_allocates_runs_and_exposes_plan():
    cache = ARDiffusionKVCache(tiny_spec(), dtype=jnp.float32, available_memory_bytes=192, gpu_memory_fraction=1.0)
    assert cache.session_capacity == 2
    assert cache.plan.pool_pages == 2 * (3 + 3)
    assert cache.pools.k.shape == (1, 12, 1, 1, 1)
    assert cache.plan.pool_bytes <= cache.plan.planned_bytes
    assert "session capacity" in str(cache.plan)
    assert "2 (requested 2)" in str(cache.plan)


def test_measured_free_memory_when_not_given():
    cache = ARDiffusionKVCache(tiny_spec(), dtype=jnp.float32)
    assert cache.plan.memory_source in ("device", "host")
    assert cache.plan.available_bytes > 0


def test_bf16_pools_are_uint16_bits_on_cpu():
    cache = ARDiffusionKVCache(tiny_spec(), dtype="bfloat16", available_memory_bytes=10**6)
    assert cache.layout.dtype == "bfloat16"
    assert cache.pools.k.dtype == jnp.uint16


@pytest.mark.parametrize("name", sorted(EXAMPLE_GEOMETRIES))
def test_cli_plan_every_example(name, capsys):
    assert cli_main(["plan", "--geometry", name, "--available-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "session capacity" in out and name in out


def test_cli_plan_reports_unfit_budget(capsys):
    assert cli_main(["plan", "--geometry", "wan_1_3b", "--available-bytes", "1000"]) == 2
    assert "cannot fit one session" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 4), heads=st.integers(1, 4), tokens=st.integers(1, 8), block=st.integers(1, 3),
    extra_window=st.integers(0, 4), sink=st.integers(0, 3), branches=st.integers(1, 2), cross=st.integers(0, 9),
    owned=st.integers(0, 5000), requested=st.integers(1, 40), available=st.integers(0, 400_000),
    fraction=st.sampled_from([0.05, 0.1, 0.5, 1.0]),
)
def test_capacity_is_the_largest_fitting_count(layers, heads, tokens, block, extra_window, sink, branches, cross,
                                               owned, requested, available, fraction):
    """The closed-form capacity equals the brute-force rule: largest c <= requested with required(c) <= budget."""
    spec = ARDiffusionKVCacheSpec(
        num_layers=layers, num_kv_heads=heads, head_size=4, tokens_per_frame=tokens, frames_per_block=block,
        window_frames=block + extra_window, sink_frames=sink, kv_branches=CFG[:branches],
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", cross),) if cross else (),
        model_owned_state_bytes_per_session=owned, session_capacity=requested)
    try:
        plan = plan_memory(spec, dtype=jnp.float32, available_memory_bytes=available, gpu_memory_fraction=fraction)
    except ValueError:
        assert plan_required_one(spec) > available
        return
    expected = max(c for c in range(1, requested + 1) if plan.required_bytes(c) <= plan.budget_bytes)
    assert plan.session_capacity == expected
    assert plan.budget_bytes == max(int(available * fraction), plan.required_bytes(1))


def plan_required_one(spec):
    big = plan_memory(spec, dtype=jnp.float32, available_memory_bytes=10**12, gpu_memory_fraction=1.0)
    return big.required_bytes(1)
