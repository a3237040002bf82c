"""The realtime server never waits on one client (hardening, second round), on a real socket.

Every test runs uvicorn in a thread on a loopback port with short timeouts and drives raw
``websockets`` clients (no compression). The server's socket send buffer is small, and a
client that never reads stops reading from its socket after one frame (``max_queue=1``) with
a fixed receive buffer, so TCP pushes back within a few hundred kilobytes and the server's
sends to it block, as they would for a real client that stopped reading. Faults are injected
by wrapping the engine (:class:`EngineSpy`) or the encoder. After each scenario a bystander
player has kept streaming, ``/healthz`` and ``/metrics`` tell the truth, and once every client
is gone the engine holds no session. The engine serves the tiny text ``WorldPipeline``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("websockets")

import httpx
import uvicorn
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.models import WorldPipeline
from ardiff_jax.serve import ProtocolError, ServedWorld, ServerSettings, create_app
from ardiff_jax.serve import _app
from ardiff_jax.serve._protocol import MAX_JSON_DEPTH, parse_client_message
from ardiff_jax.types import ARDiffusionTickRequest

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)
#: 32x upscaled frames (256x256 JPEGs, ~5 KB a chunk): a client that does not read fills its socket in a second.
LARGE = {"format": "jpeg", "width": 256, "height": 256}


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(0.02)


def start_message(**fields: Any) -> str:
    return json.dumps({"type": "session.start", "prompt": "a quiet lake", **fields})


def start(ws: ClientConnection, **fields: Any) -> dict:
    ws.send(start_message(**fields))
    reply = json.loads(ws.recv(timeout=30))
    assert reply["type"] == "video.start", reply
    return reply


def next_chunk(ws: ClientConnection) -> dict:
    """The next ``video.chunk_metadata`` (its binary frame read too); control messages on the way fail."""
    meta = json.loads(ws.recv(timeout=30))
    assert meta["type"] == "video.chunk_metadata", meta
    assert isinstance(ws.recv(timeout=30), bytes)
    return meta


def until(ws: ClientConnection, kind: str) -> dict:
    """Read until a message of type ``kind`` (skipping chunks)."""
    while True:
        message = ws.recv(timeout=30)
        if isinstance(message, bytes):
            continue
        payload = json.loads(message)
        if payload["type"] == kind:
            return payload
        assert payload["type"] == "video.chunk_metadata", payload


def close_code(ws: ClientConnection) -> int:
    """The close code the server sent, reading (and discarding) whatever came before it."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None, "the server dropped the connection without a close frame"
    return closed.value.rcvd.code


def queued(conn: Any, kind: str) -> int:
    return sum(1 for item in tuple(conn.queue._items) if item.kind == kind)


class EngineSpy:
    """Wraps ``engine.generate`` and ``engine.close_session``: counts ticks and closes per session, injects faults.

    ``fail_generate``: sessions whose ticks raise; ``fail_close``: sessions whose next close raises (once);
    ``hold_close``: sessions whose every close raises (the engine keeps them) while they are listed;
    ``gate``: cleared, every tick waits for it.
    """

    def __init__(self, engine: ARDiffusionEngine) -> None:
        self.engine = engine
        self.ticks: collections.Counter[str] = collections.Counter()
        self.closes: collections.Counter[str] = collections.Counter()
        self.fail_generate: set[str] = set()
        self.fail_close: set[str] = set()
        self.hold_close: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self._generate, self._close_session = engine.generate, engine.close_session
        engine.generate = self.generate
        engine.close_session = self.close_session

    def generate(self, request: Any) -> Any:
        self.gate.wait(timeout=30)
        session_id = ARDiffusionTickRequest.from_extra_args(request.extra_args).session_id
        self.ticks[session_id] += 1
        if session_id in self.fail_generate:
            raise RuntimeError("injected device failure")
        return self._generate(request)

    def close_session(self, session_id: str) -> None:
        self.closes[session_id] += 1
        if session_id in self.fail_close:
            self.fail_close.discard(session_id)
            raise RuntimeError("injected close failure")
        if session_id in self.hold_close:
            raise RuntimeError("injected lasting close failure")
        self._close_session(session_id)

    def restore(self) -> None:
        self.gate.set()
        del self.engine.generate
        del self.engine.close_session


