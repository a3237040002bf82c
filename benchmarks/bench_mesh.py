"""Commit and attend time vs shard count: the KV core on a ``tp x cfg`` mesh of CPU host devices.

A **proxy**, not a GPU measurement: XLA's host platform is split into 8 virtual devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) that share this machine's cores,
so a mesh does not add compute; what the numbers show is the cost of the sharded programs
themselves (per-shard work in ``shard_map``, the ``cfg`` exchange of the attention output,
dispatch over more devices) next to the unsharded ones, and that each device holds
``1 / (tp * cfg)`` of the pools. ``main`` re-runs itself in a subprocess with that flag
when it is missing.

For one geometry (one branch, two session slots: ``bench_spec(..., session_capacity=2)``)
and each mesh (none, tp=2, tp=4, cfg=2, tp=2 x cfg=2), side by side in one interleaved run:

* ``commit``: one donated commit of a block (``F`` frames, all layers, K and V) into the
  session in slot 1, steady state (window full and wrapping): ``ardiff_jax.kv.commit_block``
  without a mesh, ``jax.jit(sharded_write_block, static_argnums=(0, 1), donate_argnums=2)``
  on one;
* ``attend``: one layer of attention over a full window (sink + window history + the
  current block), rotating over the layers: the ``"xla"`` backend (``paged_attention``,
  jitted) without a mesh, ``sharded_attention`` with that backend on one. With ``cfg > 1``
  only one group holds the session's run, the others compute on their own pages and the
  groups sum the attention output;
* ``attend_2_branches``: the same attention ``jax.vmap``-ed over two runs (slots 0 and 1), the
  shape of a CFG step that attends both branches in one call. With ``cfg=2`` the batch axis
  maps onto the two groups (each attends its own branch, nothing is exchanged); other
  meshes attend the branches one after the other.
* ``slot_copy``: a device copy of slot 1's run, what host offload and session files read:
  ``read_pages`` without a mesh, ``sharded_read_runs`` on one (each group reads the runs
  it holds; with ``cfg > 1`` a reduce-scatter leaves each device its share of the copy);
* ``slot_restore``: that copy written back in place (donated): ``restore_pages`` /
  ``sharded_write_runs`` (with ``cfg > 1`` the copy's layers are gathered first).

Every mesh's attention output is compared with the unsharded one (same blocks committed).
Ratios are medians against the unsharded case of the same run.

Run: ``nice -n 19 python -m benchmarks.bench_mesh`` (``--smoke``: a 4-head ``tiny``
geometry, one repetition). Results go to ``benchmarks/results/mesh_<geometry>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ardiff_jax.kv import (
    KVPools,
    KVSharding,
    advance_cursor,
    allocate_pools,
    attention_backend,
    commit_block,
    contiguous_table_cursor,
    cursor_block_pages,
    read_pages,
    restore_pages,
    shard_zeros,
    sharded_attention,
    sharded_read_runs,
    sharded_write_block,
    sharded_write_runs,
)
from ardiff_jax.runtime import ARDiffusionKVCache, plan_memory
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

__all__ = ["MESHES", "main", "run"]

#: Virtual host devices the benchmark runs on.
NUM_DEVICES = 8
DEVICE_FLAG = f"--xla_force_host_platform_device_count={NUM_DEVICES}"

#: ``(tp, cfg)`` of each mesh; ``(1, 1)`` is the unsharded baseline (no mesh at all).
MESHES: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))

PROXY_NOTE = (f"CPU proxy: {NUM_DEVICES} virtual XLA host devices share this machine's cores, so sharding adds "
              "no compute here; the ratios show the sharded programs' own overhead, not a GPU speed-up")

# (warmup, rounds, reps_per_round) per measurement.
_REPS = {"commit": (3, 20, 5), "attend": (2, 8, 2), "attend_2_branches": (1, 6, 1), "slot_copy": (2, 10, 3),
         "slot_restore": (2, 10, 3)}
_SMOKE_REPS = {name: (1, 1, 1) for name in _REPS}


def _label(tp: int, cfg: int) -> str:
    if (tp, cfg) == (1, 1):
        return "none"
    return " x ".join(part for part, size in ((f"tp={tp}", tp), (f"cfg={cfg}", cfg)) if size > 1)


def _spec(geometry: str, smoke: bool) -> Any:
    if smoke:
        # tiny has 2 KV heads; 4 let tp=4 divide them.
        return dataclasses.replace(bench_spec("tiny", session_capacity=2), num_kv_heads=4), "smoke"
    return bench_spec(geometry, session_capacity=2), geometry


class MeshCase:
    """One mesh's pools (the same blocks committed as every other mesh's) and its jitted programs."""

    def __init__(self, layout: Any, tp: int, cfg: int) -> None:
        self.layout, self.tp, self.cfg = layout, tp, cfg
        self.label = _label(tp, cfg)
        backend = attention_backend("xla")  # paged_attention, jitted with the layout static
        if (tp, cfg) == (1, 1):
            self.sharding = None
            self.pools = allocate_pools(layout)
            self.commit = functools.partial(commit_block, layout)
            single = functools.partial(backend, layout)
            copy = jax.jit(read_pages, static_argnums=(0, 3))
            self._copy = lambda pools, start: copy(layout, pools, start[0], layout.run_pages)
            self._restore = lambda pools, start, pages: restore_pages(layout, pools, start[0], pages)
        else:
            devices = np.array(jax.devices()[: tp * cfg]).reshape(cfg, tp)
            self.sharding = sharding = KVSharding(Mesh(devices, ("cfg", "tp")))
            where = sharding.pool_sharding
            self.pools = KVPools(k=shard_zeros(layout.pool_shape, layout.storage_dtype, where),
                                 v=shard_zeros(layout.pool_shape, layout.storage_dtype, where))
            self.commit = functools.partial(
                jax.jit(sharded_write_block, static_argnums=(0, 1), donate_argnums=2), layout, sharding)
            single = functools.partial(sharded_attention, backend, layout, sharding)
            self._copy = functools.partial(jax.jit(sharded_read_runs, static_argnums=(0, 1)), layout, sharding)
            self._restore = functools.partial(
                jax.jit(sharded_write_runs, static_argnums=(0, 1), donate_argnums=2), layout, sharding)
        self._attend = jax.jit(single)
        # Two branches' runs in one call: cursor, queries and current K/V carry the branch axis.
        self._attend_branches = jax.jit(jax.vmap(single, in_axes=(None, 0, None, 0, 0, 0)))

    def place_heads(self, x: Any) -> Any:
        """``[..., H, D]`` arrays (blocks, queries): on the first device, or heads split over ``tp``."""
        if self.sharding is None:
            return jax.device_put(x, jax.devices()[0])
        return jax.device_put(x, self.sharding.heads_sharding(x.ndim))

    def write(self, pages: np.ndarray, k: Any, v: Any) -> Any:
        self.pools = self.commit(self.pools, pages, k, v)
        return self.pools

    def attend(self, cursor: np.ndarray, layer: np.int32, q: Any, k: Any, v: Any) -> Any:
        return self._attend(self.pools, cursor, layer, q, k, v)

    def attend_branches(self, cursors: np.ndarray, layer: np.int32, q: Any, k: Any, v: Any) -> Any:
        return self._attend_branches(self.pools, cursors, layer, q, k, v)

    def copy_slot(self, run_starts: np.ndarray) -> KVPools:
        return self._copy(self.pools, run_starts)

    def restore_slot(self, run_starts: np.ndarray, pages: KVPools) -> KVPools:
        self.pools = self._restore(self.pools, run_starts, pages)
        return self.pools

    def pool_bytes_per_device(self) -> int:
        """Both pools' bytes on the first device (measured from its shard, not computed)."""
        return int(sum(x.addressable_shards[0].data.nbytes for x in (self.pools.k, self.pools.v)))


