"""DreamZero inference calls through the engine: seconds per call, their breakdown, KV bytes per robot.

One robot episode (``DreamZeroPipeline``, random weights) runs through ``ARDiffusionEngine``: an
episode start, then continuing calls (2 observed latent frames committed on both CFG branches, 16 UniPC
steps, the transformer at the 8 masked steps on both branches). Measured per call, after a warmup
episode, in one run:

* ``call_s``: one ``generate`` to its outputs on the host (the number a robot waits for);
* the breakdown, from a second pass whose device calls are each awaited: ``commit_s`` (both branches'
  commit passes), ``dit_s`` (the 8 evaluations of both branches), ``scheduler_s`` (the 16 steps of both
  solvers), ``host_s`` (the rest: request checks, cache views, dispatch).

And the memory plan at the DROID geometry: KV bytes per robot session (two branches x the 9-frame window
x 880 tokens x 40 layers, scratch for the register, the cross caches) and robots per 80 GB and 141 GB
device beside the bf16 weights. The release's figures, for comparison (its README): about 3 s per
inference on two H100s, 0.6 s on GB200; our goal on one H200 is under 1 s (``gpu_check.sh --sections
dreamzero``).

Usage::

    python -m benchmarks.bench_dreamzero            # writes benchmarks/results/dreamzero.json
    python -m benchmarks.bench_dreamzero --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import format_table, machine_info, machine_line, write_json

RESULTS = Path(__file__).resolve().parent / "results"

#: CPU geometries: the parity network, and a mid-size one: 4 layers of width 512 (4 heads x 128), a 22x40 latent
#: (220 tokens a frame, a quarter of DROID's), DROID's 2-frame blocks, 9-frame window, register and context.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "tiny": {"preset": "dreamzero-tiny"},
    "mid": {"preset": "dreamzero-droid", "num_layers": 4, "dim": 512, "num_heads": 4, "ffn_dim": 2048,
            "latent_height": 22, "latent_width": 40, "dtype": "float32", "param_dtype": "float32"},
}
DEVICE_BYTES = {"80 GB (H100)": 80 * 10**9, "141 GB (H200)": 141 * 10**9}


def geometry_config(name: str) -> Any:
    from ardiff_jax.models import dit_preset

    fields = dict(GEOMETRIES[name])
    return dit_preset(fields.pop("preset"), **fields)


def episode_requests(config: Any, session: str, calls: int, seed: int = 0) -> list[Any]:
    """A robot's episode with random encoder outputs: a start, then ``calls - 1`` continuing calls."""
    from ardiff_jax import DiffusionRequest

    rng = np.random.default_rng(seed)
    latent = (config.latent_channels, config.latent_height, config.latent_width)
    requests = []
    for call in range(calls):
        inputs: dict[str, Any] = {"state": rng.uniform(-1, 1, 8).astype(np.float32)}
        if call == 0:
            inputs.update(latents=rng.standard_normal((1, *latent)).astype(np.float32),
                          condition=rng.standard_normal((config.window_frames, config.latent_channels + 4,
                                                         *latent[1:])).astype(np.float32),
                          clip=rng.standard_normal((config.image_len, config.image_dim)).astype(np.float32),
                          prompt_embeds=rng.standard_normal((30, config.text_dim)).astype(np.float32),
                          negative_prompt_embeds=rng.standard_normal((46, config.text_dim)).astype(np.float32))
        else:
            inputs["latents"] = rng.standard_normal((config.frames_per_block, *latent)).astype(np.float32)
        requests.append(DiffusionRequest(f"{session}-{call}", extra_args={"session_id": session}, inputs=inputs))
    return requests


