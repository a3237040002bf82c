"""Cache-free reference rollouts for the model pipelines (used by tests/test_models_*.py).

No KV cache at all: each reference session keeps only the *inputs* of what it committed
(clean latents, frame index, prompt, controls). Every request recomputes the K/V of every
committed block from scratch, in order, with dense float32 attention
(:class:`~ardiff_jax.models.DenseAttention`, i.e. ``ref_attention``), selecting each
forward's visible frames with :func:`visible_history_frames`, a plain-Python model of the
window/sink rule written independently of ``ardiff_jax.kv``. It then runs the new block's
forwards the same way. (The history is recomputed once per request: it cannot change
between the forwards of one request, so recomputing it per forward gives the same arrays.)

The model code is shared (the same jitted step functions, called with a dense backend):
the comparison isolates the paged KV path, the runtime's cursors/eviction/LRU and the
pipelines' use of them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from ardiff_jax.models import DenseAttention, cfg_commit, cfg_step, world_step
from ardiff_jax.models._cfg import image_features, initial_noise
from ardiff_jax.models._common import block_noise, new_session_key, prompt_ids, session_seed, text_cross_kv


def visible_history_frames(committed: int, current: int, sink: int, window: int) -> list[int]:
    """Committed frames a forward of ``current`` new frames sees, in key order.

    The first ``sink`` frames ever committed stay visible; of the others, the newest
    ``window - current`` (the current block uses up window slots; ``docs/reference_behaviour.md``,
    "Visible window").
    """
    frames = list(range(committed))
    sink_part = frames[:sink]
    others = frames[sink:]
    room = window - current
    recent = others[-room:] if room > 0 else []
    return sink_part + recent


def dense_backend(kv_by_frame: dict[int, tuple[np.ndarray, np.ndarray]], frames: list[int], capacity_frames: int,
                  tokens_per_frame: int, device: Any) -> DenseAttention:
    """History K/V of ``frames`` (in order) padded to ``capacity_frames`` frames, with a mask."""
    sample = next(iter(kv_by_frame.values()))[0] if kv_by_frame else None
    if sample is None:
        raise ValueError("dense_backend needs at least one computed frame to learn the shapes; use empty_backend")
    layers, _, heads, dim = sample.shape
    k = np.zeros((layers, capacity_frames * tokens_per_frame, heads, dim), np.float32)
    v = np.zeros_like(k)
    mask = np.zeros((capacity_frames * tokens_per_frame,), bool)
    for slot, frame in enumerate(frames):
        lo, hi = slot * tokens_per_frame, (slot + 1) * tokens_per_frame
        k[:, lo:hi], v[:, lo:hi] = kv_by_frame[frame]
        mask[lo:hi] = True
    return jax.device_put(DenseAttention(k=k, v=v, mask=mask), device)


def empty_backend(pipeline: Any) -> DenseAttention:
    cfg = pipeline.config
    capacity = (cfg.sink_frames + cfg.window_frames) * cfg.tokens_per_frame
    return jax.device_put(DenseAttention.empty(cfg.num_layers, cfg.num_heads, cfg.head_dim, capacity), pipeline.device)


def _backend(pipeline: Any, kv_by_frame: dict, committed: int, current: int) -> DenseAttention:
    cfg = pipeline.config
    frames = visible_history_frames(committed, current, cfg.sink_frames, cfg.window_frames)
    if not frames:
        return empty_backend(pipeline)
    return dense_backend(kv_by_frame, frames, cfg.sink_frames + cfg.window_frames, cfg.tokens_per_frame,
                         pipeline.device)


def _split_frames(kv_by_frame: dict, frame_start: int, k: jax.Array, v: jax.Array, frames: int, tokens: int) -> None:
    k, v = np.asarray(k), np.asarray(v)
    for i in range(frames):
        kv_by_frame[frame_start + i] = (k[:, i * tokens:(i + 1) * tokens], v[:, i * tokens:(i + 1) * tokens])


class ReferenceLRU:
    """Independent model of the runner's session residency: LRU with a fixed capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.evicted: list[str] = []

    def touch(self, session_id: str, factory: Any, reset: bool = False) -> Any:
        if reset:
            self.order.pop(session_id, None)
        if session_id not in self.order:
            while len(self.order) >= self.capacity:
                oldest, _ = self.order.popitem(last=False)
                self.evicted.append(oldest)
            self.order[session_id] = factory()
        self.order.move_to_end(session_id)
        return self.order[session_id]

    def drop(self, session_id: str) -> None:
        self.order.pop(session_id, None)


# -- world ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _WorldCommitted:
    frame_start: int
    block_index: int
    latents: jax.Array
    prompt: str
    action: np.ndarray | None


@dataclasses.dataclass
class ReferenceWorldSession:
    key: jax.Array
    prompt: str
    block_index: int = 0
    committed: list[_WorldCommitted] = dataclasses.field(default_factory=list)


