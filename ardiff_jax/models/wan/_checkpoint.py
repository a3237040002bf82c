"""Load published causal-Wan checkpoints into :class:`~ardiff_jax.models.CausalDiT`.

Formats (detected from the path; ``format=`` overrides):

* ``"wan"``: the original Wan 2.1/2.2 directory: ``config.json`` (``_class_name: WanModel``
  or the Wan fields ``dim, ffn_dim, num_heads, num_layers, in_dim, out_dim, ...``) and
  ``diffusion_pytorch_model.safetensors``, or shards listed by
  ``diffusion_pytorch_model.safetensors.index.json``.
* ``"diffusers"``: a ``WanTransformer3DModel`` directory (or the pipeline root with a
  ``transformer/`` subfolder), sharded or not. Its names are a pure 1:1 rename of Wan's.
* ``"pt"``: a Self-Forcing / LongLive ``torch.save`` training checkpoint, a dict holding
  ``generator_ema`` / ``generator`` / ``critic`` / ``model`` (``checkpoint_key`` picks; by
  default ``generator_ema``, then ``generator``, then ``model``), keys prefixed ``model.``
  and possibly wrapped by FSDP (``_fsdp_wrapped_module.``, stripped). Read with torch's
  safe unpickler (``weights_only=True``, memory-mapped); only for a ``.pt``/``.pth`` path or
  ``format="pt"``. torch is the optional extra ``ardiff_jax[torch]``.
* ``"safetensors"``: one ``.safetensors`` file with Wan's names, with or without a
  ``model.`` prefix (Krea realtime ships ``model.``-prefixed keys).

Matrix-Game 2.0 (SkyworkAI) loads through the same formats: the release's ``model.``-prefixed
``.safetensors`` (``"safetensors"``) and FastVideo's diffusers directory (``"diffusers"``,
``config.json`` with ``image_dim`` and ``action_config``): its ``img_emb.proj.*`` MLPProj
replaces ``text_embedding.*`` and ``blocks.{i}.action_model.*`` fill the action modules of
the first blocks (``ardiff_jax.models.matrix_game``).

Every tensor maps to exactly one parameter of our model and every parameter is filled by
exactly one tensor (asserted on every load): ``nnx.state(model, nnx.Param)`` has the 27
per-layer tensors of Wan's blocks stacked ``[L, ...]`` plus 15 top-level ones, nn.Linear
weights are transposed (``[out, in]`` -> ``[in, out]``), the patch Conv3d becomes a linear
map over ``(c, ph, pw)``, and the head's output features are permuted from Wan's
``(ph, pw, c)`` order (c fastest) to our ``(c, ph, pw)``.

Everything is checked before anything is read: names (missing / unexpected), shapes,
dtypes, the config against the tensors and against ``config.json``, the LoRA's targets
and shapes. Then each parameter is built on the host in its final dtype, one stacked
``[L, ...]`` array at a time, and put on device (split over ``mesh`` by the model's own
partition annotations), so host memory peaks near one stacked parameter and no device
ever receives a full copy of a split parameter.

What a file can make the loader allocate is bounded by the file, before anything is
allocated: a ``.pt`` tensor must be a plain view of bytes the file stores (stride-0
``expand``-ed or self-overlapping views are refused, and one state dict's tensors may span
at most twice the file), a safetensors header at most a few KB per tensor the loader
expects (:func:`~ardiff_jax._checkpoint_files.header_budget`), and a network inferred
from the tensors no more blocks than the tensors can fill. Side files (config.json, shard
indexes, adapter_config.json) are read by :func:`ardiff_jax._files.read_json_file`: regular
files only (a FIFO, a device or a directory is refused without being read), a few MB at
most, no NaN/Infinity, bounded nesting; every config.json number is checked (integers
positive and not bools, ``eps`` finite and positive); a shard index may only name files of
its own directory; and no error message quotes a file's bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._files import read_json_file
from ardiff_jax.models._common import mesh_placement
from ardiff_jax.models._config import CausalDiTConfig, dit_preset
from ardiff_jax.models._pretrained import _path_name as weight_file_name
from ardiff_jax.models._dit import CausalDiT
# The model-independent file readers; the underscore aliases are the names this package's loaders use.
from ardiff_jax._checkpoint_files import (
    MAX_EXPECTED_TENSORS,
    CheckpointError,
    SafetensorsFile,
    StoredTensor as _Tensor,
    as_checkpoint_error as _as_checkpoint_error,
    header_budget,
    import_torch as _torch,
    safetensors_tensors as _safetensors_tensors,
    shown_names as _names,
    tensor_dict as _tensor_dict,
    torch_load as _torch_load,
    torch_tensors as _torch_tensors,
)

__all__ = ["CHECKPOINT_FORMATS", "CheckpointError", "checkpoint_config", "load_checkpoint", "wan_names"]

#: The checkpoint formats :func:`load_checkpoint` reads.
CHECKPOINT_FORMATS = ("wan", "diffusers", "pt", "safetensors")

#: The published networks a checkpoint without a config is matched against (by geometry).
_PUBLISHED = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b")

#: Keys of a training checkpoint that hold a generator's state dict, in the default order.
_PT_KEYS = ("generator_ema", "generator", "model")

#: Checkpoints over this many bytes show a progress bar when ``progress`` is None.
_PROGRESS_BYTES = 256 * 2**20

_WEIGHTS = "diffusion_pytorch_model.safetensors"
_INDEX = "diffusion_pytorch_model.safetensors.index.json"


# -- the name mapping: our parameters <-> Wan's state dict ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter of ours and the Wan tensor it comes from (``{i}``: the block index)."""

    path: str  # our flat parameter path, e.g. "blocks.self_attn.q.kernel"
    source: str  # Wan's name, e.g. "blocks.{i}.self_attn.q.weight"
    kind: str  # "linear" (transpose), "copy", "conv", "squeeze" (drop a leading 1), "head_weight", "head_bias"

    @property
    def per_layer(self) -> bool:
        return self.source.startswith("blocks.")


def _linear_entries(ours: str, theirs: str) -> list[_Entry]:
    return [_Entry(f"{ours}.kernel", f"{theirs}.weight", "linear"), _Entry(f"{ours}.bias", f"{theirs}.bias", "copy")]


def _mapping() -> list[_Entry]:
    top = [_Entry("patch_embedding.kernel", "patch_embedding.weight", "conv"),
           _Entry("patch_embedding.bias", "patch_embedding.bias", "copy")]
    for ours, theirs in (("text_in", "text_embedding.0"), ("text_out", "text_embedding.2"),
                         ("time_in", "time_embedding.0"), ("time_out", "time_embedding.2"),
                         ("time_projection", "time_projection.1")):
        top += _linear_entries(ours, theirs)
    top += [_Entry("head_modulation", "head.modulation", "squeeze"),
            _Entry("head.kernel", "head.head.weight", "head_weight"),
            _Entry("head.bias", "head.head.bias", "head_bias")]
    block = []
    for attn in ("self_attn", "cross_attn"):
        for proj in ("q", "k", "v", "o"):
            block += _linear_entries(f"blocks.{attn}.{proj}", f"blocks.{{i}}.{attn}.{proj}")
        for norm in ("norm_q", "norm_k"):
            block.append(_Entry(f"blocks.{attn}.{norm}.weight", f"blocks.{{i}}.{attn}.{norm}.weight", "copy"))
    block += [_Entry("blocks.norm3.scale", "blocks.{i}.norm3.weight", "copy"),
              _Entry("blocks.norm3.bias", "blocks.{i}.norm3.bias", "copy")]
    block += _linear_entries("blocks.ffn_in", "blocks.{i}.ffn.0")
    block += _linear_entries("blocks.ffn_out", "blocks.{i}.ffn.2")
    block.append(_Entry("blocks.modulation", "blocks.{i}.modulation", "squeeze"))
    assert len(top) == 15 and len(block) == 27
    return top + block


_MAPPING = _mapping()
_BY_PATH = {entry.path: entry for entry in _MAPPING}

#: Matrix-Game 2.0's action module (``blocks.{i}.action_model.*``, ``i < action.num_blocks``): ours <- release.
_ACTION_LINEAR = (("keyboard_embed_in", "keyboard_embed.0", True), ("keyboard_embed_out", "keyboard_embed.2", True),
                  ("keyboard_q", "mouse_attn_q", False), ("keyboard_kv", "keyboard_attn_kv", False),
                  ("keyboard_proj", "proj_keyboard", False))
