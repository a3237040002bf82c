"""Every array a public ``ardiff_jax.kv`` name takes or returns has its documented shape and dtype.

The ``Shapes:`` docstring sections (convention: the ``ardiff_jax.kv`` module docstring) are
parsed here, their ``dtype[dims]`` strings evaluated for a concrete layout, and checked with
chex against real calls, eagerly and under ``jax.jit``; the eager and jitted results must
also agree. Each case must supply exactly the documented names, so a docstring that drifts
from the code (or a test that drifts from the docstring) fails.

Layouts: float32 with grouped-query heads (``Hq = 2H``) and extra tokens; bfloat16 stored
as ``uint16`` bits (the CPU storage) with ``Hq = 2H`` and no extras; float32 under
``reset_at_boundary`` with no sink, ``Hq = H`` and extras. Tolerances for eager vs jit:
``1e-5`` in float32 (same math, possibly different fusion), ``1e-2`` where K/V pass through
bfloat16.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import kv
from ardiff_jax.kv import KVLayout, KVPools, PagedKVCaches

# -- the Shapes: sections ----------------------------------------------------------------------------------

_TOKEN = re.compile(r"([A-Za-z_][\w.]*)\[([^\]]*)\]")


def documented_shapes(obj: Any) -> dict[str, tuple[str, str]]:
    """``{name: (dtype token, dims)}`` from the ``Shapes:`` section of ``obj``'s docstring."""
    lines = (inspect.getdoc(obj) or "").splitlines()
    assert "Shapes:" in lines, f"{obj!r} has no Shapes: section"
    shapes: dict[str, tuple[str, str]] = {}
    for line in lines[lines.index("Shapes:") + 1:]:
        if not line.startswith("  "):
            break
        names, _, rest = line.strip().partition(":")
        match = _TOKEN.search(rest)
        assert match, f"{obj!r}: no dtype[dims] in {line!r}"
        for name in names.split(","):
            assert name.strip() not in shapes, f"{obj!r}: {name.strip()} documented twice"
            shapes[name.strip()] = (match.group(1), match.group(2))
    assert shapes, f"{obj!r}: empty Shapes: section"
    return shapes


@dataclasses.dataclass(frozen=True)
class Geometry:
    layout: KVLayout
    num_q_heads: int  # Hq
    num_frames: int  # f
    num_extra: int  # E (0: extras not passed)
    num_queries: int  # S

    @property
    def dims(self) -> dict[str, int]:
        """The letters of the convention, for the calls of ``_cases``."""
        layout = self.layout
        K, W, T, f = layout.sink_frames, layout.window_frames, layout.tokens_per_frame, self.num_frames
        return dict(L=layout.num_layers, P=layout.num_pages, T=T, H=layout.num_kv_heads, Hq=self.num_q_heads,
                    D=layout.head_size, K=K, W=W, f=f, E=self.num_extra, S=self.num_queries,
                    n=K + W,  # gather_pages reads a whole visible table
                    R=2,  # the slot-copy cases copy two runs
                    B=2,  # the batched-write cases write two rows (one of them padding)
                    N=f * T,  # ref_attention attends to one block
                    # visible_frames of the setup cursor (past one lap): the sink plus the newest W - f
                    # frames, or only the sink right after a reset boundary.
                    V=K + (0 if layout.reset_at_boundary else W - f))


def _layout(*, layers, tokens, heads, head_size, sink, window, runs, frames_per_block, scratch, reset=False,
            dtype="float32", storage=None) -> KVLayout:
    return KVLayout(num_layers=layers, num_pages=runs * (sink + window), tokens_per_frame=tokens,
                    num_kv_heads=heads, head_size=head_size, sink_frames=sink, window_frames=window,
                    frames_per_block=frames_per_block, scratch_pages=scratch, reset_at_boundary=reset, dtype=dtype,
                    storage_dtype=storage or dtype)


