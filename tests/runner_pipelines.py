"""Small pipelines implementing the capability, for runner tests.

``RecordingPipeline`` appends every lifecycle call to a shared ``log`` list so tests can
assert exact hook order. ``forward`` behaviour is driven by ``request.inputs``:

* ``frames`` (default: the spec's block): current frames of the forward;
* ``commit`` (default True): committing forward or denoise probe;
* ``branch`` (default the first branch): which KV branch;
* ``fail`` : ``"before"`` (raise before any KV call), ``"after_commit"`` (raise after the
  commit wrote), ``"retain"`` (keep the state in an attribute), ``"delete_pools"``
  (delete the pool buffers, as a model that donates them would);
* ``populate`` : name of a cross cache to populate with ``value``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from ardiff_jax import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    DiffusionRequest,
    StepResult,
)

MAIN = (ARDiffusionKVBranchSpec("main", 0),)
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def small_spec(**overrides: Any) -> ARDiffusionKVCacheSpec:
    fields = dict(num_layers=2, num_kv_heads=1, head_size=4, tokens_per_frame=1, frames_per_block=3,
                  window_frames=5, sink_frames=1, kv_branches=MAIN,
                  cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 8),), session_capacity=2)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def block_values(spec: ARDiffusionKVCacheSpec, frames: int, seed: int) -> jnp.ndarray:
    """Deterministic ``[L, frames*T, H, D]`` block K/V for a forward."""
    rng = np.random.default_rng(seed)
    shape = (spec.num_layers, frames * spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


class RecordingPipeline:
    """Implements SupportsARDiffusionPipeline and records every call in ``log``."""

    def __init__(self, spec: ARDiffusionKVCacheSpec | None = None, log: list | None = None) -> None:
        self.spec = small_spec() if spec is None else spec
        self.log = [] if log is None else log
        self.current_state = None
        self.states_seen: list[Any] = []
        self.model_state: dict[str, int] = {}
        self.forward_count = 0
        self.bind_error: BaseException | None = None

    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self.spec

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: Any):
        self.log.append(("bind", session_id))
        if self.bind_error is not None:
            raise self.bind_error
        if state.session_id != session_id:
            raise ValueError("state/session mismatch")
        self.current_state = state
        self.states_seen.append(state)
        try:
            yield
        finally:
            if self.current_state is state:
                self.current_state = None
            self.log.append(("unbind", session_id))

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self.log.append(("reset_hook", session_id))
        self.model_state.pop(session_id, None)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self.log.append(("close_hook", session_id))
        self.model_state.pop(session_id, None)

    def fork_ar_diffusion_session(self, source_id: str, new_id: str, *, noise_seed: int | None = None) -> None:
        self.log.append(("fork_hook", source_id, new_id))
        if source_id in self.model_state:
            self.model_state[new_id] = self.model_state[source_id]

    def forward(self, request: DiffusionRequest) -> Any:
        state = self.current_state
        assert state is not None, "forward called without a bound state"
        inputs = request.inputs
        branch = inputs.get("branch", self.spec.kv_branches[0].name)
        self.log.append(("forward", state.session_id))
        self.forward_count += 1
        fail = inputs.get("fail")
        if fail == "before":
            raise RuntimeError("model failed before touching KV")
        if "populate" in inputs:
            name = inputs["populate"]
            n = self.spec.cross_attention_lengths[name]
            heads = self.spec.cross_attention_heads(name)
            value = float(inputs.get("value", 1.0))
            pairs = [(jnp.full((n, heads, self.spec.head_size), value + layer),) * 2
                     for layer in range(self.spec.num_layers)]
            state.populate_cross_attention(branch, name, pairs)
        frames = int(inputs.get("frames", self.spec.frames_per_block))
        commit = bool(inputs.get("commit", True))
        seq_len = frames * self.spec.tokens_per_frame
        caches = state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit)
        kv = block_values(self.spec, frames, seed=int(inputs.get("seed", self.forward_count)))
        outputs = [caches.attend(layer, kv[layer], kv[layer], kv[layer]) for layer in range(self.spec.num_layers)]
        if fail == "delete_pools":
            # What a model that donates the PagedKVCaches pools in its own jit leaves behind.
            caches.pools.delete()
            return jnp.stack(outputs)
        if commit:
            state.commit_paged_context(branch, kv=(kv, kv))
        else:
            state.commit_paged_context(branch)
        self.model_state[state.session_id] = self.model_state.get(state.session_id, 0) + 1
        if fail == "after_commit":
            raise RuntimeError("model failed after committing")
        if fail == "retain":
            self.retained = state
        return jnp.stack(outputs)


class StepPipeline(RecordingPipeline):
    """Adds SupportsStepExecution: ``inputs["results"]`` scripts what each step returns."""

    supports_step_execution = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_calls: dict[str, int] = {}
        self.bound_during_step: list[bool] = []

    def step(self, request: DiffusionRequest) -> StepResult:
        state = self.current_state
        self.bound_during_step.append(state is not None and state._bound)
        index = self.step_calls.get(request.request_id, 0)
        self.step_calls[request.request_id] = index + 1
        self.log.append(("step", request.request_id, index))
        script = request.inputs.get("results", ())
        action = script[index] if index < len(script) else "output"
        if action == "raise":
            raise RuntimeError("step failed")
        # Every step is a denoise probe; the last scripted step commits the block.
        frames = self.spec.frames_per_block
        caches = state.get_kv_caches("main", seq_len=frames * self.spec.tokens_per_frame,
                                     commit_current=action in ("output", "finish"))
        kv = block_values(self.spec, frames, seed=index)
        caches.attend(0, kv[0], kv[0], kv[0])
        if action in ("output", "finish"):
            state.commit_paged_context("main", kv=(kv, kv))
        if action == "none":
            return StepResult(finished=False)
        if action == "error":
            return StepResult(finished=False, error="model reported an error")
        return StepResult(finished=action == "finish", output=kv)


class WarmupPipeline(RecordingPipeline):
    """Adds SupportsARDiffusionWarmup yielding ``warmup_plan`` requests (``"fail"`` entries raise)."""

    def __init__(self, *args: Any, warmup_plan: tuple = ("ok", "ok"), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warmup_plan = warmup_plan

    def ar_diffusion_warmup_requests(self, session_id: str):
        self.log.append(("warmup_requests", session_id))
        for i, kind in enumerate(self.warmup_plan):
            inputs = {"frames": 1 if i == 0 else self.spec.frames_per_block}
            if kind == "fail":
                inputs["fail"] = "after_commit"
            yield DiffusionRequest(f"warmup-{i}", extra_args={"session_id": session_id, "reset": i == 0},
                                   inputs=inputs)
