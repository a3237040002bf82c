"""The ``"cudnn"`` attention backend: the visible window in key order, one fused attention call.

:func:`ordered_window_attention` reads the visible history *in key order* (sink frames, then
the newest history frames, oldest first: :func:`~ardiff_jax.kv.visible_table`), appends the
current block and the extra tokens right after the last real history key, and pads the
sequence with zeros to its static maximum length. The real keys then form a prefix of known
length, which :func:`jax.nn.dot_product_attention` takes as ``key_value_seq_lengths``:
a padding length instead of a boolean mask, which cuDNN's flash attention kernel applies
without materialising a mask. Shapes depend only on the layout and the number of current frames, never on the
fill level, so filling, wrapping and resetting a window reuse one program.

Only visible pages are read (invisible table entries name the null page, which reads as
zeros), so whatever an invisible page holds, even NaN, contributes nothing; padded keys
and values are zeros and lie past the key length.

With ``implementation="xla"`` the same code runs anywhere: it is the CPU correctness path
of the backend (XLA materialises the float32 score matrix, so it is meant for test sizes,
not for long windows on CPU). :func:`cudnn_paged_attention` is the registered backend:
cuDNN flash attention on a GPU, refused with a ValueError naming the reason where cuDNN
cannot run the layout (:func:`cudnn_support`), so a forced ``"cudnn"`` never silently
runs something else. :func:`select_attention_backend` is the automatic choice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ardiff_jax.kv._attention import _default_scale, _prepare
from ardiff_jax.kv._backends import DEFAULT_BACKEND, register_attention_backend
from ardiff_jax.kv._layout import KVLayout, KVPools, checked_layer
from ardiff_jax.kv._ops import gather_pages
from ardiff_jax.kv._tables import visible_table

__all__ = ["cudnn_paged_attention", "cudnn_support", "ordered_window_attention", "select_attention_backend"]

#: ``implementation`` values of :func:`ordered_window_attention` (those of ``jax.nn.dot_product_attention``).
IMPLEMENTATIONS = ("xla", "cudnn")

#: dtypes cuDNN flash attention computes in.
CUDNN_DTYPES = ("bfloat16", "float16")

#: Largest head size every GPU generation's cuDNN flash attention supports (Hopper goes further).
CUDNN_MAX_HEAD_SIZE = 128


def _static_scale(layout: KVLayout, q: jax.Array, scale: Any) -> tuple[jax.Array, float]:
    """``(q, scale)`` with the scale a Python float, as ``dot_product_attention`` needs it.

    cuDNN takes the scale as a compile-time attribute, but under ``jit`` (the backend
    registry jits every backend) an explicit scale arrives traced. A traced scale is folded
    into the queries as ``scale / default`` against the static default ``1 / sqrt(D)``: for
    the usual ``scale = 1 / sqrt(D)`` both are the same float32, the factor is exactly 1 and
    the queries pass unchanged.
    """
    scale = _default_scale(layout, scale)
    if not isinstance(scale, jax.core.Tracer):
        return q, float(scale)
    default = float(_default_scale(layout, None))
    factor = jnp.asarray(scale, jnp.float32) / jnp.float32(default)
    return (q.astype(jnp.float32) * factor).astype(q.dtype), default


def ordered_window_attention(
    layout: KVLayout,
    pools: KVPools,
    cursor: jax.Array,  # (run_base, committed, visible_start, *page table)
    layer: jax.Array | int,  # may be traced; a concrete layer is range-checked
    q: jax.Array,
    k: jax.Array,  # the current block
    v: jax.Array,
    extra_k: jax.Array | None = None,  # action/state tokens: attended to, never cached
    extra_v: jax.Array | None = None,
    *,
    scale: Any = None,  # Python float or f32[]; default 1/sqrt(D)
    implementation: str = "xla",  # static: "xla" (any platform) or "cudnn" (GPU)
) -> jax.Array:
    """Attention over ``[sink][history][current][extra]`` read in key order, padded by length.

    One call to :func:`jax.nn.dot_product_attention` over ``(K+W)*T + E`` key slots whose
    first ``V*T + f*T + E`` are the real keys (``V`` visible history frames, at most
    ``K + W - f``); the rest are zeros past ``key_value_seq_lengths``. ``q`` is cast to the
    layout's dtype as in :func:`~ardiff_jax.kv.paged_attention`; query head ``h`` reads KV
    head ``h // (Hq // H)``. Returns ``q``'s shape (batch axis included) and dtype. Reads the
    pools, never writes them. ``implementation="xla"`` is the CPU correctness path (it
    materialises the scores); ``"cudnn"`` needs a GPU (:func:`cudnn_support`).

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
      layer: i32[]
      q: float[S, Hq, D]
      k, v: float[f*T, H, D]
      extra_k, extra_v: float[E, H, D]
      scale: f32[]
      returns: q.dtype[S, Hq, D]
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    layer = checked_layer(layout, layer)
    q3, had_batch, cur_k, cur_v, num_frames = _prepare(layout, q, k, v, extra_k, extra_v)
    tokens = layout.tokens_per_frame
    # At most K + W - f history frames are visible beside f current frames, and the table
    # lists them first: its last f entries are always padding and are not read at all.
    hist_frames = layout.run_pages - num_frames
    pages, frames = visible_table(layout, cursor, num_frames, jnp)
    pages = pages[:hist_frames]
    num_hist_tokens = jnp.sum(frames >= 0, dtype=jnp.int32) * tokens

    tail = cur_k.shape[0]  # f*T + E: current block then extras; (K+W)*T + E key slots in all

    def ordered(cur: jax.Array, hist: jax.Array | None) -> jax.Array:
        padding = jnp.zeros((tail,) + cur.shape[1:], cur.dtype)
        slots = padding if hist is None else jnp.concatenate([hist, padding])
        # The current block and the extras start right after the last visible history key;
        # what they overwrite and what follows them are null-page zeros.
        return jax.lax.dynamic_update_slice(slots, cur, (num_hist_tokens, 0, 0))

    if hist_frames:
        hist_k, hist_v = gather_pages(layout, pools, layer, pages)
    else:  # no sink and a block as long as the window: no history is ever visible
        hist_k = hist_v = None
    keys, values = ordered(cur_k, hist_k), ordered(cur_v, hist_v)
    kv_len = (num_hist_tokens + tail).reshape(1)

    query, static_scale = _static_scale(layout, q3.astype(layout.dtype), scale)
    out = jax.nn.dot_product_attention(
        query[None], keys[None], values[None], scale=static_scale, key_value_seq_lengths=kv_len,
        implementation=implementation,
    )[0].astype(q.dtype)
    return out[None] if had_batch else out


