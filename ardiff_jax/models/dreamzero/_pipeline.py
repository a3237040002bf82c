"""``DreamZeroPipeline``: DreamZero's own inference loop, per robot session, on the paged runtime.

The seed's adapter with the real network: two KV branches (``"positive"``, ``"negative"``: the task
prompt and Wan's negative prompt), the action/state register as scratch, named cross-attention
caches (``"text"`` per branch, ``"image"``: the CLIP tokens), warmup. Per request, as the release's
``WANPolicyHead.lazy_joint_video_action``:

1. **Commit** the newly observed latent frames at ``t = 0`` to both branches (no register): the
   conditioning frame at frame 0 when an episode starts, the last ``frames_per_block`` observed latents
   otherwise, each with its slice of the image-to-video condition.
2. **Denoise** the next video chunk and action chunk together, reading the caches without writing them:
   16 flow-UniPC steps (order 2, shift 5, truncated integer timesteps), one solver for the video and one
   for the actions; the transformer only at the masked steps (``dit_steps`` 8: steps 0, 1, 2, 6, 10,
   13, 14, 15), the other steps reusing the last outputs and still advancing both solvers; CFG
   ``neg + 5 (pos - neg)`` on the video only, the positive branch's action flow unguided; the same
   initial noise every call (the release re-seeds with 1140).
3. **Episodes.** A request with one latent frame starts a new episode (the release's first call, a
   language change, a one-frame call); a continuing request carries the observed latents. When the
   start frame reaches the attention window (9 frames), the release starts a new episode from the
   last observed frame: here the request's ``restart`` inputs (that frame's latent, condition and CLIP
   tokens) are used then, and a full episode without them is refused, changing nothing. Part 3's
   encoders make those inputs from pixels themselves.

Options as the release's: every step (``dit_steps=16``), the decoupled video schedule
(``video_final_noise=0.8``: the video ends at noise 0.8, the actions at 0) and the similarity-driven
schedule (``dynamic_schedule=True``: after two evaluations, skip 4 steps when the last two guided
video flows have cosine similarity above 0.95, 2 above 0.93).

Request ``inputs`` (host arrays, float32; the encoders that make them from camera pixels and the
instruction are part 3):

* ``"latents"``: ``[1, C, h, w]`` (the conditioning frame: starts an episode) or
  ``[frames_per_block, C, h, w]`` (the observed latents to commit);
* ``"state"``: the robot state, ``[<= state_dim]`` (zero-padded; DROID: 7 joints + gripper);
* when an episode starts: ``"condition"`` ``[window, C + 4, h, w]`` (the release's ``ys``: 4 mask
  channels then the VAE latent of the first frame and black frames), ``"clip"`` ``[257, 1280]``,
  ``"prompt_embeds"`` and ``"negative_prompt_embeds"`` ``[<= text_len, text_dim]`` (umT5 rows;
  zero-padded to ``text_len``, and attended, as the release does);
* optional ``"restart"``: ``{"latents" [1, C, h, w], "condition", "clip"}``, used when the episode is full;
* optional ``"noise"``: ``(video [f, C, h, w], actions [A, action_dim])``, the initial noise (default:
  drawn once from ``noise_seed``; the release's own is drawn on CUDA in bf16 and cannot be reproduced
  off the GPU).

Output: ``{"actions": f32[A, action_dim], "video": f32[n, C, h, w]}``: the predicted action chunk and
video latents (``n = 1 + f`` on an episode's first call, the conditioning frame first, as the release
returns it; ``f`` after).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

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
    PipelineBase,
    PipelineConfigBase,
    PipelineSession,
    dit_kv_spec,
    nbytes,
    new_session_key,
    with_tick_metadata,
)
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._loop import Denoiser, Lane, commit_pass, denoise
from ardiff_jax.models._dit import ActionStateInputs
from ardiff_jax.models.wan import WanModules, load_dreamzero
from ardiff_jax.models.dreamzero._unipc import DIT_STEP_MASKS, UniPCSchedule, unipc_init, unipc_schedule, unipc_step
from ardiff_jax.types import DiffusionRequest

__all__ = ["DreamZeroPipeline", "DreamZeroPipelineConfig", "dreamzero_evaluate", "dreamzero_commit"]

POSITIVE = "positive"
NEGATIVE = "negative"
TEXT = "text"
IMAGE = "image"
#: The release's noise seed, re-used on every call.
RELEASE_NOISE_SEED = 1140
#: Similarity thresholds of the dynamic schedule and the steps each skips (the release's should_run_model).
DYNAMIC_SKIPS = ((0.95, 4), (0.93, 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DreamZeroPipelineConfig(PipelineConfigBase):
    """Policy of :class:`DreamZeroPipeline` (defaults: the release's inference settings).

    Attributes:
      guidance_scale: CFG scale of the video (5.0); the actions are never guided.
      num_steps, shift: the UniPC schedule (16 steps, shift 5).
      dit_steps: the release's ``NUM_DIT_STEPS``: 5, 6, 7 or 8 run the transformer at its masked steps
        (8: steps 0, 1, 2, 6, 10, 13, 14, 15), any other count (16) at every step.
      dynamic_schedule: the release's ``DYNAMIC_CACHE_SCHEDULE`` (similarity-driven skipping; overrides
        ``dit_steps``).
      video_final_noise: the decoupled video schedule's final noise (the release's
        ``video_inference_final_noise``, 0.8) or None (both schedules end at 0).
      noise_seed: seed of the initial noise, the same for every call and session (the release: 1140).
    """

    guidance_scale: float = 5.0
    num_steps: int = 16
    shift: float = 5.0
    dit_steps: int = 8
    dynamic_schedule: bool = False
    video_final_noise: float | None = None
    noise_seed: int = RELEASE_NOISE_SEED

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        for field in ("guidance_scale", "shift"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} {field} must be a finite number, got {value!r}")
        if self.shift <= 0:
            raise ValueError(f"{name} shift must be positive, got {self.shift}")
        check_positive_int(f"{name} num_steps", self.num_steps)
        check_positive_int(f"{name} dit_steps", self.dit_steps)
        if self.num_steps < 2:
            raise ValueError(f"{name} num_steps must be at least 2 (UniPC's first and last steps), got {self.num_steps}")
        if self.dit_steps in DIT_STEP_MASKS and self.num_steps != 16:
            raise ValueError(f"{name} dit_steps {self.dit_steps} selects a mask of the release's 16 steps; with "
                             f"num_steps {self.num_steps} use dit_steps={self.num_steps} (every step)")
        if not isinstance(self.dynamic_schedule, bool):
            raise ValueError(f"{name} dynamic_schedule must be a bool, got {self.dynamic_schedule!r}")
        final = self.video_final_noise
        if final is not None and (isinstance(final, bool) or not isinstance(final, numbers.Real)
                                  or not 0.0 < final < 1.0):
            raise ValueError(f"{name} video_final_noise must be None or in (0, 1), got {final!r}")

    @property
    def dit_step_mask(self) -> tuple[bool, ...]:
        """Which of the steps run the transformer (without the dynamic schedule)."""
        steps = DIT_STEP_MASKS.get(self.dit_steps)
        return tuple(steps is None or step in steps for step in range(self.num_steps))


@dataclasses.dataclass(frozen=True)
class _DreamZeroSession(PipelineSession):
    """A robot session's model state: its episode's image-to-video condition and its prompt's identity.

    ``prompt`` is a digest of the prompt embeddings (a changed instruction starts a new episode);
    ``block_index`` counts the episode's calls; ``frames`` the frames its caches hold (what decides,
    before any device work, whether the episode is full).
    """

    condition: jax.Array | None = None  # f32[window, C + 4, h, w]
    frames: int = 0

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        return (self.key, self.condition)


# -- the jitted core ------------------------------------------------------------------------------------


def _commit(graphdef: Any, params: Any, attention: Any, latents: jax.Array, start: jax.Array, text: Any,
            image: Any, condition: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One branch's commit pass: the observed latents at ``t = 0`` -> ``(flow, k, v)`` (the flow is discarded
    by the release; tests compare it)."""
    dit = nnx.merge(graphdef, params).transformer
    out = dit(latents, jnp.zeros((latents.shape[0],), jnp.float32), start, text, image, attention=attention,
              condition=condition)
    return out.video, out.k, out.v


