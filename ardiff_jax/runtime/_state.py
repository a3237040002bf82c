"""``ARDiffusionKVState``: the model-facing handle of one session.

The state holds host bookkeeping only (slot, per-branch cursors, pending forward
contexts, published cross-attention arrays). The pools belong to the
:class:`~ardiff_jax.ARDiffusionKVCache`; the state never keeps a second reference to them,
so a donated commit can never leave a session object holding deleted buffers.

Rules that make every call transactional: validate on the host first, dispatch the one
device call, and only then update bookkeeping. A call that raises changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax._checks import check_not_traced, is_integer
from ardiff_jax.kv import PagedKVCaches, slot_of_frame
from ardiff_jax.runtime._legacy import LegacyStateAPI, branch_of, deprecated
from ardiff_jax.runtime._session import (
    BranchCursor,
    CrossAttentionKV,
    SessionKV,
    check_session_kv,
    clear_cross_attention,
    commit_frames,
    new_session_kv,
    publish_cross_attention,
    branch_cursor_array,
    home_table,
    reset_session_kv,
    run_base,
    run_table,
    with_run_table,
)

if TYPE_CHECKING:  # pragma: no cover
    from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache

__all__ = [
    "ARDiffusionKVState", "ARDiffusionRequestAdapter", "CrossAttentionKV", "StateCheckpoint", "plan_batch_writes",
]


class ARDiffusionRequestAdapter:
    """The live cursor of one (session, logical branch): a read-only view.

    ``request_id == f"ar::{session_id}::{branch}"``. Identity is stable until the session is
    released or ``state.reset`` installs a fresh adapter with the same request id; a retired
    adapter keeps reporting the cursor it had. Models read ``num_computed_tokens`` /
    ``committed_frames`` (e.g. for RoPE frame offsets). Only the state's commit path moves
    the cursor (:func:`~ardiff_jax.runtime.commit_frames`).
    """

    __slots__ = ("request_id", "kv_branch", "local_index", "tokens_per_frame", "_cursor")

    def __init__(self, session_id: str, kv_branch: str, local_index: int, tokens_per_frame: int,
                 cursor: BranchCursor) -> None:
        self.request_id = f"ar::{session_id}::{kv_branch}"
        self.kv_branch = kv_branch
        self.local_index = local_index
        self.tokens_per_frame = tokens_per_frame
        self._cursor = cursor

    @property
    def cursor(self) -> BranchCursor:
        return self._cursor

    @property
    def committed_frames(self) -> int:
        """Frames committed since the session (or its last reset) began: the absolute frame index of the next block."""
        return self._cursor.committed_frames

    @property
    def completed_chunks(self) -> int:
        """The reference runtime's name for :attr:`committed_frames` (one chunk = one frame = one page)."""
        return self._cursor.committed_frames

    @property
    def num_computed_tokens(self) -> int:
        """Committed tokens: ``committed_frames * tokens_per_frame``."""
        return self._cursor.committed_frames * self.tokens_per_frame

    @property
    def visible_start_frame(self) -> int:
        """First non-sink frame still visible (moves only under ``reset_at_boundary``)."""
        return self._cursor.visible_start_frame

    def __repr__(self) -> str:
        return f"ARDiffusionRequestAdapter({self.request_id!r}, committed_frames={self.committed_frames})"


@dataclasses.dataclass(frozen=True)
class _PendingContext:
    seq_len: int
    num_frames: int
    commit_current: bool


@dataclasses.dataclass(frozen=True)
class StateCheckpoint:
    """What :meth:`ARDiffusionKVState.rollback` reinstalls: a session's value and its pending forward contexts.

    ``value`` is the session's :class:`~ardiff_jax.runtime.SessionKV` (slot and page tables
    included), ``pending`` the pending contexts as ``(kv_branch, context)`` pairs sorted by
    branch. Immutable: the state it came from changes after it, the checkpoint does not.
    """

    session_id: str
    value: SessionKV
    pending: tuple[tuple[str, _PendingContext], ...]

    @property
    def pending_branches(self) -> tuple[str, ...]:
        """The branches with a forward context pending when the checkpoint was taken."""
        return tuple(name for name, _ in self.pending)


