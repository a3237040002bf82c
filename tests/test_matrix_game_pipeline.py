"""MatrixGamePipeline through the engine: paged, interleaved, evicted, offloaded and saved sessions equal a dense
recomputation.

The recomputation runs the transformer block by block with every visible frame's clean K/V
handed in densely (``DenseAttention``), the action ring rebuilt from its own commits, the
image condition from one whole-clip ``WanVAE.encode`` of ``[image, black frames...]`` and
the action windows from the session's complete row arrays: none of the pipeline's
per-session bookkeeping (paged window, streaming encoder cache, the last-12-rows buffer) is
shared. ``tests/test_matrix_game_model.py`` shows that this block-by-block forward equals
the independent torch reference.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import DenseAttention, dit_preset
from ardiff_jax.models._common import (
    NOISE_PRNG_IMPL,
    block_noise,
    renoise,
    step_noise_key,
)
from ardiff_jax.models._dit import ActionInputs, commit_action_cache, init_action_cache
from ardiff_jax.models.matrix_game import (
    MatrixGamePipeline,
    MatrixGamePipelineConfig,
    action_windows,
)
from ardiff_jax.models.wan import WanVAE, WanVAEConfig
from ardiff_jax.models.wan import random_vae as host_random_vae

CONFIG = dit_preset("matrix-game-tiny", dtype="float32", param_dtype="float32")
ACTION = CONFIG.action
VAE = WanVAEConfig.tiny(base_dim=8, z_dim=4, latents_mean=(0.1, -0.2, 0.0, 0.3), latents_std=(1.5, 0.5, 1.0, 2.0))
H, W = CONFIG.latent_height * 8, CONFIG.latent_width * 8
TOLERANCE = 1e-4  # float32, the paged vs the dense path (measured ~1e-6)


def random_vae(seed: int = 3) -> WanVAE:
    """A random tiny VAE filled on the host (``WanVAE(...)``'s eager initialisation takes minutes on a loaded
    2-core CPU): the one ``build_matrix_game`` uses for random weights."""
    return host_random_vae(VAE, seed)


@pytest.fixture(scope="module")
def parts():
    base = MatrixGamePipeline(CONFIG, vae=random_vae())
    return base.modules, base.vae


def _engine(parts, capacity: int = 2, host_offload_bytes: int = 0) -> ARDiffusionEngine:
    modules, vae = parts
    pipeline = MatrixGamePipeline(CONFIG, MatrixGamePipelineConfig(session_capacity=capacity), modules=modules,
                                  vae=vae)
    # No warmup: these tests run sessions one request at a time (each program compiles on first use and is
    # cached for the process); warmup would compile and run the batch bucket no test here uses.
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                    gpu_memory_fraction=1.0, host_offload_bytes=host_offload_bytes,
                                                    warmup=False))


class Player:
    """One session's inputs: a reference image, its CLIP tokens, and keyboard/mouse rows per block."""

    def __init__(self, seed: int, blocks: int = 3) -> None:
        rng = np.random.default_rng(seed)
        self.image = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        self.embeds = rng.standard_normal((CONFIG.text_len, CONFIG.text_dim)).astype(np.float32)
        rows = ACTION.num_rows(blocks * CONFIG.frames_per_block)
        self.keyboard = np.eye(ACTION.keyboard_dim, dtype=np.float32)[rng.integers(0, ACTION.keyboard_dim, rows)]
        self.mouse = (0.1 * rng.standard_normal((rows, ACTION.mouse_dim))).astype(np.float32)
        self.seed = seed
        self.sent = 0  # blocks requested

    def rows(self, block: int) -> slice:
        first = ACTION.num_rows(CONFIG.frames_per_block)
        per = ACTION.frames_per_latent * CONFIG.frames_per_block
        return slice(0, first) if block == 0 else slice(first + per * (block - 1), first + per * block)

    def inputs(self) -> dict:
        part = self.rows(self.sent)
        inputs = {"keyboard": self.keyboard[part], "mouse": self.mouse[part]}
        if self.sent == 0:
            inputs.update(image=self.image, image_embeds=self.embeds, seed=self.seed)
        self.sent += 1
        return inputs

    def request(self, session: str, inputs: dict | None = None, **extra) -> DiffusionRequest:
        inputs = self.inputs() if inputs is None else inputs
        return DiffusionRequest(f"r-{session}-{self.sent}", inputs=inputs, extra_args={"session_id": session, **extra})