class ReferenceWorld:
    """Cache-free reference of :class:`~ardiff_jax.models.WorldPipeline` (tick mode)."""

    def __init__(self, pipeline: Any) -> None:
        self.p = pipeline
        self._text: dict[str, Any] = {}

    def new_session(self, session_id: str, prompt: str, seed: int | None = None) -> ReferenceWorldSession:
        inputs = {} if seed is None else {"seed": seed}
        seed = session_seed(session_id, inputs, self.p.pipeline_config.noise_seed)
        return ReferenceWorldSession(key=new_session_key(seed, self.p.device), prompt=prompt)

    def text_kv(self, prompt: str) -> Any:
        if prompt not in self._text:
            ids = jax.device_put(prompt_ids(prompt, self.p.config.text_len), self.p.device)
            self._text[prompt] = text_cross_kv(self.p._graphdef, self.p._params, ids)
        return self._text[prompt]

    def _registers(self, action: np.ndarray | None) -> Any:
        return None if action is None else jax.device_put(action, self.p.device)

    def generate(self, session: ReferenceWorldSession, prompt: str | None, action: np.ndarray | None) -> np.ndarray:
        p, cfg, schedule = self.p, self.p.config, self.p.schedule
        frames, tokens = cfg.frames_per_block, cfg.tokens_per_frame
        if prompt is not None:
            session.prompt = prompt
        if action is None and cfg.num_register_tokens:
            action = np.zeros((cfg.num_register_tokens, cfg.register_dim), np.float32)
        # 1. Recompute every committed block's K/V from its inputs, oldest first.
        kv_by_frame: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for blk in session.committed:
            attention = _backend(p, kv_by_frame, blk.frame_start, frames)
            t, sigma, sigma_next = schedule.step_args(schedule.num_steps)
            _, _, k, v = world_step(
                p._graphdef, p._params, attention, blk.latents, t, sigma, sigma_next, session.key,
                np.int32(blk.block_index), np.int32(schedule.num_steps), np.int32(blk.frame_start),
                self.text_kv(blk.prompt), self._registers(blk.action))
            _split_frames(kv_by_frame, blk.frame_start, k, v, frames, tokens)
        # 2. The new block's denoise steps over the visible history.
        frame_start = sum(frames for _ in session.committed)
        attention = _backend(p, kv_by_frame, frame_start, frames)
        x = block_noise(session.key, np.int32(session.block_index), cfg.block_shape)
        x0 = None
        for step in range(schedule.num_steps):
            t, sigma, sigma_next = schedule.step_args(step)
            x, x0, _, _ = world_step(
                p._graphdef, p._params, attention, x, t, sigma, sigma_next, session.key,
                np.int32(session.block_index), np.int32(step), np.int32(frame_start),
                self.text_kv(session.prompt), self._registers(action))
        session.committed.append(_WorldCommitted(frame_start, session.block_index, x0, session.prompt, action))
        session.block_index += 1
        return np.asarray(x0)


# -- CFG -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceCFGSession:
    key: jax.Array
    prompt: str
    block_index: int = 0
    observations: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)  # (frame_start, latents)
    image: Any = None


class ReferenceCFG:
    """Cache-free reference of :class:`~ardiff_jax.models.CFGWorldActionPipeline`."""

    def __init__(self, pipeline: Any) -> None:
        self.p = pipeline
        self._text: dict[str, Any] = {}

    def new_session(self, session_id: str, prompt: str, seed: int | None = None) -> ReferenceCFGSession:
        inputs = {} if seed is None else {"seed": seed}
        seed = session_seed(session_id, inputs, self.p.pipeline_config.noise_seed)
        return ReferenceCFGSession(key=new_session_key(seed, self.p.device), prompt=prompt)

    def text_kv(self, prompt: str) -> Any:
        if prompt not in self._text:
            ids = jax.device_put(prompt_ids(prompt, self.p.config.text_len), self.p.device)
            self._text[prompt] = text_cross_kv(self.p._graphdef, self.p._params, ids)
        return self._text[prompt]

    def generate(self, session: ReferenceCFGSession, observation: dict) -> tuple[np.ndarray, np.ndarray]:
        from ardiff_jax.models._common import image_cross_kv

        p, cfg, schedule = self.p, self.p.config, self.p.schedule
        tokens = cfg.tokens_per_frame
        views, robot_state, _ = p.schema.validate(observation)
        latents = p._encoder(views)
        if session.image is None and cfg.image_len:
            feats = jax.device_put(image_features(cfg, latents[0]), p.device)
            session.image = image_cross_kv(p._graphdef, p._params, feats)
        committed = sum(obs.shape[0] for _, obs in session.observations)
        session.observations.append((committed, latents))
        crosses = {False: (self.text_kv(session.prompt), session.image),
                   True: (self.text_kv(p.pipeline_config.negative_prompt), session.image)}
        # Recompute both branches' history from the observations, oldest first.
        histories: dict[bool, dict] = {}
        for negative in (False, True):
            kv_by_frame: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            for frame_start, obs in session.observations:
                attention = _backend(p, kv_by_frame, frame_start, obs.shape[0])
                k, v = cfg_commit(p._graphdef, p._params, attention, jax.device_put(obs, p.device),
                                  np.int32(frame_start), *crosses[negative])
                _split_frames(kv_by_frame, frame_start, k, v, obs.shape[0], tokens)
            histories[negative] = kv_by_frame
        frame_start = committed + latents.shape[0]
        pos_att = _backend(p, histories[False], frame_start, cfg.frames_per_block)
        neg_att = _backend(p, histories[True], frame_start, cfg.frames_per_block)
        block = np.int32(session.block_index)
        x, a = initial_noise(session.key, block, cfg.block_shape, (p.num_action_tokens, p.pipeline_config.action_dim))
        state_features = np.zeros((p.pipeline_config.num_state_tokens, cfg.register_dim), np.float32)
        state_features[:, : robot_state.shape[0]] = robot_state
        state_features = jax.device_put(state_features, p.device)
        x0 = a0 = None
        for step in range(schedule.num_steps):
            t, sigma, sigma_next = schedule.step_args(step)
            x, x0, a, a0 = cfg_step(
                p._graphdef, p._params, pos_att, neg_att, x, a, state_features, t, sigma, sigma_next, session.key,
                block, np.int32(step), np.int32(frame_start), crosses[False], crosses[True],
                np.float32(p.pipeline_config.guidance_scale))
        session.block_index += 1
        return np.asarray(x0), np.asarray(a0)
