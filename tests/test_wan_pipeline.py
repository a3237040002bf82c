"""CausalWanPipeline through the engine: Self-Forcing's sampler on paged KV equals dense recomputations.

Two independent references:

* :class:`ReferenceWan`: the cache-free reference of ``tests/models_reference.py`` (every
  committed block's K/V recomputed from its clean latents, block by block, dense
  attention over the frames the window/sink rule shows) with Wan's prompt embeddings;
  it follows prompt switches, resets and LRU evictions;
* :func:`block_causal_recomputation`: one multi-block training-mode pass per block
  (``CausalDiT.forward_blocks`` under ``block_causal_mask``) over every clean block so
  far plus the noisy current one: no cache, no incremental state at all.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig, StepSchedulerOutput
from ardiff_jax.models import CausalDiTConfig, MaskedAttention, block_causal_mask
from ardiff_jax.models._common import block_noise, renoise, step_noise_key
from ardiff_jax.models.wan import (
    CausalWanPipeline,
    CausalWanPipelineConfig,
    WanModules,
    warped_schedule,
    with_policy,
)
from ardiff_jax.models.wan._pipeline import _with_config, wan_text_kv
from models_reference import ReferenceLRU, ReferenceWorld

#: float32 end to end; as in tests/test_models_world.py only the summation order of the paged
#: attention differs from the dense reference.
TOLERANCE = 1e-5

#: A Wan-shaped transformer small enough for CI: 2 layers, 2 heads x 12 (RoPE split 4/4/4),
#: 4-channel 4x6 latents (6 tokens per frame), 8 x 16 text context; LongLive's policy.
TINY_WAN = CausalDiTConfig(
    name="tiny-wan", num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
    latent_width=6, text_len=8, text_dim=16, frames_per_block=3, window_frames=6, sink_frames=3, freq_dim=32,
)
#: No warmup: no test here is about compiling, and warmup would compile programs none runs (the text
#: projection of its 1-token warmup prompt, the batch bucket); each program used compiles on first use.
ENGINE = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0, warmup=False)


def _embeds(seed: int, length: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((length, TINY_WAN.text_dim)).astype(np.float32)


def _request(session: str, embeds: np.ndarray | None, **extra) -> DiffusionRequest:
    inputs = {} if embeds is None else {"prompt_embeds": embeds}
    return DiffusionRequest(f"r-{session}", extra_args={"session_id": session, **extra}, inputs=inputs)


@pytest.fixture(scope="module")
def modules():
    return CausalWanPipeline(TINY_WAN).modules


def _pipeline(modules, config: CausalDiTConfig = TINY_WAN, **pipeline_kwargs) -> CausalWanPipeline:
    if config != modules.transformer.config:  # the same weights under another window policy
        modules = WanModules(_with_config(modules.transformer, config))
    return CausalWanPipeline(config, CausalWanPipelineConfig(**pipeline_kwargs), modules=modules)


class ReferenceWan(ReferenceWorld):
    """The cache-free world reference with Wan's text conditioning (a prompt is its embeddings' digest)."""

    def __init__(self, pipeline: CausalWanPipeline) -> None:
        super().__init__(pipeline)
        self.embeds: dict[str, np.ndarray] = {}

    def prompt(self, embeds: np.ndarray) -> str:
        parsed = self.p._check_embeds(embeds)
        self.embeds[parsed.digest] = parsed.embeds
        return parsed.digest

    def text_kv(self, prompt: str):
        if prompt not in self._text:
            self._text[prompt] = wan_text_kv(self.p._graphdef, self.p._params,
                                             jax.device_put(self.embeds[prompt], self.p.device))
        return self._text[prompt]


def test_warped_schedule_is_self_forcings():
    assert warped_schedule().timesteps == pytest.approx((1000.0, 937.5, 833.3333, 625.0), abs=1e-4)
    assert CausalWanPipelineConfig().schedule == warped_schedule((1000, 750, 500, 250), 5.0)
    assert warped_schedule((1000, 757, 522), 8.0).timesteps[0] == 1000.0  # CausVid's list
    with pytest.raises(ValueError, match="integers in"):
        warped_schedule((1000, 750.5))
    with pytest.raises(ValueError, match="shift must be positive"):
        warped_schedule(shift=0.0)


def test_policies_set_block_window_and_sink():
    self_forcing = with_policy("wan2.1-t2v-1.3b", "self-forcing")
    assert (self_forcing.frames_per_block, self_forcing.sink_frames, self_forcing.window_frames) == (3, 0, 21)
    longlive = with_policy("wan2.1-t2v-1.3b", "longlive")
    assert (longlive.sink_frames + longlive.window_frames, longlive.sink_frames) == (12, 3)
    with pytest.raises(ValueError, match="unknown causal-Wan policy"):
        with_policy("wan2.1-t2v-1.3b", "krea")


@pytest.mark.parametrize("policy", ["longlive", "self-forcing"])
def test_rollout_equals_the_cache_free_reference(modules, policy):
    """Interleaved sessions, LRU eviction, a prompt switch, a reset, the window sliding past the sink."""
    # Self-Forcing's shape at CI size: no sink, everything visible up to 6 frames, then sliding.
    config = TINY_WAN.replace(sink_frames=0, window_frames=6) if policy == "self-forcing" else TINY_WAN
    pipeline = _pipeline(modules, config, session_capacity=2)
    engine = ARDiffusionEngine(pipeline, ENGINE)
    assert engine.session_capacity == 2
    reference = ReferenceWan(pipeline)
    lru = ReferenceLRU(engine.session_capacity)
    prompts = {sid: _embeds(i) for i, sid in enumerate("ABCD")}
    worst = 0.0
    for r in range(6):
        for sid in ("A", "B" if r % 2 else "C" if r % 4 == 0 else "D"):
            if sid == "A" and r == 3:
                prompts["A"] = _embeds(99, length=8)  # switch: new text K/V, self-attention history kept
            reset = sid == "A" and r == 5
            digest = reference.prompt(prompts[sid])
            session = lru.touch(sid, lambda s=sid, d=digest: reference.new_session(s, d), reset=reset)
            expected = reference.generate(session, digest, None)
            out = engine.generate(_request(sid, prompts[sid], **({"reset": True} if reset else {})))
            assert out.latents.shape == config.block_shape
            assert out.first_frame == session.committed[-1].frame_start
            diff = float(np.max(np.abs(np.asarray(out.latents) - expected)))
            worst = max(worst, diff)
            assert diff <= TOLERANCE, f"{policy} round {r} session {sid}: max |paged - reference| = {diff:.3g}"
    assert lru.evicted
    print(f"causal Wan ({policy}): worst |paged - reference| = {worst:.3g}")


def block_causal_recomputation(pipeline: CausalWanPipeline, session_key, embeds: np.ndarray, num_blocks: int
                               ) -> list[np.ndarray]:
    """Blocks of one session, each from one dense pass over every clean block so far plus the noisy one."""
    config, schedule = pipeline.config, pipeline.schedule
    graphdef, params = nnx.split(pipeline.transformer)
    text_kv = _text_kv(pipeline, embeds)
    f = config.frames_per_block
    clean: list[np.ndarray] = []
    for block in range(num_blocks):
        starts = np.arange(block + 1, dtype=np.int32) * f
        x = block_noise(session_key, np.int32(block), config.block_shape)
        for step in range(schedule.num_steps):
            x0, x = _dense_step(graphdef, params, clean, x, starts, schedule, block, step, session_key, text_kv)
        clean.append(x0)
    return clean


def _text_kv(pipeline: CausalWanPipeline, embeds: np.ndarray):
    """The prompt's text K/V through the pipeline's own jitted program and device placement (compiled once)."""
    return wan_text_kv(pipeline._graphdef, pipeline._params, pipeline._to_device(pipeline._check_embeds(embeds).embeds))


def _dense_step(graphdef, params, clean: list[np.ndarray], x, starts: np.ndarray, schedule, block: int, step: int,
                session_key, text_kv) -> tuple[np.ndarray, np.ndarray]:
    """One denoise step of the noisy last instance ``x`` after the clean ones: ``(x0, x at the next step)``.

    Host (numpy) inputs and one jitted program per instance count: eagerly, the mask, the stacking,
    the step arithmetic and the noise keys each compiled a program per shape."""
    t, sigma, sigma_next = schedule.step_args(step)
    times = np.asarray([0.0] * len(clean) + [t], np.float32)
    is_clean = np.arange(len(clean) + 1) < len(clean)
    stacked = np.stack(clean) if clean else np.zeros((0, *np.shape(x)), np.float32)
    # The noise outside the step's program: threefry compiles once for the block shape, not into every program.
    noise = jax.random.normal(step_noise_key(session_key, np.int32(block), np.int32(step)), np.shape(x))
    x0, x = _dense_step_jit(graphdef, params, stacked, np.asarray(x), times, starts, is_clean, text_kv,
                            np.float32(sigma), np.float32(sigma_next), noise)
    return np.asarray(x0), np.asarray(x)


@functools.partial(jax.jit, static_argnums=0)
def _dense_step_jit(graphdef, params, clean, x, times, starts, is_clean, text_kv, sigma, sigma_next, noise):
    """The last instance's flow in one masked pass over every instance (training mode), then the sampler step."""
    model = nnx.merge(graphdef, params)
    mask = block_causal_mask(model.config, starts, is_clean)
    latents = jnp.concatenate([clean, x[None]])
    flow = model.forward_blocks(latents, times, starts, text_kv, attention=MaskedAttention(mask)).video[-1]
    x0 = x - sigma * flow
    return x0, renoise(x0, sigma_next, noise)


