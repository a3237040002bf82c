"""The notebooks: committed without outputs, public API only, and each one runs top to bottom (small settings)."""

from __future__ import annotations

import ast
import concurrent.futures
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["bring_your_own_model.ipynb", "quickstart.ipynb",
                                           "train_and_rollout.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_and_on_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert "pip" in code[0].source  # a Colab-friendly install cell comes first
    for cell in code:
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("!", "%")))
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert not (node.attr.startswith("_") and not node.attr.startswith("__")), (path.name, node.attr)
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not any(part.startswith("_") for part in node.module.split(".")), (path.name, node.module)
                assert not any(re.match(r"_[^_]", alias.name) for alias in node.names), (path.name, node.module)


def _execute(path: pathlib.Path, workdir: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """Every notebook run top to bottom at once, each in its own kernel (they share the cores; most of a
    kernel's time is single-threaded compilation). Maps each path to its executed notebook or its error."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ARDIFF_NOTEBOOK_STEPS", "4")  # train_and_rollout: a handful of training steps
        patch.setenv("MPLBACKEND", "Agg")
        with concurrent.futures.ThreadPoolExecutor(len(NOTEBOOKS)) as pool:
            runs = {path: pool.submit(_execute, path, tmp_path_factory.mktemp(path.stem)) for path in NOTEBOOKS}
            return {path: run.exception() or run.result() for path, run in runs.items()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    nb = executed[path]
    if isinstance(nb, BaseException):
        raise nb
    errors = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
              if output.output_type == "error"]
    assert errors == []
