"""Deprecated spellings of the former experimental API: each works, warns naming its replacement, and matches it."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_jax.runtime import ARDiffusionKVCache

L, H, D, T, F = 2, 1, 4, 2, 2
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
GEOMETRY = dict(num_layers=L, num_kv_heads=H, head_size=D, window_frames=4, sink_frames=1)
F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)


def make_state():
    spec = ARDiffusionKVCacheSpec(**GEOMETRY, tokens_per_frame=T, frames_per_block=F, kv_branches=CFG,
                                  session_capacity=2, cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 3),
                                                                       ARDiffusionCrossAttentionKVSpec("image", 2)))
    return ARDiffusionKVCache(spec, **F32).create_state("s")


def block(seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(L, F * T, H, D)), jnp.float32)


def test_pos_and_neg_are_the_branch_adapters():
    state = make_state()
    with pytest.warns(DeprecationWarning, match=r'state.adapter\("positive"\)'):
        assert state.pos is state.adapter("positive")
    with pytest.warns(DeprecationWarning, match=r'state.adapter\("negative"\)'):
        assert state.neg is state.adapter("negative")


def test_boolean_branch_calls_map_to_names():
    legacy, modern = make_state(), make_state()
    with pytest.warns(DeprecationWarning, match=r"get_kv_caches\('negative'"):
        legacy_view = legacy.get_kv_caches(True, F * T, True)
    with pytest.warns(DeprecationWarning, match=r"commit_paged_context\('negative'"):
        legacy.commit_paged_context(True, kv=(block(0), block(1)))
    modern.get_kv_caches("negative", seq_len=F * T, commit_current=True)
    modern.commit_paged_context("negative", kv=(block(0), block(1)))
    assert legacy.snapshot() == modern.snapshot()
    assert legacy_view.seq_len == F * T
    with pytest.warns(DeprecationWarning):
        legacy.get_kv_caches(False, F * T, False)
    assert legacy.has_pending_context("positive")


def test_staged_cross_attention_is_published_only_at_the_mark():
    state = make_state()
    pairs = [(jnp.full((3, H, D), float(i)), jnp.full((3, H, D), -float(i))) for i in range(L)]
    with pytest.warns(DeprecationWarning, match="populate_cross_attention"):
        state.write_cross_attention_kv("text", 0, "positive", *pairs[0])
    assert not state.is_cross_attention_populated("positive", "text")  # staged, not readable
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match=r"layers \[1\] were never written"):
            state.mark_cross_attention_populated("positive", "text")
    assert not state.is_cross_attention_populated("positive", "text")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        state.write_cross_attention_kv("text", 1, "positive", *pairs[1])
        state.mark_cross_attention_populated("positive", "text")
    published = state.get_cross_attention_kv("positive", "text")
    np.testing.assert_array_equal(np.asarray(published.k[1]), np.ones((3, H, D)))
    with pytest.warns(DeprecationWarning, match="get_cross_attention_kv"):
        caches = state.get_cross_kv_caches(False)
    assert set(caches) == {"text"} and caches["text"] is published
    with pytest.warns(DeprecationWarning), pytest.raises(IndexError, match="layer_index"):
        state.write_cross_attention_kv("text", 2, "positive", *pairs[0])


def test_reset_keep_cross_text():
    state = make_state()
    pairs = [(jnp.ones((3, H, D)),) * 2] * L
    state.populate_cross_attention("positive", "text", pairs)
    state.populate_cross_attention("positive", "image", [(jnp.ones((2, H, D)),) * 2] * L)
    with pytest.warns(DeprecationWarning, match=r'keep_cross_attention=\("text",\)'):
        state.reset(keep_cross_text=True)
    assert state.is_cross_attention_populated("positive", "text")
    assert not state.is_cross_attention_populated("positive", "image")
    with pytest.warns(DeprecationWarning):
        state.reset(keep_cross_text=False)
    assert not state.is_cross_attention_populated("positive", "text")


def test_old_cache_keywords_build_the_same_spec():
    with pytest.warns(DeprecationWarning) as record:
        legacy = ARDiffusionKVCache(**GEOMETRY, frame_seqlen=T, num_frame_per_block=F, local_branches=2,
                                    cross_attn_length=3, cross_attn_img_length=2, **F32)
    messages = " ".join(str(w.message) for w in record)
    for new in ("frames_per_block", "kv_branches", "tokens_per_frame", '"text"', '"image"'):
        assert new in messages
    assert legacy.spec.kv_branches == CFG and legacy.spec.frames_per_block == F
    assert legacy.spec.cross_attention_lengths == {"text": 3, "image": 2}
    assert legacy.spec.session_capacity == 64  # the legacy LRU size
    modern = ARDiffusionKVCache(**GEOMETRY, tokens_per_frame=T, frames_per_block=F, kv_branches=CFG,
                                session_capacity=64, cross_attention_lengths={"text": 3, "image": 2}, **F32)
    assert modern.spec == legacy.spec
    with pytest.raises(TypeError, match="spec and spec keywords"):
        ARDiffusionKVCache(modern.spec, num_layers=2, **F32)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="local_branches must be 1 or 2"):
        ARDiffusionKVCache(**GEOMETRY, tokens_per_frame=T, frames_per_block=F, local_branches=3, **F32)
