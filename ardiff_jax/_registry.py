"""The models the command line knows, in one registry that ``generate``, ``serve``, ``rollout`` and ``plan`` share.

One :class:`ModelEntry` per model says everything a command needs to know about it: how the command line
names it (``--model wan``, ``--pipeline world``), its presets (the tiny one that runs on a CPU marked), the
commands it supports, its argument check (run before any work), the optional modules it imports per command
(:func:`ardiff_jax.cli.required_modules` reads them) and its builders: the pipeline classes that ``plan`` and
``rollout`` plan memory with (``rollout`` also builds them, and makes its requests with ``rollout_requests``), the
pipeline or policy app ``serve`` serves, the run ``generate`` makes. The
commands look a model up here and call its entry; they hold no list of models or presets of their own, so a
model added here appears in each command's ``--model``/``--pipeline`` choices, ``--preset`` list and errors.

Importing this module imports no model code (building the parser must stay cheap): the builders import
what they build when called. ``tests/test_first_hour.py`` keeps the preset lists equal to what the pipelines
accept.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ardiff_jax._console import plural as _plural
from ardiff_jax._console import refuse as _refuse
from ardiff_jax._console import say as _say

__all__ = ["COMMANDS", "FLAGS", "MAX_ACTIONS_BYTES", "MODELS", "BuildRefused", "ModelEntry", "model", "models",
           "preset_groups", "read_image", "selected", "wrong_preset"]

#: The commands that take a model from this registry.
COMMANDS = ("generate", "serve", "rollout", "plan")
#: How a command line names a model: ``--model wan``, ``--pipeline world``, ``--pretrained sprite_world``
#: (``rollout`` names every model with ``--pipeline``, ``plan`` with ``--model``).
FLAGS = ("--model", "--pipeline", "--pretrained")

#: WorldPipeline (rollout --pipeline world, serve --pipeline world): random-weights reference geometries.
WORLD_PRESETS = ("tiny", "medium", "wan_1_3b")
#: CFGWorldActionPipeline (rollout --pipeline cfg): needs action and state register tokens.
CFG_PRESETS = ("tiny", "medium")
#: CausalWanPipeline (generate/serve --model wan, rollout --pipeline wan): wan-tiny is a small network for a CPU.
WAN_PRESETS = ("wan-tiny", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b")
#: MatrixGamePipeline (generate/serve --model matrix-game): matrix-game-tiny runs on a CPU.
MATRIX_GAME_PRESETS = ("matrix-game-tiny", "matrix-game-2-universal", "matrix-game-2-gta-drive",
                       "matrix-game-2-templerun")
#: DreamZero's presets (``serve --model dreamzero --random-weights``; the tiny one runs on a CPU).
DREAMZERO_PRESETS = ("dreamzero-tiny", "dreamzero-droid", "dreamzero-wan22-5b")

#: The largest --actions file read (a row is about 30 bytes: 4 MiB is well over an hour of video at 25 fps).
MAX_ACTIONS_BYTES = 4 * 2**20

#: The default largest client message ``serve`` reads (a model may need more: ``ModelEntry.max_message_bytes``).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024

Check = Callable[[argparse.Namespace], "str | None"]


class BuildRefused(Exception):
    """A problem with the arguments found only while building (a refusal, exit 2; the message is the error)."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model as the command line knows it.

    Attributes:
      name: its value on the command line (``wan`` in ``--model wan``).
      flag: how ``generate`` and ``serve`` name it (``--model``, ``--pipeline`` or ``--pretrained``); ``rollout``
        names every model with ``--pipeline``, ``plan`` with ``--model``.
      commands: the commands it supports, of :data:`COMMANDS`.
      presets: the ``--preset`` values it takes (``dit_preset`` names); none for shipped weights.
      tiny_preset: the preset small enough for a CPU (one of ``presets``), None without presets.
      checks: ``(command, check)``: ``check(args)`` is the first problem with the arguments, or None; host only,
        run before any work (it may fill in a default the build needs, e.g. the preset).
      modules: ``(command, module, what for)``: optional modules it imports beyond the command's own.
      pipeline_classes: ``() -> (pipeline class, its config class)``: ``plan`` and ``rollout`` plan memory with the
        class's static ``kv_spec_for`` before any weight (:meth:`kv_spec`); ``rollout`` then builds it.
      rollout_requests: ``rollout``: ``(pipeline, seed) -> make_request``, where ``make_request(session, block)`` is
        the :class:`~ardiff_jax.types.DiffusionRequest` of that session's block (inputs made up from ``seed``).
      rollout_checkpoints: ``rollout``: ``(path, config, pipeline_config) -> pipeline`` loading a checkpoint; None:
        the model runs on random weights only.
      build_served: ``serve``: ``(args) -> pipeline`` that a ``ServedWorld`` plays; :class:`BuildRefused` for a
        problem with the arguments.
      build_policy_app: ``serve``: ``(args, access, say) -> (app, policy, what is served)``, a robot-policy server.
      generate: ``generate``: ``(args) -> exit code``: builds, generates and writes the video.
      takes_dtype: ``serve``: ``--dtype`` sets its weights and KV dtype (otherwise float32).
      max_message_bytes: ``serve``: the default largest client message.
    """

    name: str
    flag: str
    commands: tuple[str, ...]
    presets: tuple[str, ...] = ()
    tiny_preset: str | None = None
    checks: tuple[tuple[str, Check], ...] = ()
    modules: tuple[tuple[str, str, str], ...] = ()
    pipeline_classes: Callable[[], tuple[type, type]] | None = None
    rollout_requests: Callable[[Any, int], Callable[[int, int], Any]] | None = None
    rollout_checkpoints: Callable[[str, Any, Any], Any] | None = None
    build_served: Callable[[argparse.Namespace], Any] | None = None
    build_policy_app: Callable[..., tuple[Any, Any, str]] | None = None
    generate: Callable[[argparse.Namespace], int] | None = None
    takes_dtype: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"model name must be letters, digits, '-' and '_', got {self.name!r}")
        if self.flag not in FLAGS:
            raise ValueError(f"model {self.name!r}: flag must be one of {FLAGS}, got {self.flag!r}")
        unknown = sorted(set(self.commands) - set(COMMANDS))
        if not self.commands or unknown:
            raise ValueError(f"model {self.name!r}: commands must be some of {COMMANDS}, got {self.commands!r}")
        if (self.tiny_preset is None) != (not self.presets) or (self.presets and self.tiny_preset not in self.presets):
            raise ValueError(f"model {self.name!r}: tiny_preset must be one of its presets {self.presets!r}, got "
                             f"{self.tiny_preset!r}")
        for command in {command for command, _ in self.checks} | {command for command, _, _ in self.modules}:
            if command not in self.commands:
                raise ValueError(f"model {self.name!r}: a check or module for {command!r}, which it does not support")
        needs = {"generate": self.generate is not None,
                 "serve": (self.build_served is None) != (self.build_policy_app is None),
                 "rollout": self.pipeline_classes is not None and self.rollout_requests is not None,
                 "plan": self.pipeline_classes is not None}
        missing = [command for command in self.commands if not needs[command]]
        if missing:
            raise ValueError(f"model {self.name!r}: no builder for {', '.join(missing)} (generate: generate; serve: "
                             "build_served or build_policy_app, one of them; rollout: pipeline_classes and "
                             "rollout_requests; plan: pipeline_classes)")
        if self.flag == "--pretrained" and {"rollout", "plan"} & set(self.commands):
            raise ValueError(f"model {self.name!r}: rollout names models with --pipeline and plan with --model, both "
                             "building from presets")
        if "plan" in self.commands and not self.presets:
            raise ValueError(f"model {self.name!r}: plan plans a preset's spec, and it has no presets")
        if self.rollout_checkpoints is not None and "rollout" not in self.commands:
            raise ValueError(f"model {self.name!r}: rollout_checkpoints, but it does not support rollout")

    def flag_for(self, command: str) -> str:
        """The flag ``command`` names this model with (``rollout`` has one selector, ``--pipeline``; ``plan`` has
        ``--model``)."""
        return {"rollout": "--pipeline", "plan": "--model"}.get(command, self.flag)

    def selector(self, command: str) -> str:
        """``--model wan``: the model as ``command``'s arguments and errors name it."""
        return f"{self.flag_for(command)} {self.name}"

    def check(self, command: str, args: argparse.Namespace) -> str | None:
        """The first problem with ``command``'s arguments for this model, or None (host only, nothing built)."""
        for where, check in self.checks:
            if where == command:
                problem = check(args)
                if problem is not None:
                    return problem
        return None

    def kv_spec(self, preset: str, session_capacity: int) -> Any:
        """The KV spec this model's pipeline class gives for ``preset`` (its static ``kv_spec_for``: no weights, so
        without the per-session state a built pipeline adds beside it, e.g. a VAE's streaming caches); ValueError
        if the pipeline cannot run the preset."""
        from ardiff_jax.models import dit_preset

        if self.pipeline_classes is None:
            raise ValueError(f"model {self.name!r} has no pipeline to plan")
        pipeline_cls, config_cls = self.pipeline_classes()
        return pipeline_cls.kv_spec_for(dit_preset(preset), config_cls(session_capacity=session_capacity))


