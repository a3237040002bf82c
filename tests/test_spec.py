"""Capability specs: fields, defaults, derived properties and every validation error.

The validation order is the reference's (``docs/reference_behaviour.md``, "Capability spec").
"""

from __future__ import annotations

import dataclasses

import pytest

from ardiff_jax import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionWarmup,
    SupportsStepExecution,
)

MAIN = (ARDiffusionKVBranchSpec("main", 0),)


def make_spec(**overrides):
    fields = dict(num_layers=2, num_kv_heads=2, head_size=4, tokens_per_frame=3, frames_per_block=2,
                  window_frames=4, kv_branches=MAIN, session_capacity=2)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def test_branch_spec_errors():
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="non-blank"):
            ARDiffusionKVBranchSpec(blank, 0)
    with pytest.raises(ValueError, match="non-negative"):
        ARDiffusionKVBranchSpec("main", -1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="", num_tokens=4), "non-blank"),
    (dict(name=" ", num_tokens=4), "non-blank"),
    (dict(name="text", num_tokens=0), "num_tokens must be positive"),
    (dict(name="text", num_tokens=-3), "num_tokens must be positive"),
    (dict(name="text", num_tokens=4, num_kv_heads=0), "num_kv_heads must be positive"),
])
def test_cross_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ARDiffusionCrossAttentionKVSpec(**kwargs)


def test_defaults_and_frozen():
    spec = make_spec()
    assert spec.sink_frames == 0
    assert spec.reset_at_boundary is False
    assert spec.cross_attention == ()
    assert spec.max_model_len is None  # sessions are unbounded by default; the field is an optional cap
    assert spec.max_scratch_tokens_per_branch == 0
    assert spec.model_owned_state_bytes_per_session == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 3
    assert hash(spec) == hash(make_spec())


@pytest.mark.parametrize("field", [
    "num_layers", "num_kv_heads", "head_size", "tokens_per_frame", "frames_per_block", "window_frames",
    "session_capacity",
])
def test_positive_fields(field):
    with pytest.raises(ValueError, match=f"AR-Diffusion {field} must be positive, got 0"):
        make_spec(**{field: 0})


@pytest.mark.parametrize("field", ["sink_frames", "max_scratch_tokens_per_branch",
                                   "model_owned_state_bytes_per_session"])
def test_non_negative_fields(field):
    with pytest.raises(ValueError, match=f"{field} must be non-negative, got -1"):
        make_spec(**{field: -1})


def test_branch_and_cross_errors():
    with pytest.raises(ValueError, match="at least one KV branch"):
        make_spec(kv_branches=())
    with pytest.raises(ValueError, match="unique"):
        make_spec(kv_branches=(ARDiffusionKVBranchSpec("a", 0), ARDiffusionKVBranchSpec("a", 1)))
    with pytest.raises(ValueError, match="contiguous"):
        make_spec(kv_branches=(ARDiffusionKVBranchSpec("a", 1),))
    with pytest.raises(ValueError, match="contiguous"):
        make_spec(kv_branches=(ARDiffusionKVBranchSpec("a", 0), ARDiffusionKVBranchSpec("b", 2)))
    text = ARDiffusionCrossAttentionKVSpec("text", 4)
    with pytest.raises(ValueError, match="cross-attention cache names must be unique"):
        make_spec(cross_attention=(text, ARDiffusionCrossAttentionKVSpec("text", 8)))


def test_non_integer_fields_rejected():
    with pytest.raises(ValueError, match="integer"):
        make_spec(num_layers=2.0)
    with pytest.raises(ValueError, match="integer"):
        make_spec(head_size=True)


def test_block_longer_than_window_names_both_values():
    with pytest.raises(ValueError, match=r"frames_per_block \(5\).*window_frames \(4\)"):
        make_spec(frames_per_block=5, window_frames=4)
    make_spec(frames_per_block=4, window_frames=4)  # equal is fine


def test_derived_properties():
    spec = make_spec(
        kv_branches=[ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1)],
        cross_attention=[ARDiffusionCrossAttentionKVSpec("text", 8),
                         ARDiffusionCrossAttentionKVSpec("image", 4, num_kv_heads=6)],
        sink_frames=1,
    )
    assert isinstance(spec.kv_branches, tuple) and isinstance(spec.cross_attention, tuple)
    assert spec.num_local_kv_branches == 2
    assert spec.cross_attention_lengths == {"text": 8, "image": 4}
    assert spec.cross_attention_kv_heads == {"image": 6}
    assert spec.cross_attention_heads("text") == 2 and spec.cross_attention_heads("image") == 6
    assert spec.max_visible_frames == 5
    shared = make_spec(kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0)))
    assert shared.num_local_kv_branches == 1


def test_protocols_are_runtime_checkable():
    class Pipeline:
        def ar_diffusion_kv_cache_spec(self): ...
        def bind_ar_diffusion_state(self, session_id, state): ...
        def reset_ar_diffusion_session(self, session_id): ...
        def close_ar_diffusion_session(self, session_id): ...
        def forward(self, request): ...

    class Warm(Pipeline):
        def ar_diffusion_warmup_requests(self, session_id): ...

    class Step(Pipeline):
        supports_step_execution = True

        def step(self, request): ...

    assert isinstance(Pipeline(), SupportsARDiffusionPipeline)
    assert not isinstance(object(), SupportsARDiffusionPipeline)
    assert isinstance(Warm(), SupportsARDiffusionWarmup) and not isinstance(Pipeline(), SupportsARDiffusionWarmup)
    assert isinstance(Step(), SupportsStepExecution) and not isinstance(Pipeline(), SupportsStepExecution)
