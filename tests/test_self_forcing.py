"""Self-Forcing's differentiable cached rollout: the engine's blocks, the right gradient, truncation, no recompiles.

* forward: with the engine's noise the rollout commits exactly the blocks the engine serves
  (the sprite world: observation prefill, one-step delta, cell decoder; the tiny world
  pipeline: a 4-step flow schedule, two-frame blocks, register tokens);
* gradient: equal to a central finite difference (the gradient-free forwards held at the
  same parameters) and to a dense recomputation that never touches the paged pools
  (``forward_blocks`` for the clean context, ``DenseAttention`` for each exit forward);
* truncation: exit steps reproducible from the key, shared or per block; ``gradient_frames``
  keeps exactly the last blocks' gradient;
* the training step compiles once.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld, sprite_world_clips
from ardiff_jax.models import (
    DenseAttention,
    DiTModules,
    FewStepSchedule,
    MaskedAttention,
    SpriteWorldPipeline,
    SpriteWorldPipelineConfig,
    WorldPipeline,
    WorldPipelineConfig,
    action_registers,
    block_causal_mask,
    clean_estimate,
    dit_preset,
    frames_to_latents,
    pretrained,
    snap_to_cells,
    tokenize_prompt,
)
from ardiff_jax.training import (
    RolloutConditioning,
    TrainConfig,
    Truncation,
    gradient_blocks,
    make_train_step,
    init_train_state,
    pipeline_noise,
    rollout_batch_loss,
    rollout_weights,
    sample_exit_steps,
    sample_training_batch,
    self_rollout,
    training_batch,
)
from ardiff_jax.training._objective import Objective
from helpers import count_compiles

ENGINE = EngineConfig(dtype="float32", available_memory_bytes=2**28, gpu_memory_fraction=1.0, warmup=False)
#: A small SpriteWorld-shaped transformer (16 x 16 frames): fast, and every sprite-specific path runs.
SPRITE = dit_preset("sprite-world-tiny")
ONE_STEP = FewStepSchedule((1000.0,))
DEFAULT_TRUNCATION = Truncation()


def _snap(latents):
    return snap_to_cells(latents, jnp)


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _text_kv(graphdef, params, config, rows, prompt=""):
    """A prompt's cross-attention K/V for ``rows`` rows, one jitted program (eagerly, every op of the text encoder
    compiled its own)."""
    modules = nnx.merge(graphdef, params)
    kv = modules.transformer.text_cross_kv(modules.text_encoder(jnp.asarray(tokenize_prompt(prompt, config.text_len))))
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (rows,) + a.shape), kv)


@pytest.fixture(scope="module")
def sprite_modules():
    return DiTModules.create(SPRITE, 3)


def test_sprite_rollout_commits_exactly_the_engines_blocks():
    """The shipped model (its outputs sit far from the cell decoder's decision boundaries, so the decoded
    frames compare exactly; a random network's near-ties could flip a cell on a 1e-7 difference)."""
    pipeline = pretrained("sprite_world", session_capacity=2)
    config = pipeline.config
    engine = ARDiffusionEngine(pipeline, ENGINE)
    observation = SpriteWorld(3).reset()
    actions = np.random.default_rng(0).integers(0, 5, 5)
    blocks = []
    for i, action in enumerate(actions):
        inputs = {"actions": [int(action)], **({"observation": observation} if i == 0 else {})}
        blocks.append(np.asarray(engine.generate(DiffusionRequest(f"r{i}", extra_args={"session_id": "s"},
                                                                  inputs=inputs)).latents))
    n = len(actions) + 1
    noise = pipeline_noise(pipeline._sessions["s"].key, 0, n - 1, 1, config.block_shape)
    noise = jnp.concatenate([jnp.zeros_like(noise[:1]), noise])[None]  # block 0 is the observed sink
    frames = jnp.zeros((1, n) + config.block_shape).at[0, 0].set(frames_to_latents(observation[None]))
    observed = jnp.arange(n)[None] == 0
    controls = jnp.asarray(action_registers(np.concatenate([[0], actions]), 5))[None, :, None]
    cond = RolloutConditioning(text_kv=_text_kv(pipeline._graphdef, pipeline._params, config, 1), controls=controls)
    out = self_rollout(pipeline._graphdef, pipeline._params, frames, observed, cond, noise, jnp.zeros(n, jnp.int32),
                       schedule=ONE_STEP, prediction="delta", finish=_snap)
    np.testing.assert_allclose(np.asarray(out.committed[0, 1:, 0]), np.concatenate(blocks), rtol=0, atol=1e-5)
    # The generated (differentiable) frames are the decoder's input: it snaps them to what is committed.
    np.testing.assert_allclose(np.asarray(_snap(out.generated[0, 1:])), np.asarray(out.committed[0, 1:]), atol=1e-6)


#: Blocks of the tiny world rollouts: past the 5-frame window with 2-frame blocks.
WORLD_BLOCKS = 5


@pytest.fixture(scope="module")
def tiny_world():
    """The tiny world pipeline and its 4-step schedule. The exit-step test rolls its weights out at the engine
    comparison's shapes, so both run one compiled rollout instead of compiling one each."""
    schedule = FewStepSchedule()
    return WorldPipeline(dit_preset("tiny"), WorldPipelineConfig(session_capacity=2, schedule=schedule)), schedule


def _world_rollout(tiny_world, frames, cond, noise, exit_steps):
    """``self_rollout`` of the tiny world pipeline's weights, nothing observed. Every argument committed to the
    device and the keywords spelled alike, so both world tests hit one compiled rollout (an uncommitted
    argument, or a keyword left to its default, is another cache entry: a second trace and compile)."""
    pipeline, schedule = tiny_world
    args = jax.device_put((frames, jnp.zeros(frames.shape[:2], bool), cond, noise, exit_steps), jax.devices()[0])
    return self_rollout(pipeline._graphdef, pipeline._params, *args, schedule=schedule, prediction="flow")


def test_world_rollout_matches_a_four_step_engine_session_with_registers(tiny_world):
    pipeline, schedule = tiny_world
    config = pipeline.config
    engine = ARDiffusionEngine(pipeline, ENGINE)
    n = WORLD_BLOCKS
    registers = np.random.default_rng(1).standard_normal((n, config.num_register_tokens, config.register_dim))
    blocks = [np.asarray(engine.generate(DiffusionRequest(
        f"r{i}", prompt="a red car" if i == 0 else None, extra_args={"session_id": "w"},
        inputs={"action": registers[i].astype(np.float32)})).latents) for i in range(n)]
    cond = RolloutConditioning(text_kv=_text_kv(pipeline._graphdef, pipeline._params, config, 1, "a red car"),
                               registers=jnp.asarray(registers, jnp.float32)[None])
    noise = pipeline_noise(pipeline._sessions["w"].key, 0, n, schedule.num_steps, config.block_shape)[None]
    last = jnp.full((n,), schedule.num_steps - 1, jnp.int32)  # exit at the last step: the whole schedule
    out = _world_rollout(tiny_world, jnp.zeros((1, n) + config.block_shape), cond, noise, last)
    np.testing.assert_allclose(np.asarray(out.committed[0]), np.stack(blocks), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.generated[0]), np.stack(blocks), rtol=0, atol=1e-5)