@functools.partial(jax.jit, static_argnums=0)
def _dense_forward(graphdef, params, x, t, start, context, history_k, history_v, history_mask, condition, actions,
                   ring):
    model = nnx.merge(graphdef, params)
    out = model(x, t, start, context, attention=DenseAttention(history_k, history_v, history_mask),
                condition=condition, actions=actions, action_history=ring)
    return out.video, out.k, out.v, out.action_kv


def dense_recomputation(pipeline: MatrixGamePipeline, player: Player, num_blocks: int) -> list[np.ndarray]:
    cfg, schedule, vae = pipeline.config, pipeline.schedule, pipeline.vae
    graphdef, params = nnx.split(pipeline.transformer)
    context = pipeline.transformer.text_cross_kv(jnp.asarray(player.embeds))
    frames = num_blocks * cfg.frames_per_block
    pixels = np.zeros((ACTION.num_rows(frames), 3, H, W), np.float32)
    pixels[0] = player.image.astype(np.float32).transpose(2, 0, 1) / 127.5 - 1.0
    condition = np.asarray(vae.encode(jnp.asarray(pixels)))  # [frames, C, h, w]
    mask = np.zeros((frames, 4, cfg.latent_height, cfg.latent_width), np.float32)
    mask[0] = 1.0
    condition = np.concatenate([mask, condition], axis=1)
    key = jax.random.key(player.seed, impl=NOISE_PRNG_IMPL)
    f, tokens, hist = cfg.frames_per_block, cfg.tokens_per_frame, cfg.window_frames - cfg.frames_per_block
    ring = init_action_cache(cfg)
    ks, vs, blocks = [], [], []
    for block in range(num_blocks):
        start = block * f
        seen = list(range(max(0, start - hist), start))
        zeros = jnp.zeros((cfg.num_layers, tokens, cfg.num_heads, cfg.head_dim))
        pad = hist - len(seen)
        hk = jnp.concatenate([zeros] * pad + [ks[i] for i in seen], axis=1)
        hv = jnp.concatenate([zeros] * pad + [vs[i] for i in seen], axis=1)
        hmask = jnp.asarray(np.repeat(np.arange(hist) >= pad, tokens))
        windows = action_windows(cfg, player.keyboard, player.mouse, start)
        actions = ActionInputs(jnp.asarray(windows.keyboard), jnp.asarray(windows.mouse))
        cond = jnp.asarray(condition[start:start + f])
        x = block_noise(key, np.int32(block), cfg.block_shape)
        for step in range(schedule.num_steps + 1):
            t, sigma, sigma_next = schedule.step_args(step)
            flow, k, v, action_kv = _dense_forward(graphdef, params, x, jnp.float32(t), jnp.int32(start), context,
                                                   hk, hv, hmask, cond, actions, ring)
            if step == schedule.num_steps:  # the commit pass on the clean block
                break
            x0 = x - sigma * flow
            x = renoise(x0, sigma_next, jax.random.normal(step_noise_key(key, np.int32(block), np.int32(step)),
                                                          x.shape))
            if step == schedule.num_steps - 1:
                x = x0
        blocks.append(np.asarray(x))
        ring = commit_action_cache(cfg, ring, action_kv, jnp.int32(start))
        ks += [k[:, i * tokens:(i + 1) * tokens] for i in range(f)]
        vs += [v[:, i * tokens:(i + 1) * tokens] for i in range(f)]
    return blocks


