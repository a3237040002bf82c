"""One short check for a GPU machine: KV commit, attention, the causal Wan2.1-1.3B rollout and its batched ticks.

Meant to run once when a GPU is available (``benchmarks/gpu_check.sh``, under five minutes
on one H200) and to write ONE JSON. (a) and (b) use the Wan2.1-1.3B KV geometry (30 layers,
12 KV heads x 128, 1560 tokens/frame, 3-frame blocks, sink 3 + window 18 frames, bf16 KV, one
branch):

(a) **commit**: one block (``F`` frames, all layers, K and V) through the core's donated
    writer ``ardiff_jax.kv.commit_block`` vs one donated ``lax.dynamic_update_slice`` of the
    same bytes into a same-sized pool (the write floor), interleaved; the ratio of medians.
(b) **attend** at a full window (``(K + W) * T`` keys, current block included), one layer per
    call, rotating over the layers, for each backend: ``"xla"`` (``paged_attention``) and
    ``"cudnn"`` (``cudnn_paged_attention``, recorded as skipped with the reason where
    ``cudnn_support`` refuses), plus cuDNN attention over the same number of *contiguous*
    keys for context. Each against two floors: the bandwidth floor (the visible window's
    K+V bytes of one layer at the H200's spec bandwidth; achieved GB/s reported too) and the
    FLOP floor (``4 * S * N * Hq * D`` at the H200's dense bf16 spec). Every backend's output
    is compared with the dense float32 reference on one frame of queries.
(c) **world**: :class:`~ardiff_jax.models.wan.CausalWanPipeline` at the published
    ``wan2.1-t2v-1.3b`` preset with Self-Forcing's policy (3-frame blocks, sink 0 + window 21
    frames, warped 4-step schedule) and random weights, at the full 480x832 frame (60x104
    latent, 1,560 tokens/frame), bf16 activations, parameters and KV, driven through
    ``ARDiffusionEngine`` (one session, one block per request: 4 denoise forwards + 1 commit
    forward) with the full-size Wan 2.1 VAE (random bf16 weights) decoding every block through
    its streaming cache (one session's cache: 1801 MiB), for a few blocks after warmup, per
    attention backend (cuDNN first when supported; XLA when time is left). Reported end to end
    (transformer + VAE decode + runtime) in video frames/s (the 12 frames a steady-state block
    decodes per engine block) and latent frames/s, next to the reported H100 figures of
    LongLive-1.3B (20.7) and Self-Forcing (17 reported, ~13 measured end to end by users) and
    our goal: **end to end >= 17 video frames/s on one H200** (``goal_met``; the earlier
    transformer-only goal, >= 20, is kept as ``transformer_goal_met``). Then, on the same engine
    and session, ``benchmarks.bench_wan.split_block``: the block split into the 4 denoise steps,
    the commit pass, the VAE decode (the recorded ``decode_step`` on a copy of the session's
    cache) and the runtime overhead (engine block minus the same programs on the block's
    recorded arguments, interleaved; target <= 5% of model time). After the first backend,
    when the time guard allows, the **text encode** of one prompt: umT5-XXL (5.68B parameters,
    random bf16 weights, 11.4 GB) through ``WanTextEncoder`` at the full 512 tokens, as
    ``CausalWanPipeline`` runs it once per prompt, with end-to-end frames/s amortised over a
    prompt held for 1, 7 and 28 blocks; skipped with the reason when the guard has no time for
    it. The session itself is conditioned on random ``prompt_embeds``.

(d) **matrix_game**: Matrix-Game 2.0 (``matrix-game-2-universal``: random bf16 weights, 352x640,
    880 tokens per latent frame, window 6, 3 denoise steps + the commit pass, action modules in
    blocks 0-14, the Wan VAE decoding 12 frames per block) through ``ARDiffusionEngine``
    (``bench_wan.matrix_game_blocks``): per block the transformer, the VAE decode and the runtime,
    and end-to-end video frames/s next to the release's reported 25 (one A100/H100-class GPU).

(e) **wan_batch**: players per device. (c)'s network, policy and VAE (random weights, every block
    decoded) behind ONE ``ARDiffusionEngine`` at session capacity 8 (its warmup compiles batch buckets
    2, 4 and 8; ``engine_load_s`` times it), 8 sessions with their own random prompts filled with
    batched ticks until a block sees a full window, then for ``B`` = 8, 4, 2, 1 (largest first, each
    asked of the guard): timed ticks of ``engine.generate_batch`` over ``B`` sessions (``generate`` at
    ``B = 1``), reporting the tick median, aggregate video frames/s (``B`` x 12 / tick), per-session
    latency (the tick) and frames/s, players at 16 fps (``floor(aggregate / 16)``, Wan's native rate)
    and compiles during the timed ticks (0 expected: every bucket compiled at warmup), plus the memory
    plan's bytes per session and how many sessions fit at this engine's ``gpu_memory_fraction`` (0.9:
    (c)'s 0.3 admits only ~3 such sessions), at (c)'s and in all free memory. It is last and the
    longest (an estimated ~170-380 s, mostly compiles), so after (a)-(d) the guard usually skips it:
    ``--sections wan_batch`` runs it alone (``--budget-s`` past the wrapper's 290 s gives it more).

``--smoke`` runs the same code at the ``tiny`` KV geometry, a 2-layer Wan-shaped model
(``bench_wan.smoke_config``), a width-8 VAE, a 2-layer width-16 umT5 and (e) at ``B`` = 2, 1 (capacity
2), so it runs on a CPU, nearly all compiles (cuDNN is then recorded as skipped, with the reason):
~210-235 s on 2 cores shared with a training job, (e) ~50-60 s of it. A time guard bounds the whole run:
each section starts only with enough time left, the world rollout stops between blocks, the split
between rounds and (e) between ticks at the deadline, a SIGALRM at the hard deadline ends whatever
runs, and the JSON is rewritten after every section (with each section's seconds), so an interrupted
run still leaves what it measured.

(f) **dreamzero**: DreamZero-DROID (``dreamzero-droid``: random bf16 weights, 16.5e9 parameters, 880
    tokens a latent frame, 2-frame blocks, a 9-frame window, both CFG branches) robot inference calls
    through ``ARDiffusionEngine`` (``bench_dreamzero.measure_calls``): seconds per call and its breakdown
    (commit, DiT evaluations, scheduler, host), next to the release's ~3 s on two H100s and 0.6 s on GB200;
    the goal on one H200 is under 1 s. Run alone with ``--sections dreamzero``.

Run: ``bash benchmarks/gpu_check.sh`` or ``python -m benchmarks.gpu_check [--smoke] [--out PATH]
[--sections commit,attend,world,matrix_game,wan_batch,dreamzero]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_wan import GOAL_E2E_VIDEO_FRAMES_PER_S, REFERENCE_FPS, REFERENCE_LABEL
from benchmarks.common import (
    RESULTS_DIR,
    Case,
    bench_spec,
    format_table,
    machine_info,
    ratio,
    run_interleaved,
    write_json,
)

__all__ = ["GOAL_TRANSFORMER_VIDEO_FRAMES_PER_S", "GOAL_VIDEO_FRAMES_PER_S", "H200_BANDWIDTH_BYTES_PER_S",
           "H200_BF16_FLOPS", "PLAYER_FPS", "REFERENCE_FPS", "SECTIONS", "TimeGuard", "main", "run"]

#: H200 SXM spec sheet: HBM3e bandwidth (bytes/s) and dense BF16 tensor-core throughput (FLOP/s).
H200_BANDWIDTH_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS = 989e12

# REFERENCE_FPS (LongLive-1.3B 20.7, Self-Forcing 17 reported / ~13 measured by users, all on one H100)
# and REFERENCE_LABEL come from bench_wan: published end-to-end figures, context only.

#: Wan's causal VAE: latent frame 0 decodes to 1 video frame, every later latent frame to 4.
VIDEO_FRAMES_PER_LATENT_FRAME = 4

TEXT_LEN_NOTE = "512 tokens"


@dataclasses.dataclass(frozen=True)
class Mode:
    """Sizes of one run: the full GPU check or the CPU smoke run."""

    name: str
    geometry: str  # ardiff_jax.geometries name of the KV layout of (a) and (b)
    preset: str  # CausalDiTConfig preset of (c); "wan-smoke" is bench_wan.smoke_config()
    commit_reps: tuple[int, int, int]  # (warmup, rounds, reps_per_round)
    attend_reps: tuple[int, int, int]
    world_warmup_blocks: int  # untimed blocks after the engine's own warmup
    world_timed_blocks: int
    budget_s: float  # the time guard's soft deadline
    world_split_rounds: int = 6  # bench_wan.split_block rounds (engine block + its 5 forwards + decode) per backend
    text_encoder: str = "xxl"  # bench_wan.text_encoder_config kind of the text encode
    text_rounds: int = 5  # timed text encodes (after one untimed warmup)
    text_needed_s: float = 60.0  # the time guard's estimate for the text encode (init, compiles, rounds)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)  # (e): sessions per tick; the engine's capacity is the largest
    batch_timed_ticks: int = 3  # (e): timed ticks per batch size
    batch_memory_fraction: float = 0.9  # (e): the engine's gpu_memory_fraction on an accelerator (see below)
    batch_needed_s: float = 150.0  # (e): the time guard's estimate (init, load with every bucket, fill, one size)


# Time budget of the full run on one H200 (the wrapper's `timeout 290`; guard 270 s + 10 s grace).
# Measured on CPU at the 1.3B geometry (benchmarks/results/bench_wan.json, 2 shared cores, 8x12
# latent): the random init is one jitted program (WanModules.create), 7.7 s of XLA compile, and
# the engine load compiles world_step and the text K/V projection in 9.7 s; neither grows with
# the 30 layers (the DiT is nnx.vmap-stacked and lax.scan-ned) and the latent size changes
# shapes, not the program. The smoke run of this script took ~26 s on that CPU before the VAE and
# the text encoder, ~50 s with them (under load), nearly all compile. XLA:GPU compiles slower than XLA:CPU (autotuning), hence ~30-60 s below. On
# the GPU: the init draws 1.42e9 bf16 normals (milliseconds of HBM time; ~2.8 GB resident, plus
# one session's pools: 24 frames x 30 layers x 1560 tokens x 12 x 128 x K,V x 2 bytes = 6.9 GB,
# copied once by the split's recorder; well inside the H200's 141 GB). A block is 5 forwards of
# ~2 x 1.25e9 x 4,680 = 11.7 TFLOP of matmuls plus self-attention over 21 x 1,560 = 32,760 keys
# (4 x 4,680 x 32,760 x 1,536 x 30 = 28 TFLOP) plus text cross-attention (0.4 TFLOP): ~200 TFLOP
# per block, 0.2 s at the 989 TFLOP/s spec, ~0.4-1 s in practice (the XLA backend materialises
# the scores). Per backend: compile + warmup block ~30-60 s (the budget the wan_1_3b rollout had
# before; same network), 9 blocks of rollout and ~17 block-equivalents of split (capture, warmup
# round, 6 rounds of engine block + denoise + commit, 2 blocks with synced forwards): 10-25 s.
# (a) + (b) take ~30 s, process and CUDA start ~15 s: one backend ends by ~130 s, both by ~220 s.
# The guard starts the second backend only with 1.2x the first's time left and stops the rollout
# and the split rounds at the deadline, so a slower GPU loses the XLA numbers, never the JSON.
#
# Added with the VAE and the text encoder (estimates, not measured on a GPU yet):
# * VAE init: the full Wan 2.1 VAE (126.9M bf16 parameters) in one jitted program: ~10-20 s of
#   compile (19 s on the CPU above), milliseconds to run. Its per-session cache is 1801 MiB at
#   480x832 (bf16); the split's recorder holds one copy and each vae_decode sample one more.
# * VAE decode: XLA's cost analysis gives 40.5 TFLOP per steady-state block (3 latents -> 12
#   frames of 480x832); at 30-50% of the 989 TFLOP/s spec that is ~0.08-0.14 s per block (the
#   CPU at 64x96: 0.60 TFLOP in ~22 s). The engine's warmup now runs 2 blocks (a session's first
#   decode and the later ones are two programs): +~20-40 s of compile with conv autotuning, once
#   (the second backend's pipeline shares the VAE, hence its compiled programs). Per backend the
#   9 rollout blocks, ~17 split block-equivalents and 6 vae_decode samples add ~30 decodes: ~3-5 s.
# * Text encode (after the first backend, guarded by text_needed_s = 60 s): umT5-XXL, 5.68B
#   bf16 parameters (11.4 GB), random in one jitted program: ~10-20 s of compile, ~0.1 s to draw;
#   the encode program compiles in ~10-20 s; one 512-token prompt is 4.85 TFLOP of matmuls
#   (bench_wan.umt5_flops; 5.8 TFLOP if the 1.05B-row embedding is counted as a matmul, it is a
#   gather), ~10-20 ms, 6 of them: < 1 s. ~25-45 s in all, the weights dropped afterwards.
# * So +~60-110 s: the first backend (cuDNN) ends by ~160-200 s, the text encode by ~200-240 s,
#   and the second backend (XLA) will usually find less than 1.2x the first's time left and be
#   skipped with its reason (`--world-backend xla` runs it alone). Where the guard has no time
#   for the text encode, it is skipped and the reason recorded.
#
# (e) wan_batch (estimates, not measured on a GPU yet). It comes last and needs ~150 s, so after (a)-(d) the
# guard will usually skip it with its reason; `--sections wan_batch` runs it alone inside the same guard,
# which may still be too short for every size (see below).
# * Init: the transformer's random init is the program (c) compiled (cached in the process; ~10-20 s of
#   compile when (e) runs alone), the VAE is drawn on the host (~2-5 s).
# * Engine load at capacity 8 compiles (measured in the smoke run, where the same programs compile): the
#   one-session programs again (the pools' shapes depend on the capacity: world_step, the first and later
#   decodes unless (c) compiled them), one batched world_step per bucket 2, 4, 8, and the two decodes that
#   keep the session's cache (a batch keeps the old cache until it succeeds): 6 programs after (c), 8 alone,
#   of ~20-40 s each with autotuning: ~120-300 s, each bucket then running a first and a later block.
# * Memory: the plan at (c)'s fraction (0.3 of the free memory, ~100 GB under JAX's default 75%
#   preallocation) admits only ~3 sessions of ~8 GB (21 pages of 274 MiB, the 94 MB text cache and the
#   1801 MiB VAE cache), so this engine plans at 0.9 of it; it allocates 8 sessions' pages and caches, ~64 GB,
#   and the rest holds the batched forward's temporaries (and the 8 old decoder caches a batch keeps until
#   it succeeds: +15 GB at B = 8).
# * A steady tick: B x (~0.4-1 s transformer + ~0.1 s decode) unbatched; batching should cut the transformer's
#   share. Filling 8 windows (6 ticks at B = 8) ~15-50 s; then B = 8, 4, 2, 1 (largest first, see
#   measure_wan_batch), 3 timed ticks each (+1 warm below 8): ~30 s. So ~170-380 s alone: when time runs short
#   the guard skips the sizes left (the smallest, which run last); `python -m benchmarks.gpu_check --sections
#   wan_batch --budget-s 500` (no wrapper timeout) gives it more.
# * Smoke (CPU, B = 2, 1): the same 4 extra programs at the tiny sizes, ~9 s of compile each; the section took
#   51-62 s of 208-232 s smoke runs on 2 cores shared with a training job (load average ~8), hence the smoke
#   budget of 250 s (was 200).
FULL = Mode("full", "wan_1_3b", "wan2.1-t2v-1.3b", commit_reps=(3, 10, 3), attend_reps=(2, 5, 2),
            world_warmup_blocks=1, world_timed_blocks=8, budget_s=270.0, world_split_rounds=6)
SMOKE = Mode("smoke", "tiny", "wan-smoke", commit_reps=(1, 2, 2), attend_reps=(1, 2, 1),
             world_warmup_blocks=1, world_timed_blocks=2, budget_s=250.0, world_split_rounds=2,
             text_encoder="smoke", text_rounds=2, text_needed_s=1.0, batch_sizes=(1, 2), batch_timed_ticks=2,
             batch_needed_s=1.0)

#: Section keys in run order; ``--sections`` picks a subset (the order stays this one).
SECTIONS = ("commit", "attend", "world", "matrix_game", "wan_batch", "dreamzero")

#: Our goal for the causal Wan2.1-1.3B on one H200: end-to-end (transformer + VAE) video frames/s at 480x832.
GOAL_VIDEO_FRAMES_PER_S = GOAL_E2E_VIDEO_FRAMES_PER_S
#: The earlier goal, transformer only (from the split's denoise + commit medians).
GOAL_TRANSFORMER_VIDEO_FRAMES_PER_S = 20.0

#: Seconds past the soft deadline before SIGALRM interrupts whatever runs.
HARD_GRACE_S = 10.0


class TimeGuardExpired(Exception):
    """Raised by the SIGALRM handler at the hard deadline."""


class TimeGuard:
    """The run's deadline: sections ask before they start, loops before each iteration."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = float(budget_s)
        self.start = time.monotonic()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def allows(self, what: str, needed_s: float) -> bool:
        """Whether ``needed_s`` seconds are left; records ``what`` as skipped otherwise."""
        if self.remaining() >= needed_s:
            return True
        self.skipped.append(f"{what}: {self.remaining():.1f} s left of {self.budget_s:.0f} s, needs ~{needed_s:.0f} s")
        return False

    @contextmanager
    def hard_deadline(self) -> Iterator[None]:
        """SIGALRM at ``budget + HARD_GRACE_S``: interrupts a section that overruns (main thread only).

        Python runs the handler between bytecodes, so a single long XLA call finishes
        first; the shell wrapper's ``timeout`` is the last resort.
        """
        usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
        if not usable:
            yield
            return

        def expire(signum: int, frame: Any) -> None:
            raise TimeGuardExpired(f"hard deadline of {self.budget_s + HARD_GRACE_S:.0f} s reached")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(max(1, math.ceil(self.remaining() + HARD_GRACE_S)))
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


