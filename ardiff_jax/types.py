"""Requests, results, engine configuration and typed realtime ticks: the bottom layer.

Everything that crosses the engine boundary is defined here, as frozen dataclasses that
validate their fields on construction. This module imports nothing of ours except the
argument checks in :mod:`ardiff_jax._checks`, so the capability protocols, the models and
the runtime can all depend on it without depending on each other.

Typed ticks (:class:`ARDiffusionTickRequest`) travel in
``DiffusionRequest.extra_args["ar_diffusion_tick"]`` and are authoritative over the
top-level ``session_id`` / ``reset`` / ``close_session`` keys (``docs/reference_behaviour.md``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ardiff_jax._checks import check_flag, check_non_negative_int, check_session_id, is_integer

__all__ = [
    "AR_DIFFUSION_TICK_KEY",
    "ARDiffusionChunkMetadata",
    "ARDiffusionControlInput",
    "ARDiffusionTickRequest",
    "BATCH_COMPILE_MODES",
    "DiffusionRequest",
    "EngineConfig",
    "StepResult",
    "StepSchedulerOutput",
    "check_kv_dtype",
]


def _frozen_mapping(name: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping, got {type(value).__name__}")
    # A read-only copy: the caller mutating its dict later cannot change a submitted request.
    return types.MappingProxyType(dict(value))


#: Logical KV dtypes a pool can store: floating types the backend keeps at that width.
_KV_DTYPES = ("bfloat16", "float16", "float32", "float64")


def check_kv_dtype(dtype: Any) -> str:
    """The canonical name of a KV dtype, or ValueError naming what was given and why it is refused.

    Only floating dtypes store K/V faithfully (an integer or bool pool silently truncates,
    a complex one doubles the bytes for nothing). ``float64`` needs jax's 64-bit mode:
    without it jax stores float32, and a plan charging 8 bytes per element would be wrong.
    """
    if dtype is None or isinstance(dtype, bool):
        raise ValueError(f"KV dtype must be one of {', '.join(_KV_DTYPES)}, got {dtype!r}")
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"KV dtype {dtype!r} is not a dtype; use one of {', '.join(_KV_DTYPES)}") from None
    if name not in _KV_DTYPES:
        raise ValueError(f"KV dtype {name} is not supported for KV storage; use one of {', '.join(_KV_DTYPES)}")
    if name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "KV dtype float64 needs jax 64-bit mode (jax.config.update('jax_enable_x64', True)); without it jax "
            "stores float32")
    return name


#: When an engine compiles its batched programs (:attr:`EngineConfig.batch_compile`).
BATCH_COMPILE_MODES = ("eager", "background", "lazy")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime configuration of an :class:`~ardiff_jax.ARDiffusionEngine`.

    Attributes:
      dtype: logical KV dtype: ``bfloat16`` (default), ``float16``, ``float32``, or
        ``float64`` with jax's 64-bit mode on. Stored as its canonical name.
      gpu_memory_fraction: share of free device memory for KV, in ``(0, 1]`` (a soft floor:
        one session that fits the free memory is always admitted).
      available_memory_bytes: free memory to plan against; ``None`` measures it.
      max_num_seqs: must be 1 (one request executes at a time).
      step_execution: enable :meth:`~ardiff_jax.ARDiffusionModelRunner.execute_stepwise`;
        the pipeline must implement :class:`~ardiff_jax.SupportsStepExecution`.
      warmup: run the pipeline's warmup provider at load, when it has one.
      batch_compile: when the batched programs (one per batch bucket) compile, for a
        pipeline with batched forwards and ``warmup`` on: ``"eager"`` (default) at load, so
        nothing compiles afterwards; ``"background"``: load returns after the one-session
        warmup and a background thread compiles the buckets smallest first, each while
        enough slots are free; a batch whose bucket is not compiled yet runs through the
        smallest compiled bucket that holds it, or one by one, so no request ever waits
        for a compile on its own tick (a tick can wait for the runner lock while a bucket
        compiles: ``runner.wait_for_batch_compilation()`` ends that phase); ``"lazy"``: each
        bucket compiles on its first batch. ``"background"`` is what ``ardiff-jax serve``
        uses: the first player is served once the one-session programs are built.
      attention_backend: the paged-attention implementation: ``"auto"`` (default: cuDNN
        flash attention on a GPU where the layout allows it, else ``"xla"``; the choice is
        logged and readable as ``engine.runner.kv_cache.attention_backend``), ``"xla"``,
        ``"cudnn"``, or a name registered with :func:`ardiff_jax.kv.register_attention_backend`.
      host_offload_bytes: host memory for sessions the LRU evicts (0: off, the reference's
        behaviour). When positive, an evicted session of a pipeline that implements
        :class:`~ardiff_jax.SupportsARDiffusionSessionExport` is copied to host memory and
        restored into a free slot on its next request, exactly as it was; the host tier is
        itself LRU-bounded by this many bytes (a session dropped from it gets its close hook).
      mesh: a ``jax.sharding.Mesh`` to run one replica on (``None``: one device). Axis
        ``"tp"`` splits KV heads (and the model's heads and FFN hidden), axis ``"cfg"``
        puts CFG branches (or, for one-branch pipelines, sessions) on separate device
        groups; either may be absent or of size 1. The pipeline must implement
        :class:`~ardiff_jax.capability.SupportsARDiffusionMesh`. Host offload and session
        files work on a mesh too (a session's copy keeps its heads split over ``"tp"``).
    """

    dtype: str = "bfloat16"
    gpu_memory_fraction: float = 0.1
    available_memory_bytes: int | None = None
    max_num_seqs: int = 1
    step_execution: bool = False
    warmup: bool = True
    batch_compile: str = "eager"
    attention_backend: str = "auto"
    host_offload_bytes: int = 0
    mesh: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", check_kv_dtype(self.dtype))
        check_flag("EngineConfig step_execution", self.step_execution)
        check_flag("EngineConfig warmup", self.warmup)
        if not isinstance(self.batch_compile, str) or self.batch_compile not in BATCH_COMPILE_MODES:
            raise ValueError(f"EngineConfig batch_compile must be one of {', '.join(BATCH_COMPILE_MODES)}, got "
                             f"{self.batch_compile!r}")
        if not is_integer(self.max_num_seqs):
            raise ValueError(f"EngineConfig max_num_seqs must be an integer, got {self.max_num_seqs!r}")
        if self.available_memory_bytes is not None:
            check_non_negative_int("EngineConfig available_memory_bytes", self.available_memory_bytes)
        object.__setattr__(self, "host_offload_bytes",
                           check_non_negative_int("EngineConfig host_offload_bytes", self.host_offload_bytes))
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError(f"EngineConfig attention_backend must be a backend name, got {self.attention_backend!r}")
        if self.mesh is not None:
            if not isinstance(self.mesh, jax.sharding.Mesh):
                raise TypeError(
                    f"EngineConfig mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}")


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
        # A str is iterable: finished_req_ids="abc" would otherwise close sessions "a", "b" and "c".
        for field in ("scheduled", "finished_req_ids"):
            value = getattr(self, field)
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, set, frozenset)):
                raise TypeError(f"StepSchedulerOutput {field} must be a sequence or set, got {value!r}")
        object.__setattr__(self, "scheduled", tuple(self.scheduled))
        object.__setattr__(self, "finished_req_ids", frozenset(self.finished_req_ids))
        for request in self.scheduled:
            if not isinstance(request, DiffusionRequest):
                raise TypeError(f"StepSchedulerOutput.scheduled must hold DiffusionRequest, got {request!r}")
        for request_id in self.finished_req_ids:
            if not isinstance(request_id, str):
                raise TypeError(f"StepSchedulerOutput finished_req_ids must hold request id strings, got {request_id!r}")
            check_session_id(request_id, "finished request id")


