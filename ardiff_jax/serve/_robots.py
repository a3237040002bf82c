"""``ardiff-jax serve --model dreamzero``: DreamZero's robot policy over the openpi / RoboArena protocol.

Builds :class:`~ardiff_jax.models.dreamzero.DreamZeroRobotPolicy` (a release checkpoint with its frozen Wan2.1
encoders, or random weights of a preset) and serves it with :func:`~ardiff_jax.serve.create_policy_app` on
uvicorn: each connection is one robot and one engine session, concurrent robots share batched engine ticks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

__all__ = ["DreamZeroServeOptions", "build_dreamzero_app"]


@dataclasses.dataclass(frozen=True)
class DreamZeroServeOptions:
    """What ``serve --model dreamzero`` was asked for (validated by the CLI before any work).

    Attributes:
      checkpoint: the release's ``save_pretrained`` directory, or None with ``preset`` (random weights).
      preset: the random-weights preset (``dreamzero-tiny`` on a CPU).
      vae, clip, umt5, tokenizer: the Wan2.1 encoder files DreamZero froze (with ``checkpoint``).
      metadata: ``experiment_cfg/metadata.json`` (default: the checkpoint's).
      capacity: robots resident on the device; dtype: weights and KV dtype; available_bytes: the KV plan's memory.
    """

    checkpoint: Path | None
    preset: str
    vae: Path | None = None
    clip: Path | None = None
    umt5: Path | None = None
    tokenizer: Path | None = None
    metadata: Path | None = None
    capacity: int = 4
    dtype: str = "float32"
    available_bytes: int = 2**30


def build_dreamzero_app(options: DreamZeroServeOptions, *, access: Any, say: Any = print) -> tuple[Any, Any]:
    """``(app, policy)``: the policy server app over a freshly built DreamZero robot policy."""
    from ardiff_jax.models.dreamzero import build_robot_policy
    from ardiff_jax.serve._policy import PolicyServerConfig, create_policy_app
    from ardiff_jax.types import EngineConfig

    engine_config = EngineConfig(dtype=options.dtype, available_memory_bytes=options.available_bytes,
                                 gpu_memory_fraction=1.0, warmup=False)
    if options.checkpoint is None:
        say(f"building DreamZero with random weights ({options.preset}), a width-8 VAE, a one-block CLIP and "
            "placeholder text features: the protocol works, the actions mean nothing")
        policy = build_robot_policy(preset=options.preset, session_capacity=options.capacity,
                                    engine_config=engine_config, dtype=options.dtype)
    else:
        from ardiff_jax.models.matrix_game import load_clip_vision
        from ardiff_jax.models.wan import WanTextEncoder, load_umt5, load_vae

        say(f"loading DreamZero from {options.checkpoint} and its encoders (VAE, CLIP, umT5)")
        text = WanTextEncoder(load_umt5(options.umt5, dtype=options.dtype), options.tokenizer)
        policy = build_robot_policy(checkpoint=options.checkpoint, vae=load_vae(options.vae, dtype=options.dtype),
                                    clip=load_clip_vision(options.clip), text_encoder=text,
                                    metadata=options.metadata, session_capacity=options.capacity,
                                    engine_config=engine_config, dtype=options.dtype)
    app = create_policy_app(policy, config=PolicyServerConfig(), access=access, name=f"dreamzero ({options.preset})")
    return app, policy
