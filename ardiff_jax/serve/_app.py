"""``create_app``: the Starlette app of ``ardiff-jax serve`` (see :mod:`ardiff_jax.serve` for the design)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import importlib.resources
import json
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ardiff_jax._checks import check_positive_int
from ardiff_jax.realtime import (
    ARDiffusionEventQueueFullError,
    ARDiffusionSession,
    ARDiffusionSessionError,
    ARDiffusionSessionEvent,
    ARDiffusionSessionManager,
    EngineSessionLifecycle,
    EngineTickConsumer,
)
from ardiff_jax.serve._encode import make_encoder
from ardiff_jax.serve._metrics import ServerMetrics
from ardiff_jax.serve._protocol import (
    ProtocolError,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    error_message,
    parse_client_message,
)
from ardiff_jax.serve._send_queue import SendQueue
from ardiff_jax.serve._world import ServedWorld, StartPlan

__all__ = ["REALTIME_VIDEO_PATH", "ServerSettings", "create_app"]

logger = logging.getLogger(__name__)

REALTIME_VIDEO_PATH = "/v1/realtime/video"
#: Wire event ids a connection remembers to answer repeats as duplicates (older ones count as new).
REMEMBERED_EVENT_IDS = 4096
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
      stall_timeout_s: a started session with neither a generated chunk nor a ping for this long is
        reported (``stall``) and closed.
      max_pending_events: interactions queued per session before the next chunk; beyond ->
        ``interaction_rejected``.
      max_queued_chunks: media pairs waiting per connection; beyond, the oldest is dropped.
      max_queued_control: control messages waiting per connection; beyond, that connection's reader waits.
      capacity: sessions served at once (``None``: the engine's resident capacity, plus its host
        tier's when host offload is on).
    """

    max_message_bytes: int = 64 * 1024
    start_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0
    max_pending_events: int = 16
    max_queued_chunks: int = 8
    max_queued_control: int = 64
    capacity: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_pending_events", "max_queued_chunks", "max_queued_control"):
            check_positive_int(f"ServerSettings {name}", getattr(self, name))
        for name in ("start_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerSettings {name} must be a positive number of seconds, got {value!r}")
        if self.capacity is not None:
            check_positive_int("ServerSettings capacity", self.capacity)


class _State(enum.Enum):
    WAITING = "waiting"  # connected, no session yet
    STREAMING = "streaming"  # the generation loop serves it
    FINISHING = "finishing"  # stopped or done: no more chunks, session.done on its way
    CLOSED = "closed"


@dataclasses.dataclass
class _EventRecord:
    wire_id: str
    fields: tuple[str, ...]


class _Connection:
    """One WebSocket: its session (once started), its send queue and its event bookkeeping."""

    def __init__(self, websocket: WebSocket, queue: SendQueue) -> None:
        self.websocket = websocket
        self.queue = queue
        self.state = _State.WAITING
        self.request_id = f"rt-{uuid.uuid4().hex}"
        self.plan: StartPlan | None = None
        self.session: ARDiffusionSession | None = None
        self.encoder: Any = None
        self.clock = time.monotonic()  # start clock while WAITING, stall clock while STREAMING
        self.frames_generated = 0
        self.tail: asyncio.Task | None = None  # the last chunk's encode-and-queue task (chunks stay in order)
        self.closing: asyncio.Task | None = None  # the control-plane close, once begun
        self.finishing = False  # session.done is on its way
        self.admitted = False
        # Wire ids: remembered (duplicates), the integer id each became, what each event set.
        self.wire_ids: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.events: dict[int, _EventRecord] = {}
        self.pending: set[int] = set()
        self.owners: dict[str, int] = {}  # field ("prompt" or a control track) -> event in effect
        self.active: set[int] = set()
        self.next_event_id = 1
        self.server_ids = 0

    def remember(self, wire_id: str, event_id: int, fields: tuple[str, ...]) -> None:
        self.wire_ids[wire_id] = event_id
        while len(self.wire_ids) > REMEMBERED_EVENT_IDS:
            self.wire_ids.popitem(last=False)
        self.events[event_id] = _EventRecord(wire_id, fields)
        self.pending.add(event_id)

    def chunk_events(self, applied: tuple[int, ...]) -> tuple[list[str], list[str], list[str]]:
        """``(started, active, completed)`` wire ids after a chunk that applied ``applied`` (see the package doc)."""
        for event_id in applied:
            self.pending.discard(event_id)
            for field in self.events[event_id].fields:
                self.owners[field] = event_id
        active = set(self.owners.values())
        completed = sorted((self.active | set(applied)) - active)
        started = [self.events[i].wire_id for i in applied]
        completed_wire = [self.events[i].wire_id for i in completed]
        for event_id in completed:
            del self.events[event_id]
        self.active = active
        return started, [self.events[i].wire_id for i in sorted(active)], completed_wire


