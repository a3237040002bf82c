"""The training loop: optax AdamW with warmup + cosine decay and clipping, orbax checkpoints, resumable."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checks import check_non_negative_int, check_positive_int
from ardiff_jax.models import PREDICTIONS, CausalDiTConfig, DiTModules, dit_preset
from ardiff_jax.training._evaluate import EVALUATION_SEED
from ardiff_jax.training._objective import (
    Objective,
    TrainingBatch,
    batch_loss,
    rollout_batch_loss,
    rollout_weights,
    sample_training_batch,
)
from ardiff_jax.training._self_forcing import Truncation

__all__ = ["TrainConfig", "TrainState", "TrainResult", "make_optimizer", "init_train_state", "make_train_step",
           "deepen", "train", "save_checkpoint", "restore_checkpoint", "plot_loss_curve", "checkpoint_config",
           "config_differences", "BOOKKEEPING_FIELDS", "training_batch", "MAX_BATCH_SIZE", "MAX_SEQUENCE_FRAMES",
           "MAX_FRAMES_PER_STEP"]

# Bounds on a step's size, checked with the config (before any data, weights or compile): a teacher-forced
# step attends densely over 2 (sequence_frames - 1) frames of 64 tokens each, so its memory grows with the
# batch and with the square of the sequence; the default step is 16 x 4 frames. Without them
# `--batch-size 2000000000` ended in a MemoryError after 30 s of building and compiling.
#: Sequences per step.
MAX_BATCH_SIZE = 1024
#: Frames per sequence, the sink included.
MAX_SEQUENCE_FRAMES = 64
#: batch_size x sequence_frames: 64 times the default step's 64 frames.
MAX_FRAMES_PER_STEP = 4096


def _optional(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"training needs {module}; install the extra: pip install 'ardiff_jax[train]'") from None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the seed, the run is reproducible and resumable).

    Attributes:
      preset: the ``CausalDiT`` preset to train (``"sprite_world"``).
      steps: optimizer steps.
      batch_size: training sequences per step.
      sequence_frames: frames per sequence: the sink frame plus ``sequence_frames - 1`` consecutive frames.
      max_gap: largest number of simulated steps from the sink to the first consecutive frame.
      max_sink_distance: largest frame distance at which such a run is placed from the sink
        (``sample_training_batch``); 0 places it where it was simulated.
      learning_rate, warmup_steps, end_learning_rate: linear warmup to the peak, then cosine decay.
      weight_decay: AdamW's decoupled weight decay.
      grad_clip: global gradient-norm clip.
      change_weight, focus_weight, sigma_one_probability, low_sigma_max, prediction: the loss
        (:class:`Objective`).
      encounter_share, encounter_weight: how often a gapped sequence is placed at an
        agent-ball encounter, and the extra loss weight of targets that follow one
        (:func:`~ardiff_jax.training.sample_training_batch`); 0 and 0 are the original data.
      chase_probability: how often the clips' player chases the ball instead of acting at
        random (:func:`~ardiff_jax.envs.sprite_world_clips`); 0 is the original data.
      init_weights: a weights file written by ``ardiff-jax train --export`` (``.npz`` with its
        sidecar) to start from instead of fresh weights: a fine-tune. Its config must be this
        run's model config, except that it may have fewer layers (:func:`deepen` adds the
        rest); the optimizer state starts fresh. ``""``: fresh weights from ``seed``.
      num_layers: transformer depth; 0 keeps the preset's.
      self_rollout: train through the model's own cached rollout (Self-Forcing,
        :func:`~ardiff_jax.training.rollout_batch_loss`) instead of teacher forcing: each
        sequence is played as a session plays it, every frame after the observed ones
        generated from the model's own committed frames, the loss on what it generated
        against the simulator's frames. ``sequence_frames`` counts the sink too.
      per_block_exit, gradient_frames: Self-Forcing's gradient truncation
        (:class:`~ardiff_jax.training.Truncation`); the shipped model samples in one step,
        so its exit step is always that step.
      seed: initial weights (unless ``init_weights``), data and noise.
      checkpoint_every: steps between orbax checkpoints (the last step is always saved).
    """

    preset: str = "sprite_world"
    steps: int = 2000
    batch_size: int = 16
    sequence_frames: int = 4
    max_gap: int = 48
    max_sink_distance: int = 1024
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    end_learning_rate: float = 1e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    change_weight: float = 0.0
    focus_weight: float = 8.0
    sigma_one_probability: float = 1.0
    low_sigma_max: float = 0.3
    prediction: str = "delta"
    encounter_share: float = 0.0
    encounter_weight: float = 0.0
    chase_probability: float = 0.0
    init_weights: str = ""
    num_layers: int = 0
    self_rollout: bool = False
    per_block_exit: bool = False
    gradient_frames: int = 0
    seed: int = 0
    checkpoint_every: int = 250

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_gap", "checkpoint_every"):
            check_positive_int(f"TrainConfig {name}", getattr(self, name))
        check_non_negative_int("TrainConfig warmup_steps", self.warmup_steps)
        check_non_negative_int("TrainConfig max_sink_distance", self.max_sink_distance)
        check_non_negative_int("TrainConfig seed", self.seed)
        check_non_negative_int("TrainConfig num_layers", self.num_layers)
        check_non_negative_int("TrainConfig gradient_frames", self.gradient_frames)
        for name in ("self_rollout", "per_block_exit"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig {name} must be a bool, got {getattr(self, name)!r}")
        if self.seed == EVALUATION_SEED:
            raise ValueError(f"TrainConfig seed {EVALUATION_SEED} is the evaluation clips' seed "
                             "(ardiff_jax.training.EVALUATION_SEED); train with another")
        if check_positive_int("TrainConfig sequence_frames", self.sequence_frames) < 2:
            raise ValueError("TrainConfig sequence_frames must be at least 2 (the sink and one target)")
        if self.batch_size > MAX_BATCH_SIZE or self.sequence_frames > MAX_SEQUENCE_FRAMES:
            raise ValueError(f"TrainConfig batch_size must be 1..{MAX_BATCH_SIZE} and sequence_frames "
                             f"2..{MAX_SEQUENCE_FRAMES}, got {self.batch_size} and {self.sequence_frames}")
        if self.batch_size * self.sequence_frames > MAX_FRAMES_PER_STEP:
            raise ValueError(f"TrainConfig batch_size x sequence_frames must be at most {MAX_FRAMES_PER_STEP} frames "
                             f"per step, got {self.batch_size} x {self.sequence_frames}")
        for name in ("learning_rate", "end_learning_rate", "weight_decay", "grad_clip", "change_weight",
                     "focus_weight", "sigma_one_probability", "low_sigma_max", "encounter_share",
                     "encounter_weight", "chase_probability"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) or value < 0:
                raise ValueError(f"TrainConfig {name} must be a finite non-negative number, got {value!r}")
        if self.sigma_one_probability > 1 or not 0 < self.low_sigma_max <= 1:
            raise ValueError("TrainConfig sigma_one_probability must be in [0, 1] and low_sigma_max in (0, 1]")
        for name in ("encounter_share", "chase_probability"):
            if getattr(self, name) > 1:
                raise ValueError(f"TrainConfig {name} must be in [0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.init_weights, str):
            raise ValueError(f"TrainConfig init_weights must be a path string ('' for fresh weights), "
                             f"got {self.init_weights!r}")
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"TrainConfig prediction must be one of {PREDICTIONS}, got {self.prediction!r}")
        dit_preset(self.preset)  # KeyError naming the presets if unknown
        if self.self_rollout and self.sequence_frames < self.context_frames + 2:
            raise ValueError(f"TrainConfig sequence_frames must be at least {self.context_frames + 2} with "
                             f"self_rollout (the sink, {self.context_frames} observed context frames of a gapped "
                             "sequence and one generated frame)")

    @property
    def context_frames(self) -> int:
        """True frames a gapped self-rollout sequence observes after its sink: the history one forward sees."""
        preset = dit_preset(self.preset)
        return preset.window_frames - preset.frames_per_block

    @property
    def truncation(self) -> Truncation:
        return Truncation(per_block_exit=self.per_block_exit, gradient_frames=self.gradient_frames)

    @property
    def model_config(self) -> CausalDiTConfig:
        preset = dit_preset(self.preset)
        return preset.replace(num_layers=self.num_layers) if self.num_layers else preset

    @property
    def objective(self) -> Objective:
        return Objective(change_weight=float(self.change_weight), focus_weight=float(self.focus_weight),
                         sigma_one_probability=float(self.sigma_one_probability),
                         low_sigma_max=float(self.low_sigma_max), prediction=self.prediction)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TrainState(NamedTuple):
    """What a checkpoint holds: the step reached, the parameters, the optimizer state."""

    step: jax.Array  # i32[]
    params: Any
    opt_state: Any


class TrainResult(NamedTuple):
    """A finished (or resumed and finished) run; ``wall_seconds`` sums every call of the run."""

    modules: DiTModules
    losses: list[tuple[int, float]]
    wall_seconds: float
    resumed_from: int | None


def make_optimizer(config: TrainConfig) -> Any:
    """AdamW on a warmup + cosine schedule behind a global-norm clip."""
    optax = _optional("optax")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1), end_value=config.end_learning_rate)
    return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                       optax.adamw(schedule, weight_decay=config.weight_decay))


