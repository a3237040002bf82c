"""Distribution matching distillation (DMD): the loss Self-Forcing trains its few-step generators with (pure, jittable).

A few-step causal generator rolls out (:func:`~ardiff_jax.training.self_rollout`); two
flow-prediction denoisers of the same ``CausalDiT`` kind judge what it generated: a frozen
**real score** (the teacher) and a trainable **fake score** (the critic), which keeps
learning to denoise the generator's own outputs. For generated frames ``x``:

* draw a timestep ``t`` per row (uniform on ``[min_score_timestep, num_train_timesteps)``,
  shifted by ``timestep_shift``, clamped to ``[min_timestep, max_timestep]``), noise
  ``x_t = (1 - sigma) x + sigma eps`` with ``sigma = t / num_train_timesteps``;
* both scores predict ``x0`` from ``x_t`` (the real one with classifier-free guidance,
  ``cond + guidance_scale (cond - uncond)``);
* ``grad = (fake_x0 - real_x0) / mean|x - real_x0|`` (the normaliser per row), and the
  generator loss is ``0.5 mse(x, stop_gradient(x - grad))``: its gradient with respect to
  ``x`` is ``grad / x.size``, pushing samples from where the critic says the generator's
  distribution is towards where the teacher says the data is (DMD, Yin et al. 2024, eq. 7-8);
* the critic learns by flow matching on ``stop_gradient(x)``: ``mse(fake_flow, eps - x)``.

The generator updates every ``generator_update_every`` iterations, the critic every
iteration (the release's ``dfake_gen_update_ratio``); :func:`make_dmd_step` is one such
iteration as one jitted program (a ``lax.cond`` on the step counter picks whether the
generator's backward runs), each network with its own optax state.

Followed: ``model/dmd.py`` (``_compute_kl_grad``, ``compute_distribution_matching_loss``,
``critic_loss``), ``model/base.py`` (``_get_timestep``), ``trainer/distillation.py`` (the
alternation) and ``configs/self_forcing_dmd.yaml`` (defaults) of ``guandeh17/Self-Forcing`` at
commit ``33593df3e81fa3ec10239271dd2c100facac6de1``; written anew, not copied.

Scores here are ``CausalDiT`` networks run teacher-forced (:func:`causal_score_fn`): every
generated block is noised and denoised seeing the *clean* generated blocks before it through
``block_causal_mask`` (what cached inference would show it), in one ``forward_blocks`` pass.
The release's scores are bidirectional Wan networks that see the whole noisy video; a
causal teacher is what this runtime serves, and a score function is any callable, so a
bidirectional one plugs into :func:`dmd_generator_loss` unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ardiff_jax._checks import check_flag, check_non_negative_int, check_positive_int
from ardiff_jax.models import FewStepSchedule, MaskedAttention, block_causal_mask
from ardiff_jax.training._self_forcing import (RolloutBlocks, RolloutConditioning, Truncation, rollout_noise,
                                               sample_exit_steps, self_rollout)

__all__ = ["DMDConfig", "DMDState", "DMDInputs", "DMDKeys", "ScoreFn", "dmd_keys", "sample_score_timesteps",
           "dmd_generator_loss", "critic_loss", "causal_score_fn", "rollout_frame_starts", "dmd_rollout",
           "init_dmd_state", "make_dmd_step", "dmd_optimizer"]

#: ``score(x_t f32[B, n, f, C, H, W], timesteps f32[B, n], clean f32[B, n, f, C, H, W]) -> x0`` (same shape as
#: ``x_t``): a denoiser's clean estimate of every block, each seeing ``clean``'s earlier blocks as history.
ScoreFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _check_scale(name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class DMDConfig:
    """One DMD run's hyperparameters (hashable; defaults: ``configs/self_forcing_dmd.yaml`` of the release).

    Attributes:
      guidance_scale: classifier-free guidance of the real score, ``cond + g (cond - uncond)``
        (the release's ``guidance_scale`` / ``real_guidance_scale``: 3.0).
      fake_guidance_scale: the same for the critic's score in the generator loss (0: none;
        the critic always trains unguided, as in the release).
      min_timestep, max_timestep: the clamp of the score timestep on the ``num_train_timesteps``
        scale (the release's ``min_step = 0.02 T``, ``max_step = 0.98 T``). ``min_timestep > 0``.
      min_score_timestep: the lower end of the uniform draw, before the shift (release: 0).
      timestep_shift: ``t -> s t / (1 + (s - 1) t)`` on ``t / T`` (release: 5.0; 1.0: none).
      num_train_timesteps: ``T``; ``sigma = t / T``.
      generator_update_every: the generator updates on iterations ``step % k == 0``, the
        critic on every one (the release's ``dfake_gen_update_ratio``: 5).
      per_block_timestep: ``False`` (the release's ``uniform_timestep``): one score timestep
        per row for all its blocks; ``True``: one per block.
      normalize: divide the DMD gradient by ``mean|x - real_x0|`` per row (DMD eq. 8; the
        release always does).
    """

    guidance_scale: float = 3.0
    fake_guidance_scale: float = 0.0
    min_timestep: int = 20
    max_timestep: int = 980
    min_score_timestep: int = 0
    timestep_shift: float = 5.0
    num_train_timesteps: int = 1000
    generator_update_every: int = 5
    per_block_timestep: bool = False
    normalize: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "guidance_scale", _check_scale("DMDConfig guidance_scale", self.guidance_scale, 0.0))
        object.__setattr__(self, "fake_guidance_scale",
                           _check_scale("DMDConfig fake_guidance_scale", self.fake_guidance_scale, 0.0))
        object.__setattr__(self, "timestep_shift", _check_scale("DMDConfig timestep_shift", self.timestep_shift, 1.0))
        total = check_positive_int("DMDConfig num_train_timesteps", self.num_train_timesteps)
        low = check_positive_int("DMDConfig min_timestep", self.min_timestep)
        high = check_positive_int("DMDConfig max_timestep", self.max_timestep)
        if not low <= high <= total:
            raise ValueError(f"DMDConfig needs 0 < min_timestep <= max_timestep <= num_train_timesteps, got "
                             f"{low}, {high}, {total}")
        draw = check_non_negative_int("DMDConfig min_score_timestep", self.min_score_timestep)
        if draw >= total:
            raise ValueError(f"DMDConfig min_score_timestep must be below num_train_timesteps ({total}), got {draw}")
        check_positive_int("DMDConfig generator_update_every", self.generator_update_every)
        check_flag("DMDConfig per_block_timestep", self.per_block_timestep)
        check_flag("DMDConfig normalize", self.normalize)


def sample_score_timesteps(key: jax.Array, batch: int, num_blocks: int, config: DMDConfig) -> jax.Array:
    """``f32[B, n]``: the score timesteps of a DMD or critic loss (a pure function of ``key``).

    Integers uniform on ``[min_score_timestep, num_train_timesteps)``, one per row (or per
    block), shifted by ``timestep_shift`` and clamped to ``[min_timestep, max_timestep]``.
    """
    shape = (batch, num_blocks) if config.per_block_timestep else (batch, 1)
    t = jax.random.randint(key, shape, config.min_score_timestep, config.num_train_timesteps).astype(jnp.float32)
    if config.timestep_shift != 1.0:
        u = t / config.num_train_timesteps
        t = config.timestep_shift * u / (1.0 + (config.timestep_shift - 1.0) * u) * config.num_train_timesteps
    t = jnp.clip(t, float(config.min_timestep), float(config.max_timestep))
    return jnp.broadcast_to(t, (batch, num_blocks))


def _noised(x: jax.Array, key: jax.Array, config: DMDConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(x_t, timesteps [B, n], sigma [B, n, 1, 1, 1, 1], eps)`` for clean ``x [B, n, f, C, H, W]``."""
    key_t, key_eps = jax.random.split(key)
    timesteps = sample_score_timesteps(key_t, x.shape[0], x.shape[1], config)
    sigma = (timesteps / config.num_train_timesteps).reshape(timesteps.shape + (1,) * (x.ndim - 2))
    eps = jax.random.normal(key_eps, x.shape, jnp.float32)
    return (1.0 - sigma) * x + sigma * eps, timesteps, sigma, eps


def _weighted_mean(err: jax.Array, weights: jax.Array | None) -> jax.Array:
    """Mean over every element, or over the blocks ``weights f32[B, n]`` weighs (weighted)."""
    if weights is None:
        return jnp.mean(err)
    per_block = err.mean(axis=tuple(range(2, err.ndim)))
    return jnp.sum(per_block * weights) / jnp.maximum(jnp.sum(weights), 1e-12)


def dmd_generator_loss(
    real_score_fn: ScoreFn,  # the teacher (guidance inside): frozen, never differentiated
    fake_score_fn: ScoreFn,  # the critic at its current parameters: never differentiated here
    generated: jax.Array,  # f32[B, n, f, C, H, W]: the rollout's generated blocks (carries the generator's gradient)
    key: jax.Array,
    config: DMDConfig,
    weights: jax.Array | None = None,  # f32[B, n]: each block's loss weight (0: observed); None: every block
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)``: the DMD generator loss ``0.5 mse(x, stop_gradient(x - grad))``.

    Everything but ``generated`` itself sits under ``stop_gradient``: the loss's gradient
    reaches the generator only through ``generated`` (``d loss / d x = grad / size``, in the
    weighted blocks), and the scores' parameters get none. The scores see
    ``stop_gradient(generated)`` as the clean history of each block.

    ``metrics``: ``dmd_gradient_norm`` (``mean|grad|``, the release's ``dmdtrain_gradient_norm``)
    and ``timesteps f32[B, n]``.
    """
    x = jax.lax.stop_gradient(generated)
    x_t, timesteps, _, _ = _noised(x, key, config)
    real = jax.lax.stop_gradient(real_score_fn(x_t, timesteps, x))
    fake = jax.lax.stop_gradient(fake_score_fn(x_t, timesteps, x))
    grad = fake - real
    if config.normalize:
        grad = grad / jnp.mean(jnp.abs(x - real), axis=tuple(range(1, x.ndim)), keepdims=True)
    grad = jnp.nan_to_num(grad)
    target = jax.lax.stop_gradient(x - grad)
    loss = 0.5 * _weighted_mean(jnp.square(generated - target), weights)
    return loss, {"dmd_gradient_norm": jnp.mean(jnp.abs(grad)), "timesteps": timesteps}


def critic_loss(
    fake_score_fn: Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array],  # (params, x_t, timesteps, clean) -> x0
    params_critic: Any,  # the critic's parameters: the loss is differentiable with respect to them
    generated: jax.Array,  # f32[B, n, f, C, H, W]: the generator's outputs (stop_gradient'ed here)
    key: jax.Array,
    config: DMDConfig,
    weights: jax.Array | None = None,  # f32[B, n]; None: every block
) -> jax.Array:
    """The critic's flow-matching loss on the generator's outputs: ``mse(fake_flow, eps - x)``.

    ``x = stop_gradient(generated)`` (the generator gets no gradient from its critic),
    noised at the same timestep distribution as the DMD loss; ``fake_flow = (x_t - x0) / sigma``
    converts the score's clean estimate back to the flow it predicted.
    """
    x = jax.lax.stop_gradient(generated)
    x_t, timesteps, sigma, eps = _noised(x, key, config)
    x0 = fake_score_fn(params_critic, x_t, timesteps, x)
    flow = (x_t - x0) / sigma
    return _weighted_mean(jnp.square(flow - (eps - x)), weights)


def rollout_frame_starts(batch: int, num_blocks: int, frames_per_block: int,
                         run_start: jax.Array | None = None) -> jax.Array:
    """``i32[B, n]``: each block's first frame in a :func:`self_rollout` (``run_start`` places block 1 there)."""
    contiguous = jnp.arange(num_blocks, dtype=jnp.int32) * frames_per_block
    if run_start is None:
        return jnp.broadcast_to(contiguous, (batch, num_blocks))
    run = jnp.asarray(run_start, jnp.int32)[:, None] + (contiguous[1:] - frames_per_block)[None]
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), run], axis=1)


def _transformer(graphdef: Any, params: Any) -> Any:
    module = nnx.merge(graphdef, params)
    return getattr(module, "transformer", module)


def causal_score_fn(
    graphdef: Any,  # nnx graphdef of a CausalDiT, or of a module with a .transformer (DiTModules)
    text: Any,  # f32[B, Lt, text_dim] prompt features, or precomputed text K/V ([B, L, N, H, D], [B, L, N, H, D])
    negative_text: Any = None,  # the same for the unconditional (negative) prompt; needed when guided
    guidance_scale: float = 0.0,
    *,
    registers: jax.Array | None = None,  # f32[B, n, E, register_dim]
    controls: jax.Array | None = None,  # f32[B, n, f, control_dim]
    image_kv: tuple[jax.Array, jax.Array] | None = None,  # [B, L, Ni, H, D] each
    frame_starts: jax.Array | None = None,  # i32[B, n] (rollout_frame_starts); None: block i at i * f
    num_train_timesteps: float = 1000.0,
) -> Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]:
    """``score(params, x_t, timesteps, clean) -> x0``: a flow-prediction ``CausalDiT`` as a teacher-forced score.

    Per row, one ``forward_blocks`` pass over the clean blocks ``0 .. n-2`` (``t = 0``) and
    every noisy block ``x_t[i]`` (at ``timesteps[i]``) under ``block_causal_mask``: noisy block
    ``i`` sees the clean blocks before it as cached inference would (sink, sliding window),
    plus itself. ``x0 = x_t - sigma v``. With ``guidance_scale != 0`` a second pass with
    ``negative_text`` gives ``x0 = cond + guidance_scale (cond - uncond)``.

    Prompt *features* are projected by the network's own layers inside (so a trainable
    critic's text projections train); precomputed K/V tuples are used as given (no gradient
    reaches the projections that made them). ``functools.partial(score, params)`` is a
    :data:`ScoreFn`.
    """
    guided = _check_scale("guidance_scale", guidance_scale, 0.0) != 0.0
    if guided and negative_text is None:
        raise ValueError("a guided score (guidance_scale != 0) needs negative_text (the unconditional prompt)")
    texts = [text, negative_text] if guided else [text]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *texts)  # leading [G]: conditional, unconditional

    def score(params: Any, x_t: jax.Array, timesteps: jax.Array, clean: jax.Array) -> jax.Array:
        transformer = _transformer(graphdef, params)
        config = transformer.config
        if x_t.ndim != 6 or x_t.shape != clean.shape:
            raise ValueError(f"x_t and clean must both be [B, n, f, C, H, W], got {x_t.shape} and {clean.shape}")
        if config.action is not None or config.input_channels:
            raise NotImplementedError("causal_score_fn runs forward_blocks, which takes no I2V or action networks")
        batch, n, f = x_t.shape[:3]
        times = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32), (batch, n))
        starts = rollout_frame_starts(batch, n, f) if frame_starts is None else jnp.asarray(frame_starts, jnp.int32)
        is_clean = jnp.arange(2 * n - 1) < n - 1

        def row(context: Any, x: jax.Array, t: jax.Array, history: jax.Array, start: jax.Array, reg: Any,
                ctrl: Any, image: Any) -> jax.Array:
            kv = context if isinstance(context, tuple) else transformer.text_cross_kv(context)
            both = jnp.concatenate([start[:-1], start])
            attention = MaskedAttention(block_causal_mask(config, both, is_clean))
            out = transformer.forward_blocks(
                jnp.concatenate([history[:-1], x]), jnp.concatenate([jnp.zeros((n - 1,), jnp.float32), t]), both, kv,
                image, None if reg is None else jnp.concatenate([reg[:-1], reg]),
                None if ctrl is None else jnp.concatenate([ctrl[:-1], ctrl]), attention=attention)
            sigma = (t / num_train_timesteps)[:, None, None, None, None]
            return x - sigma * out.video[n - 1:]

        rows = jax.vmap(row, in_axes=(0, 0, 0, 0, 0, 0, 0, 0))
        x0 = jax.vmap(lambda context: rows(context, x_t, times, clean, starts, registers, controls, image_kv))(
            stacked)
        if not guided:
            return x0[0]
        return x0[0] + guidance_scale * (x0[0] - x0[1])

    return score


