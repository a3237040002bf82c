"""Host offload tier: offloading and restoring one session against raw copies of the same bytes.

When the LRU evicts a session and ``EngineConfig(host_offload_bytes > 0)``, the runner copies
the session's slot to host memory (``_copy_out``: ``kv_cache.offload_slot(slot)``, one
program that reads the slot and writes it into the ``pinned_host`` memory kind); its next
request writes the pages back (``kv_cache.write_slot``: one donated program that moves the
host pages in and updates the slot in place). The issue's target:
offload and restore each within 1.5x of a raw device-to-host / host-to-device copy of the
same bytes, at the ``medium`` geometry.

One process, every case interleaved (``common.run_interleaved``), on one session's pages at
``--geometry`` (default ``medium``: one branch, sink 3 + window 9 pages, bf16 stored as
uint16 on CPU; ``bench_spec``), in the last of two slots so the copy is a real sub-slice
of the pools:

* **offload**: ``cache.offload_slot(slot)``, waited for: exactly what ``_copy_out`` does
  for the pages. Raw baselines, from a same-shaped, same-dtype device
  array that already exists (no slicing):

  * ``d2h_device_get``: ``jax.device_get`` into a new host array. On CPU ``device_get``
    returns a zero-copy view of the device buffer, so the copy is made explicitly
    (``np.array``): one copy of the bytes, what ``device_get`` costs on an accelerator.
    The source is a fresh device copy made untimed before each sample, because jax caches
    an array's host value after its first ``device_get``;
  * ``d2h_pinned_host``: ``jax.device_put(x, SingleDeviceSharding(dev, memory_kind="pinned_host"))``;
  * attribution and the earlier design, not baselines: ``read_slot`` alone (a device copy
    of the slot), and ``offload_two_pass``: that device copy then ``to_host`` (a
    ``device_put`` to ``pinned_host``), the bytes crossing twice.

* **restore**: ``cache.write_slot(slot, host_pages)`` with the ``pinned_host`` pages the
  offload produced, waited for. Raw baseline ``h2d_device_put``:
  ``jax.device_put(host_pages, SingleDeviceSharding(dev))``, the same host arrays.
  Attribution and the earlier design: ``write_slot_from_device`` (the same call with device
  pages: the donated write alone) and ``restore_two_pass`` (a ``device_put`` of the host
  pages to device memory, then that donated write).

* ``memcpy``: ``np.copyto`` of the same bytes between preallocated numpy arrays, the
  bandwidth floor of a copy on this machine. On CPU "host" and "device" memory are the same
  RAM, so every copy above is a RAM-to-RAM copy and this is their common floor.

* **ticks**, restored vs resident, through a real ``ARDiffusionEngine`` with capacity 1 and
  a host tier that holds every offloaded session:

  * ``engine_swap`` / ``engine_resident``: at ``--geometry``, around a pipeline that
    implements the session export and whose forward does nothing
    (:class:`ExportingTrivialPipeline`): a swap tick is the runner's whole eviction
    (``_evict``: offload, events, host tier) plus its restore, and nothing else;
  * ``world_swap`` / ``world_resident``: the reference ``WorldPipeline`` (``--world-preset``,
    default ``tiny``: a ``medium`` world tick costs seconds on a 2-core CPU, too slow to
    sample here), float32, one block per tick. Its KV geometry is the preset's, not
    ``--geometry``'s; the record says which.

  ``*_swap`` alternates two sessions A, B on one slot, so every tick offloads one and
  restores the other; ``*_resident`` ticks one session that never leaves its slot (a second
  engine with its own pipeline). The record checks the events per tick (one ``restored`` and
  one ``offloaded`` per swap tick, none per resident tick) and the bytes each restore moves
  (the offloaded record's ``nbytes``). A swap tick returns once the restored pages are
  written; the other session's copy to host may still be in flight, and the next swap tick,
  which restores exactly that session, waits for it.

The record also checks that the pages survive the round trip bit for bit. Nothing here
asserts a timing.

Run: ``python -m benchmarks.bench_offload``; results go to
``benchmarks/results/offload_<geometry>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.bench_host import TrivialPipeline
from benchmarks.common import (
    RESULTS_DIR,
    Case,
    Stats,
    bench_spec,
    format_table,
    machine_info,
    machine_line,
    pyplot,
    ratio,
    run_interleaved,
    save_figure,
    write_json,
)

__all__ = ["CopyBench", "ExportingTrivialPipeline", "TickBench", "main", "run"]

#: Target from the issue: offload and restore within this factor of a raw copy of the same
#: bytes, at this geometry.
OFFLOAD_TARGET = 1.5
TARGET_GEOMETRY = "medium"

OFFLOAD_CASES = ("offload", "d2h_device_get", "d2h_pinned_host", "read_slot", "offload_two_pass")
RESTORE_CASES = ("restore", "h2d_device_put", "write_slot_from_device", "restore_two_pass")
FLOOR_CASES = ("memcpy",)
TICK_CASES = ("engine_swap", "engine_resident", "world_swap", "world_resident")

# (warmup, rounds, reps_per_round); a round runs every case, so all of them get the same count.
_REPS = (5, 40, 5)
_QUICK_REPS = (1, 3, 2)


def _host_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)


# -- copies ------------------------------------------------------------------------------------------
class CopyBench:
    """A cache at ``geometry`` (bf16, one branch, two slots) whose last slot holds random pages.

    ``raw`` are device arrays with the same bits, shape and dtype as the slot's pages;
    ``host_pages`` the ``pinned_host`` copy an offload produces (the restore's source).
    """

    def __init__(self, geometry: str, seed: int = 0) -> None:
        from ardiff_jax.kv import KVPools
        from ardiff_jax.runtime import ARDiffusionKVCache
        from ardiff_jax.runtime._offload import to_host

        self.geometry = geometry
        self.spec = bench_spec(geometry, session_capacity=2)
        self.cache = cache = ARDiffusionKVCache(self.spec, dtype="bfloat16", available_memory_bytes=64 * 2**30,
                                                gpu_memory_fraction=1.0)
        self.device = cache.device
        self.layout = layout = cache.layout
        self.slot = cache.session_capacity - 1
        self.num_pages = cache.session_pages
        self.start = np.int32(self.slot * self.num_pages)
        shape = (layout.num_layers, self.num_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
        storage = np.dtype(jax.numpy.dtype(layout.storage_dtype))
        rng = np.random.default_rng(seed)
        # Random bits: a copy does not look at the values (a bf16 NaN pattern is copied like any other).
        self.bits = KVPools(k=rng.integers(0, 2**16, shape, dtype=np.uint16).view(storage),
                            v=rng.integers(0, 2**16, shape, dtype=np.uint16).view(storage))
        self.raw = jax.device_put(self.bits, _device_sharding(self.device))
        cache.write_slot(self.slot, self.raw)
        self.host_pages = jax.block_until_ready(cache.offload_slot(self.slot))
        self.nbytes = int(self.raw.k.nbytes + self.raw.v.nbytes)
        self._to_host = to_host
        self._device_get_aliases = _device_get_aliases(self.raw.k)
        self._fresh: Any = None
        self.memcpy_dst = jax.tree_util.tree_map(np.empty_like, self.bits)

    # offload
    def offload(self) -> Any:
        return self.cache.offload_slot(self.slot)

    def fresh_source(self) -> Any:
        """Untimed: a new device copy of the raw pages, whose host value jax has not cached."""
        self._fresh = jax.tree_util.tree_map(lambda x: x.copy(), self.raw)
        return self._fresh

    def d2h_device_get(self) -> Any:
        host = jax.device_get(self._fresh)
        if self._device_get_aliases:  # CPU: a view of the device buffer, not a copy
            host = jax.tree_util.tree_map(np.array, host)
        return host

    def d2h_pinned_host(self) -> Any:
        return jax.device_put(self.raw, _host_sharding(self.device))

    def read_slot(self) -> Any:
        return self.cache.read_slot(self.slot)

    def offload_two_pass(self) -> Any:
        return self._to_host(self.cache.read_slot(self.slot), self.device)

    # restore
    def restore(self) -> Any:
        self.cache.write_slot(self.slot, self.host_pages)
        return self.cache.pools

    def h2d_device_put(self) -> Any:
        return jax.device_put(self.host_pages, _device_sharding(self.device))

    def write_slot_from_device(self) -> Any:
        self.cache.write_slot(self.slot, self.raw)
        return self.cache.pools

    def restore_two_pass(self) -> Any:
        self.cache.write_slot(self.slot, jax.device_put(self.host_pages, _device_sharding(self.device)))
        return self.cache.pools

    # floor
    def memcpy(self) -> None:
        np.copyto(self.memcpy_dst.k, self.bits.k)
        np.copyto(self.memcpy_dst.v, self.bits.v)

    def cases(self) -> list[Case]:
        return [
            Case("offload", self.offload),
            Case("d2h_device_get", self.d2h_device_get, setup=self.fresh_source),
            Case("d2h_pinned_host", self.d2h_pinned_host),
            Case("read_slot", self.read_slot),
            Case("offload_two_pass", self.offload_two_pass),
            Case("restore", self.restore),
            Case("h2d_device_put", self.h2d_device_put),
            Case("write_slot_from_device", self.write_slot_from_device),
            Case("restore_two_pass", self.restore_two_pass),
            Case("memcpy", self.memcpy),
        ]

    def checks(self) -> dict[str, bool]:
        """Every path moved the same bits: the slot, an offload and the alternatives' copies match."""
        def equal(pools: Any) -> bool:
            return all(np.array_equal(np.asarray(jax.device_get(x)), y)
                       for x, y in ((pools.k, self.bits.k), (pools.v, self.bits.v)))

        return {
            "slot pages equal the written bits after every restore": equal(self.cache.read_slot(self.slot)),
            "offload equals the written bits": equal(self.offload()),
            "offload_two_pass equals the written bits": equal(self.offload_two_pass()),
            "host pages are in pinned_host": all(
                x.sharding.memory_kind == "pinned_host" for x in (self.host_pages.k, self.host_pages.v)),
        }

    def describe(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "geometry": self.geometry, "dtype": layout.dtype, "storage_dtype": layout.storage_dtype,
            "branches": 1, "num_layers": layout.num_layers, "tokens_per_frame": layout.tokens_per_frame,
            "num_kv_heads": layout.num_kv_heads, "head_size": layout.head_size,
            "session_pages": self.num_pages, "page_shape": list(self.raw.k.shape), "slot": self.slot,
            "session_bytes": self.nbytes,
            "device_get_is_a_view": self._device_get_aliases,
        }

    def close(self) -> None:
        self.cache.close()


def _device_get_aliases(x: jax.Array) -> bool:
    """Whether ``jax.device_get`` hands back a view of ``x``'s buffer (CPU) instead of a copy."""
    try:
        pointer = x.unsafe_buffer_pointer()
    except (AttributeError, NotImplementedError, RuntimeError):  # pragma: no cover - no raw pointers
        return False
    return int(np.asarray(jax.device_get(x)).ctypes.data) == int(pointer)


# -- ticks -------------------------------------------------------------------------------------------
class ExportingTrivialPipeline(TrivialPipeline):
    """``bench_host``'s do-nothing pipeline plus the session export: its sessions can be offloaded.

    The model state it exports is empty, so a swap tick costs the runner's offload and
    restore of the pages and nothing of a model's.
    """

    def export_ar_diffusion_session(self, session_id: str) -> dict[str, Any]:
        return {}

    def import_ar_diffusion_session(self, session_id: str, state: Any) -> None:
        if state != {}:
            raise ValueError(f"ExportingTrivialPipeline exports an empty dict, got {type(state).__name__}")


class _EventCounter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, event: Any) -> None:
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1

    def get(self, kind: str) -> int:
        return self.counts.get(kind, 0)


