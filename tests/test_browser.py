"""The bundled browser client (``GET /``) in a real headless Chromium, driven by selenium, against
the trained sprite world served by uvicorn on a free port.

Skipped when selenium, ``chromium`` or ``chromedriver`` is missing (Debian: ``apt-get install
chromium chromium-driver``). Set ``ARDIFF_SCREENSHOT=docs/browser_client.png`` to refresh the
screenshot in the docs.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="needs the chromium and chromedriver binaries on PATH "
                                       "(Debian: apt-get install chromium chromium-driver)")

from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.envs import ACTION_NAMES
from ardiff_jax.models import pretrained
from ardiff_jax.serve import ServedWorld, create_app

CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)
RIGHT = ACTION_NAMES.index("right")
NO_OP = ACTION_NAMES.index("no-op")
SEED = 5  # the agent starts at (1, 3) with three free cells to its right


def wait_for(condition: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Recorder:
    """Wraps ``engine.generate``: records each tick's actions and the frames the model generated."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.original = engine.generate
        self.ticks: list[tuple[np.ndarray, np.ndarray]] = []
        engine.generate = self

    def __call__(self, request):
        output = self.original(request)
        self.ticks.append((np.asarray(request.inputs["actions"]).copy(), np.asarray(output.frames).copy()))
        return output

    def restore(self) -> None:
        del self.engine.generate


@pytest.fixture(scope="module")
def served_url():
    pipeline = pretrained("sprite_world")
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        import uvicorn

        recorder = Recorder(engine)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        app = create_app(engine, world=ServedWorld.for_pipeline(pipeline))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: server.started, what="uvicorn to start")
            yield f"http://127.0.0.1:{port}/", recorder
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            recorder.restore()
        assert engine.sessions == (), "closing the page must release the session's KV"


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=720,900"):
        options.add_argument(argument)
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    except WebDriverException as error:  # the machine cannot start a browser at all: not the page's fault
        pytest.skip(f"headless chromium could not start here: {error.msg or error}")
    try:
        yield driver
    finally:
        driver.quit()


def stats(driver) -> dict:
    return driver.execute_script("return window.ardiffStats")


def canvas_frame(driver) -> np.ndarray:
    url = driver.execute_script("return document.getElementById('canvas').toDataURL('image/png')")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def agent_column(frame: np.ndarray) -> int:
    """The grid column of the agent (the greenest 4x4 cell) in a drawn frame; JPEG blurs colours a little."""
    cells = frame.astype(float).reshape(8, 4, 8, 4, 3).mean(axis=(1, 3))  # [row, col, rgb]
    greenness = cells[..., 1] - np.maximum(cells[..., 0], cells[..., 2])  # agent (0, 255, 0): 255; balls, walls: <= 0
    return int(np.unravel_index(np.argmax(greenness), greenness.shape)[1])


