"""A Self-Forcing-style rolling KV cache in PyTorch (CPU), written from its description.

Layout and policy of Self-Forcing's ``causal_model.py`` KV cache, as its public description
gives them (this is an independent re-implementation, no code copied):

* per layer a dict with one contiguous preallocated ``k`` and ``v`` of shape
  ``[B=1, cap, H, D]`` (``cap = (K + W) * T`` tokens: the sink plus the attention window,
  the current block included), plus ``global_end_index`` and ``local_end_index`` kept as
  1-element tensors and read with ``.item()`` (host syncs on a GPU; cheap on CPU);
* writing a block whose end passes ``global_end_index`` when it does not fit after
  ``local_end_index``: **roll** the window left, keeping the sink: the span
  ``[sink + evicted, local_end)`` is cloned and assigned back to ``[sink, ...)`` (K and V,
  every layer), then the block is written at the new end;
* re-writing the same block (a later denoising step of the same block: ``current_end`` equal
  to ``global_end_index``) overwrites the same tail positions in place, without a roll;
* attention reads the view ``[local_end - max_attention_size, local_end)`` (current block
  included), here with ``max_attention_size = cap``.

So per block Self-Forcing moves ``W - F`` frames of every layer twice (clone: read + write,
assign back: read + write) on top of writing the block: linear in the window.

``rewrites_per_block=4`` reproduces how its pipeline runs one block: the first denoising
forward rolls and writes, three more denoising forwards and the final clean (timestep 0)
forward rewrite the tail in place: 1 roll + 5 writes per block.

PyTorch is optional for the benchmark suite: this module imports it lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from benchmarks.peers import PeerCache, PeerGeometry

__all__ = ["SelfForcingTorchCache", "torch_available"]


def _torch() -> Any:
    return importlib.import_module("torch")


def torch_available() -> bool:
    try:
        _torch()
    except ImportError:
        return False
    return True


_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


class SelfForcingTorchCache(PeerCache):
    name = "selfforcing_torch"

    def __init__(self, geometry: PeerGeometry, rewrites_per_block: int = 0) -> None:
        super().__init__(geometry)
        torch = _torch()
        self.torch = torch
        g = geometry
        self.dtype = getattr(torch, _TORCH_DTYPES[g.dtype])
        self.rewrites_per_block = rewrites_per_block
        if rewrites_per_block:
            self.name = "selfforcing_torch_pipeline"
        self.sink_tokens = g.sink_frames * g.tokens_per_frame
        self.capacity = g.visible_frames * g.tokens_per_frame  # kv_cache_size
        self.max_attention_size = self.capacity
        shape = (1, self.capacity, g.num_kv_heads, g.head_size)
        self.kv_cache = [
            {
                "k": torch.zeros(shape, dtype=self.dtype),
                "v": torch.zeros(shape, dtype=self.dtype),
                "global_end_index": torch.tensor([0], dtype=torch.long),
                "local_end_index": torch.tensor([0], dtype=torch.long),
            }
            for _ in range(g.num_layers)
        ]
        self.next_start = 0  # absolute token index where the next block begins

    def from_numpy(self, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        return (self.torch.from_numpy(k).to(self.dtype).contiguous(),
                self.torch.from_numpy(v).to(self.dtype).contiguous())

    # -- the per-layer write, as the attention layer does it -----------------------------------
    def _write_layer(self, cache: dict[str, Any], k: Any, v: Any, current_start: int) -> None:
        """Write ``k, v`` (``[1, n, H, D]``) for tokens ``[current_start, current_start + n)``."""
        num_new = k.shape[1]
        current_end = current_start + num_new
        global_end = int(cache["global_end_index"].item())
        local_end = int(cache["local_end_index"].item())
        if current_end > global_end and num_new + local_end > self.capacity:
            # Roll: drop the oldest non-sink tokens by shifting the rest left over them.
            num_evicted = num_new + local_end - self.capacity
            num_rolled = local_end - num_evicted - self.sink_tokens
            src = slice(self.sink_tokens + num_evicted, self.sink_tokens + num_evicted + num_rolled)
            dst = slice(self.sink_tokens, self.sink_tokens + num_rolled)
            # clone() first: source and destination overlap.
            cache["k"][:, dst] = cache["k"][:, src].clone()
            cache["v"][:, dst] = cache["v"][:, src].clone()
            new_local_end = local_end + current_end - global_end - num_evicted
        else:
            new_local_end = local_end + current_end - global_end
        new_local_start = new_local_end - num_new
        cache["k"][:, new_local_start:new_local_end] = k
        cache["v"][:, new_local_start:new_local_end] = v
        cache["global_end_index"].fill_(current_end)
        cache["local_end_index"].fill_(new_local_end)

    def commit_block(self, k: Any, v: Any) -> None:
        start = self.next_start
        for _ in range(1 + self.rewrites_per_block):  # later passes: same positions, no roll
            for layer, cache in enumerate(self.kv_cache):
                self._write_layer(cache, k[layer:layer + 1], v[layer:layer + 1], start)
        self.next_start = start + k.shape[1]

    # -- reads ----------------------------------------------------------------------------------
    def _attention_view(self, cache: dict[str, Any]) -> tuple[Any, Any]:
        local_end = int(cache["local_end_index"].item())
        lo = max(0, local_end - self.max_attention_size)
        return cache["k"][:, lo:local_end], cache["v"][:, lo:local_end]

    def read_visible(self) -> Any:
        import jax.dlpack

        from benchmarks.peers import sum_f32

        out = []
        for cache in self.kv_cache:
            k, v = self._attention_view(cache)  # views: attention reads the cache in place
            # Zero-copy into JAX (the views are contiguous slices), so the same reduction
            # kernel reads the same bytes for every peer.
            out.append(sum_f32(jax.dlpack.from_dlpack(k), jax.dlpack.from_dlpack(v)))
        return out

    def visible_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """History the next forward will see: what survives its roll, without its own block."""
        cache = self.kv_cache[layer]
        local_end = int(cache["local_end_index"].item())
        num_new = self.geometry.block_tokens
        if num_new + local_end > self.capacity:
            num_evicted = num_new + local_end - self.capacity
            keep = [slice(0, self.sink_tokens), slice(self.sink_tokens + num_evicted, local_end)]
        else:
            keep = [slice(0, local_end)]
        out = []
        for name in ("k", "v"):
            parts = [cache[name][0, s].float().numpy() for s in keep]
            out.append(np.concatenate(parts, axis=0))
        return out[0], out[1]
