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
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax.kv import PagedKVCaches, block_pages, make_cursor

if TYPE_CHECKING:  # pragma: no cover
    from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache

__all__ = ["ARDiffusionKVState", "ARDiffusionRequestAdapter", "CrossAttentionKV"]


class CrossAttentionKV(NamedTuple):
    """A published cross-attention cache: per-layer K and V stacked on axis 0.

    Attributes:
      k: ``dtype[L, N, Hc, D]``
      v: ``dtype[L, N, Hc, D]``

    A pytree (NamedTuple), so it passes into ``jax.jit`` as is; ``kv.k[i]`` is layer ``i``.
    """

    k: jax.Array
    v: jax.Array


class ARDiffusionRequestAdapter:
    """The live cursor of one (session, logical branch).

    ``request_id == f"ar::{session_id}::{branch}"``. Identity is stable until the session is
    released or ``state.reset`` installs a fresh adapter with the same request id. Models
    read ``num_computed_tokens`` / ``committed_frames`` (e.g. for RoPE frame offsets).
    """

    __slots__ = ("request_id", "kv_branch", "local_index", "tokens_per_frame", "_committed", "_visible_start")

    def __init__(self, session_id: str, kv_branch: str, local_index: int, tokens_per_frame: int) -> None:
        self.request_id = f"ar::{session_id}::{kv_branch}"
        self.kv_branch = kv_branch
        self.local_index = local_index
        self.tokens_per_frame = tokens_per_frame
        self._committed = 0
        self._visible_start = 0

    @property
    def committed_frames(self) -> int:
        """Frames committed since the session (or its last reset) began: the absolute frame index of the next block."""
        return self._committed

    @property
    def completed_chunks(self) -> int:
        """Committed chunks (one chunk = one frame = one page)."""
        return self._committed

    @property
    def num_computed_tokens(self) -> int:
        """Committed tokens: ``committed_frames * tokens_per_frame``."""
        return self._committed * self.tokens_per_frame

    @property
    def visible_start_frame(self) -> int:
        """First non-sink frame still visible (moves only under ``reset_at_boundary``)."""
        return self._visible_start

    def __repr__(self) -> str:
        return f"ARDiffusionRequestAdapter({self.request_id!r}, committed_frames={self._committed})"


@dataclasses.dataclass(frozen=True)
class _PendingContext:
    seq_len: int
    num_frames: int
    commit_current: bool


