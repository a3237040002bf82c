"""One-step accuracy of a SpriteWorld model: does the next frame put the agent and the ball in the right cell?

Given the true context (teacher forcing, the same pass the loss uses, which equals cached
inference), the model generates each next frame with the pipeline's sampler (one step from
pure noise at ``t = 1000``), the frame is decoded the way the pipeline decodes it, and its
cells are compared with the simulator's:

* **agent**: the cells showing the agent are exactly the true agent cell;
* **ball**: the cells showing a ball are exactly the true ball cell, in the true colour
  (the colour is the ball's velocity);
* **frame**: every cell is right.

Clips come from :func:`~ardiff_jax.training.sample_training_batch` with a seed of their
own (``EVALUATION_SEED``, never a training seed): half contiguous from the reset frame,
half far from it (the sink up to ``max_gap`` frames back), as a long rollout sees it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.envs import ACTION_NAMES, cell_codes
from ardiff_jax.models import (
    CausalDiTConfig,
    action_registers,
    clean_estimate,
    frames_to_latents,
    latents_to_frames,
    snap_to_cells,
    tokenize_prompt,
)
from ardiff_jax.training._objective import sample_training_batch, teacher_forced_outputs

__all__ = ["OneStepAccuracy", "one_step_accuracy", "EVALUATION_SEED"]

#: Seed of the evaluation clips; ``ardiff-jax train`` refuses it as a training seed.
EVALUATION_SEED = 1_000_003

_AGENT, _FIRST_BALL = 2, 3


class OneStepAccuracy(NamedTuple):
    """Shares of next-frame predictions (true context) with the agent, the ball and the whole frame right."""

    agent: float
    ball: float
    frame: float
    transitions: int

    def as_dict(self) -> dict[str, float | int]:
        return self._asdict()


@functools.partial(jax.jit, static_argnums=(0, 2, 7, 8))
def _predicted_frames(graphdef: Any, params: Any, config: CausalDiTConfig, frames: jax.Array, actions: jax.Array,
                      positions: jax.Array, key: jax.Array, prediction: str, decoder: str) -> jax.Array:
    """``u8[B, n - 1, H, W, 3]``: each target frame as the pipeline would generate and decode it."""
    modules = nnx.merge(graphdef, params)
    text_kv = modules.transformer.text_cross_kv(modules.text_encoder(jnp.asarray(tokenize_prompt("", config.text_len))))

    def one(frames: jax.Array, actions: jax.Array, positions: jax.Array, key: jax.Array) -> jax.Array:
        latents = frames_to_latents(frames, jnp)
        controls = action_registers(actions, len(ACTION_NAMES), jnp)[:, None, :]
        noise = jax.random.normal(key, latents[1:].shape, jnp.float32)  # sigma = 1: x_t is the noise
        sigma = jnp.ones((latents.shape[0] - 1,), jnp.float32)
        out = teacher_forced_outputs(modules, config, latents, controls, positions, noise, sigma, text_kv)
        x0 = jax.vmap(lambda o, x, prev: clean_estimate(o[None], x[None], 1.0, prev, prediction)[0])(
            out, noise, latents[:-1])
        if decoder == "cells":
            x0 = snap_to_cells(x0, jnp)
        return latents_to_frames(x0, jnp)

    keys = jax.random.split(key, frames.shape[0])
    return jax.vmap(one)(frames, actions, positions, keys)


def one_step_accuracy(modules: Any, config: CausalDiTConfig, *, prediction: str = "delta", decoder: str = "cells",
                      batches: int = 4, batch_size: int = 32, sequence_frames: int = 4, max_gap: int = 64,
                      seed: int = EVALUATION_SEED) -> OneStepAccuracy:
    """Score ``modules`` (a :class:`~ardiff_jax.models.DiTModules`) on held-out transitions (module docstring).

    ``prediction`` and ``decoder`` must be the pipeline's (``SpriteWorldPipelineConfig``).
    Counts only targets whose previous frame is in the sequence.
    """
    graphdef, params = nnx.split(modules)
    agent = ball = frame = total = 0
    for step in range(batches):
        batch = sample_training_batch(seed, step, batch_size, sequence_frames, max_gap, size=config.latent_height)
        predicted = np.asarray(_predicted_frames(graphdef, params, config, batch.frames, batch.actions,
                                                 batch.positions, jax.random.key(step), prediction, decoder))
        for b in range(batch_size):
            for i in np.flatnonzero(batch.weights[b] > 0):
                got, want = cell_codes(predicted[b, i]), cell_codes(batch.frames[b, i + 1])
                agent += bool(np.array_equal(got == _AGENT, want == _AGENT))
                ball += bool(np.array_equal(np.where(got >= _FIRST_BALL, got, -1),
                                            np.where(want >= _FIRST_BALL, want, -1)))
                frame += bool(np.array_equal(got, want))
                total += 1
    return OneStepAccuracy(agent=agent / total, ball=ball / total, frame=frame / total, transitions=total)