_MOUSE_LINEAR = (("mouse_mlp_in", "mouse_mlp.0", True), ("mouse_mlp_out", "mouse_mlp.2", True),
                 ("mouse_qkv", "t_qkv", False), ("mouse_proj", "proj_mouse", False))


def _action_entries(mouse: bool) -> list[_Entry]:
    entries = []
    linears = _ACTION_LINEAR + (_MOUSE_LINEAR if mouse else ())
    norms = [("keyboard_q_norm", "key_attn_q_norm"), ("keyboard_k_norm", "key_attn_k_norm")]
    if mouse:
        norms += [("mouse_q_norm", "img_attn_q_norm"), ("mouse_k_norm", "img_attn_k_norm")]
    for ours, theirs, bias in linears:
        entries.append(_Entry(f"action_blocks.{ours}.kernel", f"blocks.{{i}}.action_model.{theirs}.weight", "linear"))
        if bias:
            entries.append(_Entry(f"action_blocks.{ours}.bias", f"blocks.{{i}}.action_model.{theirs}.bias", "copy"))
    for ours, theirs in norms:
        entries.append(_Entry(f"action_blocks.{ours}.weight", f"blocks.{{i}}.action_model.{theirs}.weight", "copy"))
    if mouse:
        entries += [_Entry("action_blocks.mouse_mlp_norm.scale", "blocks.{i}.action_model.mouse_mlp.3.weight", "copy"),
                    _Entry("action_blocks.mouse_mlp_norm.bias", "blocks.{i}.action_model.mouse_mlp.3.bias", "copy")]
    return entries


def _i2v_entries() -> list[_Entry]:
    """Wan I2V's image branch over CLIP tokens (DreamZero): ``img_emb`` MLPProj and each block's ``k_img``,
    ``v_img``, ``norm_k_img``."""
    return [_Entry("image_norm_in.scale", "img_emb.proj.0.weight", "copy"),
            _Entry("image_norm_in.bias", "img_emb.proj.0.bias", "copy"),
            *_linear_entries("image_in", "img_emb.proj.1"), *_linear_entries("image_out", "img_emb.proj.3"),
            _Entry("image_norm_out.scale", "img_emb.proj.4.weight", "copy"),
            _Entry("image_norm_out.bias", "img_emb.proj.4.bias", "copy"),
            *_linear_entries("blocks.cross_attn.k_img", "blocks.{i}.cross_attn.k_img"),
            *_linear_entries("blocks.cross_attn.v_img", "blocks.{i}.cross_attn.v_img"),
            _Entry("blocks.cross_attn.norm_k_img.weight", "blocks.{i}.cross_attn.norm_k_img.weight", "copy")]


#: DreamZero's action/state register: category-specific linears, ``W [categories, in, out]`` as stored.
_REGISTER_LINEARS = ("state_encoder.layer1", "state_encoder.layer2", "action_encoder.W1", "action_encoder.W2",
                     "action_encoder.W3", "action_decoder.layer1", "action_decoder.layer2")


def _register_entries() -> list[_Entry]:
    return [_Entry(f"{name}.{p}", f"{name}.{p}", "copy") for name in _REGISTER_LINEARS for p in ("W", "b")]


def _entries(config: CausalDiTConfig) -> list[_Entry]:
    """The mapping of ``config``'s network: Wan's, with Matrix-Game's image context (Wan I2V's ``img_emb``
    MLPProj instead of the text MLP) and action modules, or DreamZero's I2V image branch and action/state
    register, when the config has them."""
    if config.context_embedding == "text" and config.action is None and not config.image_dim \
            and config.action_register is None:
        return _MAPPING
    entries = list(_MAPPING)
    if config.context_embedding == "image":
        entries = [e for e in entries if not e.source.startswith("text_embedding.")]
        entries += [_Entry("context_norm_in.scale", "img_emb.proj.0.weight", "copy"),
                    _Entry("context_norm_in.bias", "img_emb.proj.0.bias", "copy"),
                    *_linear_entries("context_in", "img_emb.proj.1"), *_linear_entries("context_out", "img_emb.proj.3"),
                    _Entry("context_norm_out.scale", "img_emb.proj.4.weight", "copy"),
                    _Entry("context_norm_out.bias", "img_emb.proj.4.bias", "copy")]
    if config.action is not None:
        entries += _action_entries(bool(config.action.mouse_dim))
    if config.image_len and config.image_dim:
        entries += _i2v_entries()
    if config.action_register is not None:
        entries += _register_entries()
    return entries


def _by_path(config: CausalDiTConfig) -> dict[str, _Entry]:
    entries = _entries(config)
    return _BY_PATH if entries is _MAPPING else {entry.path: entry for entry in entries}


def _stack_size(entry: _Entry, config: CausalDiTConfig) -> int:
    """How many per-layer tensors fill ``entry``'s stacked parameter (action modules: the first blocks only)."""
    if ".action_model." in entry.source:
        assert config.action is not None
        return config.action.num_blocks
    return config.num_layers


def _source_shape(entry: _Entry, ours: tuple[int, ...], config: CausalDiTConfig) -> tuple[int, ...]:
    """The shape Wan stores for ``entry`` given our (per-layer) parameter shape."""
    p = config.patch_size
    if entry.kind in ("linear", "head_weight"):
        return (ours[1], ours[0])
    if entry.kind == "conv":
        return (config.dim, config.in_channels, 1, p, p)
    if entry.kind == "squeeze":
        return (1, *ours)
    return ours


def _transform(entry: _Entry, x: np.ndarray, config: CausalDiTConfig) -> np.ndarray:
    """Wan's layout of ``entry`` -> ours (a view where possible; no dtype change)."""
    p, c, dim = config.patch_size, config.latent_channels, config.dim
    if entry.kind == "linear":
        return x.T
    if entry.kind == "conv":  # [dim, C_in, 1, p, p] -> [C_in*p*p (c, ph, pw), dim]
        return x.reshape(dim, config.input_patch_dim).T
    if entry.kind == "squeeze":
        return x[0]
    if entry.kind == "head_weight":  # rows (ph, pw, c) with c fastest -> (c, ph, pw); then transpose
        return x.reshape(p, p, c, dim).transpose(2, 0, 1, 3).reshape(c * p * p, dim).T
    if entry.kind == "head_bias":
        return x.reshape(p, p, c).transpose(2, 0, 1).reshape(c * p * p)
    return x