class TickBench:
    """Two engines of one pipeline kind, capacity 1: ``swap`` alternates sessions A and B, ``resident`` ticks one."""

    def __init__(self, name: str, make_pipeline: Callable[[], Any], config: Any,
                 requests: Callable[[str, bool], Any]) -> None:
        from ardiff_jax import ARDiffusionEngine

        self.name = name
        self.engines: dict[str, Any] = {}
        self.events: dict[str, _EventCounter] = {}
        self.ticks = {"swap": 0, "resident": 0}
        self.session_ids = {"swap": ("A", "B"), "resident": ("R",)}
        self._requests: dict[str, list[Any]] = {}
        for variant, ids in self.session_ids.items():
            engine = ARDiffusionEngine(make_pipeline(), config)
            if engine.session_capacity != 1:
                raise RuntimeError(f"{name}: tick bench needs 1 session slot, the plan gave {engine.session_capacity}")
            for sid in ids:  # untimed: create the sessions (the swap's B offloads A here already)
                engine.generate(requests(sid, True))
            self._requests[variant] = [requests(sid, False) for sid in ids]
            counter = _EventCounter()
            engine.runner.add_session_listener(counter)
            self.engines[variant] = engine
            self.events[variant] = counter

    def tick_fn(self, variant: str) -> Callable[[], Any]:
        generate = self.engines[variant].generate
        requests = self._requests[variant]
        count = len(requests)
        ticks = self.ticks

        def tick() -> Any:
            i = ticks[variant]
            ticks[variant] = i + 1
            return generate(requests[i % count])

        return tick

    def cases(self) -> list[Case]:
        return [Case(f"{self.name}_{variant}", self.tick_fn(variant)) for variant in ("swap", "resident")]

    def summary(self) -> dict[str, Any]:
        swap = self.engines["swap"]
        # After a swap tick the other session is offloaded: its record is what the next tick restores.
        offloaded = swap.offloaded_sessions
        record = swap.runner.host_tier.get(offloaded[0]) if offloaded else None
        out: dict[str, Any] = {
            "bytes per restore (offloaded record nbytes)": None if record is None else record.nbytes,
            "page bytes per restore": None if record is None else int(record.pages.k.nbytes + record.pages.v.nbytes),
            "planned host bytes per offloaded session": swap.memory_plan.offload_bytes_per_session,
        }
        for variant, counter in self.events.items():
            ticks = max(self.ticks[variant], 1)
            out[f"{variant}: ticks counted"] = self.ticks[variant]
            out[f"{variant}: restored per tick"] = counter.get("restored") / ticks
            out[f"{variant}: offloaded per tick"] = counter.get("offloaded") / ticks
            out[f"{variant}: released per tick"] = counter.get("released") / ticks
        return out

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def engine_tick_bench(geometry: str) -> TickBench:
    """The runner's own swap at ``geometry``: a pipeline whose forward does nothing."""
    from ardiff_jax import DiffusionRequest, EngineConfig

    spec = bench_spec(geometry, session_capacity=1)
    config = EngineConfig(dtype="bfloat16", available_memory_bytes=64 * 2**30, gpu_memory_fraction=1.0,
                          warmup=False, host_offload_bytes=2**33)

    def requests(sid: str, first: bool) -> Any:
        return DiffusionRequest(f"r-{sid}", extra_args={"session_id": sid})

    return TickBench("engine", lambda: ExportingTrivialPipeline(spec, touch_kv=False), config, requests)


