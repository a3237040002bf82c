"""Watching a DreamZero robot's predicted video on the policy server's ``WS /v1/realtime/video``.

The tiny random policy (``build_robot_policy``) served on uvicorn: a viewer gets one decoded chunk per inference of
the robot it watches, and those pixels are our Wan VAE's decode of the latents the engine returned; a robot nobody
watches is never decoded; refusals are the realtime protocol's errors; and nothing a viewer does (falling over,
leaving) reaches the robot: its actions equal those of a run nobody watched.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from ardiff_jax import EngineConfig
from ardiff_jax.models.dreamzero import build_robot_policy

uvicorn = pytest.importorskip("uvicorn")
websockets_client = pytest.importorskip("websockets.sync.client")

VIEWS = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")
KEY = "w" * 24
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def policy():
    policy = build_robot_policy(engine_config=EngineConfig(dtype="float32", available_memory_bytes=10**10,
                                                           gpu_memory_fraction=1.0, warmup=False))
    # The random decoder's output is nearly flat grey (pixel spread about 2 levels): its last conv scaled 12x, the
    # pictures spread about 16 levels, so comparing pixels tells one decode from another. Only viewers decode.
    kernel = policy.vae.decoder.head_conv.kernel
    kernel[...] = kernel[...] * 12
    return policy


def _observation(rng: np.random.Generator, frames: int) -> dict:
    obs = {key: rng.integers(0, 256, (frames, 180, 320, 3), dtype=np.uint8) for key in VIEWS}
    obs["observation/joint_position"] = rng.uniform(-1, 1, 7)
    obs["observation/gripper_position"] = rng.uniform(0, 1, 1)
    obs["prompt"] = "pick up the cup"
    return obs


def _episode(seed: int, calls: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [_observation(rng, 1 if call == 0 else 4) for call in range(calls)]


@contextlib.contextmanager
def serving(policy, access=None, **app_kwargs):
    """``create_policy_app(policy)`` on uvicorn in a thread on a free loopback port; yields the port."""
    from ardiff_jax.serve import POLICY_TRANSPORT_MAX_BYTES, PolicyServerConfig, ServerAccess, create_policy_app

    app = create_policy_app(policy, config=PolicyServerConfig(), access=access or ServerAccess(), name="watch-test",
                            **app_kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", proxy_headers=False,
                                          ws_max_size=POLICY_TRANSPORT_MAX_BYTES, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _robot(port: int, **kwargs):
    from ardiff_jax.serve import PolicyClient

    return PolicyClient(f"ws://127.0.0.1:{port}", timeout_s=TIMEOUT_S, **kwargs)


def _viewer(port: int, query: str = "", **kwargs):
    return websockets_client.connect(f"ws://127.0.0.1:{port}/v1/realtime/video{query}", open_timeout=30,
                                     max_size=None, compression=None, **kwargs)


def _send(viewer, **message: Any) -> None:
    viewer.send(json.dumps(message))


def _json(viewer) -> dict:
    frame = viewer.recv(timeout=TIMEOUT_S)
    assert isinstance(frame, str), f"expected a text frame, got {len(frame)} bytes"
    return json.loads(frame)


def _chunk(viewer) -> tuple[dict, bytes]:
    message = _json(viewer)
    assert message["type"] == "video.chunk_metadata", message
    payload = viewer.recv(timeout=TIMEOUT_S)
    assert isinstance(payload, bytes) and len(payload) == message["byte_length"]
    return message, payload


def _healthz(port: int) -> dict:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()


def _wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class _Recorder:
    """Wraps the policy's engine and decoders: the video latents each engine call returned, the frames each viewer's
    decoder made, and how many decodes ran."""

    def __init__(self, policy, monkeypatch) -> None:
        self.latents: list[Any] = []
        self.frames: list[list[np.ndarray]] = []
        generate, make_decoder = policy.engine.generate, policy.video_decoder

        def recording_generate(request):
            out = generate(request)
            self.latents.append(out["video"])
            return out

        def recording_decoder():
            decoder, made = make_decoder(), []
            self.frames.append(made)
            decode = decoder.decode

            def recording_decode(video):
                frames, info = decode(video)
                made.append(frames)
                return frames, info

            decoder.decode = recording_decode
            return decoder

        monkeypatch.setattr(policy.engine, "generate", recording_generate)
        monkeypatch.setattr(policy, "video_decoder", recording_decoder)


def test_a_viewer_gets_each_inference_of_its_robot_decoded_as_our_vae_decodes_the_engines_latents(
        policy, monkeypatch) -> None:
    """A jpeg and an m4s viewer of one robot through a 4-call episode: one chunk per inference, 9 frames for the
    episode's first call (its conditioning frame and 2 predicted latents), 8 after, 64 x 96 (the tiny canvas), at
    5 frames/s; the frames are our VAE's decode of the engine's latents (the episode's latents decoded at once);
    the jpeg bytes carry them, the m4s stream decodes to as many frames."""
    import av

    from ardiff_jax.models._pixels import latents_to_frames
    from ardiff_jax.serve._encode import decode_jpeg_chunk

    recorder = _Recorder(policy, monkeypatch)
    with serving(policy) as port, _robot(port) as robot, _viewer(port) as jpeg, _viewer(port) as m4s:
        robot.reset()  # the robot is connected: /healthz lists it by key
        (listed,) = _healthz(port)["connected_robots"]
        assert listed == {"robot": "robot-1", "session_id": None, "inferences": 0, "viewers": 0}
        _send(jpeg, type="session.start", robot="robot-1")
        started = _json(jpeg)
        assert started["type"] == "video.start" and started["format"] == "jpeg"
        assert {k: started["config"][k] for k in ("robot", "width", "height", "fps", "watch_only")} == {
            "robot": "robot-1", "width": 96, "height": 64, "fps": 5, "watch_only": True}
        _send(m4s, type="session.start", format="m4s")  # no robot named: the most recently active (the only one)
        assert _json(m4s)["config"]["robot"] == "robot-1"
        assert _healthz(port)["connected_robots"][0]["viewers"] == 2
        received: dict[str, list] = {"jpeg": [], "m4s": []}
        for obs in _episode(seed=3, calls=4):
            action = robot.infer({**obs, "session_id": "episode-1"})
            assert action.shape == (24, 8)
            for name, viewer in (("jpeg", jpeg), ("m4s", m4s)):
                received[name].append(_chunk(viewer))
        health = _healthz(port)
        assert health["connected_robots"][0]["session_id"] == "episode-1"
        assert health["connected_robots"][0]["inferences"] == 4 and health["chunks_decoded"] == 8

    for name in ("jpeg", "m4s"):
        metadata = [message for message, _ in received[name]]
        assert [m["num_frames"] for m in metadata] == [9, 8, 8, 8]
        assert [m["robot_inference"] for m in metadata] == [1, 2, 3, 4]
        assert [m["episode_start"] for m in metadata] == [True, False, False, False]
        assert [m["continued"] for m in metadata] == [False, True, True, True]
        assert [m["transport_chunk_index"] for m in metadata] == [0, 1, 2, 3]
        assert all(m["width"] == 96 and m["height"] == 64 and m["fps"] == 5 and m["robot"] == "robot-1"
                   and m["dropped_chunks"] == 0 for m in metadata)

    # Ours, directly: the episode's latents as the engine returned them, decoded by the VAE in one go.
    assert [tuple(v.shape) for v in recorder.latents] == [(3, 16, 8, 12)] + [(2, 16, 8, 12)] * 3
    direct = np.asarray(latents_to_frames(np.asarray(policy.vae.decode(np.concatenate(
        [np.asarray(v) for v in recorder.latents])))))
    assert direct.shape == (33, 64, 96, 3)
    for made in recorder.frames:  # each viewer's decoder, streaming, chunk by chunk
        streamed = np.concatenate(made)
        assert streamed.shape == direct.shape
        assert np.abs(streamed.astype(int) - direct).max() <= 1  # float32 reassociation may move a rounding
    assert direct.std() > 8  # pictures, not a flat grey (see the fixture)
    sent = np.concatenate([np.stack(decode_jpeg_chunk(payload)) for _, payload in received["jpeg"]])
    error = np.abs(sent.astype(int) - direct)
    # JPEG at quality 90 of small noisy pictures: close, and far closer than another chunk's pictures would be.
    assert sent.shape == direct.shape and error.mean() < 8
    assert np.corrcoef(sent.reshape(-1).astype(float), direct.reshape(-1).astype(float))[0, 1] > 0.9
    with av.open(io.BytesIO(b"".join(payload for _, payload in received["m4s"])), format="mp4") as container:
        assert sum(1 for _ in container.decode(video=0)) == 33


def test_a_robot_nobody_watches_is_never_decoded(policy, monkeypatch) -> None:
    """Two robots, one watched: the VAE decodes only the watched robot's chunks, the other's predicted video is
    never taken; after session.stop (session.done counts the chunks sent) nothing is decoded any more."""
    from ardiff_jax.models import wan  # the watcher decodes with the package's decode_step

    decodes, taken = [], []
    decode_step, take_video = wan.decode_step, policy.take_video
    monkeypatch.setattr(wan, "decode_step", lambda *a, **k: decodes.append(1) or decode_step(*a, **k))
    monkeypatch.setattr(policy, "take_video", lambda key: taken.append(key) or take_video(key))
    watched_calls, unwatched_calls = _episode(seed=4, calls=3), _episode(seed=5, calls=2)
    with serving(policy) as port, _robot(port) as watched, _robot(port) as unwatched, _viewer(port) as viewer:
        watched.infer(watched_calls[0])
        unwatched.infer(unwatched_calls[0])  # now the most recently active robot
        _send(viewer, type="session.start", robot="robot-1")
        assert _json(viewer)["config"]["robot"] == "robot-1"
        watched.infer(watched_calls[1])
        unwatched.infer(unwatched_calls[1])
        message, _ = _chunk(viewer)
        assert message["robot_inference"] == 2 and not message["continued"]  # joined mid-episode: a fresh stream
        assert message["num_frames"] == 5  # 2 latents decoded as a clip's start: 1 + 4
        assert len(decodes) == 1 and taken == ["robot-1"]
        _send(viewer, type="session.stop")
        assert _json(viewer) == {"type": "session.done", "request_id": "watch-1", "chunks": 1, "stopped": True}
        watched.infer(watched_calls[2])
        assert len(decodes) == 1 and taken == ["robot-1"]


def test_a_viewer_that_falls_behind_skips_stale_chunks(policy, monkeypatch) -> None:
    """While a viewer's decode is held, the robot goes on: of the two chunks made meanwhile the older is dropped
    (``dropped_chunks`` 1), the newer decoded as a fresh stream (it does not continue the last one decoded)."""
    gate, blocked = threading.Event(), threading.Event()
    make_decoder = policy.video_decoder

    def held_decoder():
        decoder = make_decoder()
        decode = decoder.decode

        def held(video):
            blocked.set()
            assert gate.wait(60)
            return decode(video)

        decoder.decode = held
        return decoder

    monkeypatch.setattr(policy, "video_decoder", held_decoder)
    with serving(policy) as port, _robot(port) as robot, _viewer(port) as viewer:
        robot.reset()
        _send(viewer, type="session.start")
        assert _json(viewer)["config"]["robot"] == "robot-1"
        calls = _episode(seed=7, calls=3)
        robot.infer(calls[0])
        assert blocked.wait(60)
        robot.infer(calls[1])  # waits in the viewer's one slot...
        robot.infer(calls[2])  # ...and replaces it there
        gate.set()
        first, _ = _chunk(viewer)
        second, _ = _chunk(viewer)
    # dropped_chunks counts the stream's skipped chunks so far: the first chunk's metadata is made after the skip.
    assert (first["robot_inference"], first["num_frames"], first["dropped_chunks"]) == (1, 9, 1)
    assert (second["robot_inference"], second["continued"], second["num_frames"], second["dropped_chunks"]) == (
        3, False, 5, 1)
    assert (first["transport_chunk_index"], second["transport_chunk_index"]) == (0, 1)


def test_watch_refusals_are_the_realtime_protocols_errors(policy) -> None:
    """No robot, an unknown robot (the error names the connected ones), a format other than jpeg and m4s, a
    second start, an interaction, a stop before a start, more viewers than max_viewers: each an error, the socket
    stays open and a good start still works; a policy that predicts no video has no watch route."""
    with serving(policy, max_viewers=1) as port:
        with _viewer(port) as viewer:
            _send(viewer, type="session.start")
            refused = _json(viewer)
            assert refused["code"] == "unknown_robot" and "no robot is connected" in refused["message"]
            with _robot(port) as robot:
                robot.reset({"session_id": "lab-7"})
                _send(viewer, type="session.start", robot="robot-9")
                refused = _json(viewer)
                assert refused["code"] == "unknown_robot"
                assert "robot-9" in refused["message"] and "robot-1 (session_id 'lab-7')" in refused["message"]
                for bad in ("mp4", 3):
                    _send(viewer, type="session.start", robot="robot-1", format=bad)
                    refused = _json(viewer)
                    assert refused["code"] == "invalid_field" and "format" in refused["message"]
                _send(viewer, type="session.start", robot="")
                assert _json(viewer)["code"] == "invalid_field"
                _send(viewer, type="session.stop")
                assert _json(viewer)["code"] == "not_started"
                _send(viewer, type="session.start", robot="lab-7")  # by its openpi session_id
                assert _json(viewer)["config"]["robot"] == "robot-1"
                _send(viewer, type="session.start")
                assert _json(viewer)["code"] == "already_started"
                _send(viewer, type="session.interaction", interaction={"event_id": "e1", "event": {"prompt": "x"}})
                refused = _json(viewer)
                assert refused["code"] == "interaction_rejected" and refused["event_id"] == "e1"
                _send(viewer, type="session.ping")
                assert _json(viewer) == {"type": "session.pong"}
                with _viewer(port) as second:
                    _send(second, type="session.start")
                    assert _json(second)["code"] == "capacity"
            done = _json(viewer)  # the watched robot left
            assert done["type"] == "session.done" and done["stopped"] is False
            assert done["reason"] == "robot_disconnected"

    from ardiff_jax.serve import create_policy_app

    class NoVideo:
        def validate(self, key, obs): ...
        def infer_batch(self, items): return [np.zeros((24, 8), np.float32) for _ in items]
        def reset(self, key): ...
        def close(self, key): ...

    with pytest.raises(ValueError, match="max_viewers is for a policy that predicts video"):
        create_policy_app(NoVideo(), max_viewers=2)
    with serving(NoVideo()) as port, pytest.raises(Exception):
        with _viewer(port):
            pass


def test_the_access_rules_of_the_robot_socket_apply_to_viewers(policy) -> None:
    """With an API key, a viewer without it (or with a wrong one) is refused 401 before the socket opens; the key as
    a header or ``?token=`` connects; a foreign Origin is refused 403; viewers count toward the per-address limit."""
    from websockets.exceptions import InvalidStatus

    from ardiff_jax.serve import ServerAccess

    with serving(policy, ServerAccess(api_key=KEY, max_connections_per_client=2)) as port:
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer " + "x" * 24}}):
            with pytest.raises(InvalidStatus) as refused:
                with _viewer(port, **kwargs):
                    pass
            assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as refused:
            with _viewer(port, f"?token={KEY}", origin="http://evil.example"):
                pass
        assert refused.value.response.status_code == 403
        with _viewer(port, f"?token={KEY}") as first, _viewer(
                port, additional_headers={"Authorization": f"Bearer {KEY}"}) as second:
            _send(first, type="session.ping")
            _send(second, type="session.ping")
            assert _json(first) == _json(second) == {"type": "session.pong"}
            with pytest.raises(InvalidStatus) as refused:  # a third connection from this address
                with _robot(port, api_key=KEY):
                    pass
            assert refused.value.response.status_code == 429


def test_viewers_failing_or_leaving_change_nothing_for_the_robot(policy, monkeypatch) -> None:
    """The robot's reply is sent while a viewer's decode is still blocked; that decode then fails: that viewer gets
    ``generation_failed`` and is closed (1011); another viewer leaves mid-stream; the robot's actions are bit for bit
    those of the same episode served with nobody watching."""
    episode = _episode(seed=6, calls=4)
    with serving(policy) as port, _robot(port) as robot:
        unwatched = [robot.infer({**obs, "session_id": "alone"}) for obs in episode]

    gate, blocked = threading.Event(), threading.Event()
    make_decoder = policy.video_decoder
    made = []

    def decoders():
        decoder = make_decoder()
        if not made:  # the first viewer's decoder blocks on the gate, then fails
            def failing(video):
                blocked.set()
                assert gate.wait(60)
                raise RuntimeError("the decoder fell over")

            decoder.decode = failing
        made.append(decoder)
        return decoder

    monkeypatch.setattr(policy, "video_decoder", decoders)
    with serving(policy) as port, _robot(port) as robot, _viewer(port) as failing, _viewer(port) as leaving:
        robot.reset()
        for viewer in (failing, leaving):
            _send(viewer, type="session.start", robot="robot-1")
            assert _json(viewer)["type"] == "video.start"
        watched = [robot.infer({**episode[0], "session_id": "watched"})]
        assert blocked.wait(60) and not gate.is_set()  # the reply came while the decode was still held
        gate.set()
        error = _json(failing)
        assert error["type"] == "error" and error["code"] == "generation_failed"
        assert "the decoder fell over" in error["message"]
        with pytest.raises(Exception):
            failing.recv(timeout=30)
        assert failing.close_code == 1011
        _chunk(leaving)
        leaving.close()  # mid-stream
        watched += [robot.infer({**obs, "session_id": "watched"}) for obs in episode[1:]]
        _wait_for(lambda: _healthz(port)["viewers"] == 0, "the viewers gone")
    for served, expected in zip(watched, unwatched, strict=True):
        np.testing.assert_array_equal(served, expected)



def test_at_droids_size_a_viewer_sees_the_352_x_640_canvas_and_holds_a_1016_mib_cache() -> None:
    """What the docs say a DROID viewer costs and sees: the Wan2.1 VAE's decode cache at DROID's latent (44 x 80)
    is 1016 MiB in bf16, and a decoded frame is the three views' 352 x 640 canvas."""
    import types

    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.dreamzero import PredictedVideoDecoder
    from ardiff_jax.models.wan import WanVAEConfig, cache_nbytes

    droid = dit_preset("dreamzero-droid")
    latent_hw = (droid.latent_height, droid.latent_width)
    assert latent_hw == (44, 80)
    assert round(cache_nbytes(WanVAEConfig(), latent_hw, "bfloat16") / 2**20) == 1016
    decoder = PredictedVideoDecoder(types.SimpleNamespace(config=WanVAEConfig()), latent_hw)
    assert decoder.frame_size == (352, 640) and decoder.fps == 5
