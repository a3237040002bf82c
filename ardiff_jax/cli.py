"""The ``ardiff-jax`` command line.

``ardiff-jax plan`` prints the memory plan of a shipped example geometry against the
free memory of this machine (or an explicit budget), without allocating anything. With
``--tp``/``--cfg`` the plan is one device's of that mesh; ``--devices`` adds how many
replicas of the mesh fit and their sessions.

``ardiff-jax demo`` plays the trained SpriteWorld model in several sessions through the
engine, next to the simulator, and writes GIFs, a contact sheet and a JSON summary of its
tracking error and speed (``ardiff_jax.demo``).

``ardiff-jax train`` trains that model (``ardiff_jax.training``; needs the ``train`` extra)
with checkpoints and resumption, and exports weights with ``--export``.

``ardiff-jax generate`` writes an MP4: a causal Wan (Self-Forcing, LongLive, Krea) from prompts,
or Matrix-Game 2.0 from a start picture and a JSON action script; ``--random-weights`` with a
small preset (``wan-tiny``, ``matrix-game-tiny``) runs without any download.

``ardiff-jax serve`` serves a world model over WebSocket (``ardiff_jax.serve``; needs the ``serve``
extra): ``--pretrained sprite_world`` for the trained SpriteWorld model, ``--model wan`` or
``--model matrix-game``, or ``--pipeline world --preset tiny`` for a random-weights WorldPipeline.

``ardiff-jax rollout`` runs a timed multi-session generation with a reference pipeline
(round-robin over sessions, one block per request) through the engine on the default
device, with a progress bar on stderr, and writes a JSON summary (per-block latencies,
frames/s, compile time, memory plan).

Arguments are checked before any work: a bad value ends the command with exit code 2 and
a message on stderr that names the argument (no traceback). So are the optional packages the
command will import (``required_modules``: PyAV to write an MP4, the ``serve`` extra to serve,
torch for ``.pt`` files ...): a missing one is named with the extra that installs it. Each long
step (building, compiling, generating) is announced on stderr before it starts. ``rollout`` also plans the KV
memory of the preset from its spec before building any weights; ``generate`` also reads its
input files (start picture, action script), checks them against the model and makes sure
``--out`` can be written, before building the model. Every ``--preset`` lists the values it
takes in ``--help`` and in its error.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import socket
import sys
import time
from typing import Any
from collections.abc import Sequence

from ardiff_jax.capability import spec_summary
from ardiff_jax.geometries import EXAMPLE_GEOMETRIES, example_spec
from ardiff_jax.runtime import free_memory_bytes, plan_memory
from ardiff_jax.types import check_kv_dtype

__all__ = ["main"]

#: The largest memory budget accepted (bytes): beyond int64 the plan's arithmetic is meaningless.
MAX_MEMORY_BYTES = 2**63 - 1


# -- argument types: each raises ArgumentTypeError, which argparse reports with the flag's name --


def _int_argument(text: str, low: int, high: int | None, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value >= high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_argument(text, 1, None, "a positive integer")


def _memory_bytes(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_MEMORY_BYTES} bytes, got {text!r}")
    return value


def _host_bytes(text: str) -> int:
    return _int_argument(text, 0, MAX_MEMORY_BYTES + 1, f"a byte count in [0, {MAX_MEMORY_BYTES}]")


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


def _non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite non-negative number, got {text!r}")
    return value


def _share(text: str) -> float:
    value = _non_negative_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _weights_input(text: str) -> str:
    """A weights file written by ``train --export`` (``.npz``; its ``.json`` sidecar beside it)."""
    path = os.path.splitext(text)[0] + ".npz" if not text.endswith(".npz") else text
    for file in (path, os.path.splitext(path)[0] + ".json"):
        if not os.path.isfile(file):
            raise argparse.ArgumentTypeError(
                f"weights file {file!r} does not exist (train --export writes an .npz and a .json)")
    return path


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


def _weights_output(text: str) -> str:
    """Where ``train --export`` writes: a ``.npz`` path (suffix optional) in a directory that can be written."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a weights file path (.npz), got {text!r}")
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a .npz file")
    if os.path.splitext(path)[1] not in ("", ".npz"):
        raise argparse.ArgumentTypeError(f"{text!r}: weights are written as .npz (+ .json sidecar); name a .npz file")
    _output_dir(os.path.dirname(path))
    return text


def _output_dir(text: str) -> str:
    """A directory that exists and is writable, or can be created under a writable parent."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}")
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"{existing!r} is a file, so {text!r} cannot be a directory")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{existing!r} is not writable, so {text!r} cannot be written")
    return text


def _make_output_dir(text: str) -> str | None:
    """Create the directory ``--out`` names and write a file in it; None, or why not (naming --out).

    Run after every other check and before any work: a parent that is writable to ``os.access``
    can still refuse the directory (a name too long, a read-only or special filesystem, root's
    ``access`` saying yes to everything), and that used to surface after the whole run.
    """
    import tempfile

    try:
        os.makedirs(text, exist_ok=True)
        with tempfile.TemporaryFile(dir=text):
            pass
    except OSError as error:
        return f"argument --out: cannot write in {text!r}: {error.strerror or error}"
    return None


def _bounded_int(low: int, high: int, why: str = "") -> Any:
    """An argument type taking integers in ``low..high``; its error says the range (and ``why``)."""

    def bounded(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high}{why}, got {text!r}")
        return value

    bounded.__name__ = "integer"  # argparse names the type in some messages
    return bounded


def _non_negative_int(text: str) -> int:
    return _int_argument(text, 0, 2**31, "an integer in [0, 2**31)")


# -- optional dependencies: which extras a command will import, checked before any work ----------------

#: The optional modules a command may import: module -> (what pip installs, the extra that brings it).
OPTIONAL_MODULES = {
    "av": ("PyAV", "serve"),
    "starlette": ("starlette", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "websockets": ("websockets", "serve"),
    "prometheus_client": ("prometheus-client", "serve"),
    "optax": ("optax", "train"),
    "orbax.checkpoint": ("orbax-checkpoint", "train"),
    "matplotlib": ("matplotlib", "train"),
    "torch": ("torch", "torch"),
}
#: Files that only torch reads (the loaders pick the reader by suffix; .safetensors needs no torch).
_TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
_SERVER_MODULES = (("starlette", "serving"), ("uvicorn", "serving"), ("websockets", "serving WebSockets"),
                   ("prometheus_client", "the server's /metrics"), ("av", "the server's m4s video chunks"))


def _reads_torch(path: str | None) -> bool:
    """Whether loading ``path`` (a checkpoint file or directory) goes through torch."""
    if not path:
        return False
    if not os.path.isdir(path):
        return path.lower().endswith(_TORCH_SUFFIXES)
    # A directory: torch only when it holds torch files and no safetensors (two levels: diffusers' layout).
    names = [name for _, _, files in _walk(path, depth=2) for name in files]
    return any(n.lower().endswith(_TORCH_SUFFIXES) for n in names) and not any(
        n.endswith(".safetensors") for n in names)


def _walk(path: str, depth: int) -> list[tuple[str, list[str], list[str]]]:
    found = []
    for root, dirs, files in os.walk(path):
        found.append((root, dirs, files))
        if root[len(path):].count(os.sep) + 1 >= depth:
            dirs.clear()
    return found


def required_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(module, what it is for)`` of every optional module the parsed command will import.

    The one place that knows it: :func:`missing_dependencies` checks these before any work, so a
    missing extra is a one-line error at once, not an ImportError after the model built and compiled.
    """
    command = args.command
    needed: list[tuple[str, str]] = []
    if command == "train":
        needed += [("optax", "the optimizer"), ("orbax.checkpoint", "checkpoints"), ("matplotlib", "the loss curve")]
    elif command == "generate":
        needed.append(("av", "writing the MP4"))
    elif command == "serve":
        needed += list(_SERVER_MODULES)
        if getattr(args, "model", None) == "dreamzero":
            needed.append(("msgpack", "the robot-policy protocol"))
    files = {"rollout": ("checkpoint",), "generate": ("weights", "vae", "text_encoder", "lora", "clip"),
             "serve": ("weights", "vae", "text_encoder", "lora", "clip")}.get(command, ())
    torch_files = [f"--{name.replace('_', '-')}" for name in files if _reads_torch(getattr(args, name, None))]
    if torch_files:
        needed.append(("torch", f"reading the .pt/.pth file of {', '.join(torch_files)}"))
    return needed


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module whose spec is unset
        return False


def missing_dependencies(args: argparse.Namespace) -> str | None:
    """Why the parsed command cannot run for want of an optional package (naming it and its extra), or None.

    Checked on the host, before any argument file is read or any model built (``find_spec``: nothing
    is imported)."""
    missing = [(module, why) for module, why in required_modules(args) if not _installed(module)]
    if not missing:
        return None
    extras = sorted({OPTIONAL_MODULES[module][1] for module, _ in missing})
    names = ", ".join(f"{OPTIONAL_MODULES[module][0]} (" + ("" if OPTIONAL_MODULES[module][0] == module else
                                                           f"module {module}, ") + f"for {why})"
                      for module, why in missing)
    install = " ".join(f'"ardiff_jax[{extra}]"' for extra in extras)
    return f"not installed: {names}; install: pip install {install}"


# -- presets: which CausalDiT presets (ardiff_jax.models.DIT_PRESETS) each model runs on ----------
# Written out here so that building the parser imports no model code; tests/test_first_hour.py
# keeps them equal to what the pipelines accept.