# -- one DMD iteration --------------------------------------------------------------------------------------


class DMDKeys(NamedTuple):
    """The keys one DMD iteration draws from: rollout (exit steps, noise), generator loss, critic loss."""

    rollout: jax.Array
    generator: jax.Array
    critic: jax.Array


def dmd_keys(key: jax.Array) -> DMDKeys:
    """Split an iteration's key the way :func:`make_dmd_step` does."""
    return DMDKeys(*jax.random.split(key, 3))


class DMDInputs(NamedTuple):
    """What one DMD iteration rolls out and scores (a pytree; ``None`` fields are static).

    Attributes:
      text: ``f32[B, Lt, text_dim]`` prompt features; every network projects them with its own layers.
      negative_text: the unconditional (negative) prompt's features, or ``None`` when unguided.
      frames: ``f32[B, n, f, C, H, W]`` the observed blocks' latents (zeros where none).
      observed: ``bool[B, n]`` blocks committed from ``frames`` (weight 0 in both losses).
      registers: ``f32[B, n, E, register_dim]`` or ``None``.
      controls: ``f32[B, n, f, control_dim]`` or ``None``.
      run_start: ``i32[B]`` frame index of block 1 (:func:`self_rollout`), or ``None``.
    """

    text: jax.Array
    negative_text: jax.Array | None
    frames: jax.Array
    observed: jax.Array
    registers: jax.Array | None = None
    controls: jax.Array | None = None
    run_start: jax.Array | None = None


