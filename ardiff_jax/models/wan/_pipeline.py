"""``CausalWanPipeline``: text-to-video with a published causal Wan (Self-Forcing, LongLive) on the paged runtime.

The sampler is Self-Forcing's, which is the :class:`~ardiff_jax.models.WorldPipeline`
loop with Wan's settings:

* the step list ``[1000, 750, 500, 250]`` warped by the training scheduler's shift 5
  (:func:`warped_schedule`: ``[1000, 937.5, 833.33, 625]``), each step predicting the flow,
  taking ``x0 = x_t - sigma * flow`` and re-noising with fresh noise;
* after the last step one forward at ``t = 0`` over the clean block writes its K/V (the
  commit pass), so later blocks attend to clean history;
* 3 latent frames per block; the attention policy of the checkpoint (:data:`CAUSAL_WAN_POLICIES`):
  Self-Forcing attends to everything up to its trained 21 frames and then slides a
  21-frame window; LongLive keeps a 3-frame sink plus the newest 9 frames.

Conditioning is the text encoder's output, ``inputs["prompt_embeds"]`` (``[L <= text_len,
text_dim]``, umT5-XXL: ``[<= 512, 4096]``), zero-padded to ``text_len`` as Wan pads it. It
is required on a session's first request and may come again with any request: when its
content differs from the session's current prompt, the session's text cross-attention K/V
are replaced (one functional swap in the runtime) and the self-attention history is kept.
A request that carries the same embeddings again costs nothing.

Each block returns the denoised latents ``f32[3, C, H/8, W/8]`` (:class:`~ardiff_jax.models.WorldBlock`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.models._common import FewStepSchedule, check_prompt, check_seed, resolve_config, weights_key
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._dit import CausalDiT
from ardiff_jax.kv import slot_of_frame, visible_history
from ardiff_jax.models._attention import MaskedAttention, block_causal_mask
from ardiff_jax.models._common import nbytes
from ardiff_jax.models._world import MAIN, TEXT, WorldBlock, WorldPipeline, WorldPipelineConfig, _BlockInputs, _WorldSession
from ardiff_jax.models.wan._vae import (
    VAEDecodeCache,
    WanVAE,
    _decode_step_jit,
    _decode_step_keep_jit,
    cache_nbytes,
    init_decode_cache,
)
from ardiff_jax.types import ARDiffusionChunkMetadata, DiffusionRequest

__all__ = ["CausalWanPipeline", "CausalWanPipelineConfig", "CAUSAL_WAN_POLICIES", "WanBlock", "WanModules",
           "warped_schedule", "with_policy"]


def warped_schedule(steps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0), shift: float = 5.0,
                    num_train_timesteps: int = 1000) -> FewStepSchedule:
    """Self-Forcing's denoising list: ``steps`` looked up in the shifted training schedule.

    The training scheduler has ``sigma_i = linspace(1, 0, T + 1)[:-1]`` shifted to
    ``s * sigma / (1 + (s - 1) * sigma)`` and timesteps ``T * sigma'``; step ``t`` of the
    list becomes that schedule's entry ``T - t`` (``t = 0`` past its end). Evaluated in
    float32 as the original. ``(1000, 750, 500, 250)`` at shift 5 gives
    ``(1000, 937.5, 833.33, 625)``.
    """
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    total = int(num_train_timesteps)
    sigmas = np.linspace(1.0, 0.0, total + 1, dtype=np.float32)[:-1]
    shifted = np.float32(shift) * sigmas / (np.float32(1.0) + np.float32(shift - 1.0) * sigmas)
    timesteps = np.concatenate([shifted * np.float32(total), np.zeros((1,), np.float32)])
    picked = []
    for step in steps:
        if not (0 < float(step) <= total) or float(step) != int(step):
            raise ValueError(f"denoising steps must be integers in (0, {total}], got {step!r}")
        picked.append(float(timesteps[total - int(step)]))
    return FewStepSchedule(timesteps=tuple(picked), num_train_timesteps=float(total))


#: Attention policies of the published checkpoints: frames per block, window and sink
#: (``sink_frames + window_frames`` frames are visible, the current block included).
CAUSAL_WAN_POLICIES: dict[str, dict[str, int]] = {
    # Self-Forcing: global attention up to its trained length (21 latent frames), then sliding.
    "self-forcing": {"frames_per_block": 3, "window_frames": 21, "sink_frames": 0},
    # LongLive: local_attn_size 12 with a 3-frame frame sink that never rolls.
    "longlive": {"frames_per_block": 3, "window_frames": 9, "sink_frames": 3},
}


def with_policy(config: CausalDiTConfig | str, policy: str) -> CausalDiTConfig:
    """``config`` with the block, window and sink of a :data:`CAUSAL_WAN_POLICIES` entry."""
    try:
        fields = CAUSAL_WAN_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown causal-Wan policy {policy!r}; choose from {sorted(CAUSAL_WAN_POLICIES)}") from None
    return resolve_config(config).replace(**fields)


@dataclasses.dataclass(frozen=True)
class CausalWanPipelineConfig(WorldPipelineConfig):
    """Policy around a causal Wan: Self-Forcing's warped 4-step schedule by default.

    Attributes:
      schedule: the denoising list (:func:`warped_schedule`; default ``[1000, 750, 500, 250]``
        warped with shift 5).
      session_capacity: requested upper bound of resident sessions (the memory plan may keep fewer).
      weights_seed: seed of random weights (``--random-weights``: benchmarks of the real geometry).
      noise_seed: mixed into session ids to derive per-session noise seeds.
      recache_on_prompt_switch: LongLive's recache: when the prompt changes, recompute the K/V
        of every frame the next block sees (sink and window) under the new prompt, so the
        history stops pulling toward the old one. Costs one forward over the visible frames
        per switch and keeps those frames' clean latents per session (model-owned state).
    """

    schedule: FewStepSchedule = dataclasses.field(default_factory=warped_schedule)
    session_capacity: int = 2
    recache_on_prompt_switch: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.recache_on_prompt_switch, bool):
            raise TypeError(f"CausalWanPipelineConfig recache_on_prompt_switch must be a bool, got "
                            f"{self.recache_on_prompt_switch!r}")


class WanModules(nnx.Module):
    """What a causal-Wan pipeline computes with: the transformer alone (text comes in as embeddings)."""

    def __init__(self, transformer: CausalDiT) -> None:
        self.transformer = transformer

    @classmethod
    def create(cls, config: CausalDiTConfig, seed: int) -> WanModules:
        """Random weights of ``config`` in one compiled program (``--random-weights``)."""
        key = weights_key(seed)
        graphdef = nnx.split(nnx.eval_shape(lambda: cls(CausalDiT(config, rngs=nnx.Rngs(key)))))[0]
        return nnx.merge(graphdef, _init_wan_params(config, key))


@functools.partial(jax.jit, static_argnums=0)
def _init_wan_params(config: CausalDiTConfig, key: jax.Array) -> Any:
    """One compiled init per config: the seed's key is an argument, so every seed reuses it (as ``DiTModules``)."""
    return nnx.split(WanModules(CausalDiT(config, rngs=nnx.Rngs(key))))[1]


