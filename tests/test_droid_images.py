"""The DROID image path against the release's own code run on small images (issue 46 section 3).

``tests/fixtures/droid_images/release_images.npz`` holds what the DreamZero release's server and eval transform
(``socket_test_optimized_AR.py``, ``groot/vla/data/transform/video.py``, ``dreamzero_cotrain.py``, run by
``tests/fixtures/droid_images/make_fixture.py``) produced from stored random uint8 frames: each view's cropped and
resized frames, the frames each call chose, and each call's tiled canvas. Our crop + resize
(:func:`resize_views`), tiling (:func:`tile_views`) and frame accumulation (:class:`FrameBuffer`) must give the
same bytes; the bilinear resize is allowed one level on a few values that sit on an integer level (below), and
perturbed variants (the crop one row off, the padding from the wrong frame, two views swapped) must fail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ardiff_jax.models.dreamzero import (
    VIEW_KEYS,
    FrameBuffer,
    _droid,
    prepare_views,
    resize_views,
    tile_views,
)
from ardiff_jax.models.dreamzero._droid import CANVAS_VIEW_HW, VIEW_HW

FIXTURE = Path(__file__).parent / "fixtures" / "droid_images" / "release_images.npz"
RELEASE_COMMIT = "ab790c198fbce33503358efbbd4187ce9a89adf3"
# One truncated level may differ where the exact value lies on an integer level (within LEVEL_SLACK: measured
# at most 3.6e-4 level off): float32 rounding (torch's separable kernel vs XLA's) lands either side of it. Seen: 108 of 506,880 served values (2.1e-4), 41 of
# 90,720 small ones (4.5e-4; small upsampling ratios put more values exactly on a level); the bound is 2x that.
MAX_MISMATCH_FRACTION = 1e-3
# How close (in levels) the exact value must be to an integer for such a mismatch to be allowed.
LEVEL_SLACK = 1e-3


@pytest.fixture(scope="module")
def release() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {key: data[key] for key in data.files}


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """``f64[n_out, n_in]``: torch's antialiased bilinear weights (triangle of support max(scale, 1), half-pixel
    centres, renormalised at the borders) in exact arithmetic."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centres = scale * (np.arange(n_out) + 0.5)
    taps = np.arange(n_in) + 0.5
    weights = np.clip(1.0 - np.abs(taps[None, :] - centres[:, None]) / support, 0.0, None)
    return weights / weights.sum(axis=1, keepdims=True)