def _sprite_problem(modules, rows=2, n=5, seed=0):
    """A small rollout problem: row 0 contiguous from the sink, row 1 a context run placed at frame 40."""
    frames, actions = sprite_world_clips(seed, rows, n, size=24)
    latents = jnp.asarray(np.stack([frames_to_latents(f) for f in frames]))[:, :, None]
    controls = jnp.asarray(action_registers(actions, 5))[:, :, None]
    index = jnp.arange(n)[None]
    observed = (index == 0) | ((jnp.arange(rows)[:, None] == 1) & (index <= 2))
    run_start = jnp.asarray([1] + [40] * (rows - 1), jnp.int32)
    noise = jax.random.normal(jax.random.key(seed), (rows, n, 1) + SPRITE.block_shape)
    cond = RolloutConditioning(text_kv=_text_kv(*nnx.split(modules), SPRITE, rows), controls=controls)
    weights = jnp.where(observed, 0.0, 1.0)
    return latents, observed, cond, noise, run_start, weights


def _loss(generated, latents, weights, probe):
    return jnp.sum(jnp.sum(jnp.square(generated - latents) * probe, axis=(2, 3, 4, 5)) * weights)


@pytest.fixture(scope="module")
def sprite_gradient(sprite_modules):
    """The small sprite problem's paged loss, its value, gradient and committed blocks, compiled and run once.

    The finite-difference check, the dense recomputation and the gradient-frames check all use this one
    compiled value-and-gradient (each compiling its own copy of the rollout's backward pass cost most of their
    time): the context parameters and the block weights are arguments, so the finite difference evaluates
    shifted parameters against fixed context parameters and the gradient-frames check restricts the loss to
    the last blocks through the same program. The context parameters are passed explicitly (equal to
    ``params``: the Self-Forcing gradient); the default ``context_params=None`` is differentiated by the
    gradient-frames check here and by tests/test_self_forcing_models.py's dense recomputation."""
    graphdef, params = nnx.split(sprite_modules)
    # Committed, like the finite difference's shifted copies: a committed and an uncommitted argument would
    # compile the program twice.
    params = jax.device_put(params, jax.devices()[0])
    latents, observed, cond, noise, run_start, weights = problem = _sprite_problem(sprite_modules)
    probe = jax.random.uniform(jax.random.key(9), latents.shape[2:])
    n = observed.shape[1]

    def loss(p, context, block_weights, truncation=DEFAULT_TRUNCATION):
        out = self_rollout(graphdef, p, latents, observed, cond, noise, jnp.zeros(n, jnp.int32), run_start,
                           context, schedule=ONE_STEP, prediction="delta", truncation=truncation, finish=_snap)
        return _loss(out.generated, latents, block_weights, probe), out.committed

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, committed), grad = value_and_grad(params, params, weights)
    return types.SimpleNamespace(graphdef=graphdef, params=params, problem=problem, probe=probe, loss=loss,
                                 value_and_grad=value_and_grad, value=value, grad=grad, committed=committed)


