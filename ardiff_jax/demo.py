"""``ardiff-jax demo``: the trained SpriteWorld model, played through the engine and checked against the simulator.

The demo opens several sessions (each its own SpriteWorld seed) on one
:class:`~ardiff_jax.ARDiffusionEngine`, drives every session and its simulator with the same
seeded random actions, round-robin, one block per request, far past the attention window,
and reports how closely the generated frames track the simulator:

* **tracking error**: mean absolute per-pixel error (0-255 scale, over ``H x W x 3``)
  between generated and simulated frames, over the first and second half of the rollout;
* the same figure for **repeat the first frame** (a model that never moves anything) and
  for the **untrained** model (same architecture, random weights, same engine path: what
  the runtime alone would show, so the difference is what training contributed);
* **exact frames** per session: generated frames identical to the simulator's before the
  first one that is not (:func:`exact_frames`);
* **one-step accuracy** on held-out transitions with the true context
  (:func:`ardiff_jax.training.one_step_accuracy`): agent cell, ball cell, whole frame;
* frames/s of one session alone, of the interleaved sessions (one request at a time) and
  of 4 sessions batched (``engine.generate_batch``: one forward per round for all of
  them), per-request latency percentiles, and the memory plan.

Frames are decoded the way the pipeline decodes them for every user: each 4x4 cell snapped
to the nearest of the seven looks a SpriteWorld cell can have
(``SpriteWorldPipelineConfig.decoder="cells"``), so a frame shows only what the world can
show; a sprite in the wrong cell still counts as wrong.

With more sessions than the engine's capacity, LRU eviction drops a session's KV. The
world is fully observable, so the demo restarts an evicted session from its own last
generated frame (a new observation prefill) and counts the restarts; with host offload
(a later feature) the session would resume exactly instead.

Outputs (:func:`write_demo_outputs`): one GIF per session (generated | simulator, with a caption
strip naming each side, the frame number and the colours: the agent is the green square, the
ball the one with red in it (red, yellow, magenta or white: its colour is its direction), blue
cells are walls), a contact-sheet PNG (per session a "model" row above a
"simulator" row, frame numbers on top), ``summary.json`` (with the machine it ran on), and
``session_<i>.npz`` with ``frames``, ``truth`` and ``actions``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ardiff_jax._machine import machine_summary
from ardiff_jax.envs import ACTION_NAMES, SpriteWorld
from ardiff_jax.models import SpriteWorldPipeline, pretrained, pretrained_metadata
from ardiff_jax.runtime import ARDiffusionEngine
from ardiff_jax.types import DiffusionRequest, EngineConfig

__all__ = ["SessionTrack", "drive_sessions", "random_actions", "tracking_errors", "exact_frames", "quality_summary",
           "run_demo", "write_demo_outputs", "contact_sheet", "verdict"]


@dataclasses.dataclass
class SessionTrack:
    """One session's rollout next to its simulator.

    Attributes:
      seed: the SpriteWorld seed.
      frames: ``u8[N + 1, H, W, 3]`` frame 0 is the observation, frames 1.. generated.
      truth: ``u8[N + 1, H, W, 3]`` the simulator's frames (``truth[0] == frames[0]``).
      actions: ``i32[N + 1]`` the action before each frame (``actions[0]`` is the no-op before reset).
      latencies_ms: per-request latency (one request per block).
      restarts: times the session was evicted and restarted from its last frame.
    """

    seed: int
    frames: np.ndarray
    truth: np.ndarray
    actions: np.ndarray
    latencies_ms: list[float]
    restarts: int = 0


def random_actions(seed: int, num_frames: int, repeat_probability: float = 0.75) -> np.ndarray:
    """``i32[num_frames + 1]``: a no-op, then actions that repeat the previous one with ``repeat_probability``."""
    rng = np.random.default_rng(seed)
    actions = np.zeros(num_frames + 1, np.int32)
    for t in range(1, num_frames + 1):
        repeat = t > 1 and rng.random() < repeat_probability
        actions[t] = actions[t - 1] if repeat else rng.integers(len(ACTION_NAMES))
    return actions


def drive_sessions(engine: ARDiffusionEngine, seeds: Sequence[int], num_frames: int, *, action_seed: int = 0,
                   on_block: Callable[[int, float], None] | None = None, batched: bool = False) -> list[SessionTrack]:
    """Drive one session per SpriteWorld seed and its simulator with the same actions, round-robin.

    Every session gets ``num_frames`` generated frames after its observation (a multiple of
    the pipeline's ``frames_per_block``). ``on_block(session_index, latency_ms)`` is called
    after every request (progress bars hook in here). With ``batched``, each round's blocks
    are requested with ``engine.generate_batch`` in groups of at most the engine's capacity
    (one batched forward per group; the same frames as one by one); a session's latency is
    then its group's.
    """
    pipeline = engine.runner.pipeline
    f = pipeline.config.frames_per_block
    if num_frames % f:
        raise ValueError(f"num_frames ({num_frames}) must be a multiple of frames_per_block ({f})")
    size = pipeline.config.latent_height
    worlds = [SpriteWorld(seed, size=size) for seed in seeds]
    tracks = []
    for i, world in enumerate(worlds):
        first = world.reset()
        tracks.append(SessionTrack(seed=int(world.seed), frames=[first], truth=[first],
                                   actions=random_actions(action_seed * 7919 + i, num_frames), latencies_ms=[]))
    ids = [f"world-{i}-seed-{track.seed}" for i, track in enumerate(tracks)]
    group_size = engine.session_capacity if batched else 1
    for block in range(num_frames // f):
        for first in range(0, len(tracks), group_size):
            group = range(first, min(first + group_size, len(tracks)))
            requests = []
            for i in group:
                track = tracks[i]
                inputs: dict[str, Any] = {"actions": track.actions[1 + block * f: 1 + (block + 1) * f]}
                if ids[i] not in engine.sessions:  # new, or evicted by LRU: (re)start from the last frame
                    inputs["observation"] = np.stack(track.frames[-f:])
                    track.restarts += block > 0
                requests.append(DiffusionRequest(f"{ids[i]}-b{block}", extra_args={"session_id": ids[i]},
                                                 inputs=inputs))
            start = time.perf_counter()
            outs = engine.generate_batch(requests) if batched else [engine.generate(requests[0])]
            latency = (time.perf_counter() - start) * 1e3
            for i, out in zip(group, outs, strict=True):
                track, world = tracks[i], worlds[i]
                track.latencies_ms.append(latency)
                track.frames.extend(out.frames)
                track.truth.extend(world.step(int(a)) for a in track.actions[1 + block * f: 1 + (block + 1) * f])
                if on_block is not None:
                    on_block(i, latency)
    for session_id in ids:
        if session_id in engine.sessions:
            engine.close_session(session_id)
    for track in tracks:
        track.frames, track.truth = np.stack(track.frames), np.stack(track.truth)
    return tracks


def tracking_errors(frames: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """``f32[N]``: mean absolute per-pixel error (0-255) of each frame against the simulator."""
    return np.abs(frames.astype(np.float32) - truth.astype(np.float32)).mean(axis=(1, 2, 3))


def _halves(errors: np.ndarray) -> tuple[float, float]:
    """Means over the first and second half of the generated frames (frame 0, the observation, excluded)."""
    generated = errors[1:]
    half = len(generated) // 2
    return float(generated[:half].mean()), float(generated[half:].mean())


def exact_frames(frames: np.ndarray, truth: np.ndarray) -> int:
    """Generated frames identical to the simulator's, pixel for pixel, before the first one that is not.

    Frame 0 (the observation) is not counted. A per-session figure that a mean error hides: how
    long the model plays the world exactly before its first mistake.
    """
    same = np.all(frames[1:] == truth[1:], axis=(1, 2, 3))
    return int(len(same)) if same.all() else int(np.argmin(same))


def quality_summary(tracks: Sequence[SessionTrack], untrained: Sequence[SessionTrack] | None = None) -> dict[str, Any]:
    """The demo's quality figures (see the module docstring), per session and averaged."""
    per_session = []
    for i, track in enumerate(tracks):
        model_first, model_second = _halves(tracking_errors(track.frames, track.truth))
        repeat = np.broadcast_to(track.truth[:1], track.truth.shape)
        repeat_first, repeat_second = _halves(tracking_errors(repeat, track.truth))
        row = {"seed": track.seed, "model_first_half": model_first, "model_second_half": model_second,
               "repeat_first_frame_second_half": repeat_second, "repeat_first_frame_first_half": repeat_first,
               "exact_frames": exact_frames(track.frames, track.truth), "restarts": track.restarts}
        if untrained is not None:
            row["untrained_second_half"] = _halves(tracking_errors(untrained[i].frames, untrained[i].truth))[1]
        per_session.append(row)

    def mean(key: str) -> float:
        return float(statistics.fmean(row[key] for row in per_session))

    summary: dict[str, Any] = {
        "metric": "mean absolute per-pixel error against the simulator, 0-255 scale",
        "generated_frames_per_session": int(len(tracks[0].frames) - 1),
        "model_first_half": mean("model_first_half"),
        "model_second_half": mean("model_second_half"),
        "repeat_first_frame_second_half": mean("repeat_first_frame_second_half"),
    }
    summary["ratio_to_repeat_first_frame"] = summary["model_second_half"] / max(
        summary["repeat_first_frame_second_half"], 1e-9)
    summary["drift_second_over_first_half"] = summary["model_second_half"] / max(summary["model_first_half"], 1e-9)
    summary["exact_frames_per_session"] = [row["exact_frames"] for row in per_session]
    if untrained is not None:
        summary["untrained_second_half"] = mean("untrained_second_half")
    summary["sessions"] = per_session
    return summary


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, np.float64)
    return {f"p{q}": float(np.percentile(array, q)) for q in (50, 90, 99)} | {"max": float(array.max())}