def world_tick_bench(preset: str) -> tuple[TickBench, dict[str, Any]]:
    """The reference world pipeline: every tick one block (4 denoise forwards + 1 commit forward)."""
    from ardiff_jax import DiffusionRequest, EngineConfig
    from ardiff_jax.capability import spec_summary
    from ardiff_jax.models import WorldPipeline, WorldPipelineConfig

    pipeline_config = WorldPipelineConfig(session_capacity=1)
    first = WorldPipeline(preset, pipeline_config)
    made = [first]

    def make() -> Any:
        if made:
            return made.pop()
        return WorldPipeline(preset, pipeline_config, modules=first.modules)  # same weights, no second init

    # float32 as bench_e2e runs the world model; the host tier holds every offloaded session. No
    # warmup request: the untimed first blocks compile, and the second engine shares the programs.
    config = EngineConfig(dtype="float32", available_memory_bytes=2**32, gpu_memory_fraction=1.0,
                          host_offload_bytes=2**33, warmup=False)

    def requests(sid: str, first_block: bool) -> Any:
        return DiffusionRequest(f"r-{sid}", prompt=f"a drive through {sid}" if first_block else None,
                                extra_args={"session_id": sid})

    bench = TickBench("world", make, config, requests)
    spec = first.ar_diffusion_kv_cache_spec()
    info = {"pipeline": f"WorldPipeline({preset!r})", "preset": preset, "dtype": "float32",
            "denoise_steps": first.schedule.num_steps, "kv_spec": dict(spec_summary(spec))}
    return bench, info


