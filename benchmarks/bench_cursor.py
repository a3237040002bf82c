"""Cursor forms: does reading pages through the run's page table cost more than ``run_base + slot``?

Issue 48 asks for one cursor form, the table cursor ``i32[3+K+W]``, if the table path costs
no more than the contiguous arithmetic. This benchmark runs the same jitted program, a
forward's attention history read for every layer plus the commit of one block (donated
pools, window full and wrapping), with cursors that all name the same contiguous run
(run 1 of 2, so its pages are a real sub-slice of the pools):

* ``contiguous``: the contiguous ``i32[3]`` cursor, pages ``run_base + slot`` in the core
  (``cursor_pages``'s contiguous branch);
* ``arithmetic``: the program receives ``i32[3]`` and builds the run's table from
  ``run_base`` inside jit (``run_base + arange(K+W)``), then reads through it;
* ``table``: the table cursor the runtime passes, ``i32[3+K+W]``, its table an argument;
* ``scattered``: the same, but the run's slots sit on pages in reverse order (a forked or
  remapped run is not contiguous), so no lookup can fold into arithmetic.

And, for context, one layer of ``paged_attention`` (the history read, the current block
and the masked softmax) with the ``arithmetic`` and ``table`` cursors.

Ratios are medians of interleaved repeats in one run (``benchmarks/common.run_interleaved``).
Run: ``python -m benchmarks.bench_cursor [--geometry tiny medium] [--quick]``; results go to
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
    Stats,
    bench_spec,
    format_table,
    machine_info,
    machine_line,
    ratio,
    run_interleaved,
    write_json,
)

__all__ = ["CURSORS", "build_layout", "main", "run_geometry"]

#: The cursors compared, in the order they run.
CURSORS = ("contiguous", "arithmetic", "table", "scattered")

# (warmup, rounds, reps_per_round) per geometry and part; --quick uses _QUICK_REPS.
_REPS = {
    "tiny": {"step": (20, 40, 10), "attend": (10, 20, 5)},
    "medium": {"step": (3, 20, 3), "attend": (2, 8, 2)},
}
_DEFAULT_REPS = {"step": (3, 10, 3), "attend": (1, 4, 1)}
_QUICK_REPS = {"step": (1, 3, 1), "attend": (1, 2, 1)}


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


def _table_cursor(layout: Any, cursor: jax.Array, build_table: bool) -> jax.Array:
    """The cursor a program reads: with ``build_table``, an ``i32[3]`` cursor gets its table built from ``run_base``."""
    if not build_table or cursor.shape[-1] != 3:
        return cursor
    table = cursor[0] + jnp.arange(layout.run_pages, dtype=jnp.int32)
    return jnp.concatenate([cursor, table])


def _step(layout: Any, build_table: bool, pools: Any, cursor: jax.Array, k: jax.Array, v: jax.Array
          ) -> tuple[Any, jax.Array]:
    """Every layer's attention history read (reduced by a float32 sum), then the commit of one block."""
    from ardiff_jax.kv import commit_block, cursor_block_pages
    from ardiff_jax.kv._attention import read_visible_history

    cursor = _table_cursor(layout, cursor, build_table)
    total = jnp.float32(0)
    for layer in range(layout.num_layers):
        hk, hv, _ = read_visible_history(layout, pools, cursor, layer, layout.frames_per_block)
        total = total + jnp.sum(hk, dtype=jnp.float32) + jnp.sum(hv, dtype=jnp.float32)
    pages = cursor_block_pages(layout, cursor, layout.frames_per_block, jnp)
    return commit_block(layout, pools, pages, k, v), total


def _attend(layout: Any, build_table: bool, pools: Any, cursor: jax.Array, q: jax.Array, k: jax.Array,
            v: jax.Array) -> jax.Array:
    from ardiff_jax.kv import paged_attention

    return paged_attention(layout, pools, _table_cursor(layout, cursor, build_table), 0, q, k, v)


_step_jit = jax.jit(_step, static_argnums=(0, 1), donate_argnums=2)
_attend_jit = jax.jit(_attend, static_argnums=(0, 1))


def _cursors(layout: Any, committed: int) -> dict[str, np.ndarray]:
    """The three cursors of run 1 at ``committed`` frames (sliding window: visible_start 0)."""
    from ardiff_jax.kv import make_table_cursor

    base = layout.run_pages  # run 1
    contiguous = np.arange(base, base + layout.run_pages, dtype=np.int32)
    return {
        "contiguous": np.array([base, committed, 0], np.int32),
        "arithmetic": np.array([base, committed, 0], np.int32),
        "table": make_table_cursor(base, committed, 0, contiguous),
        "scattered": make_table_cursor(base, committed, 0, contiguous[::-1]),
    }