def _scaled(frame: np.ndarray, scale: int) -> np.ndarray:
    return np.repeat(np.repeat(frame, scale, axis=0), scale, axis=1)


#: The GIFs' caption strip: what the colours mean (``ardiff_jax.envs.SpriteWorld``: the ball is always red
#: 255, plus green when it moves down and blue when it moves right).
GIF_LEGEND = ("agent: green   walls: blue", "ball: red/yellow/magenta/white")


def _gif_frame(generated: np.ndarray, truth: np.ndarray, index: int, seed: int, scale: int) -> Any:
    """One GIF frame: the generated frame | the simulator's, above a caption strip that labels them."""
    from PIL import Image, ImageDraw

    side = generated.shape[1] * scale
    gap = np.full((generated.shape[0] * scale, 2 * scale, 3), 255, np.uint8)
    pair = np.concatenate([_scaled(generated, scale), gap, _scaled(truth, scale)], axis=1)
    lines = 2 + len(GIF_LEGEND)
    picture = Image.new("RGB", (pair.shape[1], pair.shape[0] + 11 * lines + 3), (255, 255, 255))
    picture.paste(Image.fromarray(pair), (0, 0))
    draw = ImageDraw.Draw(picture)
    y = pair.shape[0] + 2
    draw.text((2, y), "generated", fill=(0, 0, 0))
    draw.text((side + 2 * scale + 2, y), "simulator", fill=(0, 0, 0))
    frame = "obs" if index == 0 else f"frame {index}"
    for row, text in enumerate((f"{frame}, seed {seed}", *GIF_LEGEND), start=1):
        draw.text((2, y + 11 * row), text, fill=(96, 96, 96))
    return picture


