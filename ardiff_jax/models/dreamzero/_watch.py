"""The predicted video of a DreamZero robot, decoded to pixels for whoever watches it.

Each inference of :class:`~ardiff_jax.models.dreamzero.DreamZeroRobotPolicy` returns, beside the action chunk, the
video latents it predicted (``f32[n, 16, h, w]``: ``n = 1 + 2`` on an episode's first call, the conditioning frame
first, ``2`` after). The policy keeps the last one per robot as a :class:`PredictedVideo` (a reference to the
engine's array: nothing is copied or decoded); the policy server takes it after the robot's reply only while a
viewer watches that robot, and hands it to that viewer's :class:`PredictedVideoDecoder`.

The decoder is our Wan VAE decoder run as a stream (``decode_step`` with one ``VAEDecodeCache`` per viewer): the
chunks of one episode decode to exactly what the whole episode's latents, concatenated, decode to at once (what the
release does with the latents it keeps). A chunk that does not continue the last one decoded (an episode's first
call, or a chunk after one the viewer skipped) starts a fresh cache, so it decodes as a clip of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["PREDICTED_VIDEO_FPS", "PredictedVideo", "PredictedVideoDecoder"]

#: The rate the predicted video plays at: the rate the release writes its predicted videos at.
PREDICTED_VIDEO_FPS = 5


@dataclasses.dataclass(frozen=True)
class PredictedVideo:
    """One inference's predicted video latents, as the engine returned them.

    Attributes:
      latents: ``f32[n, C, h, w]`` normalised Wan latents (a device array; decoded only if somebody watches).
      inference: the robot's inference count (1 for its first; consecutive while the episode lasts).
      episode_start: the call started an episode (its latents begin with the conditioning frame).
    """

    latents: Any
    inference: int
    episode_start: bool


class PredictedVideoDecoder:
    """One viewer's streaming decoder: :meth:`decode` turns each :class:`PredictedVideo` it is given into
    ``uint8[F, 8h, 8w, 3]`` frames (``F = 1 + 4 (n - 1)`` when a chunk starts a stream, ``4 n`` when it continues
    the last one). Holds one VAE decode cache (``cache_nbytes``: 1016 MiB in bf16 at DROID's 44 x 80 latent);
    not thread-safe (one decode at a time, as one viewer's worker calls it)."""

    def __init__(self, vae: Any, latent_hw: tuple[int, int], fps: int = PREDICTED_VIDEO_FPS) -> None:
        self.vae = vae
        self.latent_hw = (int(latent_hw[0]), int(latent_hw[1]))
        factor = vae.config.spatial_factor
        #: ``(height, width)`` of a decoded frame: the three views' canvas (352 x 640 at DROID's size).
        self.frame_size = (self.latent_hw[0] * factor, self.latent_hw[1] * factor)
        self.fps = fps
        self._cache: Any = None
        self._last: int | None = None

    def decode(self, video: PredictedVideo) -> tuple[np.ndarray, dict[str, Any]]:
        """``(frames uint8[F, H, W, 3], info)``; ``info``: ``robot_inference``, ``episode_start`` and ``continued``
        (whether the chunk continued the stream: False starts a fresh cache)."""
        from ardiff_jax.models._pixels import latents_to_frames
        from ardiff_jax.models.wan import decode_step, init_decode_cache

        if not isinstance(video, PredictedVideo):
            raise TypeError(f"decode takes a PredictedVideo, got {type(video).__name__}")
        continued = (self._cache is not None and not video.episode_start and self._last is not None
                     and video.inference == self._last + 1)
        cache = self._cache if continued else init_decode_cache(self.vae.config, self.latent_hw)
        # decode_step donates the cache: until it returns, this decoder holds none (a failure restarts the stream).
        self._cache, self._last = None, None
        pixels, cache = decode_step(self.vae, video.latents, cache)
        frames = np.asarray(latents_to_frames(np.asarray(pixels)))
        self._cache, self._last = cache, video.inference
        return frames, {"robot_inference": video.inference, "episode_start": video.episode_start,
                        "continued": continued}
