"""The ``ardiff-jax`` command line.

``ardiff-jax plan`` prints the memory plan of a shipped example geometry against the
free memory of this machine (or an explicit budget), without allocating anything.

``ardiff-jax rollout`` runs a timed multi-session generation with a reference pipeline
(round-robin over sessions, one block per request) through the engine on the default
device, with a progress bar on stderr, and writes a JSON summary (per-block latencies,
frames/s, compile time, memory plan).

Arguments are checked before any work: a bad value ends the command with exit code 2 and
a message on stderr that names the argument (no traceback). ``rollout`` also plans the KV
memory of the preset from its spec before building any weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

from ardiff_jax._checks import check_positive_int
from ardiff_jax.capability import spec_summary
from ardiff_jax.geometries import EXAMPLE_GEOMETRIES, example_spec
from ardiff_jax.runtime import free_memory_bytes, plan_memory
from ardiff_jax.types import check_kv_dtype

__all__ = ["main"]

#: The largest memory budget accepted (bytes): beyond int64 the plan's arithmetic is meaningless.
MAX_MEMORY_BYTES = 2**63 - 1


# -- argument types: each raises ArgumentTypeError, which argparse reports with the flag's name --


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    try:
        return check_positive_int("value", value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def _memory_bytes(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_MEMORY_BYTES} bytes, got {text!r}")
    return value


def _memory_gib(text: str) -> int:
    """GiB as a float on the command line, bytes (an int) after parsing."""
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not math.isfinite(gib) or gib <= 0 or gib * 2**30 > MAX_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of GiB in (0, {MAX_MEMORY_BYTES / 2**30:.0f}], got {text!r}")
    value = int(gib * 2**30)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected at least one byte, got {text!r} GiB")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _kv_dtype(text: str) -> str:
    try:
        return check_kv_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _output_path(text: str) -> str:
    """A file path whose directory exists and is writable (checked before the run, not after it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file")
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} is not writable")
    return text


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", type=_kv_dtype, default="bfloat16", help="KV dtype (default: bfloat16)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--available-bytes", type=_memory_bytes, default=None,
                        help="free memory to plan against (default: measured on the default device)")
    budget.add_argument("--available-gib", type=_memory_gib, default=None, help="free memory in GiB")
    parser.add_argument("--fraction", type=_fraction, default=0.1, help="gpu_memory_fraction in (0, 1] (default: 0.1)")


def _available_bytes(args: argparse.Namespace) -> int | None:
    # --available-gib is converted to bytes by its argument type.
    return args.available_bytes if args.available_bytes is not None else args.available_gib


# -- plan ----------------------------------------------------------------------------------------


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="print the KV memory plan of an example geometry")
    plan.add_argument("--geometry", default="medium", choices=sorted(EXAMPLE_GEOMETRIES),
                      help="shipped example geometry (default: medium)")
    _add_budget_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the geometry and plan as JSON")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    spec = example_spec(args.geometry)
    available = _available_bytes(args)
    source = "explicit"
    if available is None:
        available, source = free_memory_bytes()
    try:
        plan = plan_memory(spec, dtype=args.dtype, available_memory_bytes=available,
                           gpu_memory_fraction=args.fraction, memory_source=source)
    except ValueError as error:
        return _refuse("plan", f"--geometry {args.geometry} does not fit the memory budget: {error}")
    if args.json:
        print(json.dumps({"geometry": args.geometry, "spec": spec_summary(spec), "plan": plan.as_dict()}, indent=2))
    else:
        geometry = ", ".join(f"{key}={value}" for key, value in spec_summary(spec).items())
        print(f"geometry {args.geometry}: {geometry}")
        print(plan)
    return 0


# -- rollout -------------------------------------------------------------------------------------


def _add_rollout(subparsers: argparse._SubParsersAction) -> None:
    rollout = subparsers.add_parser("rollout", help="run a timed multi-session generation with a reference pipeline")
    rollout.add_argument("--pipeline", default="world", choices=("world", "cfg"),
                         help="world: single-branch WorldPipeline; cfg: DreamZero-style CFGWorldActionPipeline")
    rollout.add_argument("--preset", default="tiny", help="CausalDiT preset (tiny, medium, wan_1_3b)")
    rollout.add_argument("--sessions", type=_positive_int, default=2, help="concurrent sessions (round-robin)")
    rollout.add_argument("--blocks", type=_positive_int, default=4, help="blocks per session")
    _add_budget_arguments(rollout)
    rollout.add_argument("--out", type=_output_path, default=None, help="write the JSON summary here")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rollout.set_defaults(run=_run_rollout)


def _run_rollout(args: argparse.Namespace) -> int:
    # Imported here: `ardiff-jax plan` must not pay for importing the models.
    from ardiff_jax._timed_generation import TimedGenerationOptions, plan_timed_generation, run_timed_generation
    from ardiff_jax.models import DIT_PRESETS

    if args.preset not in DIT_PRESETS:
        return _refuse("rollout", f"argument --preset: unknown preset {args.preset!r}; choose from "
                                  f"{', '.join(sorted(DIT_PRESETS))}")
    options = TimedGenerationOptions(
        pipeline=args.pipeline, preset=args.preset, sessions=args.sessions, blocks=args.blocks, dtype=args.dtype,
        available_memory_bytes=_available_bytes(args), gpu_memory_fraction=args.fraction,
    )
    try:
        options.validate()  # the argument types checked each value already; this is the library's own check
        options.kv_spec()
    except ValueError as error:
        return _refuse("rollout", f"--pipeline {args.pipeline} cannot run on --preset {args.preset}: {error}")
    try:
        plan_timed_generation(options)
    except ValueError as error:
        return _refuse("rollout", f"--preset {args.preset} does not fit the memory budget (--available-bytes or "
                                  f"--available-gib, --fraction, --dtype, --sessions): {error}")
    summary = run_timed_generation(options, stdout=sys.stdout, progress=None if args.no_progress else sys.stderr)
    if args.out is not None:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2)
        print(f"summary written to {args.out}")
    return 0


def _refuse(command: str, message: str) -> int:
    print(f"ardiff-jax {command}: error: {message}", file=sys.stderr)
    return 2


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
