"""One causal-Wan block through the engine: the 4 denoise steps, the commit pass and the runtime's overhead.

The network is Wan2.1-T2V-1.3B (30 layers, 12 heads x 128, dim 1536, FFN 8960, bf16
parameters, activations and KV) in :class:`~ardiff_jax.models.wan.CausalWanPipeline` with
Self-Forcing's policy and sampler (3-latent-frame blocks, sink 0 + window 21 frames; per
block 4 denoise forwards at the warped timesteps 1000 / 937.5 / 833.3 / 625 and one commit
forward at ``t = 0``), driven through :class:`~ardiff_jax.ARDiffusionEngine` (one session,
one block per request). Weights are random by default (``--random-weights``: the real
geometry, nothing downloaded); ``--checkpoint PATH`` times published weights instead
(``CausalWanPipeline.from_checkpoint``). Transformer only: the prompt is random
``prompt_embeds f32[64, 4096]`` sent with the session's first block (no text encoder), and
no VAE decodes the latents.

How a block's time is split. Every forward of a block runs the one jitted
``ardiff_jax.models._world.world_step``. During one untimed engine block we wrap it and
record the arguments of its 5 calls (the KV pools are copied at the call: the commit after
the last forward donates them), then time three cases **interleaved** (``benchmarks/common.py``
rules: one sync per sample, medians):

* ``engine_block``: ``engine.generate`` of the session's next block, until its latents are ready;
* ``denoise``: the 4 recorded denoise calls of the same ``world_step``, chained as the
  pipeline chains them (step ``i + 1`` takes step ``i``'s ``x_next``, which is exactly its
  recorded ``x_t``), one sync at the end;
* ``commit``: the recorded commit forward (``t = sigma = 0``), alone.

``model = denoise + commit`` is the pure model time of the block's 5 forwards and
``overhead = engine_block - model`` is everything the runtime adds around them: request
validation, session lookup, the paged views, noise, the donated KV commit write, host
dispatch. Target: ``overhead <= 5%`` of the model time (recorded as met or not).
``denoise`` and ``commit`` each end with a sync where the engine dispatches its 5 forwards
back to back, so the isolated model time carries one more exposed dispatch than the engine
block does (overhead is, if anything, under-counted by one dispatch: ~1 ms).

A drift-free cross-check follows the rounds (``runtime_self_time``): two more engine blocks
with every ``world_step`` call synced and timed inside the block; ``block - sum(forwards)``
is the runtime's own time, both terms from the same block. On a shared CPU, where samples
of the same forward vary by 2x between rounds, this is the number that resolves a few
percent; it counts host work that the unsynced engine hides behind device work, so it is an
upper bound of what the runtime exposes.

Throughput: latent frames/s = 3 / the engine block's median; video frames/s = 4 x that
(Wan's causal VAE turns every latent frame after the first into 4 video frames: the steady
state of a long stream); ``model_only`` is the same from the model time.

On CPU the full 480x832 frame (a 60x104 latent, 1,560 tokens/frame) takes minutes per
block, so the CPU run uses a reduced latent (``--latent HxW``, default 8x12: 24 tokens per
frame, 72 per block) with the full 30-layer 1.3B network and Self-Forcing's 3-frame blocks
and 21-frame window: the forwards are then bound by reading the 2.6 GB of bf16 weights, not
by attention. ``benchmarks/gpu_check.py`` runs the same split at the full size on a GPU.
``--smoke``: a 2-layer Wan-shaped model (seconds; ``tests/test_benchmarks_smoke.py``).

Run: ``python -m benchmarks.bench_wan [--latent 8x12] [--blocks 5] [--checkpoint PATH]``;
writes ``benchmarks/results/bench_wan.json`` (``bench_wan_smoke.json`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, Case, Stats, format_table, machine_info, machine_line, write_json

__all__ = [
    "DEFAULT_LATENT",
    "OVERHEAD_TARGET",
    "PRESET",
    "VIDEO_FRAMES_PER_LATENT_FRAME",
    "ForwardRecorder",
    "ForwardTimer",
    "capture_block_forwards",
    "main",
    "make_pipeline",
    "prompt_embeds",
    "run",
    "runtime_self_time",
    "smoke_config",
    "split_block",
    "throughput",
]

#: The published network this benchmark times.
PRESET = "wan2.1-t2v-1.3b"
#: The CPU run's latent (H, W): 24 tokens per frame (the real one is 60x104, 1,560 tokens).
DEFAULT_LATENT = (8, 12)
#: Wan's causal VAE: every latent frame after the first decodes to 4 video frames.
VIDEO_FRAMES_PER_LATENT_FRAME = 4
#: Runtime overhead budget, as a fraction of the block's pure model time.
OVERHEAD_TARGET = 0.05
#: Rows of the random prompt embeddings (padded to the model's text_len, 512, as Wan pads).
PROMPT_ROWS = 64


def _progress(message: str) -> None:
    print(f"[bench_wan] {message}", file=sys.stderr, flush=True)


def smoke_config() -> Any:
    """A Wan-shaped bf16 transformer small enough for a smoke run: 2 layers, 6 tokens/frame, Self-Forcing's
    3-frame blocks with no sink (window 6 frames)."""
    from ardiff_jax.models import CausalDiTConfig

    return CausalDiTConfig(
        name="wan-smoke", num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
        latent_width=6, text_len=8, text_dim=16, frames_per_block=3, window_frames=6, sink_frames=0, freq_dim=32,
        dtype="bfloat16", param_dtype="bfloat16")


def wan_config(latent: tuple[int, int] | None = None, *, smoke: bool = False) -> Any:
    """The 1.3B preset (Self-Forcing policy) at ``latent`` (None: the real 60x104), or the smoke config."""
    from ardiff_jax.models import dit_preset

    if smoke:
        return smoke_config()
    config = dit_preset(PRESET)
    if latent is not None:
        config = config.replace(latent_height=int(latent[0]), latent_width=int(latent[1]))
    return config


def make_pipeline(config: Any, *, checkpoint: str | Path | None = None, session_capacity: int = 1) -> Any:
    """A :class:`CausalWanPipeline` of ``config``: random weights, or ``checkpoint``'s (same geometry)."""
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig

    pipeline_config = CausalWanPipelineConfig(session_capacity=session_capacity)
    if checkpoint is not None:
        return CausalWanPipeline.from_checkpoint(checkpoint, config, pipeline_config=pipeline_config)
    return CausalWanPipeline(config, pipeline_config)


