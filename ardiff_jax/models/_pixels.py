"""Pixel-space "latents" of the SpriteWorld model and its action registers (host and traceable).

The SpriteWorld model works on pixels directly: a frame ``uint8[H, W, 3]`` becomes the
latent ``f32[3, H, W]`` in ``[-1, 1]`` and back. Frames are flat-coloured and 32x32, so a
VAE would buy nothing but a second model to train and ship. Actions become one one-hot
control vector per frame (the transformer's ``controls``).

:func:`snap_to_cells` is the world's palette-aware decoder: every SpriteWorld frame is a grid
of 4x4 cells, each one of seven looks (:func:`ardiff_jax.envs.cell_templates`), so a
predicted frame is decoded cell by cell to the nearest look. It can only show what a
SpriteWorld screen can show; it cannot make a wrong prediction right (a ball in the wrong
cell stays in the wrong cell, two agents stay two agents).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["frames_to_latents", "latents_to_frames", "action_registers", "snap_to_cells"]


def frames_to_latents(frames: Any, xp: Any = np) -> Any:
    """``u8[..., H, W, 3]`` -> ``f32[..., 3, H, W]`` in ``[-1, 1]`` (``xp``: numpy or jax.numpy)."""
    x = xp.asarray(frames).astype(xp.float32) / 127.5 - 1.0
    return xp.moveaxis(x, -1, -3)


def latents_to_frames(latents: Any, xp: Any = np) -> Any:
    """``f32[..., 3, H, W]`` -> ``u8[..., H, W, 3]``: clipped to ``[-1, 1]`` and rounded to the nearest level."""
    x = xp.moveaxis(xp.asarray(latents, xp.float32), -3, -1)
    return xp.round((xp.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(xp.uint8)


def action_registers(actions: Any, num_actions: int, xp: Any = np) -> Any:
    """``int[..., f]`` actions -> ``f32[..., f, num_actions]``: one one-hot vector per frame."""
    actions = xp.asarray(actions)
    return (actions[..., None] == xp.arange(num_actions)).astype(xp.float32)



def snap_to_cells(latents: Any, xp: Any = np) -> Any:
    """``f32[..., 3, H, W]`` -> the same shape, every 4x4 cell replaced by the nearest SpriteWorld cell look.

    Nearest in squared error over the cell's 48 values (``xp``: numpy or jax.numpy;
    traceable). The result is exactly the latents of a frame made of valid cells.
    """
    from ardiff_jax.envs import CELL_SIZE, cell_templates

    latents = xp.asarray(latents, xp.float32)
    *lead, c, h, w = latents.shape
    rows, cols = h // CELL_SIZE, w // CELL_SIZE
    templates = xp.asarray(frames_to_latents(cell_templates()))  # [K, 3, 4, 4]
    cells = latents.reshape(-1, c, rows, CELL_SIZE, cols, CELL_SIZE).transpose(0, 2, 4, 1, 3, 5)
    dist = xp.sum(xp.square(cells[..., None, :, :, :] - templates), axis=(-1, -2, -3))  # [N, rows, cols, K]
    chosen = templates[xp.argmin(dist, axis=-1)]  # [N, rows, cols, 3, 4, 4]
    chosen = chosen.transpose(0, 3, 1, 4, 2, 5)  # [N, 3, rows, 4, cols, 4]
    return chosen.reshape(*lead, c, h, w)
