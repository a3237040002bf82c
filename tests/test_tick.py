"""Typed realtime ticks (``docs/reference_behaviour.md``, "Ticks")."""

from __future__ import annotations

import pytest

from ardiff_jax.types import (
    AR_DIFFUSION_TICK_KEY,
    ARDiffusionChunkMetadata,
    ARDiffusionControlInput,
    ARDiffusionTickRequest,
)


def make_tick(**overrides):
    fields = dict(session_id="world-7", request_id="tick-1", chunk_index=3, applied_event_ids=(4, 9),
                  prompt="a red car", controls=(ARDiffusionControlInput("camera", "pose6d", {"yaw": 0.25,
                                                                                       "path": [1, 2]}),),
                  reset=True, close_session=False)
    fields.update(overrides)
    return ARDiffusionTickRequest(**fields)


def test_round_trip_through_extra_args():
    tick = make_tick()
    extra = tick.to_extra_args()
    assert list(extra) == [AR_DIFFUSION_TICK_KEY]
    payload = extra[AR_DIFFUSION_TICK_KEY]
    assert payload["applied_event_ids"] == [4, 9]
    assert payload["controls"] == [{"track": "camera", "schema": "pose6d", "data": {"yaw": 0.25, "path": [1, 2]}}]
    assert ARDiffusionTickRequest.from_extra_args(extra) == tick
    assert ARDiffusionTickRequest.from_extra_args({AR_DIFFUSION_TICK_KEY: tick}) is tick
    assert ARDiffusionTickRequest.from_extra_args({"session_id": "s"}) is None
    assert ARDiffusionTickRequest.from_extra_args(None) is None


def test_metadata_from_tick():
    tick = make_tick()
    meta = ARDiffusionChunkMetadata.from_tick(tick)
    assert meta.to_dict() == {"session_id": "world-7", "request_id": "tick-1", "chunk_index": 3,
                              "applied_event_ids": [4, 9]}
    assert ARDiffusionChunkMetadata.from_dict(meta.to_dict()) == meta


@pytest.mark.parametrize("overrides, match", [
    (dict(session_id="  "), "session_id"),
    (dict(request_id=""), "request_id"),
    (dict(chunk_index=-1), "chunk_index"),
    (dict(chunk_index=True), "chunk_index"),
    (dict(applied_event_ids=(2, 1)), "strictly increasing"),
    (dict(applied_event_ids=(1, 1)), "strictly increasing"),
    (dict(applied_event_ids=(-1,)), "non-negative"),
    (dict(prompt=3), "prompt"),
    (dict(reset=1), "reset"),
    (dict(close_session="yes"), "close_session"),
    (dict(controls=({"track": "x"},)), "ARDiffusionControlInput"),
])
def test_tick_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_tick(**overrides)


def test_from_extra_args_errors():
    with pytest.raises(ValueError, match="must be a mapping"):
        ARDiffusionTickRequest.from_extra_args({AR_DIFFUSION_TICK_KEY: [1, 2]})
    with pytest.raises(ValueError, match="missing"):
        ARDiffusionTickRequest.from_extra_args({AR_DIFFUSION_TICK_KEY: {"session_id": "s"}})
    with pytest.raises(ValueError, match="sequence"):
        ARDiffusionTickRequest.from_extra_args({AR_DIFFUSION_TICK_KEY: {
            "session_id": "s", "request_id": "r", "chunk_index": 0, "applied_event_ids": 5}})


def test_control_input_is_frozen_and_transport_safe():
    data = {"yaw": 0.5, "nested": {"keys": [1, 2]}}
    control = ARDiffusionControlInput("camera", "pose", data)
    data["yaw"] = 9.0  # the caller mutating its payload later has no effect
    assert control.data["yaw"] == 0.5
    with pytest.raises(TypeError):
        control.data["yaw"] = 1.0
    assert control.data["nested"]["keys"] == (1, 2)
    with pytest.raises(ValueError, match="transport-safe"):
        ARDiffusionControlInput("camera", "pose", {"obj": object()})
    with pytest.raises(ValueError, match="track"):
        ARDiffusionControlInput("", "pose", {})
    with pytest.raises(ValueError, match="mapping"):
        ARDiffusionControlInput("camera", "pose", [1])
    with pytest.raises(ValueError, match="mapping"):
        ARDiffusionControlInput.from_dict("camera")