# -- the run -----------------------------------------------------------------------------------------
def run(*, geometry: str | None = None, world_preset: str = "tiny", reps: tuple[int, int, int] | None = None,
        quick: bool = False, out_dir: Path = RESULTS_DIR, write: bool = True) -> dict[str, Any]:
    """Measure every case interleaved; write ``offload_<geometry>.json`` / ``.png`` unless ``write=False``.

    ``geometry`` is the copies' and the engine ticks' geometry: ``None`` means ``medium``,
    or ``tiny`` with ``quick``.
    """
    if geometry is None:
        geometry = "tiny" if quick else "medium"
    if reps is None:
        reps = _QUICK_REPS if quick else _REPS
    with contextlib.ExitStack() as stack:
        copies = CopyBench(geometry)
        stack.callback(copies.close)
        engine_ticks = engine_tick_bench(geometry)
        stack.callback(engine_ticks.close)
        world_ticks, world_info = world_tick_bench(world_preset)
        stack.callback(world_ticks.close)
        cases = copies.cases() + engine_ticks.cases() + world_ticks.cases()
        stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
        checks = copies.checks()
        engine_summary = engine_ticks.summary()
        world_summary = world_ticks.summary()
        copy_config = copies.describe()

    nbytes = copy_config["session_bytes"]
    gb_per_s = {name: nbytes / (stats[name].median_ms / 1e3) / 1e9
                for name in OFFLOAD_CASES + RESTORE_CASES + FLOOR_CASES}
    ratios = {
        "offload / d2h_device_get": ratio(stats["offload"], stats["d2h_device_get"]),
        "offload / d2h_pinned_host": ratio(stats["offload"], stats["d2h_pinned_host"]),
        "restore / h2d_device_put": ratio(stats["restore"], stats["h2d_device_put"]),
        "offload / memcpy": ratio(stats["offload"], stats["memcpy"]),
        "restore / memcpy": ratio(stats["restore"], stats["memcpy"]),
        "offload_two_pass / d2h_pinned_host": ratio(stats["offload_two_pass"], stats["d2h_pinned_host"]),
        "restore_two_pass / h2d_device_put": ratio(stats["restore_two_pass"], stats["h2d_device_put"]),
        "engine_swap / engine_resident": ratio(stats["engine_swap"], stats["engine_resident"]),
        "world_swap / world_resident": ratio(stats["world_swap"], stats["world_resident"]),
    }
    offload_plus_restore = stats["offload"].median_ms + stats["restore"].median_ms
    derived = {
        "engine_swap - engine_resident, ms (the runner's offload + restore per tick)":
            stats["engine_swap"].median_ms - stats["engine_resident"].median_ms,
        "offload + restore medians, ms": offload_plus_restore,
        "world_swap - world_resident, ms": stats["world_swap"].median_ms - stats["world_resident"].median_ms,
    }
    record: dict[str, Any] = {
        "benchmark": "bench_offload",
        "machine": machine_info(),
        "config": {**copy_config, "world_preset": world_preset, "reps": list(reps), "quick": quick},
        "offload": {name: stats[name] for name in OFFLOAD_CASES},
        "restore": {name: stats[name] for name in RESTORE_CASES},
        "floor": {name: stats[name] for name in FLOOR_CASES},
        "ticks": {name: stats[name] for name in TICK_CASES},
        "gb_per_s": gb_per_s,
        "ratios": ratios,
        "derived": derived,
        "engine_ticks": {"pipeline": "ExportingTrivialPipeline (forward does nothing)", "geometry": geometry,
                         "dtype": "bfloat16", **engine_summary},
        "world_ticks": {**world_info, **world_summary},
        "checks": checks,
        "targets": {},
    }
    if geometry == TARGET_GEOMETRY:  # the issue states its target at this geometry only
        record["targets"] = {
            f"offload <= {OFFLOAD_TARGET}x d2h_device_get ({geometry})":
                ratios["offload / d2h_device_get"] <= OFFLOAD_TARGET,
            f"offload <= {OFFLOAD_TARGET}x d2h_pinned_host ({geometry})":
                ratios["offload / d2h_pinned_host"] <= OFFLOAD_TARGET,
            f"restore <= {OFFLOAD_TARGET}x h2d_device_put ({geometry})":
                ratios["restore / h2d_device_put"] <= OFFLOAD_TARGET,
        }
    if write:
        path = write_json(out_dir / f"offload_{geometry}.json", record)
        _plot(record, out_dir / f"offload_{geometry}.png")
        _print_report(record, path)
    return record


