"""KV core micro-benchmarks against their memory floors, side by side in one run.

What it measures, for one geometry (one branch, two session slots, measured session in
slot 1 so its run is a real sub-slice of the pools; logical dtype bf16 by default, which
XLA:CPU stores as uint16 bit patterns):

(a) **Commit** of one block (``F`` frames, all layers, K and V), steady state (window full
    and wrapping):

    * ``runtime``: ``state.get_kv_caches(...)`` (untimed) then ``state.commit_paged_context``
      (timed): the real runtime path, host bookkeeping included;
    * ``runtime_host``: the host side of that call alone (returns before the device is done);
    * ``commit_block``: the core's jitted, donated writer (``ardiff_jax.kv.commit_block``: one
      ``dynamic_update_slice`` per frame) on its own;
    * ``floor``: a donated jitted ``lax.dynamic_update_slice`` of the same bytes into a
      same-sized pool in the storage dtype (the bitcast to the storage dtype is inside, and
      free).

(b) **History read of attend** over a full window, one layer per call (rotating over layers
    so the working set is the whole run of every layer, not one layer hot in L3):

    * ``read_path``: exactly ``paged_attention``'s read (:func:`history_read`:
      ``read_visible_history``, a gather of the pages that can be visible), reduced by a
      float32 sum;
    * ``read_floor``: ``dynamic_slice`` of the same bytes from a contiguous array + the same sum;
    * ``gather``: ``gather_pages`` of the visible table in time order (the reference path),
      for context;
    * ``all_layers/*``: ``read_path`` and ``read_floor`` for all layers unrolled in one
      program (one call reads everything), where temporaries of all layers can be live at
      once.

(c) **attend** for one layer (``caches.attend``) vs ``jax.nn.dot_product_attention`` over the
    same number of dense contiguous keys (``(sink + window) * T``: history + current), for
    context only: on CPU the attention math dominates.

Run: ``python -m benchmarks.bench_kv --geometry tiny medium``. Results go to
``benchmarks/results/kv_<geometry>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import math
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
    pyplot,
    save_figure,
)

__all__ = ["KVBench", "history_read", "main", "measure_commit", "measure_read", "measure_attend", "ring_pages",
           "run_geometry"]

#: Targets from the performance issue (medians, CPU, measured side by side).
COMMIT_TARGET = 1.2
READ_TARGET = 1.3

# Repetitions per geometry: (warmup, rounds, reps_per_round). Tiny is dispatch-bound and
# cheap, so it gets more samples; medium attention costs ~10-100 ms a call.
_REPS = {
    "tiny": dict(commit=(20, 40, 10), read=(20, 40, 10), attend=(10, 20, 5)),
    "medium": dict(commit=(5, 30, 5), read=(5, 30, 5), attend=(2, 6, 2)),
}
_DEFAULT_REPS = dict(commit=(3, 10, 3), read=(3, 10, 3), attend=(1, 3, 1))


# -- the programs measured -------------------------------------------------------------------------
def history_read(layout: Any, pools: Any, cursor: jax.Array, layer: jax.Array, num_current_frames: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The history read of ``paged_attention`` (``ardiff_jax/kv/_attention.py``): the same function.

    ``read_visible_history``: a gather of the ``sink + window - f`` entries of the ordered
    visible table (the only pages that can be visible), null pages reading as zeros. The
    mask and the concatenation with the current block that follow in ``paged_attention``
    are attention math, not the read; ``tests/test_benchmarks_smoke.py`` checks that the
    core still reads this way.
    """
    from ardiff_jax.kv._attention import read_visible_history

    layer = jnp.where(jnp.asarray(layer) < 0, jnp.asarray(layer) + layout.num_layers, layer)
    k, v, _ = read_visible_history(layout, pools, cursor, layer, num_current_frames)
    return k, v


