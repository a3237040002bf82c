"""Published causal-Wan models on the paged runtime: Self-Forcing, LongLive (Wan2.1-T2V-1.3B), Krea realtime (14B).

* :class:`CausalWan` is :class:`~ardiff_jax.models.CausalDiT` (one transformer serves our
  own models and the published ones) with a published config (``"wan2.1-t2v-1.3b"``,
  ``"wan2.1-t2v-14b"``, ``"wan2.2-ti2v-5b"``); its parameters map one-to-one onto the
  original Wan 2.1 names;
* :func:`load_checkpoint` reads the original Wan directory, the diffusers directory, a
  Self-Forcing / LongLive ``.pt`` training checkpoint, a bare ``.safetensors`` file (Krea)
  and merges a PEFT LoRA (LongLive);
* :class:`CausalWanPipeline` runs Self-Forcing's sampler on the paged runtime, conditioned on
  precomputed text-encoder features (``inputs["prompt_embeds"]``).

Example::

    pipeline = CausalWanPipeline.from_checkpoint("checkpoints/self_forcing_dmd.pt",
                                                 "wan2.1-t2v-1.3b")
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="bfloat16"))
    block = engine.generate("s", DiffusionRequest("r0", inputs={"prompt_embeds": embeds}))
    block.latents  # f32[3, 16, 60, 104]

``docs/models.md`` ("Published models") lists the files each format reads and the measured parity.
"""

from ardiff_jax.models._dit import CausalDiT as CausalWan
from ardiff_jax.models.wan._checkpoint import (
    CHECKPOINT_FORMATS,
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    wan_names,
)
from ardiff_jax.models.wan._dreamzero import (
    DIT_PREFIX as DREAMZERO_DIT_PREFIX,
    HEAD_TARGETS as DREAMZERO_HEAD_TARGETS,
    DreamZeroCheckpoint,
    dreamzero_checkpoint_config,
    load_dreamzero,
)
from ardiff_jax.models.wan._umt5 import (
    WAN_UMT5_FILE,
    UMT5Config,
    UMT5Encoder,
    WanTextEncoder,
    clean_prompt,
    load_umt5,
    umt5_config,
    umt5_names,
)
from ardiff_jax.models.wan._vae import (
    CACHE_T,
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    VAEDecodeCache,
    VAEEncodeCache,
    WanVAE,
    WanVAEConfig,
    random_vae,
    cache_nbytes,
    decode_step,
    decoded_frames,
    encode_step,
    init_decode_cache,
    init_encode_cache,
    load_vae,
    vae_names,
)
from ardiff_jax.models.wan._generate import (
    VIDEO_FPS,
    GeneratedVideo,
    PlaceholderTextEncoder,
    PromptSchedule,
    generate_video,
    placeholder_embeds,
    write_mp4,
)
from ardiff_jax.models.wan._pipeline import (
    CAUSAL_WAN_POLICIES,
    CausalWanPipeline,
    CausalWanPipelineConfig,
    WanBlock,
    WanModules,
    warped_schedule,
    with_policy,
)

__all__ = [
    "DREAMZERO_DIT_PREFIX",
    "DREAMZERO_HEAD_TARGETS",
    "DreamZeroCheckpoint",
    "dreamzero_checkpoint_config",
    "load_dreamzero",
    "CHECKPOINT_FORMATS",
    "CheckpointError",
    "checkpoint_config",
    "load_checkpoint",
    "wan_names",
    "VIDEO_FPS",
    "GeneratedVideo",
    "PlaceholderTextEncoder",
    "PromptSchedule",
    "generate_video",
    "placeholder_embeds",
    "write_mp4",
    "CACHE_T",
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "VAEDecodeCache",
    "VAEEncodeCache",
    "WanVAE",
    "WanVAEConfig",
    "random_vae",
    "cache_nbytes",
    "decode_step",
    "decoded_frames",
    "encode_step",
    "init_decode_cache",
    "init_encode_cache",
    "load_vae",
    "vae_names",
    "WAN_UMT5_FILE",
    "UMT5Config",
    "UMT5Encoder",
    "WanTextEncoder",
    "clean_prompt",
    "load_umt5",
    "umt5_config",
    "umt5_names",
    "CAUSAL_WAN_POLICIES",
    "CausalWan",
    "CausalWanPipeline",
    "CausalWanPipelineConfig",
    "WanBlock",
    "WanModules",
    "warped_schedule",
    "with_policy",
]
