"""Pacing: the server generates each session's chunks just in time for playback at its frame rate.

The clock arithmetic (:class:`ardiff_jax.serve._pacing.PlaybackClock`) is tested on its own with
explicit times; the server tests drive a sprite world (random weights, one frame per chunk)
through Starlette's ``TestClient`` and check what pacing promises: a session never runs more
than its lookahead ahead of playback, an action applies to a chunk at most two after the one
the client last received, a session asking for more than the engine sustains is clamped and
told so, and when the engine cannot keep up every session slows evenly and reports it.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")

from helpers import next_chunk_metadata
from starlette.testclient import TestClient

from ardiff_jax import ARDiffusionEngine, EngineConfig
from ardiff_jax.envs import ACTION_NAMES, cell_codes, cell_templates
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, dit_preset, pretrained
from ardiff_jax.serve import ServedWorld, ServerSettings, create_app
from ardiff_jax.serve._pacing import UNDERRUN_TOLERANCE_S, PlaybackClock
from ardiff_jax.serve._protocol import CameraUpdate, SessionInteraction
from ardiff_jax.serve._world import DEFAULT_TRANSITION_CHUNKS, target_actions
from ardiff_jax.types import ARDiffusionTickRequest

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


# -- the clock ---------------------------------------------------------------------------------------------


def test_the_first_lookahead_plus_one_chunks_are_due_at_once_then_each_when_its_predecessor_plays():
    clock = PlaybackClock(10, 1)  # chunks of 2 frames = 0.2 s each below
    assert clock.due_at() == -math.inf and clock.deadline() == -math.inf
    assert clock.record(5.0, 2) == 0.0  # the first chunk ready: frame 0 plays at 5.0
    assert clock.anchor == 5.0 and clock.due_at() == -math.inf  # chunk 1: the one lookahead chunk
    assert clock.deadline() == pytest.approx(5.2)
    clock.record(5.05, 2)
    # Chunk 2 may start when chunk 1 starts playing (frame 2, at 5.2); it must be ready when chunk 2 plays (5.4).
    assert clock.due_at() == pytest.approx(5.2) and clock.deadline() == pytest.approx(5.4)
    assert clock.playing_chunks_ahead(5.1) == pytest.approx(0.3)
    clock.record(5.3, 2)
    assert clock.due_at() == pytest.approx(5.4) and clock.underruns == 0


def test_a_late_chunk_is_an_underrun_and_moves_playback_later_by_its_lateness():
    clock = PlaybackClock(10, 1)
    clock.record(0.0, 2)
    clock.record(0.01, 2)
    late = clock.record(0.5, 2)  # chunk 2 should have been ready at 0.4
    assert late == pytest.approx(0.1) and clock.underruns == 1 and clock.stalled_s == pytest.approx(0.1)
    assert clock.anchor == pytest.approx(0.1)  # the player waited 0.1 s; nothing was skipped
    assert clock.deadline() == pytest.approx(0.7) and clock.due_at() == pytest.approx(0.5)
    assert clock.record(0.4 + 0.1 + 0.2 + UNDERRUN_TOLERANCE_S / 2, 2) == 0.0  # within tolerance: on time
    assert clock.underruns == 1


def test_lookahead_zero_makes_a_chunk_due_only_when_it_is_needed():
    clock = PlaybackClock(4, 0)
    clock.record(1.0, 1)
    assert clock.due_at() == clock.deadline() == pytest.approx(1.25)


def test_unpaced_clocks_make_every_chunk_due_and_still_measure_the_rate():
    clock = PlaybackClock(10, 1, paced=False)
    assert clock.real_fps() is None and clock.real_time_factor() is None
    for i in range(5):
        clock.record(0.1 * i, 4)
        assert clock.due_at() == -math.inf
    assert clock.real_fps() == pytest.approx(40.0) and clock.real_time_factor() == pytest.approx(4.0)


def test_the_real_rate_is_measured_over_recent_chunks():
    clock = PlaybackClock(10, 1)
    for i in range(20):  # 10 slow chunks (0.4 s per 2 frames), then 10 on time
        clock.record(0.4 * i if i < 10 else 3.6 + 0.2 * (i - 9), 2)
    assert clock.real_fps() == pytest.approx(10.0) and clock.real_time_factor() == pytest.approx(1.0)


@pytest.mark.parametrize("fps", [0, -1, float("nan"), True, "10"])
def test_a_bad_rate_is_refused(fps):
    with pytest.raises(ValueError, match="fps"):
        PlaybackClock(fps, 1)


@pytest.mark.parametrize("field, value", [("lookahead_chunks", -1), ("lookahead_chunks", 1.5),
                                          ("paced", 1), ("fps_samples", 0), ("batch_ticks", "yes")])
def test_bad_pacing_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})


# -- the server --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    pipeline = SpriteWorldPipeline("sprite_world", modules=DiTModules.create(dit_preset("sprite_world"), 1))
    with ARDiffusionEngine(pipeline, CONFIG) as engine:
        engine.generate(_warm_request())  # compile before any timing
        engine.close_session("warm")
        yield engine


def _warm_request():
    from ardiff_jax import DiffusionRequest
    from ardiff_jax.envs import SpriteWorld

    return DiffusionRequest("warm", extra_args={"session_id": "warm"},
                            inputs={"observation": SpriteWorld(0, size=32).reset(), "actions": [0], "seed": 0})


class Slowed:
    """``engine.generate`` taking at least ``seconds``; counts the calls per session."""

    def __init__(self, engine, seconds: float) -> None:
        self.engine, self.seconds, self.original = engine, seconds, engine.generate
        self.calls: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        engine.generate = self

    def __call__(self, request):
        started = time.monotonic()
        output = self.original(request)
        time.sleep(max(0.0, self.seconds - (time.monotonic() - started)))
        with self.lock:
            self.calls.append((time.monotonic(), ARDiffusionTickRequest.from_extra_args(request.extra_args).session_id))
        return output

    def count(self, session_id: str | None = None) -> int:
        with self.lock:
            return sum(1 for _, s in self.calls if session_id is None or s == session_id)

    def restore(self) -> None:
        del self.engine.generate


@pytest.fixture
def slowed(engine):
    made: list[Slowed] = []

    def make(seconds: float) -> Slowed:
        made.append(Slowed(engine, seconds))
        return made[-1]

    yield make
    for spy in made:
        spy.restore()


def serve(engine, **settings) -> TestClient:
    return TestClient(create_app(engine, world=ServedWorld.for_pipeline(engine.runner.pipeline),
                                 settings=ServerSettings(**settings)))


def start(ws, **fields) -> dict:
    ws.send_json({"type": "session.start", "format": "jpeg", **fields})
    reply = ws.receive_json()
    assert reply["type"] == "video.start", reply
    return reply


next_chunk = next_chunk_metadata


def test_a_paced_session_never_runs_more_than_its_lookahead_ahead_of_playback(engine, slowed):
    spy = slowed(0.0)
    fps, frames_per_chunk = 20, 1
    with serve(engine) as client, client.websocket_connect(PATH) as ws:
        config = start(ws, fps=fps, seed=3)["config"]
        assert config["fps"] == fps and config["paced"] is True and config["lookahead_chunks"] == 1
        first = next_chunk(ws)
        first_ready = time.monotonic()
        assert first["fps"] == fps and first["underruns"] == 0
        received = 1
        while time.monotonic() - first_ready < 1.5:
            meta = next_chunk(ws)
            received += 1
            # Playback has reached frame (now - first_ready) * fps at most; one chunk is playing and one more
            # may be generated (lookahead 1), plus the one whose generation may be under way.
            played = (time.monotonic() - first_ready) * fps / frames_per_chunk
            assert spy.count() <= math.floor(played) + 1 + 1 + 1, (spy.count(), played)
        ws.send_json({"type": "session.stop"})
    elapsed = time.monotonic() - first_ready
    # It kept up (one-frame chunks of a tiny model) but did not run ahead: about fps chunks per second.
    assert received <= elapsed * fps + 3
    assert meta["real_fps"] is not None and meta["real_fps"] < fps * 1.3


def test_unpaced_sessions_run_as_fast_as_the_engine(engine, slowed):
    spy = slowed(0.0)
    with serve(engine, paced=False) as client, client.websocket_connect(PATH) as ws:
        assert start(ws, fps=2, seed=3)["config"]["paced"] is False
        began = time.monotonic()
        for _ in range(12):
            meta = next_chunk(ws)
        elapsed = time.monotonic() - began
        ws.send_json({"type": "session.stop"})
    assert elapsed < 12 / 2  # paced at 2 frames/s these twelve chunks would take about six seconds
    assert meta["real_time_factor"] > 1.0 and spy.count() >= 12


def test_an_action_applies_to_a_chunk_at_most_two_after_the_last_one_received(engine, slowed):
    slowed(0.0)
    with serve(engine) as client, client.websocket_connect(PATH) as ws:
        start(ws, fps=20, seed=4)
        for attempt in range(4):
            last = next_chunk(ws)["generation_chunk_index"]
            event_id = f"key-{attempt}"
            ws.send_json({"type": "session.interaction", "interaction": {
                "event_id": event_id, "event": {"multi_modal_data": {"action": {
                    "value": ("left", "right")[attempt % 2]}}}}})
            while True:
                meta = next_chunk(ws)
                if event_id in meta["started_event_ids"]:
                    break
            # Generated before the event arrived: at most the chunk after the last received (lookahead 1).
            assert meta["generation_chunk_index"] <= last + 2, (last, meta["generation_chunk_index"])
        ws.send_json({"type": "session.stop"})


def test_a_rate_above_what_the_engine_sustains_is_clamped_and_reported(engine, slowed):
    slowed(0.05)  # one-frame chunks: about 20 frames/s at most
    with serve(engine, fps_samples=4) as client:
        with client.websocket_connect(PATH) as ws:
            config = start(ws, fps=240, seed=1)["config"]
            assert config["fps"] == 240 and config["fps_limit"] is None  # nothing measured yet: as asked
            for _ in range(5):
                next_chunk(ws)
            ws.send_json({"type": "session.stop"})
        with client.websocket_connect(PATH) as ws:
            config = start(ws, fps=240, seed=1)["config"]
            assert config["requested_fps"] == 240
            assert config["fps_limit"] is not None and config["fps_limit"] <= 20.5
            assert config["fps"] == max(1, math.floor(config["fps_limit"]))
            meta = next_chunk(ws)
            assert meta["fps"] == config["fps"]
            ws.send_json({"type": "session.stop"})


def test_when_the_engine_cannot_keep_up_every_session_slows_evenly_and_says_so(engine, slowed):
    spy = slowed(0.04)  # 25 chunks/s for three sessions asking 20 each (60 chunks/s)
    with serve(engine, batch_ticks=False) as client:  # one by one, each call slowed (batching: test_serve_batch)
        sockets = [client.websocket_connect(PATH).__enter__() for _ in range(3)]
        try:
            ids = [start(ws, fps=20, seed=i)["request_id"] for i, ws in enumerate(sockets)]
            metas: dict[str, dict] = {}
            began = time.monotonic()
            while time.monotonic() - began < 2.0:
                for ws, request_id in zip(sockets, ids):
                    metas[request_id] = next_chunk(ws)
            counts = [spy.count(request_id) for request_id in ids]
            assert max(counts) - min(counts) <= 2, counts
            for meta in metas.values():
                assert meta["underruns"] > 0
                assert meta["real_time_factor"] is not None and meta["real_time_factor"] < 0.8
            body = client.get("/metrics").text
            underruns = next(float(line.split()[-1]) for line in body.splitlines()
                             if line.startswith("ardiff_underruns_total "))
            assert underruns > 0
            rated = [line for line in body.splitlines() if line.startswith("ardiff_session_real_time_factor{")]
            assert len(rated) == 3 and all(float(line.split()[-1]) < 0.8 for line in rated)
        finally:
            for ws in sockets:
                ws.send_json({"type": "session.stop"})
                ws.__exit__(None, None, None)
        # Ended sessions are no longer reported.
        deadline = time.monotonic() + 10
        while "ardiff_session_real_time_factor{" in client.get("/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# -- camera target mode and transition_chunks ----------------------------------------------------------------


def _room(agent: tuple[int, int], walls: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
    """An 8x8-cell frame: the border ring and ``walls`` as walls, the agent at ``agent``, nothing else."""
    codes = np.zeros((8, 8), np.int64)
    codes[0, :] = codes[-1, :] = codes[:, 0] = codes[:, -1] = 1
    for wall in walls:
        codes[wall] = 1
    codes[agent] = 2
    templates = cell_templates()
    return templates[codes].transpose(0, 2, 1, 3, 4).reshape(32, 32, 3)


RIGHT, DOWN, NO_OP = ACTION_NAMES.index("right"), ACTION_NAMES.index("down"), ACTION_NAMES.index("no-op")


def test_target_actions_walk_a_shortest_path_on_schedule():
    frame = _room((3, 2))
    # Three cells to go in one chunk of four frames: three steps, then a no-op.
    assert target_actions(frame, (3, 5), 4, 1).tolist() == [RIGHT, RIGHT, RIGHT, NO_OP]
    # Over three chunks: one step per chunk, spread (the first frame of the chunk takes it).
    assert target_actions(frame, (3, 5), 4, 3).tolist() == [RIGHT, NO_OP, NO_OP, NO_OP]
    # Two steps in a four-frame chunk land on frames 0 and 2.
    assert target_actions(frame, (3, 4), 4, 1).tolist() == [RIGHT, NO_OP, RIGHT, NO_OP]
    # A chunk shorter than the path: one cell per frame at most, the rest in later chunks.
    assert target_actions(frame, (3, 6), 2, 1).tolist() == [RIGHT, RIGHT]
    assert target_actions(frame, (3, 2), 4, 1).tolist() == [NO_OP] * 4  # already there


def test_target_actions_go_around_walls_and_to_the_nearest_reachable_cell():
    frame = _room((3, 2), walls=((3, 3), (2, 3)))
    path = target_actions(frame, (3, 4), 4, 1).tolist()
    assert path == [DOWN, RIGHT, RIGHT, ACTION_NAMES.index("up")]  # around the wall below it
    # A wall as the target: the agent heads for the free cell nearest it.
    assert target_actions(_room((3, 2), walls=((3, 5),)), (3, 5), 4, 1).tolist() == [RIGHT, NO_OP, RIGHT, NO_OP]
    assert target_actions(np.zeros((32, 32, 3), np.uint8), (3, 5), 4, 1).tolist() == [NO_OP] * 4  # no agent


def test_a_target_camera_is_accepted_and_maps_x_z_to_a_clipped_cell():
    world = ServedWorld(name="sprite", kind="sprite", frame_height=32, frame_width=32, frames_per_chunk=1)
    update = world.event_update(SessionInteraction(
        event_id="t", camera=CameraUpdate("target", (5.2, 0.0, 2.0)), transition_chunks=3))
    (control,) = update.controls
    assert control.schema == "target" and dict(control.data) == {"row": 5, "col": 5, "transition_chunks": 3,
                                                                "event": "t"}
    clipped = world.event_update(SessionInteraction(event_id="u", camera=CameraUpdate("target", (-4, 0, 99))))
    assert dict(clipped.controls[0].data)["row"] == 0 and dict(clipped.controls[0].data)["col"] == 0
    assert dict(clipped.controls[0].data)["transition_chunks"] == DEFAULT_TRANSITION_CHUNKS


@pytest.fixture(scope="module")
def trained_engine():
    with ARDiffusionEngine(pretrained("sprite_world"), CONFIG) as engine:
        yield engine


def test_a_target_move_brings_the_agent_to_the_cell_in_the_frames_within_its_transition(trained_engine):
    from ardiff_jax.envs import SpriteWorld

    seed = 7
    observation = SpriteWorld(seed, size=32).reset()
    codes = cell_codes(observation)
    agent = tuple(int(i) for i in np.argwhere(codes == 2)[0])
    free = {tuple(int(i) for i in c) for c in np.argwhere(codes == 0)}
    target = max(free, key=lambda c: (len(target_actions(observation, c, 64, 1).nonzero()[0]) <= 4,
                                      abs(c[0] - agent[0]) + abs(c[1] - agent[1]), c))
    outputs: list[np.ndarray] = []
    original = trained_engine.generate

    def recording(request):
        output = original(request)
        outputs.append(np.asarray(output.frames))
        return output

    trained_engine.generate = recording
    try:
        with serve(trained_engine, paced=False) as client, client.websocket_connect(PATH) as ws:
            start(ws, seed=seed)
            next_chunk(ws)
            ws.send_json({"type": "session.interaction", "interaction": {
                "event_id": "go", "transition_chunks": 4, "event": {"multi_modal_data": {"camera": {
                    "mode": "target", "data": {"translation": [target[1], 0, 7 - target[0]]}}}}}})
            meta = next_chunk(ws)
            while "go" not in meta["started_event_ids"]:
                meta = next_chunk(ws)
            began = len(outputs)
            for _ in range(5):
                next_chunk(ws)
            ws.send_json({"type": "session.stop"})
    finally:
        del trained_engine.generate
    # By the transition's last chunk (4 one-frame chunks from the first that applied it) the agent is there.
    arrived = [tuple(int(i) for i in np.argwhere(cell_codes(frames[-1]) == 2)[0]) for frames in outputs[began - 1:]]
    assert agent != target and arrived[3] == target and arrived[-1] == target, (agent, target, arrived)
