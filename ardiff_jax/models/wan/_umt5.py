"""umT5-XXL, the text encoder that conditions Wan (Self-Forcing, LongLive, Krea), in Flax NNX.

Wan's ``umt5_xxl(encoder_only=True)`` is transformers' ``UMT5EncoderModel`` under other
names. The architecture (both agree):

* token embedding ``[vocab, d_model]`` (no scaling, no absolute positions);
* per layer: T5 RMS norm -> self-attention -> residual, T5 RMS norm -> gated FFN -> residual;
  a final T5 RMS norm;
* **a relative-position bias in every layer** (umT5; T5 and mT5 share layer 0's): a learned
  ``[num_buckets, heads]`` table indexed by the bucket of ``key - query`` (bidirectional:
  half the buckets per sign, half of those exact, the rest logarithmic up to
  ``max_distance``), added to the attention scores;
* T5 attention: the scores are **not** scaled by ``1/sqrt(d_kv)``; no biases anywhere;
* T5 RMS norm: no mean subtraction, no bias, the statistic in float32;
* gated tanh-GELU FFN: ``fc2(gelu_tanh(gate(x)) * fc1(x))``: Wan's ``ffn.gate.0`` is
  transformers' ``DenseReluDense.wi_0`` (through the GELU), ``ffn.fc1`` is ``wi_1``
  (linear), ``ffn.fc2`` is ``wo``.

Checkpoints :func:`load_umt5` reads (the format from the path, the naming from the names):

* Wan's ``models_t5_umt5-xxl-enc-bf16.pth`` (a ``torch.save`` state dict, read with torch's
  safe unpickler, possibly under one top-level key); keys ``token_embedding.weight``,
  ``blocks.{i}.{norm1,norm2}.weight``, ``blocks.{i}.attn.{q,k,v,o}.weight``,
  ``blocks.{i}.pos_embedding.embedding.weight``, ``blocks.{i}.ffn.{gate.0,fc1,fc2}.weight``,
  ``norm.weight``; or a Wan checkpoint directory holding that file;
* transformers / diffusers: a directory with ``config.json`` and ``model.safetensors`` or
  the shards ``model.safetensors.index.json`` lists (or a diffusers pipeline root with a
  ``text_encoder/`` folder); names ``shared.weight`` / ``encoder.embed_tokens.weight`` and
  ``encoder.block.{i}.layer.{0,1}.*``, ``encoder.final_layer_norm.weight``;
* a bare ``.safetensors`` / ``.pth`` / ``.bin`` file with either naming.

The tied embedding: transformers' ``save_pretrained`` writes ``shared.weight`` only, and a
diffusers ``text_encoder`` may too while its ``config.json`` says
``tie_word_embeddings: false`` (so transformers leaves ``encoder.embed_tokens`` random); the
encoder's embedding is ``encoder.embed_tokens.weight`` when stored, else ``shared.weight``,
and when both are stored they must be equal (checked before anything is placed).

:class:`WanTextEncoder` is Wan's ``T5EncoderModel.__call__``: clean the prompt (Wan's
``clean='whitespace'``), tokenize with the umT5 tokenizer (``tokenizer.json``, appending
``</s>``, truncated to ``text_len = 512``), encode with the padding masked out, and return
the rows of the true length (what Wan hands the DiT, which zero-pads them to 512 itself),
one jitted program for every prompt length and an LRU cache per prompt string.

Departures from Wan on purpose: the residual stream stays float32 when the activations
are bf16/fp16 (Wan keeps it in the activation dtype), the attention scores and the FFN
gate are formed in float32; in float32 every step is transformers' (tests/test_wan_umt5.py
measures the parity). ``fp16_clamp`` is reproduced for float16 activations.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax._files import read_regular_file
from ardiff_jax.models.wan._checkpoint import (
    CheckpointError,
    _as_checkpoint_error,
    _names,
    _path_name,
    _progress_bar,
    _read_json,
    _read_weights_dir,
    _safetensors_tensors,
    _Tensor,
    _tensor_dict,
    _torch,
    _torch_load,
    _torch_tensors,
    float_dtype_name,
    json_positive_float,
    json_positive_int,
)
from ardiff_jax.models.wan._safetensors import MAX_EXPECTED_TENSORS, SafetensorsFile, header_budget

__all__ = ["UMT5Config", "UMT5Encoder", "WanTextEncoder", "load_umt5", "umt5_config", "umt5_names",
           "relative_position_buckets", "clean_prompt", "WAN_UMT5_FILE"]

_F32 = jnp.float32

#: The file name of Wan's umT5 checkpoint (in every Wan 2.1 / 2.2 model directory).
WAN_UMT5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"

_HF_WEIGHTS = "model.safetensors"
#: The largest tokenizer.json read (umT5-XXL's is about 16 MB).
_MAX_TOKENIZER_BYTES = 64 * 2**20
_HF_INDEX = "model.safetensors.index.json"


# -- config ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UMT5Config:
    """Size of a :class:`UMT5Encoder`; the defaults are umT5-XXL's (Wan's text encoder).

    Attributes (transformers' ``UMT5Config`` spelling in brackets):
      vocab_size: embedding rows (256384; the tokenizer uses fewer).
      d_model: width of the residual stream and of the output features (4096).
      d_ff: hidden width of the gated FFN (10240).
      d_kv: width of one attention head (64); attention width ``num_heads * d_kv``.
      num_heads, num_layers: 64 heads, 24 layers.
      num_buckets, max_distance: relative-position buckets and the distance where the
        logarithmic buckets end (32, 128) [relative_attention_num_buckets / _max_distance].
      eps: RMS-norm epsilon (1e-6) [layer_norm_epsilon].
      dtype: activation (matmul) dtype; param_dtype: parameter dtype. Wan runs bf16.
    """

    vocab_size: int = 256384
    d_model: int = 4096
    d_ff: int = 10240
    d_kv: int = 64
    num_heads: int = 64
    num_layers: int = 24
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6
    dtype: str = "bfloat16"
    param_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "d_ff", "d_kv", "num_heads", "num_layers", "num_buckets",
                      "max_distance"):
            value = getattr(self, field)
            if type(value) is not int or value <= 0:
                raise ValueError(f"UMT5Config.{field} must be a positive int, got {value!r}")
        # Bidirectional buckets: num_buckets // 2 per sign, of which num_buckets // 4 exact; the
        # logarithmic ones need max_distance beyond the exact range.
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 4:
            raise ValueError(f"UMT5Config needs num_buckets >= 4 and max_distance > num_buckets // 4, got "
                             f"num_buckets={self.num_buckets}, max_distance={self.max_distance}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (
                math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"UMT5Config.eps must be a finite positive number, got {self.eps!r}")
        for field in ("dtype", "param_dtype"):
            try:
                dtype = jnp.dtype(getattr(self, field))
            except TypeError:
                raise ValueError(f"UMT5Config.{field} {getattr(self, field)!r} is not a dtype") from None
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"UMT5Config.{field} must be a floating dtype, got {dtype.name}")
            object.__setattr__(self, field, dtype.name)

    @property
    def inner_dim(self) -> int:
        """Attention width: ``num_heads * d_kv`` (4096 for XXL)."""
        return self.num_heads * self.d_kv

    def replace(self, **changes: Any) -> UMT5Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **changes: Any) -> UMT5Config:
        """A 2-layer float32 umT5 for CPU tests: width 32, FFN 48, 4 heads x 8, umT5's 32 buckets / 128, vocab 300."""
        base = cls(vocab_size=300, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2,
                   dtype="float32", param_dtype="float32")
        return base.replace(**changes)


# -- relative positions ------------------------------------------------------------------------------


def relative_position_buckets(relative_position: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional bucket of each ``key - query`` offset: ``int[...]`` -> ``int32[...]`` in ``[0, num_buckets)``.

    Evaluated on the host in float32 with transformers' (and Wan's) operation order, so the
    logarithmic boundaries (offsets 16, 32, 64 for umT5, where the ratio is an integer up
    to rounding) fall on the same side as theirs.
    """
    rel = np.asarray(relative_position, np.int64)
    half = num_buckets // 2
    buckets = (rel > 0).astype(np.int64) * half
    rel = np.abs(rel)
    max_exact = half // 2
    is_small = rel < max_exact
    safe = np.where(is_small, max_exact, rel).astype(np.float32)  # log(0) never evaluated
    ratio = np.log(safe / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
    ratio = ratio * np.float32(half - max_exact)
    large = np.minimum(max_exact + ratio.astype(np.int64), half - 1)  # astype truncates, as .to(torch.long)
    return (buckets + np.where(is_small, rel, large)).astype(np.int32)


def _bucket_table(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """``int32[2 * length - 1]``: the bucket of offset ``d - (length - 1)`` at index ``d``."""
    return relative_position_buckets(np.arange(-(length - 1), length), num_buckets, max_distance)


# -- modules -------------------------------------------------------------------------------------------


def _normal(std: float) -> Any:
    return nnx.initializers.normal(stddev=std)


def _precision(config: UMT5Config) -> jax.lax.Precision | None:
    # float32 is the parity mode: full float32 products (XLA may otherwise use TF32 on GPUs,
    # where torch's float32 matmuls do not). bf16/fp16 run at the default precision.
    return jax.lax.Precision.HIGHEST if config.dtype == "float32" else None


def _linear(config: UMT5Config, din: int, dout: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    # No biases in T5; init as transformers' _init_weights (factor 1), for random use only.
    return nnx.Linear(din, dout, use_bias=False, dtype=config.dtype, param_dtype=config.param_dtype,
                      precision=_precision(config), kernel_init=_normal(std), rngs=rngs)


class T5RMSNorm(nnx.Module):
    """T5's layer norm: ``x * rsqrt(mean(x^2) + eps) * weight``, no mean, no bias, in float32."""

    def __init__(self, dim: int, eps: float, param_dtype: str) -> None:
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``f32[..., dim]`` -> ``f32[..., dim]``."""
        xf = x.astype(_F32)
        out = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return out * self.weight[...].astype(_F32)


class UMT5Attention(nnx.Module):
    """T5 self-attention (no ``1/sqrt(d)`` scaling); the relative bias is the layer's own."""

    def __init__(self, config: UMT5Config, rngs: nnx.Rngs) -> None:
        d, inner = config.d_model, config.inner_dim
        self.config = config
        self.q = _linear(config, d, inner, (d * config.d_kv) ** -0.5, rngs)
        self.k = _linear(config, d, inner, d ** -0.5, rngs)
        self.v = _linear(config, d, inner, d ** -0.5, rngs)
        self.o = _linear(config, inner, d, inner ** -0.5, rngs)

    def __call__(
        self,
        h: jax.Array,  # [B, N, d_model] in config.dtype: the normed residual stream
        bias: jax.Array,  # f32[H, N, N]: the layer's relative-position bias
        key_mask: jax.Array,  # bool[B, N]: True at real tokens
    ) -> jax.Array:  # [B, N, d_model]
        cfg = self.config
        b, n, _ = h.shape
        q = self.q(h).reshape(b, n, cfg.num_heads, cfg.d_kv)
        k = self.k(h).reshape(b, n, cfg.num_heads, cfg.d_kv)
        v = self.v(h).reshape(b, n, cfg.num_heads, cfg.d_kv)
        precision = _precision(cfg)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=_F32) + bias[None]
        # Padding keys get the lowest float (transformers adds it, Wan fills it): their
        # weight is exactly 0 after the softmax. Every row has a real key (at least </s>).
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(_F32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision, preferred_element_type=_F32)
        return self.o(out.astype(cfg.dtype).reshape(b, n, cfg.inner_dim))


