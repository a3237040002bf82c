"""Watching a robot's predicted video: the policy server's watch-only ``WS /v1/realtime/video``.

A policy that predicts video with its actions (DreamZero) may be watched while robots drive it. The socket speaks
the realtime video protocol of :mod:`ardiff_jax.serve` (its messages, error codes and chunk framing), watch-only:

* ``session.start`` ``{"format"?, "robot"?}``: ``format`` ``"jpeg"`` (the default here) or ``"m4s"``; ``robot``
  names the robot to watch: its connection key (``"robot-1"``, listed by ``GET /healthz`` under
  ``connected_robots``) or its openpi ``session_id`` (the most recently active robot that sent it); without it, the
  most recently active robot. The key is resolved once: the stream follows that connection. Answered with
  ``video.start`` ``{request_id, format, config: {robot, session_id, width, height, fps, watch_only, controls}}``;
  an unknown robot (or none connected) is ``error`` ``unknown_robot`` naming the connected ones, a format other
  than the two ``invalid_field``, more viewers than the server's ``max_viewers`` ``capacity``; the socket stays
  open after each, and the viewer may start again.
* Then, after each inference of that robot (after the robot's reply is sent), the video the policy predicted in it,
  decoded to pixels, as one ``video.chunk_metadata`` (the realtime fields, ``width``, ``height``,
  ``robot``, ``robot_inference``, ``episode_start``, ``continued``, ``decode_ms``, ``dropped_chunks``) and one binary
  frame (``jpeg`` or ``m4s``, as the realtime server frames them).
* ``session.ping``: ``session.pong``. ``session.stop``: ``session.done`` ``{request_id, chunks, stopped: true}``.
  When the watched robot disconnects: ``session.done`` with ``stopped: false`` and ``reason``
  ``"robot_disconnected"``. ``session.interaction``: ``interaction_rejected`` (nothing to steer).

Design:

* **Decoding happens only while somebody watches.** The policy keeps the last predicted video per robot
  (``take_video``); this module takes it only for a robot with a viewer, after that robot's reply was sent, so a
  reply never waits for a decode and a robot nobody watches costs no decode.
* **One worker thread decodes** (not the policy's thread): each viewer's chunks are decoded and encoded there in
  order, by the viewer's own decoder (``policy.video_decoder()``, a streaming VAE cache).
* **A viewer that falls behind skips chunks.** Each viewer holds at most one undecoded chunk (a newer one replaces
  it: counted in ``dropped_chunks``) and at most 2 chunks waiting to be sent (the send queue drops the oldest).
* **A failure ends only its viewer**: a decode or encode that raises sends that viewer ``generation_failed`` and
  closes it (1011); robots and other viewers never notice. A viewer disconnecting changes nothing for the robot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from typing import Any, Protocol, runtime_checkable

from ardiff_jax.serve._encode import make_encoder
from ardiff_jax.serve._protocol import (
    ProtocolError,
    SessionInteraction,
    SessionPing,
    SessionStart,
    SessionStop,
    error_message,
    parse_client_message,
)
from ardiff_jax.serve._send_queue import SendQueue, drain_to_websocket, until_first_ends

__all__ = ["DEFAULT_MAX_VIEWERS", "WATCH_FORMATS", "RobotRecord", "VideoHub", "WatchStart", "WatchablePolicy",
           "parse_watch_message"]

logger = logging.getLogger(__name__)

#: Formats a viewer may ask for; the first is the default (any chunk decodes alone, the cheapest to make).
WATCH_FORMATS = ("jpeg", "m4s")
#: Viewers one server decodes for at once (each holds a VAE decode cache on the device: 1016 MiB in bf16 at DROID).
DEFAULT_MAX_VIEWERS = 4
#: Chunks waiting to be sent per viewer; beyond, the oldest is dropped.
MAX_QUEUED_CHUNKS = 2
#: Replies waiting per viewer; beyond, that viewer's reader waits.
MAX_QUEUED_CONTROL = 8
#: The largest text frame a viewer may send.
MAX_WATCH_MESSAGE_BYTES = 64 * 1024
#: The longest ``robot`` a start may name (an openpi ``session_id`` is at most 256 characters).
MAX_ROBOT_CHARS = 256
#: Robots an ``unknown_robot`` error names before "and N more".
_NAMED_ROBOTS = 16
CLOSE_INTERNAL = 1011


@runtime_checkable
class WatchablePolicy(Protocol):
    """A :class:`~ardiff_jax.serve.RobotPolicy` whose inferences predict video (what the watch socket needs).

    * ``take_video(session_key)``: the key's last inference's predicted video, handed over once (None when there is
      none); called on the event loop, so it must not wait (e.g. for the policy's lock).
    * ``video_decoder()``: a fresh decoder for one viewer, with ``frame_size`` ``(height, width)``, ``fps``, and
      ``decode(video) -> (uint8[F, height, width, 3], info)`` (``info``: JSON-able fields added to the chunk's
      metadata), called on the decode thread, one call at a time per decoder.
    """

    def take_video(self, session_key: str) -> Any: ...

    def video_decoder(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class WatchStart:
    """A viewer's ``session.start``: the ``format`` and the ``robot`` to watch (None: the most recently active)."""

    format: str = WATCH_FORMATS[0]
    robot: str | None = None


def parse_watch_message(text: str) -> WatchStart | SessionInteraction | SessionPing | SessionStop:
    """One viewer text frame -> its message; :class:`ProtocolError` as the realtime protocol raises it.

    The realtime parser checks the JSON, the type and every field it knows (``format`` among them); a start is read
    again for what watching adds (``robot``, and ``jpeg`` as the default format).
    """
    message = parse_client_message(text)
    if not isinstance(message, SessionStart):
        return message
    payload = json.loads(text)  # valid: it was just parsed
    robot = payload.get("robot")
    if robot is not None and (not isinstance(robot, str) or not robot.strip() or len(robot) > MAX_ROBOT_CHARS):
        shown = json.dumps(robot)[:80] if isinstance(robot, (str, int, float, bool, list, dict)) else repr(robot)
        raise ProtocolError("invalid_field", f"robot must be a robot's key (as /healthz lists it) or its session_id, "
                                             f"a non-blank string of at most {MAX_ROBOT_CHARS} characters, got {shown}")
    fmt = payload.get("format") or WATCH_FORMATS[0]
    return WatchStart(format=fmt, robot=robot)


@dataclasses.dataclass
class RobotRecord:
    """What the server knows of one connected robot (mutable: the connection's handler updates it)."""

    key: str
    connected: int  # the order it connected in
    session_id: str | None = None
    inferences: int = 0
    active: int = 0  # the order of its last inference (0: none yet)


class _Viewer:
    def __init__(self, websocket: Any) -> None:
        self.websocket = websocket
        self.queue = SendQueue(max_media=MAX_QUEUED_CHUNKS, max_control=MAX_QUEUED_CONTROL)
        self.request_id: str | None = None
        self.robot: str | None = None
        self.decoder: Any = None
        self.encoder: Any = None
        self.pending: Any = None  # the newest chunk not yet decoded (one slot: an older one is stale)
        self.wake = asyncio.Event()
        self.worker: asyncio.Task | None = None
        self.decoded = 0
        self.dropped = 0


class VideoHub:
    """The viewers of one policy server and the decode worker they share (see the module docstring).

    ``robots`` is the server's record of its connected robots (it adds and removes them); the server calls
    :meth:`inferred` after each reply it sent and :meth:`robot_gone` when a robot's connection ended."""

    def __init__(self, policy: Any, robots: dict[str, RobotRecord], *, max_viewers: int = DEFAULT_MAX_VIEWERS) -> None:
        self.policy = policy
        self.robots = robots
        self.max_viewers = max_viewers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.viewers: dict[str, set[_Viewer]] = {}
        self._ids = itertools.count(1)
        #: Chunks decoded (every viewer), and the decode seconds of the last: what ``/healthz`` reports.
        self.chunks_decoded = 0
        self.last_decode_s: float | None = None

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The decode thread (started with the first viewer; a stopped app's next lifespan starts a new one)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-video")
        return self._executor

    def watching(self, key: str) -> int:
        return len(self.viewers.get(key, ()))

    def total_viewers(self) -> int:
        return sum(len(viewers) for viewers in self.viewers.values())

    # -- called by the robots' side ----------------------------------------------------------------------
    def inferred(self, key: str) -> None:
        """The robot's reply was sent: give its predicted video to its viewers (taken only if it has some)."""
        viewers = self.viewers.get(key)
        if not viewers:
            return
        video = self.policy.take_video(key)
        if video is None:
            return
        for viewer in viewers:
            if viewer.pending is not None:
                viewer.dropped += 1  # the viewer fell behind: the older chunk is stale
            viewer.pending = video
            viewer.wake.set()

    def robot_gone(self, key: str) -> None:
        """The robot disconnected: each of its viewers gets ``session.done`` (``stopped: false``) and may start again."""
        for viewer in list(self.viewers.get(key, ())):
            request_id = viewer.request_id
            self._stop_watching(viewer)
            viewer.queue.put_final({"type": "session.done", "request_id": request_id, "chunks": 0, "stopped": False,
                                    "reason": "robot_disconnected"})

    # -- one viewer's connection ---------------------------------------------------------------------------
    async def serve(self, websocket: Any) -> None:
        """Serve one accepted-to-be viewer connection until it ends (the access checks were made by the caller)."""
        await websocket.accept()
        viewer = _Viewer(websocket)
        try:
            await until_first_ends(self._read(viewer), self._send(viewer))
        finally:
            self._stop_watching(viewer)
            viewer.queue.discard()

    async def _read(self, viewer: _Viewer) -> None:
        while True:
            message = await viewer.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            if viewer.queue.closed:
                continue
            try:
                if message.get("bytes") is not None:
                    raise ProtocolError("unexpected_binary", "the client sends JSON text frames only; a binary "
                                                             f"frame of {len(message['bytes'])} bytes was ignored")
                text = message.get("text") or ""
                size = len(text) if len(text) > MAX_WATCH_MESSAGE_BYTES else len(text.encode("utf-8", "surrogatepass"))
                if size > MAX_WATCH_MESSAGE_BYTES:
                    raise ProtocolError("message_too_large", f"message of {size} bytes exceeds the limit of "
                                                             f"{MAX_WATCH_MESSAGE_BYTES} bytes; it was ignored")
                await self._dispatch(viewer, parse_watch_message(text))
            except ProtocolError as error:
                await viewer.queue.put_control(error_message(error.code, error.message, error.event_id))

    async def _dispatch(self, viewer: _Viewer, message: Any) -> None:
        if isinstance(message, SessionPing):
            await viewer.queue.put_control({"type": "session.pong"})
        elif isinstance(message, WatchStart):
            await self._start(viewer, message)
        elif isinstance(message, SessionStop):
            if viewer.robot is None:
                raise ProtocolError("not_started", "session.stop before session.start: there is no stream to stop")
            request_id = viewer.request_id
            self._stop_watching(viewer)
            await viewer.queue.put_control({"type": "session.done", "request_id": request_id, "chunks": 0,
                                            "stopped": True})
        else:  # a session.interaction
            raise ProtocolError("interaction_rejected", "this stream watches a robot's predicted video; it takes "
                                                        "no interactions (the robot drives the policy)",
                                event_id=getattr(message, "event_id", None))

    def _choose(self, wanted: str | None) -> RobotRecord:
        """The robot a start names (its key, else the most recently active robot with that session_id), or the
        most recently active robot; ``unknown_robot`` naming the connected ones otherwise."""
        recent = sorted(self.robots.values(), key=lambda r: (r.active, r.connected), reverse=True)
        if wanted is None and recent:
            return recent[0]
        if wanted is not None:
            if wanted in self.robots:
                return self.robots[wanted]
            for record in recent:
                if record.session_id == wanted:
                    return record
        if not recent:
            raise ProtocolError("unknown_robot", "no robot is connected; start again once one is (GET /healthz "
                                                 "lists them under connected_robots)")
        named = [r.key + (f" (session_id {r.session_id!r})" if r.session_id is not None else "")
                 for r in recent[:_NAMED_ROBOTS]]
        more = f" and {len(recent) - _NAMED_ROBOTS} more" if len(recent) > _NAMED_ROBOTS else ""
        raise ProtocolError("unknown_robot", f"no robot {wanted!r} is connected; connected: {', '.join(named)}{more}")

    async def _start(self, viewer: _Viewer, start: WatchStart) -> None:
        if viewer.robot is not None:
            raise ProtocolError("already_started", f"this connection already watches {viewer.robot} "
                                                   f"({viewer.request_id}); send session.stop first")
        record = self._choose(start.robot)
        if self.total_viewers() >= self.max_viewers:
            raise ProtocolError("capacity", f"the server decodes for {self.max_viewers} viewers at most and has "
                                            f"{self.total_viewers()}; retry session.start later")
        decoder = self.policy.video_decoder()
        height, width = decoder.frame_size
        try:
            encoder = make_encoder(start.format, width=width, height=height, fps=decoder.fps)
        except Exception as error:  # noqa: BLE001 - e.g. m4s without PyAV: this start is refused, nothing else
            raise ProtocolError("invalid_field", f"format {start.format!r} is not available on this server: "
                                                 f"{type(error).__name__}: {error}") from None
        viewer.request_id = f"watch-{next(self._ids)}"
        viewer.robot, viewer.decoder, viewer.encoder = record.key, decoder, encoder
        viewer.pending, viewer.decoded, viewer.dropped = None, 0, 0
        self.viewers.setdefault(record.key, set()).add(viewer)
        viewer.worker = asyncio.create_task(self._decode_loop(viewer))
        await viewer.queue.put_control({
            "type": "video.start", "request_id": viewer.request_id, "format": start.format,
            "config": {"robot": record.key, "session_id": record.session_id, "width": width, "height": height,
                       "fps": decoder.fps, "watch_only": True, "controls": [], "max_queued_chunks": MAX_QUEUED_CHUNKS}})

    def _stop_watching(self, viewer: _Viewer) -> None:
        """Forget what the viewer watched (its worker cancelled, its encoder closed after any encode in flight)."""
        if viewer.robot is not None:
            viewers = self.viewers.get(viewer.robot)
            if viewers is not None:
                viewers.discard(viewer)
                if not viewers:
                    del self.viewers[viewer.robot]
        if viewer.worker is not None:
            viewer.worker.cancel()
        if viewer.encoder is not None:
            # On the decode thread, after an encode it may be running: closing here would wait for it on the loop.
            if self._executor is None:
                viewer.encoder.close()
            else:
                with contextlib.suppress(RuntimeError):  # the executor is shut down: the app is stopping
                    self._executor.submit(viewer.encoder.close)
        viewer.robot = viewer.decoder = viewer.encoder = viewer.worker = viewer.pending = None

    async def _decode_loop(self, viewer: _Viewer) -> None:
        loop = asyncio.get_running_loop()
        decoder, encoder, robot = viewer.decoder, viewer.encoder, viewer.robot
        while True:
            await viewer.wake.wait()
            viewer.wake.clear()
            video, viewer.pending = viewer.pending, None
            if video is None:
                continue
            try:
                frames, info, payload, decode_s, encode_s = await loop.run_in_executor(
                    self.executor, _decode_chunk, decoder, encoder, video)
            except Exception as error:  # noqa: BLE001 - this viewer's stream ends; robots and others never notice
                logger.warning("decoding the predicted video of %s for %s failed: %s: %s", robot, viewer.request_id,
                               type(error).__name__, error)
                request_id = viewer.request_id
                viewer.worker = None  # this task is ending: nothing to cancel
                self._stop_watching(viewer)
                viewer.queue.close(CLOSE_INTERNAL, "decoding failed", {
                    **error_message("generation_failed", f"decoding the predicted video failed: "
                                                         f"{type(error).__name__}: {error}"), "request_id": request_id})
                return
            self.chunks_decoded += 1
            self.last_decode_s = decode_s
            height, width = decoder.frame_size
            message = {"type": "video.chunk_metadata", "request_id": viewer.request_id, "kind": "media",
                       "generation_chunk_index": viewer.decoded, "num_frames": frames, "byte_length": len(payload),
                       "started_event_ids": [], "active_event_ids": [], "completed_event_ids": [],
                       "latency_ms": round((decode_s + encode_s) * 1e3, 3), "fps": decoder.fps, "real_fps": None,
                       "real_time_factor": None, "underruns": 0, "width": width, "height": height, "robot": robot,
                       **info, "decode_ms": round(decode_s * 1e3, 3), "dropped_chunks": viewer.dropped}
            # The first m4s fragment carries the stream header: without it nothing after it decodes.
            viewer.queue.put_media(message, payload, droppable=not (encoder.format == "m4s" and viewer.decoded == 0))
            viewer.decoded += 1

    async def _send(self, viewer: _Viewer) -> None:
        """Drain the viewer's queue onto its socket (:func:`drain_to_websocket`: a chunk is its metadata text
        frame, then its binary frame)."""
        try:
            await drain_to_websocket(viewer.queue, viewer.websocket)
        except Exception:  # noqa: BLE001 - the viewer went away (several exception types, by server); the reader sees it
            return

    def stop(self) -> None:
        """The app is stopping: no more decodes (a decode in flight finishes on its thread, its result unused)."""
        for viewers in list(self.viewers.values()):
            for viewer in list(viewers):
                self._stop_watching(viewer)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _decode_chunk(decoder: Any, encoder: Any, video: Any) -> tuple[int, dict[str, Any], bytes, float, float]:
    """On the decode thread: ``(frames, info, payload, decode seconds, encode seconds)`` of one chunk."""
    began = time.perf_counter()
    frames, info = decoder.decode(video)
    decoded = time.perf_counter()
    payload = encoder.encode(frames)
    return int(frames.shape[0]), dict(info), payload, decoded - began, time.perf_counter() - decoded
