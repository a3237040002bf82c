"""What an ``ARDiffusionModelRunner`` can load: the load-time checks of a pipeline and an ``EngineConfig``.

Pure: they read the pipeline's capabilities (``isinstance`` against the runtime-checkable
protocols, attribute look-ups) and the config, call no pipeline code and change nothing. The
runner makes them first, before it allocates anything, in the reference runner's order
(``docs/reference_behaviour.md``, "Runner").
"""

from __future__ import annotations

from typing import Any

from ardiff_jax.capability import SupportsARDiffusionMesh, SupportsARDiffusionPipeline, SupportsStepExecution
from ardiff_jax.types import EngineConfig

__all__ = ["check_loadable"]

#: What ``SupportsARDiffusionPipeline`` asks for, named in the refusal of a pipeline that lacks some of it.
PIPELINE_METHODS = (
    "ar_diffusion_kv_cache_spec",
    "bind_ar_diffusion_state",
    "reset_ar_diffusion_session",
    "close_ar_diffusion_session",
    "forward",
)


def check_loadable(pipeline: Any, config: Any) -> EngineConfig:
    """``config`` (``None``: the default ``EngineConfig``) after checking a runner can load ``pipeline`` with it.

    Refused, in this order: a config that is no ``EngineConfig`` (TypeError);
    ``step_execution`` without a ``SupportsStepExecution`` pipeline (ValueError);
    ``max_num_seqs != 1`` (ValueError); a pipeline without ``SupportsARDiffusionPipeline``
    (TypeError naming the missing methods); a mesh without ``SupportsARDiffusionMesh``
    (TypeError); a request-batch pipeline (ValueError).
    """
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    if config.step_execution and not step_capable(pipeline):
        raise ValueError(
            "step_execution=True requires a pipeline that implements SupportsStepExecution "
            "(supports_step_execution = True and step(request)); otherwise stepwise calls would bypass "
            "per-request KV binding"
        )
    if config.max_num_seqs != 1:
        raise ValueError(f"ARDiffusionModelRunner supports max_num_seqs=1, got {config.max_num_seqs}")
    if not isinstance(pipeline, SupportsARDiffusionPipeline):
        missing = [name for name in PIPELINE_METHODS if not callable(getattr(pipeline, name, None))]
        raise TypeError(
            f"{type(pipeline).__name__} does not implement SupportsARDiffusionPipeline "
            f"({', '.join(PIPELINE_METHODS)}); missing: {', '.join(missing)}. Use a plain (non-AR) engine for "
            "pipelines without the AR-Diffusion capability"
        )
    if config.mesh is not None and not isinstance(pipeline, SupportsARDiffusionMesh):
        raise TypeError(f"EngineConfig(mesh=...) needs a pipeline that implements SupportsARDiffusionMesh "
                        f"(shard_ar_diffusion_model(mesh)); {type(pipeline).__name__} does not")
    if getattr(pipeline, "supports_request_batch", False):
        raise ValueError("ARDiffusionModelRunner does not support request-batch execution pipelines")
    return config


def step_capable(pipeline: Any) -> bool:
    """Whether ``pipeline`` runs stepwise: ``SupportsStepExecution`` and ``supports_step_execution`` true."""
    return isinstance(pipeline, SupportsStepExecution) and bool(getattr(pipeline, "supports_step_execution", False))