class Bystander:
    """A player that reads everything on its own thread, recording when each chunk arrived."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.request_id = start(ws, format="jpeg", prompt="a bystander")["request_id"]
        self.arrivals: list[float] = []
        self.unexpected: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    message = self.ws.recv(timeout=0.2)
                except TimeoutError:
                    continue
                if isinstance(message, bytes):
                    continue
                payload = json.loads(message)
                if payload["type"] == "video.chunk_metadata":
                    self.arrivals.append(time.monotonic())
                else:
                    self.unexpected.append(payload)
        except Exception as error:  # noqa: BLE001 - recorded, asserted by assert_streaming
            self.unexpected.append(error)

    def assert_streaming(self, since: float, chunks: int = 5, max_gap_s: float = 5.0) -> None:
        """At least ``chunks`` chunks arrived after ``since``, and chunks never stopped for ``max_gap_s``."""
        wait_for(lambda: sum(t > since for t in self.arrivals) >= chunks, 20, "the bystander's chunks")
        assert not self.unexpected, self.unexpected
        arrivals = list(self.arrivals)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])] + [time.monotonic() - arrivals[-1]]
        assert max(gaps) < max_gap_s, f"the bystander waited {max(gaps):.1f} s for a chunk"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class LiveServer:
    """``create_app`` on uvicorn in a thread on a loopback port; the clients it opened are dropped on exit."""

    def __init__(self, engine: ARDiffusionEngine, world: ServedWorld | None = None, **settings: Any) -> None:
        self.engine = engine
        world = ServedWorld.for_pipeline(engine.runner.pipeline) if world is None else world
        self.app = create_app(engine, world=world, settings=ServerSettings(**settings))
        self.server = self.app.state.server
        self.clients: list[ClientConnection] = []
        self.bystanders: list[Bystander] = []
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> LiveServer:
        self.socket = socket.socket()
        # Accepted sockets inherit it: a fixed, small send buffer (no autotuning up to megabytes).
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}{PATH}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_config=None, log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, 30, "uvicorn's start")
        return self

    def __exit__(self, *exc: Any) -> None:
        for bystander in self.bystanders:
            bystander.stop()
        for ws in self.clients:
            with contextlib.suppress(OSError):
                ws.socket.shutdown(socket.SHUT_RDWR)  # first: it wakes a thread blocked sending on it
            ws.close_socket()
        self.stack.close()
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not shut down"

    # -- clients ----------------------------------------------------------------------------------------
    def reader(self) -> ClientConnection:
        ws = self.stack.enter_context(connect(self.url, open_timeout=10, ping_interval=None, compression=None))
        self.clients.append(ws)
        return ws

    def non_reader(self) -> ClientConnection:
        """A client that never reads: it stops reading from its socket after one frame, and the socket's
        receive buffer is fixed (Linux otherwise grows it up to ``tcp_rmem``'s maximum, megabytes).
        No compression: repeated replies would deflate to a few bytes each."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", self.port))
        ws = self.stack.enter_context(connect(self.url, sock=sock, open_timeout=10, ping_interval=None,
                                              compression=None, max_queue=1))
        self.clients.append(ws)
        return ws

    def bystander(self) -> Bystander:
        bystander = Bystander(self.reader())
        self.bystanders.append(bystander)
        return bystander

    def connection(self, exclude: set[str]) -> Any:
        """The server's connection object of the newest client (the one whose request id is not in ``exclude``)."""
        found: list[Any] = []

        def find() -> bool:
            found[:] = [c for c in tuple(self.server.connections) if c.request_id not in exclude]
            return len(found) == 1

        wait_for(find, 10, "the connection")
        return found[0]

    # -- what the server says -----------------------------------------------------------------------------
    def health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=10).json()

    def metric(self, line_start: str) -> float:
        for line in httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return 0.0  # a labelled counter appears at its first increment

    def assert_serving(self, bystanders: list[Bystander], since: float) -> None:
        """Only ``bystanders`` are left, they stream, and /healthz, /metrics and the engine say so."""
        players = len(bystanders)
        expected = {"connected": players, "streaming": players, "admitted": players, "resident": players,
                    "closing": 0}
        wait_for(lambda: self.health()["sessions"] == expected, 15, f"/healthz sessions {expected}")
        for bystander in bystanders:
            bystander.assert_streaming(since)
        assert self.health()["status"] == "ok"
        assert self.metric("ardiff_sessions_connected") == players
        assert self.metric("ardiff_sessions_resident") == players
        assert sorted(self.engine.sessions) == sorted(b.request_id for b in bystanders)
        assert self.engine.offloaded_sessions == ()


