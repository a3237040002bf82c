"""``ardiff-jax rollout``: a small multi-session rollout through ardiff_jax.cli.main."""

from __future__ import annotations

import importlib.util
import json

import pytest

from ardiff_jax.cli import main
from ardiff_jax.models._common import DiTModules
from ardiff_jax.models.wan import WanModules

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


def test_rollout_runs_a_causal_wan_on_random_weights(tmp_path, capsys):
    out = tmp_path / "summary.json"
    argv = ["rollout", "--pipeline", "wan", "--preset", "wan-tiny", "--random-weights", "--sessions", "2",
            "--blocks", "2", "--dtype", "float32", "--available-bytes", str(10**9), "--fraction", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["pipeline"] == "wan" and summary["weights"] == "random"
    assert summary["frames_per_block"] == 3 and summary["denoise_steps"] == 4
    assert summary["compile_seconds_during_rollout"] == 0.0  # warmup compiled every program at load
    assert "4/4 blocks" in capsys.readouterr().err


def _exit_code(argv: list[str]) -> int:
    """What the ``ardiff-jax`` process would exit with (argparse errors raise SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def no_weights(monkeypatch):
    """Building any model's weights fails the test: every refusal must come before that."""

    def refuse(cls, config, seed):
        raise AssertionError(f"weights of {config.name} were built before the arguments were checked")

    monkeypatch.setattr(DiTModules, "create", classmethod(refuse))
    monkeypatch.setattr(WanModules, "create", classmethod(refuse))


BAD_ARGUMENTS = [
    (["rollout", "--fraction", "0"], "--fraction"),
    (["rollout", "--fraction", "-1"], "--fraction"),
    (["rollout", "--fraction", "nan"], "--fraction"),
    (["plan", "--fraction", "inf"], "--fraction"),
    (["rollout", "--available-gib", "nan"], "--available-gib"),
    (["rollout", "--available-gib", "inf"], "--available-gib"),
    (["rollout", "--available-gib", "1e300"], "--available-gib"),
    (["plan", "--available-gib", "1e300"], "--available-gib"),
    (["rollout", "--available-bytes", "-5"], "--available-bytes"),
    (["plan", "--available-bytes", "0"], "--available-bytes"),
    (["plan", "--dtype", "nope"], "--dtype"),
    (["plan", "--dtype", "str"], "--dtype"),
    (["plan", "--dtype", "int8"], "--dtype"),
    (["rollout", "--dtype", "int8"], "--dtype"),
    (["rollout", "--sessions", "0"], "--sessions"),
    (["rollout", "--blocks", "two"], "--blocks"),
    (["rollout", "--preset", "huge"], "--preset"),
    # 1.4e9 parameters: refused by the KV plan of the preset's spec, before any weight exists.
    (["rollout", "--preset", "wan_1_3b", "--available-gib", "4"], "--preset wan_1_3b does not fit"),
    (["rollout", "--pipeline", "cfg", "--preset", "wan_1_3b"], "not a preset of --pipeline cfg; choose from tiny"),
    (["rollout", "--out", ""], "--out"),
    (["rollout", "--out", "{tmp}/missing/summary.json"], "--out"),
    (["rollout", "--out", "{tmp}"], "--out"),
    (["rollout", "--pipeline", "wan", "--preset", "wan-tiny"], "needs exactly one of a checkpoint"),
    (["rollout", "--pipeline", "wan", "--preset", "tiny", "--random-weights"], "not a preset of --pipeline wan"),
    (["rollout", "--pipeline", "wan", "--checkpoint", "{tmp}/missing.pt"], "--checkpoint"),
    (["rollout", "--pipeline", "world", "--checkpoint", "{tmp}"], "has no checkpoints"),
    (["rollout", "--pipeline", "wan", "--checkpoint", "a.pt", "--random-weights"], "not allowed with"),
]


@pytest.mark.parametrize("argv, names", BAD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_a_message_naming_them(argv, names, tmp_path, capsys, no_weights):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert names in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was written



def test_serve_on_a_busy_port_is_a_one_line_error_before_anything_is_built(capsys, no_weights):
    pytest.importorskip("uvicorn")
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _exit_code(["serve", "--pipeline", "world", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing claims to be serving
    assert captured.err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in captured.err


def test_serve_listens_before_it_says_so():
    from ardiff_jax.cli import _listen

    with _listen("127.0.0.1", 0) as listener:
        host, port = listener.getsockname()[:2]
        with socket_connect(host, port):  # the socket accepts connections: "serving on" may be printed
            pass


def socket_connect(host, port):
    import socket

    return socket.create_connection((host, port), timeout=5)


# -- demo and train: every argument bounded and checked before any work (issue 43, item 10) ----------------

TOO_LONG = "a" * 300  # a directory name no filesystem takes (NAME_MAX is 255), whoever runs the tests (root too)

CHECKED_FIRST = [
    # demo --agent: the planner's sizes, bounded before the model is built (they ended in a MemoryError after it)
    (["demo", "--agent", "--horizon", "2000000000"], "argument --horizon: must be 1..64"),
    (["demo", "--agent", "--horizon", "65"], "argument --horizon: must be 1..64"),
    (["demo", "--agent", "--horizon", "0"], "argument --horizon: must be 1..64"),
    (["demo", "--agent", "--worlds", "2000000000"], "argument --worlds: must be 1..10000"),
    (["demo", "--agent", "--budget", "2000000000"], "argument --budget: must be 1..256"),
    # the live session and the candidates share the 221 sessions of the agent engine's 256 MiB KV plan
    (["demo", "--agent", "--candidates", "2000000000"], "--candidates must be 1..220"),
    (["demo", "--agent", "--candidates", "221"], "--candidates must be 1..220"),
    # flags the mode does not use are refused, not ignored
    (["demo", "--agent", "--capacity", "3"], "--capacity is not used by demo --agent"),
    (["demo", "--agent", "--sessions", "2"], "--sessions is not used by demo --agent"),
    (["demo", "--agent", "--no-untrained"], "--no-untrained is not used by demo --agent"),
    (["demo", "--agent", "--frames", "8"], "--frames is not used by demo --agent"),
    (["demo", "--agent", "--sessions", "2", "--capacity", "1"], "--sessions, --capacity are not used by demo --agent"),
    (["demo", "--horizon", "3"], "--horizon is not used by demo without --agent"),
    (["demo", "--candidates", "3", "--worlds", "2"], "--worlds, --candidates are not used by demo without --agent"),
    # the tracking demo keeps every generated frame
    (["demo", "--sessions", "257"], "argument --sessions: must be 1..256"),
    (["demo", "--sessions", "256", "--frames", "1000"], "--sessions x --frames must be at most 100000"),
    # an --out that cannot be created, refused before the run (it failed after every episode)
    (["demo", "--agent", "--out", "{tmp}/" + TOO_LONG], "argument --out: cannot write in"),
    (["demo", "--out", "{tmp}/" + TOO_LONG], "argument --out: cannot write in"),
    # train: the step's size (a MemoryError after 30 s of building and compiling)
    (["train", "--batch-size", "2000000000"], "--batch-size must be 1..1024"),
    (["train", "--sequence-frames", "2000000000"], "--sequence-frames must be 2..64"),
    (["train", "--batch-size", "1024", "--sequence-frames", "64"], "--batch-size x --sequence-frames must be at most "
                                                                  "4096"),
    (["train", "--out", "{tmp}/" + TOO_LONG], "argument --out: cannot write in"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Reaching the demo, the agent demo, training or a model's weights fails the test."""
    import ardiff_jax.demo
    import ardiff_jax.models
    import ardiff_jax.planning

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(ardiff_jax.demo, "run_demo", refuse)
    monkeypatch.setattr(ardiff_jax.planning, "run_agent_demo", refuse)
    monkeypatch.setattr(ardiff_jax.models, "pretrained", refuse)
    monkeypatch.setattr(DiTModules, "create", classmethod(refuse))
    if importlib.util.find_spec("optax") is not None:
        import ardiff_jax.training

        monkeypatch.setattr(ardiff_jax.training, "train", refuse)


@pytest.mark.parametrize("argv, message", CHECKED_FIRST, ids=[" ".join(argv)[:60] for argv, _ in CHECKED_FIRST])
def test_demo_and_train_check_every_argument_before_any_work(argv, message, tmp_path, capsys, no_work):
    if argv[0] == "train":
        pytest.importorskip("optax")
    if "--out" not in argv:
        argv = [*argv, "--out", "{tmp}/out"]
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # --out is created only once every argument passed


def test_demo_creates_its_out_directory_before_the_run(tmp_path, monkeypatch, capsys):
    """The directory exists (and takes a file) when the demo starts, so a bad one cannot fail after the run."""
    import ardiff_jax.planning

    out = tmp_path / "new" / "agent"
    seen = []

    def stop(out_dir, **kwargs):
        seen.append((out.is_dir(), kwargs["num_candidates"], kwargs["horizon"], kwargs["worlds"], kwargs["budget"]))
        raise ValueError("stopped")

    monkeypatch.setattr(ardiff_jax.planning, "run_agent_demo", stop)
    assert _exit_code(["demo", "--agent", "--out", str(out), "--candidates", "220", "--horizon", "64"]) == 2
    assert seen == [(True, 220, 64, 32, 6)]  # the largest bounds pass; the defaults are the planner's
    assert "stopped" in capsys.readouterr().err


def test_the_cli_fills_in_the_planners_and_the_demos_own_defaults():
    """demo's mode-specific flags default to None (so that the other mode can refuse them); the values the CLI
    fills in are the library's."""
    import inspect

    from ardiff_jax import cli
    from ardiff_jax.demo import run_demo
    from ardiff_jax.planning import run_agent_demo

    agent = inspect.signature(run_agent_demo).parameters
    assert cli._AGENT_DEFAULTS == {"worlds": agent["worlds"].default, "budget": agent["budget"].default,
                                   "candidates": agent["num_candidates"].default, "horizon": agent["horizon"].default}
    demo = inspect.signature(run_demo).parameters
    assert cli._DEMO_DEFAULTS == {"sessions": demo["sessions"].default, "frames": demo["num_frames"].default}


def test_train_config_bounds_the_step_for_library_callers_too():
    pytest.importorskip("optax")
    from ardiff_jax.training import TrainConfig

    for fields in (dict(batch_size=2_000_000_000), dict(sequence_frames=2_000_000_000),
                   dict(batch_size=1024, sequence_frames=64)):
        with pytest.raises(ValueError, match="TrainConfig batch_size"):
            TrainConfig(**fields)
    assert TrainConfig(batch_size=1024, sequence_frames=4).batch_size == 1024
