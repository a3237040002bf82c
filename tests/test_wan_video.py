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

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.runtime import ARDiffusionBatchError
from ardiff_jax.models import CausalDiTConfig
from ardiff_jax.models.wan import random_vae
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
    """The tiny transformer and a random tiny VAE filled on the host (``WanVAE(...)``'s eager initialisation
    compiles every initializer op by op, a minute on a 2-core CPU): the one ``build_matrix_game`` uses for
    random weights. The tests compare the engine's decodes with ``vae.decode`` of the same VAE."""
    base = CausalWanPipeline(TINY_WAN)
    return base.modules, random_vae(TINY_VAE, 3)


def _engine(parts, capacity: int = 2, host_offload_bytes: int = 0) -> ARDiffusionEngine:
    modules, vae = parts
    pipeline = CausalWanPipeline(TINY_WAN, CausalWanPipelineConfig(session_capacity=capacity), modules=modules,
                                 vae=vae)
    # No warmup: these tests run sessions one request at a time (each program compiles on first use and is cached
    # for the process); warmup would run a block and compile the batch bucket no test here uses, per engine.
    # The batched tests build their own engines (``_batch_engine``), one of them warmed up on purpose.
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                    gpu_memory_fraction=1.0, host_offload_bytes=host_offload_bytes,
                                                    warmup=False))


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


# -- batched ticks ---------------------------------------------------------------------------------------


class _FaultyDecode(CausalWanPipeline):
    """Fails the VAE decode of the chosen sessions, batched or not (after the others in its batch decoded)."""

    bad: frozenset[str] = frozenset()
    _order: list[str] = []

    def _advance_batch(self, batch, sessions):
        self._order = list(batch.session_ids)
        return super()._advance_batch(batch, sessions)

    def _advance(self, state, session):
        self._order = [state.session_id]
        return super()._advance(state, session)

    def _finish_wan_block(self, session, block, *, donate):
        session_id = self._order.pop(0)
        if session_id in self.bad:
            raise RuntimeError(f"injected decode fault in session {session_id}")
        return super()._finish_wan_block(session, block, donate=donate)


def _batch_engine(parts, *, warmup: bool = False, cls=CausalWanPipeline):
    modules, vae = parts
    pipeline = cls(TINY_WAN, CausalWanPipelineConfig(session_capacity=3, recache_on_prompt_switch=True),
                   modules=modules, vae=vae)
    return pipeline, ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                              gpu_memory_fraction=1.0, warmup=warmup))


def _assert_same_blocks(batched, sequential):
    for got, want in zip(batched, sequential, strict=True):
        np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), rtol=0, atol=1e-5)
        assert got.video.shape == want.video.shape
        assert int(np.max(np.abs(np.asarray(got.video, int) - np.asarray(want.video, int)))) <= ONE_LEVEL
        assert (got.first_frame, got.block_index) == (want.first_frame, want.block_index)


def test_batched_ticks_decode_and_recache_as_one_by_one_without_compiling_after_warmup(parts):
    """Fresh and continuing sessions (first and later VAE decodes) in one batch, a prompt switch with
    LongLive's recache inside a batch: every block and frame equals the same requests one by one."""
    from helpers import count_compiles

    _, batched = _batch_engine(parts, warmup=True)
    _, sequential = _batch_engine(parts)
    assert batched.runner.supports_batched_forward and batched.batch_buckets == (2, 3)
    ticks = [[("a", 0), ("b", 1)], [("a", None), ("b", None), ("c", 2)], [("c", None), ("a", None)]]
    with count_compiles() as compiles:
        for rows in ticks:
            requests = [_request(sid, None if seed is None else _embeds(seed)) for sid, seed in rows]
            _assert_same_blocks(batched.generate_batch(requests), [sequential.generate(r) for r in requests])
    assert compiles == []  # warmup ran every bucket with a first and a later block
    switch = [_request("b", _embeds(7)), _request("a", None), _request("c", _embeds(8))]  # b and c recache
    _assert_same_blocks(batched.generate_batch(switch), [sequential.generate(r) for r in switch])
    batched.close()
    sequential.close()


def test_a_decode_fault_in_a_batch_releases_only_its_session(parts):
    """The last session's decode fails after the others decoded: their installed decoder caches were kept
    (not donated), so the one-by-one rerun gives them exactly the unbatched blocks."""
    pipeline, batched = _batch_engine(parts, cls=_FaultyDecode)
    _, sequential = _batch_engine(parts)
    ids = ("s1", "s2", "s3")
    first = [_request(sid, _embeds(index)) for index, sid in enumerate(ids)]
    _assert_same_blocks(batched.generate_batch(first), [sequential.generate(r) for r in first])
    pipeline.bad = frozenset({"s3"})
    requests = [_request(sid) for sid in ids]
    with pytest.raises(ARDiffusionBatchError) as raised:
        batched.generate_batch(requests)
    assert set(raised.value.errors) == {"s3"} and "decode fault in session s3" in str(raised.value.errors["s3"])
    _assert_same_blocks(raised.value.outputs[:2], [sequential.generate(r) for r in requests[:2]])
    assert set(batched.sessions) == {"s1", "s2"}
    pipeline.bad = frozenset()
    again = [_request("s1"), _request("s2")]
    _assert_same_blocks(batched.generate_batch(again), [sequential.generate(r) for r in again])
    batched.close()
    sequential.close()


