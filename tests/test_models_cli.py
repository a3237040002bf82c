"""``ardiff-jax rollout``: a small multi-session rollout through ardiff_jax.cli.main."""

from __future__ import annotations

import json

import pytest

from ardiff_jax.cli import main

# The same plan as the model tests (float32, ample memory, 3 sessions): the compiled
# programs are shared with them when the suite runs in one process.
COMMON = ["--preset", "tiny", "--sessions", "3", "--blocks", "2", "--dtype", "float32",
          "--available-bytes", str(10**9), "--fraction", "1"]


@pytest.mark.parametrize("pipeline", ["world", "cfg"])
def test_rollout_writes_summary(pipeline, tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["rollout", "--pipeline", pipeline, *COMMON, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "AR-Diffusion KV memory plan" in captured.out
    assert "6/6 blocks" in captured.err and "frames/s" in captured.err  # the progress bar
    summary = json.loads(out.read_text())
    assert summary["pipeline"] == pipeline and summary["sessions"] == 3 and summary["blocks_per_session"] == 2
    assert [(b["session"], b["block"]) for b in summary["blocks"]] == [(s, b) for b in range(2) for s in range(3)]
    assert all(b["latency_ms"] > 0 for b in summary["blocks"])
    assert summary["frames_per_second"] > 0
    assert summary["plan"]["session_capacity"] == 3
    assert summary["resident_sessions"] == ["session-0", "session-1", "session-2"]
    # Warmup compiled everything at load: round-robin sessions and growing windows compile nothing.
    assert summary["compile_seconds_during_rollout"] == 0.0


def test_rollout_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["rollout", "--sessions", "0"])
    assert main(["rollout", "--preset", "huge", "--blocks", "1"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err
