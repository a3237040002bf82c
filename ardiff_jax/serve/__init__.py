"""``ardiff-jax serve``: a realtime video server (Starlette on uvicorn) on top of the control plane.

The robot-policy server (openpi / RoboArena policy protocol, ``WS /`` and ``GET /healthz``) is
:func:`create_policy_app`, generic over a :class:`RobotPolicy`; its protocol and guarantees are in the
:mod:`ardiff_jax.serve._policy` module docstring. A policy that predicts video (DreamZero) can also be
watched there on a watch-only ``WS /v1/realtime/video`` speaking the protocol below (:mod:`ardiff_jax.serve._watch`).
The rest of this docstring is the video server.

Routes
======
* ``WS /v1/realtime/video``: one WebSocket per generation session (the vLLM-Omni streaming
  video protocol, below);
* ``GET /healthz``: JSON ``{"status", "model", "sessions": {"connected", "streaming",
  "admitted", "resident", "closing"}, "capacity"}``; ``status`` is ``ok``, ``stalled`` (the generation
  loop has been on one chunk for over ``stall_timeout_s``: every session waits) or ``stopped``;
  ``closing`` counts sessions whose engine close failed and is being retried (with a bounded
  backoff, 0.05 s doubling to 2 s; the slot frees once the engine releases the session);
* ``GET /metrics``: Prometheus text (names prefixed ``ardiff_``);
* while ``ardiff-jax serve`` still builds the model (:class:`StartingApp`): ``/healthz`` (any HTTP
  path) answers at once 503 with ``Retry-After`` and ``{"status": "starting", "building",
  "stage", "elapsed_s"}``, and a WebSocket is told ``error`` ``starting`` (retry) and closed
  with 1013 (try again later), never left waiting;
* ``GET /``: the browser client (``static/index.html``, one page, no external resources): plays
  the stream at the session's announced rate behind a small jitter buffer (0.1 s; ``jpeg`` on
  a canvas, ``m4s`` through Media Source Extensions), sends the arrow keys / WASD as actions
  (release: ``no-op``), a prompt box for text worlds, start / stop buttons, and a stats line:
  frames/s presented (counted the same way in both formats: each new frame on screen), chunk
  latency, the last action's action-to-display latency (sending it to the first frame
  generated with it on screen), and the server's real rate and underruns.

Design
======
* **One asyncio task per connection reads** its messages (plus a sender task and a watchdog
  task per connection). Parsing (:mod:`~ardiff_jax.serve._protocol`) yields frozen values or an
  ``error`` reply; what a field means for the model is :class:`ServedWorld`'s business.
* **One state machine per connection** (:mod:`~ardiff_jax.serve._connection`): ``waiting`` ->
  ``starting`` (a start holds a slot) -> ``streaming`` -> ``finishing`` (last chunk made, or
  ``session.stop``) -> ``closing`` (the engine close runs) -> ``ended`` -> ``waiting`` again after
  ``session.done`` (a fresh session record), or ``closed`` once the connection is released; an
  error, a timeout or a disconnect goes from any live state to ``closing`` (a session exists)
  or ``ended`` (none yet). ``/healthz`` counts ``streaming`` and ``admitted`` (``starting``
  through ``closing``) from these states alone. A move outside the table is a server bug: it
  is logged and that connection is closed with ``internal_error`` (1011); no other connection
  notices.
* **One generation loop per app, paced.** Each session plays at its frame rate (``fps``), and its
  chunks are generated just in time for playback: at most ``lookahead_chunks`` (default 1)
  beyond the one playing (:mod:`ardiff_jax.serve._pacing`: playback starts when the first
  chunk is ready; chunk ``k`` is due once playback reaches chunk ``k - lookahead``). The loop
  makes one chunk at a time, for the due session whose playback needs it soonest (earliest
  deadline first), and sleeps when nothing is due. A chunk ready after its play time is an
  underrun: that session's playback waits (nothing is skipped), so when the engine cannot keep
  up every session slows by the same share, and each chunk's metadata and ``/metrics`` say so.
  ``ServerSettings(paced=False)`` (``--no-pacing``) generates as fast as the engine goes.
  Sessions due at the same time are generated together: their ticks go to one
  ``engine.generate_batch`` call (one forward for all of them where the pipeline batches; at
  most the engine's resident capacity per call; ``batch_ticks=False`` or an engine without it,
  such as a router, makes them one by one), and a session whose request fails in a batch ends
  alone. A chunk is
  ``ARDiffusionSession.next_chunk()`` of the control plane
  (:class:`~ardiff_jax.realtime.ARDiffusionSessionManager` over an
  :class:`~ardiff_jax.realtime.EngineTickConsumer` and an
  :class:`~ardiff_jax.realtime.EngineSessionLifecycle` sharing one single-thread executor, so
  ticks and releases reach the engine one at a time, off the event loop). The consumer's
  inputs provider maps a tick's controls to the pipeline's inputs (:meth:`ServedWorld.inputs`).
* **Encoding** runs on an encoder thread pool, one encoder per session; a session's chunks are
  encoded in order while the engine already runs the next session's tick.
* **Sending**: each connection has a bounded send queue drained by its sender task. A chunk is
  one item (its ``video.chunk_metadata`` text frame, then its binary frame), so the pair is
  never split. While a connection has ``max_queued_chunks`` chunks waiting, the generation loop
  skips its session (the session pauses, no chunk is made to be dropped) until its sender takes
  one: a client that reads slowly gets every chunk at its own pace, and never stalls the loop or
  other sessions. (The queue's own backstop would drop the oldest chunk, counted by the
  ``ardiff_`` dropped-chunk metric; the first ``m4s`` chunk, the stream header, never.)
  ``transport_chunk_index`` is assigned when a chunk is sent, so it stays consecutive from 0 on
  each connection; ``generation_chunk_index`` is the control plane's chunk index.
  Replies to a client's own messages are never dropped: at most ``max_queued_control`` wait,
  after which that connection's reader waits (its own input is throttled, nobody else's).

Protocol
========
Client -> server (JSON text frames; binary frames are refused with ``unexpected_binary``):

* ``session.start``: ``format`` ``"m4s"`` (default) or ``"jpeg"``; ``num_frames`` (positive;
  without it the session runs until ``session.stop`` or disconnect); ``seed`` (``[0, 2**31)``;
  default random, reported back); ``prompt`` (required by text-conditioned worlds, ignored by
  the sprite world); ``width`` / ``height`` (an integer multiple of the native frame size, the
  same factor for both: the frames are upscaled by it); ``fps`` (integer: the rate the session
  plays at, paced and written into the media; default the model's, 16 for Wan, 10 for the
  sprite and latent worlds; once the server has timed ``fps_samples`` chunks, a rate above
  what the engine sustains for one session is clamped to it). ``model``, ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``,
  ``extra_params`` and ``image_reference`` are type-checked and ignored (listed in
  ``config.ignored_fields``), except ``image_reference`` by a Matrix-Game world: its start picture,
  ``{"image_url": "data:image/png;base64,..."}`` (PNG, JPEG or WebP, up to 16 MiB, declaring at
  most 16 times the frame's pixels; anything else is ``invalid_field``), read once the start is
  admitted (a full server answers ``capacity`` without reading it) and off the event loop.
  Answered with ``video.start`` ``{request_id, format, config}``; ``config`` lists the
  accepted values, ``controls`` (``"prompt"``, ``"camera"``, ``"action"``), the action values
  and the camera modes, and the pacing: ``fps`` (the rate granted), ``requested_fps``,
  ``fps_limit`` (the frames/s the engine sustains for one session, ``null`` until measured),
  ``paced`` and ``lookahead_chunks``.
* ``session.interaction``: ``{"interaction": {"event_id"?, "event": {"prompt"?,
  "multi_modal_data"?: {"camera"?, "action"?: {"value": name}}}, "transition_chunks"?}}``.
  Answered ``session.interaction.queued`` ``{request_id, event_id, duplicate}``: ``queued``
  means accepted, applied by a later chunk. Without ``event_id`` the server assigns one and
  returns it. String wire ids become the control plane's integer event ids in arrival order;
  a wire id seen before (the last 4096 are remembered) is answered ``queued`` with
  ``"duplicate": true`` and not queued again (the first copy wins). An event the world cannot
  apply (a prompt for the sprite world, an unknown action, a camera for a text world) or the
  control plane refuses (its queue of ``max_pending_events`` is full) gets ``error`` code
  ``interaction_rejected`` with the ``event_id``; the session keeps streaming and the id may be
  sent again. An event applies to the next chunk generated after it arrives (with the default
  lookahead, at most two chunks after the one the client last received). Controls persist
  until replaced: an action (or camera velocity) holds until another event sets a new one. A
  camera in ``target`` mode (sprite world) walks the agent to an absolute cell over
  ``transition_chunks`` chunks (default 4; see the ``ardiff_jax.serve._world`` module doc);
  ``transition_chunks`` has no effect on velocity controls, which apply from the next chunk.
* ``session.ping``: ``session.pong`` (its delivery refreshes the stall clock, like any frame the
  client takes).
* ``session.stop``: no more chunks; ``session.done`` ``{request_id, chunks, stopped: true}``
  after the chunks already generated; the control-plane session is closed (the engine releases
  its KV). A session with ``num_frames`` ends the same way with ``stopped: false`` after its
  last frame (the last chunk is trimmed to it). ``chunks`` counts the media chunks sent for the
  session. The socket stays open: the client may send another ``session.start`` on it (a new
  ``request_id``; chunk indices and event ids start afresh), or close it. A connection left
  idle after its ``session.done`` is closed normally (1000) after ``start_timeout_s``.

Server -> client per chunk: ``video.chunk_metadata`` ``{request_id, kind: "media",
transport_chunk_index, generation_chunk_index, num_frames, byte_length, started_event_ids,
active_event_ids, completed_event_ids, latency_ms, fps, real_fps, real_time_factor,
underruns}`` then one binary frame (``m4s``: the next
piece of one fragmented MP4 stream; ``jpeg``: a 4-byte big-endian frame count, then per frame a
4-byte big-endian length and the JPEG). Event ids are wire ids: *started* were first applied
by this chunk, *active* are in effect in it (for each field, prompt or control track, the last
event that set it), *completed* were in effect before (or started here) and no longer are,
every field they set having been replaced; each id is reported completed once.
``latency_ms`` is the chunk's engine plus encode time. ``fps`` is the session's rate,
``real_fps`` the frames per second it was really generated at over its last 8 chunks and
``real_time_factor`` their ratio (``null`` until two chunks exist; about 1.0 while the engine
keeps up, below when it cannot), ``underruns`` the session's chunks so far that were ready after
their play time.

Errors are ``{"type": "error", "code", "message", "event_id"?}``. Codes: ``invalid_json``,
``unknown_type``, ``invalid_field`` (the message names the field), ``message_too_large`` (a
text frame over ``max_message_bytes``, ignored), ``unexpected_binary``, ``not_started``,
``already_started``, ``session_ended``, ``capacity`` (a start beyond the server's capacity:
the socket stays open and the client may retry; a live session is never evicted; the start
clock restarts; a session the engine still holds, its close having failed, counts),
``interaction_rejected``, ``interaction_failed`` (a queued event whose chunk failed),
``starting`` (the server is still building its model: connect again later; the socket closes,
1013), ``unavailable`` (its build failed; closes, 1013),
``generation_failed`` (generating or encoding a chunk failed; then the socket closes,
1011), ``internal_error`` (a server bug, logged; closes, 1011), ``start_timeout`` (no session
started within ``start_timeout_s``; the socket closes, 1008), ``stall`` (a started session
whose client took nothing, no chunk and no reply, for ``stall_timeout_s``; closes, 1008). A
disconnect closes the session and releases its KV.

Capacity: the engine's resident session capacity, plus the sessions its host tier holds when
host offload is on (the round-robin then swaps sessions between device and host, each resuming
exactly); for an :class:`~ardiff_jax.runtime.ARDiffusionRouter`, the sum over its replicas.

Guarantees
==========
The server never waits on one client; it keeps serving everyone else whatever one client does.

* **Nothing shared waits for a client.** The generation loop and the watchdogs never await a
  send: replies they produce (``interaction_failed``, the final ``error``, ``session.done``)
  are queued without waiting; an ``interaction_failed`` that finds the control queue full is
  dropped, the final message and the close always get through (one past the bound).
* **A client that does not read is stalled.** A send completes only when the transport takes
  the frame, so the server sees what a client consumes. A streaming session whose client takes
  nothing for ``stall_timeout_s`` gets ``stall`` and is closed, however many chunks were made
  for it; generation for it pauses while its send queue is full.
* **Timeouts hold whatever the client does.** Flooding messages changes no clock. A closing
  connection (``session.done``, an error, a timeout) whose client takes nothing for
  ``close_timeout_s`` is dropped without the rest; its session, slot and resources are freed
  either way.
* **A failed chunk ends its session**, whether generating or encoding it failed: the client gets
  ``generation_failed`` (1011) and the slot is freed.
* **Cleanup always completes.** An engine close that raises is logged and retried in the
  background; the socket still ends (``session.done`` or the error). The slot is free once the
  engine released the session: while it still holds it (its session events say so) the slot
  stays taken, and a start that finds the server full retries the close.
* **Capacity never exceeds what stays resident.** ``ServerSettings.capacity`` above the engine's
  capacity (plus its host tier) is clamped to it, with a logged warning; a start is admitted
  only while the admitted sessions and the sessions the engine holds, together, leave room, so
  the engine never evicts a served session to make room for another.
* **A start picture costs a bounded amount, off the event loop.** Its header is read first and a
  picture declaring more than 16 times the frame's pixels is ``invalid_field`` before any
  pixel is decoded; a full server reads none; decoding runs on a worker thread.
* **Hostile JSON gets a reply.** Numbers beyond Python's integer-digit limit and nesting deeper
  than 32 levels are ``invalid_json``; any unexpected error while handling a message is logged
  and answered with ``internal_error`` (then 1011), never a silent drop.
"""

