"""Run benchmarks against two trees of the package, interleaved, and print their key numbers side by side.

A process imports one ``ardiff_jax``, so each measurement is its own process: the package
comes from the tree under test (``--before`` / ``--after``), the benchmark code from *this*
checkout for both, so both trees are measured by the same script. A tree must provide
what the benchmarks import (the engine API; bench_kv also the KV core and the cache
manager); a run that fails stops the comparison with the tail of its error.

Fairness across processes: run ``i`` measures every benchmark on both trees back to back,
``before`` first on even runs and ``after`` first on odd runs (ABBA), so machine drift and
the order within a pair hit both trees alike. A tree's value of a metric is the median over
its runs; the table also shows the spread (min-max). Ratios inside one benchmark run (e.g.
commit / write floor) are the numbers to trust; a cross-process after/before of absolute
times needs a quiet machine and several runs.

Usage::

    python -m benchmarks.compare_revisions --before /tmp/base --after . --bench kv host --runs 4

Each run's output goes under ``--out`` (default: a new temporary directory), never to
``benchmarks/results/``: ``<out>/<run>-<tree>/<bench>/`` holds the benchmark's JSON, PNG and
its stdout/stderr; ``<out>/compare.json`` holds every run's metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, format_table, write_json

__all__ = ["BENCHES", "bench_command", "compare", "host_metrics", "kv_metrics", "main", "render", "tree_command"]

#: The checkout whose ``benchmarks`` package is measured against both trees.
CODE_ROOT = Path(__file__).resolve().parents[1]

TREES = ("before", "after")

# Imports ``ardiff_jax`` from the tree first (so its submodules resolve inside that tree),
# then puts this checkout first for ``benchmarks`` and runs the module as ``__main__``. Both
# trees contain both packages, so neither PYTHONPATH order alone would do; the working
# directory is dropped from sys.path so it cannot shadow either.
_BOOTSTRAP = """\
import runpy, sys
from pathlib import Path
tree, code_root, module, *args = sys.argv[1:]
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
sys.path.insert(0, tree)
import ardiff_jax
origin = Path(ardiff_jax.__file__).resolve().parent
if origin.parent != Path(tree).resolve():
    raise SystemExit(f"compare_revisions: ardiff_jax was imported from {origin}, not from the tree {tree}")
sys.path.insert(0, code_root)
for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
    del sys.modules[name]
print(f"compare_revisions: ardiff_jax from {origin}, benchmarks from {code_root}", file=sys.stderr, flush=True)
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def tree_command(tree: Path, module: str, args: Sequence[str]) -> list[str]:
    """argv for ``python -m module args`` with ``ardiff_jax`` from ``tree``, ``benchmarks`` from this checkout."""
    return [sys.executable, "-c", _BOOTSTRAP, str(Path(tree).resolve()), str(CODE_ROOT), module, *args]


# -- what each benchmark runs and which numbers it reports ------------------------------------------
def kv_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """bench_kv: every case's median (commit, read, attend) and every ratio of medians."""
    out: dict[str, float] = {}
    for section in ("commit", "read", "attend"):
        for name, stats in record.get(section, {}).items():
            out[f"{section}/{name} median ms"] = stats["median_ms"]
    for name, value in record.get("ratios", {}).items():
        out[f"ratio {name}"] = value
    return out


def host_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """bench_host: median tick per variant, and the engine commit against its write floor."""
    out = {f"tick {name} median us": s["median_us"] for name, s in record.get("ticks", {}).items()}
    commit = record.get("engine_commit")
    if commit:
        geometry = commit["geometry"]
        for name, stats in commit["stats"].items():
            out[f"engine commit ({geometry}) {name} median ms"] = stats["median_ms"]
        out[f"engine commit ({geometry}) commit cost ms"] = commit["commit_cost_ms"]
        out[f"ratio engine commit cost / write floor ({geometry})"] = commit["commit_cost/write_floor"]
    return out


@dataclasses.dataclass(frozen=True)
class Bench:
    """How to run one benchmark module and read its result.

    Attributes:
      module: the module run as ``__main__``.
      args: its command line, from the parsed options and the output directory.
      result: the JSON file name it writes there.
      metrics: the numbers compared, from that JSON.
    """

    module: str
    args: Callable[[argparse.Namespace, Path], list[str]]
    result: Callable[[argparse.Namespace], str]
    metrics: Callable[[Mapping[str, Any]], dict[str, float]]


def _kv_args(options: argparse.Namespace, out: Path) -> list[str]:
    args = ["--geometry", options.kv_geometry, "--out", str(out)]
    return args + (["--quick"] if options.quick else []) + (["--skip-attend"] if options.skip_attend else [])


def _host_args(options: argparse.Namespace, out: Path) -> list[str]:
    args = ["--out", str(out)] + (["--quick"] if options.quick else [])
    return args + (["--commit-geometry", options.commit_geometry] if options.commit_geometry else [])


BENCHES: dict[str, Bench] = {
    "kv": Bench("benchmarks.bench_kv", _kv_args, lambda o: f"kv_{o.kv_geometry}.json", kv_metrics),
    "host": Bench("benchmarks.bench_host", _host_args, lambda o: "host.json", host_metrics),
}


def bench_command(bench: str, tree: Path, options: argparse.Namespace, out: Path) -> list[str]:
    spec = BENCHES[bench]
    return tree_command(tree, spec.module, spec.args(options, out))


