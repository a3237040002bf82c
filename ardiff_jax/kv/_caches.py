"""``PagedKVCaches``: the per-forward, per-branch view a model passes into its own jit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from ardiff_jax.kv._attention import ref_paged_attention
from ardiff_jax.kv._backends import attention_backend
from ardiff_jax.kv._layout import KVLayout, KVPools
from ardiff_jax.kv._tables import visible_table

__all__ = ["PagedKVCaches", "LayerKVCache"]

_ref_paged_attention_jit = jax.jit(ref_paged_attention, static_argnums=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCaches:
    """Paged self-attention KV of one session branch for one forward, as a pytree.

    ``len(caches) == num_layers``; ``caches[i]`` is a per-layer view. The pytree carries the
    pool arrays (read-only here: the runtime's donated commit is their only writer), the
    branch cursor as ``i32[3]`` values and, as static metadata, the layout, the current
    block length and the attention backend's name. Values change between forwards, sessions and fill levels; the treedef
    does not, so one compiled model serves all of them.

    Attributes:
      pools: the runtime's KV pools at the time of ``get_kv_caches``.
      cursor: ``i32[3]`` = (first page of the branch's run, committed frames,
        first visible non-sink frame).
      layout: static pool geometry.
      seq_len: tokens of the current block this view was prepared for.
      backend: the registered attention backend :meth:`attend` calls (``"xla"`` by default;
        see :func:`~ardiff_jax.kv.register_attention_backend`).
    """

    pools: KVPools
    cursor: jax.Array
    layout: KVLayout = dataclasses.field(metadata=dict(static=True))
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(default="xla", metadata=dict(static=True))

    # -- sequence protocol ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.layout.num_layers

    def __getitem__(self, layer: int) -> LayerKVCache:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"PagedKVCaches indices must be integers, got {layer!r}; use attend(layer, ...) for traced layers")
        index = self._check_layer(int(layer))
        return LayerKVCache(caches=self, layer=index)

    def __iter__(self) -> Iterator[LayerKVCache]:
        return (LayerKVCache(caches=self, layer=i) for i in range(len(self)))

    @property
    def num_current_frames(self) -> int:
        return self.seq_len // self.layout.tokens_per_frame

    def _check_layer(self, layer: int) -> int:
        num_layers = self.layout.num_layers
        if not -num_layers <= layer < num_layers:
            raise IndexError(f"layer {layer} out of range for {num_layers} layers")
        return layer % num_layers

    def _check_call(self, layer: Any, k: jax.Array) -> Any:
        if self.pools.is_deleted():
            raise RuntimeError(
                "PagedKVCaches refers to KV pools that were replaced by a later commit_paged_context (or deleted); "
                "call state.get_kv_caches(...) again for a fresh view"
            )
        length = k.shape[-3]
        if length != self.seq_len:
            raise ValueError(
                f"current k/v have {length} tokens but this context was prepared for seq_len={self.seq_len}"
            )
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            return np.int32(self._check_layer(int(layer)))
        return layer

    # -- attention ----------------------------------------------------------------------------
    def attend(
        self,
        layer: int | jax.Array,  # i32[]: may be traced (e.g. inside a scan over layers)
        q: jax.Array,  # [S, Hq, D] or [1, S, Hq, D]
        k: jax.Array,  # [seq_len, H, D] or [1, seq_len, H, D]: the current block
        v: jax.Array,
        *,
        extra_k: jax.Array | None = None,  # [E, H, D] or [1, E, H, D]: action/state tokens
        extra_v: jax.Array | None = None,
        scale: Any = None,
    ) -> jax.Array:
        """Attention of ``q`` over ``[sink][newest history][current k, v][extra]``.

        Returns ``q``'s shape and dtype. Non-causal: every query sees every visible key.
        """
        layer = self._check_call(layer, k)
        return attention_backend(self.backend)(
            self.layout, self.pools, self.cursor, layer, q, k, v, extra_k, extra_v, scale=scale
        )

    def ref_attend(
        self, layer: int | jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *,
        extra_k: jax.Array | None = None, extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        """Dense float32 reference of :meth:`attend` (ordered gather + concat + softmax)."""
        layer = self._check_call(layer, k)
        return _ref_paged_attention_jit(
            self.layout, self.pools, self.cursor, layer, q, k, v, extra_k, extra_v, scale=scale
        )

    def visible_frames(self) -> np.ndarray:
        """Absolute indices of the visible history frames, in key order (host numpy).

        Useful for position-dependent models (e.g. relative RoPE at read time).
        """
        _, frames = visible_table(self.layout, np.asarray(self.cursor), self.num_current_frames, np)
        return frames[frames >= 0]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["caches"], meta_fields=["layer"])
@dataclasses.dataclass(frozen=True)
class LayerKVCache:
    """One layer of a :class:`PagedKVCaches` (``caches[i]``)."""

    caches: PagedKVCaches
    layer: int

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
        extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        """See :meth:`PagedKVCaches.attend`."""
        return self.caches.attend(self.layer, q, k, v, extra_k=extra_k, extra_v=extra_v, scale=scale)

    def ref_attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, extra_k: jax.Array | None = None,
        extra_v: jax.Array | None = None, scale: Any = None,
    ) -> jax.Array:
        return self.caches.ref_attend(self.layer, q, k, v, extra_k=extra_k, extra_v=extra_v, scale=scale)
