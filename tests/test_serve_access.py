"""Who may connect to ``ardiff-jax serve``: the API key, the Origin allow-list, the per-address limit.

The decisions are pure functions (``ardiff_jax.serve._access``) and are tested as such first; then
real clients (the ``websockets`` library and ``httpx``) talk to uvicorn on a loopback port: a refused
handshake gets its HTTP status and a one-phrase reason, creates no engine session and is counted in
``ardiff_connections_refused_total``; an admitted one plays a chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, Self

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("websockets")

import httpx
import uvicorn
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.cli import build_parser, main
from ardiff_jax.models import WorldPipeline
from ardiff_jax.serve import (
    ServedWorld,
    ServerAccess,
    _access,
    create_app,
    read_api_key_file,
)
from ardiff_jax.serve._access import (
    ConnectionCounter,
    Refusal,
    FORWARDED_UNVERIFIED,
    TokenRedactingFilter,
    bearer_or_token,
    client_address,
    key_matches,
    metrics_refusal,
    origin_allowed,
    websocket_refusal,
)

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)
KEY = "s3cret-Key_0123456789"


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(0.02)


# -- the pure decisions ------------------------------------------------------------------------------------


#: The address a handshake arrived on (the ASGI ``scope["server"]``: the listening socket's, never a header).
LOOPBACK = ("127.0.0.1", 8000)


@pytest.mark.parametrize("origin, allowed, admitted", [
    (None, (), True),                                   # not a browser: the key governs it
    ("http://127.0.0.1:8000", (), True),                # the server's own page
    ("HTTP://127.0.0.1:8000/", (), True),               # case and a bare slash do not matter
    ("http://localhost:8000", (), True),                # a loopback server's other loopback names
    ("http://[::1]:8000", (), True),
    ("http://127.0.0.1:8001", (), False),               # another port is another origin
    ("https://127.0.0.1:8000", (), False),              # another scheme too
    ("http://evil.example:8000", (), False),            # a name that resolves here (DNS rebinding) is not ours
    ("http://evil.example", (), False),
    ("null", (), False),                                # a sandboxed frame or a file
    ("http://127.0.0.1:8000/page", (), False),          # an Origin never has a path: not an origin
    ("http://evil.example", ("http://evil.example",), True),
    ("http://evil.example:80", ("http://evil.example",), True),   # the default port, written or not
    ("https://evil.example", ("http://evil.example",), False),
    ("http://evil.example", ("*",), True),
    ("null", ("*",), True),
])
def test_origin_allowed_same_origin_allow_list_and_any(origin, allowed, admitted):
    access = ServerAccess(allowed_origins=allowed)
    assert origin_allowed(origin, server=LOOPBACK, scheme="ws", allowed_origins=access.allowed_origins) is admitted


def test_same_origin_is_the_address_the_server_listens_on_never_the_host_header():
    # A server on a LAN address: its own address and port are same-origin; a name is not, whatever resolves to it.
    lan = ("192.168.1.5", 8000)
    assert origin_allowed("http://192.168.1.5:8000", server=lan, scheme="ws", allowed_origins=())
    assert not origin_allowed("http://localhost:8000", server=lan, scheme="ws", allowed_origins=())
    assert not origin_allowed("http://mybox.lan:8000", server=lan, scheme="ws", allowed_origins=())
    assert origin_allowed("http://mybox.lan:8000", server=lan, scheme="ws", allowed_origins=("http://mybox.lan:8000",))
    # The page's scheme follows the handshake's; default ports are filled in.
    assert origin_allowed("https://10.0.0.2", server=("10.0.0.2", 443), scheme="wss", allowed_origins=())
    assert not origin_allowed("http://10.0.0.2:443", server=("10.0.0.2", 443), scheme="wss", allowed_origins=())
    assert origin_allowed("http://[::1]:8000", server=("::1", 8000), scheme="ws", allowed_origins=())
    assert origin_allowed("http://localhost:8000", server=("::ffff:127.0.0.1", 8000), scheme="ws", allowed_origins=())
    # No server address known (no socket): only the allow-list.
    assert not origin_allowed("http://127.0.0.1:8000", server=None, scheme="ws", allowed_origins=())
    # The Host header is not even an input: a rebinding page that sends Host: evil.example gains nothing.
    access = ServerAccess()
    rebinding = {"host": "evil.example:8000", "origin": "http://evil.example:8000"}
    assert websocket_refusal(access, headers=rebinding, query={}, scheme="ws", server=LOOPBACK,
                             open_connections=0) is Refusal.ORIGIN_NOT_ALLOWED


@pytest.mark.parametrize("client, forwarded, trusted, expected", [
    (("127.0.0.1", 5000), None, (), "127.0.0.1"),
    (("127.0.0.1", 5000), "10.0.0.7", (), "127.0.0.1"),                  # not trusted: the peer counts
    (("10.0.0.7", 0), "10.0.0.7", (), FORWARDED_UNVERIFIED),             # rewritten in front of the app
    (("10.0.0.7", 5555), "10.0.0.7:5555", (), FORWARDED_UNVERIFIED),
    (("127.0.0.1", 5000), "10.0.0.7", ("127.0.0.1",), "10.0.0.7"),       # a trusted proxy names the client
    (("127.0.0.1", 5000), "6.6.6.6, 10.0.0.7", ("127.0.0.1",), "10.0.0.7"),   # the right-most untrusted hop
    (("10.1.2.3", 5000), "6.6.6.6, 10.0.0.7, 10.1.0.9", ("10.1.0.0/16",), "10.0.0.7"),
    (("10.1.2.3", 5000), "10.1.0.8", ("10.1.0.0/16",), "10.1.0.8"),      # only proxies: the left-most
    (("192.0.2.1", 5000), "10.0.0.7", ("127.0.0.1",), "192.0.2.1"),      # not from a trusted proxy
    (None, None, (), ""),
])
def test_the_client_address_trusts_forwarding_headers_only_from_trusted_proxies(client, forwarded, trusted,
                                                                                  expected):
    headers = {} if forwarded is None else {"x-forwarded-for": forwarded}
    assert client_address(ServerAccess(trusted_proxies=trusted), client=client, headers=headers) == expected


def test_the_presented_key_comes_from_the_bearer_header_or_the_token_parameter():
    assert bearer_or_token({"authorization": f"Bearer {KEY}"}, {}) == KEY
    assert bearer_or_token({"authorization": f"bearer  {KEY} "}, {}) == KEY
    assert bearer_or_token({}, {"token": KEY}) == KEY
    assert bearer_or_token({"authorization": "Basic abc"}, {"token": KEY}) == KEY
    assert bearer_or_token({"authorization": "Basic abc"}, {}) is None
    assert bearer_or_token({}, {"token": ""}) is None


def test_keys_are_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(_access.hmac, "compare_digest", spy)
    assert key_matches(KEY, KEY) and not key_matches(KEY, KEY[:-1]) and not key_matches(KEY, None)
    assert not key_matches(KEY, "\udcff")  # a lone surrogate from a hostile query string is a wrong key, not a crash
    assert compared[:2] == [(KEY.encode(), KEY.encode()), (KEY.encode(), KEY[:-1].encode())]


def test_the_handshake_decision_checks_origin_then_key_then_the_limit():
    access = ServerAccess(api_key=KEY, max_connections_per_client=2)
    good = {"host": "h:1", "origin": "http://h:1", "authorization": f"Bearer {KEY}"}

    def decide(headers: dict, query: dict | None = None, open_connections: int = 0) -> Refusal | None:
        return websocket_refusal(access, headers=headers, query=query or {}, scheme="ws", server=("h", 1),
                                 open_connections=open_connections)

    assert decide(good) is None and decide(good, open_connections=1) is None
    assert decide(good, open_connections=2) is Refusal.TOO_MANY_CONNECTIONS
    assert decide({**good, "authorization": "Bearer wrong"}) is Refusal.UNAUTHORIZED
    assert decide({"host": "h:1"}, {"token": KEY}) is None
    assert decide({**good, "origin": "http://evil.example"}) is Refusal.ORIGIN_NOT_ALLOWED
    assert websocket_refusal(ServerAccess(), headers={"host": "h:1"}, query={}, scheme="ws", server=("h", 1),
                             open_connections=0) is None
    assert metrics_refusal(access, headers={}, query={}) is Refusal.UNAUTHORIZED
    assert metrics_refusal(access, headers={}, query={"token": KEY}) is None
    assert metrics_refusal(dataclasses.replace(access, public_metrics=True), headers={}, query={}) is None
    assert metrics_refusal(ServerAccess(), headers={}, query={}) is None
    assert [(r.value, r.status_code, r.metric_label) for r in Refusal] == [
        ("unauthorized", 401, "unauthorized"), ("origin not allowed", 403, "origin_not_allowed"),
        ("too many connections", 429, "too_many_connections")]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"api_key": ""}, ValueError, "non-empty"),
    ({"api_key": "two words"}, ValueError, "printable ASCII"),
    ({"api_key": "key\n"}, ValueError, "printable ASCII"),
    ({"api_key": 123}, ValueError, "non-empty string"),
    ({"allowed_origins": "http://a.example"}, TypeError, "tuple"),
    ({"allowed_origins": ("ftp://a.example",)}, ValueError, "scheme://host"),
    ({"allowed_origins": ("http://a.example/path",)}, ValueError, "no path"),
    ({"allowed_origins": ("a.example",)}, ValueError, "scheme://host"),
    ({"public_metrics": "yes"}, TypeError, "bool"),
    ({"max_connections_per_client": 0}, ValueError, "positive"),
    ({"trusted_proxies": "127.0.0.1"}, TypeError, "tuple"),
    ({"trusted_proxies": ("proxy.example",)}, ValueError, "IP address or network"),
])
def test_bad_access_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ServerAccess(**kwargs)


def test_access_settings_are_canonical_and_never_show_the_key():
    access = ServerAccess(api_key=KEY, allowed_origins=["HTTPS://Play.Example:443", "http://[::1]:9000/", "*"])
    assert access.allowed_origins == ("https://play.example:443", "http://[::1]:9000", "*")
    assert KEY not in repr(access) and KEY not in str(access)
    assert ServerAccess().max_connections_per_client == 8 and ServerAccess().api_key is None


def test_the_connection_counter_counts_per_address_and_forgets_idle_addresses():
    counter = ConnectionCounter()
    counter.acquire("a")
    counter.acquire("a")
    counter.acquire("b")
    assert (counter.open_connections("a"), counter.open_connections("b"), counter.open_connections("c")) == (2, 1, 0)
    counter.release("a")
    counter.release("b")
    assert counter.open_connections("a") == 1 and counter._open == {"a": 1}
    with pytest.raises(RuntimeError, match="more often"):
        counter.release("b")


def test_the_key_file_is_read_stripped_and_an_empty_one_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {KEY}\n", encoding="utf-8")
    assert read_api_key_file(path) == KEY
    path.write_text(" \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        read_api_key_file(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="UTF-8"):
        read_api_key_file(path)


def test_the_log_filter_redacts_tokens_in_request_lines():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", f"{PATH}?a=1&token={KEY}&b=2"), None)
    assert TokenRedactingFilter().filter(record)
    assert record.getMessage() == f'127.0.0.1:5 - "WebSocket {PATH}?a=1&token=<redacted>&b=2" [accepted]'


@pytest.mark.parametrize("query", [
    f"%74oken={KEY}", f"TOKEN={KEY}", f"Token={KEY}&x=1", f"%54%4f%4b%45%4e={KEY}", f"to%6Ben={KEY}",
    f"token=%{ord(KEY[0]):02x}{KEY[1:]}", f"a=1;token={KEY}", f"other={KEY}", f"x=1&{KEY}",
    "z=" + "".join(f"%{ord(ch):02X}" for ch in KEY), f"token={KEY.replace('-', '%2D')}",
])
def test_the_log_filter_redacts_the_key_parameter_however_spelled_and_any_value_equal_to_the_key(query):
    # The name is compared as the server reads it (percent-decoded) and case-folded; with the key known,
    # any value that is the key (raw or percent-encoded) goes too, under whatever name.
    for message, args in (("%s", (f"{PATH}?{query}",)), ("%(path)s", ({"path": f"{PATH}?{query}"},))):
        record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, message, args, None)
        assert TokenRedactingFilter(KEY).filter(record)
        shown = record.getMessage()
        assert KEY not in urllib.parse.unquote(shown) and "<redacted>" in shown, shown
    record = logging.LogRecord("x", logging.INFO, __file__, 1, f'"GET {PATH}?{query} HTTP/1.1" 401', None, None)
    TokenRedactingFilter(KEY).filter(record)
    shown = record.getMessage()
    assert KEY not in urllib.parse.unquote(shown) and shown.endswith('HTTP/1.1" 401'), shown


# -- a real server -----------------------------------------------------------------------------------------


class SessionSpy:
    """Counts the control plane's ``create_session`` calls (a refused handshake must make none)."""

    def __init__(self, manager: Any) -> None:
        self.calls = 0
        original = manager.create_session

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await original(*args, **kwargs)

        manager.create_session = counted