class UMT5FeedForward(nnx.Module):
    """Gated tanh-GELU FFN: ``fc2(gelu_tanh(gate(x)) * fc1(x))`` (transformers: wi_0, wi_1, wo)."""

    def __init__(self, config: UMT5Config, rngs: nnx.Rngs) -> None:
        d, f = config.d_model, config.d_ff
        self.config = config
        self.gate = _linear(config, d, f, d ** -0.5, rngs)
        self.fc1 = _linear(config, d, f, d ** -0.5, rngs)
        self.fc2 = _linear(config, f, d, f ** -0.5, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        """``[..., d_model]`` -> ``[..., d_model]``."""
        # gelu_new (transformers) = Wan's GELU = the tanh approximation.
        hidden = jax.nn.gelu(self.gate(h).astype(_F32), approximate=True) * self.fc1(h).astype(_F32)
        return self.fc2(hidden.astype(self.config.dtype))


class UMT5Block(nnx.Module):
    """One umT5 encoder layer: pre-norm self-attention with the layer's own position bias, pre-norm FFN."""

    def __init__(self, config: UMT5Config, rngs: nnx.Rngs) -> None:
        self.config = config
        self.norm1 = T5RMSNorm(config.d_model, config.eps, config.param_dtype)
        self.attn = UMT5Attention(config, rngs)
        self.pos_embedding = nnx.Param(
            _normal(config.d_model ** -0.5)(rngs.params(), (config.num_buckets, config.num_heads), config.param_dtype))
        self.norm2 = T5RMSNorm(config.d_model, config.eps, config.param_dtype)
        self.ffn = UMT5FeedForward(config, rngs)

    def __call__(
        self,
        x: jax.Array,  # f32[B, N, d_model]: the residual stream
        buckets: jax.Array,  # i32[N, N]: bucket of key - query
        key_mask: jax.Array,  # bool[B, N]
    ) -> jax.Array:  # f32[B, N, d_model]
        cfg = self.config
        bias = jnp.take(self.pos_embedding[...].astype(_F32).T, buckets, axis=1)  # [H, N, N]
        x = _fp16_clamp(x + self.attn(self.norm1(x).astype(cfg.dtype), bias, key_mask).astype(_F32), cfg)
        x = _fp16_clamp(x + self.ffn(self.norm2(x).astype(cfg.dtype)).astype(_F32), cfg)
        return x


def _fp16_clamp(x: jax.Array, config: UMT5Config) -> jax.Array:
    """Wan's ``fp16_clamp`` for float16 activations: when the stream overflows float16, clamp it to
    ``max - 1000``. The stream here is float32, so "overflows" is read off its float16 cast."""
    if config.dtype != "float16":
        return x
    limit = float(jnp.finfo(jnp.float16).max) - 1000.0
    overflow = jnp.any(jnp.isinf(x.astype(jnp.float16)))
    return jnp.where(overflow, jnp.clip(x, -limit, limit), x)


class UMT5Encoder(nnx.Module):
    """The umT5 encoder stack (see the module docstring): token ids -> ``f32`` features.

    Example::

        encoder = load_umt5("Wan2.1-T2V-1.3B/models_t5_umt5-xxl-enc-bf16.pth")
        features = encoder(ids, mask)   # i32[N], bool[N] -> f32[N, 4096]

    The layers are stacked (``nnx.vmap`` at construction) and run with ``jax.lax.scan``, so
    compile time does not grow with depth. Padding positions are computed (and masked as
    keys), not zeroed: :class:`WanTextEncoder` zeroes them as Wan does.
    """

    def __init__(self, config: UMT5Config, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, UMT5Config):
            raise TypeError(f"config must be a UMT5Config, got {type(config).__name__}")
        self.config = config
        self.token_embedding = nnx.Param(
            _normal(1.0)(rngs.params(), (config.vocab_size, config.d_model), config.param_dtype))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> UMT5Block:
            return UMT5Block(config, rngs)

        self.blocks = make_blocks(rngs)
        self.norm = T5RMSNorm(config.d_model, config.eps, config.param_dtype)

    def __call__(
        self,
        token_ids: jax.Array,  # i32[N] or i32[B, N]
        mask: jax.Array | None = None,  # bool/int [N] or [B, N]: nonzero at real tokens; None: all real
    ) -> jax.Array:  # f32[N, d_model] or f32[B, N, d_model]
        cfg = self.config
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim not in (1, 2) or not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise ValueError(f"token_ids must be integer [N] or [B, N], got {token_ids.dtype}{list(token_ids.shape)}")
        single = token_ids.ndim == 1
        ids = token_ids[None] if single else token_ids
        if mask is None:
            key_mask = jnp.ones(ids.shape, bool)
        else:
            mask = jnp.asarray(mask)
            if mask.shape != token_ids.shape:
                raise ValueError(f"mask must have the shape of token_ids {list(token_ids.shape)}, "
                                 f"got {list(mask.shape)}")
            key_mask = (mask[None] if single else mask) != 0
        n = ids.shape[1]
        # Host-built bucket table (float32 as transformers evaluates it), indexed by key - query.
        table = jnp.asarray(_bucket_table(n, cfg.num_buckets, cfg.max_distance))
        positions = jnp.arange(n)
        buckets = table[positions[None, :] - positions[:, None] + (n - 1)]

        x = jnp.take(self.token_embedding[...], ids, axis=0).astype(_F32)
        graphdef, stacked = nnx.split(self.blocks)

        def layer_step(x: jax.Array, state: Any) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, state)(x, buckets, key_mask), None

        x, _ = jax.lax.scan(layer_step, x, stacked)
        out = self.norm(x)
        return out[0] if single else out

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(self, nnx.Param)))


