"""The ``ardiff-jax`` command line.

``ardiff-jax plan`` prints the memory plan of a shipped example geometry (``--geometry``), or of a
model's preset (``--model wan --preset wan2.1-t2v-1.3b``: the spec its pipeline gives from the preset,
no weights built), against the free memory of this machine (or an explicit budget), without allocating
anything. With ``--tp``/``--cfg`` the plan is one device's of that mesh; ``--devices`` adds how many
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

from ardiff_jax import _registry
from ardiff_jax._console import plural as _plural
from ardiff_jax._console import refuse as _refuse
from ardiff_jax._console import say as _say
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
    "msgpack": ("msgpack", "serve"),
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
    if command in _registry.COMMANDS:  # and what the chosen model imports beyond its command's own
        entry = _registry.selected(command, args)
        needed += [(module, why) for where, module, why in (entry.modules if entry else ()) if where == command]
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


# -- models and presets: one registry (ardiff_jax._registry) that generate, serve, rollout and plan share ----
# Each command's --model/--pipeline choices, --preset list, checks and builders come from the registry's
# entries; importing it imports no model code, so building the parser stays cheap.


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


def _model_choices(command: str, flag: str) -> tuple[str, ...]:
    """The values ``command``'s ``flag`` (``--model``, ``--pipeline``, ``--pretrained``) takes: the registry's."""
    return tuple(entry.name for entry in _registry.models(command, flag))


def _tiny_presets(command: str) -> str:
    """``wan-tiny and matrix-game-tiny``: the presets of ``command``'s models that run on a CPU."""
    tiny = [entry.tiny_preset for entry in _registry.models(command) if entry.tiny_preset is not None]
    return ", ".join(tiny[:-1]) + (" and " if len(tiny) > 1 else "") + tiny[-1]


def _refuse_preset(command: str, entry: _registry.ModelEntry, preset: str | None) -> int | None:
    """Refuse a ``--preset`` that ``entry``'s model does not take (None: it takes it, or none was given)."""
    if preset is None or preset in entry.presets:
        return None
    if not entry.presets:
        takers = [other.selector(command) for other in _registry.models(command) if other.presets]
        return _refuse(command, f"argument --preset: for {', '.join(takers[:-1])} or {takers[-1]}")
    return _refuse(command, _registry.wrong_preset(entry.selector(command), preset, entry.presets))


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


#: What ``plan`` plans when it is given neither --geometry nor --model.
_DEFAULT_GEOMETRY = "medium"
#: plan --model: the sessions asked for when --sessions is not given (serve's --capacity default).
_DEFAULT_PLAN_SESSIONS = 4


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", **_about("plan"))
    plan.add_argument("--geometry", default=None, choices=sorted(EXAMPLE_GEOMETRIES),
                      help=f"shipped example geometry (default: {_DEFAULT_GEOMETRY}, unless --model is given)")
    plan.add_argument("--model", default=None, choices=_model_choices("plan", "--model"),
                      help="plan this model's --preset instead of a geometry: the KV spec its pipeline gives from "
                           "the preset alone (no weights; per-session state a built pipeline adds beside it, such "
                           "as a VAE's streaming caches, is not counted)")
    presets = _registry.preset_groups("plan")
    plan.add_argument("--preset", default=None, type=_preset_argument(presets), metavar="PRESET",
                      help=f"with --model: the preset to plan; {_preset_choices(presets)}")
    plan.add_argument("--sessions", type=_positive_int, default=None,
                      help=f"with --model: the sessions asked for (the spec's session_capacity; the plan keeps as "
                           f"many as fit) (default: {_DEFAULT_PLAN_SESSIONS})")
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
    plan.add_argument("--json", action="store_true",
                      help="print the geometry (or the model and preset), its spec and the plan as JSON")
    plan.set_defaults(run=_run_plan)


