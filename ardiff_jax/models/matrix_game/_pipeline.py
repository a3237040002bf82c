"""``MatrixGamePipeline``: Matrix-Game 2.0's interactive image-to-world generation on the paged runtime.

It is :class:`~ardiff_jax.models.wan.CausalWanPipeline` (the same Self-Forcing sampler,
commit pass, streaming VAE decode, session export and memory plan) with Matrix-Game's
conditioning:

* the session's first request carries the reference image ``inputs["image"]``
  (``uint8[H, W, 3]`` at the network's resolution, ``8 x`` the latent: 352 x 640 for the
  published models) and its CLIP image tokens ``inputs["image_embeds"]`` (``f32[257, 1280]``,
  open-clip ViT-H/14's penultimate-block output; the only cross-attention context, kept in the
  runtime's cross-attention cache like a prompt's);
* as the release builds its condition, the image followed by black (zero) frames is encoded
  by the VAE *causally*, a block at a time (image + 8 zero frames for the first block, 12
  zero frames for each later one, the encoder's causal cache per session), giving each latent
  frame its 16 image-condition channels; 4 mask channels are 1 on latent frame 0 and 0
  after. The network reads ``[noisy 16 | mask 4 | condition 16]``;
* every request carries the keyboard and mouse rows of the video frames its block adds,
  ``inputs["keyboard"] f32[n, K]`` and ``inputs["mouse"] f32[n, 2]`` (not for Temple Run):
  ``n = 9`` for a session's first block (video frames 0-8), 12 for each later one (a stepwise
  request for ``num_blocks`` blocks carries all of its blocks' rows). The session keeps the
  last 12 rows, which the next block's windows read;
* the action modules' keys/values live in the session's action ring (the last
  ``window_frames`` latent frames), written by the commit pass like the paged K/V.

Defaults follow the release's universal/GTA inference: denoising list ``[1000, 666, 333]``
warped with shift 5 (``[1000, 908.8, 714.0]``); Temple Run uses ``[1000, 750, 500, 250]``
(``MatrixGamePipelineConfig(schedule=warped_schedule())``). Output: :class:`~ardiff_jax.models.wan.WanBlock`
with ``.video`` (9 frames for the first block, 12 after) decoded by the streaming VAE.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.models._common import (
    FewStepSchedule,
    check_seed,
    jitted_encode_image,
    renoise,
    resolve_config,
    step_noise_key,
)
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._dit import (
    ActionInputs,
    ActionKV,
    action_cache_nbytes,
    commit_action_cache,
    init_action_cache,
)
from ardiff_jax.models._loop import Lane
from ardiff_jax.models._world import MAIN, TEXT, BlockProgram, _BlockInputs
from ardiff_jax.models.matrix_game._actions import action_windows, check_action_rows
from ardiff_jax.models.wan import (
    CausalWanPipeline,
    CausalWanPipelineConfig,
    VAEEncodeCache,
    WanVAE,
    encode_step,
    init_encode_cache,
    warped_schedule,
)
from ardiff_jax.types import DiffusionRequest

__all__ = ["MatrixGamePipeline", "MatrixGamePipelineConfig", "matrix_game_step", "matrix_game_step_batch"]

#: Mask channels in front of the image-condition latent (the release slices 4 of its mask).
MASK_CHANNELS = 4


class _ImagePrompt(NamedTuple):
    """A session's start image whose CLIP tokens the pipeline's image encoder computes in the engine call."""

    digest: str
    embeds: None
    image: np.ndarray  # f32[1, 3, H, W] in [-1, 1]


@dataclasses.dataclass(frozen=True)
class MatrixGamePipelineConfig(CausalWanPipelineConfig):
    """:class:`~ardiff_jax.models.wan.CausalWanPipelineConfig` with Matrix-Game's default 3-step list
    ``[1000, 666, 333]`` warped with shift 5."""

    schedule: FewStepSchedule = dataclasses.field(default_factory=lambda: warped_schedule((1000, 666, 333)))


def _matrix_game_step(graphdef: Any, params: Any, attention: Any, x_t: jax.Array, t: jax.Array, sigma: jax.Array,
                      sigma_next: jax.Array, session_key: jax.Array, block_index: jax.Array, step_index: jax.Array,
                      frame_start: jax.Array, context_kv: tuple[jax.Array, jax.Array], condition: jax.Array,
                      actions: ActionInputs, ring: ActionKV) -> tuple[Any, ...]:
    model = nnx.merge(graphdef, params).transformer
    out = model(x_t, t, frame_start, context_kv, attention=attention, condition=condition, actions=actions,
                action_history=ring)
    x0 = x_t - sigma * out.video
    noise = jax.random.normal(step_noise_key(session_key, block_index, step_index), x_t.shape, jnp.float32)
    return renoise(x0, sigma_next, noise), x0, out.k, out.v, out.action_kv


#: One forward: ``(graphdef, params, attention, x_t f32[f, C, H, W], t, sigma, sigma_next, key, block, step,
#: frame_start, context_kv, condition f32[f, 20, H, W], actions, ring) -> (x_next, x0, k, v, action_kv)``.
matrix_game_step = jax.jit(_matrix_game_step, static_argnums=0)


def _matrix_game_step_batch(graphdef: Any, params: Any, attention: Any, x_t: jax.Array, t: jax.Array,
                            sigma: jax.Array, sigma_next: jax.Array, session_keys: jax.Array, block_index: jax.Array,
                            step_index: jax.Array, frame_start: jax.Array, context_kv: tuple[jax.Array, jax.Array],
                            condition: jax.Array, actions: ActionInputs, ring: ActionKV) -> tuple[Any, ...]:
    model = nnx.merge(graphdef, params).transformer

    def one_session(attention: Any, x_t: jax.Array, frame_start: jax.Array, context_kv: Any, condition: jax.Array,
                    actions: ActionInputs, ring: ActionKV) -> tuple[Any, ...]:
        out = model(x_t, t, frame_start, context_kv, attention=attention, condition=condition, actions=actions,
                    action_history=ring)
        return x_t - sigma * out.video, out.k, out.v, out.action_kv

    x0, k, v, action_kv = jax.vmap(one_session, in_axes=(attention.vmap_axes(), 0, 0, 0, 0, 0, 0))(
        attention, x_t, frame_start, context_kv, condition, actions, ring)
    # Row by row, as world_step_batch: a vmapped draw differs from the unbatched one.
    noise = jax.lax.map(lambda row: jax.random.normal(step_noise_key(row[0], row[1], step_index), x_t.shape[1:],
                                                      jnp.float32), (session_keys, block_index))
    return renoise(x0, sigma_next, noise), x0, k, v, action_kv


#: :data:`matrix_game_step` for a batch of sessions in one program: ``attention`` is a batched paged
#: view, every per-session argument (keys, block index, frame start, context K/V, condition, action
#: windows, action ring) has a leading batch axis; row ``i`` equals ``matrix_game_step`` on session ``i``.
matrix_game_step_batch = jax.jit(_matrix_game_step_batch, static_argnums=0)


#: ``(config, ring, block_kv, frame_start) -> ring``: the committed block's action keys/values written (ring donated:
#: it is not small, 310 MiB at matrix-game-2-universal (``action_cache_nbytes``), and a commit writes one block of it,
#: so a copy per block would cost more than the one copy a fork makes).
_commit_ring = jax.jit(commit_action_cache, static_argnums=0, donate_argnums=1)


def _commit_rings(config: CausalDiTConfig, rings: ActionKV, block_kv: ActionKV, frame_starts: jax.Array) -> ActionKV:
    return jax.vmap(lambda ring, block, start: commit_action_cache(config, ring, block, start))(
        rings, block_kv, frame_starts)


#: :data:`_commit_ring` over a batch's stacked rings (a stacked copy: the installed rings stay as they were).
_commit_rings_jit = jax.jit(_commit_rings, static_argnums=0, donate_argnums=1)


class _Inputs(NamedTuple):
    """A request's Matrix-Game inputs, checked on the host."""

    image: np.ndarray | None  # f32[1, 3, H, W] in [-1, 1] (first request only)
    keyboard: np.ndarray  # f32[n, K]
    mouse: np.ndarray | None  # f32[n, M]


