"""Load a released DreamZero checkpoint directory into :class:`~ardiff_jax.models.CausalDiT`.

DreamZero (NVIDIA GEAR's world-action model) saves its whole ``VLA`` with ``save_pretrained``:

* ``config.json``: a ``VLAConfig`` whose ``action_head_cfg`` carries hydra ``_target_`` names and
  the transformer's own arguments under ``action_head_cfg.config.diffusion_model_cfg``
  (``dim``, ``ffn_dim``, ``num_heads``, ``num_layers``, ``in_dim``, ``out_dim``, ``frame_seqlen``,
  ``num_frame_per_block``, ``num_action_per_block``, ``num_state_per_block``, ``max_chunk_size``,
  ``model_type``, ...; absent fields take the release's ``CausalWanModel`` defaults);
* ``model.safetensors.index.json`` plus shards, or one ``model.safetensors``; bf16 in practice.

Keys: the transformer is ``action_head.model.<name>``, ``<name>`` exactly the release's
``CausalWanModel`` parameter (Wan's names plus ``img_emb.proj.*``, ``blocks.{i}.cross_attn.{k,v}_img``,
``state_encoder.*``, ``action_encoder.*``, ``action_decoder.*``). The frozen umT5, CLIP and VAE saved
beside it (``action_head.text_encoder.*``, ``action_head.image_encoder.*``, ``action_head.vae.*``) and
anything else are reported (:attr:`DreamZeroCheckpoint.skipped`) and never read. As the release's own
loader: ``.base_layer.`` is removed from every key; a LoRA-trained checkpoint saved whole
(``action_head.model.base_model.model.<name>`` with ``lora_A``/``lora_B``) is merged,
``W += alpha / r * B @ A`` in float32 with the head config's ``lora_alpha`` and ``lora_rank``.

Both the current head module (``...action_head.wan_flow_matching_action_tf.WANPolicyHead``) and the
first public one (``..._efficient.`` / ``..._efficient_weighted.WANPolicyHead``, before the file was
renamed) are accepted. The register width (``hidden_size`` of ``CausalWanModel``, 1024 for DROID)
is read from the weights (``state_encoder.layer1.W``), never from the head config's unrelated
``hidden_size`` field.

Everything is checked before anything is placed on a device: the config's fields, every tensor's
name, shape and dtype, the shard index, bounded headers (the readers of the Wan loader), the LoRA
factors; then one parameter at a time is built on the host and put on device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ardiff_jax._checkpoint_files import MAX_EXPECTED_TENSORS, CheckpointError, shown_names
from ardiff_jax._checkpoint_files import as_checkpoint_error
from ardiff_jax._files import read_json_file
from ardiff_jax.models._config import ActionRegisterConfig, CausalDiTConfig, DIT_PRESETS, dit_preset
from ardiff_jax.models._dit import CausalDiT
from ardiff_jax.models.wan._checkpoint import (
    _Checkpoint,
    _check_tensors,
    _Lora,
    _read_weights_dir,
    build_checked_model,
    float_dtype_name,
    wan_names,
)

__all__ = ["DreamZeroCheckpoint", "dreamzero_checkpoint_config", "load_dreamzero", "DIT_PREFIX", "HEAD_TARGETS"]

_log = logging.getLogger(__name__)

#: Where the transformer's parameters sit in the VLA's state dict.
DIT_PREFIX = "action_head.model."
#: The LoRA wrapper peft puts around a model trained with ``train_architecture=lora``.
_LORA_WRAPPER = "base_model.model."
#: The head modules a DreamZero ``config.json`` may name: the current one and the first public ones.
HEAD_TARGETS = tuple(f"groot.vla.model.dreamzero.action_head.{module}.WANPolicyHead" for module in (
    "wan_flow_matching_action_tf", "wan_flow_matching_action_tf_efficient",
    "wan_flow_matching_action_tf_efficient_weighted"))
_DIT_TARGET = "groot.vla.model.dreamzero.modules.wan_video_dit_action_casual_chunk.CausalWanModel"
_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight")
#: Tensors a whole VLA checkpoint holds beside the transformer (umT5-XXL, CLIP's two towers, the VAE):
#: what bounds the headers read, past the transformer's own count.
_ENCODER_TENSORS = 4096

#: ``CausalWanModel``'s defaults for the fields a ``config.json`` may omit.
_DEFAULTS = {"text_len": 512, "text_dim": 4096, "freq_dim": 256, "eps": 1e-6, "action_dim": 32, "max_state_dim": 64,
             "num_frame_per_block": 1, "num_action_per_block": 32, "num_state_per_block": 1, "max_chunk_size": -1,
             "concat_first_frame_latent": True, "patch_size": [1, 2, 2], "model_type": "t2v", "in_dim": 16,
             "out_dim": 16, "frame_seqlen": 220}


@dataclasses.dataclass(frozen=True)
class DreamZeroCheckpoint:
    """What :func:`load_dreamzero` read: the network's config and the keys it did not take.

    Attributes:
      config: the :class:`CausalDiTConfig` the model was built with.
      skipped: keys of the checkpoint outside the transformer (the frozen encoders, ...), not read.
      merged_lora: modules whose LoRA was merged into the weights (empty for a full checkpoint).
    """

    config: CausalDiTConfig
    skipped: tuple[str, ...]
    merged_lora: tuple[str, ...]


def _field(data: dict[str, Any], path: Path, where: str, name: str) -> Any:
    value = data.get(name, _DEFAULTS.get(name))
    if value is None:
        raise CheckpointError(f"{path}: {where} has no field {name!r}")
    return value


def _int(path: Path, where: str, name: str, value: Any, *, allow_negative_one: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and not (allow_negative_one and value == -1)):
        raise CheckpointError(f"{path}: {where}.{name} must be a positive integer, got {value!r}"[:300])
    return value


def _transformer_json(path: Path) -> dict[str, Any]:
    """``action_head_cfg.config.diffusion_model_cfg`` of ``config.json``, its targets checked."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json: not a DreamZero checkpoint directory")
    data = read_json_file(config_path, error=CheckpointError, what="DreamZero config")
    head = data.get("action_head_cfg") if isinstance(data, dict) else None
    target = head.get("_target_") if isinstance(head, dict) else None
    if target not in HEAD_TARGETS:
        raise CheckpointError(f"{config_path}: action_head_cfg._target_ is {str(target)[:120]!r}, not a DreamZero "
                              f"WANPolicyHead (one of {', '.join(HEAD_TARGETS)})")
    head_config = head.get("config")
    dit = head_config.get("diffusion_model_cfg") if isinstance(head_config, dict) else None
    if not isinstance(dit, dict):
        raise CheckpointError(f"{config_path} has no action_head_cfg.config.diffusion_model_cfg object")
    if dit.get("_target_", _DIT_TARGET) != _DIT_TARGET:
        raise CheckpointError(f"{config_path}: diffusion_model_cfg._target_ is {str(dit.get('_target_'))[:120]!r}, "
                              f"not {_DIT_TARGET}")
    return {"dit": dit, "head": head_config}


