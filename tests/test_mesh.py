"""Runs ``tests/mesh`` (sharded pools, attention, pipelines on 8 virtual CPU devices) in a subprocess.

The device count is fixed when jax starts, so the mesh tests cannot share this process
(the rest of the suite runs on one device); see ``tests/mesh/conftest.py``. The
subprocess starts as soon as collection selects this test (``tests/conftest.py``), so it
runs while the rest of the suite does; the test waits for it and reports its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLAG = "--xla_force_host_platform_device_count=8"


def start_mesh_suite() -> tuple[subprocess.Popen, Path]:
    """Start ``pytest tests/mesh`` on 8 virtual devices; its output goes to a temporary file."""
    env = dict(os.environ, ARDIFF_MESH_SUITE="1", XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip())
    log = Path(tempfile.mkstemp(prefix="ardiff-mesh-suite-", suffix=".log")[1])
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                    "tests/mesh"],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return process, log


def test_mesh_suite_on_eight_virtual_devices(request: pytest.FixtureRequest):
    started = getattr(request.config, "ardiff_mesh_suite", None)
    process, log = started if started is not None else start_mesh_suite()
    try:
        returncode = process.wait(timeout=1200)
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    log.unlink(missing_ok=True)
    assert returncode == 0, output[-12000:]
    assert " passed" in output and "failed" not in output, output[-12000:]
    print(output.strip().splitlines()[-1])
