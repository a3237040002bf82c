"""Meshes and HLO checks shared by the mesh suite."""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh

#: (cfg, tp) shapes the issue asks for, plus the one-device-per-axis corner.
MESH_SHAPES = {"tp2-cfg2": (2, 2), "tp4": (1, 4), "tp8": (1, 8), "cfg2": (2, 1)}

_COLLECTIVE = re.compile(r"=\s*(.*?)\s+(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def make_mesh(shape: tuple[int, int]) -> Mesh:
    cfg, tp = shape
    return Mesh(np.array(jax.devices()[: cfg * tp]).reshape(cfg, tp), ("cfg", "tp"))


def collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """``(kind, result shapes)`` of every cross-device collective in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(match.group(1))]
            found.append((match.group(2), shapes))
    return found


def assert_no_pool_collective(hlo: str, num_pages: int, cfg: int) -> None:
    """No collective moves a pool (the only 5-d ``[L, P or P/cfg, T, H, D]`` arrays)."""
    for kind, shapes in collectives(hlo):
        for shape in shapes:
            assert not (len(shape) == 5 and shape[1] in (num_pages, num_pages // cfg)), (kind, shape)
