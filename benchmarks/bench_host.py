"""Host overhead of one ``execute_model`` tick through the real engine, with a pipeline that does nothing.

Everything the runtime does around a forward is host Python: parse the request's session,
validate it, look the session up (or LRU-evict and create one), bind the state, run the
forward, unbind and check what the pipeline left, wait for the device, record the tick's
wall time. With a real model that work overlaps nothing (``execute_model`` waits for the
device before it returns), so it adds to every block's latency. This benchmark isolates it:
:class:`TrivialPipeline` implements the capability and its ``forward`` does nothing at all
(``no_kv``) or only prepares the paged view a denoise forward would pass to its jit
(``get_kv``: ``state.get_kv_caches(..., commit_current=False)``), so a tick costs only the
runtime's own work.

Variants, measured interleaved in one run (each round runs a batch of ticks of every
variant in turn), ``--ticks`` timed ticks each (default 10,000):

* ``hot``: one session id every tick (lookup + move-to-end);
* ``churn``: ``capacity + 1`` session ids in rotation, so every tick misses, LRU-evicts the
  least recently used session (KV release + close hook) and creates a new one.

Reported per variant: median, p90, p99 and mean in microseconds, the evictions per tick
(1.0 for ``churn``, 0 for ``hot``: a check that the variant does what it says), plus two
attributions of where the time goes: micro-timings of the runner's steps called directly,
and a ``cProfile`` of a shorter run (profiling inflates small functions; use it for the
ranking, the micro-timings for the microseconds).

Target from the issue: median tick < 100 us.

Run: ``python -m benchmarks.bench_host``; results go to ``benchmarks/results/host.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    bench_spec,
    format_table,
    machine_info,
    machine_line,
    pyplot,
    save_figure,
    write_json,
)

__all__ = ["TrivialPipeline", "HostBench", "main", "run"]

#: Target from the performance issue: median host overhead per tick, microseconds.
TICK_TARGET_US = 100.0

VARIANTS = ("no_kv/hot", "no_kv/churn", "get_kv/hot", "get_kv/churn")


class TrivialPipeline:
    """The capability and nothing else: the runtime's host work is all a tick costs.

    ``touch_kv=True`` makes ``forward`` prepare the paged view of the bound session's branch
    (what every denoise forward does before its jit); otherwise ``forward`` returns at once.
    The hooks only count calls, so the benchmark can check how often sessions were released.
    """

    def __init__(self, spec: Any, *, touch_kv: bool) -> None:
        self._spec = spec
        self._touch_kv = touch_kv
        self._branch = spec.kv_branches[0].name
        self._seq_len = spec.frames_per_block * spec.tokens_per_frame
        self._state: Any = None
        self.closed = 0
        self.resets = 0

    def ar_diffusion_kv_cache_spec(self) -> Any:
        return self._spec

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: Any) -> Iterator[None]:
        self._state = state
        try:
            yield
        finally:
            self._state = None  # the runner checks that no attribute keeps the state

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self.resets += 1

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self.closed += 1

    def forward(self, request: Any) -> None:
        if self._touch_kv:
            self._state.get_kv_caches(self._branch, seq_len=self._seq_len, commit_current=False)
        return None


class HostBench:
    """One engine per variant, all alive at once so their ticks can be interleaved."""

    def __init__(self, geometry: str = "tiny", capacity: int = 3) -> None:
        from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig

        self.geometry = geometry
        self.capacity = capacity
        self.spec = bench_spec(geometry, session_capacity=capacity)
        # float32: no bf16 storage detour; the pools' size does not enter a tick (nothing is
        # written), so the small geometry only keeps the allocation cheap.
        config = EngineConfig(dtype="float32", available_memory_bytes=2**30, gpu_memory_fraction=1.0)
        self.engines: dict[str, Any] = {}
        self.pipelines: dict[str, TrivialPipeline] = {}
        self.requests: dict[str, list[Any]] = {}
        for name in VARIANTS:
            kv, sessions = name.split("/")
            pipeline = TrivialPipeline(self.spec, touch_kv=kv == "get_kv")
            engine = ARDiffusionEngine(pipeline, config)
            assert engine.session_capacity == capacity, engine.memory_plan
            ids = ["hot"] if sessions == "hot" else [f"s{i}" for i in range(capacity + 1)]
            # Requests are built once: constructing one (two read-only mapping copies) is the
            # caller's cost, not the runtime's.
            self.requests[name] = [DiffusionRequest(f"r-{sid}", extra_args={"session_id": sid}) for sid in ids]
            self.engines[name] = engine
            self.pipelines[name] = pipeline
        self._cursor = {name: 0 for name in VARIANTS}

    def tick_fn(self, name: str) -> Callable[[], None]:
        """One tick of variant ``name`` per call, cycling through its session ids."""
        generate = self.engines[name].generate
        requests = self.requests[name]
        count = len(requests)
        cursor = self._cursor

        def tick() -> None:
            i = cursor[name]
            cursor[name] = i + 1
            generate(requests[i % count])

        return tick

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def time_ticks(bench: HostBench, *, ticks: int, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    """``ticks`` timed ticks per variant, interleaved in ``rounds`` rounds; summary in microseconds."""
    batch = max(1, ticks // rounds)
    fns = {name: bench.tick_fn(name) for name in VARIANTS}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    closed_before = {name: bench.pipelines[name].closed for name in VARIANTS}
    samples: dict[str, list[int]] = {name: [] for name in VARIANTS}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, fn in fns.items():
            out = samples[name]
            for _ in range(batch):
                start = clock()
                fn()
                out.append(clock() - start)
    summary = {}
    for name, ns in samples.items():
        us = np.asarray(ns, np.float64) / 1e3
        p50, p90, p99 = np.percentile(us, [50, 90, 99])
        summary[name] = {
            "median_us": float(p50), "p90_us": float(p90), "p99_us": float(p99), "mean_us": float(us.mean()),
            "max_us": float(us.max()), "n": int(us.size),
            "evictions_per_tick": (bench.pipelines[name].closed - closed_before[name]) / us.size,
        }
    return summary


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` back-to-back calls, microseconds."""
    results = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter_ns() - start) / calls / 1e3)
    return float(np.median(results))


