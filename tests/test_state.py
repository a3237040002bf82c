"""``ARDiffusionKVState``: error paths are transactional, lifecycle, cross-attention.

The behaviour is specified in ``docs/reference_behaviour.md``, "KV state".

Every failing call must leave the stored KV (both pools, compared with host copies taken
before the call), the cursors and the pending contexts exactly as they were.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionCrossAttentionKVSpec, CrossAttentionKV
from helpers import CFG, SHARED, make_cache, pool_snapshot, randn, text_cross

L, H, D, T = 2, 2, 4, 2


def _cache(**overrides):
    fields = dict(num_layers=L, num_kv_heads=H, head_size=D, tokens_per_frame=T, frames_per_block=2, window_frames=3,
                  sink_frames=1, kv_branches=CFG,
                  cross_attention=(text_cross(3), ARDiffusionCrossAttentionKVSpec("image", 2)),
                  max_scratch_tokens_per_branch=0)
    fields.update(overrides)
    return make_cache(**fields)


def _block(rng, frames=2):
    return randn(rng, L, frames * T, H, D), randn(rng, L, frames * T, H, D)


def _commit(state, branch, rng, frames=2):
    state.get_kv_caches(branch, seq_len=frames * T, commit_current=True)
    state.commit_paged_context(branch, kv=_block(rng, frames))


def _snapshot(cache, state):
    k, v = pool_snapshot(cache)
    return k, v, state.describe()


def _assert_unchanged(cache, state, before):
    k, v = pool_snapshot(cache)
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])
    assert state.describe() == before[2]


@pytest.fixture
def primed():
    """A session with committed history on both branches (6 frames on 'positive', 1 on 'negative')."""
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(0)
    for _ in range(3):
        _commit(state, "positive", rng)
    _commit(state, "negative", rng, frames=1)
    assert pool_snapshot(cache)[0].any()
    return cache, state, rng


# -- error paths ---------------------------------------------------------------------------------------------

ERROR_CASES = {
    "unknown branch get": (KeyError, "Unknown AR-Diffusion KV branch",
                           lambda s, rng: s.get_kv_caches("nope", seq_len=T)),
    "unknown branch commit": (KeyError, "Unknown", lambda s, rng: s.commit_paged_context("nope")),
    "unknown branch adapter": (KeyError, "Unknown", lambda s, rng: s.adapter("nope")),
    "unknown branch discard": (KeyError, "Unknown", lambda s, rng: s.discard_paged_context("nope")),
    "seq_len missing": (ValueError, "requires seq_len", lambda s, rng: s.get_kv_caches("negative")),
    "seq_len not an int": (ValueError, "integer", lambda s, rng: s.get_kv_caches("negative", seq_len=2.0)),
    "seq_len not frame aligned": (ValueError, "frame-aligned",
                                  lambda s, rng: s.get_kv_caches("negative", seq_len=T + 1)),
    "seq_len zero": (ValueError, "frame-aligned", lambda s, rng: s.get_kv_caches("negative", seq_len=0)),
    "seq_len > window": (ValueError, "exceeds window_frames",
                         lambda s, rng: s.get_kv_caches("negative", seq_len=4 * T)),
    "seq_len > scratch": (RuntimeError, "scratch blocks exhausted",
                          lambda s, rng: s.get_kv_caches("negative", seq_len=3 * T)),
    "committing without kv": (ValueError, "must be committed with kv",
                              lambda s, rng: s.commit_paged_context("positive")),
    "second get over committing": (RuntimeError, "replaced before",
                                   lambda s, rng: s.get_kv_caches("positive", seq_len=T)),
    "second committing get over committing": (RuntimeError, "replaced before",
                                              lambda s, rng: s.get_kv_caches("positive", seq_len=2 * T,
                                                                             commit_current=True)),
    "kv without pending": (ValueError, "no pending context",
                           lambda s, rng: s.commit_paged_context("negative", kv=_block(rng))),
    "kv shape wrong length": (ValueError, "must have shape",
                              lambda s, rng: s.commit_paged_context("positive", kv=_block(rng, 1))),
    "kv wrong layers": (ValueError, "must have shape",
                        lambda s, rng: s.commit_paged_context(
                            "positive", kv=(randn(rng, L + 1, 2 * T, H, D), randn(rng, L + 1, 2 * T, H, D)))),
    "kv wrong heads for v": (ValueError, "commit v must have shape",
                             lambda s, rng: s.commit_paged_context(
                                 "positive", kv=(randn(rng, L, 2 * T, H, D), randn(rng, L, 2 * T, H + 1, D)))),
    "kv batch 2": (ValueError, "must have shape",
                   lambda s, rng: s.commit_paged_context(
                       "positive", kv=(randn(rng, L, 2, 2 * T, H, D), randn(rng, L, 2, 2 * T, H, D)))),
    "kv not a pair": (ValueError, "pair", lambda s, rng: s.commit_paged_context("positive", kv=_block(rng)[:1])),
    "kv integer dtype": (ValueError, "floating",
                         lambda s, rng: s.commit_paged_context(
                             "positive", kv=tuple(np.ones((L, 2 * T, H, D), np.int32) for _ in range(2)))),
    "kv not an array": (ValueError, "must be an array",
                        lambda s, rng: s.commit_paged_context("positive", kv=([1.0], [1.0]))),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_paths_change_nothing(primed, case):
    cache, state, rng = primed
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)  # pending committing context
    adapters = {name: state.adapter(name) for name in state.kv_branch_names}
    before = _snapshot(cache, state)
    exc, match, call = ERROR_CASES[case]
    with pytest.raises(exc, match=match):
        call(state, rng)
    _assert_unchanged(cache, state, before)
    assert {name: state.adapter(name) for name in state.kv_branch_names} == adapters
    assert not cache.pools.is_deleted()
    # The pending committing context is still usable afterwards.
    state.commit_paged_context("positive", kv=_block(rng))
    assert state.adapter("positive").committed_frames == 3 * 2 + 2


def test_non_committing_context_committed_with_kv(primed):
    cache, state, rng = primed
    state.get_kv_caches("negative", seq_len=T, commit_current=False)
    before = _snapshot(cache, state)
    with pytest.raises(ValueError, match="non-committing"):
        state.commit_paged_context("negative", kv=_block(rng, 1))
    _assert_unchanged(cache, state, before)
    state.commit_paged_context("negative")  # without kv: just clears
    assert state.describe()["pending"] == {}
    np.testing.assert_array_equal(pool_snapshot(cache)[0], before[0])


@pytest.mark.parametrize("method", ["get", "commit", "adapter", "discard", "populate", "read_cross", "clear_cross",
                                    "is_populated"])
def test_closed_state_raises_and_changes_nothing(primed, method):
    cache, state, rng = primed
    state.close()
    before = _snapshot(cache, state)
    calls = {
        "get": lambda: state.get_kv_caches("positive", seq_len=T),
        "commit": lambda: state.commit_paged_context("positive", kv=_block(rng)),
        "adapter": lambda: state.adapter("positive"),
        "discard": lambda: state.discard_paged_context("positive"),
        "populate": lambda: state.populate_cross_attention("positive", "text", _cross_layers(rng, 3)),
        "read_cross": lambda: state.get_cross_attention_kv("positive", "text"),
        "clear_cross": lambda: state.clear_cross_attention(),
        "is_populated": lambda: state.is_cross_attention_populated("positive", "text"),
    }
    with pytest.raises(RuntimeError, match="is closed"):
        calls[method]()
    _assert_unchanged(cache, state, before)
    assert state.cross_attention_bytes == 0


def test_max_model_len_refuses_the_commit():
    cache = _cache(max_model_len=3 * T)
    state = cache.create_state("s")
    rng = np.random.default_rng(1)
    _commit(state, "positive", rng)
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)
    before = _snapshot(cache, state)
    with pytest.raises(RuntimeError, match="max_model_len"):
        state.commit_paged_context("positive", kv=_block(rng))
    _assert_unchanged(cache, state, before)


# -- commits, branches, adapters ------------------------------------------------------------------------------


def test_commit_advances_cursor_and_writes_only_its_pages():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(2)
    positive = state.adapter("positive")
    assert positive.request_id == "ar::s::positive"
    assert state.adapter("negative").request_id == "ar::s::negative"
    assert (positive.committed_frames, positive.num_computed_tokens) == (0, 0)
    k, v = _block(rng)
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)
    assert positive.committed_frames == 0  # nothing advances before the commit
    state.commit_paged_context("positive", kv=(k, v))
    assert positive is state.adapter("positive")
    assert (positive.committed_frames, positive.completed_chunks, positive.num_computed_tokens) == (2, 2, 2 * T)
    # Branches are independent: the negative branch is still empty.
    negative = state.adapter("negative")
    assert negative.committed_frames == 0 and negative.num_computed_tokens == 0
    assert state.get_kv_caches("negative", seq_len=T).visible_frames().tolist() == []
    state.commit_paged_context("negative")
    # The block landed in positive's run (run 0 of slot 0): frame 0 = sink page 0, frame 1 = ring page 1.
    pk, pv = pool_snapshot(cache)
    np.testing.assert_array_equal(pk[:, 0:2].reshape(L, 2 * T, H, D), k)
    np.testing.assert_array_equal(pv[:, 0:2].reshape(L, 2 * T, H, D), v)
    assert not pk[:, 2:].any() and not pv[:, 2:].any()
    assert state.get_kv_caches("positive", seq_len=T).visible_frames().tolist() == [0, 1]


def test_batched_commit_kv_is_accepted():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(3)
    k, v = _block(rng)
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)
    state.commit_paged_context("positive", kv=(jnp.asarray(k)[:, None], jnp.asarray(v)[:, None]))
    np.testing.assert_array_equal(pool_snapshot(cache)[0][:, 0:2].reshape(k.shape), k)


def test_discard_paged_context():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(4)
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)
    before = _snapshot(cache, state)
    state.discard_paged_context("positive")
    assert state.describe()["pending"] == {}
    assert state.adapter("positive").committed_frames == 0
    np.testing.assert_array_equal(pool_snapshot(cache)[0], before[0])
    with pytest.raises(ValueError, match="no pending context"):
        state.commit_paged_context("positive", kv=_block(rng))
    state.discard_paged_context("positive")  # nothing pending: a no-op
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=True)  # allowed again
    state.commit_paged_context("positive", kv=_block(rng))
    assert state.adapter("positive").committed_frames == 2


def test_shared_local_index_cannot_hold_two_histories():
    cache = _cache(kv_branches=SHARED)
    assert cache.spec.num_local_kv_branches == 1
    state = cache.create_state("s")
    rng = np.random.default_rng(5)
    _commit(state, "positive", rng)
    state.get_kv_caches("negative", seq_len=2 * T, commit_current=True)
    before = _snapshot(cache, state)
    with pytest.raises(RuntimeError, match="share local_index 0"):
        state.commit_paged_context("negative", kv=_block(rng))
    _assert_unchanged(cache, state, before)
    # Scratch (non-committing) forwards of the other branch are fine and see nothing.
    state.discard_paged_context("negative")
    assert state.get_kv_caches("negative", seq_len=T).visible_frames().tolist() == []


def test_reset_zeroes_counters_and_installs_new_adapters():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(6)
    _commit(state, "positive", rng)
    _commit(state, "negative", rng)
    state.get_kv_caches("positive", seq_len=T, commit_current=True)
    old = {name: state.adapter(name) for name in state.kv_branch_names}
    state.populate_cross_attention("positive", "text", _cross_layers(rng, 3))
    state.reset()
    for name in state.kv_branch_names:
        new = state.adapter(name)
        assert new is not old[name] and new.request_id == old[name].request_id == f"ar::s::{name}"
        assert new.committed_frames == 0 and new.num_computed_tokens == 0 and new.visible_start_frame == 0
        assert state.get_kv_caches(name, seq_len=T).visible_frames().tolist() == []
    assert state.describe()["pending"] != {}  # the probes just taken
    assert not state.is_cross_attention_populated("positive", "text")
    assert state.slot == 0 and cache.num_free_slots == cache.session_capacity - 1
    # A later commit works (the pending non-committing context is replaced silently).
    _commit(state, "positive", rng)
    assert state.adapter("positive").committed_frames == 2


def test_reset_keeps_only_named_cross_caches_and_unknown_name_changes_nothing():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(7)
    _commit(state, "positive", rng)
    text = _cross_layers(rng, 3)
    state.populate_cross_attention("positive", "text", text)
    state.populate_cross_attention("negative", "text", _cross_layers(rng, 3))
    state.populate_cross_attention("positive", "image", _cross_layers(rng, 2))
    adapters = {name: state.adapter(name) for name in state.kv_branch_names}
    before = _snapshot(cache, state)
    with pytest.raises(KeyError, match="video"):
        state.reset(keep_cross_attention=("text", "video"))
    _assert_unchanged(cache, state, before)
    assert {name: state.adapter(name) for name in state.kv_branch_names} == adapters
    state.reset(keep_cross_attention=("text",))
    assert state.is_cross_attention_populated("positive", "text")
    assert state.is_cross_attention_populated("negative", "text")
    assert not state.is_cross_attention_populated("positive", "image")
    _assert_cross_equal(state.get_cross_attention_kv("positive", "text"), text)
    assert state.adapter("positive") is not adapters["positive"]
    state.reset()
    assert not any(state.is_cross_attention_populated(b, n) for b in state.kv_branch_names for n in ("text", "image"))
    assert state.cross_attention_bytes == 0


def test_close_is_idempotent_and_frees_the_slot():
    cache = _cache(session_capacity=2)
    a = cache.create_state("a")
    b = cache.create_state("b")
    assert (a.slot, b.slot) == (0, 1) and cache.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free session slot"):
        cache.create_state("c")
    assert cache.session_ids == ("a", "b")
    with pytest.raises(ValueError, match="already has an open state"):
        cache.create_state("b")
    a.close()
    assert a.closed and a.slot is None and cache.num_free_slots == 1
    a.close()
    assert cache.num_free_slots == 1 and cache.session_ids == ("b",) and cache.get_state("a") is None
    c = cache.create_state("c")
    assert c.slot == 0 and cache.num_free_slots == 0


def test_runs_of_two_sessions_and_branches_are_disjoint():
    cache = _cache(session_capacity=2)
    rng = np.random.default_rng(8)
    a, b = cache.create_state("a"), cache.create_state("b")
    blocks = {}
    for state in (a, b):
        for branch in ("positive", "negative"):
            state.get_kv_caches(branch, seq_len=2 * T, commit_current=True)
            blocks[state.session_id, branch] = _block(rng)
            state.commit_paged_context(branch, kv=blocks[state.session_id, branch])
    pk = pool_snapshot(cache)[0]
    run = cache.layout.run_pages
    for index, key in enumerate([("a", "positive"), ("a", "negative"), ("b", "positive"), ("b", "negative")]):
        np.testing.assert_array_equal(pk[:, index * run:index * run + 2].reshape(L, 2 * T, H, D), blocks[key][0])


# -- cross-attention ------------------------------------------------------------------------------------------


def _cross_layers(rng, num_tokens, heads=H, batched=False, layers=L):
    shape = (1, num_tokens, heads, D) if batched else (num_tokens, heads, D)
    return [(randn(rng, *shape), randn(rng, *shape)) for _ in range(layers)]


def _assert_cross_equal(kv, layers):
    assert isinstance(kv, CrossAttentionKV)
    want_k = np.stack([np.asarray(k).reshape(np.asarray(k).shape[-3:]) for k, _ in layers])
    want_v = np.stack([np.asarray(v).reshape(np.asarray(v).shape[-3:]) for _, v in layers])
    np.testing.assert_array_equal(np.asarray(kv.k), want_k)
    np.testing.assert_array_equal(np.asarray(kv.v), want_v)


def _cross_snapshot(state):
    out = {}
    for branch in state.kv_branch_names:
        for name in ("text", "image"):
            if state.is_cross_attention_populated(branch, name):
                kv = state.get_cross_attention_kv(branch, name)
                out[branch, name] = (np.array(kv.k), np.array(kv.v))
    return out


def _assert_cross_unchanged(state, before):
    after = _cross_snapshot(state)
    assert after.keys() == before.keys()
    for key, (k, v) in before.items():
        np.testing.assert_array_equal(after[key][0], k)
        np.testing.assert_array_equal(after[key][1], v)


@pytest.mark.parametrize("batched", [False, True])
def test_cross_populate_and_read(batched):
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(9)
    for branch in ("positive", "negative"):
        with pytest.raises(RuntimeError, match="before it was populated"):
            state.get_cross_attention_kv(branch, "text")
        assert not state.is_cross_attention_populated(branch, "text")
    layers = _cross_layers(rng, 3, batched=batched)
    state.populate_cross_attention("positive", "text", iter(layers))
    kv = state.get_cross_attention_kv("positive", "text")
    assert kv.k.shape == kv.v.shape == (L, 3, H, D) and kv.k.dtype == jnp.float32
    _assert_cross_equal(kv, layers)
    assert state.cross_attention_bytes == 2 * L * 3 * H * D * 4
    assert not state.is_cross_attention_populated("negative", "text")
    with pytest.raises(KeyError, match="cross-attention cache 'video'"):
        state.populate_cross_attention("positive", "video", layers)
    with pytest.raises(KeyError, match="Unknown AR-Diffusion KV branch"):
        state.get_cross_attention_kv("nope", "text")


def _failing_after(layers, count):
    for index, item in enumerate(layers):
        if index == count:
            raise OSError("encoder died")
        yield item


FAILURES = {
    "iterator raises": (OSError, "encoder died", lambda rng: _failing_after(_cross_layers(rng, 3), 1)),
    "too few layers": (ValueError, f"expected {L} layers, got 1", lambda rng: _cross_layers(rng, 3, layers=1)),
    "too many layers": (ValueError, f"expected {L} layers, got more than {L}",
                        lambda rng: _cross_layers(rng, 3, layers=L + 1)),
    "wrong tokens": (ValueError, "expected k/v shape", lambda rng: _cross_layers(rng, 4)),
    "wrong heads": (ValueError, "expected k/v shape", lambda rng: _cross_layers(rng, 3, heads=H + 1)),
    "batch 2": (ValueError, "expected k/v shape",
                lambda rng: [(randn(rng, 2, 3, H, D), randn(rng, 2, 3, H, D))] * L),
    "second layer wrong": (ValueError, "layer 1: expected k/v shape",
                           lambda rng: _cross_layers(rng, 3)[:1] + _cross_layers(rng, 2)[:1]),
    "integer dtype": (ValueError, "floating", lambda rng: [(np.ones((3, H, D), np.int32),) * 2] * L),
    "not a pair": (ValueError, "pair", lambda rng: [(randn(rng, 3, H, D),)] * L),
}


@pytest.mark.parametrize("repopulate", [False, True], ids=["first", "repopulate"])
@pytest.mark.parametrize("case", sorted(FAILURES))
def test_cross_population_is_transactional(case, repopulate):
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(10)
    _commit(state, "positive", rng)
    state.populate_cross_attention("negative", "text", _cross_layers(rng, 3))  # another branch: untouched
    if repopulate:
        state.populate_cross_attention("positive", "text", _cross_layers(rng, 3))
    before = _cross_snapshot(state)
    kv_before = _snapshot(cache, state)
    exc, match, make = FAILURES[case]
    with pytest.raises(exc, match=match):
        state.populate_cross_attention("positive", "text", make(rng))
    _assert_cross_unchanged(state, before)
    assert state.is_cross_attention_populated("positive", "text") == repopulate
    _assert_unchanged(cache, state, kv_before)


def test_cross_population_of_a_closed_state_stores_nothing():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(11)
    state.close()
    with pytest.raises(RuntimeError, match="is closed"):
        state.populate_cross_attention("positive", "text", _cross_layers(rng, 3))
    assert state.cross_attention_bytes == 0 and cache.memory_report()["cross_attention_bytes"] == 0

    # An iterator that closes the state while it runs is refused too.
    other = cache.create_state("t")

    def closing():
        yield from _cross_layers(rng, 3, layers=1)
        other.close()
        yield from _cross_layers(rng, 3, layers=1)

    with pytest.raises(RuntimeError, match="is closed"):
        other.populate_cross_attention("positive", "text", closing())
    assert other.cross_attention_bytes == 0


def test_branches_sharing_a_local_index_keep_their_own_cross_caches():
    cache = _cache(kv_branches=SHARED)
    state = cache.create_state("s")
    rng = np.random.default_rng(12)
    pos, neg = _cross_layers(rng, 3), _cross_layers(rng, 3)
    state.populate_cross_attention("positive", "text", pos)
    state.populate_cross_attention("negative", "text", neg)
    _assert_cross_equal(state.get_cross_attention_kv("positive", "text"), pos)
    _assert_cross_equal(state.get_cross_attention_kv("negative", "text"), neg)


def test_clear_cross_attention_keeps_self_attention_kv():
    cache = _cache()
    state = cache.create_state("s")
    rng = np.random.default_rng(13)
    _commit(state, "positive", rng)
    _commit(state, "positive", rng)
    state.populate_cross_attention("positive", "text", _cross_layers(rng, 3))
    state.populate_cross_attention("negative", "image", _cross_layers(rng, 2))
    pools_before = pool_snapshot(cache)
    state.clear_cross_attention()
    assert not state.is_cross_attention_populated("positive", "text")
    assert not state.is_cross_attention_populated("negative", "image")
    assert state.adapter("positive").committed_frames == 4
    assert state.get_kv_caches("positive", seq_len=T).visible_frames().tolist() == [0, 2, 3]
    for a, b in zip(pool_snapshot(cache), pools_before):
        np.testing.assert_array_equal(a, b)


def test_per_cache_head_override_changes_the_accepted_shape():
    cache = _cache(cross_attention=(text_cross(3, num_kv_heads=3),))
    state = cache.create_state("s")
    rng = np.random.default_rng(14)
    with pytest.raises(ValueError, match=r"expected k/v shape \(1, 3, 3, 4\)"):
        state.populate_cross_attention("positive", "text", _cross_layers(rng, 3, heads=H))
    layers = _cross_layers(rng, 3, heads=3, batched=True)
    state.populate_cross_attention("positive", "text", layers)
    kv = state.get_cross_attention_kv("positive", "text")
    assert kv.k.shape == (L, 3, 3, D)
    _assert_cross_equal(kv, layers)


def test_cross_cache_is_stored_in_the_kv_dtype():
    cache = _cache(dtype="bfloat16")
    state = cache.create_state("s")
    rng = np.random.default_rng(15)
    layers = _cross_layers(rng, 3)
    state.populate_cross_attention("positive", "text", layers)
    kv = state.get_cross_attention_kv("positive", "text")
    assert kv.k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kv.k[1]), np.asarray(jnp.asarray(layers[1][0]).astype(jnp.bfloat16)))


def test_reset_reopens_a_closed_state_only_when_a_slot_is_free():
    cache = _cache(session_capacity=1)
    state = cache.create_state("s")
    rng = np.random.default_rng(16)
    _commit(state, "positive", rng)
    state.close()
    other = cache.create_state("other")  # takes the only slot
    with pytest.raises(RuntimeError, match="no free session slot"):
        state.reset()
    assert state.closed and state.slot is None and cache.session_ids == ("other",)
    other.close()
    state.reset()
    assert not state.closed and state.slot == 0 and cache.num_free_slots == 0
    assert state.adapter("positive").committed_frames == 0
    assert state.get_kv_caches("positive", seq_len=T).visible_frames().tolist() == []


# -- restore: page ids are checked before anything changes (issue 43, item 5) ------------------------------


def _bad_tables(cache, value):
    """Page tables ``restore`` must refuse: ids outside the pool (the null page aside), a page twice, not ints."""
    null, P = cache.layout.null_page, cache.layout.num_pages
    good = value.pages

    def with_first(page):
        first = (page,) + tuple(good[0][1:])
        return (first,) + tuple(good[1:])

    return {
        "past the null page": with_first(P + 1),
        "negative": with_first(-1),
        "huge": with_first(2**40),
        "a float": with_first(1.0),
        "a bool": with_first(True),
        "one page in two slots": ((good[0][1],) + tuple(good[0][1:]),) + tuple(good[1:]),
        "one page in two runs": tuple(good[:1]) + ((good[0][0],) + (null,) * (len(good[0]) - 1),) * (len(good) - 1),
    }


@pytest.mark.parametrize("case", ["past the null page", "negative", "huge", "a float", "a bool",
                                  "one page in two slots", "one page in two runs"])
def test_restore_refuses_page_ids_outside_the_pool_and_changes_nothing(primed, case):
    """A refused restore installs nothing and counts nothing: the state keeps its tables, close() frees the slot."""
    from ardiff_jax.runtime import SessionKV

    cache, state, rng = primed
    value = state.snapshot()
    pages = _bad_tables(cache, value)[case]
    counts = [cache.page_pool.count(p) for p in range(cache.layout.num_pages)]
    before = _snapshot(cache, state)
    with pytest.raises(ValueError, match="page"):
        state.restore(SessionKV(session_id="s", slot=state.slot, cursors=value.cursors,
                                cross_attention=value.cross_attention, run_owners=value.run_owners, pages=pages))
    _assert_unchanged(cache, state, before)
    assert state.snapshot().pages == value.pages
    assert [cache.page_pool.count(p) for p in range(cache.layout.num_pages)] == counts
    cache.page_pool.check_tables(value.pages)
    _commit(state, "positive", rng)  # still usable
    state.close()  # and its slot is freed
    assert cache.num_free_slots == cache.session_capacity and cache.pages_in_use == 0
