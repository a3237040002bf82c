"""Sessions off the device: the record of an offloaded session and the host tier that bounds them.

An :class:`OffloadedSession` is everything needed to continue a session exactly: its
:class:`~ardiff_jax.runtime.SessionKV` value (cursors, run owners, cross caches), the
pages of its slot (every local branch's sink + ring, K and V, all layers) and the
pipeline's exported model-owned state, with every array in host memory. The runner builds
one when the LRU evicts a session (``EngineConfig(host_offload_bytes > 0)``) or when
``save_session`` writes one to disk; restoring it is one donated in-place write of the
pages into a free slot plus the pipeline's import.

Host memory means the device's ``pinned_host`` memory kind where the backend has one
(CPU, CUDA and TPU in the jax versions we support): ``jax.device_put`` to it is an
asynchronous DMA that the next computation overlaps, and copying back is a plain
``device_put``. A backend without it gets numpy copies (synchronous).

:class:`HostSessionTier` is policy only, like :class:`~ardiff_jax.runtime.SessionTable`:
offloaded sessions in least-recently-used order with a byte budget; it decides which
records an admission drops, the runner executes (close hooks, events).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ardiff_jax._checks import check_non_negative_int
from ardiff_jax.kv import KVPools
from ardiff_jax.runtime._session import CrossAttentionKV, SessionKV

__all__ = ["HostSessionTier", "OffloadedSession", "device_memory", "host_memory_kind", "to_device", "to_host",
           "tree_nbytes"]

#: The memory kind offloaded arrays live in, where the device has it.
PINNED_HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class OffloadedSession:
    """One session held off the device: enough to continue it exactly.

    Attributes:
      session: the session's bookkeeping (cursors, run owners, cross caches as host
        arrays); ``session.slot`` is the slot it left, replaced on restore.
      pages: the slot's pages, ``KVPools`` of host arrays ``storage[L, R*(K+W), T, H, D]``
        (``R`` local branches, each sink + ring).
      pipeline_state: what the pipeline's ``export_ar_diffusion_session`` returned, its
        arrays in host memory.
      nbytes: host bytes of the pages, the cross caches and the pipeline state's arrays.
    """

    session: SessionKV
    pages: KVPools
    pipeline_state: Any
    nbytes: int

    @property
    def session_id(self) -> str:
        return self.session.session_id

    def renamed(self, session_id: str) -> OffloadedSession:
        """The same record under another session id (``load_session(path, session_id=...)``)."""
        return dataclasses.replace(self, session=dataclasses.replace(self.session, session_id=session_id))


def host_memory_kind(device: jax.Device) -> str | None:
    """``"pinned_host"`` when ``device`` can address it, else ``None`` (numpy copies)."""
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # pragma: no cover - a backend without the memories API
        return None
    return PINNED_HOST if PINNED_HOST in kinds else None


def device_memory(placement: Any) -> jax.sharding.Sharding:
    """``placement`` (a device or a sharding) in device memory: ``device_put`` to a bare device refuses host arrays."""
    if isinstance(placement, jax.sharding.Sharding):
        return placement.with_memory_kind(_device_kind(placement))
    return jax.sharding.SingleDeviceSharding(placement)


def _device_kind(sharding: jax.sharding.Sharding) -> str:
    return next(iter(sharding.device_set)).default_memory().kind


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def to_host(tree: Any, device: jax.Device) -> Any:
    """Every array of ``tree`` copied to host memory (asynchronously where the device allows).

    jax arrays go to the ``pinned_host`` memory of the devices they are on, keeping their
    layout (an array split over a mesh stays split, each device's part in its own host
    memory); typed PRNG keys included. ``device`` says whether that memory kind exists.
    numpy arrays are copied, so the record never aliases a caller's buffer. Other leaves
    (ints, strings, ``None``) are kept.
    """
    kind = host_memory_kind(device)

    def move(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            if kind is not None:
                return jax.device_put(leaf, leaf.sharding.with_memory_kind(kind))
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # pragma: no cover - no pinned_host
                return leaf  # a key is a few bytes; numpy cannot hold one
            return np.array(leaf)  # pragma: no cover - backends without pinned_host
        if isinstance(leaf, (np.ndarray, np.generic)):
            return np.array(leaf)
        return leaf

    return jax.tree_util.tree_map(move, tree)


def to_device(tree: Any, placement: Any, *, numpy_too: bool = False) -> Any:
    """Every jax array of ``tree`` back in device memory; numpy leaves stay numpy unless ``numpy_too``.

    ``placement`` is a device or a sharding (on a mesh: replicated over it). An array
    already on exactly those devices (what :func:`to_host` made) keeps its layout and only
    moves to device memory; any other array is placed at ``placement``.
    """
    target = device_memory(placement)
    kind = _device_kind(target)

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return jax.device_put(leaf, target) if numpy_too and isinstance(leaf, np.ndarray) else leaf
        if leaf.sharding.device_set == target.device_set:
            return jax.device_put(leaf, leaf.sharding.with_memory_kind(kind))
        return jax.device_put(leaf, target)

    return jax.tree_util.tree_map(move, tree)


def tree_nbytes(tree: Any) -> int:
    """Bytes of the arrays in ``tree`` (a typed PRNG key counts its key data)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            total += int(jax.random.key_data(leaf).nbytes)
        elif _is_array(leaf):
            total += int(np.asarray(leaf).nbytes) if isinstance(leaf, np.generic) else int(leaf.nbytes)
    return total


