"""Shipped example geometries: real model sizes (``docs/models.md``) and the reference's memory-plan examples.

Each entry is a function returning the :class:`ARDiffusionKVCacheSpec` a pipeline of that
model would report. Window semantics follow the runtime: ``sink_frames + window_frames``
is the largest visible video context *including* the current block, so a "21-frame
window with a 3-frame sink" is ``sink_frames=3, window_frames=18``.
"""

from __future__ import annotations

from collections.abc import Callable

from ardiff_jax.capability import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec

__all__ = ["EXAMPLE_GEOMETRIES", "example_spec"]

_MAIN = (ARDiffusionKVBranchSpec("main", 0),)
_CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def tiny() -> ARDiffusionKVCacheSpec:
    """CI geometry: 2 layers, 2 KV heads x 16, 16 tokens/frame, CFG, 6 visible frames (sink 1)."""
    return ARDiffusionKVCacheSpec(
        num_layers=2, num_kv_heads=2, head_size=16, tokens_per_frame=16, frames_per_block=2,
        window_frames=5, sink_frames=1, kv_branches=_CFG,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 8), ARDiffusionCrossAttentionKVSpec("image", 4)),
        max_scratch_tokens_per_branch=3, session_capacity=3,
    )


def medium() -> ARDiffusionKVCacheSpec:
    """CPU benchmark geometry: 8 layers, 4 KV heads x 128, 220 tokens/frame, 12 visible frames (sink 3)."""
    return ARDiffusionKVCacheSpec(
        num_layers=8, num_kv_heads=4, head_size=128, tokens_per_frame=220, frames_per_block=3,
        window_frames=9, sink_frames=3, kv_branches=_CFG,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512), ARDiffusionCrossAttentionKVSpec("image", 257)),
        max_scratch_tokens_per_branch=33, session_capacity=4,
    )


def wan_1_3b() -> ARDiffusionKVCacheSpec:
    """Wan2.1-1.3B Self-Forcing/LongLive geometry: 30 layers, 12 x 128, 1560 tokens/frame, 21 frames (sink 3)."""
    return ARDiffusionKVCacheSpec(
        num_layers=30, num_kv_heads=12, head_size=128, tokens_per_frame=1560, frames_per_block=3,
        window_frames=18, sink_frames=3, kv_branches=_MAIN,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512),), session_capacity=8,
    )


def wan_1_3b_cfg() -> ARDiffusionKVCacheSpec:
    """The Wan-1.3B geometry with positive and negative CFG branches."""
    base = wan_1_3b()
    return ARDiffusionKVCacheSpec(
        num_layers=base.num_layers, num_kv_heads=base.num_kv_heads, head_size=base.head_size,
        tokens_per_frame=base.tokens_per_frame, frames_per_block=base.frames_per_block,
        window_frames=base.window_frames, sink_frames=base.sink_frames, kv_branches=_CFG,
        cross_attention=base.cross_attention, session_capacity=4,
    )


def dreamzero_droid() -> ARDiffusionKVCacheSpec:
    """DreamZero-DROID (Wan2.1-I2V-14B): 40 x 40 x 128, 880 tokens/frame, 9-frame window reset at boundary."""
    return ARDiffusionKVCacheSpec(
        num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=880, frames_per_block=2,
        window_frames=9, sink_frames=0, reset_at_boundary=True, kv_branches=_CFG,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512), ARDiffusionCrossAttentionKVSpec("image", 257)),
        max_scratch_tokens_per_branch=33, model_owned_state_bytes_per_session=603 * 2**20, session_capacity=64,
    )


def lingbot_world() -> ARDiffusionKVCacheSpec:
    """The reference's shipped LingBot-World geometry (``docs/reference_behaviour.md``, "Memory plan")."""
    return ARDiffusionKVCacheSpec(
        num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=1560, frames_per_block=3,
        window_frames=9, sink_frames=9, kv_branches=_MAIN,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512),),
        model_owned_state_bytes_per_session=7_488_000, session_capacity=2,
    )


EXAMPLE_GEOMETRIES: dict[str, Callable[[], ARDiffusionKVCacheSpec]] = {
    "tiny": tiny,
    "medium": medium,
    "wan_1_3b": wan_1_3b,
    "wan_1_3b_cfg": wan_1_3b_cfg,
    "dreamzero_droid": dreamzero_droid,
    "lingbot_world": lingbot_world,
}


def example_spec(name: str) -> ARDiffusionKVCacheSpec:
    try:
        return EXAMPLE_GEOMETRIES[name]()
    except KeyError:
        raise KeyError(f"unknown example geometry {name!r}; choose from {sorted(EXAMPLE_GEOMETRIES)}") from None
