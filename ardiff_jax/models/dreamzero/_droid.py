"""The DROID robot's side of DreamZero: camera frames, state and instruction in; joint targets out.

What the release does around its model (``socket_test_optimized_AR.py``, ``transform/dreamzero_cotrain.py``,
``data/transform/video.py``, ``state_action.py``, ``n1_5/sim_policy.py``), as pure host functions:

* **Cameras.** RoboArena's ``observation/exterior_image_0_left``, ``observation/exterior_image_1_left`` and
  ``observation/wrist_image_left`` (``uint8[180, 320, 3]``, one frame or several per message) are the
  left exterior, right exterior and wrist views. Each frame is centre-cropped to 95 % (171 x 304: the
  torchvision ``CenterCrop`` of the eval transform), resized bilinearly to 176 x 320 on ``[0, 1]`` floats
  and brought back to ``uint8`` by truncation (``(x * 255).to(uint8)``); the three views are tiled into
  one 352 x 640 canvas: the wrist view on top, widened x2 by repeating columns, the exteriors below
  (left | right) (:func:`tile_views`).
* **Frames per call** (:class:`FrameBuffer`): frames accumulate per session; the first call uses one
  frame, every later call the last 4 (padded with the first when fewer arrived).
* **State**: ``observation/joint_position`` (7) then ``observation/gripper_position`` (1), q99-normalised
  (``2 (x - q01) / (q99 - q01) - 1``, clipped; unchanged where ``q01 == q99``), zero-padded to 64.
* **Actions**: the predicted ``[24, 32]`` chunk's dims 0-6 (joint position, relative to the current
  state) and 7 (gripper, absolute) are un-normalised (``(a + 1) / 2 (q99 - q01) + q01``), the current
  joint position added to the joints: a ``float32 [24, 8]`` reply.
* **Text**: the DROID prompt template around the instruction (:func:`droid_prompt`); Wan's standard
  negative prompt (:data:`NEGATIVE_PROMPT`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax._files import read_json_file

__all__ = ["VIEW_KEYS", "VIEW_HW", "CANVAS_VIEW_HW", "FRAMES_PER_CHUNK", "NEGATIVE_PROMPT", "DroidStatistics",
           "FrameBuffer", "droid_prompt", "prepare_views", "resize_views", "tile_views", "normalize_state", "actions_to_targets"]

#: RoboArena's camera keys in the release's view order: left exterior, right exterior, wrist.
VIEW_KEYS = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")
#: What the client sends (the server config's ``image_resolution``) and what one view becomes.
VIEW_HW = (180, 320)
CANVAS_VIEW_HW = (176, 320)
#: Pixel frames of one later call (``FRAMES_PER_CHUNK`` in the release's server).
FRAMES_PER_CHUNK = 4
#: The crop of the eval transform (``VideoCrop(scale=0.95)``).
CROP_SCALE = 0.95

NEGATIVE_PROMPT = ("Vibrant colors, overexposed, static, blurry details, text, subtitles, style, artwork, painting, "
                   "image, still, grayscale, dull, worst quality, low quality, JPEG artifacts, ugly, mutilated, extra "
                   "fingers, bad hands, bad face, deformed, disfigured, mutated limbs, fused fingers, stagnant image, "
                   "cluttered background, three legs, many people in the background, walking backwards.")


def droid_prompt(instruction: str) -> str:
    """The DROID training prompt around a task instruction (lower-cased twice, as the release's collate does)."""
    task = str(instruction).lower()
    return ("A multi-view video shows that a robot " + task + " The video is split into three views: The top view "
            "shows the camera view from the robot's wrist, the bottom-left view shows the camera view from the left "
            "exterior camera, and the bottom-right view shows the camera view from the right exterior camera. During "
            "training, one of the two bottom exterior views may be a black screen (dropped view). The robot " + task)


def _crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision ``CenterCrop((int(h * 0.95), int(w * 0.95)))``: ``(top, left, h, w)`` (round half to even)."""
    crop_h, crop_w = int(height * CROP_SCALE), int(width * CROP_SCALE)
    return int(round((height - crop_h) / 2.0)), int(round((width - crop_w) / 2.0)), crop_h, crop_w


def prepare_views(frames: np.ndarray) -> np.ndarray:
    """``uint8[T, 180, 320, 3]`` -> ``uint8[T, 176, 320, 3]``: the release's eval transform of one view."""
    return resize_views(frames, CANVAS_VIEW_HW)


def resize_views(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``uint8[T, H, W, 3]`` -> ``uint8[T, *size, 3]``: centre crop to 95 %, bilinear resize on ``[0, 1]`` floats
    (half-pixel centres, antialiased when shrinking, as torch's ``antialias=True``), back to ``uint8`` by
    truncation as the release does."""
    frames = np.asarray(frames)
    t, h, w, _ = frames.shape
    top, left, crop_h, crop_w = _crop_box(h, w)
    crop = frames[:, top: top + crop_h, left: left + crop_w].astype(np.float32) / np.float32(255.0)
    out_h, out_w = size
    resized = jax.image.resize(jnp.asarray(crop), (t, out_h, out_w, 3), method="linear", antialias=True)
    return np.asarray(np.asarray(resized) * np.float32(255.0)).astype(np.uint8)


def tile_views(left: np.ndarray, right: np.ndarray, wrist: np.ndarray) -> np.ndarray:
    """Three ``uint8[T, h, w, 3]`` views -> the ``uint8[T, 2h, 2w, 3]`` canvas: the wrist view widened x2 on top
    (each column repeated), left | right exterior below."""
    t, h, w, c = left.shape
    canvas = np.zeros((t, 2 * h, 2 * w, c), np.uint8)
    canvas[:, :h] = np.repeat(wrist, 2, axis=2)
    canvas[:, h:, :w] = left
    canvas[:, h:, w:] = right
    return canvas


@dataclasses.dataclass
class FrameBuffer:
    """One robot session's camera frames (each view's, after :func:`prepare_views`) since its episode began."""

    frames: list[np.ndarray] = dataclasses.field(default_factory=list)  # each uint8[352, 640, 3]
    calls: int = 0

    def add(self, canvas: np.ndarray) -> None:
        self.frames.extend(list(canvas))

    def take(self) -> np.ndarray:
        """The call's frames: the first call one frame; later calls the last 4, padded with the first (the
        release's server)."""
        count = 1 if self.calls == 0 else FRAMES_PER_CHUNK
        self.calls += 1
        chosen = self.frames[-count:]
        if len(chosen) < count:
            chosen = [self.frames[0]] * (count - len(chosen)) + chosen
        return np.stack(chosen)


@dataclasses.dataclass(frozen=True)
class DroidStatistics:
    """The q01/q99 statistics DreamZero-DROID normalises with (``experiment_cfg/metadata.json``, ``oxe_droid``).

    Attributes: ``f32[7]`` / ``f32[1]`` arrays: ``state_joint_q01``, ``state_joint_q99``, ``state_gripper_q01``,
    ``state_gripper_q99``, ``action_joint_q01``, ``action_joint_q99`` (the relative joint deltas),
    ``action_gripper_q01``, ``action_gripper_q99``.
    """

    state_joint_q01: np.ndarray
    state_joint_q99: np.ndarray
    state_gripper_q01: np.ndarray
    state_gripper_q99: np.ndarray
    action_joint_q01: np.ndarray
    action_joint_q99: np.ndarray
    action_gripper_q01: np.ndarray
    action_gripper_q99: np.ndarray

    @classmethod
    def from_metadata(cls, path: str | Path, embodiment: str = "oxe_droid") -> DroidStatistics:
        """Read ``metadata.json`` (``{embodiment: {"statistics": {"state"|"action": {key: {"q01", "q99"}}}}}``)."""
        path = Path(path)
        data = read_json_file(path, error=ValueError, what="DreamZero metadata")
        try:
            stats = data[embodiment]["statistics"]
            values = {}
            for group, key, width in (("state", "joint_position", 7), ("state", "gripper_position", 1),
                                      ("action", "joint_position", 7), ("action", "gripper_position", 1)):
                for q in ("q01", "q99"):
                    array = np.asarray(stats[group][key][q], np.float32).reshape(-1)[:width]
                    if array.shape != (width,) or not np.isfinite(array).all():
                        raise ValueError(f"{group}.{key}.{q} must be {width} finite numbers")
                    values[f"{group}_{key.split('_')[0]}_{q}"] = array
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: no usable {embodiment} q01/q99 statistics ({error})"[:400]) from None
        return cls(**values)

    @classmethod
    def stand_in(cls) -> DroidStatistics:
        """Statistics for random weights (no checkpoint): joints in [-pi, pi], the gripper in [0, 1], joint
        deltas within +-0.25 rad per step. Not DROID's: a real checkpoint's metadata.json replaces them."""
        seven = np.ones(7, np.float32)
        return cls(-math.pi * seven, math.pi * seven, np.zeros(1, np.float32), np.ones(1, np.float32),
                   -0.25 * seven, 0.25 * seven, np.zeros(1, np.float32), np.ones(1, np.float32))


def _q99(x: np.ndarray, q01: np.ndarray, q99: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    span = q99 - q01
    same = span == 0
    out = np.where(same, x, 2 * (x - q01) / np.where(same, 1, span) - 1)
    return np.clip(out, -1, 1).astype(np.float32)


def normalize_state(stats: DroidStatistics, joint: np.ndarray, gripper: np.ndarray, state_dim: int = 64) -> np.ndarray:
    """``f32[state_dim]``: the q99-normalised joint position (7) and gripper (1), zero-padded."""
    out = np.zeros(state_dim, np.float32)
    out[:7] = _q99(joint, stats.state_joint_q01, stats.state_joint_q99)
    out[7:8] = _q99(gripper, stats.state_gripper_q01, stats.state_gripper_q99)
    return out


def actions_to_targets(stats: DroidStatistics, actions: np.ndarray, joint: np.ndarray) -> np.ndarray:
    """``f32[A, 32]`` predicted (normalised, relative joints) -> ``f32[A, 8]`` absolute joint targets + gripper."""
    actions = np.asarray(actions, np.float32)
    joints = (actions[:, :7] + 1) / 2 * (stats.action_joint_q99 - stats.action_joint_q01) + stats.action_joint_q01
    gripper = (actions[:, 7:8] + 1) / 2 * (stats.action_gripper_q99 - stats.action_gripper_q01) \
        + stats.action_gripper_q01
    return np.concatenate([joints + np.asarray(joint, np.float32)[None, :7], gripper], axis=1).astype(np.float32)
