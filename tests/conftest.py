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

# -- one compilation cache for the whole run ----------------------------------------------------------------
# The same programs are compiled in many processes of one run (both xdist workers build the tiny pipelines; the
# CLI, the README lines, the notebooks and the benchmark smokes start fresh interpreters) and, within a process, by
# every fresh ``jax.jit`` of the same function (each pipeline instance jits its own steps). jax's persistent
# cache, keyed by the program's HLO, the compile options and XLA_FLAGS, lets each be compiled once per run. A
# fresh directory per run (made by the first process, inherited by every worker and subprocess through the
# environment, removed at the end), so no run depends on what an earlier one left. A load from it still counts
# as a compile for the suite's no-recompile checks (``ardiff_jax._compile_events``; tests/test_compile_events.py).
# A user's own JAX_COMPILATION_CACHE_DIR wins.
_RUN_CACHE_OWNER = False
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ardiff-test-compile-cache-")
    _RUN_CACHE_OWNER = True
# Every program, however small or quick to compile (jax's defaults skip those under 1 s: nearly all of ours).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# tests/mesh needs 8 virtual devices, which must be configured before jax starts: the main
# run leaves it to tests/test_mesh.py, which runs it in a subprocess.
collect_ignore = [] if os.environ.get("ARDIFF_MESH_SUITE") == "1" else ["mesh"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _RUN_CACHE_OWNER:  # the process that made it (workers and subprocesses inherit it, so never own it)
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0 and exitstatus == 0 and not session.config.option.collectonly:
        session.exitstatus = 1
        reporter.write_line("no test passed: failing the run (see tests/conftest.py)", red=True)


#: The files that take longest (CPU seconds, ``ARDIFF_CPU_REPORT``, of the idle 2-core run of 2026-12-06 at
#: 11 min 39 s), handed out first after the mesh suite: with whole files per worker (``--dist loadfile``) a long
#: file handed out last leaves the other worker idle at the end, so the longest go first and the short ones fill in.
#: Order only: a file missing here runs after these, alphabetically, and a stale figure costs a few seconds.
LONGEST_FILES = (
    "test_self_forcing.py", "test_dreamzero_robot.py", "test_training.py", "test_benchmarks_smoke.py",  # 83-69 s
    "test_self_forcing_models.py", "test_demo.py", "test_dreamzero_pipeline.py", "test_batch_failures.py",  # 68-47
    "test_notebooks.py", "test_dreamzero_watch.py", "test_matrix_game_pipeline.py", "test_gpu_check_smoke.py",  # 44-32
    "test_dmd.py", "test_wan_video.py", "test_kv_shapes.py", "test_state_machine.py",  # 31-24
    "test_dreamzero_model.py", "test_visible_property.py", "test_batch.py", "test_wan_vae.py",  # 21-17
    "test_wan_checkpoints.py",  # 13
)


def _file_order(item: pytest.Item) -> int:
    """tests/test_mesh.py first (its subprocess then runs alongside everything), then LONGEST_FILES, then the rest."""
    name = item.path.name
    if name == "test_mesh.py":
        return -1
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Start the mesh suite's subprocess now, so it runs alongside the rest (see tests/test_mesh.py).

    Under pytest-xdist (``-n 2`` in pyproject.toml) every worker collects everything, so the worker
    that runs tests/test_mesh.py starts the subprocess itself; the file goes first, so that happens
    at the start and the other worker runs the rest meanwhile. The longest files follow
    (:data:`LONGEST_FILES`), so the run does not end on one worker alone."""
    if os.environ.get("ARDIFF_MESH_SUITE") == "1" or config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_file_order)  # stable: a file's tests keep their order
        return
    if any(item.path.name == "test_mesh.py" for item in items):
        from test_mesh import start_mesh_suite

        config.ardiff_mesh_suite = start_mesh_suite()


# -- CPU seconds per test (opt-in: ARDIFF_CPU_REPORT=path.tsv) -------------------------------------------------
# Wall-clock durations swing with the machine's load; CPU seconds (this process and the subprocesses it waited
# for) do not, so the suite's cost can be measured while other work runs. Each worker appends
# ``file<TAB>test<TAB>seconds`` rows; a module fixture's setup counts against the first test that uses it.
_CPU_REPORT = os.environ.get("ARDIFF_CPU_REPORT")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_REPORT:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
        before = _cpu_seconds()
        yield
        with open(_CPU_REPORT, "a", encoding="utf-8") as report:
            report.write(f"{item.path.name}\t{item.name}\t{_cpu_seconds() - before:.2f}\n")