def ring_pages(layout: Any, run_base: int, committed: int, num_frames: int) -> np.ndarray:
    """Pages a commit of ``num_frames`` frames at ``committed`` writes in a run on its home pages (host numpy).

    The core's slot rule (``slot_of_frame``: the sink slots, then the ring) written out here rather
    than imported: ``compare_revisions`` runs this benchmark against older trees too, which
    predate the core's table-cursor helpers. ``tests/test_benchmarks_smoke.py`` checks it against
    ``cursor_block_pages`` of the same run.
    """
    sink, window = layout.sink_frames, layout.window_frames
    frames = committed + np.arange(num_frames)
    slots = np.where(frames < sink, frames, sink + (frames - sink) % window)
    return (run_base + slots).astype(np.int32)


def _floor_write(layout: Any, pools: Any, start: jax.Array, k: jax.Array, v: jax.Array) -> Any:
    """Write floor: one DUS per pool of the block's bytes (bitcast to the storage dtype is free)."""
    from ardiff_jax.kv import KVPools, to_storage

    shape = (layout.num_layers, k.shape[1] // layout.tokens_per_frame, layout.tokens_per_frame,
             layout.num_kv_heads, layout.head_size)

    def write(pool: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(pool, to_storage(layout, x.reshape(shape)), (0, start, 0, 0, 0))

    return KVPools(k=write(pools.k, k), v=write(pools.v, v))


def _read_path(layout: Any, pools: Any, cursor: jax.Array, layer: jax.Array) -> jax.Array:
    """``paged_attention``'s history read, reduced by a float32 sum in the same program.

    The reduction stands for attention's first consumer: in the compiled ``attend`` the
    slice, page mask and bitcast fuse into the fusion that lays the keys out for the score
    einsum (``results/hlo/<geometry>/attend.hlo.txt``: a ``transpose_copy_fusion`` whose
    operands are the pool, the cursor and the layer), so the read is never a separate pass.
    """
    k, v = history_read(layout, pools, cursor, layer, layout.frames_per_block)
    return jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)


def _read_floor(layout: Any, contiguous_k: jax.Array, contiguous_v: jax.Array, layer: jax.Array) -> jax.Array:
    """Read floor: the same bytes from a contiguous ``[L, N, H, D]`` storage array, same sum."""
    from ardiff_jax.kv import from_storage

    sizes = (1,) + contiguous_k.shape[1:]

    def read(x: jax.Array) -> jax.Array:
        return jnp.sum(from_storage(layout, jax.lax.dynamic_slice(x, (layer, 0, 0, 0), sizes)), dtype=jnp.float32)

    return read(contiguous_k) + read(contiguous_v)


def _read_gather(layout: Any, pools: Any, cursor: jax.Array, layer: jax.Array) -> jax.Array:
    """Ordered gather of the visible pages (the reference path), same sum."""
    from ardiff_jax.kv import gather_pages, visible_table

    pages, _ = visible_table(layout, cursor, layout.frames_per_block, jnp)
    k, v = gather_pages(layout, pools, layer, pages)
    return jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)


def _all_layers(read_layer: Any) -> Any:
    """All layers' reads unrolled in ONE program, as a model jit without a layer scan has them.

    XLA may then schedule every layer's read before any reduction, so all per-layer
    temporaries are live at once; when they pass 32 MiB (glibc's largest mmap threshold)
    every execution mmaps them afresh and the kernel zeroes each page again. This is where
    the old bf16 token mask cost 1.8x the floor (README, *Findings*).
    """
    def read(layout: Any, *args: Any) -> jax.Array:
        return sum(read_layer(layout, *args, layer) for layer in range(layout.num_layers))

    return jax.jit(read, static_argnums=0)


_floor_write_jit = jax.jit(_floor_write, static_argnums=0, donate_argnums=1)
_read_path_jit = jax.jit(_read_path, static_argnums=0)
_read_floor_jit = jax.jit(_read_floor, static_argnums=0)
_read_gather_jit = jax.jit(_read_gather, static_argnums=0)
_read_path_all = _all_layers(_read_path)
_read_floor_all = _all_layers(_read_floor)


