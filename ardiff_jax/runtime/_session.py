"""One session's KV bookkeeping as a value, and the pure functions that change it.

:class:`SessionKV` is everything the runtime knows about a session's KV besides the page
contents: its slot (hence its runs of pages), a :class:`BranchCursor` per logical branch,
which branch holds committed KV in each worker-local run, and the published
cross-attention arrays. It is an immutable pytree: a change produces a new value.

Every cursor change goes through :func:`commit_frames` (validate, then advance with the
cursor arithmetic of :mod:`ardiff_jax.kv`, written once for numpy and jnp). The
imperative :class:`~ardiff_jax.ARDiffusionKVState`, the device-side rollout
(:mod:`ardiff_jax.rollout`) and any later path (offload, snapshots) call it; nothing
else constructs an advanced cursor. Because the value is validated before any device work
and published only after the device call returned, a refused or failed commit leaves the
previous value in place.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from ardiff_jax._checks import check_positive_int
from ardiff_jax.capability import ARDiffusionKVCacheSpec
from ardiff_jax.kv import KVLayout, advance_frames, make_table_cursor

__all__ = [
    "BranchCursor",
    "CrossAttentionKV",
    "SessionKV",
    "branch_cursor_array",
    "check_session_kv",
    "clear_cross_attention",
    "commit_frames",
    "fork_session_kv",
    "new_session_kv",
    "publish_cross_attention",
    "reset_session_kv",
    "home_table",
    "run_base",
    "run_table",
    "session_kv_from_saved",
    "with_run_table",
]


class CrossAttentionKV(NamedTuple):
    """A published cross-attention cache: per-layer K and V stacked on axis 0.

    Attributes:
      k: ``dtype[L, N, Hc, D]``
      v: ``dtype[L, N, Hc, D]``

    A pytree (NamedTuple), so it passes into ``jax.jit`` as is; ``kv.k[i]`` is layer ``i``.
    """

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BranchCursor:
    """Where one logical KV branch of a session stands.

    Attributes:
      committed_frames: frames committed since the session (or its last reset) began; the
        absolute index of the next block's first frame.
      visible_start_frame: first non-sink frame still visible (moves only under
        ``reset_at_boundary``, where it jumps to ``committed_frames`` after every commit).

    Host values are Python ints; inside ``jit`` the fields may be ``i32[]`` arrays.
    """

    committed_frames: Any
    visible_start_frame: Any


@dataclasses.dataclass(frozen=True)
class SessionKV:
    """The KV bookkeeping of one session: an immutable pytree.

    Attributes:
      session_id: the session.
      slot: the session slot; the runs of its local branches start at :func:`run_base`.
      cursors: ``{branch name: BranchCursor}`` for every logical branch of the spec.
      cross_attention: ``{(cache name, branch name): CrossAttentionKV}``, the published
        cross-attention caches.
      run_owners: ``((local_index, branch name), ...)`` sorted by local index: which logical
        branch holds committed KV in each worker-local run. Branches may share a local
        index (CFG-parallel layouts); only the owner may commit into a shared run.
      pages: the page table of each worker-local run, in local-index order: ``pages[r][s]``
        is the page holding slot ``s`` of run ``r`` (``sink + window`` slots; the null page
        for a slot never written). ``()``: nothing written yet (every entry null). A fork's
        tables start as its source's (the pages are shared, reference-counted by the cache).

    The two mappings are read-only views of private copies, so nobody holding a value (a
    snapshot, say) can change the session through it; the functions below build new values.
    As a pytree, the cursors and cross caches are the children (their dict keys sorted, as
    jax sorts them) and the id, slot and run owners are static.
    """

    session_id: str
    slot: int
    cursors: Mapping[str, BranchCursor]
    cross_attention: Mapping[tuple[str, str], CrossAttentionKV]
    run_owners: tuple[tuple[int, str], ...] = ()
    pages: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "cursors", types.MappingProxyType(dict(self.cursors)))
        object.__setattr__(self, "cross_attention", types.MappingProxyType(dict(self.cross_attention)))
        object.__setattr__(self, "run_owners", tuple(tuple(pair) for pair in self.run_owners))
        object.__setattr__(self, "pages", tuple(tuple(int(page) for page in table) for table in self.pages))

    def cursor(self, branch: str) -> BranchCursor:
        try:
            return self.cursors[branch]
        except KeyError:
            raise KeyError(f"Unknown AR-Diffusion KV branch {branch!r}; configured: {list(self.cursors)}") from None

    def run_owner(self, local_index: int) -> str | None:
        return dict(self.run_owners).get(local_index)

    @property
    def cross_attention_bytes(self) -> int:
        return sum(kv.k.nbytes + kv.v.nbytes for kv in self.cross_attention.values())


def _flatten_session(session: SessionKV) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
    return (dict(session.cursors), dict(session.cross_attention)), (session.session_id, session.slot,
                                                                    session.run_owners, session.pages)


def _unflatten_session(static: tuple[Any, ...], children: Any) -> SessionKV:
    session_id, slot, run_owners, pages = static
    return SessionKV(session_id=session_id, slot=slot, cursors=children[0], cross_attention=children[1],
                     run_owners=run_owners, pages=pages)


jax.tree_util.register_pytree_node(SessionKV, _flatten_session, _unflatten_session)


_EMPTY = BranchCursor(committed_frames=0, visible_start_frame=0)


def new_session_kv(spec: ARDiffusionKVCacheSpec, session_id: str, slot: int,
                   cross_attention: Mapping[tuple[str, str], CrossAttentionKV] | None = None) -> SessionKV:
    """A session with every branch empty (optionally keeping some published cross caches)."""
    return SessionKV(session_id=session_id, slot=slot, cursors={name: _EMPTY for name in spec.kv_branch_names},
                     cross_attention=dict(cross_attention or {}), run_owners=())


def fork_session_kv(source: SessionKV, session_id: str, slot: int) -> SessionKV:
    """The value of a fork of ``source``: session ``session_id`` in ``slot``, standing where ``source`` stands.

    The same cursors, run owners and published cross caches (the arrays are shared, never
    copied: they are immutable) and the same page tables, so the fork reads the source's
    history from the source's pages; whichever of the two writes a shared slot first moves
    to a fresh page (:class:`~ardiff_jax.runtime._pages.PagePool`). Pure: nothing is held here,
    the counts follow when the state publishes the value.
    """
    return SessionKV(session_id=session_id, slot=slot, cursors=source.cursors, cross_attention=source.cross_attention,
                     run_owners=source.run_owners, pages=source.pages)


def reset_session_kv(spec: ARDiffusionKVCacheSpec, session: SessionKV, keep_cross_attention: Iterable[str] = ()
                     ) -> SessionKV:
    """Every branch emptied; only the cross caches named in ``keep_cross_attention`` survive."""
    keep = frozenset(keep_cross_attention)
    kept = {key: kv for key, kv in session.cross_attention.items() if key[0] in keep}
    return new_session_kv(spec, session.session_id, session.slot, kept)


def run_base(spec: ARDiffusionKVCacheSpec, layout: KVLayout, slot: int, local_index: int, *,
             branch_major: bool = False) -> int:
    """First page of the run of (``slot``, ``local_index``).

    Slot-major by default (a session's runs are adjacent, so it is one contiguous slice).
    ``branch_major`` (pools split over a ``"cfg"`` mesh axis) numbers runs
    ``local_index * capacity + slot``, so each local branch of every session lands in the
    same device group.
    """
    num_local = spec.num_local_kv_branches
    if branch_major:
        return (local_index * (layout.num_runs // num_local) + slot) * layout.run_pages
    return (slot * num_local + local_index) * layout.run_pages


def home_table(spec: ARDiffusionKVCacheSpec, layout: KVLayout, slot: int, local_index: int, *,
               branch_major: bool = False) -> tuple[int, ...]:
    """The run's own pages (its slot's contiguous run): where its writes go when nobody else holds them."""
    base = run_base(spec, layout, slot, local_index, branch_major=branch_major)
    return tuple(range(base, base + layout.run_pages))


def run_table(layout: KVLayout, session: SessionKV, local_index: int) -> tuple[int, ...]:
    """The page table of the session's run ``local_index`` (all null before anything was written)."""
    if not session.pages:
        return (layout.null_page,) * layout.run_pages
    return session.pages[local_index]