def wan_names(config: CausalDiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of Wan's state dict for ``config`` and its shape (what a checkpoint must hold)."""
    shapes = _our_shapes(config)
    out: dict[str, tuple[int, ...]] = {}
    for entry in _entries(config):
        ours = shapes[entry.path]
        if entry.per_layer:
            per_layer = _source_shape(entry, ours[1:], config)
            for i in range(_stack_size(entry, config)):
                out[entry.source.format(i=i)] = per_layer
        else:
            out[entry.source] = _source_shape(entry, ours, config)
    return out


def _our_shapes(config: CausalDiTConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes, computed arithmetically (no model is built)."""
    d, f, L, p = config.dim, config.ffn_dim, config.num_layers, config.patch_dim
    shapes = {"patch_embedding.kernel": (config.input_patch_dim, d), "patch_embedding.bias": (d,),
              "text_in.kernel": (config.text_dim, d), "text_in.bias": (d,), "text_out.kernel": (d, d),
              "text_out.bias": (d,), "time_in.kernel": (config.freq_dim, d), "time_in.bias": (d,),
              "time_out.kernel": (d, d), "time_out.bias": (d,), "time_projection.kernel": (d, 6 * d),
              "time_projection.bias": (6 * d,), "head_modulation": (2, d), "head.kernel": (d, p), "head.bias": (p,),
              "blocks.norm3.scale": (L, d), "blocks.norm3.bias": (L, d), "blocks.modulation": (L, 6, d),
              "blocks.ffn_in.kernel": (L, d, f), "blocks.ffn_in.bias": (L, f),
              "blocks.ffn_out.kernel": (L, f, d), "blocks.ffn_out.bias": (L, d)}
    for attn in ("self_attn", "cross_attn"):
        for proj in ("q", "k", "v", "o"):
            shapes[f"blocks.{attn}.{proj}.kernel"] = (L, d, d)
            shapes[f"blocks.{attn}.{proj}.bias"] = (L, d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"blocks.{attn}.{norm}.weight"] = (L, d)
    if config.context_embedding == "image":
        c = config.text_dim
        shapes.update({"context_norm_in.scale": (c,), "context_norm_in.bias": (c,), "context_in.kernel": (c, c),
                       "context_in.bias": (c,), "context_out.kernel": (c, d), "context_out.bias": (d,),
                       "context_norm_out.scale": (d,), "context_norm_out.bias": (d,)})
    if config.image_len and config.image_dim:
        c = config.image_dim
        shapes.update({"image_norm_in.scale": (c,), "image_norm_in.bias": (c,), "image_in.kernel": (c, c),
                       "image_in.bias": (c,), "image_out.kernel": (c, d), "image_out.bias": (d,),
                       "image_norm_out.scale": (d,), "image_norm_out.bias": (d,),
                       "blocks.cross_attn.k_img.kernel": (L, d, d), "blocks.cross_attn.k_img.bias": (L, d),
                       "blocks.cross_attn.v_img.kernel": (L, d, d), "blocks.cross_attn.v_img.bias": (L, d),
                       "blocks.cross_attn.norm_k_img.weight": (L, d)})
    if config.action_register is not None:
        r = config.action_register
        widths = {"state_encoder.layer1": (r.state_dim, r.hidden_size), "state_encoder.layer2": (r.hidden_size, d),
                  "action_encoder.W1": (r.action_dim, d), "action_encoder.W2": (2 * d, d), "action_encoder.W3": (d, d),
                  "action_decoder.layer1": (d, r.hidden_size), "action_decoder.layer2": (r.hidden_size, r.action_dim)}
        for name, (din, dout) in widths.items():
            shapes[f"{name}.W"] = (r.categories, din, dout)
            shapes[f"{name}.b"] = (r.categories, dout)
    if config.action is not None:
        a = config.action
        n, kh, mh, e = a.num_blocks, a.keyboard_hidden_dim, a.mouse_hidden_dim, a.keyboard_embed_dim
        shapes.update({"action_blocks.keyboard_embed_in.kernel": (n, a.keyboard_dim, e),
                       "action_blocks.keyboard_embed_in.bias": (n, e),
                       "action_blocks.keyboard_embed_out.kernel": (n, e, e), "action_blocks.keyboard_embed_out.bias": (n, e),
                       "action_blocks.keyboard_q.kernel": (n, d, kh),
                       "action_blocks.keyboard_kv.kernel": (n, a.rows * e, 2 * kh),
                       "action_blocks.keyboard_proj.kernel": (n, kh, d),
                       "action_blocks.keyboard_q_norm.weight": (n, a.keyboard_head_dim),
                       "action_blocks.keyboard_k_norm.weight": (n, a.keyboard_head_dim)})
        if a.mouse_dim:
            shapes.update({"action_blocks.mouse_mlp_in.kernel": (n, a.rows * a.mouse_dim + d, mh),
                           "action_blocks.mouse_mlp_in.bias": (n, mh), "action_blocks.mouse_mlp_out.kernel": (n, mh, mh),
                           "action_blocks.mouse_mlp_out.bias": (n, mh), "action_blocks.mouse_mlp_norm.scale": (n, mh),
                           "action_blocks.mouse_mlp_norm.bias": (n, mh), "action_blocks.mouse_qkv.kernel": (n, mh, 3 * mh),
                           "action_blocks.mouse_proj.kernel": (n, mh, d),
                           "action_blocks.mouse_q_norm.weight": (n, a.mouse_head_dim),
                           "action_blocks.mouse_k_norm.weight": (n, a.mouse_head_dim)})
    return shapes


# -- diffusers names -> Wan names ---------------------------------------------------------------------

_DIFFUSERS_TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
    # Wan I2V / Matrix-Game's image MLPProj (FastVideo's conversion).
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
}
_DIFFUSERS_BLOCK = {"norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
for _theirs, _ours in (("attn1", "self_attn"), ("attn2", "cross_attn")):
    _DIFFUSERS_BLOCK.update({f"{_theirs}.to_q": f"{_ours}.q", f"{_theirs}.to_k": f"{_ours}.k",
                             f"{_theirs}.to_v": f"{_ours}.v", f"{_theirs}.to_out.0": f"{_ours}.o",
                             f"{_theirs}.norm_q": f"{_ours}.norm_q", f"{_theirs}.norm_k": f"{_ours}.norm_k"})
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")


def _diffusers_module(module: str) -> str | None:
    """A diffusers module name -> Wan's (``None``: no Wan counterpart)."""
    match = _BLOCK_NAME.fullmatch(module)
    if match:
        if match.group(2).startswith("action_model."):  # Matrix-Game's action modules keep their names
            return module
        rest = _DIFFUSERS_BLOCK.get(match.group(2))
        return None if rest is None else f"blocks.{match.group(1)}.{rest}"
    return _DIFFUSERS_TOP.get(module)


def _diffusers_name(name: str) -> str | None:
    """A diffusers parameter name -> Wan's (``None``: no Wan counterpart)."""
    if name == "scale_shift_table":
        return "head.modulation"
    match = _BLOCK_NAME.fullmatch(name)
    if match and match.group(2) == "scale_shift_table":
        return f"blocks.{match.group(1)}.modulation"
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    renamed = _diffusers_module(module)
    return None if renamed is None else f"{renamed}.{leaf}"


def _looks_diffusers(names: Iterable[str]) -> bool:
    return any(n.startswith(("condition_embedder.", "proj_out.")) or ".attn1." in n for n in names)


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _strip_prefixes(names: Iterable[str], prefixes: tuple[str, ...]) -> dict[str, str]:
    """Stored names -> cleaned ones: wrapper segments (FSDP, activation checkpointing, torch.compile)
    removed anywhere, then one of ``prefixes`` removed when every name carries it."""
    cleaned = {}
    for name in names:
        clean = name
        for wrapper in _WRAPPERS:
            clean = clean.replace(wrapper, "")
        cleaned[name] = clean
    for prefix in prefixes:
        if cleaned and all(c.startswith(prefix) for c in cleaned.values()):
            cleaned = {name: c[len(prefix):] for name, c in cleaned.items()}
            break
    return cleaned


# -- tensor sources ------------------------------------------------------------------------------------


def _shard_file(directory: Path, shard: Any, index: Path) -> Path:
    """The shard file ``shard`` of ``index`` names: a plain file name in ``directory`` that stays there.

    Refused: anything but a file name (separators, ``..``, an absolute path), and a file that
    resolves outside the directory (a symlink elsewhere), except into the ``blobs/`` of the
    Hugging Face cache repository the directory is a snapshot of (where the hub's symlinks
    point). The error quotes the entry, never the target's contents.
    """
    plain = (isinstance(shard, str) and shard not in ("", ".", "..") and not any(c in shard for c in "/\\\0")
             and not Path(shard).is_absolute() and Path(shard).name == shard)
    if not plain:
        raise CheckpointError(f"{index}: the weight_map entry {shard!r} is not a shard file name in {directory} "
                              "(a shard index may only name files of its own directory)")
    root = directory.resolve()
    target = (directory / shard).resolve()
    if target.parent == root or _in_hub_blobs(root, target):
        return directory / shard
    raise CheckpointError(f"{index}: the shard {shard!r} resolves outside {directory} (a symlink elsewhere); "
                          "a shard index may only name files of its own directory")


def _in_hub_blobs(root: Path, target: Path) -> bool:
    """Whether ``target`` is a blob of the Hugging Face cache repo whose snapshot holds ``root``
    (``<repo>/snapshots/<revision>/...`` -> ``<repo>/blobs/<hash>``)."""
    parts = root.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            blobs = Path(*parts[:i]) / "blobs"
            return target.parent == blobs
    return False


def _read_weights_dir(directory: Path, weights: str = _WEIGHTS, index: str = _INDEX,
                      max_tensors: int = MAX_EXPECTED_TENSORS) -> dict[str, _Tensor]:
    """``weights`` (default ``diffusion_pytorch_model.safetensors``) or the shards its ``index`` lists,
    cross-checked against the index. ``max_tensors``: the most tensors the caller expects (bounds
    the headers it will parse)."""
    index, single = directory / index, directory / weights
    budget = header_budget(max_tensors)
    if index.exists():
        data = read_json_file(index, error=CheckpointError, what="shard index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} is not a valid shard index: a JSON object whose 'weight_map' maps "
                                  "tensor names to shard file names is expected")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
        paths = {shard: _shard_file(directory, shard, index) for shard in shards}
        missing = [shard for shard in shards if not paths[shard].is_file()]
        if missing:
            raise CheckpointError(f"{directory}: the shard index {index.name} lists shard file(s) that do not exist: "
                                  + "; ".join(f"{s} (holding {_names(shards[s], 3)})" for s in missing))
        files = {shard: SafetensorsFile(paths[shard], max_header_bytes=budget) for shard in shards}
        for shard, names in shards.items():
            absent = [n for n in names if n not in files[shard]]
            if absent:
                raise CheckpointError(f"{directory / shard} lacks tensor(s) its index {index.name} places there: "
                                      f"{_names(absent)}")
            extra = [n for n in files[shard].keys() if weight_map.get(n) != shard]
            if extra:
                raise CheckpointError(f"{directory / shard} holds tensor(s) its index {index.name} does not place "
                                      f"there: {_names(extra)}")
        return _safetensors_tensors(files, weight_map)
    if single.exists():
        return _safetensors_tensors({single.name: SafetensorsFile(single, max_header_bytes=budget)})
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    raise CheckpointError(f"{directory} has neither {single.name} nor {index.name}"
                          + (f" (found {', '.join(found)}; pickled .bin/.pt weights are not read from a directory)"
                             if found else ""))


# -- config.json ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _JsonConfig:
    """The fields of a checkpoint's config.json, under our names, with their spelling there."""

    path: Path
    values: dict[str, Any]  # our field -> value
    spelled: dict[str, str]  # our field -> the JSON field name
    #: Matrix-Game 2.0's ``action_config`` (keyboard_dim_in, enable_mouse, blocks, ...), or None.
    action: dict[str, Any] | None = None


def _action_json(path: Path, data: dict[str, Any]) -> dict[str, Any] | None:
    action = data.get("action_config")
    if action is None:
        return None
    if not isinstance(action, dict):
        raise CheckpointError(f"{path}: action_config must be a JSON object, got {action!r}")
    return action


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON side file (config.json, adapter_config.json): a regular file of at most a few MB holding a
    JSON object (no NaN/Infinity, nesting bounded); anything else is a CheckpointError naming it."""
    data = read_json_file(path, error=CheckpointError, what="JSON file")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _is_wan_json(data: dict[str, Any]) -> bool:
    name = str(data.get("_class_name", ""))
    return name.endswith("WanModel") or {"dim", "num_heads", "num_layers", "in_dim"} <= set(data)


def _is_diffusers_json(data: dict[str, Any]) -> bool:
    return data.get("_class_name") == "WanTransformer3DModel" or (
        {"num_attention_heads", "attention_head_dim", "in_channels"} <= set(data))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_positive_int(path: Path, field: str, value: Any) -> int:
    """``value`` if it is a JSON integer ``>= 1`` (not a bool, float or string), else CheckpointError naming it."""
    if not _is_int(value) or value <= 0:
        raise CheckpointError(f"{path}: {field} must be a positive integer, got {_shown(value)}")
    return value


def json_positive_float(path: Path, field: str, value: Any) -> float:
    """``value`` if it is a finite JSON number ``> 0`` (not a bool or string), else CheckpointError naming it."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or not (
            math.isfinite(value) and value > 0):
        raise CheckpointError(f"{path}: {field} must be a finite positive number, got {_shown(value)}")
    return float(value)


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _checked_values(path: Path, values: dict[str, Any], spelled: dict[str, str]) -> dict[str, Any]:
    """The config.json fields under our names, each checked: integers positive, ``eps`` finite and positive."""
    return {ours: json_positive_float(path, spelled[ours], value) if ours == "eps"
            else json_positive_int(path, spelled[ours], value) for ours, value in values.items()}


def _patch(value: Any, path: Path, field: str) -> int:
    if not (isinstance(value, (list, tuple)) and len(value) == 3 and all(_is_int(v) and v > 0 for v in value)):
        raise CheckpointError(f"{path}: {field} must be [t, h, w] (positive integers), got {_shown(value)}")
    if value[0] != 1 or value[1] != value[2]:
        raise CheckpointError(f"{path}: {field} {list(value)} is not supported (CausalDiT patches each frame "
                              "with a square p x p patch: [1, p, p])")
    return value[1]


def _wan_json(path: Path, data: dict[str, Any]) -> _JsonConfig:
    model_type = data.get("model_type", "t2v")
    action = _action_json(path, data)
    # Matrix-Game 2.0 is i2v with action_config: image tokens are its only context (no k_img/v_img).
    if model_type not in ("t2v", "ti2v") and not (model_type == "i2v" and action is not None):
        raise CheckpointError(f"{path}: model_type {model_type!r} has an image (or other conditioning) branch; "
                              "CausalDiT loads text-to-video networks (model_type t2v or ti2v) and Matrix-Game 2.0 "
                              "(model_type i2v with an action_config)")
    for flag in ("qk_norm", "cross_attn_norm"):
        if data.get(flag, True) is not True:
            raise CheckpointError(f"{path}: {flag}={data[flag]!r} is not supported (CausalDiT has q/k RMS norms and "
                                  "an affine norm before cross-attention, as the published Wan networks)")
    spelled = {"dim": "dim", "num_heads": "num_heads", "num_layers": "num_layers", "ffn_dim": "ffn_dim",
               "in_channels": "in_dim", "out_channels": "out_dim", "text_dim": "text_dim",
               "freq_dim": "freq_dim", "eps": "eps", "text_len": "text_len"}
    if action is not None:  # text_dim / text_len are unused leftovers in Matrix-Game's configs
        del spelled["text_dim"], spelled["text_len"]
    values = {ours: data[theirs] for ours, theirs in spelled.items() if theirs in data}
    values = _checked_values(path, values, spelled)
    if "patch_size" in data:
        values["patch_size"], spelled["patch_size"] = _patch(data["patch_size"], path, "patch_size"), "patch_size"
    return _JsonConfig(path, values, spelled, action)


def _diffusers_json(path: Path, data: dict[str, Any]) -> _JsonConfig:
    action = _action_json(path, data)
    # FastVideo's Matrix-Game conversion: image_dim is its CLIP context width (no text, no k_img/v_img).
    for field in ("added_kv_proj_dim", "pos_embed_seq_len") if action is not None else (
            "image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
        if data.get(field) is not None:
            raise CheckpointError(f"{path}: {field}={data[field]!r} means an image branch; CausalDiT loads "
                                  "text-to-video networks (image_dim and added_kv_proj_dim null)")
    if data.get("cross_attn_norm", True) is not True:
        raise CheckpointError(f"{path}: cross_attn_norm={data['cross_attn_norm']!r} is not supported (CausalDiT has "
                              "the affine norm before cross-attention of the published Wan networks)")
    if data.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
        raise CheckpointError(f"{path}: qk_norm={data['qk_norm']!r} is not supported (CausalDiT normalises q and k "
                              "with 'rms_norm_across_heads')")
    spelled = {"num_heads": "num_attention_heads", "num_layers": "num_layers", "ffn_dim": "ffn_dim",
               "in_channels": "in_channels", "out_channels": "out_channels",
               "text_dim": "image_dim" if action is not None else "text_dim", "freq_dim": "freq_dim", "eps": "eps"}
    values = {ours: data[theirs] for ours, theirs in spelled.items() if theirs in data}
    if values.get("out_channels", 0) is None:
        del values["out_channels"]  # diffusers: out_channels null = in_channels
    values = _checked_values(path, values, spelled)
    if "num_attention_heads" in data and "attention_head_dim" in data:
        head_dim = json_positive_int(path, "attention_head_dim", data["attention_head_dim"])
        values["dim"] = values["num_heads"] * head_dim
        spelled["dim"] = "num_attention_heads * attention_head_dim"
    if "patch_size" in data:
        values["patch_size"], spelled["patch_size"] = _patch(data["patch_size"], path, "patch_size"), "patch_size"
    return _JsonConfig(path, values, spelled, action)


# -- the opened checkpoint -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Checkpoint:
    """A checkpoint opened (headers only): Wan name -> tensor, and its config.json if any."""

    path: Path
    format: str
    tensors: dict[str, _Tensor]  # Wan name -> tensor
    json: _JsonConfig | None

    def describe(self, name: str) -> str:
        stored = self.tensors[name].stored
        return name if stored == name else f"{stored} (= {name})"


def _detect_format(path: Path) -> tuple[str, Path]:
    if path.is_dir():
        root = path
        if not (root / "config.json").exists() and (root / "transformer" / "config.json").exists():
            root = root / "transformer"
        config = root / "config.json"
        if not config.exists():
            raise CheckpointError(f"{path} is a directory without config.json (nor transformer/config.json): "
                                  "not a Wan or diffusers checkpoint directory")
        data = _read_json(config)
        if _is_diffusers_json(data):
            return "diffusers", root
        if _is_wan_json(data):
            return "wan", root
        raise CheckpointError(f"{config} is neither a Wan (WanModel) nor a diffusers (WanTransformer3DModel) "
                              f"config (_class_name={data.get('_class_name')!r}); pass format=")
    if path.name == _INDEX:
        return _detect_format(path.parent)
    if path.suffix in (".pt", ".pth"):
        return "pt", path
    if path.suffix == ".safetensors":
        return "safetensors", path
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    raise CheckpointError(f"cannot tell the format of {path} from its name; pass format= (one of "
                          f"{', '.join(CHECKPOINT_FORMATS)})")


def _expected_tensors(config: CausalDiTConfig | str | None) -> int:
    """How many tensors a checkpoint for ``config`` holds (what bounds the headers read); a cap when unknown."""
    try:
        if isinstance(config, str):
            config = dit_preset(config)
        if isinstance(config, CausalDiTConfig):
            return len(wan_names(config))
    except (KeyError, ValueError, TypeError):  # refused later, with the reason
        pass
    return MAX_EXPECTED_TENSORS


def _open(path: str | os.PathLike[str], format: str | None, checkpoint_key: str | None,
          max_tensors: int = MAX_EXPECTED_TENSORS) -> _Checkpoint:
    path = Path(path)
    if format is None:
        format, path = _detect_format(path)
    elif format not in CHECKPOINT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {format!r}")
    elif format in ("wan", "diffusers"):
        if path.name == _INDEX:
            path = path.parent
        if path.is_dir() and not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
            path = path / "transformer"
        if not path.is_dir():
            raise CheckpointError(f"format={format!r} reads a checkpoint directory; {path} is not a directory")
    if checkpoint_key is not None and format != "pt":
        raise ValueError(f"checkpoint_key picks an entry of a .pt training checkpoint; {path} is {format!r}")
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")

    json_config = None
    if format in ("wan", "diffusers"):
        config_path = path / "config.json"
        if not config_path.exists():
            raise CheckpointError(f"{path} has no config.json")
        data = _read_json(config_path)
        json_config = _wan_json(config_path, data) if format == "wan" else _diffusers_json(config_path, data)
        stored = _read_weights_dir(path, max_tensors=max_tensors)
    elif format == "safetensors":
        if path.is_dir():
            raise CheckpointError(f"format='safetensors' reads one .safetensors file; {path} is a directory")
        file = SafetensorsFile(path, max_header_bytes=header_budget(max_tensors))
        stored = _safetensors_tensors({path.name: file})
    else:
        if path.is_dir():
            raise CheckpointError(f"format='pt' reads one torch.save file; {path} is a directory")
        obj = _torch_load(path)
        stored = _torch_tensors(_pick_state(obj, path, checkpoint_key), path)

    if format == "diffusers":
        prefixes: tuple[str, ...] = ()
    else:
        prefixes = ("model.diffusion_model.", "model.")
    cleaned = _strip_prefixes(stored, prefixes)
    rename = format == "diffusers" or (format in ("pt", "safetensors") and _looks_diffusers(cleaned.values()))
    tensors: dict[str, _Tensor] = {}
    unknown: list[str] = []
    for name, clean in cleaned.items():
        wan = _diffusers_name(clean) if rename else clean
        if wan is None:
            unknown.append(name)
            continue
        if wan in tensors:
            raise CheckpointError(f"{path}: tensors {tensors[wan].stored} and {name} both map to {wan}")
        tensors[wan] = stored[name]
    if unknown:
        raise CheckpointError(f"{path} holds unexpected tensors (no parameter of CausalDiT takes them): "
                              f"{_names(unknown)}")
    return _Checkpoint(path, format, tensors, json_config)


def _pick_state(obj: Any, path: Path, checkpoint_key: str | None) -> dict[str, Any]:
    torch = _torch()
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a dict of state dicts or tensors")
    if checkpoint_key is not None:
        if checkpoint_key not in obj:
            raise CheckpointError(f"{path} has no entry {checkpoint_key!r} (it has: {_names(map(str, obj))})")
        return _tensor_dict(obj[checkpoint_key], path, f"entry {checkpoint_key!r}")
    for key in _PT_KEYS:
        if key in obj and isinstance(obj[key], dict) and obj[key]:
            return _tensor_dict(obj[key], path, f"entry {key!r}")
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _tensor_dict(obj, path, "the file")
    raise CheckpointError(f"{path} holds none of {', '.join(_PT_KEYS)} (it has: {_names(map(str, obj))}); "
                          "pass checkpoint_key=")


# -- geometry and config -------------------------------------------------------------------------------


def _geometry(ckpt: _Checkpoint) -> dict[str, tuple[int, str]]:
    """What the tensors say: our field -> (value, the tensor that says it). Missing tensors say nothing."""
    t = ckpt.tensors
    out: dict[str, tuple[int, str]] = {}

    def shape(name: str) -> tuple[int, ...] | None:
        return t[name].shape if name in t else None

    def where(name: str) -> str:
        return f"{ckpt.describe(name)} {list(t[name].shape)}"

    patch = shape("patch_embedding.weight")
    if patch is not None and len(patch) == 5:
        out["dim"] = (patch[0], where("patch_embedding.weight"))
        out["in_channels"] = (patch[1], where("patch_embedding.weight"))
        if patch[2] != 1 or patch[3] != patch[4]:
            raise CheckpointError(f"{ckpt.path}: patch_embedding.weight {list(patch)} has patch {list(patch[2:])}; "
                                  "CausalDiT patches each frame with a square p x p patch ([1, p, p])")
        out["patch_size"] = (patch[3], where("patch_embedding.weight"))
    for field, name, axis in (("text_dim", "text_embedding.0.weight", 1), ("text_dim", "img_emb.proj.1.weight", 1),
                              ("freq_dim", "time_embedding.0.weight", 1), ("ffn_dim", "blocks.0.ffn.0.weight", 0)):
        s = shape(name)
        if s is not None and len(s) == 2:
            out[field] = (s[axis], where(name))
    head = shape("head.head.weight")
    if head is not None and len(head) == 2 and "patch_size" in out:
        p = out["patch_size"][0]
        if p > 0 and head[0] % (p * p) == 0:
            out["out_channels"] = (head[0] // (p * p), where("head.head.weight"))
    layers = sorted({int(m.group(1)) for m in map(_BLOCK_NAME.fullmatch, t) if m})
    if layers:
        out["num_layers"] = (layers[-1] + 1, f"the highest block index, blocks.{layers[-1]}.*")
    keyboard = shape("blocks.0.action_model.keyboard_embed.0.weight")
    if keyboard is not None and len(keyboard) == 2:
        out["keyboard_dim"] = (keyboard[1], where("blocks.0.action_model.keyboard_embed.0.weight"))
    return out


def _action_geometry(ckpt: _Checkpoint) -> tuple[int, bool, int] | None:
    """Matrix-Game's action modules as the tensors show them: (keyboard_dim, mouse, blocks), or None."""
    t = ckpt.tensors
    blocks = {int(m.group(1)) for m in map(_BLOCK_NAME.fullmatch, t) if m and m.group(2).startswith("action_model.")}
    keyboard = t.get("blocks.0.action_model.keyboard_embed.0.weight")
    if not blocks or keyboard is None or len(keyboard.shape) != 2:
        return None
    return keyboard.shape[1], "blocks.0.action_model.mouse_mlp.0.weight" in t, max(blocks) + 1


def _check_json(ckpt: _Checkpoint, geometry: dict[str, tuple[int, str]]) -> None:
    js = ckpt.json
    if js is None:
        return
    for field, (value, where) in geometry.items():
        if field in js.values and js.values[field] != value:
            raise CheckpointError(f"{js.path} disagrees with the tensors: {js.spelled[field]} = {js.values[field]!r} "
                                  f"but {where} says {value}")
    heads, dim = js.values.get("num_heads"), js.values.get("dim", geometry.get("dim", (None,))[0])
    if heads is not None and dim is not None and (not isinstance(heads, int) or heads <= 0 or dim % heads):
        raise CheckpointError(f"{js.path} disagrees with the tensors: {js.spelled['num_heads']} = {heads!r} does not "
                              f"divide dim {dim}")
    channels, out = js.values.get("in_channels"), js.values.get("out_channels")
    if channels is not None and out is not None and channels != out and js.action is None:
        raise CheckpointError(f"{js.path}: {js.spelled['out_channels']} = {out} differs from "
                              f"{js.spelled['in_channels']} = {channels}; CausalDiT predicts the channels it reads")
    if js.action is not None and "keyboard_dim" in geometry:
        value, where = geometry["keyboard_dim"]
        if js.action.get("keyboard_dim_in", value) != value:
            raise CheckpointError(f"{js.path} disagrees with the tensors: action_config.keyboard_dim_in = "
                                  f"{js.action['keyboard_dim_in']!r} but {where} says {value}")


_GEOMETRY_FIELDS = ("num_layers", "dim", "ffn_dim", "in_channels", "patch_size", "text_dim", "freq_dim")

#: Matrix-Game 2.0's presets by (keyboard_dim, mouse).
_MATRIX_GAME = {(4, True): "matrix-game-2-universal", (2, True): "matrix-game-2-gta-drive",
                (7, False): "matrix-game-2-templerun"}


def _matrix_game_config(ckpt: _Checkpoint, geometry: dict[str, tuple[int, str]],
                        action: tuple[int, bool, int]) -> CausalDiTConfig:
    keyboard, mouse, blocks = action
    name = _MATRIX_GAME.get((keyboard, mouse))
    preset = None if name is None else dit_preset(name)
    if preset is None or blocks != preset.action.num_blocks or any(
            getattr(preset, field) != value for field, (value, _) in geometry.items()
            if field in _GEOMETRY_FIELDS):
        raise CheckpointError(f"{ckpt.path}: a Matrix-Game network (action modules in {blocks} blocks, keyboard "
                              f"{keyboard}, {'with' if mouse else 'without'} mouse) that matches none of the "
                              f"published ones ({', '.join(_MATRIX_GAME.values())}): pass config=")
    return preset


def _build_config(ckpt: _Checkpoint, geometry: dict[str, tuple[int, str]]) -> CausalDiTConfig:
    action = _action_geometry(ckpt)
    if action is not None:
        return _matrix_game_config(ckpt, geometry, action)
    needed = {"num_layers": "blocks.0.*", "dim": "patch_embedding.weight", "in_channels": "patch_embedding.weight",
              "patch_size": "patch_embedding.weight", "text_dim": "text_embedding.0.weight",
              "freq_dim": "time_embedding.0.weight", "ffn_dim": "blocks.0.ffn.0.weight"}
    absent = sorted({tensor for field, tensor in needed.items() if field not in geometry})
    if absent:
        raise CheckpointError(f"{ckpt.path}: cannot infer the network's size, missing tensors: {', '.join(absent)} "
                              "(pass config= to get the full list of what is missing)")
    values = {field: geometry[field][0] for field in _GEOMETRY_FIELDS}
    # The highest block index sizes the network: one stray "blocks.99999999.*" must not make it a
    # network of 10**8 blocks (whose tensor table alone would not fit in memory).
    # (A few missing tensors are left to the check that names them.)
    needed = 15 + 27 * values["num_layers"]
    if needed > 2 * len(ckpt.tensors) + 64:
        raise CheckpointError(f"{ckpt.path}: {geometry['num_layers'][1]} makes a network of {values['num_layers']} "
                              f"blocks ({needed} tensors) but the checkpoint holds {len(ckpt.tensors)}: corrupt, or "
                              "pass config=")
    js = ckpt.json.values if ckpt.json is not None else {}
    heads = js.get("num_heads")
    for name in _PUBLISHED:
        preset = dit_preset(name)
        if all(getattr(preset, f) == v for f, v in values.items()) and heads in (None, preset.num_heads):
            return preset.replace(eps=js.get("eps", preset.eps))
    if heads is None:
        if values["dim"] % 128:
            raise CheckpointError(f"{ckpt.path}: dim {values['dim']} matches no published network and no config.json "
                                  "gives num_heads (Wan's heads are 128 wide; dim is no multiple of 128): pass config=")
        heads = values["dim"] // 128
    values["latent_channels"] = values.pop("in_channels")  # text-to-video: it predicts what it reads
    base = next((dit_preset(n) for n in _PUBLISHED if dit_preset(n).latent_channels == values["latent_channels"]),
                dit_preset(_PUBLISHED[0]))
    extra = {"eps": js["eps"]} if "eps" in js else {}
    if "text_len" in js:
        extra["text_len"] = js["text_len"]
    try:
        return base.replace(name="custom", num_heads=heads, **values, **extra)
    except ValueError as error:  # e.g. a head width RoPE cannot split
        raise CheckpointError(f"{ckpt.json.path if ckpt.json is not None else ckpt.path} describes no valid "
                              f"CausalDiT: {error}") from None


def _resolve_config(ckpt: _Checkpoint, config: CausalDiTConfig | str | None, dtype: Any) -> CausalDiTConfig:
    geometry = _geometry(ckpt)
    _check_json(ckpt, geometry)
    if config is None:
        config = _build_config(ckpt, geometry)
    elif isinstance(config, str):
        config = dit_preset(config)
    elif not isinstance(config, CausalDiTConfig):
        raise TypeError(f"config must be a CausalDiTConfig, a preset name or None, got {type(config).__name__}")
    for field in ("image_len", "num_register_tokens", "control_dim"):
        if getattr(config, field):
            raise CheckpointError(f"config {config.name!r} has {field}={getattr(config, field)}: a published Wan "
                                  "text-to-video checkpoint has no image branch, register tokens or controls; use a "
                                  f"config with {field}=0")
    for field, (value, where) in geometry.items():
        if field == "keyboard_dim":
            if config.action is None:
                raise CheckpointError(f"config {config.name!r} has no action modules, but {ckpt.path} is a "
                                      f"Matrix-Game checkpoint ({where}): use a Matrix-Game config")
            ours = config.action.keyboard_dim
        else:
            ours = config.latent_channels if field == "out_channels" else getattr(config, field)
        if ours != value:
            shown = {"out_channels": "latent_channels (output)", "keyboard_dim": "action.keyboard_dim",
                     "in_channels": "in_channels (input)" if config.input_channels else "latent_channels",
                     }.get(field, field)
            raise CheckpointError(f"config {config.name!r} disagrees with the checkpoint {ckpt.path}: {shown} = {ours} "
                                  f"but {where} says {value}")
    if ckpt.json is not None:
        js = ckpt.json
        for field in ("num_heads", "eps"):
            if field in js.values and not math.isclose(js.values[field], getattr(config, field), rel_tol=1e-9):
                raise CheckpointError(f"config {config.name!r} disagrees with {js.path}: {field} = "
                                      f"{getattr(config, field)} but {js.spelled[field]} = {js.values[field]}")
    if dtype is not None:
        name = float_dtype_name(dtype)
        config = config.replace(dtype=name, param_dtype=name)
    return config


# -- LoRA -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Lora:
    a: _Tensor  # [r, in]
    b: _Tensor  # [out, r]
    scale: float


_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight")


#: The largest magnitude a LoRA delta may reach in float32 (half of float32's maximum: the base
#: weight is added to it).
_F32_HALF_MAX = float(np.finfo(np.float32).max) / 2


def _lora_number(value: Any, where: str, field: str) -> float:
    """A LoRA's alpha: a finite real number (not a bool, string or list), else CheckpointError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(
            float(value)):
        raise CheckpointError(f"LoRA {where}: {field} must be a finite number, got {_shown(value)}")
    return float(value)


def _read_lora(lora: str | os.PathLike[str], lora_alpha: float | None,
               expected: dict[str, tuple[int, ...]]) -> dict[str, _Lora]:
    """Wan weight name -> its LoRA factors and scale; everything checked against ``expected`` shapes.

    Refused by name (the file, the tensor, why): tensors that are not factors, two names for one
    factor, a half pair, mis-shaped, rank-0 or non-floating factors, factors holding NaN or
    infinity, an alpha (or ``adapter_config.json`` field) that is not a finite number, and a
    scale that would take the merged weights past float32's range.
    """
    path = Path(lora)
    if lora_alpha is not None:
        lora_alpha = _lora_number(lora_alpha, str(path), "lora_alpha")
    adapter_config: dict[str, Any] = {}
    budget = header_budget(2 * len(expected))  # at most two factors per weight
    if path.is_dir():
        config_path, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not weights.exists():
            raise CheckpointError(f"LoRA directory {path} has no adapter_model.safetensors (pickled adapter_model.bin "
                                  "is not read)")
        if config_path.exists():
            adapter_config = _read_json(config_path)
        stored = _safetensors_tensors({weights.name: SafetensorsFile(weights, max_header_bytes=budget)})
    elif path.suffix == ".safetensors":
        stored = _safetensors_tensors({path.name: SafetensorsFile(path, max_header_bytes=budget)})
    elif path.suffix in (".pt", ".pth"):
        obj = _torch_load(path)
        if isinstance(obj, dict) and isinstance(obj.get("generator_lora"), dict):
            obj = obj["generator_lora"]
        stored = _torch_tensors(_tensor_dict(obj, path, "the LoRA"), path)
    elif not path.exists():
        raise FileNotFoundError(f"LoRA {path} does not exist")
    else:
        raise CheckpointError(f"cannot tell the format of {path}: pass a .pt/.pth or .safetensors file, or a "
                              "PEFT directory (adapter_model.safetensors + adapter_config.json)")
    config_where = f"{path} (adapter_config.json)"
    for field in ("rank_pattern", "alpha_pattern"):
        if adapter_config.get(field):
            raise CheckpointError(f"{path}: adapter_config.json {field} (per-module ranks or alphas) is not supported")
    for field in ("use_dora", "use_rslora"):
        if not isinstance(adapter_config.get(field, False), bool):
            raise CheckpointError(f"LoRA {config_where}: {field} must be true or false, got "
                                  f"{_shown(adapter_config[field])}")
    if adapter_config.get("use_dora"):
        raise CheckpointError(f"{path}: a DoRA adapter (use_dora) is not supported, only plain LoRA")
    rank_declared = adapter_config.get("r")
    if rank_declared is not None and (not _is_int(rank_declared) or rank_declared <= 0):
        raise CheckpointError(f"LoRA {config_where}: r must be a positive integer, got {_shown(rank_declared)}")
    if lora_alpha is None and adapter_config.get("lora_alpha") is not None:
        lora_alpha = _lora_number(adapter_config["lora_alpha"], config_where, "lora_alpha")

    cleaned = _strip_prefixes(stored, ("base_model.model.",))
    cleaned = {name: c.removeprefix("transformer.").removeprefix("model.diffusion_model.").removeprefix("model.")
               for name, c in cleaned.items()}
    modules = {n.rpartition(".")[0] for n in expected}
    factors: dict[str, dict[str, _Tensor]] = {}
    unknown, twice = [], []
    for name, clean in cleaned.items():
        match = _LORA_KEY.fullmatch(clean)
        if match is None:
            unknown.append(name)
            continue
        module = match.group("module")
        if module not in modules:  # a diffusers-named LoRA (blocks.0.attn1.to_q, ...)
            module = _diffusers_module(module) or module
        ab = match.group("ab")
        if ab in factors.get(module, {}):
            twice.append(f"{factors[module][ab].stored} and {name} (both {module}.lora_{ab})")
            continue
        factors.setdefault(module, {})[ab] = stored[name]
    if unknown:
        raise CheckpointError(f"LoRA {path} holds tensors that are not LoRA factors (*.lora_A.weight / "
                              f"*.lora_B.weight): {_names(unknown)}")
    if twice:
        raise CheckpointError(f"LoRA {path} names the same factor twice (which one would win is arbitrary): "
                              f"{_names(twice, 6)}")
    if not factors:
        raise CheckpointError(f"LoRA {path} holds no LoRA factors")
    absent = sorted(m for m in factors if f"{m}.weight" not in expected or len(expected[f"{m}.weight"]) != 2
                    or m == "patch_embedding")
    if absent:
        raise CheckpointError(f"LoRA {path} targets modules this model does not have as linear layers (a LoRA for "
                              f"another model?): {_names(absent)}")
    out: dict[str, _Lora] = {}
    problems = []
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{module} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
            continue
        out_dim, in_dim = expected[f"{module}.weight"]
        a, b = ab["A"], ab["B"]
        rank = a.shape[0] if len(a.shape) == 2 else -1
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != in_dim or b.shape != (out_dim, rank):
            problems.append(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit its weight "
                            f"[{out_dim}, {in_dim}] (lora_A must be [r, {in_dim}], lora_B [{out_dim}, r])")
            continue
        if rank == 0:
            problems.append(f"{module}: lora_A {a.stored} / lora_B {b.stored} have rank 0")
            continue
        not_float = [t.stored for t in (a, b) if not jnp.issubdtype(t.dtype, jnp.floating)]
        if not_float:
            problems.append(f"{module}: {' and '.join(not_float)} {'is' if len(not_float) == 1 else 'are'} "
                            f"{a.dtype if a.stored in not_float else b.dtype}, not floating-point")
            continue
        if rank_declared is not None and rank != rank_declared:
            problems.append(f"{module}: rank {rank} but adapter_config.json r = {rank_declared}")
            continue
        alpha = lora_alpha if lora_alpha is not None else float(rank)
        scale = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
        if not abs(scale) <= _F32_HALF_MAX:
            problems.append(f"{module}: the scale alpha / r = {alpha:g} / {rank} is beyond float32's range")
            continue
        out[f"{module}.weight"] = _Lora(a, b, scale)
    if problems:
        raise CheckpointError(f"LoRA {path} does not fit the model: " + "; ".join(problems[:12])
                              + (f"; ... ({len(problems) - 12} more)" if len(problems) > 12 else ""))
    _check_lora_values(path, out)
    return out


def _check_lora_values(path: Path, loras: dict[str, _Lora]) -> None:
    """CheckpointError naming the factors that hold NaN or infinity, or whose scaled product could leave
    float32's range (``|scale| * r * max|A| * max|B|`` bounds every entry of the delta and its partial sums).
    Runs before anything is merged or placed; the factors are small (rank x width)."""
    problems = []
    for name, factors in sorted(loras.items()):
        peaks = []
        for tensor in (factors.a, factors.b):
            values = np.asarray(tensor.read(), np.float32)
            if not np.isfinite(values).all():
                problems.append(f"{tensor.stored} holds NaN or infinite values")
                break
            peaks.append(float(np.abs(values).max(initial=0.0)))
        else:
            rank = factors.a.shape[0]
            bound = rank * peaks[0] * peaks[1]
            if not (bound <= _F32_HALF_MAX and abs(factors.scale) * bound <= _F32_HALF_MAX):
                problems.append(f"{name.removesuffix('.weight')}: scale {factors.scale:g} x r {rank} x max|A| "
                                f"{peaks[0]:g} x max|B| {peaks[1]:g} can overflow float32")
    if problems:
        raise CheckpointError(f"LoRA {path} cannot be merged: " + "; ".join(problems[:12])
                              + (f"; ... ({len(problems) - 12} more)" if len(problems) > 12 else ""))


# -- the plan: everything checked before anything is read ------------------------------------------------


def _check_tensors(ckpt: _Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if n not in ckpt.tensors]
    unexpected = [ckpt.describe(n) for n in ckpt.tensors if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names(unexpected)}")
        raise CheckpointError(f"{ckpt.path} does not match the model: " + "; ".join(parts))
    wrong = [f"{ckpt.describe(n)} is {list(ckpt.tensors[n].shape)}, the model needs {list(shape)}"
             for n, shape in expected.items() if ckpt.tensors[n].shape != shape]
    if wrong:
        raise CheckpointError(f"{ckpt.path} has mis-shaped tensors: " + "; ".join(wrong[:12])
                              + (f"; ... ({len(wrong) - 12} more)" if len(wrong) > 12 else ""))
    not_float = [f"{ckpt.describe(n)} ({t.dtype})" for n, t in ckpt.tensors.items()
                 if not jnp.issubdtype(t.dtype, jnp.floating)]
    if not_float:
        raise CheckpointError(f"{ckpt.path} has non-floating-point tensors: {_names(not_float)}")


def float_dtype_name(dtype: Any) -> str:
    """``dtype``'s name when it is a floating dtype (the ``dtype=`` of the loaders), else ValueError."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from None
    if not jnp.issubdtype(jnp.dtype(name), jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {name}")
    return name


def _placement(mesh: Any, config: CausalDiTConfig) -> Callable[[Any], Any] | None:
    if mesh is None:
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    return mesh_placement(mesh, config)  # the rule PipelineBase.shard_ar_diffusion_model applies


def _path_name(path: tuple[Any, ...]) -> str:
    """A parameter's dotted path (``blocks.self_attn.q.kernel``), as the mapping table names it."""
    parts = weight_file_name(path).split("/")
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def _progress_bar(progress: bool | None, total: int, path: Path) -> Any:
    show = total > _PROGRESS_BYTES if progress is None else bool(progress)
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading {path.name}")


# -- public API -------------------------------------------------------------------------------------------


def checkpoint_config(path: str | os.PathLike[str], *, format: str | None = None,
                      checkpoint_key: str | None = None) -> CausalDiTConfig:
    """The :class:`CausalDiTConfig` :func:`load_checkpoint` builds for ``path`` when given no config.

    Read from the checkpoint's ``config.json`` (or, for a bare file, from its tensor shapes)
    on top of the matching published preset (``wan2.1-t2v-1.3b``, ``wan2.1-t2v-14b``,
    ``wan2.2-ti2v-5b``: their latent size, block policy and bf16); a network matching none
    gets the name ``"custom"`` and the latent size of the published network with its
    channel count. Without a config.json, heads are ``dim // 128`` (Wan's head width).
    Reads headers only.
    """
    with _as_checkpoint_error():
        ckpt = _open(path, format, checkpoint_key)
    return _resolve_config(ckpt, None, None)


def load_checkpoint(
    path: str | os.PathLike[str],
    config: CausalDiTConfig | str | None = None,
    *,
    format: str | None = None,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    lora: str | os.PathLike[str] | None = None,
    lora_alpha: float | None = None,
    checkpoint_key: str | None = None,
    progress: bool | None = None,
) -> CausalDiT:
    """A :class:`CausalDiT` holding the weights of a published causal-Wan checkpoint.

    Args:
      path: a Wan or diffusers checkpoint directory (or diffusers pipeline root), a ``.pt`` /
        ``.pth`` training checkpoint, or a ``.safetensors`` file (see the module docstring).
      config: a :class:`CausalDiTConfig` or preset name; None: :func:`checkpoint_config`.
        Refused when it disagrees with the tensors (layers, width, FFN, channels, patch,
        text width, timestep width) or with the checkpoint's config.json (heads, eps), or
        when it has an image branch, register tokens or controls.
      format: ``"wan"``, ``"diffusers"``, ``"pt"`` or ``"safetensors"``; None: from the path.
      dtype: parameter and activation dtype (replaces the config's ``dtype`` and
        ``param_dtype``); None: the config's (bf16 for the published presets).
      mesh: a ``jax.sharding.Mesh``; parameters are placed split over its ``"tp"`` axis by
        the model's partition annotations (heads, FFN hidden units), the rest replicated.
      lora: a LoRA merged into the weights on the host in float32 before the dtype cast
        (``W += alpha / r * B @ A``): a ``.pt`` (a state dict, or one under
        ``"generator_lora"``, as LongLive ships it), a ``.safetensors`` file, or a PEFT
        directory (``adapter_model.safetensors`` + ``adapter_config.json``). Keys like
        ``base_model.model.blocks.0.self_attn.q.lora_A.weight`` (prefixes optional).
      lora_alpha: the LoRA's alpha; None: ``adapter_config.json``'s ``lora_alpha``, else the
        rank (scale 1, as LongLive).
      checkpoint_key: the entry of a ``.pt`` checkpoint to load (``generator_ema``,
        ``generator``, ``critic``, ``model``); None: ``generator_ema``, then ``generator``,
        then ``model``.
      progress: a tqdm progress bar (bytes); None: shown for checkpoints over 256 MiB.

    Raises:
      CheckpointError: (a ValueError) a missing, unexpected, mis-shaped or non-float tensor,
        a corrupt or truncated file, a missing shard, a config or config.json that disagrees
        with the tensors or holds a value of the wrong kind (a bool, string, NaN, infinite or
        non-positive size or epsilon), a ``.pt`` tensor the file does not store (stride-0 or
        overlapping views), a header larger than the expected tensors need, a side or weight
        file that is not a regular file or is too large, a shard index naming a file outside
        its directory, a LoRA that does not fit (shapes, rank 0, integer or non-finite factors,
        a factor named twice, an alpha that is not a finite number, a merge that could
        overflow float32); the message names the file and the tensor or field. Nothing is
        placed on device before every check has passed (a merge past float32's range
        through a base weight near float32's maximum is the one refusal found while
        building).
      ImportError: a ``.pt`` file without torch installed (``pip install "ardiff_jax[torch]"``).
    """
    with _as_checkpoint_error():
        ckpt = _open(path, format, checkpoint_key, _expected_tensors(config))
    config = _resolve_config(ckpt, config, dtype)
    expected = wan_names(config)
    _check_tensors(ckpt, expected)
    with _as_checkpoint_error():
        loras = _read_lora(lora, lora_alpha, expected) if lora is not None else {}
    return build_checked_model(ckpt, config, loras, mesh=mesh, progress=progress, lora_name=lora)


def build_checked_model(ckpt: _Checkpoint, config: CausalDiTConfig, loras: dict[str, _Lora], *,
                        mesh: jax.sharding.Mesh | None, progress: bool | None, lora_name: Any = None) -> CausalDiT:
    """The :class:`CausalDiT` of ``config`` filled from ``ckpt`` (Wan names, already checked against
    ``wan_names(config)``), each LoRA of ``loras`` merged into its tensor in float32 first.

    One parameter at a time is built on the host in its final dtype and put on device, so the host
    holds at most one stacked ``[L, ...]`` parameter beside the memory-mapped files; every tensor is
    used exactly once (asserted).
    """
    lora = lora_name
    placement = _placement(mesh, config)

    abstract = nnx.eval_shape(lambda: CausalDiT(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    if placement is not None:
        specs = jax.tree_util.tree_leaves(nnx.get_partition_spec(abstract_state),
                                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        shardings = [placement(spec) for spec in specs]
    else:
        shardings = [None] * len(flat)
    paths = [_path_name(p) for p, _ in flat]
    by_path = _by_path(config)
    if sorted(paths) != sorted(by_path):  # pragma: no cover - CausalDiT and this table changed apart
        raise RuntimeError(f"CausalDiT's parameters no longer match the Wan mapping: "
                           f"{sorted(set(paths) ^ set(by_path))}")

    used: Counter[str] = Counter()
    bar = _progress_bar(progress, sum(t.nbytes for t in ckpt.tensors.values())
                        + sum(l.a.nbytes + l.b.nbytes for l in loras.values()), ckpt.path)

    def read(name: str) -> np.ndarray:
        tensor = ckpt.tensors[name]
        used[name] += 1
        array = tensor.read()
        nbytes = tensor.nbytes
        if name in loras:  # merge in float32, in Wan's layout, before the cast
            factors = loras[name]
            a = factors.a.read().astype(np.float32)
            b = factors.b.read().astype(np.float32)
            base = array.astype(np.float32)
            array = base + np.float32(factors.scale) * (b @ a)
            if not np.isfinite(array[np.isfinite(base)]).all():  # only a base weight near float32's maximum
                raise CheckpointError(f"merging LoRA {lora} into {tensor.stored} of {ckpt.path} gives infinite "
                                      "weights (the base weight plus the scaled delta leaves float32's range)")
            nbytes += factors.a.nbytes + factors.b.nbytes
        if bar is not None:
            bar.update(nbytes)
        return array

    leaves = []
    try:
        for name, (_, spec), sharding in zip(paths, flat, shardings):
            entry = by_path[name]
            target = jnp.dtype(spec.dtype)
            if entry.per_layer:
                host = np.empty(spec.shape, target)
                for i in range(_stack_size(entry, config)):
                    host[i] = _transform(entry, read(entry.source.format(i=i)), config)
            else:
                host = np.array(_transform(entry, read(entry.source), config), dtype=target)
            if host.shape != tuple(spec.shape):  # pragma: no cover - guarded by _check_tensors
                raise RuntimeError(f"{name}: built {host.shape}, the model needs {spec.shape}")
            leaves.append(jax.device_put(host, sharding) if sharding is not None else jax.device_put(host))
            del host
    finally:
        if bar is not None:
            bar.close()
    wrong = sorted(n for n in ckpt.tensors if used[n] != 1) + sorted(set(used) - set(ckpt.tensors))
    if wrong:  # the mapping must be a bijection: every tensor used exactly once
        raise RuntimeError("checkpoint tensors not used exactly once: "
                           + ", ".join(f"{n} x{used[n]}" for n in wrong))
    state = jax.tree_util.tree_unflatten(treedef, leaves)
    return nnx.merge(graphdef, state)
