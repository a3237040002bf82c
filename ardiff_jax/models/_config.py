"""``CausalDiTConfig``: the size and KV policy of a Wan-style causal video transformer, and presets.

The config carries both the network size (layers, width, heads, FFN) and the causal
policy a causal-Wan checkpoint fixes at training time (frames per AR block, attention
window, sink, register tokens, text/image context lengths). Pipelines read the KV
geometry from here, as the seed's ``WorldPipeline`` sketch reads it from its transformer.

Presets:

* ``tiny``: CPU tests in seconds; its KV geometry is ``ardiff_jax.geometries.tiny()``.
* ``medium``: 8 layers, 4 heads x 128, 220 tokens/frame (22x40 latent); the geometry of
  ``ardiff_jax.geometries.medium()``.
* ``sprite_world``: the trained SpriteWorld model (``ardiff_jax.models.pretrained``):
  32x32 RGB pixel-space frames, 4 layers, one frame per block, 1-frame sink + 3-frame window;
  ``sprite-world-tiny``: the same layout at 24x24 frames, 2 layers of width 32, for CPU tests
  of the training paths (``SpriteWorld(size=24)``).
* ``wan_1_3b``: Wan2.1-T2V-1.3B (30 layers, 12 heads x 128, dim 1536, FFN 8960, 1560
  tokens/frame = 60x104 latent, 3-frame blocks, 512 x 4096 text); the geometry of
  ``ardiff_jax.geometries.wan_1_3b()``. On CPU instantiate it shape-wise only
  (``nnx.eval_shape``).
* ``wan2.1-t2v-1.3b``, ``wan2.1-t2v-14b``, ``wan2.2-ti2v-5b``: the published networks
  (``ardiff_jax.models.wan`` loads their checkpoints), bf16, Self-Forcing's block policy;
  ``wan-tiny``: a Wan-shaped 2-layer network for CPU tests of that path.
* ``matrix-game-2-universal``, ``matrix-game-2-gta-drive``, ``matrix-game-2-templerun``:
  Matrix-Game 2.0 (36 input channels, CLIP image tokens as the only context, keyboard/mouse
  action modules in blocks 0-14; ``ardiff_jax.models.matrix_game``); ``matrix-game-tiny`` for
  CPU tests.
* ``dreamzero-droid``, ``dreamzero-wan22-5b``: DreamZero (causal Wan with an action/state register,
  :class:`ActionRegisterConfig`; ``ardiff_jax.models.dreamzero``) on the Wan2.1-I2V-14B and
  Wan2.2-TI2V-5B backbones; ``dreamzero-tiny``: the tiny network of its parity fixture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from ardiff_jax._checks import check_non_negative_int, check_positive_int

__all__ = ["CONTEXT_EMBEDDINGS", "DIT_PRESETS", "ActionConfig", "ActionRegisterConfig", "CausalDiTConfig", "dit_preset"]

#: How a config's cross-attention context is embedded: ``"text"`` (Wan's text MLP,
#: Linear-GELU(tanh)-Linear) or ``"image"`` (Wan I2V's ``img_emb`` MLPProj over CLIP image
#: tokens, LayerNorm-Linear-GELU-Linear-LayerNorm; Matrix-Game 2.0's only context).
CONTEXT_EMBEDDINGS = ("text", "image")


@dataclasses.dataclass(frozen=True)
class ActionConfig:
    """Matrix-Game 2.0's action modules: per-frame keyboard and mouse input enter blocks ``0 .. num_blocks-1``.

    Each latent frame ``j`` reads a window of ``rows = frames_per_latent * window_latents``
    raw action rows (one per video frame: rows ``4j-12 .. 4j-1``, earlier ones clamped to
    row 0). The mouse path concatenates the window (flattened, ``rows * mouse_dim``) to every
    token and runs temporal self-attention per spatial token over the visible latent frames;
    the keyboard path embeds each row, projects the window to one key/value per latent frame
    and lets every token cross-attend to the visible frames' keys. Both rotate the first
    ``rope_dim`` channels of each head by the absolute latent frame (base ``rope_theta``).

    Attributes:
      num_blocks: transformer blocks that carry an action module (the first ones).
      keyboard_dim: keys per row (universal 4: W, S, A, D; gta_drive 2; templerun 7).
      mouse_dim: mouse values per row (2: pitch, yaw); 0 = no mouse path (templerun).
      heads: attention heads of both paths.
      keyboard_embed_dim: width of one embedded keyboard row.
      keyboard_hidden_dim, mouse_hidden_dim: attention widths (``heads * head_dim``).
      frames_per_latent: video frames per latent frame (the VAE's temporal factor, 4).
      window_latents: latent frames of action history one latent frame reads (3).
      rope_theta, rope_dim: action RoPE base and rotated channels per head.
      norm_eps: the q/k RMS norms' epsilon; mlp_norm_eps: the mouse MLP's LayerNorm epsilon.
    """

    num_blocks: int = 15
    keyboard_dim: int = 4
    mouse_dim: int = 2
    heads: int = 16
    keyboard_embed_dim: int = 128
    keyboard_hidden_dim: int = 1024
    mouse_hidden_dim: int = 1024
    frames_per_latent: int = 4
    window_latents: int = 3
    rope_theta: float = 256.0
    rope_dim: int = 8
    norm_eps: float = 1e-6
    mlp_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("num_blocks", "keyboard_dim", "heads", "keyboard_embed_dim", "keyboard_hidden_dim",
                      "mouse_hidden_dim", "frames_per_latent", "window_latents", "rope_dim"):
            object.__setattr__(self, field, check_positive_int(f"ActionConfig {field}", getattr(self, field)))
        object.__setattr__(self, "mouse_dim", check_non_negative_int("ActionConfig mouse_dim", self.mouse_dim))
        for field in ("keyboard_hidden_dim", "mouse_hidden_dim"):
            width = getattr(self, field)
            if width % self.heads or (width // self.heads) % 2:
                raise ValueError(f"ActionConfig {field} ({width}) must split into {self.heads} heads of even width")
        if self.rope_dim % 2 or self.rope_dim > min(self.keyboard_head_dim, self.mouse_head_dim):
            raise ValueError(f"ActionConfig rope_dim ({self.rope_dim}) must be even and fit a head")

    @property
    def rows(self) -> int:
        """Action rows (video frames) in one latent frame's window."""
        return self.frames_per_latent * self.window_latents

    @property
    def keyboard_head_dim(self) -> int:
        return self.keyboard_hidden_dim // self.heads

    @property
    def mouse_head_dim(self) -> int:
        return self.mouse_hidden_dim // self.heads

    def num_rows(self, num_latent_frames: int) -> int:
        """Action rows that cover ``num_latent_frames`` latent frames: ``1 + 4 (F - 1)``."""
        return 1 + self.frames_per_latent * (num_latent_frames - 1)


@dataclasses.dataclass(frozen=True)
class ActionRegisterConfig:
    """DreamZero's action/state register: the robot's noisy action chunk and its state ride with a block.

    Per denoised block the transformer reads ``actions_per_block`` action tokens and
    ``states_per_block`` state tokens after the video tokens. They are never cached (scratch),
    attend to everything the video tokens attend to (and are attended by them), and carry their
    own per-token timestep (actions: each its own; the state: its block's first action's).

    * ``action_encoder``: ``W3(swish(W2([W1 a, sinusoid(t)])))``, each a category-specific linear
      (``W [categories, in, out]``) of width ``dim``; the sinusoid is ``[sin, cos]`` over ``dim``;
    * ``state_encoder``: ``layer2(relu(layer1 s))``, width ``hidden_size``;
    * ``action_decoder``: ``layer2(relu(layer1 h))`` on the last block's hidden states of the
      action tokens (no head norm), width ``hidden_size``;
    * 1-D RoPE over the whole head: action ``j`` of register block ``i`` at position
      ``i * actions_per_block + j`` (a table of ``action_positions``), the state at ``i``
      (``state_positions``), with ``i = (frame_start - 1) // frames_per_block``.

    Attributes:
      action_dim: width of one action (DROID: 32, of which 8 are used).
      state_dim: width of the state vector (DROID: 64, of which 8 are used).
      actions_per_block, states_per_block: register tokens per block (DROID: 24 and 1).
      hidden_size: width of the state encoder and action decoder MLPs (the release's
        ``CausalWanModel.hidden_size``, 1024 for DROID; not the head config's field).
      categories: embodiment categories of the category-specific linears (the release forces 1).
      action_positions, state_positions: rows of the 1-D RoPE tables (10240 and 1024).
    """

    action_dim: int = 32
    state_dim: int = 64
    actions_per_block: int = 24
    states_per_block: int = 1
    hidden_size: int = 1024
    categories: int = 1
    action_positions: int = 10240
    state_positions: int = 1024

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name,
                               check_positive_int(f"ActionRegisterConfig {field.name}", getattr(self, field.name)))

    @property
    def num_tokens(self) -> int:
        """Register tokens per block: actions then states."""
        return self.actions_per_block + self.states_per_block


