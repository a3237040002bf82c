"""End-to-end rollout of the tiny world model: KV cache (the engine) vs recompute from scratch.

Both implementations run the same model with the same weights and the same jitted step
function (``ardiff_jax.models.world_step``); only the attention backend and what is kept
between blocks differ:

* ``cached``: :class:`ardiff_jax.models.WorldPipeline` through :class:`ardiff_jax.ARDiffusionEngine`,
  one block per request on one session: per block ``num_steps`` denoise forwards over the
  paged history plus one clean forward whose K/V the runtime commits. Work per block is
  constant once the window is full.
* ``recompute``: no KV cache. The cache-free reference of the test suite
  (``tests/models_reference.py``, :class:`ReferenceWorld`) keeps only each committed block's
  inputs and, for every new block, recomputes every committed block's K/V in order (one
  clean forward each, dense float32 attention over that block's visible history,
  :class:`ardiff_jax.models.DenseAttention`), then runs the new block's denoise forwards.
  Work per block grows linearly with the blocks generated so far: exact recomputation needs
  every earlier block, not only the visible ones, because each block's K/V depend on the
  history it saw when it was committed.

The rollout runs to ``10 x window_frames`` generated frames (tiny: window 5 frames, sink 1,
2 frames per block: 25 blocks), ``--reps`` times on fresh sessions. Each block of the two
implementations is timed back to back (order alternating per block and repetition), from the
request to the block's latents on the host; per block index we report the median over the
repetitions as frames/s (``frames_per_block / seconds``). Both outputs are compared block
by block (they agree to float32 summation order, ~1e-6).

Compilation is excluded and reported separately: the engine compiles at load (the
pipeline's warmup request), the recompute path in an untimed two-block warm-up; XLA compile
events during the timed rollouts are counted (expected: 0).

Run: ``python -m benchmarks.bench_e2e``; results go to ``benchmarks/results/e2e_tiny.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    format_table,
    machine_info,
    machine_line,
    pyplot,
    save_figure,
    write_json,
)

__all__ = ["main", "reference_module", "run"]

PROMPT = "a drive through the city"


def reference_module() -> Any:
    """``tests/models_reference.py`` (the test suite's cache-free reference), imported once.

    Under pytest ``tests/`` is on ``sys.path`` and the module is already importable; from the
    command line it is loaded from its file under the same module name.
    """
    if "models_reference" in sys.modules:
        return sys.modules["models_reference"]
    try:
        import models_reference  # type: ignore[import-not-found]

        return models_reference
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "tests" / "models_reference.py"
        spec = importlib.util.spec_from_file_location("models_reference", path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules["models_reference"] = module
        spec.loader.exec_module(module)
        return module


class _CompileClock:
    """Sums XLA compile time and counts programs made (a load from jax's persistent cache counts, at 0 s)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._recording: Any = None

    def _record(self, program: Any) -> None:
        self.seconds += program.seconds
        self.count += 1

    def __enter__(self) -> _CompileClock:
        from ardiff_jax._compile_events import recording_compiles

        self._recording = recording_compiles(self._record)
        self._recording.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recording.__exit__(*exc)


def run(*, preset: str = "tiny", blocks: int | None = None, reps: int = 5, quick: bool = False,
        out_dir: Path = RESULTS_DIR, write: bool = True) -> dict[str, Any]:
    """Roll both implementations out; write ``e2e_<preset>.json`` / ``.png`` unless ``write=False``."""
    from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
    from ardiff_jax.models import WorldPipeline

    ref_mod = reference_module()
    compile_info: dict[str, Any] = {}
    with _CompileClock() as clock:
        start = time.perf_counter()
        pipeline = WorldPipeline(preset)
        compile_info["pipeline_init_s"] = time.perf_counter() - start
        compile_info["pipeline_init_compile_s"] = clock.seconds
        cfg = pipeline.config
        # float32 end to end, as the equivalence tests run it: the two paths then agree to
        # summation order, which the comparison below checks.
        start, before = time.perf_counter(), clock.seconds
        engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**30,
                                                          gpu_memory_fraction=1.0))
        compile_info["cached_engine_load_s"] = time.perf_counter() - start  # includes the warmup block
        compile_info["cached_engine_load_compile_s"] = clock.seconds - before
        reference = ref_mod.ReferenceWorld(pipeline)
        start, before = time.perf_counter(), clock.seconds
        warm = reference.new_session("e2e-warmup", PROMPT)
        for _ in range(2):  # the first block has no history, the second one recomputes one block
            reference.generate(warm, PROMPT, None)
        compile_info["recompute_warmup_s"] = time.perf_counter() - start
        compile_info["recompute_warmup_compile_s"] = clock.seconds - before

        frames = cfg.frames_per_block
        if blocks is None:
            blocks = math.ceil(10 * cfg.window_frames / frames)
        if quick:
            blocks, reps = min(blocks, 3), 1
        samples = {"cached": np.zeros((reps, blocks)), "recompute": np.zeros((reps, blocks))}
        worst_diff = 0.0
        compiles_before = clock.count
        for rep in range(reps):
            session_id = f"e2e-{rep}"
            # A prompt neither path has seen: both compute its text K/V in their first block
            # (the reference caches text K/V per prompt across sessions, the engine per session).
            first_prompt = f"{PROMPT}, take {rep}"
            ref_sessions: list[Any] = []  # created inside the first timed block, as the engine's is
            for block in range(blocks):
                prompt = first_prompt if block == 0 else None
                request = DiffusionRequest(f"{session_id}-b{block}", prompt=prompt,
                                           extra_args={"session_id": session_id})

                def cached() -> np.ndarray:
                    return np.asarray(engine.generate(request).latents)

                def recompute() -> np.ndarray:
                    if not ref_sessions:
                        ref_sessions.append(reference.new_session(session_id, first_prompt))
                    # The pipeline's default action (zeros), as the engine request has none.
                    return reference.generate(ref_sessions[0], prompt, None)

                order = (("cached", cached), ("recompute", recompute))
                if (rep + block) % 2:
                    order = order[::-1]
                outs = {}
                for name, fn in order:
                    t0 = time.perf_counter()
                    outs[name] = fn()
                    samples[name][rep, block] = time.perf_counter() - t0
                worst_diff = max(worst_diff, float(np.max(np.abs(outs["cached"] - outs["recompute"]))))
            engine.close_session(session_id)
        compiles_during = clock.count - compiles_before
    engine.close()

    generated = [(b + 1) * frames for b in range(blocks)]
    per_impl = {}
    for name, s in samples.items():
        med = np.median(s, axis=0)
        per_impl[name] = {
            "block_ms_median": (med * 1e3).tolist(),
            "block_ms_min": (s.min(axis=0) * 1e3).tolist(),
            "block_ms_max": (s.max(axis=0) * 1e3).tolist(),
            "frames_per_s": (frames / med).tolist(),
            "frames_per_s_overall": float(frames * blocks * reps / s.sum()),
        }
    cached_fps = np.asarray(per_impl["cached"]["frames_per_s"])
    recompute_fps = np.asarray(per_impl["recompute"]["frames_per_s"])
    full = cfg.sink_frames + cfg.window_frames  # visible context incl. the current block
    steady = [i for i, g in enumerate(generated) if g > full] or list(range(blocks))
    summary = {
        "cached frames/s, median over blocks": float(np.median(cached_fps)),
        "cached frames/s once the window is full: slowest/fastest block":
            float(cached_fps[steady].max() / cached_fps[steady].min()),
        "recompute frames/s, first block": float(recompute_fps[0]),
        "recompute frames/s, last block": float(recompute_fps[-1]),
        "cached / recompute frames/s, first block": float(cached_fps[0] / recompute_fps[0]),
        "cached / recompute frames/s, last block": float(cached_fps[-1] / recompute_fps[-1]),
        "cached / recompute, whole rollout": per_impl["cached"]["frames_per_s_overall"]
        / per_impl["recompute"]["frames_per_s_overall"],
        "max |cached - recompute| latents": worst_diff,
        "XLA compiles during the timed rollouts": compiles_during,
    }
    record = {
        "benchmark": "bench_e2e",
        "machine": machine_info(),
        "config": {"preset": preset, "blocks": blocks, "reps": reps, "quick": quick, "frames_per_block": frames,
                   "window_frames": cfg.window_frames, "sink_frames": cfg.sink_frames,
                   "denoise_steps": pipeline.schedule.num_steps, "num_layers": cfg.num_layers, "dim": cfg.dim,
                   "tokens_per_frame": cfg.tokens_per_frame, "dtype": "float32", "sessions": 1},
        "compile": compile_info,
        "generated_frames": generated,
        "results": per_impl,
        "summary": summary,
    }
    if write:
        path = write_json(out_dir / f"e2e_{preset}.json", record)
        _plot(record, out_dir / f"e2e_{preset}.png")
        _print_report(record, path)
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    config = record["config"]
    print(f"\n== bench_e2e: {config['preset']} world model, {config['blocks']} blocks x {config['reps']} reps, "
          f"{config['frames_per_block']} frames/block, window {config['window_frames']} (sink "
          f"{config['sink_frames']}), {config['denoise_steps']} denoise steps + 1 commit forward ==")
    print(machine_line(record["machine"]))
    res = record["results"]
    rows = []
    blocks = len(record["generated_frames"])
    for i in sorted({0, 1, 2, blocks // 4, blocks // 2, (3 * blocks) // 4, blocks - 1}):
        if i < blocks:
            rows.append((record["generated_frames"][i], res["cached"]["block_ms_median"][i],
                         res["cached"]["frames_per_s"][i], res["recompute"]["block_ms_median"][i],
                         res["recompute"]["frames_per_s"][i]))
    print(format_table(("generated frames", "cached ms/block", "cached frames/s", "recompute ms/block",
                        "recompute frames/s"), rows))
    print(format_table(("summary", "value"), list(record["summary"].items())))
    print(format_table(("compile / load (excluded above)", "s"), list(record["compile"].items())))
    print(f"  wrote {path}")


def _plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:  # matplotlib is the optional bench extra
        return
    config = record["config"]
    x = np.asarray(record["generated_frames"])
    frames = config["frames_per_block"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("cached", dict(color="tab:blue", marker="o")),
                        ("recompute", dict(color="tab:red", marker="s"))):
        res = record["results"][name]
        ax.plot(x, res["frames_per_s"], label=f"{name} (median of {config['reps']})", markersize=3, **style)
        # Band: the fastest and slowest repetition of each block.
        lo = frames / (np.asarray(res["block_ms_max"]) / 1e3)
        hi = frames / (np.asarray(res["block_ms_min"]) / 1e3)
        ax.fill_between(x, lo, hi, color=style["color"], alpha=0.15)
    full = config["sink_frames"] + config["window_frames"]
    ax.axvline(full, color="gray", linestyle=":", label=f"visible context full ({full} frames)")
    ax.set_yscale("log")
    ax.set_xlabel("generated frames")
    ax.set_ylabel("frames/s of that block (latent frames)")
    ax.set_title(f"{config['preset']} world model rollout, one session: KV cache vs recompute from scratch",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(machine_line(record["machine"]), fontsize=7)
    save_figure(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="CausalDiT preset (default tiny)")
    parser.add_argument("--blocks", type=int, default=None, help="blocks per rollout (default: 10x the window)")
    parser.add_argument("--reps", type=int, default=5, help="rollouts per implementation (default 5)")
    parser.add_argument("--quick", action="store_true", help="3 blocks, 1 rollout (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    run(preset=args.preset, blocks=args.blocks, reps=args.reps, quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