def components(bench: HostBench, calls: int) -> dict[str, float]:
    """Each host step of a tick, called directly on the ``get_kv/hot`` engine (us per call).

    The names follow ``ARDiffusionModelRunner.execute_model``. ``churn - hot`` of the tick
    medians is the cost of one LRU eviction + session creation.
    """
    import jax

    from ardiff_jax.capability import SupportsARDiffusionRequestValidation

    name = "get_kv/hot"
    runner = bench.engines[name].runner
    pipeline = bench.pipelines[name]
    request = bench.requests[name][0]
    session_id = "hot"
    bench.engines[name].generate(request)  # make sure the session is resident
    state = runner._get_or_create_session(session_id)  # noqa: SLF001 - attributing the runner's own steps
    kv_cache = runner.kv_cache
    branch, seq_len = pipeline._branch, pipeline._seq_len  # noqa: SLF001

    def bind_unbind() -> None:
        with runner._bound(session_id, state):  # noqa: SLF001
            pass

    def get_kv_caches() -> None:
        with runner._bound(session_id, state):  # noqa: SLF001
            state.get_kv_caches(branch, seq_len=seq_len, commit_current=False)

    out = {
        "tick (engine.generate), for reference": _per_call_us(lambda: bench.engines[name].generate(request), calls),
        "_request_session (parse extra_args / typed tick)": _per_call_us(
            lambda: runner._request_session(request), calls),  # noqa: SLF001
        "_validate_request (runtime_checkable Protocol isinstance)": _per_call_us(
            lambda: runner._validate_request(session_id, request), calls),  # noqa: SLF001
        "isinstance(pipeline, SupportsARDiffusionRequestValidation)": _per_call_us(
            lambda: isinstance(pipeline, SupportsARDiffusionRequestValidation), calls),
        "_get_or_create_session, hit (OrderedDict move_to_end)": _per_call_us(
            lambda: runner._get_or_create_session(session_id), calls),  # noqa: SLF001
        "_bound enter+exit (bind hook, vars() scan, check_pools)": _per_call_us(bind_unbind, calls),
        "state.get_kv_caches inside _bound, minus _bound": 0.0,  # filled below
        "_synchronize(None) (kv_cache.block_until_ready + output leaves)": _per_call_us(
            lambda: runner._synchronize(None), calls),  # noqa: SLF001
        "jax.block_until_ready(pools) alone": _per_call_us(lambda: jax.block_until_ready(kv_cache.pools), calls),
        "kv_cache.check_pools (2x Array.is_deleted)": _per_call_us(kv_cache.check_pools, calls),
        "2x time.perf_counter + deque.append": _per_call_us(
            lambda: runner._perf_e2e_times.append(time.perf_counter() - time.perf_counter()), calls),  # noqa: SLF001
    }
    out["state.get_kv_caches inside _bound, minus _bound"] = (
        _per_call_us(get_kv_caches, calls) - out["_bound enter+exit (bind hook, vars() scan, check_pools)"])
    return out


def profile(bench: HostBench, ticks: int, top: int = 12) -> dict[str, Any]:
    """cProfile of ``ticks`` ticks of each variant: the functions with the most own time."""
    out: dict[str, Any] = {}
    for name in VARIANTS:
        fn = bench.tick_fn(name)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(ticks):
            fn()
        profiler.disable()
        stats = pstats.Stats(profiler, stream=io.StringIO())
        total = stats.total_tt
        rows = []
        for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append({"function": f"{_short(path)}:{line}({func})", "calls_per_tick": calls / ticks,
                         "own_us_per_tick": tottime / ticks * 1e6, "cum_us_per_tick": cumtime / ticks * 1e6,
                         "own_share": tottime / total if total else 0.0})
        rows.sort(key=lambda r: r["own_us_per_tick"], reverse=True)
        out[name] = {"profiled_us_per_tick": total / ticks * 1e6, "top_own_time": rows[:top]}
    return out


