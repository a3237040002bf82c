"""Who may connect: an API key, an Origin allow-list and a per-address connection limit.

A server that faces people must not let whoever reaches its port play, and must not let a
web page a visitor happens to open drive a server on the visitor's own machine (a browser
sends the page's ``Origin`` with every WebSocket handshake, and nothing else stops a foreign
page). Every decision here is a pure function of the handshake (headers, query string, client
address) and :class:`ServerAccess`; the app refuses before it accepts the WebSocket or
creates a session, so a refused attempt costs the engine nothing.

Refusals say only which rule refused (``unauthorized``, ``origin not allowed``, ``too many
connections``), never anything about the key, so a refusal does not help anyone guess it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hmac
import logging
import os
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

from ardiff_jax._checks import check_positive_int

__all__ = [
    "ANY_ORIGIN",
    "DEFAULT_MAX_CONNECTIONS_PER_CLIENT",
    "ConnectionCounter",
    "Refusal",
    "ServerAccess",
    "TokenRedactingFilter",
    "bearer_or_token",
    "deny_websocket",
    "key_matches",
    "metrics_refusal",
    "origin_allowed",
    "read_api_key_file",
    "redacted_tokens_in_uvicorn_logs",
    "refusal_response",
    "websocket_refusal",
]

#: The ``allowed_origins`` entry that admits a page from any origin.
ANY_ORIGIN = "*"
#: Open WebSockets per client address: enough for a few tabs of one player, not a flood.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 8
#: Schemes an Origin may have, and the port each implies when the origin names none.
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: The scheme of the page a same-origin WebSocket comes from, per the handshake's own scheme.
_PAGE_SCHEME = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


class Refusal(enum.Enum):
    """Why a handshake or a request was refused; the value is the whole reason the client is told."""

    UNAUTHORIZED = "unauthorized"
    ORIGIN_NOT_ALLOWED = "origin not allowed"
    TOO_MANY_CONNECTIONS = "too many connections"

    @property
    def status_code(self) -> int:
        """The HTTP status of the refusal: 401 (no or wrong key), 403 (foreign page), 429 (limit)."""
        return {Refusal.UNAUTHORIZED: 401, Refusal.ORIGIN_NOT_ALLOWED: 403, Refusal.TOO_MANY_CONNECTIONS: 429}[self]

    @property
    def metric_label(self) -> str:
        """The ``reason`` label of the refusal counter: the reason in snake case."""
        return self.value.replace(" ", "_")


def _check_key(key: Any, owner: str) -> str:
    """A key that can travel in an ``Authorization`` header and a query string unchanged."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{owner} must be a non-empty string")
    # Visible ASCII only: whitespace or control characters would be mangled by a header or a URL
    # (and a key with a trailing newline from a file would never match what a client sends).
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError(f"{owner} must be printable ASCII without spaces (a header and a URL carry it unchanged)")
    return key