_BaseSession = CausalWanPipeline.session_type


@dataclasses.dataclass(frozen=True)
class _MatrixGameSession(_BaseSession):
    #: The decode and encode steps donate the VAE caches, the ring commit the action cache: all three are
    #: large (at matrix-game-2-universal: decoder 2032 MiB and encoder 1207 MiB with a float32 VAE, ring
    #: 310 MiB) and a step rewrites a block's worth of each, so donating saves a cache-sized copy per block;
    #: a fork copies them once instead.
    donated_fields: ClassVar[tuple[str, ...]] = ("vae_cache", "encode_cache", "action_cache")
    #: The action modules' ring of the last window_frames latent frames ([A, W, ...], config.dtype).
    action_cache: ActionKV | None = None
    #: The VAE encoder's causal cache (the image then black frames, a block at a time).
    encode_cache: VAEEncodeCache | None = None
    #: The last rows (up to 12) of keyboard / mouse input, the ones the next block's windows read.
    recent_keyboard: jax.Array | None = None
    recent_mouse: jax.Array | None = None
    #: Rows received so far (video frames covered by the session's input).
    rows_received: int = 0
    #: The in-flight block's condition [f, 4 + C, H, W] and action windows.
    block_condition: jax.Array | None = None
    block_keyboard: jax.Array | None = None
    block_mouse: jax.Array | None = None

    def device_arrays(self) -> tuple[jax.Array | None, ...]:
        ring = () if self.action_cache is None else tuple(self.action_cache)
        encoder = () if self.encode_cache is None else tuple(self.encode_cache.convs)
        return (*super().device_arrays(), *ring, *encoder, self.recent_keyboard, self.recent_mouse,
                self.block_condition, self.block_keyboard, self.block_mouse)