# -- shared setup -----------------------------------------------------------------------------------------
def _layout(geometry: str) -> Any:
    """A one-branch bf16 layout of ``geometry`` with two runs (the measured run is run 1)."""
    import jax

    from ardiff_jax.kv import KVLayout, default_storage_dtype

    spec = bench_spec(geometry)
    run_pages = spec.sink_frames + spec.window_frames
    return KVLayout(
        num_layers=spec.num_layers, num_pages=2 * run_pages, tokens_per_frame=spec.tokens_per_frame,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, sink_frames=spec.sink_frames,
        window_frames=spec.window_frames, frames_per_block=spec.frames_per_block,
        scratch_pages=spec.frames_per_block, dtype="bfloat16",
        storage_dtype=default_storage_dtype("bfloat16", jax.default_backend()),
    )


class KVSetup:
    """The layout, the measured pools, the block every commit writes and the cursor of run 1."""

    def __init__(self, geometry: str, seed: int = 0) -> None:
        import jax.numpy as jnp

        from ardiff_jax.kv import allocate_pools, commit_block, cursor_block_pages

        self.layout = layout = _layout(geometry)
        self.frames = layout.frames_per_block
        self.seq_len = self.frames * layout.tokens_per_frame
        rng = np.random.default_rng(seed)
        shape = (layout.num_layers, self.seq_len, layout.num_kv_heads, layout.head_size)
        self.k = jnp.asarray(rng.standard_normal(shape, np.float32), layout.dtype)
        self.v = jnp.asarray(rng.standard_normal(shape, np.float32), layout.dtype)
        self.run_base = layout.run_base(1)
        self.pools = allocate_pools(layout)
        # Fill sink + ring and wrap the ring, with blocks that differ per commit (layer-rolled),
        # so that the attention comparison sees distinct frames.
        self.committed = 0
        for i in range(math.ceil(layout.run_pages / self.frames) + 2):
            pages = cursor_block_pages(layout, self.cursor(), self.frames, np)
            self.pools = commit_block(layout, self.pools, pages, jnp.roll(self.k, i, axis=0),
                                      jnp.roll(self.v, i, axis=0))
            self.committed += self.frames

    def cursor(self) -> np.ndarray:
        from ardiff_jax.kv import contiguous_table_cursor

        return contiguous_table_cursor(self.layout, self.run_base, self.committed, 0)

    def describe(self) -> dict[str, Any]:
        layout = self.layout
        fields = ("num_layers", "num_pages", "tokens_per_frame", "num_kv_heads", "head_size", "sink_frames",
                  "window_frames", "frames_per_block", "dtype", "storage_dtype")
        return {"layout": {f: getattr(layout, f) for f in fields}, "block_bytes": self.block_bytes,
                "pool_bytes": layout.pool_bytes}

    @property
    def block_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