def _origin_triple(origin: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an ``http(s)://host[:port]`` origin (port filled in), else None."""
    try:
        parts = urllib.parse.urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.password is not None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    return scheme, parts.hostname.lower(), _DEFAULT_PORTS[scheme] if port is None else port


def _canonical_origin(origin: Any) -> str:
    if not isinstance(origin, str):
        raise TypeError(f"allowed origin must be a string, got {origin!r}")
    if origin.strip() == ANY_ORIGIN:
        return ANY_ORIGIN
    triple = _origin_triple(origin)
    if triple is None:
        raise ValueError(f"allowed origin must be {ANY_ORIGIN!r} or scheme://host[:port] with scheme http or https "
                         f"and no path, got {origin!r}")
    scheme, host, port = triple
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


@dataclasses.dataclass(frozen=True)
class ServerAccess:
    """Who may connect to one server (``create_app(..., access=ServerAccess(...))``).

    Attributes:
      api_key: when set, every WebSocket handshake (and ``GET /metrics`` unless ``public_metrics``)
        must present it, as ``Authorization: Bearer <key>`` or as the ``token`` query parameter (a
        browser cannot set headers on a WebSocket). ``None`` (the default): no key is asked for.
        Never shown by ``repr``.
      allowed_origins: pages of these origins (``scheme://host[:port]``) may open a WebSocket, besides
        the server's own origin (the ``Origin`` header equal to the handshake's ``Host``); ``"*"``
        admits any page. A handshake without ``Origin`` (not a browser) is not refused by this rule.
      public_metrics: serve ``GET /metrics`` without the key.
      max_connections_per_client: open WebSockets allowed per client address at once.

    The defaults keep a server usable as before on the loopback (no key) while a foreign web
    page still cannot drive it. A bad value raises ValueError (TypeError for a wrong type) and
    nothing is built.
    """

    api_key: str | None = dataclasses.field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    public_metrics: bool = False
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT

    def __post_init__(self) -> None:
        if self.api_key is not None:
            _check_key(self.api_key, "ServerAccess api_key")
        origins = self.allowed_origins
        if isinstance(origins, (str, bytes)) or not isinstance(origins, (tuple, list)):
            raise TypeError(f"ServerAccess allowed_origins must be a tuple of origins, got {origins!r}")
        object.__setattr__(self, "allowed_origins", tuple(dict.fromkeys(_canonical_origin(o) for o in origins)))
        if not isinstance(self.public_metrics, bool):
            raise TypeError(f"ServerAccess public_metrics must be a bool, got {self.public_metrics!r}")
        object.__setattr__(self, "max_connections_per_client", check_positive_int(
            "ServerAccess max_connections_per_client", self.max_connections_per_client))


def read_api_key_file(path: str | os.PathLike[str]) -> str:
    """The key in ``path`` (surrounding whitespace, e.g. the final newline, removed); ValueError if there is none.

    A file keeps the key out of the process list and shell history, where ``--api-key`` would show it.
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError:
        raise ValueError(f"API key file {os.fspath(path)!r} is not UTF-8 text") from None
    key = text.strip()
    if not key:
        raise ValueError(f"API key file {os.fspath(path)!r} is empty")
    return _check_key(key, f"the key in API key file {os.fspath(path)!r}")


# -- decisions (pure) --------------------------------------------------------------------------------


def bearer_or_token(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The key a client presented: ``Authorization: Bearer <key>`` first, else the ``token`` query parameter."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    token = query.get("token")
    return token if token else None


def key_matches(expected: str, presented: str | None) -> bool:
    """Constant-time comparison (``hmac.compare_digest``): the time taken says nothing about how close a guess was."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8", "surrogatepass"))


def origin_allowed(origin: str | None, *, host: str | None, scheme: str, allowed_origins: tuple[str, ...]) -> bool:
    """Whether a handshake with this ``Origin`` header may proceed.

    No ``Origin``: yes (not a browser page; the key governs it). Otherwise the origin must be
    the server's own (scheme, host and port equal to the handshake's ``Host`` under ``scheme``:
    ``ws`` pairs with an ``http`` page, ``wss`` with ``https``), or listed in
    ``allowed_origins`` (canonical, as :class:`ServerAccess` stores them), or ``"*"`` be listed.
    An origin that does not parse (``null`` from a sandboxed frame or a file) is refused unless ``"*"``.
    """
    if origin is None:
        return True
    if ANY_ORIGIN in allowed_origins:
        return True
    triple = _origin_triple(origin)
    if triple is None:
        return False
    page_scheme = _PAGE_SCHEME.get(scheme.lower())
    if host and page_scheme is not None:
        own = _origin_triple(f"{page_scheme}://{host.strip()}")
        if own is not None and own == triple:
            return True
    return any(_origin_triple(allowed) == triple for allowed in allowed_origins)


