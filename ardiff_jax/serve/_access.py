"""Who may connect: an API key, an Origin allow-list and a per-address connection limit.

A server that faces people must not let whoever reaches its port play, and must not let a
web page a visitor happens to open drive a server on the visitor's own machine (a browser
sends the page's ``Origin`` with every WebSocket handshake, and nothing else stops a foreign
page). Every decision here is a pure function of the handshake (headers, query string, the
client's and the server's socket addresses) and :class:`ServerAccess`; the app refuses before
it accepts the WebSocket or creates a session, so a refused attempt costs the engine nothing.

What a client writes is never taken for the server's identity or its own: "same origin" is the
address the connection arrived on (the listening socket's, as the ASGI server reports it), not
the ``Host`` header, which a page on a DNS-rebinding name sends as its own; and the client's
address is the connection's peer, not ``X-Forwarded-For``, unless the peer is a proxy the
operator named (``trusted_proxies``).

Refusals say only which rule refused (``unauthorized``, ``origin not allowed``, ``too many
connections``), never anything about the key, so a refusal does not help anyone guess it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hmac
import ipaddress
import logging
import os
import re
import unicodedata
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

from ardiff_jax._checks import check_positive_int

__all__ = [
    "ANY_ORIGIN",
    "DEFAULT_MAX_CONNECTIONS_PER_CLIENT",
    "FORWARDED_UNVERIFIED",
    "KEY_PARAMETER",
    "ConnectionCounter",
    "Refusal",
    "ServerAccess",
    "TokenRedactingFilter",
    "bearer_or_token",
    "client_address",
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
#: The names of the loopback: a page of a server listening on a loopback address may be opened under any of them.
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: The query parameter that carries the key (a browser cannot set headers on a WebSocket).
KEY_PARAMETER = "token"
#: The address a handshake is counted under when the server in front of the app replaced the peer's address with
#: one from ``X-Forwarded-For`` that this server does not trust: the true peer is unknown, so all such share one.
FORWARDED_UNVERIFIED = "<forwarded, unverified>"


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
        the server's own origin (see :func:`origin_allowed`: the address and port the connection arrived
        on, and the loopback names when that address is a loopback one; never the ``Host`` header); ``"*"``
        admits any page. A handshake without ``Origin`` (not a browser) is not refused by this rule. A page
        served under a DNS name (``http://play.example:8000``), through a reverse proxy, or from a server
        listening on ``0.0.0.0`` opened by a name must be listed here.
      public_metrics: serve ``GET /metrics`` without the key.
      max_connections_per_client: open WebSockets allowed per client address at once.
      trusted_proxies: addresses (``"10.0.0.1"``) or networks (``"10.0.0.0/8"``) of the reverse proxies whose
        ``X-Forwarded-For`` names the client; a connection from one is counted under the right-most address
        of that header that is not itself a trusted proxy. ``()`` (the default): the header is never
        believed, and each connection counts under its peer's address (see :func:`client_address`).

    The defaults keep a server usable as before on the loopback (no key) while a foreign web
    page still cannot drive it. A bad value raises ValueError (TypeError for a wrong type) and
    nothing is built.
    """

    api_key: str | None = dataclasses.field(default=None, repr=False)
    allowed_origins: tuple[str, ...] = ()
    public_metrics: bool = False
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    trusted_proxies: tuple[str, ...] = ()

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
        proxies = self.trusted_proxies
        if isinstance(proxies, (str, bytes)) or not isinstance(proxies, (tuple, list)):
            raise TypeError(f"ServerAccess trusted_proxies must be a tuple of addresses, got {proxies!r}")
        object.__setattr__(self, "trusted_proxies", tuple(dict.fromkeys(str(_network(p)) for p in proxies)))

    def trusts(self, address: str) -> bool:
        """Whether ``address`` (a peer's IP address) is one of :attr:`trusted_proxies`."""
        ip = _ip(address)
        return ip is not None and any(ip in _network(proxy) for proxy in self.trusted_proxies)


