"""The benchmark suite runs: each benchmark's quick path produces well-formed results.

Structure only (keys present, numbers finite and positive, the benchmarks' own correctness
checks pass). Never timings: on a shared 2-core machine a timing assertion is a coin flip,
and ``benchmarks/README.md`` is where speed is judged.
"""

from __future__ import annotations

import inspect
import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

pytest.importorskip("benchmarks.common")

from benchmarks.common import write_json  # noqa: E402 - after the sys.path fix above


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
    assert "read_visible_history(layout, pools, cursor, layer, num_frames)" in source


def test_bench_kv_quick(tmp_path):
    from benchmarks import bench_kv

    record = bench_kv.run_geometry("tiny", quick=True, skip_attend=False, out_dir=tmp_path)
    assert set(record["commit"]) == {"runtime", "runtime_host", "commit_block", "floor"}
    assert {"read_path", "read_floor", "gather", "all_layers/read_path", "all_layers/read_floor"} == set(record["read"])
    for section in ("commit", "read"):
        for stats in record[section].values():
            _stats_ok(stats.as_dict() if hasattr(stats, "as_dict") else stats)
    assert all(_positive(v) for v in record["ratios"].values())
    assert set(record["targets"]) and all(isinstance(v, bool) for v in record["targets"].values())
    assert record["hlo"]["read"]["read_path_matches_gather"] is True
    assert (tmp_path / "kv_tiny.json").is_file()


@pytest.mark.parametrize("sink, window, frames", [(0, 3, 1), (1, 5, 2), (3, 9, 3), (2, 7, 3)])
def test_bench_kv_ring_pages_are_the_cores_pages(sink, window, frames):
    """bench_kv writes its own slot rule out (it also runs against older trees): it names the core's pages."""
    import numpy as np

    from ardiff_jax.kv import KVLayout, contiguous_table_cursor, cursor_block_pages
    from benchmarks.bench_kv import ring_pages

    layout = KVLayout(num_layers=1, num_pages=2 * (sink + window), tokens_per_frame=1, num_kv_heads=1, head_size=1,
                      sink_frames=sink, window_frames=window, frames_per_block=frames, scratch_pages=1)
    base = layout.run_base(1)
    for committed in range(4 * layout.run_pages):
        want = cursor_block_pages(layout, contiguous_table_cursor(layout, base, committed, 0), frames, np)
        got = ring_pages(layout, base, committed, frames)
        assert got.dtype == np.int32 and got.tolist() == want.tolist(), committed


def test_bench_cursor_quick(tmp_path):
    from benchmarks import bench_cursor

    record = bench_cursor.run_geometry("tiny", quick=True, out_dir=tmp_path)
    assert set(record["step"]) == set(bench_cursor.CURSORS)
    for stats in record["step"].values():
        _stats_ok(stats.as_dict())
    assert set(record["ratios"]) == {"table/contiguous", "scattered/contiguous"}
    assert set(record["ratios_p10"]) == set(record["ratios"])
    assert all(_positive(v) for v in [*record["ratios"].values(), *record["ratios_p10"].values()])
    assert set(record["copy"]) == {"copy: slot", "copy: table", "restore: slot", "restore: table"}
    for stats in record["copy"].values():
        _stats_ok(stats.as_dict())
    assert all(_positive(v) for v in [*record["copy_ratios"].values(), *record["copy_ratios_p10"].values()])
    assert record["checks"] == {"same_read": True, "same_copy": True}
    assert (tmp_path / "cursor_tiny.json").is_file()


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

    commit = record["engine_commit"]
    assert commit["geometry"] == record["config"]["commit_geometry"] == "tiny"  # --quick's geometry
    assert tuple(commit["stats"]) == bench_host.COMMIT_CASES
    for stats in commit["stats"].values():
        _stats_ok(stats.as_dict())
    assert _positive(commit["write_floor_ms"]) and _positive(commit["config"]["block_bytes"])
    assert math.isfinite(commit["commit_cost_ms"]) and math.isfinite(commit["commit_cost/write_floor"])
    checks = commit["checks"]
    # No timed commit wrapped the ring; at tiny (window 5, 2-frame blocks) some blocks would
    # have, so the skip rule ran; every commit is accounted for; the runtime's cursor agrees.
    assert checks["timed_commits_wrapping"] == 0
    assert checks["untimed_commits_skipping_a_wrap"] > 0
    assert checks["commits_counted"] == (commit["config"]["fill_blocks"] + checks["commits_timed_or_warmup"]
                                         + checks["untimed_commits_skipping_a_wrap"])
    assert checks["runtime_cursor_matches"] is True
    assert not any(key.startswith("engine commit") for key in record["targets"])  # the target is medium's
    assert "engine commit cost / write floor (tiny)" in record["ratios"]
    saved = json.loads((tmp_path / "host.json").read_text())["engine_commit"]
    assert set(saved["stats"]) == set(bench_host.COMMIT_CASES) and "median_ms" in saved["stats"]["write_floor"]