# -- (a) commit --------------------------------------------------------------------------------------------
def measure_commit(setup: KVSetup, reps: tuple[int, int, int]) -> dict[str, Any]:
    """``commit_block`` (donated) vs a donated ``dynamic_update_slice`` of the same bytes, interleaved."""
    from ardiff_jax.kv import allocate_pools, commit_block, contiguous_table_cursor, cursor_block_pages
    from benchmarks.bench_kv import _floor_write_jit

    layout, frames = setup.layout, setup.frames
    own = {"commit_block": setup.pools, "floor": allocate_pools(layout)}
    committed = {name: setup.committed for name in own}

    def next_pages(name: str) -> np.ndarray:
        cursor = contiguous_table_cursor(layout, setup.run_base, committed[name], 0)
        pages = cursor_block_pages(layout, cursor, frames, np)
        committed[name] += frames
        return pages

    def commit_step() -> Any:
        own["commit_block"] = commit_block(layout, own["commit_block"], next_pages("commit_block"), setup.k, setup.v)
        return own["commit_block"]

    def floor_step() -> Any:
        # The same bytes into a same-sized pool, at a start that keeps the block inside it.
        start = np.int32(min(int(next_pages("floor")[0]), layout.num_pages - frames))
        own["floor"] = _floor_write_jit(layout, own["floor"], start, setup.k, setup.v)
        return own["floor"]

    stats = run_interleaved([Case("commit_block", commit_step), Case("floor", floor_step)],
                            warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
    # The commit pools go back to the setup (attention reads them); the floor's are freed.
    setup.pools, setup.committed = own["commit_block"], committed["commit_block"]
    own["floor"].delete()
    return {
        "stats": stats,
        "commit_block/floor": ratio(stats["commit_block"], stats["floor"]),
        "block_bytes": setup.block_bytes,
        "achieved_GBps": {name: setup.block_bytes / (s.median_ms / 1e3) / 1e9 for name, s in stats.items()},
    }


# -- (b) attend --------------------------------------------------------------------------------------------
def _attention_floors(layout: Any, num_queries: int, num_q_heads: int) -> dict[str, Any]:
    keys = layout.run_pages * layout.tokens_per_frame  # sink + window frames, current block included
    import jax.numpy as jnp

    itemsize = jnp.dtype(layout.dtype).itemsize  # the logical dtype attention reads
    window_bytes = 2 * keys * layout.num_kv_heads * layout.head_size * itemsize
    flops = 4 * num_queries * keys * num_q_heads * layout.head_size
    return {
        "queries": num_queries, "keys": keys, "query_heads": num_q_heads, "window_bytes_one_layer": window_bytes,
        "flops_one_layer": flops,
        "bandwidth_floor_ms": window_bytes / H200_BANDWIDTH_BYTES_PER_S * 1e3,
        "flop_floor_ms": flops / H200_BF16_FLOPS * 1e3,
    }


def measure_attend(setup: KVSetup, reps: tuple[int, int, int], guard: TimeGuard) -> dict[str, Any]:
    """Each attention backend at a full window against the bandwidth and FLOP floors."""
    import jax
    import jax.numpy as jnp

    from ardiff_jax.kv import attention_backend, ref_paged_attention
    from ardiff_jax.kv._cudnn import cudnn_support

    layout = setup.layout
    rng = np.random.default_rng(1)
    heads, size, seq = layout.num_kv_heads, layout.head_size, setup.seq_len
    q = jnp.asarray(rng.standard_normal((seq, heads, size), np.float32), layout.dtype)
    k_cur, v_cur = setup.k[0], setup.v[0]
    pools, cursor = setup.pools, setup.cursor()
    floors = _attention_floors(layout, seq, heads)
    cudnn_ok, cudnn_reason = cudnn_support(layout, q_dtype=q.dtype)

    dense_keys = floors["keys"]
    programs: dict[str, Callable[[np.int32], Any]] = {}
    skipped: dict[str, str] = {}
    for name in ("xla", "cudnn"):
        if name == "cudnn" and not cudnn_ok:
            skipped[name] = cudnn_reason
            continue
        fn = attention_backend(name)  # jitted with the layout static, as PagedKVCaches.attend calls it
        programs[name] = lambda layer, fn=fn: fn(layout, pools, cursor, layer, q, k_cur, v_cur)
    if cudnn_ok:
        dense = [jnp.asarray(rng.standard_normal((1, dense_keys, heads, size), np.float32), layout.dtype)
                 for _ in range(2)]
        dpa = jax.jit(lambda q4, k4, v4: jax.nn.dot_product_attention(q4, k4, v4, implementation="cudnn"))
        programs["dense_contiguous_cudnn"] = lambda layer: dpa(q[None], dense[0], dense[1])
    else:
        skipped["dense_contiguous_cudnn"] = cudnn_reason

    results: dict[str, Any] = {name: {"skipped": reason} for name, reason in skipped.items()}
    cases = []
    for name, program in programs.items():
        try:  # compile (and run once) outside the timing; a backend that fails is recorded, not fatal
            jax.block_until_ready(program(np.int32(0)))
        except Exception as error:  # noqa: BLE001 - one GPU run: record every failure and go on
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        counter = [0]

        def step(program: Callable[[np.int32], Any] = program, counter: list[int] = counter) -> Any:
            layer = np.int32(counter[0] % layout.num_layers)  # a new layer each call, like a forward
            counter[0] += 1
            return program(layer)

        cases.append(Case(name, step))
    if cases and guard.allows("attend timing", 5.0):
        stats = run_interleaved(cases, warmup=reps[0], rounds=reps[1], reps_per_round=reps[2])
        for name, s in stats.items():
            seconds = s.median_ms / 1e3
            results[name] = {
                "stats": s,
                "median_ms": s.median_ms,
                "x_bandwidth_floor": s.median_ms / floors["bandwidth_floor_ms"],
                "x_flop_floor": s.median_ms / floors["flop_floor_ms"],
                "achieved_GBps": floors["window_bytes_one_layer"] / seconds / 1e9,
                "achieved_TFLOPs": floors["flops_one_layer"] / seconds / 1e12,
            }
        if "cudnn" in stats and "dense_contiguous_cudnn" in stats:
            results["cudnn/dense_contiguous_cudnn"] = ratio(stats["cudnn"], stats["dense_contiguous_cudnn"])
        if "cudnn" in stats and "xla" in stats:
            results["xla/cudnn"] = ratio(stats["xla"], stats["cudnn"])

    # Agreement with the dense float32 reference on one frame of queries (rows are independent).
    check_q = q[:layout.tokens_per_frame]
    agreement: dict[str, Any] = {"queries": int(check_q.shape[0])}
    try:
        ref = np.asarray(jax.jit(ref_paged_attention, static_argnums=0)(
            layout, pools, cursor, np.int32(0), check_q, k_cur, v_cur), np.float32)
        agreement["max_abs_reference"] = float(np.abs(ref).max())
        for name in ("xla", "cudnn"):
            if name in programs and "error" not in results.get(name, {}):
                out = attention_backend(name)(layout, pools, cursor, np.int32(0), check_q, k_cur, v_cur)
                agreement[f"{name}_max_abs_diff"] = float(np.abs(np.asarray(out, np.float32) - ref).max())
    except Exception as error:  # noqa: BLE001 - keep the timings above even if the check cannot run
        agreement["error"] = f"{type(error).__name__}: {error}"
    return {"floors": floors, "cudnn_support": {"supported": cudnn_ok, "reason": cudnn_reason},
            "backends": results, "agreement_with_reference": agreement}


# -- (c) world ---------------------------------------------------------------------------------------------
def _world_backends(layout: Any, requested: str) -> tuple[list[str], str]:
    from ardiff_jax.kv._cudnn import select_attention_backend

    chosen, reason = select_attention_backend(layout)
    if requested == "auto":
        return (["cudnn", "xla"] if chosen == "cudnn" else ["xla"]), reason
    return [requested], reason


def world_config(mode: Mode) -> Any:
    """The transformer config of (c) and (e): the ``wan2.1-t2v-1.3b`` preset at its full 60x104 latent with
    Self-Forcing's policy (the preset's own, stated) in bf16, or ``bench_wan.smoke_config()`` for ``--smoke``."""
    from benchmarks.bench_wan import wan_config

    if mode.preset == "wan-smoke":
        return wan_config(smoke=True)
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.wan import with_policy

    return with_policy(dit_preset(mode.preset, dtype="bfloat16", param_dtype="bfloat16"), "self-forcing")


def measure_world(mode: Mode, layout: Any, guard: TimeGuard, requested: str = "auto") -> dict[str, Any]:
    """The causal-Wan pipeline with its VAE through the engine, per backend: blocks/s after warmup, then the
    block split; after the first backend, the text encode of one prompt."""
    from benchmarks.bench_wan import make_pipeline, make_vae, vae_config, vae_summary

    backends, reason = _world_backends(layout, requested)
    config = world_config(mode)
    smoke = mode.preset == "wan-smoke"
    frames = config.frames_per_block
    record: dict[str, Any] = {
        "preset": mode.preset, "pipeline": "CausalWanPipeline", "policy": "self-forcing", "weights": "random",
        "dtype": "bfloat16", "num_layers": config.num_layers, "dim": config.dim,
        "latent": [config.latent_height, config.latent_width],
        "video_resolution": [8 * config.latent_height, 8 * config.latent_width], "frames_per_block": frames,
        "visible_frames": config.sink_frames + config.window_frames, "sink_frames": config.sink_frames,
        "window_frames": config.window_frames, "tokens_per_frame": config.tokens_per_frame,
        "backends_planned": backends, "backend_choice_reason": reason,
        "video_frames_note": (f"end to end: every block is decoded by the streaming VAE; a steady-state block is "
                              f"{frames} latent frames -> {VIDEO_FRAMES_PER_LATENT_FRAME * frames} video frames "
                              f"({VIDEO_FRAMES_PER_LATENT_FRAME} per latent frame after a session's first), so video "
                              "frames/s = decoded frames per block / block time (transformer + VAE decode + "
                              "runtime); the text encode is timed once per prompt, separately (text_encode); the "
                              "session is conditioned on random prompt_embeds"),
        "reference_fps": {"label": REFERENCE_LABEL, **REFERENCE_FPS},
        "goal": {"video_frames_per_s": GOAL_VIDEO_FRAMES_PER_S, "hardware": "1x H200",
                 "what": "end-to-end (transformer + VAE decode) video frames/s at 480x832"},
        "transformer_goal": {"video_frames_per_s": GOAL_TRANSFORMER_VIDEO_FRAMES_PER_S, "hardware": "1x H200",
                             "what": "transformer-only video frames/s (the split's denoise + commit medians)"},
        "results": {},
    }
    start = time.perf_counter()
    # One random init each (the transformer: bf16, one jitted program; the VAE: drawn on the host), shared by
    # every backend's pipeline.
    modules = make_pipeline(config).modules
    record["weights_init_s"] = time.perf_counter() - start
    start = time.perf_counter()
    vae = make_vae(vae_config(config, smoke=smoke))
    record["vae_init_s"] = time.perf_counter() - start
    record["vae"] = vae_summary(vae, config, smoke=smoke)
    previous_s = None
    for index, name in enumerate(backends):
        # The first backend needs ~1.5-2 minutes on a GPU; a later one as long as the first took.
        if not guard.allows(f"world/{name}", 20.0 if previous_s is None else 1.2 * previous_s):
            record["results"][name] = {"skipped": guard.skipped[-1]}
        else:
            began = time.perf_counter()
            try:
                record["results"][name] = _roll_out(name, config, modules, vae, mode, guard)
            except TimeGuardExpired as error:  # keep the earlier backends' numbers; the guard skips the rest
                record["results"][name] = {"aborted": str(error)}
                guard.skipped.append(f"world/{name}: {error}")
            except Exception as error:  # noqa: BLE001 - one GPU run: record every failure and go on
                record["results"][name] = {"error": f"{type(error).__name__}: {error}"}
            previous_s = time.perf_counter() - began
        if index == 0:
            record["text_encode"] = _text_encode(mode, guard)
    _amortise(record)
    return record


def _text_encode(mode: Mode, guard: TimeGuard) -> dict[str, Any]:
    """``bench_wan.measure_text_encode`` of the mode's umT5 (the XXL on a GPU) when the guard leaves time."""
    from benchmarks.bench_wan import measure_text_encode

    if not guard.allows(f"world/text_encode ({mode.text_encoder})", mode.text_needed_s):
        return {"skipped": guard.skipped[-1], "kind": mode.text_encoder}
    try:
        return measure_text_encode(mode.text_encoder, warmup=1, rounds=mode.text_rounds,
                                   keep_going=lambda slowest: guard.remaining() >= 2 * slowest)
    except TimeGuardExpired as error:  # keep the rollout's numbers; the guard skips what follows
        guard.skipped.append(f"world/text_encode: {error}")
        return {"aborted": str(error), "kind": mode.text_encoder}
    except Exception as error:  # noqa: BLE001 - e.g. out of memory: record it, keep the rollout's numbers
        return {"error": f"{type(error).__name__}: {error}", "kind": mode.text_encoder}


def _amortise(record: dict[str, Any]) -> None:
    """Add end-to-end frames/s with one text encode per prompt to every backend that has a block time."""
    from benchmarks.bench_wan import amortised_fps

    text = record.get("text_encode", {})
    if "median_ms" not in text:
        return
    for result in record["results"].values():
        if "block_ms_median" in result and math.isfinite(result["block_ms_median"]):
            result["amortised_with_text_encode"] = amortised_fps(
                result["video_frames_per_block"], result["block_ms_median"], text["median_ms"])


def _roll_out(name: str, config: Any, modules: Any, vae: Any, mode: Mode, guard: TimeGuard) -> dict[str, Any]:
    """One engine with attention backend ``name`` and the VAE: warmup blocks, timed blocks on one session,
    then the split."""
    from ardiff_jax import ARDiffusionEngine, DiffusionRequest
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig
    from benchmarks.bench_e2e import _CompileClock
    from benchmarks.bench_wan import engine_config, prompt_embeds, split_block
    from benchmarks.common import sync

    frames = config.frames_per_block
    session = f"gpu-check-{name}"
    embeds = prompt_embeds(config)
    block_s: list[float] = []
    video_frames: list[int] = []
    finite = True
    stopped_early = False
    split: dict[str, Any] = {}
    with _CompileClock() as clock:
        start = time.perf_counter()
        pipeline = CausalWanPipeline(config, CausalWanPipelineConfig(session_capacity=1), modules=modules, vae=vae)
        engine = ARDiffusionEngine(pipeline, engine_config(name))
        load_s = time.perf_counter() - start  # includes the pipeline's 2 warmup blocks (compilation)
        load_compiles = clock.count
        try:
            for block in range(mode.world_warmup_blocks + mode.world_timed_blocks):
                timed = block >= mode.world_warmup_blocks
                if timed and not block_s:
                    compiles_before = clock.count
                if timed and block_s and guard.remaining() < 2 * max(block_s):
                    stopped_early = True
                    break
                inputs = {"prompt_embeds": embeds} if block == 0 else {}
                request = DiffusionRequest(f"{session}-b{block}", inputs=inputs, extra_args={"session_id": session})
                t0 = time.perf_counter()
                out = engine.generate(request)
                sync(out)  # the latents and the decoded uint8 video
                elapsed = time.perf_counter() - t0
                latents = np.asarray(out.latents)
                finite = finite and latents.shape[0] == frames and bool(np.isfinite(latents).all())
                if timed:
                    block_s.append(elapsed)
                    video_frames.append(int(out.video.shape[0]))
            compiles_during = clock.count - compiles_before if block_s else 0
            capacity = engine.session_capacity
            # The split: capture + a warmup round + rounds of ~2 blocks each; a round starts only
            # with twice the slowest round left (before the first, ~6 blocks' worth).
            block_guess = max(block_s) if block_s else 1.0
            if guard.allows(f"world/{name}/split", 6 * block_guess):
                try:
                    split = split_block(engine, session, frames_per_block=frames, warmup=1,
                                        rounds=mode.world_split_rounds,
                                        keep_going=lambda slowest: guard.remaining() >= 2 * slowest)
                except TimeGuardExpired:
                    raise
                except Exception as error:  # noqa: BLE001 - keep the rollout's numbers
                    split = {"error": f"{type(error).__name__}: {error}"}
            else:
                split = {"skipped": guard.skipped[-1]}
        finally:
            engine.close()
    median_s = float(np.median(block_s)) if block_s else float("nan")
    frames_per_block = int(np.median(video_frames)) if video_frames else VIDEO_FRAMES_PER_LATENT_FRAME * frames
    latent_fps = frames / median_s
    video_fps = frames_per_block / median_s
    transformer_fps = None
    if "transformer_ms" in split:
        transformer_fps = VIDEO_FRAMES_PER_LATENT_FRAME * frames / (split["transformer_ms"] / 1e3)
    return {
        "engine_load_s": load_s, "engine_load_compiles": load_compiles, "session_capacity": capacity,
        "blocks_timed": len(block_s), "stopped_early_by_time_guard": stopped_early,
        "block_ms": [s * 1e3 for s in block_s], "block_ms_median": median_s * 1e3,
        "video_frames_per_block": frames_per_block,
        "latent_frames_per_s": latent_fps,
        "video_frames_per_s": video_fps,
        "e2e_video_frames_per_s": video_fps,
        "video_frames_per_s_over_reference": {
            ref: video_fps / figures["video_frames_per_s"] for ref, figures in REFERENCE_FPS.items()},
        "goal_video_frames_per_s": GOAL_VIDEO_FRAMES_PER_S,
        "goal_met": bool(video_fps >= GOAL_VIDEO_FRAMES_PER_S),
        "transformer_video_frames_per_s": transformer_fps,
        "transformer_goal_video_frames_per_s": GOAL_TRANSFORMER_VIDEO_FRAMES_PER_S,
        "transformer_goal_met": None if transformer_fps is None else bool(
            transformer_fps >= GOAL_TRANSFORMER_VIDEO_FRAMES_PER_S),
        "vae_decode_ms": split.get("vae_decode_ms"),
        "xla_compiles_during_timed_blocks": compiles_during,
        "latents_finite": finite,
        "split": split,
    }


# -- (e) wan_batch -----------------------------------------------------------------------------------------
#: Wan2.1's native video frame rate: a player is served in real time at 16 video frames/s.
PLAYER_FPS = 16


#: What the runtime logs when a batched forward raised and its requests were rerun one by one.
BATCH_FALLBACK_LOG = "rerunning them one by one"


@contextmanager
def _runtime_warnings() -> Iterator[list[str]]:
    """The runtime's warnings while the block runs: a failed bucket warmup or a batched forward rerun one by
    one is only logged (the tick still returns), and (e) must not report such a tick as a batched one."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("ardiff_jax.runtime")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _sessions_fit(plan: Any, fraction: float) -> int:
    """The most resident sessions the plan's terms admit in ``fraction`` of the free memory it saw (no cap).

    The plan itself stops at the requested capacity; this is its own arithmetic, ``required(c) <=
    floor(available * fraction)``, carried past that cap. It counts what the plan counts (pages, cross
    caches, model-owned state such as the VAE cache, scratch), not the batched forward's temporaries.
    """
    budget = math.floor(plan.available_bytes * fraction)
    fixed = plan.required_bytes(0)
    per_session = plan.required_bytes(1) - fixed
    count = max(0, (budget - fixed) // per_session)
    while count > 0 and plan.required_bytes(count) > budget:
        count -= 1
    while plan.required_bytes(count + 1) <= budget:
        count += 1
    return int(count)


def _memory_summary(plan: Any, fractions: dict[str, float]) -> dict[str, Any]:
    """The plan's per-session and fixed bytes, and how many sessions fit at each named fraction."""
    fixed = plan.required_bytes(0)
    return {
        "available_bytes": plan.available_bytes, "memory_source": plan.memory_source,
        "gpu_memory_fraction": plan.gpu_memory_fraction, "budget_bytes": plan.budget_bytes,
        "requested_session_capacity": plan.requested_session_capacity, "session_capacity": plan.session_capacity,
        "page_bytes": plan.page_bytes, "run_pages": plan.run_pages, "pool_bytes": plan.pool_bytes,
        "cross_attention_bytes_per_session": plan.cross_attention_bytes_per_session,
        "model_owned_bytes_per_session": plan.model_owned_bytes_per_session,
        "per_session_bytes": plan.required_bytes(1) - fixed,
        "fixed_bytes": fixed,
        "sessions_fit": {name: {"gpu_memory_fraction": fraction, "sessions": _sessions_fit(plan, fraction)}
                         for name, fraction in fractions.items()},
        "note": "per_session_bytes = required(c + 1) - required(c) of the plan (the session's pages, its text "
                "cross-attention cache and its model-owned state, the VAE decoder cache included); sessions_fit = "
                "the largest c with required(c) <= floor(available_bytes * fraction), past the requested "
                "capacity; the batched forward's temporaries are not in the plan",
    }


def measure_wan_batch(mode: Mode, guard: TimeGuard) -> dict[str, Any]:
    """Players per device: (c)'s causal Wan with its VAE, one engine serving ``B`` sessions per tick.

    One engine at capacity ``max(mode.batch_sizes)`` (its warmup compiles every batch bucket, timed as
    part of the load); that many sessions, each with its own random prompt, get full windows from
    batched fill ticks; then per ``B``: ticks of ``generate_batch`` over sessions ``0 .. B-1``
    (``generate`` for ``B = 1``), each tick synced on every session's latents and decoded video.
    Sizes run largest first: the sessions' windows are already full after the fill, the largest is
    the figure a player count needs, and a size's time is bounded by the larger one measured before
    it (a smaller batch is not slower), which is what the guard is asked for before each size.
    Compiles after the load are counted (every bucket was compiled by the warmup, so expected 0).
    """
    import jax

    from ardiff_jax import ARDiffusionEngine
    from benchmarks.bench_batch import _count_compiles
    from benchmarks.bench_wan import engine_config, make_pipeline, make_vae, vae_config

    config = world_config(mode)
    smoke = mode.preset == "wan-smoke"
    frames = config.frames_per_block
    visible = config.sink_frames + config.window_frames
    # A block sees at most visible - frames history frames beside its own: full from this many committed blocks on.
    fill_blocks = max(1, math.ceil((visible - frames) / frames))
    requested = max(mode.batch_sizes)
    world_engine_config = engine_config()  # (c)'s: on an accelerator 0.3 of the free memory
    on_cpu = jax.default_backend() == "cpu"
    config_e = world_engine_config if on_cpu else dataclasses.replace(
        world_engine_config, gpu_memory_fraction=mode.batch_memory_fraction)
    record: dict[str, Any] = {
        "preset": mode.preset, "pipeline": "CausalWanPipeline", "policy": "self-forcing", "weights": "random",
        "dtype": "bfloat16", "num_layers": config.num_layers, "dim": config.dim,
        "latent": [config.latent_height, config.latent_width],
        "video_resolution": [8 * config.latent_height, 8 * config.latent_width], "frames_per_block": frames,
        "visible_frames": visible, "with_vae": True, "batch_sizes_planned": list(mode.batch_sizes),
        "session_capacity_requested": requested, "fill_blocks": fill_blocks,
        "player_fps": PLAYER_FPS,
        "note": (f"one tick = the next block of B sessions (generate_batch; generate at B = 1), transformer + each "
                 f"session's VAE decode + runtime, synced; every session's block arrives at the end of the tick, so "
                 f"per-session latency = the tick; aggregate video frames/s = B x decoded frames per block / tick; "
                 f"players_at_{PLAYER_FPS}fps = floor(aggregate / {PLAYER_FPS}) (Wan's native frame rate); "
                 f"all_players_real_time: each of the B sessions gets >= {PLAYER_FPS} frames/s at that B"),
        "results": {},
    }
    start = time.perf_counter()
    vae = make_vae(vae_config(config, smoke=smoke))
    record["vae_init_s"] = time.perf_counter() - start
    start = time.perf_counter()
    pipeline = make_pipeline(config, session_capacity=requested, vae=vae)  # random weights, one jitted init
    record["weights_init_s"] = time.perf_counter() - start
    with _count_compiles() as load_compiles, _runtime_warnings() as load_warnings:
        start = time.perf_counter()
        engine = ARDiffusionEngine(pipeline, config_e)
        record["engine_load_s"] = time.perf_counter() - start  # plan, pools and the warmup of every bucket
    record["engine_load_compiles"] = len(load_compiles)
    record["engine_load_warnings"] = load_warnings[:10]
    try:
        plan = engine.memory_plan
        record.update({
            "session_capacity": engine.session_capacity, "batch_buckets": list(engine.batch_buckets),
            "supports_batched_forward": engine.runner.supports_batched_forward,
            "attention_backend": engine.runner.kv_cache.attention_backend,
            "memory": _memory_summary(plan, {
                "this_engine": plan.gpu_memory_fraction,
                "world_section": world_engine_config.gpu_memory_fraction,
                "all_free_memory": 1.0}),
        })
        sizes = sorted((size for size in mode.batch_sizes if size <= engine.session_capacity), reverse=True)
        for size in mode.batch_sizes:
            if size > engine.session_capacity:
                record["results"][str(size)] = {"skipped": (
                    f"the memory plan admits {engine.session_capacity} sessions at gpu_memory_fraction "
                    f"{plan.gpu_memory_fraction}")}
        if sizes:
            _batch_ticks(engine, config, sizes, fill_blocks, mode, guard, record)
    except TimeGuardExpired as error:  # keep the sizes measured so far; the guard skips what follows
        record["aborted"] = str(error)
        guard.skipped.append(f"wan_batch: {error}")
    except Exception as error:  # noqa: BLE001 - e.g. out of memory at a batch size: keep the sizes measured
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        engine.close()
    record["results"] = {str(size): record["results"][str(size)] for size in mode.batch_sizes
                         if str(size) in record["results"]}
    measured = [r for r in record["results"].values() if "aggregate_video_frames_per_s" in r]
    record["batch_sizes_measured"] = [r["batch_size"] for r in measured]
    if measured:
        best = max(measured, key=lambda r: r[f"players_at_{PLAYER_FPS}fps"])
        real_time = [r["batch_size"] for r in measured if r["all_players_real_time"]]
        record["players"] = {
            f"most_players_at_{PLAYER_FPS}fps": best[f"players_at_{PLAYER_FPS}fps"],
            "at_batch_size": best["batch_size"],
            "largest_batch_all_players_real_time": max(real_time, default=0),
        }
        one = record["results"].get("1", {})
        if "aggregate_video_frames_per_s" in one:
            for result in measured:
                result["aggregate_over_batch_1"] = (result["aggregate_video_frames_per_s"]
                                                    / one["aggregate_video_frames_per_s"])
    return record


def _batch_ticks(engine: Any, config: Any, sizes: list[int], fill_blocks: int, mode: Mode, guard: TimeGuard,
                 record: dict[str, Any]) -> None:
    """Fill ``max(sizes)`` sessions' windows with batched ticks, then time each size (largest first) into
    ``record["results"]``, so that what was measured survives a hard-deadline abort."""
    from ardiff_jax import DiffusionRequest
    from benchmarks.bench_batch import _count_compiles
    from benchmarks.bench_wan import prompt_embeds
    from benchmarks.common import Stats, sync

    sessions = [f"gpu-check-batch-{index}" for index in range(max(sizes))]
    sent = [0]

    def tick(ids: list[str], first: bool = False) -> tuple[float, list[Any]]:
        """One tick over ``ids``, synced; a session's first request carries its own random prompt."""
        requests = []
        for index, sid in enumerate(ids):
            sent[0] += 1
            inputs = {"prompt_embeds": prompt_embeds(config, seed=index)} if first else {}
            requests.append(DiffusionRequest(f"{sid}-r{sent[0]}", inputs=inputs, extra_args={"session_id": sid}))
        start = time.perf_counter()
        outs = [engine.generate(requests[0])] if len(requests) == 1 else engine.generate_batch(requests)
        sync(outs)  # every session's latents and decoded uint8 video
        return time.perf_counter() - start, outs

    results = record["results"]
    with _count_compiles() as after_load:
        # Fill: every session's first block, then the next ones until the next block sees a full window.
        fill_s: list[float] = []
        for block in range(fill_blocks):
            if fill_s and guard.remaining() < 2 * max(fill_s):
                break
            fill_s.append(tick(sessions, first=block == 0)[0])
        record["fill"] = {"batch_size": len(sessions), "ticks": len(fill_s), "tick_ms": [1e3 * s for s in fill_s],
                          "windows_full": len(fill_s) == fill_blocks}
        bound_s = max(fill_s)  # the slowest tick of the largest batch: no smaller batch takes longer
        for size in sizes:
            ids = sessions[:size]
            warm = 0 if size == len(sessions) else 1  # the fill has just run the largest batch's programs
            if not guard.allows(f"wan_batch/B={size}", (warm + mode.batch_timed_ticks) * bound_s):
                results[str(size)] = {"skipped": guard.skipped[-1]}
                continue
            for _ in range(warm):
                tick(ids)
            tick_s: list[float] = []
            video_frames: list[int] = []
            finite = True
            stopped = False
            with _count_compiles() as compiles, _runtime_warnings() as warnings:
                for _ in range(mode.batch_timed_ticks):
                    if tick_s and guard.remaining() < 2 * max(tick_s):
                        stopped = True
                        break
                    elapsed, outs = tick(ids)
                    tick_s.append(elapsed)
                    video_frames.extend(int(out.video.shape[0]) for out in outs)
                    finite = finite and all(bool(np.isfinite(np.asarray(out.latents)).all()) for out in outs)
            stats = Stats.of(tick_s)
            seconds = stats.median_ms / 1e3
            per_block = int(np.median(video_frames))
            aggregate = size * per_block / seconds
            results[str(size)] = {
                "batch_size": size, "call": "generate" if size == 1 else "generate_batch",
                "ticks_timed": len(tick_s), "warm_ticks": warm, "stopped_early_by_time_guard": stopped,
                "tick_ms": stats.as_dict(), "tick_ms_median": stats.median_ms,
                "video_frames_per_block": per_block,
                "aggregate_video_frames_per_s": aggregate,
                "aggregate_latent_frames_per_s": size * config.frames_per_block / seconds,
                "session_latency_ms_median": stats.median_ms,
                "per_session_video_frames_per_s": per_block / seconds,
                f"players_at_{PLAYER_FPS}fps": math.floor(aggregate / PLAYER_FPS),
                "all_players_real_time": bool(per_block / seconds >= PLAYER_FPS),
                "xla_compiles_during_timed_ticks": len(compiles),
                "compiled_during_timed_ticks": sorted(set(compiles)),
                "batched_forward_fallbacks": sum(BATCH_FALLBACK_LOG in message for message in warnings),
                "runtime_warnings": warnings[:5],
                "latents_finite": finite,
            }
            bound_s = max(tick_s)
    record["xla_compiles_after_load"] = len(after_load)


# -- driver ------------------------------------------------------------------------------------------------
def _device_info() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    stats = {}
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    return {"platform": device.platform, "device_kind": device.device_kind, "num_devices": jax.device_count(),
            "bytes_limit": stats.get("bytes_limit")}


def run(*, smoke: bool = False, out: Path | None = None, budget_s: float | None = None,
        world_backend: str = "auto", sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Run (a)-(e) (or the ``sections`` named, in that order) under the time guard; write the JSON after every
    section; return it. Sections not named are left out of the JSON; ``complete`` is about those named."""
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ValueError(f"sections must be a non-empty subset of {SECTIONS}, got {tuple(sections)}")
    mode = SMOKE if smoke else FULL
    out = out if out is not None else RESULTS_DIR / ("gpu_check_smoke.json" if smoke else "gpu_check.json")
    guard = TimeGuard(mode.budget_s if budget_s is None else budget_s)
    record: dict[str, Any] = {
        "benchmark": "gpu_check",
        "mode": mode.name,
        "machine": machine_info(),
        "device": _device_info(),
        "config": dataclasses.asdict(mode),
        "hardware_floors": {
            "bandwidth_bytes_per_s": H200_BANDWIDTH_BYTES_PER_S, "bf16_dense_flops_per_s": H200_BF16_FLOPS,
            "label": "H200 SXM spec sheet: HBM3e bandwidth and dense BF16 tensor throughput"},
        "sections": [key for key in SECTIONS if key in sections],
        "complete": False,
    }
    errors: list[str] = []  # sections that raised
    section_s: dict[str, float] = {}  # wall seconds of each section that started: the next budget's estimates

    def save() -> None:
        record["time_guard"] = {"budget_s": guard.budget_s, "elapsed_s": guard.elapsed(), "skipped": guard.skipped,
                                "section_s": section_s}
        write_json(out, record)

    def section(key: str, needed_s: float, fn: Callable[[], Any]) -> None:
        if key not in sections:
            return
        if not guard.allows(key, needed_s):
            record[key] = {"skipped": guard.skipped[-1]}
        else:
            began = guard.elapsed()
            try:
                record[key] = fn()
                if isinstance(record[key], dict) and "error" in record[key]:  # raised inside, kept what it measured
                    errors.append(key)
            except TimeGuardExpired as error:
                record[key] = {"aborted": str(error)}
                guard.skipped.append(f"{key}: {error}")
            except Exception as error:  # noqa: BLE001 - one GPU run: record the failure, run the next section
                record[key] = {"error": f"{type(error).__name__}: {error}"}
                errors.append(key)
            section_s[key] = guard.elapsed() - began
        save()

    save()
    setup: list[KVSetup] = []

    def kv_setup() -> KVSetup:
        if not setup:
            setup.append(KVSetup(mode.geometry))
        return setup[0]

    with guard.hard_deadline():
        section("commit", 1.0 if smoke else 10.0, lambda: {**kv_setup().describe(),
                                                               **measure_commit(kv_setup(), mode.commit_reps)})
        section("attend", 1.0 if smoke else 20.0, lambda: measure_attend(kv_setup(), mode.attend_reps, guard))
        layout = setup[0].layout if setup else _layout(mode.geometry)
        if setup:  # free the KV benchmark's pools before the engine plans its memory
            setup[0].pools.delete()
            setup.clear()
        section("world", 1.0 if smoke else 30.0, lambda: measure_world(mode, layout, guard, world_backend))
        # (d) Matrix-Game 2.0 (universal, random weights, bf16, 352x640) through the engine, next to its 25 fps.
        section("matrix_game", 1.0 if smoke else 60.0, lambda: _matrix_game(smoke))
        # (e) (c)'s Wan-1.3B with its VAE, one engine serving 8, 4, 2, 1 sessions per tick: players per device.
        # Last: it is the longest and the guard skips it (with the reason) rather than anything before it.
        section("wan_batch", mode.batch_needed_s, lambda: measure_wan_batch(mode, guard))
        # (f) DreamZero-DROID (random bf16 weights) robot inference calls next to the release's ~3 s (2 x H100).
        section("dreamzero", 1.0 if smoke else 150.0, lambda: measure_dreamzero(smoke))
    record["complete"] = not guard.skipped and not errors
    save()
    _print_summary(record, out)
    return record


#: The release's DreamZero-DROID inference time per call (its README): 2 x H100 with CFG split over them, and
#: GB200; our goal on one H200.
DREAMZERO_RELEASE_S = {"2 x H100": 3.0, "GB200": 0.6}
DREAMZERO_GOAL_S = 1.0


def measure_dreamzero(smoke: bool) -> dict[str, Any]:
    """(f) DreamZero robot inference calls through the engine (``bench_dreamzero``): the DROID geometry with
    random bf16 weights (16.5e9 parameters, 33 GB), one robot episode: seconds per call (an episode start,
    then continuing calls: 2 observed frames committed on both branches, 16 UniPC steps, 8 x 2 DiT
    evaluations) and its breakdown, the memory plan's robots per device; ``--smoke``: the tiny parity network."""
    import jax

    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.dreamzero import DreamZeroPipeline
    from benchmarks.bench_dreamzero import measure_calls, memory_plan

    preset = "dreamzero-tiny" if smoke else "dreamzero-droid"
    config = dit_preset(preset)
    began = time.perf_counter()
    pipeline = DreamZeroPipeline(config)  # random weights, initialised on the device in one program
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype=config.dtype, gpu_memory_fraction=0.9, warmup=False))
    build_s = time.perf_counter() - began
    with engine:
        record = measure_calls(engine, config, calls=4, episodes=1 if smoke else 2)
    record.update(preset=preset, build_s=build_s, device=str(jax.devices()[0].device_kind),
                  release_s=DREAMZERO_RELEASE_S, goal_s=DREAMZERO_GOAL_S,
                  goal_met=bool(record["call_s"] < DREAMZERO_GOAL_S), memory=memory_plan(dtype="bfloat16"))
    return record