def models(command: str, flag: str | None = None) -> tuple[ModelEntry, ...]:
    """The models ``command`` takes (named with ``flag``, if given), in the registry's order."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
    return tuple(entry for entry in MODELS if command in entry.commands
                 and (flag is None or entry.flag_for(command) == flag))


def model(name: str, command: str | None = None) -> ModelEntry:
    """The entry called ``name`` (that supports ``command``, if given); ValueError naming the choices."""
    choices = MODELS if command is None else models(command)
    for entry in choices:
        if entry.name == name:
            return entry
    where = "" if command is None else f" for {command}"
    raise ValueError(f"unknown model {name!r}{where}; choose from {', '.join(entry.name for entry in choices)}")


def selected(command: str, args: argparse.Namespace) -> ModelEntry | None:
    """The model ``command``'s parsed arguments name (``args.model``, ``args.pipeline``, ``args.pretrained``)."""
    for entry in models(command):
        if getattr(args, entry.flag_for(command)[2:], None) == entry.name:
            return entry
    return None


def preset_groups(command: str) -> dict[str, tuple[str, ...]]:
    """``{"--model wan": presets, ...}``: the presets ``command`` takes, by the model they belong to."""
    return {entry.selector(command): entry.presets for entry in models(command) if entry.presets}


def wrong_preset(flag: str, preset: str, names: Sequence[str]) -> str:
    return f"argument --preset: {preset!r} is not a preset of {flag}; choose from {', '.join(names)}"


