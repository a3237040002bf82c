"""Shared test utilities: tiny specs and managers, random K/V, compile counting, jaxpr walking."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core
import numpy as np

from ardiff_jax import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCache,
    ARDiffusionKVCacheSpec,
)
from ardiff_jax._compile_events import recording_compiles

MAIN = (ARDiffusionKVBranchSpec("main", 0),)
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
SHARED = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0))

#: Plenty of memory: capacity is then ``spec.session_capacity``.
AMPLE = 10**9


def make_spec(**overrides: Any) -> ARDiffusionKVCacheSpec:
    fields: dict[str, Any] = dict(
        num_layers=2, num_kv_heads=2, head_size=4, tokens_per_frame=2, frames_per_block=2, window_frames=5,
        sink_frames=1, kv_branches=MAIN, session_capacity=2, max_scratch_tokens_per_branch=3,
    )
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def make_cache(spec: ARDiffusionKVCacheSpec | None = None, *, dtype: Any = "float32", **overrides: Any
               ) -> ARDiffusionKVCache:
    spec = make_spec(**overrides) if spec is None else spec
    cache = ARDiffusionKVCache(spec, dtype=dtype, available_memory_bytes=AMPLE, gpu_memory_fraction=1.0)
    assert cache.session_capacity == spec.session_capacity
    return cache


def text_cross(num_tokens: int = 3, num_kv_heads: int | None = None) -> ARDiffusionCrossAttentionKVSpec:
    return ARDiffusionCrossAttentionKVSpec("text", num_tokens, num_kv_heads)


def randn(rng: np.random.Generator, *shape: int, dtype: Any = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def pool_snapshot(cache: ARDiffusionKVCache) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of both pools (copies: the device buffers are donated by later commits)."""
    return np.array(cache.pools.k, copy=True), np.array(cache.pools.v, copy=True)


# -- the reference model of the visible window -------------------------------------------------------


def contract_resident(sink: int, window: int, reset: bool, committed: int) -> list[int]:
    """The reference eviction policy, applied eagerly: committed frames still resident, in order.

    ``docs/reference_behaviour.md``, "KV state" (commit and eviction).

    Skipped frames after ``committed`` frames: ``max(0, n - window - sink)`` (sliding) or
    ``max(0, n - sink)`` (``reset_at_boundary``); eviction frees table indices
    ``[sink, sink + skipped)``; the sink is never freed.
    """
    skipped = max(0, committed - sink) if reset else max(0, committed - window - sink)
    return [g for g in range(committed) if g < sink or g >= sink + skipped]


def contract_visible(sink: int, window: int, reset: bool, committed: int, num_current: int) -> list[int]:
    """The reference's visible-block selection: history frames visible beside ``num_current`` current frames.

    ``docs/reference_behaviour.md``, "Visible window".

    ``history + current`` is kept whole if it fits ``sink + window`` blocks, else its first
    ``sink`` entries followed by its last ``window`` entries.
    """
    blocks: list[int | None] = contract_resident(sink, window, reset, committed) + [None] * num_current
    max_blocks = sink + window
    if len(blocks) > max_blocks:
        blocks = blocks[:sink] + blocks[len(blocks) - (max_blocks - sink):]
    assert blocks.count(None) == num_current  # the current block always stays visible (f <= window)
    return [g for g in blocks if g is not None]


# -- compile counting ------------------------------------------------------------------------------
# ardiff_jax._compile_events is the one counter (the package's and the benchmarks'): a backend compile and a
# load from jax's persistent compilation cache, where a user turned it on, both count.


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """The names of the XLA programs compiled inside the block, one entry per program, filled as they are made."""
    names: list[str] = []
    with recording_compiles(lambda program: names.append(program.name)):
        yield names


@contextlib.contextmanager
def compiles_by_thread() -> Iterator[list[tuple[int, str]]]:
    """``(thread id, program name)`` of every XLA program compiled inside the block."""
    found: list[tuple[int, str]] = []
    with recording_compiles(lambda program: found.append((program.thread, program.name))):
        yield found


# -- jaxpr walking ---------------------------------------------------------------------------------


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    """Jaxprs held in an eqn parameter (pjit ``jaxpr``, scan ``jaxpr``, cond ``branches``, while bodies)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and, recursively, of its sub-jaxprs."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                yield from iter_eqns(sub)


def scan_pool_operands(jaxpr: Any, pool_shape: tuple[int, ...]) -> list[str]:
    """Descriptions of every ``scan`` xs operand / ys output whose shape is ``pool_shape``.

    The pools must ride in a scan's carry: as ``xs``/``ys`` they cost a pool-sized temporary.
    """
    found = []
    pool_shape = tuple(pool_shape)
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name != "scan":
            continue
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        for i, var in enumerate(eqn.invars[num_consts + num_carry:]):
            if tuple(getattr(var.aval, "shape", ())) == pool_shape:
                found.append(f"scan xs[{i}] {var.aval}")
        for i, var in enumerate(eqn.outvars[num_carry:]):
            if tuple(getattr(var.aval, "shape", ())) == pool_shape:
                found.append(f"scan ys[{i}] {var.aval}")
    return found


def next_chunk_metadata(ws: Any) -> dict[str, Any]:
    """The next ``video.chunk_metadata`` on a Starlette test WebSocket (its binary frame read and dropped);
    control messages on the way are skipped."""
    while True:
        payload = json.loads(ws.receive_text())
        if payload["type"] == "video.chunk_metadata":
            ws.receive_bytes()
            return payload