def cudnn_support(layout: KVLayout, q_dtype: Any = None, platform: str | None = None) -> tuple[bool, str]:
    """Whether cuDNN flash attention can run attention of this layout, and why (not).

    Requirements: a GPU platform (``platform``, default ``jax.default_backend()``); a
    logical KV dtype (and ``q_dtype``, when given) of bfloat16 or float16; a head size that
    is a multiple of 8 and at most 128. Returns ``(True, description)`` or
    ``(False, every unmet requirement)``.
    """
    platform = jax.default_backend() if platform is None else platform
    problems = []
    if platform not in ("gpu", "cuda"):
        problems.append(f"platform is {platform!r}, cuDNN flash attention needs 'gpu'")
    if layout.dtype not in CUDNN_DTYPES:
        problems.append(f"KV dtype {layout.dtype} is not one of {', '.join(CUDNN_DTYPES)}")
    if q_dtype is not None and jnp.dtype(q_dtype).name not in CUDNN_DTYPES:
        problems.append(f"query dtype {jnp.dtype(q_dtype).name} is not one of {', '.join(CUDNN_DTYPES)}")
    if layout.head_size % 8:
        problems.append(f"head size {layout.head_size} is not a multiple of 8")
    if layout.head_size > CUDNN_MAX_HEAD_SIZE:
        problems.append(f"head size {layout.head_size} exceeds {CUDNN_MAX_HEAD_SIZE}")
    if problems:
        return False, "; ".join(problems)
    return True, f"cuDNN flash attention runs {layout.dtype} KV with head size {layout.head_size} on {platform!r}"


def cudnn_paged_attention(
    layout: KVLayout,
    pools: KVPools,
    cursor: jax.Array,
    layer: jax.Array | int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    extra_k: jax.Array | None = None,
    extra_v: jax.Array | None = None,
    *,
    scale: Any = None,
) -> jax.Array:
    """The ``"cudnn"`` backend: :func:`ordered_window_attention` with ``implementation="cudnn"``.

    Checks :func:`cudnn_support` for the layout first (at trace time) and raises ValueError
    naming the reason where cuDNN cannot run it, instead of running something else. The
    query dtype is not part of the check: queries are cast to the KV dtype, as in every
    backend.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
      layer: i32[]
      q: float[S, Hq, D]
      k, v: float[f*T, H, D]
      extra_k, extra_v: float[E, H, D]
      scale: f32[]
      returns: q.dtype[S, Hq, D]
    """
    supported, reason = cudnn_support(layout)
    if not supported:
        raise ValueError(f"attention backend 'cudnn' cannot run this layout: {reason}")
    return ordered_window_attention(layout, pools, cursor, layer, q, k, v, extra_k, extra_v, scale=scale,
                                    implementation="cudnn")


def select_attention_backend(layout: KVLayout, platform: str | None = None, q_dtype: Any = None
                             ) -> tuple[str, str]:
    """The automatic backend choice: ``("cudnn", why)`` where cuDNN can run the layout, else ``("xla", why)``.

    ``platform`` defaults to ``jax.default_backend()``; ``q_dtype`` (optional) is the model's
    query dtype. The reason is meant for a log line saying which backend runs and why.
    """
    supported, reason = cudnn_support(layout, q_dtype=q_dtype, platform=platform)
    if supported:
        return "cudnn", reason
    return DEFAULT_BACKEND, f"cuDNN flash attention unavailable ({reason}); using the XLA backend"


register_attention_backend("cudnn", cudnn_paged_attention)
