"""``create_app``: the Starlette app of ``ardiff-jax serve`` (see :mod:`ardiff_jax.serve` for the design)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import importlib.resources
import itertools
import logging
import math
import statistics
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ardiff_jax._checks import check_non_negative_int, check_positive_int
from ardiff_jax.realtime import (
    ARDiffusionEventQueueFullError,
    ARDiffusionSessionError,
    ARDiffusionSessionEvent,
    ARDiffusionSessionManager,
    EngineSessionLifecycle,
    EngineTickConsumer,
)
from ardiff_jax.serve._access import (
    ConnectionCounter,
    ServerAccess,
    client_address,
    deny_websocket,
    metrics_refusal,
    redacted_tokens_in_uvicorn_logs,
    refusal_response,
    websocket_refusal,
)
from ardiff_jax.serve._connection import (
    Connection,
    ConnectionState,
    SessionRecord,
    Stream,
)
from ardiff_jax.serve._encode import make_encoder
from ardiff_jax.serve._metrics import ServerMetrics
from ardiff_jax.serve._pacing import PlaybackClock
from ardiff_jax.serve._protocol import (
    ProtocolError,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    error_message,
    parse_client_message,
)
from ardiff_jax.serve._send_queue import SendQueue, drain_to_websocket, until_first_ends
from ardiff_jax.serve._world import ServedWorld, StartPlan

__all__ = ["REALTIME_VIDEO_PATH", "ServerSettings", "create_app"]

logger = logging.getLogger(__name__)

REALTIME_VIDEO_PATH = "/v1/realtime/video"
_S = ConnectionState


def close_retry_delays(first_s: float = 0.05, max_s: float = 2.0, attempts: int = 40) -> tuple[float, ...]:
    """A bounded backoff: ``first_s`` doubling up to ``max_s``, ``attempts`` delays (0.05 s .. 2 s, 40: ~72 s)."""
    return tuple(min(first_s * 2**k, max_s) for k in range(attempts))


#: Seconds between the retries of a failed engine close (after the first attempt). A transient failure
#: must not cost a slot until restart: the close is retried until it succeeds (the engine releases the
#: session, its slot frees); past the last delay it is given up, logged, and tried again only when a
#: start finds the server full while the engine still holds the session.
CLOSE_RETRY_DELAYS_S = close_retry_delays()
#: WebSocket close codes.
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Limits of one server (every bound a hostile client could otherwise push).

    Attributes:
      max_message_bytes: largest client text frame (UTF-8 bytes) read; larger -> ``message_too_large``.
      start_timeout_s: a connection must start a session within this (``start_timeout``, then closed).
      stall_timeout_s: a started session whose client takes nothing (no chunk, no reply: its sends do not
        complete) for this long is reported (``stall``) and closed, whatever the server produced for it.
      close_timeout_s: a closing connection (``session.done`` or an error queued, then the close) is
        dropped, without what is left, when its client takes nothing for this long.
      max_pending_events: interactions queued per session before the next chunk; beyond ->
        ``interaction_rejected``.
      max_queued_chunks: media pairs waiting per connection; while they wait, generation for that session
        pauses.
      max_queued_control: control messages waiting per connection; beyond, that connection's reader waits
        (and an ``interaction_failed`` of a failed chunk, which the generation loop cannot wait to queue,
        is dropped; the final ``generation_failed`` still goes).
      capacity: sessions served at once (``None``: the engine's resident capacity, plus its host
        tier's when host offload is on; a larger value is clamped to that, with a warning).
      lookahead_chunks: chunks a session may have generated beyond the one its client is playing
        (pacing, see :mod:`ardiff_jax.serve._pacing`): with 1, chunk ``k + 1`` is generated while chunk
        ``k`` plays, so an action shows within two chunk intervals. 0 generates each chunk when it is
        needed (every chunk then arrives one generation late).
      paced: generate each session's chunks just in time for playback at its frame rate (the default).
        ``False`` generates as fast as the engine goes (offline use, throughput benchmarks); rates and
        underruns are measured either way.
      batch_ticks: sessions due at the same time get their chunks from one ``engine.generate_batch`` call (one
        forward for all of them where the pipeline batches; at most the engine's resident capacity per
        call); ``False``, or an engine without ``generate_batch`` (a router), makes them one by one.
      fps_samples: chunk timings from which the engine's sustained frame rate is estimated (the median
        seconds per frame of the last this many chunks); a session asking for more frames per second than
        that is clamped to it once this many chunks were timed.
    """

    max_message_bytes: int = 64 * 1024
    start_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0
    close_timeout_s: float = 5.0
    max_pending_events: int = 16
    max_queued_chunks: int = 8
    max_queued_control: int = 64
    capacity: int | None = None
    lookahead_chunks: int = 1
    paced: bool = True
    fps_samples: int = 8
    batch_ticks: bool = True

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_pending_events", "max_queued_chunks", "max_queued_control"):
            check_positive_int(f"ServerSettings {name}", getattr(self, name))
        for name in ("start_timeout_s", "stall_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerSettings {name} must be a positive number of seconds, got {value!r}")
        if self.capacity is not None:
            check_positive_int("ServerSettings capacity", self.capacity)
        check_non_negative_int("ServerSettings lookahead_chunks", self.lookahead_chunks)
        check_positive_int("ServerSettings fps_samples", self.fps_samples)
        for name in ("paced", "batch_ticks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ServerSettings {name} must be a bool, got {getattr(self, name)!r}")