def with_run_table(spec: ARDiffusionKVCacheSpec, layout: KVLayout, session: SessionKV, local_index: int,
                   table: tuple[int, ...]) -> SessionKV:
    """The session with run ``local_index``'s page table replaced."""
    tables = [run_table(layout, session, index) for index in range(spec.num_local_kv_branches)]
    tables[local_index] = tuple(table)
    return dataclasses.replace(session, pages=tuple(tables))


def branch_cursor_array(spec: ARDiffusionKVCacheSpec, layout: KVLayout, session: SessionKV, branch: str, *,
                        branch_major: bool = False) -> np.ndarray:
    """The ``i32[3 + K + W]`` cursor (run base, committed, visible start, page table) that jitted code reads."""
    cursor = session.cursor(branch)
    local_index = spec.branch(branch).local_index
    base = run_base(spec, layout, session.slot, local_index, branch_major=branch_major)
    return make_table_cursor(base, cursor.committed_frames, cursor.visible_start_frame,
                             run_table(layout, session, local_index))


def commit_frames(spec: ARDiffusionKVCacheSpec, layout: KVLayout, session: SessionKV, branch: str,
                  num_frames: int) -> SessionKV:
    """The session after ``branch`` commits ``num_frames`` frames: validate, then advance.

    Raises (and changes nothing, there being nothing to change) when the branch is
    unknown, the frame count is out of range, the commit would exceed ``max_model_len``,
    or another branch sharing the worker-local run already holds committed KV there.
    """
    cursor = session.cursor(branch)
    num_frames = check_positive_int("AR-Diffusion committed frames", num_frames)
    if num_frames > layout.window_frames:
        raise ValueError(
            f"AR-Diffusion commit of {num_frames} frames exceeds the window ({layout.window_frames} frames)")
    new_committed = cursor.committed_frames + num_frames
    if spec.max_model_len is not None and new_committed * spec.tokens_per_frame > spec.max_model_len:
        raise RuntimeError(
            f"AR-Diffusion branch {branch!r} of session {session.session_id!r} would exceed max_model_len "
            f"({spec.max_model_len} tokens); reset the session")
    local_index = spec.branch(branch).local_index
    owner = session.run_owner(local_index)
    if owner is not None and owner != branch and session.cursors[owner].committed_frames > 0:
        raise RuntimeError(
            f"AR-Diffusion branches {owner!r} and {branch!r} of session {session.session_id!r} share local_index "
            f"{local_index}: only one of them may hold committed KV on one worker (give them distinct local "
            "indices, or run each on its own worker)")
    committed, visible_start = advance_frames(layout, cursor.committed_frames, cursor.visible_start_frame,
                                              num_frames)
    new_cursor = BranchCursor(committed_frames=committed, visible_start_frame=visible_start)
    owners = session.run_owners
    if owner != branch:
        owners = tuple(sorted({**dict(owners), local_index: branch}.items()))
    return SessionKV(session_id=session.session_id, slot=session.slot,
                     cursors={**session.cursors, branch: new_cursor},
                     cross_attention=session.cross_attention, run_owners=owners, pages=session.pages)


