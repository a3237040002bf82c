"""Shared test configuration.

The suite must fail when no test ran (CI runs the README command verbatim, so the guard
lives here rather than in .ci/run).
"""

from __future__ import annotations

import os

# Eight host devices let sharding tests run on CPU; set before jax initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0 and exitstatus == 0 and not session.config.option.collectonly:
        session.exitstatus = 1
        reporter.write_line("no test passed: failing the run (see tests/conftest.py)", red=True)
