"""Per-block KV-cache overhead of ardiff_jax vs peer caches, over window lengths.

For each window ``W`` (default 6, 12, 24, 48 frames; sink and block from the geometry,
3 and 3 for ``medium``) every peer in :mod:`benchmarks.peers` is built, filled past the
point where its window is full and wrapping (steady state), then timed interleaved with the
others, one block per sample:

* ``commit``: commit one block of all layers (K and V) and wait for it;
* ``block``: the per-block cache overhead, i.e. that commit plus the read of the visible
  window attention would do (every layer, reduced by a float32 sum: the read without the
  attention math).

A ``floor`` line gives the memory floor of the same work: a donated ``dynamic_update_slice``
of the block into a same-sized pool plus a contiguous read of the same ``K + W`` frames.

Before timing, a correctness pass on the same geometry checks that every peer exposes the
same visible history, frame for frame, after each of the first blocks.

Run: ``python -m benchmarks.bench_peers --geometry medium``; results go to
``benchmarks/results/peers_<geometry>.json`` and ``.png``.
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
    run_interleaved,
    write_json,
    pyplot,
    save_figure,
)
from benchmarks.peers import PeerCache, PeerGeometry, available_peers, make_peer

__all__ = ["FloorCache", "check_agreement", "main", "run_geometry"]

DEFAULT_WINDOWS = (6, 12, 24, 48)
#: ardiff_jax's commit counts as constant in W when its slowest window is within this factor
#: of its fastest (medians; the machine's run-to-run noise alone is ~1.3x).
FLAT_FACTOR = 1.5

# (warmup, rounds, reps_per_round) per geometry; medium W=48 blocks cost up to ~0.1-0.3 s.
_REPS = {"tiny": (5, 20, 5), "medium": (3, 8, 3)}
_QUICK_REPS = (1, 3, 1)


class FloorCache(PeerCache):
    """Memory floor of one block's cache work: DUS write of the block + contiguous read of ``K + W`` frames."""

    name = "floor"

    def __init__(self, geometry: PeerGeometry) -> None:
        super().__init__(geometry)
        from ardiff_jax.kv import KVLayout, allocate_pools, default_storage_dtype

        g = geometry
        self.layout = KVLayout(
            num_layers=g.num_layers, num_pages=g.visible_frames, tokens_per_frame=g.tokens_per_frame,
            num_kv_heads=g.num_kv_heads, head_size=g.head_size, sink_frames=g.sink_frames,
            window_frames=g.window_frames, frames_per_block=g.frames_per_block, scratch_pages=g.frames_per_block,
            dtype=g.dtype, storage_dtype=default_storage_dtype(g.dtype, jax.default_backend()),
        )
        self.pools = allocate_pools(self.layout)
        self.slot = 0
        # The read floor: the same K + W frames of every layer as one contiguous array per K
        # and V in the logical dtype, handed to the shared reduction as they are (no copy).
        shape = (g.num_layers, g.visible_frames * g.tokens_per_frame, g.num_kv_heads, g.head_size)
        self.read_k = jnp.zeros(shape, g.dtype)
        self.read_v = jnp.zeros(shape, g.dtype)

    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        dtype = jnp.dtype(self.geometry.dtype)
        return jnp.asarray(k, dtype), jnp.asarray(v, dtype)

    def commit_block(self, k: Any, v: Any) -> None:
        from benchmarks.bench_kv import _floor_write_jit

        g = self.geometry
        start = g.sink_frames + self.slot * g.frames_per_block
        self.slot = (self.slot + 1) % (g.window_frames // g.frames_per_block or 1)
        start = min(start, g.visible_frames - g.frames_per_block)
        self.pools = _floor_write_jit(self.layout, self.pools, np.int32(start), k, v)

    def read_visible(self) -> Any:
        from benchmarks.peers import sum_f32

        return sum_f32(self.read_k, self.read_v)

    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:  # not a cache: no history order
        raise NotImplementedError

    def sync(self, out: Any = None) -> None:
        jax.block_until_ready((self.pools, out) if out is not None else self.pools)

    def close(self) -> None:
        self.pools.delete()
        self.read_k.delete()
        self.read_v.delete()


# -- correctness: every peer must expose the same history ------------------------------------------
def check_agreement(geometry: PeerGeometry, peers: list[str], num_blocks: int | None = None) -> dict[str, Any]:
    """Commit the same blocks to every peer; compare each peer's visible history with ardiff_jax's."""
    g = geometry
    if num_blocks is None:
        num_blocks = math.ceil(g.visible_frames / g.frames_per_block) + 3  # fill, then wrap
    built = [make_peer(name, g) for name in peers]
    mismatches: list[str] = []
    try:
        for b in range(num_blocks):
            values = built[0].block_values(seed=1000 + b)
            for peer in built:
                peer.commit_block(*peer.from_numpy(*values))
            for layer in (0, g.num_layers - 1):
                ref_k, ref_v = built[0].visible_kv(layer)
                for peer in built[1:]:
                    k, v = peer.visible_kv(layer)
                    if k.shape != ref_k.shape or not (np.array_equal(k, ref_k) and np.array_equal(v, ref_v)):
                        mismatches.append(f"{peer.name} block {b} layer {layer}: {k.shape} vs {ref_k.shape}")
    finally:
        for peer in built:
            peer.close()
    return {"peers": peers, "blocks": num_blocks, "ok": not mismatches, "mismatches": mismatches[:10]}


# -- timing ----------------------------------------------------------------------------------------
def _cases(peer: PeerCache, block: tuple[Any, Any]) -> list[Case]:
    k, v = block

    def commit() -> None:
        peer.commit_block(k, v)
        peer.sync()

    def commit_and_read() -> Any:
        peer.commit_block(k, v)
        out = peer.read_visible()
        peer.sync(out)
        return out

    group = "torch" if peer.name.startswith("selfforcing_torch") else "jax"
    return [Case(f"{peer.name}/commit", commit, group=group), Case(f"{peer.name}/block", commit_and_read, group=group)]


def measure_window(geometry: PeerGeometry, peers: list[str], reps: tuple[int, int, int]) -> dict[str, dict[str, Stats]]:
    """Steady-state per-block timings of every peer (and the floor) at one window length."""
    built: list[PeerCache] = [make_peer(name, geometry) for name in peers] + [FloorCache(geometry)]
    try:
        fill = math.ceil(geometry.visible_frames / geometry.frames_per_block) + 2
        cases: list[Case] = []
        for peer in built:
            block = peer.make_block(seed=7)
            for _ in range(fill):  # naive_jax compiles once per length here, not while timed
                peer.commit_block(*block)
            peer.sync(peer.read_visible())
            cases += _cases(peer, block)
        # Runtimes grouped (JAX peers, then torch peers) so each round switches runtime twice.
        cases.sort(key=lambda case: case.group != "jax")
        stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
    finally:
        for peer in built:
            peer.close()
    out: dict[str, dict[str, Stats]] = {}
    for key, s in stats.items():
        name, part = key.split("/")
        out.setdefault(name, {})[part] = s
    return out


def _judge(results: dict[int, dict[str, dict[str, Stats]]]) -> dict[str, Any]:
    windows = sorted(results)
    ours = "ardiff_jax"
    verdict: dict[str, Any] = {}
    for part in ("commit", "block"):
        medians = [results[w][ours][part].median_ms for w in windows]
        verdict[f"{ours} {part}: slowest/fastest window"] = max(medians) / min(medians)
        verdict[f"{ours} {part} constant in W (<= {FLAT_FACTOR}x)"] = max(medians) / min(medians) <= FLAT_FACTOR
        beaten = {}
        for w in windows:
            others = {n: s[part].median_ms for n, s in results[w].items() if n not in (ours, "floor")}
            beaten[w] = sorted(n for n, m in others.items() if m <= results[w][ours][part].median_ms)
        verdict[f"{ours} {part} below every peer"] = all(not b for b in beaten.values())
        verdict[f"{ours} {part}: peers at or below it, per W"] = beaten
        verdict[f"{ours} {part} / floor, per W"] = {
            w: results[w][ours][part].median_ms / results[w]["floor"][part].median_ms for w in windows}
        # The overhead proper: what ardiff_jax costs above the memory floor of the same work
        # (the floor's own read of the window grows with W, as any implementation's must).
        verdict[f"{ours} {part} - floor {part}, per W (ms)"] = {
            w: results[w][ours][part].median_ms - results[w]["floor"][part].median_ms for w in windows}
    return verdict


def run_geometry(geometry: str, *, windows: tuple[int, ...] = DEFAULT_WINDOWS, peers: list[str] | None = None,
                 dtype: str = "bfloat16", quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    peers = peers or available_peers()
    if peers[0] != "ardiff_jax":
        peers = ["ardiff_jax"] + [p for p in peers if p != "ardiff_jax"]
    reps = _QUICK_REPS if quick else _REPS.get(geometry, _QUICK_REPS)
    base = bench_spec(geometry)
    results: dict[int, dict[str, dict[str, Stats]]] = {}
    checks: dict[int, Any] = {}
    for window in windows:
        g = PeerGeometry.from_spec(bench_spec(geometry, window_frames=window), dtype=dtype)
        checks[window] = check_agreement(g, peers)
        print(f"  {geometry} W={window}: peers agree: {checks[window]['ok']}", flush=True)
        results[window] = measure_window(g, peers, reps)
    record = {
        "benchmark": "bench_peers",
        "machine": machine_info(),
        "config": {
            "geometry": geometry, "num_layers": base.num_layers, "num_kv_heads": base.num_kv_heads,
            "head_size": base.head_size, "tokens_per_frame": base.tokens_per_frame,
            "frames_per_block": base.frames_per_block, "sink_frames": base.sink_frames, "windows": list(windows),
            "dtype": dtype, "branches": 1, "reps": reps, "quick": quick, "peers": peers,
            "frame_bytes": PeerGeometry.from_spec(base, dtype).frame_bytes,
            # What the ardiff_jax peer's read is (it changed with the core's page mask).
            "ardiff_read": "bench_kv.history_read per layer (run_visibility + read_run(..., page_visible), as "
                           "paged_attention), its output handed to the shared sum_f32",
        },
        "agreement": checks,
        "results": {w: {n: {p: s for p, s in parts.items()} for n, parts in r.items()} for w, r in results.items()},
        "verdict": _judge(results),
    }
    path = write_json(out_dir / f"peers_{geometry}.json", record)
    _plot(record, results, out_dir / f"peers_{geometry}.png")
    _print_report(record, results, path)
    return record


def _print_report(record: dict[str, Any], results: dict[int, dict[str, dict[str, Stats]]], path: Path) -> None:
    config = record["config"]
    windows = sorted(results)
    names = list(results[windows[0]])
    print(f"\n== bench_peers: {config['geometry']} ({config['num_layers']} layers, {config['num_kv_heads']}x"
          f"{config['head_size']}, T={config['tokens_per_frame']}, F={config['frames_per_block']}, sink "
          f"{config['sink_frames']}, {config['dtype']}, one branch), ms per block, median [p10-p90] ==")
    print(machine_line(record["machine"]))
    for part in ("commit", "block"):
        rows = []
        for name in names:
            rows.append([f"{name} ({part})"] + [
                f"{results[w][name][part].median_ms:.3g} [{results[w][name][part].p10_ms:.3g}-"
                f"{results[w][name][part].p90_ms:.3g}]" for w in windows])
        print(format_table(["implementation"] + [f"W={w}" for w in windows], rows))
    for key, value in record["verdict"].items():
        if isinstance(value, dict):
            value = {w: (round(x, 2) if isinstance(x, float) else x) for w, x in value.items()}
        elif isinstance(value, float):
            value = round(value, 2)
        print(f"  {key}: {value}")
    print(f"  wrote {path}")


def _plot(record: dict[str, Any], results: dict[int, dict[str, dict[str, Stats]]], path: Path) -> None:
    plt = pyplot()
    if plt is None:  # matplotlib is the optional bench extra
        return
    windows = sorted(results)
    names = list(results[windows[0]])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    titles = {"commit": "commit only", "block": "commit + read of the visible window"}
    for ax, part in zip(axes, ("commit", "block")):
        for name in names:
            med = np.array([results[w][name][part].median_ms for w in windows])
            lo = med - np.array([results[w][name][part].p10_ms for w in windows])
            hi = np.array([results[w][name][part].p90_ms for w in windows]) - med
            style = dict(linestyle="--", color="black") if name == "floor" else dict(marker="o")
            if name == "ardiff_jax":
                style.update(linewidth=2.5)
            ax.errorbar(windows, med, yerr=[lo, hi], label=name, capsize=3, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(windows, [str(w) for w in windows])
        ax.set_xlabel("window frames W (sink %d, block %d)" % (record["config"]["sink_frames"],
                                                              record["config"]["frames_per_block"]))
        ax.set_title(titles[part])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per block (median, p10-p90)")
    axes[1].legend(fontsize=8)
    config = record["config"]
    fig.suptitle(f"Per-block KV cache overhead, {config['geometry']} ({config['dtype']}, one branch); "
                 f"{machine_line(record['machine'])}", fontsize=9)
    save_figure(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=["medium"], help="example geometries (default: medium)")
    parser.add_argument("--windows", type=int, nargs="+", default=list(DEFAULT_WINDOWS), help="window frames W")
    parser.add_argument("--peers", nargs="+", default=None,
                        help=f"implementations (default: all available: {', '.join(available_peers())})")
    parser.add_argument("--dtype", default="bfloat16", help="logical KV dtype (default bfloat16)")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice, all cores)")
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    for geometry in args.geometry:
        run_geometry(geometry, windows=tuple(args.windows), peers=args.peers, dtype=args.dtype, quick=args.quick,
                     out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
