"""``EventLog``: the runner's session events, queued under its lock and delivered outside it.

One thing only: the listeners, the events the runner produced while it held its lock, and
their delivery once the outermost holder let go. Listeners run outside the lock (a slow or
re-entrant listener cannot stall or deadlock the runner), one event at a time, in the order
the runner produced them, whichever thread happens to deliver them. No pipeline code, no
session state: the runner says what happened, this delivers it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable

__all__ = ["EventLog", "SessionEvent", "WARMUP_SESSION_ID"]

logger = logging.getLogger("ardiff_jax.runtime")

#: Session id under which warmup requests run; released after warmup.
WARMUP_SESSION_ID = "__ardiffusion_warmup__"


@dataclasses.dataclass(frozen=True)
class SessionEvent:
    """A session lifecycle event, delivered to listeners added with ``add_session_listener``.

    ``kind`` is one of:

    * ``"created"``: a new session became resident;
    * ``"released"`` (KV or host copy dropped, before the pipeline hook), ``reason`` one of
      ``"reset"``, ``"close"``, ``"lru_eviction"``, ``"forward_exception"``,
      ``"warmup_complete"``, ``"pools_lost"``, ``"host_eviction"`` (dropped from the
      host tier), ``"restore_failed"``, ``"save_failed"``;
    * ``"offloaded"``: moved to the host tier (``reason`` ``"lru_eviction"``: to make room for a
      new session, a restore or a fork; ``"requested"``: ``offload_session``);
    * ``"restored"``: resident again, from the host tier (``reason`` ``"offload"``) or
      from a file (``"load"``).
    """

    kind: str
    session_id: str
    reason: str | None = None


class EventLog:
    """Listeners, the events queued under the runner lock, and their in-order delivery after it.

    ``queued`` is read by the runner lock on every exit (a plain list: the check costs one
    attribute read on the tick path); only :meth:`emit` appends to it and only
    :meth:`hand_over` empties it, both under the runner lock.
    """

    def __init__(self) -> None:
        self.queued: list[SessionEvent] = []
        self._listeners: list[Callable[[SessionEvent], None]] = []
        # Events leave the lock in lock order and are delivered by one thread at a time.
        self._delivery: collections.deque[SessionEvent] = collections.deque()
        self._delivery_lock = threading.Lock()
        self._delivering = False

    def add_listener(self, listener: Callable[[SessionEvent], None]) -> None:
        if not callable(listener):
            raise TypeError(f"session listeners must be callable, got {type(listener).__name__}")
        self._listeners.append(listener)

    def emit(self, kind: str, session_id: str, reason: str | None = None) -> None:
        """Queue an event (under the runner lock); nothing is queued while nobody listens."""
        # Warmup sessions are the runner's own (a background compile runs them beside listeners): no events.
        if self._listeners and not session_id.startswith(WARMUP_SESSION_ID):
            self.queued.append(SessionEvent(kind, session_id, reason))

    def hand_over(self) -> None:
        """Move the queued events to the delivery queue; called under the runner lock, keeping lock order."""
        with self._delivery_lock:
            self._delivery.extend(self.queued)
        self.queued = []

    def deliver(self) -> None:
        """Deliver handed-over events in order; only one thread (and frame) delivers at a time.

        A listener that calls the engine, or another thread finishing a call meanwhile, only
        appends to the queue: the active deliverer drains it, so every listener sees every
        event exactly once and in the order the runner produced them.
        """
        with self._delivery_lock:
            if self._delivering:
                return
            self._delivering = True
        try:
            while True:
                with self._delivery_lock:
                    if not self._delivery:
                        self._delivering = False
                        return
                    event = self._delivery.popleft()
                for listener in list(self._listeners):
                    try:
                        listener(event)
                    except Exception:  # a metrics hook must never break the runtime
                        logger.exception("AR-Diffusion session listener failed on %s", event)
        except BaseException:
            with self._delivery_lock:
                self._delivering = False
            raise
