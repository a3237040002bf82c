"""Self-Forcing: a differentiable cached rollout, rolled out exactly as the engine serves (pure, jittable).

Teacher forcing trains each frame from the *true* previous frames; at inference the model
sees its own. Self-Forcing (Huang et al., 2025) trains through the model's own
autoregressive rollout instead: every block is denoised from noise over the few-step
schedule with the model's own committed blocks in the KV cache, then committed by a clean
``t = 0`` forward, and the loss is put on what was generated.

:func:`self_rollout` is that rollout as one ``lax.scan`` over blocks on the runtime's own
paged pools: the sink + ring layout, the visible-window rule, the batched view, the
deferred in-place block write and the cursor advance are those of
:func:`ardiff_jax.rollout.scan_batched_blocks`, the engine's device-side rollout, so what
trains is what serves (a test compares it with the engine's blocks to 1e-5).

Gradient truncation follows Self-Forcing's training pipeline
(``pipeline/self_forcing_training.py`` of ``guandeh17/Self-Forcing``, read at commit
``33593df3e81fa3ec10239271dd2c100facac6de1``): each block stops at a
random *exit step* of the schedule (one for every block, or one per block); the denoise
steps before it run without gradient (``stop_gradient`` on the parameters), the exit step's
forward carries the gradient and its clean estimate is the block's output; the commit pass
carries none. ``Truncation.gradient_frames`` keeps the gradient of the last ``N`` generated
frames only (the release's ``start_gradient_frame_index``), and ``Truncation.remat``
recomputes each block's forward in the backward pass (``jax.checkpoint``), so activation
memory is one block's, not the rollout's.

Observed blocks (``observed[b, i]``) are committed from the given frames instead of being
generated, as the engine's observation prefill does: a sink frame, or a true context run
placed far from the sink (``run_start``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checks import check_flag, check_non_negative_int
from ardiff_jax.kv import KVLayout, allocate_pools, contiguous_table_cursor
from ardiff_jax.models import (
    ActionInputs,
    FewStepSchedule,
    clean_estimate,
    commit_action_cache,
    init_action_cache,
    noise_key,
)
from ardiff_jax.rollout import scan_batched_blocks

__all__ = ["Truncation", "RolloutConditioning", "RolloutBlocks", "sample_exit_steps", "self_rollout",
           "rollout_layout", "pipeline_noise", "rollout_noise", "gradient_blocks", "ground_truth_loss"]


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Which forwards of a rollout carry gradient (hashable: a static argument).

    Attributes:
      per_block_exit: ``False`` (Self-Forcing's default ``same_step_across_blocks``): one exit
        step for every block of a rollout; ``True``: one per block.
      gradient_frames: ``0``: every generated block carries gradient; ``N > 0``: only the
        blocks whose frames lie among the last ``N`` frames of the rollout (earlier ones run
        as in inference, under ``stop_gradient``).
      remat: recompute each block's forwards in the backward pass instead of storing their
        activations (``jax.checkpoint`` around the block).
      last_step_only: always exit at the schedule's last step (the release's
        ``last_step_only``): the whole schedule runs and its final estimate carries gradient.
    """

    per_block_exit: bool = False
    gradient_frames: int = 0
    remat: bool = True
    last_step_only: bool = False

    def __post_init__(self) -> None:
        check_flag("Truncation per_block_exit", self.per_block_exit)
        check_non_negative_int("Truncation gradient_frames", self.gradient_frames)
        check_flag("Truncation remat", self.remat)
        check_flag("Truncation last_step_only", self.last_step_only)

    def exit_steps(self, key: jax.Array, num_blocks: int, num_steps: int) -> jax.Array:
        """``i32[num_blocks]``: the exit step of each block under these options (a pure function of ``key``)."""
        if self.last_step_only:
            return jnp.full((num_blocks,), num_steps - 1, jnp.int32)
        return sample_exit_steps(key, num_blocks, num_steps, self.per_block_exit)


class RolloutConditioning(NamedTuple):
    """What conditions each row's blocks (every field but ``text_kv`` optional).

    Attributes:
      text_kv: ``([B, L, N, H, D], [B, L, N, H, D])`` each row's cross-attention K/V.
      image_kv: the same for image tokens (Wan I2V), or ``None``.
      controls: ``f32[B, n, f, control_dim]`` per-frame controls, or ``None``.
      registers: ``f32[B, n, E, register_dim]`` register features per block, or ``None``.
      condition: ``f32[B, n, f, extra, H, W]`` I2V channels (Matrix-Game), or ``None``.
      actions: :class:`~ardiff_jax.models.ActionInputs` with leading ``[B, n]`` (action modules), or ``None``.
    """

    text_kv: tuple[jax.Array, jax.Array]
    image_kv: tuple[jax.Array, jax.Array] | None = None
    controls: jax.Array | None = None
    registers: jax.Array | None = None
    condition: jax.Array | None = None
    actions: ActionInputs | None = None


