"""Reference models: a Wan-style causal DiT (Flax NNX) and two runnable AR-Diffusion pipelines.

* :class:`CausalDiT` with :class:`CausalDiTConfig` and presets (``tiny``, ``medium``,
  ``wan_1_3b``; :func:`dit_preset`);
* :class:`WorldPipeline`: single KV branch, few-step DMD-style, register tokens, stepwise;
* :class:`CFGWorldActionPipeline`: DreamZero-style positive/negative CFG branches, text and
  image caches, observation commits, action/state tokens, warmup provider;
* :class:`DenseAttention`: the cache-free attention backend (same model code, no KV cache).

Design notes: ``docs/models.md``.

Weights are random (fixed seeds): these models exercise the runtime end to end and give
benchmarks real shapes; they do not generate meaningful video.
"""

from ardiff_jax.models._attention import (
    DenseAttention,
    MaskedAttention,
    SelfAttentionBackend,
    block_causal_mask,
    dot_attention,
)
from ardiff_jax.models._cfg import (
    CFGPipelineConfig,
    CFGWorldActionPipeline,
    ObservationSchema,
    cfg_commit,
    cfg_step,
)
from ardiff_jax.models._common import DiTModules, FewStepSchedule, noise_key
from ardiff_jax.models._config import DIT_PRESETS, ActionRegisterConfig, CausalDiTConfig, dit_preset
from ardiff_jax.models._dit import (
    ActionInputs,
    ActionStateInputs,
    ActionKV,
    ByteTextEncoder,
    CausalDiT,
    DiTOutput,
    commit_action_cache,
    init_action_cache,
    block_causal_action_mask,
    tokenize_prompt,
)
from ardiff_jax.models._pixels import (
    action_registers,
    frames_to_latents,
    latents_to_frames,
    snap_to_cells,
)
from ardiff_jax.models._pretrained import (
    PRETRAINED_MODELS,
    load_weights,
    pretrained,
    pretrained_metadata,
    save_weights,
)
from ardiff_jax.models._sprite import (
    SPRITE_WORLD_SCHEDULE,
    SpriteBlock,
    SpriteWorldPipeline,
    SpriteWorldPipelineConfig,
)
from ardiff_jax.models._world import (
    PREDICTIONS,
    WorldBlock,
    clean_estimate,
    WorldPipeline,
    WorldPipelineConfig,
    world_step,
)

__all__ = [
    "ActionInputs",
    "ActionRegisterConfig",
    "ActionStateInputs",
    "ActionKV",
    "commit_action_cache",
    "init_action_cache",
    "block_causal_action_mask",
    "noise_key",
    "save_weights",
    "pretrained_metadata",
    "pretrained",
    "load_weights",
    "SpriteWorldPipelineConfig",
    "SpriteWorldPipeline",
    "SpriteBlock",
    "SPRITE_WORLD_SCHEDULE",
    "PREDICTIONS",
    "clean_estimate",
    "snap_to_cells",
    "PRETRAINED_MODELS",
    "DIT_PRESETS",
    "ByteTextEncoder",
    "CFGPipelineConfig",
    "CFGWorldActionPipeline",
    "CausalDiT",
    "CausalDiTConfig",
    "DenseAttention",
    "DiTModules",
    "DiTOutput",
    "FewStepSchedule",
    "MaskedAttention",
    "ObservationSchema",
    "SelfAttentionBackend",
    "WorldBlock",
    "WorldPipeline",
    "WorldPipelineConfig",
    "action_registers",
    "block_causal_mask",
    "cfg_commit",
    "cfg_step",
    "dit_preset",
    "dot_attention",
    "frames_to_latents",
    "latents_to_frames",
    "tokenize_prompt",
    "world_step",
]
