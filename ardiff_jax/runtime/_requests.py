"""Engine configuration and the request/step types that cross the engine boundary."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

__all__ = ["EngineConfig", "DiffusionRequest", "StepResult", "StepSchedulerOutput"]


def _frozen_mapping(name: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping, got {type(value).__name__}")
    # A read-only copy: the caller mutating its dict later cannot change a submitted request.
    return types.MappingProxyType(dict(value))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime configuration of an :class:`~ardiff_jax.ARDiffusionEngine`.

    Attributes:
      dtype: logical KV dtype.
      gpu_memory_fraction: share of free device memory for KV, in ``(0, 1]`` (a soft floor:
        one session that fits the free memory is always admitted).
      available_memory_bytes: free memory to plan against; ``None`` measures it.
      max_num_seqs: must be 1 (one request executes at a time).
      step_execution: enable :meth:`~ardiff_jax.ARDiffusionModelRunner.execute_stepwise`;
        the pipeline must implement :class:`~ardiff_jax.SupportsStepExecution`.
      warmup: run the pipeline's warmup provider at load, when it has one.
    """

    dtype: str = "bfloat16"
    gpu_memory_fraction: float = 0.1
    available_memory_bytes: int | None = None
    max_num_seqs: int = 1
    step_execution: bool = False
    warmup: bool = True

    def __post_init__(self) -> None:
        try:
            jnp.dtype(self.dtype)
        except TypeError:
            raise ValueError(f"EngineConfig dtype {self.dtype!r} is not a dtype") from None


@dataclasses.dataclass(frozen=True)
class DiffusionRequest:
    """One engine request.

    ``extra_args`` selects the session (``"session_id"``, default ``"default"``) and the
    lifecycle flags ``"reset"`` / ``"close_session"``, or carries a typed tick under
    ``"ar_diffusion_tick"`` that is authoritative over those keys. ``inputs`` holds model
    inputs (arrays, observations); ``prompt`` the text prompt. Both mappings are stored as
    read-only copies.
    """

    request_id: str
    prompt: Any = None
    extra_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id.strip():
            raise ValueError(f"DiffusionRequest request_id must be a non-empty string, got {self.request_id!r}")
        object.__setattr__(self, "extra_args", _frozen_mapping("extra_args", self.extra_args))
        object.__setattr__(self, "inputs", _frozen_mapping("inputs", self.inputs))


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one ``pipeline.step`` call produced.

    ``output`` is set when a chunk (AR block) was emitted; ``finished`` ends the request;
    ``error`` (a message) fails it. The runner releases the session when the request
    finishes or errors.
    """

    finished: bool
    output: Any = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.finished, bool):
            raise TypeError(f"StepResult finished must be a bool, got {self.finished!r}")
        if self.error is not None and not isinstance(self.error, str):
            raise TypeError(f"StepResult error must be a string or None, got {self.error!r}")

    @property
    def chunk_emitted(self) -> bool:
        return self.output is not None or self.finished or bool(self.error)


@dataclasses.dataclass(frozen=True)
class StepSchedulerOutput:
    """One scheduler tick of the stepwise path.

    ``scheduled`` holds at most one request (the runner executes one at a time);
    ``finished_req_ids`` names requests that finished or were aborted since the last tick:
    their sessions are released before anything runs.
    """

    scheduled: Sequence[DiffusionRequest] = ()
    finished_req_ids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduled", tuple(self.scheduled))
        object.__setattr__(self, "finished_req_ids", frozenset(self.finished_req_ids))
        for request in self.scheduled:
            if not isinstance(request, DiffusionRequest):
                raise TypeError(f"StepSchedulerOutput.scheduled must hold DiffusionRequest, got {request!r}")