GEOMETRIES = {
    # scratch = f + ceil(E / T) = 2 + 2.
    "f32-gqa-extra": Geometry(_layout(layers=2, tokens=2, heads=2, head_size=4, sink=1, window=3, runs=2,
                                      frames_per_block=2, scratch=4), num_q_heads=4, num_frames=2, num_extra=3,
                              num_queries=5),
    "bf16-as-uint16-gqa": Geometry(_layout(layers=3, tokens=1, heads=1, head_size=8, sink=2, window=4, runs=2,
                                           frames_per_block=1, scratch=1, dtype="bfloat16", storage="uint16"),
                                   num_q_heads=2, num_frames=1, num_extra=0, num_queries=3),
    "f32-reset-no-sink-extra": Geometry(_layout(layers=1, tokens=4, heads=2, head_size=4, sink=0, window=2, runs=3,
                                                frames_per_block=2, scratch=3, reset=True),
                                        num_q_heads=2, num_frames=2, num_extra=1, num_queries=4),
}


def _dtype_check(token: str, layout: KVLayout, args: dict[str, Any]) -> Any:
    fixed = {"i32": jnp.int32, "f32": jnp.float32, "bool": jnp.bool_, "int": int, "float": float}
    if token in fixed:
        return fixed[token]
    if token == "dtype":
        return jnp.dtype(layout.dtype)
    if token == "storage":
        return jnp.dtype(layout.storage_dtype)
    if token.endswith(".dtype"):
        return jnp.asarray(args[token.removesuffix(".dtype")]).dtype
    raise AssertionError(f"unknown dtype token {token!r}")


def assert_documented(obj: Any, geometry: Geometry, args: dict[str, Any], results: dict[str, Any]) -> None:
    """``args`` and ``results`` together hold exactly the documented names, each as documented."""
    shapes = documented_shapes(obj)
    assert not set(args) & set(results)
    assert set(shapes) == set(args) | set(results), (sorted(shapes), sorted(args), sorted(results))
    # `[...]` means "the shape of the documented argument that is `[...]`".
    any_shape = [np.shape(args[name]) for name, (_, dims) in shapes.items() if dims == "..." and name in args]
    for name, value in {**args, **results}.items():
        if value is None and name in args:
            continue  # an optional argument left out
        token, dims = shapes[name]
        shape = any_shape[0] if dims == "..." else tuple(eval(f"[{dims}]", {"__builtins__": {}}, geometry.dims))
        expected_type = _dtype_check(token, geometry.layout, args)
        leaves = jax.tree.leaves(value)
        assert leaves, f"{name}: nothing to check"
        for leaf in leaves:
            where = f"{getattr(obj, '__qualname__', obj)}: {name}"
            chex.assert_shape(leaf, shape, custom_message=where)
            chex.assert_type(leaf, expected_type, custom_message=where)