# -- the benchmark -----------------------------------------------------------------------------------
class KVBench:
    """One geometry's runtime, its measured session and the block it commits."""

    def __init__(self, geometry: str, *, dtype: str = "bfloat16", window_frames: int | None = None,
                 seed: int = 0) -> None:
        from ardiff_jax.runtime import ARDiffusionKVCache

        self.geometry = geometry
        self.spec = bench_spec(geometry, window_frames=window_frames, session_capacity=2)
        # An explicit budget: the plan is exact arithmetic, so this only needs to fit 2 sessions.
        self.cache = ARDiffusionKVCache(self.spec, dtype=dtype, available_memory_bytes=64 * 2**30,
                                        gpu_memory_fraction=1.0)
        self.layout = layout = self.cache.layout
        # Slot 0 holds an idle session, so the measured run does not start at page 0.
        self._idle = self.cache.create_state("idle")
        self.state = self.cache.create_state("measured")
        self.branch = "main"
        self.frames = layout.frames_per_block
        self.seq_len = self.frames * layout.tokens_per_frame
        rng = np.random.default_rng(seed)
        shape = (layout.num_layers, self.seq_len, layout.num_kv_heads, layout.head_size)
        self.k = jnp.asarray(rng.standard_normal(shape, np.float32), layout.dtype)
        self.v = jnp.asarray(rng.standard_normal(shape, np.float32), layout.dtype)
        self.run_base = self.state._run_base(0)  # noqa: SLF001 - the benchmark mirrors the runtime's pages
        # Blocks to fill sink + window and wrap the ring at least once.
        self.fill_blocks = math.ceil(layout.run_pages / self.frames) + 2

    def runtime_commit(self) -> None:
        self.state.get_kv_caches(self.branch, seq_len=self.seq_len, commit_current=True)
        self.state.commit_paged_context(self.branch, kv=(self.k, self.v))

    def describe(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "geometry": self.geometry,
            "layout": {f: getattr(layout, f) for f in (
                "num_layers", "num_pages", "tokens_per_frame", "num_kv_heads", "head_size", "sink_frames",
                "window_frames", "frames_per_block", "dtype", "storage_dtype")},
            "block_bytes": 2 * layout.num_layers * self.seq_len * layout.num_kv_heads * layout.head_size
                           * layout.itemsize,
            "run_bytes_per_layer": 2 * layout.run_pages * layout.tokens_per_frame * layout.num_kv_heads
                                   * layout.head_size * layout.itemsize,
            "pool_bytes": layout.pool_bytes,
            "branches": 1,
        }


def _memory(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    return {"temp_bytes": int(ma.temp_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes),
            "argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes)}


def _hlo_facts(name: str, compiled: Any, dump_dir: Path | None) -> dict[str, Any]:
    """Memory analysis plus the HLO ops that explain a gap (transposes, scatters, f32 widening)."""
    text = compiled.as_text()
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / f"{name}.hlo.txt").write_text(text)
    facts: dict[str, Any] = _memory(compiled)
    facts["ops"] = {op: text.count(f" {op}(") for op in ("scatter", "transpose", "dynamic-update-slice",
                                                         "dynamic-slice", "convert", "gather", "copy")}
    return facts


def measure_commit(bench: KVBench, reps: tuple[int, int, int], dump_dir: Path | None = None
                   ) -> tuple[dict[str, Stats], dict[str, Any]]:
    """Commit one block: runtime path, the core's ``commit_block`` alone, and the DUS floor."""
    from ardiff_jax.kv import allocate_pools, commit_block

    layout, frames = bench.layout, bench.frames
    for _ in range(bench.fill_blocks):
        bench.runtime_commit()
    bench.cache.block_until_ready()

    # Raw writers get their own pools of the same size and follow the same ring pages.
    own = {name: allocate_pools(layout) for name in ("commit_block", "floor")}
    committed = {name: bench.fill_blocks * frames for name in own}

    def pages_for(name: str) -> np.ndarray:
        pages = ring_pages(layout, bench.run_base, committed[name], frames)
        committed[name] += frames
        return pages

    def raw(name: str, fn: Any) -> Any:
        def step() -> Any:
            own[name] = fn(layout, own[name], pages_for(name), bench.k, bench.v)
            return own[name]
        return step

    def floor_step() -> Any:
        # Same bytes into a same-sized pool; start clamped so the block always fits.
        start = np.int32(min(int(pages_for("floor")[0]), layout.num_pages - frames))
        own["floor"] = _floor_write_jit(layout, own["floor"], start, bench.k, bench.v)
        return own["floor"]

    def runtime_setup() -> Any:
        return bench.state.get_kv_caches(bench.branch, seq_len=bench.seq_len, commit_current=True)

    def runtime_run() -> Any:
        bench.state.commit_paged_context(bench.branch, kv=(bench.k, bench.v))
        return bench.cache.pools

    cases = [
        Case("runtime", runtime_run, setup=runtime_setup),
        Case("runtime_host", runtime_run, setup=runtime_setup, sync_output=False),
        Case("commit_block", raw("commit_block", commit_block)),
        Case("floor", floor_step),
    ]
    stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])

    sample_pages = ring_pages(layout, bench.run_base, 0, frames)
    facts = {
        "commit_block": _hlo_facts("commit_block", commit_block.lower(
            layout, own["commit_block"], sample_pages, bench.k, bench.v).compile(), dump_dir),
        "floor": _hlo_facts("commit_floor", _floor_write_jit.lower(
            layout, own["floor"], np.int32(0), bench.k, bench.v).compile(), dump_dir),
    }
    for pools in own.values():
        pools.delete()
    return stats, facts


