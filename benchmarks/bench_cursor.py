"""Cursor forms: does reading pages through the run's page table cost more than ``run_base + slot``?

Issue 48 asked for one cursor form, the table cursor ``i32[3+K+W]``, if the table path costs
no more than the contiguous arithmetic of the old ``i32[3]`` cursor. This benchmark is that
measurement. It runs one jitted program, the commit of one block (donated pools, written
before the reads as ``write_block`` advises) then every layer's attention history read
reduced by a float32 sum, window full and wrapping, with cursors that all name the same run
(run 1 of 2, so its pages are a real sub-slice of the pools):

* ``contiguous``: the removed ``i32[3]`` form, kept here as the baseline: the program
  computes the visible pages and the commit's pages as ``run_base + slot`` (the core's
  ``visible_history`` and ``slot_of_frame``) and gathers them, as the core did for it;
* ``table``: the one form, ``i32[3+K+W]`` with the run on its home pages
  (``contiguous_table_cursor``): the core's ``read_visible_history`` and ``cursor_block_pages``;
* ``scattered``: the same, but the run's slots sit on its pages in reverse order (a forked or
  remapped run is not contiguous), so no lookup can fold into arithmetic.

And the session copy for host offload and session files (``runtime/_kv_cache.py``), where the
runtime keeps a contiguous path for runs on their home pages: the copy of one run,
``read_pages`` (one slice, jitted) vs ``gather_table_pages`` of its home table (``copy: slot`` vs
``copy: table``, the same bytes), and the write back, ``restore_pages`` (one donated
``dynamic_update_slice``) vs ``scatter_table_pages`` (donated) (``restore: slot`` vs
``restore: table``).

Every program reads the same history (``checks.same_read``: the sums agree). Ratios are of
medians (``ratios``) and of 10th percentiles (``ratios_p10``, steadier on a shared machine) of
interleaved repeats in one run (``benchmarks/common.run_interleaved``). Run:
``python -m benchmarks.bench_cursor [--geometry tiny medium] [--quick]``; results go to
``benchmarks/results/cursor_<geometry>.json``.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    Case,
    bench_spec,
    format_table,
    machine_info,
    machine_line,
    ratio,
    run_interleaved,
    write_json,
)

__all__ = ["CURSORS", "build_layout", "main", "run_geometry"]

#: The cursors compared, in the order they run; the first is the baseline of every ratio.
CURSORS = ("contiguous", "table", "scattered")

# (warmup, rounds, reps_per_round) per geometry; --quick uses _QUICK_REPS.
_REPS = {"tiny": (20, 40, 10), "medium": (5, 40, 5)}
_DEFAULT_REPS = (3, 10, 3)
_QUICK_REPS = (1, 3, 1)


def build_layout(geometry: str, dtype: str = "bfloat16") -> Any:
    """The KV layout of a one-branch example geometry with two runs (bf16 logical, stored per backend)."""
    from ardiff_jax.kv import KVLayout, default_storage_dtype

    spec = bench_spec(geometry)
    run_pages = spec.sink_frames + spec.window_frames
    return KVLayout(
        num_layers=spec.num_layers, num_pages=2 * run_pages, tokens_per_frame=spec.tokens_per_frame,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, sink_frames=spec.sink_frames,
        window_frames=spec.window_frames, frames_per_block=spec.frames_per_block, scratch_pages=1,
        dtype=dtype, storage_dtype=default_storage_dtype(dtype, jax.default_backend()),
    )


def _contiguous_pages(layout: Any, cursor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The removed ``i32[3]`` form's pages: ``(visible history pages i32[K+W-f], commit pages i32[f])``.

    ``visible_table`` with ``run_base + slot`` where the core now looks the slot up in the table.
    """
    from ardiff_jax.kv import slot_of_frame, visible_history

    f = layout.frames_per_block
    run_base, committed, visible_start = cursor[0], cursor[1], cursor[2]
    hist = visible_history(layout, committed, visible_start, f, jnp)
    index = jnp.arange(layout.run_pages, dtype=jnp.int32)
    frames = jnp.where(index < hist.num_sink, index, hist.window_start + (index - hist.num_sink))
    valid = index < hist.num_sink + hist.num_window
    pages = jnp.where(valid, run_base + slot_of_frame(layout, jnp.maximum(frames, 0), jnp), layout.null_page)
    block = run_base + slot_of_frame(layout, committed + jnp.arange(f, dtype=jnp.int32), jnp)
    return pages[:layout.run_pages - f].astype(jnp.int32), block.astype(jnp.int32)


