"""Image + action script -> Matrix-Game 2.0 blocks through the engine -> an MP4.

The action script is JSON, one row per video frame::

    {"keyboard": [[1, 0, 0, 0], ...], "mouse": [[0.0, 0.1], ...]}

(``mouse`` absent for Temple Run). ``1 + 4 (F - 1)`` rows give ``F`` latent frames; the
script is consumed a block at a time (9 rows, then 12 per block), and rows past the last
whole block are dropped. Universal keys are ``[W, S, A, D]`` one-hot; mouse ``[pitch, yaw]``
steps of about 0.1; GTA drive ``[W, S]``; Temple Run a 7-way one-hot (index 0 = no-op).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_jax._files import read_json_file
from ardiff_jax.models.wan import random_vae, write_mp4
from ardiff_jax.types import DiffusionRequest

__all__ = ["MATRIX_GAME_FPS", "ActionScript", "build_matrix_game", "generate_matrix_game", "prepare_image"]

#: The release's real-time rate (its demos and FastVideo's default).
MATRIX_GAME_FPS = 25


@dataclasses.dataclass(frozen=True)
class ActionScript:
    """Keyboard ``f32[N, K]`` and mouse ``f32[N, M]`` (or None) rows, one per video frame."""

    keyboard: np.ndarray
    mouse: np.ndarray | None

    @classmethod
    def load(cls, path: str | Path) -> ActionScript:
        """The script in the JSON file ``path``: ``{"keyboard": [[...], ...], "mouse": [[...], ...]}`` (mouse
        optional). Read bounded (:func:`ardiff_jax._files.read_json_file`): a FIFO, device or directory, a file over
        4 MiB, malformed or too deeply nested JSON, NaN/Infinity, or a missing file are a ValueError naming it."""
        try:
            data = read_json_file(path, error=ValueError, what="action script")
        except FileNotFoundError as error:
            raise ValueError(str(error)) from None
        except OSError as error:
            raise ValueError(f"action script {path} could not be read ({error.strerror or error})") from None
        if not isinstance(data, dict) or "keyboard" not in data:
            raise ValueError(f"{path}: an action script is a JSON object with 'keyboard' (and 'mouse') rows")
        keyboard = np.asarray(data["keyboard"], np.float32)
        mouse = None if data.get("mouse") is None else np.asarray(data["mouse"], np.float32)
        if keyboard.ndim != 2 or (mouse is not None and (mouse.ndim != 2 or mouse.shape[0] != keyboard.shape[0])):
            raise ValueError(f"{path}: 'keyboard' must be [N, K] and 'mouse' [N, M] with the same N")
        return cls(keyboard, mouse)

    def num_blocks(self, frames_per_block: int, frames_per_latent: int) -> int:
        first = 1 + frames_per_latent * (frames_per_block - 1)
        if self.keyboard.shape[0] < first:
            raise ValueError(f"the action script has {self.keyboard.shape[0]} rows; the first block needs {first}")
        return 1 + (self.keyboard.shape[0] - first) // (frames_per_latent * frames_per_block)


def prepare_image(image: Any, height: int, width: int) -> np.ndarray:
    """A PIL image or path -> ``uint8[height, width, 3]``: scaled to cover, then center-cropped (the release's
    resize-crop)."""
    from PIL import Image

    picture = Image.open(image) if isinstance(image, (str, Path)) else image
    picture = picture.convert("RGB")
    scale = max(height / picture.height, width / picture.width)
    size = (max(width, round(picture.width * scale)), max(height, round(picture.height * scale)))
    picture = picture.resize(size, Image.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(picture.crop((left, top, left + width, top + height)), np.uint8)


def generate_matrix_game(engine: Any, image: np.ndarray, image_embeds: np.ndarray, actions: ActionScript, *,
                         out: str | Path | None = None, fps: int = MATRIX_GAME_FPS, session_id: str = "play",
                         seed: int = 0) -> tuple[np.ndarray | None, int, float]:
    """Play ``actions`` from ``image`` on a :class:`MatrixGamePipeline` engine; returns ``(frames or None, frames,
    seconds)`` and writes ``out`` (MP4) when given."""
    pipeline = engine.runner.pipeline
    cfg = pipeline.config
    action = cfg.action
    blocks = actions.num_blocks(cfg.frames_per_block, action.frames_per_latent)
    first = action.num_rows(cfg.frames_per_block)
    per_block = action.frames_per_latent * cfg.frames_per_block

    def chunks():
        for block in range(blocks):
            rows = slice(0, first) if block == 0 else slice(first + per_block * (block - 1), first + per_block * block)
            inputs: dict[str, Any] = {"keyboard": actions.keyboard[rows]}
            if actions.mouse is not None:
                inputs["mouse"] = actions.mouse[rows]
            if block == 0:
                inputs.update(image=image, image_embeds=image_embeds, seed=seed)
            out_block = engine.generate(DiffusionRequest(f"{session_id}-{block}", inputs=inputs,
                                                         extra_args={"session_id": session_id}))
            yield np.asarray(out_block.video)

    start = time.perf_counter()
    if out is not None:
        count = 0

        def counted():
            nonlocal count
            for chunk in chunks():
                count += chunk.shape[0]
                yield chunk

        write_mp4(counted(), out, fps)
        return None, count, time.perf_counter() - start
    frames = np.concatenate(list(chunks()))
    return frames, frames.shape[0], time.perf_counter() - start


def run_generate_cli(args: Any, refuse: Any) -> int:
    """``ardiff-jax generate --model matrix-game``: check the arguments (host only), build, play, write the MP4."""
    from ardiff_jax.models import DIT_PRESETS, dit_preset

    for flag, value in (("--prompt", args.prompt), ("--prompt-embeds", args.prompt_embeds),
                        ("--text-encoder", args.text_encoder), ("--lora", args.lora), ("--policy", args.policy),
                        ("--seconds", args.seconds)):
        if value:
            return refuse("generate", f"argument {flag}: not for --model matrix-game (an image and actions drive it; "
                                      "the actions set the length)")
    if args.image is None or args.actions is None:
        return refuse("generate", "--model matrix-game needs --image and --actions")
    if args.preset is not None and (args.preset not in DIT_PRESETS or dit_preset(args.preset).action is None):
        choices = sorted(n for n in DIT_PRESETS if dit_preset(n).action is not None)
        return refuse("generate", f"argument --preset: {args.preset!r} is not a Matrix-Game preset; choose from "
                                  f"{', '.join(choices)}")
    if not args.random_weights:
        if args.vae is None:
            return refuse("generate", "argument --vae: needed to encode the image and decode video (Wan2.1_VAE.pth)")
        if args.clip is None:
            return refuse("generate", "argument --clip: needed to encode the image (the open-clip ViT-H/14 .pth)")
    elif args.vae or args.clip:
        return refuse("generate", "--random-weights builds every part itself: drop --vae and --clip")
    try:
        actions = ActionScript.load(args.actions)
    except ValueError as error:
        return refuse("generate", f"argument --actions: {error}")
    try:
        return _play(args, actions)
    except (ValueError, OSError, ImportError) as error:
        return refuse("generate", str(error))


def _play(args: Any, actions: ActionScript) -> int:
    import sys

    import jax.numpy as jnp

    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

    pipeline = build_matrix_game(weights=args.weights, preset=args.preset, vae=args.vae, clip=args.clip,
                                 dtype=args.dtype, random_weights=args.random_weights, session_capacity=1)
    if args.random_weights:
        print("random weights: the video is noise-like; this run measures speed", file=sys.stderr)
    image = prepare_image(args.image, *pipeline.pixel_hw)
    pixels = jnp.asarray(image.astype(np.float32).transpose(2, 0, 1) / 127.5 - 1.0)
    embeds = np.asarray(pipeline.image_encoder.encode_image(pixels), np.float32)
    available = None if args.available_gib is None else int(args.available_gib)
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype=args.dtype, available_memory_bytes=available,
                                                      gpu_memory_fraction=0.9))
    try:
        _, frames, seconds = generate_matrix_game(engine, image, embeds, actions, out=args.out, seed=args.seed)
    finally:
        engine.close()
    print(f"{frames} frames ({frames / MATRIX_GAME_FPS:.2f} s at {MATRIX_GAME_FPS} fps) in {seconds:.1f} s, "
          f"{frames / max(seconds, 1e-9):.2f} frames/s: {args.out}")
    return 0


def build_matrix_game(*, weights: Any = None, preset: str | None = None, vae: Any = None, clip: Any = None,
                      dtype: str = "bfloat16", random_weights: bool = False, session_capacity: int = 1) -> Any:
    """The :class:`MatrixGamePipeline` of released weights (``weights``, ``vae``, ``clip``: their files) or, with
    ``random_weights``, of random ones for ``preset`` (default ``matrix-game-2-universal``): a VAE of the
    preset's channels and a CLIP encoder whose tokens fit its context. Temple Run samples 4 steps, the other
    variants 3, as released. Used by ``generate`` and ``serve``."""
    from flax import nnx

    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.matrix_game._clip import ClipVisionConfig, ClipVisionEncoder, load_clip_vision
    from ardiff_jax.models.matrix_game._pipeline import MatrixGamePipeline, MatrixGamePipelineConfig
    from ardiff_jax.models.wan import WanVAEConfig, checkpoint_config, load_vae, warped_schedule

    def pipeline_config(config: Any) -> MatrixGamePipelineConfig:
        if config.action.keyboard_dim == 7 and config.action.mouse_dim == 0:  # Temple Run: 4 steps
            return MatrixGamePipelineConfig(session_capacity=session_capacity, schedule=warped_schedule())
        return MatrixGamePipelineConfig(session_capacity=session_capacity)

    if random_weights:
        config = dit_preset(preset or "matrix-game-2-universal", dtype=dtype, param_dtype=dtype)
        channels = config.latent_channels
        vae_config = WanVAEConfig(dtype=dtype) if channels == WanVAEConfig().z_dim else WanVAEConfig.tiny(
            base_dim=8, z_dim=channels, latents_mean=(0.0,) * channels, latents_std=(1.0,) * channels, dtype=dtype)
        clip_config = ClipVisionConfig()
        if (clip_config.num_tokens, clip_config.dim) != (config.text_len, config.text_dim):  # a small test network
            side = round((config.text_len - 1) ** 0.5)
            clip_config = ClipVisionConfig(image_size=14 * side, patch_size=14, dim=config.text_dim,
                                           heads=max(1, config.text_dim // 8), layers=2, output_blocks=2)
        return MatrixGamePipeline(config, pipeline_config(config), vae=random_vae(vae_config),
                                  image_encoder=ClipVisionEncoder(clip_config, rngs=nnx.Rngs(1)))
    config = dit_preset(preset) if preset else checkpoint_config(weights)
    return MatrixGamePipeline.from_checkpoint(weights, config, vae=load_vae(vae, dtype=dtype),
                                              image_encoder=load_clip_vision(clip),
                                              pipeline_config=pipeline_config(config), dtype=dtype)
