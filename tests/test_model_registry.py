"""One model registry (``ardiff_jax._registry``) that ``generate``, ``serve``, ``rollout`` and ``plan`` share (issue 48
§4).

Each command's ``--model``/``--pipeline``/``--pretrained`` choices, ``--preset`` list, argument checks, optional
modules and builders come from the registry's entries: a model added there appears in every command it supports,
with no other edit, and neither the command line nor the timed rollout holds a chain of ``args.model == ...`` of its
own (rollout's requests and checkpoint loader are the entry's too).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import sys

import pytest

from ardiff_jax import _registry, cli
from ardiff_jax._registry import ModelEntry

CLI_SOURCE = pathlib.Path(cli.__file__)
TIMED_GENERATION_SOURCE = CLI_SOURCE.with_name("_timed_generation.py")


def _subcommand(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if a.dest == "command").choices[command]


def _option(sub: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in sub._actions if flag in a.option_strings)


def _accepted(action: argparse.Action, names: set[str]) -> set[str]:
    accepted = set()
    for name in names:
        try:
            action.type(name)
        except argparse.ArgumentTypeError:
            continue
        accepted.add(name)
    return accepted


def test_each_commands_models_and_presets_are_the_registrys():
    """Every --model/--pipeline/--pretrained choice list and every --preset list (its help, its type) of generate,
    serve, rollout and plan is the registry's, model by model."""
    from ardiff_jax.models import DIT_PRESETS

    parser = cli.build_parser()
    for command in _registry.COMMANDS:
        sub = _subcommand(parser, command)
        for flag in _registry.FLAGS:
            names = tuple(entry.name for entry in _registry.models(command, flag))
            actions = [a for a in sub._actions if flag in a.option_strings]
            if not names:
                assert not actions, (command, flag)
                continue
            assert tuple(actions[0].choices) == names, (command, flag)
        groups = _registry.preset_groups(command)
        preset = _option(sub, "--preset")
        for selector, presets in groups.items():
            assert f"{selector}: {', '.join(presets)}" in preset.help, (command, selector)
        listed = {name for presets in groups.values() for name in presets}
        assert _accepted(preset, set(DIT_PRESETS) | {"no-such-preset"}) == listed, command
    # What the command lines name: generate's two models, serve's four kinds, rollout's three pipelines.
    assert list(_registry.preset_groups("serve")) == ["--pipeline world", "--model wan", "--model matrix-game",
                                                      "--model dreamzero"]
    assert [entry.selector("rollout") for entry in _registry.models("rollout")] == [
        "--pipeline world", "--pipeline cfg", "--pipeline wan"]
    # plan names every model that has presets with --model.
    assert list(_registry.preset_groups("plan")) == ["--model world", "--model cfg", "--model wan",
                                                     "--model matrix-game", "--model dreamzero"]


def _toy_entry(calls: list) -> ModelEntry:
    def check(args):
        calls.append(("check", args.command, args.preset))
        return "toy refuses" if args.preset == "toy-big" else None

    def generate(args):
        calls.append(("generate", args.preset))
        return 0

    def build_served(args):
        raise AssertionError("the toy is never served here")

    def classes():
        from ardiff_jax.models import WorldPipeline, WorldPipelineConfig

        return WorldPipeline, WorldPipelineConfig

    def rollout_requests(pipeline, seed):
        from ardiff_jax.types import DiffusionRequest

        def make_request(session, block):
            calls.append(("request", session, block))
            return DiffusionRequest(f"toy-{session}-{block}", prompt="a toy",
                                    extra_args={"session_id": f"toy-{session}"})

        return make_request

    return ModelEntry("toy", "--model", ("generate", "serve", "rollout", "plan"), ("tiny", "toy-big"), "tiny",
                      checks=(("generate", check), ("serve", check)),
                      modules=(("generate", "torch", "the toy's weights"),), pipeline_classes=classes,
                      rollout_requests=rollout_requests, build_served=build_served, generate=generate)


