"""The CLIP image encoder Matrix-Game 2.0 (and Wan I2V) condition on: open-clip ViT-H/14, penultimate block.

Architecture (the visual tower of ``open-clip-xlm-roberta-large-vit-huge-14``, as Wan's
``clip.py`` runs it): a 14x14 patch conv without bias, a class token, learned positions,
a LayerNorm *before* the blocks, 32 pre-LN blocks (fused qkv with bias, exact GELU MLP of
ratio 4), LayerNorm eps 1e-5. Matrix-Game takes the output after block 31 of 32
(``use_31_block``): 257 tokens x 1280, no final norm. So does transformers'
``CLIPVisionModel`` at ``hidden_states[-2]`` (FastVideo's conversion uses it).

Preprocessing as the release: the ``[-1, 1]`` image is resized to 224 x 224 with torch's
bicubic (``a = -0.75``, ``align_corners=False``, no antialias: :func:`bicubic_matrix`),
mapped to ``[0, 1]`` and normalised with CLIP's mean and std.

Parameter names: :func:`load_clip_vision` reads the original ``.pth`` (``visual.*``; the
text tower ``textual.*`` and ``log_scale`` are skipped) or transformers' names
(``embeddings.*``, ``encoder.layers.*``, with or without transformers 4's ``vision_model.`` prefix; a
``CLIPVisionModel`` directory or ``.safetensors``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._checkpoint_files import (
    MAX_EXPECTED_TENSORS,
    CheckpointError,
    SafetensorsFile,
    as_checkpoint_error,
    header_budget,
    safetensors_tensors,
    tensor_dict,
    torch_load,
    torch_tensors,
)

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "ClipVisionConfig",
    "ClipVisionEncoder",
    "bicubic_matrix",
    "clip_vision_names",
    "load_clip_vision",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig:
    """Size of the vision tower. Defaults: open-clip ViT-H/14 (224 px, 16 x 16 patches + class token = 257
    tokens of 1280, 16 heads, 32 blocks) read after ``output_blocks = 31`` blocks."""

    image_size: int = 224
    patch_size: int = 14
    dim: int = 1280
    heads: int = 16
    layers: int = 32
    mlp_ratio: int = 4
    output_blocks: int = 31
    eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or self.dim % self.heads:
            raise ValueError("ClipVisionConfig: image_size must be a multiple of patch_size and dim of heads")
        if not 1 <= self.output_blocks <= self.layers:
            raise ValueError(f"ClipVisionConfig output_blocks must be in [1, {self.layers}]")

    @property
    def num_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


class _Block(nnx.Module):
    def __init__(self, config: ClipVisionConfig, rngs: nnx.Rngs) -> None:
        d, hidden = config.dim, config.dim * config.mlp_ratio

        def linear(din: int, dout: int) -> nnx.Linear:
            return nnx.Linear(din, dout, dtype=config.dtype, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

        self.norm1_scale, self.norm1_bias = nnx.Param(jnp.ones((d,))), nnx.Param(jnp.zeros((d,)))
        self.qkv = linear(d, 3 * d)
        self.proj = linear(d, d)
        self.norm2_scale, self.norm2_bias = nnx.Param(jnp.ones((d,))), nnx.Param(jnp.zeros((d,)))
        self.fc1 = linear(d, hidden)
        self.fc2 = linear(hidden, d)
        self.config = config

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, N, d]
        cfg = self.config
        b, n, d = x.shape
        h = _layer_norm(x, self.norm1_scale[...], self.norm1_bias[...], cfg.eps)
        q, k, v = jnp.moveaxis(self.qkv(h).reshape(b, n, 3, cfg.heads, d // cfg.heads), 2, 0)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32) / math.sqrt(d // cfg.heads)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v.astype(_F32)).reshape(b, n, d)
        x = x + self.proj(out.astype(cfg.dtype)).astype(_F32)
        h = _layer_norm(x, self.norm2_scale[...], self.norm2_bias[...], cfg.eps)
        return x + self.fc2(jax.nn.gelu(self.fc1(h.astype(cfg.dtype)), approximate=False)).astype(_F32)


class ClipVisionEncoder(nnx.Module):
    """ViT image encoder: ``f32[B, 3, S, S]`` normalised pixels -> ``f32[B, tokens, dim]`` after ``output_blocks``."""

    def __init__(self, config: ClipVisionConfig = ClipVisionConfig(), *, rngs: nnx.Rngs) -> None:
        self.config = config
        d, p = config.dim, config.patch_size
        # The patch conv (no bias) as a linear map of each (c, ph, pw) patch.
        self.patch = nnx.Param(jax.random.normal(rngs.params(), (3 * p * p, d), _F32) * 0.02)
        self.class_token = nnx.Param(jax.random.normal(rngs.params(), (d,), _F32) / math.sqrt(d))
        self.positions = nnx.Param(jax.random.normal(rngs.params(), (config.num_tokens, d), _F32) / math.sqrt(d))
        self.pre_norm_scale, self.pre_norm_bias = nnx.Param(jnp.ones((d,))), nnx.Param(jnp.zeros((d,)))

        @nnx.split_rngs(splits=config.output_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> _Block:
            return _Block(config, rngs)

        # Only the blocks whose output is read are held (the last one of open-clip's 32 never runs).
        self.blocks = make_blocks(rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        b, c, s, _ = pixels.shape
        if (c, s) != (3, cfg.image_size) or pixels.shape[3] != cfg.image_size:
            raise ValueError(f"pixels must be [B, 3, {cfg.image_size}, {cfg.image_size}], got {pixels.shape}")
        g, p = s // cfg.patch_size, cfg.patch_size
        patches = pixels.astype(_F32).reshape(b, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
        x = patches @ self.patch[...]
        x = jnp.concatenate([jnp.broadcast_to(self.class_token[...], (b, 1, cfg.dim)), x], axis=1)
        x = _layer_norm(x + self.positions[...], self.pre_norm_scale[...], self.pre_norm_bias[...], cfg.eps)
        graphdef, stacked = nnx.split(self.blocks)

        def step(x: jax.Array, state: Any) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, state)(x), None

        x, _ = jax.lax.scan(step, x, stacked)
        return x

    def encode_image(self, image: jax.Array) -> jax.Array:
        """The release's ``clip.encode_video`` for one frame: ``f32[3, H, W]`` in ``[-1, 1]`` -> ``f32[tokens, dim]``."""
        size = self.config.image_size
        rows = jnp.asarray(bicubic_matrix(image.shape[1], size))
        cols = jnp.asarray(bicubic_matrix(image.shape[2], size))
        resized = jnp.einsum("oh,chw,pw->cop", rows, image.astype(_F32), cols)
        unit = resized * 0.5 + 0.5
        normed = (unit - jnp.asarray(CLIP_MEAN)[:, None, None]) / jnp.asarray(CLIP_STD)[:, None, None]
        return self(normed[None])[0]


