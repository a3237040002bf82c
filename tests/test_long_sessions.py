"""Sessions are unbounded: absolute frame indices stay exact far past any old length cap.

The ring stores a bounded window, so nothing about storage limits a session's length. The
only absolute index that reaches the device is the frame count in the ``i32[3+K+W]`` cursor;
it is exact up to ``2**31 - 1`` frames (decades of video at 16 frames/s), and the tests
below check the arithmetic at 10**6 and 10**8 frames and run a real engine session past
the reference's old default cap of ``2**20`` tokens.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec, DiffusionRequest, EngineConfig
from ardiff_jax.kv import contiguous_table_cursor, cursor_block_pages, ref_paged_attention, visible_table
from ardiff_jax.runtime import ARDiffusionKVCache, BranchCursor, commit_frames


def _spec(**overrides):
    fields = dict(num_layers=1, num_kv_heads=1, head_size=2, tokens_per_frame=2, frames_per_block=3,
                  window_frames=5, sink_frames=2, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                  session_capacity=1)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def _frame_values(spec, first_frame, frames):
    """K = V = the absolute frame index, so a read tells which frame a page holds."""
    values = np.repeat(np.arange(first_frame, first_frame + frames, dtype=np.float32), spec.tokens_per_frame)
    return jnp.asarray(np.broadcast_to(values[None, :, None, None],
                                       (spec.num_layers, frames * spec.tokens_per_frame, spec.num_kv_heads,
                                        spec.head_size)))


@pytest.mark.parametrize("start", [10**6, 10**8])
def test_cursor_and_page_arithmetic_far_past_the_old_cap(start):
    spec = _spec()
    cache = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=10**6, gpu_memory_fraction=1.0)
    layout = cache.layout
    state = cache.create_state("long")
    # Fill the sink and the first ring slots for real, then jump the cursor far ahead as a long session would be.
    for block in range(2):
        state.get_kv_caches("main", seq_len=6, commit_current=True)
        state.commit_paged_context("main", kv=(_frame_values(spec, 3 * block, 3),) * 2)
    snap = state.snapshot()
    far = snap.__class__(session_id=snap.session_id, slot=snap.slot,
                         cursors={"main": BranchCursor(committed_frames=start, visible_start_frame=0)},
                         cross_attention={}, run_owners=snap.run_owners)
    state.restore(far)
    # Commit enough blocks to cycle the whole ring past `start`, then check the pages hold the newest frames.
    for block in range(3):
        first = start + 3 * block
        state.get_kv_caches("main", seq_len=6, commit_current=True)
        state.commit_paged_context("main", kv=(_frame_values(spec, first, 3),) * 2)
    committed = start + 9
    assert state.adapter("main").committed_frames == committed
    assert state.adapter("main").num_computed_tokens == committed * spec.tokens_per_frame  # host ints: exact
    caches = state.get_kv_caches("main", seq_len=6, commit_current=False)
    # Host (numpy) and device (jnp under jit) arithmetic agree at this size.
    host_pages, host_frames = visible_table(layout, np.asarray(caches.cursor), 3, np)
    dev_pages, dev_frames = jax.jit(lambda c: visible_table(layout, c, 3, jnp))(caches.cursor)
    np.testing.assert_array_equal(host_pages, np.asarray(dev_pages))
    np.testing.assert_array_equal(host_frames, np.asarray(dev_frames))
    assert host_frames[host_frames >= 0].tolist() == [0, 1, committed - 2, committed - 1]
    # The pages really hold those frames: attend with a query that averages uniformly over all keys.
    current = _frame_values(spec, committed, 3)[0]
    q = jnp.zeros_like(current)
    out = ref_paged_attention(layout, cache.pools, caches.cursor, 0, q, current, current)
    expected = np.mean([0, 1, committed - 2, committed - 1, committed, committed + 1, committed + 2],
                       dtype=np.float64)
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(caches.attend(0, q, current, current)), np.asarray(out), rtol=1e-6)
    state.discard_paged_context("main")
    pages = cursor_block_pages(layout, contiguous_table_cursor(layout, 0, 2**31 - 4, 0), 3, np)
    assert (pages >= 0).all() and (pages < layout.num_pages).all()


def test_commit_rule_has_no_length_limit_unless_asked():
    spec = _spec()
    layout = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=10**6,
                                gpu_memory_fraction=1.0).layout
    state = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=10**6,
                               gpu_memory_fraction=1.0).create_state("s").snapshot()
    far = state.__class__(session_id="s", slot=0, cursors={"main": BranchCursor(10**9, 0)}, cross_attention={})
    assert commit_frames(spec, layout, far, "main", 3).cursors["main"].committed_frames == 10**9 + 3
    capped = _spec(max_model_len=12)
    with pytest.raises(RuntimeError, match="max_model_len"):
        commit_frames(capped, layout, far, "main", 3)


class _CommitOnly:
    """Commits its block each request and attends nothing: a fast way to make a session long."""

    def __init__(self, spec):
        self.spec, self.state = spec, None

    def ar_diffusion_kv_cache_spec(self):
        return self.spec

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.state = state
        try:
            yield
        finally:
            self.state = None

    def reset_ar_diffusion_session(self, session_id):
        pass

    def close_ar_diffusion_session(self, session_id):
        pass

    def forward(self, request):
        first = self.state.adapter("main").committed_frames
        self.state.get_kv_caches("main", seq_len=3 * self.spec.tokens_per_frame, commit_current=True)
        self.state.commit_paged_context("main", kv=(_frame_values(self.spec, first, 3),) * 2)
        return first


def test_engine_session_crosses_the_old_default_cap():
    spec = _spec(tokens_per_frame=512, head_size=1)  # 2**20 tokens = 2048 frames
    engine = ARDiffusionEngine(_CommitOnly(spec), EngineConfig(dtype="float32", available_memory_bytes=10**8,
                                                              gpu_memory_fraction=1.0))
    blocks = 2**20 // (3 * 512) + 2
    for _ in range(blocks):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": "long"}))
    state = engine.runner.session_table.get("long")
    committed = state.describe()["branches"]["main"]["committed_frames"]
    assert committed == 3 * blocks and committed * spec.tokens_per_frame > 2**20