def init_train_state(config: TrainConfig) -> tuple[Any, TrainState]:
    """``(graphdef, state)`` at step 0: fresh weights from ``config.seed``, or ``config.init_weights``.

    A ``"delta"`` model starts with a zero output head (Wan's and DiT's initialisation): its
    first prediction is "nothing moves", the best answer that ignores the context, with the
    body's features intact. From a random head it first has to learn to output zero, and does
    so by silencing its own features, a plateau it leaves only slowly (``docs/models.md``).
    """
    if config.init_weights:
        modules = _initial_weights(config)
    else:
        modules = DiTModules.create(config.model_config, config.seed)
    if config.prediction == "delta" and not config.init_weights:
        head = modules.transformer.head
        head.kernel[...] = jnp.zeros_like(head.kernel[...])
        head.bias[...] = jnp.zeros_like(head.bias[...])
    graphdef, params = nnx.split(modules)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=make_optimizer(config).init(params))
    # Committed to the default device, as a restored checkpoint is: a fresh and a resumed run
    # then present the same argument signature and share one compiled step.
    return graphdef, jax.device_put(state, jax.devices()[0])


def _initial_weights(config: TrainConfig) -> DiTModules:
    """A fine-tune's starting weights: ``config.init_weights``, deepened to the run's depth if it has fewer layers."""
    from ardiff_jax.models import load_weights

    target = config.model_config
    path = Path(config.init_weights).with_suffix(".npz")
    try:
        stored_layers = json.loads(path.with_suffix(".json").read_text())["config"]["num_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        stored_layers = target.num_layers  # load_weights names what is wrong with the file
    if not isinstance(stored_layers, int) or not 0 < stored_layers <= target.num_layers:
        raise ValueError(f"{path} has {stored_layers!r} layers; a fine-tune can keep or add layers "
                         f"(this run has {target.num_layers})")
    # Validated (digest, config, every parameter's name, shape and finiteness) before use.
    modules = load_weights(target.replace(num_layers=stored_layers), path)
    return deepen(modules, target.num_layers) if stored_layers < target.num_layers else modules


#: The projections that write into the residual stream: zero in a new layer, which then adds nothing.
_RESIDUAL_WRITERS = ("self_attn/o/", "cross_attn/o/", "ffn_out/")


def deepen(modules: DiTModules, num_layers: int) -> DiTModules:
    """``modules`` with ``num_layers`` transformer layers, computing exactly the same function.

    Each new layer is a copy of one of the middle layers, inserted right after it, with the
    projections that write into the residual stream (self-attention and cross-attention
    outputs, the FFN's second linear) set to zero: the block then adds nothing, so the
    deeper network's output equals the original's (tested), and training starts from
    there. Their gradients are not zero (a zero output projection still gets the gradient
    of its input's features), so the new layers learn from the first step. At most doubles
    the depth; not for transformers with action modules in their first layers.
    """
    config = modules.transformer.config
    old = config.num_layers
    if not isinstance(num_layers, int) or not old <= num_layers <= 2 * old:
        raise ValueError(f"deepen: num_layers must be an integer in [{old}, {2 * old}], got {num_layers!r}")
    if config.action is not None:
        raise ValueError("deepen: a transformer with action modules cannot be deepened (they live in fixed layers)")
    extra = num_layers - old
    copied = set(range((old - extra) // 2, (old - extra) // 2 + extra))
    order = [i for layer in range(old) for i in ([layer, layer] if layer in copied else [layer])]
    new = np.array([k > 0 and order[k] == order[k - 1] for k in range(len(order))])
    graphdef = nnx.split(nnx.eval_shape(lambda: DiTModules(config.replace(num_layers=num_layers), 0)))[0]

    def stack(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        if not name.startswith("transformer/blocks/"):
            return leaf
        grown = leaf[np.array(order)]
        if any(writer in name for writer in _RESIDUAL_WRITERS):
            grown = jnp.where(jnp.asarray(new).reshape((-1,) + (1,) * (leaf.ndim - 1)), 0, grown)
        return grown

    params = jax.tree_util.tree_map_with_path(stack, nnx.split(modules)[1])
    return nnx.merge(graphdef, params)


def make_train_step(config: TrainConfig, graphdef: Any
                    ) -> Callable[[TrainState, TrainingBatch], tuple[TrainState, jax.Array]]:
    """The jitted step ``(state, batch) -> (state, loss)``; the step's noise key is ``fold_in(seed, step)``.

    One step function per ``(config, graphdef)`` in a process: a resumed run (or a second
    :func:`train` with the same config) reuses the compiled step instead of compiling again.
    """
    return _train_step(config, graphdef)


@functools.lru_cache(maxsize=8)
def _train_step(config: TrainConfig, graphdef: Any
                ) -> Callable[[TrainState, TrainingBatch], tuple[TrainState, jax.Array]]:
    optax = _optional("optax")
    optimizer = make_optimizer(config)
    model_config = config.model_config

    def loss_fn(params: Any, batch: TrainingBatch, key: jax.Array) -> jax.Array:
        if not config.self_rollout:
            return batch_loss(graphdef, params, model_config, batch, key, config.objective)
        from ardiff_jax.models import SPRITE_WORLD_SCHEDULE

        # Under self_rollout the batch's weights are per frame, f32[B, n] (training_batch).
        return rollout_batch_loss(graphdef, params, model_config, batch, batch.weights, key, config.objective, SPRITE_WORLD_SCHEDULE,
                                  config.context_frames, config.truncation, _snap_cells)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: TrainState, batch: TrainingBatch) -> tuple[TrainState, jax.Array]:
        key = jax.random.fold_in(jax.random.key(config.seed), state.step)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, key))(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), loss

    return step


def _snap_cells(latents: jax.Array) -> jax.Array:
    """The shipped sprite pipeline's ``"cells"`` decoder: what a rollout commits, as the engine does."""
    from ardiff_jax.models import snap_to_cells

    return snap_to_cells(latents, jnp)


def training_batch(config: TrainConfig, step: int) -> TrainingBatch:
    """The batch of ``step`` as the step function takes it (a pure function of ``(config.seed, step)``).

    Under ``self_rollout`` its ``weights`` are per frame, ``f32[B, n]``
    (:func:`~ardiff_jax.training.rollout_weights`), not per teacher-forced target.
    """
    batch = sample_training_batch(config.seed, step, config.batch_size, config.sequence_frames, config.max_gap,
                                  size=config.model_config.latent_height,
                                  max_sink_distance=config.max_sink_distance or None,
                                  encounter_share=config.encounter_share, encounter_weight=config.encounter_weight,
                                  chase_probability=config.chase_probability)
    if config.self_rollout:
        batch = batch._replace(weights=rollout_weights(batch, config.context_frames))
    return batch


def _manager(directory: Path, keep: int = 2) -> Any:
    ocp = _optional("orbax.checkpoint")
    return ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep))


