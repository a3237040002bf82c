"""Host offload through the server: more players than the device holds, each resuming exactly.

The engine holds one session on the device and more in its host tier; the server's capacity
counts both. Three players stream at once, so the generation loop swaps sessions between the
device and host memory on every chunk. Every tick the server ran is recorded and replayed, per
session and in order, on a second engine that holds all three sessions on the device: the
frames must be identical, so an offload and restore through the server changes nothing a
player sees.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("starlette")

from helpers import next_chunk_metadata
from starlette.testclient import TestClient

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, SpriteWorldPipelineConfig, dit_preset
from ardiff_jax.serve import ServedWorld, ServerSettings, create_app
from ardiff_jax.types import ARDiffusionTickRequest

PATH = "/v1/realtime/video"


def _engine(modules, capacity: int, host_offload_bytes: int = 0) -> ARDiffusionEngine:
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity),
                                   modules=modules)
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                    gpu_memory_fraction=1.0, host_offload_bytes=host_offload_bytes))


def test_players_beyond_the_device_swap_through_host_memory_and_resume_exactly():
    modules = DiTModules.create(dit_preset("sprite_world"), 1)
    served = _engine(modules, capacity=1, host_offload_bytes=10**8)
    ticks: list[tuple[str, DiffusionRequest, np.ndarray]] = []
    original = served.generate

    def recording(request):
        output = original(request)
        session = ARDiffusionTickRequest.from_extra_args(request.extra_args).session_id
        ticks.append((session, request, np.asarray(output.frames).copy()))
        return output

    served.generate = recording
    try:
        world = ServedWorld.for_pipeline(served.runner.pipeline)
        app = create_app(served, world=world, settings=ServerSettings(paced=False))
        with TestClient(app) as client:
            assert client.get("/healthz").json()["capacity"] >= 3  # one resident + the host tier
            sockets = [client.websocket_connect(PATH).__enter__() for _ in range(3)]
            try:
                for seed, ws in enumerate(sockets):
                    ws.send_json({"type": "session.start", "format": "jpeg", "seed": seed})
                    assert ws.receive_json()["type"] == "video.start"
                for round_ in range(6):
                    for index, ws in enumerate(sockets):
                        if round_ == 2:
                            ws.send_json({"type": "session.interaction", "interaction": {"event": {
                                "multi_modal_data": {"action": {"value": ("left", "right", "up")[index]}}}}})
                        next_chunk_metadata(ws)
                metrics = client.get("/metrics").text
            finally:
                for ws in sockets:
                    ws.send_json({"type": "session.stop"})
                    ws.__exit__(None, None, None)
        offloaded = next(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("ardiff_sessions_offloaded_total "))
        restored = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("ardiff_sessions_restored_total "))
        assert offloaded >= 3 and restored >= 3, (offloaded, restored)
    finally:
        del served.generate
        served.close()

    # The same ticks, per session in order, on an engine that keeps all three on the device.
    with _engine(modules, capacity=3) as straight:
        sessions = {session for session, _, _ in ticks}
        assert len(sessions) == 3
        for session in sorted(sessions):
            for tick_session, request, frames in ticks:
                if tick_session != session:
                    continue
                replayed = np.asarray(straight.generate(DiffusionRequest(
                    request.request_id, prompt=request.prompt, extra_args={"session_id": session},
                    inputs=request.inputs)).frames)
                np.testing.assert_array_equal(replayed, frames)