_POSITIVE = (
    "num_layers", "dim", "num_heads", "ffn_dim", "latent_channels", "latent_height", "latent_width",
    "patch_size", "text_len", "text_dim", "frames_per_block", "window_frames", "freq_dim",
)
_NON_NEGATIVE = ("sink_frames", "image_len", "image_dim", "num_register_tokens", "register_dim", "control_dim",
                 "input_channels")


@dataclasses.dataclass(frozen=True)
class CausalDiTConfig:
    """Size and causal policy of a :class:`~ardiff_jax.models.CausalDiT`.

    Attributes:
      num_layers, dim, num_heads, ffn_dim: transformer size (``head_dim = dim // num_heads``).
      latent_channels, latent_height, latent_width: one latent frame is ``[C, H, W]``.
      patch_size: spatial patch (Wan: 2x2); ``tokens_per_frame = (H / p) * (W / p)``.
      text_len, text_dim: text context tokens and the text encoder's width (umT5: 512 x 4096).
      image_len: image-conditioning tokens (Wan I2V CLIP: 257); 0 = no image branch.
      image_dim: width of the image tokens. 0: the image branch reads patch features
        (``patch_dim``) through a stand-in MLP; > 0 (CLIP ViT-H/14: 1280): Wan I2V's ``img_emb``
        MLPProj (LayerNorm, Linear ``image_dim -> image_dim``, GELU, Linear ``-> dim``,
        LayerNorm; eps 1e-5), as DreamZero runs it.
      frames_per_block: latent frames one AR block generates and commits.
      window_frames, sink_frames: visible context = sink + window frames, current block included.
      num_register_tokens, register_dim: action/state (control) tokens that ride along with
        a block in scratch and are never cached; 0 = none.
      control_dim: width of the per-frame control vector (e.g. a one-hot action) that
        conditions every token of its frame through the adaLN modulation, added to the
        timestep embedding; 0 = not control-conditioned.
      input_channels: channels the patch embedding reads, when more than the latent's
        (Wan I2V / Matrix-Game: 36 = 16 noisy latent + 4 mask + 16 image-condition latent);
        0 = ``latent_channels``. The head always predicts ``latent_channels``.
      context_embedding: ``"text"`` or ``"image"`` (:data:`CONTEXT_EMBEDDINGS`): how the
        ``text_len x text_dim`` cross-attention context is embedded. ``"image"``: the context is
        CLIP image tokens (Matrix-Game: 257 x 1280) through Wan's MLPProj; there is no text.
      action: :class:`ActionConfig` (Matrix-Game 2.0's keyboard/mouse modules) or None.
      action_register: :class:`ActionRegisterConfig` (DreamZero's action/state register) or None.
      freq_dim: sinusoidal timestep embedding width (Wan: 256).
      rope_theta, eps: RoPE base and norm epsilon.
      dtype: activation dtype; param_dtype: parameter dtype.
    """

    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    latent_channels: int
    latent_height: int
    latent_width: int
    text_len: int
    text_dim: int
    frames_per_block: int
    window_frames: int
    sink_frames: int = 0
    patch_size: int = 2
    image_len: int = 0
    image_dim: int = 0
    num_register_tokens: int = 0
    register_dim: int = 0
    control_dim: int = 0
    input_channels: int = 0
    context_embedding: str = "text"
    action: ActionConfig | None = None
    action_register: ActionRegisterConfig | None = None
    freq_dim: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    name: str = "custom"

    def __post_init__(self) -> None:
        # Stored as Python ints (numpy integers are accepted): equal configs hash equal and
        # share compiled programs.
        for field in _POSITIVE:
            object.__setattr__(self, field, check_positive_int(f"CausalDiTConfig {field}", getattr(self, field)))
        for field in _NON_NEGATIVE:
            object.__setattr__(self, field, check_non_negative_int(f"CausalDiTConfig {field}", getattr(self, field)))
        for field in ("dtype", "param_dtype"):
            try:
                object.__setattr__(self, field, jnp.dtype(getattr(self, field)).name)
            except TypeError:
                raise ValueError(f"CausalDiTConfig {field} {getattr(self, field)!r} is not a dtype") from None
        if self.dim % self.num_heads:
            raise ValueError(f"CausalDiTConfig dim ({self.dim}) must be a multiple of num_heads ({self.num_heads})")
        # 3-D RoPE splits the head into (frame, row, col) parts of d - 4*(d//6), 2*(d//6), 2*(d//6)
        # channels (Wan's split); every part needs at least one rotated pair.
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"CausalDiTConfig head_dim ({self.head_dim}) must be even and at least 6 for 3-D RoPE")
        if self.freq_dim % 2:
            raise ValueError(f"CausalDiTConfig freq_dim must be even, got {self.freq_dim}")
        for field in ("latent_height", "latent_width"):
            if getattr(self, field) % self.patch_size:
                raise ValueError(
                    f"CausalDiTConfig {field} ({getattr(self, field)}) must be a multiple of patch_size "
                    f"({self.patch_size})"
                )
        if self.frames_per_block > self.window_frames:
            raise ValueError(
                f"CausalDiTConfig frames_per_block ({self.frames_per_block}) must not exceed window_frames "
                f"({self.window_frames})"
            )
        if self.context_embedding not in CONTEXT_EMBEDDINGS:
            raise ValueError(f"CausalDiTConfig context_embedding must be one of {CONTEXT_EMBEDDINGS}, got "
                             f"{self.context_embedding!r}")
        if self.input_channels and self.input_channels < self.latent_channels:
            raise ValueError(f"CausalDiTConfig input_channels ({self.input_channels}) must be 0 or at least "
                             f"latent_channels ({self.latent_channels})")
        if self.action is not None:
            if not isinstance(self.action, ActionConfig):
                raise TypeError(f"CausalDiTConfig action must be an ActionConfig or None, got "
                                f"{type(self.action).__name__}")
            if self.action.num_blocks > self.num_layers:
                raise ValueError(f"CausalDiTConfig action.num_blocks ({self.action.num_blocks}) exceeds num_layers "
                                 f"({self.num_layers})")
            # The action caches keep the window of the last window_frames latent frames (no sink),
            # and action modules see video tokens only.
            if self.sink_frames or self.num_register_tokens or self.control_dim or self.image_len:
                raise ValueError("CausalDiTConfig with action modules must have sink_frames, num_register_tokens, "
                                 "control_dim and image_len 0")
        if self.action_register is not None:
            if not isinstance(self.action_register, ActionRegisterConfig):
                raise TypeError(f"CausalDiTConfig action_register must be an ActionRegisterConfig or None, got "
                                f"{type(self.action_register).__name__}")
            # One register kind per network: DreamZero's encoders replace the generic register map.
            if self.num_register_tokens or self.control_dim or self.action is not None:
                raise ValueError("CausalDiTConfig with an action_register must have num_register_tokens, control_dim "
                                 "0 and no action modules")
        if self.image_dim and not self.image_len:
            raise ValueError(f"CausalDiTConfig image_dim ({self.image_dim}) needs image_len > 0")
        if (self.num_register_tokens > 0) != (self.register_dim > 0):
            raise ValueError(
                "CausalDiTConfig num_register_tokens and register_dim must both be zero or both positive, got "
                f"{self.num_register_tokens} and {self.register_dim}"
            )

    # -- derived ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid(self) -> tuple[int, int]:
        """Token grid of one frame: ``(rows, cols)``."""
        return self.latent_height // self.patch_size, self.latent_width // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def patch_dim(self) -> int:
        """Features of one predicted patch: ``C * p * p``."""
        return self.latent_channels * self.patch_size * self.patch_size

    @property
    def in_channels(self) -> int:
        """Channels of the patch embedding's input (``input_channels``, else ``latent_channels``)."""
        return self.input_channels or self.latent_channels

    @property
    def input_patch_dim(self) -> int:
        """Features of one input patch: ``in_channels * p * p``."""
        return self.in_channels * self.patch_size * self.patch_size

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Latents of one AR block: ``(frames, C, H, W)``."""
        return (self.frames_per_block, self.latent_channels, self.latent_height, self.latent_width)

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Head channels rotated by the frame, row and column positions (Wan's split)."""
        d = self.head_dim
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)

    def replace(self, **changes: object) -> CausalDiTConfig:
        return dataclasses.replace(self, **changes)