@pytest.fixture(scope="module")
def engine():
    with ARDiffusionEngine(WorldPipeline("tiny"), CONFIG) as engine:
        with LiveServer(engine) as live:  # compile the tick once, outside every test's time bounds
            ws = live.reader()
            start(ws, format="jpeg", num_frames=2)
            until(ws, "session.done")
        yield engine


@pytest.fixture
def spy(engine):
    spy = EngineSpy(engine)
    yield spy
    spy.restore()
    wait_for(lambda: engine.sessions == () and engine.offloaded_sessions == (), 15, "no engine session left")


# -- 1. a failed chunk of a client that does not read ---------------------------------------------------


def test_a_chunk_failing_for_a_client_that_does_not_read_never_blocks_the_loop(engine, spy):
    with LiveServer(engine, max_queued_chunks=64, max_queued_control=2, close_timeout_s=0.5) as live:
        bystander = live.bystander()
        silent = live.non_reader()
        silent.send(start_message(**LARGE))
        conn = live.connection({bystander.request_id})
        wait_for(lambda: queued(conn, "media") >= 3, 30, "its sender stuck on the full socket")
        for _ in range(8):
            silent.send(json.dumps({"type": "session.ping"}))
        wait_for(lambda: queued(conn, "control") >= 2, 10, "its control queue full")
        since = time.monotonic()
        spy.fail_generate.add(conn.request_id)
        wait_for(lambda: conn not in live.server.connections, 10, "the failed session's connection dropped")
        assert spy.ticks[conn.request_id] >= 1
        live.assert_serving([bystander], since)
        assert live.metric('ardiff_errors_total{code="generation_failed"}') == 1


# -- 2. a client that never reads -------------------------------------------------------------------------


def test_a_client_that_never_reads_is_stalled_and_its_generation_pauses(engine, spy):
    with LiveServer(engine, max_queued_chunks=2, stall_timeout_s=3.0, close_timeout_s=0.5) as live:
        bystander = live.bystander()
        silent = live.non_reader()
        silent.send(start_message(**LARGE))
        conn = live.connection({bystander.request_id})
        wait_for(lambda: queued(conn, "media") >= 2, 30, "its send queue full")
        since = time.monotonic()
        made = spy.ticks[conn.request_id]
        time.sleep(1.0)
        assert spy.ticks[conn.request_id] <= made + 1, "chunks were still made for a client that reads nothing"
        wait_for(lambda: conn not in live.server.connections, 3.0 + 0.5 + 5, "the silent client dropped")
        assert live.metric('ardiff_errors_total{code="stall"}') == 1
        live.assert_serving([bystander], since)


# -- 3. an engine close that raises ------------------------------------------------------------------------


def test_an_engine_close_that_raises_on_stop_still_frees_the_slot_and_ends_the_session(engine, spy, caplog):
    with LiveServer(engine, capacity=2) as live:
        bystander = live.bystander()
        player = live.reader()
        request_id = start(player, format="jpeg")["request_id"]
        next_chunk(player)
        spy.fail_close.add(request_id)
        since = time.monotonic()
        with caplog.at_level(logging.INFO, logger="ardiff_jax.serve"):
            player.send(json.dumps({"type": "session.stop"}))
            done = until(player, "session.done")
            assert done["stopped"] is True
            player.close()  # the socket stays open for another session after session.done; this client leaves
            live.assert_serving([bystander], since)  # the retry released the engine session
        assert spy.closes[request_id] >= 2
        assert "injected close failure" in caplog.text and f"session {request_id} closed on a retry" in caplog.text
        # The slot is free: with capacity 2, another player gets in.
        late = live.reader()
        start(late, format="jpeg")
        next_chunk(late)