@functools.cache
def _random(shape: tuple[int, ...], dtype: str, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def run_geometry(geometry: str, *, quick: bool = False, skip_attend: bool = False,
                 out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Time every cursor on one geometry; returns the JSON record (also written to disk)."""
    from ardiff_jax.kv import allocate_pools

    reps = _QUICK_REPS if quick else _REPS.get(geometry, _DEFAULT_REPS)
    layout = build_layout(geometry)
    frames, tokens = layout.frames_per_block, layout.tokens_per_frame
    seq_len = frames * tokens
    block = (layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)
    k, v = _random(block, layout.dtype, 0), _random(block, layout.dtype, 1)
    # Steady state: the window has wrapped, every history page is visible and holds real KV.
    committed = 2 * layout.run_pages + frames
    cursors = {name: jnp.asarray(c) for name, c in _cursors(layout, committed).items()}
    pools = {name: allocate_pools(layout) for name in CURSORS}
    for name in CURSORS:  # fill each pool's run (all of it: every slot once)
        for start in range(0, layout.run_pages, frames):
            fill = _cursors(layout, start)[name]
            pools[name], _ = _step_jit(layout, name == "arithmetic", pools[name], jnp.asarray(fill), k, v)

    totals: dict[str, jax.Array] = {}

    def step_case(name: str) -> Case:
        def run() -> Any:
            pools[name], totals[name] = _step_jit(layout, name == "arithmetic", pools[name], cursors[name], k, v)
            return pools[name], totals[name]
        return Case(name, run)

    step = run_interleaved([step_case(name) for name in CURSORS], warmup=reps["step"][0], rounds=reps["step"][1],
                           reps_per_round=reps["step"][2])
    # Same pages, same bytes: every cursor's program read the same history (the same sum).
    same_read = len({float(total) for total in totals.values()}) == 1

    attend: dict[str, Stats] = {}
    same_attend = None
    if not skip_attend:
        q = _random((seq_len, layout.num_kv_heads, layout.head_size), layout.dtype, 2)
        k0, v0 = k[0], v[0]
        attend_pools = pools["table"]
        attended = ("contiguous", "arithmetic", "table")
        cases = [Case(name, functools.partial(_attend_jit, layout, name == "arithmetic", attend_pools, cursors[name],
                                              q, k0, v0)) for name in attended]
        attend = run_interleaved(cases, warmup=reps["attend"][0], rounds=reps["attend"][1],
                                 reps_per_round=reps["attend"][2])
        outs = [np.asarray(_attend_jit(layout, n == "arithmetic", attend_pools, cursors[n], q, k0, v0), np.float32)
                for n in attended]
        same_attend = all(np.array_equal(outs[0], out) for out in outs[1:])

    ratios = {f"step: {name}/contiguous": ratio(step[name], step["contiguous"]) for name in CURSORS[1:]}
    if attend:
        ratios.update({f"attend: {name}/contiguous": ratio(attend[name], attend["contiguous"])
                       for name in ("arithmetic", "table")})
    record = {
        "benchmark": "bench_cursor",
        "machine": machine_info(),
        "config": {"geometry": geometry, "quick": quick, "reps": reps, "layout": {
            f: getattr(layout, f) for f in ("num_layers", "num_pages", "tokens_per_frame", "num_kv_heads",
                                            "head_size", "sink_frames", "window_frames", "frames_per_block",
                                            "dtype", "storage_dtype")}},
        "step": step,
        "attend": attend,
        "ratios": ratios,
        "checks": {"same_read": same_read, "same_attend": same_attend},
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
    rows = [(part, name, s.median_ms, s.p10_ms, s.p90_ms, s.n)
            for part in ("step", "attend") for name, s in record[part].items()]
    print(format_table(("part", "cursor", "median ms", "p10 ms", "p90 ms", "n"), rows))
    print(format_table(("ratio (medians)", "value"), list(record["ratios"].items())))
    print(f"  checks: {record['checks']}")
    print(f"  wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cursor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=["tiny", "medium"], help="example geometries")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument("--skip-attend", action="store_true", help="skip the one-layer attention context")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    for geometry in args.geometry:
        run_geometry(geometry, quick=args.quick, skip_attend=args.skip_attend, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