@pytest.mark.parametrize("sink, window, frames", [(1, 5, 2), (3, 9, 3), (2, 7, 3), (1, 4, 4), (3, 18, 3)])
def test_block_wraps_ring_is_the_runtimes_page_rule(sink, window, frames):
    """bench_host skips exactly the blocks whose runtime pages (kv.cursor_block_pages) are not adjacent."""
    import numpy as np

    from ardiff_jax.kv import contiguous_table_cursor, cursor_block_pages
    from ardiff_jax.runtime import ARDiffusionKVCache
    from benchmarks.bench_host import block_wraps_ring
    from benchmarks.common import bench_spec

    spec = bench_spec("tiny", sink_frames=sink, window_frames=window, frames_per_block=frames)
    cache = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=2**30, gpu_memory_fraction=1.0)
    try:
        layout = cache.layout
        outcomes = set()
        for committed in range(0, 4 * (sink + window)):
            pages = cursor_block_pages(layout, contiguous_table_cursor(layout, 0, committed, 0), frames, np)
            wraps = bool(np.any(np.diff(pages) != 1))
            assert block_wraps_ring(spec, committed) == wraps, (committed, pages)
            outcomes.add(wraps)
        assert outcomes == {True, False}  # both kinds of block occur at some offset
    finally:
        cache.close()


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


def test_bench_batch_quick(tmp_path):
    from benchmarks import bench_batch

    record = bench_batch.run(quick=True, out_dir=tmp_path)
    for workload in ("sprite", "medium"):
        for size, entry in record["results"][workload].items():
            assert entry["compiles_during_timed_ticks"] == 0, (workload, size)
            for kind in ("batched", "sequential"):
                _stats_ok(entry[kind]["tick_ms"])
                assert _positive(entry[kind]["frames_per_s"]) and _positive(entry[kind]["session_latency_ms_median"])
    assert all(_positive(v) for v in record["summary"].values())
    assert (tmp_path / "batch.json").is_file()


def test_report_renders_every_result(tmp_path):
    from benchmarks import bench_host, report

    # The commit part at the geometry the target is stated for (a few ms per tick).
    record = bench_host.run(quick=True, commit_geometry="medium", out_dir=tmp_path)
    assert record["engine_commit"]["checks"]["timed_commits_wrapping"] == 0
    text = report.render(tmp_path)
    assert "### host.json" in text and "median us" in text
    assert "engine commit, medium" in text and "commit cost / write floor" in text
    assert "engine commit (commit - empty tick) <= 1.2x write floor (medium): **" in text


def test_report_renders_a_host_record_without_the_engine_commit_part(tmp_path):
    """Records written before the engine-commit part existed still render."""
    from benchmarks import bench_host, report

    record = bench_host.run(quick=True, write=False)
    del record["engine_commit"]
    write_json(tmp_path / "host.json", record)
    text = report.render(tmp_path)
    assert "### host.json" in text and "engine commit," not in text


