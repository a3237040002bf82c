"""What both reference pipelines share: schedule, config base, session base, pipeline base, jitted projections.

Jit pattern (flax's "performance considerations"): the modules are split once with
``nnx.split``; every device entry point is a plain ``jax.jit`` of a module-level pure
function ``(graphdef, params, ...)`` that calls ``nnx.merge`` inside. ``graphdef`` is a
static argument; it is hashable and equal for equal configs, so the compile cache is
shared by every pipeline instance, session and fill level: one compile per shape.

:class:`PipelineBase` owns everything the pipelines do alike (request checks on the host,
session creation, the noise-key tree, text projection, model-owned bytes, hooks); a
pipeline adds its KV spec, its request schema and its forward.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import functools
import hashlib
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checks import check_non_negative_int, check_positive_int, is_integer
from ardiff_jax.capability import ARDiffusionKVCacheSpec
from ardiff_jax.models._config import CausalDiTConfig, dit_preset
from ardiff_jax.models._dit import ByteTextEncoder, CausalDiT, tokenize_prompt
from ardiff_jax.types import (
    ARDiffusionChunkMetadata,
    ARDiffusionTickRequest,
    DiffusionRequest,
)

if TYPE_CHECKING:  # pragma: no cover
    from ardiff_jax.runtime import ARDiffusionKVBatch, ARDiffusionKVState

__all__ = ["FewStepSchedule", "DiTModules", "text_cross_kv", "image_cross_kv", "block_noise", "session_seed",
           "resolve_config", "NOISE_PRNG_IMPL", "PipelineBase", "PipelineConfigBase", "PipelineSession",
           "dit_kv_spec", "check_prompt", "check_seed", "noise_key", "step_noise_key", "renoise", "with_tick_metadata",
           "weights_fingerprint", "mesh_placement", "stack_rows", "unstack_rows", "jitted_encode_image"]

#: PRNG implementation of the per-session noise keys. ``"rbg"`` (XLA's RngBitGenerator)
#: compiles several times faster than threefry on XLA:CPU. Its streams are deterministic
#: for a given key and backend, not bit-identical across backends.
NOISE_PRNG_IMPL = "rbg"


@dataclasses.dataclass(frozen=True)
class FewStepSchedule:
    """A distilled few-step (DMD-style) flow schedule: ``sigma = t / num_train_timesteps``.

    Each step predicts the flow ``v = noise - x0`` at ``x_t = (1 - sigma) x0 + sigma noise``,
    takes ``x0 = x_t - sigma v`` and re-noises to the next step's sigma with fresh noise
    (Self-Forcing/CausVid inference). After the last step the block is clean, and one more
    forward at ``t = 0`` writes its K/V.
    """

    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    num_train_timesteps: float = 1000.0

    def __post_init__(self) -> None:
        steps = tuple(float(t) for t in self.timesteps)
        object.__setattr__(self, "timesteps", steps)
        if not steps:
            raise ValueError("FewStepSchedule needs at least one timestep")
        if any(not (0 < t <= self.num_train_timesteps) for t in steps):
            raise ValueError(f"FewStepSchedule timesteps must lie in (0, {self.num_train_timesteps}], got {steps}")
        if any(a <= b for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"FewStepSchedule timesteps must be strictly decreasing, got {steps}")

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def step_args(self, index: int) -> tuple[np.float32, np.float32, np.float32]:
        """``(t, sigma, sigma_next)`` of denoise step ``index``; ``index == num_steps`` is the clean commit."""
        sigmas = [t / self.num_train_timesteps for t in self.timesteps] + [0.0]
        times = list(self.timesteps) + [0.0]
        nxt = sigmas[index + 1] if index < self.num_steps else 0.0
        return np.float32(times[index]), np.float32(sigmas[index]), np.float32(nxt)


def resolve_config(config: CausalDiTConfig | str) -> CausalDiTConfig:
    if isinstance(config, str):
        return dit_preset(config)
    if not isinstance(config, CausalDiTConfig):
        raise TypeError(f"config must be a CausalDiTConfig or a preset name, got {type(config).__name__}")
    return config


class DiTModules(nnx.Module):
    """The transformer and its stand-in text encoder, split together once by the pipelines."""

    def __init__(self, config: CausalDiTConfig, seed: int | jax.Array) -> None:
        """``seed``: an int, or the key it makes (:func:`weights_key`), which is how :meth:`create` passes it."""
        rngs = nnx.Rngs(seed if isinstance(seed, jax.Array) else weights_key(seed))
        self.transformer = CausalDiT(config, rngs=rngs)
        self.text_encoder = ByteTextEncoder(config, rngs=rngs)

    @classmethod
    def create(cls, config: CausalDiTConfig, seed: int) -> DiTModules:
        """Random-init weights with one compiled program instead of one per parameter.

        Eager construction compiles every initializer separately; one jitted init compiles
        once per config: the seed's key is an argument of the program, not a constant in it,
        so pipelines of the same config with other seeds reuse the executable (the weights
        are bit-identical to a seed compiled in: ``tests/test_structural.py``).
        """
        key = weights_key(seed)
        graphdef = nnx.split(nnx.eval_shape(lambda: cls(config, key)))[0]
        return nnx.merge(graphdef, _init_params(config, key))


def weights_key(seed: int) -> jax.Array:
    """The key random-init weights draw from: ``jax.random.key(seed)`` of :data:`NOISE_PRNG_IMPL`."""
    return jax.random.key(seed, impl=NOISE_PRNG_IMPL)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: CausalDiTConfig, key: jax.Array) -> Any:
    return nnx.split(DiTModules(config, key))[1]


# -- the noise-key tree and the re-noise step (traceable) ----------------------------------------


def noise_key(session_key: jax.Array, block_index: jax.Array, stream: Any) -> jax.Array:
    """The key tree: session key -> block index -> stream.

    Stream 0 is a block's initial noise, stream ``i + 1`` the re-noise after denoise step
    ``i``. A session's noise depends only on its own key, so its outputs do not depend on
    which other sessions ran (isolation), and a reset session replays a fresh one.
    """
    return jax.random.fold_in(jax.random.fold_in(session_key, block_index), stream)


def step_noise_key(session_key: jax.Array, block_index: jax.Array, step_index: jax.Array) -> jax.Array:
    """Key of the re-noise after denoise step ``step_index`` (traceable; used inside the jitted steps)."""
    return noise_key(session_key, block_index, step_index + 1)


def renoise(x0: jax.Array, sigma_next: jax.Array, noise: jax.Array) -> jax.Array:
    """``x_t`` at the next step: the clean estimate ``x0`` re-noised to ``sigma_next``."""
    return (1.0 - sigma_next) * x0 + sigma_next * noise


# -- jitted pure entry points ---------------------------------------------------------------


def _text_cross_kv(graphdef: Any, params: Any, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    return modules.transformer.text_cross_kv(modules.text_encoder(token_ids))


def _image_cross_kv(graphdef: Any, params: Any, image_features: jax.Array) -> tuple[jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    return modules.transformer.image_cross_kv(image_features)


def _block_noise(session_key: jax.Array, block_index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(noise_key(session_key, block_index, 0), shape, jnp.float32)


#: ``(graphdef, params, i32[N]) -> ([L, N, H, D], [L, N, H, D])``: a prompt's per-layer text K/V.
text_cross_kv = jax.jit(_text_cross_kv, static_argnums=0)
#: ``(graphdef, params, f32[Ni, patch_dim]) -> ([L, Ni, H, D], [L, Ni, H, D])``: image K/V.
image_cross_kv = jax.jit(_image_cross_kv, static_argnums=0)
#: ``(key, i32[], shape) -> f32[shape]``: the initial noise of a block (stream 0 of its key).
block_noise = jax.jit(_block_noise, static_argnums=2)


# -- batched ticks: per-session rows in and out of one program -------------------------------------

@jax.jit
def _stack(rows: tuple[Any, ...]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *rows)


@jax.jit
def _unstack(tree: Any) -> list[Any]:
    size = jax.tree.leaves(tree)[0].shape[0]
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(size)]


def stack_rows(rows: Sequence[Any], bucket_size: int) -> Any:
    """Stack ``B`` equally shaped pytrees into one with a leading ``bucket_size`` axis (one program per bucket).

    Rows past ``B`` repeat the first row: a padded row computes on real, finite inputs and
    its results are dropped (its cursor reads nothing, its commit writes nothing). The
    stack is one jitted call keyed on the bucket, so batches of different sizes in one
    bucket share it.
    """
    rows = tuple(rows)
    if not rows or len(rows) > bucket_size:
        raise ValueError(f"stack_rows needs 1..{bucket_size} rows, got {len(rows)}")
    return _stack(rows + (rows[0],) * (bucket_size - len(rows)))


def unstack_rows(tree: Any, size: int) -> list[Any]:
    """The first ``size`` rows of a stacked pytree, one pytree each (one program per bucket)."""
    return _unstack(tree)[:size]



# -- host-side request checks ------------------------------------------------------------------


def check_prompt(name: str, prompt: Any) -> str:
    """A ``str`` the tokenizer can encode (UTF-8), else ValueError naming it.

    ``json.loads`` turns ``"\\ud800"`` into a lone surrogate: a valid ``str`` that no UTF-8
    encoder accepts. Refusing it here keeps it out of ``forward``, where it would fail an
    established session.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"{name} must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = prompt[error.start:error.end]
        raise ValueError(
            f"{name} is not encodable as UTF-8: it contains the lone surrogate {bad!r} at index {error.start}"
        ) from None
    return prompt