#: WorldPipeline (rollout --pipeline world, serve --pipeline world): random-weights reference geometries.
WORLD_PRESETS = ("tiny", "medium", "wan_1_3b")
#: CFGWorldActionPipeline (rollout --pipeline cfg): needs action and state register tokens.
CFG_PRESETS = ("tiny", "medium")
#: CausalWanPipeline (generate/serve --model wan, rollout --pipeline wan): wan-tiny is a small network for a CPU.
WAN_PRESETS = ("wan-tiny", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b")
#: MatrixGamePipeline (generate/serve --model matrix-game): matrix-game-tiny runs on a CPU.
MATRIX_GAME_PRESETS = ("matrix-game-tiny", "matrix-game-2-universal", "matrix-game-2-gta-drive",
                       "matrix-game-2-templerun")


def _preset_choices(groups: dict[str, Sequence[str]]) -> str:
    return "; ".join(f"{where}: {', '.join(names)}" for where, names in groups.items())


def _preset_argument(groups: dict[str, Sequence[str]]) -> Any:
    """An argument type taking the presets of ``groups`` (``{"--model wan": names, ...}``); its error lists them."""
    valid = {name for names in groups.values() for name in names}

    def preset(text: str) -> str:
        if text not in valid:
            raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose from {_preset_choices(groups)}")
        return text

    preset.__name__ = "preset"  # argparse names the type in some messages
    return preset


def _wrong_preset(flag: str, preset: str, names: Sequence[str]) -> str:
    return f"argument --preset: {preset!r} is not a preset of {flag}; choose from {', '.join(names)}"


_GENERATE_PRESETS = {"--model wan": WAN_PRESETS, "--model matrix-game": MATRIX_GAME_PRESETS}
_ROLLOUT_PRESETS = {"--pipeline world": WORLD_PRESETS, "--pipeline cfg": CFG_PRESETS, "--pipeline wan": WAN_PRESETS}
#: DreamZero's presets (``serve --model dreamzero --random-weights``; the tiny one runs on a CPU).
DREAMZERO_PRESETS = ("dreamzero-tiny", "dreamzero-droid", "dreamzero-wan22-5b")
_SERVE_PRESETS = {"--pipeline world": WORLD_PRESETS, "--model wan": WAN_PRESETS,
                  "--model matrix-game": MATRIX_GAME_PRESETS, "--model dreamzero": DREAMZERO_PRESETS}


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
    plan = subparsers.add_parser("plan", **_about("plan"))
    plan.add_argument("--geometry", default="medium", choices=sorted(EXAMPLE_GEOMETRIES),
                      help="shipped example geometry (default: medium)")
    _add_budget_arguments(plan)
    plan.add_argument("--host-offload-bytes", type=_host_bytes, default=0,
                      help="host memory for evicted sessions (EngineConfig.host_offload_bytes; 0: off)")
    plan.add_argument("--tp", type=_positive_int, default=1,
                      help="tensor-parallel devices per replica: KV heads split this way (default 1)")
    plan.add_argument("--cfg", type=_positive_int, default=1,
                      help="device groups per replica holding whole runs, e.g. one per CFG branch (default 1)")
    plan.add_argument("--devices", type=_positive_int, default=None,
                      help="devices available: also print the replicas of the tp x cfg mesh that fit and their "
                           "total sessions")
    plan.add_argument("--json", action="store_true", help="print the geometry and plan as JSON")
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    devices_per_replica = args.tp * args.cfg
    if args.devices is not None and args.devices < devices_per_replica:
        return _refuse("plan", f"--devices {args.devices} cannot hold one tp={args.tp} x cfg={args.cfg} replica "
                               f"({devices_per_replica} devices)")
    spec = example_spec(args.geometry)
    available = _available_bytes(args)
    source = "explicit"
    if available is None:
        available, source = free_memory_bytes()
    try:
        # On a mesh the budget is one device's memory and the plan is per device.
        plan = plan_memory(spec, dtype=args.dtype, available_memory_bytes=available,
                           gpu_memory_fraction=args.fraction, memory_source=source,
                           host_offload_bytes=args.host_offload_bytes, tp=args.tp, cfg=args.cfg)
    except ValueError as error:
        where = f" on a tp={args.tp} x cfg={args.cfg} mesh" if devices_per_replica > 1 else ""
        return _refuse("plan", f"--geometry {args.geometry}{where} does not fit: {error}")
    replicas = None if args.devices is None else args.devices // devices_per_replica
    if args.json:
        mesh = {"tp": args.tp, "cfg": args.cfg, "devices_per_replica": devices_per_replica,
                "sessions_per_replica": plan.session_capacity}
        if replicas is not None:
            mesh.update(devices=args.devices, replicas=replicas, total_sessions=replicas * plan.session_capacity)
        print(json.dumps({"geometry": args.geometry, "spec": spec_summary(spec), "plan": plan.as_dict(),
                          "mesh": mesh}, indent=2))
        return 0
    geometry = ", ".join(f"{key}={value}" for key, value in spec_summary(spec).items())
    print(f"geometry {args.geometry}: {geometry}")
    print(plan)
    if devices_per_replica > 1:
        print(f"per device: page {plan.page_bytes_per_device:,} B, cross-attention per session "
              f"{plan.cross_attention_bytes_per_session_per_device:,} B, pool {plan.pool_bytes_per_device:,} B")
    print(f"devices per replica: {devices_per_replica} (tp={args.tp} x cfg={args.cfg}), "
          f"{_plural(plan.session_capacity, 'session')} each")
    if replicas is not None:
        idle = args.devices - replicas * devices_per_replica
        print(f"on {_plural(args.devices, 'device')}: {_plural(replicas, 'replica')} x "
              f"{_plural(plan.session_capacity, 'session')} = {_plural(replicas * plan.session_capacity, 'session')}"
              + (f" ({_plural(idle, 'device')} unused)" if idle else ""))
    return 0


# -- rollout -------------------------------------------------------------------------------------


def _add_rollout(subparsers: argparse._SubParsersAction) -> None:
    rollout = subparsers.add_parser("rollout", **_about("rollout"))
    rollout.add_argument("--pipeline", default="world", choices=("world", "cfg", "wan"),
                         help="world: single-branch WorldPipeline; cfg: DreamZero-style CFGWorldActionPipeline; "
                              "wan: a published causal Wan (CausalWanPipeline; needs --checkpoint or --random-weights)")
    rollout.add_argument("--preset", default="tiny", type=_preset_argument(_ROLLOUT_PRESETS), metavar="PRESET",
                         help=f"network preset; {_preset_choices(_ROLLOUT_PRESETS)} (wan-tiny: a small network for "
                              "a CPU)")
    weights = rollout.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", default=None,
                         help="--pipeline wan: the checkpoint to load (.pt, .safetensors, Wan or diffusers directory)")
    weights.add_argument("--random-weights", action="store_true",
                         help="--pipeline wan: random weights of the real geometry (timing without a checkpoint)")
    rollout.add_argument("--sessions", type=_positive_int, default=2, help="concurrent sessions (round-robin)")
    rollout.add_argument("--blocks", type=_positive_int, default=4, help="blocks per session")
    _add_budget_arguments(rollout)
    rollout.add_argument("--out", type=_output_path, default=None, help="write the JSON summary here")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rollout.set_defaults(run=_run_rollout)


def _run_rollout(args: argparse.Namespace) -> int:
    # Imported here: `ardiff-jax plan` must not pay for importing the models.
    from ardiff_jax._timed_generation import (
        TimedGenerationOptions,
        plan_timed_generation,
        run_timed_generation,
    )

    if args.checkpoint is not None and not os.path.exists(args.checkpoint):
        return _refuse("rollout", f"argument --checkpoint: {args.checkpoint} does not exist")
    names = _ROLLOUT_PRESETS[f"--pipeline {args.pipeline}"]
    if args.preset not in names:
        return _refuse("rollout", _wrong_preset(f"--pipeline {args.pipeline}", args.preset, names))
    options = TimedGenerationOptions(
        pipeline=args.pipeline, preset=args.preset, sessions=args.sessions, blocks=args.blocks, dtype=args.dtype,
        available_memory_bytes=_available_bytes(args), gpu_memory_fraction=args.fraction,
        checkpoint=args.checkpoint, random_weights=args.random_weights,
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
    weights = args.checkpoint if args.checkpoint is not None else "random weights"
    _say("rollout", f"building the {args.pipeline} pipeline (preset {args.preset}, {weights}) and compiling its "
                    "programs (seconds to a minute on a CPU); the memory plan and the progress follow")
    summary = run_timed_generation(options, stdout=sys.stdout, progress=None if args.no_progress else sys.stderr)
    if args.out is not None:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2)
        print(f"summary written to {args.out}")
    return 0


# -- train ---------------------------------------------------------------------------------------


