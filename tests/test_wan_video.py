"""CausalWanPipeline with the streaming VAE: each session's decoder cache is session state.

Blocks decoded one by one through the engine (interleaved sessions, LRU eviction to the
host tier and back, a session file) equal the whole clip decoded at once by
``WanVAE.decode``; the cache is declared, counted, exported and validated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import CausalDiTConfig
from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig, WanVAE, WanVAEConfig

TINY_WAN = CausalDiTConfig(
    name="tiny-wan", num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
    latent_width=6, text_len=8, text_dim=16, frames_per_block=3, window_frames=6, sink_frames=3, freq_dim=32,
)
#: Wan 2.1's VAE layout at base width 8 with 4 latent channels (the tiny transformer's).
TINY_VAE = WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.1, -0.2, 0.0, 0.3), latents_std=(1.5, 0.5, 1.0, 2.0))
#: uint8 frames from float32 decodes that differ by ~1e-6 can round differently at a .5 boundary.
ONE_LEVEL = 1


def _embeds(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((5, TINY_WAN.text_dim)).astype(np.float32)


def _request(session: str, embeds=None, **extra) -> DiffusionRequest:
    inputs = {} if embeds is None else {"prompt_embeds": embeds}
    return DiffusionRequest(f"r-{session}", extra_args={"session_id": session, **extra}, inputs=inputs)


@pytest.fixture(scope="module")
def parts():
    base = CausalWanPipeline(TINY_WAN)
    vae = WanVAE(TINY_VAE, rngs=nnx.Rngs(3))
    return base.modules, vae


def _engine(parts, capacity: int = 2, host_offload_bytes: int = 0) -> ARDiffusionEngine:
    modules, vae = parts
    pipeline = CausalWanPipeline(TINY_WAN, CausalWanPipelineConfig(session_capacity=capacity), modules=modules,
                                 vae=vae)
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                    gpu_memory_fraction=1.0, host_offload_bytes=host_offload_bytes))


def _whole_clip(vae: WanVAE, latents: list[np.ndarray]) -> np.ndarray:
    video = np.asarray(vae.decode(jnp.concatenate([jnp.asarray(x) for x in latents])))
    return np.round((np.clip(video, -1, 1) + 1) * 127.5).astype(np.uint8).transpose(0, 2, 3, 1)


def test_streamed_blocks_equal_the_whole_clip_across_interleaving_and_offload(parts):
    engine = _engine(parts, capacity=2, host_offload_bytes=10**9)
    latents, frames = {"A": [], "B": [], "C": []}, {"A": [], "B": [], "C": []}
    for sid in ["A", "B", "C", "A", "B", "C", "A"]:  # capacity 2: every session is offloaded and restored
        out = engine.generate(_request(sid, _embeds(ord(sid))))
        latents[sid].append(np.asarray(out.latents))
        frames[sid].append(np.asarray(out.video))
    assert [f.shape[0] for f in frames["A"]] == [9, 12, 12]  # 1 + 4*2 for the first block, then 4*3
    assert frames["A"][0].shape[1:] == (32, 48, 3) and frames["A"][0].dtype == np.uint8
    for sid in latents:
        streamed = np.concatenate(frames[sid])
        whole = _whole_clip(parts[1], latents[sid])
        assert streamed.shape == whole.shape
        assert int(np.max(np.abs(streamed.astype(int) - whole.astype(int)))) <= ONE_LEVEL, sid


def test_the_cache_is_declared_counted_and_dropped(parts):
    engine = _engine(parts)
    pipeline = engine.runner.pipeline
    engine.generate(_request("S", _embeds(1)))
    spec = pipeline.ar_diffusion_kv_cache_spec()
    assert pipeline.vae_cache_bytes > 0
    assert spec.model_owned_state_bytes_per_session >= pipeline.vae_cache_bytes
    assert pipeline.vae_cache_bytes < pipeline.model_owned_bytes("S") <= spec.model_owned_state_bytes_per_session
    engine.reset_session("S")
    assert pipeline.model_owned_bytes("S") == 0


def test_a_saved_session_continues_decoding_where_it_stopped(parts, tmp_path):
    straight = _engine(parts)
    expected = [np.asarray(straight.generate(_request("S", _embeds(2))).video) for _ in range(3)]
    engine = _engine(parts)
    engine.generate(_request("S", _embeds(2)))
    path = engine.save_session("S", tmp_path / "s")
    engine.close_session("S")
    other = _engine(parts)
    other.load_session(path)
    got = [np.asarray(other.generate(_request("S")).video) for _ in range(2)]
    for a, b in zip(expected[1:], got, strict=True):
        assert np.array_equal(a, b)


def test_a_malformed_vae_cache_is_refused_before_anything_changes(parts):
    engine = _engine(parts)
    pipeline = engine.runner.pipeline
    engine.generate(_request("S", _embeds(3)))
    state = pipeline.export_ar_diffusion_session("S")
    bad = dict(state, vae_cache={"convs": state["vae_cache"]["convs"][:-1], "started": True})
    with pytest.raises(ValueError, match="vae_cache must be"):
        pipeline.import_ar_diffusion_session("S", bad)
    convs = list(state["vae_cache"]["convs"])
    convs[0] = jnp.zeros((1, 1), convs[0].dtype)
    with pytest.raises(ValueError, match=r"vae_cache.convs\[0\] must be"):
        pipeline.import_ar_diffusion_session("S", dict(state, vae_cache={"convs": convs, "started": True}))
    assert "S" not in pipeline.session_ids
    pipeline.import_ar_diffusion_session("S", state)  # the good one still goes in
    assert "S" in pipeline.session_ids