def test_a_model_added_to_the_registry_appears_in_every_command_it_supports(monkeypatch, tmp_path, capsys):
    """One entry, no other edit: it is a choice of generate, serve and plan --model and rollout --pipeline, its
    presets are listed and taken, generate runs its check then its generator, serve refuses with its check before
    anything is built, its modules are checked before any work, plan plans its preset, and a timed rollout plans it
    and sends the requests its entry makes."""
    calls: list = []
    monkeypatch.setattr(_registry, "MODELS", (*_registry.MODELS, _toy_entry(calls)))
    parser = cli.build_parser()
    for command, flag in (("generate", "--model"), ("serve", "--model"), ("rollout", "--pipeline"),
                          ("plan", "--model")):
        sub = _subcommand(parser, command)
        assert "toy" in _option(sub, flag).choices, command
        assert "--model toy: tiny, toy-big" in _option(sub, "--preset").help or command == "rollout"
    assert "--pipeline toy: tiny, toy-big" in _option(_subcommand(parser, "rollout"), "--preset").help

    out = str(tmp_path / "toy.mp4")
    argv = ["generate", "--model", "toy", "--random-weights", "--preset", "toy-big", "--out", out]
    args = parser.parse_args(argv)
    assert ("torch", "the toy's weights") in cli.required_modules(args)
    assert cli.main(argv) == 2
    assert "ardiff-jax generate: error: toy refuses" in capsys.readouterr().err
    assert calls == [("check", "generate", "toy-big")]
    calls.clear()
    assert cli.main(["generate", "--model", "toy", "--random-weights", "--preset", "tiny", "--out", out]) == 0
    assert calls == [("check", "generate", "tiny"), ("generate", "tiny")]

    pytest.importorskip("uvicorn")
    calls.clear()
    monkeypatch.setattr(cli, "_listen", lambda *a: pytest.fail("listened before refusing"))
    assert cli.main(["serve", "--model", "toy", "--preset", "toy-big", "--port", "0"]) == 2
    assert "ardiff-jax serve: error: toy refuses" in capsys.readouterr().err
    assert calls == [("check", "serve", "toy-big")]

    from ardiff_jax._timed_generation import TimedGenerationOptions, run_timed_generation

    spec = TimedGenerationOptions(pipeline="toy", preset="tiny", sessions=3).kv_spec()
    assert spec == TimedGenerationOptions(pipeline="world", preset="tiny", sessions=3).kv_spec()
    assert cli.main(["plan", "--model", "toy", "--preset", "tiny", "--available-gib", "1", "--json"]) == 0
    toy = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", "--model", "world", "--preset", "tiny", "--available-gib", "1", "--json"]) == 0
    world = json.loads(capsys.readouterr().out)
    assert (toy["model"], toy["plan"]) == ("toy", world["plan"])

    calls.clear()
    summary = run_timed_generation(TimedGenerationOptions(pipeline="toy", preset="tiny", sessions=2, blocks=2,
                                                          available_memory_bytes=2**30))
    assert calls == [("request", 0, 0), ("request", 1, 0), ("request", 0, 1), ("request", 1, 1)]
    assert sorted(summary["resident_sessions"]) == ["toy-0", "toy-1"]  # the toy's own requests ran
    with pytest.raises(ValueError, match="pipeline 'toy' has no checkpoints .* load with pipeline 'wan'"):
        TimedGenerationOptions(pipeline="toy", checkpoint="weights.pt").validate()
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"pipeline must be one of \['cfg', 'wan', 'world'\], got 'toy'"):
        TimedGenerationOptions(pipeline="toy").validate()


def test_rollout_refuses_another_models_preset(capsys):
    assert cli.main(["rollout", "--pipeline", "cfg", "--preset", "wan-tiny"]) == 2
    assert ("argument --preset: 'wan-tiny' is not a preset of --pipeline cfg; choose from tiny, medium"
            in capsys.readouterr().err)


def test_serve_refuses_a_preset_for_shipped_weights_naming_the_models_that_take_one(capsys, monkeypatch):
    pytest.importorskip("uvicorn")
    monkeypatch.setattr(cli, "_listen", lambda *a: pytest.fail("listened before refusing"))
    assert cli.main(["serve", "--pretrained", "sprite_world", "--preset", "tiny", "--port", "0"]) == 2
    assert ("argument --preset: for --pipeline world, --model wan, --model matrix-game or --model dreamzero"
            in capsys.readouterr().err)


def test_the_command_line_holds_no_chain_over_models():
    """cli.py compares no --model/--pipeline/--pretrained value with a model's name: it looks the model up in the
    registry (an ``args.model == "wan"`` anywhere in it fails here) and writes no preset list of its own."""

    def chains(source: str) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                names = [o.attr for o in operands if isinstance(o, ast.Attribute)] + [
                    o.args[1].value for o in operands if isinstance(o, ast.Call) and getattr(o.func, "id", "") ==
                    "getattr" and len(o.args) > 1 and isinstance(o.args[1], ast.Constant)]
                if {"model", "pipeline", "pretrained"} & set(names):
                    found.append(ast.unparse(node))
        return found

    assert chains('if args.model == "wan":\n    pass\nx = getattr(args, "pipeline", None) != "world"') == [
        "args.model == 'wan'", "getattr(args, 'pipeline', None) != 'world'"]
    source = CLI_SOURCE.read_text(encoding="utf-8")
    assert chains(source) == []
    presets = {name for entry in _registry.MODELS for name in entry.presets}
    literals = {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)}
    # Only defaults: rollout's --preset tiny and plan's --geometry medium (a geometry, not a preset, of that name).
    assert presets & literals == {"tiny", "medium"}