# -- prompt to pixels ----------------------------------------------------------------------------------


def test_prompt_schedules_parse_and_refuse():
    from ardiff_jax.models.wan import PromptSchedule

    assert PromptSchedule.parse("a cat: walking").entries == ((0.0, "a cat: walking"),)
    schedule = PromptSchedule.parse(["0:a cat walking", "1.5: the cat jumps"])
    assert schedule.at(0.0) == "a cat walking" and schedule.at(1.49) == "a cat walking"
    assert schedule.at(1.5) == "the cat jumps"
    for bad, message in [(["1:late start"], "start at 0"), (["0:a", "0:b"], "increase"),
                         (["0:a", "no time"], "needs its start"), (["0: "], "non-empty")]:
        with pytest.raises(ValueError, match=message):
            PromptSchedule.parse(bad)


def test_generate_video_follows_the_schedule_and_streams_an_mp4(parts, tmp_path):
    av = pytest.importorskip("av")
    from ardiff_jax.models.wan import generate_video

    engine = _engine(parts)  # the file's capacity: its programs are already compiled, one session at a time
    embeds = {"a cat walking": _embeds(7), "the cat jumps": _embeds(8)}
    # 2 s at 16 fps = 32 frames: blocks start at frames 0, 9, 21 (times 0, 0.56, 1.31 s).
    video = generate_video(engine, ["0:a cat walking", "1:the cat jumps"], 2.0, encode=embeds, progress=False)
    assert video.frames.shape == (32, 32, 48, 3) and video.num_frames == 32 and video.blocks == 3
    assert video.prompts == ("a cat walking", "a cat walking", "the cat jumps")
    assert engine.sessions == ()  # the session is closed when the video is done
    path = tmp_path / "clip.mp4"
    written = generate_video(engine, "a cat walking", 1.0, encode=embeds, out=path, progress=False)
    assert written.frames is None and written.num_frames == 16
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 16 and frames[0].shape == (32, 48, 3)
    # Same seed, same prompt: the file holds the frames the in-memory run returns. The codec is lossy
    # and random weights make noise-like frames, its hardest case.
    again = generate_video(engine, "a cat walking", 1.0, encode=embeds, progress=False)
    assert np.corrcoef(np.stack(frames).ravel().astype(float), again.frames.ravel().astype(float))[0, 1] > 0.8
    with pytest.raises(ValueError, match=r"prompt_embeds"):
        generate_video(engine, "a cat walking", 1.0, encode={"a cat walking": np.zeros((3, 5))}, progress=False)


def test_the_generate_command_writes_a_video_from_checkpoint_files(tmp_path, capsys):
    """`ardiff-jax generate` on tiny checkpoints in the real formats: a .pt, a diffusers VAE, .npy features."""
    av = pytest.importorskip("av")
    torch = pytest.importorskip("torch")
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from ardiff_jax.cli import main
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.wan import wan_names

    config = dit_preset("wan-tiny")
    torch.manual_seed(0)
    dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2,
                                cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    sd = dit.state_dict()
    from test_wan_checkpoints import wan_to_diffusers

    torch.save({"generator_ema": {f"model.{n}": sd[wan_to_diffusers(n)] for n in wan_names(config)}},
               tmp_path / "self_forcing.pt")
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    vae.save_pretrained(tmp_path / "vae")
    np.save(tmp_path / "cat.npy", _embeds(1))
    np.save(tmp_path / "jump.npy", _embeds(2))
    out = tmp_path / "video.mp4"
    argv = ["generate", "--weights", str(tmp_path / "self_forcing.pt"), "--preset", "wan-tiny", "--vae",
            str(tmp_path / "vae"), "--prompt", "0:a cat", "--prompt", "0.5:it jumps", "--prompt-embeds",
            str(tmp_path / "cat.npy"), "--prompt-embeds", str(tmp_path / "jump.npy"), "--seconds", "1.5",
            "--out", str(out), "--dtype", "float32", "--available-gib", "1", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "24 frames" in capsys.readouterr().out
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 24
    # Refusals name the argument, before anything is built.
    for bad, message in [(["--prompt-embeds", str(tmp_path / "cat.npy")], "2 prompts"),
                         (["--vae", str(tmp_path / "missing")], "--vae"),
                         (["--out", str(tmp_path / "video.avi")], ".mp4")]:
        changed = list(argv)
        if bad[0] == "--prompt-embeds":
            cut = changed.index("--prompt-embeds")
            del changed[cut:cut + 4]
        else:
            del changed[changed.index(bad[0]):changed.index(bad[0]) + 2]
        try:
            code = main([*changed, *bad])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        assert message in capsys.readouterr().err


def test_generate_on_random_weights_needs_no_files(tmp_path, capsys):
    av = pytest.importorskip("av")
    from ardiff_jax.cli import main

    out = tmp_path / "random.mp4"
    assert main(["generate", "--random-weights", "--preset", "wan-tiny", "--prompt", "a test pattern", "--seconds",
                 "1", "--out", str(out), "--dtype", "float32", "--available-gib", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "16 frames" in captured.out and "measures speed" in captured.err
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 16
    assert main(["generate", "--random-weights", "--preset", "wan2.2-ti2v-5b", "--prompt", "x", "--seconds", "1",
                 "--out", str(out), "--no-progress"]) == 2
    assert "Wan 2.2 VAE" in capsys.readouterr().err
