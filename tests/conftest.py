"""Shared test configuration.

The suite must fail when no test ran (CI runs the README command verbatim, so the guard
lives here rather than in .ci/run).
"""

from __future__ import annotations

import os

import pytest

# tests/mesh needs 8 virtual devices, which must be configured before jax starts: the main
# run leaves it to tests/test_mesh.py, which runs it in a subprocess.
collect_ignore = [] if os.environ.get("ARDIFF_MESH_SUITE") == "1" else ["mesh"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0 and exitstatus == 0 and not session.config.option.collectonly:
        session.exitstatus = 1
        reporter.write_line("no test passed: failing the run (see tests/conftest.py)", red=True)


#: The files that take longest on the 2-core CI machine, longest first (the mesh file's subprocess, the
#: notebooks' kernels, then the heaviest in-process files). Under ``--dist loadfile`` whole files go to
#: the workers in collection order, so these start first and the many short files fill in behind them,
#: instead of a long file starting last and running alone at the end. A file missing here only runs later.
SLOW_FILES_FIRST = (
    "test_mesh.py", "test_notebooks.py", "test_wan_video.py", "test_session_files.py",
    "test_matrix_game_pipeline.py", "test_benchmarks_smoke.py", "test_offload.py", "test_training.py",
    "test_gpu_check_smoke.py", "test_demo.py", "test_state_machine.py", "test_models_cfg.py",
    "test_wan_pipeline.py", "test_hardening_engine.py", "test_visible_property.py", "test_models_world.py",
)


def _slow_first(item: pytest.Item) -> int:
    name = item.path.name
    return SLOW_FILES_FIRST.index(name) if name in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Start the mesh suite's subprocess now, so it runs alongside the rest (see tests/test_mesh.py).

    Under pytest-xdist (``-n 2`` in pyproject.toml) every worker collects everything, so the worker
    that runs tests/test_mesh.py starts the subprocess itself; the file goes first (``SLOW_FILES_FIRST``,
    with ``--no-loadscope-reorder``, which keeps this order instead of sorting files by their number of
    tests), so that happens at the start and the other worker runs the rest meanwhile."""
    if os.environ.get("ARDIFF_MESH_SUITE") == "1" or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_slow_first)  # stable: the files keep their tests' order, the rest their order
        return
    if any(item.path.name == "test_mesh.py" for item in items):
        from test_mesh import start_mesh_suite

        config.ardiff_mesh_suite = start_mesh_suite()