def tiny() -> CausalDiTConfig:
    """CPU-test size: 2 layers, 2 heads x 16, 8x8 latent (16 tokens/frame), 4 channels, text 8, image 4."""
    return CausalDiTConfig(
        name="tiny", num_layers=2, dim=32, num_heads=2, ffn_dim=64, latent_channels=4, latent_height=8,
        latent_width=8, text_len=8, text_dim=32, image_len=4, frames_per_block=2, window_frames=5, sink_frames=1,
        num_register_tokens=3, register_dim=16, freq_dim=32,
    )


def medium() -> CausalDiTConfig:
    """CPU-benchmark size: 8 layers, 4 heads x 128, 22x40 latent (220 tokens/frame), text 512, image 257."""
    return CausalDiTConfig(
        name="medium", num_layers=8, dim=512, num_heads=4, ffn_dim=2048, latent_channels=16, latent_height=22,
        latent_width=40, text_len=512, text_dim=512, image_len=257, frames_per_block=3, window_frames=9,
        sink_frames=3, num_register_tokens=33, register_dim=32,
    )


def wan_1_3b() -> CausalDiTConfig:
    """Wan2.1-T2V-1.3B as Self-Forcing/LongLive run it: 21 visible frames with a 3-frame sink."""
    return CausalDiTConfig(
        name="wan_1_3b", num_layers=30, dim=1536, num_heads=12, ffn_dim=8960, latent_channels=16,
        latent_height=60, latent_width=104, text_len=512, text_dim=4096, frames_per_block=3, window_frames=18,
        sink_frames=3,
    )