# -- the name mapping ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: str  # our flat parameter path
    source: str  # Wan's name ({i}: the layer)
    kind: str  # "linear" (transpose [out, in] -> [in, out]) or "copy"

    @property
    def per_layer(self) -> bool:
        return self.source.startswith("blocks.")


_MAPPING = (
    [_Entry("token_embedding", "token_embedding.weight", "copy"), _Entry("norm.weight", "norm.weight", "copy")]
    + [_Entry(f"blocks.{n}.weight", f"blocks.{{i}}.{n}.weight", "copy") for n in ("norm1", "norm2")]
    + [_Entry(f"blocks.attn.{p}.kernel", f"blocks.{{i}}.attn.{p}.weight", "linear") for p in "qkvo"]
    + [_Entry("blocks.pos_embedding", "blocks.{i}.pos_embedding.embedding.weight", "copy")]
    + [_Entry(f"blocks.ffn.{ours}.kernel", f"blocks.{{i}}.ffn.{theirs}.weight", "linear")
       for ours, theirs in (("gate", "gate.0"), ("fc1", "fc1"), ("fc2", "fc2"))]
)
_BY_PATH = {entry.path: entry for entry in _MAPPING}

#: transformers' per-layer names -> Wan's.
_HF_BLOCK = {
    "layer.0.layer_norm.weight": "norm1.weight",
    "layer.0.SelfAttention.q.weight": "attn.q.weight",
    "layer.0.SelfAttention.k.weight": "attn.k.weight",
    "layer.0.SelfAttention.v.weight": "attn.v.weight",
    "layer.0.SelfAttention.o.weight": "attn.o.weight",
    "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
    "layer.1.layer_norm.weight": "norm2.weight",
    "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",  # through the GELU
    "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",  # the linear branch
    "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight",
}
_HF_BLOCK_NAME = re.compile(r"encoder\.block\.(\d+)\.(.+)")
_WAN_BLOCK_NAME = re.compile(r"blocks\.(\d+)\..+")
_HF_EMBEDDINGS = ("encoder.embed_tokens.weight", "shared.weight")  # the encoder reads the first