def _playback(conn: Connection) -> PlaybackClock:
    """A streaming connection's playback clock (its stream is attached before it streams)."""
    stream = conn.record.stream
    assert stream is not None, f"connection {conn.request_id} is {conn.state.value} without a stream"
    return stream.playback


class _EngineHeld:
    """The session ids the engine holds (resident or in its host tier), followed from its session events.

    The engine's own count, not the server's: a session whose close failed may still be held, and
    the engine would evict a live session to admit another beyond its capacity. Events come from the
    engine's thread (inside its calls); the server reads the set on its event loop.
    """

    def __init__(self, engine: Any) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        engine.runner.add_session_listener(self.on_session_event)
        with self._lock:  # what the engine held before this server (another server's, or a caller's sessions)
            self._ids.update(engine.sessions)
            self._ids.update(getattr(engine, "offloaded_sessions", ()))

    def on_session_event(self, event: Any) -> None:
        with self._lock:
            if event.kind in ("created", "restored"):
                self._ids.add(event.session_id)
            elif event.kind == "released":  # "offloaded" keeps it: the host tier holds it
                self._ids.discard(event.session_id)

    def ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._ids)


class _Server:
    def __init__(self, engine: Any, world: ServedWorld, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.world = world
        self.settings = settings
        self.metrics = metrics
        plan = engine.memory_plan
        host = plan.host_session_capacity if getattr(plan, "host_offload_bytes", 0) else 0
        held = engine.session_capacity + host
        if settings.capacity is not None and settings.capacity > held:
            # Clamped, not refused: the engine plans its capacity against the memory free when it is built, so
            # the same settings can meet a smaller plan on another device or a busier one. Serving what stays
            # resident (reported by /healthz) keeps such a server up; admitting more would LRU-evict live players.
            logger.warning("ServerSettings capacity %d is above the %d sessions the engine holds (%d resident + "
                           "%d in its host tier): serving %d", settings.capacity, held, engine.session_capacity,
                           host, held)
        self.capacity = held if settings.capacity is None else min(settings.capacity, held)
        self.connections: set[Connection] = set()
        self.plans: dict[str, StartPlan] = {}
        # Per session: what the world remembers between ticks (the last frame sent, a camera move's start).
        self.world_states: dict[str, dict[str, Any]] = {}
        self.queue_depth = 0
        self.engine_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ardiff-serve-engine")
        self.encode_executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ardiff-serve-encode")
        # Start pictures are decoded here, never on the event loop (nor on the encoders, which every session needs).
        self.decode_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ardiff-serve-image")
        self.held = _EngineHeld(engine)
        # Sessions whose engine close failed and has not succeeded since; the engine may still hold them
        # (/healthz reports them as closing, and so does the ardiff_sessions_closing gauge).
        self.unclosed: set[str] = set()
        self.close_retries: dict[str, asyncio.Task] = {}
        self.consumer = EngineTickConsumer(
            engine, executor=self.engine_executor,
            inputs_provider=lambda tick: world.inputs(tick, self.plans[tick.session_id],
                                                      self.world_states.setdefault(tick.session_id, {})),
            prompt_provider=lambda tick: world.prompt(tick, self.plans[tick.session_id]))
        self.lifecycle = EngineSessionLifecycle(engine, executor=self.engine_executor)
        self.manager: ARDiffusionSessionManager = ARDiffusionSessionManager(
            tick_consumer=self.consumer, lifecycle=self.lifecycle, max_pending_events=settings.max_pending_events)
        self.wake: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None
        self.background: set[asyncio.Task] = set()
        self.busy_since: float | None = None  # the generation loop works on one session's chunk since then
        self.connection_order = itertools.count()
        # Sessions due together are generated in one engine call, up to what the engine holds resident at once.
        batching = settings.batch_ticks and callable(getattr(engine, "generate_batch", None))
        self.batch_limit = max(1, engine.session_capacity) if batching else 1
        # Engine seconds per generated frame of the last chunks: what one session can sustain (see fps_limit).
        self.frame_seconds: collections.deque[float] = collections.deque(maxlen=settings.fps_samples)

    # -- lifespan ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.wake = asyncio.Event()
        self.loop_task = asyncio.create_task(self._generation_loop(), name="ardiff-serve-generation")

    async def stop(self) -> None:
        for conn in list(self.connections):
            await self._release(conn)
        # A close still failing would hold shutdown for its whole backoff; the engine closes its sessions anyway.
        for session_id, retry in list(self.close_retries.items()):
            if not retry.done():
                logger.warning("shutting down: the close of session %s is no longer retried", session_id)
                retry.cancel()
        while self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        self.decode_executor.shutdown(wait=True)
        self.encode_executor.shutdown(wait=True)
        self.engine_executor.shutdown(wait=True)

    def status(self) -> str:
        """``/healthz`` status: ``stopped`` (no generation loop), ``stalled`` (one chunk has been in progress
        for over ``stall_timeout_s``: every session waits), else ``ok``."""
        if self.loop_task is None or self.loop_task.done():
            return "stopped"
        busy_since = self.busy_since
        if busy_since is not None and time.monotonic() - busy_since > self.settings.stall_timeout_s:
            return "stalled"
        return "ok"

    # -- helpers ----------------------------------------------------------------------------------------
    def _spawn(self, coroutine: Any) -> asyncio.Task:
        """A server-owned task: cleanup must finish even when the connection's handler is cancelled."""
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def _on_depth(self, delta: int) -> None:
        self.queue_depth += delta
        self.metrics.set_send_queue_depth(self.queue_depth)

    async def _error(self, conn: Connection, code: str, message: str, event_id: str | None = None) -> None:
        """A reply to the connection's own message: waits for room, throttling that client's input only."""
        if await conn.queue.put_control(error_message(code, message, event_id)):
            self.metrics.error(code)

    def _close_queue(self, conn: Connection, code: int, reason: str, last_message: dict[str, Any] | None) -> bool:
        """Queue ``last_message`` and the close without waiting and start the close clock; False once closing."""
        if not conn.queue.close(code, reason, last_message):
            return False
        conn.clock = time.monotonic()
        return True

    async def _close_with_error(self, conn: Connection, code: str, message: str, close_code: int) -> None:
        """Report ``code``, close the socket and end the session; never waits for the client (see :meth:`_watch`)."""
        if self._close_queue(conn, close_code, code, error_message(code, message)):
            self.metrics.error(code)
        await self._finish_session(conn)

    def fps_limit(self) -> float | None:
        """Frames per second the engine sustains for one session: the inverse of the median engine seconds per
        frame over the last ``fps_samples`` chunks (a median, so a chunk that compiled does not count);
        ``None`` until that many chunks were timed."""
        if len(self.frame_seconds) < self.settings.fps_samples:
            return None
        median = statistics.median(self.frame_seconds)
        return None if median <= 0 else 1.0 / median

    def occupied(self) -> int:
        """Slots taken: the admitted connections' sessions and every session the engine holds, each once.

        A slot is free only once the engine released its session: a session whose close failed still
        counts while the engine holds it, so no start is admitted that would make the engine evict a
        live player to make room.
        """
        return len({conn.request_id for conn in self.connections if conn.admitted} | self.held.ids())

    # -- one connection -------------------------------------------------------------------------------
    async def serve(self, websocket: WebSocket) -> None:
        await websocket.accept()
        conn = Connection(websocket, SendQueue(max_media=self.settings.max_queued_chunks,
                                                max_control=self.settings.max_queued_control,
                                                on_drop=self.metrics.dropped, on_depth=self._on_depth),
                           next(self.connection_order))
        self.connections.add(conn)
        self.metrics.connected(1)
        # The reader ends at a disconnect, the sender after the close, the watchdog when the client takes
        # nothing of a closing connection: whichever comes first ends the connection.
        try:
            await until_first_ends(self._read(conn), self._send(conn), self._watch(conn))
        finally:
            await asyncio.shield(self._spawn(self._release(conn)))

    async def _read(self, conn: Connection) -> None:
        limit = self.settings.max_message_bytes
        while True:
            message = await conn.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if conn.queue.closed:
                continue  # closing: reading goes on (the close handshake needs it), the messages are ignored
            if message.get("bytes") is not None:
                await self._error(conn, "unexpected_binary", "the client sends JSON text frames only; a binary "
                                                             f"frame of {len(message['bytes'])} bytes was ignored")
                continue
            text = message.get("text") or ""
            size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                await self._error(conn, "message_too_large", f"message of {size} bytes exceeds the limit of "
                                                             f"{limit} bytes; it was ignored")
                continue
            try:
                parsed = parse_client_message(text)
                await self._dispatch(conn, parsed)
            except ProtocolError as error:
                if error.code == "interaction_rejected":
                    self.metrics.interaction("rejected")
                await self._error(conn, error.code, error.message, error.event_id)
            except Exception:  # a bug must not drop the connection silently (1006, no reply, nothing logged)
                logger.exception("message on connection %s failed unexpectedly", conn.request_id)
                await self._close_with_error(conn, "internal_error", "the server failed; see its log",
                                             CLOSE_INTERNAL)

    async def _dispatch(self, conn: Connection, message: Any) -> None:
        if isinstance(message, SessionPing):
            await conn.queue.put_control({"type": "session.pong"})
        elif isinstance(message, SessionStart):
            await self._start(conn, message)
        elif isinstance(message, SessionInteraction):
            await self._interact(conn, message)
        elif isinstance(message, SessionStop):
            if conn.state in (_S.WAITING, _S.STARTING):
                raise ProtocolError("not_started", "session.stop before session.start: there is no session to stop")
            if conn.state is _S.STREAMING:
                await self._finish(conn, stopped=True)

    async def _start(self, conn: Connection, start: SessionStart) -> None:
        if conn.state is not _S.WAITING:
            raise ProtocolError("already_started", f"this connection already has session {conn.request_id}; "
                                                   "open another connection for another session")
        plan = self.world.plan_start(start, decode_image=False)  # checks only: a start picture is read below
        occupied = self.occupied()
        if occupied >= self.capacity:
            conn.clock = time.monotonic()  # a refused start restarts the start clock: the client may retry
            self._retry_unclosed()
            raise ProtocolError("capacity", f"the server is at capacity ({occupied} of {self.capacity} sessions); "
                                            "retry session.start later")
        conn.transition(_S.STARTING)  # the slot is this start's from here: no other start takes it meanwhile
        encoder = None
        try:
            if plan.image_url is not None:
                # Admitted first (a full server decodes nothing), off the event loop (a large picture takes a while,
                # and every other connection's messages and chunks wait for the loop), bounded by the picture's
                # header (see decode_image_url).
                plan = await asyncio.get_running_loop().run_in_executor(
                    self.decode_executor, self.world.decode_start_image, plan)
            if conn.state is not _S.STARTING:
                return  # the connection ended (or timed out) while the picture decoded: its close freed the slot
            requested_fps = plan.fps
            limit = self.fps_limit()
            if self.settings.paced and limit is not None and plan.fps > limit:
                # Pacing a session faster than the engine can fill only turns every chunk into an underrun.
                plan = dataclasses.replace(plan, fps=max(1, math.floor(limit)))
                logger.info("session %s asked for %d frames/s; the engine sustains about %.1f: playing at %d",
                            conn.request_id, requested_fps, limit, plan.fps)
            encoder = make_encoder(plan.format, width=self.world.frame_width, height=self.world.frame_height,
                                   fps=plan.fps, scale=plan.scale)
            self.plans[conn.request_id] = plan
            session = await self.manager.create_session(conn.request_id)
        except BaseException:
            if conn.state is _S.STARTING:
                conn.transition(_S.WAITING)  # the slot is free again; the client may retry
            self.plans.pop(conn.request_id, None)
            if encoder is not None:
                self._spawn(self._close_encoder_of(conn.request_id, encoder))
            raise
        if conn.state is not _S.STARTING:
            # The connection ended (or timed out) while a control plane whose creation yields made the session:
            # nobody will stream it, and the connection's close, which found no session yet, did not close it.
            self._spawn(self._close_session(conn.request_id))
            self._spawn(self._close_encoder_of(conn.request_id, encoder))
            return
        conn.attach(Stream(plan, session, PlaybackClock(plan.fps, self.settings.lookahead_chunks,
                                                        paced=self.settings.paced)), encoder)
        config = {**self.world.config(plan), "requested_fps": requested_fps,
                  "fps_limit": None if limit is None else round(limit, 2), "paced": self.settings.paced,
                  "lookahead_chunks": self.settings.lookahead_chunks}
        if not await conn.queue.put_control({"type": "video.start", "request_id": conn.request_id,
                                             "format": plan.format, "config": config}) \
                or conn.state is not _S.STARTING:
            return  # closed while the reply waited for room: the close ended the session
        conn.transition(_S.STREAMING)
        conn.clock = time.monotonic()
        assert self.wake is not None
        self.wake.set()

    async def _interact(self, conn: Connection, interaction: SessionInteraction) -> None:
        wire_id = interaction.event_id
        record = conn.record
        if conn.state is not _S.STREAMING or record.stream is None:
            if conn.state in (_S.WAITING, _S.STARTING):
                raise ProtocolError("not_started", "session.interaction before session.start: there is no session "
                                                   "to change yet", event_id=wire_id)
            raise ProtocolError("session_ended", "session.interaction after the session ended "
                                                 f"(it is {conn.state.value})", event_id=wire_id)
        if wire_id is None:
            record.server_ids += 1
            wire_id = f"server-{record.server_ids}-{uuid.uuid4().hex[:8]}"
        elif wire_id in record.wire_ids:
            self.metrics.interaction("duplicate")
            await conn.queue.put_control({"type": "session.interaction.queued", "request_id": conn.request_id,
                                          "event_id": wire_id, "duplicate": True})
            return
        update = self.world.event_update(dataclasses.replace(interaction, event_id=wire_id))
        event_id = record.next_event_id
        record.next_event_id += 1
        try:
            await record.stream.session.accept_event(ARDiffusionSessionEvent(event_id, update.prompt, update.controls))
        except (ARDiffusionSessionError, ValueError) as error:
            reason = "the event queue is full" if isinstance(error, ARDiffusionEventQueueFullError) else str(error)
            raise ProtocolError("interaction_rejected", f"event {wire_id!r} was not queued: {reason}",
                                event_id=wire_id) from None
        record.remember(wire_id, event_id, update.fields)
        self.metrics.interaction("queued")
        await conn.queue.put_control({"type": "session.interaction.queued", "request_id": conn.request_id,
                                      "event_id": wire_id, "duplicate": False})

    async def _send(self, conn: Connection) -> None:
        """Drain the send queue onto the socket (:func:`drain_to_websocket`); a client that does not read blocks
        it here, in its own task: :meth:`_watch` sees that no send completes."""
        assert self.wake is not None

        def sent() -> None:
            conn.sent_at = time.monotonic()

        try:  # a media item leaving the queue makes room: the generation loop may serve this session again
            await drain_to_websocket(conn.queue, conn.websocket, before_media=self.wake.set, after_send=sent)
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client went away; the reader sees the disconnect too

    async def _watch(self, conn: Connection) -> None:
        """The connection's clocks; returns when the connection must be dropped (see ``serve``).

        * waiting or starting: the start clock (``start_timeout``), whatever the client sends;
        * streaming: the stall clock, restarted by the session's start and by every frame the client
          takes (a completed send): a client that reads nothing is ``stall``-ed, whatever the server
          produced for it (a ``session.ping`` counts through its pong);
        * closing (the close is queued): the client has ``close_timeout_s`` from the close, restarted
          by every frame it takes, to take the rest; then the connection is dropped without it.
        """
        settings = self.settings
        while conn.state is not _S.CLOSED:
            now = time.monotonic()
            if conn.queue.closed:
                remaining = max(conn.clock, conn.sent_at) + settings.close_timeout_s - now
                if remaining <= 0:
                    logger.info("dropping connection %s: its client took nothing for %g s after the close",
                                conn.request_id, settings.close_timeout_s)
                    return
            elif conn.state in (_S.WAITING, _S.STARTING):
                remaining = conn.clock + settings.start_timeout_s - now
                if remaining <= 0:
                    if conn.sessions_done:  # idle after a finished session: nothing went wrong
                        self._close_queue(conn, CLOSE_NORMAL, "idle after session.done", None)
                    else:
                        await self._close_with_error(conn, "start_timeout", "no session.start within "
                                                     f"{settings.start_timeout_s:g} s", CLOSE_POLICY)
                    continue
            elif conn.state is _S.STREAMING:
                remaining = max(conn.clock, conn.sent_at) + settings.stall_timeout_s - now
                if remaining <= 0:
                    await self._close_with_error(conn, "stall", "the client took nothing (no chunk, no reply) for "
                                                 f"{settings.stall_timeout_s:g} s", CLOSE_POLICY)
                    continue
            else:
                remaining = 1.0  # finishing, closing, ended: session.done or the close follows
            await asyncio.sleep(min(remaining, 1.0))

    # -- sessions ending ---------------------------------------------------------------------------------
    async def _finish_session(self, conn: Connection) -> None:
        """No more chunks; close the control-plane session (engine KV released) and free the slot; idempotent.

        Any live state moves on: a connection without a session to ``ended``, one with a session to
        ``closing`` and, once the close returned, ``ended`` (the slot is free). The close runs as a
        server-owned task, so a cancelled caller cannot leave the session open; it never raises (see
        :meth:`_close_session`), so the slot is freed whatever the engine did.
        """
        record = conn.record
        if conn.state in (_S.WAITING, _S.STARTING, _S.STREAMING, _S.FINISHING):
            if record.stream is None:
                conn.transition(_S.ENDED)
            else:
                conn.transition(_S.CLOSING)
                record.closing = self._spawn(self._close_session(record.request_id))
        if record.closing is not None:
            await asyncio.shield(record.closing)
            # Whoever awaited the close first frees the slot; the record check keeps a later session's close apart.
            if conn.state is _S.CLOSING and conn.record is record:
                conn.transition(_S.ENDED)

    async def _close_session(self, request_id: str) -> None:
        """Close the control-plane session. Whatever the engine raises is logged and the close retried in
        the background (the control plane keeps the session as a tombstone meanwhile), so cleanup goes on.
        While the engine still holds the session its slot stays taken (see :meth:`occupied`)."""
        try:
            await self.manager.close_session(request_id)
        except Exception:  # noqa: BLE001 - not only the control plane's own errors: any engine error
            logger.exception("closing session %s failed; retrying", request_id)
            self._mark_unclosed(request_id, True)
            self._retry_close_later(request_id, CLOSE_RETRY_DELAYS_S)
        finally:
            self.plans.pop(request_id, None)
            self.world_states.pop(request_id, None)

    def _mark_unclosed(self, session_id: str, unclosed: bool) -> None:
        if unclosed:
            self.unclosed.add(session_id)
        else:
            self.unclosed.discard(session_id)
        self.metrics.set_closing(len(self.unclosed))

    def closing(self) -> int:
        """Sessions whose engine close failed and is being retried (the engine may hold their slots meanwhile)."""
        return len(self.unclosed)

    def _retry_close_later(self, session_id: str, delays: tuple[float, ...]) -> None:
        """Retry the close of ``session_id`` after each of ``delays`` until one succeeds (one series at a time)."""
        running = self.close_retries.get(session_id)
        if running is None or running.done():
            self.close_retries[session_id] = self._spawn(self._retry_close(session_id, delays))

    def _retry_unclosed(self) -> None:
        """A start found the server full: retry at once the closes that failed of sessions the engine still holds."""
        held = self.held.ids()
        for session_id in sorted(self.unclosed):
            if session_id in held:
                self._retry_close_later(session_id, (0.0,))

    async def _retry_close(self, session_id: str, delays: tuple[float, ...]) -> None:
        for delay in delays:
            await asyncio.sleep(delay)
            try:
                await self.manager.close_session(session_id)
            except Exception as error:  # noqa: BLE001 - logged; the next retry may succeed
                logger.warning("retried close of session %s failed: %s: %s", session_id, type(error).__name__, error)
            else:
                logger.info("session %s closed on a retry", session_id)
                self._mark_unclosed(session_id, False)
                return
        if session_id in self.held.ids():
            logger.error("session %s could not be closed (%d retries failed): the engine still holds it, so its "
                         "slot stays taken (a start that finds the server full retries the close)", session_id,
                         len(delays))
        else:
            logger.error("session %s could not be closed (%d retries failed); the engine released it, so its slot "
                         "is free", session_id, len(delays))

    async def _finish(self, conn: Connection, *, stopped: bool) -> None:
        """``session.done`` after the session's last chunk, then a normal close (never waits for the client).

        Streaming (a stop) or finishing (the last chunk was made) -> closing -> ended -> waiting with a
        fresh session record; a session ended otherwise (an error, a disconnect) gets no ``session.done``.
        """
        if conn.state is _S.STREAMING:
            conn.transition(_S.FINISHING)
        elif conn.state is not _S.FINISHING:
            return  # ended otherwise meanwhile: its close says why
        record = conn.record
        await self._finish_session(conn)
        tail = record.tail
        if tail is not None and tail is not asyncio.current_task():
            with contextlib.suppress(Exception):
                await tail
        await self._close_encoder(record)
        if conn.state is not _S.ENDED or conn.queue.closed:
            return  # the connection ended meanwhile: nobody to tell
        done = {"type": "session.done", "request_id": record.request_id, "chunks": 0, "stopped": stopped}
        self.metrics.session_ended(record.request_id)
        # The socket stays open: the client may start another session on it (or close it). The start
        # clock runs again; a connection left idle after its session.done is closed normally (see _watch).
        conn.sessions_done += 1
        conn.transition(_S.WAITING)  # a fresh session record
        conn.clock = time.monotonic()
        conn.queue.put_final(done)

    async def _close_encoder(self, record: SessionRecord) -> None:
        encoder, record.encoder = record.encoder, None  # closed once; nothing more is delivered (see _deliver)
        if encoder is not None:
            await self._close_encoder_of(record.request_id, encoder)

    async def _close_encoder_of(self, request_id: str, encoder: Any) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.encode_executor, encoder.close)
        except Exception:  # noqa: BLE001 - logged; the slot and the socket are freed all the same
            logger.exception("closing the encoder of session %s failed", request_id)

    async def _release(self, conn: Connection) -> None:
        """The connection is gone: its session is closed and every resource dropped (idempotent)."""
        # Until ended: a session.done racing this may have started the connection over (waiting) meanwhile.
        while conn.state is not _S.ENDED and conn.state is not _S.CLOSED:
            await self._finish_session(conn)
        if conn.state is _S.CLOSED:
            return  # released by another caller meanwhile (a disconnect during shutdown)
        conn.transition(_S.CLOSED)
        record = conn.record
        if record.tail is not None and not record.tail.done():
            record.tail.cancel()
            with contextlib.suppress(BaseException):
                await record.tail
        await self._close_encoder(record)
        self.metrics.session_ended(record.request_id)
        conn.queue.discard()
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connected(-1)

    # -- the generation loop ------------------------------------------------------------------------------
    async def _generation_loop(self) -> None:
        """Earliest deadline first over the sessions that are due: one chunk per iteration.

        A session is due when its playback clock says its next chunk may be generated (at once
        when unpaced, or for the first ``lookahead_chunks + 1`` chunks). Among the due ones the
        session whose playback needs its next chunk soonest goes first (ties: connection order),
        so when the engine cannot keep up every session falls behind by the same amount. When
        nothing is due the loop sleeps until the next due time or a wake-up (a new session, a
        client taking a chunk). A session whose send queue is full (its client is behind) is
        skipped until its sender takes a chunk: nothing here waits for a client. ``busy_since``
        marks a chunk in progress for ``/healthz``.
        """
        assert self.wake is not None
        while True:
            self.wake.clear()  # before looking: a wake-up from here on is seen by the wait below
            ready = [conn for conn in self.connections if conn.state is _S.STREAMING and not conn.queue.media_full]
            if not ready:
                await self.wake.wait()
                continue
            now = time.monotonic()
            due = [conn for conn in ready if _playback(conn).due_at() <= now]
            if not due:
                next_due = min(_playback(conn).due_at() for conn in ready)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, next_due - now))
                continue
            due.sort(key=lambda c: (_playback(c).deadline(), c.order))
            group = due[:self.batch_limit]
            self.busy_since = time.monotonic()
            try:
                if len(group) == 1:
                    await self._guarded_next_chunk(group[0])
                else:
                    await self._next_chunks_batched(group)
            finally:
                self.busy_since = None

    async def _guarded_next_chunk(self, conn: Connection) -> None:
        try:
            await self._next_chunk(conn)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not end every other session's stream
            logger.exception("chunk of session %s failed unexpectedly", conn.request_id)
            await self._close_with_error(conn, "internal_error", "the server failed; see its log", CLOSE_INTERNAL)

    async def _next_chunks_batched(self, group: list[Connection]) -> None:
        """The next chunk of every session of ``group`` in one engine call (``engine.generate_batch``).

        Each session runs its own ``next_chunk`` (control plane, metadata, events, encoding) as a
        task; the consumer holds their ticks until all arrived, then runs them together. A task
        that ends without submitting a tick (its session ended meanwhile) is withdrawn, so the
        others never wait for it; a session whose request fails gets its own error and ends alone.
        """
        with self.consumer.batch(conn.request_id for conn in group) as batch:
            tasks = []
            for conn in group:
                task = asyncio.create_task(self._guarded_next_chunk(conn))
                task.add_done_callback(lambda _, session_id=conn.request_id: batch.withdraw(session_id))
                tasks.append(task)
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                for task in tasks:
                    task.cancel()
                raise
        self.metrics.observe_batch(len(group))

    async def _next_chunk(self, conn: Connection) -> None:
        tail = conn.record.tail
        if tail is not None and not tail.done():
            # At most one chunk per session waits for its encoder. asyncio.wait, not await: a
            # disconnect cancels the tail, and awaiting a cancelled task would cancel this
            # loop, ending every other session's stream.
            await asyncio.wait({tail})
        record = conn.record
        if conn.state is not _S.STREAMING or conn.queue.media_full:
            return
        stream = record.stream
        assert stream is not None  # attached while starting, before streaming
        applying = tuple(sorted(record.pending))
        started = time.perf_counter()
        try:
            output = await stream.session.next_chunk()
        except Exception as error:  # noqa: BLE001 - whatever failed the chunk is reported to its client
            if conn.state is _S.STREAMING and conn.record is record:
                wire_ids = [record.events[i].wire_id for i in applying if i in record.events]
                await self._chunk_failed(conn, wire_ids, "generating", error)
            return
        engine_s = time.perf_counter() - started
        if conn.state is not _S.STREAMING or conn.record is not record:
            return  # stopped (or gone) while the chunk was made: it is not sent, as after the stop
        metadata = self.consumer.chunk_metadata(output)
        started_ids, active_ids, completed_ids = record.chunk_events(metadata.applied_event_ids)
        plan, playback = stream.plan, stream.playback
        generated = self.world.chunk_frames(metadata.chunk_index)
        if generated > 0:
            self.frame_seconds.append(engine_s / generated)
        keep = generated
        if plan.num_frames is not None:
            keep = min(keep, plan.num_frames - record.frames_generated)
        record.frames_generated += keep
        last = plan.num_frames is not None and record.frames_generated >= plan.num_frames
        if last:
            conn.transition(_S.FINISHING)
        late_s = playback.record(time.monotonic(), keep)
        real_fps, real_time_factor = playback.real_fps(), playback.real_time_factor()
        self.metrics.observe_playback(record.request_id, late_s, real_time_factor)
        message = {"type": "video.chunk_metadata", "request_id": record.request_id, "kind": "media",
                   "generation_chunk_index": metadata.chunk_index, "num_frames": keep,
                   "started_event_ids": started_ids, "active_event_ids": active_ids,
                   "completed_event_ids": completed_ids, "fps": plan.fps,
                   "real_fps": None if real_fps is None else round(real_fps, 3),
                   "real_time_factor": None if real_time_factor is None else round(real_time_factor, 4),
                   "underruns": playback.underruns}
        record.tail = asyncio.create_task(self._guarded_deliver(conn, record, output, message, keep, engine_s, last))

    async def _guarded_deliver(self, conn: Connection, record: SessionRecord, output: Any, message: dict[str, Any],
                               keep: int, engine_s: float, last: bool) -> None:
        try:
            await self._deliver(conn, record, output, message, keep, engine_s, last)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug (an illegal state move included) ends this connection only, never silently
            logger.exception("delivering a chunk of session %s failed unexpectedly", record.request_id)
            await self._close_with_error(conn, "internal_error", "the server failed; see its log", CLOSE_INTERNAL)

    async def _deliver(self, conn: Connection, record: SessionRecord, output: Any, message: dict[str, Any],
                       keep: int, engine_s: float, last: bool) -> None:
        """Encode one chunk off the event loop and queue it (then, after the last chunk, finish the session).

        An encode failure is a chunk failure: reported, and the session ends.
        """
        encoder = record.encoder
        if encoder is None:
            return  # the session's encoder is closed: it ended
        started = time.perf_counter()

        state = self.world_states.get(record.request_id)

        def encode() -> bytes:
            frames = self.world.frames(output)[:keep]
            if state is not None:  # read by the session's next tick, which waits for this delivery (_next_chunk)
                self.world.observe(state, frames)
            return encoder.encode(frames)

        try:
            payload = await asyncio.get_running_loop().run_in_executor(self.encode_executor, encode)
        except Exception as error:  # noqa: BLE001 - whatever failed the chunk is reported to its client
            await self._chunk_failed(conn, message["started_event_ids"], "encoding", error)
            return
        latency_s = engine_s + time.perf_counter() - started
        self.metrics.observe_chunk(latency_s, len(payload))
        # The first m4s fragment carries the stream header: without it nothing after it decodes.
        droppable = not (encoder.format == "m4s" and message["generation_chunk_index"] == 0)
        conn.queue.put_media({**message, "byte_length": len(payload), "latency_ms": round(latency_s * 1e3, 3)},
                             payload, droppable=droppable)
        if last:
            await self._finish(conn, stopped=False)

    async def _chunk_failed(self, conn: Connection, wire_ids: list[str], stage: str, error: Exception) -> None:
        """A chunk failed (``stage``: generating or encoding it): report it and end the session.

        Runs in the shared generation loop (or a chunk's delivery), so it never waits for the client:
        an ``interaction_failed`` that finds the control queue full is dropped; the final
        ``generation_failed`` always goes, with the close (1011).
        """
        logger.warning("%s a chunk of session %s failed: %s: %s", stage, conn.request_id, type(error).__name__, error)
        for wire_id in wire_ids:
            if conn.queue.offer_control(error_message("interaction_failed", f"event {wire_id!r} was applied to a "
                                                      f"chunk that failed: {type(error).__name__}: {error}", wire_id)):
                self.metrics.error("interaction_failed")
        await self._close_with_error(conn, "generation_failed", f"{stage} a chunk failed: {type(error).__name__}: "
                                     f"{error}", CLOSE_INTERNAL)