def _wan_text_kv(graphdef: Any, params: Any, embeds: jax.Array) -> tuple[jax.Array, jax.Array]:
    return nnx.merge(graphdef, params).transformer.text_cross_kv(embeds)


#: ``(graphdef, params, f32[text_len, text_dim]) -> ([L, N, H, D], [L, N, H, D])``: a prompt's text K/V.
wan_text_kv = jax.jit(_wan_text_kv, static_argnums=0)


def _wan_recache(graphdef: Any, params: Any, latents: jax.Array, starts: jax.Array,
                 text_kv: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, params).transformer
    config = model.config
    mask = block_causal_mask(config, starts, jnp.ones(starts.shape, bool))
    times = jnp.zeros(starts.shape, jnp.float32)
    out = model.forward_blocks(latents, times, starts, text_kv, attention=MaskedAttention(mask))
    return out.k, out.v


#: ``(graphdef, params, f32[B, f, C, H, W], i32[B], text_kv) -> (k, v) [L, B*f*T, H, D]``: the K/V of
#: ``B`` committed blocks recomputed at ``t = 0`` in one block-causal pass (a prompt switch's recache).
wan_recache = jax.jit(_wan_recache, static_argnums=0)


class WanBlock(NamedTuple):
    """One generated block of a causal Wan.

    Attributes:
      latents: ``f32[f, C, H/8, W/8]`` the clean latent frames.
      video: ``uint8[F, H, W, 3]`` the block decoded by the session's streaming VAE
        (``F = 1 + 4(f-1)`` for a session's first block, ``4f`` after), or ``None`` for a
        pipeline without a VAE.
      first_frame: absolute index of the block's first latent frame in its session.
      block_index: blocks this session generated before this one.
      ar_diffusion: the chunk metadata of a typed tick (``None`` otherwise).
    """

    latents: jax.Array
    video: jax.Array | None
    first_frame: int
    block_index: int
    ar_diffusion: ARDiffusionChunkMetadata | None = None