def measure_read(bench: KVBench, reps: tuple[int, int, int], dump_dir: Path | None = None
                 ) -> tuple[dict[str, Stats], dict[str, Any]]:
    """The read part of attend over a full window vs reading the same bytes contiguously."""
    layout = bench.layout
    caches = bench.state.get_kv_caches(bench.branch, seq_len=bench.seq_len, commit_current=False)
    pools, cursor = caches.pools, caches.cursor
    run_tokens = layout.run_pages * layout.tokens_per_frame
    rng = np.random.default_rng(1)
    contiguous_shape = (layout.num_layers, run_tokens, layout.num_kv_heads, layout.head_size)
    bits = np.iinfo(np.uint16).max if layout.storage_dtype == "uint16" else None

    def contiguous() -> jax.Array:
        if bits is not None:  # random bf16 bit patterns would include NaNs; use real values
            values = jnp.asarray(rng.standard_normal(contiguous_shape, np.float32), layout.dtype)
            return jax.lax.bitcast_convert_type(values, jnp.dtype(layout.storage_dtype))
        return jnp.asarray(rng.standard_normal(contiguous_shape, np.float32), layout.storage_dtype)

    contiguous_k, contiguous_v = contiguous(), contiguous()
    num_layers = layout.num_layers

    def rotating(fn: Any, *args: Any) -> Any:
        # A new layer every call: the working set is every layer's run, like a forward.
        counter = [0]

        def step() -> Any:
            layer = np.int32(counter[0] % num_layers)
            counter[0] += 1
            return fn(layout, *args, layer)
        return step

    cases = [
        Case("read_path", rotating(_read_path_jit, pools, cursor)),
        Case("read_floor", rotating(_read_floor_jit, contiguous_k, contiguous_v)),
        Case("gather", rotating(_read_gather_jit, pools, cursor)),
        Case("all_layers/read_path", lambda: _read_path_all(layout, pools, cursor)),
        Case("all_layers/read_floor", lambda: _read_floor_all(layout, contiguous_k, contiguous_v)),
    ]
    stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
    # The contiguous masked read must see exactly the visible frames: its sum equals the
    # ordered gather's (same values, another summation order) for every layer.
    path_sums = [float(_read_path_jit(layout, pools, cursor, np.int32(i))) for i in range(num_layers)]
    gather_sums = [float(_read_gather_jit(layout, pools, cursor, np.int32(i))) for i in range(num_layers)]
    layer0 = np.int32(0)
    facts = {
        "read_path": _hlo_facts("read_path", _read_path_jit.lower(layout, pools, cursor, layer0).compile(), dump_dir),
        "read_floor": _hlo_facts("read_floor", _read_floor_jit.lower(
            layout, contiguous_k, contiguous_v, layer0).compile(), dump_dir),
        "all_layers/read_path": _hlo_facts("read_path_all_layers", _read_path_all.lower(
            layout, pools, cursor).compile(), dump_dir),
        "all_layers/read_floor": _hlo_facts("read_floor_all_layers", _read_floor_all.lower(
            layout, contiguous_k, contiguous_v).compile(), dump_dir),
        "read_path_matches_gather": bool(np.allclose(path_sums, gather_sums, rtol=1e-3, atol=1e-2)),
    }
    return stats, facts