def _add_train(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", **_about("train"))
    train.add_argument("--out", required=True, type=_output_dir,
                       help="run directory: checkpoints/, losses.json, loss_curve.png")
    train.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (default: 2000)")
    train.add_argument("--batch-size", type=_positive_int, default=None, help="sequences per step (default: 16)")
    train.add_argument("--seed", type=_non_negative_int, default=0, help="weights, data and noise seed")
    train.add_argument("--checkpoint-every", type=_positive_int, default=None,
                       help="steps between checkpoints (default: 250)")
    train.add_argument("--learning-rate", type=_non_negative_number, default=None,
                       help="peak learning rate (default: 0.003)")
    train.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                       help="linear warmup steps (default: 100)")
    train.add_argument("--end-learning-rate", type=_non_negative_number, default=None,
                       help="learning rate at the end of the cosine decay (default: 0.0001)")
    train.add_argument("--encounter-share", type=_share, default=None,
                       help="share of gapped sequences placed at an agent-ball encounter (default 0)")
    train.add_argument("--encounter-weight", type=_non_negative_number, default=None,
                       help="extra loss weight of targets that follow an encounter (default 0)")
    train.add_argument("--chase-probability", type=_share, default=None,
                       help="share of the clips' actions that chase the ball instead of being random (default 0)")
    train.add_argument("--init-weights", type=_weights_input, default=None,
                       help="start from these weights (a train --export file) instead of fresh ones: a fine-tune")
    train.add_argument("--num-layers", type=_positive_int, default=None,
                       help="transformer depth (default: the preset's); with --init-weights, new layers start as "
                            "exact identities")
    train.add_argument("--sequence-frames", type=_positive_int, default=None,
                       help="frames per training sequence, the sink included (default 4)")
    train.add_argument("--self-rollout", action="store_true", default=None,
                       help="Self-Forcing: train through the model's own cached rollout (each sequence played as a "
                            "session plays it), the loss on the generated frames against the simulator's")
    train.add_argument("--gradient-frames", type=_non_negative_int, default=None,
                       help="with --self-rollout: only the last N generated frames carry gradient (0: all)")
    train.add_argument("--per-block-exit", action="store_true", default=None,
                       help="with --self-rollout: draw each block's exit step separately (default: one for all)")
    train.add_argument("--no-resume", action="store_true", help="start over even if the run has checkpoints")
    train.add_argument("--force", action="store_true",
                       help="resume a run whose checkpoints were made under another config (named in the error)")
    train.add_argument("--export", default=None, type=_weights_output,
                       help="write the final weights here (.npz + .json sidecar)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_run_train)


def _sidecar_digest(weights: str) -> str | None:
    """The digest a weights file's sidecar records (what a fine-tune started from)."""
    try:
        with open(os.path.splitext(weights)[0] + ".json") as sidecar:
            return json.load(sidecar).get("sha256")
    except (OSError, ValueError):
        return None


def _run_train(args: argparse.Namespace) -> int:
    import dataclasses
    import datetime
    import shlex

    import jax

    try:
        from ardiff_jax.training import TrainConfig, train
        from ardiff_jax.training import MAX_BATCH_SIZE, MAX_FRAMES_PER_STEP, MAX_SEQUENCE_FRAMES
    except ImportError as error:
        return _refuse("train", str(error))
    # The step's size is bounded here, by flag, before any data, weights or compile (TrainConfig says why).
    batch = args.batch_size if args.batch_size is not None else TrainConfig.batch_size
    frames = args.sequence_frames if args.sequence_frames is not None else TrainConfig.sequence_frames
    if batch > MAX_BATCH_SIZE:
        return _refuse("train", f"--batch-size must be 1..{MAX_BATCH_SIZE}, got {batch}")
    if not 2 <= frames <= MAX_SEQUENCE_FRAMES:
        return _refuse("train", f"--sequence-frames must be 2..{MAX_SEQUENCE_FRAMES} (the sink and at least one "
                                f"target), got {frames}")
    if batch * frames > MAX_FRAMES_PER_STEP:
        return _refuse("train", f"--batch-size x --sequence-frames must be at most {MAX_FRAMES_PER_STEP} frames per "
                                f"step, got {batch} x {frames}")
    overrides = {name: getattr(args, name) for name in (
        "steps", "batch_size", "checkpoint_every", "learning_rate", "warmup_steps", "end_learning_rate",
        "encounter_share", "encounter_weight", "chase_probability", "init_weights", "num_layers", "sequence_frames",
        "self_rollout", "gradient_frames", "per_block_exit")
        if getattr(args, name) is not None}
    try:
        config = dataclasses.replace(TrainConfig(seed=args.seed), **overrides)
    except ValueError as error:
        return _refuse("train", str(error))
    problem = _make_output_dir(args.out)
    if problem is not None:
        return _refuse("train", problem)
    try:
        result = train(config, args.out, resume=not args.no_resume, progress=not args.no_progress,
                       force=args.force)
    except ValueError as error:
        return _refuse("train", str(error))
    tail = [loss for _, loss in result.losses[-50:]]
    print(f"trained {config.preset} for {len(result.losses)} steps in {result.wall_seconds:.0f} s "
          f"(final loss, mean of last {len(tail)}: {sum(tail) / len(tail):.4f}); run in {args.out}")
    if args.export:
        from ardiff_jax.models import SPRITE_WORLD_SCHEDULE, SpriteWorldPipelineConfig, save_weights

        metadata = {
            "command": "ardiff-jax train " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == [
                "train"] else "ardiff-jax train (library call)",
            "train_config": config.as_dict(),
            **({"init_weights_sha256": _sidecar_digest(config.init_weights)} if config.init_weights else {}),
            "steps": len(result.losses),
            "wall_seconds": round(result.wall_seconds, 1),
            "final_loss_mean_last_50": sum(tail) / len(tail),
            "jax_version": jax.__version__,
            "device": str(jax.devices()[0]),
            "cpu_count": os.cpu_count(),
            "date": datetime.date.today().isoformat(),
        }
        sampling = {"schedule": list(SPRITE_WORLD_SCHEDULE.timesteps), "prediction": config.prediction,
                    "decoder": SpriteWorldPipelineConfig().decoder}
        path = save_weights(result.modules, args.export, metadata, sampling=sampling)
        print(f"weights written to {path} and {path.with_suffix('.json')}")
    return 0


# -- demo ----------------------------------------------------------------------------------------


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", **_about("demo"))
    demo.add_argument("--out", required=True, type=_output_dir, help="directory for GIFs, contact sheet, summary.json")
    # The tracking demo's and the agent's own flags default to None, so that a flag the chosen mode does not use
    # is refused instead of ignored; each mode fills in its defaults (_DEMO_DEFAULTS, _AGENT_DEFAULTS).
    demo.add_argument("--sessions", type=_bounded_int(1, MAX_DEMO_SESSIONS), default=None,
                      help=f"sessions (worlds), driven round-robin, 1..{MAX_DEMO_SESSIONS} (default: 4)")
    demo.add_argument("--frames", type=lambda text: _int_argument(text, 2, 100_001, "an integer in [2, 100000]"),
                      default=None, help="generated frames per session, at least 2: the error compares two halves "
                                         "(default: 64)")
    demo.add_argument("--capacity", type=_positive_int, default=None,
                      help="session capacity of the engine (default: --sessions; below it, LRU eviction shows)")
    demo.add_argument("--seed", type=_non_negative_int, default=0, help="first world seed; actions are seeded too")
    demo.add_argument("--weights", type=_weights_input, default=None,
                      help="play a train --export weights file instead of the shipped weights")
    demo.add_argument("--no-untrained", action="store_true", help="skip the untrained-model baseline")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    from ardiff_jax.planning import add_agent_arguments

    add_agent_arguments(demo)
    agent_types = {"--worlds": _bounded_int(1, MAX_AGENT_WORLDS),
                   "--budget": _bounded_int(1, MAX_AGENT_BUDGET),
                   # The engine's capacity bounds it further (checked in _run_demo, from the memory plan).
                   "--candidates": _bounded_int(1, 2**31),
                   "--horizon": _bounded_int(1, MAX_AGENT_HORIZON, " imagined steps per candidate")}
    for action in demo._actions:
        flag = action.option_strings[0] if action.option_strings else None
        if flag in agent_types:
            action.type, action.default = agent_types[flag], None
            bound = {"--worlds": MAX_AGENT_WORLDS, "--budget": MAX_AGENT_BUDGET,
                     "--horizon": MAX_AGENT_HORIZON}.get(flag)
            action.help = (f"{action.help} (--agent only; " + (f"1..{bound}; " if bound else
                                                              "at most the engine's sessions less one; ")
                           + f"default: {_AGENT_DEFAULTS[action.dest]})")
    demo.set_defaults(run=_run_demo)


#: The tracking demo's defaults (its flags default to None: given with --agent, they are refused).
_DEMO_DEFAULTS = {"sessions": 4, "frames": 64}
#: demo --agent's defaults (ardiff_jax.planning.run_agent_demo's).
_AGENT_DEFAULTS = {"worlds": 32, "budget": 6, "candidates": 8, "horizon": 6}
#: Sessions the tracking demo plays (each one's frames are kept for its GIF, npz and the error).
MAX_DEMO_SESSIONS = 256
#: Generated frames the tracking demo keeps, all sessions together (3 KB each, twice with the baseline).
MAX_DEMO_FRAMES = 100_000
#: demo --agent: worlds per policy, real steps per episode, imagined steps per candidate.
MAX_AGENT_WORLDS = 10_000
MAX_AGENT_BUDGET = 256
MAX_AGENT_HORIZON = 64
#: demo --agent's engine (ardiff_jax.planning.run_agent_demo): float32 KV in a 256 MiB budget.
_AGENT_KV_BYTES = 2**28


def _agent_session_capacity(weights: str | None) -> int:
    """Sessions the agent demo's engine will hold, planned from the model's spec (no weights built)."""
    from ardiff_jax.models import CausalDiTConfig, SpriteWorldPipeline, SpriteWorldPipelineConfig, pretrained_metadata

    config = CausalDiTConfig(**pretrained_metadata("sprite_world", weights=weights)["config"])
    spec = SpriteWorldPipeline.kv_spec_for(config, SpriteWorldPipelineConfig(session_capacity=2**31))
    return plan_memory(spec, dtype="float32", available_memory_bytes=_AGENT_KV_BYTES,
                       gpu_memory_fraction=1.0).session_capacity


def _run_demo(args: argparse.Namespace) -> int:
    # Every check before any work: flags of the other mode, bounds, then --out created.
    tracking = {"--sessions": args.sessions, "--frames": args.frames, "--capacity": args.capacity,
                "--no-untrained": args.no_untrained or None}
    agent = {"--worlds": args.worlds, "--budget": args.budget, "--candidates": args.candidates,
             "--horizon": args.horizon}
    unused = [flag for flag, value in (tracking if args.agent else agent).items() if value is not None]
    if unused:
        where = "demo --agent" if args.agent else "demo without --agent"
        return _refuse("demo", f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by {where}")
    defaults = _AGENT_DEFAULTS if args.agent else _DEMO_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.agent:  # plan inside the world model: the controller comparison (ardiff_jax.planning)
        try:
            capacity = _agent_session_capacity(args.weights)
        except (KeyError, TypeError, ValueError) as error:
            return _refuse("demo", f"argument --weights: {error}")
        if args.candidates > capacity - 1:
            return _refuse("demo", f"--candidates must be 1..{capacity - 1}: the live session and the candidates "
                                   f"share the engine's {capacity} sessions (its {_AGENT_KV_BYTES // 2**20} MiB KV "
                                   "budget)")
        problem = _make_output_dir(args.out)
        if problem is not None:
            return _refuse("demo", problem)
        from ardiff_jax.planning import POLICIES, run_agent_from_args

        _say("demo --agent", f"building the trained sprite_world model in an engine for the live session and "
                             f"{args.candidates} candidates and compiling it (half a minute on a CPU), then "
                             f"{_plural(args.worlds, 'world')} x {len(POLICIES)} policies; a progress bar follows")
        return run_agent_from_args(args)
    if args.sessions * args.frames > MAX_DEMO_FRAMES:
        return _refuse("demo", f"--sessions x --frames must be at most {MAX_DEMO_FRAMES} generated frames, got "
                               f"{args.sessions} x {args.frames}")
    problem = _make_output_dir(args.out)
    if problem is not None:
        return _refuse("demo", problem)
    from ardiff_jax.demo import run_demo, verdict

    try:
        summary = run_demo(args.out, sessions=args.sessions, num_frames=args.frames, capacity=args.capacity,
                           seed=args.seed, compare_untrained=not args.no_untrained, progress=not args.no_progress,
                           weights=args.weights)
    except ValueError as error:
        return _refuse("demo", str(error))
    quality, speed = summary["quality"], summary["speed"]
    machine = summary.get("machine", {})
    print(f"{_plural(summary['sessions'], 'session')} x {_plural(quality['generated_frames_per_session'], 'frame')} "
          f"on {summary['device']} "
          f"({machine.get('cpu_model', 'CPU model unknown')}, {machine.get('cpu_count', '?')} cores; capacity "
          f"{summary['session_capacity']}, {_plural(summary['lru_evictions'], 'LRU eviction')})")
    print(f"Does the model track the simulator better than repeating the first frame? {verdict(quality)}")
    line = (f"tracking error (mean |pixel| 0-255, second half): model {quality['model_second_half']:.2f}, "
            f"repeat-first-frame {quality['repeat_first_frame_second_half']:.2f}")
    if "untrained_second_half" in quality:
        line += (f", untrained {quality['untrained_second_half']:.2f} (the same network with random weights "
                 "through the same engine: what training contributed)")
    print(line)
    print(f"model / repeat = {quality['ratio_to_repeat_first_frame']:.3f}; second / first half = "
          f"{quality['drift_second_over_first_half']:.2f}")
    print("frames exactly like the simulator's before the first miss, per session: "
          + ", ".join(str(n) for n in quality["exact_frames_per_session"])
          + f" (of {quality['generated_frames_per_session']})")
    accuracy = summary["one_step_accuracy"]
    print(f"one-step accuracy on {accuracy['transitions']} held-out transitions (true context): agent cell "
          f"{accuracy['agent']:.1%}, ball cell {accuracy['ball']:.1%}, whole frame {accuracy['frame']:.1%}")
    print(f"speed: {speed['frames_per_second_one_session']:.1f} frames/s one session, "
          f"{speed['frames_per_second_interleaved']:.1f} frames/s over {speed['interleaved_sessions']} interleaved, "
          f"{speed['frames_per_second_batched']:.1f} frames/s over {speed['batched_sessions']} batched; "
          f"latency p50 {speed['latency_ms']['p50']:.1f} ms, p99 {speed['latency_ms']['p99']:.1f} ms")
    print(f"wrote GIFs, contact_sheet.png, summary.json and session_*.npz to {args.out} "
          f"({summary['wall_seconds']:.1f} s)")
    return 0


# -- generate ------------------------------------------------------------------------------------


def _existing_path(text: str) -> str:
    if not text.strip() or not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def _mp4_output(text: str) -> str:
    text = _output_path(text)
    if not text.lower().endswith(".mp4"):
        raise argparse.ArgumentTypeError(f"expected an .mp4 path, got {text!r}")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 24 * 3600):
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 86400], got {text!r}")
    return value


