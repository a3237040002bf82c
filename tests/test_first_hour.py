"""A new user's first hour, kept true: the README's no-download lines run as written, every ``--help``
says what it takes, arguments are refused before any work, and every figure the README quotes
matches the file it comes from.

The README's demo caption is checked against the demo's own rollouts in ``tests/test_demo.py``
(``test_readme_caption_quotes_the_demo``), where those rollouts are computed anyway.
"""

from __future__ import annotations

import os
import json
import pathlib
import re
import shlex
import shutil
import time

import pytest

from ardiff_jax import _registry, cli
from ardiff_jax.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"


def _section(title: str) -> str:
    """The README text under a ``## `` or ``### `` heading, up to the next heading of any level."""
    body = README.split(title + "\n", 1)[1]
    return re.split(r"\n#{2,3} ", body, maxsplit=1)[0]


def _readme_block() -> list[str]:
    block = _section("### Try every model without a download").split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _readme_lines() -> list[str]:
    """The block's commands (its comment lines say which install each needs and what it writes)."""
    return [line for line in _readme_block() if not line.startswith("#")]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


# -- --help and --version -------------------------------------------------------------------------

COMMANDS = ("plan", "rollout", "train", "demo", "generate", "serve")


def test_top_level_help_names_every_command_without_markup(capsys):
    assert _exit_code(["--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text  # reST markup does not belong in a terminal
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", text, flags=re.MULTILINE), command
    assert "Matrix-Game" in text and "--version" in text
    assert _exit_code(["--version"]) == 0
    import ardiff_jax

    assert capsys.readouterr().out.strip() == f"ardiff-jax {ardiff_jax.__version__}"


def _options(help_text: str) -> dict[str, str]:
    """Each option's entry in a --help text (flags to the next option), whitespace-flattened."""
    body = help_text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n  (?=-)", "\n" + body)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_shows_its_defaults_and_presets(command, capsys):
    assert _exit_code([command, "--help"]) == 0
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    assert "``" not in text
    entries = _options(raw)
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        default = action.default
        if not action.option_strings or action.help is None or default is None or default is False \
                or default == [] or default == "==SUPPRESS==":
            continue
        # Every option with a default says it in its help (argparse's "(default: X)" or the help's own words).
        entry = entries[action.option_strings[0]]
        assert "default" in entry, f"{command} {action.option_strings[0]}: no default in --help: {entry}"
    if command in _registry.COMMANDS:
        for names in _registry.preset_groups(command).values():
            for name in names:
                assert name in text, f"{command} --help does not list preset {name}"


def test_demo_and_train_help_show_their_defaults(capsys):
    assert _exit_code(["demo", "--help"]) == 0
    demo = _options(capsys.readouterr().out)
    for flag, default in (("--sessions", 4), ("--frames", 64), ("--seed", 0)):
        assert f"(default: {default})" in demo[flag], demo[flag]
    assert _exit_code(["train", "--help"]) == 0
    train = _options(capsys.readouterr().out)
    pytest.importorskip("optax")
    from ardiff_jax.training import TrainConfig

    config = TrainConfig()
    for flag, field in (("--steps", "steps"), ("--batch-size", "batch_size"), ("--seed", "seed"),
                        ("--checkpoint-every", "checkpoint_every"), ("--learning-rate", "learning_rate"),
                        ("--warmup-steps", "warmup_steps"), ("--end-learning-rate", "end_learning_rate")):
        said = re.search(r"\(default:? ([0-9.e+-]+)\)", train[flag])
        assert said, train[flag]
        assert float(said.group(1)) == getattr(config, field), (flag, said.group(1), getattr(config, field))


def test_preset_lists_are_what_the_pipelines_take():
    """The registry's written-out preset lists (kept there so that building the parser imports no model code)
    equal what each pipeline accepts, and cover every preset but the training-only ones."""
    from ardiff_jax._timed_generation import TimedGenerationOptions
    from ardiff_jax.models import DIT_PRESETS, dit_preset

    def accepted(pipeline: str) -> set[str]:
        names = set()
        for name in DIT_PRESETS:
            options = TimedGenerationOptions(pipeline=pipeline, preset=name, random_weights=pipeline == "wan")
            try:
                options.validate()
                options.kv_spec()
            except ValueError:
                continue
            names.add(name)
        return names

    assert set(_registry.CFG_PRESETS) == accepted("cfg")
    assert set(_registry.WORLD_PRESETS) <= accepted("world")
    # CausalWanPipeline takes every text-to-video config; the CLI lists the Wan networks, not the world
    # pipeline's reference geometry (wan_1_3b) nor Matrix-Game's (an image-conditioned network).
    assert set(_registry.WAN_PRESETS) <= accepted("wan")
    assert accepted("wan") - set(_registry.WAN_PRESETS) <= {"wan_1_3b", *_registry.MATRIX_GAME_PRESETS}
    assert set(_registry.MATRIX_GAME_PRESETS) == {n for n in DIT_PRESETS if dit_preset(n).action is not None}
    assert set(_registry.DREAMZERO_PRESETS) == {n for n in DIT_PRESETS if dit_preset(n).action_register is not None}
    listed = set(_registry.WORLD_PRESETS) | set(_registry.CFG_PRESETS) | set(_registry.WAN_PRESETS) | set(_registry.MATRIX_GAME_PRESETS) \
        | set(_registry.DREAMZERO_PRESETS)
    training_only = {n for n in DIT_PRESETS if n.startswith("sprite")}  # pretrained("sprite_world"), train
    assert set(DIT_PRESETS) - listed == training_only


# -- refused before any work ------------------------------------------------------------------------


@pytest.fixture
def nothing_built(monkeypatch):
    """Building any model fails the test: every refusal here must come before that."""
    from ardiff_jax.models._common import DiTModules
    from ardiff_jax.models.matrix_game import _generate as matrix_game_generate
    from ardiff_jax.models.wan import WanModules

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(DiTModules, "create", classmethod(refuse))
    monkeypatch.setattr(WanModules, "create", classmethod(refuse))
    monkeypatch.setattr(matrix_game_generate, "build_matrix_game", refuse)
    monkeypatch.setattr(_registry, "_build_wan", refuse)


def _actions(path: pathlib.Path, rows: int, keys: int = 3, mouse: bool = True) -> str:
    script = {"keyboard": [[1] + [0] * (keys - 1)] * rows}
    if mouse:
        script["mouse"] = [[0.0, 0.1]] * rows
    path.write_text(json.dumps(script))
    return str(path)


MATRIX_GAME = ["generate", "--model", "matrix-game", "--random-weights", "--preset", "matrix-game-tiny"]
WAN = ["generate", "--random-weights", "--preset", "wan-tiny", "--seconds", "1"]


def _refusals(tmp: pathlib.Path) -> list[tuple[list[str], str]]:
    image = str(ROOT / "docs" / "demo_contact_sheet.png")
    deep = tmp / "deep.json"
    deep.write_text('{"keyboard": ' + "[" * 200_000 + "]" * 200_000 + "}")
    fifo = tmp / "pipe.json"
    os.mkfifo(fifo)  # a FIFO is refused by its type, never opened for a read that would block
    big = tmp / "big.json"
    big.write_text('{"keyboard": [' + ", ".join(["[1, 0, 0]"] * 500_000) + "]}")
    not_a_picture = tmp / "start.png"
    not_a_picture.write_text("not a picture")
    out = ["--out", str(tmp / "out" / "play.mp4")]
    return [
        ([*MATRIX_GAME, "--image", image, "--actions", _actions(tmp / "wide.json", 21, keys=4), *out],
         "keyboard rows have 4 values; matrix-game-tiny takes 3"),
        ([*MATRIX_GAME, "--image", image, "--actions", _actions(tmp / "nomouse.json", 21, mouse=False), *out],
         "needs 'mouse' rows"),
        ([*MATRIX_GAME, "--image", image, "--actions", _actions(tmp / "short.json", 5), *out],
         "5 rows; the first block needs 9"),
        ([*MATRIX_GAME, "--image", image, "--actions", str(deep), *out], "nested deeper"),
        ([*MATRIX_GAME, "--image", image, "--actions", str(fifo), *out], "not a regular file"),
        ([*MATRIX_GAME, "--image", image, "--actions", str(big), *out], "such a file may have"),
        ([*MATRIX_GAME, "--image", str(not_a_picture), "--actions", _actions(tmp / "ok.json", 21), *out],
         "argument --image"),
        ([*MATRIX_GAME, "--image", image, "--actions", _actions(tmp / "ok.json", 21),
          "--out", str(tmp / ("x" * 300 + ".mp4"))], "argument --out: cannot create"),
        ([*MATRIX_GAME, "--image", image, "--actions", _actions(tmp / "ok.json", 21), "--prompt", "a cat", *out],
         "not for --model matrix-game"),
        ([*WAN, "--prompt", "a cat", "--image", image, *out], "argument --image: not for --model wan"),
        ([*WAN, "--prompt", "a cat", "--actions", _actions(tmp / "ok.json", 21), *out],
         "argument --actions: not for --model wan"),
        ([*WAN, "--prompt", "a cat", "--clip", image, *out], "argument --clip: not for --model wan"),
        ([*WAN, "--prompt", "a \udcff cat", *out], "argument --prompt: not valid UTF-8"),
        ([*WAN, "--prompt", "a cat", "--out", str(tmp / ("x" * 300 + ".mp4"))], "argument --out: cannot create"),
        (["generate", "--random-weights", "--preset", "tiny", "--prompt", "a cat", "--seconds", "1", *out],
         "unknown preset 'tiny'; choose from --model wan: wan-tiny"),
        (["generate", "--random-weights", "--preset", "matrix-game-tiny", "--prompt", "a cat", "--seconds", "1", *out],
         "not a preset of --model wan; choose from wan-tiny"),
        (["serve", "--model", "wan", "--random-weights", "--preset", "tiny", "--port", "0"],
         "not a preset of --model wan"),
        (["serve", "--pipeline", "world", "--preset", "wan-tiny", "--port", "0"], "not a preset of --pipeline world"),
        (["serve", "--pipeline", "world", "--preset", "huge", "--port", "0"], "unknown preset 'huge'; choose from"),
        (["serve", "--pretrained", "sprite_world", "--preset", "tiny", "--port", "0"], "for --pipeline world"),
        (["rollout", "--pipeline", "cfg", "--preset", "wan-tiny"], "not a preset of --pipeline cfg"),
    ]


def test_arguments_and_input_files_are_refused_before_anything_is_built(tmp_path, capsys, nothing_built):
    (tmp_path / "out").mkdir()
    for argv, needle in _refusals(tmp_path):
        if argv[0] == "serve":
            pytest.importorskip("uvicorn")
        started = time.perf_counter()
        assert _exit_code(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err, (argv[:8], err)
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith(f"ardiff-jax {argv[0]}: error: "), err  # one line says it
        assert time.perf_counter() - started < 30, argv  # host checks only (imports included)
    assert list((tmp_path / "out").iterdir()) == []  # nothing written


def test_matrix_game_says_which_action_rows_it_drops_before_building(tmp_path, capsys, monkeypatch):
    from ardiff_jax.models.matrix_game import _generate as matrix_game_generate

    def stop(**kwargs):
        raise ValueError("stopped before building")

    monkeypatch.setattr(matrix_game_generate, "build_matrix_game", stop)
    argv = [*MATRIX_GAME, "--image", str(ROOT / "docs" / "demo_contact_sheet.png"), "--actions",
            _actions(tmp_path / "ten.json", 10), "--out", str(tmp_path / "play.mp4")]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    note = "--actions has 10 rows; the video has 9 frames (9 for the first block, then 12 per block), so the " \
           "last 1 rows are dropped"
    assert note in err and err.index(note) < err.index("stopped before building"), err


# -- the README's lines ---------------------------------------------------------------------------------


def test_readme_lines_cover_every_model_family():
    lines = _readme_lines()
    joined = "\n".join(lines)
    for needle in ("demo --out", "serve --pretrained sprite_world", "generate --random-weights --preset wan-tiny --dtype float32",
                   "serve --model wan --random-weights --preset wan-tiny",
                   "generate --model matrix-game --random-weights --preset matrix-game-tiny "
                   "--dtype float32",
                   "serve --model matrix-game --random-weights --preset matrix-game-tiny",
                   "rollout --pipeline cfg --preset tiny"):
        assert needle in joined, needle
    times = _section("### Try every model without a download")
    assert "AMD EPYC" in times and "CPU time" in times  # each measured time names its machine


def _run_line(line: str, capsys) -> tuple[int, str, str]:
    argv = shlex.split(line)
    if argv[:2] == ["python", "-c"]:
        exec(compile(argv[2], "README.md", "exec"), {})
        return 0, "", ""
    assert argv[0] == "ardiff-jax", line
    code = _exit_code(argv[1:])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _readme_installs() -> dict[str, str | None]:
    """Each command of the block -> the extra its group's comment says it needs (None: the plain ``pip install .``)."""
    installs, extra = {}, "unstated"
    for line in _readme_block():
        said = re.fullmatch(r'# needs (?:only )?`pip install (?:\.|"\.\[(\w+)\]")`', line.strip())
        if said:
            extra = said.group(1)
        elif not line.startswith("#"):
            installs[line] = extra
    return installs


def _readme_says(output: str) -> str:
    """The block's comment about what a line writes (``# <output>: ...``)."""
    said = [line for line in _readme_block() if line.startswith(f"# {output}:")]
    assert len(said) == 1, (output, said)
    return said[0]


def _plain_install() -> set[str]:
    """The distributions a plain ``pip install .`` brings: ardiff_jax's requirements without extras, transitively
    (flax alone brings optax and orbax-checkpoint, so those are never missing)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def key(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    found, todo = set(), ["ardiff_jax"]
    while todo:
        name = todo.pop()
        if key(name) in found:
            continue
        found.add(key(name))
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _block_extras(monkeypatch, keep: str | None = None) -> None:
    """Every optional module (cli.OPTIONAL_MODULES) that a plain ``pip install .`` does not bring, and that the extra
    ``keep`` does not either, made absent: a None entry in sys.modules makes ``find_spec`` find nothing and
    ``import`` raise ImportError (the packages are installed here and cannot be uninstalled)."""
    import sys
    from importlib import metadata

    plain, distributions = _plain_install(), metadata.packages_distributions()
    for module, (_, extra) in cli.OPTIONAL_MODULES.items():
        names = distributions.get(module.split(".")[0], [module])
        if extra != keep and not any(re.sub(r"[-_.]+", "-", name).lower() in plain for name in names):
            monkeypatch.setitem(sys.modules, module, None)


@pytest.fixture
def in_a_fresh_folder(tmp_path, monkeypatch):
    """The README's lines run from a checkout: its docs/ picture, nothing else."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "demo_contact_sheet.png", tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_generate_and_rollout_lines_run(in_a_fresh_folder, capsys):
    """The lines that write a video or time a rollout run for real, verbatim, on their tiny presets."""
    av = pytest.importorskip("av")
    import numpy as np

    installs = _readme_installs()
    ran = []
    for line in _readme_lines():
        if " serve " in f" {line} " or " demo " in f" {line} ":
            continue
        with pytest.MonkeyPatch.context() as absent:  # only what the README says this line needs is installed
            _block_extras(absent, keep=installs[line])
            code, out, err = _run_line(line, capsys)
        assert code == 0, (line, err[-2000:])
        ran.append(line)
        if " rollout " in line:  # says what it builds before the half minute of building and compiling
            assert err.startswith("ardiff-jax rollout: building the cfg pipeline (preset tiny, random weights)"), err
        if " generate " in line:
            video = shlex.split(line)[shlex.split(line).index("--out") + 1]
            with av.open(str(in_a_fresh_folder / video)) as container:
                stream = container.streams.video[0]
                size, fps = (stream.codec_context.width, stream.codec_context.height), int(stream.average_rate)
                pixels = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
            frames = len(pixels)
            assert f"{frames} frames" in out, out
            assert "noise-like" in err  # random weights say what the video is
            # What the README's comment says the file looks like: size, length, frame rate, nearly flat grey.
            said = _readme_says(video)
            assert f"{video}: {size[0]} x {size[1]} pixels, {frames / fps:g} s ({frames} frames at {fps} fps), " \
                   "nearly flat grey" in said, (said, size, frames, fps)
            assert pixels.std() < 8 and 96 < pixels.mean() < 160, (pixels.mean(), pixels.std())
            # Each long step said before it starts (it was silent for 20 s after its first line).
            if "--model matrix-game" in line:
                assert ("ardiff-jax generate: building matrix-game-tiny's transformer, VAE and image encoder (random "
                        f"weights), compiling it, then generating {frames} frames") in err, err
            else:
                said_at = [err.find(f"ardiff-jax generate: {step}") for step in ("building", "compiling", "generating")]
                assert -1 not in said_at and said_at == sorted(said_at), err
                assert f"ardiff-jax generate: generating {frames} frames" in err, err
    assert len(ran) == 4


def test_readme_serve_and_demo_lines_reach_their_model(in_a_fresh_folder, capsys, monkeypatch):
    """The serve lines and the demo line, verbatim, pass every check and reach the model with the settings
    they name; the models themselves are built for real by the generate lines above (the same builders),
    by tests/test_serve*.py and by tests/test_demo.py. The sprite-world server is started for real and
    prints what it builds at once, then the ws:// address and the page to open."""
    pytest.importorskip("uvicorn")
    import uvicorn

    import ardiff_jax.models.matrix_game as matrix_game
    from ardiff_jax import demo

    served, reached = [], []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(sockets))
    # uvicorn.Config installs its logging with dictConfig, which closes every handler the test process has
    # (pytest's capture handlers included) and binds new ones to this test's captured streams: the rest of
    # the worker's tests would then write to closed files. The server's logging is uvicorn's, not ours.
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)

    def reach(name):
        def stop(*args, **kwargs):
            reached.append(name)
            raise ValueError(f"reached {name}")
        return stop

    def demo_reached(out, **kwargs):
        raise ValueError(f"demo reached with {kwargs}")

    monkeypatch.setattr(_registry, "_build_wan", reach("wan"))
    monkeypatch.setattr(matrix_game, "build_matrix_game", reach("matrix-game"))  # serve imports it from here
    monkeypatch.setattr(demo, "run_demo", demo_reached)
    from ardiff_jax import serve

    monkeypatch.setattr(serve, "build_dreamzero_app", reach("dreamzero"))  # the CLI imports it from here
    lines = [line for line in _readme_lines() if " serve " in f" {line} " or " demo " in f" {line} "]
    assert len(lines) == 5
    for line in lines:
        # Port 0: the README's port 8000 may be taken on the machine running the tests.
        code, out, err = _run_line(line + " --port 0" if " serve " in line else line, capsys)
        assert code == 2 if "--pretrained" not in line else code == 0, (line, out, err)
        if "--pretrained" in line:
            assert "ardiff-jax serve: building the trained sprite_world model" in err, err
            assert re.search(r"^serving sprite_world .* on ws://127\.0\.0\.1:\d+/v1/realtime/video$", out, re.M), out
            assert re.search(r"^open http://127\.0\.0\.1:\d+/ in a browser", out, re.M), out
        elif " demo " in line:
            assert "'sessions': 1" in err and "'num_frames': 16" in err and "'compare_untrained': False" in err, err
        elif "--model dreamzero" in line:  # its own server (the robot-policy protocol): built before it listens
            assert "reached dreamzero" in err, err
        else:
            assert "reached" in err and "building --model" in err, err
    # The server runs before the build (it answers "starting" meanwhile, issue 47 item 3), so the lines whose
    # build fails (wan, matrix-game: stopped at their builders) ran it too, and stopped with their refusal.
    assert len(served) == 3
    assert sorted(reached) == ["dreamzero", "matrix-game", "wan"]


# -- every figure the README quotes, against the file it comes from ------------------------------------


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def _figures() -> list[tuple[str, str]]:
    """(the text the README must contain, where it comes from): each built from its source file."""
    sidecar = json.loads((ROOT / "ardiff_jax" / "models" / "weights" / "sprite_world.json").read_text())
    params, layers = sidecar["num_params"], sidecar["config"]["num_layers"]
    batch = _load("batch.json")["results"]["sprite"]
    serve = {run["clients"]: run for run in _load("serve_sprite_world.json")["paced"]}
    clients = sorted(serve)
    rtf = ", ".join(f"{serve[n]['real_time_factor']['mean']:.2f}" for n in clients)

    def spread(key: str, stat: str) -> str:
        values = [serve[n][key][stat] for n in clients]
        return f"{min(values):.0f}-{max(values):.0f} ms"

    first_underruns = min(n for n in clients if serve[n]["underruns"]["total"] > 0)
    worlds = _load("sprite_worlds.json")
    start = {(run["model"], run["batch_compile"]): run for run in _load("serve_start.json")["runs"]}

    def first_chunk(model: str) -> str:
        return (f"{model}` {start[model, 'background']['first_chunk_s']:.1f} s "
                f"({start[model, 'eager']['first_chunk_s']:.1f} s")

    agent = _load("agent/agent_summary.json")
    policies = agent["policies"]

    def reached(name: str) -> str:
        row = policies[name]
        return f"{row['reached']}/{row['worlds']} ({row['success_rate']:.0%})"

    forks = _load("forks.json")["median_ms"]
    pages = agent["kv_pages"]
    return [
        *[(f"{reached(name)} | {policies[name]['mean_steps_to_reach']:.2f}", "results/agent/agent_summary.json")
          for name in ("random", "greedy", "oracle planner")],
        (f"**{reached('world-model planner')}** | {policies['world-model planner']['mean_steps_to_reach']:.2f}",
         "results/agent/agent_summary.json"),
        (f"{policies['oracle planner']['decisions_per_second']:.1f} |", "results/agent/agent_summary.json"),
        (f"{policies['world-model planner']['decisions_per_second']:.1f} |", "results/agent/agent_summary.json"),
        (f"reaches {policies['world-model planner']['success_rate'] / policies['oracle planner']['success_rate']:.2f}x "
         "the oracle's success", "results/agent/agent_summary.json"),
        (f"at most {pages['with_forks']['peak']} KV pages at once, where eight private copies of the live session "
         f"would hold {pages['copying']['peak']}", "results/agent/agent_summary.json"),
        (f"about {forks['fork_ms']:.1f} ms beside {forks['block_ms']:.0f} ms for one block", "results/forks.json"),
        (f"sprite world {start['sprite_world', 'background']['first_chunk_s']:.1f} s ("
         f"{start['sprite_world', 'eager']['first_chunk_s']:.1f} s with", "results/serve_start.json"),
        (first_chunk("wan-tiny"), "results/serve_start.json"),
        (first_chunk("matrix-game-tiny"), "results/serve_start.json"),
        (f"gap between chunks was {start['sprite_world', 'background']['max_gap_ms']:.0f} ms for the sprite world "
         f"({start['sprite_world', 'eager']['max_gap_ms']:.0f} ms", "results/serve_start.json"),
        (f"{params / 1e6:.1f}M-parameter causal DiT ({layers} layers)", "models/weights/sprite_world.json"),
        (f"{params / 1e6:.1f}M parameters, {layers} layers", "models/weights/sprite_world.json"),
        (f"{batch['8']['batched / sequential frames/s']:.1f}x the sequential engine at 8 sessions",
         "results/batch.json"),
        (f"{', '.join(map(str, clients[:-1]))} and {clients[-1]} players each play in real time",
         "results/serve_sprite_world.json"),
        (f"(real-time factor {rtf}; at {first_underruns} the first underruns appear)",
         "results/serve_sprite_world.json"),
        (f"in {spread('action_to_receive_ms', 'p50')} at the median (p99 {spread('action_to_receive_ms', 'p99')})",
         "results/serve_sprite_world.json"),
        (f"on screen {spread('action_to_display_ms', 'p50')} after the key press", "results/serve_sprite_world.json"),
        (f"On {worlds['worlds']} other worlds {worlds['exact_frames']['to_the_end']} sessions are exact to frame "
         f"{worlds['frames']}", "results/sprite_worlds.json"),
    ]


def _flat(text: str) -> str:
    return " ".join(text.replace("*", "").split())


def test_readme_figures_match_their_results_files():
    readme = _flat(README)
    missing = [(want, source) for want, source in _figures() if _flat(want) not in readme]
    assert missing == [], "the README quotes figures its results files no longer hold:\n" + "\n".join(
        f"  {want!r}  (from {source})" for want, source in missing)


# The status table's figures and the doc each is quoted from (the loaders' own docs: docs/models.md;
# sizes of the 14B networks: docs/scaling.md).
STATUS_FIGURES = {
    "1.0M": None,  # the shipped sidecar: test_readme_figures_match_their_results_files
    "1.419e9": ("docs/models.md", "1.419e9 parameters"),
    "2.8 GB": ("docs/models.md", "1.419e9 parameters"),  # x 2 bytes in bf16, checked below
    "14e9": ("docs/scaling.md", "14e9 parameters"),
    "28 GB": ("docs/scaling.md", "| 28.0 |"),
    "126.9M": ("docs/models.md", "126.9M parameters"),
    "5.68B": ("docs/models.md", "5.68B parameters"),
    "11.4 GB": ("docs/models.md", "11.4 GB"),
    "1.8 GiB": ("docs/scaling.md", "1.8 GiB per session at 480x832"),
    "1.62e9": ("docs/models.md", "is 1.62 B"),
    "4.8e-6": ("docs/models.md", "| 4.8e-6 (bound 1e-5) |"),
    "3.6e-6": ("docs/models.md", "vs diffusers `decode` 3.6e-6"),
    "4.1e-6": ("docs/models.md", "at\nfull width (base 96, one-off) 4.1e-6"),
    "5.1e-6": ("docs/models.md", "5.1e-6 max abs against transformers"),
    "2.2e-6": ("docs/models.md", "max |diff| 2.2e-6"),
    "1.6e-5": ("docs/models.md", "max |diff| 1.6e-5"),
    # DreamZero: tests/test_dreamzero_pipeline.py keeps the memory figures equal to the runtime's plan.
    "16.5e9": ("docs/models.md", "16,484,292,448"),
    "33 GB": ("docs/models.md", "33.0 GB / 65.9 GB"),
    "1.4e-5": ("docs/models.md", "worst measured: 1.4e-5"),
    "1e-4": ("docs/models.md", "float32, atol 1e-4"),
    "14.2 GB": ("docs/models.md", "**14.2 GB per robot**"),
    "2": ("docs/models.md", "an 80 GB device holds 2 robots"),
    "80 GB": ("docs/models.md", "an 80 GB device holds 2 robots"),
    "141 GB": ("docs/models.md", "141 GB device 6"),
}


def test_status_table_figures_come_from_the_docs():
    status = _section("## What has run where").split("### Try every model", 1)[0]
    table = "\n".join(line for line in status.splitlines() if line.startswith("|"))
    # Standalone figures: not the digits inside names (Wan2.1, T2V-1.3B, ViT-H/14, 480x832, 2-layer, bf16).
    quoted = set(re.findall(r"(?<![\w./-])\d+(?:\.\d+)?(?:e-?\d+)?(?:M|B)?(?: GB| GiB)?(?![\w.-])", table))
    # "6 layers" (the shipped sidecar, checked above), "2-head x 12" (docs/models.md), "Matrix-Game 2.0" (a name)
    names = {"6", "12", "2.0"}
    unsourced = sorted(q for q in quoted - names if q not in STATUS_FIGURES)
    assert unsourced == [], f"status-table figures without a source in STATUS_FIGURES: {unsourced}"
    for figure, source in STATUS_FIGURES.items():
        if source is None:
            continue
        assert figure in table, f"{figure} is listed here but not in the table"
        doc, text = source
        assert _flat(text) in _flat((ROOT / doc).read_text(encoding="utf-8")), (figure, doc, text)
    assert f"{round(1.419e9 * 2 / 1e9, 1)} GB" == "2.8 GB"


# -- the first hour, second pass (issue 47, items 1, 5 and 6) --------------------------------------------------


def test_readme_says_which_install_each_line_needs_and_the_cli_agrees(in_a_fresh_folder, capsys, nothing_built,
                                                                      monkeypatch):
    """Each command of the no-download block sits under a comment naming its install. With every optional
    extra absent (simulated), a line the README runs on the plain install passes the CLI's dependency check,
    and a line that needs an extra is refused at once, naming that extra, before anything is built; with
    that extra present it passes. (The generate and rollout lines also run for real with only their named
    extra present: test_readme_generate_and_rollout_lines_run.)"""
    installs = _readme_installs()
    assert "unstated" not in installs.values(), installs
    assert set(installs) == set(_readme_lines())
    for line, extra in installs.items():
        argv = shlex.split(line)
        if argv[:2] == ["python", "-c"]:
            exec(compile(argv[2], "README.md", "exec"), {})  # writes actions.json for the matrix-game lines
            continue
        args = cli.build_parser().parse_args(argv[1:])
        with pytest.MonkeyPatch.context() as absent:
            _block_extras(absent)
            problem = cli.missing_dependencies(args)
            if extra is None:
                assert problem is None, (line, problem)
                continue
            assert problem is not None and f'pip install "ardiff_jax[{extra}]"' in problem, (line, problem)
            assert _exit_code(argv[1:] + (["--port", "0"] if argv[1] == "serve" else [])) == 2, line
        err = capsys.readouterr().err
        assert err.strip() == f"ardiff-jax {argv[1]}: error: {problem}", err
        with pytest.MonkeyPatch.context() as absent:
            _block_extras(absent, keep=extra)
            assert cli.missing_dependencies(args) is None, line
    assert not list(in_a_fresh_folder.glob("*.mp4"))  # nothing was generated


def test_readme_agent_table_says_how_many_worlds_it_played():
    """The table beside demo --agent comes from 64 worlds; the command's default is 32: the README says both."""
    agent = _load("agent/agent_summary.json")
    default = cli._AGENT_DEFAULTS["worlds"]
    text = _flat(_section("### Fork a session and plan inside the world model"))
    assert f"On {agent['worlds']} worlds" in text
    if agent["worlds"] != default:
        assert f"(`--worlds {agent['worlds']}`; the command's default is {default}" in text, text


def test_readme_actions_line_fits_matrix_game_tiny_and_the_prose_says_so(in_a_fresh_folder, capsys):
    """The no-download actions.json has matrix-game-tiny's keyboard width, and the prose beside [W, S, A, D] says so."""
    from ardiff_jax.models import dit_preset

    keys = dit_preset("matrix-game-tiny").action.keyboard_dim
    _run_line(next(line for line in _readme_lines() if line.startswith("python -c")), capsys)
    script = json.loads((in_a_fresh_folder / "actions.json").read_text())
    assert {len(row) for row in script["keyboard"]} == {keys}
    assert f"matrix-game-tiny's {keys} keyboard columns" in _readme_says("actions.json")
    prose = _flat(_section("### Play Matrix-Game 2.0 in the browser"))
    assert f"and {keys} columns for the random-weights `matrix-game-tiny`" in prose, prose


def test_gitignore_covers_what_the_readme_commands_write():
    """Running the README's commands from the checkout leaves nothing for git to show."""
    import fnmatch

    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    written = set(re.findall(r"--out ([\w./-]+)", README))  # the code blocks' commands and the prose's
    written |= set(re.findall(r"open\('([\w./-]+)', 'w'\)", README))
    assert {"demo_out", "agent_out", "wan_tiny.mp4", "actions.json", "rollout.json"} <= written, written

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, pattern.rstrip("/")) or fnmatch.fnmatch(path.rsplit("/", 1)[-1], pattern)
                   for pattern in patterns)

    assert sorted(path for path in written if not ignored(path)) == []