def _lora_scale(path: Path, head: dict[str, Any]) -> float:
    alpha, rank = head.get("lora_alpha"), head.get("lora_rank")
    for name, value in (("lora_alpha", alpha), ("lora_rank", rank)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{path}: the checkpoint holds LoRA factors but action_head_cfg.config.{name} is "
                                  f"{str(value)[:60]!r}, not a positive number")
    return float(alpha) / float(rank)


def _latent_size(path: Path, tokens: int, channels: int, latent_size: tuple[int, int] | None) -> tuple[int, int]:
    if latent_size is not None:
        h, w = latent_size
        if (h // 2) * (w // 2) != tokens or h % 2 or w % 2:
            raise CheckpointError(f"{path}: latent_size {latent_size} gives {(h // 2) * (w // 2)} tokens per frame, "
                                  f"config.json's frame_seqlen is {tokens}")
        return int(h), int(w)
    for name, make in DIT_PRESETS.items():
        preset = make()
        if preset.action_register is not None and preset.tokens_per_frame == tokens \
                and preset.latent_channels == channels:
            return preset.latent_height, preset.latent_width
    raise CheckpointError(f"{path}: frame_seqlen {tokens} with {channels} latent channels matches no DreamZero "
                          "preset's latent size; pass latent_size=(height, width)")


def _build_config(path: Path, meta: dict[str, Any], hidden_size: int, dtype: str | None,
                  latent_size: tuple[int, int] | None) -> CausalDiTConfig:
    dit = meta["dit"]
    where = "diffusion_model_cfg"
    ints = {name: _int(path, where, name, _field(dit, path, where, name)) for name in (
        "dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim", "freq_dim", "text_len", "text_dim",
        "frame_seqlen", "num_frame_per_block", "num_action_per_block", "num_state_per_block", "action_dim",
        "max_state_dim")}
    chunks = _int(path, where, "max_chunk_size", _field(dit, path, where, "max_chunk_size"), allow_negative_one=True)
    if chunks == -1:
        raise CheckpointError(f"{path}: {where}.max_chunk_size is -1 (global attention); DreamZero's released "
                              "configs bound the window (4 chunks)")
    model_type = _field(dit, path, where, "model_type")
    if model_type not in ("i2v", "ti2v"):
        raise CheckpointError(f"{path}: {where}.model_type is {str(model_type)[:40]!r}; DreamZero runs 'i2v' "
                              "(Wan2.1-I2V) or 'ti2v' (Wan2.2-TI2V) transformers")
    if list(_field(dit, path, where, "patch_size")) != [1, 2, 2]:
        raise CheckpointError(f"{path}: {where}.patch_size must be [1, 2, 2]")
    eps = _field(dit, path, where, "eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise CheckpointError(f"{path}: {where}.eps must be a positive finite number, got {str(eps)[:40]!r}")
    concat = _field(dit, path, where, "concat_first_frame_latent")
    if not isinstance(concat, bool):
        raise CheckpointError(f"{path}: {where}.concat_first_frame_latent must be true or false")
    channels = ints["out_dim"]
    # With the first-frame concat the patch embedding reads [x (C), mask (4), image latent (C)].
    want_in = 2 * channels + 4 if concat else channels
    if ints["in_dim"] != want_in:
        raise CheckpointError(f"{path}: {where}.in_dim is {ints['in_dim']}, expected {want_in} for out_dim {channels} "
                              f"with concat_first_frame_latent={concat}")
    if ints["dim"] % ints["num_heads"]:
        raise CheckpointError(f"{path}: {where}.dim {ints['dim']} is not a multiple of num_heads {ints['num_heads']}")
    height, width = _latent_size(path, ints["frame_seqlen"], channels, latent_size)
    fpb = ints["num_frame_per_block"]
    register = ActionRegisterConfig(action_dim=ints["action_dim"], state_dim=ints["max_state_dim"],
                                    actions_per_block=ints["num_action_per_block"],
                                    states_per_block=ints["num_state_per_block"], hidden_size=hidden_size)
    if register.actions_per_block % register.states_per_block:
        raise CheckpointError(f"{path}: num_action_per_block must be a multiple of num_state_per_block")
    name = "custom"
    for preset_name, make in DIT_PRESETS.items():
        preset = make()
        if preset.action_register is not None and (preset.num_layers, preset.dim, preset.num_heads, preset.ffn_dim,
                                                   preset.latent_channels, preset.tokens_per_frame,
                                                   preset.action_register) == (
                ints["num_layers"], ints["dim"], ints["num_heads"], ints["ffn_dim"], channels, ints["frame_seqlen"],
                register):
            name = preset_name
    storage = dtype or "bfloat16"
    return CausalDiTConfig(
        name=name, num_layers=ints["num_layers"], dim=ints["dim"], num_heads=ints["num_heads"],
        ffn_dim=ints["ffn_dim"], latent_channels=channels, latent_height=height, latent_width=width,
        text_len=ints["text_len"], text_dim=ints["text_dim"], image_len=257, image_dim=1280, frames_per_block=fpb,
        # The release's local_attn_size: max_chunk_size blocks plus the conditioning frame.
        window_frames=chunks * fpb + 1, sink_frames=0, input_channels=ints["in_dim"] if concat else 0,
        action_register=register, freq_dim=ints["freq_dim"], eps=float(eps), dtype=storage, param_dtype=storage)


@dataclasses.dataclass(frozen=True)
class _Opened:
    ckpt: _Checkpoint
    meta: dict[str, Any]
    lora: dict[str, tuple[Any, Any]]  # our (Wan) name of the base weight -> (lora_A tensor, lora_B tensor)
    skipped: tuple[str, ...]


def _open(path: Path, max_tensors: int) -> _Opened:
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"DreamZero checkpoint {path} does not exist")
        raise CheckpointError(f"{path} is not a directory: a DreamZero checkpoint is a save_pretrained directory "
                              "(config.json and model.safetensors[.index.json])")
    meta = _transformer_json(path)
    stored = _read_weights_dir(path, weights=_WEIGHTS, index=_INDEX, max_tensors=max_tensors)
    tensors: dict[str, Any] = {}
    factors: dict[str, dict[str, Any]] = {}
    skipped = []
    for key, tensor in stored.items():
        if not key.startswith(DIT_PREFIX):
            skipped.append(key)
            continue
        name = key[len(DIT_PREFIX):].replace(".base_layer.", ".")
        if name.startswith(_LORA_WRAPPER):
            name = name[len(_LORA_WRAPPER):]
        match = _LORA_KEY.fullmatch(name)
        if match:
            factors.setdefault(f"{match['module']}.weight", {})[match["ab"]] = tensor
            continue
        if name in tensors:
            raise CheckpointError(f"{path}: tensors {tensors[name].stored} and {key} both give {name}")
        tensors[name] = tensor
    lora = {}
    for base, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"{path}: the LoRA of {base} has lora_{''.join(pair)} without its partner")
        lora[base] = (pair["A"], pair["B"])
    return _Opened(_Checkpoint(path, "dreamzero", tensors, None), meta, lora, tuple(sorted(skipped)))


