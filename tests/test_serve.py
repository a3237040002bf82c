"""The realtime video server (``ardiff_jax.serve``): protocol, streaming, interactions, limits, a real socket.

Two engines serve every test (built once per module): the sprite world with random-init
weights and the tiny text-conditioned ``WorldPipeline``. Most tests drive the ASGI app
through Starlette's ``TestClient``; one runs uvicorn on a free port with the ``websockets``
client.
"""

from __future__ import annotations

import dataclasses
import io
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("av")

from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.cli import build_parser
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, WorldPipeline, dit_preset
from ardiff_jax.serve import (
    ProtocolError,
    ServedWorld,
    ServerSettings,
    camera_action,
    create_app,
)
from ardiff_jax.serve._encode import decode_jpeg_chunk
from ardiff_jax.serve._protocol import (
    SessionInteraction,
    SessionStart,
    parse_client_message,
)
from ardiff_jax.serve._send_queue import SendQueue
from ardiff_jax.types import ARDiffusionTickRequest

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


@pytest.fixture(scope="module")
def sprite_engine():
    pipeline = SpriteWorldPipeline("sprite_world", modules=DiTModules.create(dit_preset("sprite_world"), 1))
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        yield engine


@pytest.fixture(scope="module")
def world_engine():
    with ARDiffusionEngine(WorldPipeline("tiny"), CONFIG) as engine:
        yield engine


def world_of(engine) -> ServedWorld:
    return ServedWorld.for_pipeline(engine.runner.pipeline)


