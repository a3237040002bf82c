"""``CFGWorldActionPipeline``: a DreamZero-style world-action pipeline with classifier-free guidance.

Correspondence to DreamZero's adapter in vLLM-Omni (the runtime side it relies on is
described in ``docs/reference_behaviour.md``):

============================================  =================================================
DreamZero (``DreamZeroPipeline``)              here
============================================  =================================================
branches ``("positive", 0)``, ``("negative",   the same; ``CFGPipelineConfig.cfg_parallel_layout``
0 if CFG-parallel world size >= 2 else 1)``    selects the shared-index layout (see below)
``_kv_get(state, is_negative, seq_len,         the shared loop (``ardiff_jax.models._loop``) takes
update_kv_cache)``, ``_kv_commit``,            and commits the paged views; :meth:`_kv_get_cross`,
``_kv_get_cross``, ``_kv_populate_cross``      :meth:`_kv_populate_cross`: boolean -> branch names
``"text"`` (text_len) + ``"image"`` (257)      ``"text"`` (``config.text_len``) + ``"image"``
cross caches                                   (``config.image_len``; none when 0)
action/state register tokens in scratch        ``num_register_tokens`` = actions + state tokens,
(``num_action_per_block + num_state_per_      declared as ``max_scratch_tokens_per_branch`` and
block``), never cached                         passed as ``extra_k/extra_v``
prefill: observed frames committed at          :meth:`forward` commits the observation's latent
timestep 0, then the denoise loop with         frames at t = 0 on both branches, then denoises the
``update_kv_cache=False``                      next block non-committing with CFG (:meth:`_calls`)
CFG ``neg + scale * (pos - neg)``; actions     video flow ``neg + scale * (pos - neg)``; action
use the positive branch only                   flow from the positive branch only
prompt change -> "session" reset               prompt change -> ``state.reset()`` + fresh model
(``state.reset()``)                            state (equal to a new session with that prompt)
warmup: ``1 + ceil(max(0, W - 1) / F)``        :meth:`ar_diffusion_warmup_requests`: the same count,
requests, 1 observation frame then 4           one frame for request 0 (``reset=True``), four after
robot observation keys (3 camera views,        :class:`ObservationSchema`: the same keys; views are
joint/cartesian/gripper)                       stitched 2x2 and encoded by a stand-in VAE
output ``{"actions", "video"}``                the same
============================================  =================================================

Not carried over: DreamZero's model-detected window resets (``reset(keep_cross_attention=
("text",))`` at the attention-window boundary); this pipeline uses the runtime's sliding
window + sink instead.

CFG-parallel layout: with ``cfg_parallel_layout=True`` both branches report
``local_index=0``. That layout is only valid when each branch runs on its own worker (the
positive half on one, the negative on the other): the branches then share one
worker-local storage slot that only one of them ever uses. On a single worker both
branches commit into the same run and the runtime refuses the second commit with a
RuntimeError (``share local_index``), failing the request closed. Use the default
(positive 0, negative 1) in-process.

Stand-ins for what cannot be downloaded: the three camera views are stitched 2x2
(``[[exterior 0, exterior 1], [wrist, black]]``, as DreamZero stitches three 176x320
views into 352x640) and encoded by a fixed "VAE" (8x8 average pooling, 4x temporal
pooling after the first frame as Wan's causal VAE does, a fixed random 3 -> C channel
map); image tokens are the first observed latent frame's patch features resampled to
``image_len`` tokens (DreamZero uses CLIP features of the conditioning image).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checks import check_positive_int
from ardiff_jax.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_jax.models._common import (
    DiTModules,
    PipelineBase,
    PipelineConfigBase,
    PipelineSession,
    check_prompt,
    dit_kv_spec,
    image_cross_kv,
    nbytes,
    noise_key,
    renoise,
    step_noise_key,
    with_tick_metadata,
)
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._dit import patchify
from ardiff_jax.models._loop import (
    Denoiser,
    Lane,
    commit_pass,
    commit_together,
    denoise,
)
from ardiff_jax.types import DiffusionRequest

__all__ = ["CFGWorldActionPipeline", "CFGPipelineConfig", "ObservationSchema", "cfg_step", "cfg_commit"]

POSITIVE = "positive"
NEGATIVE = "negative"
TEXT = "text"
IMAGE = "image"

VIEW_KEYS = (
    "observation/exterior_image_0_left",
    "observation/exterior_image_1_left",
    "observation/wrist_image_left",
)
STATE_KEYS = (
    ("observation/joint_position", 7),
    ("observation/cartesian_position", 6),
    ("observation/gripper_position", 1),
)
#: Pixel frames per latent frame after the first (Wan's causal VAE: 1 + 4k -> 1 + k).
TEMPORAL_STRIDE = 4


@dataclasses.dataclass(frozen=True)
class ObservationSchema:
    """The robot observation this pipeline accepts (DreamZero's DROID keys).

    * three camera views (:data:`VIEW_KEYS`), ``uint8[view_height, view_width, 3]`` or
      ``uint8[n, view_height, view_width, 3]``, the same ``n`` for all views, where ``n`` is 1
      or a multiple of 4 (``n / 4`` latent frames; one frame gives one latent frame);
    * robot state (:data:`STATE_KEYS`): joint position (7), cartesian position (6), gripper (1);
    * optional ``"prompt"``: used when the request has no ``prompt``.

    The 2x2 stitch of the views is ``latent_height * 8`` x ``latent_width * 8`` pixels, so a
    view is ``4 * latent_height`` x ``4 * latent_width``.
    """

    view_height: int
    view_width: int

    @classmethod
    def for_config(cls, config: CausalDiTConfig) -> ObservationSchema:
        return cls(view_height=4 * config.latent_height, view_width=4 * config.latent_width)

    @property
    def state_dim(self) -> int:
        return sum(size for _, size in STATE_KEYS)

    def example(self, num_frames: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
        """A valid observation with ``num_frames`` pixel frames (warmup and tests)."""
        rng = np.random.default_rng(seed)
        obs: dict[str, np.ndarray] = {
            key: rng.integers(0, 256, (num_frames, self.view_height, self.view_width, 3), dtype=np.uint8)
            for key in VIEW_KEYS
        }
        for key, size in STATE_KEYS:
            obs[key] = rng.uniform(-1.0, 1.0, (size,)).astype(np.float32)
        return obs

    def validate(self, observation: Any) -> tuple[list[np.ndarray], np.ndarray, int]:
        """``(views uint8[n, Hv, Wv, 3] x 3, state f32[14], n)``; ValueError naming the bad field."""
        if not isinstance(observation, Mapping):
            raise ValueError(
                f"CFGWorldActionPipeline needs inputs['observation'] (a mapping with {list(VIEW_KEYS)} and "
                f"{[key for key, _ in STATE_KEYS]}), got {type(observation).__name__}")
        views = []
        for key in VIEW_KEYS:
            if key not in observation:
                raise ValueError(f"observation is missing {key!r}")
            view = np.asarray(observation[key])
            if view.ndim == 3:
                view = view[None]
            if view.dtype != np.uint8 or view.shape[1:] != (self.view_height, self.view_width, 3):
                raise ValueError(
                    f"observation {key!r} must be uint8[{self.view_height}, {self.view_width}, 3] or "
                    f"uint8[n, {self.view_height}, {self.view_width}, 3], got {view.dtype}{list(view.shape)}")
            views.append(view)
        frames = {view.shape[0] for view in views}
        if len(frames) != 1:
            raise ValueError(f"observation views must have the same number of frames, got {sorted(frames)}")
        num_frames = frames.pop()
        if num_frames != 1 and num_frames % TEMPORAL_STRIDE:
            raise ValueError(f"observation frames must be 1 or a multiple of {TEMPORAL_STRIDE}, got {num_frames}")
        state = []
        for key, size in STATE_KEYS:
            if key not in observation:
                raise ValueError(f"observation is missing {key!r}")
            value = np.asarray(observation[key], dtype=np.float32).reshape(-1)
            if value.shape != (size,) or not np.isfinite(value).all():
                raise ValueError(f"observation {key!r} must be {size} finite floats, got {value.shape}")
            state.append(value)
        return views, np.concatenate(state), num_frames

    @staticmethod
    def latent_frames(num_frames: int) -> int:
        return 1 if num_frames == 1 else num_frames // TEMPORAL_STRIDE


class _ObservationEncoder:
    """Stand-in VAE (host numpy, deterministic): stitch 2x2, 8x8 average pool, 4x temporal pool, 3 -> C map."""

    def __init__(self, config: CausalDiTConfig, seed: int) -> None:
        self._config = config
        rng = np.random.default_rng(seed)
        self._mix = (rng.standard_normal((3, config.latent_channels)) / math.sqrt(3)).astype(np.float32)

    def __call__(self, views: list[np.ndarray]) -> np.ndarray:
        """Three ``uint8[n, Hv, Wv, 3]`` views -> ``f32[n_latent, C, H, W]``."""
        cfg = self._config
        n, hv, wv, _ = views[0].shape
        stitched = np.zeros((n, 2 * hv, 2 * wv, 3), np.float32)
        stitched[:, :hv, :wv] = views[0]
        stitched[:, :hv, wv:] = views[1]
        stitched[:, hv:, :wv] = views[2]
        pixels = stitched / 127.5 - 1.0
        pooled = pixels.reshape(n, cfg.latent_height, 8, cfg.latent_width, 8, 3).mean(axis=(2, 4))
        if n > 1:
            pooled = pooled.reshape(n // TEMPORAL_STRIDE, TEMPORAL_STRIDE, *pooled.shape[1:]).mean(axis=1)
        latents = pooled @ self._mix  # [n_lat, H, W, C]
        return np.ascontiguousarray(latents.transpose(0, 3, 1, 2))


def image_features(config: CausalDiTConfig, latent_frame: np.ndarray) -> np.ndarray:
    """``f32[C, H, W]`` -> ``f32[image_len, patch_dim]``: patch features resampled along the token axis."""
    feats = patchify(np.asarray(latent_frame, np.float32)[None], config.patch_size)  # numpy: no device work
    tokens = feats.shape[0]
    where = np.linspace(0.0, tokens - 1, config.image_len)
    return np.stack([np.interp(where, np.arange(tokens), col) for col in feats.T], axis=1).astype(np.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CFGPipelineConfig(PipelineConfigBase):
    """Policy of :class:`CFGWorldActionPipeline`.

    Attributes:
      schedule: the denoising schedule (DreamZero runs 16 steps, ~4 with its DiT cache).
      session_capacity: requested upper bound of resident sessions.
      weights_seed, noise_seed: seeds of the random weights and of per-session noise.
      guidance_scale: CFG scale (DreamZero: 5.0).
      negative_prompt: text of the negative branch.
      num_state_tokens: register tokens carrying the robot state; the rest carry actions.
      action_dim: dimensions of one action (DROID: 7 joints + gripper).
      cfg_parallel_layout: both branches at ``local_index=0`` (one branch per worker only).

    The fields after ``noise_seed`` are keyword-only.
    """

    guidance_scale: float = 5.0
    negative_prompt: str = ""
    num_state_tokens: int = 1
    action_dim: int = 8
    cfg_parallel_layout: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        scale = self.guidance_scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise ValueError(f"CFGPipelineConfig guidance_scale must be a finite number, got {self.guidance_scale!r}")
        check_positive_int("CFGPipelineConfig num_state_tokens", self.num_state_tokens)
        check_positive_int("CFGPipelineConfig action_dim", self.action_dim)
        check_prompt("CFGPipelineConfig negative_prompt", self.negative_prompt)


def _register_features(config: CausalDiTConfig, actions: jax.Array, state_features: jax.Array) -> jax.Array:
    """``[A, action_dim]`` noisy actions + ``[S, register_dim]`` state -> ``[A + S, register_dim]``."""
    pad = config.register_dim - actions.shape[1]
    return jnp.concatenate([jnp.pad(actions, ((0, 0), (0, pad))), state_features])


def _cfg_step(
    graphdef: Any,
    params: Any,
    pos_attention: Any,  # SelfAttentionBackend of the positive branch
    neg_attention: Any,  # SelfAttentionBackend of the negative branch
    x_t: jax.Array,  # f32[f, C, H, W]
    a_t: jax.Array,  # f32[A, action_dim]
    state_features: jax.Array,  # f32[S, register_dim]
    t: jax.Array,  # f32[]
    sigma: jax.Array,  # f32[]
    sigma_next: jax.Array,  # f32[]
    session_key: jax.Array,
    block_index: jax.Array,  # i32[]
    step_index: jax.Array,  # i32[]
    frame_start: jax.Array,  # i32[]
    pos_cross: tuple[Any, Any],  # (text_kv, image_kv | None) of the positive branch
    neg_cross: tuple[Any, Any],
    guidance_scale: jax.Array,  # f32[]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    dit = modules.transformer
    registers = _register_features(dit.config, a_t, state_features)
    pos = dit(x_t, t, frame_start, pos_cross[0], pos_cross[1], registers, attention=pos_attention)
    neg = dit(x_t, t, frame_start, neg_cross[0], neg_cross[1], registers, attention=neg_attention)
    return _guided_update(x_t, a_t, pos.video, neg.video, pos.registers, sigma, sigma_next, session_key,
                          block_index, step_index, guidance_scale)


def _guided_update(
    x_t: jax.Array,  # f32[f, C, H, W]
    a_t: jax.Array,  # f32[A, action_dim]
    pos_video: jax.Array,  # f32[f, C, H, W]: the positive branch's flow
    neg_video: jax.Array,
    pos_registers: jax.Array,  # f32[R, register_dim]: the positive branch's register outputs
    sigma: jax.Array,
    sigma_next: jax.Array,
    session_key: jax.Array,
    block_index: jax.Array,
    step_index: jax.Array,
    guidance_scale: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The guidance combine and the step to ``sigma_next``: ``(x_next, x0, a_next, a0)``."""
    video_flow = neg_video + guidance_scale * (pos_video - neg_video)
    # DreamZero guides the video only; the action prediction comes from the positive branch.
    action_flow = pos_registers[: a_t.shape[0], : a_t.shape[1]]
    x0 = x_t - sigma * video_flow
    a0 = a_t - sigma * action_flow
    video_key, action_key = jax.random.split(step_noise_key(session_key, block_index, step_index))
    x_next = renoise(x0, sigma_next, jax.random.normal(video_key, x_t.shape, jnp.float32))
    a_next = renoise(a0, sigma_next, jax.random.normal(action_key, a_t.shape, jnp.float32))
    return x_next, x0, a_next, a0


def _cfg_commit(
    graphdef: Any,
    params: Any,
    attention: Any,  # SelfAttentionBackend of one branch
    latents: jax.Array,  # f32[n, C, H, W]: observed (clean) latent frames
    frame_start: jax.Array,  # i32[]
    text_kv: Any,  # [L, N, H, D] x 2
    image_kv: Any,  # [L, Ni, H, D] x 2 or None
) -> tuple[jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    out = modules.transformer(latents, jnp.float32(0.0), frame_start, text_kv, image_kv, None, attention=attention)
    return out.k, out.v


def _initial_noise(session_key: jax.Array, block_index: jax.Array, video_shape: tuple[int, ...],
                   action_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    video_key, action_key = jax.random.split(noise_key(session_key, block_index, 0))
    return (jax.random.normal(video_key, video_shape, jnp.float32),
            jax.random.normal(action_key, action_shape, jnp.float32))


def _branch_parallel(dit: Any, attention: Any, cursors: jax.Array, pos_cross: tuple[Any, Any],
                     neg_cross: tuple[Any, Any], *args: Any) -> Any:
    """``dit(*args, text_kv, image_kv, ..., attention=branch view)`` for both branches in one vmapped call.

    The branch axis is placed on the mesh's ``"cfg"`` axis: with the pools split
    branch-major over ``"cfg"`` (the runtime's layout), each device group runs its own
    branch over its own pages, and the attention never crosses groups
    (:func:`~ardiff_jax.kv.sharded_attention`'s batching rule).
    """
    mesh = attention.sharding.mesh
    on_groups = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cfg"))
    # Stacked inside the program: [2, L, N, H, D] per cache, positive first (image_kv may be None).
    cross = jax.tree.map(lambda p, n: jnp.stack([p, n]), pos_cross, neg_cross)
    cursors, cross = jax.lax.with_sharding_constraint((cursors, cross), on_groups)
    x_t, t, frame_start, registers = args

    def one_branch(cursor: jax.Array, text_kv: Any, image_kv: Any) -> Any:
        view = dataclasses.replace(attention, cursor=cursor)
        return dit(x_t, t, frame_start, text_kv, image_kv, registers, attention=view)

    return jax.vmap(one_branch)(cursors, *cross)


def _cfg_step_parallel(
    graphdef: Any,
    params: Any,
    attention: Any,  # PagedKVCaches of the positive branch (pools, layout, sharding)
    cursors: jax.Array,  # i32[2, 3]: positive, negative
    x_t: jax.Array,
    a_t: jax.Array,
    state_features: jax.Array,
    t: jax.Array,
    sigma: jax.Array,
    sigma_next: jax.Array,
    session_key: jax.Array,
    block_index: jax.Array,
    step_index: jax.Array,
    frame_start: jax.Array,
    pos_cross: tuple[Any, Any],  # (text_kv, image_kv | None) of the positive branch
    neg_cross: tuple[Any, Any],
    guidance_scale: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`_cfg_step` with both branches computed at once, one per ``"cfg"`` device group."""
    modules = nnx.merge(graphdef, params)
    dit = modules.transformer
    registers = _register_features(dit.config, a_t, state_features)
    out = _branch_parallel(dit, attention, cursors, pos_cross, neg_cross, x_t, t, frame_start, registers)
    # The guidance combine is the one exchange between the groups (video-sized).
    return _guided_update(x_t, a_t, out.video[0], out.video[1], out.registers[0], sigma, sigma_next, session_key,
                          block_index, step_index, guidance_scale)


def _cfg_commit_parallel(
    graphdef: Any,
    params: Any,
    attention: Any,
    cursors: jax.Array,  # i32[2, 3]
    latents: jax.Array,
    frame_start: jax.Array,
    pos_cross: tuple[Any, Any],
    neg_cross: tuple[Any, Any],
) -> tuple[jax.Array, jax.Array]:
    """:func:`_cfg_commit` of both branches at once: ``-> (k, v)`` each ``[2, L, n*T, H, D]``."""
    modules = nnx.merge(graphdef, params)
    out = _branch_parallel(modules.transformer, attention, cursors, pos_cross, neg_cross, latents, jnp.float32(0.0),
                           frame_start, None)
    return out.k, out.v


#: One CFG denoise step over both branches: ``-> (x_next, x0, a_next, a0)``.
cfg_step = jax.jit(_cfg_step, static_argnums=0)


def _cfg_step_batch(
    graphdef: Any,
    params: Any,
    pos_attention: Any,  # batched PagedKVCaches of the positive branch: cursor i32[B, 3 + K + W]
    neg_attention: Any,  # batched PagedKVCaches of the negative branch
    x_t: jax.Array,  # f32[B, f, C, H, W]
    a_t: jax.Array,  # f32[B, A, action_dim]
    state_features: jax.Array,  # f32[B, S, register_dim]
    t: jax.Array,  # f32[]
    sigma: jax.Array,  # f32[]
    sigma_next: jax.Array,  # f32[]
    session_keys: jax.Array,  # key[B]
    block_index: jax.Array,  # i32[B]
    step_index: jax.Array,  # i32[]
    frame_start: jax.Array,  # i32[B]
    pos_cross: tuple[Any, Any],  # stacked over B
    neg_cross: tuple[Any, Any],
    guidance_scale: jax.Array,  # f32[]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    dit = modules.transformer

    def both_branches(pos_att: Any, neg_att: Any, x: jax.Array, a: jax.Array, features: jax.Array, start: jax.Array,
                      pos_c: Any, neg_c: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        registers = _register_features(dit.config, a, features)
        pos = dit(x, t, start, pos_c[0], pos_c[1], registers, attention=pos_att)
        neg = dit(x, t, start, neg_c[0], neg_c[1], registers, attention=neg_att)
        return pos.video, neg.video, pos.registers

    pos_video, neg_video, pos_registers = jax.vmap(
        both_branches, in_axes=(pos_attention.vmap_axes(), neg_attention.vmap_axes(), 0, 0, 0, 0, 0, 0))(
        pos_attention, neg_attention, x_t, a_t, state_features, frame_start, pos_cross, neg_cross)
    # The combine and re-noise row by row: "rbg" draws under vmap differ from a lone session's.
    return jax.lax.map(
        lambda row: _guided_update(row[0], row[1], row[2], row[3], row[4], sigma, sigma_next, row[5], row[6],
                                   step_index, guidance_scale),
        (x_t, a_t, pos_video, neg_video, pos_registers, session_keys, block_index))


#: :func:`cfg_step` for a batch of sessions (sessions x both branches in one program): every
#: per-session argument has a leading axis ``B``; row ``i`` equals ``cfg_step`` on session ``i``.
cfg_step_batch = jax.jit(_cfg_step_batch, static_argnums=0)
#: The same with the branches on separate ``"cfg"`` device groups (one SPMD program).
cfg_step_parallel = jax.jit(_cfg_step_parallel, static_argnums=0)
cfg_commit_parallel = jax.jit(_cfg_commit_parallel, static_argnums=0)
#: The committing forward of observed frames on one branch (t = 0): ``-> (k, v)`` each ``[L, n*T, H, D]``.
cfg_commit = jax.jit(_cfg_commit, static_argnums=0)
initial_noise = jax.jit(_initial_noise, static_argnums=(2, 3))


@dataclasses.dataclass(frozen=True)
class _CFGSession(PipelineSession):
    last_video: jax.Array | None = None  # f32[f, C, H, W]
    last_actions: jax.Array | None = None  # f32[A, action_dim]

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        return (self.key, self.last_video, self.last_actions)


class CFGWorldActionPipeline(PipelineBase):
    """DreamZero-style world-action pipeline with positive/negative CFG KV branches.

    Args:
      config: a :class:`CausalDiTConfig` (with register tokens; image branch optional) or a
        preset name.
      pipeline_config: :class:`CFGPipelineConfig`.
      modules: weights to reuse (another pipeline's ``.modules`` of the same config).
      device: where inputs and weights live (default: the first device).

    Request: ``prompt`` (or ``observation["prompt"]``; required on a session's first
    request), ``inputs["observation"]`` per :class:`ObservationSchema`, optional
    ``inputs["seed"]`` for a new session. Output: ``{"actions": f32[A, action_dim],
    "video": f32[f, C, H, W]}``. See the module docstring for the DreamZero correspondence.
    """

    pipeline_config_type = CFGPipelineConfig
    session_type = _CFGSession
    pipeline_config: CFGPipelineConfig
    _sessions: dict[str, _CFGSession]

    def __init__(self, config: CausalDiTConfig | str = "tiny", pipeline_config: CFGPipelineConfig | None = None,
                 *, modules: DiTModules | None = None, device: jax.Device | None = None) -> None:
        super().__init__(config, pipeline_config, modules=modules, device=device)
        self.schema = ObservationSchema.for_config(self.config)
        self._encoder = _ObservationEncoder(self.config, self.pipeline_config.weights_seed + 1)
        self._negative_text_kv: tuple[jax.Array, jax.Array] | None = None

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: CFGPipelineConfig) -> None:
        """ValueError unless ``config`` has the action and state register tokens this pipeline needs."""
        if config.num_register_tokens <= pipeline_config.num_state_tokens:
            raise ValueError(
                f"CFGWorldActionPipeline needs action and state register tokens: num_register_tokens "
                f"({config.num_register_tokens}) must exceed num_state_tokens ({pipeline_config.num_state_tokens})")
        state_dim = sum(size for _, size in STATE_KEYS)
        if config.register_dim < max(state_dim, pipeline_config.action_dim):
            raise ValueError(
                f"CFGWorldActionPipeline register_dim ({config.register_dim}) must hold the robot state "
                f"({state_dim}) and one action ({pipeline_config.action_dim})")

    @property
    def num_action_tokens(self) -> int:
        return self.config.num_register_tokens - self.pipeline_config.num_state_tokens

    # -- capability ---------------------------------------------------------------------------
    @staticmethod
    def kv_spec_for(config: CausalDiTConfig, pipeline_config: CFGPipelineConfig | None = None
                    ) -> ARDiffusionKVCacheSpec:
        """The spec a pipeline of ``config`` reports (no weights needed); ValueError if they do not pair."""
        pipeline_config = CFGPipelineConfig() if pipeline_config is None else pipeline_config
        CFGWorldActionPipeline.check_compatible(config, pipeline_config)
        negative_index = 0 if pipeline_config.cfg_parallel_layout else 1
        cross = [ARDiffusionCrossAttentionKVSpec(TEXT, config.text_len)]
        if config.image_len:
            cross.append(ARDiffusionCrossAttentionKVSpec(IMAGE, config.image_len))
        return dit_kv_spec(
            config,
            kv_branches=(ARDiffusionKVBranchSpec(POSITIVE, 0), ARDiffusionKVBranchSpec(NEGATIVE, negative_index)),
            cross_attention=tuple(cross),
            session_capacity=pipeline_config.session_capacity,
            model_owned_bytes=CFGWorldActionPipeline.model_owned_bytes_bound(config, pipeline_config),
        )

    @staticmethod
    def model_owned_bytes_bound(config: CausalDiTConfig, pipeline_config: CFGPipelineConfig) -> int:
        """Upper bound of one session's device state: last video block, last actions, key."""
        actions = nbytes((config.num_register_tokens - pipeline_config.num_state_tokens, pipeline_config.action_dim))
        return nbytes(config.block_shape) + actions + 16

    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"last_video": tuple(self.config.block_shape),
                "last_actions": (self.num_action_tokens, self.pipeline_config.action_dim)}

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[DiffusionRequest]:
        """DreamZero's warmup: ``1 + ceil(max(0, window - 1) / frames_per_block)`` requests.

        Request 0 resets the session and carries one observation frame (the conditioning
        image); the later ones carry four frames each. Together they compile every program a
        rollout uses (1-frame commit, CFG step, text/image projections).
        """
        cfg = self.config
        count = 1 + math.ceil(max(0, cfg.window_frames - 1) / cfg.frames_per_block)
        for index in range(count):
            yield DiffusionRequest(
                f"ardiffusion-warmup-{index}", prompt="warmup",
                extra_args={"reset": index == 0, "session_id": session_id},
                inputs={"observation": self.schema.example(1 if index == 0 else TEMPORAL_STRIDE, seed=index)},
            )

    # -- DreamZero-style boolean -> branch helpers -------------------------------------------
    @staticmethod
    def _branch(is_negative: bool) -> str:
        return NEGATIVE if is_negative else POSITIVE

    def _kv_get_cross(self, state: Any, is_negative: bool) -> tuple[Any, Any]:
        branch = self._branch(is_negative)
        text = state.get_cross_attention_kv(branch, TEXT)
        image = state.get_cross_attention_kv(branch, IMAGE) if self.config.image_len else None
        return text, image

    def _kv_populate_cross(self, state: Any, session: _CFGSession, first_latent: np.ndarray) -> None:
        """Publish any missing text/image cache of both branches (one call per cache and branch)."""
        image_kv = None
        for is_negative in (False, True):
            branch = self._branch(is_negative)
            if not state.is_cross_attention_populated(branch, TEXT):
                text_k, text_v = self._branch_text_kv(session, is_negative)
                state.populate_cross_attention(branch, TEXT, zip(text_k, text_v, strict=True))
            if self.config.image_len and not state.is_cross_attention_populated(branch, IMAGE):
                if image_kv is None:
                    feats = self._to_device(image_features(self.config, first_latent))
                    image_kv = image_cross_kv(self._graphdef, self._params, feats)
                state.populate_cross_attention(branch, IMAGE, zip(*image_kv, strict=True))

    def _branch_text_kv(self, session: _CFGSession, is_negative: bool) -> tuple[jax.Array, jax.Array]:
        if is_negative:
            # The negative prompt is fixed per pipeline: project it once for all sessions.
            if self._negative_text_kv is None:
                self._negative_text_kv = self._text_kv(self.pipeline_config.negative_prompt)
            return self._negative_text_kv
        return self._text_kv(session.prompt)

    # -- forward ----------------------------------------------------------------------------------
    def _parse(self, session_id: str, request: DiffusionRequest) -> tuple[list[np.ndarray], np.ndarray, int,
                                                                          str | None]:
        observation = request.inputs.get("observation")
        views, robot_state, num_frames = self.schema.validate(observation)
        prompt = request.prompt if request.prompt is not None else observation.get("prompt")
        prompt = self._check_prompt_and_seed(session_id, request, prompt)
        latent_frames = self.schema.latent_frames(num_frames)
        if latent_frames > self.config.window_frames:
            raise ValueError(
                f"observation of {num_frames} frames encodes to {latent_frames} latent frames, more than the "
                f"window ({self.config.window_frames})")
        return views, robot_state, latent_frames, prompt

    def validate_ar_diffusion_request(self, session_id: str, request: DiffusionRequest) -> None:
        """Every host-side check of ``request`` (the one parser ``forward`` uses too), before any session changes."""
        self._parse(session_id, request)

    def _calls(self, lane: Lane, requests: Sequence[DiffusionRequest]
               ) -> tuple[list[dict[str, jax.Array]], dict[str, _CFGSession]]:
        """One CFG step per request on the lane's sessions: ``(outputs, each session's new model state)``.

        Per session: the checks (a changed prompt resets the session), the cross caches and the commit of the
        observation on both branches (:meth:`_commit_observation`); then the lane's denoising
        (:meth:`_denoise`). The caller installs the model state (:meth:`forward`) or stages it
        (:meth:`forward_batch`).
        """
        cfg, pc = self.config, self.pipeline_config
        sessions: dict[str, _CFGSession] = {}
        rows = []
        for request, state in zip(requests, lane.states, strict=True):
            session_id = state.session_id
            views, robot_state, _, prompt = self._parse(session_id, request)
            session = self._sessions.get(session_id)
            if session is not None and prompt is not None and prompt != session.prompt:
                # DreamZero's "session" reset on a prompt change: history and every cross cache go (the runtime
                # restores or releases the session if the call fails).
                state.reset()
                session = None
            if session is None:  # installed only by the caller, after the call
                session = self._create_session(session_id, request, prompt)
            sessions[session_id] = session
            latents = self._encoder(views)
            self._kv_populate_cross(state, session, latents[0])
            self._commit_observation(state, self._to_device(latents))
            block_index = np.int32(session.block_index)
            x, a = initial_noise(session.key, block_index, cfg.block_shape, (self.num_action_tokens, pc.action_dim))
            features = np.zeros((pc.num_state_tokens, cfg.register_dim), np.float32)
            features[:, : robot_state.shape[0]] = robot_state
            rows.append((x, a, self._to_device(features), session.key, block_index,
                         np.int32(state.adapter(POSITIVE).committed_frames), self._kv_get_cross(state, False),
                         self._kv_get_cross(state, True)))
        outputs = []
        for request, state, (video, actions) in zip(requests, lane.states, lane.unstack(self._denoise(lane, rows)),
                                                    strict=True):
            session = sessions[state.session_id]
            sessions[state.session_id] = dataclasses.replace(session, last_video=video, last_actions=actions,
                                                             block_index=session.block_index + 1)
            outputs.append(with_tick_metadata({"actions": actions, "video": video}, request))
        return outputs, sessions

    def forward(self, request: DiffusionRequest) -> dict[str, jax.Array]:
        """Commit the observation on both branches, then denoise the next block with CFG."""
        outputs, sessions = self._calls(Lane.single(self._bound_state()), [request])
        self._sessions.update(sessions)
        return outputs[0]

    def forward_batch(self, requests: Sequence[DiffusionRequest]) -> list[dict[str, jax.Array]]:
        """:meth:`forward` for each request's session, the denoise steps batched (``SupportsARDiffusionBatch``).

        The same code as :meth:`forward` on a batch lane: per session the prompt check (a changed
        prompt resets the session), the cross caches and the observation's commit on both branches;
        then every denoise step of every session and both branches is one program
        (:data:`cfg_step_batch`). Model state is staged and installed by the runner only once it
        has awaited the batch's device work (``batch.defer_publish``; all or nothing).
        """
        batch = self._bound_batch()
        outputs, staged = self._calls(Lane.batch(batch), requests)
        batch.defer_publish(functools.partial(self._publish_staged, staged),
                            [session.device_arrays() for session in staged.values()])
        return outputs

    @staticmethod
    def _cfg_parallel(view: Any) -> bool:
        """Whether a view's pools put the two branches on two ``"cfg"`` device groups (then: one call for both)."""
        return view.sharding is not None and view.sharding.cfg == 2

    def _on_cfg_groups(self) -> bool:
        """Whether the model sits on a mesh with two ``"cfg"`` device groups: the runtime splits the pools over the
        mesh the model is placed on (``EngineConfig(mesh=...)``; a program cannot mix a model and pools placed
        apart), so then the branches' pages are on one group each. Asked before a commit, when no view is in
        hand (:meth:`_cfg_parallel` asks a view)."""
        mesh = self.device.mesh if isinstance(self.device, jax.sharding.NamedSharding) else None
        return mesh is not None and int(mesh.shape.get("cfg", 1)) == 2

    def _commit_observation(self, state: Any, latents: jax.Array) -> None:
        """Prefill: the observed latent frames, clean (t = 0), committed on each branch."""
        lane = Lane.single(state)
        seq_len = latents.shape[0] * self.config.tokens_per_frame
        branches = (POSITIVE, NEGATIVE)
        starts = [np.int32(state.adapter(branch).committed_frames) for branch in branches]
        cross = [self._kv_get_cross(state, branch == NEGATIVE) for branch in branches]
        # Both branches commit the same observations, so they share a frame position.
        if self._on_cfg_groups() and starts[0] == starts[1]:
            def both(views: tuple[Any, Any]) -> tuple[tuple[tuple[jax.Array, jax.Array], ...], None]:
                pos, neg = views
                k, v = cfg_commit_parallel(self._graphdef, self._params, pos, np.stack([pos.cursor, neg.cursor]),
                                           latents, starts[0], cross[0], cross[1])
                return ((k[0], v[0]), (k[1], v[1])), None

            commit_together(lane, branches, seq_len, both)
            return
        for branch, start, (text_kv, image_kv) in zip(branches, starts, cross, strict=True):
            def forward(view: Any, start: Any = start, text_kv: Any = text_kv, image_kv: Any = image_kv
                        ) -> tuple[tuple[jax.Array, jax.Array], None]:
                return cfg_commit(self._graphdef, self._params, view, latents, start, text_kv, image_kv), None

            commit_pass(lane, branch, seq_len, forward)  # each view after the previous commit replaced the pools

    def _denoise(self, lane: Lane, rows: Sequence[tuple[Any, ...]]) -> tuple[jax.Array, jax.Array]:
        """The next video block and action chunk of the lane's sessions: the guided step in the shared loop
        (:func:`~ardiff_jax.models._loop.denoise`).

        ``rows``: per session ``(noise video, noise actions, state features, key, block index, start frame,
        positive cross K/V, negative cross K/V)``. Every step reads both branches without writing and runs
        one program: every row's two branches on a batch lane (:data:`cfg_step_batch`), a session's two
        branches in sequence (:data:`cfg_step`) or, with its pools on two ``"cfg"`` device groups, at once
        (:data:`cfg_step_parallel`). Returns ``(video, actions)`` of the last step: ``f32[f, C, H, W],
        f32[A, action_dim]``, with a leading bucket axis on a batch lane.
        """
        cfg = self.config
        x, a, features, keys, block_index, frame_start, pos_cross, neg_cross = lane.stack(rows)
        scale = np.float32(self.pipeline_config.guidance_scale)

        def step_program(views: tuple[Any, Any], sample: tuple[Any, ...], step: int) -> tuple[jax.Array, ...]:
            pos, neg = views
            t, sigma, sigma_next = self.schedule.step_args(step)
            args = (sample[0], sample[2], features, t, sigma, sigma_next, keys, block_index, np.int32(step),
                    frame_start, pos_cross, neg_cross, scale)
            # Looked up per call (module globals): tests wrap them.
            if self._cfg_parallel(pos):  # a batch view is never split: only a lone session's
                return cfg_step_parallel(self._graphdef, self._params, pos, np.stack([pos.cursor, neg.cursor]), *args)
            return lane.pick(cfg_step, cfg_step_batch)(self._graphdef, self._params, pos, neg, *args)

        denoiser = Denoiser(branches=(POSITIVE, NEGATIVE), seq_len=cfg.frames_per_block * cfg.tokens_per_frame,
                            evaluate=step_program, advance=lambda step, sample, outs, run: outs)
        # The carry is the step program's (x_next, x0, a_next, a0).
        _, x0, _, a0 = denoise(lane, denoiser, (x, None, a, None), range(self.schedule.num_steps))
        return x0, a0