# -- running -----------------------------------------------------------------------------------------
def _git_describe(tree: Path) -> str | None:
    """Short HEAD of ``tree`` (``+dirty`` when its work tree differs); read-only git calls."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _run_one(bench: str, tree: Path, options: argparse.Namespace, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = bench_command(bench, tree, options, out)
    proc = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=options.timeout,
                          check=False)
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{BENCHES[bench].module} on {tree} exited with {proc.returncode} (output in {out}):\n"
                           f"{tail}")
    return json.loads((out / BENCHES[bench].result(options)).read_text())


def compare(runs: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]]) -> dict[str, list[dict[str, Any]]]:
    """Per benchmark, one row per metric: each tree's median over runs, min, max and after/before.

    ``runs[bench][tree]`` is the list of that tree's metric dicts, one per run. Metrics
    present in only one tree get ``None`` for the other.
    """
    table: dict[str, list[dict[str, Any]]] = {}
    for bench, per_tree in runs.items():
        names: list[str] = []
        for tree in TREES:
            for metrics in per_tree.get(tree, ()):
                names += [name for name in metrics if name not in names]
        rows = []
        for name in names:
            row: dict[str, Any] = {"metric": name}
            for tree in TREES:
                values = [m[name] for m in per_tree.get(tree, ()) if name in m]
                row[tree] = float(np.median(values)) if values else None
                row[f"{tree}_range"] = (min(values), max(values)) if values else None
                row[f"{tree}_runs"] = values
            before, after = row["before"], row["after"]
            row["after/before"] = after / before if before and after is not None else None
            rows.append(row)
        table[bench] = rows
    return table


def render(table: Mapping[str, list[dict[str, Any]]], trees: Mapping[str, str]) -> str:
    """Markdown tables of :func:`compare`'s rows (lower is better for every metric here)."""
    def cell(value: Any, spread: Any = None) -> str:
        if value is None:
            return "-"
        text = f"{value:.4g}"
        if spread is not None and spread[0] != spread[1]:
            text += f" [{spread[0]:.3g}-{spread[1]:.3g}]"
        return text

    out = []
    for bench, rows in table.items():
        body = [(row["metric"], cell(row["before"], row["before_range"]), cell(row["after"], row["after_range"]),
                 cell(row["after/before"])) for row in rows]
        header = ("metric", f"before ({trees['before']})", f"after ({trees['after']})", "after/before")
        out.append(f"### {bench}: median over runs [min-max]\n\n" + format_table(header, body))
    return "\n\n".join(out)


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_revisions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="tree holding the old ardiff_jax package")
    parser.add_argument("--after", type=Path, default=CODE_ROOT, help="tree holding the new package (default: here)")
    parser.add_argument("--bench", nargs="+", choices=sorted(BENCHES), default=["kv", "host"],
                        help="benchmarks to run (default: kv host)")
    parser.add_argument("--runs", type=int, default=2, help="runs per tree, ABBA-interleaved (default 2)")
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (smoke run)")
    parser.add_argument("--kv-geometry", default=None, help="bench_kv geometry (default: medium; tiny with --quick)")
    parser.add_argument("--commit-geometry", default=None, help="bench_host --commit-geometry (default: its own)")
    parser.add_argument("--skip-attend", action="store_true", help="pass --skip-attend to bench_kv")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark process (default 1800)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: a new temporary one)")
    options = parser.parse_args(argv)
    if options.runs < 1:
        parser.error(f"--runs must be at least 1, got {options.runs}")
    trees = {"before": options.before.resolve(), "after": options.after.resolve()}
    for name, tree in trees.items():
        if not (tree / "ardiff_jax" / "__init__.py").is_file():
            parser.error(f"--{name} {tree} holds no ardiff_jax package")
    if options.out is not None and _inside(options.out, RESULTS_DIR):
        parser.error(f"--out {options.out} is inside {RESULTS_DIR}; comparison runs must not overwrite the "
                     "published results")
    if options.kv_geometry is None:
        options.kv_geometry = "tiny" if options.quick else "medium"
    out = (options.out if options.out is not None else Path(tempfile.mkdtemp(prefix="compare_revisions_"))).resolve()
    revisions = {name: _git_describe(tree) or str(tree) for name, tree in trees.items()}
    print(f"compare_revisions: before {revisions['before']} ({trees['before']}) vs after {revisions['after']} "
          f"({trees['after']}); benchmark code from {CODE_ROOT}; output in {out}", flush=True)

    metrics: dict[str, dict[str, list[dict[str, float]]]] = {b: {t: [] for t in TREES} for b in options.bench}
    order = []
    for run in range(options.runs):
        for bench in options.bench:
            for tree in (TREES if run % 2 == 0 else TREES[::-1]):
                run_dir = out / f"run{run}-{tree}" / bench
                print(f"  run {run}: {bench} on {tree} ...", flush=True)
                record = _run_one(bench, trees[tree], options, run_dir)
                metrics[bench][tree].append(BENCHES[bench].metrics(record))
                order.append(f"run{run}/{bench}/{tree}")
    table = compare(metrics)
    summary = {"trees": {name: {"path": str(tree), "revision": revisions[name]} for name, tree in trees.items()},
               "benchmark_code": str(CODE_ROOT), "runs": options.runs, "quick": options.quick,
               "kv_geometry": options.kv_geometry, "order": order, "metrics": metrics, "table": table}
    path = write_json(out / "compare.json", summary)
    print()
    print(render(table, revisions))
    print(f"\n  wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