def _step(layout: Any, pools: Any, cursor: jax.Array, k: jax.Array, v: jax.Array) -> tuple[Any, jax.Array]:
    """Commit one block, then read every layer's visible history (a float32 sum); either cursor form."""
    from ardiff_jax.kv import commit_block, cursor_block_pages, gather_pages
    from ardiff_jax.kv._attention import read_visible_history

    f = layout.frames_per_block
    if cursor.shape[-1] == 3:  # the removed contiguous form: pages by arithmetic
        history, block = _contiguous_pages(layout, cursor)
    else:
        history, block = None, cursor_block_pages(layout, cursor, f, jnp)
    # Writing first is exact (the block's pages are not visible to this cursor) and keeps the
    # pools in place: a read before the write would make XLA copy them (write_block's docstring).
    pools = commit_block(layout, pools, block, k, v)
    total = jnp.float32(0)
    for layer in range(layout.num_layers):
        if history is None:
            hk, hv, _ = read_visible_history(layout, pools, cursor, layer, f)
        else:
            hk, hv = gather_pages(layout, pools, layer, history)
        total = total + jnp.sum(hk, dtype=jnp.float32) + jnp.sum(hv, dtype=jnp.float32)
    return pools, total


_step_jit = jax.jit(_step, static_argnums=0, donate_argnums=1)


def _copy_cases(layout: Any, pools: Any, reps: tuple[int, int, int]) -> tuple[dict[str, Any], bool]:
    """One run's copy and write back: contiguous slot programs vs the same pages by table."""
    from ardiff_jax.kv import allocate_pools, gather_table_pages, read_pages, restore_pages, scatter_table_pages

    start = np.int32(layout.run_base(1))
    table = np.arange(start, start + layout.run_pages, dtype=np.int32)
    copy = read_pages(layout, pools, start, layout.run_pages)
    by_table = gather_table_pages(layout, pools, table)
    same = all(np.array_equal(np.asarray(getattr(copy, f)), np.asarray(getattr(by_table, f))) for f in ("k", "v"))
    own = {"slot": allocate_pools(layout), "table": allocate_pools(layout)}

    def restore_slot() -> Any:
        own["slot"] = restore_pages(layout, own["slot"], start, copy)
        return own["slot"]

    def restore_table() -> Any:
        own["table"] = scatter_table_pages(layout, own["table"], table, copy)
        return own["table"]

    read_slot = jax.jit(read_pages, static_argnums=(0, 3))  # jitted, as the runtime's slot copy is

    cases = [
        Case("copy: slot", lambda: read_slot(layout, pools, start, layout.run_pages)),
        Case("copy: table", lambda: gather_table_pages(layout, pools, table)),
        Case("restore: slot", restore_slot),
        Case("restore: table", restore_table),
    ]
    stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
    for p in own.values():
        p.delete()
    return stats, same


def _cursors(layout: Any, committed: int) -> dict[str, np.ndarray]:
    """The cursors of run 1 at ``committed`` frames (sliding window: visible_start 0)."""
    from ardiff_jax.kv import contiguous_table_cursor, make_table_cursor

    base = layout.run_base(1)
    table = contiguous_table_cursor(layout, base, committed, 0)
    return {
        "contiguous": table[:3].copy(),
        "table": table,
        "scattered": make_table_cursor(base, committed, 0, table[3:][::-1]),
    }


