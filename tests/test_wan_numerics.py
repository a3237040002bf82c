"""Wan's float64 host tables: the sinusoid and the RoPE rotation equal float64 rounded to float32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax.models import dit_preset
from ardiff_jax.models._dit import rope_rotation, timestep_embedding


def _sinusoid_f64(dim: int, t: np.ndarray) -> np.ndarray:
    half = dim // 2
    angles = np.outer(t.astype(np.float64), np.power(10000.0, -np.arange(half, dtype=np.float64) / half))
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1)


def test_timestep_sinusoid_matches_float64():
    # The warped Self-Forcing steps, the commit at 0, and arbitrary training times.
    t = np.concatenate([np.float32([0.0, 625.0, 833.3333, 937.5, 1000.0, 999.99]),
                        np.random.default_rng(0).uniform(0, 1000, 64).astype(np.float32)])
    ours = np.asarray(timestep_embedding(256, jnp.asarray(t)))
    exact = _sinusoid_f64(256, t)
    assert np.max(np.abs(ours - exact)) <= 3e-7
    # The plain float32 evaluation is far off at large t: the tables are what buys the accuracy.
    half = 128
    naive = t[:, None] * np.power(10000.0, -np.arange(half) / half).astype(np.float32)
    assert np.max(np.abs(np.cos(naive.astype(np.float32)) - exact[:, :half])) > 1e-5


@pytest.mark.parametrize("start", [0, 7, 1021, 1024, 5000, 1_048_577, 300_000_000])
def test_rope_rotation_matches_float64_at_any_frame(start):
    config = dit_preset("wan2.1-t2v-1.3b").replace(latent_height=4, latent_width=6)
    cos, sin = (np.asarray(a) for a in rope_rotation(config, jnp.int32(start), 3))
    d_t, d_h, d_w = config.rope_axes
    rows, cols = config.grid

    def inv(d):
        return 1.0 / np.power(10000.0, np.arange(0, d, 2, dtype=np.float64) / d)

    frames, r, c = np.meshgrid(np.arange(3) + start, np.arange(rows), np.arange(cols), indexing="ij")
    angles = np.concatenate([np.outer(frames.ravel(), inv(d_t)), np.outer(r.ravel(), inv(d_h)),
                             np.outer(c.ravel(), inv(d_w))], axis=1)
    assert cos.shape == (3 * rows * cols, config.head_dim // 2)
    np.testing.assert_allclose(cos, np.cos(angles), atol=5e-7)
    np.testing.assert_allclose(sin, np.sin(angles), atol=5e-7)