def test_the_page_streams_the_trained_world_and_a_held_arrow_key_moves_the_agent(served_url, browser):
    url, recorder = served_url
    browser.get(url)
    browser.find_element(By.ID, "seed").send_keys(str(SEED))
    browser.find_element(By.ID, "start").click()

    # Chunks arrive and are drawn; the picture changes (the ball moves every frame).
    wait_for(lambda: stats(browser)["framesShown"] >= 1, 30, "the first frame drawn")
    before = canvas_frame(browser)
    assert before.shape == (32, 32, 3)
    wait_for(lambda: stats(browser)["chunks"] >= 3, 30, "3 chunks")
    first = stats(browser)
    assert first["errors"] == [] and first["state"] == "streaming" and first["config"]["seed"] == SEED
    assert first["format"] == "jpeg" and first["lastLatencyMs"] > 0
    assert "right" in first["config"]["actions"]
    assert browser.find_element(By.ID, "prompt-row").is_displayed() is False  # the sprite world takes no prompt
    shown = first["framesShown"]
    wait_for(lambda: stats(browser)["framesShown"] >= shown + 3, 20, "3 more frames drawn")
    assert np.abs(canvas_frame(browser).astype(int) - before.astype(int)).max() > 64, "the picture changes"

    # Hold ArrowRight: one "right" interaction (no auto-repeat spam), the server's ticks take action right, and
    # the agent moves right in the frames the page draws (the seed leaves it three free cells to the right).
    column_before = agent_column(canvas_frame(browser))
    ticks_before_key = len(recorder.ticks)
    ActionChains(browser).key_down(Keys.ARROW_RIGHT).perform()
    wait_for(lambda: any((actions == RIGHT).all() for actions, _ in recorder.ticks[ticks_before_key:]), 10,
             "a tick with action right")
    moved = wait_for(lambda: agent_column(canvas_frame(browser)) > column_before, 10,
                     f"the agent drawn right of column {column_before}")
    assert moved
    time.sleep(0.5)
    during = stats(browser)
    ActionChains(browser).key_up(Keys.ARROW_RIGHT).perform()
    assert during["actionsSent"] == ["right"] and during["lastActionSent"] == "right"
    assert during["chunks"] > first["chunks"]

    # Releasing the key sends no-op, the server applies it, and the agent stops where it is in the picture.
    wait_for(lambda: stats(browser)["lastActionSent"] == "no-op", 5, "no-op on key up")
    ticks_at_release = len(recorder.ticks)
    wait_for(lambda: sum((actions == NO_OP).all() for actions, _ in recorder.ticks[ticks_at_release:]) >= 3, 10,
             "no-op ticks after key up")
    shown = stats(browser)["framesShown"]
    wait_for(lambda: stats(browser)["framesShown"] >= shown + 2, 10, "frames drawn after the no-op ticks")
    columns = []
    for _ in range(6):  # frames drawn over about a second after the key came up
        columns.append(agent_column(canvas_frame(browser)))
        time.sleep(0.2)
    assert len(set(columns)) == 1 and columns[0] > column_before, columns
    now = stats(browser)
    assert now["errors"] == []
    assert float(browser.find_element(By.ID, "stat-fps").text.split()[1]) > 0  # "frames/s 9.9 of 10"

    # Paced: the page draws what the server generates, behind by at most the lookahead (one chunk), the chunk
    # playing, the jitter buffer and a chunk in flight (one-frame chunks here); nothing was skipped.
    generated = len(recorder.ticks)
    assert now["framesDropped"] == 0
    assert 0 <= generated - now["framesShown"] <= 4, (generated, now["framesShown"])
    # The key press's action-to-display latency was measured and is shown.
    assert len(now["actionLatenciesMs"]) >= 1 and all(ms > 0 for ms in now["actionLatenciesMs"])
    assert "ms" in browser.find_element(By.ID, "stat-action-latency").text

    if os.environ.get("ARDIFF_SCREENSHOT"):
        browser.save_screenshot(os.environ["ARDIFF_SCREENSHOT"])

    # Stop ends the session; the server reports it done.
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: stats(browser)["state"] in ("done", "closed"), 10, "session.done after Stop")
    assert stats(browser)["errors"] == []


def test_m4s_plays_in_chromium_at_the_announced_rate(served_url, browser):
    """Debian's chromium plays the m4s stream (H.264 in fragmented MP4 through Media Source Extensions) at the
    session's rate, counted as the canvas counts its draws (the former page showed 70-99 frames/s at 10)."""
    url, _ = served_url
    browser.get(url)
    Select(browser.find_element(By.ID, "format")).select_by_value("m4s")
    browser.find_element(By.ID, "seed").send_keys(str(SEED))
    browser.find_element(By.ID, "start").click()
    wait_for(lambda: stats(browser)["framesShown"] >= 20 or stats(browser)["errors"], 30, "m4s frames presented")
    first = stats(browser)
    assert first["errors"] == [], f"chromium could not play m4s: {first['errors']}"
    time.sleep(2.5)
    later = stats(browser)
    fps = later["config"]["fps"]
    assert 0.3 * fps <= later["displayFps"] <= 1.5 * fps, (later["displayFps"], fps)
    assert later["framesShown"] <= later["frames"]
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: stats(browser)["state"] in ("done", "closed"), 10, "session.done after Stop")


# -- who may connect (ServerAccess) ------------------------------------------------------------------------

ACCESS_KEY = "browser-Key_42"
FOREIGN_PAGE = """<!doctype html><meta charset="utf-8"><title>foreign</title><script>
window.result = {opened: false, error: false, closed: false};
const socket = new WebSocket("ws://127.0.0.1:%(port)d/v1/realtime/video?token=%(key)s");
socket.onopen = () => { window.result.opened = true; };
socket.onerror = () => { window.result.error = true; };
socket.onclose = () => { window.result.closed = true; };
</script>"""


