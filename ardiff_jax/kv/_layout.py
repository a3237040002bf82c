"""Static KV geometry (``KVLayout``) and the device pools (``KVPools``).

Pool layout: one K pool and one V pool, each ``[L, P, T, H, D]`` (layers stacked in
front, page = one latent frame of ``T`` tokens). Few large leaves keep dispatch cheap.

Every (session slot x worker-local branch) owns one *run* of ``sink + window`` pages:
``sink`` pages, then a ring of ``window`` pages. Run ``r`` starts at page
``r * (sink + window)``. Page id ``P`` (one past the end) is the null page: writes to it
are dropped (``mode="drop"``) and gathers of it return zeros (``mode="fill"``). Negative
ids are never used because they wrap even under ``mode="drop"``.

Storage dtype is a per-backend layout decision: XLA:CPU widens a bf16/f16 pool to f32
around every scatter, which makes a block write many times slower than the bytes it moves
(measured in ``benchmarks/bench_kv.py``), so on CPU 16-bit float pools are stored as
``uint16`` bit patterns and bitcast at the boundary (free). Accelerators store the logical
dtype directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax._checks import check_flag, check_non_negative_int, check_positive_int, is_integer

__all__ = ["KVLayout", "KVPools", "allocate_pools", "default_storage_dtype", "to_storage", "from_storage"]


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def default_storage_dtype(dtype: Any, platform: str) -> str:
    """Storage dtype for a logical KV dtype on a backend platform ("cpu", "gpu", "tpu")."""
    name = _dtype_name(dtype)
    if platform == "cpu" and name in ("bfloat16", "float16"):
        return "uint16"
    return name


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Static, hashable geometry of the paged pools: the static argument of every kernel.

    Integer fields are stored as Python ``int`` and ``reset_at_boundary`` as ``bool``: numpy
    scalars (``np.int64(2)``, ``np.bool_(True)``) are converted, so a layout built from numpy
    values is equal to, hashes like, and shares compiled programs with one built from Python
    values. ``bool`` is refused where an integer is expected.

    Attributes:
      num_layers: ``L``, self-attention layers.
      num_pages: ``P``, real pages in each pool (the null page is ``P``).
      tokens_per_frame: ``T``, tokens per page.
      num_kv_heads: ``H``.
      head_size: ``D``.
      sink_frames: ``K``, protected prefix frames per run.
      window_frames: ``W``, ring frames per run.
      frames_per_block: ``F``, frames a committing forward adds.
      scratch_pages: pages of scratch per branch: the largest
        ``current frames + ceil(extra tokens / T)`` one non-committing forward may carry.

    A session's length is not part of the layout: the ring stores a bounded window, and the
    optional cap on a branch's committed length is the spec's ``max_model_len``.
      reset_at_boundary: after each commit only the sink stays visible.
      dtype: logical KV dtype (name).
      storage_dtype: dtype of the pool arrays (name); ``uint16`` holds 16-bit float bits.
    """

    num_layers: int
    num_pages: int
    tokens_per_frame: int
    num_kv_heads: int
    head_size: int
    sink_frames: int
    window_frames: int
    frames_per_block: int
    scratch_pages: int
    reset_at_boundary: bool = False
    dtype: str = "float32"
    storage_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "storage_dtype", _dtype_name(self.storage_dtype))
        for field in ("num_layers", "num_pages", "tokens_per_frame", "num_kv_heads", "head_size", "window_frames",
                      "frames_per_block", "scratch_pages"):
            object.__setattr__(self, field, check_positive_int(f"KVLayout {field}", getattr(self, field)))
        object.__setattr__(self, "sink_frames", check_non_negative_int("KVLayout sink_frames", self.sink_frames))
        object.__setattr__(self, "reset_at_boundary",
                           check_flag("KVLayout reset_at_boundary", self.reset_at_boundary))
        if self.num_pages % self.run_pages:
            raise ValueError(
                f"KVLayout num_pages ({self.num_pages}) must be a multiple of sink_frames + window_frames "
                f"({self.run_pages})"
            )
        if self.frames_per_block > self.window_frames:
            raise ValueError(
                f"KVLayout frames_per_block ({self.frames_per_block}) must not exceed window_frames "
                f"({self.window_frames})"
            )
        if self.storage_dtype != self.dtype:
            logical, storage = jnp.dtype(self.dtype), jnp.dtype(self.storage_dtype)
            if logical.itemsize != storage.itemsize or storage.kind not in "ui":
                raise ValueError(
                    f"KVLayout storage_dtype {self.storage_dtype} must be {self.dtype} or an unsigned integer of "
                    f"the same width to hold its bits"
                )

    # -- derived geometry -----------------------------------------------------------------
    @property
    def run_pages(self) -> int:
        """Pages owned by one (slot, local branch): sink pages then the ring."""
        return self.sink_frames + self.window_frames

    @property
    def num_runs(self) -> int:
        return self.num_pages // self.run_pages

    @property
    def null_page(self) -> int:
        return self.num_pages

    @property
    def max_visible_frames(self) -> int:
        """Video frames one forward may read, current frames included."""
        return self.run_pages

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_pages, self.tokens_per_frame, self.num_kv_heads, self.head_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return 2 * self.num_layers * self.tokens_per_frame * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.storage_dtype).itemsize

    @property
    def pool_bytes(self) -> int:
        """Bytes of both pools."""
        return self.num_pages * self.page_bytes

    def frames_in(self, seq_len: int) -> int:
        """Whole frames in ``seq_len`` current tokens; ValueError unless frame-aligned and within the window."""
        if seq_len <= 0 or seq_len % self.tokens_per_frame:
            raise ValueError(
                f"AR-Diffusion expects frame-aligned seq_len: {seq_len} is not a positive multiple of "
                f"tokens_per_frame ({self.tokens_per_frame})"
            )
        num_frames = seq_len // self.tokens_per_frame
        if num_frames > self.window_frames:
            raise ValueError(
                f"AR-Diffusion current block of {num_frames} frames exceeds window_frames ({self.window_frames})"
            )
        return num_frames

    def run_base(self, run_index: int) -> int:
        if not 0 <= run_index < self.num_runs:
            raise IndexError(f"run index {run_index} out of range [0, {self.num_runs})")
        return run_index * self.run_pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPools:
    """The two preallocated pools, threaded through jitted functions.

    Attributes:
      k: keys of every layer and page.
      v: values of every layer and page.

    Shapes:
      k, v: storage[L, P, T, H, D]
    """

    k: jax.Array
    v: jax.Array

    def is_deleted(self) -> bool:
        """True when either pool buffer was donated or deleted (concrete arrays only)."""
        return _is_deleted(self.k) or _is_deleted(self.v)  # no generator: checked on every engine tick

    def delete(self) -> None:
        """Free both device buffers now (notebooks: release memory without a restart)."""
        for x in (self.k, self.v):
            if not _is_deleted(x):
                x.delete()