class RolloutBlocks(NamedTuple):
    """A rollout's blocks, ``[B, n, f, C, H, W]`` each.

    Attributes:
      generated: the exit step's clean estimate of every block (observed blocks: the given
        frames). Differentiable: the loss goes here.
      committed: what each block committed (observed frames, or ``finish`` of the
        generated estimate); no gradient. What the engine returns as the block.
      exit_input: the noisy input of each block's exit step (what a critic or a dense
        recomputation needs); no gradient.
      exit_steps: ``i32[n]`` the exit step of each block.
    """

    generated: jax.Array
    committed: jax.Array
    exit_input: jax.Array
    exit_steps: jax.Array


def sample_exit_steps(key: jax.Array, num_blocks: int, num_steps: int, per_block: bool) -> jax.Array:
    """``i32[num_blocks]``: each block's exit step, uniform in ``[0, num_steps)`` (a pure function of ``key``).

    Shared (``per_block=False``): one draw repeated for every block, as Self-Forcing's
    ``same_step_across_blocks``.
    """
    if per_block:
        return jax.random.randint(key, (num_blocks,), 0, num_steps, jnp.int32)
    return jnp.full((num_blocks,), jax.random.randint(key, (), 0, num_steps, jnp.int32))


def gradient_blocks(num_blocks: int, frames_per_block: int, gradient_frames: int) -> np.ndarray:
    """``bool[num_blocks]``: which blocks carry gradient under :attr:`Truncation.gradient_frames`."""
    if gradient_frames == 0:
        return np.ones(num_blocks, bool)
    first_frame = np.arange(num_blocks) * frames_per_block
    return first_frame >= num_blocks * frames_per_block - gradient_frames


