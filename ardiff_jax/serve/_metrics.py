"""The server's Prometheus metrics, all named ``ardiff_*``, in a registry of their own.

Each :class:`ServerMetrics` owns a ``CollectorRegistry`` (unless given one), so several
apps in one process (tests, two servers) never clash over metric names. ``render``
returns the body and content type of ``GET /metrics``.

Metrics:

* ``ardiff_sessions_resident`` (gauge): engine sessions whose KV is on the device,
  followed from the engine's session events (:meth:`ServerMetrics.on_session_event`).
* ``ardiff_sessions_connected`` (gauge): WebSocket sessions currently open.
* ``ardiff_sessions_closing`` (gauge): sessions whose engine close failed and is being
  retried (the engine may still hold them, and their slots with them).
* ``ardiff_evictions_total``: sessions pushed off the device by the LRU policy, whether
  offloaded to host memory or released.
* ``ardiff_sessions_offloaded_total`` / ``ardiff_sessions_restored_total``: moves to and
  from the host tier (a restore from a session file counts too).
* ``ardiff_interactions_total{outcome}``: client interactions, ``outcome`` one of
  ``queued``, ``duplicate``, ``rejected``.
* ``ardiff_chunks_total`` / ``ardiff_chunk_bytes_total``: chunks sent and their bytes.
* ``ardiff_chunk_latency_seconds`` (histogram, 1 ms .. 10 s): time to produce one chunk.
* ``ardiff_send_queue_depth`` (gauge): messages waiting in all sessions' send queues
  together, as last reported by the server.
* ``ardiff_send_queue_dropped_total``: messages dropped because a send queue was full.
* ``ardiff_errors_total{code}``: ``error`` messages sent to clients, by protocol code.
* ``ardiff_underruns_total``: chunks ready after their play time (the player ran dry and waited;
  the session's playback moved later by the lateness, see :mod:`ardiff_jax.serve._pacing`).
* ``ardiff_chunk_lateness_seconds`` (histogram): how late those chunks were.
* ``ardiff_batch_sessions`` (histogram): sessions per batched engine call (two or more: a single
  session's chunk is not a batch).
* ``ardiff_session_real_time_factor{request_id}`` (gauge): each streaming session's real frame
  rate over its target (1.0: it plays at its rate; below: the engine cannot keep up), over its
  last 8 chunks; removed when the session ends.
* ``ardiff_connections_refused_total{reason}``: WebSocket handshakes refused before a session,
  ``reason`` one of ``unauthorized``, ``origin_not_allowed``, ``too_many_connections``.

Updates are thread-safe: the engine's session listener runs on the engine's thread while
the server updates the rest from its event loop.
"""

from __future__ import annotations

import threading
from typing import Any

from ardiff_jax._checks import check_int, check_non_negative_int

__all__ = ["CHUNK_LATENCY_BUCKETS", "INTERACTION_OUTCOMES", "ServerMetrics"]

INTERACTION_OUTCOMES = ("queued", "duplicate", "rejected")
# Roughly x2.5 steps from 1 ms to 10 s: a tiny model's chunk takes milliseconds, a cold compile seconds.
CHUNK_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as error:
        raise ImportError("server metrics need prometheus-client; install the serve extra: "
                          "pip install 'ardiff_jax[serve]'") from error
    return prometheus_client


