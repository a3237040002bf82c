"""The realtime video server (``ardiff-jax serve``) under concurrent WebSocket clients on the loopback.

One process: the trained sprite world (``pretrained("sprite_world")``, capacity 4, float32) on
one engine, served by ``create_app`` on uvicorn in a thread on a free loopback port; the
clients are ``websockets`` asyncio clients on the main thread's event loop.

* **Streams** (N = 1, 2, 4 clients; ``jpeg`` and ``m4s``): every client starts a session, sends
  an action interaction every few chunks, reads its chunks, then ``session.stop`` and waits for
  ``session.done``. Reported: time to first chunk (``session.start`` sent -> first binary frame
  held), chunk inter-arrival p50/p99, aggregate frames/s over the window in which every client
  streams, per-session fairness (min/max frames/s in that window), and the per-chunk server
  overhead: the client's arrival time of a chunk's bytes minus the moment ``engine.generate``
  returned that chunk (the engine is wrapped, same clock), i.e. encoding, queueing, the
  WebSocket and the client's read; ``latency_ms - engine ms`` (the encode part) too.
* **Baseline**: the same N sessions, same pipeline and inputs (the served world's observation
  and action arrays), driven round-robin through ``engine.generate`` directly in the same
  process, right after the server run of that N: the engine's own throughput. Target (issue):
  served aggregate frames/s >= 0.8x the baseline, and the server overhead p50 < 5 ms for
  ``jpeg``.
* **Correctness** per run: ``transport_chunk_index`` consecutive from 0 on each connection,
  ``generation_chunk_index`` strictly increasing and with no gap (nothing dropped), every
  binary frame as long as its metadata says, every interaction answered ``queued``, and after
  every client left ``engine.sessions == ()`` and ``/healthz`` reports no session.
* **Soak** (``ARDIFF_SOAK_SECONDS``, default a few seconds): up to capacity clients at once
  connect, play a few chunks and vanish (TCP abort, no close frame), over and over; RSS (from
  ``/proc/self/status``) is sampled through it; afterwards no session is left.

The streams, the baseline and the soak measure throughput, so their server runs unpaced
(``ServerSettings(paced=False)``: chunks as fast as the engine makes them).

* **Paced play** (N = 1, 2, 4, 8 players on a paced server at the world's 10 frames/s, default
  lookahead of one chunk): each player is a simulated viewer that plays what it receives at the
  announced rate (playback starts when a chunk is there, waits when it runs dry) and sends an
  action every few chunks. Reported per N: generated vs displayed frames at the stop (the
  engine's calls for the session returned by then against the frames the viewer has put on
  screen by then; target: at most one chunk of lookahead generated but never shown),
  action-to-display latency (sending an interaction
  to receiving the first chunk generated with it, p50 / p99; target p50 within two chunk
  intervals; also to the viewer presenting that chunk), the real-time factor per session
  (frames received per second over the announced rate, min and mean over the sessions) and the
  server's underruns; the player count from which the real-time factor drops below 1.

Run: ``python -m benchmarks.bench_serve [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import math
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from benchmarks.common import (
    RESULTS_DIR,
    format_table,
    machine_info,
    machine_line,
    pyplot,
    save_figure,
    write_json,
)

__all__ = ["CLIENT_COUNTS", "FORMATS", "main", "run"]

CLIENT_COUNTS = (1, 2, 4)
PACED_CLIENT_COUNTS = (1, 2, 4, 8)
#: A session plays in real time when its real-time factor is at least this (the measurement's own jitter).
REAL_TIME = 0.97
FORMATS = ("jpeg", "m4s")
PATH = "/v1/realtime/video"
ACTIONS = ("left", "right", "up", "down")
SOAK_ENV = "ARDIFF_SOAK_SECONDS"
SERVER_OVERHEAD_TARGET_MS = 5.0
THROUGHPUT_TARGET = 0.8


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


class EngineClock:
    """Wraps ``engine.generate`` and ``engine.generate_batch``: per session id, (returned-at, seconds) of every
    block made for it, in order (a batched call's blocks all return at its end and take its time)."""

    def __init__(self, engine: Any) -> None:
        from ardiff_jax.types import ARDiffusionTickRequest

        self._tick = ARDiffusionTickRequest
        self.engine = engine
        self.original = engine.generate
        self.original_batch = engine.generate_batch
        self.calls: dict[str, list[tuple[float, float]]] = {}
        self.batch_sizes: list[int] = []
        self.lock = threading.Lock()
        engine.generate = self
        engine.generate_batch = self.batch

    def _session(self, request: Any) -> str:
        tick = self._tick.from_extra_args(request.extra_args)
        return tick.session_id if tick is not None else str(request.extra_args.get("session_id", ""))

    def __call__(self, request: Any) -> Any:
        start = time.perf_counter()
        out = self.original(request)
        end = time.perf_counter()
        with self.lock:
            self.calls.setdefault(self._session(request), []).append((end, end - start))
        return out

    def batch(self, requests: Any) -> Any:
        start = time.perf_counter()
        outs = self.original_batch(requests)
        end = time.perf_counter()
        with self.lock:
            self.batch_sizes.append(len(requests))
            for request in requests:
                self.calls.setdefault(self._session(request), []).append((end, end - start))
        return outs

    def restore(self) -> None:
        del self.engine.generate, self.engine.generate_batch


class Server:
    """uvicorn serving ``app`` on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        # log_config=None: uvicorn's default dictConfig would stop its loggers propagating for the rest of the
        # process (a test worker's later log checks then see nothing); its warnings reach the root logger.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    ws_max_size=2**24, log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 30 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{PATH}"

    def healthz(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=10).json()


async def _client(url: str, fmt: str, seed: int, chunks: int, interact_every: int) -> dict[str, Any]:
    """One player: start, read ``chunks`` chunks (an action every ``interact_every``), stop, read to done."""
    from websockets.asyncio.client import connect

    record: dict[str, Any] = {"recv_s": [], "meta": [], "bytes_ok": True, "interactions_sent": 0,
                              "interactions_queued": 0, "errors": []}
    async with connect(url, max_size=2**24, open_timeout=30) as ws:
        record["start_s"] = time.perf_counter()
        await ws.send(json.dumps({"type": "session.start", "format": fmt, "seed": seed}))
        started = json.loads(await ws.recv())
        assert started["type"] == "video.start", started
        record["request_id"] = started["request_id"]
        stopped = False
        while True:
            message = json.loads(await ws.recv())
            kind = message["type"]
            if kind == "video.chunk_metadata":
                payload = await ws.recv()
                now = time.perf_counter()
                record["bytes_ok"] &= isinstance(payload, bytes) and len(payload) == message["byte_length"]
                record["recv_s"].append(now)
                record["meta"].append({k: message[k] for k in ("transport_chunk_index", "generation_chunk_index",
                                                               "num_frames", "latency_ms", "byte_length")})
                received = len(record["recv_s"])
                if not stopped and received % interact_every == 0:
                    action = ACTIONS[(received // interact_every) % len(ACTIONS)]
                    event = {"multi_modal_data": {"action": {"value": action}}}
                    await ws.send(json.dumps({"type": "session.interaction",
                                              "interaction": {"event_id": f"{seed}-{received}", "event": event}}))
                    record["interactions_sent"] += 1
                if not stopped and received >= chunks:
                    record["stop_s"] = now
                    await ws.send(json.dumps({"type": "session.stop"}))
                    stopped = True
            elif kind == "session.interaction.queued":
                record["interactions_queued"] += 1
            elif kind == "session.done":
                record["done"] = message
                break
            else:
                record["errors"].append(message)
    return record


def _stream_checks(records: Sequence[dict[str, Any]]) -> dict[str, bool]:
    transport_ok = generation_ok = no_gap = True
    for r in records:
        transport = [m["transport_chunk_index"] for m in r["meta"]]
        generation = [m["generation_chunk_index"] for m in r["meta"]]
        transport_ok &= transport == list(range(len(transport)))
        generation_ok &= all(b > a for a, b in itertools.pairwise(generation))
        no_gap &= generation == list(range(generation[0], generation[0] + len(generation))) if generation else False
    return {
        "transport_chunk_index consecutive from 0": transport_ok,
        "generation_chunk_index strictly increasing": generation_ok,
        "no chunk lost (generation_chunk_index without gaps)": no_gap,
        "every binary frame has its byte_length": all(r["bytes_ok"] for r in records),
        "every interaction answered queued": all(r["interactions_sent"] == r["interactions_queued"]
                                                 for r in records),
        "no error message": not any(r["errors"] for r in records),
        "session.done counts the chunks": all(r["done"]["chunks"] == len(r["meta"]) for r in records),
    }


def _wait_idle(engine: Any, server: Server, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        health = server.healthz()
        idle = engine.sessions == () and all(v == 0 for v in health["sessions"].values())
        if idle or time.monotonic() > deadline:
            return {"engine.sessions empty": engine.sessions == (), "healthz": health["sessions"],
                    "healthz reports no session": all(v == 0 for v in health["sessions"].values())}
        time.sleep(0.05)


def play(url: str, fmt: str, clients: int, chunks: int) -> list[dict[str, Any]]:
    """``clients`` players at once (run in the client process)."""

    async def together() -> list[dict[str, Any]]:
        return await asyncio.gather(*(_client(url, fmt, 100 + i, chunks, 3) for i in range(clients)))

    return asyncio.run(together())


def stream_run(engine: Any, clock: EngineClock, server: Server, clients_pool: Any, fmt: str, clients: int,
               chunks: int, frames_per_chunk: int) -> dict[str, Any]:
    clock.calls.clear()
    records = clients_pool.submit(play, server.url, fmt, clients, chunks).result(timeout=600)
    idle = _wait_idle(engine, server)
    # The window in which every client streams: from the last first chunk to the first stop.
    window_start = max(r["recv_s"][0] for r in records)
    window_end = min(r["stop_s"] for r in records)
    rates = []
    for r in records:
        recv = np.asarray(r["recv_s"])
        frames = sum(m["num_frames"] for m, t in zip(r["meta"], recv) if window_start < t <= window_end)
        rates.append(frames / max(window_end - window_start, 1e-9))
    inter = [b - a for r in records for a, b in itertools.pairwise(r["recv_s"])]
    overhead, encode = [], []
    for r in records:
        calls = clock.calls.get(r["request_id"], [])
        for m, t in zip(r["meta"], r["recv_s"]):
            g = m["generation_chunk_index"]
            if g < len(calls):
                returned, engine_s = calls[g]
                overhead.append(t - returned)
                encode.append(m["latency_ms"] / 1e3 - engine_s)
    engine_ms = [s for calls in clock.calls.values() for _, s in calls]
    checks = _stream_checks(records)
    checks["every chunk matched to its engine call"] = len(overhead) == sum(len(r["meta"]) for r in records)
    checks["no session left (engine.sessions, /healthz)"] = (idle["engine.sessions empty"]
                                                             and idle["healthz reports no session"])
    return {
        "format": fmt, "clients": clients, "chunks_per_client": chunks, "frames_per_chunk": frames_per_chunk,
        "chunks_received": sum(len(r["meta"]) for r in records),
        "time_to_first_chunk_ms": [1e3 * (r["recv_s"][0] - r["start_s"]) for r in records],
        "inter_arrival_ms": {"p50": 1e3 * _pct(inter, 50), "p99": 1e3 * _pct(inter, 99)},
        "aggregate_frames_per_s": float(sum(rates)),
        "session_frames_per_s": rates,
        "fairness_min_over_max": float(min(rates) / max(rates)),
        "server_overhead_ms": {"p50": 1e3 * _pct(overhead, 50), "p99": 1e3 * _pct(overhead, 99), "n": len(overhead)},
        "encode_ms": {"p50": 1e3 * _pct(encode, 50), "p99": 1e3 * _pct(encode, 99)},
        "engine_ms": {"p50": _pct(engine_ms, 50) * 1e3, "p99": _pct(engine_ms, 99) * 1e3},
        "bytes_per_chunk": float(np.mean([m["byte_length"] for r in records for m in r["meta"]])),
        "checks": checks,
    }


def engine_baseline(engine: Any, world: Any, clients: int, chunks: int) -> dict[str, Any]:
    """N sessions round-robin through ``engine.generate``: the served world's inputs, no server."""
    from ardiff_jax.envs import ACTION_NAMES, SpriteWorld
    from ardiff_jax.types import DiffusionRequest

    f = world.frames_per_chunk
    ids = [f"baseline-{clients}-{i}" for i in range(clients)]

    def request(i: int, chunk: int) -> DiffusionRequest:
        inputs: dict[str, Any] = {"actions": np.full(f, ACTION_NAMES.index(ACTIONS[chunk // 3 % len(ACTIONS)]),
                                                     np.int64)}
        if chunk == 0:
            inputs["observation"] = SpriteWorld(100 + i, size=world.frame_height).reset()
        return DiffusionRequest(f"{ids[i]}-{chunk}", extra_args={"session_id": ids[i]}, inputs=inputs)

    for i in range(clients):  # the prefill chunk, untimed as the server's window excludes it too
        np.asarray(engine.generate(request(i, 0)).frames)
    start = time.perf_counter()
    for chunk in range(1, chunks):
        for i in range(clients):
            np.asarray(engine.generate(request(i, chunk)).frames)  # frames on the host, as the server needs them
    elapsed = time.perf_counter() - start
    for session_id in ids:
        engine.close_session(session_id)
    return {"clients": clients, "chunks_per_session": chunks - 1,
            "frames_per_s": clients * (chunks - 1) * f / elapsed}


def soak(engine: Any, server: Server, seconds: float, capacity: int) -> dict[str, Any]:
    """Clients connect, play a few chunks and vanish (TCP abort); RSS sampled all along."""
    from websockets.asyncio.client import connect

    samples: list[tuple[float, float]] = []
    counts = {"sessions": 0, "refused_capacity": 0, "chunks": 0}
    t0 = time.perf_counter()

    async def player(seed: int) -> None:
        ws = await connect(server.url, max_size=2**24, open_timeout=30)
        try:
            await ws.send(json.dumps({"type": "session.start", "format": ("jpeg", "m4s")[seed % 2], "seed": seed}))
            reply = json.loads(await ws.recv())
            if reply["type"] == "error" and reply.get("code") == "capacity":
                counts["refused_capacity"] += 1
                await asyncio.sleep(0.05)
                return
            counts["sessions"] += 1
            for _ in range(1 + seed % 4):
                message = json.loads(await ws.recv())
                if message["type"] == "video.chunk_metadata":
                    await ws.recv()
                    counts["chunks"] += 1
        finally:
            ws.transport.abort()  # vanish: no close frame, no session.stop

    async def lane(lane_index: int) -> None:
        seed = lane_index
        while time.perf_counter() - t0 < seconds:
            await player(seed)
            seed += capacity

    async def sampler() -> None:
        while time.perf_counter() - t0 < seconds:
            samples.append((time.perf_counter() - t0, _rss_mib()))
            await asyncio.sleep(0.1)

    async def main() -> None:
        await asyncio.gather(sampler(), *(lane(i) for i in range(capacity)))

    asyncio.run(main())
    idle = _wait_idle(engine, server)
    rss = np.asarray([mib for _, mib in samples])
    quarter = max(1, len(rss) // 4)
    first, last = float(np.median(rss[:quarter])), float(np.median(rss[-quarter:]))
    # The second half's trend: the first seconds include one-off growth (allocator arenas, caches).
    times = np.asarray([t for t, _ in samples])
    half = times >= times[-1] / 2
    slope = float(np.polyfit(times[half], rss[half], 1)[0]) * 60 if half.sum() > 1 else float("nan")
    return {"seconds": seconds, **counts, "rss_mib_samples": samples, "rss_first_quarter_mib": first,
            "rss_last_quarter_mib": last, "rss_growth_mib": last - first, "rss_second_half_mib_per_min": slope,
            "checks": {"no session left (engine.sessions, /healthz)": idle["engine.sessions empty"]
                       and idle["healthz reports no session"]}}


async def _paced_client(url: str, seed: int, seconds: float, interact_every: int) -> dict[str, Any]:
    """One player on a paced server for ``seconds`` after its first chunk: a viewer playing at the announced rate.

    The viewer plays chunk ``k`` from ``max(arrival_k, end of chunk k-1)`` for ``frames_k / fps``
    seconds (it waits when it runs dry, it never skips): what a browser page with a jitter
    buffer does. An action goes out every ``interact_every`` chunks.
    """
    from websockets.asyncio.client import connect

    record: dict[str, Any] = {"chunks": [], "sent": {}, "errors": []}
    async with connect(url, max_size=2**24, open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "session.start", "format": "jpeg", "seed": seed}))
        started = json.loads(await ws.recv())
        assert started["type"] == "video.start", started
        record["request_id"], record["fps"] = started["request_id"], started["config"]["fps"]
        record["lookahead_chunks"] = started["config"]["lookahead_chunks"]
        first = stop_at = None
        stopped = False
        while True:
            message = json.loads(await ws.recv())
            kind = message["type"]
            if kind == "video.chunk_metadata":
                await ws.recv()
                now = time.perf_counter()
                record["chunks"].append({"t": now, "frames": message["num_frames"],
                                         "started": message["started_event_ids"],
                                         "real_time_factor": message["real_time_factor"],
                                         "underruns": message["underruns"]})
                if first is None:
                    first, stop_at = now, now + seconds
                received = len(record["chunks"])
                # The stop is decided first: an action sent in the same breath as the stop may never be applied
                # (the session ends before a chunk starts it), and "every action applied" would fail by timing.
                if not stopped and now >= stop_at:
                    record["stop_s"] = now
                    await ws.send(json.dumps({"type": "session.stop"}))
                    stopped = True
                if not stopped and received % interact_every == 0:
                    event_id = f"{seed}-{received}"
                    event = {"multi_modal_data": {"action": {"value": ACTIONS[received // interact_every % 4]}}}
                    record["sent"][event_id] = time.perf_counter()
                    await ws.send(json.dumps({"type": "session.interaction",
                                              "interaction": {"event_id": event_id, "event": event}}))
            elif kind == "session.done":
                break
            elif kind == "error":
                record["errors"].append(message)
    return record


def _viewer(chunks: Sequence[dict[str, Any]], fps: float, until: float) -> tuple[list[float], int]:
    """Each chunk's start on screen and the frames shown by ``until`` (see :func:`_paced_client`)."""
    starts, shown, end = [], 0, -float("inf")
    for chunk in chunks:
        begin = max(chunk["t"], end)
        end = begin + chunk["frames"] / fps
        starts.append(begin)
        if until >= begin:  # a frame counts as shown from the moment it is on screen
            shown += min(chunk["frames"], math.floor((until - begin) * fps + 1e-9) + 1)
    return starts, shown


def play_paced(url: str, clients: int, seconds: float) -> list[dict[str, Any]]:
    async def together() -> list[dict[str, Any]]:
        return await asyncio.gather(*(_paced_client(url, 300 + i, seconds, 5) for i in range(clients)))

    return asyncio.run(together())


def paced_run(engine: Any, clock: EngineClock, server: Server, clients_pool: Any, clients: int, seconds: float,
              frames_per_chunk: int) -> dict[str, Any]:
    clock.calls.clear()
    records = clients_pool.submit(play_paced, server.url, clients, seconds).result(timeout=600)
    idle = _wait_idle(engine, server)
    unseen, to_receive, to_display, factors, underruns = [], [], [], [], []
    for r in records:
        fps, chunks = r["fps"], [c for c in r["chunks"] if c["t"] <= r["stop_s"]]
        starts, shown = _viewer(chunks, fps, r["stop_s"])
        # Generated by the stop (a chunk under way when the player stops is never shown, by definition).
        generated = sum(1 for returned, _ in clock.calls.get(r["request_id"], []) if returned <= r["stop_s"])
        generated *= frames_per_chunk
        unseen.append(generated - shown)
        for event_id, sent in r["sent"].items():
            for chunk, start in zip(r["chunks"], starts + [float("nan")] * len(r["chunks"])):
                if event_id in chunk["started"]:
                    to_receive.append(chunk["t"] - sent)
                    to_display.append(start - sent)
                    break
        # Frames received per second over the announced rate, after the first two chunks (the lookahead fill).
        times = [c["t"] for c in chunks[2:]]
        frames = sum(c["frames"] for c in chunks[3:])
        factors.append(frames / (times[-1] - times[0]) / fps if len(times) > 1 and times[-1] > times[0] else 0.0)
        underruns.append(chunks[-1]["underruns"] if chunks else 0)
    fps = records[0]["fps"]
    chunk_s = frames_per_chunk / fps
    lookahead = records[0]["lookahead_chunks"]
    return {
        "clients": clients, "seconds": seconds, "fps": fps, "lookahead_chunks": lookahead,
        "frames_per_chunk": frames_per_chunk,
        "generated_not_shown_frames": {"max": int(max(unseen)), "mean": float(np.mean(unseen))},
        "action_to_receive_ms": {"p50": 1e3 * _pct(to_receive, 50), "p99": 1e3 * _pct(to_receive, 99),
                                 "n": len(to_receive)},
        "action_to_display_ms": {"p50": 1e3 * _pct(to_display, 50), "p99": 1e3 * _pct(to_display, 99)},
        "chunk_interval_ms": 1e3 * chunk_s,
        "real_time_factor": {"min": float(min(factors)), "mean": float(np.mean(factors))},
        "server_real_time_factor_last": [r["chunks"][-1]["real_time_factor"] for r in records if r["chunks"]],
        "underruns": {"total": int(sum(underruns)), "per_session_max": int(max(underruns))},
        "checks": {"no error message": not any(r["errors"] for r in records),
                   "every action applied": len(to_receive) == sum(len(r["sent"]) for r in records),
                   "no session left (engine.sessions, /healthz)": idle["engine.sessions empty"]
                   and idle["healthz reports no session"]},
    }


def _plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    for fmt, marker, color in zip(FORMATS, "os", ("C0", "C1"), strict=True):
        runs = [r for r in record["streams"] if r["format"] == fmt]
        ns = [r["clients"] for r in runs]
        ax0.plot(ns, [r["aggregate_frames_per_s"] for r in runs], marker=marker, color=color, label=f"served ({fmt})")
        ax1.plot(ns, [r["server_overhead_ms"]["p50"] for r in runs], marker=marker, color=color, label=f"{fmt} p50")
        ax1.plot(ns, [r["server_overhead_ms"]["p99"] for r in runs], marker=marker, color=color, ls="--",
                 label=f"{fmt} p99")
    base = record["baseline"]
    ax0.plot([b["clients"] for b in base], [b["frames_per_s"] for b in base], marker="^", color="k",
             label="engine alone (round-robin)")
    ax0.set(xlabel="clients", ylabel="aggregate frames/s", title="throughput")
    ax1.axhline(SERVER_OVERHEAD_TARGET_MS, color="r", lw=0.8, label="target (jpeg p50)")
    ax1.set(xlabel="clients", ylabel="ms", title="server overhead per chunk (arrival - engine return)")
    samples = np.asarray(record["soak"]["rss_mib_samples"])
    if len(samples):
        ax2.plot(samples[:, 0], samples[:, 1])
    ax2.set(xlabel="s", ylabel="RSS MiB", title=f"soak: {record['soak']['sessions']} vanishing clients")
    for ax in (ax0, ax1):
        ax.legend(fontsize=7)
        ax.set_xticks(list(CLIENT_COUNTS))
    fig.suptitle(f"bench_serve, sprite_world: {machine_line(record['machine'])}", fontsize=8)
    save_figure(fig, path, plt)


def run(*, quick: bool = False, chunks: int | None = None, soak_seconds: float | None = None,
        out_dir: Path = RESULTS_DIR, write: bool = True) -> dict[str, Any]:
    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.models import pretrained
    from ardiff_jax.serve import ServedWorld, ServerAccess, ServerSettings, create_app

    chunks = chunks or (4 if quick else 100)
    if soak_seconds is None:
        soak_seconds = float(os.environ.get(SOAK_ENV) or (1.5 if quick else 15.0))
    client_counts = (1, 2) if quick else CLIENT_COUNTS
    paced_seconds = 2.0 if quick else 8.0
    paced_counts = (1, 2) if quick else PACED_CLIENT_COUNTS
    pipeline = pretrained("sprite_world", session_capacity=max(PACED_CLIENT_COUNTS))
    config = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)
    with ARDiffusionEngine(pipeline, config) as engine:
        world = ServedWorld.for_pipeline(pipeline)
        clock = EngineClock(engine)
        # Every client is on 127.0.0.1 and a vanished one counts until its cleanup ends: no per-address limit here.
        access = ServerAccess(max_connections_per_client=1024)
        app = create_app(engine, world=world, settings=ServerSettings(paced=False), access=access)
        paced_app = create_app(engine, world=world, access=access)
        streams, baseline, paced = [], [], []
        # The stream clients run in a second process: in this one they would take the GIL from the
        # server's event loop. Both read CLOCK_MONOTONIC (perf_counter), so their times compare.
        spawn = multiprocessing.get_context("spawn")
        with Server(app) as server, concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as clients_pool:
            # Compile the programs and warm the encoders and the client process.
            stream_run(engine, clock, server, clients_pool, "jpeg", 1, 3, world.frames_per_chunk)
            engine_baseline(engine, world, 1, 3)
            for clients in client_counts:
                for fmt in FORMATS:
                    streams.append(stream_run(engine, clock, server, clients_pool, fmt, clients, chunks,
                                              world.frames_per_chunk))
                baseline.append(engine_baseline(engine, world, clients, chunks))
            soak_record = soak(engine, server, soak_seconds, 4)
        with Server(paced_app) as server, concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as clients_pool:
            for clients in paced_counts:
                paced.append(paced_run(engine, clock, server, clients_pool, clients, paced_seconds,
                                       world.frames_per_chunk))
        clock.restore()
        capacity = engine.session_capacity
    base_by_n = {b["clients"]: b["frames_per_s"] for b in baseline}
    ratios = {f"served/engine frames/s, {r['format']}, N={r['clients']}":
              r["aggregate_frames_per_s"] / base_by_n[r["clients"]] for r in streams}
    targets = {f"aggregate frames/s >= {THROUGHPUT_TARGET}x engine alone, N={n}":
               all(v >= THROUGHPUT_TARGET for k, v in ratios.items() if k.endswith(f"N={n}") and "jpeg" in k)
               for n in client_counts}
    targets.update({f"server overhead p50 < {SERVER_OVERHEAD_TARGET_MS} ms (jpeg, N={r['clients']})":
                    r["server_overhead_ms"]["p50"] < SERVER_OVERHEAD_TARGET_MS
                    for r in streams if r["format"] == "jpeg"})
    for p in paced:
        n = p["clients"]
        targets[f"paced N={n}: generated but never shown <= one lookahead chunk"] = (
            p["generated_not_shown_frames"]["max"] <= p["lookahead_chunks"] * p["frames_per_chunk"])
        if n <= 4:
            targets[f"paced N={n}: action-to-receive p50 <= two chunk intervals"] = (
                p["action_to_receive_ms"]["p50"] <= 2 * p["chunk_interval_ms"])
    below = [p["clients"] for p in paced if p["real_time_factor"]["min"] < REAL_TIME]
    paced_summary = {"first player count below real time": below[0] if below else None,
                     "real_time_threshold": REAL_TIME}
    record = {
        "benchmark": "bench_serve",
        "machine": machine_info(),
        "config": {"model": "sprite_world", "preset": "sprite_world", "dtype": "float32", "capacity": capacity,
                   "frames_per_chunk": world.frames_per_chunk, "chunks_per_client": chunks,
                   "clients": list(client_counts), "formats": list(FORMATS), "soak_seconds": soak_seconds,
                   "paced_clients": list(paced_counts), "paced_seconds": paced_seconds, "quick": quick},
        "streams": streams,
        "baseline": baseline,
        "ratios": ratios,
        "soak": soak_record,
        "paced": paced,
        "paced_summary": paced_summary,
        "checks": {f"{r['format']} N={r['clients']}: {k}": v for r in streams for k, v in r["checks"].items()}
        | {f"soak: {k}": v for k, v in soak_record["checks"].items()}
        | {f"paced N={p['clients']}: {k}": v for p in paced for k, v in p["checks"].items()},
        "targets": targets,
    }
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "serve_sprite_world.json", record)
        _plot(record, out_dir / "serve_sprite_world.png")
    return record


def summary_table(record: dict[str, Any]) -> str:
    base = {b["clients"]: b["frames_per_s"] for b in record["baseline"]}
    rows = [(r["format"], r["clients"], f"{np.median(r['time_to_first_chunk_ms']):.1f}",
             f"{r['inter_arrival_ms']['p50']:.1f} / {r['inter_arrival_ms']['p99']:.1f}",
             f"{r['aggregate_frames_per_s']:.0f}", f"{base[r['clients']]:.0f}",
             f"{r['aggregate_frames_per_s'] / base[r['clients']]:.2f}", f"{r['fairness_min_over_max']:.2f}",
             f"{r['server_overhead_ms']['p50']:.2f} / {r['server_overhead_ms']['p99']:.2f}",
             f"{r['encode_ms']['p50']:.2f}", f"{r['engine_ms']['p50']:.1f}") for r in record["streams"]]
    table = format_table(("format", "N", "first chunk ms (median)", "inter-arrival ms p50 / p99",
                          "served frames/s", "engine alone frames/s", "served/engine", "fairness min/max",
                          "server overhead ms p50 / p99", "encode ms p50", "engine ms/chunk p50"), rows)
    soak_ = record["soak"]
    soak_line = (f"soak {soak_['seconds']:.0f} s: {soak_['sessions']} sessions vanished, "
                 f"{soak_['refused_capacity']} capacity refusals, {soak_['chunks']} chunks; RSS "
                 f"{soak_['rss_first_quarter_mib']:.0f} -> {soak_['rss_last_quarter_mib']:.0f} MiB "
                 f"(first / last quarter medians), second half {soak_['rss_second_half_mib_per_min']:+.1f} MiB/min")
    paced = paced_table(record)
    failed = [k for k, ok in record["checks"].items() if not ok]
    checks = "- checks: **all ok**" if not failed else "- checks failed: " + "; ".join(failed)
    targets = "\n".join(f"- {k}: **{'holds' if ok else 'missed'}**" for k, ok in record["targets"].items())
    parts = [table, soak_line] + ([paced] if paced else []) + [f"{checks}\n{targets}"]
    return "\n\n".join(parts)


def paced_table(record: dict[str, Any]) -> str:
    """The paced-play figures (records written before pacing existed have none: an empty string)."""
    paced = record.get("paced")
    if not paced:
        return ""
    rows = [(p["clients"], f"{p['fps']}", f"{p['generated_not_shown_frames']['max']} / {p['frames_per_chunk']}",
             f"{p['action_to_receive_ms']['p50']:.0f} / {p['action_to_receive_ms']['p99']:.0f}",
             f"{p['action_to_display_ms']['p50']:.0f} / {p['action_to_display_ms']['p99']:.0f}",
             f"{p['chunk_interval_ms']:.0f}",
             f"{p['real_time_factor']['min']:.2f} / {p['real_time_factor']['mean']:.2f}",
             p["underruns"]["total"]) for p in paced]
    table = format_table(("players (paced)", "fps", "generated never shown, frames max / per chunk",
                          "action->receive ms p50 / p99", "action->display ms p50 / p99", "chunk interval ms",
                          "real-time factor min / mean", "underruns"), rows)
    first = record["paced_summary"]["first player count below real time"]
    line = (f"real-time factor below {record['paced_summary']['real_time_threshold']} from "
            f"{first} players" if first else "every player count measured played in real time")
    return f"{table}\n\n{line}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1, 2, few chunks, a short soak (smoke run)")
    parser.add_argument("--chunks", type=int, default=None, help="chunks per client per run (default 100; 4 quick)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.chunks is not None and args.chunks < 2:
        parser.error(f"--chunks must be at least 2, got {args.chunks}")
    record = run(quick=args.quick, chunks=args.chunks, out_dir=args.out)
    print(f"Machine: {machine_line(record['machine'])}\n\n{summary_table(record)}")
    return 0 if all(record["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
