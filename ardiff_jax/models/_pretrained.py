"""Shipped weights: ``pretrained("sprite_world")`` and the weight-file format behind it.

A weight file is a plain ``.npz`` of float arrays, one entry per parameter named by its
path in :class:`~ardiff_jax.models.DiTModules` (``transformer/blocks/self_attn/q/kernel``),
read with ``allow_pickle=False`` so loading never runs code, plus a JSON sidecar: the
``CausalDiTConfig`` it was trained for, how to sample it (schedule, prediction, decoder),
how it was trained (command, seed, steps, wall time, final loss) and a SHA-256 digest over
the ``.npz`` bytes **and** the rest of the sidecar, so an edit of either (a config field
that keeps every parameter's shape, such as ``num_heads`` or the prediction) is refused.
Loading checks the digest, the config and every parameter's name, shape and dtype before
building anything; a missing, truncated or malformed sidecar is an error naming the file.

``ardiff-jax train`` writes both files (``--export``); the shipped ones live in
``ardiff_jax/models/weights/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from ardiff_jax._files import read_json_file
from ardiff_jax.models._common import DiTModules, FewStepSchedule
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._sprite import SpriteWorldPipeline, SpriteWorldPipelineConfig

__all__ = ["PRETRAINED_MODELS", "pretrained", "pretrained_metadata", "save_weights", "load_weights",
           "WEIGHTS_FORMAT_VERSION"]

WEIGHTS_FORMAT_VERSION = 2
_WEIGHTS_DIR = Path(__file__).with_name("weights")
#: Names ``pretrained`` accepts, with the weight file each loads (``<name>.npz`` + ``<name>.json``).
PRETRAINED_MODELS = ("sprite_world",)


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:  # pragma: no cover - jax adds no other key kinds for nnx state
            parts.append(str(entry))
    return "/".join(parts)


def _named_params(params: Any) -> dict[str, Any]:
    return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _digest(npz_bytes: bytes, sidecar: dict[str, Any]) -> str:
    """SHA-256 over the arrays file and every sidecar field but the digest itself (canonical JSON)."""
    fields = {key: value for key, value in sidecar.items() if key != "sha256"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(hashlib.sha256(npz_bytes).digest() + canonical).hexdigest()


def save_weights(modules: DiTModules, path: str | Path, metadata: dict[str, Any] | None = None, *,
                 sampling: dict[str, Any] | None = None) -> Path:
    """Write ``modules``' parameters to ``path`` (``.npz``) and the JSON sidecar next to it.

    ``metadata`` (JSON-serialisable) is stored under ``"training"``; ``sampling`` (e.g.
    ``{"schedule": [1000.0], "prediction": "delta", "decoder": "cells"}``) under
    ``"sampling"``, where :func:`pretrained` reads it. The config, format version and
    digest are added here. Returns the ``.npz`` path.
    """
    path = Path(path).with_suffix(".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(jax.device_get(leaf)) for name, leaf in _named_params(nnx.split(modules)[1]).items()}
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    sidecar = {
        "format_version": WEIGHTS_FORMAT_VERSION,
        "config": dataclasses.asdict(modules.transformer.config),
        "num_params": int(sum(a.size for a in arrays.values())),
        "sampling": sampling or {},
        "training": metadata or {},
    }
    sidecar["sha256"] = _digest(path.read_bytes(), sidecar)
    path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return path


def _read_sidecar(path: Path) -> dict[str, Any]:
    """The sidecar of ``path``, its digest checked against the arrays file and itself."""
    sidecar_path = path.with_suffix(".json")
    try:  # a regular file of at most a few MB of UTF-8 JSON (a diverged loss may be NaN); failures name it
        sidecar = read_json_file(sidecar_path, error=ValueError, what="weights sidecar", allow_nan=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"weight file {path} has no JSON sidecar {sidecar_path}") from None
    if not isinstance(sidecar, dict):
        raise ValueError(f"{sidecar_path} is not a valid weights sidecar (a JSON object is expected)")
    if sidecar.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise ValueError(f"{sidecar_path} has format_version {sidecar.get('format_version')!r}; this "
                         f"ardiff_jax reads version {WEIGHTS_FORMAT_VERSION}")
    for key, kind in (("config", dict), ("sampling", dict), ("training", dict), ("sha256", str)):
        if not isinstance(sidecar.get(key), kind):
            raise ValueError(f"{sidecar_path} is not a valid weights sidecar: {key!r} must be a JSON "
                             f"{'object' if kind is dict else 'string'}")
    try:
        npz_bytes = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"weights sidecar {sidecar_path} has no arrays file {path}") from None
    if _digest(npz_bytes, sidecar) != sidecar["sha256"]:
        raise ValueError(f"{path} and its sidecar {sidecar_path} do not match their SHA-256 digest "
                         "(an edited, corrupt or replaced file)")
    return sidecar


def _with_field_defaults(stored: Any) -> Any:
    """A stored config with the defaults of the fields added to ``CausalDiTConfig`` since it was written.

    A field added later defaults to what models had before it existed, so weights written then
    describe the same model; any field the file does state must still match exactly.
    """
    if not isinstance(stored, dict):
        return stored
    filled = dict(stored)
    for field in dataclasses.fields(CausalDiTConfig):
        if field.name not in filled and field.default is not dataclasses.MISSING:
            default = field.default
            filled[field.name] = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
    return filled


def load_weights(config: CausalDiTConfig, path: str | Path) -> DiTModules:
    """:class:`DiTModules` of ``config`` with the parameters stored at ``path`` (validated first)."""
    path = Path(path).with_suffix(".npz")
    sidecar = _read_sidecar(path)
    stored = _with_field_defaults(sidecar.get("config"))
    if stored != dataclasses.asdict(config):
        diff = sorted(k for k in set(stored or {}) | set(dataclasses.asdict(config))
                      if (stored or {}).get(k) != dataclasses.asdict(config).get(k))
        raise ValueError(f"{path} was trained for another CausalDiTConfig (differs in {', '.join(diff)})")
    abstract = nnx.eval_shape(lambda: DiTModules(config, 0))
    graphdef, shapes = nnx.split(abstract)
    expected = _named_params(shapes)
    with np.load(path, allow_pickle=False) as data:
        names = set(data.files)
        if names != set(expected):
            missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
            raise ValueError(f"{path} parameters do not match the model: missing {missing}, unexpected {extra}")
        arrays = {}
        for name, spec in expected.items():
            array = data[name]
            if array.shape != spec.shape or array.dtype != spec.dtype:
                raise ValueError(f"{path} parameter {name} is {array.dtype}{list(array.shape)}, the model needs "
                                 f"{spec.dtype}{list(spec.shape)}")
            if not np.isfinite(array).all():
                raise ValueError(f"{path} parameter {name} is not finite")
            arrays[name] = array
    leaves = [arrays[_path_name(p)] for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), leaves)
    return nnx.merge(graphdef, params)


def _weights_path(name: str) -> Path:
    if name not in PRETRAINED_MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; choose from {list(PRETRAINED_MODELS)}")
    return _WEIGHTS_DIR / f"{name}.npz"


def _chosen_weights(name: str, weights: str | Path | None) -> Path:
    """The shipped file of ``name``, or ``weights`` (a ``train --export`` file) when given."""
    path = _weights_path(name)  # the name is checked either way: it chooses the pipeline
    if weights is None:
        return path
    path = Path(weights).with_suffix(".npz")
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist (train --export writes an .npz and a .json)")
    return path


def pretrained_metadata(name: str = "sprite_world", *, weights: str | Path | None = None) -> dict[str, Any]:
    """The shipped model's sidecar (or that of ``weights``, a ``train --export`` file): config,
    sampling, training command, seed, steps, wall time, loss."""
    return _read_sidecar(_chosen_weights(name, weights))


def pretrained(name: str = "sprite_world", *, session_capacity: int = 4, noise_seed: int = 0,
               device: jax.Device | None = None, weights: str | Path | None = None) -> SpriteWorldPipeline:
    """A ready :class:`SpriteWorldPipeline` with the shipped weights (drive it with ``ARDiffusionEngine``).

    ``weights``: a ``train --export`` file (``.npz`` with its ``.json`` sidecar) to load instead
    of the shipped one, with the config and sampling its sidecar states, validated as the
    shipped file is: to play or score a model of your own exactly as the shipped one is.

    Example::

        engine = ARDiffusionEngine(pretrained("sprite_world"), EngineConfig(available_memory_bytes=2**28))
        world = SpriteWorld(seed=3)
        out = engine.generate(DiffusionRequest("r0", extra_args={"session_id": "p1"},
                                               inputs={"observation": world.reset(), "actions": [4]}))
        out.frames  # u8[1, 32, 32, 3]
    """
    path = _chosen_weights(name, weights)
    sidecar = _read_sidecar(path)
    try:
        config = CausalDiTConfig(**sidecar["config"])
        sampling = sidecar["sampling"]
        pipeline_config = SpriteWorldPipelineConfig(
            session_capacity=session_capacity, noise_seed=noise_seed,
            schedule=FewStepSchedule(tuple(sampling["schedule"])), prediction=sampling["prediction"],
            decoder=sampling["decoder"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path.with_suffix('.json')} does not describe a SpriteWorld model: {error}") from None
    return SpriteWorldPipeline(config, pipeline_config, modules=load_weights(config, path), device=device)
