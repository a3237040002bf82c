"""``SendQueue``: one connection's outbound messages, bounded so that a slow reader never stalls anyone else.

Two kinds of items share one FIFO, so the client sees them in the order they were produced:

* **control** messages (``video.start``, ``session.interaction.queued``, ``error``,
  ``session.pong``, ``session.done``): :meth:`SendQueue.put_control` never drops, it waits for
  room while ``max_control`` wait. Only the connection's own reader uses it, so the wait
  throttles that client's input and nothing else. Writers that serve everyone (the shared
  generation loop, the watchdogs) must never wait for one client: :meth:`SendQueue.offer_control`
  drops the message when the bound is reached, and :meth:`SendQueue.close` queues a
  connection's last message (``session.done`` or the final ``error``) with the close at once,
  past the bound (by one: nothing follows a close).
* **media** pairs (a ``video.chunk_metadata`` and its binary frame, one item, so the pair can
  never be split) come from the shared generation loop. :meth:`SendQueue.put_media` never
  blocks: when ``max_media`` pairs are waiting, the oldest droppable pair is dropped
  (``on_drop`` counts it). A pair marked not droppable (the first ``m4s`` fragment carries the
  stream header) is kept; the bound then allows one more. The server stops generating for a
  connection while :attr:`SendQueue.media_full`, so the drop is only the queue's own backstop.

A ``close`` item ends the stream: the sender (:func:`drain_to_websocket`) sends everything
queued before it, then closes the socket with its code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["OutboundItem", "SendQueue", "drain_to_websocket", "until_first_ends"]


@dataclasses.dataclass(frozen=True)
class OutboundItem:
    """``kind`` ``"control"`` (``message``), ``"media"`` (``message`` + ``payload``) or ``"close"`` (``code``, ``reason``)."""

    kind: str
    message: dict[str, Any] | None = None
    payload: bytes = b""
    droppable: bool = True
    code: int = 1000
    reason: str = ""


class SendQueue:
    """See the module docstring. ``on_depth(delta)`` follows the number of queued items."""

    def __init__(self, *, max_media: int, max_control: int, on_drop: Callable[[], None] = lambda: None,
                 on_depth: Callable[[int], None] = lambda delta: None) -> None:
        if max_media < 1 or max_control < 1:
            raise ValueError(f"SendQueue bounds must be positive, got max_media={max_media}, "
                             f"max_control={max_control}")
        self._items: collections.deque[OutboundItem] = collections.deque()
        self._max_media = max_media
        self._max_control = max_control
        self._media = 0
        self._control = 0
        self._closed = False
        self._on_drop = on_drop
        self._on_depth = on_depth
        self._readable = asyncio.Event()
        self._control_room = asyncio.Event()
        self._control_room.set()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """A close item was queued: nothing more is accepted."""
        return self._closed

    @property
    def media_full(self) -> bool:
        """``max_media`` pairs wait: a producer that must not drop should stop making more."""
        return self._media >= self._max_media

    def _push(self, item: OutboundItem) -> None:
        self._items.append(item)
        self._on_depth(1)
        self._readable.set()

    async def put_control(self, message: dict[str, Any]) -> bool:
        """Queue a control message, waiting while ``max_control`` are queued; False once closed."""
        while self._control >= self._max_control and not self._closed:
            self._control_room.clear()
            await self._control_room.wait()
        if self._closed:
            return False
        self._control += 1
        self._push(OutboundItem("control", message))
        return True

    def offer_control(self, message: dict[str, Any]) -> bool:
        """Queue a control message without waiting; False (the message is dropped) when ``max_control`` are
        queued or the queue is closed."""
        if self._closed or self._control >= self._max_control:
            return False
        self._control += 1
        self._push(OutboundItem("control", message))
        return True

    def put_final(self, message: dict[str, Any]) -> bool:
        """Queue a session's last control message (``session.done``) without waiting, past the control bound if
        need be (by one per session: the next session's replies wait for room again); False once closed."""
        if self._closed:
            return False
        self._control += 1
        self._push(OutboundItem("control", message))
        return True

    def put_media(self, message: dict[str, Any], payload: bytes, *, droppable: bool = True) -> bool:
        """Queue a media pair, dropping the oldest droppable one when full; False once closed."""
        if self._closed:
            return False
        if self._media >= self._max_media:
            for index, queued in enumerate(self._items):
                if queued.kind == "media" and queued.droppable:
                    del self._items[index]
                    self._media -= 1
                    self.dropped += 1
                    self._on_depth(-1)
                    self._on_drop()
                    break
        self._media += 1
        self._push(OutboundItem("media", message, payload, droppable))
        return True

    def close(self, code: int = 1000, reason: str = "", message: dict[str, Any] | None = None) -> bool:
        """Queue ``message`` (the last control message, past the control bound if need be), then the close item,
        without waiting; False (nothing queued) once closed. Control writers waiting for room give up."""
        if self._closed:
            return False
        self._closed = True
        if message is not None:
            self._control += 1
            self._push(OutboundItem("control", message))
        self._push(OutboundItem("close", code=code, reason=reason))
        self._control_room.set()
        return True

    async def get(self) -> OutboundItem:
        """The next item, waiting for one."""
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        self._on_depth(-1)
        if item.kind == "media":
            self._media -= 1
        elif item.kind == "control":
            self._control -= 1
            self._control_room.set()
        return item

    def discard(self) -> None:
        """Drop everything still queued (the connection is gone)."""
        self._on_depth(-len(self._items))
        self._items.clear()
        self._media = self._control = 0
        self._closed = True
        self._control_room.set()


async def drain_to_websocket(queue: SendQueue, websocket: Any, *, before_media: Callable[[], None] | None = None,
                             after_send: Callable[[], None] | None = None) -> None:
    """Send ``queue``'s items on ``websocket`` until its ``close`` item (then close the socket with its code).

    A media item is its ``video.chunk_metadata`` text frame, with ``transport_chunk_index`` assigned here
    (consecutive from 0 on the socket), then its binary frame; a ``session.done`` gets ``chunks``, the
    media items sent since the last one, and restarts the count. ``before_media`` runs as a media item
    leaves the queue, ``after_send`` once the transport took an item. A send completes once the transport
    takes the frame, so a client that does not read blocks here, in its own task. A send that fails
    raises (the client went away): the caller decides what that means.
    """
    transport_index = 0
    while True:
        item = await queue.get()
        if item.kind == "close":
            await websocket.close(item.code, item.reason)
            return
        assert item.message is not None
        if item.kind == "media":
            if before_media is not None:
                before_media()
            await websocket.send_text(json.dumps({**item.message, "transport_chunk_index": transport_index}))
            await websocket.send_bytes(item.payload)
            transport_index += 1
        else:
            message = item.message
            if message.get("type") == "session.done":
                message = {**message, "chunks": transport_index}
                transport_index = 0  # a next session on this socket counts its chunks from 0
            await websocket.send_text(json.dumps(message))
        if after_send is not None:
            after_send()


async def until_first_ends(*coroutines: Coroutine[Any, Any, Any]) -> None:
    """Run one socket's tasks (its reader, its sender, ...) until the first of them ends, then cancel the others
    and wait for them: whichever ends first (a disconnect, a close sent, a watchdog) ends the connection."""
    tasks = [asyncio.create_task(coroutine) for coroutine in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