def _network(proxy: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    if not isinstance(proxy, str):
        raise TypeError(f"trusted proxy must be a string, got {proxy!r}")
    try:
        return ipaddress.ip_network(proxy.strip(), strict=False)
    except ValueError:
        raise ValueError(f"trusted proxy must be an IP address or network (10.0.0.1, 10.0.0.0/8), got {proxy!r}; "
                         "a host name is not: its address can change") from None


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``address`` writes (an IPv4-mapped IPv6 address as its IPv4 one), or None."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip if mapped is None else mapped


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


#: The ``Authorization`` schemes that carry the key: ``Bearer``, and ``Api-Key`` (openpi's policy client sends it).
_KEY_SCHEMES = ("bearer", "api-key")


def bearer_or_token(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The key a client presented: ``Authorization: Bearer <key>`` (or ``Api-Key <key>``, openpi's spelling)
    first, else the ``token`` query parameter."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() in _KEY_SCHEMES and credentials.strip():
            return credentials.strip()
    token = query.get(KEY_PARAMETER)
    return token if token else None


def key_matches(expected: str, presented: str | None) -> bool:
    """Constant-time comparison (``hmac.compare_digest``): the time taken says nothing about how close a guess was."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8", "surrogatepass"))


def _own_hosts(server: tuple[str, int | None] | list | None) -> tuple[tuple[str, ...], int | None]:
    """The host names of the server's own pages and its port, from the address a connection arrived on."""
    if not server or not isinstance(server[0], str) or not server[0]:
        return (), None
    host, port = server[0], server[1] if len(server) > 1 else None
    ip = _ip(host)
    if ip is None:
        return (host.lower(),), port  # a name the ASGI server itself reports (a test client's "testserver")
    if ip.is_loopback:
        return _LOOPBACK_HOSTS + (str(ip),), port
    return (str(ip),), port


def origin_allowed(origin: str | None, *, server: tuple[str, int | None] | None, scheme: str,
                   allowed_origins: tuple[str, ...]) -> bool:
    """Whether a handshake with this ``Origin`` header may proceed.

    No ``Origin``: yes (not a browser page; the key governs it). Otherwise the origin must be
    the server's own, or listed in ``allowed_origins`` (canonical, as :class:`ServerAccess` stores
    them), or ``"*"`` be listed. An origin that does not parse (``null`` from a sandboxed frame or
    a file) is refused unless ``"*"``.

    The server's own origin is the page scheme of the handshake (``ws`` pairs with an ``http``
    page, ``wss`` with ``https``), the port the connection arrived on, and as host the address it
    arrived on, ``server`` (the ASGI ``scope["server"]``: the listening socket's address, which no
    client writes), or any loopback name (``localhost``, ``127.0.0.1``, ``[::1]``) when that
    address is a loopback one. Never the ``Host`` header: a page on a name its attacker points
    at this server (DNS rebinding) sends that name as ``Host`` and as ``Origin`` alike. So a
    page opened by a DNS name, or through a proxy, is another origin: list it in ``allowed_origins``.
    A server listening on ``0.0.0.0`` cannot know the names it is reached by; the address a
    connection arrived on (``http://192.168.1.5:8000``) and, on the loopback, the loopback names
    are its own.
    """
    if origin is None:
        return True
    if ANY_ORIGIN in allowed_origins:
        return True
    triple = _origin_triple(origin)
    if triple is None:
        return False
    page_scheme = _PAGE_SCHEME.get(scheme.lower())
    hosts, port = _own_hosts(server)
    if page_scheme is not None and port is not None:
        page_host = triple[1]
        own_host = page_host in hosts or (_ip(page_host) is not None and str(_ip(page_host)) in hosts)
        if own_host and triple[0] == page_scheme and triple[2] == port:
            return True
    return any(_origin_triple(allowed) == triple for allowed in allowed_origins)


def _forwarded_hosts(headers: Mapping[str, str]) -> list[str]:
    """The hosts of ``X-Forwarded-For`` (every such header, in order), ports and IPv6 brackets removed."""
    getlist = getattr(headers, "getlist", None)
    values = getlist("x-forwarded-for") if getlist is not None else (
        [headers["x-forwarded-for"]] if headers.get("x-forwarded-for") is not None else [])
    hosts = []
    for item in ",".join(values).split(","):
        item = item.strip()
        if item.startswith("[") and "]" in item:
            item = item[1:item.index("]")]
        elif item.count(":") == 1:
            item = item.rsplit(":", 1)[0]
        if item:
            hosts.append(item)
    return hosts


def client_address(access: ServerAccess, *, client: tuple[str, int] | list | None,
                   headers: Mapping[str, str]) -> str:
    """The address a connection is counted under (the per-address limit).

    The peer's address (``client``, the ASGI ``scope["client"]``), unless the peer is one of
    ``access.trusted_proxies`` and sent ``X-Forwarded-For``: then the right-most address of that
    header that is not a trusted proxy (what the proxies nearest the server saw; anything to its left
    the client could have written), or the left-most if all are.

    A peer address that ``X-Forwarded-For`` itself names (the header not trusted) means the server in
    front of the app already replaced the peer with it: uvicorn does so for a peer on 127.0.0.1 by
    default (``proxy_headers``; ``ardiff-jax serve`` turns it off, and so should anyone who runs
    :func:`~ardiff_jax.serve.create_app` under uvicorn). The true peer is then unknown, so every such
    connection counts under one address, :data:`FORWARDED_UNVERIFIED`, rather than under whatever the
    header said: a loopback client cannot multiply its connections by varying it.
    """
    host = client[0] if client else ""
    host = host if isinstance(host, str) else ""
    forwarded = _forwarded_hosts(headers)
    if not forwarded:
        return host
    if access.trusted_proxies and access.trusts(host):
        for hop in reversed(forwarded):
            if not access.trusts(hop):
                return hop
        return forwarded[0]
    ip = _ip(host)
    if host in forwarded or (ip is not None and any(_ip(hop) == ip for hop in forwarded)):
        return FORWARDED_UNVERIFIED
    return host


def websocket_refusal(access: ServerAccess, *, headers: Mapping[str, str], query: Mapping[str, str],
                      scheme: str, server: tuple[str, int | None] | None, open_connections: int) -> Refusal | None:
    """Why this WebSocket handshake must be refused, or None: the origin, then the key, then the limit.

    ``server`` is the address the connection arrived on (the ASGI ``scope["server"]``, see
    :func:`origin_allowed`); ``open_connections`` is how many WebSockets the client's address
    (:func:`client_address`) holds open already.
    """
    if not origin_allowed(headers.get("origin"), server=server, scheme=scheme,
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


#: A query string in a log line: from ``?`` to the next whitespace or double quote (uvicorn quotes request lines
#: with it; an HTTP request target has neither).
_QUERY_IN_TEXT = re.compile(r"\?([^\s\"]*)")
_REDACTED = "<redacted>"


def _decoded(text: str) -> str:
    """``text`` as a server reads a query string's name or value (percent-decoded, ``+`` a space), compared
    case-free and width-free (NFKC, case-folded, surrounding spaces ignored)."""
    return unicodedata.normalize("NFKC", urllib.parse.unquote_plus(text, errors="replace")).casefold().strip()


class TokenRedactingFilter(logging.Filter):
    """Redacts the key from log records: the value of every query parameter whose name reads as ``token``
    (percent-decoded and case-folded: ``%74oken``, ``TOKEN``, ``To%6Ben``), and, given the key, every query
    value or bare query part that is the key (raw or percent-encoded) and every plain occurrence of it.

    uvicorn logs every request's path with its raw query string (``"WebSocket /v1/realtime/video?token=..."``,
    ``"GET /metrics?token=..."``), which would otherwise write the key into the server's log, whether the
    server accepted the spelling (``%74oken``, decoded to ``token``) or refused it (``TOKEN``). Arguments are
    redacted one by one, so uvicorn's access formatter, which reads them, still finds them.
    """

    def __init__(self, key: str | None = None) -> None:
        super().__init__()
        self._key = key
        self._folded_key = None if key is None else _decoded(key)

    def _secret(self, text: str) -> bool:
        return self._folded_key is not None and _decoded(text) == self._folded_key

    def _query(self, match: re.Match[str]) -> str:
        parts = re.split(r"([&;])", match.group(1))
        for index in range(0, len(parts), 2):
            name, equals, value = parts[index].partition("=")
            if equals and (_decoded(name) == KEY_PARAMETER or self._secret(value)):
                parts[index] = f"{name}={_REDACTED}"
            elif not equals and self._secret(name):
                parts[index] = _REDACTED
        return "?" + "".join(parts)

    def redact(self, text: str) -> str:
        text = _QUERY_IN_TEXT.sub(self._query, text)
        if self._key is not None and self._key in text:
            text = text.replace(self._key, _REDACTED)
        return text

    def _value(self, value: Any) -> Any:
        return self.redact(value) if isinstance(value, str) else value

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._value(arg) for arg in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {name: self._value(arg) for name, arg in record.args.items()}
        return True


#: The loggers uvicorn writes request paths to.
UVICORN_REQUEST_LOGGERS = ("uvicorn.error", "uvicorn.access")


@contextlib.contextmanager
def redacted_tokens_in_uvicorn_logs(key: str | None = None) -> Iterator[None]:
    """While inside: uvicorn's log lines show ``token=<redacted>`` (however the parameter is spelled) and
    ``<redacted>`` for ``key`` wherever it appears, instead of the key."""
    redactor = TokenRedactingFilter(key)
    loggers = [logging.getLogger(name) for name in UVICORN_REQUEST_LOGGERS]
    for logger in loggers:
        logger.addFilter(redactor)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(redactor)