def _add_wan_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The arguments that build a causal Wan with its VAE (generate, serve --model wan)."""
    weights = parser.add_mutually_exclusive_group(required=required)
    weights.add_argument("--weights", type=_existing_path, default=None,
                         help="the causal-Wan checkpoint (.pt, .safetensors, Wan or diffusers directory)")
    weights.add_argument("--random-weights", action="store_true",
                         help="random transformer and VAE of --preset and stand-in prompt features (timing only)")
    parser.add_argument("--policy", choices=("self-forcing", "longlive"), default=None,
                        help="block window and sink (default: the preset's, Self-Forcing's)")
    parser.add_argument("--lora", type=_existing_path, default=None, help="a LoRA merged into the weights (LongLive)")
    parser.add_argument("--vae", type=_existing_path, default=None, help="Wan2.1_VAE.pth or a diffusers VAE")
    parser.add_argument("--tokenizer", type=_existing_path, default=None,
                        help="umT5's tokenizer.json (or a directory holding it)")
    parser.add_argument("--text-device", choices=("default", "host"), default="default",
                        help="where the text encoder runs (host: the CPU, to keep 11 GB off the accelerator)")


def _check_wan_arguments(command: str, args: argparse.Namespace, *, embeds_allowed: bool) -> str | None:
    """The first problem with the causal-Wan arguments, or None (host only, nothing built)."""
    embeds = getattr(args, "prompt_embeds", None)
    if args.random_weights:
        if args.vae or args.text_encoder or embeds or args.lora:
            return "--random-weights builds every part itself: drop --vae, --text-encoder, --prompt-embeds and --lora"
        return None
    if args.weights is None:
        return "give --weights (a causal-Wan checkpoint) or --random-weights"
    if args.vae is None:
        return "argument --vae: needed to turn latents into video (Wan2.1_VAE.pth)"
    if args.text_encoder is None and not (embeds_allowed and embeds):
        return ("give --text-encoder with --tokenizer" + (", or --prompt-embeds per prompt" if embeds_allowed else ""))
    if args.text_encoder is not None and args.tokenizer is None:
        return "argument --tokenizer: needed with --text-encoder (umT5's tokenizer.json)"
    return None


def _build_wan(args: argparse.Namespace, pipeline_config: Any) -> Any:
    """The CausalWanPipeline the arguments describe, with its VAE and (unless --prompt-embeds) text encoder."""
    from ardiff_jax.models import dit_preset
    from ardiff_jax.models.wan import (
        CausalWanPipeline,
        PlaceholderTextEncoder,
        WanTextEncoder,
        WanVAEConfig,
        load_umt5,
        load_vae,
        random_vae,
        with_policy,
    )

    if args.random_weights:
        config = dit_preset(args.preset or "wan2.1-t2v-1.3b", dtype=args.dtype, param_dtype=args.dtype)
        if args.policy is not None:
            config = with_policy(config, args.policy)
        channels = config.latent_channels
        if config.name == "wan2.2-ti2v-5b":
            raise ValueError("--preset wan2.2-ti2v-5b decodes with the Wan 2.2 VAE (48 channels, 16x), which this "
                             "repository does not have yet")
        if channels == WanVAEConfig().z_dim:
            vae_config = WanVAEConfig(dtype=args.dtype)  # the real Wan 2.1 VAE geometry
        else:  # a small test network (e.g. wan-tiny): Wan 2.1's VAE layout at base width 8, its channel count
            vae_config = WanVAEConfig.tiny(base_dim=8, z_dim=channels, latents_mean=(0.0,) * channels,
                                           latents_std=(1.0,) * channels, dtype=args.dtype)
        # Filled on the host after a shape evaluation: WanVAE's eager initializers take minutes on a CPU.
        vae = random_vae(vae_config, 0)
        print(f"random weights of {config.name}: the video is noise-like; this run measures speed", file=sys.stderr)
        return CausalWanPipeline(config, pipeline_config, vae=vae,
                                 text_encoder=PlaceholderTextEncoder(config.text_dim, min(32, config.text_len)))
    text_encoder = None
    if args.text_encoder is not None:
        device = "host" if args.text_device == "host" else None
        text_encoder = WanTextEncoder(load_umt5(args.text_encoder, device=device), args.tokenizer)
    return CausalWanPipeline.from_checkpoint(
        args.weights, args.preset, policy=args.policy, pipeline_config=pipeline_config,
        vae=load_vae(args.vae, dtype=args.dtype), text_encoder=text_encoder, dtype=args.dtype, lora=args.lora,
        progress=None if not getattr(args, "no_progress", False) else False)


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser("generate", **_about("generate"))
    _add_wan_arguments(generate, required=True)
    text = generate.add_mutually_exclusive_group()
    text.add_argument("--text-encoder", type=_existing_path, default=None,
                      help="models_t5_umt5-xxl-enc-bf16.pth or a transformers UMT5 encoder (needs --tokenizer)")
    text.add_argument("--prompt-embeds", type=_existing_path, action="append", default=None,
                      help="precomputed features (.npy, [L <= 512, 4096]), one per --prompt, in order")
    generate.add_argument("--preset", default=None, type=_preset_argument(_GENERATE_PRESETS), metavar="PRESET",
                          help=f"network preset; {_preset_choices(_GENERATE_PRESETS)} (default: read from the "
                               "checkpoint; with --random-weights the full wan2.1-t2v-1.3b or matrix-game-2-universal; "
                               "wan-tiny and matrix-game-tiny are small networks for a CPU)")
    generate.add_argument("--model", choices=("wan", "matrix-game"), default="wan",
                          help="wan: prompt-conditioned causal Wan; matrix-game: Matrix-Game 2.0, an image "
                               "and keyboard/mouse actions (--image, --actions)")
    generate.add_argument("--prompt", action="append", default=None,
                          help="--model wan: a prompt, or 'SECONDS:text' entries (repeat the flag) for a prompt "
                               "schedule")
    generate.add_argument("--seconds", type=_positive_seconds, default=None,
                          help="--model wan: video length in seconds")
    generate.add_argument("--image", type=_existing_path, default=None,
                          help="--model matrix-game: the start frame (resized and center-cropped to the model's size)")
    generate.add_argument("--actions", type=_existing_path, default=None,
                          help="--model matrix-game: JSON {\"keyboard\": [[...], ...], \"mouse\": [[...], ...]}, one "
                               "row per video frame (keyboard: universal [W, S, A, D], gta-drive [W, S], templerun 7 "
                               "one-hot, matrix-game-tiny 3; mouse [pitch, yaw], none for templerun); 9 rows make the "
                               "first block, 12 each further one, and rows past the last whole block are dropped "
                               f"(said on stderr); at most {MAX_ACTIONS_BYTES // 2**20} MiB")
    generate.add_argument("--clip", type=_existing_path, default=None,
                          help="--model matrix-game: the CLIP vision weights (open-clip .pth or a CLIPVisionModel)")
    generate.add_argument("--out", type=_mp4_output, required=True, help="the .mp4 to write")
    generate.add_argument("--dtype", type=_kv_dtype, default="bfloat16", help="weights and KV dtype")
    generate.add_argument("--seed", type=_non_negative_int, default=0, help="noise seed")
    generate.add_argument("--no-recache", action="store_true",
                          help="keep the history's K/V at a prompt switch (default: LongLive's recache)")
    generate.add_argument("--available-gib", type=_memory_gib, default=None,
                          help="memory to plan the KV against (default: measured)")
    generate.add_argument("--no-progress", action="store_true", help="no progress bar")
    generate.set_defaults(run=_run_generate)


#: The largest --actions file read (a row is about 30 bytes: 4 MiB is well over an hour of video at 25 fps).
MAX_ACTIONS_BYTES = 4 * 2**20


def _check_writable_file(path: str) -> str | None:
    """Why ``path`` cannot be written, or None: tried on the file system before any work (created, then removed)."""
    try:
        if os.path.exists(path):
            if not os.path.isfile(path) or not os.access(path, os.W_OK):
                return f"argument --out: {path} exists and cannot be overwritten"
            return None
        with open(path, "xb"):
            pass
        os.remove(path)
    except OSError as error:
        return f"argument --out: cannot create {path}: {error.strerror or error}"
    return None


def _check_prompts(prompts: Sequence[str]) -> str | None:
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # bytes the locale could not decode arrive as lone surrogates
            shown = prompt.encode("utf-8", "replace")[:60]
            return f"argument --prompt: not valid UTF-8 text ({shown!r}: {error.reason})"
    return None


def _read_action_script(path: str) -> tuple[Any, Any]:
    """``(keyboard f32[N, K], mouse f32[N, M] or None)`` of a JSON action script; ValueError naming the problem."""
    import numpy as np

    from ardiff_jax._files import read_json_file

    # The shared bounded reader: regular files only (a FIFO is refused, never opened for a blocking read),
    # size- and depth-bounded, NaN/Infinity refused, the message naming the file.
    try:
        data = read_json_file(path, error=ValueError, what="action script", max_bytes=MAX_ACTIONS_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such action script") from None
    if not isinstance(data, dict) or "keyboard" not in data:
        raise ValueError(f"{path}: an action script is a JSON object with 'keyboard' (and 'mouse') rows")
    unknown = sorted(set(data) - {"keyboard", "mouse"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; an action script has 'keyboard' and 'mouse'")
    arrays = []
    for name in ("keyboard", "mouse"):
        if data.get(name) is None:
            arrays.append(None)
            continue
        try:
            array = np.asarray(data[name], np.float32)
        except (TypeError, ValueError, RecursionError):
            raise ValueError(f"{path}: '{name}' must be rows of numbers, one row per video frame") from None
        if array.ndim != 2 or array.shape[0] < 1:
            raise ValueError(f"{path}: '{name}' must be rows of numbers [N, width], one row per video frame; "
                             f"got shape {list(array.shape)}")
        if not np.isfinite(array).all():
            raise ValueError(f"{path}: '{name}' has values that are not finite numbers")
        arrays.append(array)
    keyboard, mouse = arrays
    if mouse is not None and mouse.shape[0] != keyboard.shape[0]:
        raise ValueError(f"{path}: {keyboard.shape[0]} keyboard rows but {mouse.shape[0]} mouse rows (one each per "
                         "video frame)")
    return keyboard, mouse


_KEYBOARD_LAYOUT = {4: "[W, S, A, D]", 2: "[W, S]", 7: "a 7-way one-hot (index 0 = no-op)"}


def _check_matrix_game_generate(args: argparse.Namespace) -> str | None:
    """The first problem with ``generate --model matrix-game``'s arguments and files, or None. Host only: the
    action script is checked against the variant and the picture is read before anything is built."""
    for flag, value in (("--prompt", args.prompt), ("--prompt-embeds", args.prompt_embeds),
                        ("--text-encoder", args.text_encoder), ("--tokenizer", args.tokenizer), ("--lora", args.lora),
                        ("--policy", args.policy), ("--seconds", args.seconds)):
        if value:
            return (f"argument {flag}: not for --model matrix-game (an image and actions drive it; the actions set "
                    "the length)")
    if args.image is None or args.actions is None:
        return "--model matrix-game needs --image and --actions"
    if args.preset is not None and args.preset not in MATRIX_GAME_PRESETS:
        return (f"argument --preset: {args.preset!r} is not a Matrix-Game preset; choose from "
                f"{', '.join(MATRIX_GAME_PRESETS)}")
    if args.random_weights:
        if args.vae or args.clip:
            return "--random-weights builds every part itself: drop --vae and --clip"
    elif args.vae is None:
        return "argument --vae: needed to encode the image and decode video (Wan2.1_VAE.pth)"
    elif args.clip is None:
        return "argument --clip: needed to encode the image (the open-clip ViT-H/14 .pth)"
    from ardiff_jax.models import dit_preset

    if args.preset is not None or args.random_weights:
        config = dit_preset(args.preset or "matrix-game-2-universal")
    else:
        from ardiff_jax.models.wan import checkpoint_config

        try:
            config = checkpoint_config(args.weights)  # headers only
        except (ValueError, OSError) as error:
            return f"argument --weights: {error}"
        if config.action is None:
            return f"argument --weights: {args.weights} has no action modules: not a Matrix-Game checkpoint"
    try:
        keyboard, mouse = _read_action_script(args.actions)
    except (ValueError, OSError) as error:
        return f"argument --actions: {error}"
    action, name = config.action, config.name
    if keyboard.shape[1] != action.keyboard_dim:
        layout = _KEYBOARD_LAYOUT.get(action.keyboard_dim)
        return (f"argument --actions: keyboard rows have {keyboard.shape[1]} values; {name} takes "
                f"{action.keyboard_dim}" + (f": {layout}" if layout else ""))
    if action.mouse_dim == 0 and mouse is not None:
        return f"argument --actions: {name} has no mouse (keyboard only): drop 'mouse'"
    if action.mouse_dim and mouse is None:
        return f"argument --actions: {name} needs 'mouse' rows ([pitch, yaw] per video frame) beside 'keyboard'"
    if mouse is not None and mouse.shape[1] != action.mouse_dim:
        return (f"argument --actions: mouse rows have {mouse.shape[1]} values; {name} takes {action.mouse_dim} "
                "([pitch, yaw])")
    first = action.num_rows(config.frames_per_block)  # 9: the first block's video frames
    per_block = action.frames_per_latent * config.frames_per_block  # 12 per further block
    rows = keyboard.shape[0]
    if rows < first:
        return (f"argument --actions: {rows} rows; the first block needs {first} (one row per video frame: {first}, "
                f"then {per_block} per block)")
    try:
        _read_image(args.image)
    except (ValueError, OSError) as error:
        return str(error) if str(error).startswith("argument --image") else f"argument --image: {error}"
    problem = _check_writable_file(args.out)
    if problem is not None:
        return problem
    used = first + per_block * ((rows - first) // per_block)
    args.video_frames = (used, 1 + (rows - first) // per_block)  # said before the build starts
    if used < rows:
        print(f"ardiff-jax generate: note: --actions has {rows} rows; the video has {used} frames ({first} for the "
              f"first block, then {per_block} per block), so the last {rows - used} rows are dropped", file=sys.stderr)
    return None


def _run_generate(args: argparse.Namespace) -> int:
    if args.model == "matrix-game":
        problem = _check_matrix_game_generate(args)
        if problem is not None:
            return _refuse("generate", problem)
        if args.random_weights and args.preset is None:
            print("ardiff-jax generate: note: --random-weights without --preset builds the full "
                  "matrix-game-2-universal (1.6e9 parameters); --preset matrix-game-tiny is a small network for a CPU",
                  file=sys.stderr)
        from ardiff_jax.models.matrix_game import MATRIX_GAME_FPS, run_generate_cli

        frames, blocks = args.video_frames
        weights = "random weights" if args.random_weights else args.weights
        length = f"{frames / MATRIX_GAME_FPS:.2f} s at {MATRIX_GAME_FPS} fps"
        _say("generate", f"building {args.preset or 'the checkpoint'}'s transformer, VAE and image encoder "
                         f"({weights}), compiling it, then generating {_plural(frames, 'frame')} ({length}) in "
                         f"{_plural(blocks, 'block')} (seconds to a minute on a CPU)")
        return run_generate_cli(args, _refuse)
    for flag, value in (("--image", args.image), ("--actions", args.actions), ("--clip", args.clip)):
        if value is not None:
            return _refuse("generate", f"argument {flag}: not for --model wan (a causal Wan is driven by prompts); "
                                       f"{flag} is for --model matrix-game")
    if args.prompt is None or args.seconds is None:
        return _refuse("generate", "--model wan needs --prompt and --seconds")
    problem = _check_prompts(args.prompt)
    if problem is not None:
        return _refuse("generate", problem)
    from ardiff_jax.models.wan import PromptSchedule

    try:
        schedule = PromptSchedule.parse(args.prompt)
    except ValueError as error:
        return _refuse("generate", f"argument --prompt: {error}")
    problem = _check_wan_arguments("generate", args, embeds_allowed=True)
    if problem is not None:
        return _refuse("generate", problem)
    if args.prompt_embeds and len(args.prompt_embeds) != len(schedule.prompts):
        return _refuse("generate", f"argument --prompt-embeds: {len(args.prompt_embeds)} files for "
                                   f"{len(schedule.prompts)} prompts (one each, in order)")
    if args.preset is not None and args.preset not in WAN_PRESETS:
        return _refuse("generate", _wrong_preset("--model wan", args.preset, WAN_PRESETS))
    if args.preset == "wan2.2-ti2v-5b":
        return _refuse("generate", "--preset wan2.2-ti2v-5b decodes with the Wan 2.2 VAE (48 channels, 16x), which "
                                   "this repository does not have yet")
    problem = _check_writable_file(args.out)
    if problem is not None:
        return _refuse("generate", problem)
    if args.random_weights and args.preset is None:
        print("ardiff-jax generate: note: --random-weights without --preset builds the full wan2.1-t2v-1.3b "
              "(1.4e9 parameters); --preset wan-tiny is a small network for a CPU", file=sys.stderr)
    try:
        return _generate(args, schedule)
    except (ValueError, OSError, ImportError) as error:  # bad files and shapes, named by the loaders
        return _refuse("generate", str(error))


def _generate(args: argparse.Namespace, schedule: Any) -> int:
    import numpy as np

    from ardiff_jax.models.wan import CausalWanPipelineConfig
    from ardiff_jax.models.wan import generate_video
    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

    from ardiff_jax.models.wan import VIDEO_FPS

    recache = len(schedule.prompts) > 1 and not args.no_recache
    weights = "random weights" if args.random_weights else args.weights
    _say("generate", f"building {args.preset or 'the checkpoint'}'s transformer, VAE and text encoder ({weights})")
    pipeline = _build_wan(args, CausalWanPipelineConfig(session_capacity=1, recache_on_prompt_switch=recache))
    encode = None
    if args.prompt_embeds:
        encode = {p: np.load(path) for p, path in zip(schedule.prompts, args.prompt_embeds, strict=True)}
    available = None if args.available_gib is None else int(args.available_gib)
    _say("generate", "compiling one block's programs (seconds to a minute on a CPU)")
    engine = ARDiffusionEngine(pipeline, EngineConfig(dtype=args.dtype, available_memory_bytes=available,
                                                      gpu_memory_fraction=0.9))
    # As generate_video counts them: the first block makes 1 + t(f - 1) video frames, each further one t f.
    frames = max(1, round(args.seconds * VIDEO_FPS))
    f, t = pipeline.config.frames_per_block, pipeline.vae.config.temporal_factor
    first = 1 + t * (f - 1)
    blocks = 1 if frames <= first else 1 + math.ceil((frames - first) / (t * f))
    _say("generate", f"generating {_plural(frames, 'frame')} ({frames / VIDEO_FPS:.2f} s at {VIDEO_FPS} fps) in "
                     f"{_plural(blocks, 'block')}")
    try:
        video = generate_video(engine, schedule, args.seconds, encode=encode, out=args.out, seed=args.seed,
                               progress=not args.no_progress)
    finally:
        engine.close()
    print(f"{video.num_frames} frames ({video.num_frames / video.fps:.2f} s at {video.fps} fps) in {video.blocks} "
          f"blocks, {video.frames_per_second:.2f} frames/s: {video.path}")
    return 0


# -- serve ---------------------------------------------------------------------------------------


def _port(text: str) -> int:
    return _int_argument(text, 0, 65536, "a port number in [0, 65535]")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", **_about("serve"))
    model = serve.add_mutually_exclusive_group(required=True)
    model.add_argument("--pretrained", choices=("sprite_world",), default=None,
                       help="shipped weights: the trained SpriteWorld model")
    model.add_argument("--pipeline", choices=("world",), default=None,
                       help="a random-weights WorldPipeline (with --preset)")
    model.add_argument("--model", choices=("wan", "matrix-game", "dreamzero"), default=None,
                       help="wan: text-to-video with a causal Wan (--weights, --vae, --text-encoder, --tokenizer); "
                            "matrix-game: Matrix-Game 2.0, played with keys and the mouse from a start picture "
                            "(--weights, --vae, --clip, --variant); dreamzero: DreamZero robot policies over the "
                            "openpi / RoboArena protocol (--checkpoint, --vae, --clip, --text-encoder, --tokenizer); "
                            "each with --random-weights instead")
    serve.add_argument("--preset", default=None,
                       help="CausalDiT preset of --pipeline world (default: tiny) or --model wan (default: read from "
                            "the checkpoint)")
    _add_wan_arguments(serve, required=False)
    serve.add_argument("--text-encoder", type=_existing_path, default=None,
                       help="--model wan: models_t5_umt5-xxl-enc-bf16.pth or a transformers UMT5 encoder")
    serve.add_argument("--variant", choices=("universal", "gta-drive", "templerun"), default=None,
                       help="--model matrix-game: which release (default universal; the keys and mouse it takes)")
    serve.add_argument("--clip", type=_existing_path, default=None,
                       help="--model matrix-game: the CLIP vision weights (open-clip .pth or a CLIPVisionModel)")
    serve.add_argument("--checkpoint", type=_existing_path, default=None,
                       help="--model dreamzero: the release's checkpoint directory (config.json, model.safetensors*)")
    serve.add_argument("--metadata", type=_existing_path, default=None,
                       help="--model dreamzero: the q01/q99 statistics (default: the checkpoint's "
                            "experiment_cfg/metadata.json)")
    serve.add_argument("--image", type=_existing_path, default=None,
                       help="--model matrix-game: the picture a session starts from when its session.start has no "
                            "image_reference")
    serve.add_argument("--dtype", type=_kv_dtype, default="bfloat16",
                       help="--model wan / matrix-game: weights and KV dtype")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    serve.add_argument("--capacity", type=_positive_int, default=4,
                       help="sessions resident on the device at once (default: 4)")
    serve.add_argument("--host-offload-bytes", type=_host_bytes, default=0,
                       help="host memory for sessions beyond --capacity (EngineConfig.host_offload_bytes; "
                            "0: off)")
    serve.add_argument("--batch-compile", choices=("eager", "background", "lazy"), default="background",
                       help="when the batched programs (one per batch size) compile (EngineConfig.batch_compile): "
                            "background serves the first player once the one-player programs are built and builds "
                            "the rest on a thread (default: background)")
    serve.add_argument("--available-bytes", type=_memory_bytes, default=2**28,
                       help="device memory to plan the KV pools against (default: 256 MiB)")
    serve.add_argument("--max-message-bytes", type=_positive_int, default=None,
                       help="largest client message read (default: 65536; 16 MiB for --model matrix-game, whose "
                            "session.start may carry the start picture)")
    serve.add_argument("--start-timeout", type=_seconds, default=10.0,
                       help="seconds a connection has to send session.start (default: 10)")
    serve.add_argument("--stall-timeout", type=_seconds, default=60.0,
                       help="seconds without progress or ping before a session is reported stalled (default: 60)")
    serve.add_argument("--fps", type=lambda text: _int_argument(text, 1, 241, "an integer in [1, 240]"),
                       default=None, help="default frame rate a session plays at, paced and written into the media "
                                          "(default: the model's, 16 for Wan, else 10)")
    serve.add_argument("--lookahead-chunks", type=lambda text: _int_argument(text, 0, 65, "an integer in [0, 64]"),
                       default=1, help="chunks a session may have generated beyond the one playing (default: 1)")
    serve.add_argument("--no-pacing", action="store_true",
                       help="generate as fast as the engine goes instead of just in time for playback")
    # Who may connect (ardiff_jax.serve.ServerAccess).
    key = serve.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="clients must present KEY (Authorization: Bearer KEY, or ?token=KEY); also guards /metrics. "
                          "Visible in the process list: prefer --api-key-file")
    key.add_argument("--api-key-file", type=_api_key_file, default=None, metavar="PATH", dest="api_key_from_file",
                     help="read the key from PATH (surrounding whitespace removed; an empty file is refused)")
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="let web pages of ORIGIN (scheme://host[:port]) connect besides the server's own origin; "
                            "repeatable; '*' allows any page (default: same origin only)")
    serve.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without the key (default: /metrics needs it when a key is set)")
    serve.add_argument("--max-connections-per-client", type=_positive_int, default=8, metavar="N",
                       help="open WebSockets per client address (default: 8)")
    serve.add_argument("--trust-forwarded-for", action="append", default=[], metavar="PROXY",
                       help="a reverse proxy (IP address or network) whose X-Forwarded-For names the client the "
                            "per-address limit counts; repeatable (default: none, the header is never believed)")
    serve.set_defaults(run=_run_serve)


def _api_key_file(text: str) -> str:
    try:
        from ardiff_jax.serve import read_api_key_file
    except ImportError as error:
        raise argparse.ArgumentTypeError(f"{error}; install the serve extra: pip install 'ardiff_jax[serve]'") from None
    try:
        return read_api_key_file(text)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {error.strerror or error}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _run_serve(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        import uvicorn

        from ardiff_jax.serve import (
            ServedWorld,
            ServerAccess,
            ServerSettings,
            StartingApp,
            create_app,
        )
    except ImportError as error:
        return _refuse("serve", f"{error}; install the serve extra: pip install 'ardiff_jax[serve]'")
    try:
        access = ServerAccess(api_key=args.api_key if args.api_key is not None else args.api_key_from_file,
                              allowed_origins=tuple(args.allow_origin), public_metrics=args.public_metrics,
                              max_connections_per_client=args.max_connections_per_client,
                              trusted_proxies=tuple(args.trust_forwarded_for))
    except (TypeError, ValueError) as error:
        return _refuse("serve", str(error))
    from ardiff_jax.models import (
        WorldPipeline,
        WorldPipelineConfig,
        pretrained,
    )
    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

    if args.model is None and (args.weights or args.random_weights or args.vae or args.text_encoder):
        return _refuse("serve", "--weights, --random-weights, --vae and --text-encoder are for --model wan or "
                                "matrix-game")
    if args.model != "dreamzero" and (args.checkpoint or args.metadata):
        return _refuse("serve", "--checkpoint and --metadata are for --model dreamzero")
    if args.model == "dreamzero":
        problem = _check_dreamzero_serve(args)
        return _refuse("serve", problem) if problem is not None else _run_serve_dreamzero(args, access, started)
    if args.model != "matrix-game" and (args.variant or args.clip or args.image):
        return _refuse("serve", "--variant, --clip and --image are for --model matrix-game")
    if args.model == "matrix-game" and args.text_encoder:
        return _refuse("serve", "--text-encoder is for --model wan: Matrix-Game is conditioned on a picture")
    if args.max_message_bytes is None:
        args.max_message_bytes = 16 * 2**20 if args.model == "matrix-game" else 64 * 1024
    if args.model == "wan":
        problem = _check_wan_arguments("serve", args, embeds_allowed=False)
        if problem is not None:
            return _refuse("serve", problem)
    elif args.model == "matrix-game":
        problem = _check_matrix_game_serve(args)
        if problem is not None:
            return _refuse("serve", problem)
    elif args.preset is None and args.pipeline is not None:
        args.preset = "tiny"
    family = f"--model {args.model}" if args.model else "--pipeline world" if args.pipeline else None
    if args.preset is not None and args.preset not in _SERVE_PRESETS.get(family, ()):
        if family is None:
            return _refuse("serve", "argument --preset: for --pipeline world, --model wan or --model matrix-game")
        return _refuse("serve", _wrong_preset(family, args.preset, _SERVE_PRESETS[family]))
    # Bind before building anything: a busy port is a one-line error, not a traceback after
    # the model loaded, and "serving on" is printed only once the socket really listens.
    try:
        listener = _listen(args.host, args.port)
    except OSError as error:
        return _refuse("serve", f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    try:
        start_image = None if args.image is None else _read_image(args.image)  # host only: before any build
    except (TypeError, ValueError, OSError) as error:
        listener.close()
        return _refuse("serve", str(error))
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    page = "127.0.0.1" if host in ("0.0.0.0", "::") else shown  # a wildcard address: this machine's page
    built: dict[str, Any] = {}  # the engine, once built: closed however serve ends

    def build(stage: Any) -> Any:
        """Runs on StartingApp's thread while the port already answers "starting" (issue 47, item 3)."""
        stage("building the model")
        if args.pretrained is not None:
            pipeline = pretrained(args.pretrained, session_capacity=args.capacity)
        elif args.model == "wan":
            from ardiff_jax.models.wan import CausalWanPipelineConfig

            try:
                pipeline = _build_wan(args, CausalWanPipelineConfig(session_capacity=args.capacity))
            except (ValueError, OSError, ImportError) as error:
                raise _ServeRefused(str(error)) from None
        elif args.model == "matrix-game":
            from ardiff_jax.models.matrix_game import build_matrix_game

            try:
                pipeline = build_matrix_game(weights=args.weights, preset=args.preset, vae=args.vae, clip=args.clip,
                                             dtype=args.dtype, random_weights=args.random_weights,
                                             session_capacity=args.capacity)
            except (ValueError, OSError, ImportError) as error:
                raise _ServeRefused(str(error)) from None
            if args.random_weights:
                print("random weights: the video is noise-like; this server measures speed", file=sys.stderr)
        else:
            pipeline = WorldPipeline(args.preset, WorldPipelineConfig(session_capacity=args.capacity))
        try:
            world = ServedWorld.for_pipeline(pipeline, fps=args.fps, start_image=start_image)
        except (TypeError, ValueError, OSError) as error:
            raise _ServeRefused(str(error)) from None
        stage("planning memory and compiling the engine's programs")
        config = EngineConfig(dtype=args.dtype if args.model in ("wan", "matrix-game") else "float32",
                              available_memory_bytes=args.available_bytes, gpu_memory_fraction=1.0,
                              host_offload_bytes=args.host_offload_bytes, batch_compile=args.batch_compile)
        try:
            built["engine"] = engine = ARDiffusionEngine(pipeline, config)
        except ValueError as error:
            raise _ServeRefused(f"the model does not fit --available-bytes {args.available_bytes}: {error}") from None
        settings = ServerSettings(max_message_bytes=args.max_message_bytes, start_timeout_s=args.start_timeout,
                                  stall_timeout_s=args.stall_timeout, lookahead_chunks=args.lookahead_chunks,
                                  paced=not args.no_pacing)
        return create_app(engine, world=world, settings=settings, access=access)

    def ready(app: Any) -> None:
        engine = built["engine"]
        print(f"serving {app.state.server.world.name} (capacity {app.state.server.capacity}) on "
              f"ws://{shown}:{port}/v1/realtime/video", flush=True)
        token = "?token=<key>" if args.api_key is not None or args.api_key_from_file is not None else ""
        print(f"open http://{page}:{port}/{token} in a browser for the bundled player", flush=True)
        later = ("; the batched programs for several players compile in the background"
                 if engine.runner.compiled_batch_buckets != engine.batch_buckets else "")
        print(f"ardiff-jax serve: ready {time.perf_counter() - started:.1f} s after start{later}", file=sys.stderr,
              flush=True)

    subject = _serve_subject(args)
    starting = StartingApp(build, building=subject, access=access, on_built=ready,
                           on_failure=lambda error: setattr(server, "should_exit", True))
    # The transport refuses frames far beyond the app's own limit before reading them whole.
    # proxy_headers=False: the app reads X-Forwarded-For itself, from --trust-forwarded-for proxies only.
    server = uvicorn.Server(uvicorn.Config(starting, log_level="info", proxy_headers=False,
                                           ws_max_size=max(4 * args.max_message_bytes, 2**20)))
    stopped_by: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        # uvicorn re-raises the signal that stopped it once it has shut down; with Python's default
        # handlers that was a KeyboardInterrupt traceback (SIGINT) or a kill that skipped engine.close()
        # (SIGTERM). This handler takes the re-raised signal (and one before uvicorn's own are in place).
        stopped_by.append(signum)
        server.should_exit = True

    with listener:
        print(f"ardiff-jax serve: building {subject} and compiling it (seconds to minutes); meanwhile "
              f"http://{page}:{port}/healthz answers 503 \"starting\" and clients are told to retry; the addresses "
              "follow when it is ready", file=sys.stderr, flush=True)
        import signal
        import threading

        # Signal handlers belong to the main thread (a caller running serve on another thread keeps its own).
        handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
        previous = {signum: signal.signal(signum, stop) for signum in handled}
        try:
            starting.start()  # the build runs while uvicorn starts; the port answers "starting" meanwhile
            server.run(sockets=[listener])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            thread = starting.building_thread
            if thread is not None and thread.is_alive() and stopped_by:
                # Stopped mid-build: the build cannot be interrupted (it may be compiling) and the process must not
                # run interpreter shutdown under it (XLA may abort), so it ends here, at once and without a traceback.
                print("ardiff-jax serve: stopped while building; nothing was served", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(130)
            if thread is not None:
                thread.join()  # the server ended on its own (not a signal): let the build finish, then close it
            if "engine" in built:
                built["engine"].close()
    if starting.error is not None:
        error = starting.error
        if isinstance(error, _ServeRefused):
            return _refuse("serve", str(error))
        return _refuse("serve", f"building {subject} failed: {type(error).__name__}: {error}")
    # Stopped by a signal once serving (Ctrl-C, SIGTERM): a clean stop, the engine closed.
    return 0


class _ServeRefused(Exception):
    """A problem with ``serve``'s arguments found while building (a refusal, exit 2; the message is the error)."""


def _serve_subject(args: argparse.Namespace) -> str:
    """What ``serve`` is about to build, in words (printed before the build starts)."""
    if args.pretrained is not None:
        return f"the trained {args.pretrained} model"
    if args.model is None:
        return f"a random-weights WorldPipeline ({args.preset})"
    weights = "random weights" if args.random_weights else args.weights
    return f"--model {args.model} {args.preset or '(preset read from the checkpoint)'} ({weights})"


def _check_dreamzero_serve(args: argparse.Namespace) -> str | None:
    """The first problem with ``serve --model dreamzero``'s arguments, or None (host only, nothing built)."""
    if args.variant or args.image or args.weights or args.lora or args.policy:
        return "--model dreamzero takes --checkpoint (not --weights) and no --variant, --image, --lora or --policy"
    if args.preset is not None and args.preset not in DREAMZERO_PRESETS:
        return _wrong_preset("--model dreamzero", args.preset, DREAMZERO_PRESETS)
    if args.random_weights:
        if args.checkpoint or args.vae or args.clip or args.text_encoder or args.tokenizer or args.metadata:
            return "--random-weights builds every part itself: drop --checkpoint, --vae, --clip, --text-encoder, " \
                   "--tokenizer and --metadata"
        args.preset = args.preset or "dreamzero-tiny"
        return None
    if args.checkpoint is None:
        return "give --checkpoint (the release's DreamZero directory) or --random-weights --preset dreamzero-tiny"
    missing = [flag for flag, value in (("--vae", args.vae), ("--clip", args.clip),
                                        ("--text-encoder", args.text_encoder), ("--tokenizer", args.tokenizer))
               if value is None]
    if missing:
        return (f"a DreamZero checkpoint is served with the Wan2.1 encoders it froze: give {', '.join(missing)} "
                "(Wan2.1_VAE.pth, the open-clip ViT-H/14 .pth, models_t5_umt5-xxl-enc-bf16.pth, umT5's tokenizer)")
    return None


def _run_serve_dreamzero(args: argparse.Namespace, access: Any, started: float) -> int:
    """``serve --model dreamzero``: the robot-policy server (openpi / RoboArena) over DreamZero."""
    import uvicorn

    from ardiff_jax.serve import POLICY_TRANSPORT_MAX_BYTES as TRANSPORT_MAX_BYTES
    from ardiff_jax.serve import DreamZeroServeOptions, build_dreamzero_app

    options = DreamZeroServeOptions(
        checkpoint=args.checkpoint, preset=args.preset or "dreamzero-droid", vae=args.vae, clip=args.clip,
        umt5=args.text_encoder, tokenizer=args.tokenizer, metadata=args.metadata, capacity=args.capacity,
        dtype="float32" if args.random_weights and args.preset == "dreamzero-tiny" else args.dtype,
        available_bytes=args.available_bytes)
    try:
        listener = _listen(args.host, args.port)
    except OSError as error:
        return _refuse("serve", f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    say = functools.partial(print, "ardiff-jax serve:", file=sys.stderr, flush=True)
    try:
        app, policy = build_dreamzero_app(options, access=access, say=say)
    except (ValueError, OSError, ImportError) as error:
        listener.close()
        return _refuse("serve", str(error))
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", proxy_headers=False,
                                           ws_max_size=TRANSPORT_MAX_BYTES))
    print(f"serving DreamZero robot policies ({options.preset}, capacity {options.capacity}) on ws://{shown}:{port} "
          "(openpi / RoboArena policy protocol)", flush=True)
    say(f"ready {time.perf_counter() - started:.1f} s after start")
    with listener:
        try:
            server.run(sockets=[listener])
        except KeyboardInterrupt:  # Ctrl-C: a clean stop
            pass
        finally:
            policy.engine.close()
    return 0