def _plan_subject(args: argparse.Namespace) -> tuple[str, Any] | int:
    """``(what is planned, its KV spec)`` from --geometry or --model/--preset, or the refusal's exit code.

    ``--model`` plans the spec the model's pipeline class gives for the preset (``ModelEntry.kv_spec``, what
    ``rollout`` plans with before building anything): no weights are built.
    """
    if args.model:
        if args.geometry:
            return _refuse("plan", "give --geometry or --model with --preset, not both")
        entry = _registry.model(args.model, "plan")
        if not args.preset:
            return _refuse("plan", f"{entry.selector('plan')} needs --preset; choose from {', '.join(entry.presets)}")
        refused = _refuse_preset("plan", entry, args.preset)
        if refused is not None:
            return refused
        try:
            spec = entry.kv_spec(args.preset, args.sessions or _DEFAULT_PLAN_SESSIONS)
        except ValueError as error:
            return _refuse("plan", f"{entry.selector('plan')} cannot run --preset {args.preset}: {error}")
        return f"{entry.selector('plan')} --preset {args.preset}", spec
    for flag, value in (("--preset", args.preset), ("--sessions", args.sessions)):
        if value:
            return _refuse("plan", f"argument {flag}: only with --model (a geometry is planned as shipped)")
    args.geometry = args.geometry or _DEFAULT_GEOMETRY
    return f"--geometry {args.geometry}", example_spec(args.geometry)


def _run_plan(args: argparse.Namespace) -> int:
    devices_per_replica = args.tp * args.cfg
    if args.devices is not None and args.devices < devices_per_replica:
        return _refuse("plan", f"--devices {args.devices} cannot hold one tp={args.tp} x cfg={args.cfg} replica "
                               f"({devices_per_replica} devices)")
    subject = _plan_subject(args)
    if isinstance(subject, int):
        return subject
    planned, spec = subject
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
        return _refuse("plan", f"{planned}{where} does not fit: {error}")
    replicas = None if args.devices is None else args.devices // devices_per_replica
    if args.json:
        mesh = {"tp": args.tp, "cfg": args.cfg, "devices_per_replica": devices_per_replica,
                "sessions_per_replica": plan.session_capacity}
        if replicas is not None:
            mesh.update(devices=args.devices, replicas=replicas, total_sessions=replicas * plan.session_capacity)
        what = {"model": args.model, "preset": args.preset} if args.model else {"geometry": args.geometry}
        print(json.dumps({**what, "spec": spec_summary(spec), "plan": plan.as_dict(), "mesh": mesh}, indent=2))
        return 0
    geometry = ", ".join(f"{key}={value}" for key, value in spec_summary(spec).items())
    heading = planned if args.model else f"geometry {args.geometry}"  # the geometry's line as it always was
    print(f"{heading}: {geometry}")
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
    rollout.add_argument("--pipeline", default="world", choices=_model_choices("rollout", "--pipeline"),
                         help="world: single-branch WorldPipeline; cfg: DreamZero-style CFGWorldActionPipeline; "
                              "wan: a published causal Wan (CausalWanPipeline; needs --checkpoint or --random-weights)")
    presets = _registry.preset_groups("rollout")
    rollout.add_argument("--preset", default="tiny", type=_preset_argument(presets), metavar="PRESET",
                         help=f"network preset; {_preset_choices(presets)} (wan-tiny: a small network for a CPU)")
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
    refused = _refuse_preset("rollout", _registry.selected("rollout", args), args.preset)
    if refused is not None:
        return refused
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


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser("generate", **_about("generate"))
    _add_wan_arguments(generate, required=True)
    text = generate.add_mutually_exclusive_group()
    text.add_argument("--text-encoder", type=_existing_path, default=None,
                      help="models_t5_umt5-xxl-enc-bf16.pth or a transformers UMT5 encoder (needs --tokenizer)")
    text.add_argument("--prompt-embeds", type=_existing_path, action="append", default=None,
                      help="precomputed features (.npy, [L <= 512, 4096]), one per --prompt, in order")
    presets = _registry.preset_groups("generate")
    generate.add_argument("--preset", default=None, type=_preset_argument(presets), metavar="PRESET",
                          help=f"network preset; {_preset_choices(presets)} (default: read from the "
                               "checkpoint; with --random-weights the full wan2.1-t2v-1.3b or matrix-game-2-universal; "
                               f"{_tiny_presets('generate')} are small networks for a CPU)")
    generate.add_argument("--model", choices=_model_choices("generate", "--model"), default="wan",
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
                               f"(said on stderr); at most {_registry.MAX_ACTIONS_BYTES // 2**20} MiB")
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