def _evaluate(graphdef: Any, params: Any, pos_attention: Any, neg_attention: Any, x: jax.Array, t_video: jax.Array,
              actions: jax.Array, t_action: jax.Array, state: jax.Array, start: jax.Array, y: jax.Array,
              pos_cross: Any, neg_cross: Any, scale: jax.Array) -> tuple[jax.Array, ...]:
    """Both branches' transformer on one denoising step: ``(guided video flow, positive action flow,
    positive video, negative video, negative action flow)``."""
    dit = nnx.merge(graphdef, params).transformer
    register = dit.config.action_register
    inputs = ActionStateInputs(actions, jnp.full((register.actions_per_block,), t_action, jnp.float32), state)
    pos = dit(x, t_video, start, pos_cross[0], pos_cross[1], attention=pos_attention, condition=y, action_state=inputs)
    neg = dit(x, t_video, start, neg_cross[0], neg_cross[1], attention=neg_attention, condition=y, action_state=inputs)
    guided = neg.video + scale * (pos.video - neg.video)  # CFG on the video only
    return guided, pos.registers, pos.video, neg.video, neg.registers


def _solver_step(x: jax.Array, a: jax.Array, video_flow: jax.Array, action_flow: jax.Array, video_state: Any,
                 action_state: Any, video_row: Any, action_row: Any, first: jax.Array) -> tuple[Any, ...]:
    """Both solvers one step (video and actions have their own schedules in the decoupled mode)."""
    x, video_state = unipc_step(x, video_flow, video_state, *video_row, first)
    a, action_state = unipc_step(a, action_flow, action_state, *action_row, first)
    return x, a, video_state, action_state


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """The release's ``cosine_similarity(v_last.flatten(1), v_prev.flatten(1), dim=1)`` (eps 1e-8)."""
    a, b = a.reshape(-1).astype(jnp.float32), b.reshape(-1).astype(jnp.float32)
    norms = jnp.maximum(jnp.linalg.norm(a) * jnp.linalg.norm(b), 1e-8)
    return jnp.dot(a, b) / norms