#: TrainConfig fields that do not change what a run computes: a resume may change them freely.
BOOKKEEPING_FIELDS = ("checkpoint_every",)


def save_checkpoint(directory: str | Path, state: TrainState, losses: list[tuple[int, float]],
                    wall_seconds: float = 0.0, config: TrainConfig | None = None) -> None:
    """Save ``state`` (orbax, arrays), the loss history so far, the run's training time and its config (JSON item)."""
    ocp = _optional("orbax.checkpoint")
    manager = _manager(Path(directory))
    step = int(state.step)
    record = {"losses": losses, "wall_seconds": wall_seconds,
              "config": None if config is None else config.as_dict()}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               losses=ocp.args.JsonSave(record)))
    manager.wait_until_finished()
    manager.close()


def checkpoint_config(directory: str | Path) -> dict[str, Any] | None:
    """The config stored with the latest checkpoint in ``directory`` (``None``: no checkpoint, or one without it)."""
    ocp = _optional("orbax.checkpoint")
    directory = Path(directory)
    if not directory.exists():
        return None
    manager = _manager(directory)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        record = manager.restore(step, args=ocp.args.Composite(losses=ocp.args.JsonRestore()))["losses"]
    finally:
        manager.close()
    return record.get("config") if isinstance(record, dict) else None


