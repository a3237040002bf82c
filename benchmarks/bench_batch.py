"""Batched ticks: aggregate frames/s and per-session latency vs batch size, next to the sequential engine.

One tick serves the next block of ``B`` sessions. Two ways, timed interleaved in the same
run (``benchmarks/common.py``: round ``r`` runs every case in turn, so a noisy neighbour
drifts across all of them alike):

* ``batched``: ``engine.generate_batch(B requests)``: one vmapped forward per denoise step
  over one paged view of the ``B`` sessions' slots, one donated write of every block;
* ``sequential``: ``engine.generate(request)`` for each of the ``B`` sessions in turn (what
  a server without batching does; the reference runtime's ``max_num_seqs = 1``).

Reported per ``B``: the tick's median wall time, aggregate frames/s (``B * frames_per_block``
per tick) and per-session latency (batched: every block arrives when the tick ends;
sequential: the mean over sessions of the time from the tick's start to *its* block).

Two workloads:

* ``sprite``: the SpriteWorld model (``dit_preset("sprite_world")``, random weights: timing does
  not depend on them) behind ``SpriteWorldPipeline``, sessions with a full window, one
  frame per block, the shipped one-step schedule (one denoise forward + the commit forward),
  decoded RGB frames returned.
* ``medium``: the runtime's own share at the ``medium`` example geometry (8 layers, 4 KV heads
  x 128, 220 tokens/frame, 3 frames/block, 12 visible frames): a model-free pipeline whose
  forward is paged attention of the block's 660 queries over the session's visible history
  in ``--medium-layers`` layers (default 1: the full 8 cost ~18 GFLOP per session on CPU)
  plus the commit of the block's K/V in every layer. It isolates what batching changes in
  the runtime (views, attention over many slots, one write) from a model's compute.

Compilation is excluded (engines warm every bucket at load; one untimed tick per case);
compile events during the timed ticks are counted (expected 0).

Run: ``python -m benchmarks.bench_batch``; results go to ``benchmarks/results/batch.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    Stats,
    bench_spec,
    format_table,
    machine_info,
    machine_line,
    write_json,
)

__all__ = ["main", "run"]

BATCH_SIZES = (1, 2, 4, 8, 16)


@contextlib.contextmanager
def _count_compiles() -> Iterator[list[str]]:
    """The names of the programs compiled (or loaded from jax's persistent cache) inside the block, as made."""
    from ardiff_jax._compile_events import recording_compiles

    names: list[str] = []
    with recording_compiles(lambda program: names.append(program.name)):
        yield names


# -- workloads ---------------------------------------------------------------------------------------


class _SpriteWorkload:
    name = "sprite"

    def __init__(self, capacity: int) -> None:
        from ardiff_jax import ARDiffusionEngine, EngineConfig
        from ardiff_jax.models import (
            DiTModules,
            SpriteWorldPipeline,
            SpriteWorldPipelineConfig,
            dit_preset,
        )

        modules = DiTModules.create(dit_preset("sprite_world"), 0)
        config = EngineConfig(dtype="float32", available_memory_bytes=2**30, gpu_memory_fraction=1.0)
        self.engines = {
            kind: ARDiffusionEngine(SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(
                session_capacity=capacity), modules=modules), config)
            for kind in ("batched", "sequential")
        }
        self.frames_per_block = modules.transformer.config.frames_per_block
        self._tick = 0

    def request(self, session_id: str, first: bool) -> Any:
        from ardiff_jax import DiffusionRequest
        from ardiff_jax.envs import SpriteWorld

        inputs: dict[str, Any] = {"actions": np.array([self._tick % 5])}
        if first:
            inputs["observation"] = SpriteWorld(len(session_id), size=32).reset()
        return DiffusionRequest(session_id, extra_args={"session_id": session_id}, inputs=inputs)

    def next_tick(self) -> None:
        self._tick += 1

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


