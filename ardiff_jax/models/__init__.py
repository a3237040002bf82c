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

from ardiff_jax.models._attention import DenseAttention, SelfAttentionBackend, dot_attention
from ardiff_jax.models._cfg import (
    CFGPipelineConfig,
    CFGWorldActionPipeline,
    ObservationSchema,
    cfg_commit,
    cfg_step,
)
from ardiff_jax.models._common import FewStepSchedule
from ardiff_jax.models._config import DIT_PRESETS, CausalDiTConfig, dit_preset
from ardiff_jax.models._dit import ByteTextEncoder, CausalDiT, DiTOutput, tokenize_prompt
from ardiff_jax.models._world import WorldBlock, WorldPipeline, WorldPipelineConfig, world_step

__all__ = [
    "DIT_PRESETS",
    "ByteTextEncoder",
    "CFGPipelineConfig",
    "CFGWorldActionPipeline",
    "CausalDiT",
    "CausalDiTConfig",
    "DenseAttention",
    "DiTOutput",
    "FewStepSchedule",
    "ObservationSchema",
    "SelfAttentionBackend",
    "WorldBlock",
    "WorldPipeline",
    "WorldPipelineConfig",
    "cfg_commit",
    "cfg_step",
    "dit_preset",
    "dot_attention",
    "tokenize_prompt",
    "world_step",
]
