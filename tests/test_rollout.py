"""Device-side rollout: equals the runner path, keeps pools in the carry, one program for all fill levels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionKVBranchSpec, ARDiffusionKVCache, ARDiffusionKVCacheSpec
from ardiff_jax.kv import contiguous_table_cursor
from ardiff_jax.rollout import rollout_blocks, rollout_sessions

MODEL_DIM = 8


def make_cache(reset_at_boundary=False, capacity=3):
    spec = ARDiffusionKVCacheSpec(num_layers=2, num_kv_heads=2, head_size=4, tokens_per_frame=2, frames_per_block=2,
                                  window_frames=4, sink_frames=1, reset_at_boundary=reset_at_boundary,
                                  kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=capacity,
                                  max_scratch_tokens_per_branch=2)
    return ARDiffusionKVCache(spec, dtype=jnp.float32, available_memory_bytes=10**7, gpu_memory_fraction=1.0)


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    shape = (2, MODEL_DIM, 2 * 4)
    return {name: jnp.asarray(rng.normal(size=shape) / np.sqrt(MODEL_DIM), jnp.float32) for name in "qkv"} | {
        "o": jnp.asarray(rng.normal(size=(2, 8, MODEL_DIM)) / np.sqrt(8), jnp.float32)}


def block_fn(params, caches, x):
    """A 2-layer attention-only model: a denoise probe (no write) then the committing clean pass."""
    seq = x.shape[0]

    def forward(h):
        ks, vs = [], []
        for layer in range(2):
            q = (h @ params["q"][layer]).reshape(seq, 2, 4)
            k = (h @ params["k"][layer]).reshape(seq, 2, 4)
            v = (h @ params["v"][layer]).reshape(seq, 2, 4)
            extra = k[:2] * 0.5  # two register tokens riding in scratch
            o = caches.attend(layer, q, k, v, extra_k=extra, extra_v=extra)
            h = h + o.reshape(seq, 8) @ params["o"][layer]
            ks.append(k)
            vs.append(v)
        return h, jnp.stack(ks), jnp.stack(vs)

    noisy, _, _ = forward(x + 1.0)  # non-committing probe
    clean, k, v = forward(x + 0.01 * noisy)
    return clean, k, v


def schedule(num_sessions, blocks_each):
    return np.array([s for _ in range(blocks_each) for s in range(num_sessions)], dtype=np.int32)


@pytest.mark.parametrize("reset_at_boundary", [False, True])
def test_device_rollout_equals_runner_path(reset_at_boundary):
    params = make_params()
    order = schedule(num_sessions=2, blocks_each=7)  # 14 frames per session: the 4-frame ring wraps 3x
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(len(order), 4, MODEL_DIM)), jnp.float32)

    # Runner path: one get_kv_caches / jitted forward / donated commit per block.
    host_cache = make_cache(reset_at_boundary)
    host_states = [host_cache.create_state(f"s{i}") for i in range(2)]
    step = jax.jit(block_fn)
    host_ys = []
    for i, s in enumerate(order):
        caches = host_states[s].get_kv_caches("main", seq_len=4, commit_current=True)
        y, k, v = step(params, caches, xs[i])
        host_states[s].commit_paged_context("main", kv=(k, v))
        host_ys.append(y)
    host_ys = np.stack(host_ys)

    # Device path: the whole schedule in one jit.
    dev_cache = make_cache(reset_at_boundary)
    dev_states = [dev_cache.create_state(f"s{i}") for i in range(2)]
    dev_ys = rollout_sessions(dev_cache, dev_states, jax.tree_util.Partial(block_fn, params), xs, order,
                              branch="main", num_frames=2)
    # Different XLA programs (fused scan vs separate jits) may round differently; float32
    # attention over <= 10 keys keeps the difference at a few ulps.
    np.testing.assert_allclose(np.asarray(dev_ys), host_ys, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dev_cache.pools.k), np.asarray(host_cache.pools.k), rtol=2e-5, atol=2e-6)
    for host, dev in zip(host_states, dev_states):
        assert dev.adapter("main").committed_frames == host.adapter("main").committed_frames == 14
        assert dev.adapter("main").visible_start_frame == host.adapter("main").visible_start_frame


def test_rollout_donates_and_keeps_pools_in_carry():
    cache = make_cache(capacity=64)  # a pool much larger than the model's own temporaries
    states = [cache.create_state("a")]
    params = make_params()
    fn = jax.tree_util.Partial(block_fn, params)
    order = schedule(1, 5)
    xs = jnp.zeros((5, 4, MODEL_DIM), jnp.float32)
    cursors = np.stack([contiguous_table_cursor(cache.layout, 0, 0, 0)])
    lowered = rollout_blocks.lower(cache.layout, cache.pools, cursors, fn, xs, order, num_frames=2)
    analysis = lowered.compile().memory_analysis()
    pool_bytes = cache.pools.k.nbytes + cache.pools.v.nbytes
    assert analysis.alias_size_in_bytes >= pool_bytes  # pools aliased in place
    # No hidden pool copy: a copy of either pool would cost pool_bytes / 2 of temporaries
    # (writing the carried pools after reading them in the same step did exactly that).
    assert analysis.temp_size_in_bytes < pool_bytes // 8, analysis
    jaxpr = jax.make_jaxpr(lambda p, c, x, i: rollout_blocks(cache.layout, p, c, fn, x, i, num_frames=2))(
        cache.pools, cursors, xs, order)
    scans = [eqn for eqn in _walk(jaxpr.jaxpr) if eqn.primitive.name == "scan"]
    assert scans, "the rollout must be a scan"
    for eqn in scans:
        num_carry = eqn.params["num_carry"]
        num_consts = eqn.params["num_consts"]
        xs_vars = eqn.invars[num_consts + num_carry:]
        ys_vars = eqn.outvars[num_carry:]
        for var in list(xs_vars) + list(ys_vars):
            assert tuple(var.aval.shape) != cache.pools.k.shape, "pools passed as scan xs/ys"
    old_k = cache.pools.k
    rollout_sessions(cache, states, fn, xs, order, branch="main", num_frames=2)
    assert old_k.is_deleted()


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _walk(inner if hasattr(inner, "eqns") else inner.jaxpr)


def test_rollout_validates_on_host_before_dispatch():
    cache = make_cache()
    states = [cache.create_state("a")]
    fn = jax.tree_util.Partial(block_fn, make_params())
    xs = jnp.zeros((2, 4, MODEL_DIM), jnp.float32)
    pools = cache.pools
    with pytest.raises(ValueError, match="session_index"):
        rollout_sessions(cache, states, fn, xs, [0, 1], branch="main", num_frames=2)
    with pytest.raises(KeyError):
        rollout_sessions(cache, states, fn, xs, [0, 0], branch="nope", num_frames=2)
    with pytest.raises(ValueError, match="num_frames"):
        rollout_sessions(cache, states, fn, xs, [0, 0], branch="main", num_frames=5)
    assert cache.pools is pools and not pools.k.is_deleted()
