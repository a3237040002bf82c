"""Serving Matrix-Game 2.0: the world's wire rules, pure (no pipeline needed), then a tiny model end to end.

How a Matrix-Game session is driven: it starts from a picture (``image_reference`` as a data URL, or
the server's start image), keys become keyboard rows (held keys joined by ``+``; Temple Run one-hot),
a velocity camera's rotation becomes the mouse row (pitch up, yaw right, in radians per frame),
GTA driving steers with the mouse yaw, and every tick carries one row per video frame of its chunk.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import math
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from ardiff_jax.serve import ProtocolError, ServedWorld
from ardiff_jax.serve._protocol import CameraUpdate, SessionInteraction, SessionStart, parse_client_message
from ardiff_jax.serve._world import camera_mouse, decode_image_url
from ardiff_jax.types import ARDiffusionTickRequest


def _world(keyboard_dim: int = 4, mouse: bool = True, start_image=None) -> ServedWorld:
    return ServedWorld(name="mg", kind="matrix-game", frame_height=16, frame_width=24, frames_per_chunk=12,
                       first_chunk_frames=9, fps=25, keyboard_dim=keyboard_dim, mouse=mouse, start_image=start_image)


def _data_url(image: np.ndarray, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _turn(pitch_up: float, yaw: float) -> tuple[float, float, float, float]:
    hx, hy = -pitch_up / 2, yaw / 2
    return (math.cos(hy) * math.sin(hx), math.sin(hy) * math.cos(hx), -math.sin(hy) * math.sin(hx),
            math.cos(hy) * math.cos(hx))


def test_a_start_image_arrives_as_a_data_url_and_is_center_cropped_to_the_frames():
    picture = np.zeros((40, 120, 3), np.uint8)
    picture[:, 40:80] = 200  # the middle third: what a crop to 16x24 (2:3 of 40x120's 1:3) keeps
    start = parse_client_message('{"type": "session.start", "image_reference": {"image_url": "%s"}}'
                                 % _data_url(picture))
    plan = _world().plan_start(start)
    assert plan.image.shape == (16, 24, 3) and plan.image.dtype == np.uint8
    assert plan.image[:, 4:20].mean() > 150 and "image_reference" not in plan.ignored_fields


@pytest.mark.parametrize("url, needle", [
    ("https://example.com/a.png", "data URL"), ("data:text/plain;base64,aGk=", "data URL"),
    ("data:image/png;base64,not-base64!", "readable"), ("data:image/png;base64,aGVsbG8=", "readable"),
    (_data_url(np.zeros((16, 24, 3), np.uint8), "BMP"), "PNG, JPEG, WEBP")])  # PNG, JPEG and WebP only
def test_a_start_image_that_is_not_a_readable_data_url_is_refused(url, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode_image_url(url, 16, 24)


def _png(width: int, height: int, idat: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


@functools.cache
def _bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of ``width x height`` black pixels: a few kilobytes declaring any number of pixels."""
    packer = zlib.compressobj(9)
    rows = bytes(1 + (width + 7) // 8) * 256  # per row: filter byte 0, then the row's bits
    body = [packer.compress(rows) for _ in range(height // 256)]
    body += [packer.compress(rows[:(height % 256) * (len(rows) // 256)]), packer.flush()]
    return _png(width, height, b"".join(body))


def _png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns, at open
def test_a_picture_declaring_too_many_pixels_is_refused_from_its_header():
    # 12000 x 12000 pixels in a few kilobytes: decoding it would take seconds and gigabytes.
    bomb = _bomb_png(12000, 12000)
    assert len(bomb) < 100_000 and struct.unpack(">II", bomb[16:24]) == (12000, 12000)
    # The second declares more than PIL's own bomb limit (its pixel data is left out: only the header is read).
    for url in (_png_url(bomb), _png_url(_png(100_000, 100_000, b""))):
        started = time.perf_counter()
        with pytest.raises(ProtocolError, match="pixels") as refused:
            decode_image_url(url, 16, 24)
        assert refused.value.code == "invalid_field" and time.perf_counter() - started < 1.0
    # The bound is a small multiple of the frame (16 x its pixels): a picture at it is read; one above is not.
    assert decode_image_url(_data_url(np.zeros((64, 96, 3), np.uint8)), 16, 24).shape == (16, 24, 3)
    with pytest.raises(ProtocolError, match="pixels"):
        decode_image_url(_data_url(np.zeros((65, 96, 3), np.uint8)), 16, 24)
    # A sliver within the bound that the crop to the frame's aspect would first have to blow up is refused too.
    with pytest.raises(ProtocolError, match="pixels"):
        decode_image_url(_data_url(np.zeros((1, 2000, 3), np.uint8)), 16, 24)


def test_a_start_without_a_picture_needs_the_server_default():
    with pytest.raises(ProtocolError, match="starts from a picture"):
        _world().plan_start(SessionStart())
    default = np.full((16, 24, 3), 7, np.uint8)
    assert (_world(start_image=default).plan_start(SessionStart()).image == 7).all()
    # Other worlds list image_reference as ignored.
    sprite = ServedWorld(name="s", kind="sprite", frame_height=32, frame_width=32, frames_per_chunk=1)
    assert "image_reference" in sprite.plan_start(SessionStart(image_url="data:x")).ignored_fields


def test_keys_become_keyboard_rows_and_a_turn_becomes_the_mouse_row_of_every_frame():
    world = _world()
    config = world.config(world.plan_start(SessionStart(image_url=_data_url(np.zeros((16, 24, 3), np.uint8)))))
    assert config["actions"] == ["no-op", "forward", "back", "left", "right"] and config["mouse_look"] is True
    assert config["key_bindings"]["KeyW"] == "forward" and config["combine_keys"] is True
    assert config["camera_modes"] == ["velocity"]
    keys = world.event_update(SessionInteraction("k", action="forward+left"))
    turn = world.event_update(SessionInteraction("t", camera=CameraUpdate("velocity", (0, 0, 0), _turn(0.1, -0.1))))
    assert [c.track for c in turn.controls] == ["mouse"]  # a turn alone keeps the held keys
    tick = ARDiffusionTickRequest("s", "r", 1, controls=keys.controls + turn.controls)
    inputs = world.inputs(tick, world.plan_start(SessionStart(image_url=_data_url(np.zeros((16, 24, 3), np.uint8)))))
    assert inputs["keyboard"].shape == (12, 4) and (inputs["keyboard"] == [1, 0, 1, 0]).all()
    np.testing.assert_allclose(inputs["mouse"], np.tile([0.1, -0.1], (12, 1)), atol=1e-6)
    assert "image" not in inputs  # only the first chunk carries the picture
    first = world.inputs(ARDiffusionTickRequest("s", "r", 0), world.plan_start(SessionStart(
        image_url=_data_url(np.zeros((16, 24, 3), np.uint8)), seed=3)))
    assert first["keyboard"].shape == (9, 4) and not first["keyboard"].any() and first["image"].shape == (16, 24, 3)
    assert first["seed"] == 3 and not first["mouse"].any()
    # Walking by camera translation: +z forward, -x left.
    walk = world.event_update(SessionInteraction("w", camera=CameraUpdate("velocity", (-1, 0, 1))))
    assert dict(walk.controls[0].data) == {"keys": ("forward", "left")}


def test_camera_mouse_reads_pitch_up_and_yaw_right_from_the_quaternion():
    assert camera_mouse(_turn(0.1, 0.0)) == pytest.approx((0.1, 0.0))
    assert camera_mouse(_turn(0.0, -0.1)) == pytest.approx((0.0, -0.1))
    assert camera_mouse(_turn(0.05, 0.2)) == pytest.approx((0.05, 0.2))
    assert camera_mouse(None) == (0.0, 0.0)


def test_gta_steers_with_the_mouse_yaw_and_temple_run_is_one_hot_without_a_camera():
    gta = _world(keyboard_dim=2)
    update = gta.event_update(SessionInteraction("g", action="forward+steer-right"))
    assert {c.track: dict(c.data) for c in update.controls} == {"keyboard": {"keys": ("forward",)},
                                                                "mouse": {"pitch": 0.0, "yaw": 0.1}}
    temple = _world(keyboard_dim=7, mouse=False)
    assert temple.controls == ("action",) and temple.camera_modes == ()
    with pytest.raises(ProtocolError, match="one of"):
        temple.event_update(SessionInteraction("x", action="jump+slide"))
    with pytest.raises(ProtocolError, match="no camera"):
        temple.event_update(SessionInteraction("c", camera=CameraUpdate("velocity", (0, 0, 1))))
    jump = temple.event_update(SessionInteraction("j", action="jump"))
    inputs = temple.inputs(ARDiffusionTickRequest("s", "r", 2, controls=jump.controls),
                           temple.plan_start(SessionStart(image_url=_data_url(np.zeros((16, 24, 3), np.uint8)))))
    assert "mouse" not in inputs and (inputs["keyboard"].argmax(1) == 1).all() and inputs["keyboard"].sum() == 12
    idle = temple.inputs(ARDiffusionTickRequest("s", "r", 2),
                         temple.plan_start(SessionStart(image_url=_data_url(np.zeros((16, 24, 3), np.uint8)))))
    assert (idle["keyboard"][:, 0] == 1).all()  # no key: index 0, the release's no-op


def test_unknown_keys_targets_and_prompts_are_rejected():
    world = _world()
    for interaction, needle in [(SessionInteraction("a", action="jump"), "unknown action"),
                                (SessionInteraction("b", action="forward+forward"), "unknown action"),
                                (SessionInteraction("c", camera=CameraUpdate("target", (1, 0, 1))), "velocity"),
                                (SessionInteraction("d", prompt="a castle"), "not text-conditioned")]:
        with pytest.raises(ProtocolError, match=needle):
            world.event_update(interaction)


# -- a tiny random Matrix-Game served end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def matrix_game_engine():
    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.models.matrix_game import build_matrix_game

    pipeline = build_matrix_game(preset="matrix-game-tiny", random_weights=True, dtype="float32", session_capacity=2)
    with ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                  gpu_memory_fraction=1.0)) as engine:
        yield engine


def test_a_served_matrix_game_session_plays_from_its_picture_with_keys_and_mouse(matrix_game_engine):
    from helpers import next_chunk_metadata
    from starlette.testclient import TestClient

    from ardiff_jax.serve import ServerSettings, create_app

    engine = matrix_game_engine
    world = ServedWorld.for_pipeline(engine.runner.pipeline)
    assert (world.kind, world.fps, world.first_chunk_frames, world.frames_per_chunk) == ("matrix-game", 25, 9, 12)
    seen: list = []
    original = engine.generate

    def recording(request):
        seen.append({k: np.asarray(v) for k, v in request.inputs.items() if k in ("keyboard", "mouse", "image")})
        return original(request)

    engine.generate = recording
    picture = np.random.default_rng(0).integers(0, 256, (world.frame_height * 2, world.frame_width * 2, 3), np.uint8)
    try:
        app = create_app(engine, world=world, settings=ServerSettings(paced=False, max_message_bytes=2**22))
        with TestClient(app) as client, client.websocket_connect("/v1/realtime/video") as ws:
            ws.send_json({"type": "session.start", "format": "jpeg", "seed": 1,
                          "image_reference": {"image_url": _data_url(picture)}})
            reply = ws.receive_json()
            assert reply["type"] == "video.start" and reply["config"]["mouse_look"] is True
            assert reply["config"]["actions"] == ["no-op", "key-1", "key-2", "key-3"]
            assert reply["config"]["key_bindings"] == {"Digit1": "key-1", "Digit2": "key-2", "Digit3": "key-3"}

            def chunk() -> dict:
                return next_chunk_metadata(ws)

            assert chunk()["num_frames"] == 9
            ws.send_json({"type": "session.interaction", "interaction": {"event_id": "keys", "event": {
                "multi_modal_data": {"action": {"value": "key-1+key-3"}}}}})
            ws.send_json({"type": "session.interaction", "interaction": {"event_id": "look", "event": {
                "multi_modal_data": {"camera": {"mode": "velocity", "data": {"translation": [0, 0, 0],
                                                                             "rotation": list(_turn(0.0, 0.1))}}}}}})
            meta = chunk()
            while "look" not in meta["active_event_ids"]:
                meta = chunk()
            assert meta["num_frames"] == 12 and set(meta["active_event_ids"]) == {"keys", "look"}
            ws.send_json({"type": "session.stop"})
    finally:
        del engine.generate
    assert seen[0]["image"].shape == (world.frame_height, world.frame_width, 3) and seen[0]["keyboard"].shape[0] == 9
    last = seen[-1]
    assert (last["keyboard"] == [1, 0, 1]).all() and last["keyboard"].shape == (12, 3)  # the tiny net's 3 keys
    np.testing.assert_allclose(last["mouse"], np.tile([0.0, 0.1], (12, 1)), atol=1e-6)
    assert engine.sessions == ()


def _start_with(picture_url: str) -> dict:
    return {"type": "session.start", "format": "jpeg", "seed": 1, "image_reference": {"image_url": picture_url}}


def _picture_url(world: ServedWorld) -> str:
    return _data_url(np.random.default_rng(1).integers(0, 256, (world.frame_height, world.frame_width, 3), np.uint8))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns, at open
def test_a_picture_bomb_gets_invalid_field_at_once_and_the_server_keeps_serving(matrix_game_engine):
    from helpers import next_chunk_metadata
    from starlette.testclient import TestClient

    from ardiff_jax.serve import ServerSettings, create_app

    world = ServedWorld.for_pipeline(matrix_game_engine.runner.pipeline)
    app = create_app(matrix_game_engine, world=world, settings=ServerSettings(max_message_bytes=2**22))
    with (TestClient(app) as client, client.websocket_connect("/v1/realtime/video") as player,
          client.websocket_connect("/v1/realtime/video") as attacker):
        player.send_json(_start_with(_picture_url(world)))
        assert player.receive_json()["type"] == "video.start"
        next_chunk_metadata(player)
        started = time.perf_counter()
        attacker.send_json(_start_with(_png_url(_bomb_png(12000, 12000))))
        refusal = attacker.receive_json()
        assert refusal["type"] == "error" and refusal["code"] == "invalid_field", refusal
        assert "pixels" in refusal["message"] and time.perf_counter() - started < 2.0
        next_chunk_metadata(player)  # the player kept streaming
        attacker.send_json({"type": "session.ping"})
        assert attacker.receive_json() == {"type": "session.pong"}  # the socket stays; a good picture plays
        attacker.send_json(_start_with(_picture_url(world)))
        assert attacker.receive_json()["type"] == "video.start"
        next_chunk_metadata(attacker)
        assert client.get("/healthz").json()["sessions"]["admitted"] == 2
    assert matrix_game_engine.sessions == ()


def test_a_start_when_full_is_refused_before_its_picture_is_decoded(matrix_game_engine, monkeypatch):
    from starlette.testclient import TestClient

    from ardiff_jax.serve import ServerSettings, _world, create_app

    decoded: list[str] = []
    decode = _world.decode_image_url

    def recording(url: str, *args, **kwargs):
        decoded.append(url)
        return decode(url, *args, **kwargs)

    monkeypatch.setattr(_world, "decode_image_url", recording)
    world = ServedWorld.for_pipeline(matrix_game_engine.runner.pipeline)
    app = create_app(matrix_game_engine, world=world, settings=ServerSettings(capacity=1, max_message_bytes=2**22))
    with (TestClient(app) as client, client.websocket_connect("/v1/realtime/video") as player,
          client.websocket_connect("/v1/realtime/video") as late):
        player.send_json(_start_with(_picture_url(world)))
        assert player.receive_json()["type"] == "video.start" and len(decoded) == 1
        late.send_json(_start_with(_picture_url(world)))
        refusal = late.receive_json()
        assert refusal["code"] == "capacity" and "1 of 1" in refusal["message"], refusal
        assert len(decoded) == 1  # the full server never read the late start's picture
    assert matrix_game_engine.sessions == ()


def test_a_start_picture_is_decoded_off_the_event_loop(matrix_game_engine, monkeypatch):
    from starlette.testclient import TestClient

    from ardiff_jax.serve import ServerSettings, _world, create_app

    on_loop: list[bool] = []
    release = threading.Event()
    decode = _world.decode_image_url

    def slow(url: str, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        release.wait(timeout=5)  # a slow decode: on the loop, nobody else would be answered meanwhile
        return decode(url, *args, **kwargs)

    monkeypatch.setattr(_world, "decode_image_url", slow)
    world = ServedWorld.for_pipeline(matrix_game_engine.runner.pipeline)
    app = create_app(matrix_game_engine, world=world, settings=ServerSettings(max_message_bytes=2**22))
    with (TestClient(app) as client, client.websocket_connect("/v1/realtime/video") as starting,
          client.websocket_connect("/v1/realtime/video") as other):
        starting.send_json(_start_with(_picture_url(world)))
        deadline = time.monotonic() + 10
        while not on_loop:
            assert time.monotonic() < deadline, "the picture was never decoded"
            time.sleep(0.01)
        sent = time.perf_counter()
        other.send_json({"type": "session.ping"})
        assert other.receive_json() == {"type": "session.pong"}
        waited = time.perf_counter() - sent
        release.set()
        assert starting.receive_json()["type"] == "video.start"
    assert on_loop == [False] and waited < 2.0, (on_loop, waited)
    assert matrix_game_engine.sessions == ()


def test_serve_matrix_game_arguments_are_checked_before_building(capsys):
    from ardiff_jax.cli import main

    for argv, needle in [
        (["serve", "--model", "matrix-game"], "--weights"),
        (["serve", "--model", "matrix-game", "--random-weights", "--preset", "tiny"], "not a Matrix-Game preset"),
        (["serve", "--model", "matrix-game", "--random-weights", "--variant", "templerun", "--preset",
          "matrix-game-tiny"], "not both"),
        (["serve", "--model", "wan", "--random-weights", "--variant", "universal"], "for --model matrix-game"),
    ]:
        assert main(argv) == 2
        assert needle in capsys.readouterr().err