def checked_layer(layout: KVLayout, layer: Any) -> Any:
    """``layer`` checked against ``layout.num_layers`` and normalised into ``[0, L)``.

    A concrete layer (Python or numpy integer, or a concrete jax / numpy integer scalar) is
    range-checked like a Python sequence index (negative counts from the end; IndexError
    otherwise) and returned as ``np.int32``. A traced layer (inside a ``lax.scan`` over the
    layers) cannot be range-checked on the host: it must be an integer scalar, negative
    values are wrapped once, and an index outside ``[-L, L)`` reads a clamped layer. Booleans
    and non-integers are a TypeError.
    """
    num_layers = layout.num_layers
    if isinstance(layer, jax.core.Tracer):
        if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise TypeError(f"layer must be an integer scalar, got a traced {layer.dtype}{list(layer.shape)}")
        return jnp.where(layer < 0, layer + num_layers, layer).astype(jnp.int32)
    concrete_array = (isinstance(layer, (jax.Array, np.ndarray)) and layer.shape == ()
                      and jnp.issubdtype(layer.dtype, jnp.integer))
    if not (is_integer(layer) or concrete_array):
        raise TypeError(f"layer must be an integer (Python, numpy or a jax integer scalar), got {layer!r}")
    value = int(layer)
    if not -num_layers <= value < num_layers:
        raise IndexError(f"layer {value} out of range for {num_layers} layers")
    return np.int32(value % num_layers)


def _is_deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()


def allocate_pools(layout: KVLayout, device: jax.Device | None = None) -> KVPools:
    """Allocate zeroed pools once.

    ``jnp.zeros``, not ``jnp.empty``: newer jax versions may hand back uninitialised memory,
    and a pool's contents must not depend on what the device held before.

    Shapes:
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    device = device if device is not None else jax.devices()[0]
    k = jnp.zeros(layout.pool_shape, layout.storage_dtype, device=device)
    v = jnp.zeros(layout.pool_shape, layout.storage_dtype, device=device)
    return KVPools(k=k, v=v)


def to_storage(layout: KVLayout, x: jax.Array) -> jax.Array:
    """Cast ``x`` to the logical dtype and reinterpret it as the storage dtype.

    Shapes:
      x: float[...]
      returns: storage[...]
    """
    x = x.astype(layout.dtype)
    if layout.storage_dtype != layout.dtype:
        x = jax.lax.bitcast_convert_type(x, jnp.dtype(layout.storage_dtype))
    return x


def from_storage(layout: KVLayout, x: jax.Array) -> jax.Array:
    """Reinterpret stored pages as the logical dtype (a free bitcast).

    Shapes:
      x: storage[...]
      returns: dtype[...]
    """
    if layout.storage_dtype != layout.dtype:
        x = jax.lax.bitcast_convert_type(x, jnp.dtype(layout.dtype))
    return x