def test_rollout_equals_a_block_causal_recomputation(modules):
    pipeline = _pipeline(modules)
    engine = ARDiffusionEngine(pipeline, ENGINE)
    embeds = _embeds(3)
    blocks = [np.asarray(engine.generate(_request("S", embeds if b == 0 else None)).latents) for b in range(4)]
    key = pipeline._sessions["S"].key
    expected = block_causal_recomputation(pipeline, key, embeds, 4)
    for b, (got, want) in enumerate(zip(blocks, expected, strict=True)):
        diff = float(np.max(np.abs(got - want)))
        assert diff <= 1e-4, f"block {b}: max |paged - block-causal| = {diff:.3g}"


def test_same_embeddings_again_change_nothing_and_new_ones_switch(modules):
    runs = {}
    for name, schedule in {"once": [0, None, None], "repeated": [0, 0, 0], "switched": [0, 0, 1]}.items():
        engine = ARDiffusionEngine(_pipeline(modules), ENGINE)
        runs[name] = [np.asarray(engine.generate(_request("S", None if e is None else _embeds(e))).latents)
                      for e in schedule]
    for a, b in zip(runs["once"], runs["repeated"], strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(runs["once"][1], runs["switched"][1])
    assert not np.allclose(runs["once"][2], runs["switched"][2])


@pytest.mark.parametrize("request_kwargs, message", [
    ({"prompt": "a cat"}, "has no text encoder"),
    ({"inputs": {}}, "needs a prompt or inputs\\['prompt_embeds'\\]"),
    ({"inputs": {"prompt_embeds": np.zeros((9, 16), np.float32)}}, "L <= 8"),
    ({"inputs": {"prompt_embeds": np.zeros((4, 15), np.float32)}}, "L <= 8, 16"),
    ({"inputs": {"prompt_embeds": np.full((4, 16), np.nan, np.float32)}}, "must be finite"),
    ({"inputs": {"prompt_embeds": "text"}}, "float array"),
    ({"inputs": {"prompt_embeds": np.zeros((4, 16), np.float32), "action": np.zeros((1, 1))}}, "takes no inputs"),
    ({"inputs": {"prompt_embeds": np.zeros((4, 16), np.float32), "seed": -1}}, "seed"),
])
def test_bad_requests_are_refused_before_anything_runs(modules, request_kwargs, message):
    engine = ARDiffusionEngine(_pipeline(modules), ENGINE)
    engine.generate(_request("kept", _embeds(1)))
    before = engine.sessions
    request = DiffusionRequest("bad", extra_args={"session_id": "new"}, **request_kwargs)
    with pytest.raises(ValueError, match=message):
        engine.generate(request)
    assert engine.sessions == before


def test_stepwise_equals_tick(modules):
    tick = ARDiffusionEngine(_pipeline(modules), ENGINE)
    expected = [np.asarray(tick.generate(_request("S", _embeds(2))).latents) for _ in range(2)]
    pipeline = _pipeline(modules)
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, step_execution=True, warmup=False))
    request = DiffusionRequest("S", inputs={"prompt_embeds": _embeds(2), "num_blocks": 2})
    outputs, calls = [], 0
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