def config_differences(stored: dict[str, Any], config: TrainConfig) -> list[str]:
    """``"field: stored -> new"`` for every run-defining field in which ``config`` differs from ``stored``.

    A field missing from ``stored`` (a checkpoint written before the field existed) counts as
    its default, which is what such runs did, so they resume without ``force``.
    """
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    stored = {**{name: value for name, value in defaults.items() if name not in stored}, **stored}
    current = config.as_dict()
    return [f"{name}: {stored.get(name)!r} -> {current.get(name)!r}" for name in sorted(set(stored) | set(current))
            if name not in BOOKKEEPING_FIELDS and stored.get(name) != current.get(name)]


def restore_checkpoint(directory: str | Path, config: TrainConfig, step: int | None = None
                       ) -> tuple[Any, TrainState, list[tuple[int, float]], float] | None:
    """``(graphdef, state, losses, wall_seconds)`` of the latest (or given) checkpoint; ``None`` if there is none."""
    ocp = _optional("orbax.checkpoint")
    directory = Path(directory)
    if not directory.exists():
        return None
    manager = _manager(directory)
    step = manager.latest_step() if step is None else step
    if step is None:
        manager.close()
        return None
    # The shapes only: a fine-tune's starting weights need not be read to restore its checkpoint.
    abstract = jax.eval_shape(lambda: init_train_state(dataclasses.replace(config, init_weights=""))[1])
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                             losses=ocp.args.JsonRestore()))
    manager.close()
    graphdef = nnx.split(nnx.eval_shape(lambda: DiTModules(config.model_config, config.seed)))[0]
    record = restored["losses"]
    losses = [(int(s), float(v)) for s, v in record["losses"]]
    return graphdef, TrainState(*restored["state"]), losses, float(record.get("wall_seconds", 0.0))


