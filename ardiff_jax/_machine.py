"""The machine a figure was measured on: every speed figure the package writes names it."""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["machine_summary"]


def machine_summary() -> dict[str, Any]:
    """The CPU this runs on (its model name and cores) and the first JAX device."""
    import jax

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "device": str(jax.devices()[0])}