def test_bfloat16_weights_and_pools_stay_close_to_float32(modules):
    """bf16 parameters, activations and KV pools against the float32 run of the same weights."""
    f32 = ARDiffusionEngine(_pipeline(modules), ENGINE)
    bf16_config = TINY_WAN.replace(dtype="bfloat16", param_dtype="bfloat16")
    bf16 = ARDiffusionEngine(CausalWanPipeline(bf16_config, modules=_in_bfloat16(modules, bf16_config)),
                             EngineConfig(dtype="bfloat16", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                                          warmup=False))
    for block in range(3):
        a = np.asarray(f32.generate(_request("S", _embeds(4) if block == 0 else None)).latents)
        b = np.asarray(bf16.generate(_request("S", _embeds(4) if block == 0 else None)).latents)
        # bf16 keeps 8 mantissa bits (relative 4e-3 per rounding). Measured: 0.014, 0.018, 0.028
        # on latents of magnitude ~3.7 over three blocks (the committed history feeds back);
        # 0.06 leaves 2x headroom and still catches a wrong cast or a lost scale.
        diff = float(np.max(np.abs(a - b)))
        assert diff <= 0.06, f"block {block}: max |bf16 - f32| = {diff:.3g}"


def _in_bfloat16(modules, config):
    graphdef, state = nnx.split(modules.transformer)
    # Cast on the host (ml_dtypes' round-to-nearest-even, XLA's convert): eagerly each parameter shape
    # compiled a convert program of its own.
    state = jax.tree.map(lambda x: jax.device_put(np.asarray(x).astype(jnp.bfloat16)) if x.dtype == jnp.float32
                         else x, state)
    return WanModules(_with_config(nnx.merge(graphdef, state), config))