def _rows(record: dict[str, Any], section: str) -> Iterator[tuple[Any, ...]]:
    for name, s in record[section].items():
        s = s.as_dict() if isinstance(s, Stats) else s
        rate = record["gb_per_s"].get(name)
        yield (section, name, s["median_ms"], s["p10_ms"], s["p90_ms"], "" if rate is None else f"{rate:.2f}",
               s["page_faults"])


def _print_report(record: dict[str, Any], path: Path) -> None:
    config = record["config"]
    print(f"\n== bench_offload: {config['geometry']} session pages ({config['session_bytes'] / 2**20:.2f} MiB, "
          f"{config['dtype']} stored as {config['storage_dtype']}); world ticks: {record['world_ticks']['pipeline']} ==")
    print(machine_line(record["machine"]))
    rows = [row for section in ("offload", "restore", "floor", "ticks") for row in _rows(record, section)]
    print(format_table(("part", "case", "median ms", "p10 ms", "p90 ms", "GB/s", "page faults"), rows))
    print(format_table(("ratio of medians", "value"), list(record["ratios"].items())))
    print(format_table(("derived", "value"), list(record["derived"].items())))
    print(format_table(("engine ticks", "value"), list(record["engine_ticks"].items())))
    print(format_table(("world ticks", "value"),
                       [(k, v) for k, v in record["world_ticks"].items() if k != "kv_spec"]))
    for check, ok in record["checks"].items():
        print(f"  check {check}: {'ok' if ok else 'FAILED'}")
    for target, ok in record["targets"].items():
        print(f"  target {target}: {'HOLDS' if ok else 'MISSED'}")
    print(f"  wrote {path}")