def websocket_refusal(access: ServerAccess, *, headers: Mapping[str, str], query: Mapping[str, str],
                      scheme: str, open_connections: int) -> Refusal | None:
    """Why this WebSocket handshake must be refused, or None: the origin, then the key, then the limit.

    ``open_connections`` is how many WebSockets the client's address holds open already.
    """
    if not origin_allowed(headers.get("origin"), host=headers.get("host"), scheme=scheme,
                          allowed_origins=access.allowed_origins):
        return Refusal.ORIGIN_NOT_ALLOWED
    if access.api_key is not None and not key_matches(access.api_key, bearer_or_token(headers, query)):
        return Refusal.UNAUTHORIZED
    if open_connections >= access.max_connections_per_client:
        return Refusal.TOO_MANY_CONNECTIONS
    return None


def metrics_refusal(access: ServerAccess, *, headers: Mapping[str, str], query: Mapping[str, str]) -> Refusal | None:
    """Why ``GET /metrics`` must be refused (only ``UNAUTHORIZED``: the key is asked for unless metrics are public)."""
    if access.api_key is None or access.public_metrics:
        return None
    if key_matches(access.api_key, bearer_or_token(headers, query)):
        return None
    return Refusal.UNAUTHORIZED


# -- the one piece of state ----------------------------------------------------------------------------


class ConnectionCounter:
    """Open WebSockets per client address. All calls come from the server's one event loop, so a
    check and the acquire that follows it (no ``await`` between) cannot interleave with another."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def open_connections(self, address: str) -> int:
        return self._open.get(address, 0)

    def acquire(self, address: str) -> None:
        self._open[address] = self._open.get(address, 0) + 1

    def release(self, address: str) -> None:
        remaining = self._open.get(address, 0) - 1
        if remaining < 0:
            raise RuntimeError(f"connection counter released {address!r} more often than it acquired it")
        if remaining:
            self._open[address] = remaining
        else:
            del self._open[address]  # forget addresses with nothing open: the map stays as small as the live set


# -- the shell: how a refusal reaches the client ------------------------------------------------------


def refusal_response(refusal: Refusal) -> Any:
    """A plain-text HTTP response carrying only the refusal's reason and status (401 asks for a Bearer key)."""
    from starlette.responses import PlainTextResponse

    headers = {"WWW-Authenticate": "Bearer"} if refusal is Refusal.UNAUTHORIZED else None
    return PlainTextResponse(refusal.value, status_code=refusal.status_code, headers=headers)


async def deny_websocket(websocket: Any, refusal: Refusal) -> None:
    """Refuse a WebSocket handshake without accepting it: the refusal's own status and reason where the
    server speaks the WebSocket Denial Response extension (uvicorn does), else a close before accept
    (which the server answers with HTTP 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(refusal_response(refusal))
    else:
        await websocket.close(1008, refusal.value)


_TOKEN_IN_TEXT = re.compile(r"([?&]token=)[^&\s\"']*")


class TokenRedactingFilter(logging.Filter):
    """Replaces the value of any ``token=`` query parameter in a log record with ``<redacted>``.

    uvicorn logs every request's path with its query string (``"WebSocket /v1/realtime/video?token=..."``,
    ``"GET /?token=..."``), which would write the key into the server's log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = _TOKEN_IN_TEXT.sub(r"\1<redacted>", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_TOKEN_IN_TEXT.sub(r"\1<redacted>", arg) if isinstance(arg, str) else arg
                                for arg in record.args)
        return True


#: The loggers uvicorn writes request paths to.
UVICORN_REQUEST_LOGGERS = ("uvicorn.error", "uvicorn.access")


@contextlib.contextmanager
def redacted_tokens_in_uvicorn_logs() -> Iterator[None]:
    """While inside: uvicorn's request log lines show ``token=<redacted>`` instead of a key."""
    redactor = TokenRedactingFilter()
    loggers = [logging.getLogger(name) for name in UVICORN_REQUEST_LOGGERS]
    for logger in loggers:
        logger.addFilter(redactor)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(redactor)
