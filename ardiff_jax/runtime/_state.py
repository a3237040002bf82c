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
from collections.abc import Iterable, Mapping, Sequence
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
    "ARDiffusionKVState", "ARDiffusionRequestAdapter", "CommitPlan", "CrossAttentionKV", "StateCheckpoint",
    "commit_planned", "dispatch_commit", "own_rollout_pages", "plan_commits", "plan_rollout", "prepare_forwards",
    "publish_commit",
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


@dataclasses.dataclass(frozen=True, eq=False)
class CommitPlan:
    """One device write of one or more sessions, planned on the host; nothing applied yet.

    Made by :func:`plan_commits` (a commit of one session or of a batch), :func:`plan_rollout`
    (a device-side rollout) or a rewrite; applied by :func:`dispatch_commit` (the device write)
    and :func:`publish_commit` (the bookkeeping, only after the write returned), or both at
    once by :func:`commit_planned`.

    Attributes:
      states: the sessions written, one row each.
      values: ``values[i]`` is what ``states[i]`` holds once the write returned (cursors
        advanced, page tables remapped where a page was shared).
      pages: ``pages[i]`` (``i32[f]``) the pages row ``i``'s block goes to, one per frame.
      frames: ``frames[i]`` (``i32[f]``) the absolute frames row ``i`` writes.
      clears: the branch whose pending contexts the publish clears (None: nothing pending).
    """

    states: tuple[ARDiffusionKVState, ...]
    values: tuple[SessionKV, ...]
    pages: tuple[np.ndarray, ...]
    frames: tuple[np.ndarray, ...]
    clears: str | None


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
        # The tables last found held by the pool, and the pool's count version then (see _check_tables).
        self._checked_pages: tuple[tuple[int, ...], ...] = ()
        self._checked_version = -1

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

    def _drop_pages(self) -> None:
        """Forget every page table (a reset or a release): the cache's counts drop with them, in :meth:`_publish`."""
        if self._value.pages:
            self._publish(dataclasses.replace(self._value, pages=()))

    def _write_row(self, local_index: int, frames: np.ndarray) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
        """``(table, slots, home)`` of a write of ``frames`` of run ``local_index``: one row of a page plan."""
        slots = [int(s) for s in slot_of_frame(self._cache.layout, np.asarray(frames), np)]
        return self._slots_row(local_index, slots)

    def _slots_row(self, local_index: int, slots: list[int]) -> tuple[tuple[int, ...], list[int], tuple[int, ...]]:
        cache = self._cache
        home = home_table(cache.spec, cache.layout, self._value.slot, local_index, branch_major=cache.branch_major)
        return run_table(cache.layout, self._value, local_index), slots, home

    def _own_pages(self, local_index: int, frames: np.ndarray) -> None:
        """Give every slot ``frames`` will occupy a page only this session holds (:func:`own_rollout_pages`).

        A device rollout writes through constant page tables, so a shared slot cannot be
        remapped at the step that overwrites it: its page (still visible until then) is
        copied into a fresh one first; a slot never written gets a fresh page. Sessions that
        share nothing (every session that never forked) move nothing and copy nothing.
        """
        cache = self._cache
        slots = sorted({int(s) for s in slot_of_frame(cache.layout, np.asarray(frames), np)})  # a ring laps: once each
        plan = cache.page_pool.plan_batch([self._slots_row(local_index, slots)])[0]
        old = plan.old
        moved = [(old[s], plan.new[s]) for s in slots if old[s] != cache.layout.null_page and old[s] != plan.new[s]]
        if moved:
            cache._copy_pages(np.array([a for a, _ in moved], np.int32), np.array([b for _, b in moved], np.int32))
        if plan.new != old:
            self._publish(with_run_table(cache.spec, cache.layout, self._value, local_index, plan.new))

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
        and hands it to :meth:`rollback` when that forward fails. RuntimeError when closed or
        when the session's page tables name a page the pool does not hold.
        """
        if self._closed:
            raise RuntimeError(f"AR-Diffusion session {self._session_id!r} is closed")
        self._check_tables()
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
        self._check_tables()

    def _check_tables(self) -> None:
        """RuntimeError unless the pool holds every page the session's tables name (every public entry checks).

        A table naming a page nobody holds (its frames may be another session's by now) is
        refused before anything moves. Checked once per table and pool count version: a
        tick that remaps nothing pays two comparisons.
        """
        pages = self._value.pages
        if not pages:  # nothing written: no table names a page
            return
        pool = self._cache.page_pool
        if self._checked_version == pool.version and (self._checked_pages is pages or self._checked_pages == pages):
            return
        pool.check_held(pages, f"session {self._session_id!r}")
        self._checked_pages, self._checked_version = pages, pool.version

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

    def pending_context(self, kv_branch: str) -> _PendingContext | None:
        """The pending forward context of ``kv_branch`` (``seq_len``, ``num_frames``, ``commit_current``), or None."""
        self.adapter(kv_branch)
        return self._pending.get(kv_branch)

    def committing_branches(self) -> tuple[str, ...]:
        """The branches whose pending context is committing: their block is not in the pages yet."""
        pending = self._pending
        if not pending:  # the common case, asked after every forward
            return ()
        return tuple(name for name, context in pending.items() if context.commit_current)

    def owned_by(self, cache: Any) -> bool:
        """Whether ``cache`` is the :class:`~ardiff_jax.ARDiffusionKVCache` that made this state (its slot's pools)."""
        return self._cache is cache

    @property
    def runner_managed(self) -> bool:
        """Whether a runner manages this state (usable only while bound, released only by the runner)."""
        return self._runner_managed

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
        self.adapter(kv_branch)  # usable, known branch
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
        commit_planned(plan_commits((self,), kv_branch, pending.num_frames), k, v)  # published after the write

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
        # The cursor stays; a shared frame is rewritten into a fresh page (the plan's new table).
        commit_planned(_plan_rows(self._cache, (self,), (self._value,), kv_branch, (frames,), clears=None), k, v)

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


# -- the commit transaction: plan (pure), dispatch (one device write), publish (after it returned) ---------------------
# The one place a commit of one session, of a batch of sessions or of a device-side rollout is planned and published:
# the state's own methods, ARDiffusionKVBatch and ardiff_jax.rollout all go through these functions.

def plan_commits(states: Sequence[ARDiffusionKVState], kv_branch: str, num_frames: int) -> CommitPlan:
    """Plan one device write committing ``num_frames`` frames of ``kv_branch`` of every state (nothing changes).

    Each state's value advances by the one commit rule (:func:`~ardiff_jax.runtime.commit_frames`;
    a refusal raises here, before anything is written). The rows' pages are planned together
    (:meth:`~ardiff_jax.runtime._pages.PagePool.plan_batch`): a session and its fork in one write
    overwrite the same shared pages, one of them keeps each such page and only the others take
    fresh ones, so the write fits the pool whenever the sessions do. Every state must belong to
    one cache. The publish clears the branch's pending contexts.

    Shapes:
      plan.pages: one ``i32[num_frames]`` per state; plan.frames: one ``i32[num_frames]`` per state.
    """
    states = tuple(states)
    cache = _one_cache(states)
    spec, layout = cache.spec, cache.layout
    values = [commit_frames(spec, layout, state._value, kv_branch, num_frames) for state in states]  # refusals first
    frames = [state._adapters[kv_branch].committed_frames + np.arange(num_frames, dtype=np.int32) for state in states]
    return _plan_rows(cache, states, values, kv_branch, frames, clears=kv_branch)


def plan_rollout(states: Sequence[ARDiffusionKVState], kv_branch: str, session_index: np.ndarray,
                 num_frames: int) -> CommitPlan:
    """Plan a device-side rollout: step ``i`` commits ``num_frames`` frames of ``states[session_index[i]]`` (pure).

    Every step goes through the one commit rule on the host first, so any refusal (an
    unknown branch, a pending context: :meth:`ARDiffusionKVState.snapshot` refuses it, a run
    owned by another branch, an overlong session) raises before anything moves. The device
    writes through the page tables the states hold when it runs (:func:`own_rollout_pages`
    makes them the session's own first), so the plan names no pages.

    Shapes:
      session_index: ``i32[num_steps]``; plan.frames: per state ``i32[steps_of_state * num_frames]``;
      plan.pages: per state ``i32[0]``.
    """
    states = tuple(states)
    cache = _one_cache(states)
    spec, layout = cache.spec, cache.layout
    session_index = np.asarray(session_index)
    if session_index.ndim != 1 or (session_index.size and (session_index.min() < 0
                                                           or session_index.max() >= len(states))):
        raise ValueError(f"session_index must be a 1-d sequence of indices in [0, {len(states)}), got "
                         f"{session_index.tolist()}")
    planned = [state.snapshot() for state in states]
    for index in session_index:
        planned[index] = commit_frames(spec, layout, planned[index], kv_branch, int(num_frames))
    steps = np.bincount(session_index, minlength=len(states))
    frames = tuple(state._adapters[kv_branch].committed_frames + np.arange(count * int(num_frames), dtype=np.int32)
                   for state, count in zip(states, steps, strict=True))
    nothing = tuple(np.zeros(0, np.int32) for _ in states)
    return CommitPlan(states=states, values=tuple(planned), pages=nothing, frames=frames, clears=None)


def own_rollout_pages(plan: CommitPlan, kv_branch: str) -> CommitPlan:
    """Before a device rollout: every slot ``plan`` writes gets a page its session alone holds; the plan follows.

    A rollout writes through constant page tables, so a fork's shared history is copied into
    fresh pages once, here (one page copy per state that shares, then its new tables are
    published: counts follow). Returns ``plan`` with each value's page tables the state's
    new ones. Sessions that share nothing move and copy nothing.
    """
    local = plan.states[0]._cache.spec.branch(kv_branch).local_index if plan.states else 0
    for state, frames in zip(plan.states, plan.frames, strict=True):
        if len(frames):
            state._own_pages(local, frames)
    values = tuple(dataclasses.replace(value, pages=state._value.pages)
                   for state, value in zip(plan.states, plan.values, strict=True))
    return dataclasses.replace(plan, values=values)


def dispatch_commit(plan: CommitPlan, k: jax.Array, v: jax.Array) -> None:
    """The device write of ``plan``: every row's block into its planned pages, one donated program; publishes nothing.

    Shapes:
      one state: k, v ``[L, f*T, H, D]``;
      batched: k, v ``[B, L, f*T, H, D]`` with ``B >= len(plan.states)``: row ``i`` is state ``i``'s
      block, rows past the states (a bucket's padding) are dropped.
    """
    cache = plan.states[0]._cache  # a plan's states share one cache (checked when it was made)
    if k.ndim == 4:
        if len(plan.states) != 1:
            raise ValueError(f"a write of {len(plan.states)} sessions needs batched k, v [B, L, f*T, H, D]")
        cache._write_block(plan.pages[0], k, v)
        return
    pages = np.full((k.shape[0], len(plan.pages[0])), cache.layout.null_page, np.int32)  # padded rows drop
    for row, row_pages in enumerate(plan.pages):
        pages[row] = row_pages
    cache._write_blocks(pages, k, v)


def publish_commit(plan: CommitPlan) -> None:
    """Install ``plan``'s values (after its device work returned) and clear the pending contexts it commits.

    Each state's reference counts follow its new tables (:meth:`ARDiffusionKVState._publish`,
    the one place they change), all or nothing per state.
    """
    for state, value in zip(plan.states, plan.values, strict=True):
        state._publish(value)
        if plan.clears is not None:
            state._pending.pop(plan.clears, None)


def commit_planned(plan: CommitPlan, k: jax.Array, v: jax.Array) -> None:
    """The whole transaction of a planned write: :func:`dispatch_commit`, then :func:`publish_commit`.

    A write that raises publishes nothing: every state keeps its value and its pending context.

    Shapes:
      k, v: as :func:`dispatch_commit`.
    """
    dispatch_commit(plan, k, v)
    publish_commit(plan)  # bookkeeping only after the device call returned


def prepare_forwards(states: Sequence[ARDiffusionKVState], kv_branch: str, seq_len: int | None,
                     commit_current: bool) -> list[PagedKVCaches]:
    """:meth:`ARDiffusionKVState.get_kv_caches` of every state, all or nothing (a batched forward's prepare).

    If one state refuses, every state gets back the pending context it had before, and the
    error propagates: no state keeps a new pending context.
    """
    states = tuple(states)
    previous = [state._pending.get(kv_branch) for state in states]
    views = []
    try:
        for state in states:
            views.append(state.get_kv_caches(kv_branch, seq_len, commit_current))
    except BaseException:
        for state, pending in zip(states, previous, strict=True):
            if pending is None:
                state._pending.pop(kv_branch, None)
            else:
                state._pending[kv_branch] = pending
        raise
    return views


def _one_cache(states: tuple[ARDiffusionKVState, ...]) -> ARDiffusionKVCache:
    if not states:
        raise ValueError("a commit plan needs at least one state")
    cache = states[0]._cache
    if any(state._cache is not cache for state in states):
        raise ValueError("the states of one commit must belong to one ARDiffusionKVCache")
    return cache


def _plan_rows(cache: ARDiffusionKVCache, states: tuple[ARDiffusionKVState, ...], values: Sequence[SessionKV],
               kv_branch: str, frames: Sequence[np.ndarray], clears: str | None) -> CommitPlan:
    """The page plan of one write of ``frames[i]`` of ``kv_branch`` of each state (all of ``cache``), then ``values[i]``."""
    local = states[0]._adapters[kv_branch].local_index
    plans = cache.page_pool.plan_batch([state._write_row(local, rows) for state, rows in zip(states, frames,
                                                                                           strict=True)])
    spec, layout = cache.spec, cache.layout
    return CommitPlan(states=states,
                      values=tuple(with_run_table(spec, layout, value, local, plan.new)
                                   for value, plan in zip(values, plans, strict=True)),
                      pages=tuple(plan.pages for plan in plans), frames=tuple(frames), clears=clears)
