"""Shipped weights: ``pretrained("sprite_world")`` and the weight-file format behind it.

A weight file is a plain ``.npz`` of float arrays, one entry per parameter named by its
path in :class:`~ardiff_jax.models.DiTModules` (``transformer/blocks/self_attn/q/kernel``),
read with ``allow_pickle=False`` so loading never runs code, plus a JSON sidecar: the
``CausalDiTConfig`` it was trained for, the sampling schedule, how it was trained (command,
seed, steps, wall time, final loss) and the SHA-256 of the ``.npz``. Loading checks the
digest, the config and every parameter's name, shape and dtype before building anything.

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

from ardiff_jax.models._common import DiTModules, FewStepSchedule
from ardiff_jax.models._config import CausalDiTConfig
from ardiff_jax.models._sprite import SpriteWorldPipeline, SpriteWorldPipelineConfig

__all__ = ["PRETRAINED_MODELS", "pretrained", "pretrained_metadata", "save_weights", "load_weights",
           "WEIGHTS_FORMAT_VERSION"]

WEIGHTS_FORMAT_VERSION = 1
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


def save_weights(modules: DiTModules, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``modules``' parameters to ``path`` (``.npz``) and the JSON sidecar next to it.

    ``metadata`` (JSON-serialisable) is stored under ``"training"``; the config, format
    version and digest are added here. Returns the ``.npz`` path.
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
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "training": metadata or {},
    }
    path.with_suffix(".json").write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
    return path


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        sidecar = json.loads(path.with_suffix(".json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"weight file {path} has no JSON sidecar {path.with_suffix('.json')}") from None
    if sidecar.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise ValueError(f"{path.with_suffix('.json')} has format_version {sidecar.get('format_version')!r}; this "
                         f"ardiff_jax reads version {WEIGHTS_FORMAT_VERSION}")
    return sidecar


def load_weights(config: CausalDiTConfig, path: str | Path) -> DiTModules:
    """:class:`DiTModules` of ``config`` with the parameters stored at ``path`` (validated first)."""
    path = Path(path).with_suffix(".npz")
    sidecar = _read_sidecar(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sidecar.get("sha256"):
        raise ValueError(f"{path} does not match the SHA-256 in its sidecar (corrupt or replaced file)")
    stored = sidecar.get("config")
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


def pretrained_metadata(name: str = "sprite_world") -> dict[str, Any]:
    """The shipped model's sidecar: config, schedule, training command, seed, steps, wall time, loss."""
    return _read_sidecar(_weights_path(name))


def pretrained(name: str = "sprite_world", *, session_capacity: int = 4, noise_seed: int = 0,
               device: jax.Device | None = None) -> SpriteWorldPipeline:
    """A ready :class:`SpriteWorldPipeline` with the shipped weights (drive it with ``ARDiffusionEngine``).

    Example::

        engine = ARDiffusionEngine(pretrained("sprite_world"), EngineConfig(available_memory_bytes=2**28))
        world = SpriteWorld(seed=3)
        out = engine.generate(DiffusionRequest("r0", extra_args={"session_id": "p1"},
                                               inputs={"observation": world.reset(), "actions": [4]}))
        out.frames  # u8[1, 32, 32, 3]
    """
    path = _weights_path(name)
    sidecar = _read_sidecar(path)
    config = CausalDiTConfig(**sidecar["config"])
    training = sidecar.get("training", {})
    schedule = training.get("schedule")
    prediction = training.get("train_config", {}).get("prediction", "flow")
    pipeline_config = SpriteWorldPipelineConfig(
        session_capacity=session_capacity, noise_seed=noise_seed, prediction=prediction,
        **({} if schedule is None else {"schedule": FewStepSchedule(tuple(schedule))}))
    return SpriteWorldPipeline(config, pipeline_config, modules=load_weights(config, path), device=device)
