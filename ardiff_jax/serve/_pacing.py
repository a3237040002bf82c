"""Pacing: when a session's next chunk is due, and how fast it really plays.

A world model that runs ahead of its player wastes the device and makes the controls feel
detached: an action can only show in a chunk generated after it arrives, so every chunk
generated early is a chunk of stale controls the player must watch first. The server
therefore generates each session's chunks *just in time* for playback at the session's
frame rate, keeping at most ``lookahead_chunks`` chunks generated beyond the one playing.

:class:`PlaybackClock` is the per-session arithmetic, pure and clock-free (every method takes
``now``), so it is tested without a server:

* playback of frame 0 starts when the first chunk is ready (the client starts drawing on
  arrival, give or take its small jitter buffer); chunk ``k`` then plays from
  ``anchor + F_k / fps``, ``F_k`` being the frames of the chunks before it;
* chunk ``k`` is *due* (may start generating) once playback reaches the start of chunk
  ``k - lookahead_chunks``; the first ``lookahead_chunks + 1`` chunks are due at once. With
  the default lookahead of one, chunk ``k + 1`` is generated while chunk ``k`` plays, so an
  action shows within two chunk intervals;
* a chunk ready after its play time is an *underrun*: the player has run dry and waits, so the
  anchor moves by the lateness (playback resumes with that chunk; nothing is skipped) and the
  session's real rate drops below its target. Every late session slows this way, and the
  server serves due sessions earliest deadline first, so when the engine cannot keep up
  all sessions slow evenly;
* the real rate is measured over the last :data:`RATE_WINDOW_CHUNKS` chunks.
"""

from __future__ import annotations

import collections
import math

__all__ = ["RATE_WINDOW_CHUNKS", "UNDERRUN_TOLERANCE_S", "PlaybackClock"]

#: Chunks over which the real frame rate is measured.
RATE_WINDOW_CHUNKS = 8
#: Lateness below this is not an underrun: the client's jitter buffer absorbs it.
UNDERRUN_TOLERANCE_S = 0.005


class PlaybackClock:
    """One session's playback timeline (see the module docstring).

    Args:
      fps: frames per second the session plays at (positive).
      lookahead_chunks: chunks generated beyond the one playing (>= 0).
      paced: ``False`` makes every chunk due at once (generation as fast as the engine goes);
        the rates and underruns are still measured.
    """

    def __init__(self, fps: float, lookahead_chunks: int, *, paced: bool = True) -> None:
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        if isinstance(lookahead_chunks, bool) or not isinstance(lookahead_chunks, int) or lookahead_chunks < 0:
            raise ValueError(f"lookahead_chunks must be a non-negative integer, got {lookahead_chunks!r}")
        self.fps = float(fps)
        self.lookahead_chunks = lookahead_chunks
        self.paced = paced
        self.anchor: float | None = None  # wall time frame 0 plays, moved later by every underrun
        self.chunks = 0  # chunks generated
        self.frames = 0  # frames generated
        self.underruns = 0
        self.stalled_s = 0.0  # playback time lost to underruns
        # Frame offsets at which the last lookahead_chunks chunks start, oldest first: the due time of
        # the next chunk is when playback reaches the start of the oldest of them.
        self._starts: collections.deque[int] = collections.deque(maxlen=max(lookahead_chunks, 1))
        self._ready: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW_CHUNKS)

    def _play_time(self, frame: int) -> float:
        assert self.anchor is not None
        return self.anchor + frame / self.fps

    def due_at(self) -> float:
        """Wall time from which the next chunk may be generated (``-inf``: now)."""
        if not self.paced or self.anchor is None or self.chunks <= self.lookahead_chunks:
            return -math.inf
        start = self.frames if self.lookahead_chunks == 0 else self._starts[0]
        return self._play_time(start)

    def deadline(self) -> float:
        """Wall time the next chunk must be ready to play without a gap (``-inf`` before playback starts)."""
        return -math.inf if self.anchor is None else self._play_time(self.frames)

    def playing_chunks_ahead(self, now: float) -> float:
        """Generated video not yet played at ``now``, in seconds (0 before playback starts)."""
        if self.anchor is None:
            return 0.0
        return max(0.0, self._play_time(self.frames) - now)

    def record(self, now: float, frames: int) -> float:
        """Chunk ``self.chunks`` (``frames`` frames) is ready at ``now``; returns its lateness in seconds (0: on time).

        A chunk later than :data:`UNDERRUN_TOLERANCE_S` counts as an underrun and moves playback later by
        its lateness.
        """
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0:
            raise ValueError(f"frames must be a non-negative integer, got {frames!r}")
        late = 0.0
        if self.anchor is None:
            self.anchor = now
        else:
            late = now - self._play_time(self.frames)
            if late > UNDERRUN_TOLERANCE_S:
                self.underruns += 1
                self.stalled_s += late
                self.anchor += late
            else:
                late = 0.0
        if self.lookahead_chunks:
            self._starts.append(self.frames)
        self.frames += frames
        self.chunks += 1
        self._ready.append((now, frames))
        return late

    def real_fps(self) -> float | None:
        """Frames per second generated over the last :data:`RATE_WINDOW_CHUNKS` chunks (``None``: fewer than two)."""
        if len(self._ready) < 2:
            return None
        span = self._ready[-1][0] - self._ready[0][0]
        if span <= 0:
            return None
        return sum(frames for _, frames in list(self._ready)[1:]) / span

    def real_time_factor(self) -> float | None:
        """:meth:`real_fps` over the target fps: 1.0 when the session keeps its rate, below when it cannot."""
        fps = self.real_fps()
        return None if fps is None else fps / self.fps
