"""The one denoise-and-commit loop of the paged pipelines (issue 45).

The world pipeline (and the pipelines built on it: causal Wan, the sprite world), Matrix-Game
and DreamZero differ in their rows, their step program and their schedule, not in the loop
around them. This module is that loop, once:

* a :class:`Lane` says where it runs: one session (its ``ARDiffusionKVState``, the unbatched
  programs, the row as it is) or a batched tick (its ``ARDiffusionKVBatch``, the batched
  programs, rows stacked to the bucket). Both handles have the same ``get_kv_caches`` and
  ``commit_paged_context``, so the loop never asks which one it holds;
* a :class:`Denoiser` is what a pipeline supplies per call: the KV branches a step reads,
  its step program (``evaluate``), its scheduler or solver update (``advance``) and the rule
  saying which rows run the transformer at a step (``runs``; every row by default);
* :func:`denoise` runs the steps: per step, the branches' non-committing views, the step
  program, the reads closed, the update; :func:`commit_pass` is the committing forward whose
  K/V a branch keeps, :func:`commit_together` the same for several branches in one program
  (branches whose pools live on separate ``"cfg"`` device groups).

The pipelines keep only what is theirs: the world pipeline's few-step sampler with its commit
at ``t = 0`` (:meth:`~ardiff_jax.models.WorldPipeline._denoise`), Matrix-Game's rows and its
action-ring update after the commit (``_block_program``), DreamZero's two branches, two UniPC
solvers and similarity skip rule (``DreamZeroPipeline._denoise``) after its commit of the
observed frames, the CFG world-action pipeline's guided step on two branches
(``CFGWorldActionPipeline._denoise``; both branches in one program on a cfg-parallel
layout) after its commit of the observation. A session's call is the batched loop's code run on a one-session lane: a
batch of one is never built, since it would be one more compiled program and the unbatched
one is what ``generate`` runs, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ardiff_jax.models._common import stack_rows, unstack_rows

__all__ = ["Lane", "Denoiser", "denoise", "commit_pass", "commit_together"]

Carry = TypeVar("Carry")
Row = TypeVar("Row")


@dataclasses.dataclass(frozen=True)
class Lane:
    """Where the loop runs: one session's state handle or a batched tick's batch handle.

    Use :meth:`single` or :meth:`batch`. ``handle`` is bound to the running invocation (a
    lane lives as long as one ``forward``/``step``/``forward_batch`` call).
    """

    handle: Any  # ARDiffusionKVState (one session) or ARDiffusionKVBatch (a batched tick)
    batched: bool

    @classmethod
    def single(cls, state: Any) -> Lane:
        return cls(state, False)

    @classmethod
    def batch(cls, batch: Any) -> Lane:
        return cls(batch, True)

    @property
    def states(self) -> tuple[Any, ...]:
        """The sessions' state handles, in row order."""
        return tuple(self.handle.states) if self.batched else (self.handle,)

    @property
    def size(self) -> int:
        """Real rows: the sessions of the lane (a batch's padded rows not counted)."""
        return self.handle.size if self.batched else 1

    def pick(self, single: Any, batched: Any) -> Any:
        """The program of this lane: ``batched`` (a leading row axis on every per-session argument) or ``single``."""
        return batched if self.batched else single

    def stack(self, rows: Sequence[Row]) -> Row:
        """The per-session ``rows`` as the lane's program takes them: stacked to the bucket (one
        program per bucket, padded rows repeat the first), or a session's row as it is."""
        if self.batched:
            return stack_rows(rows, self.handle.bucket_size)
        if len(rows) != 1:
            raise ValueError(f"a one-session lane takes one row, got {len(rows)}")
        return rows[0]

    def unstack(self, tree: Any) -> list[Any]:
        """One pytree per real session of a stacked ``tree`` (a one-session lane's value is its own row)."""
        return unstack_rows(tree, self.handle.size) if self.batched else [tree]


@dataclasses.dataclass(frozen=True)
class Denoiser(Generic[Carry]):
    """A pipeline's denoising as the loop runs it, built per call over the lane's stacked rows.

    Attributes:
      branches: the KV branches a step reads; each gets a non-committing view (``seq_len``
        current tokens) and is closed after the step program (a read writes nothing).
      seq_len: tokens of the block being denoised.
      evaluate: ``(views, carry, step) -> outs``: the step program on the views, in
        ``branches`` order.
      advance: ``(step, carry, outs, run) -> carry``: the scheduler or solver update;
        ``outs`` is ``None`` at a step no row evaluated.
      runs: ``(step, carry) -> bool | bool[rows]``: which rows run the transformer at
        ``step`` (a step evaluates when any does); every row by default.
    """

    branches: tuple[str, ...]
    seq_len: int
    evaluate: Callable[[tuple[Any, ...], Carry, int], Any]
    advance: Callable[[int, Carry, Any, np.ndarray], Carry]
    runs: Callable[[int, Carry], Any] = lambda step, carry: True


def denoise(lane: Lane, denoiser: Denoiser[Carry], carry: Carry, steps: Iterable[int]) -> Carry:
    """Run ``steps`` of ``denoiser`` on ``lane`` from ``carry``; returns the last carry.

    A step reads the branches' caches (``commit_current=False``) and writes nothing; its
    contexts are closed once the step program returned, so a commit may follow on any branch.
    """
    handle = lane.handle
    for step in steps:
        run = np.asarray(denoiser.runs(step, carry))
        outs = None
        if run.any():
            views = tuple(handle.get_kv_caches(branch, seq_len=denoiser.seq_len, commit_current=False)
                          for branch in denoiser.branches)
            outs = denoiser.evaluate(views, carry, step)
            for branch in denoiser.branches:
                handle.commit_paged_context(branch)  # a non-committing context: cleared, nothing written
        carry = denoiser.advance(step, carry, outs, run)
    return carry


def commit_pass(lane: Lane, branch: str, seq_len: int,
                forward: Callable[[Any], tuple[tuple[Any, Any], Any]]) -> Any:
    """One committing forward of ``seq_len`` tokens on ``branch``: ``forward(view) -> ((k, v), extra)``; the
    K/V are written to every session of the lane (one donated write) and ``extra`` returned.

    Branch by branch: a commit replaces the pools, so the next branch's view is taken after it.
    """
    view = lane.handle.get_kv_caches(branch, seq_len=seq_len, commit_current=True)
    kv, extra = forward(view)
    lane.handle.commit_paged_context(branch, kv=kv)
    return extra


def commit_together(lane: Lane, branches: tuple[str, ...], seq_len: int,
                    forward: Callable[[tuple[Any, ...]], tuple[tuple[tuple[Any, Any], ...], Any]]) -> Any:
    """One committing forward of ``seq_len`` tokens on every one of ``branches`` in one program:
    ``forward(views) -> (kv per branch, extra)``, views and K/V in ``branches`` order; each branch's
    K/V are written (one donated write each) and ``extra`` returned.

    Only for branches whose pools do not hold each other's pages (one per ``"cfg"`` device group):
    every view is taken before any commit replaces the pools, so a branch reads the pools as they
    were before the others' writes.
    """
    views = tuple(lane.handle.get_kv_caches(branch, seq_len=seq_len, commit_current=True) for branch in branches)
    kvs, extra = forward(views)
    if len(kvs) != len(branches):
        raise ValueError(f"commit_together: forward returned {len(kvs)} K/V pairs for {len(branches)} branches")
    for branch, kv in zip(branches, kvs, strict=True):
        lane.handle.commit_paged_context(branch, kv=kv)
    return extra
