"""Pixel-space "latents" of the SpriteWorld model and its action registers (host and traceable).

The SpriteWorld model works on pixels directly: a frame ``uint8[H, W, 3]`` becomes the
latent ``f32[3, H, W]`` in ``[-1, 1]`` and back. Frames are flat-coloured and 32x32, so a
VAE would buy nothing but a second model to train and ship. Actions become one register
token per frame: a one-hot row over the actions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["frames_to_latents", "latents_to_frames", "action_registers"]


def frames_to_latents(frames: Any, xp: Any = np) -> Any:
    """``u8[..., H, W, 3]`` -> ``f32[..., 3, H, W]`` in ``[-1, 1]`` (``xp``: numpy or jax.numpy)."""
    x = xp.asarray(frames).astype(xp.float32) / 127.5 - 1.0
    return xp.moveaxis(x, -1, -3)


def latents_to_frames(latents: Any, xp: Any = np) -> Any:
    """``f32[..., 3, H, W]`` -> ``u8[..., H, W, 3]``: clipped to ``[-1, 1]`` and rounded to the nearest level."""
    x = xp.moveaxis(xp.asarray(latents, xp.float32), -3, -1)
    return xp.round((xp.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(xp.uint8)


def action_registers(actions: Any, num_actions: int, xp: Any = np) -> Any:
    """``int[..., f]`` actions -> ``f32[..., f, num_actions]``: one one-hot register token per frame."""
    actions = xp.asarray(actions)
    return (actions[..., None] == xp.arange(num_actions)).astype(xp.float32)