class Generate:
    """Wraps ``engine.generate``: records requests; can hold every call at a gate or raise.

    ``error`` fails every call; with ``fail_only_applying`` only the calls of ticks that apply
    an interaction (so a test knows which chunk fails, whatever the generation loop's timing).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.original = engine.generate
        self.requests: list[Any] = []
        self.gate = threading.Event()
        self.gate.set()
        self.error: Exception | None = None
        self.fail_only_applying = False
        engine.generate = self

    def __call__(self, request):
        self.gate.wait(timeout=30)
        self.requests.append(request)
        if self.error is not None and not (
                self.fail_only_applying
                and not ARDiffusionTickRequest.from_extra_args(request.extra_args).applied_event_ids):
            raise self.error
        return self.original(request)

    def sessions(self) -> list[str]:
        return [ARDiffusionTickRequest.from_extra_args(r.extra_args).session_id for r in self.requests]

    def restore(self) -> None:
        self.gate.set()
        del self.engine.generate


@pytest.fixture
def sprite_generate(sprite_engine):
    generate = Generate(sprite_engine)
    yield generate
    generate.restore()


def serve(engine, **settings) -> TestClient:
    return TestClient(create_app(engine, world=world_of(engine), settings=ServerSettings(**settings)))


def start(ws, **fields) -> dict:
    ws.send_json({"type": "session.start", **fields})
    reply = ws.receive_json()
    assert reply["type"] == "video.start", reply
    return reply


def receive(ws) -> dict:
    """The next message; WebSocketDisconnect (with the close code) when the server closed the socket."""
    message = ws.receive()
    if message["type"] == "websocket.close":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    assert message["type"] == "websocket.send", message
    return message


def next_chunk(ws, controls: list[dict] | None = None) -> tuple[dict, bytes]:
    """The next metadata + binary pair; control messages on the way go to ``controls``."""
    while True:
        message = receive(ws)
        assert message.get("text") is not None, "a binary frame without its metadata"
        payload = json.loads(message["text"])
        if payload["type"] == "video.chunk_metadata":
            media = receive(ws)
            assert media.get("bytes") is not None, "metadata not followed by a binary frame"
            return payload, media["bytes"]
        assert controls is not None, f"unexpected control message {payload}"
        controls.append(payload)


def until(ws, kind: str, chunks: list | None = None) -> dict:
    """Read until a control message of type ``kind``; chunks on the way go to ``chunks``."""
    while True:
        payload = json.loads(receive(ws)["text"])
        if payload["type"] == "video.chunk_metadata":
            media = receive(ws)["bytes"]
            if chunks is not None:
                chunks.append((payload, media))
            continue
        if payload["type"] == kind:
            return payload
        assert payload["type"] in ("session.interaction.queued", "session.pong"), payload


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {line_start!r}")


def interaction(event_id: str | None = None, **event) -> dict:
    body: dict = {"event": event}
    if event_id is not None:
        body["event_id"] = event_id
    return {"type": "session.interaction", "interaction": body}


def action(value: str) -> dict:
    return {"multi_modal_data": {"action": {"value": value}}}


def camera(x: float, y: float, z: float, mode: str = "velocity") -> dict:
    return {"multi_modal_data": {"camera": {"mode": mode, "data": {"translation": [x, y, z],
                                                                  "rotation": [0, 0, 0, 1]}}}}


# -- pure parts ---------------------------------------------------------------------------------------


def test_camera_velocity_maps_to_actions_by_dominant_axis():
    assert camera_action((1.0, 0.0, 0.0)) == "right"
    assert camera_action((-0.5, 0.0, 0.0)) == "left"
    assert camera_action((0.0, 0.0, 2.0)) == "up"
    assert camera_action((0.0, 9.0, -1.0)) == "down"  # y is ignored
    assert camera_action((0.0, 3.0, 0.0)) == "no-op"
    assert camera_action((0.3, 0.0, -0.9)) == "down"  # the larger magnitude wins
    assert camera_action((-1.0, 0.0, 1.0)) == "left"  # x on a tie


def test_protocol_parsing_names_the_offending_field():
    start = parse_client_message('{"type": "session.start", "format": "jpeg", "num_frames": 3, "model": "m"}')
    assert start == SessionStart(format="jpeg", num_frames=3, ignored_fields=("model",))
    cases = [
        ("{nope", "invalid_json", "JSON"),
        ("[1, 2]", "invalid_json", "object"),
        ('{"type": "video.dance"}', "unknown_type", "video.dance"),
        ('{"type": 5}', "invalid_field", "type"),
        ('{"type": "session.start", "format": "webm"}', "invalid_field", "format"),
        ('{"type": "session.start", "num_frames": 0}', "invalid_field", "num_frames"),
        ('{"type": "session.start", "num_frames": true}', "invalid_field", "num_frames"),
        ('{"type": "session.start", "seed": -1}', "invalid_field", "seed"),
        ('{"type": "session.start", "prompt": 7}', "invalid_field", "prompt"),
        ('{"type": "session.start", "prompt": "\\ud800"}', "invalid_field", "UTF-8"),
        ('{"type": "session.interaction", "interaction": []}', "invalid_field", "interaction"),
        ('{"type": "session.interaction", "interaction": {"event_id": 3, "event": {}}}', "invalid_field",
         "event_id"),
        ('{"type": "session.interaction", "interaction": {"event": {"multi_modal_data": {"camera": {"mode": "v"}}}}}',
         "invalid_field", "camera.mode"),
        (('{"type": "session.interaction", "interaction": {"event": {"multi_modal_data": {"camera": '
          '{"mode": "velocity", "data": {"translation": [1, "x", 0]}}}}}}'), "invalid_field", "translation"),
    ]
    for text, code, needle in cases:
        with pytest.raises(ProtocolError, match=needle) as raised:
            parse_client_message(text)
        assert raised.value.code == code, text


def test_world_plans_starts_and_refuses_what_it_cannot_apply(sprite_engine, world_engine):
    sprite, tiny = world_of(sprite_engine), world_of(world_engine)
    plan = sprite.plan_start(SessionStart(width=128, height=128, seed=4, prompt="ignored"))
    assert (plan.scale, plan.width, plan.seed, plan.prompt, plan.ignored_fields) == (4, 128, 4, None, ("prompt",))
    with pytest.raises(ProtocolError, match="same factor"):
        sprite.plan_start(SessionStart(width=64, height=96))
    with pytest.raises(ProtocolError, match="multiple"):
        sprite.plan_start(SessionStart(width=50))
    with pytest.raises(ProtocolError, match="prompt is required"):
        tiny.plan_start(SessionStart())
    for event, needle in [(SessionInteraction("e", prompt="a cat"), "not text-conditioned"),
                          (SessionInteraction("e", action="jump"), "unknown action"),
                          (SessionInteraction("e", unsupported_modalities=("image",)), "image"),
                          (SessionInteraction("e"), "changes nothing")]:
        with pytest.raises(ProtocolError, match=needle) as raised:
            sprite.event_update(event)
        assert (raised.value.code, raised.value.event_id) == ("interaction_rejected", "e")
    with pytest.raises(ProtocolError, match="prompt updates only"):
        tiny.event_update(SessionInteraction("e", action="left"))
    assert tiny.event_update(SessionInteraction("e", prompt="a dog")).fields == ("prompt",)


def test_send_queue_drops_the_oldest_droppable_media_and_never_control():
    import asyncio

    async def scenario():
        drops = []
        queue = SendQueue(max_media=2, max_control=4, on_drop=lambda: drops.append(1))
        queue.put_media({"i": 0}, b"header", droppable=False)
        await queue.put_control({"type": "c"})
        for i in range(1, 5):
            queue.put_media({"i": i}, b"x")
        items = [await queue.get() for _ in range(len(queue))]
        return drops, [(item.kind, item.message) for item in items]

    drops, items = asyncio.run(scenario())
    assert len(drops) == 3  # 1, 2, 3 dropped: the header and the control message stay
    assert items == [("media", {"i": 0}), ("control", {"type": "c"}), ("media", {"i": 4})]


# -- streaming -----------------------------------------------------------------------------------------


def test_sprite_jpeg_session_streams_until_stop_then_done_releases_the_engine(sprite_engine):
    with serve(sprite_engine) as client, client.websocket_connect(PATH) as ws:
        reply = start(ws, format="jpeg", seed=5)
        config = reply["config"]
        assert reply["format"] == "jpeg" and config["actions"] == ["no-op", "up", "down", "left", "right"]
        assert config["controls"] == ["camera", "action"] and config["camera_modes"] == ["velocity", "target"]
        assert config["seed"] == 5 and config["num_frames"] is None
        received = [next_chunk(ws) for _ in range(4)]
        for index, (meta, payload) in enumerate(received):
            assert meta["request_id"] == reply["request_id"] and meta["kind"] == "media"
            assert meta["transport_chunk_index"] == index == meta["generation_chunk_index"]
            assert meta["byte_length"] == len(payload) and meta["num_frames"] == 1 and meta["latency_ms"] > 0
            frames = decode_jpeg_chunk(payload)
            assert len(frames) == 1 and frames[0].shape == (32, 32, 3)
        assert list(sprite_engine.sessions) == [reply["request_id"]]
        ws.send_json({"type": "session.stop"})
        chunks: list = []
        done = until(ws, "session.done", chunks)
        assert done["stopped"] is True and done["chunks"] == 4 + len(chunks)
        assert [m["transport_chunk_index"] for m, _ in chunks] == list(range(4, 4 + len(chunks)))
        wait_for(lambda: sprite_engine.sessions == ())


def test_a_session_restarts_on_the_same_socket_after_session_done(sprite_engine):
    with serve(sprite_engine, start_timeout_s=0.5) as client, client.websocket_connect(PATH) as ws:
        first = start(ws, format="jpeg", seed=1, num_frames=2)["request_id"]
        done = until(ws, "session.done", chunks := [])
        assert done["stopped"] is False and done["request_id"] == first and done["chunks"] == len(chunks) == 2
        wait_for(lambda: sprite_engine.sessions == ())
        # The socket stays open: a second session on it, with its own id and chunk indices from 0.
        second = start(ws, format="jpeg", seed=2)["request_id"]
        assert second != first
        meta, _ = next_chunk(ws)
        assert meta["request_id"] == second and meta["transport_chunk_index"] == 0
        assert meta["generation_chunk_index"] == 0 and list(sprite_engine.sessions) == [second]
        ws.send_json({"type": "session.stop"})
        assert until(ws, "session.done")["request_id"] == second
        # Left idle after its session.done, the connection is closed normally at the start timeout, with no error.
        since = time.monotonic()
        with pytest.raises(WebSocketDisconnect) as closed:
            receive(ws)
        assert closed.value.code == 1000 and 0.3 < time.monotonic() - since < 5
        wait_for(lambda: sprite_engine.sessions == ())


def test_world_m4s_session_with_num_frames_decodes_with_pyav(world_engine):
    import av

    with serve(world_engine) as client, client.websocket_connect(PATH) as ws:
        reply = start(ws, prompt="a red fox", num_frames=5, width=32, height=32, fps=8)
        assert reply["config"]["controls"] == ["prompt"] and reply["config"]["actions"] == []
        chunks: list = []
        done = until(ws, "session.done", chunks)
        assert done == {"type": "session.done", "request_id": reply["request_id"], "chunks": 3, "stopped": False}
        assert [m["num_frames"] for m, _ in chunks] == [2, 2, 1]  # the last chunk is trimmed to num_frames
        with av.open(io.BytesIO(b"".join(payload for _, payload in chunks)), format="mp4") as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    wait_for(lambda: world_engine.sessions == ())


def test_world_start_needs_a_prompt_and_prompt_updates_are_queued(world_engine):
    with serve(world_engine) as client, client.websocket_connect(PATH) as ws:
        ws.send_json({"type": "session.start"})
        error = ws.receive_json()
        assert error["code"] == "invalid_field" and "prompt" in error["message"]
        start(ws, prompt="a forest", format="jpeg")  # the socket stayed open
        ws.send_json(interaction("p1", prompt="a beach"))
        controls: list = []
        meta, _ = next_chunk(ws, controls)
        while "p1" not in meta["started_event_ids"]:
            meta, _ = next_chunk(ws, controls)
        assert meta["active_event_ids"] == ["p1"]
        assert {"type": "session.interaction.queued", "request_id": meta["request_id"], "event_id": "p1",
                "duplicate": False} in controls


def test_interactions_queued_duplicate_rejected_and_event_lifecycle(sprite_engine, sprite_generate):
    sprite_generate.gate.clear()  # no chunk completes while the events are queued
    with serve(sprite_engine) as client, client.websocket_connect(PATH) as ws:
        start(ws, format="jpeg")
        ws.send_json(interaction("a", **action("left")))
        ws.send_json(interaction("a", **action("right")))
        ws.send_json(interaction("p", prompt="a cat"))
        ws.send_json(interaction("t", **action("jump")))
        ws.send_json(interaction(None, **camera(0, 0, 1)))
        replies = [ws.receive_json() for _ in range(5)]
        assert [r.get("duplicate") for r in replies[:2]] == [False, True]
        assert [(r["code"], r["event_id"]) for r in replies[2:4]] == [("interaction_rejected", "p"),
                                                                      ("interaction_rejected", "t")]
        assert "not text-conditioned" in replies[2]["message"] and "unknown action" in replies[3]["message"]
        assigned = replies[4]["event_id"]
        assert replies[4]["type"] == "session.interaction.queued" and assigned.startswith("server-")
        sprite_generate.gate.set()
        meta, _ = next_chunk(ws)
        while not meta["started_event_ids"]:
            meta, _ = next_chunk(ws)
        # Both set the action: "a" started and was replaced by the later event in the same chunk.
        assert meta["started_event_ids"] == ["a", assigned]
        assert meta["active_event_ids"] == [assigned] and meta["completed_event_ids"] == ["a"]
        ws.send_json(interaction("b", **action("no-op")))
        controls: list = []
        meta, _ = next_chunk(ws, controls)
        while "b" not in meta["started_event_ids"]:
            meta, _ = next_chunk(ws, controls)
        assert meta["active_event_ids"] == ["b"] and meta["completed_event_ids"] == [assigned]
        assert metric(client, 'ardiff_interactions_total{outcome="duplicate"}') == 1
        assert metric(client, 'ardiff_interactions_total{outcome="rejected"}') == 2


def test_camera_velocity_and_actions_reach_the_engine_and_persist(sprite_engine, sprite_generate):
    with serve(sprite_engine) as client, client.websocket_connect(PATH) as ws:
        start(ws, format="jpeg", seed=11)
        next_chunk(ws)
        ws.send_json(interaction("down", **camera(0.0, 0.0, -0.7)))
        controls: list = []
        meta, _ = next_chunk(ws, controls)
        while "down" not in meta["started_event_ids"]:
            meta, _ = next_chunk(ws, controls)
        for _ in range(2):
            next_chunk(ws, controls)
        ws.send_json({"type": "session.stop"})
        until(ws, "session.done")
    first = sprite_generate.requests[0]
    assert first.inputs["observation"].shape == (32, 32, 3) and int(first.inputs["seed"]) == 11
    actions = [int(r.inputs["actions"][0]) for r in sprite_generate.requests]
    changed = actions.index(2)  # "down"
    assert set(actions[:changed]) == {0} and set(actions[changed:]) == {2}  # held until replaced
    assert len(actions) - changed >= 3


def test_interaction_flood_past_the_queue_is_rejected_and_streaming_goes_on(sprite_engine, sprite_generate):
    sprite_generate.gate.clear()
    with serve(sprite_engine, max_pending_events=3) as client, client.websocket_connect(PATH) as ws:
        start(ws, format="jpeg")
        for i in range(10):
            ws.send_json(interaction(f"e{i}", **action("up")))
        replies = [ws.receive_json() for _ in range(10)]
        # The first chunk is in flight (held) and applied nothing: three fit the queue.
        assert [r["type"] for r in replies[:3]] == ["session.interaction.queued"] * 3
        assert all(r["code"] == "interaction_rejected" and "full" in r["message"] for r in replies[3:])
        assert [r["event_id"] for r in replies] == [f"e{i}" for i in range(10)]
        sprite_generate.gate.set()
        meta, _ = next_chunk(ws)
        while not meta["started_event_ids"]:
            meta, _ = next_chunk(ws)
        assert meta["started_event_ids"] == ["e0", "e1", "e2"]
        ws.send_json(interaction("e5", **action("down")))  # a rejected id may be sent again
        assert ws.receive_json()["type"] in ("session.interaction.queued", "video.chunk_metadata")


def test_capacity_refuses_a_start_without_evicting_and_the_client_may_retry(sprite_engine):
    with (serve(sprite_engine, capacity=1) as client, client.websocket_connect(PATH) as first,
          client.websocket_connect(PATH) as second):
        start(first, format="jpeg")
        next_chunk(first)
        second.send_json({"type": "session.start", "format": "jpeg"})
        refusal = second.receive_json()
        assert refusal["code"] == "capacity" and "1 of 1" in refusal["message"]
        second.send_json({"type": "session.ping"})
        assert second.receive_json() == {"type": "session.pong"}  # still open
        next_chunk(first)  # the live player kept streaming
        first.send_json({"type": "session.stop"})
        until(first, "session.done")
        wait_for(lambda: client.get("/healthz").json()["sessions"]["admitted"] == 0)
        start(second, format="jpeg")
        next_chunk(second)
        health = client.get("/healthz").json()
        assert health["capacity"] == 1 and health["sessions"]["admitted"] == 1
        assert health["sessions"]["resident"] == 1


def test_hostile_messages_get_clear_errors_and_the_socket_stays_usable(sprite_engine):
    with serve(sprite_engine, max_message_bytes=256) as client, client.websocket_connect(PATH) as ws:
        probes = [
            ("text", json.dumps({"type": "session.ping", "pad": "x" * 300}), "message_too_large", "256"),
            ("text", "{not json", "invalid_json", "JSON"),
            ("text", json.dumps({"type": "session.teleport"}), "unknown_type", "session.teleport"),
            ("text", json.dumps({"type": "session.start", "format": 5}), "invalid_field", "format"),
            ("text", json.dumps({"type": "session.start", "seed": "one"}), "invalid_field", "seed"),
            ("bytes", b"\x00\x01", "unexpected_binary", "binary"),
            ("text", json.dumps(interaction("x", **action("up"))), "not_started", "session.start"),
            ("text", json.dumps({"type": "session.stop"}), "not_started", "session.stop"),
        ]
        for kind, data, code, needle in probes:
            ws.send_bytes(data) if kind == "bytes" else ws.send_text(data)
            reply = ws.receive_json()
            assert reply["type"] == "error" and reply["code"] == code and needle in reply["message"], reply
        start(ws, format="jpeg")
        ws.send_json({"type": "session.start", "format": "jpeg"})
        assert until(ws, "error")["code"] == "already_started"
        assert metric(client, 'ardiff_errors_total{code="invalid_field"}') == 2


def test_start_timeout_reports_and_closes(sprite_engine):
    with serve(sprite_engine, start_timeout_s=0.2) as client, client.websocket_connect(PATH) as ws:
        reply = ws.receive_json()
        assert reply["code"] == "start_timeout"
        with pytest.raises(WebSocketDisconnect) as closed:
            receive(ws)
        assert closed.value.code == 1008


def test_stall_without_progress_or_ping_reports_and_closes(sprite_engine, sprite_generate):
    with serve(sprite_engine, stall_timeout_s=0.3) as client, client.websocket_connect(PATH) as ws:
        sprite_generate.gate.clear()  # the engine makes no progress
        start(ws, format="jpeg")
        error = until(ws, "error")
        assert error["code"] == "stall" and "0.3 s" in error["message"]
        sprite_generate.gate.set()
        with pytest.raises(WebSocketDisconnect):
            until(ws, "never")
        wait_for(lambda: sprite_engine.sessions == ())


def test_two_connections_are_served_round_robin(sprite_engine, sprite_generate):
    with (serve(sprite_engine) as client, client.websocket_connect(PATH) as a,
          client.websocket_connect(PATH) as b):
        ids = [start(a, format="jpeg")["request_id"], start(b, format="jpeg")["request_id"]]
        for _ in range(6):
            next_chunk(a)
            next_chunk(b)
        served = sprite_generate.sessions()
        both = served[served.index(ids[1]):]  # from the second session's first tick on
        for end in range(1, len(both) + 1):  # every prefix: counts within one of each other
            assert abs(both[:end].count(ids[0]) - both[:end].count(ids[1])) <= 1, both


def test_a_client_that_never_reads_pauses_its_session_and_others_keep_streaming(sprite_engine, sprite_generate,
                                                                                   monkeypatch):
    blocked = threading.Event()
    release = None
    original = WebSocket.send_bytes

    async def send_bytes(self, data):
        nonlocal release
        if getattr(self, "never_reads", False):
            import asyncio

            release = asyncio.Event()
            blocked.set()
            await release.wait()
        await original(self, data)

    monkeypatch.setattr(WebSocket, "send_bytes", send_bytes)
    app = create_app(sprite_engine, world=world_of(sprite_engine), settings=ServerSettings(max_queued_chunks=2))
    server = app.state.server
    with TestClient(app) as client, client.websocket_connect(PATH) as slow:
        (slow_conn,) = server.connections
        slow_conn.websocket.never_reads = True
        start(slow, format="jpeg")
        with client.websocket_connect(PATH) as fast:
            start(fast, format="jpeg")
            assert blocked.wait(10)
            # Its sender holds one chunk and two wait: no more are made for it, none is dropped.
            wait_for(lambda: len(slow_conn.queue) == 2)
            made = sprite_generate.sessions().count(slow_conn.request_id)
            for _ in range(12):
                next_chunk(fast)
            assert sprite_generate.sessions().count(slow_conn.request_id) == made
            assert len(slow_conn.queue) == 2 and slow_conn.queue.dropped == 0
            assert metric(client, "ardiff_send_queue_dropped_total") == 0


def test_disconnect_closes_the_session_and_metrics_and_health_follow(sprite_engine):
    with serve(sprite_engine) as client:
        with client.websocket_connect(PATH) as ws:
            start(ws, format="m4s")
            next_chunk(ws)
            assert metric(client, "ardiff_sessions_connected") == 1
            assert metric(client, "ardiff_sessions_resident") == 1
            assert client.get("/healthz").json()["sessions"]["streaming"] == 1
        wait_for(lambda: sprite_engine.sessions == () and metric(client, "ardiff_sessions_connected") == 0)
        assert metric(client, "ardiff_sessions_resident") == 0
        assert metric(client, "ardiff_chunks_total") >= 1
        assert metric(client, "ardiff_chunk_latency_seconds_count") >= 1
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["sessions"] == {"connected": 0, "streaming": 0, "admitted": 0,
                                                                    "resident": 0, "closing": 0}
        assert "text/plain" in client.get("/metrics").headers["content-type"]
        root = client.get("/")
        assert root.status_code == 200 and root.headers["content-type"].startswith("text/html")
        assert PATH in root.text and "<canvas" in root.text


def test_a_disconnect_while_its_chunk_encodes_leaves_the_generation_loop_running(sprite_engine):
    """The loop waits for a session's encoder before its next chunk; a disconnect then cancels that wait's task."""
    base = world_of(sprite_engine)
    encoding = threading.Event()
    release = threading.Event()

    class HeldWorld(type(base)):
        def frames(self, output):
            encoding.set()
            release.wait(timeout=30)
            return super().frames(output)

    held = HeldWorld(**{field.name: getattr(base, field.name) for field in dataclasses.fields(base)})
    try:
        with TestClient(create_app(sprite_engine, world=held, settings=ServerSettings())) as client:
            with client.websocket_connect(PATH) as ws:
                start(ws, format="jpeg")
                assert encoding.wait(timeout=30)
                time.sleep(0.3)  # the loop's next round is now waiting on this session's encoder
            wait_for(lambda: sprite_engine.sessions == ())
            release.set()
            assert client.get("/healthz").json()["status"] == "ok"  # the loop survived the cancelled wait
            with client.websocket_connect(PATH) as ws:  # and still streams
                start(ws, format="jpeg")
                next_chunk(ws)
    finally:
        release.set()
    wait_for(lambda: sprite_engine.sessions == ())


def test_a_failed_chunk_reports_its_events_and_ends_the_session(sprite_engine, sprite_generate):
    with serve(sprite_engine) as client, client.websocket_connect(PATH) as ws:
        start(ws, format="jpeg")
        next_chunk(ws)
        # Only the chunk that applies "boom" fails (chunks already in flight without it stream on).
        sprite_generate.fail_only_applying = True
        sprite_generate.error = RuntimeError("device lost")
        ws.send_json(interaction("boom", **action("up")))
        assert until(ws, "session.interaction.queued")["event_id"] == "boom"
        failed = until(ws, "error")
        assert failed["code"] == "interaction_failed" and failed["event_id"] == "boom"
        final = until(ws, "error")
        assert final["code"] == "generation_failed" and "device lost" in final["message"]
        with pytest.raises(WebSocketDisconnect) as closed:
            receive(ws)
        assert closed.value.code == 1011
    wait_for(lambda: sprite_engine.sessions == ())


# -- a real socket ---------------------------------------------------------------------------------------


def test_uvicorn_on_a_free_port_serves_the_websockets_client(sprite_engine):
    import httpx
    import uvicorn
    from websockets.sync.client import connect

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(sprite_engine, world=world_of(sprite_engine))
    # log_config=None: uvicorn's default dictConfig would stop its loggers propagating for the rest of this
    # worker's tests (tests/test_serve_access.py reads uvicorn's request lines through caplog).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        with connect(f"ws://127.0.0.1:{port}{PATH}", open_timeout=10) as ws:
            ws.send(json.dumps({"type": "session.start", "format": "jpeg", "num_frames": 3, "seed": 2}))
            assert json.loads(ws.recv(timeout=10))["type"] == "video.start"
            frames = []
            while True:
                message = json.loads(ws.recv(timeout=10))
                if message["type"] == "session.done":
                    break
                assert message["type"] == "video.chunk_metadata"
                payload = ws.recv(timeout=10)
                assert isinstance(payload, bytes) and len(payload) == message["byte_length"]
                frames += decode_jpeg_chunk(payload)
            assert message["chunks"] == 3 and len(frames) == 3
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
        assert health["model"] == "sprite_world"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert sprite_engine.sessions == ()


# -- the command line -------------------------------------------------------------------------------------


def test_serve_command_line_refuses_bad_arguments(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--pretrained", "sprite_world", "--port", "0", "--capacity", "2",
                              "--host-offload-bytes", "1024", "--max-message-bytes", "512"])
    assert (args.pretrained, args.port, args.capacity, args.host_offload_bytes, args.max_message_bytes) == (
        "sprite_world", 0, 2, 1024, 512)
    assert (args.lookahead_chunks, args.no_pacing) == (1, False)
    paced = parser.parse_args(["serve", "--pretrained", "sprite_world", "--lookahead-chunks", "0", "--no-pacing"])
    assert (paced.lookahead_chunks, paced.no_pacing) == (0, True)
    for argv, needle in [(["serve"], "one of the arguments"), (["serve", "--pipeline", "world", "--port", "70000"],
                                                                "port"),
                         (["serve", "--pipeline", "world", "--capacity", "0"], "positive"),
                         (["serve", "--pretrained", "sprite_world", "--pipeline", "world"], "not allowed"),
                         (["serve", "--pretrained", "sprite_world", "--lookahead-chunks", "-1"], "[0, 64]")]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2 and needle in capsys.readouterr().err