class MatrixGamePipeline(CausalWanPipeline):
    """Matrix-Game 2.0 on the paged runtime (see the module docstring for the request schema).

    Args:
      config: a Matrix-Game config or preset (default ``"matrix-game-2-universal"``).
      pipeline_config: :class:`MatrixGamePipelineConfig`.
      modules: the weights (``WanModules(load_checkpoint(path))``); default random ones.
      vae: the Wan 2.1 VAE (:func:`~ardiff_jax.models.wan.load_vae`): required, it encodes the
        reference image (and the black frames after it) and decodes every block.
      image_encoder: the CLIP vision encoder (:class:`~ardiff_jax.models.matrix_game.ClipVisionEncoder`, or
        anything with ``encode_image(f32[3, H, W] in [-1, 1]) -> f32[257, 1280]``). With it a session's
        first request may carry the image alone: its tokens are computed inside the engine call, on the
        session's first block (a server never runs CLIP on its event loop). Without it, or to reuse
        tokens, ``inputs["image_embeds"]`` gives them.
      device: where inputs and weights live.
    """

    pipeline_config_type = MatrixGamePipelineConfig
    session_type = _MatrixGameSession
    pipeline_config: MatrixGamePipelineConfig

    def __init__(self, config: CausalDiTConfig | str = "matrix-game-2-universal",
                 pipeline_config: MatrixGamePipelineConfig | None = None, *, modules: Any = None,
                 vae: WanVAE | None = None, image_encoder: Any = None, device: jax.Device | None = None) -> None:
        config = resolve_config(config)
        if vae is None:
            raise ValueError("MatrixGamePipeline needs vae= (a WanVAE): it encodes the reference image into the "
                             "condition channels and decodes every block")
        if image_encoder is not None and not callable(getattr(image_encoder, "encode_image", None)):
            raise TypeError(f"image_encoder must have encode_image(f32[3, H, W]) -> f32[tokens, dim], got "
                            f"{type(image_encoder).__name__}")
        super().__init__(config, pipeline_config, modules=modules, vae=vae, device=device)
        self.image_encoder = image_encoder
        self._encode_image = None if image_encoder is None else jitted_encode_image(image_encoder)

    @classmethod
    def from_checkpoint(cls, path: Any, config: CausalDiTConfig | str | None = None, *, vae: Any = None,
                        image_encoder: Any = None, pipeline_config: MatrixGamePipelineConfig | None = None,
                        device: jax.Device | None = None, **load_options: Any) -> MatrixGamePipeline:
        """A pipeline on the weights at ``path`` (the release's ``.safetensors`` or FastVideo's directory);
        ``vae`` and ``image_encoder`` may be loaded modules or their weight files."""
        from ardiff_jax.models.matrix_game._clip import load_clip_vision
        from ardiff_jax.models.wan import WanModules, load_checkpoint, load_vae

        transformer = load_checkpoint(path, config, **load_options)
        if vae is not None and not isinstance(vae, WanVAE):
            vae = load_vae(vae, dtype=load_options.get("dtype"))
        if image_encoder is not None and not callable(getattr(image_encoder, "encode_image", None)):
            image_encoder = load_clip_vision(image_encoder)
        return cls(transformer.config, pipeline_config, modules=WanModules(transformer), vae=vae,
                   image_encoder=image_encoder, device=device)

    @classmethod
    def check_compatible(cls, config: CausalDiTConfig, pipeline_config: Any) -> None:
        if config.action is None or config.context_embedding != "image" \
                or config.in_channels != 2 * config.latent_channels + MASK_CHANNELS:
            raise ValueError(f"MatrixGamePipeline runs Matrix-Game networks (action modules, image-token context, "
                             f"{MASK_CHANNELS} mask + C condition channels); config {config.name!r} is not one")
        if getattr(pipeline_config, "recache_on_prompt_switch", False):
            raise ValueError("MatrixGamePipeline has no prompt to switch: recache_on_prompt_switch must be False")

    # -- the memory plan ---------------------------------------------------------------------------
    @property
    def pixel_hw(self) -> tuple[int, int]:
        factor = self.vae.config.spatial_factor
        return self.config.latent_height * factor, self.config.latent_width * factor

    def _encoder_template(self) -> VAEEncodeCache:
        return jax.eval_shape(lambda: init_encode_cache(self.vae.config, self.pixel_hw))

    def ar_diffusion_kv_cache_spec(self) -> Any:
        spec = super().ar_diffusion_kv_cache_spec()
        cfg, action = self.config, self.config.action
        encoder = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self._encoder_template().convs)
        f, h, w = cfg.frames_per_block, cfg.latent_height, cfg.latent_width
        block = 4 * (f * (MASK_CHANNELS + cfg.latent_channels) * h * w
                     + f * action.rows * (action.keyboard_dim + action.mouse_dim))
        recent = 4 * action.rows * (action.keyboard_dim + action.mouse_dim)
        extra = action_cache_nbytes(cfg) + encoder + block + recent
        return dataclasses.replace(spec, model_owned_state_bytes_per_session=(
            spec.model_owned_state_bytes_per_session + extra))

    # -- session export / import -------------------------------------------------------------------
    def _session_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg, action = self.config, self.config.action
        f = cfg.frames_per_block
        return {**super()._session_shapes(),
                "recent_keyboard": (action.rows, action.keyboard_dim), "recent_mouse": (action.rows, action.mouse_dim),
                "block_condition": (f, MASK_CHANNELS + cfg.latent_channels, cfg.latent_height, cfg.latent_width),
                "block_keyboard": (f, action.rows, action.keyboard_dim),
                "block_mouse": (f, action.rows, action.mouse_dim)}

    def import_ar_diffusion_session(self, session_id: str, state: Any) -> None:
        """As the base, plus the action ring and the encoder cache, validated before anything changes."""
        ring = encoder = None
        if isinstance(state, dict):
            if state.get("action_cache") is not None:
                ring = self._checked_ring(state["action_cache"])
            if state.get("encode_cache") is not None:
                encoder = self._checked_encoder(state["encode_cache"])
            state = {**state, "action_cache": None, "encode_cache": None}
        super().import_ar_diffusion_session(session_id, state)
        if session_id in self._sessions:
            self._sessions[session_id] = dataclasses.replace(self._sessions[session_id], action_cache=ring,
                                                             encode_cache=encoder)

    def _checked_ring(self, value: Any) -> ActionKV:
        template = jax.eval_shape(lambda: init_action_cache(self.config))
        if not isinstance(value, (tuple, list)) or len(value) != len(template):
            raise ValueError(f"session state action_cache must be {len(template)} arrays (mouse k/v, keyboard k/v)")
        out = []
        for name, array, want in zip(ActionKV._fields, value, template, strict=True):
            if want is None or array is None:
                if (want is None) != (array is None):
                    raise ValueError(f"session state action_cache.{name} must be "
                                     f"{'None' if want is None else 'an array'}")
                out.append(None)
                continue
            if not isinstance(array, jax.Array) or array.shape != want.shape or array.dtype != want.dtype:
                raise ValueError(f"session state action_cache.{name} must be {want.dtype}{list(want.shape)}, got "
                                 f"{getattr(array, 'dtype', type(array).__name__)}{list(getattr(array, 'shape', ()))}")
            out.append(jax.device_put(array, self.device))
        return ActionKV(*out)

    def _checked_encoder(self, value: Any) -> VAEEncodeCache:
        template = self._encoder_template()
        if not isinstance(value, dict) or sorted(value) != ["convs", "started"] \
                or not isinstance(value["started"], bool) or not isinstance(value["convs"], (list, tuple)) \
                or len(value["convs"]) != len(template.convs):
            raise ValueError(f"session state encode_cache must be {{'convs': {len(template.convs)} arrays, "
                             "'started': bool}")
        convs = []
        for index, (array, want) in enumerate(zip(value["convs"], template.convs, strict=True)):
            if not isinstance(array, jax.Array) or array.shape != want.shape or array.dtype != want.dtype:
                raise ValueError(f"session state encode_cache.convs[{index}] must be {want.dtype}{list(want.shape)}")
            convs.append(jax.device_put(array, self.device))
        return VAEEncodeCache(tuple(convs), value["started"])

    # -- request parsing (host only) -----------------------------------------------------------------
    def _rows(self, request: DiffusionRequest, name: str, width: int, expected: int) -> np.ndarray:
        value = request.inputs.get(name)
        if value is None:
            raise ValueError(f"MatrixGamePipeline needs inputs[{name!r}]: [{expected}, {width}] (one row per video "
                             "frame the block adds)")
        rows = check_action_rows(self.config, f"inputs[{name!r}]", value, width)
        if rows.shape[0] != expected:
            raise ValueError(f"inputs[{name!r}] must have {expected} rows (one per video frame the request's blocks "
                             f"add: {self.config.action.num_rows(self.config.frames_per_block)} for a session's first "
                             f"block, {self.config.action.frames_per_latent * self.config.frames_per_block} for each "
                             f"other), got {rows.shape[0]}")
        return rows

    def _parse_image(self, value: Any) -> np.ndarray:
        h, w = self.pixel_hw
        array = np.asarray(value)
        if array.dtype != np.uint8 or array.shape != (h, w, 3):
            raise ValueError(f"inputs['image'] must be uint8[{h}, {w}, 3] (the reference frame at the network's "
                             f"resolution), got {array.dtype}{list(array.shape)}")
        return (array.astype(np.float32) / np.float32(127.5) - 1.0).transpose(2, 0, 1)[None]

    def _parse_new_block(self, session_id: str, request: DiffusionRequest) -> tuple[Any, _Inputs]:
        """The inputs of the block ``request`` starts. A request may ask for ``num_blocks`` (stepwise
        streaming): its rows then cover every one of its blocks (9 + 12 (n - 1) when it starts the
        session, 12 n otherwise), and block ``k`` of the request takes its own slice."""
        cfg, action = self.config, self.config.action
        num_blocks = self._num_blocks(request)
        for key in ("action", "controls", "prompt_embeds"):
            if request.inputs.get(key) is not None:
                raise ValueError(f"MatrixGamePipeline takes no inputs[{key!r}] (it is conditioned on an image and "
                                 "keyboard/mouse rows)")
        if request.prompt is not None:
            raise ValueError("MatrixGamePipeline takes no text prompt")
        if request.inputs.get("seed") is not None:
            check_seed(request.inputs["seed"])
        session = self._sessions.get(session_id)
        first = session is None
        within = 0 if session is None else min(session.blocks_emitted, num_blocks - 1)  # block k of the request
        starts_session = (0 if session is None else session.block_index - within) == 0
        per_block = action.frames_per_latent * cfg.frames_per_block
        first_rows = action.num_rows(cfg.frames_per_block) if starts_session else per_block
        expected = first_rows + per_block * (num_blocks - 1)
        offset = 0 if within == 0 else first_rows + per_block * (within - 1)
        part = slice(offset, offset + (first_rows if within == 0 else per_block))
        keyboard = self._rows(request, "keyboard", action.keyboard_dim, expected)[part]
        mouse = None
        if action.mouse_dim:
            mouse = self._rows(request, "mouse", action.mouse_dim, expected)[part]
        elif request.inputs.get("mouse") is not None:
            raise ValueError(f"config {cfg.name!r} has no mouse input; inputs['mouse'] must be absent")
        image, embeds = request.inputs.get("image"), request.inputs.get("image_embeds")
        encode_here = False
        if first:
            if image is None or (embeds is None and self.image_encoder is None):
                raise ValueError(f"MatrixGamePipeline session {session_id!r} is new: its first request needs "
                                 f"inputs['image'] (uint8[{self.pixel_hw[0]}, {self.pixel_hw[1]}, 3]) and "
                                 f"inputs['image_embeds'] (the CLIP tokens, f32[{cfg.text_len}, {cfg.text_dim}]; "
                                 "or build the pipeline with image_encoder= to compute them)")
            encode_here = embeds is None
            raw = np.asarray(image)
            image = self._parse_image(image)
        elif image is not None and not starts_session:
            raise ValueError("inputs['image'] starts a session; this session already has its reference image")
        else:
            image = None  # a later block of the request that started the session
        prompt = None
        if embeds is not None:
            array = np.asarray(embeds, np.float32)
            if array.shape != (cfg.text_len, cfg.text_dim):
                raise ValueError(f"inputs['image_embeds'] must be f32[{cfg.text_len}, {cfg.text_dim}] (the CLIP image "
                                 f"tokens), got {list(array.shape)}")
            prompt = self._check_embeds(array)
        elif encode_here:  # the tokens are computed on the engine's device when the session's context is filled
            prompt = _ImagePrompt("image:" + hashlib.sha256(raw.tobytes()).hexdigest(), None, image)
        return prompt, _Inputs(image, keyboard, mouse)

    def _sync_prompt(self, state: Any, session: Any, prompt: Any) -> Any:
        if isinstance(prompt, _ImagePrompt):
            tokens = self._encode_image(jnp.asarray(prompt.image[0]))
            prompt = self._check_embeds(np.asarray(tokens, np.float32))  # a new digest: the first block fills it
        return super()._sync_prompt(state, session, prompt)

    # -- device work ------------------------------------------------------------------------------------
    def _start_block(self, state: Any, session: _MatrixGameSession, block: Any, *, staged: bool = False
                     ) -> _MatrixGameSession:
        cfg, action = self.config, self.config.action
        session = super()._start_block(state, session, _BlockInputs(None, None), staged=staged)
        start = session.inflight.frame_start
        h, w = self.pixel_hw
        encode_cache = session.encode_cache
        if encode_cache is None:
            encode_cache = jax.device_put(init_encode_cache(self.vae.config, self.pixel_hw), self.device)
        # The release encodes [image, black frames...] as one clip; the causal encoder gives the same
        # latents a block at a time: 1 + 4 (f - 1) frames first, 4 f after.
        per_latent = self.vae.config.temporal_factor
        if start == 0:
            zeros = np.zeros((per_latent * (cfg.frames_per_block - 1), 3, h, w), np.float32)
            video = np.concatenate([block.image, zeros])
        else:
            video = np.zeros((per_latent * cfg.frames_per_block, 3, h, w), np.float32)
        # A staged session shares its encoder cache with the installed one: keep that one intact.
        latents, encode_cache = encode_step(self.vae, self._to_device(video), encode_cache, donate=not staged)
        mask = np.zeros((cfg.frames_per_block, MASK_CHANNELS, cfg.latent_height, cfg.latent_width), np.float32)
        if start == 0:
            mask[0] = 1.0  # the reference frame is given; every later frame is to be generated
        condition = jnp.concatenate([self._to_device(mask), latents.astype(jnp.float32)], axis=1)

        def rows(recent: jax.Array | None, new: np.ndarray) -> tuple[np.ndarray, int]:
            old = np.zeros((0, new.shape[1]), np.float32) if recent is None else np.asarray(recent)
            held = min(session.rows_received, action.rows)
            return np.concatenate([old[old.shape[0] - held:], new]), session.rows_received - held

        keyboard, first_row = rows(session.recent_keyboard, block.keyboard)
        mouse = None if block.mouse is None else rows(session.recent_mouse, block.mouse)[0]
        windows = action_windows(cfg, keyboard, mouse, start, first_row=first_row)
        return dataclasses.replace(
            session, encode_cache=encode_cache, block_condition=condition,
            block_keyboard=self._to_device(windows.keyboard),
            block_mouse=None if windows.mouse is None else self._to_device(windows.mouse),
            rows_received=session.rows_received + block.keyboard.shape[0],
            recent_keyboard=self._to_device(_last_rows(keyboard, action.rows)),
            recent_mouse=None if mouse is None else self._to_device(_last_rows(mouse, action.rows)),
            action_cache=(jax.device_put(init_action_cache(cfg), self.device) if session.action_cache is None
                          else session.action_cache))

    def _block_program(self, lane: Lane, sessions: Sequence[_MatrixGameSession]) -> BlockProgram:
        """Matrix-Game's rows (the condition, the action windows, the action ring) and :data:`matrix_game_step`
        (or :data:`matrix_game_step_batch`) over them; after the commit the pass's action keys/values join each
        session's ring, as its K/V joined the pages (the world pipeline's loop runs the rest)."""
        cfg = self.config
        rows = lane.stack([(session.inflight.x_t, session.key, np.int32(session.inflight.block_index),
                            np.int32(session.inflight.frame_start), state.get_cross_attention_kv(MAIN, TEXT),
                            session.block_condition, ActionInputs(session.block_keyboard, session.block_mouse),
                            session.action_cache)
                           for state, session in zip(lane.states, sessions, strict=True)])
        x, keys, block_index, frame_start, context_kv, condition, actions, rings = rows
        program = lane.pick(matrix_game_step, matrix_game_step_batch)

        def forward(view: Any, x: jax.Array, step: int) -> tuple[jax.Array, ...]:
            t, sigma, sigma_next = self.schedule.step_args(step)
            return program(self._graphdef, self._params, view, x, t, sigma, sigma_next, keys, block_index,
                           np.int32(step), frame_start, context_kv, condition, actions, rings)

        def after_commit(extra: tuple[jax.Array, ...]) -> list[_MatrixGameSession]:
            (action_kv,) = extra
            # A batch's stacked rings are a copy (donated here); a session's own ring is donated and replaced.
            committed = lane.pick(_commit_ring, _commit_rings_jit)(cfg, rings, action_kv, frame_start)
            return [dataclasses.replace(session, action_cache=ring, block_condition=None, block_keyboard=None,
                                        block_mouse=None)
                    for session, ring in zip(sessions, lane.unstack(committed), strict=True)]

        return BlockProgram(x, forward, after_commit)

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[DiffusionRequest]:
        """Two blocks (a session's first block and a later one are different programs for the VAE)."""
        cfg, action = self.config, self.config.action
        h, w = self.pixel_hw
        for index, rows in enumerate((action.num_rows(cfg.frames_per_block),
                                      action.frames_per_latent * cfg.frames_per_block)):
            inputs: dict[str, Any] = {"keyboard": np.zeros((rows, action.keyboard_dim), np.float32)}
            if action.mouse_dim:
                inputs["mouse"] = np.zeros((rows, action.mouse_dim), np.float32)
            if index == 0:
                inputs["image"] = np.zeros((h, w, 3), np.uint8)
                inputs["image_embeds"] = np.zeros((cfg.text_len, cfg.text_dim), np.float32)
            yield DiffusionRequest(f"matrix-game-warmup-{index}", inputs=inputs,
                                   extra_args={"session_id": session_id, **({"reset": True} if index == 0 else {})})


def _last_rows(rows: np.ndarray, count: int) -> np.ndarray:
    """The last ``count`` rows, zero-padded in front when there are fewer (padding is never read)."""
    out = np.zeros((count, rows.shape[1]), np.float32)
    take = min(count, rows.shape[0])
    out[count - take:] = rows[rows.shape[0] - take:]
    return out
