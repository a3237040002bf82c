"""Shared test configuration.

The suite must fail when no test ran (CI runs the README command verbatim, so the guard
lives here rather than in .ci/run).
"""

from __future__ import annotations

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0 and exitstatus == 0 and not session.config.option.collectonly:
        session.exitstatus = 1
        reporter.write_line("no test passed: failing the run (see tests/conftest.py)", red=True)