#: The ``extra_args`` key that carries a typed tick.
AR_DIFFUSION_TICK_KEY = "ar_diffusion_tick"


def _freeze(value: Any, where: str) -> Any:
    """Deep, read-only copy of a transport-safe value (str/bool/int/float/None, mappings, sequences)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        frozen = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: mapping keys must be strings to be transport-safe, got {key!r}")
            frozen[key] = _freeze(item, f"{where}.{key}")
        return types.MappingProxyType(frozen)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise ValueError(f"{where}: {type(value).__name__} is not transport-safe")


def _thaw(value: Any) -> Any:
    """Plain dicts and lists again (for ``to_dict``)."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


def _non_blank(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{owner} {field} must be a non-blank string, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ARDiffusionControlInput:
    """One control track for a chunk (e.g. ``track="camera", schema="pose6d", data={...}``).

    ``data`` is frozen recursively (read-only mappings, tuples); only transport-safe values.
    """

    track: str
    schema: str
    data: Mapping[str, Any]

    def __post_init__(self) -> None:
        _non_blank("ARDiffusionControlInput", "track", self.track)
        _non_blank("ARDiffusionControlInput", "schema", self.schema)
        if not isinstance(self.data, Mapping):
            raise ValueError(f"ARDiffusionControlInput data must be a mapping, got {type(self.data).__name__}")
        object.__setattr__(self, "data", _freeze(self.data, f"control {self.track!r} data"))

    def to_dict(self) -> dict[str, Any]:
        return {"track": self.track, "schema": self.schema, "data": _thaw(self.data)}

    @classmethod
    def from_dict(cls, payload: Any) -> ARDiffusionControlInput:
        if not isinstance(payload, Mapping):
            raise ValueError(f"ARDiffusionControlInput payload must be a mapping, got {type(payload).__name__}")
        try:
            return cls(track=payload["track"], schema=payload["schema"], data=payload["data"])
        except KeyError as missing:
            raise ValueError(f"ARDiffusionControlInput payload is missing {missing}") from None


def _event_ids(owner: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{owner} applied_event_ids must be a sequence of integers, got {value!r}")
    ids = tuple(value)
    for event_id in ids:
        if isinstance(event_id, bool) or not isinstance(event_id, int) or event_id < 0:
            raise ValueError(f"{owner} applied_event_ids must be non-negative integers, got {event_id!r}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"{owner} applied_event_ids must be unique and strictly increasing, got {list(ids)}")
    return ids


def _chunk_index(owner: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner} chunk_index must be a non-negative integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ARDiffusionTickRequest:
    """One realtime chunk request: session, correlation id, chunk index, applied events and controls."""

    session_id: str
    request_id: str
    chunk_index: int
    applied_event_ids: tuple[int, ...] = ()
    prompt: str | None = None
    controls: tuple[ARDiffusionControlInput, ...] = ()
    reset: bool = False
    close_session: bool = False

    def __post_init__(self) -> None:
        owner = "ARDiffusionTickRequest"
        _non_blank(owner, "session_id", self.session_id)
        _non_blank(owner, "request_id", self.request_id)
        _chunk_index(owner, self.chunk_index)
        object.__setattr__(self, "applied_event_ids", _event_ids(owner, self.applied_event_ids))
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"{owner} prompt must be a string or None, got {type(self.prompt).__name__}")
        for flag in ("reset", "close_session"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{owner} {flag} must be a bool, got {getattr(self, flag)!r}")
        if isinstance(self.controls, (str, bytes)) or not isinstance(self.controls, Sequence):
            raise ValueError(f"{owner} controls must be a sequence, got {type(self.controls).__name__}")
        controls = tuple(self.controls)
        for control in controls:
            if not isinstance(control, ARDiffusionControlInput):
                raise ValueError(f"{owner} controls must be ARDiffusionControlInput, got {control!r}")
        object.__setattr__(self, "controls", controls)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "request_id": self.request_id,
            "chunk_index": self.chunk_index,
            "applied_event_ids": list(self.applied_event_ids),
            "prompt": self.prompt,
            "controls": [control.to_dict() for control in self.controls],
            "reset": self.reset,
            "close_session": self.close_session,
        }

    def to_extra_args(self) -> dict[str, Any]:
        """``{"ar_diffusion_tick": {...}}``, ready to merge into a request's ``extra_args``."""
        return {AR_DIFFUSION_TICK_KEY: self.to_dict()}

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> ARDiffusionTickRequest | None:
        """Parse the tick from ``extra_args``; ``None`` when absent (plain requests); ValueError when malformed."""
        if not extra_args or AR_DIFFUSION_TICK_KEY not in extra_args:
            return None
        payload = extra_args[AR_DIFFUSION_TICK_KEY]
        if isinstance(payload, cls):
            return payload
        if not isinstance(payload, Mapping):
            raise ValueError(f"{AR_DIFFUSION_TICK_KEY} must be a mapping, got {type(payload).__name__}")
        controls = payload.get("controls", ())
        if isinstance(controls, (str, bytes)) or not isinstance(controls, Sequence):
            raise ValueError(f"{AR_DIFFUSION_TICK_KEY} controls must be a sequence, got {type(controls).__name__}")
        try:
            return cls(
                session_id=payload["session_id"],
                request_id=payload["request_id"],
                chunk_index=payload["chunk_index"],
                applied_event_ids=_event_ids("ARDiffusionTickRequest", payload.get("applied_event_ids", ())),
                prompt=payload.get("prompt"),
                controls=tuple(
                    c if isinstance(c, ARDiffusionControlInput) else ARDiffusionControlInput.from_dict(c)
                    for c in controls
                ),
                reset=payload.get("reset", False),
                close_session=payload.get("close_session", False),
            )
        except KeyError as missing:
            raise ValueError(f"{AR_DIFFUSION_TICK_KEY} is missing {missing}") from None


@dataclasses.dataclass(frozen=True)
class ARDiffusionChunkMetadata:
    """What a pipeline reports back for a tick; must equal ``from_tick(tick)`` exactly."""

    session_id: str
    request_id: str
    chunk_index: int
    applied_event_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "ARDiffusionChunkMetadata"
        _non_blank(owner, "session_id", self.session_id)
        _non_blank(owner, "request_id", self.request_id)
        _chunk_index(owner, self.chunk_index)
        object.__setattr__(self, "applied_event_ids", _event_ids(owner, self.applied_event_ids))

    @classmethod
    def from_tick(cls, tick: ARDiffusionTickRequest) -> ARDiffusionChunkMetadata:
        return cls(tick.session_id, tick.request_id, tick.chunk_index, tick.applied_event_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "request_id": self.request_id,
            "chunk_index": self.chunk_index,
            "applied_event_ids": list(self.applied_event_ids),
        }

    @classmethod
    def from_dict(cls, payload: Any) -> ARDiffusionChunkMetadata:
        if not isinstance(payload, Mapping):
            raise ValueError(f"ARDiffusionChunkMetadata payload must be a mapping, got {type(payload).__name__}")
        try:
            return cls(payload["session_id"], payload["request_id"], payload["chunk_index"],
                       _event_ids("ARDiffusionChunkMetadata", payload.get("applied_event_ids", ())))
        except KeyError as missing:
            raise ValueError(f"ARDiffusionChunkMetadata payload is missing {missing}") from None