def _plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:  # matplotlib is the optional bench extra
        return

    def bars(ax: Any, section_names: list[tuple[str, str]], title: str) -> None:
        stats = [record[section][name] for section, name in section_names]
        stats = [s.as_dict() if isinstance(s, Stats) else s for s in stats]
        medians = np.asarray([s["median_ms"] for s in stats])
        low = medians - np.asarray([s["p10_ms"] for s in stats])
        high = np.asarray([s["p90_ms"] for s in stats]) - medians
        colors = ["tab:blue" if name in ("offload", "restore") or name.endswith("_swap") else "tab:gray"
                  for _, name in section_names]
        x = np.arange(len(section_names))
        ax.bar(x, medians, yerr=[low, high], color=colors, capsize=3)
        ax.set_xticks(x, [name for _, name in section_names], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("ms, median [p10-p90]")
        ax.set_title(title, fontsize=8)

    config = record["config"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    bars(axes[0], [("offload", n) for n in OFFLOAD_CASES] + [("floor", "memcpy")],
         f"offload, {config['geometry']} session ({config['session_bytes'] / 2**20:.1f} MiB)")
    bars(axes[1], [("restore", n) for n in RESTORE_CASES] + [("floor", "memcpy")], "restore")
    bars(axes[2], [("ticks", n) for n in TICK_CASES],
         f"tick: swap (restore every tick) vs resident\nengine: {config['geometry']}, trivial forward; "
         f"world: {record['world_ticks']['pipeline']}")
    fig.suptitle(f"host offload tier; {machine_line(record['machine'])}", fontsize=7)
    save_figure(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_offload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default=None,
                        help="geometry of the copies and the engine ticks (default medium; tiny with --quick)")
    parser.add_argument("--world-preset", default="tiny", help="WorldPipeline preset of the world ticks (default tiny)")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaving rounds (default {_REPS[1]})")
    parser.add_argument("--quick", action="store_true", help="tiny geometry, few samples (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    reps = None
    if args.rounds is not None:
        warmup, _, per_round = _QUICK_REPS if args.quick else _REPS
        reps = (warmup, args.rounds, per_round)
    run(geometry=args.geometry, world_preset=args.world_preset, reps=reps, quick=args.quick, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