# -- compare_revisions ---------------------------------------------------------------------------------
def test_compare_revisions_takes_the_package_from_the_tree_and_the_benchmarks_from_here(tmp_path):
    """A fake tree's ardiff_jax is the one imported, even though this checkout has one too."""
    import subprocess

    from benchmarks.compare_revisions import tree_command

    tree = tmp_path / "tree"
    (tree / "ardiff_jax").mkdir(parents=True)
    (tree / "ardiff_jax" / "__init__.py").write_text("FAKE = True\n")
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "__init__.py").write_text("raise ImportError('the tree benchmarks were imported')\n")
    empty = tmp_path / "results"
    empty.mkdir()
    proc = subprocess.run(tree_command(tree, "benchmarks.report", [str(empty)]), cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"ardiff_jax from {(tree / 'ardiff_jax').resolve()}, benchmarks from {ROOT}" in proc.stderr


def test_compare_revisions_table():
    from benchmarks.compare_revisions import compare, render

    runs = {"host": {"before": [{"tick": 10.0, "old only": 1.0}, {"tick": 14.0, "old only": 1.0}],
                     "after": [{"tick": 20.0}, {"tick": 30.0}]}}
    rows = {row["metric"]: row for row in compare(runs)["host"]}
    assert rows["tick"]["before"] == 12.0 and rows["tick"]["after"] == 25.0
    assert rows["tick"]["after/before"] == pytest.approx(25.0 / 12.0)
    assert rows["tick"]["after_range"] == (20.0, 30.0)
    assert rows["old only"]["after"] is None and rows["old only"]["after/before"] is None
    text = render(compare(runs), {"before": "abc", "after": "def"})
    assert "before (abc)" in text and "| tick | 12 [10-14] | 25 [20-30] | 2.083 |" in text


def test_compare_revisions_refuses_to_write_into_the_results(tmp_path):
    from benchmarks.common import RESULTS_DIR
    from benchmarks.compare_revisions import main

    with pytest.raises(SystemExit):
        main(["--before", str(ROOT), "--bench", "host", "--out", str(RESULTS_DIR / "compare")])
    assert not (RESULTS_DIR / "compare").exists()


def test_compare_revisions_quick(tmp_path, capsys):
    from benchmarks.compare_revisions import main

    assert main(["--before", str(ROOT), "--after", str(ROOT), "--bench", "host", "--quick", "--runs", "1",
                 "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert summary["order"] == ["run0/host/before", "run0/host/after"]
    for tree in ("before", "after"):
        (metrics,) = summary["metrics"]["host"][tree]
        assert "ratio engine commit cost / write floor (tiny)" in metrics
        assert all(math.isfinite(v) for v in metrics.values())
        assert (tmp_path / f"run0-{tree}" / "host" / "host.json").is_file()
    assert "engine commit (tiny) write_floor median ms" in capsys.readouterr().out


def test_bench_offload_quick(tmp_path):
    from benchmarks import bench_offload, report

    record = bench_offload.run(quick=True, out_dir=tmp_path)
    assert record["config"]["geometry"] == "tiny"  # --quick's geometry
    for section, names in (("offload", bench_offload.OFFLOAD_CASES), ("restore", bench_offload.RESTORE_CASES),
                           ("floor", bench_offload.FLOOR_CASES), ("ticks", bench_offload.TICK_CASES)):
        assert tuple(record[section]) == names
        for stats in record[section].values():
            _stats_ok(stats.as_dict())
    assert all(_positive(v) for v in record["gb_per_s"].values())
    assert all(_positive(v) for v in record["ratios"].values())
    # Every copy moved the bits it was given, and the offloaded pages sit in pinned_host memory.
    assert record["checks"] and [name for name, held in record["checks"].items() if not held] == []
    for part in ("engine_ticks", "world_ticks"):
        ticks = record[part]
        # The swap variant restores and offloads exactly once per tick, the resident one never.
        assert ticks["swap: restored per tick"] == ticks["swap: offloaded per tick"] == 1.0, ticks
        assert ticks["resident: restored per tick"] == ticks["resident: offloaded per tick"] == 0.0, ticks
        assert ticks["swap: released per tick"] == ticks["resident: released per tick"] == 0.0, ticks
        assert _positive(ticks["bytes per restore (offloaded record nbytes)"])
    # The engine's swap moves exactly the pages the copy cases copy.
    assert record["engine_ticks"]["page bytes per restore"] == record["config"]["session_bytes"]
    assert record["targets"] == {}  # the target is stated at medium only
    saved = json.loads((tmp_path / "offload_tiny.json").read_text())
    assert set(saved["ticks"]) == set(bench_offload.TICK_CASES) and "median_ms" in saved["offload"]["offload"]
    assert "### offload_tiny.json (tiny)" in report.render(tmp_path)


def test_bench_serve_quick(tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("websockets")
    pytest.importorskip("av")
    from benchmarks import bench_serve

    record = bench_serve.run(quick=True, soak_seconds=1.0, out_dir=tmp_path)
    clients = record["config"]["clients"]
    assert [(r["format"], r["clients"]) for r in record["streams"]] == [
        (fmt, n) for n in clients for fmt in bench_serve.FORMATS]
    for stream in record["streams"]:
        assert len(stream["time_to_first_chunk_ms"]) == len(stream["session_frames_per_s"]) == stream["clients"]
        assert all(_positive(x) for x in stream["time_to_first_chunk_ms"] + stream["session_frames_per_s"])
        assert _positive(stream["aggregate_frames_per_s"]) and 0 < stream["fairness_min_over_max"] <= 1
        # Every chunk every client read (chunks generated before its stop arrive after it) was
        # matched to the engine call that produced it.
        assert stream["chunks_received"] >= stream["clients"] * stream["chunks_per_client"]
        assert stream["server_overhead_ms"]["n"] == stream["chunks_received"]
        for part in ("inter_arrival_ms", "server_overhead_ms", "encode_ms", "engine_ms"):
            assert all(math.isfinite(stream[part][q]) for q in ("p50", "p99")), (part, stream[part])
    assert [b["clients"] for b in record["baseline"]] == clients
    assert all(_positive(b["frames_per_s"]) for b in record["baseline"])
    assert len(record["ratios"]) == len(record["streams"]) and all(_positive(v) for v in record["ratios"].values())
    # No lost, repeated or reordered chunk; every interaction queued; no session left anywhere.
    assert record["checks"] and all(record["checks"].values()), record["checks"]
    assert "jpeg N=1: transport_chunk_index consecutive from 0" in record["checks"]
    assert "soak: no session left (engine.sessions, /healthz)" in record["checks"]
    soak = record["soak"]
    assert soak["sessions"] > 0 and soak["chunks"] > 0 and len(soak["rss_mib_samples"]) > 1
    assert set(record["targets"]) and all(isinstance(v, bool) for v in record["targets"].values())
    saved = json.loads((tmp_path / "serve_sprite_world.json").read_text())
    assert saved["benchmark"] == "bench_serve" and set(saved["checks"]) == set(record["checks"])


def test_bench_wan_smoke(tmp_path):
    from ardiff_jax.models.wan import UMT5Config, cache_nbytes
    from benchmarks import bench_wan

    record = bench_wan.run(smoke=True, blocks=2, out_dir=tmp_path)
    config = record["config"]
    assert config["preset"] == "wan-smoke" and config["weights"] == "random" and config["policy"] == "self-forcing"
    assert config["frames_per_block"] == 3 and config["sink_frames"] == 0 and config["dtype"] == "bfloat16"
    assert config["timesteps"] == pytest.approx([1000.0, 937.5, 833.333, 625.0], abs=1e-3)
    assert config["vae"] is True and config["text_encoder"] == "smoke"
    block = record["block"]
    # One engine block = 4 denoise forwards + 1 commit forward of the same world_step + 1 VAE decode.
    assert block["forwards_recorded"] == 5 and block["denoise_steps"] == 4 and block["rounds"] == 2
    assert block["vae_decodes_recorded"] == 1 and block["vae_latents_per_decode"] == 3
    assert block["vae_cache_started"] is True  # a steady-state block, not the session's first
    assert set(block["stats"]) == {"engine_block", "denoise", "commit", "vae_decode", "text_encode"}
    for name in block["stats"]:
        _stats_ok(block["stats"][name].as_dict())
    for key in ("engine_block_ms", "denoise_ms", "commit_ms", "vae_decode_ms", "transformer_ms", "model_ms"):
        assert _positive(block[key]), key
    assert block["transformer_ms"] == pytest.approx(block["denoise_ms"] + block["commit_ms"])
    assert block["model_ms"] == pytest.approx(block["transformer_ms"] + block["vae_decode_ms"])
    assert block["overhead_ms"] == pytest.approx(block["engine_block_ms"] - block["model_ms"])
    assert block["overhead_fraction_of_model"] == pytest.approx(block["overhead_ms"] / block["model_ms"])
    assert isinstance(block["overhead_target_met"], bool)
    assert block["xla_compiles_during_split"] == 0  # the recorded arguments hit the compiled programs
    self_time = block["runtime_self_time"]
    assert len(self_time["blocks"]) == 2
    assert all(b["forwards"] == 5 and b["vae_decodes"] == 1 for b in self_time["blocks"])
    assert all(_positive(b["forwards_ms"]) and _positive(b["vae_decode_ms"])
               and b["block_ms"] >= b["forwards_ms"] + b["vae_decode_ms"] for b in self_time["blocks"])
    tp = block["throughput"]
    assert tp["video_frames_per_s"] == pytest.approx(4 * tp["latent_frames_per_s"])
    assert tp["latent_frames_per_s"] == pytest.approx(3 / (block["engine_block_ms"] / 1e3))
    # The video: 1 + 4 x 2 = 9 frames for the session's first block, 4 x 3 = 12 after, 8x the latent.
    assert block["video_frames_per_block"] == 12 and block["video_shape"] == [12, 32, 48, 3]
    assert record["first_video_shape"] == [9, 32, 48, 3]
    assert record["latents_finite"] is True and record["latents_shape"] == [3, 4, 4, 6]
    # End to end: 12 frames per engine block (transformer + VAE + runtime), the text encode apart.
    e2e = record["e2e"]
    assert e2e["video_frames_per_s"] == pytest.approx(12 / (block["engine_block_ms"] / 1e3))
    assert e2e["model_only_video_frames_per_s"] == pytest.approx(12 / (block["model_ms"] / 1e3))
    assert e2e["transformer_only_video_frames_per_s"] == pytest.approx(12 / (block["transformer_ms"] / 1e3))
    assert e2e["goal"]["video_frames_per_s"] == 17.0 and e2e["goal_applies"] is False
    assert e2e["goal_met"] is (e2e["video_frames_per_s"] >= 17.0)
    assert e2e["reference_fps"]["LongLive-1.3B"]["video_frames_per_s"] == 20.7
    self_forcing = e2e["reference_fps"]["Self-Forcing (chunk-wise, Wan2.1-1.3B)"]
    assert self_forcing["video_frames_per_s"] == 17.0 and self_forcing["measured_by_users_video_frames_per_s"] == 13.1
    text = record["text_encode"]
    assert e2e["text_encode_ms_per_prompt"] == text["median_ms"] and _positive(text["median_ms"])
    assert [a["blocks_per_prompt"] for a in e2e["amortised_with_text_encode"]] == [1, 7, 28]
    for entry in e2e["amortised_with_text_encode"]:
        n = entry["blocks_per_prompt"]
        assert entry["video_frames_per_s"] == pytest.approx(
            12 * n / ((n * block["engine_block_ms"] + text["median_ms"]) / 1e3))
        assert entry["video_frames_per_s"] < e2e["video_frames_per_s"]
    # The text encode: one prompt at Wan's full 512 tokens through the (tiny) umT5, features to the host.
    assert text["kind"] == "smoke" and text["text_len"] == 512 and text["features_finite"] is True
    assert text["features_shape"][1] == 16 and text["stats"].n == 2
    assert _positive(text["flops_per_prompt"]) and text["xxl_estimate_ms"] is None
    assert text["xxl_flops_per_prompt"] == pytest.approx(4.85e12, rel=0.01)
    assert bench_wan.umt5_flops(UMT5Config()) == text["xxl_flops_per_prompt"]
    # The VAE cache: per session at this latent (what capacity planning counts) and at 832x480.
    vae = record["vae"]
    assert vae["cache_bytes_per_session"] == record["pipeline_vae_cache_bytes"] > 0
    assert vae["cache_bytes_per_session"] == cache_nbytes(bench_wan.vae_config(smoke=True), (4, 6))
    assert vae["cache_bytes_per_session_832x480"] == cache_nbytes(bench_wan.vae_config(smoke=True), (60, 104))
    assert _positive(vae["decode_flops_per_block"])
    assert vae["decode_flops_per_block_832x480"] > vae["decode_flops_per_block"]
    # The full-size VAE's cache per session at 832x480 in bf16: 1801 MiB (shapes only).
    assert cache_nbytes(bench_wan.vae_config(), bench_wan.FULL_LATENT) / 2**20 == pytest.approx(1801.08, abs=0.01)
    saved = json.loads((tmp_path / "bench_wan_smoke.json").read_text())
    assert saved["benchmark"] == "bench_wan" and "median_ms" in saved["block"]["stats"]["denoise"]
    assert "median_ms" in saved["block"]["stats"]["vae_decode"] and saved["e2e"]["goal"]["hardware"] == "1x H200"
    # The engine's world_step and decode program are the originals again once the recording is over.
    from ardiff_jax.models import _world
    from ardiff_jax.models.wan import _pipeline

    assert not isinstance(_world.world_step, (bench_wan.ForwardRecorder, bench_wan.ForwardTimer))
    assert not isinstance(_pipeline._decode_step_jit, (bench_wan.ForwardRecorder, bench_wan.ForwardTimer))


def test_eval_sprite_worlds_quick(tmp_path):
    import numpy as np

    from ardiff_jax.envs import CELL_SIZE, SpriteWorld, cell_codes
    from benchmarks import eval_sprite_worlds

    world = SpriteWorld(5)
    frame = world.reset()
    moved = world.step(0)
    assert eval_sprite_worlds.ball_state(frame, frame) == "right"
    assert eval_sprite_worlds.ball_state(frame, moved) == "wrong cell or colour"  # the ball moves every step
    (r, c), (r2, c2) = (np.argwhere(cell_codes(f) >= 3)[0] * CELL_SIZE for f in (frame, moved))
    empty, two = frame.copy(), frame.copy()
    empty[r:r + CELL_SIZE, c:c + CELL_SIZE] = 0
    two[r2:r2 + CELL_SIZE, c2:c2 + CELL_SIZE] = moved[r2:r2 + CELL_SIZE, c2:c2 + CELL_SIZE]
    assert eval_sprite_worlds.ball_state(empty, frame) == "missing"
    assert eval_sprite_worlds.ball_state(two, frame) == "two or more"
    record = eval_sprite_worlds.run(worlds=2, frames=4, batch=2, out_dir=tmp_path)
    assert record["second_half_frames"] == 2 * 2
    assert sum(record["second_half_ball"].values()) == pytest.approx(1.0)
    assert 0 <= record["exact_frames"]["to_the_end"] <= record["exact_frames"]["at_least_half"] <= 2
    assert json.loads((tmp_path / "sprite_worlds.json").read_text())["worlds"] == 2
    with pytest.raises(ValueError, match="demo's worlds"):
        eval_sprite_worlds.run(first_seed=0, out_dir=tmp_path)


def test_eval_sprite_worlds_writes_to_an_output_folder_unless_told_to_update_the_results(tmp_path, monkeypatch):
    """The command the docs cite never rewrites the committed record; only --update-results does."""
    from benchmarks import eval_sprite_worlds

    committed = tmp_path / "committed"
    monkeypatch.setattr(eval_sprite_worlds, "RESULTS", committed)
    monkeypatch.chdir(tmp_path)
    small = ["--worlds", "1", "--frames", "4"]
    monkeypatch.setattr("sys.argv", ["eval_sprite_worlds", *small])
    eval_sprite_worlds.main()
    assert (tmp_path / "eval_sprite_worlds_out" / "sprite_worlds.json").is_file() and not committed.exists()
    monkeypatch.setattr("sys.argv", ["eval_sprite_worlds", *small, "--update-results"])
    eval_sprite_worlds.main()
    assert json.loads((committed / "sprite_worlds.json").read_text())["worlds"] == 1