def record_nbytes(session: SessionKV, pages: KVPools, pipeline_state: Any) -> int:
    return int(pages.k.nbytes + pages.v.nbytes) + int(session.cross_attention_bytes) + tree_nbytes(pipeline_state)


def host_cross_attention(session: SessionKV, device: jax.Device) -> SessionKV:
    """``session`` with its cross caches copied to host memory."""
    cross = {key: CrossAttentionKV(*to_host((kv.k, kv.v), device)) for key, kv in session.cross_attention.items()}
    return dataclasses.replace(session, cross_attention=cross)


class HostSessionTier:
    """Offloaded sessions in least-recently-used order, bounded by bytes.

    Args:
      capacity_bytes: host bytes the tier may hold (0: the tier holds nothing).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity_bytes = check_non_negative_int("host tier capacity", capacity_bytes)
        self._records: collections.OrderedDict[str, OffloadedSession] = collections.OrderedDict()
        self._bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._records))

    @property
    def lru_order(self) -> tuple[str, ...]:
        """Offloaded session ids, least recently offloaded first."""
        return tuple(self._records)

    def get(self, session_id: str) -> OffloadedSession | None:
        return self._records.get(session_id)

    def fits(self, nbytes: int) -> bool:
        """Whether a record of ``nbytes`` can be held at all (with every other record dropped)."""
        return 0 < nbytes <= self._capacity_bytes

    def admission_victims(self, nbytes: int) -> list[str]:
        """The records to drop, oldest first, so that one of ``nbytes`` fits (it must :meth:`fits`)."""
        victims: list[str] = []
        free = self._capacity_bytes - self._bytes
        for session_id, record in self._records.items():
            if free >= nbytes:
                break
            victims.append(session_id)
            free += record.nbytes
        return victims

    def add(self, record: OffloadedSession) -> None:
        """Hold ``record`` as most recent; drop the :meth:`admission_victims` first."""
        if record.session_id in self._records:
            raise ValueError(f"AR-Diffusion session {record.session_id!r} is already offloaded")
        if self._bytes + record.nbytes > self._capacity_bytes:
            raise RuntimeError(f"AR-Diffusion host tier is full ({self._bytes} of {self._capacity_bytes} bytes); "
                               "drop the admission victims first")
        self._records[record.session_id] = record
        self._bytes += record.nbytes

    def pop(self, session_id: str) -> OffloadedSession | None:
        """Take a record out (restore, close, drop); ``None`` if the session is not offloaded."""
        record = self._records.pop(session_id, None)
        if record is not None:
            self._bytes -= record.nbytes
        return record