@jax.jit
def _to_uint8_frames(video: jax.Array) -> jax.Array:
    """``f32[F, 3, H, W]`` in ``[-1, 1]`` -> ``uint8[F, H, W, 3]`` (what a video file or a browser shows)."""
    return jnp.round((jnp.clip(video, -1.0, 1.0) + 1.0) * 127.5).astype(jnp.uint8).transpose(0, 2, 3, 1)


class _Prompt(NamedTuple):
    """A checked prompt: its digest and either its embeddings (zero-padded to ``text_len``) or, for a text
    prompt, the text the pipeline's encoder turns into them when they are needed."""

    digest: str
    embeds: np.ndarray | None  # f32[text_len, text_dim]
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class _WanSession(_WorldSession):
    #: With recache on: the clean latents of every resident frame ``f32[sink + window, C, H, W]``,
    #: frame ``i`` at the slot of its KV page (sink frames first, then the ring).
    resident: jax.Array | None = None
    #: With a VAE: the streaming decoder's causal-conv cache (the last frames of every conv).
    vae_cache: VAEDecodeCache | None = None
    donated_fields: ClassVar[tuple[str, ...]] = ("vae_cache",)  # the streaming decode step donates it

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        vae = () if self.vae_cache is None else tuple(self.vae_cache.convs)
        return (*super().device_arrays(), self.resident, *vae)


