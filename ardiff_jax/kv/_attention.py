"""Non-causal attention over a paged session history, plus its dense reference.

The key sequence of one forward is ``[sink frames][newest history frames][current block]
[extra tokens]`` (``docs/reference_behaviour.md``, "Visible window"): history comes from
the pools, the current block and the extra (action/state register) tokens come from the
arguments, so a non-committing forward writes nothing.

Fast path (:func:`paged_attention`): gather only the pages that can be visible
(:func:`read_visible_history`: at most ``sink + window - f`` history frames are, so the
first ``K + W - f`` entries of the ordered visible table), append the current block and
the extras, and run one masked softmax over those keys. Once the window is full every
gathered key is visible, so the cost follows the visible keys: it is dense attention over
them plus a mask (``benchmarks/bench_batch.py`` and ``bench_kv`` measure it next to
``jax.nn.dot_product_attention``). Entries past the visible frames (a window still
filling) are the null page: they read as zeros and their scores are masked, so no page
that is not visible (a previous owner's KV, even NaN) is ever read. The same code runs
under ``jax.vmap`` over a batch of cursors (a batched tick): each row gathers its own
session's pages.

Dense reference (:func:`ref_paged_attention`): gather the visible pages in reference
order, concatenate ``[history][current][extra]`` and run textbook softmax attention in
float32 (:func:`ref_attention`). Tests compare the two.

Query heads ``Hq`` must be a multiple of the KV heads ``H``; query head ``h`` reads KV
head ``h // (Hq // H)``, as ``jax.nn.dot_product_attention`` groups heads. ``q``, ``k``,
``v`` and the extras may each carry a leading batch axis of size 1; the output keeps
``q``'s.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ardiff_jax.kv._layout import KVLayout, KVPools, checked_layer
from ardiff_jax.kv._ops import gather_pages
from ardiff_jax.kv._tables import visible_table

__all__ = ["paged_attention", "read_visible_history", "ref_attention", "ref_paged_attention"]


def _drop_batch(name: str, x: jax.Array) -> tuple[jax.Array, bool]:
    """Accept ``[N, H, D]`` or ``[1, N, H, D]``; return the 3-d array and whether it had a batch."""
    if x.ndim == 4:
        if x.shape[0] != 1:
            raise ValueError(f"{name} must have batch size 1, got shape {tuple(x.shape)}")
        return x[0], True
    if x.ndim != 3:
        raise ValueError(f"{name} must be [N, H, D] or [1, N, H, D], got shape {tuple(x.shape)}")
    return x, False


def _check_floating(name: str, x: jax.Array) -> None:
    # An integer query would come back truncated to integers; integer K/V would be cast silently.
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.dtype(x.dtype).name}")


def _check_kv(layout: KVLayout, name: str, x: jax.Array) -> jax.Array:
    _check_floating(name, x)
    x3, _ = _drop_batch(name, x)
    if x3.shape[1:] != (layout.num_kv_heads, layout.head_size):
        raise ValueError(
            f"{name} must have {layout.num_kv_heads} KV heads of size {layout.head_size}, got shape {tuple(x.shape)}"
        )
    return x3


def check_attention_inputs(
    layout: KVLayout, q: jax.Array, k: jax.Array, v: jax.Array, extra_k: jax.Array | None,
    extra_v: jax.Array | None,
) -> int:
    """Validate the arrays of one attention call (shapes and dtypes only: runs at trace time).

    Returns the number of current frames ``f``. ValueError names the offending argument;
    RuntimeError when the extra tokens alone exceed the scratch pages.
    """
    _check_floating("q", q)
    q3, _ = _drop_batch("q", q)
    if q3.shape[-1] != layout.head_size:
        raise ValueError(f"q head size must be {layout.head_size}, got shape {tuple(q.shape)}")
    if q3.shape[1] % layout.num_kv_heads:
        raise ValueError(
            f"q heads ({q3.shape[1]}) must be a multiple of the KV heads ({layout.num_kv_heads})"
        )
    k3 = _check_kv(layout, "k", k)
    v3 = _check_kv(layout, "v", v)
    if k3.shape != v3.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    num_frames = layout.frames_in(k3.shape[0])
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v must be given together")
    num_extra = 0
    if extra_k is not None:
        ek = _check_kv(layout, "extra_k", extra_k)
        ev = _check_kv(layout, "extra_v", extra_v)
        if ek.shape != ev.shape:
            raise ValueError(f"extra_k and extra_v shapes differ: {tuple(ek.shape)} vs {tuple(ev.shape)}")
        num_extra = ek.shape[0]
    # Scratch accounting (docs/reference_behaviour.md, "Scratch"): extra tokens always use scratch
    # from offset 0 of a committing forward, so they must fit it by themselves. Whether the
    # current frames use scratch too depends on commit_current, which one compiled program
    # serving both kinds of forward cannot know: the runtime checks that part on the host
    # (ARDiffusionKVState.get_kv_caches).
    extra_pages = -(-num_extra // layout.tokens_per_frame)
    if extra_pages > layout.scratch_pages:
        raise RuntimeError(
            f"AR-Diffusion scratch blocks exhausted: {num_extra} extra tokens ({extra_pages} pages) exceed "
            f"{layout.scratch_pages} scratch pages per branch; declare max_scratch_tokens_per_branch in the spec "
            "or raise AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH"
        )
    return num_frames


def _prepare(
    layout: KVLayout, q: jax.Array, k: jax.Array, v: jax.Array, extra_k: jax.Array | None,
    extra_v: jax.Array | None,
) -> tuple[jax.Array, bool, jax.Array, jax.Array, int]:
    """Validate, drop the batch axes and merge current + extra K/V in the logical dtype."""
    num_frames = check_attention_inputs(layout, q, k, v, extra_k, extra_v)
    q3, had_batch = _drop_batch("q", q)
    keys, values = [_drop_batch("k", k)[0]], [_drop_batch("v", v)[0]]
    if extra_k is not None:
        keys.append(_drop_batch("extra_k", extra_k)[0])
        values.append(_drop_batch("extra_v", extra_v)[0])
    cur_k, cur_v = (jnp.concatenate([x.astype(layout.dtype) for x in xs], axis=0) if len(xs) > 1
                    else xs[0].astype(layout.dtype) for xs in (keys, values))
    return q3, had_batch, cur_k, cur_v, num_frames


def _default_scale(layout: KVLayout, scale: Any) -> Any:
    return 1.0 / math.sqrt(layout.head_size) if scale is None else scale


#: Largest float32 score block one attention call materialises before it processes the
#: queries in chunks (bounded temporaries at Wan-1.3B scale: 4,680 queries x 32,760 keys x
#: 12 heads would otherwise be 7.4 GB per layer).
MAX_SCORE_BYTES = 256 * 2**20


def read_visible_history(
    layout: KVLayout,
    pools: KVPools,
    cursor: jax.Array,  # (run_base, committed, visible_start, *page table)
    layer: jax.Array | int,  # may be traced
    num_current_frames: int,  # static
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The history keys a forward of ``f`` current frames can see: ``(k, v, token_visible)``.

    At most ``sink + window - f`` history frames are visible (the current frames use up
    window slots), so exactly that many entries of the ordered visible table
    (:func:`~ardiff_jax.kv.visible_table`) are gathered, in time order. Entries past the
    visible frames hold the null page: they read as zeros and ``token_visible`` is False
    for them. Nothing outside the visible frames is read.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
      layer: i32[]
      returns: (k, v, token_visible); k, v: dtype[(K+W-f)*T, H, D]; token_visible: bool[(K+W-f)*T]
    """
    num_history = layout.run_pages - num_current_frames
    pages, frames = visible_table(layout, cursor, num_current_frames, jnp)
    hist_k, hist_v = gather_pages(layout, pools, layer, pages[:num_history])
    return hist_k, hist_v, jnp.repeat(frames[:num_history] >= 0, layout.tokens_per_frame)


