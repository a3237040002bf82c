"""``StartingApp``: the ASGI app of ``ardiff-jax serve`` that answers while the served app is still being built.

Building a model and compiling its programs takes seconds to minutes. The port listens from the
start (so a busy port is refused before any work), and a listening port that answers nothing
looks like a hung server: ``/healthz`` would block and a WebSocket client would wait without a
word. So the build runs on a thread while this app answers at once:

* ``GET /healthz`` (and any other HTTP path): **503** with ``Retry-After`` and a JSON body
  ``{"status": "starting", "building", "stage", "elapsed_s"}`` (a load balancer routes
  nothing here yet); ``{"status": "failed", "building", "error"}`` once the build failed;
* ``WS /v1/realtime/video`` (any WebSocket path): the handshake is checked as the served app
  checks it (origin, key), then accepted, answered with the protocol's error message
  ``{"type": "error", "code": "starting", "message"}`` (``unavailable`` after a failed
  build) and closed with **1013** (try again later).

When the build returns the served app (:func:`~ardiff_jax.serve.create_app`'s), every later
request goes to it (one arriving in the microseconds before its lifespan started waits for
it); its lifespan stops when this app's stops. A build
still running at shutdown is abandoned (its thread is a daemon: the caller decides whether to
wait for it; ``ardiff-jax serve`` exits without waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from ardiff_jax.serve._access import ServerAccess, deny_websocket, websocket_refusal
from ardiff_jax.serve._protocol import error_message

__all__ = ["CLOSE_TRY_AGAIN_LATER", "RETRY_AFTER_S", "StartingApp"]

logger = logging.getLogger(__name__)

#: WebSocket close code for "the server cannot take this connection now; try again later" (RFC 6455 registry).
CLOSE_TRY_AGAIN_LATER = 1013
#: Seconds a client is told to wait before it retries (``Retry-After`` and the error message).
RETRY_AFTER_S = 5


class StartingApp:
    """An ASGI app that runs ``build`` on a thread and answers "starting" until it returns the served app.

    Args:
      build: called once on a thread (:meth:`start`, else when the lifespan starts) with
        ``stage(text)`` to say what it is doing now (reported by ``/healthz``); returns the
        served ASGI app, whose lifespan this app then runs. An exception it raises is the
        build's failure.
      building: what is being built, in words (reported by ``/healthz`` and to early clients).
      access: who may open a WebSocket (the served app's :class:`ServerAccess`): a handshake
        it refuses is refused now too, so an early client learns nothing more than a late one.
      on_built: called on the build's thread with the served app once the build returned;
        from then on every request goes to the served app (one arriving before its lifespan
        started waits for it), so this is where ``ardiff-jax serve`` prints its addresses.
      on_failure: called with the exception when the build (on its thread) or the served
        app's lifespan start (on the event loop) fails (``ardiff-jax serve`` then stops).
    """

    def __init__(self, build: Callable[[Callable[[str], None]], Any], *, building: str,
                 access: ServerAccess | None = None, on_built: Callable[[Any], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        if not callable(build):
            raise TypeError(f"build must be callable, got {type(build).__name__}")
        if not isinstance(building, str) or not building.strip():
            raise ValueError(f"building must be a non-empty description, got {building!r}")
        access = ServerAccess() if access is None else access
        if not isinstance(access, ServerAccess):
            raise TypeError(f"access must be a ServerAccess, got {type(access).__name__}")
        self.building = building
        self.stage = "waiting to start"
        self.app: Any = None  # the served app, once its lifespan started
        self.error: BaseException | None = None
        self._build = build
        self._access = access
        self._on_built = on_built
        self._on_failure = on_failure
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._served: Any = None  # the build's result, set on its thread before anyone is told
        self._loop: asyncio.AbstractEventLoop | None = None
        self._built: asyncio.Event | None = None
        self._served_started: asyncio.Event | None = None
        self._watcher: asyncio.Task | None = None
        self._served_lifespan = contextlib.AsyncExitStack()

    @property
    def status(self) -> str:
        """``starting`` (building), ``ready`` (the served app answers) or ``failed`` (see :attr:`error`)."""
        return "failed" if self.error is not None else "ready" if self.app is not None else "starting"

    @property
    def building_thread(self) -> threading.Thread | None:
        """The build's thread (``None`` before :meth:`start`)."""
        return self._thread

    def start(self) -> None:
        """Start the build on its (daemon) thread now, before the server runs; idempotent."""
        with self._lock:
            if self._thread is not None:
                return
            self._started = time.monotonic()
            self._thread = threading.Thread(target=self._run_build, name="ardiff-serve-build", daemon=True)
            self._thread.start()

    def _set_stage(self, text: str) -> None:
        self.stage = str(text)

    def _run_build(self) -> None:
        try:
            served = self._build(self._set_stage)
        except BaseException as error:  # reported by /healthz and on_failure; the thread ends quietly
            self.error = error
            logger.error("building %s failed: %s", self.building, _describe(error))
            if self._on_failure is not None:
                self._on_failure(error)
            return
        self.stage = "starting the served app"
        self._served = served  # from here on requests go to it (waiting for its lifespan to start)
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to serve
                loop.call_soon_threadsafe(self._built.set)
        if self._on_built is not None:
            self._on_built(served)

    # -- ASGI --------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self.app
        if app is None and self._served is not None and self._served_started is not None:
            await self._served_started.wait()  # built: its lifespan is starting (microseconds)
            app = self.app
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._refuse_websocket(WebSocket(scope, receive, send))
        else:
            await JSONResponse(self.health(), status_code=503,
                               headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` answers before the served app does."""
        if self.error is not None:
            return {"status": "failed", "building": self.building, "error": _describe(self.error)}
        return {"status": "starting", "building": self.building, "stage": self.stage,
                "elapsed_s": round(time.monotonic() - self._started, 1)}

    async def _refuse_websocket(self, websocket: WebSocket) -> None:
        refusal = websocket_refusal(self._access, headers=websocket.headers, query=websocket.query_params,
                                    scheme=websocket.url.scheme, server=websocket.scope.get("server"),
                                    open_connections=0)
        if refusal is not None:
            await deny_websocket(websocket, refusal)
            return
        await websocket.accept()
        if self.error is not None:
            code, text = "unavailable", f"the server failed to build {self.building}: {_describe(self.error)}"
        else:
            code, text = "starting", (f"the server is starting ({self.stage}: {self.building}); "
                                      f"connect again in {RETRY_AFTER_S} s")
        with contextlib.suppress(Exception):  # a client gone already needs nothing more
            await websocket.send_json(error_message(code, text))
            await websocket.close(CLOSE_TRY_AGAIN_LATER, "starting; try again later")

    async def _lifespan(self, receive: Any, send: Any) -> None:
        await receive()  # lifespan.startup
        self._built, self._served_started = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._served is not None:  # built before the loop was known (the thread did not see it)
            self._built.set()
        self.start()
        self._watcher = asyncio.create_task(self._serve_when_built(), name="ardiff-serve-build-watcher")
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        self._served_started.set()  # nobody waits for a lifespan that will not start
        try:
            await self._served_lifespan.aclose()
        except Exception as error:
            logger.exception("the served app's shutdown failed")
            await send({"type": "lifespan.shutdown.failed", "message": repr(error)})
            return
        await send({"type": "lifespan.shutdown.complete"})

    async def _serve_when_built(self) -> None:
        await self._built.wait()
        served = self._served
        try:
            router = getattr(served, "router", None)
            if router is not None and getattr(router, "lifespan_context", None) is not None:
                await self._served_lifespan.enter_async_context(router.lifespan_context(served))
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self.error = error
            logger.error("starting the served app of %s failed: %s", self.building, _describe(error))
            self._served_started.set()
            if self._on_failure is not None:
                self._on_failure(error)
            return
        self.app = served  # only now: a request never reaches the served app before its lifespan started
        self._served_started.set()


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