class LiveServer:
    """``create_app(..., access=access)`` on uvicorn in a thread on a loopback port."""

    def __init__(self, engine: ARDiffusionEngine, access: ServerAccess | None, *, proxy_headers: bool = True) -> None:
        self.engine = engine
        # uvicorn's default (True) rewrites the client address of a loopback peer from X-Forwarded-For; the CLI
        # turns it off. The app must hold its rules under both.
        self.proxy_headers = proxy_headers
        self.app = create_app(engine, world=ServedWorld.for_pipeline(engine.runner.pipeline), access=access)
        self.server = self.app.state.server
        self.sessions = SessionSpy(self.server.manager)
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        self.url = f"ws://127.0.0.1:{self.port}{PATH}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_config=None, log_level="info",
                                                     proxy_headers=self.proxy_headers, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, 30, "uvicorn's start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not shut down"

    def connect(self, url: str | None = None, **kwargs: Any) -> ClientConnection:
        return self.stack.enter_context(connect(url or self.url, open_timeout=10, ping_interval=None, **kwargs))

    def connect_as(self, host: str, **kwargs: Any) -> ClientConnection:
        """A handshake naming ``host`` (``Host: host:port``), sent to this server: as a browser whose DNS now
        resolves ``host`` to 127.0.0.1 (DNS rebinding) would send it."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return self.connect(f"ws://{host}:{self.port}{PATH}", sock=sock, **kwargs)

    def refused(self, url: str | None = None, **kwargs: Any) -> tuple[int, str]:
        """The HTTP status and body of a refused handshake (failing if it was accepted)."""
        with pytest.raises(InvalidStatus) as refused:
            self.connect(url, **kwargs)
        response = refused.value.response
        return response.status_code, response.body.decode()

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=10, **kwargs)

    def refusals(self, label: str) -> float:
        for line in self.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text.splitlines():
            if line.startswith(f'ardiff_connections_refused_total{{reason="{label}"}} '):
                return float(line.split()[-1])
        return 0.0


def plays_a_chunk(ws: ClientConnection) -> None:
    ws.send(json.dumps({"type": "session.start", "prompt": "a quiet lake", "format": "jpeg", "num_frames": 1}))
    reply = json.loads(ws.recv(timeout=60))
    assert reply["type"] == "video.start", reply
    meta = json.loads(ws.recv(timeout=60))
    assert meta["type"] == "video.chunk_metadata", meta
    assert isinstance(ws.recv(timeout=60), bytes)
    assert json.loads(ws.recv(timeout=60))["type"] == "session.done"


@pytest.fixture(scope="module")
def engine() -> Iterator[ARDiffusionEngine]:
    with ARDiffusionEngine(WorldPipeline("tiny"), CONFIG) as engine:
        yield engine


@pytest.fixture
def keyed(engine) -> Iterator[LiveServer]:
    with LiveServer(engine, ServerAccess(api_key=KEY)) as live:
        yield live
    wait_for(lambda: engine.sessions == (), 15, "no engine session left")


def test_without_the_key_a_handshake_is_refused_before_any_session(keyed, caplog):
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    assert keyed.refused() == (401, "unauthorized")
    assert keyed.refused(additional_headers={"Authorization": "Bearer wrong"}) == (401, "unauthorized")
    assert keyed.refused(f"{keyed.url}?token=wrong") == (401, "unauthorized")
    assert keyed.refused(additional_headers={"Authorization": f"Bearer {KEY}x"}) == (401, "unauthorized")
    assert keyed.sessions.calls == 0 and keyed.server.connections == set() and keyed.engine.sessions == ()
    assert keyed.refusals("unauthorized") == 4
    assert keyed.get("/healthz").json()["sessions"]["connected"] == 0


def test_the_key_in_the_header_or_the_token_parameter_plays(keyed, caplog):
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    plays_a_chunk(keyed.connect(additional_headers={"Authorization": f"Bearer {KEY}"}))
    plays_a_chunk(keyed.connect(f"{keyed.url}?token={KEY}"))
    assert keyed.sessions.calls == 2 and keyed.refusals("unauthorized") == 0
    # uvicorn logs each handshake's path with its query string: the key must not reach the log.
    assert "token=<redacted>" in caplog.text and KEY not in caplog.text


def test_metrics_need_the_key_unless_public_and_health_and_the_page_stay_public(engine):
    with LiveServer(engine, ServerAccess(api_key=KEY)) as live:
        refused = live.get("/metrics")
        assert (refused.status_code, refused.text, refused.headers["www-authenticate"]) == (
            401, "unauthorized", "Bearer")
        assert live.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert live.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert "ardiff_chunks_total" in live.get("/metrics", params={"token": KEY}).text
        assert live.get("/healthz").status_code == 200 and live.get("/").status_code == 200
        assert KEY not in live.get("/").text
    with LiveServer(engine, ServerAccess(api_key=KEY, public_metrics=True)) as live:
        assert live.get("/metrics").status_code == 200
        assert live.refused() == (401, "unauthorized")  # public metrics do not open the WebSocket
    with LiveServer(engine, None) as live:  # no key set: metrics stay open as before
        assert live.get("/metrics").status_code == 200


def test_a_foreign_origin_is_refused_and_same_origin_allow_listed_and_no_origin_play(engine):
    with LiveServer(engine, ServerAccess(allowed_origins=("http://friend.example",))) as live:
        assert live.refused(origin="http://evil.example") == (403, "origin not allowed")
        assert live.refused(origin=f"http://127.0.0.1:{live.port + 1}") == (403, "origin not allowed")
        assert live.refused(origin="null") == (403, "origin not allowed")
        assert live.sessions.calls == 0 and live.refusals("origin_not_allowed") == 3
        plays_a_chunk(live.connect(origin=live.origin))
        plays_a_chunk(live.connect(origin="http://friend.example"))
        plays_a_chunk(live.connect())  # no Origin: not a browser page
        assert live.sessions.calls == 3
    with LiveServer(engine, ServerAccess(allowed_origins=("*",))) as live:
        plays_a_chunk(live.connect(origin="http://evil.example"))
    wait_for(lambda: engine.sessions == (), 15, "no engine session left")


def test_a_foreign_origin_is_refused_even_with_the_key(keyed):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert keyed.refused(origin="http://evil.example", additional_headers=headers) == (403, "origin not allowed")


def test_connections_per_client_address_are_limited_and_freed_on_close(engine):
    with LiveServer(engine, ServerAccess(max_connections_per_client=2)) as live:
        first, second = live.connect(), live.connect()
        wait_for(lambda: len(live.server.connections) == 2, 10, "two open connections")
        assert live.refused() == (429, "too many connections")
        assert live.refusals("too_many_connections") == 1 and len(live.server.connections) == 2
        second.close()
        wait_for(lambda: len(live.server.connections) == 1, 10, "the closed connection released")
        plays_a_chunk(live.connect())
        plays_a_chunk(first)
    wait_for(lambda: engine.sessions == (), 15, "no engine session left")


def test_a_dns_rebinding_page_is_not_same_origin_while_the_servers_own_pages_are(engine):
    # A page of evil.example whose name now resolves to 127.0.0.1 sends Origin and Host of evil.example:PORT.
    with LiveServer(engine, None) as live:
        rebinding = f"http://evil.example:{live.port}"
        with pytest.raises(InvalidStatus) as refused:
            live.connect_as("evil.example", origin=rebinding)
        assert (refused.value.response.status_code, refused.value.response.body) == (403, b"origin not allowed")
        assert live.sessions.calls == 0 and live.refusals("origin_not_allowed") == 1
        # The server's own page, under any of the loopback names of the address it listens on, plays.
        plays_a_chunk(live.connect(origin=f"http://127.0.0.1:{live.port}"))
        plays_a_chunk(live.connect_as("localhost", origin=f"http://localhost:{live.port}"))
        plays_a_chunk(live.connect(origin=f"http://localhost:{live.port}"))
    with LiveServer(engine, ServerAccess(allowed_origins=("http://play.example",))) as live:  # --allow-origin
        plays_a_chunk(live.connect_as("play.example", origin="http://play.example"))
    wait_for(lambda: engine.sessions == (), 15, "no engine session left")


def test_the_key_never_reaches_the_log_however_its_parameter_is_spelled(keyed, caplog):
    for name in ("uvicorn.error", "uvicorn.access"):
        caplog.set_level(logging.INFO, logger=name)
    plays_a_chunk(keyed.connect(f"{keyed.url}?%74oken={KEY}"))  # the server reads %74oken as token: it plays
    encoded = "".join(f"%{ord(ch):02X}" for ch in KEY)
    plays_a_chunk(keyed.connect(f"{keyed.url}?token={encoded}"))
    assert keyed.refused(f"{keyed.url}?TOKEN={KEY}") == (401, "unauthorized")  # not the key's name: refused
    assert keyed.refused(f"{keyed.url}?key={KEY}") == (401, "unauthorized")
    assert keyed.get(f"/metrics?Token={KEY}").status_code == 401  # an HTTP request line (uvicorn.access)
    assert keyed.get("/metrics", params={"token": KEY}).status_code == 200
    assert keyed.sessions.calls == 2
    text = caplog.text
    assert '"WebSocket ' in text and '"GET /metrics?' in text  # the request lines were logged...
    assert KEY not in urllib.parse.unquote(text) and "<redacted>" in text  # ...without the key


def test_forwarded_for_from_a_loopback_client_does_not_multiply_its_connections(engine):
    # uvicorn's defaults replace a loopback peer's address with its X-Forwarded-For; nothing here trusts it.
    for proxy_headers in (True, False):
        with LiveServer(engine, None, proxy_headers=proxy_headers) as live:
            for i in range(8):
                live.connect(additional_headers={"X-Forwarded-For": f"10.0.0.{i + 1}"})
            wait_for(lambda: len(live.server.connections) == 8, 10, "eight open connections")
            assert live.refused(additional_headers={"X-Forwarded-For": "10.0.0.99"}) == (429, "too many connections")
            assert live.refused(additional_headers={"X-Forwarded-For": "10.0.0.99:4444"}) == (
                429, "too many connections")
            if not proxy_headers:  # the peer's own address is that same one
                assert live.refused() == (429, "too many connections")
            assert len(live.server.connections) == 8


def test_forwarded_for_is_read_from_configured_proxies_only(engine):
    access = ServerAccess(trusted_proxies=("127.0.0.1",), max_connections_per_client=2)
    with LiveServer(engine, access, proxy_headers=False) as live:  # as the CLI runs it: the app reads the header
        # The proxy appends the address it saw (10.0.0.1); whatever came before it is the client's to write.
        behind = {"X-Forwarded-For": "203.0.113.7, 10.0.0.1"}
        first, second = live.connect(additional_headers=behind), live.connect(additional_headers=behind)
        wait_for(lambda: len(live.server.connections) == 2, 10, "two open connections")
        assert live.refused(additional_headers={"X-Forwarded-For": "198.51.100.1, 10.0.0.1"}) == (
            429, "too many connections")  # the same client (the right-most hop) whatever it forged
        plays_a_chunk(live.connect(additional_headers={"X-Forwarded-For": "10.0.0.2"}))  # another client
        first.close()
        second.close()
    wait_for(lambda: engine.sessions == (), 15, "no engine session left")


# -- the command line --------------------------------------------------------------------------------------


def test_the_serve_flags_parse(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n", encoding="utf-8")
    args = build_parser().parse_args([
        "serve", "--pipeline", "world", "--api-key-file", str(key_file), "--allow-origin", "https://a.example",
        "--allow-origin", "*", "--public-metrics", "--max-connections-per-client", "3",
        "--trust-forwarded-for", "10.0.0.1", "--trust-forwarded-for", "10.1.0.0/16"])
    assert (args.api_key, args.api_key_from_file, args.allow_origin, args.public_metrics,
            args.max_connections_per_client, args.trust_forwarded_for) == (
        None, KEY, ["https://a.example", "*"], True, 3, ["10.0.0.1", "10.1.0.0/16"])
    defaults = build_parser().parse_args(["serve", "--pipeline", "world", "--api-key", KEY])
    assert (defaults.api_key, defaults.api_key_from_file, defaults.allow_origin, defaults.public_metrics,
            defaults.max_connections_per_client, defaults.trust_forwarded_for) == (KEY, None, [], False, 8, [])


@pytest.mark.parametrize("argv, needle", [
    (["--api-key-file", "EMPTY"], "is empty"),
    (["--api-key-file", "MISSING"], "cannot read"),
    (["--api-key", KEY, "--api-key-file", "KEYFILE"], "not allowed with"),
    (["--max-connections-per-client", "0"], "positive"),
])
def test_bad_serve_access_flags_are_refused_by_the_parser(tmp_path, capsys, argv, needle):
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    (tmp_path / "keyfile").write_text(KEY, encoding="utf-8")
    paths = {"EMPTY": str(tmp_path / "empty"), "MISSING": str(tmp_path / "missing"), "KEYFILE": str(tmp_path / "keyfile")}
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--pipeline", "world", *[paths.get(a, a) for a in argv]])
    assert exited.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--allow-origin", "ftp://a.example"], "scheme://host"),
    (["--api-key", "two words"], "printable ASCII"),
    (["--trust-forwarded-for", "proxy.example"], "IP address or network"),
])
def test_bad_serve_access_values_are_refused_before_anything_is_built(capsys, argv, needle):
    # Refused before the port is bound or a model built: the busy port would otherwise be the error.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--pipeline", "world", "--port", str(busy.getsockname()[1]), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "cannot listen" not in err
