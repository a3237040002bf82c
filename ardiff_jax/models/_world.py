"""``WorldPipeline``: the seed's single-KV-branch causal few-step (DMD-style) pipeline.

One logical KV branch ``"main"``, one ``"text"`` cross-attention cache, register tokens
computed each block from an action/control input (declared as
``max_scratch_tokens_per_branch`` and passed to attention as ``extra_k/extra_v``), sink and
window from the transformer config. Each block (LingBot-World / Self-Forcing inference):

1. ``num_steps`` denoise forwards with ``commit_current=False`` (nothing is written; the
   block's K/V reach attention as arguments), each ``x0 = x_t - sigma v`` then re-noise;
2. one clean forward at ``t = 0`` with ``commit_current=True`` whose per-layer K/V the
   pipeline hands to ``commit_paged_context``.

All forwards of a block (denoise and commit) run the **same** compiled program: the
paged view has the same shape whether or not it commits, and the commit forward is just
``t = sigma = 0``.

Model-owned per-session state (noise key, cached prompt, block counter, the last block's
latents, an in-flight stepwise block) lives in ``self._sessions`` keyed by session id and
is dropped by the reset/close hooks; its size is declared in the spec
(``model_owned_state_bytes_per_session``). A prompt change clears the session's cross
caches (``clear_cross_attention``) and repopulates ``"text"``; self-attention history is kept.

Stepwise execution (``SupportsStepExecution``): ``step(request)`` runs one denoise step
per call; the call that runs the last step also commits and returns
``StepResult(finished=..., output=WorldBlock)``. ``request.inputs["num_blocks"]`` says how
many blocks the streaming request wants. Tick mode (``forward``) runs the very same
per-step code in a loop, so both modes produce bit-identical blocks.

Request schema (``DiffusionRequest``):

* ``prompt``: ``str``; required on a session's first request, ``None`` keeps the current one;
* ``inputs["action"]``: ``f32[E, register_dim]`` register features of the block (default
  zeros), or ``f32[num_blocks, E, register_dim]`` (one per block of a streaming request);
* ``inputs["controls"]``: for a control-conditioned transformer (``control_dim > 0``),
  ``f32[f, control_dim]``, one control vector per frame of the block (default zeros), or
  ``f32[num_blocks, f, control_dim]``;
* ``inputs["seed"]``: noise seed of a new session, an integer in ``[0, 2**31)`` (default:
  derived from the session id);
* ``inputs["num_blocks"]``: blocks a streaming (stepwise) request wants (default 1).

:meth:`WorldPipeline.validate_ar_diffusion_request` checks all of it on the host before the
runner touches any session; ``forward`` and ``step`` parse with the same code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checks import check_positive_int
from ardiff_jax.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_jax.models._common import (
    DiTModules,
    PipelineBase,
    PipelineConfigBase,
    PipelineSession,
    block_noise,
    check_array,
    dit_kv_spec,
    nbytes,
    renoise,
    step_noise_key,
    with_tick_metadata,
)
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._loop import Denoiser, Lane, commit_pass, denoise
from ardiff_jax.types import ARDiffusionChunkMetadata, DiffusionRequest, StepResult

__all__ = ["WorldPipeline", "WorldPipelineConfig", "WorldBlock", "world_step", "world_step_batch", "clean_estimate",
           "PREDICTIONS"]

MAIN = "main"
TEXT = "text"


@dataclasses.dataclass(frozen=True)
class WorldPipelineConfig(PipelineConfigBase):
    """Pipeline policy around the transformer.

    Attributes:
      schedule: the few-step denoising schedule (default 1000/750/500/250).
      session_capacity: requested upper bound of resident sessions (the memory plan may keep fewer).
      weights_seed: seed of the random-init weights.
      noise_seed: mixed into session ids to derive per-session noise seeds.
    """


def _per_block_input(name: str, value: Any, shape: tuple[int, int], block: int, num_blocks: int,
                     absent_reason: str) -> np.ndarray | None:
    """A block's float input of ``shape`` (zeros by default), or one row per block ``[num_blocks, *shape]`` of a
    streaming request (row ``block`` taken); ``None`` when the model takes none (``shape`` has a 0), where a
    given value is refused with ``absent_reason``."""
    if not all(shape):
        if value is not None:
            raise ValueError(f"{absent_reason}; {name} must be absent")
        return None
    if value is None:
        return np.zeros(shape, np.float32)
    array = np.asarray(value)
    if array.ndim == 3:
        array = check_array(name, array, (num_blocks, *shape))[block]
    return check_array(name, array, shape)


class _BlockInputs(NamedTuple):
    """The per-block conditioning of a request, parsed on the host."""

    registers: np.ndarray | None  # f32[E, register_dim]
    controls: np.ndarray | None  # f32[f, control_dim]


class WorldBlock(NamedTuple):
    """One generated AR block.

    Attributes:
      latents: ``f32[f, C, H, W]`` the clean latent frames.
      first_frame: absolute index of the block's first frame in its session.
      block_index: blocks this session generated before this one.
      ar_diffusion: for a request that carried a typed tick, the chunk metadata the
        realtime control plane checks (``ARDiffusionChunkMetadata.from_tick(tick)``); else ``None``.
    """

    latents: jax.Array
    first_frame: int
    block_index: int
    ar_diffusion: ARDiffusionChunkMetadata | None = None


#: What a transformer's video output can mean (:func:`clean_estimate`).
PREDICTIONS = ("flow", "x0", "delta")


def clean_estimate(out: jax.Array, x_t: jax.Array, sigma: jax.Array, previous: jax.Array | None,
                   prediction: str) -> jax.Array:
    """The clean block ``x0 f32[f, C, H, W]`` from the transformer's output ``out`` (same shape).

    * ``"flow"`` (Wan's convention): ``out`` is ``v = noise - x0``, so ``x0 = x_t - sigma * v``;
    * ``"x0"``: ``out`` is the clean block itself;
    * ``"delta"``: ``out`` is the change from the last committed frame ``previous [C, H, W]``
      to each frame of the block, so ``x0 = previous + out``. A world whose frames change in
      a few places makes "nothing moves" the zero output, and the model spends its capacity
      on what does move.
    """
    if prediction == "flow":
        return x_t - sigma * out
    if prediction == "x0":
        return out
    if prediction == "delta":
        if previous is None:
            raise ValueError("prediction 'delta' needs the previous frame")
        return previous[None] + out
    raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")


def _world_step(
    graphdef: Any,
    params: Any,
    attention: Any,  # SelfAttentionBackend pytree (PagedKVCaches or DenseAttention)
    x_t: jax.Array,  # f32[f, C, H, W]
    t: jax.Array,  # f32[]
    sigma: jax.Array,  # f32[]
    sigma_next: jax.Array,  # f32[]
    session_key: jax.Array,  # key
    block_index: jax.Array,  # i32[]
    step_index: jax.Array,  # i32[]
    frame_start: jax.Array,  # i32[]
    text_kv: tuple[jax.Array, jax.Array],  # [L, N, H, D] each
    registers: jax.Array | None,  # f32[E, register_dim]
    controls: jax.Array | None = None,  # f32[f, control_dim]
    previous: jax.Array | None = None,  # f32[C, H, W]: the last committed frame ("delta" prediction)
    prediction: str = "flow",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)
    out = modules.transformer(x_t, t, frame_start, text_kv, None, registers, controls, attention=attention)
    x0 = clean_estimate(out.video, x_t, sigma, previous, prediction)
    noise = jax.random.normal(step_noise_key(session_key, block_index, step_index), x_t.shape, jnp.float32)
    return renoise(x0, sigma_next, noise), x0, out.k, out.v


#: One forward of the world pipeline: ``(graphdef, params, attention, ...) -> (x_next, x0, k, v)``.
#: ``x0`` is :func:`clean_estimate` of the transformer's output; ``x_next`` re-noises ``x0`` to
#: ``sigma_next`` with the stream ``step_index + 1`` of the block's key; ``k, v`` are the
#: block's per-layer ``[L, f*T, H, D]``. The commit forward is the same call with
#: ``t = sigma = sigma_next = 0``.
world_step = jax.jit(_world_step, static_argnums=0, static_argnames="prediction")


def _world_step_batch(
    graphdef: Any,
    params: Any,
    attention: Any,  # a batched PagedKVCaches: cursor i32[B, 3 + K + W]
    x_t: jax.Array,  # f32[B, f, C, H, W]
    t: jax.Array,  # f32[]
    sigma: jax.Array,  # f32[]
    sigma_next: jax.Array,  # f32[]
    session_keys: jax.Array,  # key[B]
    block_index: jax.Array,  # i32[B]
    step_index: jax.Array,  # i32[]
    frame_start: jax.Array,  # i32[B]
    text_kv: tuple[jax.Array, jax.Array],  # [B, L, N, H, D] each
    registers: jax.Array | None,  # f32[B, E, register_dim]
    controls: jax.Array | None = None,  # f32[B, f, control_dim]
    previous: jax.Array | None = None,  # f32[B, C, H, W]
    prediction: str = "flow",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    modules = nnx.merge(graphdef, params)

    def one_session(attention: Any, x_t: jax.Array, frame_start: jax.Array, text_kv: Any, registers: Any,
                    controls: Any, previous: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        out = modules.transformer(x_t, t, frame_start, text_kv, None, registers, controls, attention=attention)
        return clean_estimate(out.video, x_t, sigma, previous, prediction), out.k, out.v

    x0, k, v = jax.vmap(one_session, in_axes=(attention.vmap_axes(), 0, 0, 0, 0, 0, 0))(
        attention, x_t, frame_start, text_kv, registers, controls, previous)
    # Noise row by row: the "rbg" streams are not invariant under vmap (a vmapped draw differs from
    # the unbatched one), while lax.map draws each row exactly as world_step does.
    noise = jax.lax.map(lambda row: jax.random.normal(step_noise_key(row[0], row[1], step_index), x_t.shape[1:],
                                                      jnp.float32), (session_keys, block_index))
    return renoise(x0, sigma_next, noise), x0, k, v


#: :func:`world_step` for a batch of sessions in one program: ``attention`` is a batched
#: paged view (``ARDiffusionKVBatch.get_kv_caches``), every other per-session argument has a
#: leading batch axis ``B``; returns ``(x_next, x0)`` as ``f32[B, f, C, H, W]`` and ``k, v`` as
#: ``[B, L, f*T, H, D]``. Row ``i`` equals ``world_step`` on session ``i`` to float32 tolerance.
world_step_batch = jax.jit(_world_step_batch, static_argnums=0, static_argnames="prediction")


@dataclasses.dataclass(frozen=True)
class BlockProgram:
    """The in-flight blocks of a lane's sessions as the shared loop runs them (:meth:`WorldPipeline._block_program`).

    Attributes:
      x: the noisy blocks, ``f32[f, C, H, W]`` on a one-session lane, ``f32[bucket, f, C, H, W]`` on a batch.
      forward: ``(view, x, step) -> (x_next, x0, k, v, *extra)``: the step program on the stacked rows;
        the commit forward is ``step = num_steps`` (``t = sigma = 0``).
      after_commit: the lane's sessions as the commit forward's ``extra`` outputs update them (Matrix-Game's
        action rings); ``None``: they do not change.
    """

    x: jax.Array
    forward: Callable[[Any, jax.Array, int], tuple[jax.Array, ...]]
    after_commit: Callable[[tuple[jax.Array, ...]], Sequence[Any]] | None = None


@dataclasses.dataclass(frozen=True)
class _InFlightBlock:
    x_t: jax.Array  # f32[f, C, H, W]
    step: int
    frame_start: int
    block_index: int
    registers: jax.Array | None  # f32[E, register_dim]
    controls: jax.Array | None = None  # f32[f, control_dim]


@dataclasses.dataclass(frozen=True)
class _WorldSession(PipelineSession):
    last_block: jax.Array | None = None  # f32[f, C, H, W]
    inflight: _InFlightBlock | None = None
    blocks_emitted: int = 0  # stepwise: blocks of the streaming request

    nested_fields: ClassVar[Mapping[str, type]] = {"inflight": _InFlightBlock}

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        inflight = () if self.inflight is None else (self.inflight.x_t, self.inflight.registers,
                                                     self.inflight.controls)
        return (self.key, self.last_block, *inflight)


class WorldPipeline(PipelineBase):
    """Single-branch causal few-step world pipeline (the seed's ``WorldPipeline`` sketch), runnable.

    Args:
      config: a :class:`CausalDiTConfig` or a preset name (``"tiny"``, ``"medium"``, ``"wan_1_3b"``).
      pipeline_config: :class:`WorldPipelineConfig`.
      modules: weights to reuse (another pipeline's ``.modules`` of the same config); default:
        random init from ``pipeline_config.weights_seed``.
      device: where inputs and weights live (default: the first device, where the runtime
        puts its pools).

    Implements ``SupportsARDiffusionPipeline``, ``SupportsARDiffusionWarmup``,
    ``SupportsStepExecution`` and ``SupportsARDiffusionBatch`` (tick mode: several sessions'
    blocks as one vmapped program per denoise step). Drive it through
    :class:`~ardiff_jax.ARDiffusionEngine`.
    """

    supports_step_execution = True
    #: Whether :meth:`forward_batch` computes what :meth:`forward` computes. A subclass that
    #: changes a block's computation (``forward``, ``_advance``, ``_create_session``) without a
    #: batched counterpart of its own (``forward_batch`` or ``_advance_batch``) is not
    #: batchable: ``forward_batch`` is removed from it (``__init_subclass__``), so the engine
    #: runs its batches one request at a time. ``_block_program`` (rows and step program)
    #: serves both paths through the shared loop, so changing it keeps a subclass batchable.
    supports_batched_forward = True
    #: What the transformer's video output is: ``"flow"`` (``v``, Wan's convention) or ``"x0"``.
    prediction = "flow"
    pipeline_config_type = WorldPipelineConfig
    session_type = _WorldSession
    pipeline_config: WorldPipelineConfig
    _sessions: dict[str, _WorldSession]

    def __init__(self, config: CausalDiTConfig | str = "tiny", pipeline_config: WorldPipelineConfig | None = None,
                 *, modules: DiTModules | None = None, device: jax.Device | None = None) -> None:
        super().__init__(config, pipeline_config, modules=modules, device=device)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        changed = [name for name in ("forward", "_advance", "_create_session") if name in vars(cls)]
        if changed and not {"forward_batch", "_advance_batch"} & set(vars(cls)):
            # A protocol method set to None is not implemented: isinstance(pipeline,
            # SupportsARDiffusionBatch) is False, and the engine runs its batches one by one.
            cls.supports_batched_forward = False
            cls.forward_batch = None  # type: ignore[assignment]

    # -- capability ---------------------------------------------------------------------------
    @staticmethod
    def kv_spec_for(config: CausalDiTConfig, pipeline_config: WorldPipelineConfig | None = None
                    ) -> ARDiffusionKVCacheSpec:
        """The spec a pipeline of ``config`` reports (no weights needed: usable for any size)."""
        pipeline_config = WorldPipelineConfig() if pipeline_config is None else pipeline_config
        return dit_kv_spec(
            config,
            kv_branches=(ARDiffusionKVBranchSpec(MAIN, 0),),
            cross_attention=(ARDiffusionCrossAttentionKVSpec(TEXT, config.text_len),),
            session_capacity=pipeline_config.session_capacity,
            model_owned_bytes=WorldPipeline.model_owned_bytes_bound(config),
        )

    @staticmethod
    def model_owned_bytes_bound(config: CausalDiTConfig) -> int:
        """Upper bound of one session's device state: in-flight + last block, registers, key."""
        block = nbytes(config.block_shape)
        registers = nbytes((config.num_register_tokens, config.register_dim))
        controls = nbytes((config.frames_per_block, config.control_dim))
        return 2 * block + registers + controls + 16

    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        block = tuple(cfg.block_shape)
        return {"last_block": block, "inflight.x_t": block,
                "inflight.registers": (cfg.num_register_tokens, cfg.register_dim),
                "inflight.controls": (cfg.frames_per_block, cfg.control_dim)}

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[DiffusionRequest]:
        """One block with a fixed prompt: compiles the step program and the text projection."""
        yield DiffusionRequest("world-warmup-0", prompt="warmup",
                               extra_args={"session_id": session_id, "reset": True})

    # -- request parsing (host only: errors before any device work) ---------------------------
    @staticmethod
    def _num_blocks(request: DiffusionRequest) -> int:
        return check_positive_int("inputs['num_blocks']", request.inputs.get("num_blocks", 1))

    def _parse_new_block(self, session_id: str, request: DiffusionRequest) -> tuple[str | None, _BlockInputs]:
        """``(prompt, inputs)`` of the block ``request`` starts; the one parser of validate, forward and step."""
        num_blocks = self._num_blocks(request)
        prompt = self._check_prompt_and_seed(session_id, request, request.prompt)
        session = self._sessions.get(session_id)
        block = min(0 if session is None else session.blocks_emitted, num_blocks - 1)
        action = self._parse_action(request.inputs.get("action"), block, num_blocks)
        controls = self._parse_controls(request.inputs.get("controls"), block, num_blocks)
        return prompt, _BlockInputs(action, controls)

    def _parse_controls(self, controls: Any, block: int, num_blocks: int) -> np.ndarray | None:
        cfg = self.config
        return _per_block_input("inputs['controls']", controls, (cfg.frames_per_block, cfg.control_dim), block,
                                num_blocks, "this WorldPipeline's transformer is not control-conditioned (control_dim 0)")

    def _parse_action(self, action: Any, block: int, num_blocks: int) -> np.ndarray | None:
        cfg = self.config
        return _per_block_input("inputs['action']", action, (cfg.num_register_tokens, cfg.register_dim), block,
                                num_blocks, "this WorldPipeline has no register tokens")

    # -- device work ----------------------------------------------------------------------------
    def _session(self, session_id: str, request: DiffusionRequest, prompt: str | None) -> _WorldSession:
        """The session's model state, or a new one (not stored: the caller stores what the call made of it)."""
        session = self._sessions.get(session_id)
        return self._create_session(session_id, request, prompt) if session is None else session

    def _sync_prompt(self, state: Any, session: _WorldSession, prompt: str | None) -> _WorldSession:
        """Switch the state's text K/V to ``prompt`` (``None``: keep the session's); the session with it."""
        if prompt is not None and prompt != session.prompt:
            # New prompt: drop the old text K/V (self-attention history stays) and repopulate.
            state.clear_cross_attention()
            session = dataclasses.replace(session, prompt=prompt)
        if not state.is_cross_attention_populated(MAIN, TEXT):
            k, v = self._text_kv(session.prompt)
            state.populate_cross_attention(MAIN, TEXT, zip(k, v, strict=True))
        return session

    def _start_block(self, state: Any, session: _WorldSession, block: _BlockInputs, *,
                     staged: bool = False) -> _WorldSession:
        """The session with its next block in flight (its initial noise and inputs on the device).

        ``staged``: ``session`` is also the installed value, or shares its arrays (a batched
        tick, :meth:`_staged_session`); a subclass must then not donate any of them.
        """
        block_index = np.int32(session.block_index)
        x_t = block_noise(session.key, block_index, self.config.block_shape)
        registers = None if block.registers is None else self._to_device(block.registers)
        controls = None if block.controls is None else self._to_device(block.controls)
        inflight = _InFlightBlock(x_t=x_t, step=0, frame_start=state.adapter(MAIN).committed_frames,
                                  block_index=session.block_index, registers=registers, controls=controls)
        return dataclasses.replace(session, inflight=inflight)

    def _block_program(self, lane: Lane, sessions: Sequence[_WorldSession]) -> BlockProgram:
        """The sessions' in-flight blocks stacked for ``lane`` and :data:`world_step` (or
        :data:`world_step_batch`) over them: the world pipeline's rows and step program."""
        rows = lane.stack([(session.inflight.x_t, session.key, np.int32(session.inflight.block_index),
                            np.int32(session.inflight.frame_start), state.get_cross_attention_kv(MAIN, TEXT),
                            session.inflight.registers, session.inflight.controls, self._previous_frame(session))
                           for state, session in zip(lane.states, sessions, strict=True)])
        x, keys, block_index, frame_start, text_kv, registers, controls, previous = rows
        program = lane.pick(world_step, world_step_batch)  # looked up per call: a benchmark may wrap them

        def forward(view: Any, x: jax.Array, step: int) -> tuple[jax.Array, ...]:
            t, sigma, sigma_next = self.schedule.step_args(step)
            return program(self._graphdef, self._params, view, x, t, sigma, sigma_next, keys, block_index,
                           np.int32(step), frame_start, text_kv, registers, controls, previous,
                           prediction=self.prediction)

        return BlockProgram(x, forward)

    def _denoise(self, lane: Lane, sessions: Sequence[_WorldSession], steps: range
                 ) -> tuple[list[_WorldSession], jax.Array | None]:
        """Run ``steps`` of the sessions' in-flight blocks through the shared loop (:func:`~ardiff_jax.models._loop.denoise`).

        Each step is one forward that writes nothing, then ``x0 = clean_estimate`` re-noised to
        the next sigma inside the program. When ``steps`` reach the schedule's end, the clean
        block (:meth:`_finish_block`) gets one forward at ``t = 0`` whose K/V are committed, and
        it is returned (``f32[f, C, H, W]``, ``f32[bucket, f, C, H, W]`` on a batch lane);
        otherwise it is ``None``. Returns ``(the sessions with their in-flight blocks advanced, block)``.
        """
        cfg, num_steps = self.config, self.schedule.num_steps
        seq_len = cfg.frames_per_block * cfg.tokens_per_frame
        block = self._block_program(lane, sessions)
        denoiser = Denoiser(branches=(MAIN,), seq_len=seq_len,
                            evaluate=lambda views, carry, step: block.forward(views[0], carry[0], step),
                            advance=lambda step, carry, outs, run: (outs[0], outs[1]))
        x, x0 = denoise(lane, denoiser, (block.x, None), steps)
        if steps.stop < num_steps:
            return [dataclasses.replace(session, inflight=dataclasses.replace(session.inflight, x_t=x_t,
                                                                               step=steps.stop))
                    for session, x_t in zip(sessions, lane.unstack(x), strict=True)], None
        x0 = self._finish_block(x0)

        def commit(view: Any) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
            _, _, k, v, *extra = block.forward(view, x0, num_steps)
            return (k, v), tuple(extra)

        extra = commit_pass(lane, MAIN, seq_len, commit)
        return list(sessions if block.after_commit is None else block.after_commit(extra)), x0

    def _previous_frame(self, session: _WorldSession) -> jax.Array | None:
        """The last committed frame ``f32[C, H, W]`` a ``"delta"`` prediction adds to (``None`` otherwise)."""
        if self.prediction != "delta":
            return None
        if session.last_block is None:
            # Nothing yet: the change from black. Committed to the device like every later frame: an uncommitted
            # array here compiled the session's first step a second time (jit keys on committedness).
            return self._to_device(np.zeros(self.config.block_shape[1:], np.float32))
        return session.last_block[-1]

    def _finish_block(self, x0: jax.Array) -> jax.Array:
        """The clean block as it is committed and returned (a subclass may project it, e.g. quantise)."""
        return x0

    def _advance_lane(self, lane: Lane, sessions: Sequence[_WorldSession], steps: range
                      ) -> tuple[list[_WorldSession], list[WorldBlock] | None]:
        """``steps`` of the sessions' in-flight blocks: ``(the sessions after them, blocks)``, the blocks
        ``None`` until the last step, then each session's block, committed."""
        sessions, x0 = self._denoise(lane, sessions, steps)
        if x0 is None:
            return sessions, None
        done, blocks = [], []
        for session, latents in zip(sessions, lane.unstack(x0), strict=True):
            inflight = session.inflight
            done.append(dataclasses.replace(session, inflight=None, last_block=latents,
                                            block_index=session.block_index + 1))
            blocks.append(WorldBlock(latents=latents, first_frame=inflight.frame_start,
                                     block_index=inflight.block_index))
        return done, blocks

    def _advance(self, state: Any, session: _WorldSession) -> tuple[_WorldSession, WorldBlock | None]:
        """Run the in-flight block's next denoise step: ``(the session after it, block)``, the block ``None``
        until the last step, which commits it."""
        step = session.inflight.step
        sessions, blocks = self._advance_lane(Lane.single(state), [session], range(step, step + 1))
        return sessions[0], None if blocks is None else blocks[0]

    # -- entry points ---------------------------------------------------------------------------
    def validate_ar_diffusion_request(self, session_id: str, request: DiffusionRequest) -> None:
        """Every host-side check of ``request``; the runner runs it before touching the session.

        A request that continues an in-flight stepwise block carries nothing new to check
        beyond ``num_blocks``.
        """
        self._num_blocks(request)
        session = self._sessions.get(session_id)
        if session is None or session.inflight is None:
            self._parse_new_block(session_id, request)

    def forward(self, request: DiffusionRequest) -> WorldBlock:
        """Generate one block on the bound session (tick mode)."""
        state = self._bound_state()
        session_id = state.session_id
        session = self._sessions.get(session_id)
        if session is not None and session.inflight is not None:
            raise RuntimeError(
                f"WorldPipeline session {session_id!r} has an in-flight stepwise block; tick requests cannot "
                "interleave with it")
        prompt, block_inputs = self._parse_new_block(session_id, request)
        session = self._session(session_id, request, prompt)
        session = self._sync_prompt(state, session, prompt)
        session = self._start_block(state, session, block_inputs)
        block = None
        while block is None:
            session, block = self._advance(state, session)
        self._sessions[session_id] = session  # only once the block's device work returned
        return with_tick_metadata(block, request)

    def forward_batch(self, requests: Sequence[DiffusionRequest]) -> list[WorldBlock]:
        """Generate one block for each request's session as one batched program per denoise step.

        Row ``i`` is request ``i`` on ``batch.states[i]``. Per-session preparation (parsing,
        prompt and cross caches, a new session's prefill) runs per session as in
        :meth:`forward`; the denoise steps and the clean commit run once for the whole batch
        (:data:`world_step_batch`), and every block is committed with one donated write. Model
        state is staged and installed by the runner only once it has awaited the batch's device
        work (``batch.defer_publish``): a batch that raises, here or when awaited, leaves every
        session's model state as it was (all or nothing).
        """
        batch = self._bound_batch()
        states = batch.states
        if len(requests) != len(states):
            raise ValueError(f"forward_batch got {len(requests)} requests for a batch of {len(states)} sessions")
        staged: dict[str, _WorldSession] = {}
        for request, state in zip(requests, states, strict=True):
            session_id = state.session_id
            current = self._sessions.get(session_id)
            if current is not None and current.inflight is not None:
                raise RuntimeError(f"{type(self).__name__} session {session_id!r} has an in-flight stepwise block; "
                                   "tick requests cannot interleave with it")
            prompt, block_inputs = self._parse_new_block(session_id, request)
            session = self._staged_session(session_id, request, prompt)
            session = self._sync_prompt(state, session, prompt)
            staged[session_id] = self._start_block(state, session, block_inputs, staged=True)
        sessions, blocks = self._advance_batch(batch, [staged[state.session_id] for state in states])
        staged = {state.session_id: session for state, session in zip(states, sessions, strict=True)}
        batch.defer_publish(functools.partial(self._publish_staged, staged),
                            [session.device_arrays() for session in staged.values()])
        return [with_tick_metadata(block, request) for block, request in zip(blocks, requests, strict=True)]

    def _advance_batch(self, batch: Any, sessions: list[_WorldSession]) -> tuple[list[_WorldSession],
                                                                                   list[WorldBlock]]:
        """Every denoise step and the clean commit of the sessions' in-flight blocks: the shared loop on the
        batch (one batched program per step, the blocks' K/V in one donated write). ``(sessions, blocks)``."""
        return self._advance_lane(Lane.batch(batch), sessions, range(self.schedule.num_steps))

    def step(self, request: DiffusionRequest) -> StepResult:
        """One denoise step of the streaming request (session id = request id)."""
        state = self._bound_state()
        session_id = state.session_id
        num_blocks = self._num_blocks(request)
        session = self._sessions.get(session_id)
        if session is None or session.inflight is None:
            prompt, block_inputs = self._parse_new_block(session_id, request)
            session = self._session(session_id, request, prompt)
            session = self._sync_prompt(state, session, prompt)
            session = self._start_block(state, session, block_inputs)
        session, block_out = self._advance(state, session)
        if block_out is not None:
            session = dataclasses.replace(session, blocks_emitted=session.blocks_emitted + 1)
        self._sessions[session_id] = session  # only once the step's device work returned
        if block_out is None:
            return StepResult(finished=False)
        return StepResult(finished=session.blocks_emitted >= num_blocks, output=with_tick_metadata(block_out, request))
