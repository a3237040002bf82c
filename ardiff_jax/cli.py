"""The ``ardiff-jax`` command line.

``ardiff-jax plan`` prints the memory plan of a shipped example geometry against the
free memory of this machine (or an explicit budget), without allocating anything.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ardiff-jax", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_plan(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
