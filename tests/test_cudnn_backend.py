"""The ``"cudnn"`` attention backend (``ardiff_jax.kv._cudnn``), checked on CPU.

cuDNN itself needs a GPU; here its code path runs through ``implementation="xla"``, which
is the same ordered, length-padded read handed to ``jax.nn.dot_product_attention``:

* equality with :func:`ref_paged_attention` across fill levels (empty history, partial
  sink, full sink, ring wrapped several times), ``reset_at_boundary``, extra tokens, GQA
  (``Hq = 2H``), a batch axis of size 1, traced and Python scales, float32 and bfloat16
  stored as ``uint16``;
* the keys reach ``dot_product_attention`` in reference order as a prefix of the padded
  sequence, with a length and no mask;
* one compilation across fill levels under ``jax.jit``;
* NaN in every page outside the visible window contributes nothing;
* ``cudnn_support`` / ``select_attention_backend`` decisions, and the registered
  ``"cudnn"`` backend refusing (ValueError with the reason) where cuDNN cannot run.

Tolerances: float32 ``1e-5`` (the two paths sum in different orders); bfloat16 ``2e-2``
(the backend rounds the queries to bfloat16 as every backend does, the reference keeps
them in float32; values are O(1)).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles

from ardiff_jax.kv import (
    KVLayout,
    PagedKVCaches,
    advance_cursor,
    allocate_pools,
    attention_backend,
    attention_backends,
    contiguous_table_cursor,
    cursor_block_pages,
    gather_pages,
    paged_attention,
    ref_paged_attention,
    to_storage,
    visible_table,
    write_block,
)
from ardiff_jax.kv._cudnn import (
    cudnn_paged_attention,
    cudnn_support,
    ordered_window_attention,
    select_attention_backend,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)

_ordered_jit = jax.jit(ordered_window_attention, static_argnums=0, static_argnames="implementation")
_ref_jit = jax.jit(ref_paged_attention, static_argnums=0)


def make_layout(*, sink=2, window=4, frames_per_block=2, reset=False, dtype="float32", head_size=8, heads=2,
                tokens=2, extra=3, runs=2) -> KVLayout:
    scratch = frames_per_block + -(-extra // tokens)
    storage = "uint16" if dtype in ("bfloat16", "float16") else dtype
    return KVLayout(num_layers=2, num_pages=runs * (sink + window), tokens_per_frame=tokens, num_kv_heads=heads,
                    head_size=head_size, sink_frames=sink, window_frames=window, frames_per_block=frames_per_block,
                    scratch_pages=scratch, reset_at_boundary=reset, dtype=dtype, storage_dtype=storage)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def fill(layout: KVLayout, committed: int, *, seed: int = 0, frames_per_commit: int | None = None):
    """Pools with ``committed`` frames written into run 1 by the public commit path, and the cursor."""
    rng = np.random.default_rng(seed)
    L, T, H, D = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    step = frames_per_commit or layout.frames_per_block
    assert committed % step == 0
    pools = allocate_pools(layout)
    cursor = contiguous_table_cursor(layout, layout.run_base(1), 0, 0)
    for _ in range(committed // step):
        pages = cursor_block_pages(layout, cursor, step)
        pools = write_block(layout, pools, pages, randn(rng, L, step * T, H, D), randn(rng, L, step * T, H, D))
        cursor = advance_cursor(layout, cursor, step)
    return pools, cursor


def inputs(layout: KVLayout, *, seed=1, num_q_heads=None, num_extra=3, num_queries=5, batch=False):
    rng = np.random.default_rng(seed)
    T, H, D, f = layout.tokens_per_frame, layout.num_kv_heads, layout.head_size, layout.frames_per_block
    x = dict(q=randn(rng, num_queries, num_q_heads or H, D), k=randn(rng, f * T, H, D), v=randn(rng, f * T, H, D),
             extra_k=randn(rng, num_extra, H, D) if num_extra else None,
             extra_v=randn(rng, num_extra, H, D) if num_extra else None)
    if batch:
        x = {name: None if a is None else a[None] for name, a in x.items()}
    return x


def call(fn, layout, pools, cursor, layer, x, **kwargs):
    return np.asarray(fn(layout, pools, cursor, layer, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"], **kwargs))


# -- equality with the dense reference -------------------------------------------------------------------

# sink 2, window 4, blocks of 2: 0 = empty, 1 = partial sink, 2 = sink full, 4 = sink + 2 ring frames,
# 22 = the ring wrapped five times.
FILL_LEVELS = {"empty": 0, "partial_sink": 1, "sink_full": 2, "window_filling": 4, "wrapped": 22}


@pytest.mark.parametrize("fill_level", list(FILL_LEVELS))
def test_equals_reference_across_fill_levels(fill_level):
    layout = make_layout()
    pools, cursor = fill(layout, FILL_LEVELS[fill_level], frames_per_commit=1)
    x = inputs(layout, num_q_heads=2 * layout.num_kv_heads)  # GQA, with extra tokens
    for layer in range(layout.num_layers):
        want = call(_ref_jit, layout, pools, cursor, layer, x)
        got = call(_ordered_jit, layout, pools, cursor, layer, x)
        np.testing.assert_allclose(got, want, **F32_TOL)
    if FILL_LEVELS[fill_level]:  # the comparison can fail: the other layer's history differs
        assert not np.allclose(call(_ordered_jit, layout, pools, cursor, 0, x),
                               call(_ref_jit, layout, pools, cursor, 1, x), **F32_TOL)


def test_equals_reference_under_reset_at_boundary():
    layout = make_layout(sink=1, window=4, reset=True)
    x = inputs(layout)
    for committed in (0, 2, 6):  # only the sink survives each boundary
        pools, cursor = fill(layout, committed)
        assert int(cursor[2]) == committed
        np.testing.assert_allclose(call(_ordered_jit, layout, pools, cursor, 1, x),
                                   call(_ref_jit, layout, pools, cursor, 1, x), **F32_TOL)


def test_no_sink_and_a_block_as_long_as_the_window():
    # K = 0, f = W: no history frame can ever be visible; only the block and the extras are keys.
    layout = make_layout(sink=0, window=2, frames_per_block=2)
    pools, cursor = fill(layout, 6)
    x = inputs(layout)
    np.testing.assert_allclose(call(_ordered_jit, layout, pools, cursor, 0, x),
                               call(_ref_jit, layout, pools, cursor, 0, x), **F32_TOL)


def test_batch_axis_gqa_without_extras_and_scales():
    layout = make_layout()
    pools, cursor = fill(layout, 10)
    x = inputs(layout, num_q_heads=2 * layout.num_kv_heads, num_extra=0, batch=True)
    want = call(_ref_jit, layout, pools, cursor, 1, x)
    got = call(ordered_window_attention, layout, pools, cursor, 1, x)  # eager
    assert got.shape == x["q"].shape == (1, 5, 4, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, **F32_TOL)
    # A Python scale (eager: passed to dot_product_attention as is) and a traced one (folded into q).
    for scale in (0.3, jnp.float32(0.3)):
        want = call(_ref_jit, layout, pools, cursor, 1, x, scale=0.3)
        np.testing.assert_allclose(call(ordered_window_attention, layout, pools, cursor, 1, x, scale=scale), want,
                                   **F32_TOL)
        np.testing.assert_allclose(call(_ordered_jit, layout, pools, cursor, 1, x, scale=scale), want, **F32_TOL)
    assert not np.allclose(call(_ordered_jit, layout, pools, cursor, 1, x), want, **F32_TOL)  # the scale matters


def test_bfloat16_stored_as_uint16():
    layout = make_layout(dtype="bfloat16")
    assert layout.storage_dtype == "uint16"
    pools, cursor = fill(layout, 22)
    for q_dtype in (np.float32, jnp.bfloat16):
        x = inputs(layout, num_q_heads=2 * layout.num_kv_heads)
        x["q"] = jnp.asarray(x["q"], q_dtype)
        got = _ordered_jit(layout, pools, cursor, 1, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"])
        assert got.dtype == q_dtype
        want = _ref_jit(layout, pools, cursor, 1, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"])
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)
        # The usual explicit scale arrives traced and is folded into q by a factor of exactly 1.
        explicit = _ordered_jit(layout, pools, cursor, 1, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"],
                                scale=1 / math.sqrt(layout.head_size))
        np.testing.assert_array_equal(np.asarray(explicit, np.float32), np.asarray(got, np.float32))


# -- the call it makes -----------------------------------------------------------------------------------


def test_keys_reach_dot_product_attention_in_reference_order_with_a_length(monkeypatch):
    layout = make_layout()
    pools, cursor = fill(layout, 22)  # wrapped: physical ring order differs from time order
    x = inputs(layout)
    seen = []
    real = jax.nn.dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append(dict(key=np.asarray(key), value=np.asarray(value), args=args, **kwargs))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    ordered_window_attention(layout, pools, cursor, 1, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"])
    (call_args,) = seen
    assert call_args["args"] == () and call_args.get("mask") is None and call_args.get("bias") is None
    assert call_args["implementation"] == "xla"
    assert call_args["scale"] == pytest.approx(1 / math.sqrt(layout.head_size))

    pages, frames = visible_table(layout, cursor, layout.frames_per_block)
    visible = frames >= 0
    hist_k, hist_v = gather_pages(layout, pools, 1, pages[visible])
    want_k = np.concatenate([hist_k, x["k"], x["extra_k"]])
    want_v = np.concatenate([hist_v, x["v"], x["extra_v"]])
    length = int(call_args["key_value_seq_lengths"][0])
    T, E = layout.tokens_per_frame, x["extra_k"].shape[0]
    assert length == want_k.shape[0] == layout.run_pages * T + E  # full window: every slot is a real key
    np.testing.assert_array_equal(call_args["key"][0, :length], want_k)
    np.testing.assert_array_equal(call_args["value"][0, :length], want_v)

    # Partly filled: the real keys still form the prefix, the padding after them is zeros.
    seen.clear()
    pools, cursor = fill(layout, 3, frames_per_commit=1)
    ordered_window_attention(layout, pools, cursor, 0, x["q"], x["k"], x["v"], x["extra_k"], x["extra_v"])
    pages, frames = visible_table(layout, cursor, layout.frames_per_block)
    hist_k, _ = gather_pages(layout, pools, 0, pages[frames >= 0])
    want_k = np.concatenate([hist_k, x["k"], x["extra_k"]])
    length = int(seen[0]["key_value_seq_lengths"][0])
    assert length == want_k.shape[0] == 3 * T + layout.frames_per_block * T + E
    np.testing.assert_array_equal(seen[0]["key"][0, :length], want_k)
    assert seen[0]["key"].shape[1] == layout.run_pages * T + E and not seen[0]["key"][0, length:].any()


def test_one_compilation_across_fill_levels():
    layout = make_layout()
    program = jax.jit(ordered_window_attention, static_argnums=0)
    x = inputs(layout)
    filled = {committed: fill(layout, committed, frames_per_commit=1) for committed in (0, 1, 2, 4, 9, 22)}
    with count_compiles() as compiled:
        outs = {committed: call(program, layout, pools, cursor, np.int32(committed % 2), x)
                for committed, (pools, cursor) in filled.items()}
    assert len(compiled) == 1 and "ordered_window_attention" in compiled[0], compiled
    for committed, (pools, cursor) in filled.items():
        np.testing.assert_allclose(outs[committed], call(_ref_jit, layout, pools, cursor, committed % 2, x),
                                   **F32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("committed", [0, 3, 22])
def test_nan_outside_the_visible_window_contributes_nothing(dtype, committed):
    layout = make_layout(dtype=dtype)
    pools, cursor = fill(layout, committed, frames_per_commit=1)
    pages, frames = visible_table(layout, cursor, layout.frames_per_block)
    visible = np.zeros(layout.num_pages, bool)
    visible[pages[frames >= 0]] = True
    nan = to_storage(layout, jnp.full(layout.pool_shape, jnp.nan))
    keep = visible[None, :, None, None, None]
    poisoned = dataclasses.replace(pools, k=jnp.where(keep, pools.k, nan), v=jnp.where(keep, pools.v, nan))
    assert np.isnan(np.asarray(gather_pages(layout, poisoned, 0, np.arange(layout.num_pages))[0],
                               np.float32)).any()  # the poison is really there
    x = inputs(layout)
    got = call(_ordered_jit, layout, poisoned, cursor, 0, x)
    assert np.isfinite(got).all()
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    np.testing.assert_allclose(got, call(_ref_jit, layout, pools, cursor, 0, x), **tol)


def test_validates_like_paged_attention_before_any_work():
    layout = make_layout()
    pools, cursor = fill(layout, 2)
    x = inputs(layout)
    with pytest.raises(ValueError, match="q head size must be 8"):
        ordered_window_attention(layout, pools, cursor, 0, x["q"][..., :4], x["k"], x["v"])
    with pytest.raises(ValueError, match="q heads \\(3\\) must be a multiple of the KV heads \\(2\\)"):
        ordered_window_attention(layout, pools, cursor, 0, x["q"][:, :1].repeat(3, axis=1), x["k"], x["v"])
    with pytest.raises(ValueError, match="extra_k and extra_v must be given together"):
        ordered_window_attention(layout, pools, cursor, 0, x["q"], x["k"], x["v"], x["extra_k"])
    with pytest.raises(IndexError, match="layer 2 out of range"):
        ordered_window_attention(layout, pools, cursor, 2, x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match="implementation must be one of .* got 'flash'"):
        ordered_window_attention(layout, pools, cursor, 0, x["q"], x["k"], x["v"], implementation="flash")


def _shapes_section(fn) -> list[str]:
    lines = inspect.getdoc(fn).splitlines()
    start = lines.index("Shapes:")
    section = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        section.append(line)
    return section


def test_documents_the_shapes_of_paged_attention():
    # Same signature as every backend, so the same Shapes: section (the kv package's convention).
    assert _shapes_section(ordered_window_attention) == _shapes_section(paged_attention)
    assert _shapes_section(cudnn_paged_attention) == _shapes_section(paged_attention)
    for fn in (cudnn_support, select_attention_backend):  # no arrays in or out
        assert "Shapes:" not in inspect.getdoc(fn)


# -- support, selection and the registered backend -------------------------------------------------------


def test_cudnn_support_decisions():
    bf16_64 = make_layout(dtype="bfloat16", head_size=64)
    assert cudnn_support(bf16_64, platform="gpu")[0] is True
    assert cudnn_support(make_layout(dtype="float16", head_size=128), q_dtype="float16", platform="gpu")[0] is True
    refused = {
        "platform is 'cpu'": cudnn_support(bf16_64, platform="cpu"),
        "KV dtype float32 is not one of bfloat16, float16": cudnn_support(make_layout(head_size=64), platform="gpu"),
        "query dtype float32": cudnn_support(bf16_64, q_dtype=np.float32, platform="gpu"),
        "head size 12 is not a multiple of 8": cudnn_support(make_layout(dtype="bfloat16", head_size=12),
                                                             platform="gpu"),
        "head size 136 exceeds 128": cudnn_support(make_layout(dtype="bfloat16", head_size=136), platform="gpu"),
    }
    for reason, (ok, message) in refused.items():
        assert ok is False and reason in message, (reason, message)
    # Every unmet requirement is named, and the default platform is jax's (CPU in this suite).
    ok, message = cudnn_support(make_layout(head_size=12))
    assert not ok and "'cpu'" in message and "float32" in message and "head size 12" in message


def test_select_attention_backend():
    bf16_64 = make_layout(dtype="bfloat16", head_size=64)
    name, reason = select_attention_backend(bf16_64)  # this suite runs on CPU
    assert name == "xla" and "platform is 'cpu'" in reason
    name, reason = select_attention_backend(bf16_64, platform="gpu")
    assert name == "cudnn" and "bfloat16" in reason and "64" in reason
    name, reason = select_attention_backend(bf16_64, platform="gpu", q_dtype="float32")
    assert name == "xla" and "query dtype float32" in reason
    assert select_attention_backend(make_layout(), platform="gpu")[0] == "xla"


def test_cudnn_backend_is_registered_and_refuses_with_the_reason_on_cpu():
    assert "cudnn" in attention_backends()
    assert attention_backend("cudnn", jitted=False) is cudnn_paged_attention
    layout = make_layout(dtype="bfloat16", head_size=8)
    pools, cursor = fill(layout, 4)
    x = inputs(layout)
    with pytest.raises(ValueError, match="attention backend 'cudnn' cannot run this layout: platform is 'cpu'"):
        call(cudnn_paged_attention, layout, pools, cursor, 0, x)
    with pytest.raises(ValueError, match="KV dtype float32"):  # jitted through the registry: refused at trace time
        f32 = make_layout()
        f32_pools, f32_cursor = fill(f32, 4)
        call(attention_backend("cudnn"), f32, f32_pools, f32_cursor, 0, x)
    # A cache view that names the backend refuses too, instead of running another kernel.
    view = PagedKVCaches(pools=pools, cursor=jnp.asarray(cursor), layout=layout,
                         seq_len=layout.frames_per_block * layout.tokens_per_frame, backend="cudnn")
    with pytest.raises(ValueError, match="platform is 'cpu'"):
        view.attend(0, x["q"], x["k"], x["v"], extra_k=x["extra_k"], extra_v=x["extra_v"])