def test_a_session_the_engine_still_holds_keeps_its_slot_and_no_live_player_is_evicted(engine, spy, caplog):
    # The server serves as many players as the engine holds. One player's engine close keeps failing: the
    # engine still holds that session, so a newcomer admitted now would make the engine evict a live one.
    with LiveServer(engine) as live:
        held = engine.session_capacity
        assert live.server.capacity == held
        bystanders = [live.bystander() for _ in range(held - 1)]
        player = live.reader()
        request_id = start(player, format="jpeg")["request_id"]
        next_chunk(player)
        spy.hold_close.add(request_id)
        since = time.monotonic()
        with caplog.at_level(logging.INFO, logger="ardiff_jax.serve"):
            player.send(json.dumps({"type": "session.stop"}))
            assert until(player, "session.done")["stopped"] is True
            player.close()
            wait_for(lambda: spy.closes[request_id] >= 3, 10, "the close retried (and failing)")
        assert request_id in engine.sessions  # the engine holds it: its slot is not free
        newcomer = live.reader()
        newcomer.send(start_message(format="jpeg"))
        refusal = json.loads(newcomer.recv(timeout=30))
        assert refusal.get("code") == "capacity" and f"{held} of {held}" in refusal["message"], refusal
        # Once the engine lets the session go (a refused start retries its close), the newcomer gets in.
        spy.hold_close.clear()
        deadline = time.monotonic() + 15
        while True:
            newcomer.send(start_message(format="jpeg"))
            reply = json.loads(newcomer.recv(timeout=30))
            if reply["type"] == "video.start":
                break
            assert reply.get("code") == "capacity" and time.monotonic() < deadline, reply
            time.sleep(0.05)
        next_chunk(newcomer)
        assert request_id not in engine.sessions
        for bystander in bystanders:
            bystander.assert_streaming(since)
        assert live.metric("ardiff_evictions_total") == 0
        newcomer.close()
        live.assert_serving(bystanders, since)


def test_a_close_failing_a_few_times_is_retried_with_backoff_until_the_engine_releases_the_slot(engine, spy):
    # Issue 43, item 7: the close keeps failing for longer than a couple of retries (four attempts
    # and more), then succeeds; nobody starts a session meanwhile (a refused start would retry it
    # too). The server retries on its own until the engine lets the session go, reporting it as
    # closing meanwhile, and the slot is free again: no capacity is lost for good.
    with LiveServer(engine, capacity=1) as live:
        player = live.reader()
        request_id = start(player, format="jpeg")["request_id"]
        next_chunk(player)
        spy.hold_close.add(request_id)
        player.send(json.dumps({"type": "session.stop"}))
        assert until(player, "session.done")["stopped"] is True
        wait_for(lambda: spy.closes[request_id] >= 4, 15, "four failed closes")
        assert request_id in engine.sessions and live.server.occupied() == 1  # held: its slot stays taken
        assert live.health()["sessions"]["closing"] == 1
        assert live.metric("ardiff_sessions_closing") == 1
        spy.hold_close.clear()  # the engine lets go at the next retry
        wait_for(lambda: request_id not in engine.sessions, 15, "the engine released the session on a retry")
        wait_for(lambda: live.health()["sessions"]["closing"] == 0, 10, "health no longer reports it closing")
        assert live.metric("ardiff_sessions_closing") == 0 and live.server.occupied() == 0
        start(player, format="jpeg")  # the one slot is free again
        next_chunk(player)


def test_close_retry_delays_double_from_50_ms_to_a_2_s_cap_and_are_bounded():
    delays = _app.close_retry_delays()
    assert delays[:6] == (0.05, 0.1, 0.2, 0.4, 0.8, 1.6) and set(delays[6:]) == {2.0}
    assert 10 <= len(delays) < 100 and _app.CLOSE_RETRY_DELAYS_S == delays


# -- 4. a client that floods and never reads ---------------------------------------------------------------


def test_a_client_that_floods_and_never_reads_is_closed_at_the_start_timeout(engine, spy):
    # A start timeout of 5 s leaves a loaded 2-core machine time to fill the socket before it fires.
    with LiveServer(engine, start_timeout_s=5.0, close_timeout_s=0.5, max_queued_control=4) as live:
        bystander = live.bystander()
        flooder = live.non_reader()
        opened = time.monotonic()
        conn = live.connection({bystander.request_id})
        unknown = json.dumps({"type": "x" * 80})  # each answered by an unknown_type error of ~230 bytes

        def flood() -> None:
            with pytest.raises(Exception):  # noqa: B017 - ends when the socket is dropped, whatever the error
                while True:
                    flooder.send(unknown)

        threading.Thread(target=flood, daemon=True).start()
        # Before the start timeout: the replies filled the socket, its control queue is full, its reader waits.
        wait_for(lambda: queued(conn, "control") >= 4, 4.5, "its control queue full")
        wait_for(lambda: conn not in live.server.connections, 5.0 + 0.5 + 5, "the flooder dropped")
        assert time.monotonic() - opened < 5.0 + 0.5 + 3
        assert live.metric('ardiff_errors_total{code="start_timeout"}') == 1
        live.assert_serving([bystander], opened)