def plot_loss_curve(losses: list[tuple[int, float]], path: str | Path, title: str = "training loss") -> Path:
    """Write the loss curve (log scale, raw and smoothed) as a PNG."""
    matplotlib = _optional("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([s for s, _ in losses])
    values = np.array([v for _, v in losses])
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, values, alpha=0.35, label="loss")
    if len(values) >= 10:
        width = max(len(values) // 20, 5)
        smooth = np.convolve(values, np.ones(width) / width, mode="valid")
        ax.plot(steps[width - 1:], smooth, label=f"mean of {width}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def train(config: TrainConfig, out_dir: str | Path, *, resume: bool = True, progress: bool = True,
          stop_after: int | None = None, force: bool = False) -> TrainResult:
    """Train (or resume) the run of ``config`` in ``out_dir``: checkpoints, ``losses.json`` and ``loss_curve.png``.

    ``out_dir/checkpoints`` holds orbax checkpoints every ``config.checkpoint_every`` steps
    and at the end; with ``resume`` the latest one is restored and the run continues with
    the same data and noise it would have seen uninterrupted. ``stop_after`` stops early
    after that many steps of this call (the run can be resumed later).

    A checkpoint made under another run-defining config (any field but
    ``checkpoint_every``: another seed, batch size, schedule, ...) is refused with a
    ValueError naming the fields, before anything is restored: continuing it would mix two
    runs under one label. ``force=True`` continues it anyway, and ``losses.json`` then
    records the stored config as ``resumed_from_config``.
    """
    tqdm = _optional("tqdm.auto").tqdm
    out = Path(out_dir)
    checkpoints = out / "checkpoints"
    started = time.perf_counter()
    stored_config = checkpoint_config(checkpoints) if resume else None
    differences = [] if stored_config is None else config_differences(stored_config, config)
    if differences and not force:
        raise ValueError(f"{out} holds a run made under another TrainConfig ({'; '.join(differences)}); resume it "
                         "with the same config, start over (resume=False / --no-resume), use another directory, "
                         "or continue it under the new config with force=True (--force)")
    restored = restore_checkpoint(checkpoints, config) if resume else None
    earlier_seconds = 0.0
    if restored is None:
        graphdef, state = init_train_state(config)
        losses: list[tuple[int, float]] = []
        resumed_from = None
    else:
        graphdef, state, losses, earlier_seconds = restored
        resumed_from = int(state.step)
    step_fn = make_train_step(config, graphdef)
    first = int(state.step)
    last = config.steps if stop_after is None else min(config.steps, first + stop_after)
    with tqdm(total=config.steps, initial=first, disable=not progress, unit="step", desc="train") as bar:
        for step in range(first, last):
            batch = training_batch(config, step)
            state, loss = step_fn(state, batch)
            losses.append((step, float(loss)))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1][1]:.4f}")
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == last:
                save_checkpoint(checkpoints, state, losses, earlier_seconds + time.perf_counter() - started, config)
    wall_seconds = earlier_seconds + time.perf_counter() - started
    record = {"config": config.as_dict(), "losses": losses, "wall_seconds": wall_seconds}
    if differences:
        record["resumed_from_config"] = stored_config
    (out / "losses.json").write_text(json.dumps(record) + "\n")
    if losses:
        plot_loss_curve(losses, out / "loss_curve.png", title=f"{config.preset}: training loss")
    modules = nnx.merge(graphdef, state.params)
    return TrainResult(modules=modules, losses=losses, wall_seconds=wall_seconds, resumed_from=resumed_from)