# -- serve: which flags belong to which model (each message names the model the flag is for) -------------


def _weights_flags(args: argparse.Namespace) -> str | None:
    if args.weights or args.random_weights or args.vae or args.text_encoder:
        return "--weights, --random-weights, --vae and --text-encoder are for --model wan or matrix-game"
    return None


def _dreamzero_flags(args: argparse.Namespace) -> str | None:
    if args.checkpoint or args.metadata:
        return "--checkpoint and --metadata are for --model dreamzero"
    return None


def _matrix_game_flags(args: argparse.Namespace) -> str | None:
    if args.variant or args.clip or args.image:
        return "--variant, --clip and --image are for --model matrix-game"
    return None


def _first_problem(*checks: Check) -> Check:
    """One check running ``checks`` in order: the first problem found, or None."""

    def check(args: argparse.Namespace) -> str | None:
        for each in checks:
            problem = each(args)
            if problem is not None:
                return problem
        return None

    return check


# -- the shipped SpriteWorld model and the random-weights reference pipelines --------------------------


def _serve_pretrained(args: argparse.Namespace) -> Any:
    from ardiff_jax.models import pretrained

    return pretrained(args.pretrained, session_capacity=args.capacity)


def _default_world_preset(args: argparse.Namespace) -> None:
    args.preset = args.preset or "tiny"