def _hf_to_wan(name: str) -> str | None:
    if name == "encoder.final_layer_norm.weight":
        return "norm.weight"
    match = _HF_BLOCK_NAME.fullmatch(name)
    if match and match.group(2) in _HF_BLOCK:
        return f"blocks.{match.group(1)}.{_HF_BLOCK[match.group(2)]}"
    return None


def umt5_names(config: UMT5Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of Wan's umT5 state dict for ``config`` and its (torch) shape."""
    d, f, inner, h = config.d_model, config.d_ff, config.inner_dim, config.num_heads
    per_layer = {"norm1.weight": (d,), "norm2.weight": (d,), "attn.q.weight": (inner, d),
                 "attn.k.weight": (inner, d), "attn.v.weight": (inner, d), "attn.o.weight": (d, inner),
                 "pos_embedding.embedding.weight": (config.num_buckets, h), "ffn.gate.0.weight": (f, d),
                 "ffn.fc1.weight": (f, d), "ffn.fc2.weight": (d, f)}
    out = {"token_embedding.weight": (config.vocab_size, d)}
    for i in range(config.num_layers):
        out.update({f"blocks.{i}.{name}": shape for name, shape in per_layer.items()})
    out["norm.weight"] = (d,)
    return out


# -- opening a checkpoint (headers only) ------------------------------------------------------------------


@dataclasses.dataclass
class _Opened:
    path: Path
    naming: str  # "wan" or "transformers"
    tensors: dict[str, _Tensor]  # Wan name -> tensor
    twin: _Tensor | None  # shared.weight when encoder.embed_tokens.weight is stored too: must be equal
    json: dict[str, Any] | None  # transformers' config.json, if any
    json_path: Path | None

    def describe(self, name: str) -> str:
        stored = self.tensors[name].stored
        return name if stored == name else f"{stored} (= {name})"


def _read_index_dir(directory: Path) -> dict[str, _Tensor]:
    """``model.safetensors`` or the shards ``model.safetensors.index.json`` lists, cross-checked."""
    return _read_weights_dir(directory, _HF_WEIGHTS, _HF_INDEX, max_tensors=MAX_EXPECTED_TENSORS)


_STATE_KEYS = ("state_dict", "model", "module", "text_encoder", "t5")


def _pick_state(obj: Any, path: Path) -> dict[str, Any]:
    """The state dict in a ``torch.save`` file: the file itself, or the one under a top-level key."""
    torch = _torch()
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _tensor_dict(obj, path, "the file")
    nested = {k: v for k, v in obj.items() if isinstance(v, dict) and v
              and all(isinstance(t, torch.Tensor) for t in v.values())}
    for key in _STATE_KEYS:
        if key in nested:
            return _tensor_dict(nested[key], path, f"entry {key!r}")
    if len(nested) == 1:
        key = next(iter(nested))
        return _tensor_dict(nested[key], path, f"entry {key!r}")
    raise CheckpointError(f"{path} holds no single state dict (top-level keys: {_names(map(str, obj))})")


_PREFIXES = ("model.", "module.", "text_encoder.", "t5.", "umt5.")


def _strip_prefix(names: list[str]) -> dict[str, str]:
    """Stored name -> name without one wrapper prefix that every name carries."""
    for prefix in _PREFIXES:
        if names and all(n.startswith(prefix) for n in names):
            return {n: n[len(prefix):] for n in names}
    return {n: n for n in names}


def _locate(path: Path) -> tuple[str, Path]:
    """``("dir" | "torch" | "safetensors", path)``."""
    if path.name == _HF_INDEX:
        path = path.parent
    if path.is_dir():
        if (path / WAN_UMT5_FILE).is_file():
            return "torch", path / WAN_UMT5_FILE
        if not (path / "config.json").exists() and (path / "text_encoder" / "config.json").exists():
            path = path / "text_encoder"
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} is a directory without config.json (nor text_encoder/config.json, nor "
                                  f"{WAN_UMT5_FILE}): not a umT5 checkpoint directory")
        return "dir", path
    if not path.exists():
        raise FileNotFoundError(f"umT5 checkpoint {path} does not exist")
    if path.suffix in (".pth", ".pt", ".bin"):
        return "torch", path
    if path.suffix == ".safetensors":
        return "safetensors", path
    raise CheckpointError(f"cannot tell the format of {path}: pass Wan's {WAN_UMT5_FILE}, a .safetensors file, or "
                          "a transformers/diffusers directory (config.json + model.safetensors)")


