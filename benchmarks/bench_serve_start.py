"""How soon ``ardiff-jax serve`` serves its first player, per model, with each ``--batch-compile`` mode.

Each run starts the README's ``serve`` line in a fresh process (``--port 0``), reads the
``ws://`` address it prints, connects one player at once and then a second one, and records:

* ``ready_s``: process start -> the ``serving ... on ws://`` line;
* ``first_chunk_s``: process start -> the first player's first video chunk;
* ``max_gap_ms``: the longest wait between two of the first player's chunks while the second
  player joins and, in background mode, the batched programs compile beside it (the server
  paces chunks at ``--fps``; a gap far above ``1000 / fps`` is a stall);
* ``second_first_chunk_s``: the second player's ``session.start`` -> its first chunk.

Usage::

    python -m benchmarks.bench_serve_start              # every model, eager and background
    python -m benchmarks.bench_serve_start --quick      # the sprite world only (the test smoke)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import format_table, machine_info, machine_line, write_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

#: (name, the serve arguments after ``ardiff-jax serve``): the README's lines.
MODELS = {
    "sprite_world": ["--pretrained", "sprite_world"],
    "wan-tiny": ["--model", "wan", "--random-weights", "--preset", "wan-tiny", "--dtype", "float32", "--capacity", "4"],
    "matrix-game-tiny": ["--model", "matrix-game", "--random-weights", "--preset", "matrix-game-tiny", "--dtype",
                         "float32", "--image", str(ROOT / "docs" / "demo_contact_sheet.png"), "--capacity", "4"],
}


async def _player(url: str, seed: int, chunks: int, start_message: dict[str, Any]) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    record: dict[str, Any] = {"recv_s": []}
    async with connect(url, max_size=2**25, open_timeout=60) as ws:
        record["start_s"] = time.perf_counter()
        await ws.send(json.dumps({**start_message, "seed": seed}))
        started = json.loads(await ws.recv())
        if started["type"] != "video.start":
            raise RuntimeError(f"session.start was answered {started}")
        while len(record["recv_s"]) < chunks:
            message = json.loads(await ws.recv())
            if message["type"] == "video.chunk_metadata":
                await ws.recv()
                record["recv_s"].append(time.perf_counter())
            elif message["type"] in ("error", "session.error"):
                raise RuntimeError(f"the server answered {message}")
        await ws.send(json.dumps({"type": "session.stop"}))
    return record


async def _two_players(url: str, start_message: dict[str, Any], chunks: int) -> tuple[dict, dict]:
    first = asyncio.create_task(_player(url, 0, chunks, start_message))
    await asyncio.sleep(1.0)
    second = asyncio.create_task(_player(url, 1, max(chunks // 2, 2), start_message))
    return await first, await second


def serve_once(model: str, mode: str, chunks: int) -> dict[str, Any]:
    """One fresh ``serve`` process: when it listened, when each player got its first chunk, the worst gap."""
    command = [sys.executable, "-m", "ardiff_jax.cli", "serve", *MODELS[model], "--port", "0", "--batch-compile", mode]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                               cwd=ROOT)
    try:
        url = None
        assert process.stdout is not None
        for line in process.stdout:
            found = re.search(r"on (ws://\S+)$", line.strip())
            if found:
                url = found.group(1)
                break
        if url is None:
            raise RuntimeError(f"serve {model} exited ({process.wait()}) before it listened")
        ready = time.perf_counter() - start
        start_message = {"type": "session.start", "format": "jpeg"}
        if model.startswith("wan"):
            start_message["prompt"] = "a cat walking"
        first, second = asyncio.run(_two_players(url, start_message, chunks))
    finally:
        process.terminate()
        process.wait(30)
    gaps = [b - a for a, b in zip(first["recv_s"], first["recv_s"][1:], strict=False)]
    return {"model": model, "batch_compile": mode, "ready_s": ready,
            "first_chunk_s": first["recv_s"][0] - start, "max_gap_ms": 1e3 * max(gaps, default=0.0),
            "second_first_chunk_s": second["recv_s"][0] - second["start_s"], "chunks": len(first["recv_s"])}


def run(*, quick: bool = False, models: list[str] | None = None, out: Path | None = None) -> dict[str, Any]:
    models = models or (["sprite_world"] if quick else list(MODELS))
    chunks = 12 if quick else 40
    runs = [serve_once(model, mode, chunks) for model in models for mode in ("eager", "background")]
    result = {"machine": machine_info(), "runs": runs}
    print(machine_line(result["machine"]))
    print(format_table(["model", "batch_compile", "ready s", "first chunk s", "max gap ms", "2nd player first chunk s"],
                       [[r["model"], r["batch_compile"], f"{r['ready_s']:.1f}", f"{r['first_chunk_s']:.1f}",
                         f"{r['max_gap_ms']:.0f}", f"{r['second_first_chunk_s']:.2f}"] for r in runs]))
    if out is not None:
        write_json(out, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the sprite world only, fewer chunks")
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="only these models (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_start.json")
    args = parser.parse_args()
    run(quick=args.quick, models=args.model, out=args.out)


if __name__ == "__main__":
    main()