class DMDState(NamedTuple):
    """The trainable state: the iteration counter, both networks' parameters and optax states."""

    step: jax.Array  # i32[]
    generator: Any
    critic: Any
    generator_opt: Any
    critic_opt: Any


def init_dmd_state(generator_params: Any, critic_params: Any, generator_optimizer: Any,
                   critic_optimizer: Any) -> DMDState:
    """Iteration 0. The critic usually starts as a copy of the teacher (``jax.tree.map(jnp.copy, real)``)."""
    return DMDState(jnp.zeros((), jnp.int32), generator_params, critic_params,
                    generator_optimizer.init(generator_params), critic_optimizer.init(critic_params))


def dmd_optimizer(learning_rate: float, *, beta1: float = 0.0, beta2: float = 0.999, weight_decay: float = 0.01,
                  max_grad_norm: float = 10.0, freeze_text_encoder: bool = True) -> Any:
    """The release's optimiser: AdamW (``beta1 = 0``) behind a global-norm clip (its generator lr 2e-6, critic 4e-7).

    ``freeze_text_encoder``: parameters under a ``text_encoder`` key (``DiTModules``' stand-in
    encoder, which the step never runs: prompts enter as features) get no update at all, where
    weight decay alone would otherwise shrink them (the release's text encoder is frozen).
    """
    import optax

    inner = optax.chain(optax.clip_by_global_norm(max_grad_norm),
                        optax.adamw(learning_rate, b1=beta1, b2=beta2, weight_decay=weight_decay))
    if not freeze_text_encoder:
        return inner

    def labels(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if any(getattr(k, "key", None) == "text_encoder" for k in path) else "train",
            params)

    return optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()}, labels)


