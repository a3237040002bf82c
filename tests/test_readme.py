"""The README's claims run: its Python examples execute as written, and CI runs its test command verbatim."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_readme_python_examples_run(capsys):
    blocks = _blocks("python")
    assert len(blocks) >= 3
    namespaces = []
    for block in blocks:  # each in a namespace of its own: a reader may copy any one of them alone
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)
        namespaces.append(namespace)
    printed = capsys.readouterr().out.split("\n")
    assert "(8, 8, 32) 8" in printed  # the rollout example's documented output
    assert any(getattr(ns.get("y"), "shape", None) == (8, 32) for ns in namespaces)  # the pipeline example's output


def test_quickstart_has_two_commands_and_ci_runs_the_test_one_verbatim():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", quickstart, flags=re.DOTALL)]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci.splitlines()


@pytest.mark.parametrize("doc", ["architecture.md", "api.md", "guarantees.md", "migration.md", "models.md",
                                 "reference_behaviour.md", "scaling.md", "replicas.md", "serving_robots.md"])
def test_linked_docs_exist(doc):
    assert (ROOT / "docs" / doc).is_file()
    assert f"`docs/{doc}`" in README  # listed under Documentation


def test_api_reference_names_every_export():
    import ardiff_jax
    import ardiff_jax.capability
    import ardiff_jax.kv
    import ardiff_jax.envs
    import ardiff_jax.models
    import ardiff_jax.realtime
    import ardiff_jax.planning
    import ardiff_jax.rollout
    import ardiff_jax.serve
    import ardiff_jax.runtime
    import ardiff_jax.types
    import ardiff_jax.demo
    import ardiff_jax.training
    import ardiff_jax.models.wan

    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    code_spans = " ".join(re.findall(r"`([^`]*)`", api))
    modules = (ardiff_jax, ardiff_jax.capability, ardiff_jax.kv, ardiff_jax.runtime, ardiff_jax.types,
               ardiff_jax.rollout, ardiff_jax.models, ardiff_jax.models.wan, ardiff_jax.envs, ardiff_jax.training, ardiff_jax.demo,
               ardiff_jax.realtime, ardiff_jax.serve, ardiff_jax.planning)
    missing = [f"{module.__name__}.{name}" for module in modules for name in module.__all__
               if not re.search(rf"\b{name}\b", code_spans)]
    assert missing == []


def test_top_level_exports_stay_small_and_compat_names_stay_importable():
    import ardiff_jax
    import ardiff_jax.capability
    import ardiff_jax.kv
    import ardiff_jax.runtime
    import ardiff_jax.types

    assert len(ardiff_jax.__all__) <= 15
    assert len(set(ardiff_jax.__all__)) == len(ardiff_jax.__all__)
    assert [name for name in ardiff_jax.__all__ if not hasattr(ardiff_jax, name)] == []
    subpackages = (ardiff_jax.capability, ardiff_jax.kv, ardiff_jax.runtime, ardiff_jax.types)
    assert [name for name in ardiff_jax.COMPAT_NAMES if not hasattr(ardiff_jax, name)] == []
    for name in ardiff_jax.COMPAT_NAMES:
        assert name not in ardiff_jax.__all__, name
        value = getattr(ardiff_jax, name)  # still importable from the top level
        # ... and documented where it lives: exported by a subpackage, as the same object.
        homes = [sub.__name__ for sub in subpackages if name in sub.__all__ and getattr(sub, name) is value]
        assert homes, f"{name} is in no subpackage's __all__"


def _imported_from_top_level(source: str) -> set[str]:
    tree = ast.parse(source)
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "ardiff_jax"
            for alias in node.names}


def test_readme_and_notebook_use_only_public_names():
    import ardiff_jax

    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text(encoding="utf-8"))
    notebook_code = "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    for where, source in (("README.md", "\n".join(_blocks("python"))), ("quickstart.ipynb", notebook_code)):
        imported = _imported_from_top_level(source)
        assert imported, where
        assert sorted(imported - set(ardiff_jax.__all__)) == [], where
        private = re.findall(r"\.\_[A-Za-z]\w*", source)  # attribute access such as state._bound
        assert private == [], where


# Built from parts so that this file does not itself mention the documents it forbids.
_FORBIDDEN = ("CONTR" + "ACTS", "DES" + "IGN.md", "_ANC" + "HORS", "REALTIME_" + "PROTOCOL", "../" + "shared")
_SECTIONS = ["Capability spec", "KV state", "Visible window", "Scratch", "Memory plan", "Runner", "Ticks",
             "Realtime control plane", "Legacy API"]


def test_user_docs_stand_alone():
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "notebooks" / "quickstart.ipynb",
            *sorted((ROOT / "docs").glob("*.md"))]
    found = [(doc.relative_to(ROOT).as_posix(), word) for doc in docs for word in _FORBIDDEN
             if word in doc.read_text(encoding="utf-8")]
    assert found == []


def test_reference_behaviour_has_the_sections_code_points_at():
    text = (ROOT / "docs" / "reference_behaviour.md").read_text(encoding="utf-8")
    assert re.findall(r"^## (.+)$", text, flags=re.MULTILINE) == _SECTIONS
    # Every pointer into that page (its file name, then a section name in double quotes, as code, tests and docs
    # cite it) names a real section, however the line wraps inside the quotes.
    sources = [path for folder in ("ardiff_jax", "tests", "docs", "benchmarks") for path in (ROOT / folder).rglob("*")
               if path.suffix in (".py", ".md")] + [ROOT / "README.md"]
    pointed = set()
    for path in sources:
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))
        pointed.update(re.findall(r"reference_behaviour\.md[`']*,\s*(?:section\s*)?\"([^\"]+)\"", flat))
    assert pointed, "no pointer found: the pattern no longer matches how the code cites sections"
    assert sorted(pointed - set(_SECTIONS)) == []