@pytest.fixture(scope="module")
def keyed_server():
    """The sprite world served with an API key, and a second HTTP server (another loopback port, so another
    origin) serving a page that tries to drive it with the right key."""
    import http.server

    import uvicorn

    from ardiff_jax.serve import ServerAccess

    pipeline = pretrained("sprite_world")
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        app = create_app(engine, world=ServedWorld.for_pipeline(pipeline), access=ServerAccess(api_key=ACCESS_KEY))
        created: list[str] = []
        create_session = app.state.server.manager.create_session

        async def counted(session_id=None):
            created.append(session_id)
            return await create_session(session_id)

        app.state.server.manager.create_session = counted
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
        thread = threading.Thread(target=server.run, daemon=True)
        page = (FOREIGN_PAGE % {"port": port, "key": ACCESS_KEY}).encode()

        class Foreign(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass

        foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
        foreign_thread = threading.Thread(target=foreign.serve_forever, daemon=True)
        thread.start()
        foreign_thread.start()
        try:
            wait_for(lambda: server.started, what="uvicorn to start")
            yield f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{foreign.server_address[1]}/", created
        finally:
            foreign.shutdown()
            foreign.server_close()
            server.should_exit = True
            thread.join(timeout=30)
        assert engine.sessions == (), "closing the page must release the session's KV"


def test_a_page_of_another_origin_is_refused_and_the_index_page_with_the_token_plays(keyed_server, browser):
    url, foreign_url, created = keyed_server
    # A page a visitor opens elsewhere cannot drive the server, even knowing the key: the browser's Origin says so.
    browser.get(foreign_url)
    wait_for(lambda: browser.execute_script("return window.result.closed"), 20, "the foreign page's WebSocket to close")
    result = browser.execute_script("return window.result")
    assert result == {"opened": False, "error": True, "closed": True}
    assert created == []

    # The server's own page, opened with ?token=KEY, passes the key on and plays.
    browser.get(f"{url}?token={ACCESS_KEY}")
    browser.find_element(By.ID, "seed").send_keys(str(SEED))
    browser.find_element(By.ID, "start").click()
    wait_for(lambda: stats(browser)["framesShown"] >= 1 or stats(browser)["errors"], 30, "a frame drawn with the token")
    assert stats(browser)["errors"] == [] and stats(browser)["chunks"] >= 1
    assert len(created) == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: stats(browser)["state"] in ("done", "closed"), 10, "session.done after Stop")

    # The same page without the token is refused before any session.
    browser.get(url)
    browser.find_element(By.ID, "start").click()
    wait_for(lambda: stats(browser)["state"] == "closed", 20, "the page's refused connection")
    assert stats(browser)["chunks"] == 0 and len(created) == 1


@pytest.fixture(scope="module")
def matrix_game_url():
    """A tiny random Matrix-Game served with a start picture (its keys are key-1..key-3 on the digit keys)."""
    import uvicorn

    from ardiff_jax.models.matrix_game import build_matrix_game

    pipeline = build_matrix_game(preset="matrix-game-tiny", random_weights=True, dtype="float32", session_capacity=1)
    start_image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), np.uint8)
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        keyboards: list[np.ndarray] = []
        original = engine.generate

        def recording(request):
            keyboards.append(np.asarray(request.inputs["keyboard"]).copy())
            return original(request)

        engine.generate = recording
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        app = create_app(engine, world=ServedWorld.for_pipeline(pipeline, start_image=start_image))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            wait_for(lambda: server.started, what="uvicorn to start")
            yield f"http://127.0.0.1:{port}/", keyboards
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            del engine.generate


def test_the_page_plays_matrix_game_with_held_keys_from_the_worlds_bindings(matrix_game_url, browser):
    url, keyboards = matrix_game_url
    browser.get(url)
    browser.find_element(By.ID, "start").click()
    wait_for(lambda: stats(browser)["framesShown"] >= 1 or stats(browser)["errors"], 60, "the first frame drawn")
    first = stats(browser)
    assert first["errors"] == [] and first["config"]["mouse_look"] is True
    assert first["config"]["key_bindings"] == {"Digit1": "key-1", "Digit2": "key-2", "Digit3": "key-3"}
    assert "Click the picture to look around" in browser.find_element(By.ID, "keys").text
    # Hold two keys together: one action joining them, and the engine's keyboard rows press both.
    before = len(keyboards)
    ActionChains(browser).key_down("1").key_down("3").perform()
    wait_for(lambda: any((k == [1, 0, 1]).all() for k in keyboards[before:]), 30, "rows pressing key-1 and key-3")
    assert stats(browser)["actionsSent"][-1] == "key-1+key-3"
    ActionChains(browser).key_up("1").key_up("3").perform()
    wait_for(lambda: stats(browser)["lastActionSent"] == "no-op", 10, "no-op once both keys are up")
    released = len(keyboards)
    wait_for(lambda: any(not k.any() for k in keyboards[released:]), 30, "rows with no key pressed")
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: stats(browser)["state"] in ("done", "closed"), 20, "session.done after Stop")
