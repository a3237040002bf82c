"""Cursor arithmetic: which frames a forward sees and which pages hold them.

One implementation serves the host (``xp=numpy``, the runner path) and device code
(``xp=jax.numpy`` inside ``jit``, device-side rollouts), so both paths agree by
construction. Shapes depend only on the static layout and the number of current frames,
never on the fill level: filling, wrapping and resetting a window reuse one program.

A branch cursor is one ``i32[3 + K + W]`` vector: ``(run_base, committed, visible_start)``
(:data:`CURSOR_FIELDS`) followed by the run's *page table* (:func:`make_table_cursor`): entry
``s`` is the page that holds run slot ``s``. A run's slots may sit anywhere in the pools and may
be shared with another session's run (a fork: the runtime remaps a shared slot to a fresh page
before it is written, so a shared page is never written); a run on its home pages
``[run_base, run_base + K + W)`` is the table :func:`contiguous_table_cursor` builds. One form,
so one program: a commit and read through the table cost the same as through the removed
``run_base + slot`` arithmetic, within noise (``benchmarks/bench_cursor.py``: medians of
table/contiguous 1.00 tiny, 1.04 medium in ``benchmarks/results/cursor_*.json``; 0.99-1.02 and
0.88-1.23 over repeated runs on a shared 2-core machine), since the lookup is one gather of at
most ``K + W`` ints beside the page gather both forms do.

The cursor fields:

* ``committed``: frames committed since the session (or its last reset) began;
* ``visible_start``: first non-sink frame still visible. It stays 0 in the sliding mode
  and jumps to ``committed`` after every commit under ``reset_at_boundary`` (only the
  sink survives a boundary).

Frame ``g`` of a run lives in run slot ``g`` if ``g < sink`` else in slot
``sink + (g - sink) mod window`` (:func:`slot_of_frame`), on page ``table[slot]``
(:func:`cursor_pages`). For a forward with ``f`` current frames the
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
    "contiguous_table_cursor",
    "make_table_cursor",
    "slot_of_frame",
    "cursor_pages",
    "cursor_block_pages",
    "visible_history",
    "visible_table",
    "run_visibility",
    "advance_cursor",
    "advance_frames",
]

#: The leading fields of the ``i32[3 + K + W]`` cursor vector passed into jitted code (the run's page table follows).
CURSOR_FIELDS = ("run_base", "committed", "visible_start")


def make_table_cursor(run_base: int, committed: int, visible_start: int, table: Any) -> np.ndarray:
    """The cursor vector: ``(run_base, committed, visible_start, *table)`` (host numpy).

    ``table[s]`` is the page holding run slot ``s`` (the null page for a slot never written);
    ``run_base`` is the run's home (first) page, which a sharded pool uses to find its device group.
    One leaf: cheaper to pass into jit than separate scalars and a table.

    Shapes:
      table: int[K+W]
      returns: i32[3+K+W]
    """
    return np.concatenate([np.array([run_base, committed, visible_start], np.int32),
                           np.asarray(table, np.int32)])


def contiguous_table_cursor(layout: KVLayout, run_base: int, committed: int, visible_start: int) -> np.ndarray:
    """The cursor of a run on its home pages: run slot ``s`` on page ``run_base + s`` (host numpy).

    For callers that own a whole contiguous run (training rollouts, benchmarks, tests); the
    runtime builds its tables itself (forks remap slots).

    Shapes:
      returns: i32[3+K+W]
    """
    return make_table_cursor(run_base, committed, visible_start,
                             np.arange(run_base, run_base + layout.run_pages, dtype=np.int32))


def _check_cursor(layout: KVLayout, cursor: Any) -> None:
    """A cursor without its table (the old ``i32[3]`` form) would look pages up in an empty table: refuse it."""
    expected = len(CURSOR_FIELDS) + layout.run_pages
    if cursor.shape[-1:] != (expected,):
        raise ValueError(
            f"a cursor is (run_base, committed, visible_start) followed by the run's {layout.run_pages}-entry page "
            f"table: last axis {expected}, got shape {tuple(cursor.shape)} (build one with make_table_cursor or "
            "contiguous_table_cursor)"
        )


def slot_of_frame(layout: KVLayout, frame: Any, xp: Any = np) -> Any:
    """Run slot (``0 .. K+W-1``) holding absolute frame ``frame``: the sink slots, then the ring.

    Shapes:
      frame: int[...]
      returns: int[...]
    """
    sink, window = layout.sink_frames, layout.window_frames
    return xp.where(frame < sink, frame, sink + xp.mod(frame - sink, window))


def cursor_pages(layout: KVLayout, cursor: Any, frame: Any, xp: Any = np) -> Any:
    """Page id holding absolute frame ``frame`` of the run ``cursor`` describes: a lookup in its table.

    ValueError if ``cursor`` is not ``3 + K + W`` long (a static shape: checked at trace time).

    Shapes:
      cursor: int[3+K+W]
      frame: int[...]
      returns: int[...]
    """
    _check_cursor(layout, cursor)
    table = cursor[3:]
    return xp.take(table, slot_of_frame(layout, frame, xp).astype(np.int32))


def cursor_block_pages(layout: KVLayout, cursor: Any, num_frames: int, xp: Any = np) -> Any:
    """Pages a commit of ``num_frames`` (``f``) frames writes, in frame order.

    In the sliding mode these are the ring pages of the oldest resident frames, exactly the
    ones the commit evicts; none of them is visible to the committing forward itself.

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

    Shapes:
      cursor: int[3+K+W]
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

    A contiguous read of a run on its home pages (:func:`~ardiff_jax.kv.read_run`) masks with
    this; it selects exactly the frames of :func:`visible_table`, in ring order instead of time
    order.

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


def advance_cursor(layout: KVLayout, cursor: Any, num_frames: int, xp: Any = np) -> Any:
    """The cursor after committing ``num_frames`` frames.

    Eviction is eager and metadata-only: the new block overwrote the oldest ring pages, and
    under ``reset_at_boundary`` every non-sink frame stops being visible. The run's page table
    is kept.

    Shapes:
      cursor: int[3+K+W]
      returns: i32[3+K+W]
    """
    _check_cursor(layout, cursor)
    committed, visible_start = advance_frames(layout, cursor[1], cursor[2], num_frames)
    head = xp.stack([xp.asarray(cursor[0]), xp.asarray(committed), xp.asarray(visible_start)]).astype(np.int32)
    return xp.concatenate([head, xp.asarray(cursor[3:]).astype(np.int32)])


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
