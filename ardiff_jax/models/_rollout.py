"""A timed multi-session rollout of a reference pipeline (what ``ardiff-jax rollout`` runs).

Round-robin over ``sessions`` session ids, one block per request, ``blocks`` rounds, on
the default device. Compilation happens at engine load (the pipelines' warmup providers
cover every program a rollout uses), so per-block latencies are steady-state numbers;
the compile time is reported separately (sum of XLA backend compiles while loading).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import numpy as np

from ardiff_jax.capability import spec_summary
from ardiff_jax.models._cfg import CFGPipelineConfig, CFGWorldActionPipeline
from ardiff_jax.models._config import DIT_PRESETS, dit_preset
from ardiff_jax.models._world import WorldPipeline, WorldPipelineConfig
from ardiff_jax.runtime._engine import ARDiffusionEngine
from ardiff_jax.types import DiffusionRequest, EngineConfig

__all__ = ["RolloutOptions", "run_rollout"]

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """What to roll out. ``available_memory_bytes=None`` measures the device's free memory."""

    pipeline: str = "world"
    preset: str = "tiny"
    sessions: int = 2
    blocks: int = 4
    dtype: str = "bfloat16"
    available_memory_bytes: int | None = None
    gpu_memory_fraction: float = 0.1
    seed: int = 0

    def validate(self) -> None:
        if self.pipeline not in ("world", "cfg"):
            raise ValueError(f"pipeline must be 'world' or 'cfg', got {self.pipeline!r}")
        if self.preset not in DIT_PRESETS:
            raise KeyError(f"unknown preset {self.preset!r}; choose from {sorted(DIT_PRESETS)}")
        for name in ("sessions", "blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        EngineConfig(dtype=self.dtype, gpu_memory_fraction=self.gpu_memory_fraction)  # validates the dtype


def _progress_bar(stream: TextIO, done: int, total: int, latency_ms: float, fps: float) -> None:
    width = 30
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    stream.write(f"\r[{bar}] {done}/{total} blocks  last {latency_ms:7.1f} ms  {fps:8.1f} frames/s")
    if done == total:
        stream.write("\n")
    stream.flush()


def _make_requests(options: RolloutOptions, pipeline: Any) -> Callable[[int, int], DiffusionRequest]:
    cfg = pipeline.config
    rng = np.random.default_rng(options.seed)

    def world(session: int, block: int) -> DiffusionRequest:
        inputs: dict[str, Any] = {}
        if cfg.num_register_tokens:
            inputs["action"] = rng.standard_normal((cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)
        return DiffusionRequest(f"s{session}-b{block}", prompt=f"session {session}: a drive through the city",
                                extra_args={"session_id": f"session-{session}"}, inputs=inputs)

    def cfg_request(session: int, block: int) -> DiffusionRequest:
        # DreamZero's convention: the conditioning frame first, then 4-frame observation chunks.
        observation = pipeline.schema.example(1 if block == 0 else 4, seed=options.seed + 1000 * session + block)
        return DiffusionRequest(f"s{session}-b{block}", prompt=f"session {session}: pick up the cup",
                                extra_args={"session_id": f"session-{session}"}, inputs={"observation": observation})

    return world if options.pipeline == "world" else cfg_request


def run_rollout(options: RolloutOptions, *, stdout: TextIO | None = None, progress: TextIO | None = None
                ) -> dict[str, Any]:
    """Build the pipeline and engine, roll out, and return the JSON-ready summary."""
    options.validate()
    config = dit_preset(options.preset)
    compile_seconds: list[float] = []

    def listener(event: str, duration: float, **_: Any) -> None:
        if event == _BACKEND_COMPILE:
            compile_seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        load_start = time.perf_counter()
        if options.pipeline == "world":
            pipeline: Any = WorldPipeline(config, WorldPipelineConfig(session_capacity=options.sessions))
        else:
            pipeline = CFGWorldActionPipeline(config, CFGPipelineConfig(session_capacity=options.sessions))
        engine = ARDiffusionEngine(pipeline, EngineConfig(
            dtype=options.dtype, available_memory_bytes=options.available_memory_bytes,
            gpu_memory_fraction=options.gpu_memory_fraction))
        load_seconds = time.perf_counter() - load_start
        load_compile = sum(compile_seconds)
        if stdout is not None:
            print(f"{options.pipeline} pipeline, preset {options.preset} on {jax.devices()[0]}", file=stdout)
            print(engine.memory_plan, file=stdout)
        make_request = _make_requests(options, pipeline)
        frames_per_block = config.frames_per_block
        total = options.sessions * options.blocks
        records = []
        rollout_start = time.perf_counter()
        for block in range(options.blocks):
            for session in range(options.sessions):
                request = make_request(session, block)
                start = time.perf_counter()
                engine.generate(request)  # the runner waits for the device before returning
                latency = time.perf_counter() - start
                records.append({"session": session, "block": block, "latency_ms": latency * 1e3})
                elapsed = time.perf_counter() - rollout_start
                if progress is not None:
                    fps = len(records) * frames_per_block / elapsed
                    _progress_bar(progress, len(records), total, latency * 1e3, fps)
        rollout_seconds = time.perf_counter() - rollout_start
        rollout_compile = sum(compile_seconds) - load_compile
        plan = engine.memory_plan.as_dict()
        resident = engine.sessions
        engine.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

    latencies = [r["latency_ms"] for r in records]
    steady = [r["latency_ms"] for r in records if r["block"] > 0] or latencies
    summary = {
        "pipeline": options.pipeline,
        "preset": options.preset,
        "device": str(jax.devices()[0]),
        "dtype": options.dtype,
        "sessions": options.sessions,
        "blocks_per_session": options.blocks,
        "frames_per_block": frames_per_block,
        "denoise_steps": pipeline.schedule.num_steps,
        "load_seconds": load_seconds,
        "compile_seconds": load_compile,
        "compile_seconds_during_rollout": rollout_compile,
        "rollout_seconds": rollout_seconds,
        "frames_per_second": total * frames_per_block / rollout_seconds,
        "latency_ms": {"median": statistics.median(latencies), "median_after_first_block": statistics.median(steady),
                       "max": max(latencies), "min": min(latencies)},
        "blocks": records,
        "resident_sessions": list(resident),
        "spec": spec_summary(pipeline.ar_diffusion_kv_cache_spec()),
        "plan": plan,
    }
    if stdout is not None:
        print(f"{total} blocks ({total * frames_per_block} latent frames) in {rollout_seconds:.3f} s: "
              f"{summary['frames_per_second']:.1f} frames/s, median block {summary['latency_ms']['median']:.2f} ms; "
              f"load {load_seconds:.2f} s of which XLA compile {load_compile:.2f} s", file=stdout)
    return summary
