"""The training objective: teacher-forced flow matching over block-causal sequences (pure, jittable).

A training sequence is a **sink frame plus a run of consecutive frames** of one SpriteWorld
clip, at their true frame indices: frame 0 (the reset frame, which inference keeps as the
attention sink) followed by frames ``g, g + 1, ..., g + n - 2``. ``g = 1`` makes it a
contiguous clip; a larger gap puts the sink as far back as a long rollout does, so the model
learns to treat a distant sink the way inference will show it.

The sequence becomes ``2 (n - 1)`` block instances in one :meth:`CausalDiT.forward_blocks`
pass (teacher forcing, as CausVid trains its causal student):

* **clean context**: frames ``0 .. n-2`` at ``t = 0``, each seeing what the runtime would
  have committed before it;
* **noisy targets**: frames ``1 .. n-1``, each at its own noise level (diffusion forcing's
  per-block levels, drawn as :class:`Objective` says), seeing the clean context the window
  rule shows it plus itself.

:func:`~ardiff_jax.models.block_causal_mask` builds the token mask from the runtime's own
visible-window rule, so a noisy target sees exactly what a cached inference forward sees.
A target whose previous frame is not in the sequence (the first frame after a gap) carries
no loss: it could only guess.

The loss is the MSE of what the transformer predicts (:class:`Objective`): the change from
the previous frame (``delta``, the default), the clean frame (``x0``) or the flow
``noise - x0``. Each frame's one-hot action conditions its tokens as the transformer's
per-frame ``controls``. Every pixel weighs the same by default: a weight that depends on the
*target* (the former 9x on pixels that changed) moves the loss's optimum away from the
expected frame, towards painting the sprite wherever it might go (ghosts); see
``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.envs import ACTION_NAMES, CELL_SIZE, sprite_world_clips
from ardiff_jax.models import (
    PREDICTIONS,
    CausalDiTConfig,
    MaskedAttention,
    action_registers,
    block_causal_mask,
    frames_to_latents,
    tokenize_prompt,
)

__all__ = ["Objective", "TrainingBatch", "sample_training_batch", "encounters", "sequence_loss", "batch_loss",
           "teacher_forced_outputs", "rollout_weights", "rollout_batch_loss"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """The knobs of the loss (hashable: a static argument of the jitted step).

    Noise levels are drawn where the sampler works: with probability
    ``sigma_one_probability`` a target is pure noise (``sigma = 1``, the step that must
    produce the whole next frame from the context), otherwise ``sigma`` is uniform in
    ``(0, low_sigma_max]`` (a clean-up step). SpriteWorld is deterministic, so the shipped
    model samples in one step and trains at ``sigma = 1`` only.

    ``prediction`` says what the transformer's video output is
    (:func:`~ardiff_jax.models.clean_estimate`): ``"delta"`` (the change from the previous
    frame; the loss is ``|delta_pred - (x0 - previous)|^2``), ``"x0"`` (the clean frame) or
    ``"flow"`` (Wan's ``v = noise - x0``). A flow prediction at ``sigma = 1`` must reproduce
    its own pure-noise input token by token on top of the next frame, and what it fails to
    copy comes out as noise in the frame.

    Attributes:
      change_weight: extra weight of pixels that changed since the previous frame (0: none;
        a target-dependent weight rewards ghosts, ``docs/models.md``).
      focus_weight: extra weight of the cells within one cell of a sprite (agent or ball) in
        the *previous* frame: every change SpriteWorld can make happens there, and a weight
        that depends only on the input leaves the loss's optimum where it was.
      sigma_one_probability: share of targets at ``sigma = 1``.
      low_sigma_max: the largest ``sigma`` of the other targets.
      prediction: ``"delta"``, ``"x0"`` or ``"flow"``.
    """

    change_weight: float = 0.0
    focus_weight: float = 0.0
    sigma_one_probability: float = 1.0
    low_sigma_max: float = 0.3
    prediction: str = "delta"

    def __post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"Objective prediction must be one of {PREDICTIONS}, got {self.prediction!r}")


class TrainingBatch(NamedTuple):
    """Host-side batch of training sequences.

    Attributes:
      frames: ``u8[B, n, H, W, 3]``: the sink frame then ``n - 1`` consecutive frames.
      actions: ``i32[B, n]``: the action that produced each frame (no-op for the reset frame).
      positions: ``i32[B, n]``: each frame's index in its clip (frame 0 is the sink).
      weights: ``f32[B, n - 1]``: loss weight of each noisy target (0 after a gap).
    """

    frames: np.ndarray
    actions: np.ndarray
    positions: np.ndarray
    weights: np.ndarray


def sample_training_batch(seed: int, step: int, batch: int, num_frames: int, max_gap: int,
                          size: int = 32, max_sink_distance: int | None = None,
                          encounter_share: float = 0.0, encounter_weight: float = 0.0,
                          chase_probability: float = 0.0) -> TrainingBatch:
    """The batch of training step ``step``: a pure function of ``(seed, step)``, so a resumed run sees the same data.

    Half the sequences are contiguous (``g = 1``); the rest start after a gap drawn
    uniformly from ``[2, max_gap]`` simulated steps. With ``max_sink_distance``, those are
    also *placed* further from the sink: their frame indices are shifted so that the first
    one sits uniformly in ``[g, max_sink_distance]``. The world is Markov and its walls never
    change, so a frame 30 steps after the reset looks exactly like one 900 steps after it;
    only the rotary distance to the sink differs, and a model that will play for thousands
    of frames must have seen such distances.

    ``encounter_share`` of the gapped sequences instead start so that one of their weighted
    targets follows an **agent-ball encounter** (:func:`encounters`): a step that ends with the
    agent beside where the ball was, so the ball's bounce depends on the agent's new cell (and
    the ball may block the agent's move). Random actions bring the two together in about one
    step in nine, and every one-step error of the 6000-step model was in such a step
    (``docs/models.md``). The world is deterministic, so whether a step is an
    encounter is a function of its context frame and action: choosing such windows more
    often changes which inputs the model sees, not the right answer to any of them. With
    ``encounter_share = 0`` the batch is exactly what it was before the option existed.
    ``encounter_weight`` adds that much to the loss weight of every target that follows an
    encounter (read from the same two frames, so it is an input-dependent weight too).
    ``chase_probability`` makes the clips' players chase the ball that share of the time
    (:func:`~ardiff_jax.envs.sprite_world_clips`): more encounters in every clip, contiguous
    ones included.
    """
    rng = np.random.default_rng([seed, step])
    clip_seed = int(rng.integers(0, 2**62))
    gaps = np.where(rng.random(batch) < 0.5, 1, rng.integers(2, max(max_gap, 2) + 1, size=batch))
    # With encounter focus every clip runs to the longest gap, so that any start in [2, max_gap] exists.
    length = (max(max_gap, 2) if encounter_share > 0 else int(gaps.max())) + num_frames - 1
    frames, actions = sprite_world_clips(clip_seed, batch, length, size=size, chase_probability=chase_probability)
    if encounter_share > 0:
        met = encounters(frames)  # [B, length - 1]
        focus = (gaps > 1) & (rng.random(batch) < encounter_share)
        for b in np.flatnonzero(focus):
            # A start g puts frames g .. g + n - 3 in front of the weighted targets g + 1 ..
            starts = [g for g in range(2, max(max_gap, 2) + 1) if met[b, g:g + num_frames - 2].any()]
            if starts:
                gaps[b] = starts[int(rng.integers(len(starts)))]
    offsets = np.arange(num_frames - 1)
    sampled = np.concatenate([np.zeros((batch, 1), np.int64), gaps[:, None] + offsets[None, :]], axis=1)
    positions = sampled
    if max_sink_distance is not None and max_sink_distance > max_gap:
        placed = np.where(gaps == 1, 1, rng.integers(gaps, max_sink_distance + 1))
        positions = np.concatenate([np.zeros((batch, 1), np.int64), placed[:, None] + offsets[None, :]], axis=1)
    rows = np.arange(batch)[:, None]
    weights = np.ones((batch, num_frames - 1), np.float32)
    weights[:, 0] = (gaps == 1).astype(np.float32)
    selected = frames[rows, sampled]
    if encounter_weight > 0:
        weights *= 1.0 + encounter_weight * encounters(selected).astype(np.float32)
    return TrainingBatch(frames=selected, actions=actions[rows, sampled].astype(np.int32),
                         positions=positions.astype(np.int32), weights=weights)


def encounters(frames: np.ndarray) -> np.ndarray:
    """``bool[..., n - 1]``: which steps of clips ``u8[..., n, H, W, 3]`` are agent-ball encounters.

    Step ``t`` (frame ``t`` to ``t + 1``) is an encounter when the agent, after its move, is
    within one cell (Chebyshev) of where the ball was: the ball's next cell is decided by
    the agent's new one (it bounces off it or is stopped), and the agent's move by the ball
    (it cannot walk into it). The world is deterministic, so this is a function of frame
    ``t`` and the action. Read from each cell's pixel at (1, 1), inside the ball's drawn
    disc: the ball is the only red, the agent the only pure green.
    """
    cells = frames[..., 1::CELL_SIZE, 1::CELL_SIZE, :]  # [..., n, rows, cols, 3]
    cols = cells.shape[-2]
    ball = (cells[..., 0] == 255).reshape(*cells.shape[:-3], -1)
    agent = ((cells[..., 1] == 255) & (cells[..., 0] == 0)).reshape(*cells.shape[:-3], -1)
    ball_at, agent_at = ball.argmax(-1)[..., :-1], agent.argmax(-1)[..., 1:]
    distance = np.maximum(np.abs(ball_at // cols - agent_at // cols), np.abs(ball_at % cols - agent_at % cols))
    return (distance <= 1) & ball.any(-1)[..., :-1] & agent.any(-1)[..., 1:]


def near_sprites(latents: jax.Array) -> jax.Array:
    """``f32[n, 1, H, W]``: 1 on the cells within one cell (3x3) of a sprite in ``latents f32[n, 3, H, W]``, else 0.

    A sprite cell is one with red or green in it (the agent is green, every ball colour has
    red; floor and walls have neither), read from the frame alone.
    """
    n, _, h, w = latents.shape
    cells = latents.reshape(n, 3, h // CELL_SIZE, CELL_SIZE, w // CELL_SIZE, CELL_SIZE).mean(axis=(3, 5))
    sprite = ((cells[:, 0] > 0) | (cells[:, 1] > 0)).astype(jnp.float32)  # [n, rows, cols]
    near = jax.lax.reduce_window(sprite, 0.0, jax.lax.max, (1, 3, 3), (1, 1, 1), "SAME")
    return jnp.repeat(jnp.repeat(near, CELL_SIZE, axis=1), CELL_SIZE, axis=2)[:, None]


def teacher_forced_outputs(
    modules: Any,  # DiTModules (transformer + text encoder)
    config: CausalDiTConfig,
    latents: jax.Array,  # f32[n, 3, H, W]: the sequence's clean frames
    controls: jax.Array,  # f32[n, 1, control_dim]: each frame's one-hot action
    positions: jax.Array,  # i32[n]
    x_t: jax.Array,  # f32[n - 1, 3, H, W]: the noisy targets (frames 1 .. n-1)
    sigma: jax.Array,  # f32[n - 1]: their noise levels
    text_kv: tuple[jax.Array, jax.Array],  # [L, N, H, D] each
) -> jax.Array:
    """``f32[n - 1, 3, H, W]``: the transformer's output for each noisy target, in one teacher-forced pass.

    Target ``i`` sees exactly what a cached inference forward of frame ``positions[i + 1]``
    would see after the clean frames before it were committed (``block_causal_mask``).
    """
    n = latents.shape[0]
    instances = jnp.concatenate([latents[:-1], x_t])[:, None]  # [2(n-1), 1, 3, H, W]
    timesteps = jnp.concatenate([jnp.zeros((n - 1,)), sigma * 1000.0])
    starts = jnp.concatenate([positions[:-1], positions[1:]])
    clean = jnp.arange(2 * (n - 1)) < n - 1
    mask = block_causal_mask(config, starts, clean)
    out = modules.transformer.forward_blocks(instances, timesteps, starts, text_kv, None, None,
                                             jnp.concatenate([controls[:-1], controls[1:]]),
                                             attention=MaskedAttention(mask))
    return out.video[n - 1:, 0]


def sequence_loss(
    modules: Any,  # DiTModules (transformer + text encoder)
    config: CausalDiTConfig,
    frames: jax.Array,  # u8[n, H, W, 3]
    actions: jax.Array,  # i32[n]
    positions: jax.Array,  # i32[n]
    weights: jax.Array,  # f32[n - 1]
    key: jax.Array,  # PRNG key of this sequence's noise levels and noise
    objective: Objective,
    text_kv: tuple[jax.Array, jax.Array],  # [L, N, H, D] each: the (empty) prompt's cross-attention K/V
) -> tuple[jax.Array, jax.Array]:
    """``(weighted loss sum, weight sum)`` of one sequence (see the module docstring)."""
    n = frames.shape[0]
    latents = frames_to_latents(frames, jnp)  # [n, 3, H, W]
    controls = action_registers(actions, len(ACTION_NAMES), jnp)[:, None, :]  # [n, f=1, 5]: one-hot per frame
    key_sigma, key_one, key_noise = jax.random.split(key, 3)
    low = jax.random.uniform(key_sigma, (n - 1,), minval=1e-3, maxval=objective.low_sigma_max)
    sigma = jnp.where(jax.random.uniform(key_one, (n - 1,)) < objective.sigma_one_probability, 1.0, low)
    x0 = latents[1:]
    noise = jax.random.normal(key_noise, x0.shape, jnp.float32)
    s = sigma[:, None, None, None]
    x_t = (1.0 - s) * x0 + s * noise
    pred = teacher_forced_outputs(modules, config, latents, controls, positions, x_t, sigma, text_kv)
    # What the output should have been; a target after a gap has no previous frame in the
    # sequence, and its weight is 0.
    target = {"x0": x0, "flow": noise - x0, "delta": x0 - latents[:-1]}[objective.prediction]
    changed = jnp.any(latents[1:] != latents[:-1], axis=1, keepdims=True)  # [n-1, 1, H, W]
    pixel_weight = (1.0 + objective.change_weight * changed.astype(jnp.float32)
                    + objective.focus_weight * near_sprites(latents[:-1]))
    err = jnp.square(pred - target) * pixel_weight
    per_target = err.mean(axis=(1, 2, 3))
    return jnp.sum(per_target * weights), jnp.sum(weights)


def batch_loss(graphdef: Any, params: Any, config: CausalDiTConfig, batch: TrainingBatch, key: jax.Array,
               objective: Objective) -> jax.Array:
    """Mean weighted loss over a batch (the value :func:`~ardiff_jax.training.train` minimises)."""
    modules = nnx.merge(graphdef, params)
    keys = jax.random.split(key, batch.frames.shape[0])
    # The model is not text-conditioned: one projection of the empty prompt serves every sequence.
    text_ids = jnp.asarray(tokenize_prompt("", config.text_len))
    text_kv = modules.transformer.text_cross_kv(modules.text_encoder(text_ids))
    totals, counts = jax.vmap(
        lambda f, a, p, w, k: sequence_loss(modules, config, f, a, p, w, k, objective, text_kv)
    )(batch.frames, batch.actions, batch.positions, batch.weights, keys)
    return jnp.sum(totals) / jnp.maximum(jnp.sum(counts), 1.0)


def rollout_weights(batch: TrainingBatch, context_frames: int) -> np.ndarray:
    """``f32[B, n]``: the loss weight of each frame of a self-rollout sequence (0 where it is observed).

    Frame 0 (the sink) is observed. A contiguous sequence (``g = 1``) is generated from
    frame 1 on, as a session is after its reset frame; a gapped one first observes
    ``context_frames`` true frames (the visible history a forward sees), then generates.
    The generated frames keep :func:`sample_training_batch`'s weights (encounter weights).
    """
    weights = np.concatenate([np.zeros((batch.weights.shape[0], 1), np.float32), batch.weights], axis=1)
    contiguous = batch.positions[:, 1] == 1
    weights[:, 1:1 + context_frames] = np.where(contiguous[:, None], weights[:, 1:1 + context_frames], 0.0)
    # sample_training_batch gives a gap's first target weight 0 ("could only guess" teacher-forced);
    # in a rollout of a contiguous sequence that target is the first generated frame, seen from the sink.
    weights[contiguous, 1] = np.maximum(weights[contiguous, 1], 1.0)
    return weights


def rollout_batch_loss(graphdef: Any, params: Any, config: CausalDiTConfig, batch: TrainingBatch,
                       weights: jax.Array, key: jax.Array, objective: Objective, schedule: Any,
                       context_frames: int, truncation: Any, decoder: Any) -> jax.Array:
    """Mean weighted loss of one self-rollout per sequence (Self-Forcing against the simulator's frames).

    Each sequence is rolled out by :func:`~ardiff_jax.training.self_rollout` exactly as a
    session plays: the sink observed, a gapped sequence's ``context_frames`` observed at
    their far-from-sink positions, every other frame generated from the model's own
    committed (decoded) frames under the recorded actions. The loss compares each generated
    frame with the simulator's, each pixel weighted as :func:`sequence_loss` weighs it
    (``focus_weight`` near the sprites of the frame it continues from, the model's own).
    """
    from ardiff_jax.training._self_forcing import (RolloutConditioning, ground_truth_loss, rollout_noise,
                                                   self_rollout)

    modules = nnx.merge(graphdef, params)
    b, n = batch.frames.shape[:2]
    latents = jax.vmap(lambda f: frames_to_latents(f, jnp))(batch.frames)[:, :, None]  # [B, n, f=1, 3, H, W]
    controls = jax.vmap(lambda a: action_registers(a, len(ACTION_NAMES), jnp))(batch.actions)[:, :, None, :]
    contiguous = batch.positions[:, 1] == 1
    index = jnp.arange(n)[None, :]
    observed = (index == 0) | ((~contiguous[:, None]) & (index <= context_frames))
    text_ids = jnp.asarray(tokenize_prompt("", config.text_len))
    text_kv = jax.lax.stop_gradient(modules.transformer.text_cross_kv(modules.text_encoder(text_ids)))
    conditioning = RolloutConditioning(text_kv=jax.tree.map(lambda a: jnp.broadcast_to(a, (b,) + a.shape), text_kv),
                                       controls=controls)
    key_exit, key_noise = jax.random.split(key)
    exits = truncation.exit_steps(key_exit, n, schedule.num_steps)
    noise = rollout_noise(key_noise, b, n, schedule.num_steps, latents.shape[2:])
    rollout = self_rollout(graphdef, params, latents, observed, conditioning, noise, exits, batch.positions[:, 1],
                           schedule=schedule, prediction=objective.prediction, truncation=truncation, finish=decoder)
    # The frame each generated frame continues from is the model's own previous committed frame.
    previous = jnp.concatenate([rollout.committed[:, :1], rollout.committed[:, :-1]], axis=1)[:, :, 0]
    focus = jax.vmap(near_sprites)(previous)[:, :, None]  # [B, n, 1, 1, H, W]
    pixel_weight = 1.0 + objective.focus_weight * focus
    total, count = ground_truth_loss(rollout, latents, weights, pixel_weight)
    return total / jnp.maximum(count, 1.0)