def run(geometry: str = "medium", *, smoke: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """Every mesh's commit and attend, interleaved; returns the JSON record (also written to disk)."""
    if len(jax.devices()) < NUM_DEVICES:
        raise RuntimeError(f"bench_mesh needs {NUM_DEVICES} devices, jax has {len(jax.devices())}: "
                           f"set XLA_FLAGS={DEVICE_FLAG} before jax starts (main() does)")
    spec, name = _spec(geometry, smoke)
    reps = _SMOKE_REPS if smoke else _REPS
    # The runtime's own layout for two slots (its pools are not used: each mesh allocates its own).
    cache = ARDiffusionKVCache(spec, dtype="bfloat16", available_memory_bytes=64 * 2**30, gpu_memory_fraction=1.0)
    layout = cache.layout
    cache.close()
    cases = [MeshCase(layout, tp, cfg) for tp, cfg in MESHES]

    frames, tokens = layout.frames_per_block, layout.tokens_per_frame
    seq_len = frames * tokens
    rng = np.random.default_rng(0)
    block_shape = (layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)

    def block() -> tuple[Any, Any]:
        return tuple(jnp.asarray(rng.standard_normal(block_shape, np.float32), layout.dtype) for _ in range(2))

    # Fill both slots' runs past a full window (the ring wraps) with the same blocks everywhere.
    cursors = [contiguous_table_cursor(layout, layout.run_base(slot), 0, 0) for slot in (0, 1)]
    fill_blocks = -(-layout.run_pages // frames) + 2
    for _ in range(fill_blocks):
        for slot in (0, 1):
            k, v = block()
            pages = cursor_block_pages(layout, cursors[slot], frames, np)
            for case in cases:
                case.write(pages, case.place_heads(k), case.place_heads(v))
            cursors[slot] = advance_cursor(layout, cursors[slot], frames, np)
    jax.block_until_ready([case.pools for case in cases])

    # -- commit: slot 1, continuing its ring ------------------------------------------------------
    k_block, v_block = block()
    committed = {case.label: int(cursors[1][1]) for case in cases}

    def commit_step(case: MeshCase, k: Any, v: Any) -> Any:
        def step() -> Any:
            cursor = contiguous_table_cursor(layout, layout.run_base(1), committed[case.label], 0)
            pages = cursor_block_pages(layout, cursor, frames, np)
            committed[case.label] += frames
            return case.write(pages, k, v)
        return step

    commit_cases = [Case(case.label, commit_step(case, case.place_heads(k_block), case.place_heads(v_block)))
                    for case in cases]

    # -- attend: slot 1's full window, one layer per call, rotating -----------------------------------
    heads, size = layout.num_kv_heads, layout.head_size
    q = jnp.asarray(rng.standard_normal((seq_len, heads, size), np.float32), layout.dtype)
    q2 = jnp.asarray(rng.standard_normal((2, seq_len, heads, size), np.float32), layout.dtype)
    k_cur, v_cur = k_block[0], v_block[0]
    k2, v2 = jnp.stack([k_cur, k_block[1 % layout.num_layers]]), jnp.stack([v_cur, v_block[1 % layout.num_layers]])
    cursor, both = cursors[1], np.stack(cursors)

    def rotating(fn: Any, *args: Any) -> Any:
        counter = [0]

        def step() -> Any:
            layer = np.int32(counter[0] % layout.num_layers)
            counter[0] += 1
            return fn(args[0], layer, *args[1:])
        return step

    placed = {case.label: tuple(case.place_heads(x) for x in (q, k_cur, v_cur, q2, k2, v2)) for case in cases}
    attend_cases = [Case(case.label, rotating(case.attend, cursor, *placed[case.label][:3])) for case in cases]
    branch_cases = [Case(case.label, rotating(case.attend_branches, both, *placed[case.label][3:]))
                    for case in cases]

    # -- slot copy and restore: slot 1's run (on the second cfg group where there are two) -------------
    slot_run = np.array([layout.run_pages], np.int32)
    copies = {case.label: case.copy_slot(slot_run) for case in cases}
    copy_cases = [Case(case.label, functools.partial(case.copy_slot, slot_run)) for case in cases]
    restore_cases = [Case(case.label, functools.partial(case.restore_slot, slot_run, copies[case.label]))
                     for case in cases]

    stats = {
        "commit": run_interleaved(commit_cases, warmup=reps["commit"][0], rounds=reps["commit"][1],
                                  reps_per_round=reps["commit"][2]),
        "slot_copy": run_interleaved(copy_cases, warmup=reps["slot_copy"][0], rounds=reps["slot_copy"][1],
                                     reps_per_round=reps["slot_copy"][2]),
        "slot_restore": run_interleaved(restore_cases, warmup=reps["slot_restore"][0],
                                        rounds=reps["slot_restore"][1], reps_per_round=reps["slot_restore"][2]),
        "attend": run_interleaved(attend_cases, warmup=reps["attend"][0], rounds=reps["attend"][1],
                                  reps_per_round=reps["attend"][2]),
        "attend_2_branches": run_interleaved(
            branch_cases, warmup=reps["attend_2_branches"][0], rounds=reps["attend_2_branches"][1],
            reps_per_round=reps["attend_2_branches"][2]),
    }

    # Agreement: every mesh's output against the unsharded one, same pools content, layer 0.
    # The commit loops above advanced every mesh's slot-1 ring alike, so the pools still agree.
    layer0 = np.int32(0)
    reference = np.asarray(cases[0].attend(cursor, layer0, *placed["none"][:3]), np.float32)
    reference2 = np.asarray(cases[0].attend_branches(both, layer0, *placed["none"][3:]), np.float32)
    reference_copy = np.asarray(copies["none"].k)
    results = []
    baseline = {part: stats[part]["none"] for part in stats}
    for case in cases:
        out = np.asarray(case.attend(cursor, layer0, *placed[case.label][:3]), np.float32)
        out2 = np.asarray(case.attend_branches(both, layer0, *placed[case.label][3:]), np.float32)
        plan = plan_memory(spec, dtype="bfloat16", available_memory_bytes=64 * 2**30, gpu_memory_fraction=1.0,
                           tp=case.tp, cfg=case.cfg)
        results.append({
            "mesh": case.label,
            "tp": case.tp,
            "cfg": case.cfg,
            "devices": case.tp * case.cfg,
            "pool_bytes_per_device": case.pool_bytes_per_device(),
            "slot_copy_bytes": int(copies[case.label].k.nbytes * 2),
            "slot_copy_bytes_per_device": int(sum(x.addressable_shards[0].data.nbytes
                                                  for x in (copies[case.label].k, copies[case.label].v))),
            "slot_copy_equals_unsharded_bitwise": np.asarray(copies[case.label].k).tobytes()
            == reference_copy.tobytes(),
            "planned_pool_bytes_per_device": plan.pool_bytes_per_device,
            **{part: stats[part][case.label] for part in stats},
            "ratio_to_unsharded": {part: ratio(stats[part][case.label], baseline[part]) for part in stats},
            "max_abs_diff_vs_unsharded": {"attend": float(np.max(np.abs(out - reference))),
                                          "attend_2_branches": float(np.max(np.abs(out2 - reference2)))},
        })
    record = {
        "benchmark": "bench_mesh",
        "note": PROXY_NOTE,
        "machine": machine_info(),
        "config": {
            "geometry": name,
            "smoke": smoke,
            "layout": {f: getattr(layout, f) for f in (
                "num_layers", "num_pages", "tokens_per_frame", "num_kv_heads", "head_size", "sink_frames",
                "window_frames", "frames_per_block", "dtype", "storage_dtype")},
            "block_bytes": 2 * layout.num_layers * seq_len * heads * size * layout.itemsize,
            "pool_bytes": layout.pool_bytes,
            "reps": reps,
        },
        "meshes": results,
    }
    path = write_json(out_dir / f"mesh_{name}.json", record)
    _print_report(record, path)
    for case in cases:
        case.pools.k.delete()
        case.pools.v.delete()
    return record


def _print_report(record: dict[str, Any], path: Path) -> None:
    config, layout = record["config"], record["config"]["layout"]
    print(f"\n== bench_mesh: {config['geometry']} ({layout['num_layers']} layers, {layout['num_kv_heads']}x"
          f"{layout['head_size']}, T={layout['tokens_per_frame']}, F={layout['frames_per_block']}, sink "
          f"{layout['sink_frames']} + window {layout['window_frames']}, {layout['dtype']}; block "
          f"{config['block_bytes'] / 2**20:.2f} MiB) ==")
    print(record["note"])
    print(machine_line(record["machine"]))
    rows = []
    for mesh in record["meshes"]:
        ratios = mesh["ratio_to_unsharded"]
        rows.append((mesh["mesh"], mesh["devices"], mesh["pool_bytes_per_device"] / 2**20,
                     mesh["commit"].median_ms, ratios["commit"], mesh["attend"].median_ms, ratios["attend"],
                     mesh["attend_2_branches"].median_ms, ratios["attend_2_branches"],
                     max(mesh["max_abs_diff_vs_unsharded"].values()),
                     mesh["slot_copy_bytes_per_device"] / 2**20, mesh["slot_copy"].median_ms, ratios["slot_copy"],
                     mesh["slot_restore"].median_ms, ratios["slot_restore"]))
    print(format_table(("mesh", "devices", "pool MiB/device", "commit ms", "x none", "attend ms", "x none",
                        "attend 2 br ms", "x none", "max |diff|", "copy MiB/device", "slot copy ms", "x none",
                        "restore ms", "x none"), rows))
    print(f"  wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mesh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="medium", help="example geometry (default: medium; one branch)")
    parser.add_argument("--smoke", action="store_true", help="a 4-head tiny geometry, one repetition")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    if DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        # The flag only takes effect before jax creates its CPU backend: run again in a fresh process.
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + DEVICE_FLAG).strip())
        root = Path(__file__).resolve().parents[1]
        return subprocess.run([sys.executable, "-m", "benchmarks.bench_mesh", *argv], env=env, cwd=root,
                              check=False).returncode
    run(args.geometry, smoke=args.smoke, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