@functools.lru_cache(maxsize=16)
def bicubic_matrix(size_in: int, size_out: int, a: float = -0.75) -> np.ndarray:
    """``f32[out, in]``: torch's bicubic interpolation along one axis (``align_corners=False``, no antialias,
    edge indices clamped), so ``M @ x`` resizes ``x`` as ``F.interpolate(..., mode="bicubic")`` does."""
    def cubic(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        return np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                        np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))

    scale = size_in / size_out
    out = np.zeros((size_out, size_in), np.float64)
    for i in range(size_out):
        x = (i + 0.5) * scale - 0.5
        base = math.floor(x)
        frac = x - base
        for offset in range(-1, 3):
            out[i, min(max(base + offset, 0), size_in - 1)] += cubic(np.float64(offset - frac))
    return out.astype(np.float32)


# -- loading -----------------------------------------------------------------------------------------


def clip_vision_names(config: ClipVisionConfig, naming: str = "wan") -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint must hold for ``config`` (``naming``: ``"wan"`` = the original ``.pth``'s
    ``visual.*``, ``"transformers"`` = ``CLIPVisionModel``'s, without the ``vision_model.`` prefix), with their shapes."""
    d, p, h = config.dim, config.patch_size, config.dim * config.mlp_ratio
    if naming == "wan":
        out = {"visual.patch_embedding.weight": (d, 3, p, p), "visual.cls_embedding": (1, 1, d),
               "visual.pos_embedding": (1, config.num_tokens, d), "visual.pre_norm.weight": (d,),
               "visual.pre_norm.bias": (d,)}
        for i in range(config.output_blocks):
            b = f"visual.transformer.{i}."
            out.update({b + "norm1.weight": (d,), b + "norm1.bias": (d,), b + "attn.to_qkv.weight": (3 * d, d),
                        b + "attn.to_qkv.bias": (3 * d,), b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                        b + "norm2.weight": (d,), b + "norm2.bias": (d,), b + "mlp.0.weight": (h, d),
                        b + "mlp.0.bias": (h,), b + "mlp.2.weight": (d, h), b + "mlp.2.bias": (d,)})
        return out
    if naming != "transformers":
        raise ValueError(f"naming must be 'wan' or 'transformers', got {naming!r}")
    out = {"embeddings.patch_embedding.weight": (d, 3, p, p),
           "embeddings.class_embedding": (d,),
           "embeddings.position_embedding.weight": (config.num_tokens, d),
           "pre_layrnorm.weight": (d,), "pre_layrnorm.bias": (d,)}
    for i in range(config.output_blocks):
        b = f"encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out.update({f"{b}self_attn.{proj}.weight": (d, d), f"{b}self_attn.{proj}.bias": (d,)})
        out.update({b + "layer_norm1.weight": (d,), b + "layer_norm1.bias": (d,), b + "layer_norm2.weight": (d,),
                    b + "layer_norm2.bias": (d,), b + "mlp.fc1.weight": (h, d), b + "mlp.fc1.bias": (h,),
                    b + "mlp.fc2.weight": (d, h), b + "mlp.fc2.bias": (d,)})
    return out


def _skipped(name: str, naming: str, config: ClipVisionConfig) -> bool:
    """Tensors a checkpoint may hold that the penultimate-block encoder does not use."""
    if naming == "wan":
        if not name.startswith("visual.") or name.startswith(("visual.post_norm", "visual.head")):
            return True  # the text tower, the logit scale, the final norm and projection
        return name.startswith("visual.transformer.") and int(name.split(".")[2]) >= config.output_blocks
    if name.startswith(("post_layernorm", "visual_projection")) or name == "embeddings.position_ids":
        return True
    return name.startswith("encoder.layers.") and int(name.split(".")[2]) >= config.output_blocks


def load_clip_vision(source: str | os.PathLike[str] | dict[str, Any], config: ClipVisionConfig = ClipVisionConfig()
                     ) -> ClipVisionEncoder:
    """A :class:`ClipVisionEncoder` from the original ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``
    (torch's safe unpickler, memory-mapped), a transformers ``CLIPVisionModel`` directory / ``.safetensors``, or a
    dict of arrays. Missing, unexpected (other than the unused text tower, final norm, projection and last block),
    mis-shaped and non-floating tensors are refused by name (``CheckpointError``, a ValueError, naming the file)
    from the files' headers, before any tensor is read: a file is read lazily, only the tensors used, and a
    ``.pt`` tensor must be a view of bytes the file stores (no stride-0 expansion)."""
    tensors, where = _read(source)
    naming = "wan" if any(n.startswith("visual.") for n in tensors) else "transformers"
    if naming == "transformers":  # transformers 4 prefixes "vision_model.", 5 does not
        tensors = {n.removeprefix("vision_model."): t for n, t in tensors.items()}
    expected = clip_vision_names(config, naming)
    used = {n: t for n, t in tensors.items() if not _skipped(n, naming, config)}
    missing = sorted(set(expected) - set(used))
    unexpected = sorted(set(used) - set(expected))
    wrong = [f"{n} is {list(used[n].shape)}, needs {list(s)}" for n, s in expected.items()
             if n in used and tuple(used[n].shape) != s]
    wrong += [f"{n} is {used[n].dtype}, not floating-point" for n in expected
              if n in used and not jnp.issubdtype(used[n].dtype, jnp.floating)]
    if missing or unexpected or wrong:
        parts = [missing and f"missing tensors: {', '.join(missing[:8])}",
                 unexpected and f"unexpected tensors: {', '.join(unexpected[:8])}", "; ".join(wrong[:8])]
        raise CheckpointError(f"CLIP vision checkpoint {where}does not fit ({naming} names): "
                              + "; ".join(filter(None, parts)))
    with as_checkpoint_error():
        get = {n: np.asarray(t.read(), np.float32) for n, t in used.items()}
    d, p = config.dim, config.patch_size
    if naming == "wan":
        patch, cls, pos = (get["visual.patch_embedding.weight"], get["visual.cls_embedding"].reshape(d),
                           get["visual.pos_embedding"].reshape(-1, d))
        pre = (get["visual.pre_norm.weight"], get["visual.pre_norm.bias"])

        def block(i: int) -> dict[str, np.ndarray]:
            b = f"visual.transformer.{i}."
            return {"qkv_w": get[b + "attn.to_qkv.weight"], "qkv_b": get[b + "attn.to_qkv.bias"],
                    "proj_w": get[b + "attn.proj.weight"], "proj_b": get[b + "attn.proj.bias"],
                    "n1": (get[b + "norm1.weight"], get[b + "norm1.bias"]),
                    "n2": (get[b + "norm2.weight"], get[b + "norm2.bias"]),
                    "fc1": (get[b + "mlp.0.weight"], get[b + "mlp.0.bias"]),
                    "fc2": (get[b + "mlp.2.weight"], get[b + "mlp.2.bias"])}
    else:
        e = "embeddings."
        patch, cls, pos = (get[e + "patch_embedding.weight"], get[e + "class_embedding"],
                           get[e + "position_embedding.weight"])
        pre = (get["pre_layrnorm.weight"], get["pre_layrnorm.bias"])

        def block(i: int) -> dict[str, np.ndarray]:
            b = f"encoder.layers.{i}."
            a = b + "self_attn."
            return {"qkv_w": np.concatenate([get[f"{a}{x}_proj.weight"] for x in "qkv"]),
                    "qkv_b": np.concatenate([get[f"{a}{x}_proj.bias"] for x in "qkv"]),
                    "proj_w": get[a + "out_proj.weight"], "proj_b": get[a + "out_proj.bias"],
                    "n1": (get[b + "layer_norm1.weight"], get[b + "layer_norm1.bias"]),
                    "n2": (get[b + "layer_norm2.weight"], get[b + "layer_norm2.bias"]),
                    "fc1": (get[b + "mlp.fc1.weight"], get[b + "mlp.fc1.bias"]),
                    "fc2": (get[b + "mlp.fc2.weight"], get[b + "mlp.fc2.bias"])}

    model = nnx.eval_shape(lambda: ClipVisionEncoder(config, rngs=nnx.Rngs(0)))
    blocks = [block(i) for i in range(config.output_blocks)]
    stack = lambda f: jnp.asarray(np.stack([f(b) for b in blocks]))
    model.patch = nnx.Param(jnp.asarray(patch.reshape(d, 3 * p * p).T))
    model.class_token = nnx.Param(jnp.asarray(cls))
    model.positions = nnx.Param(jnp.asarray(pos))
    model.pre_norm_scale, model.pre_norm_bias = nnx.Param(jnp.asarray(pre[0])), nnx.Param(jnp.asarray(pre[1]))
    blocks_module = model.blocks
    blocks_module.qkv.kernel = nnx.Param(stack(lambda b: b["qkv_w"].T))
    blocks_module.qkv.bias = nnx.Param(stack(lambda b: b["qkv_b"]))
    blocks_module.proj.kernel = nnx.Param(stack(lambda b: b["proj_w"].T))
    blocks_module.proj.bias = nnx.Param(stack(lambda b: b["proj_b"]))
    blocks_module.fc1.kernel = nnx.Param(stack(lambda b: b["fc1"][0].T))
    blocks_module.fc1.bias = nnx.Param(stack(lambda b: b["fc1"][1]))
    blocks_module.fc2.kernel = nnx.Param(stack(lambda b: b["fc2"][0].T))
    blocks_module.fc2.bias = nnx.Param(stack(lambda b: b["fc2"][1]))
    blocks_module.norm1_scale, blocks_module.norm1_bias = (nnx.Param(stack(lambda b: b["n1"][0])),
                                                           nnx.Param(stack(lambda b: b["n1"][1])))
    blocks_module.norm2_scale, blocks_module.norm2_bias = (nnx.Param(stack(lambda b: b["n2"][0])),
                                                           nnx.Param(stack(lambda b: b["n2"][1])))
    return model


class _Array:
    """An in-memory array as a lazily read tensor (shape and dtype without a copy)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.shape = tuple(np.shape(value))
        dtype = getattr(value, "dtype", None)
        self.dtype = np.dtype(dtype) if isinstance(dtype, np.dtype) else np.asarray(value).dtype

    def read(self) -> Any:
        return self.value


def _read(source: Any) -> tuple[dict[str, Any], str]:
    """Name -> tensor (``shape``, ``dtype``, ``read()``), headers only, and the file for messages ("" for a dict)."""
    if isinstance(source, dict):
        return {str(k): _Array(v) for k, v in source.items()}, ""
    path = Path(source)
    if path.is_dir():
        path = path / "model.safetensors"
    with as_checkpoint_error():
        if path.suffix == ".safetensors":
            file = SafetensorsFile(path, max_header_bytes=header_budget(MAX_EXPECTED_TENSORS))
            return safetensors_tensors({path.name: file}), f"{path} "
        return torch_tensors(tensor_dict(torch_load(path), path, "the file"), path), f"{path} "
