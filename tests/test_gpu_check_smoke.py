"""``benchmarks/gpu_check``: the GPU check's smoke mode runs on CPU and writes a well-formed JSON.

Structure only, never timings (as ``tests/test_benchmarks_smoke.py``): the shell wrapper runs
``--smoke`` in a subprocess into a temporary path; cuDNN must be recorded as skipped with the
reason, every section present, the reference figures labelled, the causal-Wan rollout (with its
VAE) finite and free of recompiles, its denoise / commit / VAE decode / overhead split and the
text encode present, and the batched ticks of (e) measured at every planned batch size without
a compile after the engine's warmup. The time guard is
checked in-process with a zero budget: every section is skipped with its reason and the JSON
is still written; ``--sections`` runs a subset and refuses unknown names.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

pytest.importorskip("benchmarks.common")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_gpu_check_smoke_through_the_shell_wrapper(tmp_path):
    out = tmp_path / "nested" / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"gpu_check JSON: {out}" in done.stdout
    record = json.loads(out.read_text())

    assert record["benchmark"] == "gpu_check" and record["mode"] == "smoke" and record["complete"] is True
    assert record["sections"] == ["commit", "attend", "world", "matrix_game", "wan_batch", "dreamzero"]
    assert record["time_guard"]["skipped"] == [] and record["time_guard"]["elapsed_s"] > 0
    assert record["device"]["platform"] == "cpu" and record["machine"]["jax_backend"] == "cpu"
    assert record["hardware_floors"]["bandwidth_bytes_per_s"] == 4.8e12
    assert record["hardware_floors"]["bf16_dense_flops_per_s"] == 989e12

    game = record["matrix_game"]  # (d): the tiny Matrix-Game network through the engine
    assert game["preset"] == "matrix-game-tiny" and game["video_frames_per_block"] == 12
    assert _positive(game["frames_per_s"]) and game["release_reported_fps"] == 25.0
    assert all(_positive(game["split_ms_median"][k]) for k in ("transformer", "vae_decode", "synced_block"))
    assert game["transformer_calls_per_block"] == 4  # 3 denoise steps + the commit pass

    robot = record["dreamzero"]  # (f): the tiny DreamZero network's robot calls through the engine
    assert robot["preset"] == "dreamzero-tiny" and robot["release_s"] == {"2 x H100": 3.0, "GB200": 0.6}
    assert _positive(robot["call_s"]) and _positive(robot["episode_start_s"]) and robot["calls_measured"] == 3
    assert all(_positive(robot["breakdown"][k]) for k in ("commit_s", "dit_s", "scheduler_s", "host_s"))
    assert robot["memory"]["robots_per_device"] == {"80 GB (H100)": 2, "141 GB (H200)": 6}

    batch = record["wan_batch"]  # (e): one engine (capacity 2, bucket 2) serving 2, then 1 session per tick
    assert batch["preset"] == "wan-smoke" and batch["with_vae"] is True and batch["player_fps"] == 16
    assert batch["batch_sizes_planned"] == [1, 2] and batch["batch_sizes_measured"] == [1, 2]
    assert batch["session_capacity"] == 2 and batch["batch_buckets"] == [2] and batch["supports_batched_forward"]
    assert _positive(batch["engine_load_s"]) and batch["engine_load_warnings"] == []
    assert batch["fill"]["batch_size"] == 2 and batch["fill"]["windows_full"] is True
    assert batch["fill"]["ticks"] == batch["fill_blocks"] == 1  # window 6 frames = this block + one before it
    assert batch["xla_compiles_after_load"] == 0  # every bucket compiled by the engine's warmup
    for size in (1, 2):
        entry = batch["results"][str(size)]
        assert entry["batch_size"] == size and entry["call"] == ("generate" if size == 1 else "generate_batch")
        assert entry["ticks_timed"] == 2 and entry["stopped_early_by_time_guard"] is False
        assert entry["latents_finite"] is True and entry["video_frames_per_block"] == 12
        assert entry["xla_compiles_during_timed_ticks"] == 0 and entry["batched_forward_fallbacks"] == 0
        assert _positive(entry["aggregate_video_frames_per_s"]) and _positive(entry["tick_ms_median"])
        seconds = entry["tick_ms_median"] / 1e3
        assert entry["aggregate_video_frames_per_s"] == pytest.approx(size * 12 / seconds)
        assert entry["per_session_video_frames_per_s"] == pytest.approx(12 / seconds)
        assert entry["session_latency_ms_median"] == entry["tick_ms_median"]  # every block arrives at the tick's end
        assert entry["players_at_16fps"] == math.floor(entry["aggregate_video_frames_per_s"] / 16)
        assert entry["all_players_real_time"] is (12 / seconds >= 16)
    assert batch["results"]["1"]["aggregate_over_batch_1"] == 1.0
    players = batch["players"]
    assert players["most_players_at_16fps"] == max(batch["results"][s]["players_at_16fps"] for s in ("1", "2"))
    memory = batch["memory"]  # the plan: the VAE's decoder cache is part of a session's bytes
    assert memory["session_capacity"] == 2 and memory["requested_session_capacity"] == 2
    assert memory["model_owned_bytes_per_session"] >= record["world"]["vae"]["cache_bytes_per_session"]
    assert memory["per_session_bytes"] > memory["model_owned_bytes_per_session"]
    assert set(memory["sessions_fit"]) == {"this_engine", "world_section", "all_free_memory"}
    assert all(fit["sessions"] >= 2 for fit in memory["sessions_fit"].values())

    commit = record["commit"]
    assert set(commit["stats"]) == {"commit_block", "floor"} and _positive(commit["commit_block/floor"])
    assert commit["layout"]["dtype"] == "bfloat16" and commit["layout"]["storage_dtype"] == "uint16"
    assert _positive(commit["block_bytes"])

    attend = record["attend"]
    reason = "platform is 'cpu', cuDNN flash attention needs 'gpu'"
    assert attend["cudnn_support"] == {"supported": False, "reason": reason}
    assert attend["backends"]["cudnn"] == {"skipped": reason}
    assert attend["backends"]["dense_contiguous_cudnn"] == {"skipped": reason}
    xla = attend["backends"]["xla"]
    for key in ("median_ms", "x_bandwidth_floor", "x_flop_floor", "achieved_GBps", "achieved_TFLOPs"):
        assert _positive(xla[key]), key
    floors = attend["floors"]
    # tiny: sink 1 + window 5 frames of 16 tokens, 2 KV heads x 16, bf16; 2 frames of queries.
    assert floors["keys"] == 96 and floors["queries"] == 32
    assert floors["window_bytes_one_layer"] == 2 * 96 * 2 * 16 * 2
    assert floors["bandwidth_floor_ms"] == pytest.approx(floors["window_bytes_one_layer"] / 4.8e12 * 1e3)
    assert floors["flop_floor_ms"] == pytest.approx(4 * 32 * 96 * 2 * 16 / 989e12 * 1e3)
    agreement = attend["agreement_with_reference"]
    assert agreement["xla_max_abs_diff"] < 0.05 * max(1.0, agreement["max_abs_reference"])

    world = record["world"]
    assert world["preset"] == "wan-smoke" and world["pipeline"] == "CausalWanPipeline"
    assert world["policy"] == "self-forcing" and world["sink_frames"] == 0 and world["frames_per_block"] == 3
    assert world["backends_planned"] == ["xla"]
    assert "platform is 'cpu'" in world["backend_choice_reason"]
    assert world["reference_fps"]["LongLive-1.3B"]["video_frames_per_s"] == 20.7
    self_forcing = world["reference_fps"]["Self-Forcing (chunk-wise, Wan2.1-1.3B)"]
    assert self_forcing["video_frames_per_s"] == 17.0 and self_forcing["measured_by_users_video_frames_per_s"] == 13.1
    assert world["goal"]["video_frames_per_s"] == 17.0 and "end-to-end" in world["goal"]["what"]
    assert world["transformer_goal"]["video_frames_per_s"] == 20.0
    assert "label" in world["reference_fps"] and "4" in world["video_frames_note"]
    # The VAE: one session's streaming cache, here and at 832x480.
    vae = world["vae"]
    assert _positive(vae["cache_bytes_per_session"]) and vae["cache_bytes_per_session_832x480"] > \
        vae["cache_bytes_per_session"]
    assert _positive(vae["decode_flops_per_block_832x480"]) and _positive(world["vae_init_s"])
    result = world["results"]["xla"]
    assert result["blocks_timed"] == 2 and result["latents_finite"] is True
    assert result["xla_compiles_during_timed_blocks"] == 0
    assert _positive(result["latent_frames_per_s"])
    # End to end: every block decoded (12 video frames per steady-state block), goal >= 17 frames/s.
    assert result["video_frames_per_block"] == 12
    assert result["video_frames_per_s"] == pytest.approx(4 * result["latent_frames_per_s"])
    assert result["video_frames_per_s"] == pytest.approx(12 / (result["block_ms_median"] / 1e3))
    assert result["e2e_video_frames_per_s"] == result["video_frames_per_s"]
    assert result["video_frames_per_s_over_reference"]["LongLive-1.3B"] == pytest.approx(
        result["video_frames_per_s"] / 20.7)
    assert result["goal_met"] is (result["video_frames_per_s"] >= 17.0)
    assert _positive(result["vae_decode_ms"])
    # The bench_wan split on the same engine: 4 denoise forwards + 1 commit forward + 1 decode recorded,
    # overhead = engine block - (denoise + commit + VAE decode), no recompilation.
    split = result["split"]
    assert split["forwards_recorded"] == 5 and split["denoise_steps"] == 4 and split["rounds"] == 2
    assert split["vae_decodes_recorded"] == 1 and split["video_frames_per_block"] == 12
    for key in ("engine_block_ms", "denoise_ms", "commit_ms", "vae_decode_ms", "model_ms"):
        assert _positive(split[key]), key
    assert split["model_ms"] == pytest.approx(split["denoise_ms"] + split["commit_ms"] + split["vae_decode_ms"])
    assert split["overhead_ms"] == pytest.approx(split["engine_block_ms"] - split["model_ms"])
    assert isinstance(split["overhead_target_met"], bool) and split["overhead_target_fraction"] == 0.05
    assert split["xla_compiles_during_split"] == 0
    assert set(split["stats"]) == {"engine_block", "denoise", "commit", "vae_decode"}
    assert [b["forwards"] for b in split["runtime_self_time"]["blocks"]] == [5, 5]
    assert [b["vae_decodes"] for b in split["runtime_self_time"]["blocks"]] == [1, 1]
    assert result["transformer_video_frames_per_s"] == pytest.approx(12 / (split["transformer_ms"] / 1e3))
    assert result["transformer_goal_met"] is (result["transformer_video_frames_per_s"] >= 20.0)
    # The text encode (the smoke umT5; the XXL on a GPU), amortised into the end-to-end figure.
    text = world["text_encode"]
    assert text["kind"] == "smoke" and text["text_len"] == 512 and text["features_finite"] is True
    assert _positive(text["median_ms"]) and text["stats"]["n"] == 2
    assert [a["blocks_per_prompt"] for a in result["amortised_with_text_encode"]] == [1, 7, 28]
    one = result["amortised_with_text_encode"][0]
    assert one["video_frames_per_s"] == pytest.approx(12 / ((result["block_ms_median"] + text["median_ms"]) / 1e3))


def test_time_guard_skips_sections_and_still_writes(tmp_path):
    from benchmarks import gpu_check

    out = tmp_path / "guarded.json"
    record = gpu_check.run(smoke=True, out=out, budget_s=0.0)
    written = json.loads(out.read_text())
    assert written["complete"] is False and record["complete"] is False
    assert written["sections"] == list(gpu_check.SECTIONS) == ["commit", "attend", "world", "matrix_game", "wan_batch",
                                                               "dreamzero"]
    for section in gpu_check.SECTIONS:
        assert written[section]["skipped"].startswith(f"{section}: "), written[section]
        assert "left of 0 s" in written[section]["skipped"]
    assert len(written["time_guard"]["skipped"]) == 6


def test_sections_runs_only_those_named(tmp_path):
    from benchmarks import gpu_check

    out = tmp_path / "one.json"
    gpu_check.run(smoke=True, out=out, budget_s=0.0, sections=("wan_batch",))
    written = json.loads(out.read_text())
    assert written["sections"] == ["wan_batch"] and "left of 0 s" in written["wan_batch"]["skipped"]
    assert not {"commit", "attend", "world", "matrix_game"} & set(written)  # not named: left out, not skipped
    assert len(written["time_guard"]["skipped"]) == 1
    with pytest.raises(ValueError, match="subset"):
        gpu_check.run(smoke=True, out=out, sections=("wan_batch", "nope"))
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--sections", "commit,nope", "--out", str(out)])


def test_hard_deadline_aborts_an_overrunning_section(tmp_path, monkeypatch):
    import time

    from benchmarks import gpu_check

    def overrun(*args, **kwargs):
        while True:  # the SIGALRM handler raises between these bytecodes
            time.sleep(0.05)

    monkeypatch.setattr(gpu_check, "HARD_GRACE_S", 0.0)
    monkeypatch.setattr(gpu_check, "measure_commit", overrun)
    out = tmp_path / "aborted.json"
    start = time.monotonic()
    gpu_check.run(smoke=True, out=out, budget_s=3.0)
    assert time.monotonic() - start < 10
    written = json.loads(out.read_text())
    assert written["commit"] == {"aborted": "hard deadline of 3 s reached"}
    assert written["complete"] is False
    # The sections after it found no time left and were skipped, not started.
    assert "skipped" in written["attend"] and "skipped" in written["world"]
