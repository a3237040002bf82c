"""``SessionTable``: the runner's session policy, host-only and testable without a device.

It decides, never executes: which sessions are resident in which order of use, whether a
new one fits, which resident session an admission evicts (the least recently used one
that is not pinned), and which sessions are pinned (the one bound to the running
invocation, and any a serving layer pins). The runner shell (``_runner.py``) asks it and
then does the work: releases KV, calls pipeline hooks, binds states, waits for devices.

Entries are opaque to the table (the runner stores its ``ARDiffusionKVState`` handles).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

from ardiff_jax._checks import check_positive_int

__all__ = ["SessionTable"]

Entry = TypeVar("Entry")


class SessionTable(Generic[Entry]):
    """Resident sessions in least-recently-used order, with a capacity and pins.

    Args:
      capacity: the most sessions that may be resident at once (``>= 1``).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = check_positive_int("SessionTable capacity", capacity)
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._pins: collections.Counter[str] = collections.Counter()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    @property
    def lru_order(self) -> tuple[str, ...]:
        """Resident session ids, least recently used first."""
        return tuple(self._entries)

    def get(self, session_id: str) -> Entry | None:
        return self._entries.get(session_id)

    def touch(self, session_id: str) -> Entry:
        """Mark a resident session most recently used and return its entry (KeyError if absent)."""
        entry = self._entries[session_id]
        self._entries.move_to_end(session_id)
        return entry

    def eviction_victims(self) -> list[str]:
        """The sessions to release, oldest first, so that one more session fits.

        RuntimeError when the sessions that would have to go are pinned: admitting the new
        session would evict a session that is in use.
        """
        excess = len(self._entries) + 1 - self._capacity
        if excess <= 0:
            return []
        if not self._pins:  # the common case: the oldest `excess` sessions, without a pin lookup each
            return list(itertools.islice(self._entries, excess))
        victims = [sid for sid in self._entries if not self._pins[sid]][:excess]
        if len(victims) < excess:
            pinned = [sid for sid in self._entries if self._pins[sid]]
            raise RuntimeError(
                f"AR-Diffusion cannot admit another session: all {self._capacity} slots are held and sessions "
                f"{pinned} are pinned (in use)")
        return victims

    def add(self, session_id: str, entry: Entry) -> None:
        """Insert a new session as most recently used (it must fit: evict the victims first)."""
        if session_id in self._entries:
            raise ValueError(f"AR-Diffusion session {session_id!r} is already resident")
        if len(self._entries) >= self._capacity:
            raise RuntimeError(f"AR-Diffusion session table is full ({self._capacity}); evict before adding")
        self._entries[session_id] = entry

    def remove(self, session_id: str) -> Entry | None:
        """Forget a session (and its pins); its entry, or ``None`` if it was not resident."""
        self._pins.pop(session_id, None)
        return self._entries.pop(session_id, None)

    def pin(self, session_id: str) -> None:
        """Protect a resident session from eviction until a matching :meth:`unpin` (pins nest)."""
        if session_id not in self._entries:
            raise KeyError(f"AR-Diffusion session {session_id!r} is not resident")
        self._pins[session_id] += 1

    def unpin(self, session_id: str) -> None:
        if self._pins[session_id] <= 1:
            self._pins.pop(session_id, None)
        else:
            self._pins[session_id] -= 1

    def is_pinned(self, session_id: str) -> bool:
        return self._pins[session_id] > 0
