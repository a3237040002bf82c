"""Matrix-Game 2.0 (SkyworkAI): an interactive world model on the causal Wan transformer and the paged runtime.

* the network is :class:`~ardiff_jax.models.CausalDiT` with a Matrix-Game preset
  (``"matrix-game-2-universal"``, ``"matrix-game-2-gta-drive"``, ``"matrix-game-2-templerun"``):
  36 input channels (noisy latent, mask, image-condition latent), CLIP image tokens as the
  only cross-attention context, and keyboard/mouse action modules in blocks 0-14;
* :func:`ardiff_jax.models.wan.load_checkpoint` reads the original release (a ``model.``-prefixed
  ``.safetensors``) and FastVideo's diffusers conversion;
* :func:`action_windows` regroups the raw per-video-frame action rows into the windows each
  latent frame reads.

``docs/models.md`` ("Matrix-Game 2.0") describes the formats, the choices and what is tested.
"""

from ardiff_jax.models._config import ActionConfig
from ardiff_jax.models._dit import (
    ActionInputs,
    ActionKV,
    ActionModule,
    action_cache_nbytes,
    action_history_mask,
    commit_action_cache,
    init_action_cache,
)
from ardiff_jax.models.matrix_game._actions import (
    action_windows,
    check_action_rows,
    rows_for_block,
)
from ardiff_jax.models.matrix_game._clip import (
    CLIP_MEAN,
    CLIP_STD,
    ClipVisionConfig,
    ClipVisionEncoder,
    bicubic_matrix,
    clip_vision_names,
    load_clip_vision,
)
from ardiff_jax.models.matrix_game._generate import (
    MATRIX_GAME_FPS,
    ActionScript,
    build_matrix_game,
    generate_matrix_game,
    prepare_image,
    run_generate_cli,
)
from ardiff_jax.models.matrix_game._pipeline import (
    MatrixGamePipeline,
    MatrixGamePipelineConfig,
    matrix_game_step,
)

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "MATRIX_GAME_FPS",
    "ActionConfig",
    "ActionInputs",
    "ActionKV",
    "ActionModule",
    "ActionScript",
    "ClipVisionConfig",
    "ClipVisionEncoder",
    "MatrixGamePipeline",
    "MatrixGamePipelineConfig",
    "action_cache_nbytes",
    "action_history_mask",
    "action_windows",
    "bicubic_matrix",
    "build_matrix_game",
    "check_action_rows",
    "clip_vision_names",
    "commit_action_cache",
    "generate_matrix_game",
    "init_action_cache",
    "load_clip_vision",
    "matrix_game_step",
    "prepare_image",
    "rows_for_block",
    "run_generate_cli",
]