def test_interleaved_evicted_offloaded_sessions_equal_a_dense_recomputation(parts):
    engine = _engine(parts, capacity=2, host_offload_bytes=10**9)
    pipeline = engine.runner.pipeline
    players = {sid: Player(seed) for sid, seed in (("A", 11), ("B", 12), ("C", 13))}
    latents, videos = {sid: [] for sid in players}, {sid: [] for sid in players}
    for sid in ["A", "B", "C", "A", "B", "C", "A"]:  # capacity 2: every session is offloaded and restored
        out = engine.generate(players[sid].request(sid))
        assert out.first_frame == 3 * len(latents[sid])
        latents[sid].append(np.asarray(out.latents))
        videos[sid].append(np.asarray(out.video))
    assert [v.shape[0] for v in videos["A"]] == [9, 12, 12] and videos["A"][0].shape[1:] == (H, W, 3)
    worst = 0.0
    for sid, player in players.items():
        expected = dense_recomputation(pipeline, player, len(latents[sid]))
        for block, (got, want) in enumerate(zip(latents[sid], expected, strict=True)):
            diff = float(np.max(np.abs(got - want)))
            assert diff <= TOLERANCE, f"session {sid} block {block}: max |paged - dense| = {diff:.3g}"
            worst = max(worst, diff)
    print(f"MatrixGamePipeline through the engine vs dense recomputation: max |diff| = {worst:.3g}")


class _FaultyMatrixGame(MatrixGamePipeline):
    """Fails the chosen sessions' blocks after their commit: a batch as a whole, one by one per session."""

    bad: frozenset[str] = frozenset()

    def _advance_batch(self, batch, sessions):
        blocks = super()._advance_batch(batch, sessions)  # every row encoded, denoised, committed and decoded already
        if self.bad & set(batch.session_ids):
            raise RuntimeError("injected fault in the batch")
        return blocks

    def _advance(self, state, session):
        session, block = super()._advance(state, session)
        if block is not None and state.session_id in self.bad:
            raise RuntimeError(f"injected fault in session {state.session_id}")
        return session, block


def _assert_same_blocks(batched, sequential):
    for got, want in zip(batched, sequential, strict=True):
        np.testing.assert_allclose(np.asarray(got.latents), np.asarray(want.latents), rtol=0, atol=TOLERANCE)
        assert int(np.max(np.abs(np.asarray(got.video, int) - np.asarray(want.video, int)))) <= 1
        assert (got.first_frame, got.block_index) == (want.first_frame, want.block_index)


def test_batched_ticks_equal_one_by_one_and_a_fault_releases_only_its_session(parts):
    """Fresh and continuing sessions in one batch (condition encode, action windows and ring, decode);
    then a fault after the batch's commit: the others were encoded without donating their installed
    encoder caches, so the one-by-one rerun gives them exactly the unbatched blocks."""
    from ardiff_jax.runtime import ARDiffusionBatchError

    modules, vae = parts

    def engine(cls):
        pipeline = cls(CONFIG, MatrixGamePipelineConfig(session_capacity=3), modules=modules, vae=vae)
        return pipeline, ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                                  gpu_memory_fraction=1.0, warmup=False))

    pipeline, batched = engine(_FaultyMatrixGame)
    _, sequential = engine(MatrixGamePipeline)
    assert batched.runner.supports_batched_forward
    players = {sid: Player(seed, blocks=4) for sid, seed in (("a", 31), ("b", 32), ("c", 33))}
    for rows in (["a", "b"], ["b", "a", "c"]):
        requests = [players[sid].request(sid) for sid in rows]
        _assert_same_blocks(batched.generate_batch(requests), [sequential.generate(r) for r in requests])
    pipeline.bad = frozenset({"c"})
    requests = [players[sid].request(sid) for sid in ("a", "b", "c")]
    with pytest.raises(ARDiffusionBatchError) as raised:
        batched.generate_batch(requests)
    assert set(raised.value.errors) == {"c"} and "injected fault in session c" in str(raised.value.errors["c"])
    _assert_same_blocks(raised.value.outputs[:2], [sequential.generate(r) for r in requests[:2]])
    assert set(batched.sessions) == {"a", "b"}
    pipeline.bad = frozenset()
    requests = [players[sid].request(sid) for sid in ("b", "a")]
    _assert_same_blocks(batched.generate_batch(requests), [sequential.generate(r) for r in requests])
    batched.close()
    sequential.close()