class CausalWanPipeline(WorldPipeline):
    """Text-to-video with a causal Wan transformer: Self-Forcing's sampler on the paged runtime.

    Args:
      config: a :class:`CausalDiTConfig` or preset name (default ``"wan2.1-t2v-1.3b"``: the
        Self-Forcing policy; :func:`with_policy` picks another).
      pipeline_config: :class:`CausalWanPipelineConfig`.
      modules: the weights, e.g. ``WanModules(load_checkpoint(path))``; default random weights
        from ``pipeline_config.weights_seed`` (the real geometry without a checkpoint).
      vae: a :class:`WanVAE`: every block is also decoded to video (``WanBlock.video``) by a
        streaming decoder whose cache is the session's state.
      text_encoder: turns a text ``prompt`` into its features (``encode(str) -> f32[L, text_dim]``,
        e.g. :class:`WanTextEncoder`, which caches per prompt); without one, requests carry
        ``inputs["prompt_embeds"]``.
      device: where inputs and weights live (default: the first device).

    Use :meth:`from_checkpoint` to load a published checkpoint. Request schema: ``prompt``
    (a string, with a text encoder) or ``inputs["prompt_embeds"]`` (``f32[L <= text_len,
    text_dim]``): one of them is required first, and one that differs from the session's
    current prompt switches it; ``inputs["seed"]``, ``inputs["num_blocks"]`` (stepwise).
    """

    pipeline_config_type = CausalWanPipelineConfig
    session_type = _WanSession
    prediction = "flow"
    pipeline_config: CausalWanPipelineConfig

    def __init__(self, config: CausalDiTConfig | str = "wan2.1-t2v-1.3b",
                 pipeline_config: CausalWanPipelineConfig | None = None, *, modules: WanModules | None = None,
                 vae: WanVAE | None = None, text_encoder: Any = None, device: jax.Device | None = None) -> None:
        config = resolve_config(config)
        if text_encoder is not None and not callable(getattr(text_encoder, "encode", None)):
            raise TypeError(f"text_encoder must have encode(prompt) -> f32[L, text_dim], got "
                            f"{type(text_encoder).__name__}")
        if vae is not None:
            if not isinstance(vae, WanVAE):
                raise TypeError(f"vae must be a WanVAE (load_vae), got {type(vae).__name__}")
            if vae.config.z_dim != config.latent_channels:
                raise ValueError(f"the VAE's latents have {vae.config.z_dim} channels, the transformer's "
                                 f"{config.latent_channels}")
        super().__init__(config, pipeline_config, modules=modules, device=device)
        self.vae = vae
        self.text_encoder = text_encoder
        if vae is not None:
            self._vae_graphdef, vae_params = nnx.split(vae)
            self._vae_params = jax.device_put(vae_params, self.device)

    @classmethod
    def from_checkpoint(cls, path: Any, config: CausalDiTConfig | str | None = None, *, policy: str | None = None,
                        pipeline_config: CausalWanPipelineConfig | None = None, vae: Any = None,
                        text_encoder: Any = None, device: jax.Device | None = None,
                        **load_options: Any) -> CausalWanPipeline:
        """A pipeline on the weights at ``path`` (any format :func:`load_checkpoint` reads).

        ``policy`` (``"self-forcing"`` or ``"longlive"``) sets block, window and sink; ``vae``
        (a :class:`WanVAE` or a path :func:`load_vae` reads) decodes every block to video;
        ``load_options`` go to :func:`load_checkpoint` (``format``, ``dtype``, ``lora``, ...).
        """
        from ardiff_jax.models.wan._checkpoint import load_checkpoint

        transformer = load_checkpoint(path, config, **load_options)
        if policy is not None:
            transformer = _with_config(transformer, with_policy(transformer.config, policy))
        if vae is not None and not isinstance(vae, WanVAE):
            from ardiff_jax.models.wan._vae import load_vae

            vae = load_vae(vae, dtype=load_options.get("dtype"))
        return cls(transformer.config, pipeline_config, modules=WanModules(transformer), vae=vae,
                   text_encoder=text_encoder, device=device)

    @classmethod
    def create_modules(cls, config: CausalDiTConfig, seed: int) -> WanModules:
        return WanModules.create(config, seed)

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: Any) -> None:
        if config.image_len or config.num_register_tokens or config.control_dim:
            raise ValueError("CausalWanPipeline runs text-to-video transformers: image_len, num_register_tokens and "
                             f"control_dim must be 0, got {config.image_len}, {config.num_register_tokens}, "
                             f"{config.control_dim}")
        if getattr(pipeline_config, "recache_on_prompt_switch", False) and (
                config.sink_frames % config.frames_per_block or config.window_frames % config.frames_per_block):
            raise ValueError("recache_on_prompt_switch recomputes whole blocks: sink_frames "
                             f"({config.sink_frames}) and window_frames ({config.window_frames}) must be multiples of "
                             f"frames_per_block ({config.frames_per_block})")

    @staticmethod
    def kv_spec_for(config: CausalDiTConfig, pipeline_config: Any = None) -> Any:
        CausalWanPipeline.check_compatible(config, pipeline_config)
        spec = WorldPipeline.kv_spec_for(config, pipeline_config)
        if pipeline_config is None or not pipeline_config.recache_on_prompt_switch:
            return spec
        resident = nbytes((config.sink_frames + config.window_frames, *config.block_shape[1:]))
        return dataclasses.replace(
            spec, model_owned_state_bytes_per_session=spec.model_owned_state_bytes_per_session + resident)

    def ar_diffusion_kv_cache_spec(self) -> Any:
        spec = self.kv_spec_for(self.config, self.pipeline_config)
        if self.vae is None:
            return spec
        # The streaming decoder's cache is per-session state: capacity from memory counts it.
        return dataclasses.replace(spec, model_owned_state_bytes_per_session=(
            spec.model_owned_state_bytes_per_session + self.vae_cache_bytes))

    @property
    def vae_cache_bytes(self) -> int:
        """Bytes of one session's streaming-decoder cache (0 without a VAE)."""
        if self.vae is None:
            return 0
        return cache_nbytes(self.vae.config, self.config.block_shape[2:], self.vae.config.dtype)

    def ar_diffusion_weights_fingerprint(self) -> str:
        """The transformer's digest, combined with the VAE's when there is one (its cache is session state)."""
        base = super().ar_diffusion_weights_fingerprint()
        if self.vae is None:
            return base
        if getattr(self, "_vae_fingerprint", None) is None:
            from ardiff_jax.models._common import weights_fingerprint

            self._vae_fingerprint = weights_fingerprint(self._vae_params)
        return hashlib.sha256(f"{base}+vae:{self._vae_fingerprint}".encode()).hexdigest()

    def import_ar_diffusion_session(self, session_id: str, state: Any) -> None:
        """As the base, plus the VAE cache: validated against this pipeline's cache layout before anything changes."""
        cache = None
        if isinstance(state, dict) and state.get("vae_cache") is not None:
            cache = self._checked_vae_cache(state["vae_cache"])
            state = {**state, "vae_cache": None}
        super().import_ar_diffusion_session(session_id, state)
        if cache is not None:
            self._sessions[session_id] = dataclasses.replace(self._sessions[session_id], vae_cache=cache)

    def _checked_vae_cache(self, value: Any) -> VAEDecodeCache:
        if self.vae is None:
            raise ValueError("session state has a VAE cache, but this CausalWanPipeline has no VAE")
        template = jax.eval_shape(lambda: init_decode_cache(self.vae.config, self.config.block_shape[2:]))
        if not isinstance(value, dict) or sorted(value) != ["convs", "started"] \
                or not isinstance(value["started"], bool) or not isinstance(value["convs"], (list, tuple)) \
                or len(value["convs"]) != len(template.convs):
            raise ValueError(f"session state vae_cache must be {{'convs': {len(template.convs)} arrays, 'started': "
                             "bool}")
        convs = []
        for index, (array, want) in enumerate(zip(value["convs"], template.convs, strict=True)):
            if not isinstance(array, jax.Array) or array.shape != want.shape or array.dtype != want.dtype:
                got = f"{getattr(array, 'dtype', type(array).__name__)}{list(getattr(array, 'shape', ()))}"
                raise ValueError(f"session state vae_cache.convs[{index}] must be {want.dtype}{list(want.shape)}, "
                                 f"got {got}")
            convs.append(jax.device_put(array, self.device))
        return VAEDecodeCache(tuple(convs), value["started"])

    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        return {**super()._session_shapes(), "resident": (cfg.sink_frames + cfg.window_frames, *cfg.block_shape[1:])}

    # -- request parsing (host only) ------------------------------------------------------------
    def _check_embeds(self, embeds: Any) -> _Prompt:
        padded = self._padded_embeds(embeds)
        return _Prompt(hashlib.sha256(padded.tobytes()).hexdigest(), padded)

    def _padded_embeds(self, embeds: Any) -> np.ndarray:
        """Text features checked on the host and zero-padded to ``f32[text_len, text_dim]``."""
        cfg = self.config
        name = "inputs['prompt_embeds']"
        try:
            array = np.asarray(embeds, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a float array [L <= {cfg.text_len}, {cfg.text_dim}], got "
                             f"{type(embeds).__name__}") from None
        if array.ndim != 2 or not 1 <= array.shape[0] <= cfg.text_len or array.shape[1] != cfg.text_dim:
            raise ValueError(f"{name} must be [L <= {cfg.text_len}, {cfg.text_dim}] (the text encoder's features), "
                             f"got {list(array.shape)}")
        if not np.isfinite(array).all():
            raise ValueError(f"{name} must be finite")
        # Wan pads the context with zeros to text_len *before* its text MLP and attends to every
        # position without a mask, so the padding is part of the conditioning.
        padded = np.zeros((cfg.text_len, cfg.text_dim), np.float32)
        padded[: array.shape[0]] = array
        return padded

    def _parse_new_block(self, session_id: str, request: DiffusionRequest) -> tuple[Any, _BlockInputs]:
        self._num_blocks(request)
        for key in ("action", "controls"):
            if request.inputs.get(key) is not None:
                raise ValueError(f"CausalWanPipeline takes no inputs[{key!r}]: it is a text-to-video model")
        if request.inputs.get("seed") is not None:
            check_seed(request.inputs["seed"])
        embeds = request.inputs.get("prompt_embeds")
        if request.prompt is not None:
            if self.text_encoder is None:
                raise ValueError("CausalWanPipeline has no text encoder: condition it on inputs['prompt_embeds'] "
                                 f"(the text encoder's [L <= {self.config.text_len}, {self.config.text_dim}] "
                                 "features), or build it with text_encoder=")
            if embeds is not None:
                raise ValueError("give a prompt or inputs['prompt_embeds'], not both")
            text = check_prompt("CausalWanPipeline prompt", request.prompt)
            return _Prompt("text:" + hashlib.sha256(text.encode("utf-8")).hexdigest(), None, text), _BlockInputs(
                None, None)
        if embeds is None:
            if session_id not in self._sessions:
                raise ValueError(f"CausalWanPipeline session {session_id!r} has no prompt yet: its first request "
                                 "needs a prompt or inputs['prompt_embeds'] (the session may have been evicted or "
                                 "reset)")
            return None, _BlockInputs(None, None)
        return self._check_embeds(embeds), _BlockInputs(None, None)

    # -- device work ----------------------------------------------------------------------------
    def _create_session(self, session_id: str, request: DiffusionRequest, prompt: Any) -> Any:
        return super()._create_session(session_id, request, None if prompt is None else prompt.digest)

    def _sync_prompt(self, state: Any, session: Any, prompt: _Prompt | None) -> Any:
        switched = prompt is not None and prompt.digest != session.prompt
        if switched:
            # New prompt: drop the old text K/V (self-attention history stays) and repopulate.
            state.clear_cross_attention()
            session = dataclasses.replace(session, prompt=prompt.digest)
        if not state.is_cross_attention_populated(MAIN, TEXT):
            if prompt is None:  # the runtime keeps a session's text K/V with its pages (offload included)
                raise RuntimeError(f"session {state.session_id!r} lost its text cross-attention K/V; send "
                                   "inputs['prompt_embeds'] again")
            embeds = prompt.embeds if prompt.embeds is not None else self._padded_embeds(
                self.text_encoder.encode(prompt.text))  # the encoder caches per prompt
            k, v = wan_text_kv(self._graphdef, self._params, self._to_device(embeds))
            state.populate_cross_attention(MAIN, TEXT, zip(k, v, strict=True))
            if switched and self.pipeline_config.recache_on_prompt_switch:
                self._recache(state, session, (k, v))
        return session

    def _recache(self, state: Any, session: _WanSession, text_kv: tuple[jax.Array, jax.Array]) -> None:
        """Recompute the K/V of every frame the next block sees under the new prompt (LongLive's recache).

        The visible blocks (sink, then the newest window) run in one block-causal pass at
        ``t = 0`` with absolute positions, each seeing the earlier visible blocks as the window
        rule shows them, and their pages are rewritten in place.
        """
        cfg = self.config
        adapter = state.adapter(MAIN)
        committed, f = adapter.committed_frames, cfg.frames_per_block
        if committed == 0 or session.resident is None:
            return
        history = visible_history(state_layout(cfg), committed, adapter.visible_start_frame, f)
        frames = [*range(int(history.num_sink)), *range(int(history.window_start), committed)]
        starts = np.asarray(frames[::f], np.int32)
        slots = slot_of_frame(state_layout(cfg), np.asarray(frames), np)
        latents = session.resident[self._to_device(slots)].reshape(len(starts), f, *cfg.block_shape[1:])
        k, v = wan_recache(self._graphdef, self._params, latents, self._to_device(starts), text_kv)
        tokens = f * cfg.tokens_per_frame
        for index, start in enumerate(starts.tolist()):
            part = slice(index * tokens, (index + 1) * tokens)
            state.rewrite_committed_context(MAIN, start, (k[:, part], v[:, part]))

    def _advance(self, state: Any, session: _WanSession) -> tuple[_WanSession, WanBlock | None]:
        session, block = super()._advance(state, session)
        if block is None:
            return session, None
        return self._finish_wan_block(session, block, donate=True)

    def _advance_batch(self, batch: Any, sessions: list[_WanSession]) -> tuple[list[_WanSession], list[WanBlock]]:
        """As the base (the transformer batched), then each session's resident latents and VAE decode.

        The decode runs per session: Wan's decoder cache is per session (1.8 GiB in bf16 at
        480x832), so stacking caches to batch it would copy every one of them each tick, while
        one session's decode already convolves a block's 9-12 full-resolution frames. It keeps
        the installed cache (no donation) until the batch has succeeded.
        """
        sessions, blocks = super()._advance_batch(batch, sessions)
        finished = [self._finish_wan_block(session, block, donate=False)
                    for session, block in zip(sessions, blocks, strict=True)]
        return [session for session, _ in finished], [block for _, block in finished]

    def _finish_wan_block(self, session: _WanSession, block: WorldBlock, *, donate: bool
                          ) -> tuple[_WanSession, WanBlock]:
        """The committed ``block`` as a :class:`WanBlock`: remembered for recache, decoded with a VAE.
        ``(the session with its resident latents and decoder cache after it, block)``.

        ``donate``: the session's decoder cache may be donated (an unbatched call); a batched
        tick's staged session shares it with the installed one, which must stay usable.
        """
        session = self._remember_resident(session, block)
        video = None
        if self.vae is not None:
            cache = session.vae_cache
            if cache is None:
                cache = jax.device_put(init_decode_cache(self.vae.config, self.config.block_shape[2:]), self.device)
            decode = _decode_step_jit if donate else _decode_step_keep_jit
            # Donated or not, the session holds only the returned cache from here on.
            decoded, cache = decode(self._vae_graphdef, self._vae_params, block.latents, cache)
            session = dataclasses.replace(session, vae_cache=cache)
            video = _to_uint8_frames(decoded)
        return session, WanBlock(block.latents, video, block.first_frame, block.block_index)

    def _remember_resident(self, session: _WanSession, block: WorldBlock) -> _WanSession:
        """The session with ``block``'s latents at their frames' slots (with recache on; else as it is)."""
        if self.pipeline_config.recache_on_prompt_switch:
            cfg = self.config
            resident = session.resident
            if resident is None:
                resident = self._to_device(
                    np.zeros((cfg.sink_frames + cfg.window_frames, *cfg.block_shape[1:]), np.float32))
            frames = np.arange(block.first_frame, block.first_frame + cfg.frames_per_block)
            slots = self._to_device(slot_of_frame(state_layout(cfg), frames, np).astype(np.int32))
            session = dataclasses.replace(session, resident=resident.at[slots].set(block.latents))
        return session

    def ar_diffusion_warmup_requests(self, session_id: str) -> Any:
        """One block with zero embeddings (the step program and the text projection); with a VAE a
        second block, since a session's first decode and the later ones are different programs."""
        yield DiffusionRequest(
            "wan-warmup-0", inputs={"prompt_embeds": np.zeros((1, self.config.text_dim), np.float32)},
            extra_args={"session_id": session_id, "reset": True})
        if self.vae is not None:
            yield DiffusionRequest("wan-warmup-1", extra_args={"session_id": session_id})


def state_layout(config: CausalDiTConfig) -> Any:
    """The sink/window geometry of ``config`` as the KV helpers read it (pages of one branch, run base 0)."""
    from ardiff_jax.kv import KVLayout

    return KVLayout(num_layers=config.num_layers, num_pages=config.sink_frames + config.window_frames,
                    tokens_per_frame=config.tokens_per_frame, num_kv_heads=config.num_heads,
                    head_size=config.head_dim, sink_frames=config.sink_frames, window_frames=config.window_frames,
                    frames_per_block=config.frames_per_block, scratch_pages=1)


def _with_config(transformer: CausalDiT, config: CausalDiTConfig) -> CausalDiT:
    """The same weights under a config that differs only in its causal policy (block, window, sink)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: CausalDiT(config, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, nnx.split(transformer)[1])
