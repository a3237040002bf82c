"""Shared test configuration.

The suite must fail when no test ran (CI runs the README command verbatim, so the guard
lives here rather than in .ci/run).
"""

from __future__ import annotations

import os

import pytest

# -- compiling, the suite's largest cost --------------------------------------------------------------
# The suite runs tiny configs, so XLA compiling dominates its time, and LLVM's optimisation of the
# generated CPU code is about a third of each compile while it buys nothing for programs that run in
# microseconds. Level 0 (and no expensive LLVM passes) skips only that: XLA's HLO passes (fusion, layouts,
# SPMD partitioning) run as before and floating-point semantics stay IEEE (no fast-math either way):
# comparisons between our own runs compile both sides alike, comparisons with the releases' stored
# outputs keep their tolerances. Set here, before any test starts jax, so
# the xdist workers and every subprocess a test starts (the CLI, the README lines, the notebooks, the mesh
# suite) inherit it; a user's ``XLA_FLAGS`` that names a level wins. Measured on tests/test_dreamzero_pipeline.py
# alone: 64 s -> 45 s.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = " ".join([_flags, *FAST_COMPILE_FLAGS]).strip()

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


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Start the mesh suite's subprocess now, so it runs alongside the rest (see tests/test_mesh.py).

    Under pytest-xdist (``-n 2`` in pyproject.toml) every worker collects everything, so the worker
    that runs tests/test_mesh.py starts the subprocess itself; the file goes first, so that happens
    at the start and the other worker runs the rest meanwhile."""
    if os.environ.get("ARDIFF_MESH_SUITE") == "1" or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.path.name != "test_mesh.py")  # stable: the rest keep their order
        return
    if any(item.path.name == "test_mesh.py" for item in items):
        from test_mesh import start_mesh_suite

        config.ardiff_mesh_suite = start_mesh_suite()