@pytest.mark.parametrize("fields, message", [
    (dict(flag="--weights"), "flag must be one of"),
    (dict(commands=("generate", "train")), "commands must be some of"),
    (dict(commands=()), "commands must be some of"),
    (dict(tiny_preset="huge"), "tiny_preset must be one of its presets"),
    (dict(presets=(), tiny_preset="tiny"), "tiny_preset must be one of its presets"),
    (dict(generate=None), "no builder for generate"),
    (dict(build_policy_app=lambda *a: None), "no builder for serve"),
    (dict(pipeline_classes=None), "no builder for rollout, plan"),
    (dict(rollout_requests=None), "no builder for rollout "),
    (dict(presets=(), tiny_preset=None), "plan plans a preset's spec, and it has no presets"),
    (dict(commands=("generate", "serve"), rollout_checkpoints=lambda *a: None), "does not support rollout"),
    (dict(commands=("generate",)), "a check or module for 'serve'"),
    (dict(flag="--pretrained"), "rollout names models with --pipeline and plan with --model"),
    (dict(name="two words"), "model name must be"),
])
def test_a_malformed_entry_is_refused_naming_what_is_wrong(fields, message):
    entry = _toy_entry([])
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(entry, **fields)


def test_the_lookups_name_the_choices():
    assert _registry.model("wan").selector("rollout") == "--pipeline wan"
    assert _registry.model("wan").selector("serve") == "--model wan"
    assert _registry.model("world").selector("plan") == "--model world"
    with pytest.raises(ValueError, match="unknown model 'cfg' for serve; choose from sprite_world, world, wan, "
                                         "matrix-game, dreamzero"):
        _registry.model("cfg", "serve")
    with pytest.raises(ValueError, match="command must be one of"):
        _registry.models("train")


def test_each_models_tiny_preset_is_its_smallest():
    """The preset marked tiny (the one for a CPU) has the fewest parameters-by-width of the model's presets."""
    from ardiff_jax.models import dit_preset

    def size(name: str) -> int:
        config = dit_preset(name)
        return config.num_layers * config.dim * config.ffn_dim

    for entry in _registry.MODELS:
        if entry.presets:
            assert min(entry.presets, key=size) == entry.tiny_preset, entry.name


def test_every_module_a_model_needs_is_one_the_dependency_check_knows(monkeypatch):
    """Each module an entry adds is in OPTIONAL_MODULES, so a missing one is named with its extra: serve --model
    dreamzero without msgpack used to end in a KeyError inside the check itself."""
    for entry in _registry.MODELS:
        for _, module, _ in entry.modules:
            assert module in cli.OPTIONAL_MODULES, (entry.name, module)
    args = cli.build_parser().parse_args(["serve", "--model", "dreamzero", "--random-weights"])
    monkeypatch.setitem(sys.modules, "msgpack", None)  # find_spec finds nothing, as when it is not installed
    problem = cli.missing_dependencies(args)
    assert problem == ('not installed: msgpack (for the robot-policy protocol); install: pip install '
                       '"ardiff_jax[serve]"')