def create_app(engine: Any, *, world: ServedWorld, settings: ServerSettings | None = None,
               metrics: ServerMetrics | None = None, access: ServerAccess | None = None) -> Starlette:
    """The ASGI app serving ``engine``'s pipeline as ``world``.

    Routes: ``WS /v1/realtime/video``, ``GET /healthz``, ``GET /metrics``; ``GET /`` serves the
    browser client (``static/index.html``). The generation loop runs while the app's lifespan is
    active (uvicorn runs it; with Starlette's ``TestClient`` use it as a context manager).
    The engine stays the caller's: the app never closes it.

    ``access`` (default ``ServerAccess()``: no key, same-origin pages only, 8 WebSockets per
    client address) says who may connect; a refused handshake is answered before the WebSocket
    is accepted or a session created. ``/healthz`` and ``/`` stay public. Same-origin is the
    address a connection arrived on (``scope["server"]``), never its ``Host`` header; the client
    address is the peer's (``X-Forwarded-For`` only from ``access.trusted_proxies``). Under
    uvicorn pass ``proxy_headers=False`` (as ``ardiff-jax serve`` does): uvicorn's default
    replaces a loopback peer's address with its ``X-Forwarded-For``, which the app then can only
    count under one shared address (see :func:`~ardiff_jax.serve._access.client_address`).
    """
    if not isinstance(world, ServedWorld):
        raise TypeError(f"world must be a ServedWorld, got {type(world).__name__}")
    settings = ServerSettings() if settings is None else settings
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings, got {type(settings).__name__}")
    metrics = ServerMetrics() if metrics is None else metrics
    access = ServerAccess() if access is None else access
    if not isinstance(access, ServerAccess):
        raise TypeError(f"access must be a ServerAccess, got {type(access).__name__}")
    open_by_address = ConnectionCounter()
    server = _Server(engine, world, settings, metrics)
    page = importlib.resources.files("ardiff_jax.serve").joinpath("static", "index.html").read_text("utf-8")
    engine.runner.add_session_listener(metrics.on_session_event)

    async def realtime_video(websocket: WebSocket) -> None:
        # Decided from the handshake alone, before accept and before any session exists.
        # Counted under the peer's address (X-Forwarded-For only from a trusted proxy); same-origin is the address
        # the connection arrived on (the listening socket's), never the Host header a page sends.
        address = client_address(access, client=websocket.client, headers=websocket.headers)
        refusal = websocket_refusal(access, headers=websocket.headers, query=websocket.query_params,
                                    scheme=websocket.url.scheme, server=websocket.scope.get("server"),
                                    open_connections=open_by_address.open_connections(address))
        if refusal is not None:
            metrics.refused(refusal.metric_label)
            await deny_websocket(websocket, refusal)
            return
        if server.wake is None:
            await websocket.close(CLOSE_INTERNAL, "the server's lifespan has not started")
            return
        open_by_address.acquire(address)  # no await since the check: the count cannot have moved
        try:
            await server.serve(websocket)
        finally:
            open_by_address.release(address)

    async def healthz(request: Request) -> JSONResponse:
        connected = len(server.connections)
        streaming = sum(1 for c in server.connections if c.state is _S.STREAMING)
        return JSONResponse({"status": server.status(), "model": world.name,
                             "sessions": {"connected": connected, "streaming": streaming,
                                          "admitted": sum(1 for c in server.connections if c.admitted),
                                          "resident": len(engine.sessions),
                                          # engine closes that failed and are being retried (slots held meanwhile)
                                          "closing": server.closing()},
                             "capacity": server.capacity})

    async def metrics_endpoint(request: Request) -> Response:
        refusal = metrics_refusal(access, headers=request.headers, query=request.query_params)
        if refusal is not None:
            return refusal_response(refusal)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(page)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        with contextlib.ExitStack() as logs:
            if access.api_key is not None:  # uvicorn logs each request's query string, a ?token= key included
                logs.enter_context(redacted_tokens_in_uvicorn_logs(access.api_key))
            await server.start()
            try:
                yield
            finally:
                await server.stop()

    app = Starlette(routes=[Route("/", index), Route("/healthz", healthz), Route("/metrics", metrics_endpoint),
                            WebSocketRoute(REALTIME_VIDEO_PATH, realtime_video)], lifespan=lifespan)
    app.state.server = server
    return app
