"""The Wan 2.1 video VAE in Flax NNX, with streaming decode as a pure function of a per-session cache.

The causal 3-D conv autoencoder Self-Forcing, LongLive and Krea realtime decode with
(``wan/modules/vae.py``'s ``_video_vae``; diffusers' ``AutoencoderKLWan``, bit-identical
to it): base width 96, 16 latent channels, widths ``96 * [1, 2, 4, 4]``, two residual
blocks per stage, no attention outside the middle blocks, 8x spatial and 4x temporal
compression (126.9M parameters, 194 tensors). The layout is the original one
(``encoder.downsamples.i``, ``decoder.upsamples.i``, ``middle``, ``head``), computed
channels-last ``[T, H, W, C]`` inside; the public API takes and returns ``[F, C, H, W]``
like the rest of the repo.

Causality and the cache. Every 3x3x3 (and ``3x1x1``) conv pads time by two frames on the
left only, so a clip can be decoded in pieces: each such conv keeps the last ``CACHE_T = 2``
frames of its input and prepends them to the next piece instead of zeros. Wan's decoder
does this one latent frame at a time with a Python list of tensors (``feat_map``) and a
``'Rep'`` string marking the temporal upsamplers of the very first frame, which pass that
frame through un-doubled (latent frame 0 -> 1 pixel frame, every later one -> 4). Here the
same state is :class:`VAEDecodeCache`, a pytree of fixed-shape arrays (the zero-initialised
last two input frames of each of the decoder's 32 cached convs; the 33rd conv, a 1x1x1
shortcut, sees no time) plus a static ``started`` flag, and :func:`decode_step` is a pure
function ``(vae, z, cache) -> (video, cache)``. It decodes a whole block of latent frames in
one batched call: on a fresh cache the temporal upsamplers pass the block's first frame
through and run their time conv on the rest with the (zero) cache in front, which is
exactly what Wan's frame-by-frame loop computes. Because ``started`` changes the output
length (``1 + 4*(f-1)`` frames for a session's first block, ``4*f`` after), it is pytree
metadata, not an array: one compiled program per (block size, first or not).

Why zeros are the right initial cache: Wan's first call pads with zeros (no cache yet),
its second prepends a one-frame cache after one zero frame, and the ``'Rep'`` upsamplers
run their first time conv without a cache; each of these equals prepending a two-frame
cache that starts as zeros and keeps the last two input frames (``tests/test_wan_vae.py``
checks whole clips and block splits against diffusers).

Encoding mirrors it (:class:`VAEEncodeCache`, :func:`encode_step`): the encoder's temporal
downsamplers keep the last frame of their input, and a session's first chunk (``1 + 4k``
pixel frames) passes its first frame through them, later chunks are ``4k`` frames.
:meth:`WanVAE.encode` chunks a clip as 1, 4, 4, ... frames, as Wan does, and returns the
normalised latent mean ``(mu - mean) * (1 / std)``; :meth:`WanVAE.decode` takes normalised
latents (``z / (1 / std) + mean`` first, Wan's arithmetic) and returns ``[-1, 1]`` video.

:func:`load_vae` reads the original ``Wan2.1_VAE.pth`` (torch's safe unpickler, original
names, the state dict at the top or under a key), an original-named ``.safetensors``
(ComfyUI's repack), and diffusers' ``AutoencoderKLWan`` (a directory with ``config.json`` +
``diffusion_pytorch_model.safetensors``, a pipeline root with ``vae/``, or the bare file).
Every tensor fills exactly one parameter; missing, unexpected, mis-shaped and non-float
tensors are refused by name before anything is placed on device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ardiff_jax.models.wan._checkpoint import (
    CheckpointError,
    _as_checkpoint_error,
    _names,
    _read_json,
    _read_weights_dir,
    _safetensors_tensors,
    _strip_prefixes,
    _Tensor,
    _tensor_dict,
    _torch,
    _torch_load,
    _torch_tensors,
    json_positive_int,
)
from ardiff_jax.models.wan._safetensors import MAX_EXPECTED_TENSORS, SafetensorsFile, header_budget

__all__ = [
    "CACHE_T",
    "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD",
    "VAEDecodeCache",
    "VAEEncodeCache",
    "WanVAE",
    "WanVAEConfig",
    "cache_nbytes",
    "decode_step",
    "decoded_frames",
    "encode_step",
    "init_decode_cache",
    "random_vae",
    "init_encode_cache",
    "load_vae",
    "vae_names",
]

_F32 = jnp.float32

#: Input frames each causal conv keeps between calls (Wan's ``CACHE_T``): its temporal left padding.
CACHE_T = 2

#: Wan 2.1's per-channel latent statistics (``WanVAE.mean/std``; diffusers' ``latents_mean/latents_std``).
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


# -- config ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Size of a :class:`WanVAE` (defaults: Wan 2.1's ``_video_vae``).

    Attributes:
      base_dim: width of the first encoder stage and the last decoder stage (Wan: 96).
      z_dim: latent channels (Wan: 16); the encoder emits ``2 * z_dim`` (mean, log-variance).
      dim_mult: stage widths as multiples of ``base_dim`` (Wan: 1, 2, 4, 4); ``len - 1``
        spatial 2x steps.
      num_res_blocks: residual blocks per encoder stage (the decoder has one more per stage).
      temperal_downsample: per encoder stage transition, whether it also halves time (Wan's
        spelling; the decoder uses it reversed).
      latents_mean, latents_std: the normalisation ``(mu - mean) / std`` of the latents the
        DiT sees (``z_dim`` entries each).
      dtype: parameter and activation dtype; norms, softmax and the (de)normalisation run in
        float32 whatever it is.
    """

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # Tuples of Python scalars: equal configs hash equal and share compiled programs.
        for field in ("base_dim", "z_dim", "num_res_blocks"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"WanVAEConfig {field} must be a positive int, got {value!r}")
            object.__setattr__(self, field, int(value))
        mult = tuple(int(m) for m in self.dim_mult)
        if len(mult) < 2 or any(m <= 0 for m in mult):
            raise ValueError(f"WanVAEConfig dim_mult must hold at least two positive ints, got {self.dim_mult!r}")
        object.__setattr__(self, "dim_mult", mult)
        down = tuple(bool(t) for t in self.temperal_downsample)
        if len(down) != len(mult) - 1:
            raise ValueError(f"WanVAEConfig temperal_downsample needs {len(mult) - 1} entries (one per stage "
                             f"transition of dim_mult {mult}), got {self.temperal_downsample!r}")
        object.__setattr__(self, "temperal_downsample", down)
        for field in ("latents_mean", "latents_std"):
            # Real numbers only (a bool or a string would be coerced by float()), finite: a NaN or an
            # infinite statistic makes every latent NaN or zero.
            raw = getattr(self, field)
            if isinstance(raw, (str, bytes)) or any(
                    isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating))
                    for v in raw):
                raise ValueError(f"WanVAEConfig {field} must hold real numbers, got {raw!r}")
            values = tuple(float(v) for v in raw)
            if len(values) != self.z_dim:
                raise ValueError(f"WanVAEConfig {field} needs z_dim = {self.z_dim} entries, got {len(values)}")
            positive = field == "latents_std"
            bad = [i for i, v in enumerate(values) if not math.isfinite(v) or (positive and v <= 0)]
            if bad:
                raise ValueError(f"WanVAEConfig {field} must be finite{' and positive' if positive else ''}, got "
                                 f"{values[bad[0]]} (entry {bad[0]})")
            object.__setattr__(self, field, values)
        try:
            object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        except TypeError:
            raise ValueError(f"WanVAEConfig dtype {self.dtype!r} is not a dtype") from None
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"WanVAEConfig dtype must be a float dtype, got {self.dtype}")

    @classmethod
    def tiny(cls, base_dim: int = 8, **overrides: Any) -> WanVAEConfig:
        """Wan 2.1's layout (same stages, blocks, latent channels, index layout) at a small width, float32."""
        return cls(base_dim=base_dim, **overrides)

    def replace(self, **changes: Any) -> WanVAEConfig:
        return dataclasses.replace(self, **changes)

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent along H and W (Wan 2.1: 8)."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        """Pixel frames per latent frame after the first (Wan 2.1: 4)."""
        return 2 ** sum(self.temperal_downsample)

    @property
    def num_params(self) -> int:
        """Parameter count (Wan 2.1: 126.9M), from shapes only."""
        abstract = nnx.eval_shape(lambda: WanVAE(self, rngs=nnx.Rngs(0)))
        return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(nnx.state(abstract, nnx.Param)))


def decoded_frames(config: WanVAEConfig, num_latents: int, first: bool) -> int:
    """Pixel frames :func:`decode_step` returns for ``num_latents`` latent frames: ``1 + 4*(f-1)`` for a
    session's first block, ``4*f`` after (Wan 2.1's factor 4)."""
    t = config.temporal_factor
    return 1 + t * (num_latents - 1) if first else t * num_latents


# -- leaf modules (each knows its original and diffusers names) ----------------------------------------


def _precision(dtype: Any) -> jax.lax.Precision:
    # float32 means float32: without HIGHEST, XLA on Ampere+ GPUs runs f32 convs/dots in TF32
    # (10-bit mantissa), which alone exceeds the parity tolerance of the port.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _init_kernel(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: str) -> jax.Array:
    fan_in = math.prod(shape[:-1])
    return (jax.random.normal(rngs.params(), shape, _F32) / math.sqrt(fan_in)).astype(dtype)


class _Conv(nnx.Module):
    """A convolution with a ``[*k, I, O]`` kernel (torch: ``[O, I, *k]``) and a bias.

    ``names``: (original Wan name, diffusers name) of the torch module it comes from.
    """

    def __init__(self, cin: int, cout: int, kernel: tuple[int, ...], names: tuple[str, str], dtype: str,
                 rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(_init_kernel(rngs, (*kernel, cin, cout), dtype))
        self.bias = nnx.Param(jnp.zeros((cout,), dtype))
        self.names = names

    def _finish(self, y: jax.Array, dtype: Any) -> jax.Array:
        # The conv accumulates in float32 and the bias is added before the one rounding to the
        # activation dtype, as cuDNN does for torch's bf16 Conv3d.
        return (y + self.bias[...].astype(_F32)).astype(dtype)


class _CausalConv3d(_Conv):
    """Wan's ``CausalConv3d``: kernel ``(kt, k, k)``, time padded ``time_pad`` frames on the left only.

    A conv with ``time_pad > 0`` (always ``CACHE_T = 2``) takes the previous call's last two
    input frames (``cache``, zeros for a fresh session) instead of zero padding and returns
    the new ones.
    """

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int], space_pad: int, time_pad: int,
                 names: tuple[str, str], dtype: str, rngs: nnx.Rngs, time_stride: int = 1) -> None:
        super().__init__(cin, cout, kernel, names, dtype, rngs)
        self.space_pad = space_pad
        self.time_pad = time_pad
        self.time_stride = time_stride

    def conv(self, x: jax.Array) -> jax.Array:
        """The plain (valid in time) conv of ``[T, H, W, I]`` -> ``[T', H, W, O]``."""
        p = self.space_pad
        y = jax.lax.conv_general_dilated(
            x[None], self.kernel[...].astype(x.dtype), window_strides=(self.time_stride, 1, 1),
            padding=((0, 0), (p, p), (p, p)), dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
            precision=_precision(x.dtype), preferred_element_type=_F32)[0]
        return self._finish(y, x.dtype)

    def __call__(self, x: jax.Array, caches: _Caches | None = None) -> jax.Array:
        if self.time_pad == 0:
            return self.conv(x)
        assert self.time_pad == CACHE_T and caches is not None, self.names
        cache = caches.take(x, CACHE_T)
        full = jnp.concatenate([cache.astype(x.dtype), x], axis=0)
        caches.give(full[-CACHE_T:])
        return self.conv(full)


class _Conv2d(_Conv):
    """A per-frame ``nn.Conv2d`` (the resamplers): ``[T, H, W, I]`` -> ``[T, H', W', O]``."""

    def __init__(self, cin: int, cout: int, pad: int, stride: int, names: tuple[str, str], dtype: str,
                 rngs: nnx.Rngs) -> None:
        super().__init__(cin, cout, (3, 3), names, dtype, rngs)
        self.pad = pad
        self.stride = stride

    def __call__(self, x: jax.Array, padding: Any = None) -> jax.Array:
        p = self.pad
        y = jax.lax.conv_general_dilated(
            x, self.kernel[...].astype(x.dtype), window_strides=(self.stride, self.stride),
            padding=padding if padding is not None else ((p, p), (p, p)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_precision(x.dtype),
            preferred_element_type=_F32)
        return self._finish(y, x.dtype)


class _Pointwise(_Conv):
    """A 1x1 ``nn.Conv2d`` (the attention's ``to_qkv`` and ``proj``): a matmul over channels."""

    def __init__(self, cin: int, cout: int, names: tuple[str, str], dtype: str, rngs: nnx.Rngs) -> None:
        super().__init__(cin, cout, (1, 1), names, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, self.kernel[...][0, 0].astype(x.dtype),
                       precision=_precision(x.dtype), preferred_element_type=_F32)
        return self._finish(y, x.dtype)


class _RMSNorm(nnx.Module):
    """Wan's ``RMS_norm``: ``F.normalize`` over channels (in float32) times ``sqrt(C) * gamma``.

    torch stores gamma ``[C, 1, 1, 1]`` (``images=False``) or ``[C, 1, 1]`` (``images=True``).
    """

    def __init__(self, dim: int, images: bool, names: tuple[str, str], dtype: str) -> None:
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))
        self.scale = float(dim) ** 0.5
        self.torch_shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.names = names

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_F32)
        norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
        normalized = (xf / jnp.maximum(norm, 1e-12)).astype(x.dtype)  # F.normalize's eps clamp
        return normalized * self.scale * self.gamma[...].astype(x.dtype)


