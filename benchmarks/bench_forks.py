"""What a fork costs: ``engine.fork_session`` against one block's forward and against copying the session.

A sprite-world engine (the shipped geometry: sink 1, window 3, one frame a block) with a
live session whose window is full. Measured, interleaved in one run:

* ``fork_ms``: ``fork_session`` then ``close_session`` of the fork (host work only);
* ``copy_ms``: the copying alternative the runtime had before forks: ``save_session`` of the
  live session to a file and ``load_session`` of it under a new id, then ``close_session``;
* ``block_ms``: one ``generate`` of the live session (a block's forward and commit).

And the KV pages N forks hold after each writes ``k`` frames, against N copies of the session
(``N x pages of one session``): ``kv_cache.pages_in_use`` counts a page N sessions share once.

Usage::

    python -m benchmarks.bench_forks            # writes benchmarks/results/forks.json
    python -m benchmarks.bench_forks --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import format_table, machine_info, machine_line, write_json

RESULTS = Path(__file__).resolve().parent / "results"


def _request(sid: str, action: int, observation: Any = None) -> Any:
    from ardiff_jax import DiffusionRequest

    inputs = {"actions": np.array([action % 5])}
    if observation is not None:
        inputs["observation"], inputs["seed"] = observation, 0
    return DiffusionRequest(f"{sid}-{action}", extra_args={"session_id": sid}, inputs=inputs)


def run(*, quick: bool = False, out: Path | None = RESULTS / "forks.json") -> dict[str, Any]:
    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.envs import SpriteWorld
    from ardiff_jax.models import pretrained

    forks = 8
    pipeline = pretrained("sprite_world", session_capacity=forks + 2)
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**28,
                                                      gpu_memory_fraction=1.0, host_offload_bytes=0))
    reps = 5 if quick else 40
    times: dict[str, list[float]] = {"fork_ms": [], "copy_ms": [], "block_ms": []}
    with engine, tempfile.TemporaryDirectory() as folder:
        engine.generate(_request("live", 0, SpriteWorld(seed=1).reset()))
        for action in range(6):  # the window is full and wrapped
            engine.generate(_request("live", action))
        for rep in range(reps):
            start = time.perf_counter()
            engine.fork_session("live", "fork")
            engine.close_session("fork")
            times["fork_ms"].append(1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            path = engine.save_session("live", Path(folder) / f"copy{rep}")
            engine.load_session(path, session_id="copy")
            engine.close_session("copy")
            times["copy_ms"].append(1e3 * (time.perf_counter() - start))
            start = time.perf_counter()
            engine.generate(_request("live", rep))
            times["block_ms"].append(1e3 * (time.perf_counter() - start))
        kv = engine.runner.kv_cache
        one_session = kv.pages_in_use
        pages: list[dict[str, int]] = []
        for i in range(forks):
            engine.fork_session("live", f"f{i}")
        for written in range(4):
            if written:
                engine.generate_batch([_request(f"f{i}", i + written) for i in range(forks)])
            pages.append({"frames_written_per_fork": written, "pages_in_use": kv.pages_in_use,
                          "pages_if_copied": (forks + 1) * one_session})
    medians = {key: statistics.median(values) for key, values in times.items()}
    result = {
        "machine": machine_info(), "forks": forks, "reps": reps,
        "median_ms": medians,
        "fork_over_block": medians["fork_ms"] / medians["block_ms"],
        "copy_over_fork": medians["copy_ms"] / medians["fork_ms"],
        "pages_one_session": one_session, "pages": pages,
    }
    print(machine_line(result["machine"]))
    print(format_table(["fork + close ms", "save + load + close ms", "one block ms", "fork / block", "copy / fork"],
                       [[f"{medians['fork_ms']:.3f}", f"{medians['copy_ms']:.1f}", f"{medians['block_ms']:.2f}",
                         f"{result['fork_over_block']:.3f}", f"{result['copy_over_fork']:.0f}"]]))
    print(format_table(["frames written per fork", f"pages in use ({forks} forks + live)", "pages if copied"],
                       [[row["frames_written_per_fork"], row["pages_in_use"], row["pages_if_copied"]]
                        for row in pages]))
    if out is not None:
        write_json(out, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "forks.json")
    args = parser.parse_args()
    run(quick=args.quick, out=args.out)


if __name__ == "__main__":
    main()