def measure_attend(bench: KVBench, reps: tuple[int, int, int], dump_dir: Path | None = None
                   ) -> tuple[dict[str, Stats], dict[str, Any]]:
    """``caches.attend`` for one layer vs dense ``dot_product_attention`` over as many contiguous keys."""
    from ardiff_jax.kv import paged_attention

    # The default backend's kernel, jitted as PagedKVCaches.attend jits it (public name: works on older trees too).
    paged_attention_jit = jax.jit(paged_attention, static_argnums=0)

    layout = bench.layout
    caches = bench.state.get_kv_caches(bench.branch, seq_len=bench.seq_len, commit_current=False)
    heads, size = layout.num_kv_heads, layout.head_size
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((bench.seq_len, heads, size), np.float32), layout.dtype)
    k_cur, v_cur = bench.k[0], bench.v[0]
    dense_len = layout.run_pages * layout.tokens_per_frame  # sink + window frames, current included
    dense = [
        tuple(jnp.asarray(rng.standard_normal((1, dense_len, heads, size), np.float32), layout.dtype)
              for _ in range(2))
        for _ in range(layout.num_layers)
    ]
    dpa = jax.jit(jax.nn.dot_product_attention)
    num_layers = layout.num_layers
    counters = {"attend": 0, "dense": 0}

    def attend_step() -> Any:
        layer = counters["attend"] % num_layers
        counters["attend"] += 1
        return caches.attend(layer, q, k_cur, v_cur)

    def dense_step() -> Any:
        layer = counters["dense"] % num_layers
        counters["dense"] += 1
        k, v = dense[layer]
        return dpa(q[None], k, v)

    cases = [Case("attend", attend_step), Case("dense_dpa", dense_step)]
    stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
    facts = {
        "dense_keys": dense_len,
        "attend_keys_scored": dense_len + bench.seq_len,
        "queries": bench.seq_len,
        "attend": _hlo_facts("attend", paged_attention_jit.lower(
            layout, caches.pools, caches.cursor, np.int32(0), q, k_cur, v_cur, None, None).compile(), dump_dir),
        "dense_dpa": _hlo_facts("dense_dpa", dpa.lower(q[None], *dense[0]).compile(), dump_dir),
    }
    return stats, facts


