"""Cursor arithmetic: which frames a forward sees and which pages hold them.

One implementation serves the host (``xp=numpy``, the runner path) and device code
(``xp=jax.numpy`` inside ``jit``, device-side rollouts), so both paths agree by
construction. Shapes depend only on the static layout and the number of current frames,
never on the fill level: filling, wrapping and resetting a window reuse one program.

A branch cursor is ``(run_base, committed, visible_start)``, optionally followed by the run's
*page table* (``i32[3 + K + W]``, :func:`make_table_cursor`): entry ``s`` is the page that holds
run slot ``s``. Without a table the run is the contiguous ``[run_base, run_base + K + W)``; with
one, a run's slots may sit anywhere in the pools and may be shared with another session's run
(a fork: the runtime remaps a shared slot to a fresh page before it is written, so a shared
page is never written). Which form a cursor has is its static shape, so each form is one
program; the runtime always passes tables.

The cursor fields:

* ``committed``: frames committed since the session (or its last reset) began;
* ``visible_start``: first non-sink frame still visible. It stays 0 in the sliding mode
  and jumps to ``committed`` after every commit under ``reset_at_boundary`` (only the
  sink survives a boundary).

Frame ``g`` of a run lives in run slot ``g`` if ``g < sink`` else in slot
``sink + (g - sink) mod window`` (:func:`slot_of_frame`): page ``base + slot``, or ``table[slot]``. For a forward with ``f`` current frames the
visible history is the sink ``[0, min(committed, sink))`` followed by the newest
``window - f`` non-sink frames ``[lo, committed)`` where
``lo = max(sink, visible_start, committed - (window - f))``: the current frames use up
window slots, so at most ``sink + window`` video frames are visible including them (the
reference runtime's rule: ``docs/reference_behaviour.md``, "Visible window").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ardiff_jax.kv._layout import KVLayout

__all__ = [
    "CURSOR_FIELDS",
    "VisibleHistory",
    "make_cursor",
    "make_table_cursor",
    "slot_of_frame",
    "page_of_frame",
    "cursor_pages",
    "cursor_block_pages",
    "visible_history",
    "visible_table",
    "run_visibility",
    "block_pages",
    "advance_cursor",
    "advance_frames",
]

#: Layout of the ``i32[3]`` cursor vector passed into jitted code.
CURSOR_FIELDS = ("run_base", "committed", "visible_start")


def make_cursor(run_base: int, committed: int, visible_start: int) -> np.ndarray:
    """The cursor vector, fields in :data:`CURSOR_FIELDS` order (host numpy).

    One leaf: cheaper to pass into jit than three scalars.

    Shapes:
      returns: i32[3]
    """
    return np.array([run_base, committed, visible_start], dtype=np.int32)


def make_table_cursor(run_base: int, committed: int, visible_start: int, table: Any) -> np.ndarray:
    """The cursor vector with the run's page table: ``(run_base, committed, visible_start, *table)`` (host numpy).

    ``table[s]`` is the page holding run slot ``s`` (the null page for a slot never written);
    ``run_base`` is the run's home (first) page, which a sharded pool uses to find its device group.

    Shapes:
      table: int[K+W]
      returns: i32[3+K+W]
    """
    return np.concatenate([np.array([run_base, committed, visible_start], np.int32),
                           np.asarray(table, np.int32)])


def slot_of_frame(layout: KVLayout, frame: Any, xp: Any = np) -> Any:
    """Run slot (``0 .. K+W-1``) holding absolute frame ``frame``: the sink slots, then the ring.

    Shapes:
      frame: int[...]
      returns: int[...]
    """
    sink, window = layout.sink_frames, layout.window_frames
    return xp.where(frame < sink, frame, sink + xp.mod(frame - sink, window))


def cursor_pages(layout: KVLayout, cursor: Any, frame: Any, xp: Any = np) -> Any:
    """Page id holding absolute frame ``frame`` of the run ``cursor`` describes.

    ``cursor`` is the table form (``int[3+K+W]``: a lookup) or the contiguous ``int[3]`` form
    (``run_base + slot``); which one is its static shape.

    Shapes:
      cursor: int[3+K+W]
      frame: int[...]
      returns: int[...]
    """
    if cursor.shape[-1] == 3:
        return page_of_frame(layout, cursor[0], frame, xp)
    table = cursor[3:]
    return xp.take(table, slot_of_frame(layout, frame, xp).astype(np.int32))


def cursor_block_pages(layout: KVLayout, cursor: Any, num_frames: int, xp: Any = np) -> Any:
    """Pages a commit of ``num_frames`` frames writes, in frame order (either cursor form, as :func:`cursor_pages`).

    Shapes:
      cursor: int[3+K+W]
      returns: i32[f]
    """
    frames = cursor[1] + xp.arange(num_frames, dtype=np.int32)
    return cursor_pages(layout, cursor, frames, xp).astype(np.int32)


class VisibleHistory(NamedTuple):
    """Visible committed frames: ``[0, num_sink)`` then ``[window_start, window_start + num_window)``.

    Shapes:
      num_sink, window_start, num_window: int[]
    """

    num_sink: Any
    window_start: Any
    num_window: Any


def page_of_frame(layout: KVLayout, run_base: Any, frame: Any, xp: Any = np) -> Any:
    """Page id holding absolute frame ``frame`` of the run starting at ``run_base``.

    Shapes:
      run_base: int[]
      frame: int[...]
      returns: int[...]
    """
    return run_base + slot_of_frame(layout, frame, xp)


def visible_history(layout: KVLayout, committed: Any, visible_start: Any, num_current_frames: int,
                    xp: Any = np) -> VisibleHistory:
    """The committed frames visible to a forward of ``num_current_frames`` (``f``) current frames.

    Shapes:
      committed, visible_start: int[]
      returns: VisibleHistory; each int[]
    """
    sink, window = layout.sink_frames, layout.window_frames
    num_sink = xp.minimum(committed, sink)
    window_start = xp.maximum(xp.maximum(visible_start, sink), committed - (window - num_current_frames))
    num_window = xp.maximum(committed - window_start, 0)
    return VisibleHistory(num_sink, window_start, num_window)


def visible_table(layout: KVLayout, cursor: Any, num_current_frames: int, xp: Any = np) -> tuple[Any, Any]:
    """Ordered visible history of a forward of ``num_current_frames`` (``f``): ``(pages, frames)``.

    Entries are ``[sink frames][newest history frames, oldest to newest]`` then padding;
    padded entries hold the null page ``P`` and frame ``-1``. Appending the current block
    and the extra tokens gives the reference key order ``[sink][history][current][extra]``.

    ``cursor`` may also be the table form ``int[3+K+W]`` (:func:`cursor_pages`).

    Shapes:
      cursor: int[3]
      returns: (pages, frames), each i32[K+W]
    """
    committed, visible_start = cursor[1], cursor[2]
    hist = visible_history(layout, committed, visible_start, num_current_frames, xp)
    index = xp.arange(layout.run_pages, dtype=np.int32)
    frames = xp.where(index < hist.num_sink, index, hist.window_start + (index - hist.num_sink))
    valid = index < hist.num_sink + hist.num_window
    pages = xp.where(valid, cursor_pages(layout, cursor, xp.maximum(frames, 0), xp), layout.null_page)
    frames = xp.where(valid, frames, -1)
    return pages.astype(np.int32), frames.astype(np.int32)


def run_visibility(layout: KVLayout, committed: Any, visible_start: Any, num_current_frames: int,
                   xp: Any = np) -> Any:
    """Which pages of a run (in physical order) hold a frame visible to ``f`` current frames.

    The fast attention path reads a run contiguously and masks with this; it selects
    exactly the frames of :func:`visible_table`, in ring order instead of time order.

    Shapes:
      committed, visible_start: int[]
      returns: bool[K+W]
    """
    sink, window = layout.sink_frames, layout.window_frames
    hist = visible_history(layout, committed, visible_start, num_current_frames, xp)
    index = xp.arange(layout.run_pages, dtype=np.int32)
    in_sink = index < hist.num_sink
    # Ring slot r holds, among the visible frames [window_start, window_start + num_window),
    # the one with (frame - sink) mod window == r; fewer than `window` frames are visible,
    # so at most one does.
    ring_offset = xp.mod(index - hist.window_start, window)  # (ring slot) - (slot of window_start)
    in_ring = (index >= sink) & (ring_offset < hist.num_window)
    return in_sink | in_ring


def block_pages(layout: KVLayout, run_base: Any, committed: Any, num_frames: int, xp: Any = np) -> Any:
    """Pages a commit of ``num_frames`` (``f``) frames writes, in frame order.

    In the sliding mode these are the ring pages of the oldest resident frames, exactly the
    ones the commit evicts; none of them is visible to the committing forward itself.

    Shapes:
      run_base, committed: int[]
      returns: i32[f]
    """
    frames = committed + xp.arange(num_frames, dtype=np.int32)
    return page_of_frame(layout, run_base, frames, xp).astype(np.int32)


def advance_cursor(layout: KVLayout, cursor: Any, num_frames: int, xp: Any = np) -> Any:
    """The cursor after committing ``num_frames`` frames.

    Eviction is eager and metadata-only: the new block overwrote the oldest ring pages, and
    under ``reset_at_boundary`` every non-sink frame stops being visible.

    A table-form cursor (``int[3+K+W]``) keeps its table.

    Shapes:
      cursor: int[3]
      returns: i32[3]
    """
    committed, visible_start = advance_frames(layout, cursor[1], cursor[2], num_frames)
    head = xp.stack([xp.asarray(cursor[0]), xp.asarray(committed), xp.asarray(visible_start)]).astype(np.int32)
    return head if cursor.shape[-1] == 3 else xp.concatenate([head, xp.asarray(cursor[3:]).astype(np.int32)])


def advance_frames(layout: KVLayout, committed: Any, visible_start: Any, num_frames: int) -> tuple[Any, Any]:
    """``(committed, visible_start)`` after committing ``num_frames`` frames: the one advance rule.

    Plain arithmetic, so it serves Python ints on the host (exact, no array round trip) and
    ``i32[]`` values inside ``jit`` alike; :func:`advance_cursor` is its array form.

    Shapes:
      committed, visible_start: int[]
      returns: (committed, visible_start), each int[]
    """
    committed = committed + num_frames
    return committed, (committed if layout.reset_at_boundary else visible_start)