def _hidden_size(opened: _Opened) -> int:
    tensor = opened.ckpt.tensors.get("state_encoder.layer1.W")
    if tensor is None or len(tensor.shape) != 3:
        raise CheckpointError(f"{opened.ckpt.path}: the transformer's state_encoder.layer1.W "
                              f"({DIT_PREFIX}state_encoder.layer1.W) is missing or not [categories, in, out]; "
                              "it gives the register width")
    return int(tensor.shape[2])


def _check_config(path: Path, given: CausalDiTConfig, built: CausalDiTConfig) -> CausalDiTConfig:
    """``given`` (a preset or config) when it is the network the checkpoint holds, else CheckpointError."""
    fields = ("num_layers", "dim", "num_heads", "ffn_dim", "latent_channels", "tokens_per_frame", "in_channels",
              "frames_per_block", "window_frames", "text_len", "text_dim", "image_dim", "action_register", "freq_dim")
    wrong = [f"{f}: given {getattr(given, f)}, the checkpoint's {getattr(built, f)}" for f in fields
             if getattr(given, f) != getattr(built, f)]
    if wrong:
        raise CheckpointError(f"{path} does not hold the network of config {given.name!r}: " + "; ".join(wrong))
    return given


def _resolve(opened: _Opened, config: CausalDiTConfig | str | None, dtype: Any,
             latent_size: tuple[int, int] | None) -> CausalDiTConfig:
    path = opened.ckpt.path
    dtype_name = None if dtype is None else float_dtype_name(dtype)
    if isinstance(config, str):
        config = dit_preset(config)
    if config is not None and not isinstance(config, CausalDiTConfig):
        raise TypeError(f"config must be a CausalDiTConfig, a preset name or None, got {type(config).__name__}")
    if config is not None and latent_size is None:
        latent_size = (config.latent_height, config.latent_width)
    built = _build_config(path, opened.meta, _hidden_size(opened), dtype_name, latent_size)
    if config is not None:
        built = _check_config(path, config, built)
    if dtype_name is not None:
        built = built.replace(dtype=dtype_name, param_dtype=dtype_name)
    elif config is None and built.name != "custom":
        preset = dit_preset(built.name)
        built = built.replace(dtype=preset.dtype, param_dtype=preset.param_dtype)
    return built