def _open(path: str | os.PathLike[str]) -> _Opened:
    kind, path = _locate(Path(path))
    data, json_path = None, None
    if kind == "dir":
        json_path = path / "config.json"
        data = _read_json(json_path)
        stored = _read_index_dir(path)
    elif kind == "safetensors":
        stored = _safetensors_tensors({path.name: SafetensorsFile(
            path, max_header_bytes=header_budget(MAX_EXPECTED_TENSORS))})
    else:
        stored = _torch_tensors(_pick_state(_torch_load(path), path), path)

    cleaned = _strip_prefix(list(stored))
    names = set(cleaned.values())
    hf = any(n.startswith("encoder.") or n == "shared.weight" for n in names)
    tensors: dict[str, _Tensor] = {}
    twin = None
    unknown, decoder = [], []
    if hf:
        present = [n for n in _HF_EMBEDDINGS if n in names]
        by_clean = {clean: stored[name] for name, clean in cleaned.items()}
        if present:
            tensors["token_embedding.weight"] = by_clean[present[0]]
            if len(present) == 2:
                twin = by_clean[present[1]]
        for name, clean in cleaned.items():
            if clean in _HF_EMBEDDINGS:
                continue
            wan = _hf_to_wan(clean)
            if wan is None:
                (decoder if clean.startswith(("decoder.", "lm_head.")) else unknown).append(name)
            else:
                tensors[wan] = stored[name]
    else:
        tensors = {clean: stored[name] for name, clean in cleaned.items()}
    if decoder:
        raise CheckpointError(f"{path} is a full encoder-decoder umT5 (it holds decoder tensors: "
                              f"{_names(decoder, 4)}); "
                              "load the encoder alone (transformers' UMT5EncoderModel.save_pretrained, or Wan's "
                              f"{WAN_UMT5_FILE})")
    if unknown:
        raise CheckpointError(f"{path} holds unexpected tensors (no parameter of the umT5 encoder takes them): "
                              f"{_names(unknown)}")
    return _Opened(path, "transformers" if hf else "wan", tensors, twin, data, json_path)


# -- config: from the tensors, config.json and the caller -------------------------------------------------


def _geometry(opened: _Opened) -> dict[str, tuple[int, str]]:
    """What the tensors say: config field -> (value, the tensor saying it)."""
    t = opened.tensors
    out: dict[str, tuple[int, str]] = {}

    def take(field: str, name: str, axis: int) -> None:
        if name in t and len(t[name].shape) > axis:
            out[field] = (t[name].shape[axis], f"{opened.describe(name)} {list(t[name].shape)}")

    take("vocab_size", "token_embedding.weight", 0)
    take("d_model", "token_embedding.weight", 1)
    take("d_ff", "blocks.0.ffn.fc1.weight", 0)
    take("num_buckets", "blocks.0.pos_embedding.embedding.weight", 0)
    take("num_heads", "blocks.0.pos_embedding.embedding.weight", 1)
    q = t.get("blocks.0.attn.q.weight")
    if "num_heads" in out and q is not None and len(q.shape) == 2 and q.shape[0] % out["num_heads"][0] == 0:
        out["d_kv"] = (q.shape[0] // out["num_heads"][0],
                       f"{opened.describe('blocks.0.attn.q.weight')} {list(q.shape)} over {out['num_heads'][0]} heads")
    layers = sorted({int(m.group(1)) for m in map(_WAN_BLOCK_NAME.fullmatch, t) if m})
    if layers:
        out["num_layers"] = (layers[-1] + 1, f"the highest layer index, {layers[-1]}")
    return out


#: Our field -> transformers' config.json field.
_JSON_FIELDS = {"vocab_size": "vocab_size", "d_model": "d_model", "d_ff": "d_ff", "d_kv": "d_kv",
                "num_heads": "num_heads", "num_layers": "num_layers",
                "num_buckets": "relative_attention_num_buckets",
                "max_distance": "relative_attention_max_distance", "eps": "layer_norm_epsilon"}


def _json_values(opened: _Opened) -> dict[str, Any]:
    data = opened.json
    if data is None:
        return {}
    where = opened.json_path
    model_type = data.get("model_type", "umt5")
    if model_type != "umt5":
        raise CheckpointError(f"{where}: model_type {model_type!r} is not 'umt5' (T5 and mT5 share one "
                              "relative-position bias in layer 0; umT5 has one per layer)")
    proj = data.get("feed_forward_proj", "gated-gelu")
    act = data.get("dense_act_fn", "gelu_new")
    if proj != "gated-gelu" or act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{where}: feed_forward_proj={proj!r} / dense_act_fn={act!r}: the umT5 encoder here is "
                              "the gated tanh-GELU FFN (feed_forward_proj 'gated-gelu', gelu_new) of umT5")
    # Each field checked here, naming the file and the field: a bool, string, NaN or infinite epsilon
    # would load and give NaN or zero features.
    return {ours: json_positive_float(where, theirs, data[theirs]) if ours == "eps"
            else json_positive_int(where, theirs, data[theirs])
            for ours, theirs in _JSON_FIELDS.items() if theirs in data}


def _float_dtype(opened: _Opened) -> str:
    """The checkpoint's floating dtype (the embedding's), for a config inferred from the file."""
    tensor = opened.tensors.get("token_embedding.weight")
    if tensor is not None and jnp.issubdtype(tensor.dtype, jnp.floating):
        return jnp.dtype(tensor.dtype).name
    return "float32"