def run_geometry(geometry: str, *, dtype: str = "bfloat16", window_frames: int | None = None,
                 quick: bool = False, skip_attend: bool = False, dump_hlo: bool = False,
                 out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """All three measurements for one geometry; returns the JSON record (also written to disk)."""
    reps = _REPS.get(geometry, _DEFAULT_REPS)
    if quick:
        reps = _DEFAULT_REPS
    dump_dir = out_dir / "hlo" / geometry if dump_hlo else None
    bench = KVBench(geometry, dtype=dtype, window_frames=window_frames)
    commit, commit_facts = measure_commit(bench, reps["commit"], dump_dir)
    read, read_facts = measure_read(bench, reps["read"], dump_dir)
    attend: dict[str, Stats] = {}
    attend_facts: dict[str, Any] = {}
    if not skip_attend:
        attend, attend_facts = measure_attend(bench, reps["attend"], dump_dir)

    ratios = {
        "commit_block/floor": ratio(commit["commit_block"], commit["floor"]),
        "runtime/floor": ratio(commit["runtime"], commit["floor"]),
        "read_path/read_floor": ratio(read["read_path"], read["read_floor"]),
        "gather/read_floor": ratio(read["gather"], read["read_floor"]),
        "all_layers: read_path/read_floor": ratio(read["all_layers/read_path"], read["all_layers/read_floor"]),
    }
    if attend:
        ratios["attend/dense_dpa"] = ratio(attend["attend"], attend["dense_dpa"])
    targets = {
        "commit_block <= 1.2x write floor": ratios["commit_block/floor"] <= COMMIT_TARGET,
        "runtime commit <= 1.2x write floor": ratios["runtime/floor"] <= COMMIT_TARGET,
        "attend read path <= 1.3x read floor": ratios["read_path/read_floor"] <= READ_TARGET,
        "attend read path, all layers in one program, <= 1.3x read floor":
            ratios["all_layers: read_path/read_floor"] <= READ_TARGET,
    }
    record = {
        "benchmark": "bench_kv",
        "machine": machine_info(),
        "config": {**bench.describe(), "reps": reps, "quick": quick},
        "commit": commit,
        "read": read,
        "attend": attend,
        "ratios": ratios,
        "targets": targets,
        "hlo": {"commit": commit_facts, "read": read_facts, "attend": attend_facts},
    }
    path = write_json(out_dir / f"kv_{geometry}.json", record)
    _plot(record, out_dir / f"kv_{geometry}.png")
    _print_report(record, path)
    bench.cache.close()
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    config = record["config"]
    layout = config["layout"]
    print(f"\n== bench_kv: {config['geometry']} ({layout['num_layers']} layers, {layout['num_kv_heads']}x"
          f"{layout['head_size']}, T={layout['tokens_per_frame']}, F={layout['frames_per_block']}, "
          f"sink {layout['sink_frames']} + window {layout['window_frames']}, {layout['dtype']} stored as "
          f"{layout['storage_dtype']}; block {config['block_bytes'] / 2**20:.2f} MiB) ==")
    print(machine_line(record["machine"]))
    rows = []
    for section in ("commit", "read", "attend"):
        for name, s in record[section].items():
            rows.append((section, name, s.median_ms, s.p10_ms, s.p90_ms, s.n, s.page_faults))
    print(format_table(("part", "case", "median ms", "p10 ms", "p90 ms", "n", "page faults"), rows))
    print(format_table(("ratio (medians)", "value"), list(record["ratios"].items())))
    for target, ok in record["targets"].items():
        print(f"  target {target}: {'HOLDS' if ok else 'MISSED'}")
    print(f"  wrote {path}")


def _plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:  # matplotlib is the optional bench extra
        return
    sections = [s for s in ("commit", "read", "attend") if record[s]]
    fig, axes = plt.subplots(1, len(sections), figsize=(4.5 * len(sections), 3.8))
    axes = np.atleast_1d(axes)
    for ax, section in zip(axes, sections):
        names = list(record[section])
        med = np.array([record[section][n].median_ms for n in names])
        lo = med - np.array([record[section][n].p10_ms for n in names])
        hi = np.array([record[section][n].p90_ms for n in names]) - med
        ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("ms (median, p10-p90)")
        ax.set_title(section)
    config = record["config"]
    fig.suptitle(f"bench_kv {config['geometry']} ({config['layout']['dtype']}); "
                 f"{machine_line(record['machine'])}", fontsize=8)
    save_figure(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=["tiny", "medium"],
                        help="example geometries (default: tiny medium); one branch is benchmarked")
    parser.add_argument("--dtype", default="bfloat16", help="logical KV dtype (default bfloat16)")
    parser.add_argument("--window", type=int, default=None, help="override window_frames")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument("--skip-attend", action="store_true", help="skip the attention context measurement")
    parser.add_argument("--dump-hlo", action="store_true", help="write optimized HLO to results/hlo/<geometry>/")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    for geometry in args.geometry:
        run_geometry(geometry, dtype=args.dtype, window_frames=args.window, quick=args.quick,
                     skip_attend=args.skip_attend, dump_hlo=args.dump_hlo, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
