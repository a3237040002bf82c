"""``SpriteWorldPipeline``: the trained, action-conditioned SpriteWorld model behind the runtime.

It is a :class:`~ardiff_jax.models.WorldPipeline` (one KV branch ``"main"``, few-step
denoising, the same jitted step program) with a request schema made for playing a world:

* ``inputs["observation"]``: ``u8[n, H, W, 3]`` or ``u8[H, W, 3]``, the real first frame(s)
  (``SpriteWorld.reset()``), **required on a session's first request** and refused later.
  The frames are committed as context before the first block, one clean ``t = 0`` forward
  per block, like DreamZero's observation prefill; the first of them becomes the attention
  sink. ``n`` must be a multiple of ``frames_per_block``. A streaming (stepwise) request
  carries it on every call; it is prefilled once, before the request's first block.
* ``inputs["observation_actions"]``: optional ``int[n]``, the action before each observation
  frame (default no-ops, which is what precedes a reset frame).
* ``inputs["actions"]``: ``int[frames_per_block]``, **required on every request**: the action
  applied before each frame of the block, aligned with ``SpriteWorld.step`` (frame ``i`` of
  the block is the world after ``actions[i]``). A streaming (stepwise) request of
  ``inputs["num_blocks"]`` blocks may give ``int[num_blocks, frames_per_block]``. Each
  action conditions its frame as a one-hot control vector (the transformer's ``controls``,
  through the adaLN modulation).
* ``inputs["seed"]``: the session's noise seed (default: derived from the session id).
* ``prompt``: ``None`` (or ``""``): the model is not text-conditioned.

Each request returns a :class:`SpriteBlock` whose ``frames`` are the decoded RGB frames. The
block is committed as those frames, so the model continues from exactly what the user saw.
The decoder is the world's own (``SpriteWorldPipelineConfig.decoder``): ``"cells"`` (the
default) snaps every 4x4 cell to the nearest of the seven looks a SpriteWorld cell can have
(:func:`~ardiff_jax.models.snap_to_cells`), ``"levels"`` only rounds to ``uint8`` levels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax._checks import is_integer
from ardiff_jax.envs import ACTION_NAMES, SpriteWorld
from ardiff_jax.models._common import FewStepSchedule, check_seed
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._loop import Lane, commit_pass
from ardiff_jax.models._pixels import (
    action_registers,
    frames_to_latents,
    latents_to_frames,
    snap_to_cells,
)
from ardiff_jax.models._world import (
    MAIN,
    PREDICTIONS,
    WorldBlock,
    _BlockInputs,
    WorldPipeline,
    WorldPipelineConfig,
    _WorldSession,
    world_step,
)
from ardiff_jax.types import ARDiffusionChunkMetadata, DiffusionRequest, StepResult

__all__ = ["SpriteWorldPipeline", "SpriteWorldPipelineConfig", "SpriteBlock", "SPRITE_WORLD_SCHEDULE", "DECODERS"]

#: The schedule the shipped model samples with: one step (``docs/models.md``: why one step).
SPRITE_WORLD_SCHEDULE = FewStepSchedule((1000.0,))

#: How a generated frame is decoded before it is shown and committed.
DECODERS = ("cells", "levels")


@dataclasses.dataclass(frozen=True)
class SpriteWorldPipelineConfig(WorldPipelineConfig):
    """:class:`WorldPipelineConfig` with the SpriteWorld model's sampling schedule as the default.

    Attributes:
      prediction: what the transformer's output is, as the weights were trained: ``"delta"``
        (the change from the last committed frame), ``"x0"`` (the clean frame) or ``"flow"``
        (Wan's ``v``); :func:`~ardiff_jax.models.clean_estimate`.
      decoder: ``"cells"`` (snap each 4x4 cell to the nearest valid SpriteWorld cell) or
        ``"levels"`` (round to ``uint8`` levels only).
    """

    schedule: FewStepSchedule = SPRITE_WORLD_SCHEDULE
    prediction: str = "delta"
    decoder: str = "cells"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"SpriteWorldPipelineConfig prediction must be one of {PREDICTIONS}, "
                             f"got {self.prediction!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"SpriteWorldPipelineConfig decoder must be one of {DECODERS}, got {self.decoder!r}")


class SpriteBlock(NamedTuple):
    """One generated block of a SpriteWorld session.

    Attributes:
      frames: ``u8[f, H, W, 3]`` the decoded RGB frames.
      latents: ``f32[f, 3, H, W]`` the clean pixel-space latents (``[-1, 1]``).
      first_frame: absolute index of the block's first frame in its session (observation frames count).
      block_index: blocks this session generated before this one.
      ar_diffusion: the chunk metadata of a typed tick (``None`` without one).
    """

    frames: np.ndarray
    latents: jax.Array
    first_frame: int
    block_index: int
    ar_diffusion: ARDiffusionChunkMetadata | None = None


class _ParsedBlock(NamedTuple):
    block: _BlockInputs  # the block's controls: one one-hot action per frame
    observation: np.ndarray | None  # f32[n, 3, H, W]
    observation_controls: np.ndarray | None  # f32[n, control_dim]


@jax.jit
def quantise_latents(latents: jax.Array) -> jax.Array:
    """``f32[..., 3, H, W]`` -> the latents of the ``uint8`` frames they decode to (what the user sees)."""
    return frames_to_latents(latents_to_frames(latents, jnp), jnp)


@jax.jit
def snap_latents(latents: jax.Array) -> jax.Array:
    """``f32[..., 3, H, W]`` -> the latents of the frame made of the nearest valid cells (:func:`snap_to_cells`)."""
    return snap_to_cells(latents, jnp)


def _check_actions(name: str, value: Any, length: int) -> np.ndarray:
    array = np.asarray(value)
    if array.shape != (length,) or not (array.dtype.kind in "iu" or (array.size == 0 or all(
            is_integer(a) for a in array.tolist()))):
        raise ValueError(f"{name} must be int[{length}] (one action per frame), got {array.dtype}{list(array.shape)}")
    array = array.astype(np.int64)
    if array.size and (array.min() < 0 or array.max() >= len(ACTION_NAMES)):
        raise ValueError(f"{name} must be actions in [0, {len(ACTION_NAMES)}) {ACTION_NAMES}, got {array.tolist()}")
    return array


class SpriteWorldPipeline(WorldPipeline):
    """The SpriteWorld world model: observation prefill, integer actions in, RGB frames out.

    Build it with :func:`ardiff_jax.models.pretrained` (``pretrained("sprite_world")``) for the
    shipped weights, or directly with ``modules=`` for weights of your own. See the module
    docstring for the request schema.
    """

    pipeline_config_type = SpriteWorldPipelineConfig
    supports_step_execution = True

    def __init__(self, config: CausalDiTConfig | str = "sprite_world",
                 pipeline_config: SpriteWorldPipelineConfig | None = None, *, modules: Any = None,
                 device: jax.Device | None = None) -> None:
        super().__init__(config, pipeline_config, modules=modules, device=device)

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: Any) -> None:
        problems = []
        if config.latent_channels != 3 or config.latent_height != config.latent_width:
            problems.append("square RGB pixel latents (latent_channels 3, latent_height == latent_width)")
        if config.control_dim != len(ACTION_NAMES):
            problems.append(f"control_dim == {len(ACTION_NAMES)} (one-hot actions as per-frame controls)")
        if config.num_register_tokens:
            problems.append("no register tokens (the actions condition through the controls)")
        if config.image_len:
            problems.append("no image branch (image_len 0)")
        if problems:
            raise ValueError(f"SpriteWorldPipeline needs a CausalDiTConfig with {'; '.join(problems)}; got {config}")

    @property
    def prediction(self) -> str:  # type: ignore[override]
        return self.pipeline_config.prediction

    @property
    def frame_size(self) -> int:
        """Side of the square RGB frames this model reads and writes (``SpriteWorld(size=...)``)."""
        return self.config.latent_height

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[DiffusionRequest]:
        """One block from a real observation: compiles the prefill, step and decode programs."""
        observation = SpriteWorld(0, size=self.frame_size).reset()
        yield DiffusionRequest("sprite-warmup-0", extra_args={"session_id": session_id, "reset": True},
                               inputs={"observation": observation,
                                       "actions": np.zeros(self.config.frames_per_block, np.int64)})

    # -- request parsing (host only) -------------------------------------------------------------
    def _check_prompt_and_seed(self, session_id: str, request: DiffusionRequest, prompt: Any) -> str | None:
        if prompt not in (None, ""):
            raise ValueError("SpriteWorldPipeline is not text-conditioned: prompt must be None (or '')")
        if request.inputs.get("seed") is not None:
            check_seed(request.inputs["seed"])
        return "" if session_id not in self._sessions else None

    def _parse_observation(self, request: DiffusionRequest) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        size, f = self.frame_size, cfg.frames_per_block
        obs = np.asarray(request.inputs["observation"])
        if obs.ndim == 3:
            obs = obs[None]
        if obs.dtype != np.uint8 or obs.ndim != 4 or obs.shape[1:] != (size, size, 3) or obs.shape[0] == 0:
            raise ValueError(f"inputs['observation'] must be uint8[n, {size}, {size}, 3] or uint8[{size}, {size}, 3] "
                             f"frames (SpriteWorld(size={size}).reset()), got {obs.dtype}{list(obs.shape)}")
        if obs.shape[0] % f:
            raise ValueError(f"inputs['observation'] must hold a multiple of frames_per_block ({f}) frames, "
                             f"got {obs.shape[0]}")
        given = request.inputs.get("observation_actions")
        actions = (np.zeros(obs.shape[0], np.int64) if given is None
                   else _check_actions("inputs['observation_actions']", given, obs.shape[0]))
        return obs, actions

    def _parse_new_block(self, session_id: str, request: DiffusionRequest) -> tuple[str | None, _ParsedBlock]:
        prompt = self._check_prompt_and_seed(session_id, request, request.prompt)
        cfg = self.config
        if "actions" not in request.inputs:
            raise ValueError(f"SpriteWorldPipeline requests need inputs['actions']: int[{cfg.frames_per_block}], "
                             f"the action before each frame of the block ({', '.join(ACTION_NAMES)})")
        num_blocks = self._num_blocks(request)
        given = np.asarray(request.inputs["actions"])
        if given.ndim == 2:  # a streaming request: one row of actions per block
            if given.shape[0] != num_blocks:
                raise ValueError(f"inputs['actions'] must be int[{cfg.frames_per_block}] or "
                                 f"int[num_blocks={num_blocks}, {cfg.frames_per_block}], got {list(given.shape)}")
            session = self._sessions.get(session_id)
            given = given[min(0 if session is None else session.blocks_emitted, num_blocks - 1)]
        actions = _check_actions("inputs['actions']", given, cfg.frames_per_block)
        block = _BlockInputs(None, action_registers(actions, cfg.control_dim))
        new_session = session_id not in self._sessions
        if new_session and request.inputs.get("observation") is None:
            raise ValueError(f"SpriteWorldPipeline session {session_id!r} has no observation yet: its first request "
                             "needs inputs['observation'] (SpriteWorld.reset() frames; the session may have been "
                             "evicted or reset)")
        # A streaming (stepwise) request carries the same inputs on every call: its observation
        # was prefilled before its first block, and later blocks of that request skip it.
        streaming = not new_session and self._sessions[session_id].blocks_emitted > 0
        if not new_session and not streaming and request.inputs.get("observation") is not None:
            raise ValueError(f"SpriteWorldPipeline session {session_id!r} already started: inputs['observation'] is "
                             "only for a session's first request (reset the session to start from a new observation)")
        if new_session:
            obs, obs_actions = self._parse_observation(request)
            return prompt, _ParsedBlock(block, frames_to_latents(obs), action_registers(obs_actions, cfg.control_dim))
        if request.inputs.get("observation_actions") is not None and not streaming:
            raise ValueError(
                "inputs['observation_actions'] goes with inputs['observation'] on a session's first request")
        return prompt, _ParsedBlock(block, None, None)

    # -- device work ------------------------------------------------------------------------------
    def _prefill(self, state: Any, session: _WorldSession, latents: np.ndarray, controls: np.ndarray
                 ) -> _WorldSession:
        """Commit the observation frames as context: one clean ``t = 0`` forward per block; the session after."""
        cfg = self.config
        f = cfg.frames_per_block
        seq_len = f * cfg.tokens_per_frame
        zero = np.float32(0.0)
        for start in range(0, latents.shape[0], f):
            block = self._to_device(latents[start:start + f])

            def forward(view: Any, block: jax.Array = block, start: int = start,
                        session: _WorldSession = session) -> tuple[Any, None]:
                _, _, k, v = world_step(
                    self._graphdef, self._params, view, block, zero, zero, zero,
                    session.key, np.int32(session.block_index), np.int32(self.schedule.num_steps),
                    np.int32(state.adapter(MAIN).committed_frames), state.get_cross_attention_kv(MAIN, "text"),
                    None, self._to_device(controls[start:start + f]), self._previous_frame(session),
                    prediction=self.prediction)
                return (k, v), None

            commit_pass(Lane.single(state), MAIN, seq_len, forward)
            # A "delta" prediction continues from the newest observed frame.
            session = dataclasses.replace(session, last_block=block)
        return session

    def _start_block(self, state: Any, session: _WorldSession, parsed: Any, *, staged: bool = False
                     ) -> _WorldSession:
        if parsed.observation is not None:
            session = self._prefill(state, session, parsed.observation, parsed.observation_controls)
        return super()._start_block(state, session, parsed.block, staged=staged)

    def _finish_block(self, x0: jax.Array) -> jax.Array:
        # Commit the frame the user sees: decoding before the t = 0 forward keeps small
        # errors from accumulating in the context (the next block is conditioned on exactly
        # the decoded frame, as if it had been observed).
        if self.pipeline_config.decoder == "cells":
            return snap_latents(x0)
        return quantise_latents(x0)

    @staticmethod
    def _decoded(block: WorldBlock) -> SpriteBlock:
        return SpriteBlock(frames=np.asarray(latents_to_frames(jax.device_get(block.latents))), latents=block.latents,
                           first_frame=block.first_frame, block_index=block.block_index,
                           ar_diffusion=block.ar_diffusion)

    def forward(self, request: DiffusionRequest) -> SpriteBlock:
        """Generate one block of the bound session (tick mode)."""
        return self._decoded(super().forward(request))

    def forward_batch(self, requests: Sequence[DiffusionRequest]) -> list[SpriteBlock]:
        """One block for each request's session, batched (``SupportsARDiffusionBatch``); equal to :meth:`forward` each."""
        return [self._decoded(block) for block in super().forward_batch(requests)]

    def step(self, request: DiffusionRequest) -> StepResult:
        """One denoise step of a streaming request; the emitted block carries decoded frames."""
        result = super().step(request)
        if result.output is None:
            return result
        return dataclasses.replace(result, output=self._decoded(result.output))