def _shape_of(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {dtype}")
    return tuple(shape)


class ARDiffusionKVState(LegacyStateAPI):
    """Per-session KV handle: paged self-attention contexts and named cross-attention caches.

    The imperative shell around one :class:`~ardiff_jax.runtime.SessionKV` value (as the
    gemma sampler keeps ``last_state``): every method validates on the host, dispatches at
    most one device call, and only then publishes the new value. :meth:`snapshot` returns
    that value; :meth:`restore` installs one.

    Created by :meth:`ARDiffusionKVCache.create_state` (the runner does it for you). Inside a
    runner the state is bound to the pipeline for exactly one invocation; using it after
    that raises. A state is a handle to one slot: it refuses ``copy``, ``deepcopy`` and
    pickling (two handles would release one slot twice).
    """

    def __init__(self, cache: ARDiffusionKVCache, session_id: str, slot: int) -> None:
        self._cache = cache
        self._session_id = session_id
        self._value: SessionKV = new_session_kv(cache.spec, session_id, slot)
        self._cursor_arrays: dict[str, np.ndarray] = {}  # the jitted code's cursor of each branch, per value
        self._closed = False
        self._adapters = self._fresh_adapters()
        self._pending: dict[str, _PendingContext] = {}
        # Runner guard: when set, the state is usable only while bound to an invocation, and only the
        # runner may release it.
        self._runner_managed = False
        self._bound = False
        # Scratch pages a forward's action/state tokens may need (the spec's declared maximum).
        self._extra_pages = -(-cache.spec.max_scratch_tokens_per_branch // cache.spec.tokens_per_frame)

    def _fresh_adapters(self) -> dict[str, ARDiffusionRequestAdapter]:
        spec = self._cache.spec
        return {
            branch.name: ARDiffusionRequestAdapter(self._session_id, branch.name, branch.local_index,
                                                   spec.tokens_per_frame, self._value.cursors[branch.name])
            for branch in spec.kv_branches
        }

    def _publish(self, value: SessionKV) -> None:
        """Install a new session value (after any device call returned); adapters follow it.

        The one place a session's page tables change: the cache's reference counts follow
        (the new tables' pages held, the old ones' dropped), updated before the value is
        installed, all or nothing, so a table the pool refuses is never installed.
        """
        old = self._value
        if old.pages is not value.pages and old.pages != value.pages:
            held: list[int] = []
            dropped: list[int] = []
            if len(old.pages) == len(value.pages):  # a commit: only the written slots changed
                for old_table, new_table in zip(old.pages, value.pages, strict=True):
                    if old_table is not new_table:
                        changed = [(a, b) for a, b in zip(old_table, new_table, strict=True) if a != b]
                        held.extend(b for _, b in changed)
                        dropped.extend(a for a, _ in changed)
            else:
                held = [page for table in value.pages for page in table]
                dropped = [page for table in old.pages for page in table]
            self._cache.page_pool.exchange(held, dropped)
        self._value = value
        self._cursor_arrays = {}
        for name, adapter in self._adapters.items():
            adapter._cursor = value.cursors[name]

    # -- the runtime's side (the residency, the gate, the batch, the batch runner; never a pipeline) --------
    # The state's fields are written here only (tests/test_architecture.py): the runtime asks.
    def _adopt(self) -> None:
        """Runner-managed from now on: usable only while bound to an invocation, released only by the runner."""
        self._runner_managed = True

    def _set_bound(self, bound: bool) -> None:
        """Bound to (``True``) or unbound from (``False``) the one pipeline invocation now running."""
        self._bound = bound

    def _set_pending(self, kv_branch: str, context: _PendingContext | None) -> None:
        """Put back (or, with ``None``, drop) the pending context of ``kv_branch`` (a refused batched prepare)."""
        if context is None:
            self._pending.pop(kv_branch, None)
        else:
            self._pending[kv_branch] = context

    def _drop_pages(self) -> None:
        """Forget every page table (a reset or a release): the cache's counts drop with them."""
        value = self._value
        if value.pages:
            self._value = dataclasses.replace(value, pages=())
            self._cursor_arrays = {}
            self._cache.page_pool.drop(page for table in value.pages for page in table)

    def _own_pages_for(self, local_index: int, frames: np.ndarray) -> None:
        """Give every slot ``frames`` will occupy a page only this session holds, before a device rollout.

        A device rollout writes through constant page tables, so a shared slot cannot be
        remapped at the step that overwrites it: its page (still visible until then) is
        copied into a fresh one first; a slot never written gets a fresh page. Sessions that
        share nothing (every session that never forked) move nothing and copy nothing.
        """
        cache = self._cache
        slots = sorted({int(s) for s in slot_of_frame(cache.layout, np.asarray(frames), np)})  # a ring laps: once each
        plan = self._plan_slots(local_index, slots)
        old = plan.old
        moved = [(old[s], plan.new[s]) for s in slots if old[s] != cache.layout.null_page and old[s] != plan.new[s]]
        if moved:
            cache._copy_pages(np.array([a for a, _ in moved], np.int32), np.array([b for _, b in moved], np.int32))
        if plan.new != old:
            self._publish(with_run_table(cache.spec, cache.layout, self._value, local_index, plan.new))

    def _plan_write(self, local_index: int, frames: np.ndarray, reserved: set[int] | None = None) -> Any:
        """Where writing ``frames`` of run ``local_index`` goes (a :class:`~ardiff_jax.runtime._pages.PagePlan`).

        Pages only this session holds are written in place; a slot whose page is shared (a
        fork's history) or was never written gets a fresh page, so no other session's frames
        change. Planned on the host, counted only when the new value is published. A batch's
        rows are planned together instead (:func:`plan_batch_writes`).
        """
        return self._cache.page_pool.plan_batch([self._write_row(local_index, frames)], reserved)[0]

    def _write_row(self, local_index: int, frames: np.ndarray) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
        """``(table, slots, home)`` of a write of ``frames`` of run ``local_index``: one row of a page plan."""
        slots = [int(s) for s in slot_of_frame(self._cache.layout, np.asarray(frames), np)]
        return self._slots_row(local_index, slots)

    def _slots_row(self, local_index: int, slots: list[int]) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
        cache = self._cache
        home = home_table(cache.spec, cache.layout, self._value.slot, local_index, branch_major=cache.branch_major)
        return run_table(cache.layout, self._value, local_index), slots, home

    def _plan_slots(self, local_index: int, slots: list[int], reserved: set[int] | None = None) -> Any:
        """:meth:`_plan_write` by run slot (each slot once): the one call into the cache's page pool."""
        return self._cache.page_pool.plan_batch([self._slots_row(local_index, slots)], reserved)[0]

    # -- a handle, not a value -------------------------------------------------------------------
    def _refuse_copy(self, *args: Any) -> NoReturn:
        raise TypeError(
            f"ARDiffusionKVState of session {self._session_id!r} cannot be copied or pickled: it is the one handle "
            "to a slot of the KV pools. Use state.snapshot() for a value of its bookkeeping")

    __copy__ = _refuse_copy
    __deepcopy__ = _refuse_copy
    __reduce_ex__ = _refuse_copy
    __getstate__ = _refuse_copy

    # -- identity ------------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return self._cache.spec.kv_branch_names

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def slot(self) -> int | None:
        """Session slot in the pools (``None`` once closed)."""
        return None if self._closed else self._value.slot

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"slot {self._value.slot}"
        return f"ARDiffusionKVState({self._session_id!r}, {status})"

    # -- the value -------------------------------------------------------------------------------
    def snapshot(self) -> SessionKV:
        """The session's KV bookkeeping as an immutable value (cursors, run owners, cross caches).

        Page contents are not part of the value: they stay in the pools, in this slot's runs.
        RuntimeError when closed or while a forward context is pending.
        """
        self._check_usable()
        if self._pending:
            raise RuntimeError(
                f"AR-Diffusion session {self._session_id!r} has pending forward contexts on {sorted(self._pending)}; "
                "commit or discard them before taking a snapshot")
        return self._value

    def restore(self, value: SessionKV) -> None:
        """Install ``value`` as this session's bookkeeping (rebased onto this state's slot).

        Only bookkeeping moves: the pages of this state's slot must already hold the KV that
        ``value`` describes (the same slot with no commit since the snapshot, or pages copied
        in by the caller). Validated before anything changes
        (:func:`~ardiff_jax.runtime.check_session_kv`): the same session id and branches,
        cursors this spec could produce, consistent run owners, well-shaped cross caches, and
        page tables of this pool (every id in ``[0, num_pages)`` or the null page, none twice).
        A refused restore changes nothing: no count moves, no table is installed.
        """
        self._check_usable()
        if not isinstance(value, SessionKV):
            raise TypeError(f"restore expects a SessionKV (from state.snapshot()), got {type(value).__name__}")
        if value.session_id != self._session_id:
            raise ValueError(f"snapshot of session {value.session_id!r} cannot restore session {self._session_id!r}")
        if self._pending:
            raise RuntimeError(f"AR-Diffusion session {self._session_id!r} has pending forward contexts on "
                               f"{sorted(self._pending)}; commit or discard them before restoring")
        checked = check_session_kv(self._cache.spec, value)
        # Every page id against the pool before anything changes: an id past it would be counted
        # (or fail half-counted) and its table installed, after which close() could not release it.
        pages = self._cache.page_pool.checked_tables(checked.pages, self._cache.spec.num_local_kv_branches,
                                                     self._cache.layout.run_pages, "restore value pages")
        self._publish(SessionKV(session_id=checked.session_id, slot=self._value.slot, cursors=checked.cursors,
                                cross_attention=checked.cross_attention, run_owners=checked.run_owners,
                                pages=pages))

    # -- checkpoint and rollback (the runtime's pair: a failed batched forward rolls back) ----------
    def checkpoint(self) -> StateCheckpoint:
        """The session's bookkeeping now, pending forward contexts included, as a frozen value.

        Unlike :meth:`snapshot` it may be taken while a context is pending and while the
        state is not bound to an invocation: the runtime takes one before a batched forward
        and hands it to :meth:`rollback` when that forward fails. RuntimeError when closed.
        """
        if self._closed:
            raise RuntimeError(f"AR-Diffusion session {self._session_id!r} is closed")
        return StateCheckpoint(session_id=self._session_id, value=self._value,
                               pending=tuple(sorted(self._pending.items())))

    def rollback(self, checkpoint: StateCheckpoint) -> None:
        """Reinstall ``checkpoint`` (from this state's :meth:`checkpoint`): its value and pending contexts.

        Only bookkeeping moves: pages written since the checkpoint lie where the restored
        cursors do not read (a failed batch's). Refused, changing nothing: anything but a
        :class:`StateCheckpoint` (TypeError), a checkpoint of another session or of another
        slot (ValueError: its pages are not this slot's), a closed state (RuntimeError).
        """
        if not isinstance(checkpoint, StateCheckpoint):
            raise TypeError(f"rollback expects a StateCheckpoint (from state.checkpoint()), got "
                            f"{type(checkpoint).__name__}")
        if self._closed:
            raise RuntimeError(f"AR-Diffusion session {self._session_id!r} is closed; it cannot be rolled back")
        if checkpoint.session_id != self._session_id:
            raise ValueError(f"checkpoint of session {checkpoint.session_id!r} cannot roll back session "
                             f"{self._session_id!r}")
        if checkpoint.value.slot != self._value.slot:
            raise ValueError(f"checkpoint of session {self._session_id!r} was taken in slot {checkpoint.value.slot}, "
                             f"the session is in slot {self._value.slot} now; it cannot be rolled back")
        self._publish(checkpoint.value)  # counts first, all or nothing: a refused table changes nothing
        self._pending = dict(checkpoint.pending)

    # -- guards --------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"AR-Diffusion session {self._session_id!r} is closed")
        self._check_binding()

    def _check_binding(self) -> None:
        if self._runner_managed and not self._bound:
            raise RuntimeError(
                f"AR-Diffusion state of session {self._session_id!r} was used outside its runner invocation; "
                "pipelines must not retain the bound state"
            )

    def adapter(self, kv_branch: str) -> ARDiffusionRequestAdapter:
        """The live cursor of ``kv_branch``. RuntimeError if closed; KeyError if unknown."""
        self._check_usable()
        try:
            return self._adapters[kv_branch]
        except (KeyError, TypeError):
            raise KeyError(
                f"Unknown AR-Diffusion KV branch {kv_branch!r}; configured: {list(self.kv_branch_names)}"
            ) from None

    def _check_cross_name(self, cache_name: str) -> None:
        if not isinstance(cache_name, str) or cache_name not in self._cache.spec.cross_attention_lengths:
            raise KeyError(
                f"Unknown AR-Diffusion cross-attention cache {cache_name!r}; configured: "
                f"{list(self._cache.spec.cross_attention_lengths)}"
            )

    def _run_base(self, local_index: int) -> int:
        return run_base(self._cache.spec, self._cache.layout, self._value.slot, local_index,  # one rule, in _session
                        branch_major=self._cache.branch_major)

    def has_pending_context(self, kv_branch: str) -> bool:
        """Whether ``kv_branch`` has a forward context from ``get_kv_caches`` not yet committed or discarded."""
        self.adapter(kv_branch)
        return kv_branch in self._pending

    # -- paged self-attention -----------------------------------------------------------------
    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False) -> PagedKVCaches:
        """Prepare one forward of ``seq_len`` current tokens on ``kv_branch``.

        Returns a :class:`~ardiff_jax.kv.PagedKVCaches` pytree (``num_layers`` per-layer views)
        to pass into the model's jit. With ``commit_current=True`` the forward must end with
        :meth:`commit_paged_context` ``(kv_branch, kv=(k, v))``; a non-committing forward
        (denoise probe) needs no write at all.
        """
        kv_branch = branch_of(kv_branch, "get_kv_caches")
        adapter = self.adapter(kv_branch)
        layout = self._cache.layout
        if seq_len is None:
            raise ValueError("AR-Diffusion get_kv_caches requires seq_len (tokens of the current block)")
        if not is_integer(seq_len):
            check_not_traced("ARDiffusionKVState.get_kv_caches", seq_len)
            raise ValueError(f"AR-Diffusion seq_len must be an integer, got {seq_len!r}")
        seq_len = int(seq_len)
        if not isinstance(commit_current, (bool, np.bool_)):
            raise ValueError(f"AR-Diffusion commit_current must be a bool, got {commit_current!r}")
        num_frames = layout.frames_in(seq_len)
        # A committing forward's frames go to the managed pages it commits into; a denoise probe's
        # frames and the declared extra tokens both use scratch (docs/reference_behaviour.md, "Scratch").
        if not commit_current and num_frames + self._extra_pages > layout.scratch_pages:
            raise RuntimeError(
                f"AR-Diffusion scratch blocks exhausted: a non-committing forward of {num_frames} frames plus "
                f"{self._extra_pages} pages of declared extra tokens exceeds {layout.scratch_pages} scratch pages per "
                "branch; raise AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH")
        pending = self._pending.get(kv_branch)
        if pending is not None and pending.commit_current:
            raise RuntimeError(
                f"AR-Diffusion paged context of branch {kv_branch!r} (session {self._session_id!r}) replaced before "
                "its committing block was committed; call commit_paged_context(branch, kv=...) or "
                "discard_paged_context(branch) first"
            )
        self._cache.check_pools()
        cursor = self._cursor_arrays.get(kv_branch)
        if cursor is None:  # one per published value and branch: a denoise loop's probes reuse it
            cursor = self._cursor_arrays[kv_branch] = branch_cursor_array(
                self._cache.spec, layout, self._value, kv_branch, branch_major=self._cache.branch_major)
        caches = PagedKVCaches(pools=self._cache.pools, cursor=cursor, layout=layout, seq_len=seq_len,
                               backend=self._cache.attention_backend, sharding=self._cache.sharding)
        self._pending[kv_branch] = _PendingContext(seq_len, num_frames, bool(commit_current))
        return caches

    def commit_paged_context(self, kv_branch: str, kv: tuple[jax.Array, jax.Array] | None = None) -> None:
        """Commit the pending forward of ``kv_branch``.

        A committing context needs ``kv=(k, v)``, each ``[num_layers, seq_len, H, D]`` (or
        ``[num_layers, 1, seq_len, H, D]``): they are written into the ring pages the commit
        evicts with one donated in-place write, then the cursor advances
        (:func:`~ardiff_jax.runtime.commit_frames`). A non-committing context is simply
        cleared and must not pass ``kv``. Call only after the forward succeeded.
        """
        kv_branch = branch_of(kv_branch, "commit_paged_context")
        adapter = self.adapter(kv_branch)
        check_not_traced("ARDiffusionKVState.commit_paged_context", kv)
        pending = self._pending.get(kv_branch)
        if pending is None:
            if kv is not None:
                raise ValueError(
                    f"AR-Diffusion branch {kv_branch!r} has no pending context to commit kv into; call "
                    "get_kv_caches(branch, seq_len=..., commit_current=True) first"
                )
            return
        if not pending.commit_current:
            if kv is not None:
                raise ValueError(
                    f"AR-Diffusion branch {kv_branch!r}: the pending context is non-committing "
                    "(commit_current=False); it cannot be committed with kv"
                )
            del self._pending[kv_branch]
            return
        if kv is None:
            raise ValueError(
                f"AR-Diffusion branch {kv_branch!r}: a committing context must be committed with kv=(k, v) "
                f"of shape [num_layers, {pending.seq_len}, H, D]"
            )
        k, v = self._validate_block_kv(kv, pending.seq_len)
        layout = self._cache.layout
        committed = commit_frames(self._cache.spec, layout, self._value, kv_branch, pending.num_frames)
        frames = adapter.committed_frames + np.arange(pending.num_frames, dtype=np.int32)
        plan = self._plan_write(adapter.local_index, frames)
        self._cache._write_block(plan.pages, k, v)
        # Bookkeeping only after the device call returned.
        self._publish(with_run_table(self._cache.spec, layout, committed, adapter.local_index, plan.new))
        del self._pending[kv_branch]

    def rewrite_committed_context(self, kv_branch: str, first_frame: int, kv: tuple[jax.Array, jax.Array]) -> None:
        """Overwrite the K/V of committed frames still in the pool; the cursor does not move.

        For a prompt switch that recomputes the visible history under the new prompt
        (LongLive's recache). ``kv=(k, v)``, each ``[num_layers, n * tokens_per_frame, H, D]``,
        replaces frames ``[first_frame, first_frame + n)``; every one of them must be resident
        and visible to the next forward (a sink frame, or one of the newest ``window_frames``
        not before ``visible_start_frame``). One donated write, as a commit. Refused, changing
        nothing, while the branch has a pending context.
        """
        kv_branch = branch_of(kv_branch, "rewrite_committed_context")
        adapter = self.adapter(kv_branch)
        check_not_traced("ARDiffusionKVState.rewrite_committed_context", kv)
        if kv_branch in self._pending:
            raise RuntimeError(f"AR-Diffusion branch {kv_branch!r} has a pending context; commit or discard it "
                               "before rewriting committed frames")
        layout = self._cache.layout
        try:
            tokens = _shape_of("AR-Diffusion rewrite k", kv[0])[1]
        except (TypeError, IndexError, KeyError):
            raise ValueError("AR-Diffusion kv must be a (k, v) pair of [num_layers, tokens, H, D] arrays") from None
        if tokens <= 0 or tokens % layout.tokens_per_frame:
            raise ValueError(f"AR-Diffusion rewrite covers whole frames: {tokens} tokens is not a positive multiple "
                             f"of {layout.tokens_per_frame} tokens per frame")
        k, v = self._validate_block_kv(kv, tokens)
        if not is_integer(first_frame) or int(first_frame) < 0:
            raise ValueError(f"AR-Diffusion first_frame must be a non-negative integer, got {first_frame!r}")
        first, count = int(first_frame), tokens // layout.tokens_per_frame
        committed, visible_start = adapter.committed_frames, adapter.visible_start_frame
        oldest_ring = max(visible_start, layout.sink_frames, committed - layout.window_frames)
        stale = [frame for frame in range(first, first + count)
                 if frame >= committed or (layout.sink_frames <= frame < oldest_ring)]
        if stale:
            raise ValueError(
                f"AR-Diffusion branch {kv_branch!r} cannot rewrite frames {stale}: only committed frames still in "
                f"the pool can be rewritten (sink frames < {min(committed, layout.sink_frames)} and frames "
                f"{oldest_ring}..{committed - 1})")
        frames = np.arange(first, first + count, dtype=np.int32)
        plan = self._plan_write(adapter.local_index, frames)  # a shared frame is rewritten into a fresh page
        self._cache._write_block(plan.pages, k, v)
        self._publish(with_run_table(self._cache.spec, layout, self._value, adapter.local_index, plan.new))

    def discard_paged_context(self, kv_branch: str) -> None:
        """Drop the pending context of ``kv_branch`` without writing (e.g. after a failed forward)."""
        self.adapter(kv_branch)
        self._pending.pop(kv_branch, None)

    def _validate_block_kv(self, kv: Any, seq_len: int) -> tuple[jax.Array, jax.Array]:
        layout = self._cache.layout
        try:
            k, v = kv
        except (TypeError, ValueError):
            raise ValueError("AR-Diffusion kv must be a (k, v) pair") from None
        expected = (layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)
        out = []
        for name, x in (("k", k), ("v", v)):
            shape = _shape_of(f"AR-Diffusion commit {name}", x)
            if len(shape) == 5 and shape[1] == 1:
                shape = shape[:1] + shape[2:]
                x = x.reshape(shape)
            if shape != expected:
                raise ValueError(f"AR-Diffusion commit {name} must have shape {expected} (or with a batch of 1 "
                                 f"after the layer axis), got {tuple(getattr(x, 'shape', ()))}")
            out.append(x)
        return out[0], out[1]

    # -- cross-attention ----------------------------------------------------------------------
    def populate_cross_attention(self, kv_branch: str, cache_name: str,
                                 layer_kv: Iterable[tuple[jax.Array, jax.Array]]) -> None:
        """Publish cache ``cache_name`` of ``kv_branch`` from exactly ``num_layers`` ``(k, v)`` pairs.

        Each pair is ``(1, N, Hc, D)`` or ``(N, Hc, D)``. The iterable is consumed once; the new
        arrays are stacked and published with one reference swap only after every layer
        validated. Any failure (the iterator raising, too few or too many layers, a wrong
        shape or dtype) leaves the previous cache readable and unchanged, or absent on a
        first population.
        """
        self.adapter(kv_branch)
        self._check_cross_name(cache_name)
        if isinstance(layer_kv, (str, bytes)) or not isinstance(layer_kv, Iterable):
            raise TypeError(f"AR-Diffusion populate_cross_attention layer_kv must be an iterable of (k, v) pairs, "
                            f"got {type(layer_kv).__name__}")
        spec = self._cache.spec
        num_layers = spec.num_layers
        expected = (spec.cross_attention_lengths[cache_name], spec.cross_attention_heads(cache_name), spec.head_size)
        keys: list[Any] = []
        values: list[Any] = []
        for index, item in enumerate(layer_kv):
            if index >= num_layers:
                raise ValueError(
                    f"AR-Diffusion cross-attention {cache_name!r}: expected {num_layers} layers, got more than "
                    f"{num_layers}"
                )
            try:
                k, v = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"AR-Diffusion cross-attention {cache_name!r} layer {index}: expected a (k, v) pair"
                ) from None
            check_not_traced("ARDiffusionKVState.populate_cross_attention", k, v)
            for name, x, bucket in (("k", k, keys), ("v", v, values)):
                shape = _shape_of(f"AR-Diffusion cross-attention {cache_name!r} layer {index} {name}", x)
                if shape == (1,) + expected:
                    x = x.reshape(expected)
                elif shape != expected:
                    raise ValueError(
                        f"AR-Diffusion cross-attention {cache_name!r} layer {index}: expected k/v shape "
                        f"(1, {expected[0]}, {expected[1]}, {expected[2]}) or {expected}, got {shape} for {name}"
                    )
                bucket.append(x)
        if len(keys) != num_layers:
            raise ValueError(
                f"AR-Diffusion cross-attention {cache_name!r}: expected {num_layers} layers, got {len(keys)}"
            )
        self._check_usable()  # the iterator may have run arbitrary code (e.g. closed the state)
        dtype = self._cache.layout.dtype
        placement = self._cache.cross_attention_placement  # a device, or KV heads split over "tp"
        published = CrossAttentionKV(
            k=jax.device_put(jnp.stack(keys).astype(dtype), placement),
            v=jax.device_put(jnp.stack(values).astype(dtype), placement),
        )
        self._publish(publish_cross_attention(self._value, kv_branch, cache_name, published))  # the one swap

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str) -> CrossAttentionKV:
        """The published cache: ``CrossAttentionKV(k, v)``, each ``[L, N, Hc, D]``. RuntimeError if absent."""
        self.adapter(kv_branch)
        self._check_cross_name(cache_name)
        try:
            return self._value.cross_attention[(cache_name, kv_branch)]
        except KeyError:
            raise RuntimeError(
                f"AR-Diffusion cross-attention cache {cache_name!r} of branch {kv_branch!r} (session "
                f"{self._session_id!r}) was read before it was populated"
            ) from None

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        self.adapter(kv_branch)
        self._check_cross_name(cache_name)
        return (cache_name, kv_branch) in self._value.cross_attention

    def clear_cross_attention(self) -> None:
        """Drop every cross-attention cache of the session (e.g. on a prompt change); keeps self-attention KV."""
        self._check_usable()
        self._publish(clear_cross_attention(self._value))

    @property
    def cross_attention_bytes(self) -> int:
        """Bytes of the published cross-attention arrays of this session."""
        return 0 if self._closed else self._value.cross_attention_bytes

    # -- lifecycle -----------------------------------------------------------------------------
    def reset(self, keep_cross_attention: Iterable[str] = (), *, keep_cross_text: bool | None = None) -> None:
        """Model-internal window reset: empty every branch, keep only the named cross caches.

        Installs fresh adapters (same request ids) and reopens a closed state (acquiring a
        slot; RuntimeError if none is free). KeyError for an unknown cache name, before any
        change. ``keep_cross_text`` is the deprecated spelling of ``keep_cross_attention=("text",)``.
        """
        if keep_cross_text is not None:
            deprecated("state.reset(keep_cross_text=...)", 'state.reset(keep_cross_attention=("text",))')
            keep_cross_attention = ("text",) if keep_cross_text else ()
        if isinstance(keep_cross_attention, str):
            keep_cross_attention = (keep_cross_attention,)
        if not isinstance(keep_cross_attention, Iterable):
            raise TypeError(f"AR-Diffusion reset keep_cross_attention must be an iterable of cache names, got "
                            f"{keep_cross_attention!r}")
        keep = tuple(keep_cross_attention)
        for name in keep:
            self._check_cross_name(name)
        self._check_binding()
        if self._closed:
            slot = self._cache._reopen(self)
            self._value = new_session_kv(self._cache.spec, self._session_id, slot)
            self._closed = False
        self._drop_pages()  # the emptied branches hold no page any more
        self._value = reset_session_kv(self._cache.spec, self._value, keep)
        self._cursor_arrays = {}
        self._adapters = self._fresh_adapters()
        self._pending = {}
        self.__dict__.pop("_legacy_staged", None)  # layers staged by the deprecated API belong to the old window

    def close(self) -> None:
        """Release the slot and every cross-attention cache. Idempotent.

        A state the runner manages is released by the runner only (``engine.close_session``):
        closing it from a pipeline would free the slot under a session the runner still lists.
        """
        if self._closed:
            return
        if self._runner_managed:
            raise RuntimeError(
                f"AR-Diffusion state of session {self._session_id!r} is managed by the runner; release it with "
                "engine.close_session / reset_session, not state.close()")
        self._release()

    def _release(self) -> None:
        """Free the slot (the runner's and the cache's release path)."""
        if self._closed:
            return
        self._closed = True
        self._pending = {}
        self.__dict__.pop("_legacy_staged", None)
        self._drop_pages()
        value = self._value
        if value.cross_attention:  # drop the arrays now: a closed handle must not keep device memory alive
            self._value = SessionKV(session_id=value.session_id, slot=value.slot, cursors=value.cursors,
                                    cross_attention={}, run_owners=value.run_owners)
        self._cache._release_slot(self, value.slot)

    # -- introspection -----------------------------------------------------------------------
    def describe(self) -> Mapping[str, Any]:
        """Host-side summary: slot, per-branch cursors, pending contexts, populated caches."""
        value, pending = self._value, dict(self._pending)  # read one consistent value
        return {
            "session_id": self._session_id,
            "slot": None if self._closed else value.slot,
            "closed": self._closed,
            "branches": {
                name: {"committed_frames": c.committed_frames, "visible_start_frame": c.visible_start_frame}
                for name, c in value.cursors.items()
            },
            "pending": {name: dataclasses.asdict(p) for name, p in pending.items()},
            "cross_attention": sorted(value.cross_attention),
        }


def plan_batch_writes(writes: Iterable[tuple[ARDiffusionKVState, int, np.ndarray]]) -> list[Any]:
    """Page plans of one device write of several sessions (``(state, local_index, frames)`` per row), planned together.

    A session and its fork in one batch overwrite the same shared pages: counted together,
    one of them keeps each such page and only the others take fresh ones
    (:meth:`~ardiff_jax.runtime._pages.PagePool.plan_batch`), so the batch fits the pool
    whenever the sessions do. Every state must belong to one cache.
    """
    writes = list(writes)
    if not writes:
        return []
    cache = writes[0][0]._cache
    return cache.page_pool.plan_batch([state._write_row(local_index, frames) for state, local_index, frames in writes])