def rollout_layout(config: Any, batch: int) -> KVLayout:
    """The paged layout of a ``batch``-row rollout of a ``CausalDiTConfig``: one sink + ring run per row."""
    f, tokens = config.frames_per_block, config.tokens_per_frame
    extra = -(-config.num_register_tokens // tokens) if config.num_register_tokens else 0
    return KVLayout(num_layers=config.num_layers, num_pages=batch * (config.sink_frames + config.window_frames),
                    tokens_per_frame=tokens, num_kv_heads=config.num_heads, head_size=config.head_dim,
                    sink_frames=config.sink_frames, window_frames=config.window_frames, frames_per_block=f,
                    scratch_pages=f + extra, dtype=config.dtype, storage_dtype=config.dtype)


def pipeline_noise(session_key: jax.Array, first_block: int, num_blocks: int, num_steps: int,
                   block_shape: tuple[int, ...]) -> jax.Array:
    """``f32[num_blocks, num_steps, *block_shape]``: the noise a world pipeline session draws for these blocks.

    Index ``[i, 0]`` is block ``first_block + i``'s initial noise, ``[i, s]`` the re-noise
    after step ``s - 1``: the key tree of :func:`~ardiff_jax.models.noise_key`, so a
    rollout fed this noise reproduces the engine's blocks.
    """
    # One draw per key, as the pipeline draws them: "rbg" keys give other numbers under vmap.
    return jnp.stack([jnp.stack([jax.random.normal(noise_key(session_key, jnp.int32(b), s), block_shape, jnp.float32)
                                 for s in range(num_steps)])
                      for b in range(first_block, first_block + num_blocks)])


def _tree_rows(tree: Any, index: int) -> Any:
    return jax.tree.map(lambda a: a[:, index], tree)


@functools.partial(jax.jit, static_argnames=("graphdef", "schedule", "prediction", "truncation", "finish"))
def self_rollout(
    graphdef: Any,  # nnx graphdef of DiTModules (or any module with a .transformer CausalDiT)
    params: Any,  # its parameters: the rollout is differentiable with respect to them
    frames: jax.Array,  # f32[B, n, f, C, H, W]: the observed blocks' latents (ignored where not observed)
    observed: jax.Array,  # bool[B, n]: block i of row b is committed from `frames` instead of generated
    conditioning: RolloutConditioning,
    noise: jax.Array,  # f32[B, n, S, f, C, H, W]: initial noise (step 0) and re-noise after each step
    exit_steps: jax.Array,  # i32[n]: each block's exit step (sample_exit_steps)
    run_start: jax.Array | None = None,  # i32[B]: frame index of block 1 (block 0 fills the sink)
    context_params: Any = None,  # parameters of the gradient-free forwards; None: `params`
    *,
    schedule: FewStepSchedule,
    prediction: str = "flow",
    truncation: Truncation = Truncation(),
    finish: Callable[[jax.Array], jax.Array] | None = None,
) -> RolloutBlocks:
    """Roll ``B`` sessions out for ``n`` blocks, each block as the engine serves it, differentiably.

    Per block and row: unless observed, the block is denoised from ``noise[:, i, 0]`` over
    ``schedule`` with the transformer seeing the row's committed history through the paged
    view; the steps before ``exit_steps[i]`` run without gradient and re-noise with
    ``noise[:, i, s + 1]``; the exit step's clean estimate is the block's output
    (:func:`~ardiff_jax.models.clean_estimate` under ``prediction``; ``"delta"`` adds to the
    row's last committed frame, zeros before the first). Then ``finish`` (e.g. the sprite
    world's cell decoder) of that estimate, or the observed frames, is committed by a clean
    ``t = 0`` forward, without gradient, exactly as ``WorldPipeline`` commits a block.

    ``run_start`` places each row's block 1 at that frame index with only the sink (block 0)
    visible, as a session that committed ``run_start`` frames and then saw its window reset:
    a true context run far from the sink (``frames_per_block`` must equal ``sink_frames``).

    Action-module transformers (Matrix-Game) carry each row's action ring and commit the
    clean block's action K/V after the commit pass, as their pipeline does.

    The forwards that carry no gradient (steps before the exit, commit passes) run with
    ``stop_gradient(context_params)``, by default ``params`` itself: the Self-Forcing
    gradient. Passing other parameters there (an earlier copy, an EMA) rolls the context
    out with them; a finite-difference check of the gradient holds it fixed this way.
    """
    modules = nnx.merge(graphdef, params)
    config = modules.transformer.config
    batch, num_blocks = observed.shape
    f = config.frames_per_block
    layout = rollout_layout(config, batch)
    pools = allocate_pools(layout)
    cursors = jnp.asarray(np.stack([contiguous_table_cursor(layout, layout.run_base(b), 0, 0) for b in range(batch)]))
    times = jnp.asarray([t / schedule.num_train_timesteps for t in schedule.timesteps] + [0.0], jnp.float32)
    timesteps = jnp.asarray(list(schedule.timesteps) + [0.0], jnp.float32)
    num_steps = schedule.num_steps
    grads = jnp.asarray(gradient_blocks(num_blocks, f, truncation.gradient_frames))
    frozen = jax.lax.stop_gradient(params if context_params is None else context_params)
    actions_on = config.action is not None
    history = None
    if actions_on:
        ring = init_action_cache(config)
        history = jax.tree.map(lambda a: None if a is None else jnp.broadcast_to(a, (batch,) + a.shape), ring)
    previous = jnp.zeros((batch,) + frames.shape[3:], jnp.float32)

    def forward(p: Any, caches_row: Any, x: jax.Array, step: int | jax.Array, start: jax.Array, cond: Any,
                ring: Any) -> Any:
        transformer = nnx.merge(graphdef, p).transformer
        return transformer(x, timesteps[step], start, cond.text_kv, cond.image_kv, cond.registers, cond.controls,
                           attention=caches_row, condition=cond.condition, actions=cond.actions,
                           action_history=ring)

    def row_block(caches_row: Any, carry_row: Any, x: Any, context: Any, exit_step: jax.Array,
                  grad_block: jax.Array) -> Any:
        prev, ring = carry_row
        block_frames, is_observed, cond, block_noise = x
        cond = cond._replace(text_kv=context[0], image_kv=context[1])
        start = caches_row.cursor[1]

        def denoise(s: int, x_t: jax.Array) -> jax.Array:  # a step before the exit: no gradient
            out = forward(frozen, caches_row, x_t, s, start, cond, ring)
            x0 = clean_estimate(out.video, x_t, times[s], prev, prediction)
            return (1.0 - times[s + 1]) * x0 + times[s + 1] * block_noise[s + 1]

        def at_exit(s: int, x_t: jax.Array) -> jax.Array:
            out = forward(params, caches_row, x_t, s, start, cond, ring)
            x0 = clean_estimate(out.video, x_t, times[s], prev, prediction)
            return jnp.where(grad_block, x0, jax.lax.stop_gradient(x0))

        x_t = block_noise[0]
        generated = jnp.zeros_like(x_t)
        exit_input = jnp.zeros_like(x_t)
        for s in range(num_steps):  # static: the schedule is a few steps
            branch = jnp.clip(jnp.sign(s - exit_step) + 1, 0, 2)  # 0 before the exit, 1 at it, 2 after
            before = (lambda s: lambda a: (denoise(s, a[0]), a[1], a[2]))(s) if s + 1 < num_steps else (
                lambda a: a)
            exit_input = jnp.where(branch == 1, x_t, exit_input)
            x_t, generated, _ = jax.lax.switch(branch, [
                before,
                (lambda s: lambda a: (a[0], at_exit(s, a[0]), a[2]))(s),
                lambda a: a,
            ], (x_t, generated, exit_input))
        kept = jnp.where(is_observed, block_frames, generated)
        decoded = jax.lax.stop_gradient(kept if finish is None else finish(kept))
        committed = jnp.where(is_observed, block_frames, decoded)
        clean = forward(frozen, caches_row, committed, num_steps, start, cond, ring)
        if actions_on:
            ring = commit_action_cache(config, ring, clean.action_kv, start)
        return ((committed[-1], ring), (kept, committed, jax.lax.stop_gradient(exit_input)),
                jax.lax.stop_gradient(clean.k), jax.lax.stop_gradient(clean.v))

    if truncation.remat:
        row_block = jax.checkpoint(row_block)

    def block_fn(caches: Any, carry: Any, x: Any) -> Any:
        per_row, exit_step, grad_block = x
        # The cross-attention K/V are the same for every block: closed over, not stacked per block.
        context = (conditioning.text_kv, conditioning.image_kv)
        carry, ys, k, v = jax.vmap(row_block, in_axes=(caches.vmap_axes(), 0, 0, 0, None, None))(
            caches, carry, per_row, context, exit_step, grad_block)
        return carry, ys, k, v

    per_block_cond = RolloutConditioning(text_kv=None, image_kv=None, controls=conditioning.controls,
                                         registers=conditioning.registers, condition=conditioning.condition,
                                         actions=conditioning.actions)

    def block_inputs(lo: int, hi: int) -> Any:
        rows = []
        for i in range(lo, hi):
            cond = _tree_rows(per_block_cond, i)
            rows.append(((frames[:, i], observed[:, i], cond, noise[:, i]), exit_steps[i], grads[i]))
        return jax.tree.map(lambda *a: jnp.stack(a), *rows)

    carry = (previous, history)
    pieces = []
    segments = [(0, num_blocks)] if run_start is None else [(0, 1), (1, num_blocks)]
    for lo, hi in segments:
        if lo == 1:  # jump to the run start with only the sink visible (see the docstring)
            start = jnp.asarray(run_start, jnp.int32)
            cursors = cursors.at[:, 1].set(start).at[:, 2].set(start)  # committed, visible_start; table kept
        if hi > lo:
            pools, cursors, carry, ys = scan_batched_blocks(layout, pools, cursors, block_fn, block_inputs(lo, hi),
                                                            carry, num_frames=f)
            pieces.append(ys)
    generated, committed, exit_input = (jnp.concatenate([p[j] for p in pieces], axis=0).swapaxes(0, 1)
                                        for j in range(3))
    return RolloutBlocks(generated=generated, committed=committed, exit_input=exit_input, exit_steps=exit_steps)


def rollout_noise(key: jax.Array, batch: int, num_blocks: int, num_steps: int, block_shape: tuple[int, ...]
                  ) -> jax.Array:
    """``f32[B, n, S, *block_shape]``: fresh Gaussian noise for a training rollout (a pure function of ``key``)."""
    return jax.random.normal(key, (batch, num_blocks, num_steps) + tuple(block_shape), jnp.float32)


def ground_truth_loss(
    rollout: RolloutBlocks,
    targets: jax.Array,  # f32[B, n, f, C, H, W]: what each block should have been (the simulator's frames)
    weights: jax.Array,  # f32[B, n]: each block's loss weight (0 for observed blocks)
    pixel_weights: jax.Array | None = None,  # f32[B, n, f, 1 or C, H, W]: per-pixel weights, or None
) -> tuple[jax.Array, jax.Array]:
    """``(weighted squared-error sum, weight sum)`` of the generated blocks against the true ones.

    The loss a simulator makes possible: each block the model generated from its *own*
    history, compared with what the world did under the same actions.
    """
    err = jnp.square(rollout.generated - targets)
    if pixel_weights is not None:
        err = err * pixel_weights
    per_block = err.mean(axis=tuple(range(2, err.ndim)))
    return jnp.sum(per_block * weights), jnp.sum(weights)