def _run_generate(args: argparse.Namespace) -> int:
    entry = _registry.selected("generate", args)
    problem = entry.check("generate", args)  # host only: files read and checked, nothing built
    if problem is not None:
        return _refuse("generate", problem)
    return entry.generate(args)


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
    model.add_argument("--pretrained", choices=_model_choices("serve", "--pretrained"), default=None,
                       help="shipped weights: the trained SpriteWorld model")
    model.add_argument("--pipeline", choices=_model_choices("serve", "--pipeline"), default=None,
                       help="a random-weights WorldPipeline (with --preset)")
    model.add_argument("--model", choices=_model_choices("serve", "--model"), default=None,
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
    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

    entry = _registry.selected("serve", args)
    problem = entry.check("serve", args)
    if problem is not None:
        return _refuse("serve", problem)
    refused = _refuse_preset("serve", entry, args.preset)
    if refused is not None:
        return refused
    if entry.build_policy_app is not None:
        return _run_policy_server(entry, args, access, started)
    if args.max_message_bytes is None:
        args.max_message_bytes = entry.max_message_bytes
    # Bind before building anything: a busy port is a one-line error, not a traceback after
    # the model loaded, and "serving on" is printed only once the socket really listens.
    try:
        listener = _listen(args.host, args.port)
    except OSError as error:
        return _refuse("serve", f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    try:
        start_image = None if args.image is None else _registry.read_image(args.image)  # host only: before building
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
        pipeline = entry.build_served(args)  # BuildRefused: a problem with the arguments (exit 2)
        try:
            world = ServedWorld.for_pipeline(pipeline, fps=args.fps, start_image=start_image)
        except (TypeError, ValueError, OSError) as error:
            raise _registry.BuildRefused(str(error)) from None
        stage("planning memory and compiling the engine's programs")
        config = EngineConfig(dtype=args.dtype if entry.takes_dtype else "float32",
                              available_memory_bytes=args.available_bytes, gpu_memory_fraction=1.0,
                              host_offload_bytes=args.host_offload_bytes, batch_compile=args.batch_compile)
        try:
            built["engine"] = engine = ARDiffusionEngine(pipeline, config)
        except ValueError as error:
            raise _registry.BuildRefused(
                f"the model does not fit --available-bytes {args.available_bytes}: {error}") from None
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

    subject = _serve_subject(entry, args)
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
        if isinstance(error, _registry.BuildRefused):
            return _refuse("serve", str(error))
        return _refuse("serve", f"building {subject} failed: {type(error).__name__}: {error}")
    # Stopped by a signal once serving (Ctrl-C, SIGTERM): a clean stop, the engine closed.
    return 0


def _serve_subject(entry: _registry.ModelEntry, args: argparse.Namespace) -> str:
    """What ``serve`` is about to build, in words (printed before the build starts)."""
    if entry.flag == "--pretrained":
        return f"the trained {entry.name} model"
    if entry.flag == "--pipeline":  # serve's one reference pipeline
        return f"a random-weights WorldPipeline ({args.preset})"
    weights = "random weights" if args.random_weights else args.weights
    return f"{entry.selector('serve')} {args.preset or '(preset read from the checkpoint)'} ({weights})"


def _run_policy_server(entry: _registry.ModelEntry, args: argparse.Namespace, access: Any, started: float) -> int:
    """``serve --model dreamzero``: a robot-policy server (openpi / RoboArena) over the model's policy."""
    import uvicorn

    from ardiff_jax.serve import POLICY_TRANSPORT_MAX_BYTES as TRANSPORT_MAX_BYTES

    try:
        listener = _listen(args.host, args.port)
    except OSError as error:
        return _refuse("serve", f"cannot listen on {args.host}:{args.port}: {error.strerror or error}")
    say = functools.partial(print, "ardiff-jax serve:", file=sys.stderr, flush=True)
    try:
        app, policy, served = entry.build_policy_app(args, access, say)
    except (ValueError, OSError, ImportError) as error:
        listener.close()
        return _refuse("serve", str(error))
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", proxy_headers=False,
                                           ws_max_size=TRANSPORT_MAX_BYTES))
    print(f"serving {served} on ws://{shown}:{port} (openpi / RoboArena policy protocol)", flush=True)
    say(f"ready {time.perf_counter() - started:.1f} s after start")
    with listener:
        try:
            server.run(sockets=[listener])
        except KeyboardInterrupt:  # Ctrl-C: a clean stop
            pass
        finally:
            policy.engine.close()
    return 0


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
    "plan": ("print the KV memory plan of a geometry or of a model's preset",
             "Print the KV memory plan of a shipped example geometry (--geometry), or of a model's preset (--model "
             "with --preset: the spec its pipeline gives from the preset, no weights built), against this machine's "
             "free memory (or an explicit budget), without allocating anything; --tp/--cfg plan one device of a "
             "mesh."),
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
            presets = _registry.preset_groups("serve")
            action.type, action.metavar = _preset_argument(presets), "PRESET"
            action.help = f"{action.help}; {_preset_choices(presets)}"
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
