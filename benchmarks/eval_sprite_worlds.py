"""The SpriteWorld model on many worlds: what four demo sessions are too few to say.

Drives ``--worlds`` sessions (world seeds ``--first-seed`` on, none of them the demo's 0-3
nor a training world) through the engine exactly as ``ardiff-jax demo`` does, with seeded
random actions, and reports against the simulator:

* the demo's quality figures over all worlds (``ardiff_jax.demo.quality_summary``): second-
  half tracking error, its ratio to repeating the first frame, second over first half;
* exact frames per session (``ardiff_jax.demo.exact_frames``): mean, median, how many
  sessions are exact for at least half the rollout and to the end;
* what the ball is in every second-half frame: right, missing (no ball drawn), one ball in a
  wrong cell or colour, or two or more. The pixel error counts a ball in a wrong cell twice
  (the cell it is in and the cell it should be in) and a missing ball once, so two models
  with the same error can show a player very different things; this says which.

``--weights`` scores a ``train --export`` file instead of the shipped weights (for example an
earlier stage of the shipped chain), through the same code. Quality only: no timing.

Run: ``python -m benchmarks.eval_sprite_worlds [--weights runs/x.npz] [--out DIR]``; the record
goes to ``DIR/sprite_worlds[_<name>].json`` (default ``DIR``: ``eval_sprite_worlds_out/``).
``--update-results`` writes it to ``benchmarks/results/`` instead, replacing the committed
record that ``docs/models.md`` quotes: only for a change that means to update those figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.demo import drive_sessions, quality_summary
from ardiff_jax.envs import cell_codes
from ardiff_jax.models import pretrained, pretrained_metadata
from benchmarks.common import machine_info

RESULTS = Path(__file__).with_name("results")
#: Where a run writes unless told otherwise: never over the committed results.
DEFAULT_OUT = Path("eval_sprite_worlds_out")
BALL_STATES = ("right", "missing", "wrong cell or colour", "two or more")


def ball_state(frame: np.ndarray, truth: np.ndarray) -> str:
    """What a generated frame shows of the ball, against the simulator's frame (one of ``BALL_STATES``)."""
    got, want = cell_codes(frame), cell_codes(truth)
    balls = int((got >= 3).sum())  # cell codes 3-6 are the ball in its four colours
    if balls == 0:
        return "missing"
    if balls > 1:
        return "two or more"
    same = np.array_equal(np.where(got >= 3, got, 0), np.where(want >= 3, want, 0))
    return "right" if same else "wrong cell or colour"


def run(*, worlds: int = 32, first_seed: int = 100, frames: int = 64, action_seed: int = 5,
        weights: str | None = None, batch: int = 8, out_dir: Path = DEFAULT_OUT) -> dict[str, Any]:
    if first_seed < 4:
        raise ValueError(f"first_seed must leave out the demo's worlds 0-3, got {first_seed}")
    pipeline = pretrained("sprite_world", session_capacity=batch, weights=weights)
    config = EngineConfig(dtype="float32", available_memory_bytes=2**28, gpu_memory_fraction=1.0)
    tracks = []
    with ARDiffusionEngine(pipeline, config) as engine:
        for start in range(first_seed, first_seed + worlds, batch):
            seeds = list(range(start, min(start + batch, first_seed + worlds)))
            tracks += drive_sessions(engine, seeds, frames, action_seed=action_seed, batched=len(seeds) > 1)
    quality = quality_summary(tracks)
    exact = quality["exact_frames_per_session"]
    half = frames // 2
    states = collections.Counter(ball_state(f, t) for track in tracks
                                 for f, t in zip(track.frames[1 + half:], track.truth[1 + half:], strict=True))
    second_half_frames = sum(states.values())
    record = {
        "benchmark": "eval_sprite_worlds",
        "machine": machine_info(),
        "weights": weights or "shipped",
        "weights_training_steps": pretrained_metadata("sprite_world", weights=weights)["training"].get("steps"),
        "num_layers": pipeline.config.num_layers,
        "worlds": worlds, "first_seed": first_seed, "frames": frames, "action_seed": action_seed,
        "quality": {k: v for k, v in quality.items() if k != "sessions"},
        "exact_frames": {"mean": statistics.fmean(exact), "median": statistics.median(exact),
                         "at_least_half": sum(e >= half for e in exact), "to_the_end": sum(e == frames for e in exact)},
        "second_half_ball": {state: states[state] / second_half_frames for state in BALL_STATES},
        "second_half_frames": second_half_frames,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if weights is None else "_" + Path(weights).stem
    path = out_dir / f"sprite_worlds{suffix}.json"
    path.write_text(json.dumps(record, indent=1))
    record["written_to"] = str(path)  # for the caller; not in the file
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=32)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--action-seed", type=int, default=5)
    parser.add_argument("--weights", default=None, help="a train --export .npz (default: the shipped weights)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=DEFAULT_OUT,
                       help=f"folder for the record (default: {DEFAULT_OUT})")
    where.add_argument("--update-results", action="store_true",
                       help=f"write the record to {RESULTS} instead, replacing the committed one the docs quote")
    args = parser.parse_args()
    record = run(worlds=args.worlds, first_seed=args.first_seed, frames=args.frames, action_seed=args.action_seed,
                 weights=args.weights, out_dir=RESULTS if args.update_results else args.out)
    q, e, b = record["quality"], record["exact_frames"], record["second_half_ball"]
    print(f"{record['weights']} ({record['num_layers']} layers, {record['weights_training_steps']} steps), "
          f"{args.worlds} worlds x {args.frames} frames")
    print(f"second-half error {q['model_second_half']:.2f} = {q['ratio_to_repeat_first_frame']:.3f}x repeat-first-frame "
          f"({q['repeat_first_frame_second_half']:.2f}); first half {q['model_first_half']:.2f}; "
          f"drift {q['drift_second_over_first_half']:.2f}")
    print(f"exact frames: mean {e['mean']:.1f}, median {e['median']:.1f}; >= half {e['at_least_half']}, "
          f"to the end {e['to_the_end']} of {args.worlds}")
    print("second-half ball: " + ", ".join(f"{state} {share:.0%}" for state, share in b.items()))
    print(f"written to {record['written_to']}")


if __name__ == "__main__":
    main()