# -- the calls -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """``fn(args, context, xp) -> {documented name: value}`` for the names not in ``args``.

    Eagerly ``xp`` is numpy (the host path of the xp-generic table functions); under
    ``jax.jit`` (``args`` and ``context`` traced) it is ``jax.numpy``.
    """

    doc: Any
    args: dict[str, Any]
    fn: Callable[[dict[str, Any], Any, Any], dict[str, Any]]
    context: Any = None
    jittable: bool = True


def _setup(geometry: Geometry) -> dict[str, Any]:
    """Filled pools, a wrapped (or reset) cursor in run 1, and random attention inputs."""
    layout, g = geometry.layout, geometry
    L, P, T, H, D = layout.pool_shape
    rng = np.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    pools = kv.write_block(layout, kv.allocate_pools(layout), np.arange(P, dtype=np.int32), randn(L, P * T, H, D),
                           randn(L, P * T, H, D))
    committed = layout.run_pages + 1
    cursor = kv.contiguous_table_cursor(layout, layout.run_base(1), committed,
                                        committed if layout.reset_at_boundary else 0)
    extra = g.num_extra > 0
    # The same run as a page table (its slots in reverse page order, so a table lookup is not run_base + slot).
    table = np.arange(layout.run_base(1), layout.run_base(1) + layout.run_pages, dtype=np.int32)[::-1].copy()
    return dict(
        table=table, table_cursor=kv.make_table_cursor(layout.run_base(1), committed, int(cursor[2]), table),
        pools=pools, cursor=cursor, run_base=np.int32(layout.run_base(1)), committed=np.int32(committed),
        q=randn(g.num_queries, g.num_q_heads, D), k=randn(g.num_frames * T, H, D), v=randn(g.num_frames * T, H, D),
        extra_k=randn(g.num_extra, H, D) if extra else None, extra_v=randn(g.num_extra, H, D) if extra else None,
        block_k=randn(L, g.num_frames * T, H, D), block_v=randn(L, g.num_frames * T, H, D),
    )


ATTENTION_ARGS = ("q", "k", "v", "extra_k", "extra_v")
ONE_DEVICE = kv.KVSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("tp", "cfg")))


def _cases(geometry: Geometry) -> dict[str, Case]:
    layout, f = geometry.layout, geometry.num_frames
    s = _setup(geometry)
    attention = {name: s[name] for name in ATTENTION_ARGS}
    layer, scale = jnp.int32(layout.num_layers - 1), jnp.float32(0.4)
    caches = PagedKVCaches(pools=s["pools"], cursor=jnp.asarray(s["cursor"]), layout=layout,
                           seq_len=f * layout.tokens_per_frame)
    paged_args = dict(pools=s["pools"], cursor=s["cursor"], layer=layer, **attention, scale=scale)

    def paged(fn):
        return lambda a, c, xp: {"returns": fn(layout, a["pools"], a["cursor"], a["layer"],
                                               *(a[n] for n in ATTENTION_ARGS), scale=a["scale"])}

    def method(name):
        return lambda a, c, xp: {"returns": getattr(c, name)(a["layer"], *(a[n] for n in ("q", "k", "v")),
                                                             extra_k=a["extra_k"], extra_v=a["extra_v"],
                                                             scale=a["scale"])}

    def layer_method(name):
        return lambda a, c, xp: {"returns": getattr(c[layout.num_layers - 1], name)(
            *(a[n] for n in ("q", "k", "v")), extra_k=a["extra_k"], extra_v=a["extra_v"], scale=a["scale"])}

    method_args = dict(layer=layer, **attention, scale=scale)
    layer_args = dict(attention, scale=scale)
    pages = kv.cursor_block_pages(layout, s["cursor"], f)
    table, _ = kv.visible_table(layout, s["cursor"], f)
    row_pages = np.stack([pages, np.full_like(pages, layout.null_page)])  # a real row and a padded one
    rows_k, rows_v = np.stack([s["block_k"]] * 2), np.stack([s["block_v"]] * 2)
    page_mask = kv.run_visibility(layout, s["committed"], np.int32(0), f)
    logical = np.asarray(jnp.asarray(s["block_k"]).astype(layout.dtype))
    run_pages = kv.read_pages(layout, s["pools"], 0, layout.run_pages)
    two_runs = np.array([1, 0], np.int32) * layout.run_pages  # out of order: runs need not be adjacent
    slot_copy = kv.sharded_read_runs(layout, ONE_DEVICE, s["pools"], two_runs)
    return {
        "KVPools": Case(KVPools, {}, lambda a, c, xp: vars(kv.allocate_pools(layout))),
        "allocate_pools": Case(kv.allocate_pools, {}, lambda a, c, xp: {"returns": kv.allocate_pools(layout)}),
        "to_storage": Case(kv.to_storage, dict(x=s["block_k"]),
                           lambda a, c, xp: {"returns": kv.to_storage(layout, a["x"])}),
        "from_storage": Case(kv.from_storage, dict(x=np.asarray(kv.to_storage(layout, logical))),
                             lambda a, c, xp: {"returns": kv.from_storage(layout, a["x"])}),
        "write_block": Case(kv.write_block, dict(pools=s["pools"], pages=pages, k=s["block_k"], v=s["block_v"]),
                            lambda a, c, xp: {"returns": kv.write_block(layout, a["pools"], a["pages"], a["k"],
                                                                        a["v"])}),
        # Already jitted, and it donates: called once, on a copy of the pools.
        "commit_block": Case(kv.commit_block, dict(pools=s["pools"], pages=pages, k=s["block_k"], v=s["block_v"]),
                             lambda a, c, xp: {"returns": kv.commit_block(layout, jax.tree.map(jnp.copy, a["pools"]),
                                                                          a["pages"], a["k"], a["v"])},
                             jittable=False),
        "write_blocks": Case(kv.write_blocks, dict(pools=s["pools"], pages=row_pages, k=rows_k, v=rows_v),
                             lambda a, c, xp: {"returns": kv.write_blocks(layout, a["pools"], a["pages"], a["k"],
                                                                          a["v"])}),
        "commit_blocks": Case(kv.commit_blocks, dict(pools=s["pools"], pages=row_pages, k=rows_k, v=rows_v),
                              lambda a, c, xp: {"returns": kv.commit_blocks(layout, jax.tree.map(jnp.copy, a["pools"]),
                                                                            a["pages"], a["k"], a["v"])},
                              jittable=False),
        "gather_pages": Case(kv.gather_pages, dict(pools=s["pools"], layer=layer, pages=table),
                             lambda a, c, xp: {"returns": kv.gather_pages(layout, a["pools"], a["layer"], a["pages"])}),
        "read_run": Case(kv.read_run, dict(pools=s["pools"], layer=layer, run_base=s["run_base"], page_mask=page_mask),
                         lambda a, c, xp: {"returns": kv.read_run(layout, a["pools"], a["layer"], a["run_base"],
                                                                  a["page_mask"])}),
        "read_pages": Case(kv.read_pages, dict(pools=s["pools"], start=s["run_base"]),
                           lambda a, c, xp: {"returns": kv.read_pages(layout, a["pools"], a["start"], layout.run_pages)}),
        "write_pages": Case(kv.write_pages, dict(pools=s["pools"], start=s["run_base"], pages=run_pages),
                            lambda a, c, xp: {"returns": kv.write_pages(layout, a["pools"], a["start"], a["pages"])}),
        # Already jitted, and it donates: called once, on a copy of the pools.
        "restore_pages": Case(kv.restore_pages, dict(pools=s["pools"], start=s["run_base"], pages=run_pages),
                              lambda a, c, xp: {"returns": kv.restore_pages(layout, jax.tree.map(jnp.copy, a["pools"]),
                                                                            a["start"], a["pages"])},
                              jittable=False),
        "paged_attention": Case(kv.paged_attention, paged_args, paged(kv.paged_attention)),
        "ordered_window_attention": Case(kv.ordered_window_attention, paged_args, paged(kv.ordered_window_attention)),
        # cuDNN runs on GPUs only (it refuses elsewhere, tested in test_cudnn_backend.py): the
        # CPU check of its documented shapes goes through the same ordered read with XLA.
        "cudnn_paged_attention": Case(kv.cudnn_paged_attention, paged_args, paged(
            kv.cudnn_paged_attention if jax.default_backend() == "gpu" else kv.ordered_window_attention)),
        # A one-device mesh: the shard_map path with the whole pool as its one shard.
        "sharded_write_block": Case(kv.sharded_write_block, dict(pools=s["pools"], pages=pages, k=s["block_k"],
                                                                 v=s["block_v"]),
                                    lambda a, c, xp: {"returns": kv.sharded_write_block(
                                        layout, ONE_DEVICE, a["pools"], a["pages"], a["k"], a["v"])}),
        "sharded_read_runs": Case(kv.sharded_read_runs, dict(pools=s["pools"], run_starts=two_runs),
                                  lambda a, c, xp: {"returns": kv.sharded_read_runs(layout, ONE_DEVICE, a["pools"],
                                                                                    a["run_starts"])}),
        "sharded_write_runs": Case(kv.sharded_write_runs, dict(pools=s["pools"], run_starts=two_runs, pages=slot_copy),
                                   lambda a, c, xp: {"returns": kv.sharded_write_runs(
                                       layout, ONE_DEVICE, a["pools"], a["run_starts"], a["pages"])}),
        "sharded_attention": Case(kv.sharded_attention, paged_args, lambda a, c, xp: {
            "returns": kv.sharded_attention(kv.paged_attention, layout, ONE_DEVICE, a["pools"], a["cursor"], a["layer"],
                                            *(a[n] for n in ATTENTION_ARGS), scale=a["scale"])}),
        "ref_paged_attention": Case(kv.ref_paged_attention, paged_args, paged(kv.ref_paged_attention)),
        "AttentionBackend": Case(kv.AttentionBackend, paged_args, paged(kv.attention_backend("xla"))),
        "ref_attention": Case(kv.ref_attention, dict(q=s["q"], k=s["block_k"][0], v=s["block_v"][0],
                                                     mask=np.arange(f * layout.tokens_per_frame) % 2 == 0, scale=scale),
                              lambda a, c, xp: {"returns": kv.ref_attention(a["q"], a["k"], a["v"], mask=a["mask"],
                                                                            scale=a["scale"])}),
        "PagedKVCaches": Case(PagedKVCaches, {}, lambda a, c, xp: {"pools": c.pools, "cursor": c.cursor}, caches),
        "PagedKVCaches.attend": Case(PagedKVCaches.attend, method_args, method("attend"), caches),
        "PagedKVCaches.ref_attend": Case(PagedKVCaches.ref_attend, method_args, method("ref_attend"), caches),
        # Host numpy: reads the concrete cursor.
        "PagedKVCaches.visible_frames": Case(PagedKVCaches.visible_frames, {},
                                             lambda a, c, xp: {"returns": c.visible_frames()}, caches, jittable=False),
        "LayerKVCache.attend": Case(kv.LayerKVCache.attend, layer_args, layer_method("attend"), caches),
        "LayerKVCache.ref_attend": Case(kv.LayerKVCache.ref_attend, layer_args, layer_method("ref_attend"), caches),
        "contiguous_table_cursor": Case(kv.contiguous_table_cursor, {}, lambda a, c, xp: {
            "returns": kv.contiguous_table_cursor(layout, layout.run_base(1), 2, 0)}, jittable=False),
        "visible_history": Case(kv.visible_history, dict(committed=s["committed"], visible_start=np.int32(0)),
                                lambda a, c, xp: {"returns": kv.visible_history(layout, a["committed"],
                                                                                a["visible_start"], f, xp)}),
        "VisibleHistory": Case(kv.VisibleHistory, {}, lambda a, c, xp: kv.visible_history(
            layout, np.int32(5), np.int32(0), f, xp)._asdict()),
        "visible_table": Case(kv.visible_table, dict(cursor=s["cursor"]),
                              lambda a, c, xp: {"returns": kv.visible_table(layout, a["cursor"], f, xp)}),
        "run_visibility": Case(kv.run_visibility, dict(committed=s["committed"], visible_start=np.int32(0)),
                               lambda a, c, xp: {"returns": kv.run_visibility(layout, a["committed"],
                                                                              a["visible_start"], f, xp)}),
        "advance_frames": Case(kv.advance_frames, dict(committed=s["committed"], visible_start=np.int32(0)),
                               lambda a, c, xp: {"returns": kv.advance_frames(layout, a["committed"],
                                                                              a["visible_start"], f)}),
        "advance_cursor": Case(kv.advance_cursor, dict(cursor=s["cursor"]),
                               lambda a, c, xp: {"returns": kv.advance_cursor(layout, a["cursor"], f, xp)}),
        "make_table_cursor": Case(kv.make_table_cursor, dict(table=s["table"]), lambda a, c, xp: {
            "returns": kv.make_table_cursor(1, 2, 0, a["table"])}, jittable=False),
        "slot_of_frame": Case(kv.slot_of_frame, dict(frame=np.arange(7, dtype=np.int32)),
                              lambda a, c, xp: {"returns": kv.slot_of_frame(layout, a["frame"], xp)}),
        "cursor_pages": Case(kv.cursor_pages, dict(cursor=s["table_cursor"], frame=np.arange(7, dtype=np.int32)),
                             lambda a, c, xp: {"returns": kv.cursor_pages(layout, a["cursor"], a["frame"], xp)}),
        "cursor_block_pages": Case(kv.cursor_block_pages, dict(cursor=s["table_cursor"]),
                                   lambda a, c, xp: {"returns": kv.cursor_block_pages(layout, a["cursor"], f, xp)}),
        "gather_table_pages": Case(kv.gather_table_pages, dict(pools=s["pools"], pages=s["table"]),
                                   lambda a, c, xp: {"returns": kv.gather_table_pages(layout, a["pools"], a["pages"])}),
        # The donating program's own function (the donation would delete the case's pools).
        "scatter_table_pages": Case(kv.scatter_table_pages, dict(pools=s["pools"], pages=s["table"],
                                                                 data=kv.gather_table_pages(layout, s["pools"],
                                                                                            s["table"])),
                                    lambda a, c, xp: {"returns": kv.scatter_table_pages.__wrapped__(
                                        layout, a["pools"], a["pages"], a["data"])}),
    }


CASE_NAMES = list(_cases(GEOMETRIES["f32-gqa-extra"]))

#: Public names that neither take nor return arrays.
NO_ARRAYS = {"CURSOR_FIELDS", "KVLayout", "default_storage_dtype", "attention_backend", "attention_backends",
             "check_attention_backend", "register_attention_backend", "unregister_attention_backend", "KVSharding",
             "check_mesh", "shard_zeros", "cudnn_support", "select_attention_backend"}


def test_every_public_name_with_arrays_documents_its_shapes():
    covered = {name.split(".")[0] for name in CASE_NAMES}
    assert set(kv.__all__) == covered | NO_ARRAYS and not covered & NO_ARRAYS
    for name in NO_ARRAYS:
        assert "Shapes:" not in (inspect.getdoc(getattr(kv, name)) or ""), name
    # Every public method of a covered class that documents shapes has a case.
    for name in covered:
        obj = getattr(kv, name)
        if inspect.isclass(obj):
            for method_name, method in vars(obj).items():
                if callable(method) and not method_name.startswith("_") and "Shapes:" in (method.__doc__ or ""):
                    assert f"{name}.{method_name}" in CASE_NAMES, f"{name}.{method_name}"


@pytest.mark.parametrize("geometry_name", list(GEOMETRIES))
@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_documented_shapes_eager_and_jit(case_name, geometry_name):
    geometry = GEOMETRIES[geometry_name]
    case = _cases(geometry)[case_name]
    eager = case.fn(case.args, case.context, np)
    assert_documented(case.doc, geometry, case.args, eager)
    if not case.jittable:
        return
    jitted = jax.jit(lambda args, context: case.fn(args, context, jnp))(case.args, case.context)
    assert_documented(case.doc, geometry, case.args, jitted)
    tol = 1e-2 if geometry.layout.dtype == "bfloat16" else 1e-5
    chex.assert_trees_all_close(jax.tree.map(np.asarray, eager), jax.tree.map(np.asarray, jitted), rtol=tol,
                                atol=tol)


def test_a_wrong_documented_shape_is_caught():
    # The checker can fail: a result of the wrong shape or dtype for write_block's `returns:`.
    geometry = GEOMETRIES["f32-gqa-extra"]
    case = _cases(geometry)["write_block"]
    pools = kv.allocate_pools(geometry.layout)
    with pytest.raises(AssertionError, match="returns"):
        assert_documented(case.doc, geometry, case.args, {"returns": KVPools(k=pools.k[:1], v=pools.v)})
    with pytest.raises(AssertionError, match="returns"):
        assert_documented(case.doc, geometry, case.args, {"returns": KVPools(k=pools.k.astype(jnp.float16),
                                                                             v=pools.v)})
    with pytest.raises(AssertionError):  # a documented argument the case did not supply
        assert_documented(case.doc, geometry, {k: v for k, v in case.args.items() if k != "pages"},
                          {"returns": pools})


@pytest.mark.parametrize("geometry_name", list(GEOMETRIES))
def test_storage_round_trip_and_donated_commit_agree(geometry_name):
    layout = GEOMETRIES[geometry_name].layout
    s = _setup(GEOMETRIES[geometry_name])
    # Storage is a bitcast: exact round trip of the logical values.
    logical = jnp.asarray(s["block_k"]).astype(layout.dtype)
    chex.assert_trees_all_equal(kv.from_storage(layout, kv.to_storage(layout, s["block_k"])), logical)
    # The donated, jitted writer writes exactly what the pure one does.
    pages = kv.cursor_block_pages(layout, s["cursor"], GEOMETRIES[geometry_name].num_frames)
    written = kv.write_block(layout, s["pools"], pages, s["block_k"], s["block_v"])
    committed = kv.commit_block(layout, jax.tree.map(jnp.copy, s["pools"]), pages, s["block_k"], s["block_v"])
    chex.assert_trees_all_equal(written, committed)
    assert not jnp.array_equal(written.k, s["pools"].k)  # the block really landed


# -- KVLayout: a static, hashable argument ------------------------------------------------------------------

LAYOUT_FIELDS = dict(num_layers=2, num_pages=8, tokens_per_frame=2, num_kv_heads=2, head_size=4, sink_frames=1,
                     window_frames=3, frames_per_block=2, scratch_pages=4, reset_at_boundary=True)


def test_layout_converts_numpy_scalars_to_python_values():
    # numpy scalars (e.g. from a config array) become Python ints/bools: the same layout, the same hash,
    # so the same compiled programs.
    from_numpy = KVLayout(**{name: np.bool_(value) if isinstance(value, bool) else np.int64(value)
                             for name, value in LAYOUT_FIELDS.items()})
    plain = KVLayout(**LAYOUT_FIELDS)
    assert from_numpy == plain and hash(from_numpy) == hash(plain)
    for name, value in LAYOUT_FIELDS.items():
        assert type(getattr(from_numpy, name)) is type(value), name
    traces = []
    program = jax.jit(lambda layout, x: traces.append(layout) or x + 1, static_argnums=0)
    program(plain, 1.0)
    program(from_numpy, 1.0)
    assert traces == [plain]


@pytest.mark.parametrize("name,value,match", [
    ("num_layers", True, "num_layers must be a positive integer, got True"),
    ("num_layers", 0, "num_layers must be a positive integer, got 0"),
    ("head_size", 4.0, "head_size must be a positive integer, got 4.0"),
    ("num_pages", np.float32(8), "num_pages must be a positive integer"),
    ("num_kv_heads", jnp.int32(2), "num_kv_heads must be a positive integer"),  # a jax array is not a static int
    ("sink_frames", -1, "sink_frames must be a non-negative integer, got -1"),
    ("sink_frames", np.bool_(True), "sink_frames must be a non-negative integer"),
    ("reset_at_boundary", "false", "reset_at_boundary must be a bool"),
    ("reset_at_boundary", 1, "reset_at_boundary must be a bool"),
])
def test_layout_rejects_non_integer_fields(name, value, match):
    with pytest.raises(ValueError, match=f"KVLayout {match}"):
        KVLayout(**dict(LAYOUT_FIELDS, **{name: value}))