def check_seed(seed: Any) -> int:
    """``inputs["seed"]``: an integer in ``[0, 2**31)``."""
    if not is_integer(seed) or not 0 <= int(seed) < 2**31:
        raise ValueError(f"inputs['seed'] must be an integer in [0, 2**31), got {seed!r}")
    return int(seed)


def session_seed(session_id: str, inputs: Mapping[str, Any], base_seed: int) -> int:
    """The noise seed of a new session: ``inputs["seed"]`` if given, else derived from the id.

    Deriving it from the session id (not from a global RNG) makes a session's outputs
    independent of which other sessions ran before it (isolation) and makes a reset
    session replay a fresh one exactly.
    """
    seed = inputs.get("seed")
    if seed is None:
        return (zlib.crc32(session_id.encode("utf-8")) ^ base_seed) & 0x7FFFFFFF
    return check_seed(seed)


def prompt_ids(prompt: str, text_len: int) -> np.ndarray:
    return tokenize_prompt(prompt, text_len)


def new_session_key(seed: int, device: jax.Device) -> jax.Array:
    """The noise key of a new session, committed to ``device`` (see :data:`NOISE_PRNG_IMPL`)."""
    return jax.device_put(jax.random.key(seed, impl=NOISE_PRNG_IMPL), device)


def check_array(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Host-side validation of a float input (before any device work): shape and finiteness."""
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a float array of shape {shape}, got {type(value).__name__}") from None
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite")
    return array


def nbytes(shape: tuple[int, ...], itemsize: int = 4) -> int:
    return int(np.prod(shape)) * itemsize


def device_bytes(array: jax.Array) -> int:
    """Bytes ``array`` holds on its device; a typed PRNG key counts its key data."""
    if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
        return int(jax.random.key_data(array).nbytes)
    return int(array.nbytes)


def dit_kv_spec(config: CausalDiTConfig, *, kv_branches: Any, cross_attention: Any, session_capacity: int,
                model_owned_bytes: int) -> ARDiffusionKVCacheSpec:
    """The KV spec of a pipeline on ``config``: geometry from the transformer, policy from the pipeline."""
    return ARDiffusionKVCacheSpec(
        num_layers=config.num_layers,
        num_kv_heads=config.num_heads,
        head_size=config.head_dim,
        tokens_per_frame=config.tokens_per_frame,
        frames_per_block=config.frames_per_block,
        window_frames=config.window_frames,
        sink_frames=config.sink_frames,
        kv_branches=kv_branches,
        cross_attention=cross_attention,
        max_scratch_tokens_per_branch=config.num_register_tokens,
        session_capacity=session_capacity,
        model_owned_state_bytes_per_session=model_owned_bytes,
    )


# -- the bases ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineConfigBase:
    """The policy every reference pipeline has; a pipeline's config adds its own fields.

    Attributes:
      schedule: the few-step denoising schedule (default 1000/750/500/250).
      session_capacity: requested upper bound of resident sessions (the memory plan may keep fewer).
      weights_seed: seed of the random-init weights.
      noise_seed: mixed into session ids to derive per-session noise seeds.
    """

    schedule: FewStepSchedule = FewStepSchedule()
    session_capacity: int = 3
    weights_seed: int = 0
    noise_seed: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.schedule, FewStepSchedule):
            raise TypeError(f"{name} schedule must be a FewStepSchedule, got {type(self.schedule).__name__}")
        check_positive_int(f"{name} session_capacity", self.session_capacity)
        check_non_negative_int(f"{name} weights_seed", self.weights_seed)
        check_non_negative_int(f"{name} noise_seed", self.noise_seed)


@dataclasses.dataclass(frozen=True)
class PipelineSession:
    """Model-owned state of one session that every reference pipeline keeps (host bookkeeping + device arrays).

    A frozen value: a pipeline builds the next one with ``dataclasses.replace`` and stores it in
    its ``_sessions`` only once the device work that produced the new fields has returned, so a
    call that fails leaves the stored value as it was, and a fork may share the value itself.

    Attributes:
      key: the session's noise key (root of :func:`noise_key`'s tree).
      prompt: the current text prompt.
      block_index: blocks this session generated.
    """

    key: jax.Array
    prompt: str
    block_index: int = 0

    #: Fields that hold a nested dataclass (exported as a dict of its fields): ``{field: class}``.
    nested_fields: ClassVar[Mapping[str, type]] = {}
    #: Fields whose arrays a pipeline program donates (updates in place): a fork gets its own copy of these
    #: (every other field a fork shares with its source, the value and its arrays).
    donated_fields: ClassVar[tuple[str, ...]] = ()

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        """Every device array the session holds (``None`` for empty slots): what ``model_owned_bytes`` counts."""
        return (self.key,)

    def to_tree(self) -> dict[str, Any]:
        """The session as a dict tree of its fields (nested dataclasses as dicts): what export returns."""
        def field_value(value: Any) -> Any:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return value
        return {f.name: field_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_tree(cls, tree: Any, shapes: Mapping[str, tuple[int, ...]], device: jax.Device) -> PipelineSession:
        """The session a :meth:`to_tree` tree describes, validated field by field (ValueError otherwise).

        Every field must be present with the kind its annotation names: the noise key a
        scalar key of :data:`NOISE_PRNG_IMPL`; other arrays ``float32`` (with the shape in
        ``shapes`` where one is given, keyed ``"field"`` or ``"field.subfield"``); ints
        non-negative; strings strings. Arrays are committed to ``device``.
        """
        return cls(**_checked_fields(cls, tree, shapes, device, prefix=""))


def _checked_fields(cls: type, tree: Any, shapes: Mapping[str, tuple[int, ...]], device: jax.Device, prefix: str
                    ) -> dict[str, Any]:
    names = [f.name for f in dataclasses.fields(cls)]
    where = f"{cls.__name__} state" + (f" {prefix[:-1]}" if prefix else "")
    if not isinstance(tree, dict) or sorted(tree) != sorted(names):
        got = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise ValueError(f"{where} must be a dict with the fields {sorted(names)}, got {got}")
    nested = getattr(cls, "nested_fields", {})
    out = {}
    for f in dataclasses.fields(cls):
        value, name, annotation = tree[f.name], prefix + f.name, str(f.type)
        if value is None and "None" in annotation:
            out[f.name] = None
        elif f.name in nested:
            out[f.name] = nested[f.name](**_checked_fields(nested[f.name], value, shapes, device, f"{name}."))
        elif "jax.Array" in annotation:
            out[f.name] = _checked_array(name, value, shapes.get(name), device)
        elif annotation.startswith("int"):
            if not is_integer(value) or int(value) < 0:
                raise ValueError(f"{where}: {f.name} must be a non-negative integer, got {value!r}")
            out[f.name] = int(value)
        elif annotation.startswith("str"):
            if not isinstance(value, str):
                raise ValueError(f"{where}: {f.name} must be a string, got {type(value).__name__}")
            out[f.name] = value
        else:  # pragma: no cover - a session field of a kind this check does not know
            raise TypeError(f"{where}: cannot validate field {f.name!r} annotated {annotation!r}")
    return out


def _checked_array(name: str, value: Any, shape: tuple[int, ...] | None, device: jax.Device) -> jax.Array:
    if not isinstance(value, jax.Array):
        raise ValueError(f"session state {name} must be a jax array, got {type(value).__name__}")
    if name == "key":
        if not jnp.issubdtype(value.dtype, jax.dtypes.prng_key) or value.shape != () or \
                str(jax.random.key_impl(value)) != NOISE_PRNG_IMPL:
            raise ValueError(f"session state key must be a scalar {NOISE_PRNG_IMPL!r} PRNG key, got {value.dtype}"
                             f"{list(value.shape)}")
    elif value.dtype != jnp.float32 or (shape is not None and tuple(value.shape) != tuple(shape)):
        want = "float32" + (str(list(shape)) if shape is not None else "")
        raise ValueError(f"session state {name} must be {want}, got {value.dtype}{list(value.shape)}")
    return jax.device_put(value, device)


def with_tick_metadata(output: Any, request: DiffusionRequest) -> Any:
    """``output`` with the chunk metadata of the request's typed tick, when it carried one.

    The realtime control plane checks that a tick's output reports exactly
    ``ARDiffusionChunkMetadata.from_tick(tick)``: a NamedTuple output gets it in its
    ``ar_diffusion`` field, a mapping output under the key ``"ar_diffusion"``. A request
    without a tick gets the output unchanged.
    """
    tick = ARDiffusionTickRequest.from_extra_args(request.extra_args)
    if tick is None:
        return output
    metadata = ARDiffusionChunkMetadata.from_tick(tick)
    if isinstance(output, Mapping):
        return {**output, "ar_diffusion": metadata}
    return output._replace(ar_diffusion=metadata)


def weights_fingerprint(params: Any) -> str:
    """SHA-256 hex digest of a parameter tree: each leaf's dtype, shape and bytes, in the tree's fixed order.

    Equal weights give equal digests in any process (the order is the tree's flattening
    order, sorted by key for flax state); a changed value, dtype or shape changes it.
    """
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        array = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{array.dtype.name}{list(array.shape)};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def mesh_placement(mesh: jax.sharding.Mesh, config: CausalDiTConfig
                   ) -> Any:  # Callable[[PartitionSpec], NamedSharding]
    """Where a parameter with a partition annotation goes on ``mesh``: the model's placement rule.

    Attention heads, the FFN hidden layer and the q/k norms split over ``"tp"`` (the
    ``CausalDiT`` annotations); annotated axes the mesh does not split are replicated.
    ValueError when the heads or the FFN do not split over the mesh's ``tp``.
    """
    tp = int(mesh.shape.get("tp", 1))
    for what, size in (("attention heads", config.num_heads), ("FFN hidden units", config.ffn_dim)):
        if size % tp:
            raise ValueError(f"cannot split {size} {what} over tp={tp}")
    axes = {name for name, size in mesh.shape.items() if size > 1}

    def placement(spec: jax.sharding.PartitionSpec) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            *(name if name in axes else None for name in spec)))

    return placement


class BoundStateMixin:
    """DreamZero-style binding: one state at a time, for the invocation only, never retained.

    The state lives in ``self._ar_state`` only inside the ``with`` block; the runner checks
    after the block that no attribute still refers to it.
    """

    _ar_state: ARDiffusionKVState | None = None
    _ar_batch: ARDiffusionKVBatch | None = None

    @contextlib.contextmanager
    def bind_ar_diffusion_batch(self, batch: ARDiffusionKVBatch) -> Iterator[None]:
        """Bind a batched tick's KV (``SupportsARDiffusionBatch``) for one ``forward_batch``; never retained."""
        if self._ar_state is not None or self._ar_batch is not None:
            raise RuntimeError(f"{type(self).__name__} already has a bound AR-Diffusion state or batch; bindings do "
                               "not nest")
        self._ar_batch = batch
        try:
            yield
        finally:
            self._ar_batch = None

    def _bound_batch(self) -> ARDiffusionKVBatch:
        batch = self._ar_batch
        if batch is None:
            raise RuntimeError(f"{type(self).__name__}.forward_batch must run inside bind_ar_diffusion_batch (drive "
                               "the pipeline through ARDiffusionEngine.generate_batch)")
        return batch

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: ARDiffusionKVState) -> Iterator[None]:
        if self._ar_state is not None or self._ar_batch is not None:
            raise RuntimeError(
                f"{type(self).__name__} already has a bound AR-Diffusion state (session "
                f"{self._ar_state.session_id!r}); bindings do not nest")
        if state.session_id != session_id:
            raise ValueError(f"bound state belongs to session {state.session_id!r}, not {session_id!r}")
        self._ar_state = state
        try:
            yield
        finally:
            self._ar_state = None

    def _bound_state(self) -> ARDiffusionKVState:
        state = self._ar_state
        if state is None:
            raise RuntimeError(
                f"{type(self).__name__}.forward/step must run inside bind_ar_diffusion_state (drive the pipeline "
                "through ARDiffusionEngine)")
        return state