def publish_cross_attention(session: SessionKV, branch: str, cache_name: str, kv: CrossAttentionKV) -> SessionKV:
    """The session with ``kv`` published as cache ``cache_name`` of ``branch`` (the one swap)."""
    session.cursor(branch)
    return dataclasses.replace(session, cross_attention={**session.cross_attention, (cache_name, branch): kv})


def clear_cross_attention(session: SessionKV) -> SessionKV:
    """The session without any cross-attention cache (self-attention KV kept)."""
    return dataclasses.replace(session, cross_attention={})


def check_session_kv(spec: ARDiffusionKVCacheSpec, value: SessionKV) -> SessionKV:
    """``value`` if it is a session this spec could have produced, else ValueError naming what is off.

    Checked: exactly the spec's branches; every cursor an integer with
    ``0 <= visible_start <= committed`` (``visible_start == committed`` under
    ``reset_at_boundary``, ``0`` otherwise) within the optional ``max_model_len``; run owners
    that name real branches at their own local index, and own every run that holds
    committed frames; cross caches with known names, known branches and ``[L, N, Hc, D]``
    arrays. Returns the value with its cursors in the spec's branch order.
    """
    if not isinstance(value, SessionKV):
        raise TypeError(f"expected a SessionKV (from state.snapshot()), got {type(value).__name__}")
    names = spec.kv_branch_names
    if set(value.cursors) != set(names):
        raise ValueError(f"session branches {sorted(value.cursors)} differ from the spec's {sorted(names)}")
    for name in names:
        cursor = value.cursors[name]
        if not isinstance(cursor, BranchCursor):
            raise ValueError(f"cursor of branch {name!r} must be a BranchCursor, got {cursor!r}")
        committed, start = cursor.committed_frames, cursor.visible_start_frame
        for field, number in (("committed_frames", committed), ("visible_start_frame", start)):
            if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number < 0:
                raise ValueError(f"cursor {name!r} {field} must be a non-negative integer, got {number!r}")
        expected_start = committed if spec.reset_at_boundary else 0
        if start != expected_start:
            raise ValueError(f"cursor {name!r} is inconsistent: visible_start_frame {start} with {committed} committed "
                             f"frames (expected {expected_start} {'under' if spec.reset_at_boundary else 'without'} "
                             "reset_at_boundary)")
        if spec.max_model_len is not None and committed * spec.tokens_per_frame > spec.max_model_len:
            raise ValueError(f"cursor {name!r} holds {committed} frames, beyond max_model_len "
                             f"({spec.max_model_len} tokens)")
    owners = dict(value.run_owners)
    if len(owners) != len(value.run_owners) or list(owners) != sorted(owners):
        raise ValueError(f"run owners must be unique and sorted by local index, got {value.run_owners}")
    for local_index, owner in owners.items():
        if owner not in names or spec.branch(owner).local_index != local_index:
            raise ValueError(f"run owner {owner!r} of local index {local_index} is not a branch at that index")
    for name in names:
        local_index = spec.branch(name).local_index
        if value.cursors[name].committed_frames > 0 and owners.get(local_index) != name:
            raise ValueError(f"branch {name!r} holds committed frames but does not own run {local_index} "
                             f"(owner: {owners.get(local_index)!r})")
    for key, kv in value.cross_attention.items():
        cache_name, branch = key
        if cache_name not in spec.cross_attention_lengths or branch not in names:
            raise ValueError(f"cross-attention cache {key} names an unknown cache or branch")
        expected = (spec.num_layers, spec.cross_attention_lengths[cache_name], spec.cross_attention_heads(cache_name),
                    spec.head_size)
        if not isinstance(kv, CrossAttentionKV) or tuple(kv.k.shape) != expected or tuple(kv.v.shape) != expected:
            raise ValueError(f"cross-attention cache {cache_name!r} of branch {branch!r} must be CrossAttentionKV of "
                             f"[L, N, Hc, D] = {expected}")
    if value.pages and (len(value.pages) != spec.num_local_kv_branches
                        or any(len(table) != spec.sink_frames + spec.window_frames for table in value.pages)):
        raise ValueError(f"page tables must be {spec.num_local_kv_branches} runs of sink + window pages")
    return SessionKV(session_id=value.session_id, slot=value.slot,
                     cursors={name: value.cursors[name] for name in names},
                     cross_attention=value.cross_attention, run_owners=value.run_owners, pages=value.pages)


def session_kv_from_saved(spec: ARDiffusionKVCacheSpec, session_id: str,
                          cursors: Mapping[str, tuple[int, int]], run_owners: Iterable[tuple[int, str]],
                          cross_attention: Mapping[tuple[str, str], CrossAttentionKV]) -> SessionKV:
    """A session read back from a file: ``{branch: (committed, visible_start)}`` and the rest, validated.

    The one way a cursor enters from outside: it must be one the spec could have produced
    (:func:`check_session_kv`; ValueError otherwise). The slot is 0 until a restore rebases it.
    """
    value = SessionKV(session_id=session_id, slot=0,
                      cursors={name: BranchCursor(committed_frames=committed, visible_start_frame=start)
                               for name, (committed, start) in cursors.items()},
                      cross_attention=cross_attention, run_owners=tuple(run_owners))
    return check_session_kv(spec, value)