def dmd_rollout(graphdef: Any, params: Any, inputs: DMDInputs, key: jax.Array, *, schedule: FewStepSchedule,
                prediction: str = "flow", truncation: Truncation = Truncation(),
                finish: Callable[[jax.Array], jax.Array] | None = None) -> RolloutBlocks:
    """The generator's rollout of one iteration: exit steps and noise from ``key``, text K/V from its own layers.

    The text K/V enter without gradient (``stop_gradient``): :func:`self_rollout` stops the
    gradient of the *parameters* in its context forwards (the denoise steps before the exit,
    the commit passes), not of the K/V it is handed, so live K/V would carry gradient through
    those forwards too. The generator's text projections therefore get no gradient (the
    release trains them with the rest).
    """
    transformer = _transformer(graphdef, params)
    batch, n = inputs.observed.shape
    key_exit, key_noise = jax.random.split(key)
    exits = sample_exit_steps(key_exit, n, schedule.num_steps, truncation.per_block_exit)
    noise = rollout_noise(key_noise, batch, n, schedule.num_steps, inputs.frames.shape[2:])
    text_kv = jax.lax.stop_gradient(jax.vmap(transformer.text_cross_kv)(inputs.text))
    conditioning = RolloutConditioning(text_kv=text_kv, registers=inputs.registers, controls=inputs.controls)
    return self_rollout(graphdef, params, inputs.frames, inputs.observed, conditioning, noise, exits,
                        inputs.run_start, schedule=schedule, prediction=prediction, truncation=truncation,
                        finish=finish)


