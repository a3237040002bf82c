"""Timed multi-session generation with a reference pipeline (what ``ardiff-jax rollout`` runs).

Round-robin over ``sessions`` session ids, one block per request, ``blocks`` rounds, on
the default device, through :class:`~ardiff_jax.ARDiffusionEngine`. Compilation happens at
engine load (the pipelines' warmup providers cover every program the run uses), so
per-block latencies are steady-state numbers; the compile time is reported separately
(sum of XLA backend compiles while loading).

Not to be confused with :mod:`ardiff_jax.rollout`, the device-side ``lax.scan`` over a
schedule of blocks: this module times host-driven engine requests.

Everything that can be checked without weights is checked first
(:func:`plan_timed_generation`): the options, the pipeline/preset pairing and the memory
plan of the preset's KV spec, so an impossible run fails before building the model.
"""

from __future__ import annotations

import dataclasses
import numbers
import statistics
import time
from typing import Any, TextIO

import jax

from ardiff_jax import _registry
from ardiff_jax._checks import check_non_negative_int, check_positive_int
from ardiff_jax._compile_events import recording_compiles
from ardiff_jax.capability import ARDiffusionKVCacheSpec, spec_summary
from ardiff_jax.models import DIT_PRESETS, dit_preset
from ardiff_jax.runtime import ARDiffusionEngine, MemoryPlan, free_memory_bytes, plan_memory
from ardiff_jax.types import EngineConfig, check_kv_dtype

__all__ = ["TimedGenerationOptions", "plan_timed_generation", "run_timed_generation"]

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _pipelines() -> tuple[str, ...]:
    """The pipelines a timed generation runs: the models that the registry gives ``rollout``."""
    return tuple(entry.name for entry in _registry.models("rollout"))


@dataclasses.dataclass(frozen=True)
class TimedGenerationOptions:
    """What to run. ``available_memory_bytes=None`` measures the device's free memory.

    ``pipeline="wan"`` (a causal Wan, e.g. ``preset="wan2.1-t2v-1.3b"``) needs either a
    ``checkpoint`` to load or ``random_weights=True`` (the real geometry without a checkpoint:
    timing, not video); the reference pipelines always run on random weights.
    """

    pipeline: str = "world"
    preset: str = "tiny"
    sessions: int = 2
    blocks: int = 4
    dtype: str = "bfloat16"
    available_memory_bytes: int | None = None
    gpu_memory_fraction: float = 0.1
    seed: int = 0
    checkpoint: str | None = None
    random_weights: bool = False

    def validate(self) -> None:
        """ValueError naming the first bad field (host only, no weights, no device work)."""
        if self.pipeline not in _pipelines():
            raise ValueError(f"pipeline must be one of {sorted(_pipelines())}, got {self.pipeline!r}")
        if self.preset not in DIT_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(DIT_PRESETS)}")
        check_positive_int("sessions", self.sessions)
        check_positive_int("blocks", self.blocks)
        check_non_negative_int("seed", self.seed)
        check_kv_dtype(self.dtype)
        fraction = self.gpu_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be a number in (0, 1], got {fraction!r}")
        if self.available_memory_bytes is not None:
            check_positive_int("available_memory_bytes", self.available_memory_bytes)
        loaders = [entry.name for entry in _registry.models("rollout") if entry.rollout_checkpoints is not None]
        if self.pipeline in loaders:
            if (self.checkpoint is None) == (not self.random_weights):
                raise ValueError(f"pipeline {self.pipeline!r} needs exactly one of a checkpoint to load or "
                                 "random_weights=True (the real geometry without a checkpoint)")
        elif self.checkpoint is not None:
            raise ValueError(f"pipeline {self.pipeline!r} has no checkpoints (it runs on random weights); "
                             f"checkpoints load with pipeline {' or '.join(repr(name) for name in loaders)}")

    def kv_spec(self) -> ARDiffusionKVCacheSpec:
        """The KV spec the run's pipeline will report, from the preset alone (no weights)."""
        return _registry.model(self.pipeline, "rollout").kv_spec(self.preset, self.sessions)


def plan_timed_generation(options: TimedGenerationOptions) -> MemoryPlan:
    """Validate ``options`` and plan KV memory from the preset's spec, before any weight exists.

    Raises ValueError if an option is bad, the pipeline cannot run on the preset, or not
    even one session fits the memory budget (the engine would refuse it after the model
    was built, which for the large presets takes minutes and gigabytes).
    """
    options.validate()
    spec = options.kv_spec()
    if options.available_memory_bytes is None:
        available, source = free_memory_bytes()
    else:
        available, source = options.available_memory_bytes, "explicit"
    return plan_memory(spec, dtype=options.dtype, available_memory_bytes=available,
                       gpu_memory_fraction=float(options.gpu_memory_fraction), memory_source=source)