def _silu(x: jax.Array) -> jax.Array:
    # Evaluated in float32 and rounded once, as torch's bf16 SiLU kernel does.
    xf = x.astype(_F32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


# -- the per-call cache threading ---------------------------------------------------------------------


class _Caches:
    """The caches of one call, handed to the cached convs in the order they run and replaced by theirs."""

    def __init__(self, caches: tuple[jax.Array, ...]) -> None:
        self._in = caches
        self.out: list[jax.Array] = []

    def take(self, x: jax.Array, frames: int) -> jax.Array:
        i = len(self.out)
        if i >= len(self._in):
            raise ValueError(f"the cache holds {len(self._in)} conv caches, the network needs more: it was "
                             "built for another WanVAEConfig")
        cache = self._in[i]
        if tuple(cache.shape) != (frames, *x.shape[1:]):
            raise ValueError(f"conv cache {i} is {tuple(cache.shape)}, this input needs {(frames, *x.shape[1:])} "
                             "([T, H, W, C]): the cache was made for another latent size or config")
        return cache

    def give(self, cache: jax.Array) -> None:
        # Stored in the cache's own dtype, so every step's cache has the same pytree type.
        self.out.append(cache.astype(self._in[len(self.out)].dtype))

    def done(self) -> tuple[jax.Array, ...]:
        if len(self.out) != len(self._in):
            raise ValueError(f"the cache holds {len(self._in)} conv caches, the network used {len(self.out)}: it "
                             "was built for another WanVAEConfig")
        return tuple(self.out)


# -- blocks ----------------------------------------------------------------------------------------------


def _names_at(original: str, diffusers: str, leaf_original: str, leaf_diffusers: str) -> tuple[str, str]:
    return f"{original}.{leaf_original}", f"{diffusers}.{leaf_diffusers}"


class _ResidualBlock(nnx.Module):
    """``x + residual(x)``: RMS norm, SiLU, 3x3x3 causal conv, twice (Wan's ``ResidualBlock``)."""

    def __init__(self, cin: int, cout: int, original: str, diffusers: str, dtype: str, rngs: nnx.Rngs) -> None:
        def at(o: str, d: str) -> tuple[str, str]:
            return _names_at(original, diffusers, o, d)

        self.norm1 = _RMSNorm(cin, False, at("residual.0", "norm1"), dtype)
        self.conv1 = _CausalConv3d(cin, cout, (3, 3, 3), 1, CACHE_T, at("residual.2", "conv1"), dtype, rngs)
        self.norm2 = _RMSNorm(cout, False, at("residual.3", "norm2"), dtype)
        self.conv2 = _CausalConv3d(cout, cout, (3, 3, 3), 1, CACHE_T, at("residual.6", "conv2"), dtype, rngs)
        # A 1x1x1 conv sees one frame: never cached (the decoder's 33rd conv).
        self.shortcut = (_CausalConv3d(cin, cout, (1, 1, 1), 0, 0, at("shortcut", "conv_shortcut"), dtype, rngs)
                         if cin != cout else None)

    def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
        h = self.shortcut(x) if self.shortcut is not None else x
        x = self.conv1(_silu(self.norm1(x)), caches)
        x = self.conv2(_silu(self.norm2(x)), caches)  # (dropout 0)
        return x + h


class _AttentionBlock(nnx.Module):
    """Single-head self-attention over the pixels of each frame (the middle blocks' ``AttentionBlock``)."""

    def __init__(self, dim: int, original: str, diffusers: str, dtype: str, rngs: nnx.Rngs) -> None:
        self.norm = _RMSNorm(dim, True, (f"{original}.norm", f"{diffusers}.norm"), dtype)
        self.to_qkv = _Pointwise(dim, 3 * dim, (f"{original}.to_qkv", f"{diffusers}.to_qkv"), dtype, rngs)
        self.proj = _Pointwise(dim, dim, (f"{original}.proj", f"{diffusers}.proj"), dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        t, h, w, c = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(t, h * w, 3 * c)
        q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
        precision = _precision(x.dtype)
        logits = jnp.einsum("tqc,tkc->tqk", q, k, precision=precision, preferred_element_type=_F32)
        weights = jax.nn.softmax(logits * (1.0 / math.sqrt(c)), axis=-1).astype(x.dtype)
        out = jnp.einsum("tqk,tkc->tqc", weights, v, precision=precision, preferred_element_type=_F32)
        return self.proj(out.astype(x.dtype).reshape(t, h, w, c)) + x


class _Resample(nnx.Module):
    """Wan's ``Resample``: 2x nearest upsample + 3x3 conv (``upsample2d``), preceded by a frame-doubling
    time conv (``upsample3d``); zero pad + stride-2 3x3 conv (``downsample2d``), followed by a
    stride-2 time conv (``downsample3d``)."""

    def __init__(self, dim: int, mode: str, original: str, diffusers: str, dtype: str, rngs: nnx.Rngs) -> None:
        self.mode = mode
        names = (f"{original}.resample.1", f"{diffusers}.resample.1")
        time_names = (f"{original}.time_conv", f"{diffusers}.time_conv")
        if mode.startswith("upsample"):
            self.resample = _Conv2d(dim, dim // 2, 1, 1, names, dtype, rngs)
        else:
            self.resample = _Conv2d(dim, dim, 0, 2, names, dtype, rngs)
        if mode == "upsample3d":
            self.time_conv = _CausalConv3d(dim, 2 * dim, (3, 1, 1), 0, CACHE_T, time_names, dtype, rngs)
        elif mode == "downsample3d":
            self.time_conv = _CausalConv3d(dim, dim, (3, 1, 1), 0, 0, time_names, dtype, rngs, time_stride=2)
        else:
            self.time_conv = None

    def __call__(self, x: jax.Array, caches: _Caches, first: bool) -> jax.Array:
        if self.mode == "upsample3d":
            x = self._double_frames(x, caches, first)
        if self.mode.startswith("upsample"):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # nearest-exact at scale 2
            x = self.resample(x)
        else:
            x = self.resample(x, padding=((0, 1), (0, 1)))  # ZeroPad2d((0, 1, 0, 1)) then a valid conv
        if self.mode == "downsample3d":
            x = self._halve_frames(x, caches, first)
        return x

    def _double_frames(self, x: jax.Array, caches: _Caches, first: bool) -> jax.Array:
        # A session's very first frame passes through (Wan's 'Rep'); every other frame becomes two,
        # and the first frame never enters the time conv's history.
        head, rest = (x[:1], x[1:]) if first else (x[:0], x)
        if rest.shape[0] == 0:
            caches.give(caches.take(x, CACHE_T))
            return head
        y = self.time_conv(rest, caches)
        t, h, w, c2 = y.shape
        y = y.reshape(t, h, w, 2, c2 // 2).transpose(0, 3, 1, 2, 4).reshape(2 * t, h, w, c2 // 2)
        return jnp.concatenate([head, y], axis=0)

    def _halve_frames(self, x: jax.Array, caches: _Caches, first: bool) -> jax.Array:
        # Wan keeps the last frame of the input; the first chunk's first frame passes through and
        # starts the first window, later chunks are windows over (last frame, chunk).
        cache = caches.take(x, 1)
        caches.give(x[-1:])
        if first:
            if x.shape[0] % 2 != 1:
                raise ValueError(f"a session's first encoder chunk needs 1 + 4k frames, got a chunk that reaches "
                                 f"a temporal downsampler with {x.shape[0]} frames")
            return x[:1] if x.shape[0] == 1 else jnp.concatenate([x[:1], self.time_conv.conv(x)], axis=0)
        if x.shape[0] % 2:
            raise ValueError(f"encoder chunks after the first need a multiple of 4 frames, got a chunk that "
                             f"reaches a temporal downsampler with {x.shape[0]} frames")
        return self.time_conv.conv(jnp.concatenate([cache.astype(x.dtype), x], axis=0))


class _Encoder(nnx.Module):
    """Wan's ``Encoder3d``: ``conv1``, ``downsamples`` (flat), ``middle`` (res, attention, res), ``head``."""

    def __init__(self, config: WanVAEConfig, rngs: nnx.Rngs) -> None:
        dtype, base, nrb = config.dtype, config.base_dim, config.num_res_blocks
        dims = [base * m for m in (1, *config.dim_mult)]
        self.conv1 = _CausalConv3d(3, dims[0], (3, 3, 3), 1, CACHE_T, ("encoder.conv1", "encoder.conv_in"),
                                   dtype, rngs)
        blocks: list[nnx.Module] = []
        for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
            for _ in range(nrb):
                j = len(blocks)
                blocks.append(_ResidualBlock(cin, cout, f"encoder.downsamples.{j}", f"encoder.down_blocks.{j}",
                                             dtype, rngs))
                cin = cout
            if i != len(config.dim_mult) - 1:
                j = len(blocks)
                mode = "downsample3d" if config.temperal_downsample[i] else "downsample2d"
                blocks.append(_Resample(cout, mode, f"encoder.downsamples.{j}", f"encoder.down_blocks.{j}",
                                        dtype, rngs))
        self.downsamples = nnx.List(blocks)
        self.middle = _middle(cout, "encoder", dtype, rngs)
        self.head_norm = _RMSNorm(cout, False, ("encoder.head.0", "encoder.norm_out"), dtype)
        self.head_conv = _CausalConv3d(cout, 2 * config.z_dim, (3, 3, 3), 1, CACHE_T,
                                       ("encoder.head.2", "encoder.conv_out"), dtype, rngs)

    def __call__(self, x: jax.Array, caches: _Caches, first: bool) -> jax.Array:
        x = self.conv1(x, caches)
        for block in self.downsamples:
            x = block(x, caches, first) if isinstance(block, _Resample) else block(x, caches)
        x = _run_middle(self.middle, x, caches)
        return self.head_conv(_silu(self.head_norm(x)), caches)


class _Decoder(nnx.Module):
    """Wan's ``Decoder3d``: ``conv1``, ``middle``, ``upsamples`` (flat: per stage ``num_res_blocks + 1``
    residual blocks, then a resampler except after the last), ``head``."""

    def __init__(self, config: WanVAEConfig, rngs: nnx.Rngs) -> None:
        dtype, base, nrb = config.dtype, config.base_dim, config.num_res_blocks
        mult = config.dim_mult
        dims = [base * m for m in (mult[-1], *mult[::-1])]
        upsample_time = config.temperal_downsample[::-1]
        self.conv1 = _CausalConv3d(config.z_dim, dims[0], (3, 3, 3), 1, CACHE_T,
                                   ("decoder.conv1", "decoder.conv_in"), dtype, rngs)
        self.middle = _middle(dims[0], "decoder", dtype, rngs)
        blocks: list[nnx.Module] = []
        for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
            if i > 0:
                cin //= 2  # the previous stage's upsampler halved the width
            for r in range(nrb + 1):
                blocks.append(_ResidualBlock(cin, cout, f"decoder.upsamples.{len(blocks)}",
                                             f"decoder.up_blocks.{i}.resnets.{r}", dtype, rngs))
                cin = cout
            if i != len(mult) - 1:
                mode = "upsample3d" if upsample_time[i] else "upsample2d"
                blocks.append(_Resample(cout, mode, f"decoder.upsamples.{len(blocks)}",
                                        f"decoder.up_blocks.{i}.upsamplers.0", dtype, rngs))
        self.upsamples = nnx.List(blocks)
        self.head_norm = _RMSNorm(cout, False, ("decoder.head.0", "decoder.norm_out"), dtype)
        self.head_conv = _CausalConv3d(cout, 3, (3, 3, 3), 1, CACHE_T, ("decoder.head.2", "decoder.conv_out"),
                                       dtype, rngs)

    def __call__(self, x: jax.Array, caches: _Caches, first: bool) -> jax.Array:
        x = self.conv1(x, caches)
        x = _run_middle(self.middle, x, caches)
        for block in self.upsamples:
            x = block(x, caches, first) if isinstance(block, _Resample) else block(x, caches)
        return self.head_conv(_silu(self.head_norm(x)), caches)


def _middle(dim: int, side: str, dtype: str, rngs: nnx.Rngs) -> nnx.List:
    return nnx.List([
        _ResidualBlock(dim, dim, f"{side}.middle.0", f"{side}.mid_block.resnets.0", dtype, rngs),
        _AttentionBlock(dim, f"{side}.middle.1", f"{side}.mid_block.attentions.0", dtype, rngs),
        _ResidualBlock(dim, dim, f"{side}.middle.2", f"{side}.mid_block.resnets.1", dtype, rngs),
    ])


def _run_middle(middle: nnx.List, x: jax.Array, caches: _Caches) -> jax.Array:
    x = middle[0](x, caches)
    x = middle[1](x)
    return middle[2](x, caches)


class WanVAE(nnx.Module):
    """The Wan 2.1 VAE: ``encoder``, ``conv1`` (diffusers' ``quant_conv``), ``conv2``
    (``post_quant_conv``), ``decoder``, in the original layout.

    Example::

        vae = load_vae("Wan2.1_VAE.pth", dtype="bfloat16")
        video = vae.decode(latents)               # f32[21, 16, 60, 104] -> f32[81, 3, 480, 832]
        cache = init_decode_cache(vae.config, (60, 104))
        block, cache = decode_step(vae, latents[:3], cache)   # f32[9, 3, 480, 832]
        block, cache = decode_step(vae, latents[3:6], cache)  # f32[12, 3, 480, 832]
    """

    def __init__(self, config: WanVAEConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        z = config.z_dim
        self.encoder = _Encoder(config, rngs)
        self.conv1 = _CausalConv3d(2 * z, 2 * z, (1, 1, 1), 0, 0, ("conv1", "quant_conv"), config.dtype, rngs)
        self.conv2 = _CausalConv3d(z, z, (1, 1, 1), 0, 0, ("conv2", "post_quant_conv"), config.dtype, rngs)
        self.decoder = _Decoder(config, rngs)

    def decode(self, z: jax.Array) -> jax.Array:
        """``f32[f, z_dim, h, w]`` normalised latents -> ``f32[1 + 4*(f-1), 3, 8h, 8w]`` video in ``[-1, 1]``.

        Wan's ``decode``: a fresh cache, then :func:`decode_step` one latent frame at a time
        (two compiled programs, first frame and later frames, whatever the clip length).
        """
        _check_frames("decode's z", z, self.config.z_dim)
        return _decode_clip(self, jnp.asarray(z))

    def encode(self, video: jax.Array) -> jax.Array:
        """``f32[1 + 4k, 3, H, W]`` video in ``[-1, 1]`` -> ``f32[1 + k, z_dim, H/8, W/8]`` normalised latent means.

        Wan's ``encode``: :func:`encode_step` on chunks of 1, 4, 4, ... frames, the
        posterior mean, then ``(mu - mean) * (1 / std)``.
        """
        _check_frames("encode's video", video, 3)
        return _encode_clip(self, jnp.asarray(video))

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(nnx.state(self, nnx.Param)))


# -- caches ----------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["convs"], meta_fields=["started"])
@dataclasses.dataclass(frozen=True)
class VAEDecodeCache:
    """A session's streaming-decode state: what Wan's ``feat_map`` holds between ``cached_decode`` calls.

    Attributes:
      convs: per cached causal conv of the decoder, in the order they run, the last two
        frames of its input ``[2, H_i, W_i, C_i]`` (channels-last; zeros before any frame).
        Wan 2.1 at a 60x104 latent: 32 arrays, 944.3M elements (1801 MiB in bf16).
      started: False until the first block is decoded (Wan's ``'Rep'`` marker: that block's
        first latent frame yields one pixel frame). Static pytree metadata: it fixes the
        output length, so ``jit`` compiles one program per (block size, started).
    """

    convs: tuple[Any, ...]
    started: bool = False


@functools.partial(jax.tree_util.register_dataclass, data_fields=["convs"], meta_fields=["started"])
@dataclasses.dataclass(frozen=True)
class VAEEncodeCache:
    """A session's streaming-encode state: the encoder's 24 conv caches (``[2, H_i, W_i, C_i]``) and its two
    temporal downsamplers' last frames (``[1, H_i, W_i, C_i]``), in the order they run; ``started`` as in
    :class:`VAEDecodeCache` (a session's first chunk is ``1 + 4k`` frames, later ones ``4k``)."""

    convs: tuple[Any, ...]
    started: bool = False


def _check_hw(hw: Any, what: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in hw)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be (height, width), got {hw!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"{what} must be positive, got {hw!r}")
    return h, w


def _decode_layout(config: WanVAEConfig, latent_hw: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """``[T, H, W, C]`` of every decoder conv cache, in the order the convs run (mirrors :class:`_Decoder`)."""
    h, w = _check_hw(latent_hw, "latent_hw")
    mult, nrb = config.dim_mult, config.num_res_blocks
    dims = [config.base_dim * m for m in (mult[-1], *mult[::-1])]
    upsample_time = config.temperal_downsample[::-1]
    entries = [(config.z_dim, 1)] + [(dims[0], 1)] * 4  # conv1, then the middle's two residual blocks
    scale, cout = 1, dims[0]
    for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
        if i > 0:
            cin //= 2
        for _ in range(nrb + 1):
            entries += [(cin, scale), (cout, scale)]
            cin = cout
        if i != len(mult) - 1:
            if upsample_time[i]:
                entries.append((cout, scale))  # the time conv, before the spatial 2x
            scale *= 2
    entries.append((cout, scale))  # head
    return [(CACHE_T, h * s, w * s, c) for c, s in entries]


def _encode_layout(config: WanVAEConfig, pixel_hw: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """``[T, H, W, C]`` of every encoder cache, in the order they are used (mirrors :class:`_Encoder`)."""
    h, w = _check_hw(pixel_hw, "pixel_hw")
    if h % config.spatial_factor or w % config.spatial_factor:
        raise ValueError(f"pixel_hw {(h, w)} must be multiples of {config.spatial_factor}")
    mult, nrb = config.dim_mult, config.num_res_blocks
    dims = [config.base_dim * m for m in (1, *mult)]
    out = [(CACHE_T, h, w, 3)]
    div, cout = 1, dims[0]
    for i, (cin, cout) in enumerate(itertools.pairwise(dims)):
        for _ in range(nrb):
            out += [(CACHE_T, h // div, w // div, cin), (CACHE_T, h // div, w // div, cout)]
            cin = cout
        if i != len(mult) - 1:
            div *= 2
            if config.temperal_downsample[i]:
                out.append((1, h // div, w // div, cout))  # the downsampler's last frame
    out += [(CACHE_T, h // div, w // div, cout)] * 5  # middle (4 convs), head
    return out


def init_decode_cache(config: WanVAEConfig, latent_hw: tuple[int, int], dtype: Any = None) -> VAEDecodeCache:
    """A fresh session's :class:`VAEDecodeCache` (zeros) for ``latent_hw = (h, w)`` latents, in ``dtype``
    (default ``config.dtype``). Shapes only under ``jax.eval_shape``."""
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    return VAEDecodeCache(tuple(jnp.zeros(shape, dtype) for shape in _decode_layout(config, latent_hw)), False)


def init_encode_cache(config: WanVAEConfig, pixel_hw: tuple[int, int], dtype: Any = None) -> VAEEncodeCache:
    """A fresh session's :class:`VAEEncodeCache` (zeros) for ``pixel_hw = (H, W)`` video."""
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    return VAEEncodeCache(tuple(jnp.zeros(shape, dtype) for shape in _encode_layout(config, pixel_hw)), False)


def cache_nbytes(config: WanVAEConfig, latent_hw: tuple[int, int], dtype: Any = None) -> int:
    """Bytes of one session's :class:`VAEDecodeCache` (Wan 2.1, 60x104 latent, bf16: 1801 MiB)."""
    itemsize = jnp.dtype(config.dtype if dtype is None else dtype).itemsize
    return sum(math.prod(shape) for shape in _decode_layout(config, latent_hw)) * itemsize


# -- the pure functions ---------------------------------------------------------------------------------


def _latent_stats(config: WanVAEConfig) -> tuple[np.ndarray, np.ndarray]:
    # Wan keeps ``scale = [mean, 1.0 / std]`` as float32 tensors; the reciprocal is rounded once, as there.
    mean = np.asarray(config.latents_mean, np.float32)
    inv_std = np.float32(1.0) / np.asarray(config.latents_std, np.float32)
    return mean, inv_std


def _check_frames(what: str, x: Any, channels: int, spatial: tuple[int, int] | None = None) -> None:
    if x.ndim != 4 or x.shape[1] != channels:
        raise ValueError(f"{what} must be [F, {channels}, H, W], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{what} has no frames")
    if spatial is not None and tuple(x.shape[2:]) != spatial:
        raise ValueError(f"{what} is {tuple(x.shape[2:])} pixels/latents, the cache was made for {spatial}")


def decode_step(vae: WanVAE, z: jax.Array, cache: VAEDecodeCache) -> tuple[jax.Array, VAEDecodeCache]:
    """Decode one block of a session: ``f32[f, z_dim, h, w]`` normalised latents -> ``(f32[F, 3, 8h, 8w], cache)``.

    ``F = 1 + 4*(f-1)`` for the session's first block (``cache.started`` False), ``4*f``
    after. Pure: the returned cache is the next call's input, and a cache copied to the
    host and back (a session offload) continues identically. Jitted inside (one program per
    (``f``, ``h, w``, ``cache.started``, cache dtype)); the input cache's buffers are donated,
    so it must not be used again. Callable inside ``jit``.
    """
    _check_frames("decode_step's z", z, vae.config.z_dim, tuple(cache.convs[0].shape[1:3]) if cache.convs else None)
    graphdef, params = nnx.split(vae)
    return _decode_step_jit(graphdef, params, jnp.asarray(z), cache)


def encode_step(vae: WanVAE, video: jax.Array, cache: VAEEncodeCache, *, donate: bool = True
                ) -> tuple[jax.Array, VAEEncodeCache]:
    """Encode one chunk of a session: ``f32[F, 3, H, W]`` in ``[-1, 1]`` -> ``(f32[f, z_dim, H/8, W/8], cache)``.

    A session's first chunk is ``1 + 4k`` frames (``1 + k`` latents: e.g. one image for
    image-to-video), later ones ``4k`` frames (``k`` latents). Returns normalised latent
    means; the input cache is donated unless ``donate=False`` (a batched tick keeps a
    session's cache intact until the whole batch has succeeded).
    """
    _check_frames("encode_step's video", video, 3, tuple(cache.convs[0].shape[1:3]) if cache.convs else None)
    f, t = video.shape[0], vae.config.temporal_factor
    if cache.started and f % t:
        raise ValueError(f"encode_step takes {t}k frames after a session's first chunk, got {f}")
    if not cache.started and (f - 1) % t:
        raise ValueError(f"encode_step takes 1 + {t}k frames for a session's first chunk, got {f}")
    graphdef, params = nnx.split(vae)
    program = _encode_step_jit if donate else _encode_step_keep_jit
    return program(graphdef, params, jnp.asarray(video), cache)


def _decode_impl(vae: WanVAE, z: jax.Array, cache: VAEDecodeCache) -> tuple[jax.Array, VAEDecodeCache]:
    config = vae.config
    mean, inv_std = _latent_stats(config)
    x = jnp.asarray(z, _F32).transpose(0, 2, 3, 1)  # [f, h, w, C]
    x = (x / inv_std + mean).astype(config.dtype)  # Wan: z / scale[1] + scale[0]
    x = vae.conv2(x)
    caches = _Caches(tuple(cache.convs))
    y = vae.decoder(x, caches, first=not cache.started)
    video = jnp.clip(y.astype(_F32), -1.0, 1.0).transpose(0, 3, 1, 2)
    return video, VAEDecodeCache(caches.done(), True)


def _encode_impl(vae: WanVAE, video: jax.Array, cache: VAEEncodeCache) -> tuple[jax.Array, VAEEncodeCache]:
    config = vae.config
    x = jnp.asarray(video, _F32).transpose(0, 2, 3, 1).astype(config.dtype)
    caches = _Caches(tuple(cache.convs))
    y = vae.conv1(vae.encoder(x, caches, first=not cache.started))
    mean, inv_std = _latent_stats(config)
    mu = (y[..., :config.z_dim].astype(_F32) - mean) * inv_std  # Wan: (mu - scale[0]) * scale[1]
    return mu.transpose(0, 3, 1, 2), VAEEncodeCache(caches.done(), True)


def _decode_step_split(graphdef: Any, params: Any, z: jax.Array, cache: VAEDecodeCache) -> Any:
    return _decode_impl(nnx.merge(graphdef, params), z, cache)


def _encode_step_split(graphdef: Any, params: Any, video: jax.Array, cache: VAEEncodeCache) -> Any:
    return _encode_impl(nnx.merge(graphdef, params), video, cache)


#: ``(graphdef, params, z, cache) -> (video, cache)``: :func:`decode_step`'s program, the cache donated.
_decode_step_jit = jax.jit(_decode_step_split, static_argnums=0, donate_argnums=3)
_encode_step_jit = jax.jit(_encode_step_split, static_argnums=0, donate_argnums=3)
#: The same programs keeping the input cache: a batched tick is all or nothing, so until every session of
#: the batch has its block, each session's installed cache must stay usable (the one-by-one rerun reads it).
_decode_step_keep_jit = jax.jit(_decode_step_split, static_argnums=0)
_encode_step_keep_jit = jax.jit(_encode_step_split, static_argnums=0)


def _decode_clip(vae: WanVAE, z: jax.Array) -> jax.Array:
    f, _, h, w = z.shape
    cache = init_decode_cache(vae.config, (h, w))
    frames = []
    for i in range(f):  # Wan's decode: a fresh cache, then one latent frame at a time
        video, cache = decode_step(vae, z[i:i + 1], cache)
        frames.append(video)
    return jnp.concatenate(frames, axis=0)


def _encode_clip(vae: WanVAE, video: jax.Array) -> jax.Array:
    f, _, h, w = video.shape
    t = vae.config.temporal_factor
    if (f - 1) % t:
        raise ValueError(f"encode takes 1 + {t}k frames (Wan chunks a clip as 1, {t}, {t}, ...), got {f}")
    cache = init_encode_cache(vae.config, (h, w))
    latents = []
    for start in range(0, f, t):  # chunks [0, 1), [1, 1 + t), ...
        chunk, cache = encode_step(vae, video[max(0, start - t + 1):start + 1], cache)
        latents.append(chunk)
    return jnp.concatenate(latents, axis=0)


# -- checkpoints -----------------------------------------------------------------------------------------

#: Prefixes a VAE state dict may carry (stripped when every name has it).
_PREFIXES = ("vae.", "model.", "module.", "first_stage_model.")

#: Keys a ``.pth`` may hold the VAE's state dict under.
_STATE_KEYS = ("state_dict", "model", "vae", "model_state_dict", "module", "ema")

_DIFFUSERS_MARKERS = ("quant_conv.", "post_quant_conv.", "encoder.conv_in.", "decoder.conv_in.",
                      "encoder.down_blocks.", "decoder.up_blocks.", ".mid_block.")


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One parameter of ours and the torch tensor that fills it."""

    path: tuple[str, ...]  # the parameter's path in nnx.state
    torch_shape: tuple[int, ...]
    kind: str  # "kernel" ([O, I, *k] -> [*k, I, O]), "copy", "gamma" (drop the broadcast 1s)


def _slots(vae: WanVAE, naming: str) -> dict[str, _Slot]:
    """Checkpoint name (``naming``: "original" or "diffusers") -> the slot it fills, for every parameter."""
    which = 0 if naming == "original" else 1
    out: dict[str, _Slot] = {}
    for path, module in nnx.iter_modules(vae):
        if isinstance(module, _Conv):
            k = module.kernel.get_value().shape
            prefix = module.names[which]
            out[f"{prefix}.weight"] = _Slot((*map(str, path), "kernel"), (k[-1], k[-2], *k[:-2]), "kernel")
            out[f"{prefix}.bias"] = _Slot((*map(str, path), "bias"), (k[-1],), "copy")
        elif isinstance(module, _RMSNorm):
            out[f"{module.names[which]}.gamma"] = _Slot((*map(str, path), "gamma"), module.torch_shape, "gamma")
    return out


def vae_names(config: WanVAEConfig | None = None, naming: str = "original") -> dict[str, tuple[int, ...]]:
    """Every tensor a Wan VAE checkpoint of ``config`` holds and its torch shape: ``naming="original"``
    (``Wan2.1_VAE.pth``) or ``"diffusers"`` (``AutoencoderKLWan``). Wan 2.1: 194 tensors."""
    if naming not in ("original", "diffusers"):
        raise ValueError(f"naming must be 'original' or 'diffusers', got {naming!r}")
    config = WanVAEConfig() if config is None else config
    abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
    return {name: slot.torch_shape for name, slot in _slots(abstract, naming).items()}


def _torch_to_ours(slot: _Slot, array: np.ndarray) -> np.ndarray:
    if slot.kind == "kernel":
        return np.transpose(array, (*range(2, array.ndim), 1, 0))
    if slot.kind == "gamma":
        return array.reshape(-1)
    return array


@dataclasses.dataclass
class _VAECheckpoint:
    path: Path
    naming: str  # "original" or "diffusers"
    tensors: dict[str, _Tensor]  # cleaned name -> tensor
    json_config: dict[str, Any] | None  # diffusers' config.json
    json_path: Path | None


def _pick_vae_state(obj: Any, path: Path) -> dict[str, Any]:
    torch = _torch()
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict (or a dict holding one)")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _tensor_dict(obj, path, "the file")
    for key in _STATE_KEYS:
        if isinstance(obj.get(key), dict) and obj[key]:
            return _tensor_dict(obj[key], path, f"entry {key!r}")
    raise CheckpointError(f"{path} is neither a state dict of tensors nor holds one under "
                          f"{', '.join(map(repr, _STATE_KEYS))} (it has: {_names(map(str, obj))})")


def _open_vae(path: str | os.PathLike[str]) -> _VAECheckpoint:
    path = Path(path)
    json_path = None
    if path.is_dir():
        root = path
        if not (root / "config.json").exists() and (root / "vae" / "config.json").exists():
            root = root / "vae"  # a diffusers pipeline root
        json_path = root / "config.json"
        if not json_path.exists():
            raise CheckpointError(f"{path} is a directory without config.json: a diffusers AutoencoderKLWan "
                                  "directory (config.json + diffusion_pytorch_model.safetensors) is expected")
        stored = _read_weights_dir(root)
        path = root
    elif not path.exists():
        raise FileNotFoundError(f"VAE checkpoint {path} does not exist")
    elif path.suffix == ".safetensors":
        stored = _safetensors_tensors({path.name: SafetensorsFile(
            path, max_header_bytes=header_budget(MAX_EXPECTED_TENSORS))})
    elif path.suffix in (".pth", ".pt", ".ckpt", ".bin"):
        stored = _torch_tensors(_pick_vae_state(_torch_load(path), path), path)
    else:
        raise CheckpointError(f"{path}: not a VAE checkpoint this loader reads (a .pth/.pt torch file, a "
                              ".safetensors file, or a diffusers AutoencoderKLWan directory)")
    cleaned = _strip_prefixes(stored, _PREFIXES)
    tensors: dict[str, _Tensor] = {}
    for stored_name, name in cleaned.items():
        if name in tensors:
            raise CheckpointError(f"{path}: tensors {tensors[name].stored!r} and {stored_name!r} both name {name!r}")
        tensors[name] = stored[stored_name]
    naming = "diffusers" if any(n.startswith(m) or m in n for n in tensors for m in _DIFFUSERS_MARKERS) \
        else "original"
    json_config = _read_json(json_path) if json_path is not None else None
    return _VAECheckpoint(path, naming, tensors, json_config, json_path)


#: diffusers config.json fields -> our config fields (the structural ones a config is checked against).
_JSON_FIELDS = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "latents_mean",
                "latents_std")


def _config_from_json(ckpt: _VAECheckpoint) -> dict[str, Any]:
    data, where = ckpt.json_config or {}, ckpt.json_path
    name = data.get("_class_name")
    if name is not None and name != "AutoencoderKLWan":
        raise CheckpointError(f"{where}: _class_name is {name!r}; load_vae reads AutoencoderKLWan (the Wan 2.1 VAE)")
    refusals = []
    if data.get("is_residual"):
        refusals.append("is_residual is true (the Wan 2.2 VAE: residual up/down blocks, patchified input)")
    if data.get("attn_scales"):
        refusals.append(f"attn_scales is {data['attn_scales']} (Wan 2.1 has attention only in the middle blocks)")
    if data.get("patch_size") not in (None, 1):
        refusals.append(f"patch_size is {data['patch_size']} (the Wan 2.2 VAE's patchified input)")
    for field in ("in_channels", "out_channels"):
        if data.get(field, 3) != 3:
            refusals.append(f"{field} is {data[field]} (RGB only)")
    if data.get("decoder_base_dim") not in (None, data.get("base_dim", 96)):
        refusals.append(f"decoder_base_dim {data['decoder_base_dim']} differs from base_dim")
    if refusals:
        raise CheckpointError(f"{where} describes a VAE this port does not implement: " + "; ".join(refusals))
    found = {field: data[field] for field in _JSON_FIELDS if data.get(field) is not None}
    _check_json_fields(where, found)
    return found


def _check_json_fields(where: Path | None, found: dict[str, Any]) -> None:
    """CheckpointError naming the file and field for a config.json value of the wrong kind: sizes positive
    integers, ``dim_mult`` a list of them, ``temperal_downsample`` of true/false, the latent statistics lists
    of finite numbers (``latents_std`` positive). Bools, strings, NaN and infinities are refused, never coerced."""
    assert where is not None
    for field in ("base_dim", "z_dim", "num_res_blocks"):
        if field in found:
            json_positive_int(where, field, found[field])
    lists = {"dim_mult": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
             "temperal_downsample": lambda v: isinstance(v, bool),
             "latents_mean": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
             "latents_std": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
             and v > 0}
    kinds = {"dim_mult": "positive integers", "temperal_downsample": "true/false values",
             "latents_mean": "finite numbers", "latents_std": "finite positive numbers"}
    for field, ok in lists.items():
        if field not in found:
            continue
        value = found[field]
        if not isinstance(value, list) or not all(ok(v) for v in value):
            bad = next((v for v in value if not ok(v)), None) if isinstance(value, list) else value
            raise CheckpointError(f"{where}: {field} must be a list of {kinds[field]}, got {bad!r}"
                                  + (" in it" if isinstance(value, list) else ""))
    if len(found.get("dim_mult", ())) > 16:
        raise CheckpointError(f"{where}: dim_mult has {len(found['dim_mult'])} stages (Wan's VAE has 4)")


def _infer_config(ckpt: _VAECheckpoint) -> dict[str, Any]:
    """base_dim and z_dim from the tensors of a file without config.json (the rest: Wan 2.1's)."""
    conv_in = "encoder.conv1.weight" if ckpt.naming == "original" else "encoder.conv_in.weight"
    post = "conv2.weight" if ckpt.naming == "original" else "post_quant_conv.weight"
    found: dict[str, Any] = {}
    if conv_in in ckpt.tensors and len(ckpt.tensors[conv_in].shape) == 5:
        found["base_dim"] = ckpt.tensors[conv_in].shape[0]
    if post in ckpt.tensors and len(ckpt.tensors[post].shape) == 5:
        found["z_dim"] = ckpt.tensors[post].shape[0]
    return found


def _resolve_vae_config(ckpt: _VAECheckpoint, config: WanVAEConfig | None, dtype: Any) -> WanVAEConfig:
    found = _config_from_json(ckpt) if ckpt.json_config is not None else _infer_config(ckpt)
    if config is None:
        if ckpt.json_config is None and found.get("z_dim", len(WAN21_LATENTS_MEAN)) != len(WAN21_LATENTS_MEAN):
            raise CheckpointError(f"{ckpt.path} has {found['z_dim']} latent channels; without a config.json only "
                                  "Wan 2.1's 16 (and their latent statistics) are known: pass config=WanVAEConfig(...)")
        try:
            config = WanVAEConfig(**found)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{ckpt.json_path or ckpt.path}: {error}") from None
    else:
        if not isinstance(config, WanVAEConfig):
            raise TypeError(f"config must be a WanVAEConfig, got {type(config).__name__}")
        wrong = []
        for field, value in found.items():
            ours = getattr(config, field)
            theirs = tuple(value) if isinstance(value, (list, tuple)) else value
            if isinstance(ours, tuple):
                theirs = tuple(type(o)(v) for o, v in zip(ours, theirs)) if len(theirs) == len(ours) else theirs
            if ours != theirs:
                wrong.append(f"{field}: config {ours}, checkpoint {value}")
        if wrong:
            raise CheckpointError(f"{ckpt.json_path or ckpt.path} disagrees with the given config: " + "; ".join(wrong))
    if dtype is not None:
        config = config.replace(dtype=jnp.dtype(dtype).name)
    return config


def _check_vae_tensors(ckpt: _VAECheckpoint, expected: dict[str, _Slot], config: WanVAEConfig) -> None:
    names = ckpt.tensors
    missing = [n for n in expected if n not in names]
    unexpected = [n for n in names if n not in expected]
    shapes = [f"{n} {list(names[n].shape)} (expected {list(s.torch_shape)})"
              for n, s in expected.items() if n in names and tuple(names[n].shape) != s.torch_shape]
    dtypes = [f"{n} ({names[n].dtype})" for n in expected  # (jnp's issubdtype knows bf16 and fp8)
              if n in names and not jnp.issubdtype(names[n].dtype, jnp.floating)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if shapes:
        problems.append(f"mis-shaped tensors: {_names(shapes)}")
    if dtypes:
        problems.append(f"non-float tensors: {_names(dtypes)}")
    if problems:
        raise CheckpointError(
            f"{ckpt.path} ({ckpt.naming} names) does not fit WanVAE(base_dim={config.base_dim}, z_dim={config.z_dim}, "
            f"dim_mult={config.dim_mult}, num_res_blocks={config.num_res_blocks}): " + "; ".join(problems))


def load_vae(path: str | os.PathLike[str], config: WanVAEConfig | None = None, *, dtype: Any = None) -> WanVAE:
    """A :class:`WanVAE` holding the weights of a Wan 2.1 VAE checkpoint.

    Args:
      path: the original ``Wan2.1_VAE.pth`` (the state dict at the top or under
        ``state_dict``/``model``/``vae``/...; ``vae.``/``model.`` prefixes stripped), an
        original- or diffusers-named ``.safetensors`` file, or a diffusers
        ``AutoencoderKLWan`` directory (``config.json`` + ``diffusion_pytorch_model.safetensors``,
        sharded or not; a pipeline root with ``vae/`` too).
      config: None: from ``config.json``, else base width and latent channels from the
        tensors and the rest Wan 2.1's. Refused where it disagrees with ``config.json``.
      dtype: parameter and activation dtype (replaces ``config.dtype``).

    Raises:
      CheckpointError: (a ValueError) missing, unexpected, mis-shaped or non-float tensors
        (named), a corrupt file, a config.json of another VAE (Wan 2.2's residual one).
        Nothing is placed on device before every check has passed.
      ImportError: a ``.pth`` without torch installed.
    """
    with _as_checkpoint_error():
        ckpt = _open_vae(path)
    config = _resolve_vae_config(ckpt, config, dtype)
    # Every residual block has 6 tensors: a config far larger than the file is refused before the
    # (abstract) network is built, which would take time and memory in its size.
    least = 6 * len(config.dim_mult) * (2 * config.num_res_blocks + 1)
    if least > len(ckpt.tensors):
        raise CheckpointError(f"{ckpt.json_path or ckpt.path} describes a VAE of at least {least} tensors "
                              f"(dim_mult {config.dim_mult}, num_res_blocks {config.num_res_blocks}) but "
                              f"{ckpt.path} holds {len(ckpt.tensors)}")
    abstract = nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0)))
    expected = _slots(abstract, ckpt.naming)
    _check_vae_tensors(ckpt, expected, config)

    graphdef, abstract_state = nnx.split(abstract)
    flat = jax.tree_util.tree_flatten_with_path(abstract_state)
    by_path = {slot.path: name for name, slot in expected.items()}
    paths = [tuple(_key(k) for k in p if _key(k) != "value") for p, _ in flat[0]]
    if sorted(paths) != sorted(by_path):  # pragma: no cover - _slots and the modules changed apart
        raise RuntimeError(f"WanVAE's parameters no longer match its checkpoint names: "
                           f"{sorted(set(paths) ^ set(by_path))}")
    used: Counter[str] = Counter()
    leaves = []
    for p, (_, spec) in zip(paths, flat[0]):
        name = by_path[p]
        used[name] += 1
        with _as_checkpoint_error():
            host = np.asarray(_torch_to_ours(expected[name], ckpt.tensors[name].read()), dtype=spec.dtype)
        if host.shape != tuple(spec.shape):  # pragma: no cover - guarded by _check_vae_tensors
            raise RuntimeError(f"{name}: built {host.shape}, the model needs {spec.shape}")
        leaves.append(jax.device_put(host))
    wrong = sorted(n for n in ckpt.tensors if used[n] != 1)
    if wrong:  # pragma: no cover - the names are checked above; the mapping must be a bijection
        raise RuntimeError("checkpoint tensors not used exactly once: " + ", ".join(f"{n} x{used[n]}" for n in wrong))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(flat[1], leaves))


def _key(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def random_vae(config: WanVAEConfig, seed: int = 0) -> WanVAE:
    """A random :class:`~ardiff_jax.models.wan.WanVAE`, filled on the host after a shape evaluation: building it
    eagerly runs every initializer op by op (minutes on a 2-core CPU), this takes a second. Kernels are scaled
    by ``1/sqrt(fan-in)`` and vectors kept small, so activations stay in range through the decoder."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)

    def fill(leaf: Any) -> np.ndarray:
        scale = 0.02 if len(leaf.shape) <= 1 else 1.0 / np.sqrt(np.prod(leaf.shape[:-1]))
        return (rng.standard_normal(leaf.shape) * scale).astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, abstract))