def _matrix_game(smoke: bool) -> dict[str, Any]:
    from benchmarks.bench_wan import matrix_game_blocks

    return matrix_game_blocks(smoke=smoke, blocks=2 if smoke else 4)


def _print_summary(record: dict[str, Any], out: Path) -> None:
    print(f"== gpu_check ({record['mode']}) on {record['device']['device_kind']} ==")
    commit = record.get("commit", {})
    if "commit_block/floor" in commit:
        print(f"commit: commit_block/floor = {commit['commit_block/floor']:.2f} "
              f"({commit['stats']['commit_block'].median_ms:.3f} vs {commit['stats']['floor'].median_ms:.3f} ms)")
    attend = record.get("attend", {})
    for name, result in attend.get("backends", {}).items():
        if isinstance(result, dict) and "median_ms" in result:
            print(f"attend {name}: {result['median_ms']:.3f} ms, {result['x_flop_floor']:.1f}x FLOP floor, "
                  f"{result['x_bandwidth_floor']:.1f}x bandwidth floor, {result['achieved_GBps']:.0f} GB/s")
        elif isinstance(result, dict):
            print(f"attend {name}: {result}")
    world = record.get("world", {})
    for name, result in world.get("results", {}).items():
        if "latent_frames_per_s" in result:
            goal = "met" if result["goal_met"] else "not met"
            print(f"world {name} ({world.get('preset')}, latent {world.get('latent')}, with VAE): "
                  f"{result['latent_frames_per_s']:.2f} latent frames/s, {result['video_frames_per_s']:.1f} video "
                  f"frames/s end to end (goal >= {result['goal_video_frames_per_s']:.0f}: {goal})")
            if result.get("transformer_video_frames_per_s"):
                print(f"world {name} transformer only: {result['transformer_video_frames_per_s']:.1f} video frames/s "
                      f"(goal >= {result['transformer_goal_video_frames_per_s']:.0f}: "
                      f"{'met' if result['transformer_goal_met'] else 'not met'})")
            split = result.get("split", {})
            if "overhead_ms" in split:
                vae = f"VAE decode {split['vae_decode_ms']:.2f} ms, " if "vae_decode_ms" in split else ""
                print(f"world {name} split: denoise {split['denoise_ms']:.2f} ms ({split['denoise_steps']} steps), "
                      f"commit {split['commit_ms']:.2f} ms, {vae}overhead {split['overhead_ms']:.2f} ms = "
                      f"{100 * split['overhead_fraction_of_model']:.2f}% of model (target <= "
                      f"{100 * split['overhead_target_fraction']:.0f}%: "
                      f"{'met' if split['overhead_target_met'] else 'not met'})")
                self_time = split.get("runtime_self_time", {})
                if "runtime_ms_median" in self_time:
                    print(f"world {name} runtime's own time with synced device calls: "
                          f"{self_time['runtime_ms_median']:.2f} ms = "
                          f"{100 * self_time['runtime_fraction_of_model_median']:.2f}% of the forwards and decode")
            elif split:
                print(f"world {name} split: {split}")
            for entry in result.get("amortised_with_text_encode", []):
                print(f"world {name} end to end with one text encode per {entry['blocks_per_prompt']} blocks: "
                      f"{entry['video_frames_per_s']:.1f} video frames/s")
        else:
            print(f"world {name}: {result}")
    text = world.get("text_encode", {})
    if "median_ms" in text:
        print(f"text encode ({text['kind']} umT5, {text['num_layers']} layers, {text['params'] / 1e9:.2f}B params, "
              f"{TEXT_LEN_NOTE}): {text['median_ms']:.2f} ms per prompt (init {text['init_s']:.1f} s, first encode "
              f"{text['first_encode_s']:.1f} s)")
    elif text:
        print(f"text encode: {text}")
    vae = world.get("vae", {})
    if "cache_bytes_per_session" in vae:
        print(f"VAE cache per session: {vae['cache_bytes_per_session'] / 2**20:.1f} MiB "
              f"({vae['cache_bytes_per_session_832x480'] / 2**20:.1f} MiB at 832x480)")
    for ref, figures in REFERENCE_FPS.items():
        users = figures.get("measured_by_users_video_frames_per_s")
        print(f"reference {ref}: {figures['video_frames_per_s']} video frames/s ({figures['hardware']}, "
              f"{figures['source']}" + (f"; ~{users:.0f} measured end to end by users" if users else "")
              + "; not measured here)")
    game = record.get("matrix_game", {})
    if "frames_per_s" in game:
        split = game["split_ms_median"]
        print(f"Matrix-Game ({game['preset']}, {game['dtype']}, {game['pixels'][0]}x{game['pixels'][1]}): "
              f"{game['frames_per_s']:.1f} video frames/s = {game['ratio_to_release']:.2f}x the release's "
              f"{game['release_reported_fps']:.0f}; per block transformer {split['transformer']:.1f} ms, VAE decode "
              f"{split['vae_decode']:.1f} ms, runtime {split['runtime']:.1f} ms")
    elif game:
        print(f"Matrix-Game: {game}")
    _print_wan_batch(record.get("wan_batch", {}))
    robot = record.get("dreamzero", {})
    if "call_s" in robot:
        split = robot["breakdown"]
        release = ", ".join(f"{k}: {v} s" for k, v in robot["release_s"].items())
        print(f"DreamZero ({robot['preset']}): {robot['call_s']:.3f} s per inference call (episode start "
              f"{robot['episode_start_s']:.3f} s; goal < {robot['goal_s']:.0f} s: {'met' if robot['goal_met'] else 'not met'}"
              f"; the release: {release}); commit {split['commit_s']:.3f} s, DiT {split['dit_s']:.3f} s, scheduler "
              f"{split['scheduler_s']:.4f} s, host {split['host_s']:.4f} s; robots per device "
              + ", ".join(f"{k}: {v}" for k, v in robot["memory"]["robots_per_device"].items()))
    elif robot:
        print(f"DreamZero: {robot}")
    if record["time_guard"]["skipped"]:
        print(f"time guard: {record['time_guard']['skipped']}")
    print(f"wrote {out}")


