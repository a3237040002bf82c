"""``serve`` while it builds (issue 47, item 3): the port answers at once, and Ctrl-C ends it cleanly.

In process, a :class:`StartingApp` whose build waits on an event: ``/healthz`` answers 503
"starting" with what is being built, a WebSocket is told to retry (``error`` ``starting``, close
1013), and once the build is released the served app answers. As a subprocess,
``ardiff-jax serve --pretrained sprite_world --port 0`` stopped with SIGINT while it builds and
once it serves: no traceback, a documented exit status.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("av")

import httpx
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, dit_preset
from ardiff_jax.serve import ServedWorld, ServerAccess, StartingApp, create_app

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


@pytest.fixture(scope="module")
def sprite_engine():
    pipeline = SpriteWorldPipeline("sprite_world", modules=DiTModules.create(dit_preset("sprite_world"), 1))
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        yield engine


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class SlowBuild:
    """A build that says its stage, then waits for :attr:`release` (or raises :attr:`error`)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.release = threading.Event()
        self.waiting = threading.Event()
        self.error: Exception | None = None

    def __call__(self, stage):
        stage("compiling the test's programs")
        self.waiting.set()
        assert self.release.wait(60)
        if self.error is not None:
            raise self.error
        return create_app(self.engine, world=ServedWorld.for_pipeline(self.engine.runner.pipeline))


def test_healthz_says_starting_and_a_websocket_is_told_to_retry_until_the_build_returns(sprite_engine):
    build = SlowBuild(sprite_engine)
    built: list = []
    app = StartingApp(build, building="the test's sprite world", on_built=built.append)
    with TestClient(app) as client:
        build.waiting.wait(30)
        health = client.get("/healthz")
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        assert health.json()["status"] == "starting"
        assert health.json()["building"] == "the test's sprite world"
        assert health.json()["stage"] == "compiling the test's programs"
        assert client.get("/").status_code == 503  # every path: nothing is served yet
        with client.websocket_connect(PATH) as ws:
            message = ws.receive_json()
            assert message["type"] == "error" and message["code"] == "starting"
            assert "the test's sprite world" in message["message"] and "connect again" in message["message"]
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
            assert closed.value.code == 1013  # try again later
        assert app.status == "starting" and built == []

        build.release.set()
        wait_for(lambda: built != [])
        health = client.get("/healthz")  # built: answered by the served app (its lifespan start awaited)
        assert app.status == "ready" and built == [app.app]
        assert health.status_code == 200 and health.json()["status"] == "ok"
        with client.websocket_connect(PATH) as ws:
            ws.send_json({"type": "session.start", "format": "jpeg", "num_frames": 1, "seed": 3})
            assert ws.receive_json()["type"] == "video.start"
            assert ws.receive_json()["type"] == "video.chunk_metadata"
            ws.receive_bytes()
            assert ws.receive_json()["type"] == "session.done"
    wait_for(lambda: sprite_engine.sessions == ())


def test_a_failed_build_is_reported_and_an_early_websocket_still_checks_the_key(sprite_engine):
    build = SlowBuild(sprite_engine)
    build.error = ValueError("--weights: no such file")
    failures: list = []
    app = StartingApp(build, building="a model", access=ServerAccess(api_key="k" * 32), on_failure=failures.append)
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect):  # no key: refused before accept, as the served app refuses it
            with client.websocket_connect(PATH) as ws:
                ws.receive_json()
        build.release.set()
        wait_for(lambda: app.status == "failed")
        assert failures == [build.error]
        health = client.get("/healthz")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "building": "a model", "error": "--weights: no such file"}
        with client.websocket_connect(f"{PATH}?token={'k' * 32}") as ws:
            message = ws.receive_json()
            assert message["code"] == "unavailable" and "--weights: no such file" in message["message"]


def test_starting_app_checks_its_arguments():
    with pytest.raises(TypeError, match="build must be callable"):
        StartingApp(None, building="x")
    with pytest.raises(ValueError, match="building"):
        StartingApp(lambda stage: None, building=" ")
    with pytest.raises(TypeError, match="access"):
        StartingApp(lambda stage: None, building="x", access="open")


# -- the command line, as a user runs it --------------------------------------------------------------------


class Serve:
    """``ardiff-jax serve --pretrained sprite_world --port 0`` in a subprocess, its output read line by line."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ardiff_jax.cli", "serve", "--pretrained", "sprite_world", "--port", "0",
             "--batch-compile", "lazy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        for stream, sink in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    def _read(self, stream, sink) -> None:
        for line in stream:
            sink.append(line)
            self.lines.put(line)

    def wait_for_line(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no line matching {pattern!r}: {''.join(self.stderr)}"
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            found = re.search(pattern, line)
            if found:
                return found

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def test_ctrl_c_while_serve_builds_ends_without_a_traceback():
    serve = Serve()
    port = int(serve.wait_for_line(r"meanwhile http://127\.0\.0\.1:(\d+)/healthz").group(1))
    health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)  # answered during the build
    code = serve.interrupt()
    stderr = "".join(serve.stderr)
    assert "Traceback" not in stderr, stderr
    if health.status_code == 503:
        assert health.json()["status"] == "starting" and "sprite_world" in health.json()["building"]
    if "stopped while building" in stderr:
        assert code == 130  # the build was abandoned: 128 + SIGINT, as a shell reports an interrupted command
    else:  # the build won the race: a clean stop of a serving server
        assert code == 0


def test_ctrl_c_on_a_serving_server_closes_it_and_exits_0_without_a_traceback():
    serve = Serve()
    port = int(serve.wait_for_line(r"serving sprite_world .* on ws://127\.0\.0\.1:(\d+)/").group(1))
    health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    code = serve.interrupt()
    stderr = "".join(serve.stderr)
    assert "Traceback" not in stderr, stderr
    assert code == 0 and "Application shutdown complete" in stderr
