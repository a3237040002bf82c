"""Pieces both reference pipelines share: the few-step schedule, weights, binding, jitted projections.

Jit pattern (flax's "performance considerations"): the modules are split once with
``nnx.split``; every device entry point is a plain ``jax.jit`` of a module-level pure
function ``(graphdef, params, ...)`` that calls ``nnx.merge`` inside. ``graphdef`` is a
static argument; it is hashable and equal for equal configs, so the compile cache is
shared by every pipeline instance, session and fill level: one compile per shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.models._config import CausalDiTConfig, dit_preset
from ardiff_jax.models._dit import ByteTextEncoder, CausalDiT, tokenize_prompt

from ardiff_jax.capability import ARDiffusionKVCacheSpec

if TYPE_CHECKING:  # pragma: no cover
    from ardiff_jax.runtime._state import ARDiffusionKVState

__all__ = ["FewStepSchedule", "DiTModules", "text_cross_kv", "image_cross_kv", "block_noise", "session_seed",
           "resolve_config", "NOISE_PRNG_IMPL", "PipelineBase", "dit_kv_spec"]

#: PRNG implementation of the per-session noise keys. ``"rbg"`` (XLA's RngBitGenerator)
#: compiles about 4x faster than threefry on XLA:CPU (measured on the 2-core test machine:
#: a block's noise 0.27 s vs 2.0 s, the tiny world step 1.4 s vs 4.4 s). Its streams are
#: deterministic for a given key and backend, not bit-identical across backends.
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

    def __init__(self, config: CausalDiTConfig, seed: int) -> None:
        rngs = nnx.Rngs(jax.random.key(seed, impl=NOISE_PRNG_IMPL))
        self.transformer = CausalDiT(config, rngs=rngs)
        self.text_encoder = ByteTextEncoder(config, rngs=rngs)

    @classmethod
    def create(cls, config: CausalDiTConfig, seed: int) -> DiTModules:
        """Random-init weights with one compiled program instead of one per parameter.

        Eager construction compiles every initializer separately (47 programs, ~5 s for the
        tiny preset on 2 cores); one jitted init compiles once per (config, seed) and later
        pipelines of the same config reuse the executable (milliseconds).
        """
        graphdef = nnx.split(nnx.eval_shape(lambda: cls(config, seed)))[0]
        return nnx.merge(graphdef, _init_params(config, seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(config: CausalDiTConfig, seed: int) -> Any:
    return nnx.split(DiTModules(config, seed))[1]


# -- jitted pure entry points ---------------------------------------------------------------


def _text_cross_kv(graphdef: Any, params: Any, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    return modules.transformer.text_cross_kv(modules.text_encoder(token_ids))


def _image_cross_kv(graphdef: Any, params: Any, image_features: jax.Array) -> tuple[jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    return modules.transformer.image_cross_kv(image_features)


def _block_noise(session_key: jax.Array, block_index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    # Key tree: session key -> block index -> stream (0 = initial noise, i + 1 = re-noise after step i).
    return jax.random.normal(jax.random.fold_in(jax.random.fold_in(session_key, block_index), 0), shape, jnp.float32)


#: ``(graphdef, params, i32[N]) -> ([L, N, H, D], [L, N, H, D])``: a prompt's per-layer text K/V.
text_cross_kv = jax.jit(_text_cross_kv, static_argnums=0)
#: ``(graphdef, params, f32[Ni, patch_dim]) -> ([L, Ni, H, D], [L, Ni, H, D])``: image K/V.
image_cross_kv = jax.jit(_image_cross_kv, static_argnums=0)
#: ``(key, i32[], shape) -> f32[shape]``: the initial noise of a block.
block_noise = jax.jit(_block_noise, static_argnums=2)


def step_noise_key(session_key: jax.Array, block_index: jax.Array, step_index: jax.Array) -> jax.Array:
    """Key of the re-noise after denoise step ``step_index`` (traceable; used inside the jitted steps)."""
    return jax.random.fold_in(jax.random.fold_in(session_key, block_index), step_index + 1)


def session_seed(session_id: str, inputs: Mapping[str, Any], base_seed: int) -> int:
    """The noise seed of a new session: ``inputs["seed"]`` if given, else derived from the id.

    Deriving it from the session id (not from a global RNG) makes a session's outputs
    independent of which other sessions ran before it (isolation) and makes a reset
    session replay a fresh one exactly.
    """
    seed = inputs.get("seed")
    if seed is None:
        return (zlib.crc32(session_id.encode("utf-8")) ^ base_seed) & 0x7FFFFFFF
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**31:
        raise ValueError(f"inputs['seed'] must be an integer in [0, 2**31), got {seed!r}")
    return int(seed)


def prompt_ids(prompt: str, text_len: int) -> np.ndarray:
    return tokenize_prompt(prompt, text_len)


def new_session_key(seed: int, device: jax.Device) -> jax.Array:
    """The noise key of a new session, committed to ``device`` (see :data:`NOISE_PRNG_IMPL`)."""
    return jax.device_put(jax.random.key(seed, impl=NOISE_PRNG_IMPL), device)


class BoundStateMixin:
    """DreamZero-style binding: one state at a time, for the invocation only, never retained.

    The state lives in ``self._ar_state`` only inside the ``with`` block; the runner checks
    after the block that no attribute still refers to it.
    """

    _ar_state: ARDiffusionKVState | None = None

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: ARDiffusionKVState) -> Iterator[None]:
        if self._ar_state is not None:
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


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def nbytes(shape: tuple[int, ...], itemsize: int = 4) -> int:
    return int(np.prod(shape)) * itemsize


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


class PipelineBase(BoundStateMixin):
    """Weights, device and the split ``(graphdef, params)`` shared by the reference pipelines.

    Every array a pipeline passes into its jitted functions is committed to ``device``:
    jax keys its compile cache on whether each argument is committed, so mixing fresh
    (uncommitted) arrays with outputs of earlier calls (committed, because the KV pools are)
    would compile the same program twice.
    """

    def __init__(self, config: CausalDiTConfig | str, weights_seed: int, modules: DiTModules | None,
                 device: jax.Device | None) -> None:
        self.config = resolve_config(config)
        if modules is None:
            modules = DiTModules.create(self.config, weights_seed)
        elif not isinstance(modules, DiTModules) or modules.transformer.config != self.config:
            raise ValueError("modules must be DiTModules built for the same CausalDiTConfig (share them between "
                             "pipelines of one config to skip re-initialisation)")
        self.modules = modules
        self.device = jax.devices()[0] if device is None else device
        # Split once; jitted entry points take (graphdef, params) and merge inside.
        graphdef, params = nnx.split(modules)
        self._graphdef = graphdef
        self._params = jax.device_put(params, self.device)
        self._ar_state = None
        # Model-owned per-session state (noise key, prompt, latents), keyed by session id.
        self._sessions: dict[str, Any] = {}

    @property
    def transformer(self) -> CausalDiT:
        return self.modules.transformer

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

    def _to_device(self, array: Any) -> jax.Array:
        return jax.device_put(np.asarray(array), self.device)