def _resolve_config(opened: _Opened, config: UMT5Config | None, dtype: Any) -> UMT5Config:
    geometry = _geometry(opened)
    js = _json_values(opened)
    for field, (value, where) in geometry.items():
        if field in js and js[field] != value:
            raise CheckpointError(f"{opened.json_path} disagrees with the tensors: {_JSON_FIELDS[field]} = "
                                  f"{js[field]!r} but {where} says {value}")
    if config is None:
        needed = {"vocab_size": "token_embedding.weight", "d_model": "token_embedding.weight",
                  "d_ff": "blocks.0.ffn.fc1.weight", "num_heads": "blocks.0.pos_embedding.embedding.weight",
                  "num_buckets": "blocks.0.pos_embedding.embedding.weight", "d_kv": "blocks.0.attn.q.weight",
                  "num_layers": "blocks.0.*"}
        absent = sorted({name for field, name in needed.items() if field not in geometry})
        if absent:
            raise CheckpointError(f"{opened.path}: cannot infer the encoder's size, missing or mis-shaped tensors: "
                                  f"{', '.join(absent)} (pass config= to get the full list of what is wrong)")
        values: dict[str, Any] = {field: value for field, (value, _) in geometry.items()}
        values.update({f: js[f] for f in ("max_distance", "eps") if f in js})
        needed = 2 + 10 * values["num_layers"]  # one stray "blocks.99999999.*" must not size the encoder
        if needed > 2 * len(opened.tensors) + 64:  # (a few missing tensors are left to the check naming them)
            raise CheckpointError(f"{opened.path}: {geometry['num_layers'][1]} makes an encoder of "
                                  f"{values['num_layers']} layers ({needed} tensors) but the checkpoint holds "
                                  f"{len(opened.tensors)}: corrupt, or pass config=")
        stored = _float_dtype(opened)
        try:
            config = UMT5Config(**values, dtype=stored, param_dtype=stored)
        except ValueError as error:
            raise CheckpointError(f"{opened.path}: the tensors describe no valid umT5 ({error})") from None
    elif not isinstance(config, UMT5Config):
        raise TypeError(f"config must be a UMT5Config or None, got {type(config).__name__}")
    else:
        for field, (value, where) in geometry.items():
            if getattr(config, field) != value:
                raise CheckpointError(f"the config disagrees with the checkpoint {opened.path}: {field} = "
                                      f"{getattr(config, field)} but {where} says {value}")
        for field in ("max_distance", "eps"):
            if field in js and not math.isclose(js[field], getattr(config, field), rel_tol=1e-9):
                raise CheckpointError(f"the config disagrees with {opened.json_path}: {field} = "
                                      f"{getattr(config, field)} but {_JSON_FIELDS[field]} = {js[field]}")
    if dtype is not None:
        name = float_dtype_name(dtype)
        config = config.replace(dtype=name, param_dtype=name)
    return config


def umt5_config(path: str | os.PathLike[str]) -> UMT5Config:
    """The :class:`UMT5Config` :func:`load_umt5` builds for ``path`` without ``config=`` (headers only).

    Sizes from the tensor shapes (``d_kv`` = the q rows over the heads of the position-bias
    table), ``max_distance`` and ``eps`` from ``config.json`` when there is one (else 128 and
    1e-6, Wan's), dtype from the stored embedding (bf16 for Wan's file).
    """
    with _as_checkpoint_error():
        opened = _open(path)
    return _resolve_config(opened, None, None)


# -- loading ----------------------------------------------------------------------------------------------


