"""Text-to-video serving: a causal Wan with its streaming VAE over ``/v1/realtime/video``.

A tiny Wan-shaped transformer, a tiny Wan VAE and the stand-in text encoder: the first chunk
carries 9 frames and later ones 12 (the VAE's first-frame rule), a prompt event switches the
prompt at a block boundary (encoded inside the engine call), and the decoder's cache lives
and dies with the session.
"""

from __future__ import annotations

import io

import pytest

pytest.importorskip("starlette")
av = pytest.importorskip("av")

from starlette.testclient import TestClient  # noqa: E402

from ardiff_jax import ARDiffusionEngine, EngineConfig  # noqa: E402
from ardiff_jax.models import dit_preset  # noqa: E402
# A random tiny Wan VAE filled on the host: WanVAE(...)'s eager init compiles every initializer op by op
# (a minute on a 2-core CPU); the served frames' count, shape and chunking do not depend on the weights.
from ardiff_jax.models.wan import random_vae  # noqa: E402
from ardiff_jax.models.wan import (  # noqa: E402
    CausalWanPipeline,
    CausalWanPipelineConfig,
    PlaceholderTextEncoder,
    WanVAEConfig,
)
from ardiff_jax.serve import ServedWorld, ServerSettings, create_app  # noqa: E402
from test_serve import PATH, interaction, next_chunk, start, until, wait_for  # noqa: E402

CONFIG = dit_preset("wan-tiny")
VAE = WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)


@pytest.fixture(scope="module")
def wan_engine():
    encoder = PlaceholderTextEncoder(CONFIG.text_dim, length=5)
    pipeline = CausalWanPipeline(CONFIG, CausalWanPipelineConfig(session_capacity=2),
                                 vae=random_vae(VAE, 0), text_encoder=encoder)
    with ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                  gpu_memory_fraction=1.0)) as engine:
        yield engine, encoder


def test_the_wan_world_reports_video_frames_and_refuses_controls(wan_engine):
    engine, _ = wan_engine
    world = ServedWorld.for_pipeline(engine.runner.pipeline)
    assert (world.kind, world.fps, world.frame_height, world.frame_width) == ("wan", 16, 32, 48)
    assert (world.chunk_frames(0), world.chunk_frames(1), world.chunk_frames(7)) == (9, 12, 12)
    assert world.text_conditioned and world.controls == ("prompt",)
    with pytest.raises(TypeError, match="needs vae="):
        ServedWorld.for_pipeline(CausalWanPipeline(CONFIG, modules=engine.runner.pipeline.modules))


def test_a_wan_session_streams_video_and_switches_prompts(wan_engine):
    engine, encoder = wan_engine
    world = ServedWorld.for_pipeline(engine.runner.pipeline)
    app = create_app(engine, world=world, settings=ServerSettings())
    with TestClient(app) as client, client.websocket_connect(PATH) as ws:
        reply = start(ws, prompt="a red fox", num_frames=40)
        assert reply["config"]["fps"] == 16 and reply["config"]["controls"] == ["prompt"]
        first, first_media = next_chunk(ws)
        ws.send_json(interaction("p1", prompt="a blue bird"))
        controls: list = []
        chunks = [(first, first_media)]
        done = until(ws, "session.done", chunks)
        assert [m["num_frames"] for m, _ in chunks] == [9, 12, 12, 7]  # 40 frames, the last chunk trimmed
        assert any("p1" in m["started_event_ids"] for m, _ in chunks)
        assert done["chunks"] == 4
        with av.open(io.BytesIO(b"".join(payload for _, payload in chunks)), format="mp4") as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert len(frames) == 40 and frames[0].shape == (32, 48, 3)
        del controls
    wait_for(lambda: engine.sessions == ())
    assert "a red fox" in encoder.calls and "a blue bird" in encoder.calls
    assert engine.runner.pipeline.session_ids == ()  # the VAE cache went with the session