@functools.cache
def _random(shape: tuple[int, ...], dtype: str, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def run_geometry(geometry: str, *, quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Time every cursor on one geometry; returns the JSON record (also written to disk)."""
    from ardiff_jax.kv import allocate_pools

    reps = _QUICK_REPS if quick else _REPS.get(geometry, _DEFAULT_REPS)
    layout = build_layout(geometry)
    frames = layout.frames_per_block
    block = (layout.num_layers, frames * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    k, v = _random(block, layout.dtype, 0), _random(block, layout.dtype, 1)
    # Steady state: the window has wrapped, every history page is visible and holds real KV.
    committed = 2 * layout.run_pages + frames
    cursors = {name: jnp.asarray(c) for name, c in _cursors(layout, committed).items()}
    pools = {name: allocate_pools(layout) for name in CURSORS}
    for name in CURSORS:  # every slot of each pool's run written once
        for start in range(0, layout.run_pages, frames):
            pools[name], _ = _step_jit(layout, pools[name], jnp.asarray(_cursors(layout, start)[name]), k, v)

    totals: dict[str, jax.Array] = {}

    def step_case(name: str) -> Case:
        def run() -> Any:
            pools[name], totals[name] = _step_jit(layout, pools[name], cursors[name], k, v)
            return pools[name], totals[name]
        return Case(name, run)

    step = run_interleaved([step_case(name) for name in CURSORS], warmup=reps[0], rounds=reps[1],
                           reps_per_round=reps[2])
    copy, same_copy = _copy_cases(layout, pools["table"], reps)
    record = {
        "benchmark": "bench_cursor",
        "machine": machine_info(),
        "config": {"geometry": geometry, "quick": quick, "reps": reps, "layout": {
            f: getattr(layout, f) for f in ("num_layers", "num_pages", "tokens_per_frame", "num_kv_heads",
                                            "head_size", "sink_frames", "window_frames", "frames_per_block",
                                            "dtype", "storage_dtype")}},
        "step": step,
        "copy": copy,
        "ratios": {f"{name}/{CURSORS[0]}": ratio(step[name], step[CURSORS[0]]) for name in CURSORS[1:]},
        # The 10th percentiles: less moved by other work on a shared machine than the medians.
        "ratios_p10": {f"{name}/{CURSORS[0]}": step[name].p10_ms / step[CURSORS[0]].p10_ms for name in CURSORS[1:]},
        "copy_ratios": {f"{part}: table/slot": ratio(copy[f"{part}: table"], copy[f"{part}: slot"])
                        for part in ("copy", "restore")},
        "copy_ratios_p10": {f"{part}: table/slot": copy[f"{part}: table"].p10_ms / copy[f"{part}: slot"].p10_ms
                            for part in ("copy", "restore")},
        # Same pages, same bytes: every cursor's program read the same history (the same sum),
        # and the copy by table holds the slot copy's bytes.
        "checks": {"same_read": len({float(total) for total in totals.values()}) == 1, "same_copy": same_copy},
    }
    path = write_json(out_dir / f"cursor_{geometry}.json", record)
    for p in pools.values():
        p.delete()
    _print_report(record, path)
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    layout = record["config"]["layout"]
    print(f"\n== bench_cursor: {record['config']['geometry']} ({layout['num_layers']} layers, "
          f"{layout['num_kv_heads']}x{layout['head_size']}, T={layout['tokens_per_frame']}, "
          f"F={layout['frames_per_block']}, sink {layout['sink_frames']} + window {layout['window_frames']}, "
          f"{layout['dtype']}) ==")
    print(machine_line(record["machine"]))
    rows = [(name, s.median_ms, s.p10_ms, s.p90_ms, s.n) for part in ("step", "copy")
            for name, s in record[part].items()]
    print(format_table(("case", "median ms", "p10 ms", "p90 ms", "n"), rows))
    print(format_table(("ratio", "medians", "p10s"),
                       [(name, value, record["ratios_p10"][name]) for name, value in record["ratios"].items()]))
    print(format_table(("copy ratio", "medians", "p10s"), [(name, value, record["copy_ratios_p10"][name])
                                                          for name, value in record["copy_ratios"].items()]))
    print(f"  checks: {record['checks']}")
    print(f"  wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cursor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=["tiny", "medium"], help="example geometries")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    for geometry in args.geometry:
        run_geometry(geometry, quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