def _world_classes() -> tuple[type, type]:
    from ardiff_jax.models import WorldPipeline, WorldPipelineConfig

    return WorldPipeline, WorldPipelineConfig


def _cfg_classes() -> tuple[type, type]:
    from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline

    return CFGWorldActionPipeline, CFGPipelineConfig


def _world_requests(pipeline: Any, seed: int) -> Callable[[int, int], Any]:
    """Rollout's requests to a WorldPipeline: a prompt per session, random actions if it has register tokens."""
    import numpy as np

    from ardiff_jax.types import DiffusionRequest

    cfg = pipeline.config
    rng = np.random.default_rng(seed)

    def make_request(session: int, block: int) -> Any:
        inputs: dict[str, Any] = {}
        if cfg.num_register_tokens:
            inputs["action"] = rng.standard_normal((cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)
        return DiffusionRequest(f"s{session}-b{block}", prompt=f"session {session}: a drive through the city",
                                extra_args={"session_id": f"session-{session}"}, inputs=inputs)

    return make_request


def _cfg_requests(pipeline: Any, seed: int) -> Callable[[int, int], Any]:
    """Rollout's requests to a CFGWorldActionPipeline: observations from its schema, seeded per session and block."""
    from ardiff_jax.types import DiffusionRequest

    def make_request(session: int, block: int) -> Any:
        # DreamZero's convention: the conditioning frame first, then 4-frame observation chunks.
        observation = pipeline.schema.example(1 if block == 0 else 4, seed=seed + 1000 * session + block)
        return DiffusionRequest(f"s{session}-b{block}", prompt=f"session {session}: pick up the cup",
                                extra_args={"session_id": f"session-{session}"}, inputs={"observation": observation})

    return make_request


def _serve_world(args: argparse.Namespace) -> Any:
    from ardiff_jax.models import WorldPipeline, WorldPipelineConfig

    return WorldPipeline(args.preset, WorldPipelineConfig(session_capacity=args.capacity))


# -- causal Wan (Self-Forcing, LongLive, Krea) -------------------------------------------------------------


def _wan_classes() -> tuple[type, type]:
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig

    return CausalWanPipeline, CausalWanPipelineConfig


def _wan_requests(pipeline: Any, seed: int) -> Callable[[int, int], Any]:
    """Rollout's requests to a causal Wan: stand-in umT5 features per session, with its first block only."""
    import numpy as np

    from ardiff_jax.types import DiffusionRequest

    cfg = pipeline.config

    def make_request(session: int, block: int) -> Any:
        # Stand-in umT5 features: one fixed random prompt per session, sent with its first block
        # only (the session keeps it; resending would time the host-side check of the features).
        inputs: dict[str, Any] = {}
        if block == 0:
            inputs["prompt_embeds"] = np.random.default_rng(seed + session).standard_normal(
                (min(32, cfg.text_len), cfg.text_dim)).astype(np.float32)
        return DiffusionRequest(f"s{session}-b{block}", extra_args={"session_id": f"session-{session}"},
                                inputs=inputs)

    return make_request


def _wan_checkpoint(path: str, config: Any, pipeline_config: Any) -> Any:
    from ardiff_jax.models.wan import CausalWanPipeline

    return CausalWanPipeline.from_checkpoint(path, config, pipeline_config=pipeline_config)


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


def _check_wan_serve(args: argparse.Namespace) -> str | None:
    return _check_wan_arguments("serve", args, embeds_allowed=False)


def _check_wan_generate(args: argparse.Namespace) -> str | None:
    """The first problem with ``generate --model wan``'s arguments and files, or None (host only)."""
    for flag, value in (("--image", args.image), ("--actions", args.actions), ("--clip", args.clip)):
        if value is not None:
            return f"argument {flag}: not for --model wan (a causal Wan is driven by prompts); {flag} is for " \
                   "--model matrix-game"
    if args.prompt is None or args.seconds is None:
        return "--model wan needs --prompt and --seconds"
    problem = _check_prompts(args.prompt)
    if problem is not None:
        return problem
    from ardiff_jax.models.wan import PromptSchedule

    try:
        schedule = PromptSchedule.parse(args.prompt)
    except ValueError as error:
        return f"argument --prompt: {error}"
    problem = _check_wan_arguments("generate", args, embeds_allowed=True)
    if problem is not None:
        return problem
    if args.prompt_embeds and len(args.prompt_embeds) != len(schedule.prompts):
        return (f"argument --prompt-embeds: {len(args.prompt_embeds)} files for {len(schedule.prompts)} prompts "
                "(one each, in order)")
    if args.preset is not None and args.preset not in WAN_PRESETS:
        return wrong_preset("--model wan", args.preset, WAN_PRESETS)
    if args.preset == "wan2.2-ti2v-5b":
        return ("--preset wan2.2-ti2v-5b decodes with the Wan 2.2 VAE (48 channels, 16x), which this repository "
                "does not have yet")
    return _check_writable_file(args.out)


def _generate_wan(args: argparse.Namespace) -> int:
    """``generate --model wan`` once its check passed: build, compile, generate, write the MP4."""
    from ardiff_jax.models.wan import PromptSchedule

    schedule = PromptSchedule.parse(args.prompt)  # parsed by the check already: it cannot fail here
    if args.random_weights and args.preset is None:
        print("ardiff-jax generate: note: --random-weights without --preset builds the full wan2.1-t2v-1.3b "
              "(1.4e9 parameters); --preset wan-tiny is a small network for a CPU", file=sys.stderr)
    try:
        return _generate_wan_video(args, schedule)
    except (ValueError, OSError, ImportError) as error:  # bad files and shapes, named by the loaders
        return _refuse("generate", str(error))


def _generate_wan_video(args: argparse.Namespace, schedule: Any) -> int:
    import numpy as np

    from ardiff_jax.models.wan import VIDEO_FPS, CausalWanPipelineConfig, generate_video
    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

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


def _serve_wan(args: argparse.Namespace) -> Any:
    from ardiff_jax.models.wan import CausalWanPipelineConfig

    try:
        return _build_wan(args, CausalWanPipelineConfig(session_capacity=args.capacity))
    except (ValueError, OSError, ImportError) as error:
        raise BuildRefused(str(error)) from None


# -- Matrix-Game 2.0 -----------------------------------------------------------------------------------------


_KEYBOARD_LAYOUT = {4: "[W, S, A, D]", 2: "[W, S]", 7: "a 7-way one-hot (index 0 = no-op)"}


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


def read_image(path: str) -> Any:
    """``u8[h, w, 3]`` of a picture file (the server's default start picture)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return np.asarray(picture.convert("RGB"), dtype=np.uint8)
    except UnidentifiedImageError:
        raise ValueError(f"argument --image: {path} is not a picture") from None


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
        read_image(args.image)
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


def _generate_matrix_game(args: argparse.Namespace) -> int:
    """``generate --model matrix-game`` once its check passed (which counted the video's frames and blocks)."""
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


def _text_encoder_flag(args: argparse.Namespace) -> str | None:
    if args.text_encoder:
        return "--text-encoder is for --model wan: Matrix-Game is conditioned on a picture"
    return None


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


def _matrix_game_classes() -> tuple[type, type]:
    from ardiff_jax.models.matrix_game import MatrixGamePipeline, MatrixGamePipelineConfig

    return MatrixGamePipeline, MatrixGamePipelineConfig


def _serve_matrix_game(args: argparse.Namespace) -> Any:
    from ardiff_jax.models.matrix_game import build_matrix_game

    try:
        pipeline = build_matrix_game(weights=args.weights, preset=args.preset, vae=args.vae, clip=args.clip,
                                     dtype=args.dtype, random_weights=args.random_weights,
                                     session_capacity=args.capacity)
    except (ValueError, OSError, ImportError) as error:
        raise BuildRefused(str(error)) from None
    if args.random_weights:
        print("random weights: the video is noise-like; this server measures speed", file=sys.stderr)
    return pipeline


# -- DreamZero (robot policies over the openpi / RoboArena protocol) -------------------------------------


def _check_dreamzero_serve(args: argparse.Namespace) -> str | None:
    """The first problem with ``serve --model dreamzero``'s arguments, or None (host only, nothing built)."""
    if args.variant or args.image or args.weights or args.lora or args.policy:
        return "--model dreamzero takes --checkpoint (not --weights) and no --variant, --image, --lora or --policy"
    if args.preset is not None and args.preset not in DREAMZERO_PRESETS:
        return wrong_preset("--model dreamzero", args.preset, DREAMZERO_PRESETS)
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


def _dreamzero_classes() -> tuple[type, type]:
    from ardiff_jax.models.dreamzero import DreamZeroPipeline, DreamZeroPipelineConfig

    return DreamZeroPipeline, DreamZeroPipelineConfig


def _serve_dreamzero(args: argparse.Namespace, access: Any, say: Callable[[str], None]) -> tuple[Any, Any, str]:
    """The robot-policy server app over DreamZero, its policy, and what it serves in words."""
    from ardiff_jax.serve import DreamZeroServeOptions, build_dreamzero_app

    options = DreamZeroServeOptions(
        checkpoint=args.checkpoint, preset=args.preset or "dreamzero-droid", vae=args.vae, clip=args.clip,
        umt5=args.text_encoder, tokenizer=args.tokenizer, metadata=args.metadata, capacity=args.capacity,
        dtype="float32" if args.random_weights and args.preset == "dreamzero-tiny" else args.dtype,
        available_bytes=args.available_bytes)
    app, policy = build_dreamzero_app(options, access=access, say=say)
    return app, policy, f"DreamZero robot policies ({options.preset}, capacity {options.capacity})"


# -- the registry ------------------------------------------------------------------------------------------

#: Every model, in the order the commands list them.
MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("sprite_world", "--pretrained", ("serve",),
               checks=(("serve", _first_problem(_weights_flags, _dreamzero_flags, _matrix_game_flags)),),
               build_served=_serve_pretrained),
    ModelEntry("world", "--pipeline", ("serve", "rollout", "plan"), WORLD_PRESETS, "tiny",
               checks=(("serve", _first_problem(_weights_flags, _dreamzero_flags, _matrix_game_flags,
                                                _default_world_preset)),),
               pipeline_classes=_world_classes, rollout_requests=_world_requests, build_served=_serve_world),
    ModelEntry("cfg", "--pipeline", ("rollout", "plan"), CFG_PRESETS, "tiny", pipeline_classes=_cfg_classes,
               rollout_requests=_cfg_requests),
    ModelEntry("wan", "--model", ("generate", "serve", "rollout", "plan"), WAN_PRESETS, "wan-tiny",
               checks=(("generate", _check_wan_generate),
                       ("serve", _first_problem(_dreamzero_flags, _matrix_game_flags, _check_wan_serve))),
               pipeline_classes=_wan_classes, rollout_requests=_wan_requests, rollout_checkpoints=_wan_checkpoint,
               build_served=_serve_wan, generate=_generate_wan, takes_dtype=True),
    ModelEntry("matrix-game", "--model", ("generate", "serve", "plan"), MATRIX_GAME_PRESETS, "matrix-game-tiny",
               checks=(("generate", _check_matrix_game_generate),
                       ("serve", _first_problem(_dreamzero_flags, _text_encoder_flag, _check_matrix_game_serve))),
               pipeline_classes=_matrix_game_classes, build_served=_serve_matrix_game,
               generate=_generate_matrix_game, takes_dtype=True,
               # its session.start may carry the start picture
               max_message_bytes=16 * 2**20),
    ModelEntry("dreamzero", "--model", ("serve", "plan"), DREAMZERO_PRESETS, "dreamzero-tiny",
               checks=(("serve", _check_dreamzero_serve),),
               modules=(("serve", "msgpack", "the robot-policy protocol"),),
               pipeline_classes=_dreamzero_classes, build_policy_app=_serve_dreamzero, takes_dtype=True),
)
