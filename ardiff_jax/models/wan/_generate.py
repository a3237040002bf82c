"""Prompt to pixels: a prompt schedule through umT5, the causal Wan blocks and the streaming VAE, into a video file.

:func:`generate_video` drives one session of a :class:`CausalWanPipeline` that has a VAE
through :class:`~ardiff_jax.ARDiffusionEngine`, one block per request, until the video
is ``seconds`` long (any length: the attention window slides). Block ``b`` starts at video
frame ``p_b`` (9 frames for the first 3-latent block, 12 for every later one); the prompt
whose schedule entry is the latest at or before ``p_b / fps`` conditions it, so a prompt
switch lands on the first block boundary at or after its time (with the pipeline's
``recache_on_prompt_switch``, LongLive's recache, the history follows it at once).
Frames stream to an MP4 (PyAV) as blocks arrive, so memory does not grow with length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_jax.models.wan._pipeline import CausalWanPipeline, WanBlock

__all__ = ["PromptSchedule", "GeneratedVideo", "generate_video", "write_mp4", "VIDEO_FPS", "placeholder_embeds",
           "PlaceholderTextEncoder"]

#: Wan's video rate (``sample_fps``): 16 frames per second.
VIDEO_FPS = 16


@dataclasses.dataclass(frozen=True)
class PromptSchedule:
    """Prompts with the second each one starts: ``((0.0, "a cat walking"), (5.0, "the cat jumps"))``.

    :meth:`parse` reads the CLI spelling: ``"a cat"`` (one prompt from 0) or ``"T:text"``
    entries (``T`` in seconds). The first entry starts at 0 and start times increase.
    """

    entries: tuple[tuple[float, str], ...]

    def __post_init__(self) -> None:
        entries = tuple((float(t), p) for t, p in self.entries)
        if not entries:
            raise ValueError("a prompt schedule needs at least one prompt")
        if entries[0][0] != 0.0:
            raise ValueError(f"the first prompt must start at 0 s, got {entries[0][0]}")
        for (a, _), (b, _) in zip(entries, entries[1:], strict=False):
            if not b > a:
                raise ValueError(f"prompt start times must increase, got {a} then {b}")
        for _, prompt in entries:
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"every prompt must be a non-empty string, got {prompt!r}")
        object.__setattr__(self, "entries", entries)

    @classmethod
    def parse(cls, values: str | Sequence[str]) -> PromptSchedule:
        values = [values] if isinstance(values, str) else list(values)
        if len(values) == 1 and not _has_time(values[0]):
            return cls(((0.0, values[0]),))
        entries = []
        for value in values:
            if not _has_time(value):
                raise ValueError(f"with several prompts each needs its start: 'SECONDS:text', got {value!r}")
            start, text = value.split(":", 1)
            entries.append((float(start), text.strip()))
        return cls(tuple(entries))

    @property
    def prompts(self) -> tuple[str, ...]:
        return tuple(p for _, p in self.entries)

    def at(self, seconds: float) -> str:
        """The prompt active at ``seconds``."""
        current = self.entries[0][1]
        for start, prompt in self.entries:
            if start <= seconds + 1e-9:
                current = prompt
        return current


def _has_time(value: str) -> bool:
    head = value.split(":", 1)[0] if ":" in value else ""
    try:
        return math.isfinite(float(head)) and float(head) >= 0
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class GeneratedVideo:
    """What :func:`generate_video` made.

    Attributes:
      frames: ``uint8[N, H, W, 3]`` when no ``out`` file was given, else ``None``.
      path: the MP4 written, or ``None``.
      num_frames, fps: video frames and their rate.
      blocks: blocks generated; prompts: the prompt of each block.
      seconds: wall time of the generation; frames_per_second: video frames per wall second.
    """

    frames: np.ndarray | None
    path: Path | None
    num_frames: int
    fps: int
    blocks: int
    prompts: tuple[str, ...]
    seconds: float
    frames_per_second: float


def placeholder_embeds(prompt: str, text_dim: int, length: int = 32) -> np.ndarray:
    """Deterministic stand-in text features ``f32[length, text_dim]`` of a prompt (random-weight timing runs only)."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal((length, text_dim)).astype(np.float32)


class PlaceholderTextEncoder:
    """A stand-in for umT5 in random-weight timing runs: :func:`placeholder_embeds` of each prompt.

    Has the text-encoder interface :class:`CausalWanPipeline` takes (``encode(prompt) -> f32[L, text_dim]``);
    ``calls`` lists the prompts it encoded, in order.
    """

    def __init__(self, text_dim: int, length: int = 32) -> None:
        self.text_dim, self.length = int(text_dim), int(length)
        self.calls: list[str] = []

    def encode(self, prompt: str) -> np.ndarray:
        self.calls.append(prompt)
        return placeholder_embeds(prompt, self.text_dim, self.length)


def _blocks_for(num_frames: int, first: int, later: int) -> int:
    return 1 if num_frames <= first else 1 + math.ceil((num_frames - first) / later)