# -- 5. an encode error -------------------------------------------------------------------------------------


def test_an_encode_error_ends_the_session_with_an_error_and_frees_the_slot(engine, spy, monkeypatch):
    make_encoder = _app.make_encoder

    def failing_second_chunk(format: str, **kwargs: Any) -> Any:
        encoder = make_encoder(format, **kwargs)
        if kwargs["scale"] == 2:  # the failing player's, not the bystander's
            encode, calls = encoder.encode, []

            def encode_once(frames: Any) -> bytes:
                calls.append(1)
                if len(calls) == 2:
                    raise ValueError("injected encode failure")
                return encode(frames)

            encoder.encode = encode_once
        return encoder

    monkeypatch.setattr(_app, "make_encoder", failing_second_chunk)
    with LiveServer(engine) as live:
        bystander = live.bystander()
        player = live.reader()
        since = time.monotonic()
        start(player, format="jpeg", num_frames=4, width=16, height=16)  # two chunks: the last one fails
        next_chunk(player)
        error = json.loads(player.recv(timeout=30))
        assert error["type"] == "error" and error["code"] == "generation_failed", error
        assert "encoding" in error["message"] and "injected encode failure" in error["message"]
        assert close_code(player) == 1011
        live.assert_serving([bystander], since)
        assert live.metric('ardiff_errors_total{code="generation_failed"}') == 1


# -- 6. a capacity above the engine's ----------------------------------------------------------------------


def test_a_capacity_above_what_the_engine_holds_is_clamped_with_a_warning(engine, spy, caplog):
    held = engine.session_capacity  # no host tier here
    with caplog.at_level(logging.WARNING, logger="ardiff_jax.serve"):
        live = LiveServer(engine, capacity=held + 2)
    assert live.server.capacity == held
    assert f"capacity {held + 2} is above the {held} sessions the engine holds" in caplog.text
    with live:
        assert live.health()["capacity"] == held
        bystanders = [live.bystander() for _ in range(held)]
        since = time.monotonic()
        extra = live.reader()
        extra.send(start_message(format="jpeg"))
        refusal = json.loads(extra.recv(timeout=30))
        assert refusal["code"] == "capacity" and f"{held} of {held}" in refusal["message"], refusal
        extra.close_socket()
        live.assert_serving(bystanders, since)
        assert live.metric("ardiff_evictions_total") == 0


# -- the send queue's writers that never wait ----------------------------------------------------------------


def test_send_queue_offer_never_waits_and_the_last_message_goes_past_the_bound():
    import asyncio

    from ardiff_jax.serve._send_queue import SendQueue

    async def scenario() -> tuple[list[bool], bool, bool, list[Any]]:
        queue = SendQueue(max_media=1, max_control=2)
        offered = [queue.offer_control({"i": i}) for i in range(3)]  # the third finds the bound: dropped
        closed = queue.close(1011, "failed", {"type": "error"})  # past the bound, with the close
        again = queue.close(1000, "done", {"type": "session.done"})
        items = [await queue.get() for _ in range(len(queue))]
        return offered, closed, again, [(item.kind, item.message, item.code) for item in items]

    offered, closed, again, items = asyncio.run(scenario())
    assert offered == [True, True, False] and closed and not again
    assert items == [("control", {"i": 0}, 1000), ("control", {"i": 1}, 1000),
                     ("control", {"type": "error"}, 1000), ("close", None, 1011)]


# -- 7. hostile JSON -------------------------------------------------------------------------------------------