def sprite_world() -> CausalDiTConfig:
    """The trained SpriteWorld model: 32x32 RGB frames in pixel space, one token per 4x4 cell.

    4 layers, 4 heads x 24, 64 tokens/frame, one frame per block, a 1-frame sink (the
    observation) plus a 3-frame window; the action (one-hot over the 5 actions) conditions
    every token of its frame through the modulation (``control_dim=5``); not
    text-conditioned (one padding text token); RoPE base 10 instead of 10,000, so that each
    axis's few rotary frequencies resolve an 8-cell grid. ``docs/models.md`` explains each
    choice.
    """
    return CausalDiTConfig(
        name="sprite_world", num_layers=4, dim=96, num_heads=4, ffn_dim=384, latent_channels=3, latent_height=32,
        latent_width=32, patch_size=4, text_len=1, text_dim=16, frames_per_block=1, window_frames=3, sink_frames=1,
        control_dim=5, freq_dim=64, rope_theta=10.0,
    )


def sprite_world_tiny() -> CausalDiTConfig:
    """``sprite_world``'s layout at 24x24 frames with 2 layers of width 32: training-path tests in seconds."""
    return sprite_world().replace(name="sprite-world-tiny", num_layers=2, dim=32, ffn_dim=64, num_heads=2,
                                  latent_height=24, latent_width=24)