def _short(path: str) -> str:
    for marker in ("/ardiff_jax/", "/site-packages/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1] if marker != "/ardiff_jax/" else "ardiff_jax/" + path.split(marker, 1)[1]
    return path


def run(*, ticks: int = 10_000, rounds: int = 100, warmup: int = 200, component_calls: int = 2000,
        profile_ticks: int = 2000, geometry: str = "tiny", capacity: int = 3, quick: bool = False,
        out_dir: Path = RESULTS_DIR, write: bool = True) -> dict[str, Any]:
    """Measure, write ``host.json`` / ``host.png`` (unless ``write=False``) and return the record."""
    if quick:
        ticks, rounds, warmup, component_calls, profile_ticks = 200, 4, 20, 50, 50
    bench = HostBench(geometry, capacity)
    try:
        ticks_summary = time_ticks(bench, ticks=ticks, rounds=rounds, warmup=warmup)
        parts = components(bench, component_calls)
        prof = profile(bench, profile_ticks)
    finally:
        bench.close()
    ratios = {f"{name} median / target": s["median_us"] / TICK_TARGET_US for name, s in ticks_summary.items()}
    hot, churn = ticks_summary["get_kv/hot"]["median_us"], ticks_summary["get_kv/churn"]["median_us"]
    derived = {
        "LRU eviction + session creation (get_kv churn - hot median), us": churn - hot,
        "get_kv_caches in forward (get_kv/hot - no_kv/hot median), us":
            hot - ticks_summary["no_kv/hot"]["median_us"],
    }
    record = {
        "benchmark": "bench_host",
        "machine": machine_info(),
        "config": {"geometry": geometry, "session_capacity": capacity, "ticks": ticks, "rounds": rounds,
                   "warmup": warmup, "component_calls": component_calls, "profile_ticks": profile_ticks,
                   "quick": quick, "dtype": "float32", "churn_session_ids": capacity + 1},
        "ticks": ticks_summary,
        "derived": derived,
        "components_us": parts,
        "profile": prof,
        "ratios": ratios,
        "targets": {f"{name} median < {TICK_TARGET_US:.0f} us": s["median_us"] < TICK_TARGET_US
                    for name, s in ticks_summary.items()},
    }
    if write:
        path = write_json(out_dir / "host.json", record)
        _plot(record, out_dir / "host.png")
        _print_report(record, path)
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    print(f"\n== bench_host: {record['config']['ticks']} ticks per variant, tiny geometry, capacity "
          f"{record['config']['session_capacity']} ==")
    print(machine_line(record["machine"]))
    rows = [(name, s["median_us"], s["p90_us"], s["p99_us"], s["mean_us"], s["evictions_per_tick"])
            for name, s in record["ticks"].items()]
    print(format_table(("variant", "median us", "p90 us", "p99 us", "mean us", "evictions/tick"), rows))
    print(format_table(("derived", "us"), list(record["derived"].items())))
    print(format_table(("step (called directly)", "us/call"), list(record["components_us"].items())))
    for name, prof in record["profile"].items():
        print(f"  cProfile {name}: {prof['profiled_us_per_tick']:.1f} us/tick under the profiler; top own time:")
        for row in prof["top_own_time"][:6]:
            print(f"    {row['own_us_per_tick']:6.2f} us  x{row['calls_per_tick']:.0f}  {row['function']}")
    for target, ok in record["targets"].items():
        print(f"  target {target}: {'HOLDS' if ok else 'MISSED'}")
    print(f"  wrote {path}")


def _plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:  # matplotlib is the optional bench extra
        return
    names = list(record["ticks"])
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    for offset, key, label in ((-0.2, "median_us", "median"), (0.0, "p90_us", "p90"), (0.2, "p99_us", "p99")):
        ax.bar(x + offset, [record["ticks"][n][key] for n in names], width=0.2, label=label)
    ax.axhline(TICK_TARGET_US, color="red", linestyle="--", label=f"target (median < {TICK_TARGET_US:.0f} us)")
    ax.set_xticks(x, names)
    ax.set_ylabel("host time per tick (us)")
    ax.legend(fontsize=8)
    fig.suptitle(f"execute_model host overhead, trivial pipeline; {machine_line(record['machine'])}", fontsize=7)
    save_figure(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=10_000, help="timed ticks per variant (default 10000)")
    parser.add_argument("--rounds", type=int, default=100, help="interleaving rounds (default 100)")
    parser.add_argument("--capacity", type=int, default=3, help="session capacity (churn cycles capacity+1 ids)")
    parser.add_argument("--quick", action="store_true", help="few ticks (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    run(ticks=args.ticks, rounds=args.rounds, capacity=args.capacity, quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