def _progress_bar(stream: TextIO, done: int, total: int, latency_ms: float, fps: float) -> None:
    width = 30
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    stream.write(f"\r[{bar}] {done}/{total} blocks  last {latency_ms:7.1f} ms  {fps:8.1f} frames/s")
    if done == total:
        stream.write("\n")
    stream.flush()


def run_timed_generation(options: TimedGenerationOptions, *, stdout: TextIO | None = None,
                         progress: TextIO | None = None) -> dict[str, Any]:
    """Check the plan, build the pipeline and engine, generate, and return the JSON-ready summary."""
    plan_timed_generation(options)  # fails before any weight is built
    config = dit_preset(options.preset)
    entry = _registry.model(options.pipeline, "rollout")
    pipeline_cls, config_cls = entry.pipeline_classes()
    compile_seconds: list[float] = []  # a load from jax's persistent cache counts its load time
    with recording_compiles(lambda program: compile_seconds.append(program.seconds)):
        load_start = time.perf_counter()
        if options.checkpoint is not None:
            pipeline = entry.rollout_checkpoints(options.checkpoint, config,
                                                 config_cls(session_capacity=options.sessions))
        else:
            pipeline = pipeline_cls(config, config_cls(session_capacity=options.sessions))
        engine = ARDiffusionEngine(pipeline, EngineConfig(
            dtype=options.dtype, available_memory_bytes=options.available_memory_bytes,
            gpu_memory_fraction=options.gpu_memory_fraction))
        load_seconds = time.perf_counter() - load_start
        load_compile = sum(compile_seconds)
        if stdout is not None:
            print(f"{options.pipeline} pipeline, preset {options.preset} on {jax.devices()[0]}", file=stdout)
            print(engine.memory_plan, file=stdout)
        make_request = entry.rollout_requests(pipeline, options.seed)
        frames_per_block = config.frames_per_block
        total = options.sessions * options.blocks
        records = []
        run_start = time.perf_counter()
        for block in range(options.blocks):
            for session in range(options.sessions):
                request = make_request(session, block)
                start = time.perf_counter()
                engine.generate(request)  # the runner waits for the device before returning
                latency = time.perf_counter() - start
                records.append({"session": session, "block": block, "latency_ms": latency * 1e3})
                elapsed = time.perf_counter() - run_start
                if progress is not None:
                    fps = len(records) * frames_per_block / elapsed
                    _progress_bar(progress, len(records), total, latency * 1e3, fps)
        run_seconds = time.perf_counter() - run_start
        run_compile = sum(compile_seconds) - load_compile
        plan = engine.memory_plan.as_dict()
        resident = engine.sessions
        engine.close()

    latencies = [r["latency_ms"] for r in records]
    steady = [r["latency_ms"] for r in records if r["block"] > 0] or latencies
    # The key names are the CLI's JSON output ("rollout" in them is the command's name).
    summary = {
        "pipeline": options.pipeline,
        "preset": options.preset,
        "weights": options.checkpoint or "random",
        "device": str(jax.devices()[0]),
        "dtype": options.dtype,
        "sessions": options.sessions,
        "blocks_per_session": options.blocks,
        "frames_per_block": frames_per_block,
        "denoise_steps": pipeline.schedule.num_steps,
        "load_seconds": load_seconds,
        "compile_seconds": load_compile,
        "compile_seconds_during_rollout": run_compile,
        "rollout_seconds": run_seconds,
        "frames_per_second": total * frames_per_block / run_seconds,
        "latency_ms": {"median": statistics.median(latencies), "median_after_first_block": statistics.median(steady),
                       "max": max(latencies), "min": min(latencies)},
        "blocks": records,
        "resident_sessions": list(resident),
        "spec": spec_summary(pipeline.ar_diffusion_kv_cache_spec()),
        "plan": plan,
    }
    if stdout is not None:
        print(f"{total} blocks ({total * frames_per_block} latent frames) in {run_seconds:.3f} s: "
              f"{summary['frames_per_second']:.1f} frames/s, median block {summary['latency_ms']['median']:.2f} ms; "
              f"load {load_seconds:.2f} s of which XLA compile {load_compile:.2f} s", file=stdout)
    return summary