def test_gradient_equals_a_central_finite_difference(sprite_gradient):
    params, grad = sprite_gradient.params, sprite_gradient.grad
    weights = sprite_gradient.problem[-1]
    # The direction and the shifts on the host (no program compiled for them); the shifted losses by the
    # fixture's compiled program (its gradient output unused).
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(2)
    direction = [rng.standard_normal(np.shape(leaf)).astype(leaf.dtype) for leaf in leaves]
    eps = 1e-3
    device = jax.devices()[0]

    def shifted_loss(sign):
        shifted = [np.asarray(leaf) + np.asarray(sign * eps, leaf.dtype) * d for leaf, d in zip(leaves, direction)]
        # The gradient-free forwards (commits) stay at `params`, as stop_gradient holds them.
        (value, _), _ = sprite_gradient.value_and_grad(jax.device_put(jax.tree.unflatten(treedef, shifted), device),
                                                       params, weights)
        return float(value)

    fd = (shifted_loss(1) - shifted_loss(-1)) / (2 * eps)
    analytic = sum(float(np.vdot(np.asarray(g), d)) for g, d in zip(jax.tree.leaves(grad), direction, strict=True))
    assert abs(analytic) > 1e-3
    np.testing.assert_allclose(fd, analytic, rtol=2e-2)