def _expected_tensors(config: CausalDiTConfig | str | None) -> int:
    try:
        config = dit_preset(config) if isinstance(config, str) else config
        if isinstance(config, CausalDiTConfig):
            return len(wan_names(config)) + _ENCODER_TENSORS
    except (KeyError, ValueError, TypeError):
        pass
    return MAX_EXPECTED_TENSORS + _ENCODER_TENSORS


def _loras(opened: _Opened, expected: dict[str, tuple[int, ...]]) -> dict[str, _Lora]:
    if not opened.lora:
        return {}
    path = opened.ckpt.path
    scale = _lora_scale(path, opened.meta["head"])
    loras = {}
    for base, (a, b) in opened.lora.items():
        if base not in expected or len(expected[base]) != 2:
            raise CheckpointError(f"{path}: a LoRA targets {base}, which is not a linear weight of the transformer")
        out_dim, in_dim = expected[base]
        rank = a.shape[0] if len(a.shape) == 2 else -1
        if rank < 1 or tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
            raise CheckpointError(f"{path}: the LoRA of {base} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                                  f"[r, {in_dim}] and [{out_dim}, r] are needed")
        loras[base] = _Lora(a, b, scale)
    return loras


def dreamzero_checkpoint_config(path: str | os.PathLike[str], *, latent_size: tuple[int, int] | None = None
                                ) -> CausalDiTConfig:
    """The :class:`CausalDiTConfig` :func:`load_dreamzero` builds for ``path`` (headers and config.json only)."""
    with as_checkpoint_error():
        opened = _open(Path(path), MAX_EXPECTED_TENSORS + _ENCODER_TENSORS)
    return _resolve(opened, None, None, latent_size)


def load_dreamzero(
    path: str | os.PathLike[str],
    config: CausalDiTConfig | str | None = None,
    *,
    dtype: Any = None,
    latent_size: tuple[int, int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool | None = None,
) -> tuple[CausalDiT, DreamZeroCheckpoint]:
    """DreamZero's transformer from a release checkpoint directory, and what was read.

    Args:
      path: the ``save_pretrained`` directory (``config.json``, ``model.safetensors.index.json`` and
        its shards, or ``model.safetensors``).
      config: a :class:`CausalDiTConfig` or preset name (``"dreamzero-droid"``, ``"dreamzero-wan22-5b"``,
        ``"dreamzero-tiny"``) that must be the checkpoint's network; None: built from config.json and the
        weights (a matching preset's name, latent size and dtype).
      dtype: parameter and activation dtype (None: the config's; bf16 for the released geometries).
      latent_size: ``(height, width)`` of a latent frame when no preset has the checkpoint's
        ``frame_seqlen`` (its tokens per frame).
      mesh: parameters placed split over its ``"tp"`` axis, as :func:`~ardiff_jax.models.wan.load_checkpoint`.
      progress: a tqdm bar over the bytes read (None: for checkpoints over 256 MiB).

    Raises:
      CheckpointError: (a ValueError) a config.json that is not DreamZero's or holds a bad value, a
        missing, unexpected, mis-shaped or non-float transformer tensor, a truncated or corrupt shard,
        a shard missing from its index, a LoRA factor without its partner or of the wrong shape; the
        message names the file and the tensor or field. Nothing is placed on a device before every
        check passed.
    """
    path = Path(path)
    with as_checkpoint_error():
        opened = _open(path, _expected_tensors(config))
    config = _resolve(opened, config, dtype, latent_size)
    expected = wan_names(config)
    _check_tensors(opened.ckpt, expected)
    loras = _loras(opened, expected)
    if opened.skipped:
        _log.info("%s: %d tensors outside the transformer not read (%s)", path, len(opened.skipped),
                  shown_names(opened.skipped, 3))
    model = build_checked_model(opened.ckpt, config, loras, mesh=mesh, progress=progress)
    return model, DreamZeroCheckpoint(config, opened.skipped, tuple(sorted(loras)))