def prompt_embeds(config: Any, seed: int = 0) -> np.ndarray:
    """Random text-encoder features ``f32[min(64, text_len), text_dim]`` (no text encoder runs)."""
    rows = min(PROMPT_ROWS, config.text_len)
    return np.random.default_rng(seed).standard_normal((rows, config.text_dim)).astype(np.float32)


def engine_config(backend: str = "auto") -> Any:
    """bf16 KV; on CPU a fixed 4 GiB plan (the pools of one session fit), on an accelerator 30% of free memory."""
    import jax

    from ardiff_jax import EngineConfig

    if jax.default_backend() == "cpu":
        return EngineConfig(dtype="bfloat16", available_memory_bytes=2**32, gpu_memory_fraction=1.0,
                            attention_backend=backend)
    return EngineConfig(dtype="bfloat16", gpu_memory_fraction=0.3, attention_backend=backend)


# -- recording the forwards of one block ------------------------------------------------------------------
class ForwardRecorder:
    """Wraps ``ardiff_jax.models._world.world_step`` while active and records every call's arguments.

    The pipeline looks ``world_step`` up in its module at each forward, so the engine runs
    through the wrapper unchanged. Each recorded call keeps the same graphdef and parameters
    (never donated) and a copy of every other array argument, made at the call: the KV pools
    in the paged views are donated by the commit that follows the block's last forward. An
    array shared by several calls (the pools, the text K/V) is copied once.
    """

    def __init__(self) -> None:
        from ardiff_jax.models import _world

        self._module = _world
        self.original: Callable[..., Any] = _world.world_step
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._copies: dict[int, tuple[Any, Any]] = {}

    def _copy(self, tree: Any) -> Any:
        import jax

        def leaf(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return x
            if id(x) not in self._copies:  # keep the original alive so its id is not reused
                self._copies[id(x)] = (x, x.copy())
            return self._copies[id(x)][1]

        return jax.tree.map(leaf, tree)

    def __call__(self, graphdef: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(((graphdef, params, *self._copy(args)), dict(self._copy(kwargs))))
        return self.original(graphdef, params, *args, **kwargs)

    def __enter__(self) -> ForwardRecorder:
        self._module.world_step = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module.world_step = self.original
        self._copies.clear()


class ForwardTimer:
    """Wraps ``world_step`` while active: waits for each forward's inputs, then times the forward to its
    outputs. A block run under it splits into its forwards and the runtime's own time around them
    (``block - sum(forwards)``), both from the same block: immune to drift between samples, but
    with every forward synced (no host work hidden behind device work)."""

    def __init__(self) -> None:
        from ardiff_jax.models import _world

        self._module = _world
        self.original: Callable[..., Any] = _world.world_step
        self.forward_s: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from benchmarks.common import sync

        sync((args, kwargs))  # the runtime's pending device work (noise, views) counts as the runtime's
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        sync(out)
        self.forward_s.append(time.perf_counter() - start)
        return out

    def __enter__(self) -> ForwardTimer:
        self._module.world_step = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module.world_step = self.original


def capture_block_forwards(engine: Any, session_id: str, request_id: str) -> tuple[Callable[..., Any], list[Any]]:
    """Run one engine block on ``session_id`` through a :class:`ForwardRecorder`: ``(world_step, calls)``."""
    from ardiff_jax import DiffusionRequest
    from benchmarks.common import sync

    with ForwardRecorder() as recorder:
        sync(engine.generate(DiffusionRequest(request_id, extra_args={"session_id": session_id})).latents)
    return recorder.original, recorder.calls


# -- the split ----------------------------------------------------------------------------------------------
def _interleave(cases: Sequence[Case], *, warmup: int, rounds: int,
                keep_going: Callable[[float], bool] | None = None) -> tuple[dict[str, Stats], dict[str, list[float]]]:
    """``common.run_interleaved`` (warm every case up, then rounds of every case in turn, one sync per
    sample), with ``keep_going(slowest round so far, s)`` asked before each round after the first.
    Returns the stats and the samples (seconds) in round order."""
    for case in cases:
        for _ in range(warmup):
            case.once()
    samples: dict[str, list[float]] = {case.name: [] for case in cases}
    faults: dict[str, list[int]] = {case.name: [] for case in cases}
    slowest = 0.0
    for round_index in range(rounds):
        if round_index and keep_going is not None and not keep_going(slowest):
            break
        began = time.perf_counter()
        for case in cases:
            elapsed, minflt = case.once()
            samples[case.name].append(elapsed)
            faults[case.name].append(minflt)
        slowest = max(slowest, time.perf_counter() - began)
    return {name: Stats.of(samples[name], faults[name]) for name in samples}, samples


def runtime_self_time(engine: Any, session_id: str, blocks: int = 2) -> dict[str, Any]:
    """``blocks`` engine blocks under a :class:`ForwardTimer`: each block's time outside its forwards."""
    from ardiff_jax import DiffusionRequest
    from benchmarks.common import sync

    per_block = []
    for index in range(blocks):
        with ForwardTimer() as timer:
            start = time.perf_counter()
            sync(engine.generate(DiffusionRequest(f"{session_id}-timed-{index}",
                                                  extra_args={"session_id": session_id})).latents)
            total = time.perf_counter() - start
        forwards = sum(timer.forward_s)
        per_block.append({"block_ms": 1e3 * total, "forwards_ms": 1e3 * forwards,
                          "forwards": len(timer.forward_s), "runtime_ms": 1e3 * (total - forwards),
                          "runtime_fraction_of_forwards": (total - forwards) / forwards})
    return {
        "blocks": per_block,
        "runtime_ms_median": float(np.median([b["runtime_ms"] for b in per_block])),
        "runtime_fraction_of_forwards_median": float(np.median([b["runtime_fraction_of_forwards"]
                                                                for b in per_block])),
    }


def split_block(engine: Any, session_id: str, *, frames_per_block: int, warmup: int = 1, rounds: int = 5,
                keep_going: Callable[[float], bool] | None = None, self_time_blocks: int = 2) -> dict[str, Any]:
    """Time ``session_id``'s next blocks through ``engine`` against its recorded forwards, interleaved.

    The session must have had its first block (prompt and compilation done). Returns the
    medians of the three cases, the split (denoise / commit / overhead, ms) and whether the
    overhead target holds; ``keep_going`` may stop the rounds early (time guards). Then
    ``self_time_blocks`` blocks under :func:`runtime_self_time` (when ``keep_going`` allows):
    the runtime's time around synced forwards, a drift-free cross-check of the overhead.
    """
    from ardiff_jax import DiffusionRequest
    from benchmarks.bench_e2e import _CompileClock

    step, calls = capture_block_forwards(engine, session_id, f"{session_id}-capture")
    if len(calls) < 2:
        raise RuntimeError(f"expected the block's denoise forwards and one commit forward, recorded {len(calls)}")
    *denoise_calls, commit_call = calls
    counter = [0]

    def engine_block() -> Any:
        counter[0] += 1
        request = DiffusionRequest(f"{session_id}-split-{counter[0]}", extra_args={"session_id": session_id})
        return engine.generate(request).latents

    def denoise() -> Any:
        out = None
        for args, kwargs in denoise_calls:
            if out is not None:  # the pipeline's chain: this step's x_t is the previous step's x_next
                args = (*args[:3], out[0], *args[4:])
            out = step(*args, **kwargs)
        return out

    def commit() -> Any:
        args, kwargs = commit_call
        return step(*args, **kwargs)

    cases = [Case("engine_block", engine_block), Case("denoise", denoise), Case("commit", commit)]
    with _CompileClock() as clock:
        stats, samples = _interleave(cases, warmup=warmup, rounds=rounds, keep_going=keep_going)
    denoise_ms, commit_ms = stats["denoise"].median_ms, stats["commit"].median_ms
    block_ms = stats["engine_block"].median_ms
    model_ms = denoise_ms + commit_ms
    overhead_ms = block_ms - model_ms
    fraction = overhead_ms / model_ms
    # The same per round (the three cases ran back to back): robust to drift between rounds.
    per_round = [(e - d - c) / (d + c) for e, d, c in zip(samples["engine_block"], samples["denoise"],
                                                           samples["commit"], strict=True)]
    slowest_block = max(samples["engine_block"])
    self_time: dict[str, Any] = {"skipped": "no blocks requested"}
    if self_time_blocks > 0:
        if keep_going is None or keep_going(self_time_blocks * slowest_block):
            self_time = runtime_self_time(engine, session_id, self_time_blocks)
        else:
            self_time = {"skipped": "time guard"}
    return {
        "stats": stats,
        "forwards_recorded": len(calls),
        "denoise_steps": len(denoise_calls),
        "engine_block_ms": block_ms,
        "denoise_ms": denoise_ms,
        "denoise_ms_per_step": denoise_ms / len(denoise_calls),
        "commit_ms": commit_ms,
        "model_ms": model_ms,
        "overhead_ms": overhead_ms,
        "overhead_fraction_of_model": fraction,
        "overhead_target_fraction": OVERHEAD_TARGET,
        "overhead_target_met": bool(fraction <= OVERHEAD_TARGET),
        "overhead_fraction_per_round": per_round,
        "overhead_fraction_per_round_median": float(np.median(per_round)),
        "samples_ms": {name: [1e3 * x for x in values] for name, values in samples.items()},
        "runtime_self_time": self_time,
        "rounds": stats["engine_block"].n,
        "xla_compiles_during_split": clock.count,
        "throughput": throughput(frames_per_block, block_ms),
        "throughput_model_only": throughput(frames_per_block, model_ms),
    }


def throughput(frames_per_block: int, block_ms: float) -> dict[str, float]:
    """Latent frames/s of one block every ``block_ms``, and video frames/s at Wan's steady-state VAE rate."""
    latent = frames_per_block / (block_ms / 1e3)
    return {"latent_frames_per_s": latent, "video_frames_per_s": VIDEO_FRAMES_PER_LATENT_FRAME * latent}


# -- the benchmark ------------------------------------------------------------------------------------------
def run(*, latent: tuple[int, int] | None = DEFAULT_LATENT, blocks: int = 5, checkpoint: str | Path | None = None,
        smoke: bool = False, backend: str = "auto", out_dir: Path = RESULTS_DIR, write: bool = True
        ) -> dict[str, Any]:
    """Build the pipeline and engine, run the session's first block, then the split over ``blocks`` rounds."""
    import jax
    from flax import nnx

    from ardiff_jax import ARDiffusionEngine, DiffusionRequest
    from benchmarks.bench_e2e import _CompileClock
    from benchmarks.common import sync

    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    config = wan_config(latent, smoke=smoke)
    setup: dict[str, Any] = {}
    with _CompileClock() as clock:
        start = time.perf_counter()
        pipeline = make_pipeline(config, checkpoint=checkpoint)
        sync(nnx.state(pipeline.modules))
        setup["weights_s"] = time.perf_counter() - start
        setup["weights_compile_s"] = clock.seconds
        _progress(f"weights: {setup['weights_s']:.1f} s; loading the engine (compiles world_step, warmup block)")
        start, before = time.perf_counter(), clock.seconds
        engine = ARDiffusionEngine(pipeline, engine_config(backend))
        setup["engine_load_s"] = time.perf_counter() - start  # includes the warmup block (compiles world_step)
        setup["engine_load_compile_s"] = clock.seconds - before
    _progress(f"engine load: {setup['engine_load_s']:.1f} s; first block")
    session = "bench-wan"
    try:
        start = time.perf_counter()  # the session's first block: text K/V of the prompt, no compile
        first = engine.generate(DiffusionRequest("bench-wan-b0", inputs={"prompt_embeds": prompt_embeds(config)},
                                                 extra_args={"session_id": session}))
        latents = np.asarray(first.latents)
        setup["first_block_s"] = time.perf_counter() - start
        _progress(f"first block: {setup['first_block_s']:.1f} s; capture + warmup round + {blocks} rounds")
        split = split_block(engine, session, frames_per_block=config.frames_per_block, warmup=1, rounds=blocks)
        last = np.asarray(engine.generate(DiffusionRequest("bench-wan-last", extra_args={"session_id": session}))
                          .latents)
        attention_backend = engine.runner.kv_cache.attention_backend
        capacity = engine.session_capacity
    finally:
        engine.close()
    finite = bool(np.isfinite(latents).all() and np.isfinite(last).all())
    record = {
        "benchmark": "bench_wan",
        "machine": machine_info(),
        "config": {
            "preset": config.name, "smoke": smoke, "weights": str(checkpoint) if checkpoint else "random",
            "policy": "self-forcing", "num_layers": config.num_layers, "dim": config.dim,
            "num_heads": config.num_heads, "head_dim": config.head_dim, "ffn_dim": config.ffn_dim,
            "latent": [config.latent_height, config.latent_width],
            "video_resolution": [8 * config.latent_height, 8 * config.latent_width],
            "tokens_per_frame": config.tokens_per_frame, "frames_per_block": config.frames_per_block,
            "window_frames": config.window_frames, "sink_frames": config.sink_frames,
            "timesteps": list(pipeline.schedule.timesteps), "dtype": "bfloat16",
            "param_dtype": config.param_dtype, "attention_backend": attention_backend,
            "session_capacity": capacity, "blocks": blocks, "prompt_rows": min(PROMPT_ROWS, config.text_len),
            "backend": jax.default_backend(),
        },
        "setup": setup,
        "block": split,
        "latents_shape": list(latents.shape),
        "latents_finite": finite,
        "notes": {
            "video_frames": "video frames/s = 4 x latent frames/s (Wan's VAE, steady state); transformer only: no VAE "
                            "decode, no text encoder",
            "overhead": "engine block median - (denoise + commit medians) of the same world_step on the block's "
                        "recorded arguments, interleaved",
        },
    }
    if write:
        path = write_json(out_dir / ("bench_wan_smoke.json" if smoke else "bench_wan.json"), record)
        print_report(record, path)
    return record


def print_report(record: dict[str, Any], path: Path | None = None) -> None:
    config, split = record["config"], record["block"]
    print(f"\n== bench_wan: {config['preset']} ({config['weights']} weights), {config['num_layers']} layers, "
          f"latent {config['latent'][0]}x{config['latent'][1]} ({config['tokens_per_frame']} tokens/frame), "
          f"{config['frames_per_block']}-frame blocks, window {config['window_frames']} + sink "
          f"{config['sink_frames']}, {config['attention_backend']} attention, bf16 ==")
    print(machine_line(record["machine"]))
    stats = split["stats"]

    def spread(name: str) -> str:
        s = stats[name]
        return f"[{s.p10_ms:.4g}-{s.p90_ms:.4g}]" if isinstance(s, Stats) else ""

    model = split["model_ms"]
    rows = [
        (f"{split['denoise_steps']} denoise steps", split["denoise_ms"], spread("denoise"),
         f"{100 * split['denoise_ms'] / model:.1f}% of model"),
        ("commit pass (t = 0)", split["commit_ms"], spread("commit"),
         f"{100 * split['commit_ms'] / model:.1f}% of model"),
        ("runtime overhead", split["overhead_ms"], "", f"{100 * split['overhead_fraction_of_model']:.2f}% of model"),
        ("engine block", split["engine_block_ms"], spread("engine_block"), f"n = {split['rounds']}"),
    ]
    print(format_table(("part of one block", "ms (median)", "[p10-p90]", "share"), rows))
    verdict = "met" if split["overhead_target_met"] else "NOT met"
    self_time = split["runtime_self_time"]
    if "runtime_ms_median" in self_time:
        print(f"runtime's own time in a block with synced forwards ({len(self_time['blocks'])} blocks): "
              f"{self_time['runtime_ms_median']:.1f} ms = "
              f"{100 * self_time['runtime_fraction_of_forwards_median']:.3f}% of its forwards")
    print(f"target: runtime overhead <= {100 * OVERHEAD_TARGET:.0f}% of model time: {verdict} "
          f"({100 * split['overhead_fraction_of_model']:.2f}% from the medians; per round, paired: median "
          f"{100 * split['overhead_fraction_per_round_median']:.2f}%, rounds "
          f"{', '.join(f'{100 * x:.1f}%' for x in split['overhead_fraction_per_round'])})")
    tp, tm = split["throughput"], split["throughput_model_only"]
    print(format_table(("throughput", "latent frames/s", "video frames/s (4x)"),
                       [("engine", tp["latent_frames_per_s"], tp["video_frames_per_s"]),
                        ("model only", tm["latent_frames_per_s"], tm["video_frames_per_s"])]))
    print(format_table(("setup (excluded above)", "s"), list(record["setup"].items())))
    print(f"XLA compiles during the split: {split['xla_compiles_during_split']}; latents finite: "
          f"{record['latents_finite']}")
    if path is not None:
        print(f"  wrote {path}")


def _latent(text: str) -> tuple[int, int]:
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--latent takes HxW (e.g. 8x12), got {text!r}") from None
    return h, w


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_wan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent", type=_latent, default=DEFAULT_LATENT,
                        help="latent HxW (default 8x12 for a CPU; 60x104 is the real 480x832 video)")
    parser.add_argument("--blocks", type=int, default=5, help="timed rounds (engine block + its forwards), default 5")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--random-weights", action="store_true", help="random weights of the real geometry (default)")
    weights.add_argument("--checkpoint", type=Path, default=None,
                         help="a published causal-Wan checkpoint (CausalWanPipeline.from_checkpoint)")
    parser.add_argument("--backend", default="auto", help="attention backend (auto, xla, cudnn)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer Wan-shaped model, 2 rounds: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    blocks = 2 if args.smoke else args.blocks
    run(latent=args.latent, blocks=blocks, checkpoint=args.checkpoint, smoke=args.smoke, backend=args.backend,
        out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
