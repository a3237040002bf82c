"""``ARDiffusionKVCache``: the KV manager (memory plan, pools, session slots).

The manager is the only owner of the device pools and the only place that replaces the
pool references (after each donated commit). Sessions are host objects that hold a slot
number, never an array of the pools. Constructible directly for research code and tests;
normal users go through :class:`~ardiff_jax.ARDiffusionEngine`. Like the reference's
manager, this class is not a stable API; the capability spec is the stable boundary.
"""

from __future__ import annotations

import functools
import heapq
import logging
from typing import Any

import jax
import numpy as np

from ardiff_jax.capability import ARDiffusionKVCacheSpec
from ardiff_jax._checks import check_session_id
from ardiff_jax.kv import (
    KVLayout,
    KVPools,
    KVSharding,
    allocate_pools,
    check_attention_backend,
    check_mesh,
    commit_block,
    commit_blocks,
    default_storage_dtype,
    gather_table_pages,
    read_pages,
    scatter_table_pages,
    select_attention_backend,
    shard_zeros,
    sharded_read_runs,
    sharded_write_block,
    sharded_write_runs,
    write_pages,
)
from ardiff_jax.runtime._legacy import spec_from_kwargs
from ardiff_jax.runtime._memory import MemoryPlan, free_memory_bytes, plan_memory
from ardiff_jax.runtime._offload import device_memory, host_memory_kind, to_host
from ardiff_jax.runtime._pages import PagePool
from ardiff_jax.runtime._session import SessionKV, fork_session_kv, home_table, run_base, run_table
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.types import check_kv_dtype

__all__ = ["ARDiffusionKVCache"]

logger = logging.getLogger("ardiff_jax.runtime")

#: ``attention_backend="auto"``: cuDNN where it can run the layout, else XLA (see ``select_attention_backend``).
AUTO_BACKEND = "auto"

#: :func:`~ardiff_jax.kv.sharded_write_block` jitted with the pools donated: the commit on a mesh.
_commit_block_sharded = jax.jit(sharded_write_block, static_argnums=(0, 1), donate_argnums=2)


def _read_slot_pages(layout: KVLayout, sharding: KVSharding | None, num_pages: int, pools: KVPools,
                     where: Any) -> KVPools:
    """A slot's pages: one slice on one device (``where`` = first page), per run on a mesh (each run's first page)."""
    if sharding is None:
        return read_pages(layout, pools, where, num_pages)
    return sharded_read_runs(layout, sharding, pools, where)


def _read_written_pages(layout: KVLayout, sharding: KVSharding | None, num_pages: int, pools: KVPools, where: Any,
                        written: Any) -> KVPools:
    """:func:`_read_slot_pages` with the pages a session never wrote as zeros (``written``: bool[num_pages]).

    A slot's pages outlive its sessions: a page the current one has not written yet still
    holds a previous occupant's frame, which must not leave the device in this session's copy.
    """
    pages = _read_slot_pages(layout, sharding, num_pages, pools, where)
    keep = jax.numpy.asarray(written)[None, :, None, None, None]
    return KVPools(k=jax.numpy.where(keep, pages.k, jax.numpy.zeros_like(pages.k)),
                   v=jax.numpy.where(keep, pages.v, jax.numpy.zeros_like(pages.v)))


def _write_slot_pages(layout: KVLayout, sharding: KVSharding | None, pools: KVPools, where: Any,
                      pages: KVPools) -> KVPools:
    """The inverse of :func:`_read_slot_pages`."""
    if sharding is None:
        return write_pages(layout, pools, where, pages)
    return sharded_write_runs(layout, sharding, pools, where, pages)


#: A copy of one slot's pages (the pools are not donated), and one written back (the pools donated).
_copy_slot = jax.jit(_read_slot_pages, static_argnums=(0, 1, 2))
_copy_written = jax.jit(_read_written_pages, static_argnums=(0, 1, 2))
_restore_slot = jax.jit(_write_slot_pages, static_argnums=(0, 1), donate_argnums=2)