def make_dmd_step(
    generator_graphdef: Any,
    real_graphdef: Any,
    critic_graphdef: Any,
    config: DMDConfig,
    *,
    schedule: FewStepSchedule,
    generator_optimizer: Any,  # optax GradientTransformation
    critic_optimizer: Any,
    prediction: str = "flow",
    truncation: Truncation = Truncation(),
    finish: Callable[[jax.Array], jax.Array] | None = None,
    donate: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Callable[[DMDState, Any, DMDInputs, jax.Array], tuple[DMDState, dict[str, jax.Array]]]:
    """``step(state, real_params, inputs, key) -> (state, metrics)``: one DMD iteration, one jitted program.

    1. The generator rolls out (:func:`dmd_rollout` with ``dmd_keys(key).rollout``), once.
    2. On iterations ``state.step % generator_update_every == 0`` (a ``lax.cond``: the other
       iterations skip the backward), the generator takes one optimiser step on
       :func:`dmd_generator_loss` (real score guided by ``guidance_scale``, the critic by
       ``fake_guidance_scale``): its gradient is the rollout's VJP of ``d loss / d generated``,
       the chain rule written out, so it reaches the generator through the generated blocks only.
    3. The critic takes one step on :func:`critic_loss` over ``stop_gradient`` of the same
       generated blocks (before the generator's update).

    Observed blocks weigh 0 in both losses. ``metrics``: ``generator_loss`` and
    ``dmd_gradient_norm`` (0 where the generator did not update), ``generator_updated``,
    ``critic_loss``. The counter is traced: no recompilation across iterations. ``donate``
    donates ``state``'s buffers (not when the critic still shares arrays with ``real_params``);
    ``compiler_options`` go to ``jax.jit`` (e.g. ``{"xla_backend_optimization_level": 0}`` for
    quick CPU tests).
    """
    import optax

    def scores(inputs: DMDInputs, batch: int, n: int, f: int) -> tuple[Any, Any, Any]:
        common = dict(registers=inputs.registers, controls=inputs.controls,
                      frame_starts=rollout_frame_starts(batch, n, f, inputs.run_start),
                      num_train_timesteps=float(config.num_train_timesteps))
        real = causal_score_fn(real_graphdef, inputs.text, inputs.negative_text, config.guidance_scale, **common)
        fake = causal_score_fn(critic_graphdef, inputs.text, inputs.negative_text, config.fake_guidance_scale,
                               **common)
        plain = causal_score_fn(critic_graphdef, inputs.text, None, 0.0, **common)
        return real, fake, plain

    def step(state: DMDState, real_params: Any, inputs: DMDInputs, key: jax.Array
             ) -> tuple[DMDState, dict[str, jax.Array]]:
        keys = dmd_keys(key)
        batch, n = inputs.observed.shape
        real, fake, plain = scores(inputs, batch, n, inputs.frames.shape[2])
        weights = jnp.where(inputs.observed, 0.0, 1.0)
        real_params = jax.lax.stop_gradient(real_params)

        def generate(params: Any) -> jax.Array:
            return dmd_rollout(generator_graphdef, params, inputs, keys.rollout, schedule=schedule,
                               prediction=prediction, truncation=truncation, finish=finish).generated

        # One forward for both networks; the backward through the rollout runs on generator iterations only.
        generated, rollout_vjp = jax.vjp(generate, state.generator)

        def update_generator(operand: Any) -> Any:
            params, opt_state = operand

            def loss_fn(x: jax.Array) -> Any:
                return dmd_generator_loss(functools.partial(real, real_params), functools.partial(fake, state.critic),
                                          x, keys.generator, config, weights)

            (loss, metrics), loss_x = jax.value_and_grad(loss_fn, has_aux=True)(generated)
            (grads,) = rollout_vjp(loss_x)  # the chain rule: the generator's gradient comes through `generated` only
            updates, opt_state = generator_optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, metrics["dmd_gradient_norm"]

        def keep_generator(operand: Any) -> Any:
            zero = jnp.zeros((), jnp.float32)
            return operand + (zero, zero)

        updated = state.step % config.generator_update_every == 0
        generator, generator_opt, loss, norm = jax.lax.cond(
            updated, update_generator, keep_generator, (state.generator, state.generator_opt))
        generated = jax.lax.stop_gradient(generated)
        critic_value, critic_grads = jax.value_and_grad(
            lambda c: critic_loss(plain, c, generated, keys.critic, config, weights))(state.critic)
        updates, critic_opt = critic_optimizer.update(critic_grads, state.critic_opt, state.critic)
        critic = optax.apply_updates(state.critic, updates)
        metrics = {"generator_loss": loss, "dmd_gradient_norm": norm, "generator_updated": updated,
                   "critic_loss": critic_value}
        return DMDState(state.step + 1, generator, critic, generator_opt, critic_opt), metrics

    return jax.jit(step, donate_argnums=(0,) if donate else (), compiler_options=compiler_options)
