"""The wire protocol of ``WS /v1/realtime/video``: client messages parsed into frozen values, server messages built.

Parsing is pure: :func:`parse_client_message` takes the text of one frame and returns a
:class:`SessionStart`, :class:`SessionInteraction`, :class:`SessionPing` or
:class:`SessionStop`, or raises :class:`ProtocolError` whose ``code`` is what the server
puts in its ``error`` reply (``invalid_json``, ``unknown_type``, ``invalid_field``) and whose
message names the offending field and value. What a field *means* for the served world
(which controls exist, whether a prompt applies) is checked later by the world adapter; here
only the shape of the message is checked.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from ardiff_jax._checks import is_integer

__all__ = [
    "FORMATS",
    "CameraUpdate",
    "ProtocolError",
    "SessionInteraction",
    "SessionPing",
    "SessionStart",
    "SessionStop",
    "error_message",
    "parse_client_message",
]

#: Media formats a session may ask for; the first is the default.
FORMATS = ("m4s", "jpeg")
#: ``session.start`` fields the server accepts for compatibility but does not act on (reported back in
#: ``video.start.config.ignored_fields`` when a client sends them).
IGNORED_START_FIELDS = ("model", "negative_prompt", "num_inference_steps", "guidance_scale", "extra_params")
#: Seeds are the pipelines' noise seeds: integers in ``[0, 2**31)``.
MAX_SEED = 2**31
#: Largest ``num_frames`` a session may ask for (a bound, so a typo cannot pin a slot for years).
MAX_NUM_FRAMES = 2**31 - 1
#: Highest frame rate a session may ask for (frames per second written into the media).
MAX_FPS = 240
#: Longest wire event id (characters).
MAX_EVENT_ID_CHARS = 256
#: Deepest nesting of arrays and objects a message may have (the deepest message the protocol defines,
#: a camera translation, is 7 levels); deeper ones are ``invalid_json``, so no later check can recurse out of stack.
MAX_JSON_DEPTH = 32


class ProtocolError(ValueError):
    """A client message the server refuses; ``code`` goes into the ``error`` reply, with ``event_id`` when known."""

    def __init__(self, code: str, message: str, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id


@dataclasses.dataclass(frozen=True)
class SessionStart:
    """``session.start``: what the client asked for (``None``: not given, the server's default applies).

    ``width``/``height`` are the streamed frame size in pixels; ``ignored_fields`` names the
    vLLM-Omni fields that were sent but have no effect here (:data:`IGNORED_START_FIELDS`).
    """

    format: str = FORMATS[0]
    prompt: str | None = None
    num_frames: int | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    image_url: str | None = None
    ignored_fields: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CameraUpdate:
    """``multi_modal_data.camera``: ``mode`` ``"target"`` or ``"velocity"``, Unity axes (+X right, +Y up, +Z forward)."""

    mode: str
    translation: tuple[float, float, float]
    rotation: tuple[float, float, float, float] | None = None


@dataclasses.dataclass(frozen=True)
class SessionInteraction:
    """``session.interaction``: one event (``event_id`` ``None`` when the client gave none).

    ``action`` is ``multi_modal_data.action.value``; ``unsupported_modalities`` names any other
    ``multi_modal_data`` keys, which the world adapter refuses.
    """

    event_id: str | None
    prompt: str | None = None
    camera: CameraUpdate | None = None
    action: str | None = None
    unsupported_modalities: tuple[str, ...] = ()
    transition_chunks: int | None = None


@dataclasses.dataclass(frozen=True)
class SessionPing:
    """``session.ping``: refreshes the stall clock; answered with ``session.pong``."""


@dataclasses.dataclass(frozen=True)
class SessionStop:
    """``session.stop``: end the session; answered with ``session.done`` (``stopped: true``)."""


ClientMessage = SessionStart | SessionInteraction | SessionPing | SessionStop


def _invalid(field: str, expected: str, value: Any, event_id: str | None = None) -> ProtocolError:
    shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    return ProtocolError("invalid_field", f"{field} must be {expected}, got {shown}", event_id=event_id)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _check_utf8(field: str, text: str, event_id: str | None = None) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``): a ``str`` no UTF-8 encoder (or tokenizer) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ProtocolError("invalid_field", f"{field} is not valid UTF-8 text: lone surrogate at index "
                                             f"{error.start}", event_id=event_id) from None
    return text


def _optional_str(payload: Mapping[str, Any], field: str, where: str, event_id: str | None = None) -> str | None:
    value = payload.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid(f"{where}{field}", "a string", value, event_id)
    return _check_utf8(f"{where}{field}", value, event_id)


def _optional_int(payload: Mapping[str, Any], field: str, low: int, high: int, where: str = "",
                  event_id: str | None = None) -> int | None:
    value = payload.get(field)
    if value is None:
        return None
    if not is_integer(value) or not low <= value < high:
        raise _invalid(f"{where}{field}", f"an integer in [{low}, {high})", value, event_id)
    return int(value)


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _parse_start(payload: Mapping[str, Any]) -> SessionStart:
    fmt = payload.get("format", FORMATS[0])
    if fmt is None:
        fmt = FORMATS[0]
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise _invalid("format", f"one of {', '.join(repr(f) for f in FORMATS)}", fmt)
    if "extra_params" in payload and payload["extra_params"] is not None and not isinstance(
            payload["extra_params"], Mapping):
        raise _invalid("extra_params", "an object", payload["extra_params"])
    for field in ("model", "negative_prompt"):
        _optional_str(payload, field, "")
    for field in ("num_inference_steps",):
        _optional_int(payload, field, 1, 2**31)
    if payload.get("guidance_scale") is not None and not _number(payload["guidance_scale"]):
        raise _invalid("guidance_scale", "a finite number", payload["guidance_scale"])
    image_url = None
    if payload.get("image_reference") is not None:
        reference = payload["image_reference"]
        if not isinstance(reference, Mapping) or not isinstance(reference.get("image_url"), str):
            raise _invalid("image_reference", 'an object {"image_url": "data:image/...;base64,..."}', reference)
        image_url = reference["image_url"]
    return SessionStart(
        format=fmt,
        prompt=_optional_str(payload, "prompt", ""),
        num_frames=_optional_int(payload, "num_frames", 1, MAX_NUM_FRAMES + 1),
        seed=_optional_int(payload, "seed", 0, MAX_SEED),
        width=_optional_int(payload, "width", 1, 2**16),
        height=_optional_int(payload, "height", 1, 2**16),
        fps=_optional_int(payload, "fps", 1, MAX_FPS + 1),
        image_url=image_url,
        ignored_fields=tuple(f for f in IGNORED_START_FIELDS if payload.get(f) is not None),
    )


def _vector(value: Any, length: int, field: str, event_id: str | None) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != length or not all(_number(v) for v in value):
        raise _invalid(field, f"a list of {length} finite numbers", value, event_id)
    return tuple(float(v) for v in value)


def _parse_camera(camera: Any, event_id: str | None) -> CameraUpdate:
    where = "interaction.event.multi_modal_data.camera"
    if not isinstance(camera, Mapping):
        raise _invalid(where, "an object", camera, event_id)
    mode = camera.get("mode")
    if mode not in ("target", "velocity"):
        raise _invalid(f"{where}.mode", "'target' or 'velocity'", mode, event_id)
    data = camera.get("data")
    if not isinstance(data, Mapping):
        raise _invalid(f"{where}.data", "an object with translation and rotation", data, event_id)
    translation = _vector(data.get("translation", [0, 0, 0]), 3, f"{where}.data.translation", event_id)
    rotation = data.get("rotation")
    return CameraUpdate(mode=mode, translation=translation,  # type: ignore[arg-type]
                        rotation=None if rotation is None else _vector(rotation, 4, f"{where}.data.rotation",
                                                                      event_id))  # type: ignore[arg-type]


def _parse_interaction(payload: Mapping[str, Any]) -> SessionInteraction:
    interaction = payload.get("interaction")
    if not isinstance(interaction, Mapping):
        raise _invalid("interaction", "an object with an event", interaction)
    event_id = interaction.get("event_id")
    if event_id is not None and (not isinstance(event_id, str) or not event_id.strip()
                                 or len(event_id) > MAX_EVENT_ID_CHARS):
        raise _invalid("interaction.event_id", f"a non-blank string of at most {MAX_EVENT_ID_CHARS} characters",
                       event_id)
    if event_id is not None:
        _check_utf8("interaction.event_id", event_id)
    event = interaction.get("event")
    if not isinstance(event, Mapping):
        raise _invalid("interaction.event", "an object", event, event_id)
    prompt = _optional_str(event, "prompt", "interaction.event.", event_id)
    transition_chunks = _optional_int(interaction, "transition_chunks", 1, 2**31, "interaction.", event_id)
    modalities = event.get("multi_modal_data")
    camera = action = None
    unsupported: tuple[str, ...] = ()
    if modalities is not None:
        if not isinstance(modalities, Mapping):
            raise _invalid("interaction.event.multi_modal_data", "an object", modalities, event_id)
        if modalities.get("camera") is not None:
            camera = _parse_camera(modalities["camera"], event_id)
        if modalities.get("action") is not None:
            value = modalities["action"]
            if not isinstance(value, Mapping) or not isinstance(value.get("value"), str):
                raise _invalid("interaction.event.multi_modal_data.action", 'an object {"value": "<action name>"}',
                               value, event_id)
            action = value["value"]
        unsupported = tuple(sorted(str(k) for k in modalities if k not in ("camera", "action")))
    return SessionInteraction(event_id=event_id, prompt=prompt, camera=camera, action=action,
                              unsupported_modalities=unsupported, transition_chunks=transition_chunks)


def _nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep (iterative: any depth is safe)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_client_message(text: str) -> ClientMessage:
    """One client text frame -> its message value; ProtocolError (``invalid_json``, ``unknown_type``,
    ``invalid_field``) otherwise.

    ``json.loads`` raises ValueError beyond JSON syntax errors (an integer of more than 4300
    digits) and RecursionError for deep nesting: both are ``invalid_json``, like nesting deeper
    than :data:`MAX_JSON_DEPTH` that happened to parse.
    """
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ProtocolError("invalid_json", f"the message is not valid JSON: {str(error)[:200]}") from None
    if _nesting_exceeds(payload, MAX_JSON_DEPTH):
        raise ProtocolError("invalid_json", f"the message nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    if not isinstance(payload, dict):
        raise ProtocolError("invalid_json", f"a message must be a JSON object, got {type(payload).__name__}")
    kind = payload.get("type")
    if not isinstance(kind, str):
        raise _invalid("type", "a string naming the message type", kind)
    if kind == "session.start":
        return _parse_start(payload)
    if kind == "session.interaction":
        return _parse_interaction(payload)
    if kind == "session.ping":
        return SessionPing()
    if kind == "session.stop":
        return SessionStop()
    raise ProtocolError("unknown_type", f"unknown message type {kind[:80]!r}; expected session.start, "
                                        "session.interaction, session.ping or session.stop")


# -- server messages ---------------------------------------------------------------------------------


def error_message(code: str, message: str, event_id: str | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if event_id is not None:
        reply["event_id"] = event_id
    return reply