def write_demo_outputs(out_dir: str | Path, tracks: Sequence[SessionTrack], summary: dict[str, Any], *,
                       gif_scale: int = 4, sheet_columns: int = 16) -> list[Path]:
    """Write the GIFs, the contact sheet, ``summary.json`` and the ``.npz`` files; returns their paths.

    Each GIF frame is the generated frame beside the simulator's, above a caption strip naming
    the two sides, the frame and the colours (:data:`GIF_LEGEND`). Session files of an earlier run
    into the same folder (``session_<i>.gif``/``.npz`` beyond this run's sessions) are removed once
    this run's are written, so the folder shows one run; no other file is touched."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, track in enumerate(tracks):
        pictures = [_gif_frame(g, t, n, track.seed, gif_scale)
                    for n, (g, t) in enumerate(zip(track.frames, track.truth, strict=True))]
        gif = out / f"session_{i}.gif"
        pictures[0].save(gif, save_all=True, append_images=pictures[1:], duration=100, loop=0)
        npz = out / f"session_{i}.npz"
        np.savez_compressed(npz, frames=track.frames, truth=track.truth, actions=track.actions)
        written += [gif, npz]
    sheet = out / "contact_sheet.png"
    contact_sheet(tracks, columns=sheet_columns).save(sheet)
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    for stale in _session_files(out) - set(written):
        stale.unlink(missing_ok=True)
    return [*written, sheet, summary_path]


def _session_files(out: Path) -> set[Path]:
    """The files :func:`write_demo_outputs` writes per session, as they stand in ``out`` (exactly its names)."""
    return {path for path in out.glob("session_*.*")
            if path.is_file() and re.fullmatch(r"session_\d+\.(gif|npz)", path.name)}


def contact_sheet(tracks: Sequence[SessionTrack], *, columns: int = 16, scale: int = 2) -> Any:
    """A PIL image: per session a "model" row above a "simulator" row, at evenly spaced frames, numbered on top.

    A footer names the sprites (:data:`GIF_LEGEND`: which is the agent, which the ball)."""
    from PIL import Image, ImageDraw

    num_frames = len(tracks[0].frames)
    picked = np.linspace(0, num_frames - 1, min(columns, num_frames)).round().astype(int)
    pad, label_width, header, footer = 2, 64, 14, 14
    side = tracks[0].frames.shape[1] * scale + 2 * pad
    width = label_width + side * len(picked)
    body = header + len(tracks) * (2 * side + 3 * pad) - 3 * pad
    sheet = Image.new("RGB", (width, body + footer), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    draw.text((2, body + 2), "   ".join(GIF_LEGEND) + " (the ball's colour is its direction)", fill=(96, 96, 96))
    for c, frame in enumerate(picked):
        draw.text((label_width + c * side + pad, 1), "obs" if frame == 0 else str(int(frame)), fill=(0, 0, 0))
    for s, track in enumerate(tracks):
        top = header + s * (2 * side + 3 * pad)
        if s:
            draw.rectangle([0, top - 3 * pad, width, top - 1], fill=(128, 128, 128))  # separates sessions
        for r, (label, source) in enumerate((("model", track.frames), ("simulator", track.truth))):
            y = top + r * side
            draw.text((2, y + side // 2 - 10), label, fill=(0, 0, 0))
            draw.text((2, y + side // 2 + 1), f"seed {track.seed}", fill=(96, 96, 96))
            for c, frame in enumerate(picked):
                sheet.paste(Image.fromarray(_scaled(source[frame], scale)), (label_width + c * side + pad, y + pad))
    return sheet


def _single_session_fps(engine: ARDiffusionEngine, seed: int, num_frames: int) -> float:
    tracks = drive_sessions(engine, [seed], num_frames, action_seed=seed)
    steady = tracks[0].latencies_ms[1:]  # the first request also prefills the observation
    f = engine.runner.pipeline.config.frames_per_block
    return 1e3 * f / statistics.fmean(steady)


def _batched_fps(engine: ARDiffusionEngine, seeds: Sequence[int], num_frames: int) -> float:
    """Aggregate frames/s of ``len(seeds)`` sessions served by one ``generate_batch`` per round (steady state)."""
    tracks = drive_sessions(engine, seeds, num_frames, action_seed=seeds[0], batched=True)
    steady = tracks[0].latencies_ms[1:]  # every session of a round shares its batch's latency
    f = engine.runner.pipeline.config.frames_per_block
    return 1e3 * f * len(seeds) / statistics.fmean(steady)


def _progress(bar: Any, frames_per_block: int) -> Callable[[int, float], None]:
    """``on_block`` for :func:`drive_sessions`: advance ``bar``; after the phase's first block, restart its clock.

    The first block of a phase follows the load and carries the compile and the observation
    prefill; timed from the bar's start, it made the first line promise an ETA of an hour. The
    count stays; only the rate and ETA start over (``tqdm.reset``, then the count put back)."""
    first = True

    def on_block(session: int, latency_ms: float) -> None:
        nonlocal first
        if not first:
            bar.update(frames_per_block)
            return
        first = False
        done = bar.n + frames_per_block
        # reset() redraws the bar at n = 0 with the old start count (the previous phase's), whose rate
        # (n - initial) / elapsed came out negative: the count starts from 0 for that redraw.
        bar.initial = 0
        bar.reset()  # restarts the clock and the smoothed rate; keeps the total
        bar.n = bar.last_print_n = bar.initial = done  # rates count from here: (n - initial) / elapsed
        bar.refresh()

    return on_block


def run_demo(out_dir: str | Path, *, sessions: int = 4, num_frames: int = 64, capacity: int | None = None,
             seed: int = 0, compare_untrained: bool = True, progress: bool = True,
             available_memory_bytes: int = 2**28, weights: str | Path | None = None) -> dict[str, Any]:
    """Run the demo (see the module docstring) and write its outputs into ``out_dir``; returns the summary.

    ``capacity`` below ``sessions`` makes LRU eviction happen (default: room for all).
    ``weights``: a ``train --export`` file to play instead of the shipped weights (validated
    before anything runs).
    """
    from tqdm.auto import tqdm

    from ardiff_jax.training import one_step_accuracy

    if not isinstance(num_frames, int) or num_frames < 2:
        raise ValueError(f"num_frames must be an integer >= 2 (the error compares two halves), got {num_frames!r}")
    for name, value in (("sessions", sessions), ("capacity", 1 if capacity is None else capacity)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    metadata = pretrained_metadata("sprite_world", weights=weights)  # a missing or bad file fails here, first
    started = time.perf_counter()
    capacity = sessions if capacity is None else capacity
    # The bar starts before the model loads: loading and compiling take a few seconds, and
    # a silent terminal looks hung. Its unit is generated frames; loading counts as none, and
    # its clock (rate, ETA) restarts after the first block of each phase, so that neither the
    # load nor the first block's compile and prefill make it promise an hour.
    bar = tqdm(total=sessions * num_frames * (2 if compare_untrained else 1), unit="frame", disable=not progress,
               desc="loading and compiling")
    with bar:
        pipeline = pretrained("sprite_world", session_capacity=capacity, weights=weights)
        f = pipeline.config.frames_per_block
        if num_frames % f:
            raise ValueError(f"num_frames ({num_frames}) must be a multiple of frames_per_block ({f})")
        config = EngineConfig(dtype="float32", available_memory_bytes=available_memory_bytes, gpu_memory_fraction=1.0)
        engine = ARDiffusionEngine(pipeline, config)  # its warmup compiles every program a block needs
        load_seconds = time.perf_counter() - started
        seeds = [seed + i for i in range(sessions)]
        total_blocks = sessions * num_frames // f
        evictions = []
        engine.runner.add_session_listener(
            lambda event: evictions.append(event.session_id) if event.reason == "lru_eviction" else None)
        bar.set_description("trained model")
        run_start = time.perf_counter()
        tracks = drive_sessions(engine, seeds, num_frames, action_seed=seed, on_block=_progress(bar, f))
        interleaved_fps = total_blocks * f / (time.perf_counter() - run_start)
        single_fps = _single_session_fps(engine, seed + 2000, min(num_frames, 32))
        batched_sessions = min(4, engine.session_capacity)
        batched_fps = (_batched_fps(engine, [seed + 3000 + i for i in range(batched_sessions)], min(num_frames, 32))
                       if batched_sessions > 1 else single_fps)
        untrained_tracks = None
        if compare_untrained:
            bar.set_description("untrained model (random weights, for comparison)")
            untrained = SpriteWorldPipeline(pipeline.config, pipeline.pipeline_config)
            with ARDiffusionEngine(untrained, config) as untrained_engine:
                untrained_tracks = drive_sessions(untrained_engine, seeds, num_frames, action_seed=seed,
                                                  on_block=_progress(bar, f))
        bar.set_description("one-step accuracy")
        accuracy = one_step_accuracy(pipeline.modules, pipeline.config, prediction=pipeline.prediction,
                                     decoder=pipeline.pipeline_config.decoder)
    plan = engine.memory_plan.as_dict()
    planned_capacity = engine.session_capacity
    engine.close()
    summary = {
        "model": "sprite_world",
        "device": str(jax.devices()[0]),
        "machine": machine_summary(),
        "sessions": sessions,
        "session_capacity": planned_capacity,
        "frames_per_block": f,
        "attention_window_frames": pipeline.config.sink_frames + pipeline.config.window_frames,
        "denoise_steps": pipeline.schedule.num_steps,
        "decoder": pipeline.pipeline_config.decoder,
        "quality": quality_summary(tracks, untrained_tracks),
        "one_step_accuracy": accuracy.as_dict(),
        "speed": {
            "frames_per_second_one_session": single_fps,
            "frames_per_second_interleaved": interleaved_fps,
            "interleaved_sessions": sessions,
            "frames_per_second_batched": batched_fps,
            "batched_sessions": batched_sessions,
            "latency_ms": _percentiles([ms for t in tracks for ms in t.latencies_ms[1:]]),
            "load_seconds": load_seconds,
        },
        "lru_evictions": len(evictions),
        "restarts_after_eviction": sum(t.restarts for t in tracks),
        "memory_plan": plan,
        "weights": {"file": "shipped" if weights is None else str(weights)}
        | {k: metadata.get(k) for k in ("num_params", "sha256")} | {"training": metadata.get("training")},
        "wall_seconds": time.perf_counter() - started,
    }
    write_demo_outputs(out_dir, tracks, summary)
    return summary


def verdict(quality: dict[str, Any], target_ratio: float = 0.25) -> str:
    """One plain sentence: does the model track the simulator better than repeating the first frame?"""
    model, repeat = quality["model_second_half"], quality["repeat_first_frame_second_half"]
    ratio = quality["ratio_to_repeat_first_frame"]
    if model < repeat:
        answer = f"yes: the model tracks the simulator better than repeating the first frame ({ratio:.2f}x its error"
    else:
        answer = f"no: repeating the first frame tracks the simulator better than the model ({ratio:.2f}x its error"
    met = "met" if ratio <= target_ratio else "not met"
    return f"{answer}; target <= {target_ratio}x {met})"