def generate_video(
    engine: Any,
    prompts: PromptSchedule | str | Sequence[str],
    seconds: float,
    *,
    encode: Callable[[str], np.ndarray] | Mapping[str, np.ndarray] | None = None,
    out: str | Path | None = None,
    fps: int = VIDEO_FPS,
    session_id: str = "video",
    seed: int = 0,
    progress: bool = True,
) -> GeneratedVideo:
    """Generate ``seconds`` of video from a prompt schedule with a causal Wan that has a VAE.

    Args:
      engine: an :class:`~ardiff_jax.ARDiffusionEngine` on a :class:`CausalWanPipeline` built
        with ``vae=``.
      prompts: a :class:`PromptSchedule`, one prompt, or CLI-style ``"T:text"`` entries.
      seconds: video length; ``round(seconds * fps)`` frames (at least 1).
      encode: the prompt's text features ``f32[L, text_dim]``: a function (e.g.
        ``WanTextEncoder.encode``, cached per prompt) or a mapping prompt -> features;
        ``None``: the prompts go to the pipeline as text, for its own ``text_encoder``.
      out: an ``.mp4`` path to stream the frames to (PyAV); ``None`` returns them.
      fps: the video rate (Wan: 16).
      session_id, seed: the engine session and its noise seed (a fresh session).
      progress: a tqdm bar with video frames/s.
    """
    pipeline = engine.runner.pipeline
    if not isinstance(pipeline, CausalWanPipeline) or pipeline.vae is None:
        raise ValueError("generate_video needs an engine on a CausalWanPipeline with a VAE (vae=...)")
    schedule = prompts if isinstance(prompts, PromptSchedule) else PromptSchedule.parse(prompts)
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    num_frames = max(1, round(seconds * fps))
    embeds: dict[str, np.ndarray] = {}
    if encode is None:
        if pipeline.text_encoder is None:
            raise ValueError("generate_video needs encode= (prompt features) for a pipeline without a text_encoder")
    else:
        lookup = encode.__getitem__ if isinstance(encode, Mapping) else encode
        embeds = {prompt: np.asarray(lookup(prompt), np.float32) for prompt in schedule.prompts}  # all checked first
        for value in embeds.values():
            pipeline._check_embeds(value)  # a wrong shape fails here, before any block runs
    f, t = pipeline.config.frames_per_block, pipeline.vae.config.temporal_factor
    first, later = 1 + t * (f - 1), t * f
    num_blocks = _blocks_for(num_frames, first, later)
    writer = _Mp4Writer(Path(out), fps) if out is not None else None
    collected: list[np.ndarray] = []
    used: list[str] = []
    bar = _progress(progress, num_frames)
    written, start = 0, time.perf_counter()
    try:
        for block in range(num_blocks):
            video_frame = 0 if block == 0 else first + (block - 1) * later
            prompt = schedule.at(video_frame / fps)
            used.append(prompt)
            # The prompt goes out only when it changes: the session keeps its current one, and the
            # pipeline would otherwise check and hash the features again on every block.
            changed = block == 0 or prompt != used[-2]
            inputs: dict[str, Any] = {"prompt_embeds": embeds[prompt]} if embeds and changed else {}
            extra: dict[str, Any] = {"session_id": session_id}
            if block == 0:
                inputs["seed"] = seed
                extra["reset"] = True
            text = prompt if not embeds and changed else None
            output: WanBlock = engine.generate(_request(f"{session_id}-{block}", text, inputs, extra))
            frames = np.asarray(output.video)[: num_frames - written]
            written += len(frames)
            if writer is not None:
                writer.write(frames)
            else:
                collected.append(frames)
            if bar is not None:
                bar.update(len(frames))
                bar.set_postfix_str(f"{written / (time.perf_counter() - start):.2f} frames/s")
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        if session_id in engine.sessions:
            engine.close_session(session_id)
    elapsed = time.perf_counter() - start
    return GeneratedVideo(
        frames=None if writer is not None else np.concatenate(collected), path=None if out is None else Path(out),
        num_frames=written, fps=fps, blocks=num_blocks, prompts=tuple(used), seconds=elapsed,
        frames_per_second=written / elapsed)


def _request(request_id: str, prompt: str | None, inputs: dict[str, Any], extra: dict[str, Any]) -> Any:
    from ardiff_jax.types import DiffusionRequest

    return DiffusionRequest(request_id, prompt=prompt, inputs=inputs, extra_args=extra)


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="frame", desc="generate")


class _Mp4Writer:
    """Frames ``uint8[f, H, W, 3]`` appended to an H.264 MP4 (MPEG-4 Part 2 where PyAV's FFmpeg lacks libx264)."""

    def __init__(self, path: Path, fps: int) -> None:
        try:
            import av
        except ImportError as error:
            raise ImportError("writing an MP4 needs PyAV: pip install 'ardiff_jax[serve]'") from error
        self._av = av
        self.path = path
        self.fps = fps
        self._container = None
        self._stream = None

    def write(self, frames: np.ndarray) -> None:
        av = self._av
        if self._container is None:
            height, width = frames.shape[1:3]
            self._container = av.open(str(self.path), mode="w")
            codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
            self._stream = self._container.add_stream(codec, rate=self.fps)
            self._stream.width, self._stream.height = width + width % 2, height + height % 2
            self._stream.pix_fmt = "yuv420p"
        for frame in frames:
            if frame.shape[0] % 2 or frame.shape[1] % 2:  # yuv420p needs even sizes: repeat the last row/column
                frame = np.pad(frame, ((0, frame.shape[0] % 2), (0, frame.shape[1] % 2), (0, 0)), mode="edge")
            for packet in self._stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                self._container.mux(packet)

    def close(self) -> None:
        if self._container is None:
            return
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()
        self._container = None


def write_mp4(frames: np.ndarray | Iterator[np.ndarray], path: str | Path, fps: int = VIDEO_FPS) -> Path:
    """Write ``uint8[N, H, W, 3]`` frames (or an iterator of ``[f, H, W, 3]`` chunks) to an MP4 with PyAV."""
    writer = _Mp4Writer(Path(path), fps)
    try:
        chunks = [frames] if isinstance(frames, np.ndarray) else frames
        for chunk in chunks:
            writer.write(np.asarray(chunk, np.uint8))
    finally:
        writer.close()
    return Path(path)