class ARDiffusionKVCache:
    """Plans memory, allocates the pools once, hands out session slots.

    Args:
      spec: the pipeline's KV geometry and policy.
      dtype: logical KV dtype (``"bfloat16"``, ``jnp.float32``, ...).
      available_memory_bytes: free memory to plan against. ``None`` measures it:
        ``device.memory_stats()`` where the backend has it, else the host's available RAM.
      gpu_memory_fraction: share of the free memory for KV, in ``(0, 1]``; a soft floor
        (one session that fits the free memory is always admitted).
      device: where the pools live (default: the first device). Not with ``mesh``.
      mesh: a ``jax.sharding.Mesh`` with axes ``"tp"`` and/or ``"cfg"``: the pools are created
        already split (KV heads over ``"tp"``, runs over ``"cfg"``, branch-major when
        ``cfg > 1`` so each local branch lives on its own device group), commits and
        attention run per shard, cross-attention caches are split by heads, and the plan is
        per device (``available_memory_bytes`` is one device's). See ``docs/scaling.md``.
      storage_dtype: dtype of the pool arrays; default per backend (``uint16`` bit patterns
        for 16-bit floats on CPU, the logical dtype elsewhere).
      attention_backend: the registered paged-attention backend the states' views call, or
        ``"auto"``: cuDNN flash attention (``"cudnn"``) where it can run the layout (a GPU,
        16-bit KV, head size a multiple of 8 up to 128), else ``"xla"``; the choice and its
        reason are logged.
      host_offload_bytes: the host tier's size, for the plan's host rows (the runner owns the tier).
      **spec_fields: instead of ``spec``, its fields as keywords (the reference manager's
        form); the former experimental names (``num_frame_per_block``, ``local_branches``,
        ``cross_attn_length``, ``cross_attn_img_length``, ``frame_seqlen``) still work with a
        ``DeprecationWarning``.
    """

    def __init__(
        self,
        spec: ARDiffusionKVCacheSpec | None = None,
        *,
        dtype: Any,
        available_memory_bytes: int | None = None,
        gpu_memory_fraction: float = 0.1,
        device: jax.Device | None = None,
        storage_dtype: Any = None,
        attention_backend: str = "auto",
        host_offload_bytes: int = 0,
        mesh: Any = None,
        **spec_fields: Any,
    ) -> None:
        if spec is None and spec_fields:
            spec = spec_from_kwargs(spec_fields)  # the reference's keyword form (legacy names warn)
        elif spec_fields:
            raise TypeError(f"ARDiffusionKVCache got a spec and spec keywords {sorted(spec_fields)}; pass one")
        if not isinstance(spec, ARDiffusionKVCacheSpec):
            raise TypeError(f"spec must be an ARDiffusionKVCacheSpec, got {type(spec).__name__}")
        dtype = check_kv_dtype(dtype)
        if attention_backend != AUTO_BACKEND:
            check_attention_backend(attention_backend)
        self._closed = False
        self._sharding = None if mesh is None else KVSharding(check_mesh(mesh))
        if self._sharding is not None:
            if device is not None:
                raise ValueError("ARDiffusionKVCache takes a device or a mesh, not both")
            device = mesh.devices.flat[0]  # every device of the mesh has the same free memory to plan against
        self._device = device if device is not None else jax.devices()[0]
        if available_memory_bytes is None:
            available, source = free_memory_bytes(self._device)
        else:
            available, source = available_memory_bytes, "explicit"
        self._spec = spec
        self._plan: MemoryPlan = plan_memory(
            spec, dtype=dtype, available_memory_bytes=available, gpu_memory_fraction=gpu_memory_fraction,
            memory_source=source, host_offload_bytes=host_offload_bytes,
            tp=1 if self._sharding is None else self._sharding.tp,
            cfg=1 if self._sharding is None else self._sharding.cfg,
        )
        plan = self._plan
        if storage_dtype is None:
            storage_dtype = default_storage_dtype(dtype, self._device.platform)
        self._layout = KVLayout(
            num_layers=spec.num_layers,
            num_pages=plan.pool_pages,
            tokens_per_frame=spec.tokens_per_frame,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            sink_frames=spec.sink_frames,
            window_frames=spec.window_frames,
            frames_per_block=spec.frames_per_block,
            scratch_pages=plan.scratch_blocks_per_branch,
            reset_at_boundary=spec.reset_at_boundary,
            dtype=dtype,
            storage_dtype=storage_dtype,
        )
        if self._sharding is not None:
            self._sharding.check_layout(self._layout)
        if attention_backend == AUTO_BACKEND:
            attention_backend, why = select_attention_backend(self._layout, self._device.platform)
            logger.info("AR-Diffusion attention backend %r: %s", attention_backend, why)
        self._attention_backend = attention_backend
        self._pools: KVPools = self._allocate()
        self._free_slots = list(range(plan.session_capacity))  # a heap: lowest free slot first
        self._page_pool = PagePool(self._layout.num_pages)  # who holds each page (forks share theirs)
        self._host_programs: tuple[Any, Any] | None = None  # (offload, restore), compiled at first use
        self._host_kind = host_memory_kind(self._device)  # where offloaded pages live (None: numpy copies)
        self._states: dict[str, ARDiffusionKVState] = {}
        logger.info(
            "AR-Diffusion KV cache: %d layers x %d KV heads x %d, %d tokens/frame, block %d, window %d, sink %d; "
            "capacity %d of %d requested; pools %s %s (%d bytes) on %s",
            spec.num_layers, spec.num_kv_heads, spec.head_size, spec.tokens_per_frame, spec.frames_per_block,
            spec.window_frames, spec.sink_frames, plan.session_capacity, spec.session_capacity,
            self._layout.pool_shape, self._layout.storage_dtype, self._layout.pool_bytes, self._device,
        )
        logger.debug("%s", plan)

    # -- read-only views ---------------------------------------------------------------------
    @property
    def spec(self) -> ARDiffusionKVCacheSpec:
        return self._spec

    @property
    def plan(self) -> MemoryPlan:
        return self._plan

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def device(self) -> jax.Device:
        return self._device

    @property
    def sharding(self) -> KVSharding | None:
        """How the pools are split over the mesh (``None``: one device)."""
        return self._sharding

    @property
    def branch_major(self) -> bool:
        """Runs numbered ``local_index * capacity + slot`` (pools split over ``"cfg"``) instead of slot-major."""
        return self._sharding is not None and self._sharding.cfg > 1

    @property
    def cross_attention_placement(self) -> Any:
        """Where published cross-attention arrays ``[L, N, H, D]`` go: the device, or heads over ``"tp"``."""
        return self._device if self._sharding is None else self._sharding.heads_sharding(4)

    @property
    def state_placement(self) -> Any:
        """Where a session's model state goes back to (offload, session files): the device, or the mesh, replicated."""
        return self._device if self._sharding is None else self._sharding.replicated

    @property
    def dtype(self) -> str:
        """Logical KV dtype name."""
        return self._layout.dtype

    @property
    def session_capacity(self) -> int:
        """Effective capacity: sessions that can be resident at once."""
        return self._plan.session_capacity

    @property
    def attention_backend(self) -> str:
        """Name of the paged-attention backend (:func:`~ardiff_jax.kv.attention_backends`)."""
        return self._attention_backend

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pools(self) -> KVPools:
        """The current pools. Do not keep this reference across a commit: commits donate it."""
        return self._pools

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Ids of the open states, in creation order."""
        return tuple(self._states)

    def get_state(self, session_id: str) -> ARDiffusionKVState | None:
        return self._states.get(session_id)

    def check_owned(self, state: Any) -> None:
        """ValueError unless ``state`` is an open state of *this* cache (not a closed or foreign one)."""
        if not isinstance(state, ARDiffusionKVState):
            raise TypeError(f"expected an ARDiffusionKVState, got {type(state).__name__}")
        if not state.owned_by(self):
            raise ValueError(
                f"ARDiffusionKVState of session {state.session_id!r} belongs to another ARDiffusionKVCache; its slot "
                "numbers mean nothing in this one")
        if self._states.get(state.session_id) is not state:
            raise RuntimeError(f"AR-Diffusion session {state.session_id!r} is closed")

    # -- sessions ------------------------------------------------------------------------------
    def create_state(self, session_id: str) -> ARDiffusionKVState:
        """Open a new session in a free slot. RuntimeError when every slot is taken."""
        check_session_id(session_id)
        self._check_open()
        self.check_pools()
        slot = self._take_slot(session_id)
        state = ARDiffusionKVState(self, session_id, slot)
        self._states[session_id] = state
        return state

    def fork_state(self, source: ARDiffusionKVState, session_id: str) -> ARDiffusionKVState:
        """Open ``session_id`` in a free slot as a fork of ``source``: its pages shared, nothing copied.

        The fork's value is planned from the source's (:func:`~ardiff_jax.runtime.fork_session_kv`,
        pure; the source may have pending contexts, the fork starts with none) and installed
        with the state's checks (page tables of this pool, counts held on publish). All or
        nothing: a refused fork frees its slot again and leaves the source untouched.
        """
        self.check_owned(source)
        checkpoint = source.checkpoint()  # not snapshot(): the source may be unbound or mid-forward
        state = self.create_state(session_id)
        try:
            state.restore(fork_session_kv(checkpoint.value, session_id, state.slot))
        except BaseException:
            state._release()
            raise
        return state

    def _take_slot(self, session_id: str) -> int:
        if session_id in self._states:
            raise ValueError(f"AR-Diffusion session {session_id!r} already has an open state")
        if not self._free_slots:
            raise RuntimeError(
                f"AR-Diffusion KV cache has no free session slot (capacity {self.session_capacity}); close or evict "
                "a session first"
            )
        return heapq.heappop(self._free_slots)

    def _reopen(self, state: ARDiffusionKVState) -> int:
        """Give a closed state a slot again (``state.reset`` reopens a closed state)."""
        self._check_open()
        slot = self._take_slot(state.session_id)
        self._states[state.session_id] = state
        return slot

    def _release_slot(self, state: ARDiffusionKVState, slot: int) -> None:
        if self._states.get(state.session_id) is not state:
            raise RuntimeError(f"AR-Diffusion slot {slot} of session {state.session_id!r} was already released")
        if slot in self._free_slots:  # pragma: no cover - guarded above; a second release would share a slot
            raise RuntimeError(f"AR-Diffusion slot {slot} released twice")
        del self._states[state.session_id]
        heapq.heappush(self._free_slots, slot)

    # -- device ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ARDiffusionKVCache is closed: its pools were freed")

    def check_pools(self) -> None:
        """RuntimeError if the cache is closed or the pools were donated or deleted behind the manager's back."""
        self._check_open()
        if isinstance(self._pools.k, jax.core.Tracer):  # pragma: no cover - rollout_sessions refuses this first
            raise RuntimeError("AR-Diffusion KV pools were replaced by traced values (a runtime call under jax.jit)")
        if self._pools.is_deleted():
            raise RuntimeError(
                "AR-Diffusion KV pools were deleted or donated outside the KV manager (a model must not donate "
                "PagedKVCaches); the resident sessions' KV is lost"
            )

    @property
    def session_pages(self) -> int:
        """Pages of one slot: every local branch's run (sink + ring), adjacent in the pools."""
        return self._spec.num_local_kv_branches * self._layout.run_pages

    def _slot_start(self, slot: int) -> np.int32:
        if not 0 <= slot < self.session_capacity:
            raise IndexError(f"AR-Diffusion slot {slot} out of range [0, {self.session_capacity})")
        return np.int32(slot * self.session_pages)

    def _slot_run_starts(self, slot: int) -> np.ndarray:
        """First page of each of ``slot``'s runs, in local-branch order (on a mesh they need not be adjacent)."""
        self._slot_start(slot)  # range check
        return np.array([run_base(self._spec, self._layout, slot, local, branch_major=self.branch_major)
                         for local in range(self._spec.num_local_kv_branches)], np.int32)

    @property
    def slot_copy_sharding(self) -> jax.sharding.Sharding:
        """Where a copy of a slot lives: the device, or on a mesh KV heads over ``"tp"`` and layers over ``"cfg"``."""
        if self._sharding is None:
            return jax.sharding.SingleDeviceSharding(self._device)
        return self._sharding.copy_sharding(self._layout)

    def read_slot(self, slot: int) -> KVPools:
        """A device copy of ``slot``'s pages, ``storage[L, R*(K+W), T, H, D]`` (dispatched, not awaited).

        The runs come in local-branch order on one device and on a mesh alike, so the copy
        of a session is the same array wherever it was taken.
        """
        self.check_pools()
        return _copy_slot(self._layout, self._sharding, self.session_pages, self._pools, self._slot_where(slot))

    @property
    def page_pool(self) -> PagePool:
        """The pages' reference counts (read them; the session states change them)."""
        return self._page_pool

    @property
    def pages_in_use(self) -> int:
        """Distinct pages the resident sessions hold: a page N forks share counts once."""
        return self._page_pool.pages_in_use

    def home_tables(self, slot: int) -> tuple[tuple[int, ...], ...]:
        """The page tables of ``slot``'s own contiguous runs, in local-branch order."""
        return tuple(home_table(self._spec, self._layout, slot, local, branch_major=self.branch_major)
                     for local in range(self._spec.num_local_kv_branches))

    def _session_pages(self, value: SessionKV) -> tuple[np.ndarray | None, np.ndarray]:
        """``(pages, written)`` of a copy of ``value``, in slot-copy order.

        ``written`` says which of the copy's pages the session wrote (its table holds a page
        there); ``pages`` is None when every written slot sits on its home page (every session
        that never forked or shared: the contiguous slot programs copy it), else the table's
        pages to gather one by one into the same array (a fork, or a source whose shared slots
        moved). Either way the pages it never wrote are copied as zeros.
        """
        layout = self._layout
        homes = self.home_tables(value.slot)
        tables = np.array([run_table(layout, value, local) for local in range(len(homes))], np.int32)
        written = (tables != layout.null_page).reshape(-1)
        if np.all((tables == layout.null_page) | (tables == np.array(homes, np.int32))):
            return None, written
        if self._sharding is not None:  # pragma: no cover - forks are refused on a mesh
            raise RuntimeError("AR-Diffusion sessions with remapped pages cannot be copied on a mesh")
        return tables.reshape(-1), written

    def offload_session(self, value: SessionKV) -> KVPools:
        """The session's pages copied to host memory, in the slot-copy layout whatever its page tables.

        Only what the session wrote: a page it never wrote is zeros in the copy, never a
        previous occupant's frame (so no offload record or session file carries another
        session's KV). A fork's shared pages are copied too: the copy stands alone (restored or
        loaded without its source)."""
        pages, written = self._session_pages(value)
        if pages is None:
            return self.offload_slot(value.slot, written)
        self.check_pools()
        return to_host(gather_table_pages(self._layout, self._pools, pages), self._device)

    def restore_session_pages(self, slot: int, pages: KVPools) -> tuple[tuple[int, ...], ...]:
        """Write a session copy into the pools for a session now in ``slot``; returns its page tables.

        Into the slot's own runs when no session holds any of their pages (one contiguous
        write); otherwise (a fork of the slot's previous occupant still reads some of them)
        into free pages, preferring the slot's own, so no other session's frames change.
        Nothing is counted here: the tables are held once the session's value is published.
        """
        homes = self.home_tables(slot)
        if self._page_pool.is_free(page for home in homes for page in home):
            self.write_slot(slot, pages)
            return homes
        self.check_pools()
        self._check_slot_pages(pages)
        reserved: set[int] = set()
        tables = tuple(self._page_pool.plan_writes(self._page_pool.empty_table(self._layout.run_pages),
                                                   range(self._layout.run_pages), home, reserved).new
                       for home in homes)
        target = np.concatenate([np.asarray(table, np.int32) for table in tables])
        # Into device memory as write_slot places them: a record in pinned host memory (what the
        # runtime offloads) cannot be put on a bare device ("Memory kind mismatch").
        placement = device_memory(self.slot_copy_sharding)
        on_device = KVPools(k=jax.device_put(pages.k, placement), v=jax.device_put(pages.v, placement))
        self._pools = scatter_table_pages(self._layout, self._pools, target, on_device)
        return tables

    def _check_slot_pages(self, pages: KVPools) -> None:
        layout = self._layout
        shape = (layout.num_layers, self.session_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
        for name, array in (("k", pages.k), ("v", pages.v)):
            if tuple(array.shape) != shape or np.dtype(array.dtype) != np.dtype(jax.numpy.dtype(layout.storage_dtype)):
                raise ValueError(f"AR-Diffusion slot pages {name} must be {layout.storage_dtype}{list(shape)}, got "
                                 f"{array.dtype}{list(array.shape)}")

    def offload_slot(self, slot: int, written: np.ndarray | None = None) -> KVPools:
        """``slot``'s pages copied to host memory (``pinned_host``), dispatched and not awaited.

        ``written`` (bool per page of the slot, default all) keeps those pages; the others are
        zeros in the copy. One program reads the slot and writes it straight into host memory:
        the bytes cross once. Where the backend cannot compile that, a device copy is moved to
        host memory instead (two passes). On a mesh the host copy keeps the heads split over
        ``"tp"`` (each device's host memory holds its heads).
        """
        self.check_pools()
        where = self._slot_where(slot)
        written = np.ones(self.session_pages, bool) if written is None else np.asarray(written, bool)
        if written.shape != (self.session_pages,):
            raise ValueError(f"AR-Diffusion offload_slot written must be bool[{self.session_pages}], got "
                             f"{written.dtype}{list(written.shape)}")
        offload = self._compiled_host_programs()[0]
        if offload is None:
            copy = _copy_written(self._layout, self._sharding, self.session_pages, self._pools, where, written)
            return to_host(copy, self._device)
        return offload(self._pools, where, written)

    def write_slot(self, slot: int, pages: KVPools) -> None:
        """Overwrite ``slot``'s pages with ``pages`` (host or device arrays): one donated in-place write.

        Shapes and dtypes are checked before anything moves; every page of the slot is written,
        so nothing of the slot's previous occupant survives. Pages in host memory (what
        :meth:`offload_slot` returns) move to the device inside the writing program; other
        arrays (numpy, another device, another mesh) are placed first.
        """
        self.check_pools()
        where = self._slot_where(slot)
        layout = self._layout
        self._check_slot_pages(pages)
        restore = self._compiled_host_programs()[1]
        host = None if self._host_kind is None else self.slot_copy_sharding.with_memory_kind(self._host_kind)
        if restore is not None and all(isinstance(x, jax.Array) and x.sharding == host for x in (pages.k, pages.v)):
            self._pools = restore(self._pools, where, pages)
            return
        target = self.slot_copy_sharding  # device memory: a bare device refuses host-memory arrays
        on_device = KVPools(k=jax.device_put(pages.k, target), v=jax.device_put(pages.v, target))
        self._pools = _restore_slot(layout, self._sharding, self._pools, where, on_device)

    def _slot_where(self, slot: int) -> np.ndarray:
        """What the slot copy programs take: the first page (one device) or each run's first page (mesh)."""
        return self._slot_start(slot) if self._sharding is None else self._slot_run_starts(slot)

    def _compiled_host_programs(self) -> tuple[Any, Any]:
        """``(offload, restore)``: slot <-> host memory in one program each, compiled once (``None`` if unsupported).

        Ahead-of-time compiled, so a backend that cannot place a program's output (or take
        its input) in host memory fails here, before any pool is donated, and the two-pass
        path is used instead.
        """
        if self._host_programs is not None:
            return self._host_programs
        kind = self._host_kind
        if kind is None:
            self._host_programs = (None, None)
            return self._host_programs
        layout, num_pages, sharding = self._layout, self.session_pages, self._sharding
        device = self.slot_copy_sharding
        host = device.with_memory_kind(kind)
        where = self._slot_where(0)

        def restore_from_host(pools: KVPools, where: Any, pages: KVPools) -> KVPools:
            return _write_slot_pages(layout, sharding, pools, where, jax.device_put(pages, device))

        try:
            read = functools.partial(_read_written_pages, layout, sharding, num_pages)
            offload = jax.jit(read, out_shardings=host).lower(self._pools, where,
                                                             np.ones(num_pages, bool)).compile()
        except Exception as error:  # pragma: no cover - backends without host-memory outputs
            logger.warning("AR-Diffusion offload falls back to two passes (%r)", error)
            offload = None
        shape = (layout.num_layers, num_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
        spec = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(layout.storage_dtype), sharding=host)
        try:
            restore = jax.jit(restore_from_host, donate_argnums=0).lower(self._pools, where,
                                                                         KVPools(k=spec, v=spec)).compile()
        except Exception as error:  # pragma: no cover - backends without host-memory inputs
            logger.warning("AR-Diffusion restore falls back to two passes (%r)", error)
            restore = None
        self._host_programs = (offload, restore)
        return self._host_programs

    def _write_block(self, pages: np.ndarray, k: jax.Array, v: jax.Array) -> None:
        """One donated write of a committed block; swaps the pool references after dispatch."""
        self.check_pools()
        if self._sharding is not None:
            self._pools = _commit_block_sharded(self._layout, self._sharding, self._pools, pages, k, v)
            return
        self._pools = commit_block(self._layout, self._pools, pages, k, v)

    def _copy_pages(self, source: np.ndarray, target: np.ndarray) -> None:
        """Copy whole pages ``source[i] -> target[i]`` (one gather and one donated scatter; pools on one device)."""
        self.check_pools()
        if self._sharding is not None:  # pragma: no cover - forks are refused on a mesh
            raise RuntimeError("AR-Diffusion page copies need pools on one device")
        data = gather_table_pages(self._layout, self._pools, source)
        self._pools = scatter_table_pages(self._layout, self._pools, target, data)

    def _write_blocks(self, pages: np.ndarray, k: jax.Array, v: jax.Array) -> None:
        """One donated write of a batched tick's blocks (``pages i32[B, f]``, null rows dropped); pools on one device."""
        self.check_pools()
        if self._sharding is not None:
            raise RuntimeError("AR-Diffusion batched commits need pools on one device")
        self._pools = commit_blocks(self._layout, self._pools, pages, k, v)

    def _replace_pools(self, pools: KVPools) -> None:
        """Take back the pools a donated device program returned (device-side rollouts)."""
        if isinstance(pools.k, jax.core.Tracer) or isinstance(pools.v, jax.core.Tracer):
            raise TypeError("AR-Diffusion pools must be concrete arrays; a runtime call ran under a jax transformation")
        self._pools = pools

    def block_until_ready(self) -> None:
        """Wait for every dispatched pool write (surfaces asynchronous device errors)."""
        self.check_pools()
        jax.block_until_ready(self._pools)

    def reallocate_pools(self) -> None:
        """Replace lost pools with fresh zeroed ones. Every open session must be closed first."""
        self._check_open()
        if self._states:
            raise RuntimeError(
                f"AR-Diffusion reallocate_pools needs every session closed; open: {list(self._states)}"
            )
        self._pools.delete()
        self._pools = self._allocate()

    def _allocate(self) -> KVPools:
        """Zeroed pools: on the device, or created already split over the mesh (no full-size buffer anywhere)."""
        if self._sharding is None:
            return allocate_pools(self._layout, self._device)
        layout, where = self._layout, self._sharding.pool_sharding
        return KVPools(k=shard_zeros(layout.pool_shape, layout.storage_dtype, where),
                       v=shard_zeros(layout.pool_shape, layout.storage_dtype, where))

    def close(self) -> None:
        """Close every session and free the pools now (notebooks: release device memory). Idempotent."""
        if self._closed:
            return
        managed = [sid for sid, state in self._states.items() if state.runner_managed]
        if managed:
            raise RuntimeError(
                f"ARDiffusionKVCache sessions {managed} belong to a runner; close the engine (engine.close()), which "
                "releases them with their hooks and then closes this cache")
        for state in list(self._states.values()):
            state._release()
        self._pools.delete()
        self._closed = True

    def memory_report(self) -> dict[str, int]:
        """Live device bytes owned by the manager: pools and published cross-attention arrays."""
        states = list(self._states.values())  # one read: another thread may open or close sessions meanwhile
        cross = sum(state.cross_attention_bytes for state in states)
        live = not (self._closed or self._pools.is_deleted())
        shards = 1 if self._sharding is None else self._sharding.num_shards
        return {
            "pool_bytes": self._layout.pool_bytes if live else 0,
            "pool_bytes_per_device": self._layout.pool_bytes // shards if live else 0,
            "cross_attention_bytes": cross,
            "open_sessions": len(states),
            "free_slots": len(self._free_slots),
        }