def test_gradient_equals_a_dense_block_causal_recomputation(sprite_gradient):
    """The same loss computed without pools: clean context by ``forward_blocks``, each exit forward dense."""
    graphdef, params = sprite_gradient.graphdef, sprite_gradient.params
    latents, observed, cond, noise, run_start, weights = sprite_gradient.problem
    probe = sprite_gradient.probe
    rows, n = observed.shape
    committed = sprite_gradient.committed  # [rows, n, 1, C, H, W], constants
    positions = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), run_start[:, None] + jnp.arange(n - 1)[None]], 1)

    tokens = SPRITE.tokens_per_frame

    def dense_row(modules, frozen, r):
        """Row ``r``'s loss: its clean context in one masked ``forward_blocks`` pass, then every generated
        block's exit forward against the dense K/V it may see (vmapped over the blocks: one forward traced
        and compiled, not ``n - 1``)."""
        text_kv = jax.tree.map(lambda a: a[r], cond.text_kv)
        clean = frozen.transformer.forward_blocks(
            committed[r], jnp.zeros(n), positions[r], text_kv, controls=cond.controls[r],
            attention=MaskedAttention(block_causal_mask(SPRITE, positions[r], jnp.ones(n, bool))))
        # Which clean frames block i's forward sees: the mask's row for a noisy copy of block i.
        starts = jnp.concatenate([positions[r], positions[r]])
        full = block_causal_mask(SPRITE, starts, jnp.arange(2 * n) < n)

        def block_loss(i):
            visible = full[(n + i) * tokens, :n * tokens] & (jnp.arange(n * tokens) < i * tokens)
            attention = DenseAttention(k=clean.k, v=clean.v, mask=visible)
            y = modules.transformer(noise[r, i, 0], jnp.float32(1000.0), positions[r, i], text_kv,
                                    controls=cond.controls[r, i], attention=attention)
            x0 = clean_estimate(y.video, noise[r, i, 0], jnp.float32(1.0), committed[r, i - 1, -1], "delta")
            return weights[r, i] * jnp.sum(jnp.square(x0 - latents[r, i]) * probe)

        return jnp.sum(jax.vmap(block_loss)(jnp.arange(1, n)))

    def dense(p):
        modules = nnx.merge(graphdef, p)
        frozen = nnx.merge(graphdef, jax.lax.stop_gradient(p))
        # vmapped over the rows: one row's forwards traced and compiled, not one copy per row.
        return jnp.sum(jax.vmap(lambda r: dense_row(modules, frozen, r))(jnp.arange(rows)))

    dense_value, dense_grad = jax.jit(jax.value_and_grad(dense))(params)
    paged_value, paged_grad = sprite_gradient.value, sprite_gradient.grad
    np.testing.assert_allclose(float(dense_value), float(paged_value), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(dense_grad), jax.tree.leaves(paged_grad)):
        # float32 summation order differs (dense softmax vs paged): relative to each leaf's scale.
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_exit_steps_are_reproducible_from_the_key_shared_or_per_block():
    key = jax.random.key(7)
    shared = sample_exit_steps(key, 12, 4, per_block=False)
    assert np.all(np.asarray(shared) == np.asarray(shared)[0])
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(sample_exit_steps(key, 12, 4, per_block=False)))
    per_block = np.asarray(sample_exit_steps(key, 64, 4, per_block=True))
    np.testing.assert_array_equal(per_block, np.asarray(sample_exit_steps(key, 64, 4, per_block=True)))
    assert set(per_block.tolist()) == {0, 1, 2, 3}
    draws = {int(sample_exit_steps(jax.random.key(s), 3, 4, per_block=False)[0]) for s in range(40)}
    assert draws == {0, 1, 2, 3}
    np.testing.assert_array_equal(np.asarray(Truncation(per_block_exit=True).exit_steps(key, 64, 4)), per_block)
    assert np.asarray(Truncation(last_step_only=True).exit_steps(key, 5, 4)).tolist() == [3] * 5


