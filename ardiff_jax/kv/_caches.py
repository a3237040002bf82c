"""``PagedKVCaches``: the per-forward, per-branch view a model passes into its own jit."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from ardiff_jax.kv._attention import check_attention_inputs, ref_paged_attention
from ardiff_jax.kv._backends import attention_backend, check_attention_backend
from ardiff_jax.kv._layout import KVLayout, KVPools, checked_layer
from ardiff_jax.kv._sharding import KVSharding, sharded_attention
from ardiff_jax.kv._tables import visible_table

__all__ = ["PagedKVCaches", "LayerKVCache"]

_ref_paged_attention_jit = jax.jit(ref_paged_attention, static_argnums=0)

#: Float32 score bytes of one row above which a batched view (``jax.vmap`` over sessions)
#: attends its rows one after another (``lax.map``) instead of as one vmapped program. A
#: large row fills the machine by itself, and the vmapped form (a gather of every row's pages,
#: dots with a batch axis) measured 1.0x the unbatched call per row where the loop measured
#: 0.8x (medium geometry, CPU); small rows gain from one fused program.
ROWWISE_SCORE_BYTES = 8 * 2**20


@functools.cache
def _attention_program(backend_name: str, layout: KVLayout, has_extra: bool) -> Any:
    """``attend(pools, cursor, layer, scale, q, k, v, *extras)`` with a batching rule for batched views.

    Unbatched it is the backend itself. Under ``jax.vmap`` over sessions (pools shared), rows
    whose scores exceed :data:`ROWWISE_SCORE_BYTES` run one after another under ``lax.map``
    (each exactly the unbatched program); smaller rows run vmapped.
    """
    def plain(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array, k: jax.Array,
              v: jax.Array, *extras: jax.Array) -> jax.Array:
        extra_k, extra_v = extras if has_extra else (None, None)
        backend = attention_backend(backend_name)  # looked up when traced: a re-registered name takes effect
        return backend(layout, pools, cursor, layer, q, k, v, extra_k, extra_v, scale=scale)

    @custom_vmap
    def attend(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array, k: jax.Array,
               v: jax.Array, *extras: jax.Array) -> jax.Array:
        return plain(pools, cursor, layer, scale, q, k, v, *extras)

    @attend.def_vmap
    def attend_batched(axis_size: int, in_batched: list[Any], *args: Any) -> tuple[jax.Array, bool]:
        flags = [any(jax.tree_util.tree_leaves(b)) for b in in_batched]
        q = args[4]
        row_q = q.shape[1:] if flags[4] else q.shape
        row_bytes = 4 * row_q[-3] * row_q[-2] * (layout.run_pages * layout.tokens_per_frame)
        if flags[0] or row_bytes < ROWWISE_SCORE_BYTES:  # batched pools (not a runtime view) or small rows
            in_axes = [jax.tree_util.tree_map(lambda b: 0 if b else None, b) for b in in_batched]
            return jax.vmap(plain, in_axes=in_axes)(*args), True
        rows = [x for x, batched in zip(args, flags) if batched]

        def one_row(xs: list[Any]) -> jax.Array:
            it = iter(xs)
            return plain(*[next(it) if batched else x for x, batched in zip(args, flags)])

        return jax.lax.map(one_row, rows), True

    return attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCaches:
    """Paged self-attention KV of one session branch for one forward, as a pytree.

    ``len(caches) == num_layers``; ``caches[i]`` is a per-layer view. The pytree carries the
    pool arrays (read-only here: the runtime's donated commit is their only writer), the
    branch cursor and, as static metadata, the layout, the current block length and the
    attention backend's name. Values change between forwards, sessions and fill levels; the
    treedef does not, so one compiled model serves all of them. A different backend is a
    different treedef (one compilation per backend).

    Attributes:
      pools: the runtime's KV pools at the time of ``get_kv_caches``.
      cursor: (first page of the branch's run, committed frames, first visible non-sink frame)
        followed by the run's page table (:func:`~ardiff_jax.kv.make_table_cursor`).
      layout: static pool geometry.
      seq_len: tokens of the current block (``f*T``) this view was prepared for.
      backend: the registered attention backend :meth:`attend` calls (``"xla"`` by default;
        see :func:`~ardiff_jax.kv.register_attention_backend`). ValueError at construction
        if it is not registered.
      sharding: the mesh the pools are split over (:class:`~ardiff_jax.kv.KVSharding`), or
        ``None`` for pools on one device. With a mesh, :meth:`attend` runs the backend per
        shard (:func:`~ardiff_jax.kv.sharded_attention`): no pool is gathered.

    A *batched* view (:meth:`ardiff_jax.runtime.ARDiffusionKVBatch.get_kv_caches`, one
    forward for many sessions) carries one cursor row per session, ``i32[B, 3 + K + W]``, over the
    same pools. It is attended under ``jax.vmap`` with ``in_axes=caches.vmap_axes()``: the
    pools are shared, each row reads its own session's run with its own fill level, and a
    padded row's cursor (committed 0) makes every page invisible, so it reads nothing.
    Calling :meth:`attend` on a batched view outside ``vmap`` is a TypeError.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
    """

    pools: KVPools
    cursor: jax.Array
    layout: KVLayout = dataclasses.field(metadata=dict(static=True))
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(default="xla", metadata=dict(static=True))
    sharding: KVSharding | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        check_attention_backend(self.backend)
        if self.sharding is not None:
            if not isinstance(self.sharding, KVSharding):
                raise TypeError(f"PagedKVCaches sharding must be a KVSharding or None, got {self.sharding!r}")
            self.sharding.check_layout(self.layout)

    # -- sequence protocol ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.layout.num_layers

    def __getitem__(self, layer: int) -> LayerKVCache:
        if isinstance(layer, jax.core.Tracer):
            raise TypeError("PagedKVCaches indices must be concrete integers; use attend(layer, ...) for traced layers")
        return LayerKVCache(caches=self, layer=int(checked_layer(self.layout, layer)))

    def __iter__(self) -> Iterator[LayerKVCache]:
        return (LayerKVCache(caches=self, layer=i) for i in range(len(self)))

    @property
    def num_current_frames(self) -> int:
        return self.seq_len // self.layout.tokens_per_frame

    @property
    def batch_size(self) -> int | None:
        """Rows of a batched view (cursor ``i32[B, 3 + K + W]``); ``None`` for a one-branch view."""
        return int(self.cursor.shape[0]) if getattr(self.cursor, "ndim", 1) == 2 else None

    def vmap_axes(self) -> PagedKVCaches:
        """``in_axes`` of this view for ``jax.vmap`` over a batch: pools shared, one cursor row per element."""
        return dataclasses.replace(self, pools=None, cursor=0)

    def _check_call(self, layer: Any, q: jax.Array, k: jax.Array, v: jax.Array, extra_k: jax.Array | None,
                    extra_v: jax.Array | None) -> Any:
        """Everything a backend may rely on (see ``AttentionBackend``); returns the normalised layer."""
        if self.pools.is_deleted():
            raise RuntimeError(
                "PagedKVCaches refers to KV pools that were replaced by a later commit_paged_context (or deleted); "
                "call state.get_kv_caches(...) again for a fresh view"
            )
        if getattr(self.cursor, "ndim", 1) != 1:
            raise TypeError(
                f"this PagedKVCaches is a batched view (cursor shape {tuple(self.cursor.shape)}): attend under "
                "jax.vmap(..., in_axes=caches.vmap_axes()), one session per element")
        layer = checked_layer(self.layout, layer)
        check_attention_inputs(self.layout, q, k, v, extra_k, extra_v)
        length = k.shape[-3]
        if length != self.seq_len:
            raise ValueError(
                f"current k/v have {length} tokens but this context was prepared for seq_len={self.seq_len}"
            )
        return layer

    # -- attention ----------------------------------------------------------------------------
    def attend(
        self,
        layer: int | jax.Array,  # may be traced (e.g. inside a scan over layers)
        q: jax.Array,
        k: jax.Array,  # the current block: seq_len == f*T tokens
        v: jax.Array,
        *,
        extra_k: jax.Array | None = None,  # action/state tokens: attended to, never cached
        extra_v: jax.Array | None = None,
        scale: Any = None,  # Python float or f32[]; default 1/sqrt(D)
    ) -> jax.Array:
        """Attention of ``q`` over ``[sink][newest history][current k, v][extra]`` via the backend.

        Returns ``q``'s shape and dtype. Non-causal: every query sees every visible key. Each
        array may carry a leading batch axis of size 1. Checked before the backend runs: a
        concrete ``layer`` (Python, numpy or concrete jax integer) must lie in ``[-L, L)``
        (IndexError); a traced one (a scan over layers) must be an integer scalar and cannot
        be range-checked (out of range, it reads a clamped layer); a non-integer layer is a
        TypeError; non-floating arrays and wrong shapes are a ValueError naming the argument.
        A concrete jax layer is read back to the host for its check: pass Python ints on hot
        eager paths.

        Shapes:
          layer: i32[]
          q: float[S, Hq, D]
          k, v: float[f*T, H, D]
          extra_k, extra_v: float[E, H, D]
          scale: f32[]
          returns: q.dtype[S, Hq, D]
        """
        layer = self._check_call(layer, q, k, v, extra_k, extra_v)
        if self.sharding is not None:
            return sharded_attention(attention_backend(self.backend), self.layout, self.sharding, self.pools,
                                     self.cursor, layer, q, k, v, extra_k, extra_v, scale=scale)
        scale = jnp.asarray(1.0 / math.sqrt(self.layout.head_size) if scale is None else scale, jnp.float32)
        extras = () if extra_k is None else (extra_k, extra_v)
        return _attention_program(self.backend, self.layout, extra_k is not None)(
            self.pools, self.cursor, layer, scale, q, k, v, *extras)

    def ref_attend(
        self, layer: int | jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *,
        extra_k: jax.Array | None = None, extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        """Dense float32 reference of :meth:`attend` (ordered gather + concat + softmax), same checks.

        Shapes:
          layer: i32[]
          q: float[S, Hq, D]
          k, v: float[f*T, H, D]
          extra_k, extra_v: float[E, H, D]
          scale: f32[]
          returns: q.dtype[S, Hq, D]
        """
        layer = self._check_call(layer, q, k, v, extra_k, extra_v)
        return _ref_paged_attention_jit(
            self.layout, self.pools, self.cursor, layer, q, k, v, extra_k, extra_v, scale=scale
        )

    def visible_frames(self) -> np.ndarray:
        """Absolute indices of the visible history frames, in key order (host numpy).

        Useful for position-dependent models (e.g. relative RoPE at read time). Reads the
        concrete cursor, so it cannot run inside ``jax.jit``.

        Shapes:
          returns: i32[V]
        """
        _, frames = visible_table(self.layout, np.asarray(self.cursor), self.num_current_frames, np)
        return frames[frames >= 0]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["caches"], meta_fields=["layer"])
@dataclasses.dataclass(frozen=True)
class LayerKVCache:
    """One layer of a :class:`PagedKVCaches` (``caches[i]``); ``layer`` is a static Python int."""

    caches: PagedKVCaches
    layer: int

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
        extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        """See :meth:`PagedKVCaches.attend`.

        Shapes:
          q: float[S, Hq, D]
          k, v: float[f*T, H, D]
          extra_k, extra_v: float[E, H, D]
          scale: f32[]
          returns: q.dtype[S, Hq, D]
        """
        return self.caches.attend(self.layer, q, k, v, extra_k=extra_k, extra_v=extra_v, scale=scale)

    def ref_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
        extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        """See :meth:`PagedKVCaches.ref_attend`.

        Shapes:
          q: float[S, Hq, D]
          k, v: float[f*T, H, D]
          extra_k, extra_v: float[E, H, D]
          scale: f32[]
          returns: q.dtype[S, Hq, D]
        """
        return self.caches.ref_attend(self.layer, q, k, v, extra_k=extra_k, extra_v=extra_v, scale=scale)