def test_actions_steer_only_the_blocks_that_read_them(parts):
    engine = _engine(parts, capacity=2)
    one, two = Player(5), Player(5)
    two.keyboard[9:] = np.roll(two.keyboard[9:], 1, axis=1)  # rows of the second block on differ
    two.mouse[9:] = -two.mouse[9:]
    a = [np.asarray(engine.generate(one.request("one")).latents) for _ in range(2)]
    b = [np.asarray(engine.generate(two.request("two")).latents) for _ in range(2)]
    assert np.array_equal(a[0], b[0])  # block 0 reads rows 0-7 only
    assert float(np.max(np.abs(a[1] - b[1]))) > 1e-3


def test_a_saved_session_continues_exactly(parts, tmp_path):
    straight = _engine(parts)
    player = Player(21)
    expected = [np.asarray(straight.generate(player.request("S")).latents) for _ in range(3)]
    engine = _engine(parts)
    player = Player(21)
    engine.generate(player.request("S"))
    pipeline = engine.runner.pipeline
    assert 0 < pipeline.model_owned_bytes("S") <= pipeline.ar_diffusion_kv_cache_spec().model_owned_state_bytes_per_session
    path = engine.save_session("S", tmp_path / "s")
    engine.close_session("S")
    other = _engine(parts)
    other.load_session(path)
    got = [np.asarray(other.generate(player.request("S")).latents) for _ in range(2)]
    for a, b in zip(expected[1:], got, strict=True):
        assert np.array_equal(a, b)


def test_a_fork_continues_exactly_with_its_decoder_and_action_caches(parts):
    """A fork after one block plays the next two exactly as the unforked session does (latents and decoded video:
    the VAE's streaming decoder cache and the action module's caches are forked with the KV)."""
    straight = _engine(parts)
    player = Player(21)
    expected = [straight.generate(player.request("S")) for _ in range(3)]
    engine = _engine(parts, capacity=3)
    source, fork = Player(21), Player(21)
    engine.generate(source.request("S"))
    fork.inputs()  # the fork's player is one block in, as the source
    kv = engine.runner.kv_cache
    pages = kv.pages_in_use
    engine.fork_session("S", "F")
    assert kv.pages_in_use == pages
    for want in expected[1:]:
        for sid, player in (("F", fork), ("S", source)):
            got = engine.generate(player.request(sid))
            assert np.array_equal(np.asarray(got.latents), np.asarray(want.latents))
            assert np.array_equal(np.asarray(got.video), np.asarray(want.video))


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("keyboard"), r"needs inputs\['keyboard'\]"),
    (lambda r: r.update(keyboard=np.zeros((12, ACTION.keyboard_dim))), "must have 9 rows"),
    (lambda r: r.update(mouse=np.zeros((9, 3))), r"inputs\['mouse'\] must be \[N, 2\]"),
    (lambda r: r.pop("image"), "first request needs"),
    (lambda r: r.update(image=np.zeros((H, W, 3), np.float32)), r"must be uint8\[32, 48, 3\]"),
    (lambda r: r.update(image_embeds=np.zeros((4, CONFIG.text_dim))), r"image_embeds'\] must be f32\[5, 16\]"),
    (lambda r: r.update(prompt_embeds=np.zeros((4, 16))), "takes no inputs"),
])
def test_bad_requests_are_refused_before_anything_runs(parts, change, message):
    engine = _engine(parts)
    player = Player(1)
    inputs = player.inputs()
    change(inputs)
    with pytest.raises(ValueError, match=message):
        engine.generate(player.request("S", inputs))
    assert "S" not in engine.runner.pipeline.session_ids