def _shape_of(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {dtype}")
    return tuple(shape)


class ARDiffusionKVState:
    """Per-session KV handle: paged self-attention contexts and named cross-attention caches.

    Created by :meth:`ARDiffusionKVCache.create_state` (the runner does it for you). Inside a
    runner the state is bound to the pipeline for exactly one invocation; using it after
    that raises.
    """

    def __init__(self, cache: ARDiffusionKVCache, session_id: str, slot: int) -> None:
        self._cache = cache
        self._session_id = session_id
        self._slot: int | None = slot
        self._closed = False
        self._adapters = self._fresh_adapters()
        self._pending: dict[str, _PendingContext] = {}
        self._cross: dict[tuple[str, str], CrossAttentionKV] = {}
        # Which logical branch holds committed KV in a shared local run (local index -> name).
        self._run_owner: dict[int, str] = {}
        # Runner guard: when set, the state is usable only while bound to an invocation.
        self._runner_managed = False
        self._bound = False

    def _fresh_adapters(self) -> dict[str, ARDiffusionRequestAdapter]:
        spec = self._cache.spec
        return {
            branch.name: ARDiffusionRequestAdapter(self._session_id, branch.name, branch.local_index,
                                                   spec.tokens_per_frame)
            for branch in spec.kv_branches
        }

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
        return self._slot

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"slot {self._slot}"
        return f"ARDiffusionKVState({self._session_id!r}, {status})"

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
        except KeyError:
            raise KeyError(
                f"Unknown AR-Diffusion KV branch {kv_branch!r}; configured: {list(self.kv_branch_names)}"
            ) from None

    def _check_cross_name(self, cache_name: str) -> None:
        if cache_name not in self._cache.spec.cross_attention_lengths:
            raise KeyError(
                f"Unknown AR-Diffusion cross-attention cache {cache_name!r}; configured: "
                f"{list(self._cache.spec.cross_attention_lengths)}"
            )

    def _run_base(self, local_index: int) -> int:
        assert self._slot is not None
        run_index = self._slot * self._cache.spec.num_local_kv_branches + local_index
        return run_index * self._cache.layout.run_pages

    # -- paged self-attention -----------------------------------------------------------------
    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False) -> PagedKVCaches:
        """Prepare one forward of ``seq_len`` current tokens on ``kv_branch``.

        Returns a :class:`~ardiff_jax.kv.PagedKVCaches` pytree (``num_layers`` per-layer views)
        to pass into the model's jit. With ``commit_current=True`` the forward must end with
        :meth:`commit_paged_context` ``(kv_branch, kv=(k, v))``; a non-committing forward
        (denoise probe) needs no write at all.
        """
        adapter = self.adapter(kv_branch)
        layout = self._cache.layout
        if seq_len is None:
            raise ValueError("AR-Diffusion get_kv_caches requires seq_len (tokens of the current block)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)):
            raise ValueError(f"AR-Diffusion seq_len must be an integer, got {seq_len!r}")
        seq_len = int(seq_len)
        num_frames = layout.frames_in(seq_len)
        if num_frames > layout.scratch_pages:
            raise RuntimeError(
                f"AR-Diffusion scratch blocks exhausted: {num_frames} frames exceed {layout.scratch_pages} scratch "
                f"pages per branch; raise AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH"
            )
        pending = self._pending.get(kv_branch)
        if pending is not None and pending.commit_current:
            raise RuntimeError(
                f"AR-Diffusion paged context of branch {kv_branch!r} (session {self._session_id!r}) replaced before "
                "its committing block was committed; call commit_paged_context(branch, kv=...) or "
                "discard_paged_context(branch) first"
            )
        self._cache.check_pools()
        cursor = make_cursor(self._run_base(adapter.local_index), adapter.committed_frames,
                             adapter.visible_start_frame)
        caches = PagedKVCaches(pools=self._cache.pools, cursor=cursor, layout=layout, seq_len=seq_len)
        self._pending[kv_branch] = _PendingContext(seq_len, num_frames, bool(commit_current))
        return caches

    def commit_paged_context(self, kv_branch: str, kv: tuple[jax.Array, jax.Array] | None = None) -> None:
        """Commit the pending forward of ``kv_branch``.

        A committing context needs ``kv=(k, v)``, each ``[num_layers, seq_len, H, D]`` (or
        ``[num_layers, 1, seq_len, H, D]``): they are written into the ring pages the commit
        evicts with one donated in-place write, then the cursor advances. A non-committing context
        is simply cleared and must not pass ``kv``. Call only after the forward succeeded.
        """
        adapter = self.adapter(kv_branch)
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
        new_committed = adapter.committed_frames + pending.num_frames
        if new_committed * layout.tokens_per_frame > layout.max_model_len:
            raise RuntimeError(
                f"AR-Diffusion branch {kv_branch!r} of session {self._session_id!r} would exceed max_model_len "
                f"({layout.max_model_len} tokens); reset the session"
            )
        owner = self._run_owner.get(adapter.local_index)
        if owner is not None and owner != kv_branch and self._adapters[owner].committed_frames > 0:
            raise RuntimeError(
                f"AR-Diffusion branches {owner!r} and {kv_branch!r} share local_index {adapter.local_index}: only one "
                "of them may hold committed KV on one worker (give them distinct local indices, or run each on its "
                "own worker)"
            )
        pages = block_pages(layout, self._run_base(adapter.local_index), adapter.committed_frames,
                            pending.num_frames, np)
        self._cache._write_block(pages, k, v)
        # Bookkeeping only after the device call returned.
        adapter._committed = new_committed
        if layout.reset_at_boundary:
            adapter._visible_start = new_committed
        self._run_owner[adapter.local_index] = kv_branch
        del self._pending[kv_branch]

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
        device = self._cache.device
        published = CrossAttentionKV(
            k=jax.device_put(jnp.stack(keys).astype(dtype), device),
            v=jax.device_put(jnp.stack(values).astype(dtype), device),
        )
        self._cross[(cache_name, kv_branch)] = published  # the one swap

    def get_cross_attention_kv(self, kv_branch: str, cache_name: str) -> CrossAttentionKV:
        """The published cache: ``CrossAttentionKV(k, v)``, each ``[L, N, Hc, D]``. RuntimeError if absent."""
        self.adapter(kv_branch)
        self._check_cross_name(cache_name)
        try:
            return self._cross[(cache_name, kv_branch)]
        except KeyError:
            raise RuntimeError(
                f"AR-Diffusion cross-attention cache {cache_name!r} of branch {kv_branch!r} (session "
                f"{self._session_id!r}) was read before it was populated"
            ) from None

    def is_cross_attention_populated(self, kv_branch: str, cache_name: str) -> bool:
        self.adapter(kv_branch)
        self._check_cross_name(cache_name)
        return (cache_name, kv_branch) in self._cross

    def clear_cross_attention(self) -> None:
        """Drop every cross-attention cache of the session (e.g. on a prompt change); keeps self-attention KV."""
        self._check_usable()
        self._cross = {}

    @property
    def cross_attention_bytes(self) -> int:
        """Bytes of the published cross-attention arrays of this session."""
        return sum(kv.k.nbytes + kv.v.nbytes for kv in self._cross.values())

    # -- lifecycle -----------------------------------------------------------------------------
    def reset(self, keep_cross_attention: Iterable[str] = ()) -> None:
        """Model-internal window reset: empty every branch, keep only the named cross caches.

        Installs fresh adapters (same request ids) and reopens a closed state (acquiring a
        slot; RuntimeError if none is free). KeyError for an unknown cache name, before any
        change.
        """
        if isinstance(keep_cross_attention, str):
            keep_cross_attention = (keep_cross_attention,)
        keep = tuple(keep_cross_attention)
        for name in keep:
            self._check_cross_name(name)
        self._check_binding()
        if self._closed:
            self._slot = self._cache._reopen(self)
            self._closed = False
        self._adapters = self._fresh_adapters()
        self._pending = {}
        self._run_owner = {}
        self._cross = {key: kv for key, kv in self._cross.items() if key[0] in keep}

    def close(self) -> None:
        """Release the slot and every cross-attention cache. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending = {}
        self._cross = {}
        self._run_owner = {}
        slot, self._slot = self._slot, None
        self._cache._release_slot(self, slot)

    # -- introspection -----------------------------------------------------------------------
    def describe(self) -> Mapping[str, Any]:
        """Host-side summary: slot, per-branch cursors, pending contexts, populated caches."""
        return {
            "session_id": self._session_id,
            "slot": self._slot,
            "closed": self._closed,
            "branches": {
                name: {"committed_frames": a.committed_frames, "visible_start_frame": a.visible_start_frame}
                for name, a in self._adapters.items()
            },
            "pending": {name: dataclasses.asdict(p) for name, p in self._pending.items()},
            "cross_attention": sorted(self._cross),
        }
