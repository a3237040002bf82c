"""Training causal models: teacher forcing and Self-Forcing (through the model's own cached rollout), optax, orbax.

* :class:`TrainConfig` fixes a run (the seed makes it reproducible and resumable);
  :func:`train` runs it with a tqdm progress bar, orbax checkpoints, ``losses.json`` and
  ``loss_curve.png``; ``ardiff-jax train`` is its command line.
* The objective (:func:`batch_loss`, :func:`sequence_loss`, :func:`sample_training_batch`)
  is pure and jittable; the training-mode forward is the same ``CausalDiT`` that serves
  inference, run over many block instances at once under a token mask built from the
  runtime's own visible-window rule (``ardiff_jax.models.block_causal_mask``).

* Self-Forcing (:func:`self_rollout`, :class:`Truncation`, :func:`ground_truth_loss`, and the
  distribution-matching hook in :mod:`ardiff_jax.training`): the engine's cached rollout,
  differentiable, in one jitted program (``docs/training.md``).

Needs the ``train`` extra (``pip install 'ardiff_jax[train]'``: optax, orbax-checkpoint,
matplotlib); inference with the shipped weights does not. Design notes: ``docs/models.md``.
"""

from ardiff_jax.training._dmd import (
    DMDConfig,
    DMDInputs,
    DMDState,
    DMDKeys,
    ScoreFn,
    dmd_generator_loss,
    critic_loss,
    causal_score_fn,
    make_dmd_step,
    init_dmd_state,
    dmd_rollout,
    dmd_keys,
    dmd_optimizer,
    rollout_frame_starts,
    sample_score_timesteps,
)
from ardiff_jax.training._evaluate import EVALUATION_SEED, OneStepAccuracy, one_step_accuracy
from ardiff_jax.training._loop import (
    BOOKKEEPING_FIELDS,
    MAX_BATCH_SIZE,
    MAX_FRAMES_PER_STEP,
    MAX_SEQUENCE_FRAMES,
    checkpoint_config,
    config_differences,
    deepen,
    TrainConfig,
    TrainResult,
    TrainState,
    init_train_state,
    make_optimizer,
    make_train_step,
    plot_loss_curve,
    restore_checkpoint,
    save_checkpoint,
    train,
    training_batch,
)
from ardiff_jax.training._objective import (
    Objective,
    TrainingBatch,
    batch_loss,
    encounters,
    sample_training_batch,
    sequence_loss,
    rollout_batch_loss,
    rollout_weights,
    teacher_forced_outputs,
)
from ardiff_jax.training._self_forcing import (
    RolloutBlocks,
    RolloutConditioning,
    Truncation,
    ground_truth_loss,
    gradient_blocks,
    pipeline_noise,
    rollout_layout,
    rollout_noise,
    sample_exit_steps,
    self_rollout,
)

__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_FRAMES_PER_STEP",
    "MAX_SEQUENCE_FRAMES",
    "BOOKKEEPING_FIELDS",
    "checkpoint_config",
    "config_differences",
    "deepen",
    "EVALUATION_SEED",
    "OneStepAccuracy",
    "one_step_accuracy",
    "teacher_forced_outputs",
    "Objective",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "TrainingBatch",
    "batch_loss",
    "encounters",
    "init_train_state",
    "make_optimizer",
    "make_train_step",
    "plot_loss_curve",
    "restore_checkpoint",
    "sample_training_batch",
    "save_checkpoint",
    "sequence_loss",
    "train",
    "training_batch",
    "rollout_batch_loss",
    "rollout_weights",
    "RolloutBlocks",
    "RolloutConditioning",
    "Truncation",
    "ground_truth_loss",
    "gradient_blocks",
    "pipeline_noise",
    "rollout_layout",
    "rollout_noise",
    "sample_exit_steps",
    "self_rollout",
    "DMDConfig",
    "DMDInputs",
    "DMDState",
    "DMDKeys",
    "ScoreFn",
    "dmd_generator_loss",
    "critic_loss",
    "causal_score_fn",
    "make_dmd_step",
    "init_dmd_state",
    "dmd_rollout",
    "dmd_keys",
    "dmd_optimizer",
    "rollout_frame_starts",
    "sample_score_timesteps",
]