#: A committing forward of one branch: ``-> (flow, k, v)``.
dreamzero_commit = jax.jit(_commit, static_argnums=0)
#: One denoising evaluation of both branches with the guidance combine.
dreamzero_evaluate = jax.jit(_evaluate, static_argnums=0)
_solver_step_jit = jax.jit(_solver_step)
_solver_step_batch = jax.jit(jax.vmap(_solver_step, in_axes=(0, 0, 0, 0, 0, 0, None, None, None)))
_cosine_batch = jax.jit(jax.vmap(_cosine))


def _evaluate_batch(graphdef: Any, params: Any, pos_attention: Any, neg_attention: Any, x: jax.Array,
                    t_video: jax.Array, actions: jax.Array, t_action: jax.Array, state: jax.Array, start: jax.Array,
                    y: jax.Array, pos_cross: Any, neg_cross: Any, scale: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`_evaluate` over ``B`` sessions (rows) and both branches in one program."""
    def row(pos_att: Any, neg_att: Any, x: Any, a: Any, s: Any, st: Any, y: Any, pc: Any, nc: Any) -> Any:
        return _evaluate(graphdef, params, pos_att, neg_att, x, t_video, a, t_action, s, st, y, pc, nc, scale)

    return jax.vmap(row, in_axes=(pos_attention.vmap_axes(), neg_attention.vmap_axes(), 0, 0, 0, 0, 0, 0, 0))(
        pos_attention, neg_attention, x, actions, state, start, y, pos_cross, neg_cross)


dreamzero_evaluate_batch = jax.jit(_evaluate_batch, static_argnums=0)


class _Sample(NamedTuple):
    """The denoising loop's carry: both samples, both solvers' states and the flows the solvers reuse."""

    x: jax.Array  # f32[(B,) f, C, h, w]: the video sample
    a: jax.Array  # f32[(B,) A, action_dim]: the action sample
    video_state: Any
    action_state: Any
    last_video: jax.Array | None  # the last guided video flow (None before the first evaluation)
    previous_video: jax.Array | None  # the one before it (the dynamic schedule's similarity)
    last_action: jax.Array | None  # the last positive action flow


# -- the request ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Start:
    """What starts an episode: the conditioning frame's latent, the I2V condition, the CLIP tokens."""

    latents: np.ndarray  # f32[1, C, h, w]
    condition: np.ndarray  # f32[window, C + 4, h, w]
    clip: np.ndarray  # f32[257, 1280]


@dataclasses.dataclass(frozen=True)
class _Parsed:
    latents: np.ndarray  # f32[n, C, h, w]
    state: np.ndarray  # f32[S, state_dim]
    start: _Start | None  # the request's own episode start (n == 1)
    restart: _Start | None
    prompt: tuple[np.ndarray, np.ndarray] | None  # (positive, negative) [text_len, text_dim], zero-padded
    prompt_digest: str | None
    noise: tuple[np.ndarray, np.ndarray] | None


def _float_array(name: str, value: Any, shape: tuple[int, ...] | None = None, *, max_rows: int | None = None,
                 tail: tuple[int, ...] | None = None) -> np.ndarray:
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be a float array, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be a float array") from None
    if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be a float array, got dtype {array.dtype}")
    if shape is not None and array.shape != shape:
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be {list(shape)}, got {list(array.shape)}")
    if tail is not None and (array.ndim != len(tail) + 1 or array.shape[1:] != tail or not 1 <= array.shape[0] <= max_rows):
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be [1..{max_rows}, "
                         f"{', '.join(map(str, tail))}], got {list(array.shape)}")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be finite")
    return array


class DreamZeroPipeline(PipelineBase):
    """DreamZero's world-action inference loop on the paged runtime (see the module docstring).

    Args:
      config: a DreamZero :class:`CausalDiTConfig` (``action_register`` and a CLIP image branch) or a
        preset name (``"dreamzero-tiny"``, ``"dreamzero-droid"``, ``"dreamzero-wan22-5b"``).
      pipeline_config: :class:`DreamZeroPipelineConfig`.
      modules: weights (``WanModules`` holding :func:`~ardiff_jax.models.dreamzero.load_dreamzero`'s
        transformer: :meth:`from_checkpoint`); None: random weights of the geometry.
      device: where inputs and weights live (default: the first device).
    """

    pipeline_config_type = DreamZeroPipelineConfig
    session_type = _DreamZeroSession
    pipeline_config: DreamZeroPipelineConfig
    _sessions: dict[str, _DreamZeroSession]

    def __init__(self, config: CausalDiTConfig | str = "dreamzero-tiny",
                 pipeline_config: DreamZeroPipelineConfig | None = None, *, modules: WanModules | None = None,
                 device: jax.Device | None = None) -> None:
        super().__init__(config, pipeline_config, modules=modules, device=device)
        pc = self.pipeline_config
        self.video_schedule: UniPCSchedule = unipc_schedule(pc.num_steps, pc.shift, pc.video_final_noise)
        self.action_schedule: UniPCSchedule = unipc_schedule(pc.num_steps, pc.shift)
        register = self.config.action_register
        video_key, action_key = jax.random.split(jax.random.key(pc.noise_seed))
        self._noise = jax.device_put(
            (jax.random.normal(video_key, self.config.block_shape, jnp.float32),
             jax.random.normal(action_key, (register.actions_per_block, register.action_dim), jnp.float32)),
            self.device)
        self._text_cache: dict[str, Any] = {}
        #: Per-step samples of the last single-session call (``record_steps=True``): tests compare them.
        self.record_steps = False
        self.last_steps: list[tuple[jax.Array, jax.Array]] = []
        self.last_ran: list[bool] = []

    @classmethod
    def from_checkpoint(cls, path: Any, config: CausalDiTConfig | str | None = None, *,
                        pipeline_config: DreamZeroPipelineConfig | None = None, device: jax.Device | None = None,
                        **load_options: Any) -> DreamZeroPipeline:
        """A pipeline on a release checkpoint directory (:func:`~ardiff_jax.models.dreamzero.load_dreamzero`)."""
        model, info = load_dreamzero(path, config, **load_options)
        return cls(info.config, pipeline_config, modules=WanModules(model), device=device)

    @classmethod
    def create_modules(cls, config: CausalDiTConfig, seed: int) -> WanModules:
        """Random weights of ``config`` (the transformer alone: text and images come in encoded)."""
        return WanModules.create(config, seed)

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: DreamZeroPipelineConfig) -> None:
        if config.action_register is None or not config.image_dim or not config.image_len:
            raise ValueError("DreamZeroPipeline needs a DreamZero network: an action_register and a CLIP image "
                             f"branch (a dreamzero-* preset); config {config.name!r} has none")
        if config.sink_frames:
            raise ValueError("DreamZeroPipeline runs the release's sliding window without a sink (sink_frames 0)")
        if config.in_channels not in (config.latent_channels, 2 * config.latent_channels + 4):
            raise ValueError(f"DreamZeroPipeline reads the latent alone or with the 4 mask + {config.latent_channels} "
                             f"condition channels; config has {config.in_channels} input channels")

    # -- capability ----------------------------------------------------------------------------------
    @staticmethod
    def kv_spec_for(config: CausalDiTConfig, pipeline_config: DreamZeroPipelineConfig | None = None
                    ) -> ARDiffusionKVCacheSpec:
        pipeline_config = DreamZeroPipelineConfig() if pipeline_config is None else pipeline_config
        DreamZeroPipeline.check_compatible(config, pipeline_config)
        spec = dit_kv_spec(
            config, kv_branches=(ARDiffusionKVBranchSpec(POSITIVE, 0), ARDiffusionKVBranchSpec(NEGATIVE, 1)),
            cross_attention=(ARDiffusionCrossAttentionKVSpec(TEXT, config.text_len),
                             ARDiffusionCrossAttentionKVSpec(IMAGE, config.image_len)),
            session_capacity=pipeline_config.session_capacity,
            model_owned_bytes=DreamZeroPipeline.model_owned_bytes_bound(config))
        # The register (actions + state) rides in scratch beside the block, never cached.
        return dataclasses.replace(spec, max_scratch_tokens_per_branch=config.action_register.num_tokens)

    @staticmethod
    def model_owned_bytes_bound(config: CausalDiTConfig) -> int:
        """One session's device state: the episode's condition and the noise key."""
        condition = (config.window_frames, config.in_channels - config.latent_channels or config.latent_channels + 4,
                     config.latent_height, config.latent_width)
        return nbytes(condition) + 16

    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"condition": self._condition_shape}

    @property
    def _condition_shape(self) -> tuple[int, ...]:
        cfg = self.config
        return (cfg.window_frames, cfg.latent_channels + 4, cfg.latent_height, cfg.latent_width)

    @property
    def _concat_condition(self) -> bool:
        """Whether the transformer reads the condition channels (14B I2V) or the latent alone (Wan2.2-5B)."""
        return self.config.in_channels != self.config.latent_channels

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[DiffusionRequest]:
        """The release's warmup: one episode start (one frame), then continuing calls until the window is full,
        with zero latents; every program an episode uses is compiled."""
        cfg = self.config
        zeros = np.zeros((cfg.latent_channels, cfg.latent_height, cfg.latent_width), np.float32)
        start = {"condition": np.zeros(self._condition_shape, np.float32),
                 "clip": np.zeros((cfg.image_len, cfg.image_dim), np.float32),
                 "prompt_embeds": np.zeros((1, cfg.text_dim), np.float32),
                 "negative_prompt_embeds": np.zeros((1, cfg.text_dim), np.float32)}
        calls = 1 + math.ceil(max(0, cfg.window_frames - 1) / cfg.frames_per_block) - 1
        for index in range(calls):
            frames = 1 if index == 0 else cfg.frames_per_block
            inputs = {"latents": np.stack([zeros] * frames), "state": np.zeros((8,), np.float32)}
            if index == 0:
                inputs.update(start)
            yield DiffusionRequest(f"ardiffusion-warmup-{index}", extra_args={"reset": index == 0,
                                                                              "session_id": session_id},
                                   inputs=inputs)

    # -- requests ----------------------------------------------------------------------------------------
    def _parse_start(self, name: str, values: Mapping[str, Any], latents: np.ndarray | None) -> _Start:
        cfg = self.config
        if not isinstance(values, Mapping):
            raise ValueError(f"DreamZeroPipeline inputs[{name!r}] must be a mapping")
        if latents is None:
            latents = _float_array(f"{name}.latents", values.get("latents"),
                                   (1, cfg.latent_channels, cfg.latent_height, cfg.latent_width))
        prefix = "" if name == "inputs" else f"{name}."
        missing = [key for key in ("condition", "clip") if values.get(key) is None]
        if missing:
            raise ValueError(f"DreamZeroPipeline: starting an episode needs inputs {[prefix + k for k in missing]} "
                             "(the I2V condition and the CLIP tokens of the conditioning frame)")
        condition = _float_array(f"{prefix}condition", values["condition"], self._condition_shape)
        clip = _float_array(f"{prefix}clip", values["clip"], (cfg.image_len, cfg.image_dim))
        return _Start(latents, condition, clip)

    def _parse(self, session_id: str, request: DiffusionRequest) -> _Parsed:
        cfg = self.config
        register = cfg.action_register
        inputs = request.inputs
        unknown = sorted(set(inputs) - {"latents", "state", "condition", "clip", "prompt_embeds",
                                        "negative_prompt_embeds", "restart", "noise"})
        if unknown:
            raise ValueError(f"DreamZeroPipeline does not take inputs {unknown}")
        latents = _float_array("latents", inputs.get("latents"), max_rows=cfg.frames_per_block,
                               tail=(cfg.latent_channels, cfg.latent_height, cfg.latent_width))
        if latents.shape[0] not in (1, cfg.frames_per_block):
            raise ValueError(f"DreamZeroPipeline inputs['latents'] must hold 1 frame (an episode start) or "
                             f"{cfg.frames_per_block} (observed frames), got {latents.shape[0]}")
        state = _float_array("state", inputs.get("state"))
        if state.ndim != 1 or not 1 <= state.shape[0] <= register.state_dim:
            raise ValueError(f"DreamZeroPipeline inputs['state'] must be [1..{register.state_dim}] floats, got "
                             f"{list(state.shape)}")
        padded = np.zeros((register.states_per_block, register.state_dim), np.float32)
        padded[:, : state.shape[0]] = state
        start = self._parse_start("inputs", inputs, latents) if latents.shape[0] == 1 else None
        restart = None if inputs.get("restart") is None else self._parse_start("restart", inputs["restart"], None)
        prompt = digest = None
        if inputs.get("prompt_embeds") is not None or inputs.get("negative_prompt_embeds") is not None:
            pair = []
            for key in ("prompt_embeds", "negative_prompt_embeds"):
                rows = _float_array(key, inputs.get(key), max_rows=cfg.text_len, tail=(cfg.text_dim,))
                full = np.zeros((cfg.text_len, cfg.text_dim), np.float32)
                full[: rows.shape[0]] = rows  # rows past the prompt are zero, and attended (the release)
                pair.append(full)
            prompt = (pair[0], pair[1])
            digest = "sha256:" + hashlib.sha256(pair[0].tobytes() + pair[1].tobytes()).hexdigest()
        noise = None
        if inputs.get("noise") is not None:
            value = inputs["noise"]
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError("DreamZeroPipeline inputs['noise'] must be a pair (video, actions)")
            noise = (_float_array("noise[0]", value[0], tuple(cfg.block_shape)),
                     _float_array("noise[1]", value[1], (register.actions_per_block, register.action_dim)))
        parsed = _Parsed(latents, padded, start, restart, prompt, digest, noise)
        self._plan(session_id, parsed)  # every refusal of the episode logic, before anything moves
        return parsed

    def _plan(self, session_id: str, parsed: _Parsed) -> tuple[bool, _Start | None]:
        """``(new episode?, its start inputs)`` for ``parsed`` on ``session_id``; ValueError when neither a
        continuing call nor an episode start is possible."""
        session = self._sessions.get(session_id)
        changed_prompt = session is not None and parsed.prompt_digest is not None \
            and parsed.prompt_digest != session.prompt
        full = self.episode_full(session_id)
        if parsed.start is not None:
            start = parsed.start
        elif session is None or changed_prompt or full:
            start = parsed.restart
            if start is None:
                why = ("has no episode yet" if session is None else "changed its instruction" if changed_prompt
                       else f"filled its attention window ({self.config.window_frames} frames)")
                raise ValueError(f"DreamZeroPipeline session {session_id!r} {why}: a new episode starts from one "
                                 "frame, so send inputs['latents'] of 1 frame with its 'condition' and 'clip' (or "
                                 "them under inputs['restart'])")
        else:
            return False, None
        if parsed.prompt is None and (session is None or changed_prompt):
            raise ValueError(f"DreamZeroPipeline session {session_id!r} starts an episode without "
                             "inputs['prompt_embeds'] and inputs['negative_prompt_embeds']")
        return True, start

    def episode_full(self, session_id: str) -> bool:
        """Whether ``session_id``'s next continuing call finds its attention window full (the release then starts a
        new episode from the call's last frame: send ``inputs["restart"]``)."""
        session = self._sessions.get(session_id)
        return session is not None and session.frames + self.config.frames_per_block >= self.config.window_frames

    def validate_ar_diffusion_request(self, session_id: str, request: DiffusionRequest) -> None:
        self._parse(session_id, request)

    # -- the loop ---------------------------------------------------------------------------------------
    def _cross(self, prompt: np.ndarray) -> tuple[jax.Array, jax.Array]:
        key = hashlib.sha256(prompt.tobytes()).hexdigest()
        cached = self._text_cache.get(key)
        if cached is None:  # the projections of a prompt are computed once (the negative prompt is shared)
            cached = _text_kv(self._graphdef, self._params, self._to_device(prompt))
            if len(self._text_cache) >= 64:
                self._text_cache.pop(next(iter(self._text_cache)))
            self._text_cache[key] = cached
        return cached

    def _start_episode(self, state: Any, session_id: str, parsed: _Parsed, start: _Start,
                       session: _DreamZeroSession | None) -> _DreamZeroSession:
        """Drop the old episode, publish the new cross caches, commit the conditioning frame at frame 0.

        A new instruction drops every cache; a restart under the same instruction keeps the text caches
        (the release's window reset re-encodes only the image).
        """
        same_prompt = parsed.prompt is None
        if session is not None or state.adapter(POSITIVE).committed_frames:
            state.reset(keep_cross_attention=(TEXT,) if same_prompt else ())
        if not same_prompt:
            for branch, rows in ((POSITIVE, parsed.prompt[0]), (NEGATIVE, parsed.prompt[1])):
                state.populate_cross_attention(branch, TEXT, zip(*self._cross(rows), strict=True))
        image = _image_kv(self._graphdef, self._params, self._to_device(start.clip))
        for branch in (POSITIVE, NEGATIVE):
            state.populate_cross_attention(branch, IMAGE, zip(*image, strict=True))
        key = session.key if session is not None else new_session_key(self.pipeline_config.noise_seed, self.device)
        new = _DreamZeroSession(key=key, prompt=parsed.prompt_digest if not same_prompt else session.prompt,
                                condition=self._to_device(start.condition))
        self._commit(state, new, self._to_device(start.latents))
        return new

    def _condition_slice(self, session: _DreamZeroSession, start: int, frames: int) -> jax.Array:
        window = self.config.window_frames
        first = start if start + frames <= window else window - frames
        return session.condition[first: first + frames]

    def _commit(self, state: Any, session: _DreamZeroSession, latents: jax.Array) -> None:
        """The observed latents at ``t = 0`` on both branches, at the next frames of the cache."""
        cfg = self.config
        frames = latents.shape[0]
        start = state.adapter(POSITIVE).committed_frames
        y = self._condition_slice(session, start, frames) if self._concat_condition else None
        for branch in (POSITIVE, NEGATIVE):
            text, image = state.get_cross_attention_kv(branch, TEXT), state.get_cross_attention_kv(branch, IMAGE)

            def forward(view: Any, text: Any = text, image: Any = image) -> tuple[tuple[jax.Array, jax.Array], None]:
                _, k, v = dreamzero_commit(self._graphdef, self._params, view, latents, np.int32(start),
                                           (text.k, text.v), (image.k, image.v), y)
                return (k, v), None

            commit_pass(Lane.single(state), branch, frames * cfg.tokens_per_frame, forward)

    def _branch_cross(self, state: Any, branch: str) -> tuple[Any, Any]:
        text, image = state.get_cross_attention_kv(branch, TEXT), state.get_cross_attention_kv(branch, IMAGE)
        return (text.k, text.v), (image.k, image.v)

    def _schedule_rows(self, step: int) -> tuple[Any, Any, Any]:
        vs, acs = self.video_schedule, self.action_schedule
        video_row = (vs.sigmas[step], vs.predictor[step], vs.corrector[step])
        action_row = (acs.sigmas[step], acs.predictor[step], acs.corrector[step])
        return video_row, action_row, np.bool_(step == 0)

    def _denoise(self, lane: Lane, rows: Sequence[tuple[Any, ...]]) -> tuple[jax.Array, jax.Array]:
        """The next video and action chunks of the lane's sessions: DreamZero's rows, step and schedule in the
        shared loop (:func:`~ardiff_jax.models._loop.denoise`).

        ``rows``: per session ``(noise video, noise actions, robot state, start frame, condition or None,
        positive cross K/V, negative cross K/V)``. A step reads both branches without writing and evaluates
        every row and both branches in one program when any row runs the transformer (:meth:`_rows_to_run`:
        the mask, or each row's own countdown; the others keep their last flows); both solvers step every
        step. Returns ``(video, actions)``: ``f32[f, C, h, w], f32[A, action_dim]``, with a leading bucket
        axis on a batch lane.
        """
        cfg, pc = self.config, self.pipeline_config
        x, a, robot_state, start, y, pos_cross, neg_cross = lane.stack(rows)
        evaluate = lane.pick(dreamzero_evaluate, dreamzero_evaluate_batch)  # looked up per call: tests wrap them
        solver = lane.pick(_solver_step_jit, _solver_step_batch)
        init = lane.pick(unipc_init, jax.vmap(unipc_init))
        scale = np.float32(pc.guidance_scale)
        size = lane.handle.bucket_size if lane.batched else 1
        # Per row: evaluations so far and the dynamic schedule's countdown (_rows_to_run updates it).
        evaluations, countdown = np.zeros(size, np.int64), np.zeros(size, np.int64)
        record = self.record_steps and not lane.batched
        if not lane.batched:
            self.last_steps = [(x, a)] if record else []
            self.last_ran = []

        def as_rows(flow: jax.Array | None) -> jax.Array | None:
            return flow if flow is None or lane.batched else flow[None]

        def runs(step: int, sample: _Sample) -> np.ndarray:
            run = self._rows_to_run(step, evaluations, countdown, as_rows(sample.last_video),
                                    as_rows(sample.previous_video))
            if not lane.batched:
                self.last_ran.append(bool(run[0]))
            return run

        def step_program(views: tuple[Any, ...], sample: _Sample, step: int) -> tuple[jax.Array, ...]:
            pos, neg = views
            return evaluate(self._graphdef, self._params, pos, neg, sample.x,
                            np.float32(self.video_schedule.timesteps[step]), sample.a,
                            np.float32(self.action_schedule.timesteps[step]), robot_state, start, y, pos_cross,
                            neg_cross, scale)

        def advance(step: int, sample: _Sample, outs: tuple[jax.Array, ...] | None, run: np.ndarray) -> _Sample:
            last, previous, last_action = sample.last_video, sample.previous_video, sample.last_action
            if outs is not None:
                evaluations[:] += run
                if run.all():  # every row evaluated (a lone session always): the flows move on
                    previous = outs[0] if last is None else last
                    last, last_action = outs[0], outs[1]
                else:  # the rows that skipped keep their last flows
                    mask, select = jnp.asarray(run), jax.vmap(jnp.where)
                    previous = select(mask, last, previous)
                    last = select(mask, outs[0], last)
                    last_action = select(mask, outs[1], last_action)
            video_row, action_row, first = self._schedule_rows(step)
            x, a, video_state, action_state = solver(sample.x, sample.a, last, last_action, sample.video_state,
                                                     sample.action_state, video_row, action_row, first)
            if record:
                self.last_steps.append((x, a))
            return _Sample(x, a, video_state, action_state, last, previous, last_action)

        denoiser = Denoiser(branches=(POSITIVE, NEGATIVE), seq_len=cfg.frames_per_block * cfg.tokens_per_frame,
                            evaluate=step_program, advance=advance, runs=runs)
        # The fresh solver states committed to the device as every later step's are: left uncommitted, jit
        # compiled the solver step a second time (it keys on committedness) for every lane shape.
        states = jax.device_put((init(x), init(a)), self.device)
        sample = denoise(lane, denoiser, _Sample(x, a, *states, None, None, None), range(pc.num_steps))
        return sample.x, sample.a

    def _calls(self, lane: Lane, requests: Sequence[DiffusionRequest]
               ) -> tuple[list[dict[str, jax.Array]], dict[str, _DreamZeroSession]]:
        """One robot step per request on the lane's sessions: ``(outputs, each session's new model state)``.

        Per session: the checks, then a new episode (its cross caches and conditioning frame) or the
        commit of the observed frames on both branches (:meth:`_begin_call`); then the lane's denoising.
        The caller installs the model state (:meth:`forward`) or stages it (:meth:`forward_batch`).
        """
        cfg = self.config
        sessions: dict[str, _DreamZeroSession] = {}
        starts, rows = [], []
        for request, state in zip(requests, lane.states, strict=True):
            parsed, session, new_episode, start = self._begin_call(state, request)
            frame = state.adapter(POSITIVE).committed_frames
            sessions[state.session_id] = dataclasses.replace(
                session, block_index=0 if new_episode else session.block_index + 1, frames=frame)
            starts.append(start if new_episode else None)
            x, a = parsed.noise if parsed.noise is not None else self._noise
            y = self._condition_slice(session, frame, cfg.frames_per_block) if self._concat_condition else None
            rows.append((self._to_device(x), self._to_device(a), self._to_device(parsed.state), np.int32(frame), y,
                         self._branch_cross(state, POSITIVE), self._branch_cross(state, NEGATIVE)))
        outputs = []
        for request, start, (video, actions) in zip(requests, starts, lane.unstack(self._denoise(lane, rows)),
                                                    strict=True):
            if start is not None:  # the release returns the conditioning frame before the first chunk
                video = jnp.concatenate([self._to_device(start.latents), video])
            outputs.append(with_tick_metadata({"actions": actions, "video": video}, request))
        return outputs, sessions

    def forward_batch(self, requests: Sequence[DiffusionRequest]) -> list[dict[str, jax.Array]]:
        """:meth:`forward` for several robot sessions with one program per denoising step (``SupportsARDiffusionBatch``).

        The same code as :meth:`forward` on a batch lane: per session the episode logic, the cross caches
        and the commit of the observed frames; then each denoising step evaluates every session and both
        branches in one program (:data:`dreamzero_evaluate_batch`) and steps every session's two solvers
        in another; each row equals the session run alone. With the dynamic schedule each row keeps its
        own countdown and flows. Model state is staged and installed by the runner once it has awaited
        the batch's device work (``batch.defer_publish``).
        """
        batch = self._bound_batch()
        outputs, staged = self._calls(Lane.batch(batch), requests)
        batch.defer_publish(functools.partial(self._publish_staged, staged),
                            [session.device_arrays() for session in staged.values()])
        return outputs

    def _rows_to_run(self, step: int, evaluations: np.ndarray, countdown: np.ndarray, last: Any, previous: Any
                     ) -> np.ndarray:
        """``bool[B]``: which rows run the transformer at ``step`` (the mask, or each row's own countdown);
        updates ``countdown`` in place."""
        pc = self.pipeline_config
        if not pc.dynamic_schedule:
            return np.full(evaluations.shape, pc.dit_step_mask[step])
        run = np.ones(evaluations.shape, bool)
        similarity = None
        for row in range(evaluations.shape[0]):
            if evaluations[row] < 2:
                continue
            if countdown[row] > 1:
                countdown[row] -= 1
                run[row] = False
            elif countdown[row] == 1:
                countdown[row] = 0
            else:
                if similarity is None:  # one host sync for every row's decision
                    similarity = np.asarray(_cosine_batch(last, previous))
                for threshold, count in DYNAMIC_SKIPS:
                    if similarity[row] > threshold:
                        countdown[row], run[row] = count, False
                        break
        return run

    def _begin_call(self, state: Any, request: DiffusionRequest) -> tuple[_Parsed, _DreamZeroSession, bool,
                                                                          _Start | None]:
        """A call's first half, on one session's state: the checks, then a new episode (its cross caches and
        conditioning frame) or the commit of the observed frames. ``(parsed, session, new episode?, start)``."""
        session_id = state.session_id
        parsed = self._parse(session_id, request)
        new_episode, start = self._plan(session_id, parsed)
        session = self._sessions.get(session_id)
        if new_episode:
            session = self._start_episode(state, session_id, parsed, start, session)
        else:
            self._commit(state, session, self._to_device(parsed.latents))
        return parsed, session, new_episode, start

    def forward(self, request: DiffusionRequest) -> dict[str, jax.Array]:
        """One robot step: commit the observation on both branches, then denoise the next video and action chunk."""
        outputs, sessions = self._calls(Lane.single(self._bound_state()), [request])
        self._sessions.update(sessions)
        return outputs[0]


def _text_kv_impl(graphdef: Any, params: Any, context: jax.Array) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).transformer.text_cross_kv(context)


def _image_kv_impl(graphdef: Any, params: Any, clip: jax.Array) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).transformer.image_cross_kv(clip)


_text_kv = jax.jit(_text_kv_impl, static_argnums=0)
_image_kv = jax.jit(_image_kv_impl, static_argnums=0)
