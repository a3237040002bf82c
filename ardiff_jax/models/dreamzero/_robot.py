"""``DreamZeroRobotPolicy``: RoboArena / openpi observations to DROID joint targets through the engine.

Each robot (a connection of the policy server) is one engine session of :class:`DreamZeroPipeline`. Per
call, as the release's server and ``lazy_joint_video_action`` do (``_droid`` has the transforms):

* the views are cropped, resized and tiled into one canvas per frame and buffered per robot;
* an episode's first call encodes its one frame: CLIP features, the image-to-video condition (the VAE of
  the frame followed by ``4 (window - 1)`` zero frames, a 4-channel mask on latent frame 0) and the
  frame's latent, committed at frame 0; the instruction goes through the DROID prompt template and the
  text encoder (cached per instruction), the negative prompt once;
* a later call takes the last 4 frames, repeats each twice, prefixes the first (9 frames), encodes
  them (3 latents) and commits the last 2; when the episode's window is full, its last frame starts a
  new episode, as the release does;
* the state is q99-normalised, the action chunk un-normalised and made absolute (``[24, 8]``).

Concurrent robots' calls are one ``engine.generate_batch`` (one batched forward per denoising step).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax.models.dreamzero._droid import (
    FRAMES_PER_CHUNK,
    NEGATIVE_PROMPT,
    VIEW_KEYS,
    DroidStatistics,
    FrameBuffer,
    actions_to_targets,
    droid_prompt,
    normalize_state,
    resize_views,
    tile_views,
)
from ardiff_jax.models.dreamzero._watch import PredictedVideo, PredictedVideoDecoder
from ardiff_jax.models._common import jitted_encode_image
from ardiff_jax.types import DiffusionRequest

__all__ = ["DreamZeroRobotPolicy", "ROBOT_POLICY_CONFIG"]

#: What the policy server tells a RoboArena client on connect (its ``PolicyServerConfig``).
ROBOT_POLICY_CONFIG = {"image_resolution": [180, 320], "needs_wrist_camera": True, "n_external_cameras": 2,
                       "needs_stereo_camera": False, "needs_session_id": True, "action_space": "joint_position"}
#: Frames one message may carry per view (the release's client sends 1; a bound on what a message can make us hold).
MAX_FRAMES_PER_MESSAGE = 16
_STATE_KEYS = (("observation/joint_position", 7), ("observation/gripper_position", 1))


@dataclasses.dataclass
class _Robot:
    buffer: FrameBuffer
    instruction: str | None = None


class DreamZeroRobotPolicy:
    """The robot-policy interface of the policy server (``validate``, ``infer_batch``, ``reset``, ``close``).

    Args:
      engine: an ``ARDiffusionEngine`` over ``pipeline``, a :class:`DreamZeroPipeline`.
      vae: a Wan VAE (``encode(video f32[1 + 4k, 3, H, W]) -> f32[1 + k, 16, H/8, W/8]``).
      clip: an image encoder (``encode_image(f32[3, H, W] in [-1, 1]) -> f32[257, 1280]``).
      text_encoder: ``encode(prompt) -> f32[L, 4096]`` (umT5; rows past the prompt are zero-padded here).
      statistics: :class:`DroidStatistics` (the checkpoint's ``metadata.json``; ``stand_in()`` for random weights).
      view_hw: one view's size in the canvas: ``(8 h / 2, 8 w / 2)`` of the latent ``h x w`` (176 x 320 for DROID).
    """

    def __init__(self, engine: Any, pipeline: Any, *, vae: Any, clip: Any, text_encoder: Any, statistics: DroidStatistics,
                 view_hw: tuple[int, int] | None = None) -> None:
        self.engine = engine
        self.pipeline = pipeline
        self.config = self.pipeline.config
        self.vae, self.clip, self.text_encoder, self.statistics = vae, clip, text_encoder, statistics
        cfg = self.config
        self.view_hw = view_hw or (cfg.latent_height * 4, cfg.latent_width * 4)
        self._robots: dict[str, _Robot] = {}
        #: Seconds of the last round's phases per robot: ``image_s`` (crop, resize, tile, buffer), ``encoders_s``
        #: (VAE, CLIP, text), ``loop_s`` (the engine call, shared by the round's robots), ``reply_s`` (the targets).
        self.timings: dict[str, dict[str, float]] = {}
        self._prompts: dict[str, np.ndarray] = {}
        # Each robot's last predicted video and its inference count (see take_video): a reference to the engine's
        # array, replaced by the next call, decoded only by a viewer's decoder.
        self._videos: dict[str, PredictedVideo] = {}
        self._inferences: dict[str, int] = {}
        self._lock = threading.Lock()
        # Both encoders take their weights as arguments: a jit closing over a module bakes its weights into the
        # program as constants (CLIP ViT-H: ~630M). The VAE runs its own per-chunk programs (one jit around the
        # whole encode would also compile the unrolled chunks again for each clip length); CLIP is split once.
        self._encode_video = self.vae.encode
        self._encode_image = jitted_encode_image(self.clip)

    # -- checks -------------------------------------------------------------------------------------------
    def validate(self, session_key: str, obs: Mapping[str, Any]) -> None:
        """Every check of an observation, on the host, before anything changes (ValueError naming the key)."""
        if not isinstance(obs, Mapping):
            raise ValueError("an observation must be a dict")
        frames = set()
        for key in VIEW_KEYS:
            if key not in obs:
                raise ValueError(f"observation is missing {key!r}")
            view = np.asarray(obs[key])
            if view.ndim == 3:
                view = view[None]
            if view.dtype != np.uint8 or view.ndim != 4 or view.shape[3] != 3 or view.shape[1] < 8 \
                    or view.shape[2] < 8 or view.shape[1] > 2048 or view.shape[2] > 2048:
                raise ValueError(f"observation {key!r} must be uint8 (H, W, 3) or (T, H, W, 3), got "
                                 f"{view.dtype}{list(view.shape)}")
            if not 1 <= view.shape[0] <= MAX_FRAMES_PER_MESSAGE:
                raise ValueError(f"observation {key!r} holds {view.shape[0]} frames; 1..{MAX_FRAMES_PER_MESSAGE} "
                                 "per message")
            frames.add(view.shape[:3])
        if len(frames) != 1:
            raise ValueError(f"the three views must have the same frame count and size, got {sorted(frames)}")
        for key, width in _STATE_KEYS:
            if key not in obs:
                raise ValueError(f"observation is missing {key!r}")
            value = np.asarray(obs[key])
            if value.dtype.kind not in "fiu" or value.size != width or not np.isfinite(value.astype(np.float64)).all():
                raise ValueError(f"observation {key!r} must be {width} finite numbers, got {value.dtype}{list(value.shape)}")
        prompt = obs.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > 2000:
            raise ValueError("observation 'prompt' must be a non-empty instruction string (at most 2000 characters)")

    # -- encoders -------------------------------------------------------------------------------------------
    def _canvas(self, obs: Mapping[str, Any]) -> np.ndarray:
        views = []
        for key in VIEW_KEYS:
            view = np.asarray(obs[key])
            views.append(resize_views(view[None] if view.ndim == 3 else view, self.view_hw))
        return tile_views(*views)

    @staticmethod
    def _unit(frames: np.ndarray) -> jax.Array:
        """``uint8[T, H, W, 3]`` -> ``f32[T, 3, H, W]`` in ``[-1, 1]`` (the release's ``/255`` and Normalize(0.5, 0.5))."""
        return jnp.asarray(frames.transpose(0, 3, 1, 2), jnp.float32) / 255.0 * 2.0 - 1.0

    def _prompt(self, text: str) -> np.ndarray:
        cached = self._prompts.get(text)
        if cached is None:
            cached = np.asarray(self.text_encoder.encode(text), np.float32)[: self.config.text_len]
            if len(self._prompts) > 64:
                self._prompts.pop(next(iter(self._prompts)))
            self._prompts[text] = cached
        return cached

    def _episode_start(self, frame: np.ndarray) -> dict[str, np.ndarray]:
        """The release's ``encode_image``: CLIP of the frame, ``ys`` = mask + VAE(frame + zero frames), the latent."""
        cfg = self.config
        unit = self._unit(frame[None])  # [1, 3, H, W]
        clip = np.asarray(self._encode_image(unit[0]), np.float32)
        zeros = jnp.zeros((4 * (cfg.window_frames - 1), *unit.shape[1:]), jnp.float32)
        latents = np.asarray(self._encode_video(jnp.concatenate([unit, zeros])), np.float32)  # [window, C, h, w]
        mask = np.zeros((latents.shape[0], 4, *latents.shape[2:]), np.float32)
        mask[0] = 1.0
        return {"latents": latents[0:1], "condition": np.concatenate([mask, latents], axis=1), "clip": clip}

    def _observed_latents(self, frames: np.ndarray) -> np.ndarray:
        """4 frames -> each repeated twice, the first prefixed (9 frames) -> 3 latents -> the last 2."""
        repeat = self.config.frames_per_block // max(1, frames.shape[0] // FRAMES_PER_CHUNK)
        video = np.repeat(frames, repeat, axis=0)
        video = np.concatenate([video[:1], video])
        latents = np.asarray(self._encode_video(self._unit(video)), np.float32)
        return latents[-self.config.frames_per_block:]

    # -- the policy interface --------------------------------------------------------------------------------
    def infer_batch(self, items: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Any]:
        """One batched engine tick for several robots: ``[24, 8]`` float32 targets, or the Exception of a robot
        whose call failed (the others are served)."""
        with self._lock:
            requests, contexts, results = [], [], [None] * len(items)
            for index, (key, obs) in enumerate(items):
                try:
                    self.validate(key, obs)
                    requests.append(self._request(key, obs))
                    contexts.append((index, np.asarray(obs["observation/joint_position"], np.float32).reshape(-1)))
                except Exception as error:  # noqa: BLE001 - this robot's failure is its own
                    results[index] = error
            if requests:
                began = time.perf_counter()
                try:
                    outputs = self.engine.generate_batch(requests) if len(requests) > 1 \
                        else [self.engine.generate(requests[0])]
                    outputs = [o if isinstance(o, Exception) else {**o, "actions": np.asarray(o["actions"])}
                               for o in outputs]
                except Exception as error:  # noqa: BLE001
                    outputs = [error] * len(requests)
                loop_s = time.perf_counter() - began
                for (index, joint), output in zip(contexts, outputs, strict=True):
                    began = time.perf_counter()
                    key = items[index][0]
                    count = self._inferences[key] = self._inferences.get(key, 0) + 1
                    if isinstance(output, Exception):
                        results[index] = output
                        self._videos.pop(key, None)
                    else:
                        results[index] = actions_to_targets(self.statistics, output["actions"], joint)
                        video = output["video"]
                        # An episode's first call returns the conditioning frame before the chunk (1 + f latents).
                        self._videos[key] = PredictedVideo(video, count, video.shape[0] != self.config.frames_per_block)
                    timing = self.timings.setdefault(items[index][0], {})
                    timing.update(loop_s=loop_s, reply_s=time.perf_counter() - began)
            return results

    def take_video(self, session_key: str) -> PredictedVideo | None:
        """The key's last inference's :class:`PredictedVideo`, handed over once (None: none since, or it failed).

        Called by the policy server on its event loop after the robot's reply, while an ``infer_batch`` may run:
        a dict pop, atomic, never waits for the policy's lock (a running batch writes other keys only, as a
        robot's next call is read after this one's reply)."""
        return self._videos.pop(session_key, None)

    def video_decoder(self) -> PredictedVideoDecoder:
        """A fresh streaming decoder of predicted videos (one per viewer; see :mod:`._watch`)."""
        return PredictedVideoDecoder(self.vae, (self.config.latent_height, self.config.latent_width))

    def _request(self, key: str, obs: Mapping[str, Any]) -> DiffusionRequest:
        began = time.perf_counter()
        robot = self._robots.get(key)
        instruction = obs["prompt"]
        if robot is None or robot.instruction != instruction:  # a new robot or a new task: a new episode
            robot = self._robots[key] = _Robot(FrameBuffer(), instruction)
        canvas = self._canvas(obs)
        robot.buffer.add(canvas)
        state = normalize_state(self.statistics, np.asarray(obs["observation/joint_position"], np.float32).reshape(-1),
                                np.asarray(obs["observation/gripper_position"], np.float32).reshape(-1))[:8]
        frames = robot.buffer.take()
        imaged = time.perf_counter()
        inputs: dict[str, Any] = {"state": state}
        if frames.shape[0] == 1:
            inputs.update(self._episode_start(frames[0]))
            inputs["prompt_embeds"] = self._prompt(droid_prompt(instruction))
            inputs["negative_prompt_embeds"] = self._prompt(NEGATIVE_PROMPT)
        else:
            inputs["latents"] = self._observed_latents(frames)
            if self.pipeline.episode_full(key):  # the release restarts from the call's last frame
                inputs["restart"] = self._episode_start(frames[-1])
        self.timings[key] = {"image_s": imaged - began, "encoders_s": time.perf_counter() - imaged}
        return DiffusionRequest(f"{key}-{robot.buffer.calls}", extra_args={"session_id": key}, inputs=inputs)

    def reset(self, session_key: str) -> None:
        """A new episode: the robot's frames and the engine session go (its next call starts from one frame)."""
        with self._lock:
            self._robots.pop(session_key, None)
            self._videos.pop(session_key, None)
            self._inferences.pop(session_key, None)
            if session_key in self.engine.sessions or session_key in self.engine.offloaded_sessions:
                self.engine.close_session(session_key)

    def close(self, session_key: str) -> None:
        self.reset(session_key)


def build_robot_policy(*, preset: str = "dreamzero-tiny", checkpoint: Any = None, vae: Any = None, clip: Any = None,
                       text_encoder: Any = None, metadata: Any = None, session_capacity: int = 4,
                       engine_config: Any = None, dtype: str | None = None) -> DreamZeroRobotPolicy:
    """A served DreamZero policy: the pipeline (a release checkpoint, or random weights of ``preset``), its engine
    and the encoders. With ``checkpoint=None`` every part is random and small enough for a CPU: a width-8 Wan
    VAE, a 1-block CLIP of the real token shape (257 x 1280), placeholder text features and stand-in
    statistics (:meth:`DroidStatistics.stand_in`): the path works, the actions mean nothing. With a
    checkpoint, ``vae``, ``clip`` and ``text_encoder`` are the Wan2.1 encoders DreamZero froze (loaded by the
    caller: ``load_vae``, ``load_clip_vision``, ``WanTextEncoder``) and ``metadata`` its
    ``experiment_cfg/metadata.json`` (default: beside the checkpoint)."""
    from pathlib import Path

    from flax import nnx

    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.dreamzero._pipeline import DreamZeroPipeline, DreamZeroPipelineConfig
    from ardiff_jax.models.matrix_game import ClipVisionConfig, ClipVisionEncoder
    from ardiff_jax.models.wan import PlaceholderTextEncoder, WanVAEConfig, random_vae

    pipeline_config = DreamZeroPipelineConfig(session_capacity=session_capacity)
    if checkpoint is None:
        overrides = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
        config = dit_preset(preset, **overrides)
        pipeline = DreamZeroPipeline(config, pipeline_config)
        channels = config.latent_channels
        vae = random_vae(WanVAEConfig.tiny(base_dim=8, z_dim=channels, latents_mean=(0.0,) * channels,
                                           latents_std=(1.0,) * channels))
        clip = ClipVisionEncoder(ClipVisionConfig(layers=1, output_blocks=1), rngs=nnx.Rngs(1))
        text_encoder = PlaceholderTextEncoder(config.text_dim)
        statistics = DroidStatistics.stand_in()
    else:
        if vae is None or clip is None or text_encoder is None:
            raise ValueError("a DreamZero checkpoint is served with its frozen encoders: pass vae, clip and "
                             "text_encoder (the Wan2.1 VAE, CLIP ViT-H/14 and umT5-XXL)")
        pipeline = DreamZeroPipeline.from_checkpoint(checkpoint, pipeline_config=pipeline_config,
                                                     **({} if dtype is None else {"dtype": dtype}))
        metadata = Path(checkpoint) / "experiment_cfg" / "metadata.json" if metadata is None else metadata
        statistics = DroidStatistics.from_metadata(metadata)
    engine = ARDiffusionEngine(pipeline, engine_config or EngineConfig(dtype=pipeline.config.dtype, warmup=False))
    return DreamZeroRobotPolicy(engine, pipeline, vae=vae, clip=clip, text_encoder=text_encoder,
                                statistics=statistics)