def _check(opened: _Opened, expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if n not in opened.tensors]
    if opened.naming == "transformers" and "token_embedding.weight" in missing:
        missing[missing.index("token_embedding.weight")] = "shared.weight (or encoder.embed_tokens.weight)"
    unexpected = [opened.describe(n) for n in opened.tensors if n not in expected]
    if missing or unexpected:
        parts = ([f"missing tensors: {_names(missing)}"] if missing else []) + (
            [f"unexpected tensors: {_names(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"{opened.path} does not match the umT5 encoder: " + "; ".join(parts))
    wrong = [f"{opened.describe(n)} is {list(opened.tensors[n].shape)}, the encoder needs {list(shape)}"
             for n, shape in expected.items() if opened.tensors[n].shape != shape]
    twin = opened.twin
    if twin is not None and twin.shape != expected["token_embedding.weight"]:
        wrong.append(f"{twin.stored} is {list(twin.shape)}, the encoder needs "
                     f"{list(expected['token_embedding.weight'])}")
    if wrong:
        raise CheckpointError(f"{opened.path} has mis-shaped tensors: " + "; ".join(wrong[:12])
                              + (f"; ... ({len(wrong) - 12} more)" if len(wrong) > 12 else ""))
    tensors = list(opened.tensors.values()) + ([twin] if twin is not None else [])
    not_float = [f"{t.stored} ({t.dtype})" for t in tensors if not jnp.issubdtype(t.dtype, jnp.floating)]
    if not_float:
        raise CheckpointError(f"{opened.path} has non-floating-point tensors: {_names(not_float)}")
    if twin is not None:
        _check_tied(opened.tensors["token_embedding.weight"], twin, opened.path)


def _check_tied(primary: _Tensor, twin: _Tensor, path: Path, rows: int = 16384) -> None:
    """Both embeddings stored: they must be one tensor (compared in row chunks, off the memory maps)."""
    a, b = primary.read(), twin.read()
    for start in range(0, a.shape[0], rows):
        x, y = np.asarray(a[start:start + rows]), np.asarray(b[start:start + rows])
        if x.dtype != y.dtype:
            x, y = x.astype(np.float32), y.astype(np.float32)
        if not np.array_equal(x, y):
            raise CheckpointError(f"{path} stores two different token embeddings, {primary.stored} and {twin.stored} "
                                  f"(first difference in rows {start}..{start + len(x) - 1}); umT5's encoder has one")


def _device(device: Any) -> jax.Device:
    if device is None:
        return jax.devices()[0]
    if isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        platform = "cpu" if device in ("host", "cpu") else device
        try:
            return jax.devices(platform)[0]
        except RuntimeError as error:
            raise ValueError(f"device {device!r}: no such JAX platform here ({error})") from None
    raise TypeError(f"device must be None, 'host', a platform name or a jax.Device, got {type(device).__name__}")


def _transform(entry: _Entry, array: np.ndarray) -> np.ndarray:
    return array.T if entry.kind == "linear" else array


def load_umt5(
    path: str | os.PathLike[str],
    config: UMT5Config | None = None,
    *,
    dtype: Any = None,
    device: Any = None,
    progress: bool | None = None,
) -> UMT5Encoder:
    """A :class:`UMT5Encoder` holding a umT5 encoder checkpoint (see the module docstring for the formats).

    Args:
      path: Wan's ``models_t5_umt5-xxl-enc-bf16.pth`` (or a Wan model directory holding it), a
        transformers / diffusers directory (``config.json`` + ``model.safetensors`` or its
        shard index; a diffusers pipeline root's ``text_encoder/``), or a bare
        ``.safetensors`` / ``.pth`` / ``.bin`` file with Wan's or transformers' names.
      config: None: :func:`umt5_config` (sizes from the tensors). Refused when it disagrees
        with the tensors or with config.json.
      dtype: parameter and activation dtype (replaces the config's); None: the config's
        (for an inferred config, the stored dtype: bf16 for Wan's file).
      device: where the weights go: None: ``jax.devices()[0]`` (the accelerator when there
        is one); ``"host"`` / ``"cpu"``: ``jax.devices("cpu")[0]``; a platform name; a
        ``jax.Device``. The encoder then runs there.
      progress: a tqdm bar over bytes; None: shown for checkpoints over 256 MiB.

    Raises:
      CheckpointError: (a ValueError) missing, unexpected (decoder ones included),
        mis-shaped or non-float tensors, two different stored embeddings, a corrupt or
        truncated file, a missing shard, a config / config.json that disagrees with the
        tensors; the message names them. Nothing is placed on a device before every check
        has passed.
    """
    with _as_checkpoint_error():
        opened = _open(path)
        config = _resolve_config(opened, config, dtype)
        expected = umt5_names(config)
        _check(opened, expected)
    target_device = _device(device)

    abstract = nnx.eval_shape(lambda: UMT5Encoder(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    paths = [_path_name(p) for p, _ in flat]
    if sorted(paths) != sorted(_BY_PATH):  # pragma: no cover - UMT5Encoder and this table changed apart
        raise RuntimeError(f"UMT5Encoder's parameters no longer match the mapping: "
                           f"{sorted(set(paths) ^ set(_BY_PATH))}")

    used: Counter[str] = Counter()
    if opened.twin is not None:
        used[opened.twin.stored] += 1  # read and compared by _check: the tied embedding counted once
    stored_names = {t.stored for t in opened.tensors.values()} | ({opened.twin.stored} if opened.twin else set())
    bar = _progress_bar(progress, sum(t.nbytes for t in opened.tensors.values()), opened.path)

    def read(name: str) -> np.ndarray:
        tensor = opened.tensors[name]
        used[tensor.stored] += 1
        if bar is not None:
            bar.update(tensor.nbytes)
        return tensor.read()

    leaves = []
    try:
        for name, (_, spec) in zip(paths, flat):
            entry = _BY_PATH[name]
            target = jnp.dtype(spec.dtype)
            if entry.per_layer:
                host = np.empty(spec.shape, target)
                for i in range(config.num_layers):
                    host[i] = _transform(entry, read(entry.source.format(i=i)))
            else:
                host = np.array(_transform(entry, read(entry.source)), dtype=target)
            leaves.append(jax.device_put(host, target_device))
            del host
    finally:
        if bar is not None:
            bar.close()
    wrong = sorted(n for n in stored_names if used[n] != 1) + sorted(set(used) - stored_names)
    if wrong:  # pragma: no cover - the mapping is a bijection (the tied twin counted once)
        raise RuntimeError("checkpoint tensors not used exactly once: " + ", ".join(f"{n} x{used[n]}" for n in wrong))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


# -- Wan's prompt -> embeddings ---------------------------------------------------------------------------


def clean_prompt(text: str) -> str:
    """Wan's ``clean='whitespace'``: ``ftfy.fix_text`` (only when ftfy is installed), ``html.unescape``
    twice, strip, every run of whitespace -> one space, strip."""
    if not isinstance(text, str):
        raise TypeError(f"prompt must be a string, got {type(text).__name__}")
    try:
        import ftfy
    except ImportError:  # Wan requires ftfy; without it mojibake is left as typed
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _tokenizer_file(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "tokenizer.json", path / "google" / "umt5-xxl" / "tokenizer.json"):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"{path} holds no tokenizer.json (Wan ships google/umt5-xxl/tokenizer.json in its "
                                "model directory; a spiece.model alone is not read)")
    if not path.exists():  # (anything else that is not a regular file is refused, by name, when read)
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    return path


class WanTextEncoder:
    """Prompt -> umT5 features, as Wan conditions its DiT (``prompt_embeds``).

    Example::

        encoder = load_umt5("Wan2.1-T2V-1.3B/models_t5_umt5-xxl-enc-bf16.pth")
        text = WanTextEncoder(encoder, "Wan2.1-T2V-1.3B/google/umt5-xxl/tokenizer.json")
        embeds = text.encode("a cat surfing a wave")   # f32[L, 4096], L = tokens incl. </s>
        inputs = {"prompt_embeds": embeds}             # CausalWanPipeline zero-pads to 512

    The prompt is cleaned (:func:`clean_prompt`), tokenized by ``tokenizers.Tokenizer`` from
    the given ``tokenizer.json`` (its own normalizer and pre-tokenizer, as transformers' fast
    tokenizer uses them; ``</s>`` appended by the file's post-processor, or by T5's template
    when the file has none), truncated to ``text_len`` tokens (``</s>`` kept last, as
    transformers truncates with ``max_length``), padded with ``<pad>`` to ``text_len``, encoded
    with the padding masked out, and the rows at or past the true length set to 0.0. Every
    prompt runs the same jitted program (``[text_len]`` ids and the length), so a new length
    never recompiles; results are kept per prompt string in an LRU of ``cache_size`` entries
    and returned read-only (the same array object on a hit).
    """

    def __init__(self, encoder: UMT5Encoder, tokenizer_path: str | os.PathLike[str], *, text_len: int = 512,
                 cache_size: int = 32) -> None:
        if not isinstance(encoder, UMT5Encoder):
            raise TypeError(f"encoder must be a UMT5Encoder, got {type(encoder).__name__}")
        if type(text_len) is not int or text_len < 2:
            raise ValueError(f"text_len must be an int >= 2 (a token and </s>), got {text_len!r}")
        if type(cache_size) is not int or cache_size < 0:
            raise ValueError(f"cache_size must be a non-negative int, got {cache_size!r}")
        from tokenizers import Tokenizer, processors

        self.encoder = encoder
        self.text_len = text_len
        self.cache_size = cache_size
        self.tokenizer_path = _tokenizer_file(tokenizer_path)
        # A regular file of bounded size (umT5's is 16 MB), read here: a FIFO or /dev/zero is refused.
        raw = read_regular_file(self.tokenizer_path, max_bytes=_MAX_TOKENIZER_BYTES, what="tokenizer file")
        try:
            tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"tokenizer file {self.tokenizer_path} is not UTF-8 (at byte {error.start})") from None
        except Exception as error:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise ValueError(f"tokenizer file {self.tokenizer_path} is not a tokenizer.json: "
                             f"{str(error)[:200]}") from None
        self.eos_id = tokenizer.token_to_id("</s>")
        self.pad_id = tokenizer.token_to_id("<pad>")
        if self.eos_id is None or self.pad_id is None:
            raise ValueError(f"{self.tokenizer_path} is not a umT5 tokenizer: it has no "
                             + " and no ".join(t for t, i in (("</s>", self.eos_id), ("<pad>", self.pad_id))
                                               if i is None) + " token")
        if tokenizer.post_processor is None:
            tokenizer.post_processor = processors.TemplateProcessing(
                single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", self.eos_id)])
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=text_len)  # the post-processor's </s> counted in
        probe = tokenizer.encode("a").ids
        if not probe or probe[-1] != self.eos_id:
            raise ValueError(f"{self.tokenizer_path}: its post-processor does not end a sequence with </s> "
                             f"(encoding 'a' gives {probe}); umT5 (and Wan) append </s>")
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab > encoder.config.vocab_size:
            raise ValueError(f"{self.tokenizer_path} has {vocab} tokens but the encoder only "
                             f"{encoder.config.vocab_size} "
                             "embedding rows: not this encoder's tokenizer")
        self.tokenizer = tokenizer

        graphdef, self._state = nnx.split(encoder)
        self.traces = 0  # how often the program was traced (1 after the first prompt, whatever the lengths)

        def program(state: Any, ids: jax.Array, length: jax.Array) -> jax.Array:
            self.traces += 1
            valid = jnp.arange(text_len) < length
            features = nnx.merge(graphdef, state)(ids, valid)
            return jnp.where(valid[:, None], features, 0.0)

        self._program = jax.jit(program)
        self._cache: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def tokenize(self, prompt: str) -> np.ndarray:
        """``i32[L]``: the cleaned prompt's token ids, ``</s>`` last, ``L <= text_len`` (no padding)."""
        return np.asarray(self.tokenizer.encode(clean_prompt(prompt)).ids, np.int32)

    def _lookup(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        entry = self._cache.get(prompt)
        if entry is not None:
            self.hits += 1
            self._cache.move_to_end(prompt)
            return entry
        self.misses += 1
        ids = self.tokenize(prompt)
        padded_ids = np.full((self.text_len,), self.pad_id, np.int32)
        padded_ids[: len(ids)] = ids
        padded = np.asarray(self._program(self._state, padded_ids, np.int32(len(ids))), np.float32)
        padded.setflags(write=False)
        entry = (padded, padded[: len(ids)])
        if self.cache_size:
            self._cache[prompt] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry

    def encode(self, prompt: str) -> np.ndarray:
        """``f32[L, d_model]``: the features of the prompt's ``L`` tokens (``</s>`` included), what Wan returns."""
        return self._lookup(prompt)[1]

    def encode_padded(self, prompt: str) -> np.ndarray:
        """``f32[text_len, d_model]``: :meth:`encode` followed by zero rows, as Wan's DiT consumes it."""
        return self._lookup(prompt)[0]

    __call__ = encode

    def cache_info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._cache), "maxsize": self.cache_size}

    def clear_cache(self) -> None:
        self._cache.clear()

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], tokenizer_path: str | os.PathLike[str], *,
                        config: UMT5Config | None = None, dtype: Any = None, device: Any = None,
                        text_len: int = 512, cache_size: int = 32) -> WanTextEncoder:
        """:func:`load_umt5` then the encoder: ``WanTextEncoder.from_checkpoint("Wan2.1-T2V-1.3B",
        "Wan2.1-T2V-1.3B/google/umt5-xxl")``."""
        return cls(load_umt5(path, config, dtype=dtype, device=device), tokenizer_path, text_len=text_len,
                   cache_size=cache_size)

    def __repr__(self) -> str:
        cfg = self.encoder.config
        return (f"WanTextEncoder(d_model={cfg.d_model}, layers={cfg.num_layers}, text_len={self.text_len}, "
                f"tokenizer={str(self.tokenizer_path)!r}, cache={len(self._cache)}/{self.cache_size})")