def _wan(name: str, *, num_layers: int, dim: int, num_heads: int, ffn_dim: int, channels: int = 16,
         latent: tuple[int, int] = (60, 104)) -> CausalDiTConfig:
    # The block policy defaults to Self-Forcing's: 3-frame blocks attending to everything up to
    # its trained 21-frame length, then a 21-frame sliding window (no sink). Pipelines pick
    # another policy (LongLive: sink 3 + 9) with CausalDiTConfig.replace.
    return CausalDiTConfig(
        name=name, num_layers=num_layers, dim=dim, num_heads=num_heads, ffn_dim=ffn_dim, latent_channels=channels,
        latent_height=latent[0], latent_width=latent[1], text_len=512, text_dim=4096, frames_per_block=3,
        window_frames=21, sink_frames=0, dtype="bfloat16", param_dtype="bfloat16",
    )


def wan21_t2v_1_3b() -> CausalDiTConfig:
    """The published Wan2.1-T2V-1.3B network (Self-Forcing, LongLive): 30 layers, 12 heads x 128,
    dim 1536, FFN 8960; 480x832 video = a 60x104 latent (1560 tokens/frame); bf16."""
    return _wan("wan2.1-t2v-1.3b", num_layers=30, dim=1536, num_heads=12, ffn_dim=8960)