class _KVOnlyPipeline:
    """A model-free pipeline at a given geometry: paged attention of the block's queries + the block's commit."""

    def __init__(self, spec: Any, layers: int) -> None:
        import jax
        import jax.numpy as jnp

        self.spec = spec
        self.layers = layers
        self._state: Any = None
        self._batch: Any = None
        rng = np.random.default_rng(0)
        seq = spec.frames_per_block * spec.tokens_per_frame
        shape = (spec.num_layers, seq, spec.num_kv_heads, spec.head_size)
        self.block_k = jnp.asarray(rng.normal(size=shape), jnp.float32)
        self.block_v = jnp.asarray(rng.normal(size=shape), jnp.float32)
        self.seq_len = seq

        def attend(caches: Any, k: jax.Array, v: jax.Array) -> jax.Array:
            out = jnp.zeros(k.shape[1:], jnp.float32)
            for layer in range(layers):  # q = the block's keys: one query per current token
                out = out + caches.attend(layer, k[layer], k[layer], v[layer])
            return out

        # Each forward returns the block's K/V as a new array, as a model's forward does (the
        # batched one stacked over its rows), so both paths materialise the same bytes.
        self._attend = jax.jit(lambda caches, k, v: (attend(caches, k, v), k + 0.0, v + 0.0))
        self._attend_batch = jax.jit(lambda caches, k, v: jax.vmap(
            lambda c: (attend(c, k, v), k + 0.0, v + 0.0), in_axes=(caches.vmap_axes(),))(caches))

    def ar_diffusion_kv_cache_spec(self) -> Any:
        return self.spec

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: Any) -> Iterator[None]:
        self._state = state
        try:
            yield
        finally:
            self._state = None

    @contextlib.contextmanager
    def bind_ar_diffusion_batch(self, batch: Any) -> Iterator[None]:
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def close_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def forward(self, request: Any) -> Any:
        caches = self._state.get_kv_caches("main", seq_len=self.seq_len, commit_current=True)
        out, k, v = self._attend(caches, self.block_k, self.block_v)
        self._state.commit_paged_context("main", kv=(k, v))
        return out

    def forward_batch(self, requests: Sequence[Any]) -> list[Any]:
        batch = self._batch
        caches = batch.get_kv_caches("main", seq_len=self.seq_len, commit_current=True)
        out, k, v = self._attend_batch(caches, self.block_k, self.block_v)
        batch.commit_paged_context("main", kv=(k, v))
        return [out] * len(requests)  # the benchmark reads no output: one shared array is enough


class _MediumWorkload:
    name = "medium"

    def __init__(self, capacity: int, layers: int) -> None:
        import dataclasses

        from ardiff_jax import ARDiffusionEngine, EngineConfig

        spec = dataclasses.replace(bench_spec("medium", session_capacity=capacity), max_scratch_tokens_per_branch=0)
        config = EngineConfig(dtype="float32", available_memory_bytes=2**34, gpu_memory_fraction=1.0, warmup=False)
        self.engines = {kind: ARDiffusionEngine(_KVOnlyPipeline(spec, layers), config)
                        for kind in ("batched", "sequential")}
        self.frames_per_block = spec.frames_per_block
        self.layers = layers

    def request(self, session_id: str, first: bool) -> Any:
        from ardiff_jax import DiffusionRequest

        return DiffusionRequest(session_id, extra_args={"session_id": session_id})

    def next_tick(self) -> None:
        pass

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


# -- timing -------------------------------------------------------------------------------------------


def _tick_batched(workload: Any, ids: list[str], first: bool) -> tuple[float, float]:
    start = time.perf_counter()
    workload.engines["batched"].generate_batch([workload.request(sid, first) for sid in ids])
    elapsed = time.perf_counter() - start
    return elapsed, elapsed  # every session's block arrives at the end of the tick


def _tick_sequential(workload: Any, ids: list[str], first: bool) -> tuple[float, float]:
    engine = workload.engines["sequential"]
    start = time.perf_counter()
    arrivals = []
    for sid in ids:
        engine.generate(workload.request(sid, first))
        arrivals.append(time.perf_counter() - start)
    return arrivals[-1], float(np.mean(arrivals))