from ardiff_jax.serve._access import ServerAccess, read_api_key_file
from ardiff_jax.serve._app import REALTIME_VIDEO_PATH, ServerSettings, create_app
from ardiff_jax.serve._policy import (
    PolicyClient,
    PolicyLimits,
    PolicyMessageError,
    PolicyServerConfig,
    PolicyServerError,
    TRANSPORT_MAX_BYTES as POLICY_TRANSPORT_MAX_BYTES,
    RobotPolicy,
    create_policy_app,
)
from ardiff_jax.serve._robots import DreamZeroServeOptions, build_dreamzero_app
from ardiff_jax.serve._policy import pack as pack_policy_message
from ardiff_jax.serve._policy import unpack as unpack_policy_message
from ardiff_jax.serve._protocol import ProtocolError
from ardiff_jax.serve._starting import StartingApp
from ardiff_jax.serve._world import ServedWorld, StartPlan, camera_action

__all__ = ["REALTIME_VIDEO_PATH", "POLICY_TRANSPORT_MAX_BYTES", "DreamZeroServeOptions", "build_dreamzero_app",
           "PolicyClient", "PolicyLimits", "PolicyMessageError", "PolicyServerConfig",
           "PolicyServerError", "ProtocolError", "RobotPolicy", "ServedWorld", "ServerAccess", "ServerSettings",
           "StartPlan", "StartingApp", "camera_action", "create_app", "create_policy_app", "pack_policy_message",
           "read_api_key_file", "unpack_policy_message"]
