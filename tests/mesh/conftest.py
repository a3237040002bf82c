"""The mesh suite: 8 virtual CPU devices, in a process of its own.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` only works before jax creates its
CPU backend, and the rest of the suite must keep running on one device, so these tests
are not collected by the main run: ``tests/test_mesh.py`` runs them in a subprocess with
the flag set (``ARDIFF_MESH_SUITE=1``). Run them directly with::

    ARDIFF_MESH_SUITE=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/mesh
"""

from __future__ import annotations

import os

FLAG = "--xla_force_host_platform_device_count=8"
if FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
# The suite's programs run in microseconds and every mesh shape compiles its own, so compiling is
# most of its time, and LLVM's optimisation of the generated CPU code is a third of that. Level 0
# skips only that: XLA's HLO passes (SPMD partitioning, the collectives the HLO checks read,
# fusion) run as before, and the meshed and one-device runs compared are compiled alike.
FAST_COMPILE = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " " + FAST_COMPILE).strip()

import jax  # noqa: E402  (after the flag)


def pytest_sessionstart(session) -> None:
    count = len(jax.devices())
    if count < 8:
        raise RuntimeError(f"the mesh suite needs 8 devices, jax has {count}: set XLA_FLAGS={FLAG} before jax starts")