def test_recache_recomputes_the_visible_history_under_the_new_prompt(modules):
    """LongLive's recache: after a switch, the next block equals one dense pass over the visible blocks
    (sink + window, clean, at t = 0) and the new block, all under the new prompt."""
    pipeline = _pipeline(modules, recache_on_prompt_switch=True)
    engine = ARDiffusionEngine(pipeline, ENGINE)
    old, new = _embeds(5), _embeds(6, length=7)
    clean = [np.asarray(engine.generate(_request("S", old if b == 0 else None)).latents) for b in range(4)]
    switched = np.asarray(engine.generate(_request("S", new)).latents)

    # 4 blocks = 12 frames committed; the next block (frames 12-14) sees the sink block (0-2) and
    # the newest window - f = 3 frames (9-11).
    config, schedule = pipeline.config, pipeline.schedule
    key = pipeline._sessions["S"].key
    visible = [clean[0], clean[3]]
    starts = np.asarray([0, 9, 12], np.int32)
    graphdef, params = nnx.split(pipeline.transformer)
    text_kv = _text_kv(pipeline, new)
    x = block_noise(key, np.int32(4), config.block_shape)
    for step in range(schedule.num_steps):
        x0, x = _dense_step(graphdef, params, visible, x, starts, schedule, 4, step, key, text_kv)
    diff = float(np.max(np.abs(switched - np.asarray(x0))))
    assert diff <= 1e-4, f"recached block: max |paged - dense| = {diff:.3g}"

    # Without the recache the history keeps the old prompt's K/V: a different block.
    plain = ARDiffusionEngine(_pipeline(modules), ENGINE)
    for b in range(4):
        plain.generate(_request("S", old if b == 0 else None))
    assert not np.allclose(np.asarray(plain.generate(_request("S", new)).latents), switched, atol=1e-3)


