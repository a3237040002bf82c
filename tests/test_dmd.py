"""Distribution matching (DMD): where the gradients go, what each loss trains, and a toy where both losses fall.

* the generator's gradient is the chain rule through the generated blocks only: the step's
  gradient equals ``vjp(rollout, d loss / d generated)`` computed separately, and the DMD
  loss has no gradient with respect to either score's parameters;
* the critic trains on ``stop_gradient`` of the generated blocks: its loss has no gradient
  with respect to them, its update changes the critic and nothing else;
* the teacher-forced score sees what cached inference sees (equal to the rollout's forwards);
* toys: critic steps lower the critic loss, a generator step lowers the DMD objective of the
  same key; with Gaussian scores the iteration carries the generator to the teacher's mean;
* equal scores give a zero generator gradient; the step compiles once.

Tiny, float32, one compiled program per role, built once (module fixtures); XLA at its
lowest optimisation level, which changes how fast the programs compile, not what they compute.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ardiff_jax.models import DiTModules, FewStepSchedule, dit_preset, tokenize_prompt
from ardiff_jax.training._dmd import (
    DMDConfig,
    DMDInputs,
    causal_score_fn,
    critic_loss,
    dmd_generator_loss,
    dmd_keys,
    dmd_optimizer,
    dmd_rollout,
    init_dmd_state,
    make_dmd_step,
    rollout_frame_starts,
)
from ardiff_jax.training._self_forcing import rollout_noise
from helpers import count_compiles

CONFIG = dit_preset("tiny")  # 2 layers of width 32, 8x8x4 latents, two-frame blocks, 3 register tokens
SCHEDULE = FewStepSchedule((1000.0,))  # one step: the exit step carries the gradient (multi-step: test_self_forcing)
DMD = DMDConfig(generator_update_every=2)  # guidance 3, shift 5, timesteps clamped to [20, 980]
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
ROWS, BLOCKS = 2, 3


def _key(seed: int) -> jax.Array:
    """XLA's RngBitGenerator keys: the programs that draw from them compile several times faster than threefry's."""
    return jax.random.key(seed, impl="rbg")


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST)


class Recorded(NamedTuple):
    learning_rate: jax.Array
    gradient: Any


def recording_sgd(learning_rate: float) -> optax.GradientTransformation:
    """SGD whose state keeps the gradient it was given (and its learning rate, settable without recompiling)."""

    def init(params):
        # numpy zeros put on the device: no eager zeros_like program to compile per parameter shape.
        zeros = jax.tree.map(lambda a: jnp.asarray(np.zeros(a.shape, a.dtype)), params)
        return Recorded(jnp.float32(learning_rate), zeros)

    def update(grads, state, params=None):
        del params
        return jax.tree.map(lambda g: -state.learning_rate * g, grads), Recorded(state.learning_rate, grads)

    return optax.GradientTransformation(init, update)


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(a)) for a in _leaves(tree))))


def _weights(inputs):
    return jnp.where(inputs.observed, 0.0, 1.0)


class Parts(NamedTuple):
    graphdef: Any
    generator: Any
    real: Any
    inputs: DMDInputs
    step: Any
    # (params, inputs, key, cotangent) -> (generated, the rollout's VJP at cotangent, the generator as a
    # teacher-forced score of its own rollout: x0 of each block from its initial noise at t = 1000)
    rollout: Any
    # (generated, real, critic, inputs, generator key, critic key) ->
    #   ((DMD loss, its gradients w.r.t. generated, real, critic), (critic loss, its gradient w.r.t. generated))
    losses: Any


def _scores(graphdef, inputs):
    common = dict(registers=inputs.registers, frame_starts=rollout_frame_starts(ROWS, BLOCKS, CONFIG.frames_per_block))
    real = causal_score_fn(graphdef, inputs.text, inputs.negative_text, DMD.guidance_scale, **common)
    fake = causal_score_fn(graphdef, inputs.text, inputs.negative_text, DMD.fake_guidance_scale, **common)
    plain = causal_score_fn(graphdef, inputs.text, **common)
    return real, fake, plain


@pytest.fixture(scope="module")
def parts() -> Parts:
    graphdef, generator = nnx.split(DiTModules.create(CONFIG, 0))
    # The teacher: a fixed network, the generator's weights moved by a seeded perturbation (numpy: nothing to compile).
    rng = np.random.default_rng(5)
    real = jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + 0.2 * np.asarray(a).std() * rng.standard_normal(a.shape),
                                              np.float32), generator)
    table = np.asarray(generator["text_encoder"]["table"])  # the byte encoder, in numpy

    def encode(prompt):
        ids = tokenize_prompt(prompt, CONFIG.text_len)
        return table[ids] * (ids > 0)[:, None]

    inputs = DMDInputs(
        text=jnp.asarray(np.stack([encode("a red car"), encode("a blue boat")])),
        negative_text=jnp.asarray(np.stack([encode("")] * ROWS)),
        frames=jnp.asarray(rng.standard_normal((ROWS, BLOCKS) + CONFIG.block_shape), jnp.float32),
        observed=jnp.asarray([[False] * BLOCKS, [True] + [False] * (BLOCKS - 1)]),  # row 1 observes its sink block
        registers=jnp.asarray(rng.standard_normal((ROWS, BLOCKS, CONFIG.num_register_tokens, CONFIG.register_dim)),
                              jnp.float32))
    step = make_dmd_step(graphdef, graphdef, graphdef, DMD, schedule=SCHEDULE, generator_optimizer=recording_sgd(1e-2),
                         critic_optimizer=recording_sgd(1e-2), compiler_options=FAST)

    def rollout(params, inputs, key, cotangent):
        generated, vjp = jax.vjp(lambda p: dmd_rollout(graphdef, p, inputs, key, schedule=SCHEDULE).generated, params)
        # dmd_rollout's noise: the second half of its key (see its source); block i's initial noise is step 0's.
        noise = rollout_noise(jax.random.split(key)[1], ROWS, BLOCKS, 1, CONFIG.block_shape)[:, :, 0]
        score = causal_score_fn(graphdef, inputs.text, registers=inputs.registers)
        x0 = score(params, noise, jnp.full((ROWS, BLOCKS), 1000.0), generated)
        return generated, vjp(cotangent)[0], x0

    def losses(generated, real_params, critic_params, inputs, key_generator, key_critic):
        real_fn, fake_fn, plain = _scores(graphdef, inputs)
        weights = _weights(inputs)
        generator = jax.value_and_grad(
            lambda x, r, c: dmd_generator_loss(functools.partial(real_fn, r), functools.partial(fake_fn, c), x,
                                               key_generator, DMD, weights)[0],
            argnums=(0, 1, 2))(generated, real_params, critic_params)
        critic = jax.value_and_grad(lambda x: critic_loss(plain, critic_params, x, key_critic, DMD, weights))(generated)
        return generator, critic

    return Parts(graphdef, generator, real, inputs, step, _jit(rollout), _jit(losses))


@pytest.fixture(scope="module")
def first_step(parts):
    """Iteration 0 (generator and critic update). The critic starts half way from the teacher to the generator
    (as if it had begun to fit the generator's samples), so that the two scores differ."""
    critic = jax.tree.map(lambda r, g: jnp.asarray(np.asarray(r) + 0.5 * (np.asarray(g) - np.asarray(r))),
                          parts.real, parts.generator)
    state = init_dmd_state(parts.generator, critic, recording_sgd(1e-2), recording_sgd(1e-2))
    key = _key(11)
    after, metrics = parts.step(state, parts.real, parts.inputs, key)
    return state, after, metrics, key


def _rollout(parts, params, key, cotangent=None):
    if cotangent is None:
        cotangent = jnp.zeros((ROWS, BLOCKS) + CONFIG.block_shape, jnp.float32)
    return parts.rollout(params, parts.inputs, dmd_keys(key).rollout, cotangent)


def _losses(parts, generated, critic, key, inputs=None, real=None):
    keys = dmd_keys(key)
    return parts.losses(generated, parts.real if real is None else real, critic,
                        parts.inputs if inputs is None else inputs, keys.generator, keys.critic)


def test_config_is_validated_and_frame_starts_follow_the_rollout():
    assert DMDConfig().guidance_scale == 3.0 and DMDConfig().generator_update_every == 5
    for bad in (dict(guidance_scale=-1.0), dict(guidance_scale=float("nan")), dict(timestep_shift=0.5),
                dict(min_timestep=0), dict(min_timestep=500, max_timestep=400), dict(max_timestep=1001),
                dict(min_score_timestep=1000), dict(generator_update_every=0), dict(per_block_timestep=1),
                dict(guidance_scale=True)):
        with pytest.raises(ValueError):
            DMDConfig(**bad)
    # Block 1 of a row with a run start sits there (only the sink before it), later blocks follow it.
    np.testing.assert_array_equal(np.asarray(rollout_frame_starts(2, 3, 2)), [[0, 2, 4], [0, 2, 4]])
    np.testing.assert_array_equal(np.asarray(rollout_frame_starts(2, 3, 1, np.array([1, 40]))),
                                  [[0, 1, 2], [0, 40, 41]])


def test_generator_gradient_is_the_chain_rule_through_the_generated_frames_only(parts, first_step):
    state, after, metrics, key = first_step
    assert bool(metrics["generator_updated"])
    generated = _rollout(parts, state.generator, key)[0]
    (loss, (loss_x, loss_real, loss_critic)), _ = _losses(parts, generated, state.critic, key)
    np.testing.assert_allclose(float(metrics["generator_loss"]), float(loss), rtol=1e-5)
    # The scores' parameters get no gradient at all from the generator's loss.
    assert all(np.all(a == 0) for a in _leaves(loss_real) + _leaves(loss_critic))
    # Observed blocks (row 1, block 0) get none either.
    assert np.all(np.asarray(loss_x[1, 0]) == 0) and float(jnp.abs(loss_x[1, 1:]).max()) > 0
    chain = _rollout(parts, state.generator, key, loss_x)[1]
    assert _norm(chain) > 0
    for got, want in zip(_leaves(after.generator_opt.gradient), _leaves(chain)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * _norm(chain))
    # ... and the update is that gradient's step (the critic's loss added nothing to it).
    for new, old, g in zip(_leaves(after.generator), _leaves(state.generator), _leaves(chain)):
        np.testing.assert_allclose(new, old - 1e-2 * g, rtol=1e-5, atol=1e-7)


def test_critic_trains_on_the_generated_frames_and_changes_only_the_critic(parts, first_step):
    state, after, metrics, key = first_step
    generated = _rollout(parts, state.generator, key)[0]
    # Iteration 0: the critic's loss is taken on what the generator generated (before its own update) ...
    _, (value, value_x) = _losses(parts, generated, state.critic, key)
    np.testing.assert_allclose(float(metrics["critic_loss"]), float(value), rtol=1e-5)
    assert np.all(np.asarray(value_x) == 0)  # ... and sends no gradient into the generated frames
    # The step lowered the critic's loss on those same frames and noise.
    assert float(_losses(parts, generated, after.critic, key)[1][0]) < float(value)
    # Iteration 1 updates the critic only: the generator and its optimiser state stay bit for bit.
    key = _key(12)
    later, metrics = parts.step(after, parts.real, parts.inputs, key)
    assert not bool(metrics["generator_updated"]) and float(metrics["generator_loss"]) == 0.0
    for a, b in zip(_leaves((later.generator, later.generator_opt)), _leaves((after.generator, after.generator_opt))):
        np.testing.assert_array_equal(a, b)
    generated = _rollout(parts, after.generator, key)[0]
    np.testing.assert_allclose(float(metrics["critic_loss"]), float(_losses(parts, generated, after.critic, key)[1][0]),
                               rtol=1e-5)
    moved = [not np.array_equal(a, b) for a, b in zip(_leaves(later.critic), _leaves(after.critic))]
    assert sum(moved) > len(moved) // 2


def test_the_teacher_forced_score_sees_what_cached_inference_sees(parts):
    """With one step at t = 1000, the rollout's block i is the generator's clean estimate from its initial noise
    with the committed blocks before it cached: the score, fed that noise and those blocks, gives the same."""
    generated, _, x0 = _rollout(parts, parts.generator, _key(3))
    generated_blocks = ~np.asarray(parts.inputs.observed)
    np.testing.assert_allclose(np.asarray(x0)[generated_blocks], np.asarray(generated)[generated_blocks],
                               rtol=0, atol=1e-4)


def test_toy_one_step_of_each_lowers_both_losses(parts, first_step):
    state, _, _, _ = first_step
    # The critic: a few small steps (critic-only iterations, the same key: the same generated frames and noise)
    # lower its loss.
    key = _key(21)
    slow = state.critic_opt._replace(learning_rate=jnp.float32(3e-3))
    critic_state = state._replace(step=jnp.int32(1), critic_opt=slow)
    losses = []
    for _ in range(4):
        stepped, metrics = parts.step(critic_state, parts.real, parts.inputs, key)
        losses.append(float(metrics["critic_loss"]))
        critic_state = stepped._replace(step=jnp.int32(1))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # The generator: one step moves its outputs towards the target the scores set, x - grad (same key: same
    # rollout noise, score timestep and noise), so the DMD objective against that target falls.
    critic = critic_state.critic
    key = _key(22)
    state = state._replace(critic=critic, generator_opt=state.generator_opt._replace(learning_rate=jnp.float32(1e-3)))
    after, metrics = parts.step(state, parts.real, parts.inputs, key)
    before_x = np.asarray(_rollout(parts, state.generator, key)[0])
    after_x = np.asarray(_rollout(parts, after.generator, key)[0])
    (loss, (loss_x, _, _)), _ = _losses(parts, jnp.asarray(before_x), critic, key)
    weights = np.asarray(_weights(parts.inputs))
    per_element = weights.sum() * np.prod(before_x.shape[2:])  # d loss / d x = (x - target) w / (sum w * block size)
    target = before_x - np.where(weights[:, :, None, None, None, None] > 0, np.asarray(loss_x) * per_element, 0.0)

    def objective(x):
        err = np.square(x - target).mean(axis=(2, 3, 4, 5))
        return 0.5 * float((err * weights).sum() / weights.sum())

    np.testing.assert_allclose(objective(before_x), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["generator_loss"]), float(loss), rtol=1e-5)
    assert float(np.abs(after_x - before_x).max()) > 1e-6
    assert objective(after_x) < objective(before_x)