def _check_matrix_game_serve(args: argparse.Namespace) -> str | None:
    """The first problem with ``serve --model matrix-game``'s arguments, or None (host only, nothing built)."""
    from ardiff_jax.models import DIT_PRESETS, dit_preset

    variant = "matrix-game-2-" + (args.variant or "universal")
    if args.preset is not None:
        if args.preset not in DIT_PRESETS or dit_preset(args.preset).action is None:
            choices = sorted(n for n in DIT_PRESETS if dit_preset(n).action is not None)
            return f"argument --preset: {args.preset!r} is not a Matrix-Game preset; choose from {', '.join(choices)}"
        if args.variant is not None:
            return "give --variant or --preset, not both"
    else:
        args.preset = variant
    if args.random_weights:
        if args.vae or args.clip or args.lora or args.policy:
            return "--random-weights builds every part itself: drop --vae, --clip, --lora and --policy"
        return None
    if args.weights is None:
        return "give --weights (the release's .safetensors or FastVideo's directory) or --random-weights"
    if args.vae is None:
        return "argument --vae: needed to encode the start picture and decode video (Wan2.1_VAE.pth)"
    if args.clip is None:
        return "argument --clip: needed to encode the start picture (the open-clip ViT-H/14 .pth)"
    return None


def _read_image(path: str) -> Any:
    """``u8[h, w, 3]`` of a picture file (the server's default start picture)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return np.asarray(picture.convert("RGB"), dtype=np.uint8)
    except UnidentifiedImageError:
        raise ValueError(f"argument --image: {path} is not a picture") from None


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening (``port`` 0: the system picks one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener


def _refuse(command: str, message: str) -> int:
    print(f"ardiff-jax {command}: error: {message}", file=sys.stderr)
    return 2


def _say(command: str, message: str) -> None:
    """One line on stderr before a long step (build, compile, generate): a silent terminal looks hung."""
    print(f"ardiff-jax {command}: {message}", file=sys.stderr, flush=True)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == [] or \
            action.default == argparse.SUPPRESS  # not `in (...)`: 0 == False would hide a default of 0
        if "(default" in text or "default:" in text or nothing:
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # As argparse's, but never inside a hyphenated name (matrix-game-2-universal stays whole).
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


DESCRIPTION = "ardiff-jax: a JAX runtime for autoregressive video diffusion models."
EPILOG = ("Every bad argument, and every missing optional package, is refused before any work, with exit code 2. "
          "Run 'ardiff-jax COMMAND --help'.")

#: Each command's one line in ``ardiff-jax --help`` (argparse lists them, once) and the description its own
#: ``--help`` opens with.
COMMAND_HELP = {
    "demo": ("play the trained SpriteWorld model next to its simulator (no download)",
             "Play the trained SpriteWorld model (shipped weights, no download) in several sessions through one "
             "engine, next to its simulator, and write a GIF per session, a contact sheet, summary.json and the raw "
             "frames into --out. With --agent: plan inside the world model (forked sessions) and compare four "
             "policies on reaching the ball."),
    "train": ("train that model on a CPU",
              "Train the SpriteWorld model (optax AdamW, orbax checkpoints, resumable), optionally exporting the "
              'weights. Needs the train extra: pip install "ardiff_jax[train]".'),
    "generate": ("write an MP4 with a causal Wan (Self-Forcing, LongLive, Krea) or Matrix-Game 2.0; "
                 "--random-weights with --preset wan-tiny or matrix-game-tiny needs no download",
                 "Write an MP4: a causal Wan (Self-Forcing, LongLive, Krea) from prompts, or Matrix-Game 2.0 from a "
                 "start picture and keyboard/mouse actions (--model matrix-game). --random-weights with --preset "
                 "wan-tiny or matrix-game-tiny runs without any download (a 48 x 32 video, nearly flat grey). "
                 'Writing the MP4 needs PyAV: pip install "ardiff_jax[serve]".'),
    "serve": ("stream a model to browsers over WebSocket (the bundled page at http://HOST:PORT/)",
              "Serve a world model over WebSocket (WS /v1/realtime/video) with a bundled browser player at "
              "http://HOST:PORT/: the trained SpriteWorld model, a causal Wan, Matrix-Game 2.0 or a random-weights "
              'WorldPipeline. Needs the serve extra: pip install "ardiff_jax[serve]".'),
    "rollout": ("time a multi-session rollout of a reference pipeline",
                "Run a timed multi-session generation with a reference pipeline (random weights, or a causal-Wan "
                "checkpoint) through the engine, round-robin, one block per request; print the memory plan, "
                "per-block latency and frames/s, and write a JSON summary with --out."),
    "plan": ("print the KV memory plan of a geometry",
             "Print the KV memory plan of a shipped example geometry against this machine's free memory (or an "
             "explicit budget), without allocating anything; --tp/--cfg plan one device of a mesh."),
}


def _about(command: str) -> dict[str, str]:
    summary, description = COMMAND_HELP[command]
    return {"help": summary, "description": description}


def _version() -> str:
    from ardiff_jax import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ardiff-jax", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In the order a new user meets them (argparse lists the commands in the order they are added).
    _add_demo(subparsers)
    _add_train(subparsers)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_rollout(subparsers)
    _add_plan(subparsers)
    for command in subparsers.choices.values():
        command.formatter_class = _HelpFormatter
    # serve's --preset is declared with its other flags (_add_serve); its values are listed here like every
    # other --preset's, in --help and in the error.
    for action in subparsers.choices["serve"]._actions:
        if "--preset" in action.option_strings:
            action.type, action.metavar = _preset_argument(_SERVE_PRESETS), "PRESET"
            action.help = f"{action.help}; {_preset_choices(_SERVE_PRESETS)}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Before any work: a missing extra used to surface as an ImportError after the model was built and compiled.
    problem = missing_dependencies(args)
    if problem is not None:
        return _refuse(args.command, problem)
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
