"""Runs ``tests/mesh`` (sharded pools, attention, pipelines on 8 virtual CPU devices) in a subprocess.

The device count is fixed when jax starts, so the mesh tests cannot share this process
(the rest of the suite runs on one device); see ``tests/mesh/conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mesh_suite_on_eight_virtual_devices():
    env = dict(os.environ, ARDIFF_MESH_SUITE="1",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mesh"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=1200)
    report = result.stdout[-8000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert " passed" in result.stdout and "failed" not in result.stdout, report
    print(result.stdout.strip().splitlines()[-1])
