"""Typed realtime ticks (CONTRACTS.md section 6.7): transport-safe control messages.

A tick travels in ``DiffusionRequest.extra_args["ar_diffusion_tick"]`` and is
authoritative over the top-level ``session_id`` / ``reset`` / ``close_session`` keys. Its
``request_id`` is the realtime correlation id, independent of the engine request id.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AR_DIFFUSION_TICK_KEY",
    "ARDiffusionControlInput",
    "ARDiffusionTickRequest",
    "ARDiffusionChunkMetadata",
]

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
