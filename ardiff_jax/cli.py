"""The ``ardiff-jax`` command line.

``ardiff-jax plan`` prints the memory plan of a shipped example geometry against the
free memory of this machine (or an explicit budget), without allocating anything.

``ardiff-jax rollout`` runs a multi-session rollout of a reference pipeline (round-robin
over sessions, one block per request) through the engine on the default device, with a
progress bar on stderr, and writes a JSON summary (per-block latencies, frames/s, compile
time, memory plan).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ardiff_jax.capability import spec_summary
from ardiff_jax.geometries import EXAMPLE_GEOMETRIES, example_spec
from ardiff_jax.runtime._memory import free_memory_bytes, plan_memory

__all__ = ["main"]


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="print the KV memory plan of an example geometry")
    plan.add_argument("--geometry", default="medium", choices=sorted(EXAMPLE_GEOMETRIES),
                      help="shipped example geometry (default: medium)")
    plan.add_argument("--dtype", default="bfloat16", help="KV dtype (default: bfloat16)")
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--available-bytes", type=int, default=None,
                        help="free memory to plan against (default: measured on the default device)")
    budget.add_argument("--available-gib", type=float, default=None, help="free memory in GiB")
    plan.add_argument("--fraction", type=float, default=0.1, help="gpu_memory_fraction (default: 0.1)")
    plan.add_argument("--json", action="store_true", help="print the geometry and plan as JSON")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    spec = example_spec(args.geometry)
    if args.available_bytes is not None:
        available, source = args.available_bytes, "explicit"
    elif args.available_gib is not None:
        available, source = int(args.available_gib * 2**30), "explicit"
    else:
        available, source = free_memory_bytes()
    try:
        plan = plan_memory(spec, dtype=args.dtype, available_memory_bytes=available,
                           gpu_memory_fraction=args.fraction, memory_source=source)
    except ValueError as error:
        print(f"ardiff-jax plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"geometry": args.geometry, "spec": spec_summary(spec), "plan": plan.as_dict()}, indent=2))
    else:
        geometry = ", ".join(f"{key}={value}" for key, value in spec_summary(spec).items())
        print(f"geometry {args.geometry}: {geometry}")
        print(plan)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_rollout(subparsers: argparse._SubParsersAction) -> None:
    rollout = subparsers.add_parser("rollout", help="run a multi-session rollout of a reference pipeline")
    rollout.add_argument("--pipeline", default="world", choices=("world", "cfg"),
                         help="world: single-branch WorldPipeline; cfg: DreamZero-style CFGWorldActionPipeline")
    rollout.add_argument("--preset", default="tiny", help="CausalDiT preset (tiny, medium, wan_1_3b)")
    rollout.add_argument("--sessions", type=_positive_int, default=2, help="concurrent sessions (round-robin)")
    rollout.add_argument("--blocks", type=_positive_int, default=4, help="blocks per session")
    rollout.add_argument("--dtype", default="bfloat16", help="KV dtype (default: bfloat16)")
    budget = rollout.add_mutually_exclusive_group()
    budget.add_argument("--available-bytes", type=int, default=None,
                        help="free memory to plan against (default: measured on the default device)")
    budget.add_argument("--available-gib", type=float, default=None, help="free memory in GiB")
    rollout.add_argument("--fraction", type=float, default=0.1, help="gpu_memory_fraction (default: 0.1)")
    rollout.add_argument("--out", default=None, help="write the JSON summary here")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rollout.set_defaults(run=_run_rollout)


def _run_rollout(args: argparse.Namespace) -> int:
    # Imported here: `ardiff-jax plan` must not pay for building models.
    from ardiff_jax.models._rollout import RolloutOptions, run_rollout

    available = args.available_bytes
    if args.available_gib is not None:
        available = int(args.available_gib * 2**30)
    options = RolloutOptions(
        pipeline=args.pipeline, preset=args.preset, sessions=args.sessions, blocks=args.blocks, dtype=args.dtype,
        available_memory_bytes=available, gpu_memory_fraction=args.fraction,
    )
    try:
        options.validate()
    except (KeyError, ValueError) as error:
        print(f"ardiff-jax rollout: {error}", file=sys.stderr)
        return 2
    summary = run_rollout(options, stdout=sys.stdout, progress=None if args.no_progress else sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2)
        print(f"summary written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ardiff-jax", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_plan(subparsers)
    _add_rollout(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
