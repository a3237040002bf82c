"""One model registry (``ardiff_jax._registry``) that ``generate``, ``serve`` and ``rollout`` share (issue 48 §4).

Each command's ``--model``/``--pipeline``/``--pretrained`` choices, ``--preset`` list, argument checks, optional
modules and builders come from the registry's entries: a model added there appears in every command it supports,
with no other edit, and the command line holds no chain of ``args.model == ...`` of its own.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import sys

import pytest

from ardiff_jax import _registry, cli
from ardiff_jax._registry import ModelEntry

CLI_SOURCE = pathlib.Path(cli.__file__)


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
    serve and rollout is the registry's, model by model."""
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

    return ModelEntry("toy", "--model", ("generate", "serve", "rollout"), ("tiny", "toy-big"), "tiny",
                      checks=(("generate", check), ("serve", check)),
                      modules=(("generate", "torch", "the toy's weights"),), pipeline_classes=classes,
                      build_served=build_served, generate=generate)


def test_a_model_added_to_the_registry_appears_in_every_command_it_supports(monkeypatch, tmp_path, capsys):
    """One entry, no other edit: it is a choice of generate and serve --model and rollout --pipeline, its presets
    are listed and taken, generate runs its check then its generator, serve refuses with its check before
    anything is built, its modules are checked before any work, and a timed rollout plans it."""
    calls: list = []
    monkeypatch.setattr(_registry, "MODELS", (*_registry.MODELS, _toy_entry(calls)))
    parser = cli.build_parser()
    for command, flag in (("generate", "--model"), ("serve", "--model"), ("rollout", "--pipeline")):
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

    from ardiff_jax._timed_generation import TimedGenerationOptions

    spec = TimedGenerationOptions(pipeline="toy", preset="tiny", sessions=3).kv_spec()
    assert spec == TimedGenerationOptions(pipeline="world", preset="tiny", sessions=3).kv_spec()
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
    (dict(pipeline_classes=None), "no builder for rollout"),
    (dict(commands=("generate",)), "a check or module for 'serve'"),
    (dict(flag="--pretrained"), "rollout names models with --pipeline"),
    (dict(name="two words"), "model name must be"),
])
def test_a_malformed_entry_is_refused_naming_what_is_wrong(fields, message):
    entry = _toy_entry([])
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(entry, **fields)


def test_the_lookups_name_the_choices():
    assert _registry.model("wan").selector("rollout") == "--pipeline wan"
    assert _registry.model("wan").selector("serve") == "--model wan"
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
