"""Matrix-Game 2.0's action input: raw rows (one per video frame) -> per-latent-frame windows.

A session's keyboard and mouse input is one row per generated video frame: ``1 + 4 (F - 1)``
rows cover ``F`` latent frames (the causal VAE's first latent frame is one video frame, every
later one four). The network reads, for latent frame ``j``, the window of the ``4 * 3 = 12``
rows ``4j - 12 .. 4j - 1``, where rows before 0 repeat row 0 (the release puts 12 copies of
row 0 in front). So the first block (latent frames 0-2) reads rows 0-7, and block ``b``
(latent frames ``3b .. 3b+2``) reads rows up to ``12b + 7``: a block never reads the rows of
its own last video frames, and the final row of a clip is never read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._dit import ActionInputs

__all__ = ["action_windows", "check_action_rows", "rows_for_block"]


def rows_for_block(config: CausalDiTConfig, frame_start: int, num_frames: int | None = None) -> int:
    """Rows a session must have received so that the block at latent ``frame_start`` is covered:
    ``1 + 4 (frame_start + f - 1)`` (the release's ``cond_current`` length)."""
    action = _action(config)
    frames = config.frames_per_block if num_frames is None else num_frames
    return action.num_rows(frame_start + frames)


def _action(config: CausalDiTConfig) -> Any:
    if config.action is None:
        raise ValueError(f"config {config.name!r} has no action modules")
    return config.action


def check_action_rows(config: CausalDiTConfig, name: str, rows: Any, width: int) -> np.ndarray:
    """``rows`` as ``f32[N, width]``, checked on the host (finite, 2-D, at least one row)."""
    try:
        array = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a float array [N, {width}] (one row per video frame), got "
                         f"{type(rows).__name__}") from None
    if array.ndim != 2 or array.shape[1] != width or array.shape[0] < 1:
        raise ValueError(f"{name} must be [N, {width}] (one row per video frame), got {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite")
    return array


def action_windows(config: CausalDiTConfig, keyboard: np.ndarray, mouse: np.ndarray | None, frame_start: int,
                   num_frames: int | None = None, first_row: int = 0) -> ActionInputs:
    """The windows of latent frames ``frame_start ..`` from a session's rows so far.

    Args:
      keyboard: ``f32[N, keyboard_dim]`` the session's rows from video frame ``first_row`` on
        (row ``i`` of the array = video frame ``first_row + i``).
      mouse: ``f32[N, mouse_dim]`` likewise, or None for a keyboard-only network.
      frame_start, num_frames: the block's first latent frame and its length (default ``frames_per_block``).
      first_row: the video frame of the arrays' first row; it must not be later than the first
        row the windows read (``4 * frame_start - 12``, or 0).

    Returns:
      :class:`~ardiff_jax.models.ActionInputs` of numpy arrays ``[f, 12, K]`` and ``[f, 12, M]``.
      Rows past what the windows read are ignored; too few rows is an error.
    """
    action = _action(config)
    frames = config.frames_per_block if num_frames is None else num_frames
    needed = action.num_rows(frame_start + frames) - 1  # the last row itself is never read
    pad = action.rows

    earliest = max(0, action.frames_per_latent * frame_start - pad)
    if not 0 <= first_row <= earliest:
        raise ValueError(f"latent frame {frame_start} reads action rows from {earliest}; rows from {first_row} on "
                         "were given")

    def windows(rows: np.ndarray) -> np.ndarray:
        if first_row + rows.shape[0] < needed:
            raise ValueError(f"latent frames {frame_start}..{frame_start + frames - 1} read action rows up to "
                             f"{needed - 1}, but rows only up to {first_row + rows.shape[0] - 1} were given")
        # Video frame v sits at index pad + v of `padded` (v < 0: copies of row 0).
        front = np.repeat(rows[:1], pad + first_row, axis=0)
        padded = np.concatenate([front, rows[:needed - first_row]])
        starts = action.frames_per_latent * (frame_start + np.arange(frames))
        return np.stack([padded[s:s + pad] for s in starts]).astype(np.float32)

    if (mouse is None) != (not action.mouse_dim):
        raise ValueError(f"config {config.name!r} {'reads' if action.mouse_dim else 'has no'} mouse input")
    return ActionInputs(windows(keyboard), None if mouse is None else windows(mouse))