class PipelineBase(BoundStateMixin, abc.ABC):
    """Weights, device, the split ``(graphdef, params)`` and the per-session model state of a pipeline.

    A subclass provides:

    * ``pipeline_config_type``: its :class:`PipelineConfigBase` subclass (``None`` selects
      ``pipeline_config_type()``);
    * ``session_type``: its :class:`PipelineSession` subclass;
    * ``kv_spec_for(config, pipeline_config=None)`` (static: the spec without weights),
      ``validate_ar_diffusion_request`` (every host-side check of a request) and ``forward``;
    * optionally ``check_compatible(config, pipeline_config)``, run before any weight is built.

    A subclass missing one of them fails at construction with a TypeError naming it.

    Every array a pipeline passes into its jitted functions is committed to ``device``:
    jax keys its compile cache on whether each argument is committed, so mixing fresh
    (uncommitted) arrays with outputs of earlier calls (committed, because the KV pools are)
    would compile the same program twice.
    """

    pipeline_config_type: ClassVar[type[PipelineConfigBase]]
    session_type: ClassVar[type[PipelineSession]]

    def __init__(self, config: CausalDiTConfig | str, pipeline_config: PipelineConfigBase | None = None, *,
                 modules: DiTModules | None = None, device: jax.Device | None = None) -> None:
        cls = self._checked_subclass()
        config = resolve_config(config)
        pipeline_config = cls.pipeline_config_type() if pipeline_config is None else pipeline_config
        if not isinstance(pipeline_config, cls.pipeline_config_type):
            raise TypeError(f"pipeline_config must be a {cls.pipeline_config_type.__name__}, got "
                            f"{type(pipeline_config).__name__}")
        # Validate the pairing before paying for weights.
        cls.check_compatible(config, pipeline_config)
        self.config = config
        self.pipeline_config = pipeline_config
        if modules is None:
            modules = cls.create_modules(config, pipeline_config.weights_seed)
        elif not isinstance(modules, nnx.Module) or not isinstance(getattr(modules, "transformer", None), CausalDiT) \
                or modules.transformer.config != config:
            raise ValueError("modules must hold a transformer built for the same CausalDiTConfig (e.g. another "
                             "pipeline's .modules: share them between pipelines of one config to skip "
                             "re-initialisation)")
        self.modules = modules
        self.device = jax.devices()[0] if device is None else device
        # Split once; jitted entry points take (graphdef, params) and merge inside.
        graphdef, params = nnx.split(modules)
        self._graphdef = graphdef
        self._params = jax.device_put(params, self.device)
        self._weights_fingerprint: str | None = None  # computed on first use (a session saved or loaded)
        self._ar_state = None
        # Model-owned per-session state (noise key, prompt, latents), keyed by session id.
        self._sessions: dict[str, Any] = {}

    def ar_diffusion_compile_twin(self) -> PipelineBase:
        """A pipeline that shares this one's weights, configs and device but none of its sessions.

        The background bucket compiler (``EngineConfig(batch_compile="background")``) runs its
        warmup batches on a twin bound to pools of the same layout, outside the serving
        runner's lock: the twin's jitted calls have the same static arguments and shapes, so
        they build exactly the programs the serving pipeline then runs, while its players play.
        Everything a forward writes on the instance (the bound state, the per-session model
        state, in-flight data) is the twin's own.
        """
        twin = copy.copy(self)  # one shallow copy: weights and caches of prompts are shared, read-only
        twin._sessions = {}
        twin._ar_state = None
        twin._ar_batch = None
        return twin

    @classmethod
    def create_modules(cls, config: CausalDiTConfig, seed: int) -> nnx.Module:
        """Random-init weights of ``config`` (the transformer and what else the pipeline computes with)."""
        return DiTModules.create(config, seed)

    @classmethod
    def _checked_subclass(cls) -> type[PipelineBase]:
        missing = [f"{name} (a {base.__name__} subclass)"
                   for name, base in (("pipeline_config_type", PipelineConfigBase), ("session_type", PipelineSession))
                   if not (isinstance(getattr(cls, name, None), type) and issubclass(getattr(cls, name), base))]
        if missing:
            raise TypeError(f"{cls.__name__} must set the class attribute(s) {', '.join(missing)} that "
                            "PipelineBase builds on")
        return cls

    # -- what a pipeline provides ---------------------------------------------------------------
    @staticmethod
    @abc.abstractmethod
    def kv_spec_for(config: CausalDiTConfig, pipeline_config: Any = None) -> ARDiffusionKVCacheSpec:
        """The spec a pipeline of ``config`` reports (no weights needed: usable for any size)."""

    @abc.abstractmethod
    def validate_ar_diffusion_request(self, session_id: str, request: DiffusionRequest) -> None:
        """Every host-side check of ``request`` (the runner calls it before touching any session)."""

    @abc.abstractmethod
    def forward(self, request: DiffusionRequest) -> Any:
        """One request on the bound session."""

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: Any) -> None:
        """ValueError if ``config`` cannot carry this pipeline with ``pipeline_config`` (no weights needed)."""

    # -- shared behaviour -------------------------------------------------------------------------
    @property
    def transformer(self) -> CausalDiT:
        return self.modules.transformer

    @property
    def schedule(self) -> FewStepSchedule:
        return self.pipeline_config.schedule

    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self.kv_spec_for(self.config, self.pipeline_config)

    # The runtime released the session's KV already; drop what the pipeline owns for it.
    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Sessions with model-owned state."""
        return tuple(self._sessions)

    # -- SupportsARDiffusionWeightsFingerprint: session files name the weights they were saved under --
    def ar_diffusion_weights_fingerprint(self) -> str:
        """SHA-256 of the parameters this pipeline computes with (:func:`weights_fingerprint`), hashed once.

        Lazily: the first save or load pays one copy of the weights to the host; a pipeline
        that never saves or loads a session pays nothing. Sharding the model does not change
        the values, so the digest stays valid.
        """
        if self._weights_fingerprint is None:
            self._weights_fingerprint = weights_fingerprint(self._params)
        return self._weights_fingerprint

    # -- SupportsARDiffusionMesh: one replica on a jax.sharding.Mesh ---------------------------------
    def shard_ar_diffusion_model(self, mesh: Any) -> None:
        """Place the weights on ``mesh`` by their annotations; inputs and session state replicated.

        Attention heads, the FFN hidden layer and the q/k norms split over ``"tp"`` (the
        ``CausalDiT`` annotations; a mesh without ``"tp"`` replicates them), everything else
        is replicated. Called by the runner at load (``EngineConfig(mesh=...)``); raises
        ValueError, changing nothing, when the model's heads or FFN do not split over ``tp``.
        """
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if self._sessions:
            raise RuntimeError(f"{type(self).__name__}: shard the model before any session runs")
        try:
            placement = mesh_placement(mesh, self.config)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__} {error}") from None
        specs = nnx.get_partition_spec(self._params)
        shardings = jax.tree.map(placement, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        self._params = jax.device_put(self._params, shardings)
        self.device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    # -- SupportsARDiffusionSessionExport: the runtime offloads, saves and restores sessions ------------
    def export_ar_diffusion_session(self, session_id: str) -> dict[str, Any]:
        """Move a session's model state out (``{}`` when it has none); the pipeline forgets it."""
        session = self._sessions.pop(session_id, None)
        return {} if session is None else session.to_tree()

    def import_ar_diffusion_session(self, session_id: str, state: Any) -> None:
        """Take back a state :meth:`export_ar_diffusion_session` returned; validated before anything changes."""
        if session_id in self._sessions:
            raise ValueError(f"{type(self).__name__} already holds model state for session {session_id!r}")
        if isinstance(state, dict) and not state:
            return
        self._sessions[session_id] = self.session_type.from_tree(state, self._session_shapes(), self.device)

    def fork_ar_diffusion_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        """Give ``new_id`` the model state ``source_id`` has now (none if it has none); arrays shared, not copied.

        Sessions are frozen values, so the fork shares the source's value (every field and its
        arrays), except the fields a program donates (``PipelineSession.donated_fields``: the
        VAE's streaming decode and encode caches, Matrix-Game's action ring), which the fork gets
        a device copy of, since the first of the two sessions to run would otherwise delete the
        other's; ``noise_seed`` replaces the noise key with a fresh one. Nothing is stored under
        ``new_id`` unless every step succeeded.
        """
        if new_id in self._sessions:
            raise ValueError(f"{type(self).__name__} already holds model state for session {new_id!r}")
        if noise_seed is not None and (not is_integer(noise_seed) or not 0 <= int(noise_seed) < 2**31):
            raise ValueError(f"noise_seed must be an integer in [0, 2**31) (as request seeds) or None, "
                             f"got {noise_seed!r}")
        session = self._sessions.get(source_id)
        if session is None:
            return
        changed = {name: jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, value)
                   for name in type(session).donated_fields if (value := getattr(session, name)) is not None}
        if noise_seed is not None:
            changed["key"] = new_session_key(int(noise_seed), self.device)
        self._sessions[new_id] = dataclasses.replace(session, **changed) if changed else session

    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the session's float arrays, for import validation (``"field"`` or ``"field.subfield"``)."""
        return {}

    def model_owned_bytes(self, session_id: str) -> int:
        """Device bytes this pipeline holds for ``session_id`` right now (<= the declared bound)."""
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        return sum(device_bytes(array) for array in session.device_arrays() if array is not None)

    def _check_prompt_and_seed(self, session_id: str, request: DiffusionRequest, prompt: Any) -> str | None:
        """The checks every pipeline runs on a request that may start a session: prompt and seed.

        Returns the prompt (``None`` keeps the session's current one). A prompt is required
        when the session has no model state yet, i.e. on its first request and after an
        eviction or reset.
        """
        name = type(self).__name__
        if prompt is not None:
            check_prompt(f"{name} prompt", prompt)
        elif session_id not in self._sessions:
            raise ValueError(
                f"{name} session {session_id!r} has no prompt yet: its first request needs one (the session may "
                "have been evicted or reset)")
        if request.inputs.get("seed") is not None:
            check_seed(request.inputs["seed"])
        return prompt

    def _create_session(self, session_id: str, request: DiffusionRequest, prompt: str | None) -> Any:
        """The model state of a new session (seed: ``inputs["seed"]`` or the id), not registered yet: the caller
        stores it once the call's device work has returned."""
        if prompt is None:  # _check_prompt_and_seed refuses this for a session without state
            raise RuntimeError(f"{type(self).__name__} session {session_id!r} needs a prompt to start")
        seed = session_seed(session_id, request.inputs, self.pipeline_config.noise_seed)
        return self.session_type(key=new_session_key(seed, self.device), prompt=prompt)

    def _staged_session(self, session_id: str, request: DiffusionRequest, prompt: str | None) -> Any:
        """A session's model state for a batched tick to build on (a new one if it has none).

        ``forward_batch`` is all or nothing (``SupportsARDiffusionBatch``): it builds new values
        from these (sessions are frozen: ``dataclasses.replace``) and hands :meth:`_publish_staged`
        of them to ``batch.defer_publish``: the runner installs them only once it has awaited the
        batch's device work, so a batch that raises, or fails when awaited, leaves
        ``self._sessions`` as it was.
        """
        session = self._sessions.get(session_id)
        return self._create_session(session_id, request, prompt) if session is None else session

    def _publish_staged(self, sessions: Mapping[str, Any]) -> None:
        """Install the staged sessions of a batched tick the runner awaited (``batch.defer_publish``)."""
        self._sessions.update(sessions)

    def _text_kv(self, prompt: str) -> tuple[jax.Array, jax.Array]:
        """The per-layer text cross-attention K/V of ``prompt``: ``([L, N, H, D], [L, N, H, D])``."""
        ids = self._to_device(prompt_ids(prompt, self.config.text_len))
        return text_cross_kv(self._graphdef, self._params, ids)

    def _to_device(self, array: Any) -> jax.Array:
        return jax.device_put(np.asarray(array), self.device)


def jitted_encode_image(encoder: Any) -> Any:
    """``encoder.encode_image`` compiled once, an NNX module split so its weights are arguments (a jit closing
    over the module would bake them into the program as constants); any other encoder is called as it is."""
    if not isinstance(encoder, nnx.Module):
        return encoder.encode_image
    graphdef, params = nnx.split(encoder)

    @jax.jit
    def encode(params: Any, image: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params).encode_image(image)

    return lambda image: encode(params, image)