def _gaussian_score(mean: jax.Array, spread: float):
    """The exact denoiser of N(mean, spread^2 I): E[x0 | x_t] for x_t = (1 - s) x0 + s eps."""

    def score(x_t, timesteps, clean):
        del clean
        s = (timesteps / 1000.0)[:, :, None, None, None, None]
        gain = (1 - s) * spread**2 / ((1 - s) ** 2 * spread**2 + s**2)
        return mean + gain * (x_t - (1 - s) * mean)

    return score


@pytest.mark.parametrize("normalize", [True, False])
def test_toy_gaussians_the_iteration_carries_the_generator_to_the_teachers_distribution(normalize):
    """Exact scores of two Gaussians: the DMD gradient pushes every sample from the generator's mean towards the
    teacher's; generator steps, the ideal critic refitted to the generator's samples after each, close the gap.
    Unnormalised the DMD loss falls with it; normalised (DMD eq. 8, the default) it is about 0.5 whatever the
    gap: the normaliser scales the gradient to the sample's own distance from the teacher's estimate."""
    config = DMDConfig(guidance_scale=0.0, normalize=normalize)
    teacher = _gaussian_score(jnp.float32(2.0), 1.0)
    samples = jax.random.normal(_key(0), (4, 2, 1, 2, 4, 4))  # the generator: N(offset, 1)

    @jax.jit
    def iteration(offset):
        x = samples + offset
        critic_mean = jnp.mean(x)  # the ideal critic: the generator's own distribution
        loss, grad = jax.value_and_grad(
            lambda x: dmd_generator_loss(teacher, _gaussian_score(critic_mean, 1.0), x, _key(1), config)[0])(x)
        # The generator's one parameter is its mean: d loss / d offset = sum(d loss / d x).
        return offset - 0.5 * jnp.sum(grad), jnp.abs(2.0 - critic_mean), loss, jnp.min(-grad)

    offset, gaps, losses = jnp.float32(-1.0), [], []
    for _ in range(6):
        offset, gap, loss, push = iteration(offset)
        assert float(push) > 0  # every element is pushed up, towards the teacher's mean
        gaps.append(float(gap))
        losses.append(float(loss))
    assert all(b < a for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 0.5 * gaps[0], gaps
    if not normalize:
        assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_equal_scores_give_zero_generator_gradient(parts, first_step):
    state, after, _, key = first_step
    # The critic is the teacher and guidance has nothing to amplify (the negative prompt is the prompt).
    same = parts.inputs._replace(negative_text=parts.inputs.text)
    generated = _rollout(parts, state.generator, key)[0]
    (loss, (loss_x, _, _)), _ = _losses(parts, generated, parts.real, key, inputs=same)
    # Zero up to float32 rounding: the two scores run as separate programs (XLA may fuse them differently), so
    # their difference is a few ulps of the O(1) scores, far below one ulp of the frames (1.2e-7).
    assert float(loss) < 1e-10 and float(jnp.abs(loss_x).max()) < 1e-8
    stepped, metrics = parts.step(state._replace(critic=parts.real), parts.real, same, key)
    assert bool(metrics["generator_updated"]) and float(metrics["dmd_gradient_norm"]) < 1e-5
    assert _norm(stepped.generator_opt.gradient) < 1e-5 * _norm(after.generator_opt.gradient)


def test_the_dmd_step_compiles_once(parts, first_step):
    _, state, _, _ = first_step
    keys = [_key(30 + i) for i in range(4)]
    with count_compiles() as compiled:
        for key in keys:  # iterations 1-4: critic only, both, critic only, both
            state, metrics = parts.step(state, parts.real, parts.inputs, key)
            float(metrics["critic_loss"])
    assert not compiled, compiled
    assert int(state.step) == 5 and np.isfinite(float(metrics["generator_loss"]))


def test_the_release_optimiser_leaves_the_unused_text_encoder_alone(parts):
    """AdamW's weight decay would shrink the stand-in text encoder the step never runs; it is frozen instead."""
    optimizer = dmd_optimizer(1e-2)
    ones = jax.tree.map(jnp.ones_like, parts.generator)
    updates, _ = _jit(optimizer.update)(ones, optimizer.init(parts.generator), parts.generator)
    assert np.all(np.asarray(updates["text_encoder"]["table"][...]) == 0)
    assert np.all(np.asarray(updates["transformer"]["head"]["kernel"][...]) != 0)
