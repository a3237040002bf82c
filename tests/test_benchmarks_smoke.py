"""The benchmark suite runs: each benchmark's quick path produces well-formed results.

Structure only (keys present, numbers finite and positive, the benchmarks' own correctness
checks pass). Never timings: on a shared 2-core machine a timing assertion is a coin flip,
and ``benchmarks/README.md`` is where speed is judged.
"""

from __future__ import annotations

import inspect
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

pytest.importorskip("benchmarks.common")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _stats_ok(stats: dict) -> None:
    for key in ("median_ms", "p10_ms", "p90_ms", "mean_ms"):
        assert _positive(stats[key]), (key, stats)
    assert stats["n"] > 0


def test_benchmark_read_is_paged_attentions_read():
    """bench_kv.history_read copies paged_attention's read; fail if the core reads differently."""
    from ardiff_jax.kv import _attention

    source = inspect.getsource(_attention.paged_attention)
    assert "page_visible = run_visibility(layout, committed, visible_start, num_frames, jnp)" in source
    assert "read_run(layout, pools, layer, run_base, page_visible)" in source


def test_bench_kv_quick(tmp_path):
    from benchmarks import bench_kv

    record = bench_kv.run_geometry("tiny", quick=True, skip_attend=True, out_dir=tmp_path)
    assert set(record["commit"]) == {"runtime", "runtime_host", "commit_block", "floor"}
    assert {"read_path", "read_floor", "gather", "all_layers/read_path", "all_layers/read_floor"} == set(record["read"])
    for section in ("commit", "read"):
        for stats in record[section].values():
            _stats_ok(stats.as_dict() if hasattr(stats, "as_dict") else stats)
    assert all(_positive(v) for v in record["ratios"].values())
    assert set(record["targets"]) and all(isinstance(v, bool) for v in record["targets"].values())
    assert record["hlo"]["read"]["read_path_matches_gather"] is True
    assert (tmp_path / "kv_tiny.json").is_file()


def test_bench_peers_quick(tmp_path):
    from benchmarks import bench_peers

    record = bench_peers.run_geometry("tiny", windows=(6,), peers=["ardiff_jax", "naive_jax", "nodonate_jax"],
                                      quick=True, out_dir=tmp_path)
    assert record["agreement"][6]["ok"], record["agreement"][6]["mismatches"]
    results = record["results"][6]
    assert set(results) == {"ardiff_jax", "naive_jax", "nodonate_jax", "floor"}
    for parts in results.values():
        for part in ("commit", "block"):
            _stats_ok(parts[part].as_dict())
    assert "ardiff_jax block below every peer" in record["verdict"]


def test_bench_host_quick(tmp_path):
    from benchmarks import bench_host

    record = bench_host.run(quick=True, out_dir=tmp_path)
    assert set(record["ticks"]) == set(bench_host.VARIANTS)
    for name, summary in record["ticks"].items():
        for key in ("median_us", "p90_us", "p99_us", "mean_us"):
            assert _positive(summary[key]), (name, key)
        # The variants do what they claim: churn evicts on every tick, hot never does.
        assert summary["evictions_per_tick"] == (1.0 if name.endswith("churn") else 0.0), name
    assert all(_positive(v) for v in record["components_us"].values() if v != 0.0)
    assert all(prof["top_own_time"] for prof in record["profile"].values())
    assert (tmp_path / "host.json").is_file()


def test_bench_e2e_quick(tmp_path):
    from benchmarks import bench_e2e

    record = bench_e2e.run(quick=True, out_dir=tmp_path)
    blocks = record["config"]["blocks"]
    assert len(record["generated_frames"]) == blocks
    for name in ("cached", "recompute"):
        result = record["results"][name]
        assert len(result["frames_per_s"]) == blocks
        assert all(_positive(x) for x in result["frames_per_s"] + result["block_ms_median"])
    assert math.isfinite(record["summary"]["max |cached - recompute| latents"])
    assert all(math.isfinite(v) and v >= 0 for v in record["compile"].values())
    assert (tmp_path / "e2e_tiny.json").is_file()


def test_report_renders_every_result(tmp_path):
    from benchmarks import bench_host, report

    bench_host.run(quick=True, out_dir=tmp_path)
    text = report.render(tmp_path)
    assert "### host.json" in text and "median us" in text