class _Server:
    def __init__(self, engine: Any, world: ServedWorld, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.world = world
        self.settings = settings
        self.metrics = metrics
        plan = engine.memory_plan
        host = plan.host_session_capacity if getattr(plan, "host_offload_bytes", 0) else 0
        self.capacity = settings.capacity if settings.capacity is not None else engine.session_capacity + host
        self.connections: set[_Connection] = set()
        self.plans: dict[str, StartPlan] = {}
        self.queue_depth = 0
        self.engine_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ardiff-serve-engine")
        self.encode_executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ardiff-serve-encode")
        self.consumer = EngineTickConsumer(
            engine, executor=self.engine_executor,
            inputs_provider=lambda tick: world.inputs(tick, self.plans[tick.session_id]),
            prompt_provider=lambda tick: world.prompt(tick, self.plans[tick.session_id]))
        self.lifecycle = EngineSessionLifecycle(engine, executor=self.engine_executor)
        self.manager: ARDiffusionSessionManager = ARDiffusionSessionManager(
            tick_consumer=self.consumer, lifecycle=self.lifecycle, max_pending_events=settings.max_pending_events)
        self.wake: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None
        self.background: set[asyncio.Task] = set()

    # -- lifespan ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.wake = asyncio.Event()
        self.loop_task = asyncio.create_task(self._generation_loop(), name="ardiff-serve-generation")

    async def stop(self) -> None:
        for conn in list(self.connections):
            await self._release(conn)
        while self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        self.encode_executor.shutdown(wait=True)
        self.engine_executor.shutdown(wait=True)

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

    async def _error(self, conn: _Connection, code: str, message: str, event_id: str | None = None) -> None:
        self.metrics.error(code)
        await conn.queue.put_control(error_message(code, message, event_id))

    async def _close_with_error(self, conn: _Connection, code: str, message: str, close_code: int) -> None:
        await self._error(conn, code, message)
        await self._finish_session(conn)
        conn.queue.close(close_code, code)

    # -- one connection -------------------------------------------------------------------------------
    async def serve(self, websocket: WebSocket) -> None:
        await websocket.accept()
        conn = _Connection(websocket, SendQueue(max_media=self.settings.max_queued_chunks,
                                                max_control=self.settings.max_queued_control,
                                                on_drop=self.metrics.dropped, on_depth=self._on_depth))
        self.connections.add(conn)
        self.metrics.connected(1)
        tasks = [asyncio.create_task(self._read(conn)), asyncio.create_task(self._send(conn)),
                 asyncio.create_task(self._watch(conn))]
        try:
            await asyncio.wait(tasks[:2], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            await asyncio.shield(self._spawn(self._release(conn)))

    async def _read(self, conn: _Connection) -> None:
        limit = self.settings.max_message_bytes
        while True:
            message = await conn.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
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

    async def _dispatch(self, conn: _Connection, message: Any) -> None:
        if isinstance(message, SessionPing):
            if conn.state is _State.STREAMING:
                conn.clock = time.monotonic()
            await conn.queue.put_control({"type": "session.pong"})
        elif isinstance(message, SessionStart):
            await self._start(conn, message)
        elif isinstance(message, SessionInteraction):
            await self._interact(conn, message)
        elif isinstance(message, SessionStop):
            if conn.state is _State.WAITING:
                raise ProtocolError("not_started", "session.stop before session.start: there is no session to stop")
            if conn.state is _State.STREAMING:
                await self._finish(conn, stopped=True)

    async def _start(self, conn: _Connection, start: SessionStart) -> None:
        if conn.state is not _State.WAITING:
            raise ProtocolError("already_started", f"this connection already has session {conn.request_id}; "
                                                   "open another connection for another session")
        plan = self.world.plan_start(start)
        admitted = sum(1 for c in self.connections if c.admitted)
        if admitted >= self.capacity:
            conn.clock = time.monotonic()  # a refused start restarts the start clock: the client may retry
            raise ProtocolError("capacity", f"the server is at capacity ({admitted} of {self.capacity} sessions); "
                                            "retry session.start later")
        conn.admitted = True
        try:
            encoder = make_encoder(plan.format, width=self.world.frame_width, height=self.world.frame_height,
                                   fps=plan.fps, scale=plan.scale)
            self.plans[conn.request_id] = plan
            session = await self.manager.create_session(conn.request_id)
        except BaseException:
            conn.admitted = False
            self.plans.pop(conn.request_id, None)
            raise
        conn.plan, conn.session, conn.encoder = plan, session, encoder
        await conn.queue.put_control({"type": "video.start", "request_id": conn.request_id, "format": plan.format,
                                      "config": self.world.config(plan)})
        conn.state = _State.STREAMING
        conn.clock = time.monotonic()
        assert self.wake is not None
        self.wake.set()

    async def _interact(self, conn: _Connection, interaction: SessionInteraction) -> None:
        wire_id = interaction.event_id
        if conn.state is not _State.STREAMING or conn.session is None:
            if conn.state is _State.WAITING:
                raise ProtocolError("not_started", "session.interaction before session.start: there is no session "
                                                   "to change yet", event_id=wire_id)
            raise ProtocolError("session_ended", "session.interaction after the session ended "
                                                 f"(it is {conn.state.value})", event_id=wire_id)
        if wire_id is None:
            conn.server_ids += 1
            wire_id = f"server-{conn.server_ids}-{uuid.uuid4().hex[:8]}"
        elif wire_id in conn.wire_ids:
            self.metrics.interaction("duplicate")
            await conn.queue.put_control({"type": "session.interaction.queued", "request_id": conn.request_id,
                                          "event_id": wire_id, "duplicate": True})
            return
        update = self.world.event_update(dataclasses.replace(interaction, event_id=wire_id))
        event_id = conn.next_event_id
        conn.next_event_id += 1
        try:
            await conn.session.accept_event(ARDiffusionSessionEvent(event_id, update.prompt, update.controls))
        except (ARDiffusionSessionError, ValueError) as error:
            reason = "the event queue is full" if isinstance(error, ARDiffusionEventQueueFullError) else str(error)
            raise ProtocolError("interaction_rejected", f"event {wire_id!r} was not queued: {reason}",
                                event_id=wire_id) from None
        conn.remember(wire_id, event_id, update.fields)
        self.metrics.interaction("queued")
        await conn.queue.put_control({"type": "session.interaction.queued", "request_id": conn.request_id,
                                      "event_id": wire_id, "duplicate": False})

    async def _send(self, conn: _Connection) -> None:
        """Drain the send queue onto the socket; a media item is its metadata frame then its binary frame."""
        transport_index = 0
        websocket = conn.websocket
        try:
            while True:
                item = await conn.queue.get()
                if item.kind == "close":
                    await websocket.close(item.code, item.reason)
                    return
                assert item.message is not None
                if item.kind == "media":
                    await websocket.send_text(json.dumps({**item.message, "transport_chunk_index": transport_index}))
                    await websocket.send_bytes(item.payload)
                    transport_index += 1
                else:
                    message = item.message
                    if message.get("type") == "session.done":
                        message = {**message, "chunks": transport_index}
                    await websocket.send_text(json.dumps(message))
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client went away; the reader sees the disconnect too

    async def _watch(self, conn: _Connection) -> None:
        """The start clock (until a session starts) and the stall clock (while it streams)."""
        settings = self.settings
        while True:
            now = time.monotonic()
            if conn.state is _State.WAITING:
                remaining = conn.clock + settings.start_timeout_s - now
                if remaining <= 0:
                    await self._close_with_error(conn, "start_timeout", "no session.start within "
                                                 f"{settings.start_timeout_s:g} s", CLOSE_POLICY)
                    return
            elif conn.state is _State.STREAMING:
                remaining = conn.clock + settings.stall_timeout_s - now
                if remaining <= 0:
                    await self._close_with_error(conn, "stall", "neither a generated chunk nor a session.ping for "
                                                 f"{settings.stall_timeout_s:g} s", CLOSE_POLICY)
                    return
            else:
                return
            await asyncio.sleep(min(remaining, 1.0))

    # -- sessions ending ---------------------------------------------------------------------------------
    async def _finish_session(self, conn: _Connection) -> None:
        """No more chunks; close the control-plane session (engine KV released); idempotent.

        The close runs as a server-owned task, so a cancelled caller cannot leave the session open.
        """
        if conn.state is _State.STREAMING or conn.state is _State.WAITING:
            conn.state = _State.FINISHING
        if conn.session is not None and conn.closing is None:
            conn.closing = self._spawn(self._close_session(conn))
        if conn.closing is not None:
            await asyncio.shield(conn.closing)
        conn.admitted = False

    async def _close_session(self, conn: _Connection) -> None:
        try:
            await self.manager.close_session(conn.request_id)
        except ARDiffusionSessionError as error:
            logger.warning("closing session %s failed: %s", conn.request_id, error)
        finally:
            self.plans.pop(conn.request_id, None)

    async def _finish(self, conn: _Connection, *, stopped: bool) -> None:
        """``session.done`` after the session's last chunk, then a normal close."""
        if conn.finishing or conn.state is _State.CLOSED:
            return
        conn.finishing = True
        await self._finish_session(conn)
        tail = conn.tail
        if tail is not None and tail is not asyncio.current_task():
            with contextlib.suppress(Exception):
                await tail
        await self._close_encoder(conn)
        await conn.queue.put_control({"type": "session.done", "request_id": conn.request_id, "chunks": 0,
                                      "stopped": stopped})
        conn.queue.close(CLOSE_NORMAL, "session done")

    async def _close_encoder(self, conn: _Connection) -> None:
        encoder, conn.encoder = conn.encoder, None
        if encoder is not None:
            await asyncio.get_running_loop().run_in_executor(self.encode_executor, encoder.close)

    async def _release(self, conn: _Connection) -> None:
        """The connection is gone: its session is closed and every resource dropped (idempotent)."""
        if conn.state is _State.CLOSED:
            return
        await self._finish_session(conn)
        conn.state = _State.CLOSED
        if conn.tail is not None and not conn.tail.done():
            conn.tail.cancel()
            with contextlib.suppress(BaseException):
                await conn.tail
        await self._close_encoder(conn)
        conn.queue.discard()
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connected(-1)

    # -- the generation loop ------------------------------------------------------------------------------
    async def _generation_loop(self) -> None:
        """Round-robin: every streaming session gets one chunk per round, in connection order."""
        assert self.wake is not None
        while True:
            streaming = [conn for conn in self.connections if conn.state is _State.STREAMING]
            if not streaming:
                self.wake.clear()
                await self.wake.wait()
                continue
            for conn in streaming:
                try:
                    await self._next_chunk(conn)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not end every other session's stream
                    logger.exception("chunk of session %s failed unexpectedly", conn.request_id)
                    await self._close_with_error(conn, "internal_error", "the server failed; see its log",
                                                 CLOSE_INTERNAL)

    async def _next_chunk(self, conn: _Connection) -> None:
        if conn.tail is not None and not conn.tail.done():
            # At most one chunk per session waits for its encoder. asyncio.wait, not await: a
            # disconnect cancels the tail, and awaiting a cancelled task would cancel this
            # loop, ending every other session's stream.
            await asyncio.wait({conn.tail})
        if conn.state is not _State.STREAMING or conn.session is None:
            return
        applying = tuple(sorted(conn.pending))
        started = time.perf_counter()
        try:
            output = await conn.session.next_chunk()
        except Exception as error:  # noqa: BLE001 - whatever failed the chunk is reported to its client
            if conn.state is _State.STREAMING:
                await self._chunk_failed(conn, applying, error)
            return
        engine_s = time.perf_counter() - started
        metadata = self.consumer.chunk_metadata(output)
        conn.clock = time.monotonic()
        started_ids, active_ids, completed_ids = conn.chunk_events(metadata.applied_event_ids)
        plan = conn.plan
        assert plan is not None
        keep = self.world.frames_per_chunk
        if plan.num_frames is not None:
            keep = min(keep, plan.num_frames - conn.frames_generated)
        conn.frames_generated += keep
        last = plan.num_frames is not None and conn.frames_generated >= plan.num_frames
        if last:
            conn.state = _State.FINISHING
        message = {"type": "video.chunk_metadata", "request_id": conn.request_id, "kind": "media",
                   "generation_chunk_index": metadata.chunk_index, "num_frames": keep,
                   "started_event_ids": started_ids, "active_event_ids": active_ids,
                   "completed_event_ids": completed_ids}
        conn.tail = asyncio.create_task(self._deliver(conn, output, message, keep, engine_s, last))

    async def _deliver(self, conn: _Connection, output: Any, message: dict[str, Any], keep: int, engine_s: float,
                       last: bool) -> None:
        """Encode one chunk off the event loop and queue it (then, after the last chunk, finish the session)."""
        encoder = conn.encoder
        if encoder is None:
            return
        started = time.perf_counter()

        def encode() -> bytes:
            return encoder.encode(self.world.frames(output)[:keep])

        payload = await asyncio.get_running_loop().run_in_executor(self.encode_executor, encode)
        latency_s = engine_s + time.perf_counter() - started
        self.metrics.observe_chunk(latency_s, len(payload))
        # The first m4s fragment carries the stream header: without it nothing after it decodes.
        droppable = not (encoder.format == "m4s" and message["generation_chunk_index"] == 0)
        conn.queue.put_media({**message, "byte_length": len(payload), "latency_ms": round(latency_s * 1e3, 3)},
                             payload, droppable=droppable)
        if last:
            await self._finish(conn, stopped=False)

    async def _chunk_failed(self, conn: _Connection, applying: tuple[int, ...], error: Exception) -> None:
        """The control plane failed the chunk (and released the engine session): report and end the session."""
        logger.warning("chunk of session %s failed: %s: %s", conn.request_id, type(error).__name__, error)
        for event_id in applying:
            record = conn.events.get(event_id)
            if record is not None:
                conn.wire_ids.pop(record.wire_id, None)  # a failed id may be reused
                await self._error(conn, "interaction_failed", f"event {record.wire_id!r} was applied to a chunk that "
                                  f"failed: {type(error).__name__}: {error}", record.wire_id)
        await self._close_with_error(conn, "generation_failed", f"generating chunk failed: {type(error).__name__}: "
                                     f"{error}", CLOSE_INTERNAL)


def create_app(engine: Any, *, world: ServedWorld, settings: ServerSettings | None = None,
               metrics: ServerMetrics | None = None) -> Starlette:
    """The ASGI app serving ``engine``'s pipeline as ``world``.

    Routes: ``WS /v1/realtime/video``, ``GET /healthz``, ``GET /metrics``; ``GET /`` serves the
    browser client (``static/index.html``). The generation loop runs while the app's lifespan is
    active (uvicorn runs it; with Starlette's ``TestClient`` use it as a context manager).
    The engine stays the caller's: the app never closes it.
    """
    if not isinstance(world, ServedWorld):
        raise TypeError(f"world must be a ServedWorld, got {type(world).__name__}")
    settings = ServerSettings() if settings is None else settings
    if not isinstance(settings, ServerSettings):
        raise TypeError(f"settings must be a ServerSettings, got {type(settings).__name__}")
    metrics = ServerMetrics() if metrics is None else metrics
    server = _Server(engine, world, settings, metrics)
    page = importlib.resources.files("ardiff_jax.serve").joinpath("static", "index.html").read_text("utf-8")
    engine.runner.add_session_listener(metrics.on_session_event)

    async def realtime_video(websocket: WebSocket) -> None:
        if server.wake is None:
            await websocket.close(CLOSE_INTERNAL, "the server's lifespan has not started")
            return
        await server.serve(websocket)

    async def healthz(request: Request) -> JSONResponse:
        connected = len(server.connections)
        streaming = sum(1 for c in server.connections if c.state is _State.STREAMING)
        return JSONResponse({"status": "ok" if server.loop_task is not None and not server.loop_task.done()
                             else "stopped", "model": world.name,
                             "sessions": {"connected": connected, "streaming": streaming,
                                          "admitted": sum(1 for c in server.connections if c.admitted),
                                          "resident": len(engine.sessions)},
                             "capacity": server.capacity})

    async def metrics_endpoint(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(page)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = Starlette(routes=[Route("/", index), Route("/healthz", healthz), Route("/metrics", metrics_endpoint),
                            WebSocketRoute(REALTIME_VIDEO_PATH, realtime_video)], lifespan=lifespan)
    app.state.server = server
    return app
