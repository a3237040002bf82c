"""Markdown tables of the latest results in ``benchmarks/results/`` (used for README.md).

Run: ``python -m benchmarks.report [results_dir]`` (reads ``kv_*.json``, ``peers_*.json``,
``host.json``, ``e2e_*.json``, ``offload_*.json`` and ``serve_*.json``, whichever exist).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, machine_line

__all__ = ["e2e_table", "host_table", "kv_table", "main", "offload_table", "peers_table", "render", "serve_table"]


def _ms(stats: dict[str, Any]) -> str:
    return f"{stats['median_ms']:.3g} [{stats['p10_ms']:.3g}-{stats['p90_ms']:.3g}]"


def _targets(targets: dict[str, bool]) -> str:
    return "\n".join(f"- {k}: **{'holds' if ok else 'missed'}**" for k, ok in targets.items())


def kv_table(record: dict[str, Any]) -> str:
    rows = []
    for section in ("commit", "read", "attend"):
        for name, stats in record[section].items():
            rows.append((section, name, _ms(stats), f"{stats['page_faults']:.0f}"))
    table = format_table(("part", "case", "ms median [p10-p90]", "page faults/iter"), rows)
    ratios = format_table(("ratio of medians", "value"),
                          [(k, f"{v:.2f}") for k, v in record["ratios"].items()])
    return f"{table}\n\n{ratios}\n\n{_targets(record['targets'])}"


def peers_table(record: dict[str, Any]) -> str:
    windows = [str(w) for w in record["config"]["windows"]]
    results = record["results"]
    names = list(results[windows[0]])
    out = []
    for part, title in (("commit", "commit only"), ("block", "commit + read of the visible window")):
        rows = [[name] + [_ms(results[w][name][part]) for w in windows] for name in names]
        out.append(f"{title}, ms per block, median [p10-p90]:\n\n"
                   + format_table(["implementation"] + [f"W={w}" for w in windows], rows))
    verdict = record["verdict"]
    lines = []
    for key, value in verdict.items():
        if isinstance(value, dict):
            value = ", ".join(f"W={w}: {v:.2f}" if isinstance(v, float) else f"W={w}: {v or '-'}"
                              for w, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"- {key}: {value}")
    return "\n\n".join(out) + "\n\n" + "\n".join(lines)


def host_table(record: dict[str, Any]) -> str:
    rows = [(name, f"{s['median_us']:.1f}", f"{s['p90_us']:.1f}", f"{s['p99_us']:.1f}", f"{s['mean_us']:.1f}",
             f"{s['evictions_per_tick']:.2f}", s["n"]) for name, s in record["ticks"].items()]
    ticks = format_table(("variant", "median us", "p90 us", "p99 us", "mean us", "evictions/tick", "ticks"), rows)
    derived = format_table(("derived from the medians", "us"), [(k, f"{v:.1f}") for k, v in record["derived"].items()])
    parts = format_table(("runner step, called directly", "us/call"),
                         [(k, f"{v:.2f}") for k, v in record["components_us"].items()])
    commit = record.get("engine_commit")  # absent from records written before the part existed
    if commit:
        cases = format_table((f"engine commit, {commit['geometry']}", "ms median [p10-p90]", "page faults/iter"),
                             [(name, _ms(s), f"{s['page_faults']:.0f}") for name, s in commit["stats"].items()])
        summary = format_table(("engine commit, from the medians", "value"), [
            ("commit cost = commit tick - empty tick, ms", f"{commit['commit_cost_ms']:.3g}"),
            ("commit cost / write floor", f"{commit['commit_cost/write_floor']:.2f}"),
            ("timed commits that wrapped the ring", commit["checks"]["timed_commits_wrapping"]),
        ])
        parts += f"\n\n{cases}\n\n{summary}"
    return f"{ticks}\n\n{derived}\n\n{parts}\n\n{_targets(record['targets'])}"


def e2e_table(record: dict[str, Any]) -> str:
    res, gen = record["results"], record["generated_frames"]
    blocks = len(gen)
    picks = sorted({0, 1, 2, blocks // 4, blocks // 2, (3 * blocks) // 4, blocks - 1} & set(range(blocks)))
    rows = [(gen[i], f"{res['cached']['block_ms_median'][i]:.2f}", f"{res['cached']['frames_per_s'][i]:.0f}",
             f"{res['recompute']['block_ms_median'][i]:.2f}", f"{res['recompute']['frames_per_s'][i]:.0f}",
             f"{res['cached']['frames_per_s'][i] / res['recompute']['frames_per_s'][i]:.2f}") for i in picks]
    table = format_table(("generated frames", "cached ms/block", "cached frames/s", "recompute ms/block",
                          "recompute frames/s", "cached/recompute"), rows)

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    summary = format_table(("summary", "value"), [(k, fmt(v)) for k, v in record["summary"].items()])
    compile_ = format_table(("load / compile, excluded from the blocks", "s"),
                            [(k, f"{v:.2f}") for k, v in record["compile"].items()])
    return f"{table}\n\n{summary}\n\n{compile_}"


def offload_table(record: dict[str, Any]) -> str:
    rows = []
    for section in ("offload", "restore", "floor", "ticks"):
        for name, stats in record[section].items():
            rate = record["gb_per_s"].get(name)
            rows.append((section, name, _ms(stats), "" if rate is None else f"{rate:.2f}",
                         f"{stats['page_faults']:.0f}"))
    config = record["config"]
    title = (f"{config['geometry']} session pages, {config['session_bytes'] / 2**20:.2f} MiB "
             f"({config['dtype']} stored as {config['storage_dtype']}); world ticks: "
             f"{record['world_ticks']['pipeline']}")
    table = format_table(("part", "case", "ms median [p10-p90]", "GB/s", "page faults/iter"), rows)
    ratios = format_table(("ratio of medians", "value"), [(k, f"{v:.2f}") for k, v in record["ratios"].items()])
    derived = format_table(("derived from the medians", "value"),
                           [(k, f"{v:.3g}") for k, v in record["derived"].items()])
    ticks = []
    for part in ("engine_ticks", "world_ticks"):
        for key, value in record[part].items():
            if key != "kv_spec":
                ticks.append((f"{part}: {key}", value))
    ticks_table = format_table(("tick benches", "value"), ticks)
    checks = "\n".join(f"- check {k}: **{'ok' if ok else 'failed'}**" for k, ok in record["checks"].items())
    return f"{title}\n\n{table}\n\n{ratios}\n\n{derived}\n\n{ticks_table}\n\n{checks}\n{_targets(record['targets'])}"


def serve_table(record: dict[str, Any]) -> str:
    """bench_serve: streams vs the engine alone, the soak, paced play (when recorded), checks and targets."""
    from benchmarks.bench_serve import summary_table

    return summary_table(record)


def render(results: Path = RESULTS_DIR) -> str:
    """Every result file's tables, as markdown."""
    out = []
    paths = (sorted(results.glob("kv_*.json")) + sorted(results.glob("peers_*.json"))
             + sorted(results.glob("host.json")) + sorted(results.glob("e2e_*.json"))
             + sorted(results.glob("offload_*.json")) + sorted(results.glob("serve_*.json")))
    tables = {"bench_kv": kv_table, "bench_peers": peers_table, "bench_host": host_table, "bench_e2e": e2e_table,
              "bench_offload": offload_table, "bench_serve": serve_table}
    for path in paths:
        record = json.loads(path.read_text())
        config = record["config"]
        label = config.get("geometry") or config.get("preset") or ""
        out.append(f"### {path.name} ({label})\n\nMachine: {machine_line(record['machine'])}\n\n"
                   f"{tables[record['benchmark']](record)}\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(render(Path(argv[0]) if argv else RESULTS_DIR))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
