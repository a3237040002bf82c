"""Shared helpers of the benchmark suite: geometry, timing, machine description, JSON.

Timing rules (they matter on a noisy 2-core VM):

* Every sample is one iteration timed with ``time.perf_counter`` and ends with a device
  sync (``jax.block_until_ready`` on the iteration's outputs), so asynchronous dispatch
  cannot hide work.
* Cases that are compared with each other run *interleaved*: round ``r`` runs a few
  repetitions of every case in turn. CPU frequency, a noisy neighbour or page-cache state
  then drifts across all cases alike, so the ratios of one run stay meaningful even when
  absolute numbers move by 2x between runs (they do on this machine).
* We report median, p10 and p90 (and the mean for completeness); ratios use medians.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "RESULTS_DIR",
    "Case",
    "Stats",
    "bench_spec",
    "machine_info",
    "format_table",
    "ratio",
    "run_interleaved",
    "sync",
    "write_json",
]

#: Where every benchmark writes its JSON and PNG files.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- geometry --------------------------------------------------------------------------------------
def bench_spec(geometry: str, *, window_frames: int | None = None, sink_frames: int | None = None,
               frames_per_block: int | None = None, session_capacity: int = 1) -> Any:
    """A one-branch copy of a shipped example geometry, for cache benchmarks.

    One branch ("main") because the cache cost per branch is what we compare (CFG just
    doubles it); no cross-attention caches and no scratch tokens because they are not part
    of the per-block self-attention KV work. ``max_model_len`` is set far out: sessions are
    unbounded by default now, but trees before that change capped them at ``2**20`` tokens,
    and ``compare_revisions`` runs this code against such trees too.
    """
    from ardiff_jax.capability import ARDiffusionKVBranchSpec
    from ardiff_jax.geometries import example_spec

    base = example_spec(geometry)
    changes: dict[str, Any] = dict(
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        cross_attention=(),
        max_scratch_tokens_per_branch=0,
        model_owned_state_bytes_per_session=0,
        session_capacity=session_capacity,
        reset_at_boundary=False,
        max_model_len=2**30,
    )
    if window_frames is not None:
        changes["window_frames"] = window_frames
    if sink_frames is not None:
        changes["sink_frames"] = sink_frames
    if frames_per_block is not None:
        changes["frames_per_block"] = frames_per_block
    return dataclasses.replace(base, **changes)


# -- timing ------------------------------------------------------------------------------------------
def sync(out: Any) -> None:
    """Wait for every JAX array in ``out`` (other leaves, e.g. torch CPU tensors, are synchronous)."""
    import jax

    leaves = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
    if leaves:
        jax.block_until_ready(leaves)


@dataclasses.dataclass
class Case:
    """One timed operation.

    Attributes:
      name: label in tables and JSON.
      run: one iteration; its return value is synced before the clock stops.
      setup: optional untimed work before each iteration (e.g. wait for the previous
        iteration's buffers when ``run`` measures host dispatch only).
      sync_output: set False to time only the host side of ``run`` (dispatch cost).
      group: runtime the case runs on ("jax", "torch"); see :func:`run_interleaved`.
    """

    name: str
    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    sync_output: bool = True
    group: str = "jax"

    def once(self) -> tuple[float, int]:
        """Seconds of one iteration and the minor page faults it caused.

        Page faults are recorded because large XLA:CPU temporaries (> 32 MiB, glibc's
        largest mmap threshold) are mmap'd fresh on every execution: the kernel then zeroes
        every page again, which can dominate a memory-bound kernel.
        """
        if self.setup is not None:
            sync(self.setup())
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        out = self.run()
        if self.sync_output:
            sync(out)
        elapsed = time.perf_counter() - start
        return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of one case's samples, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float
    n: int
    page_faults: float = 0.0  # median minor page faults per iteration

    @classmethod
    def of(cls, samples_s: Sequence[float], faults: Sequence[int] = ()) -> Stats:
        ms = np.asarray(samples_s, dtype=np.float64) * 1e3
        p10, p50, p90 = np.percentile(ms, [10, 50, 90])
        median_faults = float(np.median(faults)) if len(faults) else 0.0
        return cls(float(p50), float(p10), float(p90), float(ms.mean()), int(ms.size), median_faults)

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def run_interleaved(cases: Sequence[Case], *, warmup: int, rounds: int, reps_per_round: int,
                    settle_s: float = 0.05) -> dict[str, Stats]:
    """Warm every case up, then time them interleaved: ``rounds`` x (each case ``reps_per_round`` times).

    When consecutive cases run on different runtimes (``Case.group``), we pause
    ``settle_s`` first: on 2 cores, XLA's and OpenMP's worker threads keep spinning for a
    while after their last task and would steal the other runtime's cores (measured: a
    Self-Forcing roll went from 17 ms alone to 40-360 ms right after JAX work).
    """
    previous = [cases[0].group if cases else ""]

    def settle(case: Case) -> None:
        if case.group != previous[0]:
            time.sleep(settle_s)
            previous[0] = case.group

    for case in cases:
        settle(case)
        for _ in range(warmup):
            case.once()
    samples: dict[str, list[float]] = {case.name: [] for case in cases}
    faults: dict[str, list[int]] = {case.name: [] for case in cases}
    for _ in range(rounds):
        for case in cases:
            settle(case)
            for _ in range(reps_per_round):
                elapsed, minflt = case.once()
                samples[case.name].append(elapsed)
                faults[case.name].append(minflt)
    return {name: Stats.of(samples[name], faults[name]) for name in samples}


def ratio(a: Stats, b: Stats) -> float:
    """Median ratio ``a / b``."""
    return a.median_ms / b.median_ms


# -- machine description -----------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_head() -> str | None:
    # Read-only: records which commit produced the numbers.
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    import jax

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        affinity = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "mem_total_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "git_head": _git_head(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(info: Mapping[str, Any]) -> str:
    """One-line description for tables and plot titles."""
    torch = f", torch {info['torch']}" if info.get("torch") else ""
    return (f"{info['cpu_model']} x{info['cpu_count']}, jax {info['jax']}/jaxlib {info['jaxlib']} "
            f"({info['jax_backend']}){torch}, {info['date_utc'][:10]}")


# -- output ------------------------------------------------------------------------------------------
def _jsonable(x: Any) -> Any:
    if isinstance(x, Stats):
        return x.as_dict()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")
    return path


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable in a terminal)."""
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None when matplotlib is
    missing (it is the optional ``bench`` extra: results are still written as JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path, plt: Any) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