class ServerMetrics:
    """The ``ardiff_*`` metrics of one server, registered in ``registry`` (a new ``CollectorRegistry`` by default)."""

    def __init__(self, registry: Any = None) -> None:
        prom = _prometheus()
        self._prom = prom
        self.registry = prom.CollectorRegistry() if registry is None else registry
        r = self.registry
        self.sessions_resident = prom.Gauge("ardiff_sessions_resident", "Engine sessions with their KV on the device",
                                            registry=r)
        self.sessions_connected = prom.Gauge("ardiff_sessions_connected", "Open WebSocket video sessions",
                                             registry=r)
        self.sessions_closing = prom.Gauge("ardiff_sessions_closing",
                                           "Sessions whose engine close failed and is being retried", registry=r)
        self.evictions = prom.Counter("ardiff_evictions", "Sessions evicted from the device by the LRU policy",
                                      registry=r)
        self.sessions_offloaded = prom.Counter("ardiff_sessions_offloaded", "Sessions offloaded to host memory",
                                               registry=r)
        self.sessions_restored = prom.Counter("ardiff_sessions_restored",
                                              "Sessions made resident again from host memory or a file", registry=r)
        self.interactions = prom.Counter("ardiff_interactions", "Client interactions by outcome", ["outcome"],
                                         registry=r)
        self.chunks = prom.Counter("ardiff_chunks", "Video chunks produced (encoded and queued for their connection)", registry=r)
        self.chunk_bytes = prom.Counter("ardiff_chunk_bytes", "Bytes of video chunks produced", registry=r)
        self.chunk_latency = prom.Histogram("ardiff_chunk_latency_seconds", "Seconds to produce one chunk",
                                            buckets=CHUNK_LATENCY_BUCKETS, registry=r)
        self.send_queue_depth = prom.Gauge("ardiff_send_queue_depth",
                                           "Chunks and control messages waiting in all sessions' send queues", registry=r)
        self.send_queue_dropped = prom.Counter("ardiff_send_queue_dropped",
                                               "Chunks (metadata + media pairs) dropped because a session's send queue was full", registry=r)
        self.errors = prom.Counter("ardiff_errors", "Error messages sent to clients by code", ["code"], registry=r)
        self.underruns = prom.Counter("ardiff_underruns", "Chunks ready after their play time (the player waited)",
                                      registry=r)
        self.chunk_lateness = prom.Histogram("ardiff_chunk_lateness_seconds", "Lateness of chunks that underran",
                                             buckets=CHUNK_LATENCY_BUCKETS, registry=r)
        self.real_time_factor = prom.Gauge("ardiff_session_real_time_factor",
                                           "Real frame rate over the target, per streaming session (last 8 chunks)",
                                           ["request_id"], registry=r)
        self._rated: set[str] = set()
        self.batch_sessions = prom.Histogram("ardiff_batch_sessions", "Sessions per batched engine call",
                                             buckets=(2, 4, 8, 16, 32, 64), registry=r)
        self.connections_refused = prom.Counter("ardiff_connections_refused",
                                                "WebSocket handshakes refused before a session, by reason",
                                                ["reason"], registry=r)
        for outcome in INTERACTION_OUTCOMES:  # present at 0 from the start, so rates work from the first scrape
            self.interactions.labels(outcome=outcome)
        self._lock = threading.Lock()
        self._resident: set[str] = set()

    def observe_chunk(self, latency_s: float, nbytes: int) -> None:
        """One chunk produced (encoded and queued): ``latency_s`` seconds to produce, ``nbytes`` media bytes."""
        latency_s = float(latency_s)
        if not latency_s >= 0.0:  # also refuses NaN
            raise ValueError(f"latency_s must be a non-negative number of seconds, got {latency_s!r}")
        nbytes = check_non_negative_int("nbytes", nbytes)
        self.chunk_latency.observe(latency_s)
        self.chunks.inc()
        self.chunk_bytes.inc(nbytes)

    def observe_playback(self, request_id: str, late_s: float, real_time_factor: float | None) -> None:
        """One chunk of session ``request_id`` was ready ``late_s`` seconds after its play time (0: on time); its
        real-time factor so far (``None`` until it is measured)."""
        late_s = float(late_s)
        if not late_s >= 0.0:
            raise ValueError(f"late_s must be a non-negative number of seconds, got {late_s!r}")
        if late_s > 0.0:
            self.underruns.inc()
            self.chunk_lateness.observe(late_s)
        if real_time_factor is not None:
            with self._lock:
                self._rated.add(request_id)
                self.real_time_factor.labels(request_id=request_id).set(float(real_time_factor))

    def observe_batch(self, sessions: int) -> None:
        """One engine call generated the next chunk of ``sessions`` sessions together."""
        self.batch_sessions.observe(check_non_negative_int("sessions", sessions))

    def session_ended(self, request_id: str) -> None:
        """Session ``request_id`` ended: its real-time factor is no longer reported (idempotent)."""
        with self._lock:
            if request_id in self._rated:
                self._rated.discard(request_id)
                self.real_time_factor.remove(request_id)

    def interaction(self, outcome: str) -> None:
        """One client interaction answered with ``outcome`` (``queued``, ``duplicate`` or ``rejected``)."""
        if outcome not in INTERACTION_OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(INTERACTION_OUTCOMES)}, got {outcome!r}")
        self.interactions.labels(outcome=outcome).inc()

    def error(self, code: str) -> None:
        """One ``error`` message with protocol ``code`` sent to a client."""
        if not isinstance(code, str) or not code:
            raise ValueError(f"code must be a non-empty string, got {code!r}")
        self.errors.labels(code=code).inc()

    def refused(self, reason: str) -> None:
        """One WebSocket handshake refused before a session (``reason``: the refusal's snake-case label)."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        self.connections_refused.labels(reason=reason).inc()

    def set_send_queue_depth(self, depth: int) -> None:
        """The total number of messages now waiting in all sessions' send queues."""
        self.send_queue_depth.set(check_non_negative_int("depth", depth))

    def dropped(self, count: int = 1) -> None:
        """``count`` chunks (metadata + media pairs) dropped from a full send queue."""
        self.send_queue_dropped.inc(check_non_negative_int("count", count))

    def set_closing(self, count: int) -> None:
        """The number of sessions whose engine close failed and has not succeeded since."""
        self.sessions_closing.set(check_non_negative_int("count", count))

    def connected(self, delta: int) -> None:
        """A WebSocket session opened (``+1``) or closed (``-1``)."""
        self.sessions_connected.inc(check_int("delta", delta))

    def on_session_event(self, event: Any) -> None:
        """Follow one engine :class:`~ardiff_jax.SessionEvent` (add this as a session listener).

        Residency is tracked by session id: ``created`` and ``restored`` make a session
        resident, ``offloaded`` and ``released`` end it. A ``released`` event also arrives
        for a session dropped from the host tier, which was not resident; tracking ids keeps
        the gauge right there, where counting events would not.
        """
        kind, session_id, reason = event.kind, event.session_id, event.reason
        with self._lock:
            if kind in ("created", "restored"):
                self._resident.add(session_id)
            elif kind in ("offloaded", "released"):
                self._resident.discard(session_id)
            else:
                raise ValueError(f"unknown session event kind {kind!r} (session {session_id!r})")
            self.sessions_resident.set(len(self._resident))
        if kind in ("offloaded", "released") and reason == "lru_eviction":
            self.evictions.inc()
        if kind == "offloaded":
            self.sessions_offloaded.inc()
        elif kind == "restored":
            self.sessions_restored.inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