def _exact_levels(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``f64[T, h, w, 3]``: crop + resize of ``uint8[T, H, W, 3]`` in float64, on the 0..255 scale."""
    _, h, w, _ = frames.shape
    # torchvision's CenterCrop((int(0.95 h), int(0.95 w))), written out here so it is not ours being checked.
    crop_h, crop_w = int(h * 0.95), int(w * 0.95)
    top, left = round((h - crop_h) / 2.0), round((w - crop_w) / 2.0)  # half to even, as torchvision
    crop = frames[:, top: top + crop_h, left: left + crop_w].astype(np.float64) / 255.0
    rows, cols = _bilinear_matrix(crop_h, size[0]), _bilinear_matrix(crop_w, size[1])
    return np.einsum("oh,thwc,pw->topc", rows, crop, cols, optimize=True) * 255.0


def assert_views_match(ours: np.ndarray, theirs: np.ndarray, inputs: np.ndarray, size: tuple[int, int]) -> None:
    """``uint8[T, h, w, 3]`` ours vs the release's: equal, except one level on a few values whose exact level is an
    integer (so float32 rounding decides the truncation on either side)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == np.uint8
    difference = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
    assert difference.max() <= 1, f"differs by up to {difference.max()} levels"
    assert (difference > 0).mean() <= MAX_MISMATCH_FRACTION, f"{(difference > 0).sum()} values differ"
    if difference.any():
        exact = _exact_levels(inputs, size)[difference > 0]
        assert np.abs(exact - np.round(exact)).max() <= LEVEL_SLACK, "a mismatch away from an integer level"


def _views(release: dict[str, np.ndarray], case: str) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    return release[f"{case}_inputs"], release[f"{case}_views"], tuple(int(x) for x in release[f"{case}_view_hw"])


def test_the_fixture_is_the_releases_run_at_the_recorded_commit(release: dict[str, np.ndarray]) -> None:
    assert str(release["release_commit"]) == RELEASE_COMMIT
    # Our view order is RoboArena's; the release maps it onto its own keys in this order.
    assert tuple(release["roboarena_keys"]) == VIEW_KEYS
    assert tuple(release["release_keys"]) == ("video.exterior_image_1_left", "video.exterior_image_2_left",
                                              "video.wrist_image_left")
    assert release["droid_inputs"].shape[2:4] == VIEW_HW
    assert tuple(release["droid_view_hw"]) == CANVAS_VIEW_HW


def test_the_served_views_are_cropped_and_resized_as_the_release(release: dict[str, np.ndarray]) -> None:
    inputs, theirs, size = _views(release, "droid")
    for view in range(3):
        assert_views_match(prepare_views(inputs[view]), theirs[view], inputs[view], size)


def test_small_and_shrinking_views_are_cropped_and_resized_as_the_release(release: dict[str, np.ndarray]) -> None:
    for case in ("small", "shrink"):
        inputs, theirs, size = _views(release, case)
        if case == "small":  # per call: the chosen frames' views
            inputs = inputs[:, _chosen_frames(release)]
        for view in range(3):
            assert_views_match(resize_views(inputs[view], size), theirs[view], inputs[view], size)


def _chosen_frames(release: dict[str, np.ndarray]) -> np.ndarray:
    chosen = release["small_chosen"]
    return np.concatenate([row[:n] for row, n in zip(chosen, release["small_call_frames"])])


def _our_calls(release: dict[str, np.ndarray], *, views=lambda v: v) -> tuple[np.ndarray, list[int]]:
    """Our canvases for the fixture's messages, as the robot policy builds them: each message's views resized and
    tiled, added to the session's :class:`FrameBuffer`, one :meth:`FrameBuffer.take` per call."""
    inputs, size = release["small_inputs"], tuple(int(x) for x in release["small_view_hw"])
    canvases, counts, start, buffer, session = [], [], 0, None, None
    for count, message_session in zip(release["small_message_frames"], release["small_message_session"]):
        if message_session != session:  # a new session_id: a new episode, frames start again
            buffer, session = FrameBuffer(), message_session
        message = inputs[:, start: start + count]
        start += count
        buffer.add(tile_views(*views([resize_views(message[v], size) for v in range(3)])))
        frames = buffer.take()
        canvases.append(frames)
        counts.append(len(frames))
    return np.concatenate(canvases), counts


def assert_canvases_match(ours: np.ndarray, release: dict[str, np.ndarray]) -> None:
    size = tuple(int(x) for x in release["small_view_hw"])
    theirs = release["small_canvas"]
    assert ours.shape == theirs.shape, f"{ours.shape} != {theirs.shape}"
    inputs = release["small_inputs"][:, _chosen_frames(release)]
    h, w = size
    # Each canvas region against its view's exact levels (the canvas is tiled from the views, pixel for pixel).
    for region, view in (((slice(0, h), slice(0, 2 * w, 2)), 2), ((slice(0, h), slice(1, 2 * w, 2)), 2),
                         ((slice(h, 2 * h), slice(0, w)), 0), ((slice(h, 2 * h), slice(w, 2 * w)), 1)):
        assert_views_match(ours[:, region[0], region[1]], theirs[:, region[0], region[1]], inputs[view], size)


def test_calls_choose_and_tile_the_releases_frames(release: dict[str, np.ndarray]) -> None:
    ours, counts = _our_calls(release)
    assert counts == list(release["small_call_frames"]) == [1, 4, 4, 4, 4, 4, 1, 4, 4]
    assert_canvases_match(ours, release)


def test_the_comparison_fails_when_the_crop_is_one_row_off(release: dict[str, np.ndarray],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    crop_box = _droid._crop_box
    monkeypatch.setattr(_droid, "_crop_box", lambda h, w: (crop_box(h, w)[0] + 1, *crop_box(h, w)[1:]))
    inputs, theirs, size = _views(release, "droid")
    with pytest.raises(AssertionError):
        assert_views_match(prepare_views(inputs[0]), theirs[0], inputs[0], size)
    with pytest.raises(AssertionError):
        assert_canvases_match(_our_calls(release)[0], release)


def test_the_comparison_fails_when_frames_or_views_are_chosen_otherwise(release: dict[str, np.ndarray],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError):  # left and right exteriors swapped
        assert_canvases_match(_our_calls(release, views=lambda v: [v[1], v[0], v[2]])[0], release)

    def pad_with_last(self: FrameBuffer) -> np.ndarray:
        count = 1 if self.calls == 0 else 4
        self.calls += 1
        chosen = self.frames[-count:]
        return np.stack([self.frames[-1]] * (count - len(chosen)) + chosen)

    monkeypatch.setattr(FrameBuffer, "take", pad_with_last)
    with pytest.raises(AssertionError):
        assert_canvases_match(_our_calls(release)[0], release)