def wan21_t2v_14b() -> CausalDiTConfig:
    """The published Wan2.1-T2V-14B network (Krea realtime): 40 layers, 40 heads x 128, dim 5120, FFN 13824."""
    return _wan("wan2.1-t2v-14b", num_layers=40, dim=5120, num_heads=40, ffn_dim=13824)


def wan22_ti2v_5b() -> CausalDiTConfig:
    """The Wan2.2-TI2V-5B transformer of LongLive 2.0: 30 layers, 24 heads x 128, dim 3072, FFN 14336,
    48 latent channels; 704x1280 video through its 16x VAE = a 44x80 latent (880 tokens/frame)."""
    return _wan("wan2.2-ti2v-5b", num_layers=30, dim=3072, num_heads=24, ffn_dim=14336, channels=48,
                latent=(44, 80))


def wan_tiny() -> CausalDiTConfig:
    """A Wan-shaped network for CPU tests and smoke runs of the causal-Wan path: 2 layers, 2 heads x 12,
    4-channel 4x6 latent (6 tokens/frame), 8 x 16 text; LongLive's sink 3 + window 9."""
    return CausalDiTConfig(
        name="wan-tiny", num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
        latent_width=6, text_len=8, text_dim=16, frames_per_block=3, window_frames=9, sink_frames=3, freq_dim=32,
    )


def _matrix_game(name: str, keyboard_dim: int, mouse: bool, window: int) -> CausalDiTConfig:
    # Matrix-Game 2.0 (SkyworkAI): the Wan-1.3B shape, image-to-video input (36 channels),
    # 257 CLIP ViT-H/14 tokens as the only context, action modules in blocks 0-14; 352x640
    # video = a 44x80 latent (880 tokens/frame); 3-frame blocks, local_attn_size frames
    # visible (the current block included), no sink.
    return CausalDiTConfig(
        name=name, num_layers=30, dim=1536, num_heads=12, ffn_dim=8960, latent_channels=16, latent_height=44,
        latent_width=80, text_len=257, text_dim=1280, frames_per_block=3, window_frames=window, sink_frames=0,
        input_channels=36, context_embedding="image",
        action=ActionConfig(num_blocks=15, keyboard_dim=keyboard_dim, mouse_dim=2 if mouse else 0),
        dtype="bfloat16", param_dtype="bfloat16")


def matrix_game_2_universal() -> CausalDiTConfig:
    """Matrix-Game 2.0 universal (base distilled): keyboard W/S/A/D plus mouse, 6 visible latent frames."""
    return _matrix_game("matrix-game-2-universal", 4, True, 6)


def matrix_game_2_gta_drive() -> CausalDiTConfig:
    """Matrix-Game 2.0 GTA driving: keyboard W/S plus mouse, 4 visible latent frames."""
    return _matrix_game("matrix-game-2-gta-drive", 2, True, 4)


def matrix_game_2_templerun() -> CausalDiTConfig:
    """Matrix-Game 2.0 Temple Run: a 7-way keyboard (index 0 = no-op), no mouse, 6 visible latent frames."""
    return _matrix_game("matrix-game-2-templerun", 7, False, 6)


def matrix_game_tiny() -> CausalDiTConfig:
    """A Matrix-Game-shaped network for CPU tests: 3 layers (actions in the first 2), 2 heads x 12, 4-channel
    4x6 latent (6 tokens/frame) with 2 x 4 + 4 input channels, 5 x 16 image tokens, 4 visible latent frames;
    actions: 2 heads x 8 (rotating 4), keyboard 3, mouse 2."""
    return CausalDiTConfig(
        name="matrix-game-tiny", num_layers=3, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
        latent_width=6, text_len=5, text_dim=16, frames_per_block=3, window_frames=4, sink_frames=0, freq_dim=32,
        input_channels=12, context_embedding="image",
        action=ActionConfig(num_blocks=2, keyboard_dim=3, mouse_dim=2, heads=2, keyboard_embed_dim=8,
                            keyboard_hidden_dim=16, mouse_hidden_dim=16, rope_dim=4))