def test_huge_numbers_and_deep_nesting_are_invalid_json_not_a_parser_crash():
    deep = MAX_JSON_DEPTH + 1
    for text in ['{"type": "session.start", "seed": ' + "7" * 5000 + "}",
                 '{"type": "session.start", "format": ' + "[" * 1000 + "]" * 1000 + "}",
                 '{"type": "session.start", "extra_params": ' + '{"a": ' * deep + "0" + "}" * deep + "}"]:
        with pytest.raises(ProtocolError) as raised:
            parse_client_message(text)
        assert raised.value.code == "invalid_json"
    nested = '{"type": "session.start", "extra_params": ' + '{"a": ' * 20 + "0" + "}" * 20 + "}"
    assert parse_client_message(nested).ignored_fields == ("extra_params",)


def test_huge_numbers_and_deep_nesting_get_invalid_json_and_the_socket_stays(engine, spy):
    probes = ['{"type": "session.start", "seed": ' + "7" * 5000 + "}",
              '{"type": "session.start", "num_frames": -' + "1" * 4400 + "}"]
    for depth in (1000, 990, 900, 500):
        probes.append('{"type": "session.start", "format": ' + "[" * depth + "]" * depth + "}")
        probes.append('{"type": "session.ping", "pad": ' + '{"a": ' * depth + "0" + "}" * depth + "}")
    with LiveServer(engine) as live:
        bystander = live.bystander()
        since = time.monotonic()
        ws = live.reader()
        for text in probes:
            ws.send(text)
            reply = json.loads(ws.recv(timeout=30))
            assert reply["type"] == "error" and reply["code"] == "invalid_json", (text[:60], reply)
        ws.send(json.dumps({"type": "session.ping"}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.pong"}
        start(ws, format="jpeg")
        next_chunk(ws)
        ws.close()
        live.assert_serving([bystander], since)
        assert live.metric('ardiff_errors_total{code="invalid_json"}') == len(probes)


# -- a bug while handling a message; a wedged loop ------------------------------------------------------------


def test_an_unexpected_error_handling_a_message_is_logged_and_answered(engine, spy, caplog):
    base = ServedWorld.for_pipeline(engine.runner.pipeline)

    class BrokenWorld(ServedWorld):
        def plan_start(self, start: Any, **kwargs: Any) -> Any:
            if start.prompt == "break":
                raise RuntimeError("injected bug")
            return super().plan_start(start, **kwargs)

    world = BrokenWorld(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    with LiveServer(engine, world=world) as live:
        bystander = live.bystander()
        since = time.monotonic()
        ws = live.reader()
        with caplog.at_level(logging.ERROR, logger="ardiff_jax.serve"):
            ws.send(start_message(prompt="break"))
            reply = json.loads(ws.recv(timeout=30))
            assert reply["type"] == "error" and reply["code"] == "internal_error", reply
            assert close_code(ws) == 1011
        assert "injected bug" in caplog.text
        live.assert_serving([bystander], since)


def test_healthz_says_stalled_while_one_chunk_holds_the_generation_loop(engine, spy):
    with LiveServer(engine, stall_timeout_s=1.0) as live:
        ws = live.reader()
        start(ws, format="jpeg")
        next_chunk(ws)
        spy.gate.clear()  # the next tick does not return
        wait_for(lambda: live.health()["status"] == "stalled", 10, "/healthz status stalled")
        spy.gate.set()
        wait_for(lambda: live.health()["status"] == "ok", 10, "/healthz status ok")


# -- 8. the connection's state machine inside the server ---------------------------------------------------


def test_an_illegal_state_move_inside_the_server_closes_that_connection_1011_and_no_other(engine, spy, caplog,
                                                                                          monkeypatch):
    interact = _app._Server._interact

    async def buggy(self: Any, conn: Any, interaction: Any) -> None:
        if interaction.prompt == "bug":
            conn.transition(_app.ConnectionState.WAITING)  # streaming -> waiting: no move of the table
        await interact(self, conn, interaction)

    monkeypatch.setattr(_app._Server, "_interact", buggy)
    with LiveServer(engine) as live:
        bystander = live.bystander()
        since = time.monotonic()
        ws = live.reader()
        request_id = start(ws, format="jpeg")["request_id"]
        with caplog.at_level(logging.ERROR, logger="ardiff_jax.serve"):
            ws.send(json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "bug"}}}))
            reply = until(ws, "error")
            assert reply["code"] == "internal_error", reply
            assert close_code(ws) == 1011
        assert "illegal move streaming -> waiting" in caplog.text
        wait_for(lambda: spy.closes[request_id] == 1, 10, "its session's close")  # closed all the same
        live.assert_serving([bystander], since)