@contextlib.contextmanager
def _timed_phases(totals: dict[str, float]) -> Any:
    """Wrap the pipeline's jitted calls so each is awaited and its seconds added to ``totals``."""
    import jax

    from ardiff_jax.models.dreamzero import _pipeline as dz

    originals = {"commit_s": ("dreamzero_commit", dz.dreamzero_commit),
                 "dit_s": ("dreamzero_evaluate", dz.dreamzero_evaluate),
                 "scheduler_s": ("_solver_step_jit", dz._solver_step_jit)}

    def timed(key: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            return out
        return call

    for key, (name, fn) in originals.items():
        setattr(dz, name, timed(key, fn))
    try:
        yield
    finally:
        for name, fn in originals.values():
            setattr(dz, name, fn)


def measure_calls(engine: Any, config: Any, *, calls: int, episodes: int) -> dict[str, Any]:
    """Median seconds of continuing calls (and the episode start), then the breakdown of a second pass."""
    import jax

    def run_episode(session: str, seed: int) -> list[float]:
        seconds = []
        for req in episode_requests(config, session, calls, seed):
            start = time.perf_counter()
            out = engine.generate(req)
            jax.block_until_ready(out)
            np.asarray(out["actions"])  # the robot needs the actions on the host
            seconds.append(time.perf_counter() - start)
        engine.close_session(session)
        return seconds

    run_episode("warmup", 99)  # compiles every program an episode uses
    starts, continuing = [], []
    for episode in range(episodes):
        seconds = run_episode(f"robot{episode}", episode)
        starts.append(seconds[0])
        continuing.extend(seconds[1:])
    phases: list[dict[str, float]] = []
    for episode in range(episodes):
        for req in episode_requests(config, f"split{episode}", calls, 50 + episode):
            totals: dict[str, float] = {}
            with _timed_phases(totals):
                start = time.perf_counter()
                jax.block_until_ready(engine.generate(req))
                total = time.perf_counter() - start
            if req.inputs["latents"].shape[0] > 1:  # continuing calls only
                totals["host_s"] = total - sum(totals.values())
                totals["total_s"] = total
                phases.append(totals)
        engine.close_session(f"split{episode}")
    breakdown = {key: statistics.median(p[key] for p in phases) for key in phases[0]}
    return {"episode_start_s": statistics.median(starts), "call_s": statistics.median(continuing),
            "call_s_all": continuing, "breakdown": breakdown, "calls_measured": len(continuing)}


def memory_plan(preset: str = "dreamzero-droid", dtype: str = "bfloat16") -> dict[str, Any]:
    """KV bytes per robot session and robots per device at ``preset`` beside its weights, from the runtime's
    own memory plan (``plan_memory``: the pool pages, the shared scratch, the cross caches); no arrays built."""
    from flax import nnx

    from ardiff_jax.models import CausalDiT, dit_preset
    from ardiff_jax.models.dreamzero import DreamZeroPipeline, DreamZeroPipelineConfig
    from ardiff_jax.runtime import plan_memory

    config = dit_preset(preset)
    spec = DreamZeroPipeline.kv_spec_for(config, DreamZeroPipelineConfig(session_capacity=1024))
    itemsize = np.dtype(np.float16 if dtype == "bfloat16" else dtype).itemsize
    params = nnx.eval_shape(lambda: CausalDiT(config, rngs=nnx.Rngs(0))).num_params
    weights = params * itemsize
    def robots(total: int) -> int:
        try:
            return plan_memory(spec, dtype=dtype, available_memory_bytes=max(0, total - weights),
                               gpu_memory_fraction=1.0).session_capacity
        except ValueError:  # not even one session fits beside the weights
            return 0

    one = plan_memory(spec, dtype=dtype, available_memory_bytes=10**15, gpu_memory_fraction=1.0)
    window = one.page_bytes * one.run_pages * one.num_local_kv_branches
    session = window + one.cross_attention_bytes_per_session + one.model_owned_bytes_per_session
    return {"preset": preset, "dtype": dtype, "parameters": params, "weights_bytes": weights,
            "page_bytes": one.page_bytes, "window_bytes_per_session": window,
            "cross_bytes_per_session": one.cross_attention_bytes_per_session, "session_bytes": session,
            "scratch_bytes_per_device": one.scratch_bytes,
            "robots_per_device": {name: robots(total) for name, total in DEVICE_BYTES.items()},
            "note": "robots per device: the runtime's plan_memory with (device - weights) available; activations "
                    "and the compiled programs' workspace are not subtracted"}


def measure_robot_queries(*, calls: int = 4, episodes: int = 2) -> dict[str, Any]:
    """End-to-end robot queries on the tiny random policy (``build_robot_policy``), as the server runs them
    (``infer_batch``), split by the policy's own clock (``DreamZeroRobotPolicy.timings``): ``image_s`` (crop, resize,
    tile, buffer), ``encoders_s`` (the VAE of the observed frames; CLIP and text too at an episode start),
    ``loop_s`` (the engine call: commits and 16 steps), ``reply_s`` (the joint targets), plus ``pack_s`` (the
    reply on the wire). Continuing calls of the episodes after the first (which compiles), medians."""
    from ardiff_jax import EngineConfig
    from ardiff_jax.models.dreamzero import build_robot_policy
    from ardiff_jax.serve import pack_policy_message

    policy = build_robot_policy(engine_config=EngineConfig(dtype="float32", available_memory_bytes=10**10,
                                                           gpu_memory_fraction=1.0, warmup=False))
    rng = np.random.default_rng(0)
    views = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")
    rows: list[dict[str, float]] = []
    with contextlib.closing(policy.engine):
        for episode in range(episodes + 1):
            key = f"robot{episode}"
            for call in range(calls):
                obs = {view: rng.integers(0, 256, (1 if call == 0 else 4, 180, 320, 3), dtype=np.uint8)
                       for view in views}
                obs.update({"observation/joint_position": rng.uniform(-1, 1, 7),
                            "observation/gripper_position": rng.uniform(0, 1, 1), "prompt": "pick up the cup"})
                began = time.perf_counter()
                reply = policy.infer_batch([(key, obs)])[0]
                packed = time.perf_counter()
                pack_policy_message(reply)
                done = time.perf_counter()
                if episode and call:
                    rows.append({**policy.timings[key], "pack_s": done - packed, "total_s": done - began})
            policy.reset(key)
    return {name: statistics.median(row[name] for row in rows) for name in rows[0]} | {"queries": len(rows)}


def run(*, quick: bool = False, geometries: tuple[str, ...] = tuple(GEOMETRIES),
        out: Path | None = RESULTS / "dreamzero.json") -> dict[str, Any]:
    from ardiff_jax import ARDiffusionEngine, EngineConfig
    from ardiff_jax.models.dreamzero import DreamZeroPipeline

    result: dict[str, Any] = {"machine": machine_info(), "quick": quick, "geometries": {}}
    rows = []
    for name in geometries:
        config = geometry_config(name)
        pipeline = DreamZeroPipeline(config)
        engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**34,
                                                          gpu_memory_fraction=1.0, warmup=False))
        with engine:
            record = measure_calls(engine, config, calls=4, episodes=1 if quick else 3)
        record["config"] = {"layers": config.num_layers, "dim": config.dim, "heads": config.num_heads,
                            "tokens_per_frame": config.tokens_per_frame, "window_frames": config.window_frames}
        result["geometries"][name] = record
        split = record["breakdown"]
        rows.append([name, f"{record['call_s']:.3f}", f"{record['episode_start_s']:.3f}", f"{split['commit_s']:.3f}",
                     f"{split['dit_s']:.3f}", f"{split['scheduler_s']:.4f}", f"{split['host_s']:.4f}"])
    result["droid_memory"] = {dtype: memory_plan(dtype=dtype) for dtype in ("bfloat16", "float32")}
    query = result["robot_query_tiny"] = measure_robot_queries(episodes=1 if quick else 2)
    print(machine_line(result["machine"]))
    print(format_table(["geometry", "call s", "episode start s", "commit s", "DiT s (8 x 2)", "scheduler s", "host s"],
                       rows))
    print(format_table(["robot query (tiny, random)", "total s", "image s", "encoders s", "loop s", "reply s"],
                       [["continuing call", f"{query['total_s']:.3f}", f"{query['image_s']:.4f}",
                         f"{query['encoders_s']:.4f}", f"{query['loop_s']:.3f}",
                         f"{query['reply_s'] + query['pack_s']:.5f}"]]))
    for dtype, plan in result["droid_memory"].items():
        print(f"DROID {dtype}: {plan['parameters'] / 1e9:.2f}e9 parameters = {plan['weights_bytes'] / 1e9:.1f} GB; "
              f"{plan['session_bytes'] / 1e9:.2f} GB of KV per robot session (+ {plan['scratch_bytes_per_device'] / 1e9:.2f}"
              " GB shared scratch); robots per device "
              + ", ".join(f"{k}: {v}" for k, v in plan["robots_per_device"].items()))
    if out is not None:
        write_json(out, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--geometries", default=",".join(GEOMETRIES))
    parser.add_argument("--out", type=Path, default=RESULTS / "dreamzero.json")
    args = parser.parse_args()
    run(quick=args.quick, geometries=tuple(args.geometries.split(",")), out=args.out)


if __name__ == "__main__":
    main()
