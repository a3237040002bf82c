"""DreamZero (NVIDIA GEAR's world-action model): its transformer is :class:`~ardiff_jax.models.CausalDiT`
with an action/state register (:class:`~ardiff_jax.models.ActionRegisterConfig`), loaded from the
release's checkpoint directory by :func:`load_dreamzero`.

:class:`DreamZeroPipeline` runs the release's inference loop per robot session on the paged runtime
(flow UniPC, CFG on the video only, the DiT step mask); the encoders and the robot server come next.

Presets: ``dreamzero-droid`` (the 14B DROID network), ``dreamzero-wan22-5b`` (the Wan2.2-5B backbone)
and ``dreamzero-tiny`` (the parity fixture's network). ``docs/models.md`` ("DreamZero") says what is
proven against the release's own outputs and what is not yet built (the episode loop, serving).
"""

# The loader lives with the other causal-Wan loaders (it shares their readers and checks).
from ardiff_jax.models.wan import (
    DREAMZERO_DIT_PREFIX as DIT_PREFIX,
    DREAMZERO_HEAD_TARGETS as HEAD_TARGETS,
    CheckpointError,
    DreamZeroCheckpoint,
    dreamzero_checkpoint_config,
    load_dreamzero,
)

from ardiff_jax.models.dreamzero._droid import (
    NEGATIVE_PROMPT,
    VIEW_KEYS,
    DroidStatistics,
    FrameBuffer,
    actions_to_targets,
    droid_prompt,
    normalize_state,
    prepare_views,
    resize_views,
    tile_views,
)
from ardiff_jax.models.dreamzero._robot import ROBOT_POLICY_CONFIG, DreamZeroRobotPolicy, build_robot_policy
from ardiff_jax.models.dreamzero._watch import PREDICTED_VIDEO_FPS, PredictedVideo, PredictedVideoDecoder
from ardiff_jax.models.dreamzero._pipeline import (
    DreamZeroPipeline,
    DreamZeroPipelineConfig,
    dreamzero_commit,
    dreamzero_evaluate,
)
from ardiff_jax.models.dreamzero._unipc import (
    DIT_STEP_MASKS,
    UniPCSchedule,
    UniPCState,
    unipc_init,
    unipc_schedule,
    unipc_step,
)

__all__ = ["NEGATIVE_PROMPT", "VIEW_KEYS", "DroidStatistics", "FrameBuffer", "actions_to_targets", "droid_prompt",
           "normalize_state", "prepare_views", "resize_views", "tile_views", "ROBOT_POLICY_CONFIG",
           "DreamZeroRobotPolicy", "build_robot_policy", "PREDICTED_VIDEO_FPS", "PredictedVideo",
           "PredictedVideoDecoder", "DreamZeroPipeline", "DreamZeroPipelineConfig", "dreamzero_commit", "dreamzero_evaluate", "DIT_STEP_MASKS",
           "UniPCSchedule", "UniPCState", "unipc_init", "unipc_schedule", "unipc_step","CheckpointError", "DIT_PREFIX", "HEAD_TARGETS", "DreamZeroCheckpoint", "dreamzero_checkpoint_config", "load_dreamzero"]