def _section_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {','.join(SECTIONS)}; got {text!r}")
    return names


def _print_wan_batch(batch: dict[str, Any]) -> None:
    """Section (e): one row per batch size, then the memory plan's session counts."""
    if "results" not in batch:
        if batch:
            print(f"wan_batch: {batch}")
        return
    fill = batch.get("fill", {})
    print(f"wan_batch ({batch['preset']}, {batch['video_resolution'][0]}x{batch['video_resolution'][1]}, with VAE, "
          f"{batch.get('attention_backend')} attention): engine load {batch['engine_load_s']:.1f} s (warmup of "
          f"buckets {batch.get('batch_buckets')}), capacity {batch.get('session_capacity')}, fill "
          f"{fill.get('ticks')} ticks (windows full: {fill.get('windows_full')})")
    for key in ("error", "aborted"):
        if key in batch:
            print(f"wan_batch {key}: {batch[key]}")
    fps = f"players at {PLAYER_FPS} fps"
    rows = []
    for size, result in batch["results"].items():
        if "tick_ms_median" in result:
            rows.append((size, result["tick_ms_median"], result["aggregate_video_frames_per_s"],
                         result["per_session_video_frames_per_s"], result["session_latency_ms_median"],
                         result[f"players_at_{PLAYER_FPS}fps"], result["xla_compiles_during_timed_ticks"]))
        else:
            print(f"wan_batch B={size}: {result}")
    if rows:
        print(format_table(("B", "tick ms", "aggregate frames/s", "per-session frames/s", "latency ms", fps,
                            "compiles"), rows))
    players = batch.get("players", {})
    if players:
        print(f"wan_batch: at most {players[f'most_players_at_{PLAYER_FPS}fps']} {fps} (B = {players['at_batch_size']}"
              f"); largest B giving every player >= {PLAYER_FPS} fps: {players['largest_batch_all_players_real_time']}")
    memory = batch.get("memory")
    if memory is None:
        return
    fit = ", ".join(f"{v['sessions']} at fraction {v['gpu_memory_fraction']:g} ({k})"
                    for k, v in memory["sessions_fit"].items())
    print(f"wan_batch memory plan: {memory['per_session_bytes'] / 2**20:.1f} MiB per session, "
          f"{memory['fixed_bytes'] / 2**20:.1f} MiB fixed, {memory['available_bytes'] / 2**30:.1f} GiB free "
          f"[{memory['memory_source']}]; sessions that fit: {fit}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny geometry and preset: runs on a CPU in seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/gpu_check.json, gpu_check_smoke.json with --smoke)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"time guard in seconds (default {FULL.budget_s:.0f}; {SMOKE.budget_s:.0f} with --smoke)")
    parser.add_argument("--world-backend", default="auto", choices=("auto", "xla", "cudnn"),
                        help="attention backend of the world rollout (auto: cuDNN then XLA where cuDNN runs)")
    parser.add_argument("--sections", type=_section_list, default=SECTIONS,
                        help=f"comma-separated sections to run, in this order: {','.join(SECTIONS)} (default all; "
                             "e.g. wan_batch alone, which a full run's guard usually skips)")
    args = parser.parse_args(argv)
    run(smoke=args.smoke, out=args.out, budget_s=args.budget_s, world_backend=args.world_backend,
        sections=args.sections)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
