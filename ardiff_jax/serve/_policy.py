"""A robot-policy WebSocket server speaking openpi's / RoboArena's policy protocol, generic over a policy object.

Wire protocol (wire-compatible with ``openpi_client.WebsocketClientPolicy`` and RoboArena's client)
====================================================================================================
* Every binary frame is one msgpack value in openpi's *msgpack-numpy* form: a numpy array is the map
  ``{b"__ndarray__": True, b"data": <bytes>, b"dtype": <dtype.str, "|u1", "<f4">, b"shape": [...]}``, a
  numpy scalar ``{b"__npgeneric__": True, b"data": <python value>, b"dtype": <dtype.str>}`` (:func:`pack`,
  :func:`unpack`).
* On connect the server sends one binary frame: its :class:`PolicyServerConfig` as a map
  (``image_resolution``, ``needs_wrist_camera``, ``n_external_cameras``, ``needs_stereo_camera``,
  ``needs_session_id``, ``action_space``).
* Then each client frame is a packed observation map. ``endpoint`` says what it asks for: ``"infer"`` (also
  when absent, as openpi's own client sends) is answered with the packed result (an array, e.g. DreamZero's
  ``float32 (N, 8)`` action chunk); ``"reset"`` with the text frame ``"reset successful"``.
* ``session_id`` (a string, optional): a value differing from the one this connection sent last starts a new
  episode: the server calls ``policy.reset(key)`` before serving the message. The first ``session_id`` a
  connection sends starts its first episode (its key is fresh: nothing to reset); a message without one
  continues the current episode.
* A message that cannot be served (not msgpack, not a map, a bad array map, a dtype outside the whitelist,
  a size past :class:`PolicyLimits`, an ``endpoint`` other than the two, an observation the policy's
  ``validate`` refuses, an inference that failed) is answered with a **text** frame holding a clear message
  (openpi's client raises ``RuntimeError`` with it). Unlike the release, which sends a traceback and closes,
  the connection stays open, and a refused message changes nothing: the session keeps its episode (no reset,
  no inference, the last ``session_id`` unchanged) and other robots never notice.

Design
======
* **One session key per connection** (``"robot-1"``, ``"robot-2"``, ... per app), which the policy maps to its
  engine session. Each connection's messages are served in order: the next is read once the reply to the
  previous one was sent.
* **Batched ticks.** Infer requests go to one dispatcher: a worker task that takes every request pending
  (at most ``max_batch_size``) and serves them with one ``policy.infer_batch`` call, run on the policy's one
  thread (a single-thread executor) so the event loop never blocks and engine calls never overlap. While a
  batch runs, other robots' requests queue up and form the next batch. ``reset`` and ``close`` run on the
  same thread, between batches (a connection's own calls stay in order: it awaits each before the next).
* **The server never waits on one client.** The dispatcher only resolves futures; each connection sends its
  own reply, so a slow or vanished client holds back only its own connection. A disconnect calls
  ``policy.close(key)`` (once per accepted connection, after its last call; possibly for a key the policy
  never saw, which must then do nothing).
* Host-side checks (:func:`unpack`'s bounds, the request fields, ``policy.validate``) run on the event loop
  before anything is queued: a refused message never reaches the policy thread.
* **Watching.** A policy that predicts video (``take_video``, ``video_decoder``: DreamZero's) may be watched on
  ``WS /v1/realtime/video`` (:mod:`ardiff_jax.serve._watch`): its predicted video is taken after a watched robot's
  reply and decoded on a thread of its own, so robots never wait for viewers.
* The API key and Origin rules of :mod:`ardiff_jax.serve._access` apply to the handshake (refused before the
  WebSocket is accepted or any key is given out). openpi's client sends its key as ``Authorization: Api-Key
  <key>``; ``Bearer`` and ``?token=`` work as for the video server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from ardiff_jax._checks import check_positive_int
from ardiff_jax.serve._access import (
    ConnectionCounter,
    ServerAccess,
    client_address,
    deny_websocket,
    redacted_tokens_in_uvicorn_logs,
    websocket_refusal,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_ARRAY_BYTES",
    "MAX_CONTAINER_LEN",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_ITEMS",
    "MAX_MESSAGE_BYTES",
    "MAX_SESSION_ID_CHARS",
    "MAX_STRING_BYTES",
    "RESET_REPLY",
    "TRANSPORT_MAX_BYTES",
    "PolicyClient",
    "PolicyLimits",
    "PolicyMessageError",
    "PolicyServerConfig",
    "PolicyServerError",
    "RobotPolicy",
    "create_policy_app",
    "pack",
    "unpack",
]

logger = logging.getLogger(__name__)

# -- bounds -------------------------------------------------------------------------------------------

#: The largest message the server reads (a DROID observation, three 180 x 320 cameras of a few frames, is a few MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: The largest single array in a message (its ``data`` bytes).
MAX_ARRAY_BYTES = 32 * 1024 * 1024
#: The most dimensions an array may have ((T, H, W, 3) is 4).
MAX_DIMS = 6
#: The deepest nesting of maps and lists (an observation is a flat map: depth 1; an array's shape list: 2).
MAX_DEPTH = 8
#: The most entries one map or list may have.
MAX_CONTAINER_LEN = 1024
#: The most entries all maps and lists of a message may have together: a small message cannot unpack into
#: millions of Python objects.
MAX_ITEMS = 16384
#: The longest string (a prompt), in UTF-8 bytes.
MAX_STRING_BYTES = 64 * 1024
#: The longest ``session_id``.
MAX_SESSION_ID_CHARS = 256
#: What to give uvicorn as ``ws_max_size``: a frame up to :data:`MAX_MESSAGE_BYTES` is read and served, one
#: between the two is read and refused with a text error, and one beyond is refused by the transport itself
#: (closed 1009 before it is buffered whole). uvicorn's own default (16 MiB) would close the connection on a
#: legitimate message above it.
TRANSPORT_MAX_BYTES = 2 * MAX_MESSAGE_BYTES
#: The numpy ``dtype.str`` values an array or scalar may have: bool, uint8, int8..int64, float16/32/64, little
#: endian (what every openpi client on x86 or ARM sends). Object, void, complex, strings and big-endian are not.
ALLOWED_DTYPES = frozenset({"|b1", "|u1", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8"})
#: The text frame answering a ``reset`` (RoboArena's clients compare against it).
RESET_REPLY = "reset successful"

_ENDPOINTS = ("infer", "reset")
_ARRAY_KEYS = frozenset({b"__ndarray__", b"data", b"dtype", b"shape"})
_SCALAR_KEYS = frozenset({b"__npgeneric__", b"data", b"dtype"})


class PolicyMessageError(ValueError):
    """A client message the server refuses; ``str(error)`` is the whole text sent back."""


class PolicyServerError(RuntimeError):
    """:class:`PolicyClient`: the server answered with a text error frame (its text is the message)."""


@dataclasses.dataclass(frozen=True)
class PolicyLimits:
    """The bounds :func:`unpack` holds a message to (defaults: the module's constants)."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_array_bytes: int = MAX_ARRAY_BYTES
    max_dims: int = MAX_DIMS
    max_depth: int = MAX_DEPTH
    max_container_len: int = MAX_CONTAINER_LEN
    max_items: int = MAX_ITEMS
    max_string_bytes: int = MAX_STRING_BYTES

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, check_positive_int(f"PolicyLimits {field.name}",
                                                                    getattr(self, field.name)))


