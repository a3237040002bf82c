"""Peer KV caches behind one small interface, so the harness times them identically.

Every peer stores the self-attention KV of ONE branch of one session for all layers, with
a sink of ``K`` frames and a window such that one forward sees at most ``K + W`` video
frames *including* its ``F`` current frames (the runtime's semantics: after a commit the
next forward sees the sink plus the newest ``W - F`` committed frames plus its own block).

Interface (:class:`PeerCache`):

* ``make_block(seed)`` -> ``(k, v)``: one block in the peer's native array type,
  ``[L, F*T, H, D]``; made once, outside the timed region.
* ``commit_block(k, v)``: append one block of every layer (evicting what falls out).
* ``read_visible()``: for every layer, hand the arrays attention would receive (a view, a
  sliced and masked run, a materialized window) to the same jitted float32 sum, one call
  per layer: every visible byte is read once with one reduction kernel for all peers
  (torch views reach JAX zero-copy through DLPack). What differs between peers is only
  what their layout makes attention do to get its input. This stands for the KV read of
  attention without the attention math.
* ``visible_kv(layer)`` -> ``(k, v)``: the committed history the next forward sees for one
  layer, as numpy float32 ``[n*T, H, D]`` (for the cross-peer correctness check, not timed).
* ``sync(out)``: wait until dispatched work is done.

Peers: ``ardiff_jax`` (the runtime itself), ``selfforcing_torch`` (+ ``_pipeline``),
``naive_jax``, ``nodonate_jax``. PyTorch is optional: :func:`available_peers` leaves the
torch peers out when it is not installed.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
from typing import Any

import numpy as np

__all__ = ["PeerCache", "PeerGeometry", "available_peers", "make_peer", "sum_f32", "PEER_NAMES"]


def _sum_f32(*arrays: Any) -> Any:
    import jax.numpy as jnp

    total = jnp.zeros((), jnp.float32)
    for x in arrays:
        total = total + jnp.sum(x, dtype=jnp.float32)
    return total


def sum_f32(*arrays: Any) -> Any:
    """The shared read reduction: float32 sum of every element, jitted (compiled per shape)."""
    global _sum_f32_jit
    if _sum_f32_jit is None:
        import jax

        _sum_f32_jit = jax.jit(_sum_f32)
    return _sum_f32_jit(*arrays)


_sum_f32_jit: Any = None


@dataclasses.dataclass(frozen=True)
class PeerGeometry:
    """The per-branch KV geometry every peer is built for."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_block: int
    sink_frames: int
    window_frames: int
    dtype: str = "bfloat16"

    @property
    def block_tokens(self) -> int:
        return self.frames_per_block * self.tokens_per_frame

    @property
    def visible_frames(self) -> int:
        """Video frames one forward reads, its current block included: ``K + W``."""
        return self.sink_frames + self.window_frames

    @property
    def history_frames(self) -> int:
        """Committed frames visible to the next forward once the window is full: ``K + W - F``."""
        return self.visible_frames - self.frames_per_block

    @property
    def frame_bytes(self) -> int:
        """Bytes of one frame of K and V for all layers in the logical dtype."""
        itemsize = np.dtype(np.float16).itemsize if self.dtype in ("bfloat16", "float16") else np.dtype(
            self.dtype).itemsize
        return 2 * self.num_layers * self.tokens_per_frame * self.num_kv_heads * self.head_size * itemsize

    @classmethod
    def from_spec(cls, spec: Any, dtype: str = "bfloat16") -> PeerGeometry:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_size, spec.tokens_per_frame,
                   spec.frames_per_block, spec.sink_frames, spec.window_frames, dtype)


class PeerCache(abc.ABC):
    """One branch's KV cache for all layers; see the module docstring for the contract."""

    name: str = "peer"

    def __init__(self, geometry: PeerGeometry) -> None:
        if geometry.frames_per_block > geometry.window_frames:
            raise ValueError("frames_per_block must not exceed window_frames")
        self.geometry = geometry

    def block_values(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Deterministic float32 ``[L, F*T, H, D]`` K and V (converted by each peer)."""
        g = self.geometry
        rng = np.random.default_rng(seed)
        shape = (g.num_layers, g.block_tokens, g.num_kv_heads, g.head_size)
        return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)

    def make_block(self, seed: int) -> tuple[Any, Any]:
        return self.from_numpy(*self.block_values(seed))

    @abc.abstractmethod
    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        """Convert float32 numpy blocks into the peer's native block arrays."""

    @abc.abstractmethod
    def commit_block(self, k: Any, v: Any) -> None: ...

    @abc.abstractmethod
    def read_visible(self) -> Any: ...

    @abc.abstractmethod
    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]: ...

    def sync(self, out: Any = None) -> None:
        """Wait for dispatched work (torch on CPU is synchronous; its reads return JAX arrays)."""
        from benchmarks.common import sync

        sync(out)

    def close(self) -> None:  # noqa: B027
        """Drop device buffers."""


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


#: Every peer the harness knows, in plot order.
PEER_NAMES = ("ardiff_jax", "selfforcing_torch", "selfforcing_torch_pipeline", "naive_jax", "nodonate_jax")


def available_peers() -> list[str]:
    """The peers runnable here (the torch ones need PyTorch)."""
    torch_ok = _has_torch()
    return [name for name in PEER_NAMES if torch_ok or not name.startswith("selfforcing_torch")]


def make_peer(name: str, geometry: PeerGeometry) -> PeerCache:
    """Construct a peer by name; imports lazily so PyTorch is only needed for its peers."""
    if name == "ardiff_jax":
        from benchmarks.peers.ardiff import ArdiffRuntimeCache
        return ArdiffRuntimeCache(geometry)
    if name == "selfforcing_torch":
        from benchmarks.peers.selfforcing_torch import SelfForcingTorchCache
        return SelfForcingTorchCache(geometry)
    if name == "selfforcing_torch_pipeline":
        from benchmarks.peers.selfforcing_torch import SelfForcingTorchCache
        return SelfForcingTorchCache(geometry, rewrites_per_block=4)
    if name == "naive_jax":
        from benchmarks.peers.naive_jax import NaiveJaxCache
        return NaiveJaxCache(geometry)
    if name == "nodonate_jax":
        from benchmarks.peers.nodonate_jax import NoDonateJaxCache
        return NoDonateJaxCache(geometry)
    raise KeyError(f"unknown peer {name!r}; choose from {PEER_NAMES}")