def _measure(workload: Any, batch_sizes: Sequence[int], ticks: int, fill: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in batch_sizes:
        ids = [f"{workload.name}-{size}-{i}" for i in range(size)]
        for first in [True] + [False] * fill:  # start the sessions and fill their windows (untimed)
            _tick_batched(workload, ids, first)
            _tick_sequential(workload, ids, first)
            workload.next_tick()
        samples: dict[str, list[tuple[float, float]]] = {"batched": [], "sequential": []}
        with _count_compiles() as compiles:
            for tick in range(ticks):
                order = ("batched", "sequential") if tick % 2 == 0 else ("sequential", "batched")
                for kind in order:
                    tick_fn = _tick_batched if kind == "batched" else _tick_sequential
                    samples[kind].append(tick_fn(workload, ids, False))
                workload.next_tick()
        entry: dict[str, Any] = {"compiles_during_timed_ticks": len(compiles)}
        for kind, rows in samples.items():
            tick_stats = Stats.of([row[0] for row in rows])
            latency = Stats.of([row[1] for row in rows])
            entry[kind] = {
                "tick_ms": tick_stats.as_dict(),
                "frames_per_s": size * workload.frames_per_block / (tick_stats.median_ms / 1e3),
                "session_latency_ms_median": latency.median_ms,
            }
        entry["batched / sequential frames/s"] = entry["batched"]["frames_per_s"] / entry["sequential"]["frames_per_s"]
        results[str(size)] = entry
        for kind in ("batched", "sequential"):
            for sid in ids:
                workload.engines[kind].close_session(sid)
    return results


def run(*, batch_sizes: Sequence[int] = BATCH_SIZES, ticks: int = 7, medium: bool = True, medium_layers: int = 1,
        medium_batch_sizes: Sequence[int] | None = None, quick: bool = False, out_dir: Path = RESULTS_DIR,
        write: bool = True) -> dict[str, Any]:
    """Time both workloads; write ``batch.json`` unless ``write=False``. ``quick``: batch sizes 1, 2, 2 ticks."""
    if quick:
        batch_sizes, ticks = (1, 2), 2
        medium_batch_sizes = (1, 2)
    medium_batch_sizes = tuple(batch_sizes if medium_batch_sizes is None else medium_batch_sizes)
    record: dict[str, Any] = {"benchmark": "bench_batch", "machine": machine_info(),
                              "config": {"batch_sizes": list(batch_sizes), "ticks": ticks, "quick": quick,
                                         "medium_layers": medium_layers,
                                         "medium_batch_sizes": list(medium_batch_sizes) if medium else []},
                              "results": {}, "load_s": {}}
    workloads = [("sprite", lambda: _SpriteWorkload(max(batch_sizes)), batch_sizes, 2)]
    if medium:
        workloads.append(("medium", lambda: _MediumWorkload(max(medium_batch_sizes), medium_layers),
                          medium_batch_sizes, 1))
    for name, build, sizes, fill in workloads:
        start = time.perf_counter()
        workload = build()
        record["load_s"][name] = time.perf_counter() - start  # engine loads: warmup compiles every bucket
        try:
            record["results"][name] = _measure(workload, sizes, ticks, fill)
        finally:
            workload.close()
    sprite = record["results"]["sprite"]
    one = sprite[str(min(batch_sizes))]["sequential"]["frames_per_s"]
    record["summary"] = {f"sprite: batched frames/s at B={size} / one session": sprite[str(size)]["batched"]
                         ["frames_per_s"] / one for size in batch_sizes}
    if write:
        path = write_json(out_dir / "batch.json", record)
        _print_report(record, path)
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    print(f"\n== bench_batch: {record['config']['ticks']} timed ticks per batch size ==")
    print(machine_line(record["machine"]))
    for name, results in record["results"].items():
        rows = [(size, entry["batched"]["tick_ms"]["median_ms"], entry["batched"]["frames_per_s"],
                 entry["batched"]["session_latency_ms_median"], entry["sequential"]["tick_ms"]["median_ms"],
                 entry["sequential"]["frames_per_s"], entry["sequential"]["session_latency_ms_median"],
                 entry["batched / sequential frames/s"], entry["compiles_during_timed_ticks"])
                for size, entry in results.items()]
        print(f"-- {name} --")
        print(format_table(("B", "batched tick ms", "batched frames/s", "batched latency ms", "seq tick ms",
                            "seq frames/s", "seq latency ms", "batched/seq", "compiles"), rows))
    print(format_table(("summary", "value"), list(record["summary"].items())))
    print(format_table(("engine load (excluded above)", "s"), list(record["load_s"].items())))
    print(f"  wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="comma-separated (1,2,4,8,16)")
    parser.add_argument("--medium-batch-sizes", default=None, help="for the medium workload (default: --batch-sizes)")
    parser.add_argument("--ticks", type=int, default=7, help="timed ticks per batch size (default 7)")
    parser.add_argument("--no-medium", action="store_true", help="sprite world only")
    parser.add_argument("--medium-layers", type=int, default=1, help="layers attended in the medium workload")
    parser.add_argument("--quick", action="store_true", help="batch sizes 1 and 2, 2 ticks (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    medium_sizes = None if args.medium_batch_sizes is None else tuple(int(x) for x in args.medium_batch_sizes.split(","))
    run(batch_sizes=sizes, ticks=args.ticks, medium=not args.no_medium, medium_layers=args.medium_layers,
        medium_batch_sizes=medium_sizes, quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