_DEFAULT_LIMITS = PolicyLimits()
#: A client trusts its server's replies' sizes (an action chunk, a config) but still refuses malformed maps.
_CLIENT_LIMITS = PolicyLimits(max_message_bytes=1 << 40, max_array_bytes=1 << 40)

# -- the codec (pure) ---------------------------------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        if obj.dtype.kind in ("V", "O", "c"):
            raise TypeError(f"cannot pack a numpy value of dtype {obj.dtype} (object, void and complex are not "
                            "part of msgpack-numpy)")
        if isinstance(obj, np.ndarray):
            return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str,
                    b"shape": list(obj.shape)}
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack a {type(obj).__name__}")


def pack(obj: Any) -> bytes:
    """``obj`` as one msgpack-numpy message (what openpi's ``msgpack_numpy.Packer().pack`` writes).

    numpy arrays (C order) and scalars become their maps; maps, lists, tuples, strings, bytes, numbers,
    booleans and None are msgpack's own. TypeError for anything else (object, void or complex dtypes included).
    """
    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def _array(value: dict, limits: PolicyLimits) -> np.ndarray:
    if set(value) != _ARRAY_KEYS or value[b"__ndarray__"] is not True:
        raise PolicyMessageError("bad array map: an array is {__ndarray__: true, data: <bytes>, dtype: <str>, "
                                 f"shape: <list>}}, got the keys {_key_names(value)}")
    dtype = _dtype(value[b"dtype"])
    data, shape = value[b"data"], value[b"shape"]
    if not isinstance(data, bytes):
        raise PolicyMessageError(f"bad array map: data must be bytes, got {type(data).__name__}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise PolicyMessageError(f"bad array map: shape must be a list of non-negative integers, got {shape!r:.200}")
    if len(shape) > limits.max_dims:
        raise PolicyMessageError(f"array has {len(shape)} dimensions; at most {limits.max_dims}")
    nbytes = math.prod(shape) * dtype.itemsize  # Python integers: a huge shape cannot wrap around
    if nbytes > limits.max_array_bytes:
        raise PolicyMessageError(f"array of shape {tuple(shape)} and dtype {dtype} is {nbytes} bytes; "
                                 f"at most {limits.max_array_bytes}")
    if len(data) != nbytes:  # numpy would read a longer buffer's prefix without a word
        raise PolicyMessageError(f"bad array map: {len(data)} data bytes for shape {tuple(shape)} and dtype "
                                 f"{dtype} ({nbytes} bytes)")
    try:
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
    except (ValueError, TypeError) as error:  # e.g. a zero-size shape with a dimension numpy cannot index
        raise PolicyMessageError(f"bad array map: shape {tuple(shape)}: {error}") from None


def _key_names(value: dict) -> list[str]:
    return sorted(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in value)


def _dtype(name: Any) -> np.dtype:
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise PolicyMessageError(f"dtype {name!r} is not allowed; allowed: {', '.join(sorted(ALLOWED_DTYPES))} "
                                 "(bool, uint8, int8-int64, float16/32/64, little endian)")
    return np.dtype(name)


def _scalar(value: dict) -> np.generic:
    if set(value) != _SCALAR_KEYS or value[b"__npgeneric__"] is not True:
        raise PolicyMessageError("bad scalar map: a numpy scalar is {__npgeneric__: true, data: <value>, "
                                 f"dtype: <str>}}, got the keys {_key_names(value)}")
    dtype = _dtype(value[b"dtype"])
    data = value[b"data"]
    if not isinstance(data, (bool, int, float)):
        raise PolicyMessageError(f"bad scalar map: data must be a number or a boolean, got {type(data).__name__}")
    try:
        return dtype.type(data)
    except (OverflowError, ValueError, TypeError) as error:
        raise PolicyMessageError(f"bad scalar map: {data!r} is not a {dtype}: {error}") from None


def _hooks(limits: PolicyLimits) -> tuple[Callable[[dict], Any], Callable[[list], list]]:
    """msgpack's map and list hooks for one message: decode array and scalar maps and check their sizes, and
    count every container's entries, refusing past ``max_items`` while unpacking (not after it is all built)."""
    items = 0

    def count(n: int) -> None:
        nonlocal items
        items += n
        if items > limits.max_items:
            raise PolicyMessageError(f"message has more than {limits.max_items} map and list entries in all")

    def object_hook(value: dict) -> Any:
        count(len(value))
        if b"__ndarray__" in value:
            return _array(value, limits)
        if b"__npgeneric__" in value:
            return _scalar(value)
        return value

    def list_hook(value: list) -> list:
        count(len(value))
        return value

    return object_hook, list_hook


#: msgpack's refusal of a value past one of ``unpackb``'s ``max_*_len`` bounds, and how the client is told.
_PAST_LIMIT = re.compile(r"(\d+) exceeds max_(str|bin|array|map|ext)_len\((\d+)\)")
_PAST_LIMIT_TEXT = {"str": "message holds a string of {size} bytes; at most {limit}",
                    "bin": "message holds a bytes value (array data) of {size} bytes; at most {limit}",
                    "array": "message holds a list of {size} entries; at most {limit}",
                    "map": "message holds a map of {size} entries; at most {limit}",
                    "ext": "message holds a msgpack extension type; none is accepted"}

_LEAVES = (type(None), bool, int, float, str, bytes, np.ndarray, np.generic)


def _check_depth(value: Any, limits: PolicyLimits) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limits.max_depth:
                raise PolicyMessageError(f"message nests maps and lists deeper than {limits.max_depth} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
        elif not isinstance(item, _LEAVES):
            raise PolicyMessageError(f"message holds a {type(item).__name__} (msgpack extension types are not "
                                     "accepted)")


def _decode(data: bytes, limits: PolicyLimits | None) -> Any:
    """Any msgpack-numpy value within ``limits`` (a reply may be an array; a request must be a map)."""
    limits = _DEFAULT_LIMITS if limits is None else limits
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PolicyMessageError(f"a message is binary msgpack, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise PolicyMessageError(f"message of {len(data)} bytes; at most {limits.max_message_bytes}")
    object_hook, list_hook = _hooks(limits)
    try:
        value = msgpack.unpackb(
            data, object_hook=object_hook, list_hook=list_hook, raw=False, strict_map_key=True,
            max_str_len=limits.max_string_bytes, max_bin_len=limits.max_array_bytes,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len, max_ext_len=0)
    except PolicyMessageError:
        raise
    except msgpack.StackError:
        raise PolicyMessageError(f"message nests maps and lists deeper than {limits.max_depth} levels") from None
    except msgpack.ExtraData:
        raise PolicyMessageError("message is not msgpack: bytes follow its first value") from None
    except (msgpack.FormatError, ValueError, TypeError, UnicodeDecodeError) as error:
        past = _PAST_LIMIT.fullmatch(str(error))
        if past is not None:
            size, kind, limit = past.groups()
            raise PolicyMessageError(_PAST_LIMIT_TEXT[kind].format(size=size, limit=limit)) from None
        raise PolicyMessageError(f"message is not msgpack: {str(error) or 'malformed data'}") from None
    _check_depth(value, limits)
    return value


def unpack(data: bytes, limits: PolicyLimits | None = None) -> dict[str, Any]:
    """The observation map one message holds, its arrays as (read-only) numpy arrays.

    Raises :class:`PolicyMessageError` with a clear message for anything else: more than
    ``limits.max_message_bytes``, not msgpack (or trailing bytes), a top level that is not a map with string
    keys, a bad array or scalar map (other keys, a dtype outside :data:`ALLOWED_DTYPES`, a shape that is not a
    list of non-negative integers, more than ``max_dims`` dimensions, ``data`` whose length is not the shape's
    size times the item size, more than ``max_array_bytes``), a string longer than ``max_string_bytes``, a map or
    list longer than ``max_container_len``, more than ``max_items`` entries in all, nesting deeper than
    ``max_depth``, msgpack extension types.
    """
    value = _decode(data, limits)
    if not isinstance(value, dict):
        raise PolicyMessageError(f"message must be a map (an observation dict), got a {_kind(value)}")
    bad_keys = [key for key in value if not isinstance(key, str)]
    if bad_keys:
        raise PolicyMessageError(f"observation keys must be strings, got {bad_keys[0]!r}")
    return value


def _kind(value: Any) -> str:
    return "numpy array" if isinstance(value, np.ndarray) else type(value).__name__


# -- what the server serves ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyServerConfig:
    """What the server tells a robot on connect (RoboArena's ``PolicyServerConfig``; defaults: DreamZero's DROID
    policy). ``image_resolution`` is ``(height, width)``."""

    image_resolution: tuple[int, int] = (180, 320)
    needs_wrist_camera: bool = True
    n_external_cameras: int = 2
    needs_stereo_camera: bool = False
    needs_session_id: bool = True
    action_space: str = "joint_position"

    def __post_init__(self) -> None:
        resolution = self.image_resolution
        if not isinstance(resolution, (tuple, list)) or len(resolution) != 2:
            raise ValueError(f"PolicyServerConfig image_resolution must be (height, width), got {resolution!r}")
        object.__setattr__(self, "image_resolution", tuple(
            check_positive_int("PolicyServerConfig image_resolution", n) for n in resolution))
        for name in ("needs_wrist_camera", "needs_stereo_camera", "needs_session_id"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PolicyServerConfig {name} must be a bool, got {getattr(self, name)!r}")
        if type(self.n_external_cameras) is not int or self.n_external_cameras < 0:
            raise ValueError(f"PolicyServerConfig n_external_cameras must be a non-negative integer, "
                             f"got {self.n_external_cameras!r}")
        if not isinstance(self.action_space, str) or not self.action_space:
            raise ValueError(f"PolicyServerConfig action_space must be a non-empty string, got {self.action_space!r}")

    def as_wire(self) -> dict[str, Any]:
        """The map sent on connect (``image_resolution`` as a list, as msgpack carries a tuple)."""
        wire = dataclasses.asdict(self)
        wire["image_resolution"] = list(self.image_resolution)
        return wire


@runtime_checkable
class RobotPolicy(Protocol):
    """What :func:`create_policy_app` serves. Each connection has its own ``session_key`` (``"robot-<n>"``).

    * ``validate(session_key, obs)``: raise ValueError with a clear message for an observation the policy
      cannot serve (missing keys, shapes, dtypes, NaN state). Host-side and quick: it runs on the event loop,
      possibly while ``infer_batch`` runs on the policy thread, so it must change nothing and read only the
      observation (and the policy's immutable configuration). Only observations it accepts reach
      ``infer_batch``.
    * ``infer_batch(items)``: one batched tick for ``[(session_key, obs), ...]`` (distinct keys); returns one
      result per item, in order: the reply (a numpy array, packed with :func:`pack`) or an Exception (only that
      robot failed; its text is sent to it). Raising fails every item of the call.
    * ``reset(session_key)``: start a new episode for the key (a ``reset`` message, or a new ``session_id``
      before its message is served). May be called for a key never inferred.
    * ``close(session_key)``: the connection ended; release what the key holds. Called once per accepted
      connection, after its last call; may be a key the policy never saw.

    ``infer_batch``, ``reset`` and ``close`` run on one thread, one at a time.
    """

    def validate(self, session_key: str, obs: dict[str, Any]) -> None: ...

    def infer_batch(self, items: list[tuple[str, dict[str, Any]]]) -> list[Any]: ...

    def reset(self, session_key: str) -> None: ...

    def close(self, session_key: str) -> None: ...


# -- the dispatcher: batched ticks on the policy thread ------------------------------------------------


@dataclasses.dataclass
class _Infer:
    key: str
    obs: dict[str, Any]
    future: asyncio.Future


@dataclasses.dataclass
class _Control:
    call: Callable[[str], Any]
    key: str
    future: asyncio.Future | None  # None: nobody awaits it (a close after a disconnect); a failure is logged


class _Dispatcher:
    """Queues requests from every connection and serves them on the policy thread: pending controls (reset,
    close) first, then every pending inference (at most ``max_batch_size``) in one ``infer_batch`` call."""

    def __init__(self, policy: RobotPolicy, executor: concurrent.futures.Executor,
                 max_batch_size: int | None) -> None:
        self.policy = policy
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.infers: list[_Infer] = []
        self.controls: list[_Control] = []
        self.batches = 0
        self.largest_batch = 0
        self.busy = False  # the worker is serving (a policy call may be running on the policy thread)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="policy-dispatcher")

    def pending(self) -> int:
        """Inferences waiting for a batch (not counting the batch running)."""
        return sum(1 for request in self.infers if not request.future.done())

    async def infer(self, key: str, obs: dict[str, Any]) -> Any:
        """The policy's result for one observation (a value or an Exception), from the next batch."""
        self._ensure_running()
        request = _Infer(key, obs, asyncio.get_running_loop().create_future())
        self.infers.append(request)
        self._wake.set()
        return await request.future

    async def control(self, call: Callable[[str], Any], key: str) -> None:
        """Run ``call(key)`` on the policy thread between batches; raises what it raised."""
        self._ensure_running()
        future = asyncio.get_running_loop().create_future()
        self.controls.append(_Control(call, key, future))
        self._wake.set()
        await future

    def control_later(self, call: Callable[[str], Any], key: str) -> None:
        """Queue ``call(key)`` without waiting for it (a failure is logged)."""
        self._ensure_running()
        self.controls.append(_Control(call, key, None))
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.busy = False
            await self._wake.wait()
            self._wake.clear()
            self.busy = True
            while self.controls or self.infers:
                controls, self.controls = self.controls, []
                for control in controls:
                    try:
                        await loop.run_in_executor(self.executor, control.call, control.key)
                    except Exception as error:  # noqa: BLE001 - one robot's failure is reported to it alone
                        if control.future is None:
                            logger.exception("policy %s(%r) failed", getattr(control.call, "__name__", "call"),
                                             control.key)
                        elif not control.future.done():
                            control.future.set_exception(error)
                    else:
                        if control.future is not None and not control.future.done():
                            control.future.set_result(None)
                # a connection cancelled while it waited (the server shutting down) leaves its request behind
                live = [request for request in self.infers if not request.future.done()]
                size = len(live) if self.max_batch_size is None else min(len(live), self.max_batch_size)
                batch, self.infers = live[:size], live[size:]
                if batch:
                    await self._serve(loop, batch)

    async def _serve(self, loop: asyncio.AbstractEventLoop, batch: list[_Infer]) -> None:
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        try:
            results = await loop.run_in_executor(self.executor, self.policy.infer_batch,
                                                 [(request.key, request.obs) for request in batch])
        except Exception as error:  # noqa: BLE001 - the whole tick failed: every robot in it is told
            logger.exception("policy infer_batch failed for %s", [request.key for request in batch])
            results = [error] * len(batch)
        else:
            if not isinstance(results, Sequence) or isinstance(results, (str, bytes)) or len(results) != len(batch):
                count = len(results) if isinstance(results, Sequence) else type(results).__name__
                error = RuntimeError(f"the policy returned {count} results for {len(batch)} observations")
                logger.error("%s", error)
                results = [error] * len(batch)
        for request, result in zip(batch, results):
            if not request.future.done():
                request.future.set_result(result)  # an Exception is a value here: that robot's own failure

    async def stop(self, timeout_s: float) -> None:
        """Let queued controls (the closes of the last connections) run, then stop the worker."""
        if self._task is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.busy or self.controls or self.pending():
                    await asyncio.sleep(0.01)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


# -- the app ------------------------------------------------------------------------------------------


def _request_fields(obs: dict[str, Any]) -> tuple[str, str | None]:
    """The message's ``endpoint`` (absent: ``"infer"``) and ``session_id`` (absent: None), checked."""
    endpoint = obs.get("endpoint", "infer")
    if not isinstance(endpoint, str) or endpoint not in _ENDPOINTS:
        raise PolicyMessageError(f"endpoint must be 'infer' or 'reset', got {endpoint!r}")
    session_id = obs.get("session_id")
    if session_id is not None:
        if not isinstance(session_id, str) or not session_id:
            raise PolicyMessageError(f"session_id must be a non-empty string, got {_kind(session_id)} "
                                     f"{session_id!r:.80}")
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise PolicyMessageError(f"session_id of {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}")
    return endpoint, session_id


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def _send(websocket: Any, payload: bytes | str) -> bool:
    """Send one frame; False when the client is gone (its connection ends; nobody else notices)."""
    try:
        if isinstance(payload, str):
            await websocket.send_text(payload)
        else:
            await websocket.send_bytes(payload)
    except Exception:  # noqa: BLE001 - a disconnect surfaces as several exception types depending on the server
        return False
    return True


def create_policy_app(policy: RobotPolicy, *, config: PolicyServerConfig | None = None,
                      access: ServerAccess | None = None, limits: PolicyLimits | None = None,
                      max_batch_size: int | None = None, name: str = "policy",
                      executor: concurrent.futures.Executor | None = None, max_viewers: int | None = None) -> Any:
    """The Starlette app serving ``policy`` over openpi's policy protocol: ``WS /`` (openpi clients connect to
    ``ws://host:port`` with no path) and ``GET /healthz`` (JSON: ``status``, ``model`` (``name``), ``robots``
    connected, ``connected_robots`` (per robot: ``robot`` (its key), ``session_id``, ``inferences``, ``viewers``),
    ``batches`` served, ``largest_batch``, ``config``, and for a policy that predicts video ``viewers`` and
    ``chunks_decoded``).

    A policy that predicts video (:class:`~ardiff_jax.serve._watch.WatchablePolicy`: ``take_video`` and
    ``video_decoder``, as DreamZero's) may also be watched on ``WS /v1/realtime/video`` (see
    :mod:`ardiff_jax.serve._watch`), by at most ``max_viewers`` viewers at once (default
    :data:`~ardiff_jax.serve._watch.DEFAULT_MAX_VIEWERS`), under the same access rules and connection count.

    ``config`` (default :class:`PolicyServerConfig`) is sent on connect; ``access`` (default ``ServerAccess()``:
    no key, same-origin pages only, 8 connections per client address) is checked before the WebSocket is
    accepted; ``limits`` (default :class:`PolicyLimits`) bounds every message; ``max_batch_size`` caps the
    robots per ``infer_batch`` call (None: every robot pending). ``executor`` runs every policy call but
    ``validate`` (default: a single-thread executor the app owns and shuts down with its lifespan); pass
    a single-thread one, or the policy's calls may overlap. Under uvicorn pass ``ws_max_size=2 *
    limits.max_message_bytes`` (:data:`TRANSPORT_MAX_BYTES` under the default limits: a message past the limit
    but within twice it gets a text error, a larger one is closed 1009 by the transport before it is buffered;
    uvicorn's default, 16 MiB, would close a connection on a message the limits allow) and
    ``proxy_headers=False`` (see :func:`~ardiff_jax.serve.create_app`). The policy stays the
    caller's: the app closes only the sessions of its connections.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    from ardiff_jax.serve._app import REALTIME_VIDEO_PATH
    from ardiff_jax.serve._watch import DEFAULT_MAX_VIEWERS, RobotRecord, VideoHub

    for method in ("validate", "infer_batch", "reset", "close"):
        if not callable(getattr(policy, method, None)):
            raise TypeError(f"policy must have a callable {method}() (see RobotPolicy), "
                            f"got {type(policy).__name__}")
    config = PolicyServerConfig() if config is None else config
    if not isinstance(config, PolicyServerConfig):
        raise TypeError(f"config must be a PolicyServerConfig, got {type(config).__name__}")
    access = ServerAccess() if access is None else access
    if not isinstance(access, ServerAccess):
        raise TypeError(f"access must be a ServerAccess, got {type(access).__name__}")
    limits = _DEFAULT_LIMITS if limits is None else limits
    if not isinstance(limits, PolicyLimits):
        raise TypeError(f"limits must be a PolicyLimits, got {type(limits).__name__}")
    if max_batch_size is not None:
        max_batch_size = check_positive_int("max_batch_size", max_batch_size)
    watchable = callable(getattr(policy, "take_video", None)) and callable(getattr(policy, "video_decoder", None))
    if max_viewers is not None:
        max_viewers = check_positive_int("max_viewers", max_viewers)
        if not watchable:
            raise ValueError(f"max_viewers is for a policy that predicts video (take_video and video_decoder, see "
                             f"WatchablePolicy); {type(policy).__name__} has none")
    own_executor = executor is None
    if own_executor:
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy")
    dispatcher = _Dispatcher(policy, executor, max_batch_size)
    greeting = pack(config.as_wire())
    open_by_address = ConnectionCounter()
    keys = itertools.count(1)
    robots: dict[str, RobotRecord] = {}
    activity = itertools.count(1)  # orders inferences: the most recently active robot is the default one to watch
    hub = VideoHub(policy, robots, max_viewers=max_viewers or DEFAULT_MAX_VIEWERS) if watchable else None

    async def serve_robot(websocket: WebSocket, key: str) -> None:
        last_session_id: str | None = None
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                if not await _send(websocket, "invalid message: a text frame; send each observation as one "
                                              "binary msgpack frame"):
                    return
                continue
            # Host-side checks first: a refused message reaches neither the policy thread nor the episode.
            try:
                obs = unpack(data, limits)
                endpoint, session_id = _request_fields(obs)
            except PolicyMessageError as error:
                if not await _send(websocket, f"invalid message: {error}"):
                    return
                continue
            except Exception as error:  # noqa: BLE001 - a codec bug: logged, this message refused, the connection kept
                logger.exception("reading a message from %s failed", key)
                if not await _send(websocket, f"invalid message: the server could not read it: {_failure(error)}"):
                    return
                continue
            try:
                if endpoint == "infer":
                    policy.validate(key, obs)
            except ValueError as error:
                if not await _send(websocket, f"invalid observation: {error}"):
                    return
                continue
            except Exception as error:  # noqa: BLE001 - a bug in validate must not end the connection
                logger.exception("policy validate failed for %s", key)
                if not await _send(websocket, f"invalid observation: the policy's check failed: {_failure(error)}"):
                    return
                continue
            new_episode = session_id is not None and last_session_id is not None and session_id != last_session_id
            if endpoint == "reset" or new_episode:
                try:
                    await dispatcher.control(policy.reset, key)
                except Exception as error:  # noqa: BLE001 - reported to this robot; others never notice
                    logger.exception("policy reset failed for %s", key)
                    if not await _send(websocket, f"reset failed: {_failure(error)}"):
                        return
                    continue  # the last session_id stays: a retry of the same message resets again
            if session_id is not None:
                last_session_id = session_id
                robots[key].session_id = session_id
            if endpoint == "reset":
                if not await _send(websocket, RESET_REPLY):
                    return
                continue
            result = await dispatcher.infer(key, obs)
            if isinstance(result, BaseException):
                reply: bytes | str = f"inference failed: {_failure(result)}"
            else:
                try:
                    reply = pack(result)
                except Exception as error:  # noqa: BLE001
                    reply = f"inference failed: the policy's result cannot be sent: {_failure(error)}"
            if not await _send(websocket, reply):
                return
            record = robots[key]
            record.inferences += 1
            record.active = next(activity)
            if hub is not None:  # after the reply: a viewer's decode never delays it
                hub.inferred(key)

    async def admitted_address(websocket: WebSocket) -> str | None:
        """The client's address, counted as one more open connection, or None (refused and told why).

        Decided from the handshake alone, before accept: robots and viewers pass the same rules (API key,
        Origin) and share the per-address connection count."""
        address = client_address(access, client=websocket.client, headers=websocket.headers)
        refusal = websocket_refusal(access, headers=websocket.headers, query=websocket.query_params,
                                    scheme=websocket.url.scheme, server=websocket.scope.get("server"),
                                    open_connections=open_by_address.open_connections(address))
        if refusal is not None:
            await deny_websocket(websocket, refusal)
            return None
        open_by_address.acquire(address)  # no await since the check: the count cannot have moved
        return address

    async def policy_websocket(websocket: WebSocket) -> None:
        if (address := await admitted_address(websocket)) is None:
            return
        number = next(keys)
        key = f"robot-{number}"
        robots[key] = RobotRecord(key, number)
        try:
            await websocket.accept()
            if await _send(websocket, greeting):
                await serve_robot(websocket, key)
        except Exception:  # noqa: BLE001 - a server bug: logged, this connection ends, the others go on
            logger.exception("policy connection %s failed", key)
            with contextlib.suppress(Exception):
                await websocket.close(1011, "internal error")
        finally:
            robots.pop(key, None)
            if hub is not None:
                hub.robot_gone(key)
            open_by_address.release(address)
            dispatcher.control_later(policy.close, key)

    async def watch_websocket(websocket: WebSocket) -> None:
        if (address := await admitted_address(websocket)) is None:
            return
        try:
            await hub.serve(websocket)
        except Exception:  # noqa: BLE001 - a server bug: logged, this viewer ends, robots and other viewers go on
            logger.exception("a viewer connection failed")
            with contextlib.suppress(Exception):
                await websocket.close(1011, "internal error")
        finally:
            open_by_address.release(address)

    async def healthz(request: Request) -> JSONResponse:
        listed = [{"robot": r.key, "session_id": r.session_id, "inferences": r.inferences,
                   "viewers": 0 if hub is None else hub.watching(r.key)} for r in robots.values()]
        body = {"status": "ok", "model": name, "robots": len(robots), "connected_robots": listed,
                "batches": dispatcher.batches, "largest_batch": dispatcher.largest_batch, "config": config.as_wire()}
        if hub is not None:
            body.update(viewers=hub.total_viewers(), chunks_decoded=hub.chunks_decoded)
        return JSONResponse(body)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        with contextlib.ExitStack() as logs:
            if access.api_key is not None:  # uvicorn logs each request's query string, a ?token= key included
                logs.enter_context(redacted_tokens_in_uvicorn_logs(access.api_key))
            try:
                yield
            finally:
                await dispatcher.stop(timeout_s=10.0)
                if own_executor:
                    executor.shutdown(wait=False)
                if hub is not None:
                    hub.stop()

    routes = [WebSocketRoute("/", policy_websocket), Route("/healthz", healthz)]
    if hub is not None:
        routes.append(WebSocketRoute(REALTIME_VIDEO_PATH, watch_websocket))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dispatcher = dispatcher
    app.state.robots = robots
    app.state.video_hub = hub
    return app


# -- a client -----------------------------------------------------------------------------------------


class PolicyClient:
    """A synchronous client of the policy protocol (what openpi's ``WebsocketClientPolicy`` does, plus
    ``reset``): connects, reads the server's config (:attr:`server_config`), then ``infer`` / ``reset``.

    ``api_key`` is sent as ``Authorization: Api-Key <key>`` (openpi's spelling). A text reply to ``infer``
    raises :class:`PolicyServerError` (a ``RuntimeError``, as openpi's client raises) with the server's message;
    the connection stays usable. :attr:`connection` is the ``websockets`` connection, for raw frames.
    """

    def __init__(self, uri: str, *, api_key: str | None = None, timeout_s: float | None = 60.0,
                 **connect_kwargs: Any) -> None:
        from websockets.sync.client import connect

        headers = dict(connect_kwargs.pop("additional_headers", None) or {})
        if api_key is not None:
            headers["Authorization"] = f"Api-Key {api_key}"
        connect_kwargs.setdefault("open_timeout", timeout_s)
        self.timeout_s = timeout_s
        # Entered as a context manager (closed by close()): websockets >= 17.1 warns about a bare connect().
        self.connection = connect(uri, compression=None, max_size=None, additional_headers=headers or None,
                                  **connect_kwargs).__enter__()
        try:
            first = self.connection.recv(timeout=timeout_s)
            if isinstance(first, str):
                raise PolicyServerError(first)
            self.server_config = unpack(first)
        except BaseException:
            self.connection.close()
            raise

    def send_raw(self, payload: bytes | str) -> bytes | str:
        """Send one frame as is; the reply frame (bytes, or the text of an error)."""
        self.connection.send(payload)
        return self.connection.recv(timeout=self.timeout_s)

    def infer(self, obs: dict[str, Any]) -> Any:
        """The server's reply to ``obs`` (an inference unless ``obs`` names another ``endpoint``)."""
        reply = self.send_raw(pack(obs))
        if isinstance(reply, str):
            raise PolicyServerError(reply)
        return _decode(reply, _CLIENT_LIMITS)

    def reset(self, reset_info: dict[str, Any] | None = None) -> str:
        """Ask for a new episode (``reset_info`` may carry a ``session_id``); the server's text reply."""
        reply = self.send_raw(pack({**(reset_info or {}), "endpoint": "reset"}))
        if reply != RESET_REPLY:
            raise PolicyServerError(reply if isinstance(reply, str) else "unexpected binary reply to reset")
        return reply

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