def _dreamzero(name: str, *, num_layers: int, dim: int, num_heads: int, ffn_dim: int, channels: int,
               latent: tuple[int, int], input_channels: int, hidden_size: int = 1024,
               dtype: str = "bfloat16") -> CausalDiTConfig:
    # DreamZero (NVIDIA GEAR): causal Wan with an action/state register. 2-frame blocks; the
    # release's local_attn_size = max_chunk_size (4) * 2 + 1 = 9 frames visible (its cache keeps
    # the last 9 frames, current block included), no sink; 512 x 4096 umT5 text plus 257 CLIP
    # ViT-H/14 tokens (1280 wide) through img_emb.
    return CausalDiTConfig(
        name=name, num_layers=num_layers, dim=dim, num_heads=num_heads, ffn_dim=ffn_dim, latent_channels=channels,
        latent_height=latent[0], latent_width=latent[1], text_len=512, text_dim=4096, image_len=257, image_dim=1280,
        frames_per_block=2, window_frames=9, sink_frames=0, input_channels=input_channels,
        action_register=ActionRegisterConfig(hidden_size=hidden_size), dtype=dtype, param_dtype=dtype)


def dreamzero_droid() -> CausalDiTConfig:
    """DreamZero-DROID (``GEAR-Dreams/DreamZero-DROID``): the Wan2.1-I2V-14B network (40 layers, 40 heads x 128,
    dim 5120, FFN 13824), 36 input channels (16 noisy + 4 mask + 16 image latent), three 176x320 views tiled
    into 352x640 = a 44x80 latent (880 tokens/frame), register width 1024; bf16."""
    return _dreamzero("dreamzero-droid", num_layers=40, dim=5120, num_heads=40, ffn_dim=13824, channels=16,
                      latent=(44, 80), input_channels=36)


def dreamzero_wan22_5b() -> CausalDiTConfig:
    """DreamZero on the Wan2.2-TI2V-5B backbone (the release's ``WAN22_BACKBONE.md``): 30 layers, 24 heads
    x 128, dim 3072, FFN 14336, 48 latent channels read alone (no first-frame concat; the first frame
    enters through CLIP), 160x320 video through the 16x VAE = a 10x20 latent (50 tokens/frame); bf16."""
    return _dreamzero("dreamzero-wan22-5b", num_layers=30, dim=3072, num_heads=24, ffn_dim=14336, channels=48,
                      latent=(10, 20), input_channels=0)


def dreamzero_tiny() -> CausalDiTConfig:
    """The tiny random DreamZero-DROID network of the parity fixture: 3 layers, 2 heads x 32, dim 64, FFN 160,
    an 8x12 latent (24 tokens/frame, non-square), register width 40; text, CLIP and register sizes as DROID;
    float32."""
    return _dreamzero("dreamzero-tiny", num_layers=3, dim=64, num_heads=2, ffn_dim=160, channels=16,
                      latent=(8, 12), input_channels=36, hidden_size=40, dtype="float32")


DIT_PRESETS: dict[str, Callable[[], CausalDiTConfig]] = {
    "tiny": tiny, "medium": medium, "wan_1_3b": wan_1_3b, "sprite_world": sprite_world,
    "sprite-world-tiny": sprite_world_tiny,
    "wan-tiny": wan_tiny, "wan2.1-t2v-1.3b": wan21_t2v_1_3b, "wan2.1-t2v-14b": wan21_t2v_14b, "wan2.2-ti2v-5b": wan22_ti2v_5b,
    "matrix-game-2-universal": matrix_game_2_universal, "matrix-game-2-gta-drive": matrix_game_2_gta_drive,
    "matrix-game-2-templerun": matrix_game_2_templerun, "matrix-game-tiny": matrix_game_tiny,
    "dreamzero-droid": dreamzero_droid, "dreamzero-wan22-5b": dreamzero_wan22_5b, "dreamzero-tiny": dreamzero_tiny}


def dit_preset(name: str, **overrides: object) -> CausalDiTConfig:
    """A preset config by name, optionally with fields replaced (e.g. ``dtype="bfloat16"``)."""
    try:
        config = DIT_PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown CausalDiT preset {name!r}; choose from {sorted(DIT_PRESETS)}") from None
    return config.replace(**overrides) if overrides else config
