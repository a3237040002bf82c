"""``ardiff-jax rollout``: a small multi-session rollout through ardiff_jax.cli.main."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import re

import pytest

from ardiff_jax import _registry
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


# -- the first hour, second pass (issue 47, items 1, 2 and 6): extras, what is being built, --help ---------------


def _block_extras(monkeypatch, keep: tuple[str, ...] = ()) -> None:
    """Make every optional module of the extras not in ``keep`` absent, as after a plain ``pip install .``: a None
    entry in sys.modules makes ``find_spec`` find nothing and ``import`` raise ImportError (the packages are
    installed here and cannot be uninstalled)."""
    import sys

    from ardiff_jax import cli

    for module, (_, extra) in cli.OPTIONAL_MODULES.items():
        if extra not in keep:
            monkeypatch.setitem(sys.modules, module, None)


EXTRAS_NEEDED = [
    (["plan"], set()),
    (["rollout", "--pipeline", "cfg"], set()),
    (["rollout", "--pipeline", "wan", "--checkpoint", "{tmp}/w.safetensors"], set()),
    (["rollout", "--pipeline", "wan", "--checkpoint", "{tmp}/w.pt"], {"torch"}),
    (["demo", "--out", "{tmp}/demo"], set()),
    (["demo", "--agent", "--out", "{tmp}/demo"], set()),
    (["train", "--out", "{tmp}/run"], {"train"}),
    (["generate", "--random-weights", "--preset", "wan-tiny", "--prompt", "a", "--seconds", "1", "--out",
      "{tmp}/x.mp4"], {"serve"}),
    (["generate", "--weights", "{tmp}/w.pt", "--vae", "{tmp}/vae.pth", "--prompt", "a", "--seconds", "1", "--out",
      "{tmp}/x.mp4"], {"serve", "torch"}),
    (["generate", "--weights", "{tmp}/w.safetensors", "--vae", "{tmp}/w.safetensors", "--prompt", "a", "--seconds",
      "1", "--out", "{tmp}/x.mp4"], {"serve"}),
    (["serve", "--pretrained", "sprite_world"], {"serve"}),
    (["serve", "--model", "wan", "--weights", "{tmp}/diffusers", "--vae", "{tmp}/vae.pth"], {"serve", "torch"}),
]


@pytest.mark.parametrize("argv, extras", EXTRAS_NEEDED, ids=[" ".join(argv)[:70] for argv, _ in EXTRAS_NEEDED])
def test_each_command_knows_the_extras_it_will_import(argv, extras, tmp_path, monkeypatch):
    """One place (cli.required_modules) says which optional modules a command and its options import; with every
    extra absent the check names exactly the extras the command needs, and with them present it passes."""
    from ardiff_jax import cli

    for name in ("w.pt", "vae.pth", "w.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "diffusers" / "transformer").mkdir(parents=True)
    (tmp_path / "diffusers" / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"")
    args = cli.build_parser().parse_args([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert {cli.OPTIONAL_MODULES[module][1] for module, _ in cli.required_modules(args)} == extras
    _block_extras(monkeypatch)
    problem = cli.missing_dependencies(args)
    if not extras:
        assert problem is None
        return
    for extra in extras:
        assert f'"ardiff_jax[{extra}]"' in problem, problem
    monkeypatch.undo()
    assert cli.missing_dependencies(args) is None  # everything is installed here


def test_a_missing_extra_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch, no_weights):
    """generate without PyAV, serve without uvicorn, train without matplotlib: exit 2 at once, one line naming the
    package and the install, nothing built and nothing written (it used to build, compile and generate for
    half a minute, then fail writing the MP4)."""
    import ardiff_jax.models.matrix_game as matrix_game
    from ardiff_jax import cli

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the dependencies were checked")

    monkeypatch.setattr(_registry, "_build_wan", refuse)
    monkeypatch.setattr(matrix_game, "run_generate_cli", refuse)
    monkeypatch.setattr(cli, "_listen", refuse)
    actions = tmp_path / "actions.json"
    actions.write_text(json.dumps({"keyboard": [[1, 0, 0]] * 21, "mouse": [[0.0, 0.1]] * 21}))
    image = str(pathlib.Path(__file__).resolve().parents[1] / "docs" / "demo_contact_sheet.png")
    (tmp_path / "out").mkdir()
    out = str(tmp_path / "out" / "x.mp4")
    cases = [
        (["generate", "--random-weights", "--preset", "wan-tiny", "--prompt", "a cat", "--seconds", "2", "--out",
          out], "av", 'not installed: PyAV (module av, for writing the MP4); install: pip install "ardiff_jax[serve]"'),
        (["generate", "--model", "matrix-game", "--random-weights", "--preset", "matrix-game-tiny", "--image", image,
          "--actions", str(actions), "--out", out], "av", "PyAV (module av, for writing the MP4)"),
        (["serve", "--pretrained", "sprite_world", "--port", "0"], "uvicorn",
         'uvicorn (for serving); install: pip install "ardiff_jax[serve]"'),
        (["train", "--out", str(tmp_path / "out" / "run")], "matplotlib",
         'matplotlib (for the loss curve); install: pip install "ardiff_jax[train]"'),
    ]
    import sys

    for argv, module, message in cases:
        with monkeypatch.context() as absent:
            absent.setitem(sys.modules, module, None)
            assert _exit_code(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"ardiff-jax {argv[0]}: error: {err.split(': error: ', 1)[1].strip()}"]
        assert message in err, err
    assert list((tmp_path / "out").iterdir()) == []


def test_rollout_and_the_agent_demo_say_what_they_build_before_building_it(tmp_path, capsys, monkeypatch):
    """rollout and demo --agent were silent for half a minute while they built and compiled: each now says
    what it builds, on stderr, before the work starts."""
    import ardiff_jax._timed_generation as timed
    import ardiff_jax.planning as planning

    said = []  # stderr as it stood when the work was reached

    monkeypatch.setattr(timed, "run_timed_generation", lambda options, **kwargs: said.append(capsys.readouterr().err)
                        or {})
    monkeypatch.setattr(planning, "run_agent_from_args", lambda args: said.append(capsys.readouterr().err) or 0)
    assert main(["rollout", "--pipeline", "cfg", "--preset", "tiny"]) == 0
    assert main(["demo", "--agent", "--out", str(tmp_path / "agent")]) == 0
    rollout, agent = said
    assert "ardiff-jax rollout: building the cfg pipeline (preset tiny, random weights) and compiling" in rollout
    assert ("ardiff-jax demo --agent: building the trained sprite_world model in an engine for the live session and "
            "8 candidates and compiling it") in agent
    assert "then 32 worlds x 4 policies" in agent


def test_generate_says_what_it_builds_compiles_and_generates(tmp_path, capsys, monkeypatch):
    """generate said nothing for 20 s after its first line: each long step is announced before it starts."""
    from ardiff_jax import cli
    import ardiff_jax.models.matrix_game as matrix_game
    import ardiff_jax.models.wan as wan
    import ardiff_jax.runtime as runtime

    events = []

    class Engine:
        def __init__(self, pipeline, config):
            events.append(("engine", capsys.readouterr().err))

        def close(self):
            pass

    class Pipeline:
        config = wan.CausalWanPipelineConfig  # replaced below
        vae = None

    def build(args, pipeline_config):
        from ardiff_jax.models import dit_preset

        events.append(("build", capsys.readouterr().err))
        pipeline = Pipeline()
        pipeline.config = dit_preset("wan-tiny")
        pipeline.vae = type("VAE", (), {"config": wan.WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.0,) * 4,
                                                                        latents_std=(1.0,) * 4)})()
        return pipeline

    def generate_video(engine, schedule, seconds, **kwargs):
        events.append(("generate", capsys.readouterr().err))
        raise ValueError("stopped")

    monkeypatch.setattr(_registry, "_build_wan", build)
    monkeypatch.setattr(runtime, "ARDiffusionEngine", Engine)
    monkeypatch.setattr(wan, "generate_video", generate_video)
    argv = ["generate", "--random-weights", "--preset", "wan-tiny", "--dtype", "float32", "--prompt", "a cat",
            "--seconds", "2", "--out", str(tmp_path / "x.mp4")]
    assert main(argv) == 2
    assert [name for name, _ in events] == ["build", "engine", "generate"]
    assert "ardiff-jax generate: building wan-tiny's transformer, VAE and text encoder (random weights)" in events[0][1]
    assert "ardiff-jax generate: compiling one block's programs" in events[1][1]
    assert "ardiff-jax generate: generating 32 frames (2.00 s at 16 fps) in 3 blocks" in events[2][1]

    def play(args, refuse):
        events.append(("matrix-game", capsys.readouterr().err))
        return 0

    monkeypatch.setattr(matrix_game, "run_generate_cli", play)
    actions = tmp_path / "actions.json"
    actions.write_text(json.dumps({"keyboard": [[1, 0, 0]] * 21, "mouse": [[0.0, 0.1]] * 21}))
    image = str(pathlib.Path(__file__).resolve().parents[1] / "docs" / "demo_contact_sheet.png")
    assert main(["generate", "--model", "matrix-game", "--random-weights", "--preset", "matrix-game-tiny", "--image",
                 image, "--actions", str(actions), "--out", str(tmp_path / "x.mp4")]) == 0
    assert ("ardiff-jax generate: building matrix-game-tiny's transformer, VAE and image encoder (random weights), "
            "compiling it, then generating 21 frames (0.84 s at 25 fps) in 2 blocks") in events[-1][1]


def _help(command: list[str], capsys) -> str:
    assert _exit_code([*command, "--help"]) == 0
    return capsys.readouterr().out


def test_top_level_help_lists_each_command_once_and_each_command_has_a_description(capsys):
    from ardiff_jax import cli

    text = _help([], capsys)
    for command in cli.COMMAND_HELP:
        assert len(re.findall(rf"^\s+{command}\s", text, flags=re.MULTILINE)) == 1, (command, text)
        own = _help([command], capsys)
        description = " ".join(own.split("\n\n")[1].split())  # usage, description, options
        assert description == " ".join(cli.COMMAND_HELP[command][1].split()), (command, own[:600])


def _entries(text: str) -> dict[str, str]:
    body = text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + body)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}


def test_help_says_each_default_once_and_the_dtype_in_one_spelling(capsys):
    """serve --host-offload-bytes said its default twice ('default 0: off' and '(default: 0)'); serve --dtype said
    'bf16', a spelling --dtype refuses."""
    from ardiff_jax import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    dtypes = 0
    for command, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.help is None or action.help == argparse.SUPPRESS:
                continue
            if formatter._get_help_string(action) != action.help:  # the formatter appends "(default: X)"
                assert not re.search(r"\bdefault\b", action.help), (command, action.option_strings, action.help)
        entries = _entries(_help([command], capsys))
        if "--dtype" in entries:
            dtypes += 1
            assert "(default: bfloat16)" in entries["--dtype"], (command, entries["--dtype"])
            assert not re.search(r"\bbf16\b", entries["--dtype"]), (command, entries["--dtype"])
    assert dtypes == 4  # plan, rollout, generate, serve


def test_demo_progress_rate_is_never_negative():
    """The bar's second phase (the untrained model) restarted its clock with the first phase's start count, so
    one redraw showed (0 - initial) / elapsed: a negative frames/s."""
    import io
    import time

    from tqdm import tqdm

    from ardiff_jax.demo import _progress

    text = io.StringIO()
    bar = tqdm(total=8, unit="frame", file=text, mininterval=0, miniters=1)
    for _ in range(2):  # two phases, as the demo with its untrained baseline
        on_block = _progress(bar, 1)
        for _ in range(4):
            time.sleep(0.002)
            on_block(0, 1.0)
    bar.close()
    rates = re.findall(r"(-?[\d.]+)frame/s", text.getvalue())
    assert rates and all(float(rate) >= 0 for rate in rates), rates
    assert "8/8" in text.getvalue()


def test_demo_removes_its_older_session_files_and_nothing_else(tmp_path):
    """A run into a folder that held a run with more sessions left session_2.gif and friends beside the new ones."""
    import numpy as np

    from ardiff_jax.demo import SessionTrack, write_demo_outputs

    def tracks(n):
        frames = np.zeros((3, 16, 16, 3), np.uint8)
        return [SessionTrack(seed=i, frames=frames, truth=frames, actions=np.zeros(3, np.int32), latencies_ms=[1.0])
                for i in range(n)]

    write_demo_outputs(tmp_path, tracks(3), {"run": 1})
    for name in ("notes.txt", "session_9.txt", "session_x.gif"):  # not the demo's: kept
        (tmp_path / name).write_text("mine")
    write_demo_outputs(tmp_path, tracks(1), {"run": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "contact_sheet.png", "notes.txt", "session_0.gif", "session_0.npz", "session_9.txt", "session_x.gif",
        "summary.json"]


def test_counts_of_one_are_singular(capsys, monkeypatch, tmp_path):
    """'1 sessions x 16 frames': the demo's summary line (and plan's mesh lines) count in words that agree."""
    import ardiff_jax.demo as demo

    summary = {"sessions": 1, "device": "cpu:0", "machine": {"cpu_model": "CPU", "cpu_count": 2},
               "session_capacity": 1, "lru_evictions": 1, "wall_seconds": 1.0,
               "quality": {"generated_frames_per_session": 16, "model_second_half": 1.0,
                           "repeat_first_frame_second_half": 2.0, "ratio_to_repeat_first_frame": 0.5,
                           "drift_second_over_first_half": 1.0, "exact_frames_per_session": [1]},
               "one_step_accuracy": {"transitions": 1, "agent": 1.0, "ball": 1.0, "frame": 1.0},
               "speed": {"frames_per_second_one_session": 1.0, "frames_per_second_interleaved": 1.0,
                         "interleaved_sessions": 1, "frames_per_second_batched": 1.0, "batched_sessions": 1,
                         "latency_ms": {"p50": 1.0, "p99": 1.0}}}
    monkeypatch.setattr(demo, "run_demo", lambda out, **kwargs: summary)
    assert main(["demo", "--out", str(tmp_path), "--sessions", "1", "--frames", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 session x 16 frames on cpu:0") and "1 LRU eviction)" in out, out
    assert main(["plan", "--geometry", "medium", "--available-gib", "1000", "--tp", "2", "--devices", "3"]) == 0
    out = capsys.readouterr().out
    assert "(1 device unused)" in out and "on 3 devices: 1 replica x" in out, out