def test_exit_step_chooses_which_step_carries_the_gradient(tiny_world):
    """With the exit at step s the output is step s's clean estimate; later steps do not run."""
    pipeline, schedule = tiny_world
    config = pipeline.config
    graphdef, params = pipeline._graphdef, pipeline._params
    n = WORLD_BLOCKS
    noise = jax.random.normal(jax.random.key(0), (1, n, schedule.num_steps) + config.block_shape)
    cond = RolloutConditioning(text_kv=_text_kv(graphdef, params, config, 1),
                               registers=jnp.zeros((1, n, config.num_register_tokens, config.register_dim)))
    frames = jnp.zeros((1, n) + config.block_shape)
    outs = [_world_rollout(tiny_world, frames, cond, noise, jnp.full((n,), e, jnp.int32))
            for e in range(schedule.num_steps)]
    # Block 0's exit input at step 0 is its initial noise; at a later exit it has been denoised.
    np.testing.assert_array_equal(np.asarray(outs[0].exit_input[0, 0]), np.asarray(noise[0, 0, 0]))
    assert all(float(jnp.abs(o.generated[0, 0] - outs[0].generated[0, 0]).max()) > 1e-4 for o in outs[1:])


def test_gradient_frames_keeps_only_the_last_blocks_gradient(sprite_gradient):
    params = sprite_gradient.params
    weights = sprite_gradient.problem[-1]
    n = weights.shape[1]
    assert gradient_blocks(6, 1, 2).tolist() == [False] * 4 + [True] * 2
    # Row 0 generates blocks 1..n-1 (the first n-3 of them weighted but truncated), row 1 after its context run.
    assert gradient_blocks(n, 1, 2).tolist() == [False] * (n - 2) + [True] * 2

    # Truncated and without remat, the context parameters left to their default (None: `params`), jitted
    # (the truncation static): eagerly every scan of the rollout and of its backward pass was traced and
    # compiled op by op.
    truncated = jax.jit(jax.grad(lambda p, w: sprite_gradient.loss(
        p, None, w, Truncation(gradient_frames=2, remat=False))[0]))(params, weights)
    # With remat and without truncation, the loss restricted to the last two blocks (the fixture's compiled
    # program): the same gradient.
    _, last_two = sprite_gradient.value_and_grad(params, params, weights * (jnp.arange(n) >= n - 2))
    for a, b in zip(jax.tree.leaves(truncated), jax.tree.leaves(last_two), strict=True):
        b = np.asarray(b)  # host-side: no abs/max program compiled per leaf shape
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def test_rollout_weights_observe_the_sink_and_a_gapped_sequences_context():
    batch = sample_training_batch(1, 0, 8, 6, 20, size=24)
    weights = rollout_weights(batch, 2)
    contiguous = batch.positions[:, 1] == 1
    assert np.all(weights[:, 0] == 0)
    assert np.all(weights[contiguous, 1:] > 0)
    assert np.all(weights[~contiguous, 1:3] == 0) and np.all(weights[~contiguous, 3:] > 0)


def test_self_rollout_training_step_compiles_once():
    config = TrainConfig(preset="sprite-world-tiny", self_rollout=True, batch_size=2, sequence_frames=5, steps=6,
                         max_gap=8, max_sink_distance=64, learning_rate=3e-3, warmup_steps=0, seed=2)
    graphdef, state = init_train_state(config)
    step = make_train_step(config, graphdef)
    state, first = step(state, training_batch(config, 0))
    with count_compiles() as compiled:
        for s in range(1, 4):
            state, loss = step(state, training_batch(config, s))
            float(loss)
    assert not compiled, compiled
    assert np.isfinite(float(first))


def test_the_fine_tune_snippet_in_docs_training_runs():
    """docs/training.md's "Fine-tune your own causal model" block, verbatim."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "training.md").read_text()
    block = re.search(r"## Fine-tune your own causal model\n\n```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "docs/training.md", "exec"), scope)
    assert np.isfinite(float(scope["value"]))