def test_the_pipeline_refuses_other_networks(parts):
    with pytest.raises(ValueError, match="runs Matrix-Game networks"):
        MatrixGamePipeline(dit_preset("wan-tiny"), vae=parts[1])
    with pytest.raises(ValueError, match="needs vae="):
        MatrixGamePipeline(CONFIG)


def test_an_action_script_plays_into_an_mp4(parts, tmp_path):
    av = pytest.importorskip("av")
    from PIL import Image

    from ardiff_jax.models.matrix_game import (
        ActionScript,
        generate_matrix_game,
        prepare_image,
    )

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 100, 3), dtype=np.uint8)).save(
        tmp_path / "start.png")
    image = prepare_image(tmp_path / "start.png", H, W)
    assert image.shape == (H, W, 3) and image.dtype == np.uint8
    player = Player(7, blocks=3)
    rows = ACTION.num_rows(6) + 3  # two whole blocks and 3 rows more (dropped)
    (tmp_path / "actions.json").write_text(json.dumps({"keyboard": player.keyboard[:rows].tolist(),
                                                       "mouse": player.mouse[:rows].tolist()}))
    actions = ActionScript.load(tmp_path / "actions.json")
    assert actions.num_blocks(CONFIG.frames_per_block, ACTION.frames_per_latent) == 2
    _, frames, _ = generate_matrix_game(_engine(parts), image, player.embeds, actions, out=tmp_path / "play.mp4")
    assert frames == 9 + 12
    with av.open(str(tmp_path / "play.mp4")) as container:
        assert sum(1 for _ in container.decode(video=0)) == 21


def test_an_action_script_is_read_bounded(tmp_path):
    """A FIFO, a deeply nested file, NaN and a missing file are each a quick ValueError naming the file (a FIFO
    is never opened for a blocking read; the nesting never reaches the parser's recursion)."""
    import os
    import time

    from ardiff_jax.models.matrix_game import ActionScript

    good = tmp_path / "actions.json"
    good.write_text(json.dumps({"keyboard": [[1, 0], [0, 1]], "mouse": [[0.5, -0.5], [0, 0]]}))
    script = ActionScript.load(good)
    assert script.keyboard.shape == (2, 2) and script.mouse.shape == (2, 2)

    nested = tmp_path / "nested.json"
    nested.write_text('{"keyboard": ' + "[" * 100_000 + "]" * 100_000 + "}")
    fifo = tmp_path / "actions.fifo"
    os.mkfifo(fifo)  # no writer: a blocking open or read would hang
    big = tmp_path / "big.json"
    big.write_text('{"keyboard": [[' + "0," * (2 * 2**20) + "0]]}")
    nan = tmp_path / "nan.json"
    nan.write_text('{"keyboard": [[NaN]]}')
    for path, message in ((nested, "nested"), (fifo, "FIFO"), (big, "bytes"), (nan, "not valid JSON"),
                          (tmp_path / "absent.json", "does not exist")):
        start = time.monotonic()
        with pytest.raises(ValueError, match=message) as refused:
            ActionScript.load(path)
        assert str(path) in str(refused.value) and time.monotonic() - start < 5