def paged_attention(
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
    max_score_bytes: int = MAX_SCORE_BYTES,
) -> jax.Array:
    """Non-causal attention of ``q`` over the visible history, the current block and extras.

    Returns an array of ``q``'s shape and dtype. Reads the pools, never writes them; reads
    only the pages that can be visible (:func:`read_visible_history`). When the float32
    score matrix would exceed ``max_score_bytes`` (static), queries are processed in equal
    chunks with ``lax.map``; each query row's arithmetic is unchanged.

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
    layer = checked_layer(layout, layer)
    q3, had_batch, cur_k, cur_v, num_frames = _prepare(layout, q, k, v, extra_k, extra_v)
    seq_q, num_q_heads, head_size = q3.shape
    groups = num_q_heads // layout.num_kv_heads
    q4 = q3.astype(layout.dtype).reshape(seq_q, layout.num_kv_heads, groups, head_size)
    scale = _default_scale(layout, scale)

    hist_k, hist_v, hist_visible = read_visible_history(layout, pools, cursor, layer, num_frames)
    # One key sequence [history][current][extra] and one masked softmax: dense attention over
    # the gathered keys (the concatenation copies K/V, a small fraction of the score work).
    keys = jnp.concatenate([hist_k, cur_k], axis=0)
    values = jnp.concatenate([hist_v, cur_v], axis=0)
    key_visible = jnp.concatenate([hist_visible, jnp.ones((cur_k.shape[0],), bool)])

    f32 = jnp.float32

    def attend_rows(q_rows: jax.Array) -> jax.Array:  # [s, H, G, D] -> f32[H, G, s, D]
        scores = jnp.einsum("shgd,nhd->hgsn", q_rows, keys, preferred_element_type=f32) * scale
        scores = jnp.where(key_visible, scores, -jnp.inf)
        # The current block is never empty, so every row's max is finite.
        weights = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
        out = jnp.einsum("hgsn,nhd->hgsd", weights.astype(values.dtype), values, preferred_element_type=f32)
        return out / weights.sum(axis=-1, keepdims=True)

    num_keys = keys.shape[0]
    row_bytes = 4 * num_q_heads * num_keys
    chunk = max(1, min(seq_q, max_score_bytes // row_bytes))
    if chunk >= seq_q:
        out = attend_rows(q4)
    else:
        num_chunks = -(-seq_q // chunk)
        padded = jnp.pad(q4, ((0, num_chunks * chunk - seq_q), (0, 0), (0, 0), (0, 0)))
        chunks = jax.lax.map(attend_rows, padded.reshape(num_chunks, chunk, *q4.shape[1:]))  # [c, H, G, s, D]
        out = chunks.transpose(1, 2, 0, 3, 4).reshape(*chunks.shape[1:3], num_chunks * chunk, head_size)
        out = out[:, :, :seq_q]
    out = out.transpose(2, 0, 1, 3).reshape(seq_q, num_q_heads, head_size).astype(q.dtype)
    return out[None] if had_batch else out


def ref_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,  # keys to attend to (default all)
    scale: Any = None,  # Python float or f32[]; default 1/sqrt(D)
) -> jax.Array:
    """Textbook dense non-causal softmax attention in float32; output in ``q.dtype``.

    Shapes:
      q: float[S, Hq, D]
      k, v: float[N, H, D]
      mask: bool[N]
      scale: f32[]
      returns: q.dtype[S, Hq, D]
    """
    f32 = jnp.float32
    groups = q.shape[1] // k.shape[1]
    kq = jnp.repeat(k.astype(f32), groups, axis=1)
    vq = jnp.repeat(v.astype(f32), groups, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("shd,nhd->hsn", q.astype(f32), kq, precision="highest") * scale
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
        vq = jnp.where(mask[:, None, None], vq, 0.0)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hsn,nhd->shd", weights, vq, precision="highest")
    return out.astype(q.dtype)


def ref_paged_attention(
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
    """Dense reference of :func:`paged_attention`: ordered gather + concat + float32 softmax.

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
    layer = checked_layer(layout, layer)
    q3, had_batch, cur_k, cur_v, num_frames = _prepare(layout, q, k, v, extra_k, extra_v)
    pages, frames = visible_table(layout, cursor, num_frames, jnp)
    hist_k, hist_v = gather_pages(layout, pools, layer, pages)
    hist_mask = jnp.repeat(frames >= 0, layout.tokens_per_frame)
    keys = jnp.concatenate([hist_k, cur_k], axis=0)
    values = jnp.concatenate([hist_v, cur_v], axis=0)
    mask = jnp.concatenate([hist_mask, jnp.ones((cur_k.shape[0],), bool)])
    out = ref_attention(q3, keys, values, mask=mask, scale=_default_scale(layout, scale)).astype(q.dtype)
    return out[None] if had_batch else out
