"""The device-side rollout runs the real world model and equals the engine path.

Two sessions of the tiny ``WorldPipeline`` generate interleaved blocks through the engine
(runner path: one jitted forward per denoise step, one donated commit per block). The same
model, weights, noise keys and prompts then run as ONE jitted ``lax.scan`` over the whole
schedule with ``ardiff_jax.rollout.rollout_sessions``: four non-committing denoise forwards
and the clean committing forward per block, pools and cursors in the carry. The blocks
agree to float32 rounding (different XLA programs; measured max difference stated below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax import ARDiffusionEngine, ARDiffusionKVCache, DiffusionRequest, EngineConfig
from ardiff_jax.models import WorldPipeline, world_step
from ardiff_jax.models._common import block_noise, new_session_key, prompt_ids, session_seed, text_cross_kv
from ardiff_jax.rollout import rollout_sessions

SESSIONS = ("a", "b")
PROMPTS = {"a": "a red car on a beach", "b": "rain over a forest"}
BLOCKS = 6  # 12 frames per session: the 5-frame window (sink 1) wraps twice


def test_device_rollout_of_the_world_model_equals_the_engine():
    pipeline = WorldPipeline("tiny")
    config = pipeline.config
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=10**9,
                                                      gpu_memory_fraction=1.0, warmup=False))
    order = [s for _ in range(BLOCKS) for s in range(len(SESSIONS))]
    engine_blocks = [engine.generate(DiffusionRequest("r", prompt=PROMPTS[SESSIONS[s]],
                                                      extra_args={"session_id": SESSIONS[s]})).latents
                     for s in order]

    graphdef, params = pipeline._graphdef, pipeline._params
    schedule = pipeline.schedule
    device = jax.devices()[0]
    keys = jnp.stack([new_session_key(session_seed(sid, {}, pipeline.pipeline_config.noise_seed), device)
                      for sid in SESSIONS])
    text = [text_cross_kv(graphdef, params, jax.device_put(prompt_ids(PROMPTS[sid], config.text_len), device))
            for sid in SESSIONS]
    text_k = jnp.stack([k for k, _ in text])
    text_v = jnp.stack([v for _, v in text])
    registers = jnp.zeros((config.num_register_tokens, config.register_dim), jnp.float32)
    block_index = np.zeros(len(order), np.int32)
    seen = {s: 0 for s in range(len(SESSIONS))}
    for i, s in enumerate(order):
        block_index[i], seen[s] = seen[s], seen[s] + 1
    xs = {"key": keys[np.array(order)], "block": block_index, "text_k": text_k[np.array(order)],
          "text_v": text_v[np.array(order)]}

    def block_fn(caches, x):
        frame_start = caches.cursor[1]
        x_t = block_noise(x["key"], x["block"], config.block_shape)
        x0 = x_t
        for step in range(schedule.num_steps):  # denoise probes: nothing is written
            t, sigma, sigma_next = schedule.step_args(step)
            x_t, x0, _, _ = world_step(graphdef, params, caches, x_t, t, sigma, sigma_next, x["key"], x["block"],
                                       np.int32(step), frame_start, (x["text_k"], x["text_v"]), registers)
        t, sigma, sigma_next = schedule.step_args(schedule.num_steps)
        _, _, k, v = world_step(graphdef, params, caches, x0, t, sigma, sigma_next, x["key"], x["block"],
                                np.int32(schedule.num_steps), frame_start, (x["text_k"], x["text_v"]), registers)
        return x0, k, v

    cache = ARDiffusionKVCache(pipeline.ar_diffusion_kv_cache_spec(), dtype="float32",
                               available_memory_bytes=10**9, gpu_memory_fraction=1.0)
    states = [cache.create_state(sid) for sid in SESSIONS]
    device_blocks = rollout_sessions(cache, states, jax.tree_util.Partial(block_fn), xs, order, branch="main",
                                     num_frames=config.frames_per_block)

    # One fused program vs ~5 per block: XLA may fuse and round differently; float32 over a
    # 2-layer tiny DiT stays within a few ulps (measured: max abs difference 1.1e-6 on values up to 5.3).
    np.testing.assert_allclose(np.asarray(device_blocks), np.stack([np.asarray(b) for b in engine_blocks]),
                               rtol=1e-4, atol=1e-5)
    assert [s.adapter("main").committed_frames for s in states] == [BLOCKS * config.frames_per_block] * 2