def test_building_the_parser_imports_no_model_code():
    """The registry lists its models' presets as written-out names and imports what it builds only when it builds
    it: ``ardiff-jax plan`` and every ``--help`` stay free of the models' import (jax's compile caches, flax)."""
    import subprocess

    code = ("import sys\nfrom ardiff_jax import cli\ncli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ardiff_jax.models', 'ardiff_jax.serve', 'flax'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == "[]", result.stdout


# -- plan --model M --preset P -------------------------------------------------------------------------------


def _pipeline_classes_by_model() -> dict[str, tuple[type, type]]:
    """Each model's pipeline and config class, written out here (not read from the registry)."""
    from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline, WorldPipeline, WorldPipelineConfig
    from ardiff_jax.models.dreamzero import DreamZeroPipeline, DreamZeroPipelineConfig
    from ardiff_jax.models.matrix_game import MatrixGamePipeline, MatrixGamePipelineConfig
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig

    return {"world": (WorldPipeline, WorldPipelineConfig), "cfg": (CFGWorldActionPipeline, CFGPipelineConfig),
            "wan": (CausalWanPipeline, CausalWanPipelineConfig),
            "matrix-game": (MatrixGamePipeline, MatrixGamePipelineConfig),
            "dreamzero": (DreamZeroPipeline, DreamZeroPipelineConfig)}


def test_plan_of_each_models_preset_is_plan_memory_of_the_spec_its_pipeline_gives(capsys):
    """``plan --model M --preset P --json`` is, for every model and preset, ``plan_memory`` of the spec M's own
    pipeline class gives for P (computed here from the class, not through the registry), with --sessions as the
    spec's capacity (4 when not given)."""
    from ardiff_jax.capability import spec_summary
    from ardiff_jax.models import dit_preset
    from ardiff_jax.runtime import plan_memory

    classes = _pipeline_classes_by_model()
    assert {entry.name for entry in _registry.models("plan")} == set(classes)
    budget = 256 * 2**30  # one float32 session of wan2.1-t2v-14b needs 75 GB
    for entry in _registry.models("plan"):
        pipeline_cls, config_cls = classes[entry.name]
        for preset in entry.presets:
            for sessions in (None, 7):
                argv = ["plan", "--model", entry.name, "--preset", preset, "--available-bytes", str(budget),
                        "--fraction", "0.5", "--dtype", "float32", "--json"]
                argv += [] if sessions is None else ["--sessions", str(sessions)]
                assert cli.main(argv) == 0, argv
                out = json.loads(capsys.readouterr().out)
                spec = pipeline_cls.kv_spec_for(dit_preset(preset), config_cls(session_capacity=sessions or 4))
                expected = plan_memory(spec, dtype="float32", available_memory_bytes=budget, gpu_memory_fraction=0.5,
                                       memory_source="explicit")
                assert (out["model"], out["preset"]) == (entry.name, preset)
                assert out["spec"] == json.loads(json.dumps(spec_summary(spec))), (entry.name, preset)
                assert out["plan"] == json.loads(json.dumps(expected.as_dict())), (entry.name, preset)
                assert out["plan"]["requested_session_capacity"] == (sessions or 4)
                assert "geometry" not in out


def test_plan_of_a_preset_takes_the_mesh_and_budget_flags_as_a_geometry_does(capsys):
    """--tp/--cfg/--devices and the text output work on a model's preset as on a geometry: the mesh's plan is
    plan_memory's on that mesh, and the first line names the model and preset."""
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.dreamzero import DreamZeroPipeline, DreamZeroPipelineConfig
    from ardiff_jax.runtime import plan_memory

    argv = ["plan", "--model", "dreamzero", "--preset", "dreamzero-droid", "--available-gib", "120", "--fraction",
            "1", "--tp", "2", "--cfg", "2", "--devices", "8"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = DreamZeroPipeline.kv_spec_for(dit_preset("dreamzero-droid"), DreamZeroPipelineConfig(session_capacity=4))
    expected = plan_memory(spec, dtype="bfloat16", available_memory_bytes=120 * 2**30, gpu_memory_fraction=1.0,
                           memory_source="explicit", tp=2, cfg=2)
    assert out["plan"] == json.loads(json.dumps(expected.as_dict()))
    assert out["mesh"] == {"tp": 2, "cfg": 2, "devices_per_replica": 4, "sessions_per_replica": 4, "devices": 8,
                           "replicas": 2, "total_sessions": 8}
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("--model dreamzero --preset dreamzero-droid: num_layers=40, ")
    assert str(expected) in text


def test_plan_of_a_geometry_is_unchanged(capsys):
    """Without --model, plan plans --geometry (medium by default) and its JSON names the geometry, as before."""
    from ardiff_jax.geometries import example_spec
    from ardiff_jax.runtime import plan_memory

    assert cli.main(["plan", "--available-gib", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["geometry", "spec", "plan", "mesh"] and out["geometry"] == "medium"
    expected = plan_memory(example_spec("medium"), dtype="bfloat16", available_memory_bytes=64 * 2**30,
                           gpu_memory_fraction=0.1, memory_source="explicit")
    assert out["plan"] == json.loads(json.dumps(expected.as_dict()))
    assert cli.main(["plan", "--geometry", "tiny", "--available-gib", "1"]) == 0
    assert capsys.readouterr().out.startswith("geometry tiny: ")


@pytest.mark.parametrize("argv, message", [
    (["--model", "wan", "--preset", "tiny"],
     ("argument --preset: 'tiny' is not a preset of --model wan; choose from wan-tiny, wan2.1-t2v-1.3b, "
      "wan2.1-t2v-14b, wan2.2-ti2v-5b")),
    (["--model", "dreamzero", "--preset", "matrix-game-tiny"],
     ("argument --preset: 'matrix-game-tiny' is not a preset of --model dreamzero; choose from dreamzero-tiny, "
      "dreamzero-droid, dreamzero-wan22-5b")),
    (["--geometry", "tiny", "--model", "wan", "--preset", "wan-tiny"],
     "give --geometry or --model with --preset, not both"),
    (["--model", "matrix-game"], "--model matrix-game needs --preset; choose from matrix-game-tiny, "),
    (["--preset", "wan-tiny"], "argument --preset: only with --model"),
    (["--geometry", "tiny", "--sessions", "3"], "argument --sessions: only with --model"),
    (["--model", "world", "--preset", "wan_1_3b", "--available-bytes", "1000"],
     "--model world --preset wan_1_3b does not fit: "),
])
def test_plan_refuses_a_bad_model_or_preset_naming_it(argv, message, capsys):
    assert cli.main(["plan", *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"ardiff-jax plan: error: {message}" in captured.err


def test_plans_preset_argument_lists_every_models_presets(capsys):
    """An unknown --preset is refused by the parser, listing each model's presets (as every other --preset)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(["plan", "--model", "wan", "--preset", "no-such-preset"])
    assert raised.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown preset 'no-such-preset'; choose from --model world: tiny, medium, wan_1_3b; --model cfg:" in err
    assert "--model dreamzero: dreamzero-tiny, dreamzero-droid, dreamzero-wan22-5b" in err


def test_the_timed_rollout_holds_no_chain_over_pipelines():
    """_timed_generation compares no pipeline name with a string and names no model class: rollout's requests,
    checkpoint loader and pipeline classes are the registry entry's."""
    tree = ast.parse(TIMED_GENERATION_SOURCE.read_text(encoding="utf-8"))
    compared = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(o, ast.Attribute) and o.attr == "pipeline" for o in [node.left, *node.comparators])
                and any(isinstance(o, ast.Constant) for o in [node.left, *node.comparators])]
    assert compared == []
    names = {entry.name for entry in _registry.MODELS}
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    assert names & literals == {"world"}  # only TimedGenerationOptions' default pipeline
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not {"CausalWanPipeline", "WorldPipeline", "CFGWorldActionPipeline"} & imported


def test_a_planned_preset_leaves_out_the_state_a_built_pipeline_adds_beside_its_spec():
    """What plan --model's help says: the spec is the pipeline class's from the preset alone, so per-session state a
    built pipeline adds (Matrix-Game's streaming VAE encoder cache, its block and action buffers) is not in it; the
    KV geometry is the built pipeline's."""
    from ardiff_jax.models.matrix_game import build_matrix_game

    planned = _registry.model("matrix-game", "plan").kv_spec("matrix-game-tiny", 2)
    built = build_matrix_game(preset="matrix-game-tiny", random_weights=True, dtype="float32",
                              session_capacity=2).ar_diffusion_kv_cache_spec()
    assert built.model_owned_state_bytes_per_session > planned.model_owned_state_bytes_per_session
    assert dataclasses.replace(built, model_owned_state_bytes_per_session=0) == dataclasses.replace(
        planned, model_owned_state_bytes_per_session=0)


def test_plan_takes_every_preset_of_the_other_commands_and_the_readme_lines_run_as_said(capsys):
    """The README's "Plan memory" commands run as written; the model line keeps 7 of its 64 sessions (wan2.1-t2v-1.3b
    in bfloat16, 30 % of 141 GiB), and plan --model takes every preset that generate, serve and rollout take."""
    import shlex

    others = {name for command in ("generate", "serve", "rollout")
              for names in _registry.preset_groups(command).values() for name in names}
    assert {name for names in _registry.preset_groups("plan").values() for name in names} == others
    readme = (CLI_SOURCE.parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("### Plan memory", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.strip().splitlines()]
    assert [line[:3] for line in lines] == [["ardiff-jax", "plan", "--geometry"], ["ardiff-jax", "plan", "--model"]]
    for line in lines:
        assert cli.main([*line[1:], "--json"]) == 0, line
        out = json.loads(capsys.readouterr().out)
    assert (out["plan"]["session_capacity"], out["plan"]["requested_session_capacity"]) == (7, 64)