def test_recache_keeps_resident_latents_within_the_declared_bound(modules):
    pipeline = _pipeline(modules, recache_on_prompt_switch=True)
    engine = ARDiffusionEngine(pipeline, ENGINE)
    for b in range(3):
        engine.generate(_request("S", _embeds(b)))  # a switch every block
    spec = pipeline.ar_diffusion_kv_cache_spec()
    assert 0 < pipeline.model_owned_bytes("S") <= spec.model_owned_state_bytes_per_session
    with pytest.raises(ValueError, match="multiples of frames_per_block"):
        _pipeline(modules, TINY_WAN.replace(window_frames=7), recache_on_prompt_switch=True)


def test_rewrite_committed_context_writes_resident_frames_only(modules):
    from ardiff_jax.kv import contiguous_table_cursor, cursor_pages
    from helpers import make_cache, pool_snapshot

    spec = _pipeline(modules).ar_diffusion_kv_cache_spec()
    cache = make_cache(spec)
    state = cache.create_state("s")
    cfg = TINY_WAN
    seq_len = cfg.frames_per_block * cfg.tokens_per_frame
    shape = (cfg.num_layers, seq_len, cfg.num_heads, cfg.head_dim)
    for block in range(4):  # 12 frames: sink 0-2, the ring holds 6-11
        state.get_kv_caches("main", seq_len=seq_len, commit_current=True)
        state.commit_paged_context("main", kv=(jnp.full(shape, block, jnp.float32),) * 2)
    new = jnp.full(shape, 7.0, jnp.float32)
    with pytest.raises(ValueError, match=r"cannot rewrite frames \[3, 4, 5\]"):
        state.rewrite_committed_context("main", 3, (new, new))  # slid out of the ring
    with pytest.raises(ValueError, match=r"cannot rewrite frames \[12, 13, 14\]"):
        state.rewrite_committed_context("main", 12, (new, new))  # not committed yet
    with pytest.raises(ValueError, match="whole frames"):
        state.rewrite_committed_context("main", 9, (new[:, :5], new[:, :5]))
    state.get_kv_caches("main", seq_len=seq_len, commit_current=False)
    with pytest.raises(RuntimeError, match="pending context"):
        state.rewrite_committed_context("main", 9, (new, new))
    state.commit_paged_context("main")
    before, _ = pool_snapshot(cache)
    state.rewrite_committed_context("main", 0, (new, new))  # the sink block
    after, _ = pool_snapshot(cache)
    assert state.adapter("main").committed_frames == 12  # the cursor did not move
    pages = cursor_pages(cache.layout, contiguous_table_cursor(cache.layout, 0, 0, 0), np.arange(3), np)  # slot 0
    assert (after[:, pages] == 7.0).all()
    untouched = np.setdiff1d(np.arange(after.shape[1]), pages)
    assert np.array_equal(after[:, untouched], before[:, untouched])


def test_a_text_prompt_goes_through_the_pipelines_text_encoder(modules):
    from ardiff_jax.models.wan import PlaceholderTextEncoder, placeholder_embeds

    encoder = PlaceholderTextEncoder(TINY_WAN.text_dim, length=5)
    with_text = ARDiffusionEngine(CausalWanPipeline(TINY_WAN, modules=modules, text_encoder=encoder), ENGINE)
    with_embeds = ARDiffusionEngine(_pipeline(modules), ENGINE)
    for prompt in ("a cat", "a cat", "a dog"):
        a = with_text.generate(DiffusionRequest("r", prompt=prompt, extra_args={"session_id": "S"}))
        b = with_embeds.generate(_request("S", placeholder_embeds(prompt, TINY_WAN.text_dim, 5)))
        assert np.array_equal(np.asarray(a.latents), np.asarray(b.latents))
    assert encoder.calls == ["a cat", "a dog"]  # encoded once per prompt switch, not per block
    with pytest.raises(ValueError, match="not both"):
        with_text.generate(DiffusionRequest("r", prompt="x", extra_args={"session_id": "S"},
                                            inputs={"prompt_embeds": placeholder_embeds("x", 16, 5)}))