def test_the_cli_refuses_bad_matrix_game_arguments_before_building(tmp_path, capsys):
    from ardiff_jax.cli import main

    (tmp_path / "start.png").write_bytes(b"")
    (tmp_path / "bad.json").write_text("[1, 2]")
    base = ["generate", "--model", "matrix-game", "--random-weights", "--out", str(tmp_path / "play.mp4"),
            "--preset", "matrix-game-tiny"]
    for extra, message in [([], "needs --image and --actions"),
                           (["--image", str(tmp_path / "start.png"), "--actions", str(tmp_path / "bad.json")],
                            "argument --actions"),
                           (["--prompt", "a cat", "--image", str(tmp_path / "start.png")], "not for --model matrix-game"),
                           (["--preset", "wan-tiny", "--image", str(tmp_path / "start.png"), "--actions",
                             str(tmp_path / "bad.json")], "not a Matrix-Game preset")]:
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["generate", "--random-weights", "--out", str(tmp_path / "x.mp4")]) == 2
    assert "needs --prompt and --seconds" in capsys.readouterr().err


def test_stepwise_equals_tick(parts):
    from ardiff_jax.types import StepSchedulerOutput

    player = Player(31)
    tick = _engine(parts)
    expected = [np.asarray(tick.generate(player.request("S")).latents) for _ in range(2)]
    modules, vae = parts
    pipeline = MatrixGamePipeline(CONFIG, modules=modules, vae=vae)
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, step_execution=True, warmup=False))
    player, outputs, calls = Player(31), [], 0
    rows = ACTION.num_rows(2 * CONFIG.frames_per_block)  # both blocks' rows in one streaming request
    request = DiffusionRequest("S", inputs={"image": player.image, "image_embeds": player.embeds, "seed": player.seed,
                                            "keyboard": player.keyboard[:rows], "mouse": player.mouse[:rows],
                                            "num_blocks": 2})
    while True:
        result = engine.step(StepSchedulerOutput(scheduled=(request,)))
        calls += 1
        if result.output is not None:
            outputs.append(np.asarray(result.output.latents))
        if result.finished:
            break
        assert calls < 20
    assert calls == 2 * pipeline.schedule.num_steps  # one denoise step per call
    for a, b in zip(expected, outputs, strict=True):
        assert np.array_equal(a, b)


def test_an_image_encoder_computes_the_clip_tokens_in_the_engine_call(parts):
    """With image_encoder=, a session's first request may carry the picture alone (what the server sends): the
    tokens computed inside the engine call equal passing the encoder's tokens as image_embeds."""
    from ardiff_jax.models.matrix_game import ClipVisionConfig, ClipVisionEncoder

    side = int(round((CONFIG.text_len - 1) ** 0.5))  # tokens = side^2 patches + the class token
    encoder = ClipVisionEncoder(ClipVisionConfig(image_size=14 * side, patch_size=14, dim=CONFIG.text_dim, heads=2,
                                                 layers=2, output_blocks=2), rngs=nnx.Rngs(5))
    modules, vae = parts
    player = Player(11, blocks=2)
    tokens = np.asarray(encoder.encode_image(jnp.asarray(player.image.astype(np.float32).transpose(2, 0, 1)
                                                         / 127.5 - 1.0)))
    outputs = {}
    for label, use_encoder in (("tokens", False), ("encoder", True)):
        pipeline = MatrixGamePipeline(CONFIG, modules=modules, vae=vae,
                                      image_encoder=encoder if use_encoder else None)
        with ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, warmup=False)) as engine:
            player.sent = 0
            first = player.inputs()
            if use_encoder:
                del first["image_embeds"]
            else:
                first["image_embeds"] = tokens
            videos = [np.asarray(engine.generate(player.request("s", first)).video)]
            videos.append(np.asarray(engine.generate(player.request("s")).video))
        outputs[label] = videos
    for ours, theirs in zip(outputs["encoder"], outputs["tokens"], strict=True):
        np.testing.assert_allclose(ours, theirs, atol=2)
    # Without an encoder the picture alone is refused before anything runs, naming the way out.
    pipeline = MatrixGamePipeline(CONFIG, modules=modules, vae=vae)
    with ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                  gpu_memory_fraction=1.0, warmup=False)) as engine:
        player.sent = 0
        first = player.inputs()
        del first["image_embeds"]
        with pytest.raises(ValueError, match="image_encoder="):
            engine.generate(player.request("t", first))
