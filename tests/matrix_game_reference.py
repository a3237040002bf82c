"""An independent torch reference of Matrix-Game 2.0's action module and of the whole network, for parity tests.

Written from the behaviour of the release (dense, whole sequence, no caches), not from the
JAX code:

* action rows are one per video frame; 12 copies of row 0 are put in front, and latent
  frame ``j`` reads padded rows ``[4j, 4j + 12)``;
* mouse: each token is concatenated with its frame's 12 x 2 window (flattened row by row),
  an MLP (Linear, tanh-GELU, Linear, LayerNorm) gives q/k/v (16 heads of 64 in the release),
  q and k are RMS-normalised *without* the stored scale (the release's norm ignores its
  weight), rotated HunyuanVideo-style (real cos/sin, interleaved pairs, ``rotate_half``) over
  the head split ``[t, h, w]`` with the ``h``/``w`` positions at 0, and every spatial token
  attends over the latent frames under a frame mask; the result goes through ``proj_mouse``
  and is added;
* keyboard: each row is embedded (Linear, SiLU, Linear), a frame's 12 rows are flattened and
  projected to one key/value per latent frame; queries come from the tokens after the mouse
  residual; same norms and rotation; every token attends over the frames under the mask;
  ``proj_keyboard``; added.

The module's parameter names are the release's (``keyboard_embed.0``, ``mouse_mlp.3``,
``t_qkv``, ``img_attn_q_norm``, ``mouse_attn_q``, ``keyboard_attn_kv``, ``key_attn_k_norm``,
``proj_mouse``, ...), so its ``state_dict()`` is what ``blocks.{i}.action_model.*`` holds.

The whole network is diffusers' ``WanTransformer3DModel`` (36-channel input, image context
through its ``image_embedder`` MLPProj, no text tokens), with a block-causal frame mask
injected into every self-attention and the action modules inserted after the cross-attention
of the first blocks by hooks.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn


def frame_visibility(num_frames: int, frames_per_block: int, window: int) -> torch.Tensor:
    """``bool[F, F]``: query frame ``i`` sees key frame ``j`` iff ``j`` lies in the last ``window`` frames up to
    the end of ``i``'s block (the current block included, nothing later)."""
    frames = torch.arange(num_frames)
    end = (frames // frames_per_block + 1) * frames_per_block
    return (frames[None, :] < end[:, None]) & (frames[None, :] >= end[:, None] - window)


class _UnusedScale(nn.Module):
    """Holds a ``weight`` the release stores but never applies."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def _rope_tables(positions: torch.Tensor, dims: tuple[int, int, int], theta: float) -> tuple[torch.Tensor, ...]:
    """Real cos/sin ``[n, head_dim]`` over the split ``dims`` (frame, h, w), h and w at position 0; each
    frequency repeated for its interleaved pair."""
    cos_parts, sin_parts = [], []
    for axis, dim in enumerate(dims):
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        pos = positions.to(torch.float64) if axis == 0 else torch.zeros_like(positions, dtype=torch.float64)
        angles = torch.outer(pos, inv)
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos_parts, 1).float(), torch.cat(sin_parts, 1).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


class ReferenceActionModule(nn.Module):
    def __init__(self, dim: int, keyboard_dim: int, mouse_dim: int, heads: int, embed: int, keyboard_hidden: int,
                 mouse_hidden: int, rope_dims: tuple[int, int, int], ratio: int = 4, window: int = 3,
                 theta: float = 256.0, apply_norm_weight: bool = False) -> None:
        super().__init__()
        self.heads, self.ratio, self.window, self.theta = heads, ratio, window, theta
        self.rope_dims, self.apply_norm_weight = rope_dims, apply_norm_weight
        rows = ratio * window
        self.keyboard_embed = nn.Sequential(nn.Linear(keyboard_dim, embed), nn.SiLU(), nn.Linear(embed, embed))
        self.mouse = bool(mouse_dim)
        if mouse_dim:
            self.mouse_mlp = nn.Sequential(nn.Linear(rows * mouse_dim + dim, mouse_hidden), nn.GELU(approximate="tanh"),
                                           nn.Linear(mouse_hidden, mouse_hidden), nn.LayerNorm(mouse_hidden))
            self.t_qkv = nn.Linear(mouse_hidden, 3 * mouse_hidden, bias=False)
            self.img_attn_q_norm = _UnusedScale(mouse_hidden // heads)
            self.img_attn_k_norm = _UnusedScale(mouse_hidden // heads)
            self.proj_mouse = nn.Linear(mouse_hidden, dim, bias=False)
        self.mouse_attn_q = nn.Linear(dim, keyboard_hidden, bias=False)
        self.keyboard_attn_kv = nn.Linear(rows * embed, 2 * keyboard_hidden, bias=False)
        self.key_attn_q_norm = _UnusedScale(keyboard_hidden // heads)
        self.key_attn_k_norm = _UnusedScale(keyboard_hidden // heads)
        self.proj_keyboard = nn.Linear(keyboard_hidden, dim, bias=False)

    def _norm(self, x: torch.Tensor, module: _UnusedScale) -> torch.Tensor:
        return _rms(x, 1e-6, module.weight if self.apply_norm_weight else None)

    def _windows(self, rows: torch.Tensor, num_frames: int) -> torch.Tensor:
        pad = self.ratio * self.window
        padded = torch.cat([rows[:1].expand(pad, -1), rows])
        return torch.stack([padded[self.ratio * j: self.ratio * j + pad] for j in range(num_frames)])

    def forward(self, x: torch.Tensor, keyboard: torch.Tensor, mouse: torch.Tensor | None,
                visible: torch.Tensor) -> torch.Tensor:
        """``x [F*S, dim]`` (frame-major), raw rows ``keyboard [N, K]``, ``mouse [N, M]``, ``visible bool[F, F]``
        -> the two residuals' sum ``[F*S, dim]``."""
        num_frames = visible.shape[0]
        tokens = x.shape[0] // num_frames
        cos, sin = _rope_tables(torch.arange(num_frames), self.rope_dims, self.theta)  # [F, D]
        rotate = (lambda t: t * cos[:, None, None, :] + _rotate_half(t) * sin[:, None, None, :])  # t [F, ., H, D]
        total = torch.zeros_like(x)
        hidden = x
        if self.mouse:
            window = self._windows(mouse, num_frames).reshape(num_frames, 1, -1).expand(-1, tokens, -1)
            feats = self.mouse_mlp(torch.cat([x.reshape(num_frames, tokens, -1), window], dim=-1))
            q, k, v = self.t_qkv(feats).unflatten(-1, (3, self.heads, -1)).unbind(2)  # [F, S, H, D]
            q = rotate(self._norm(q, self.img_attn_q_norm))
            k = rotate(self._norm(k, self.img_attn_k_norm))
            scores = torch.einsum("fshd,gshd->shfg", q, k) / q.shape[-1] ** 0.5
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out = torch.einsum("shfg,gshd->fshd", weights, v).reshape(num_frames * tokens, -1)
            residual = self.proj_mouse(out)
            total = total + residual
            hidden = x + residual
        embedded = self.keyboard_embed(self._windows(keyboard, num_frames))  # [F, 12, E]
        k, v = self.keyboard_attn_kv(embedded.reshape(num_frames, -1)).unflatten(-1, (2, self.heads, -1)).unbind(1)
        q = self.mouse_attn_q(hidden).reshape(num_frames, tokens, self.heads, -1)
        q = rotate(self._norm(q, self.key_attn_q_norm))
        k = rotate(self._norm(k, self.key_attn_k_norm)[:, None])[:, 0]  # [F, H, D]
        scores = torch.einsum("fshd,ghd->fshg", q, k) / q.shape[-1] ** 0.5
        weights = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        out = torch.einsum("fshg,ghd->fshd", weights, v).reshape(num_frames * tokens, -1)
        return total + self.proj_keyboard(out)


@contextlib.contextmanager
def matrix_game_hooks(model: nn.Module, actions: list[ReferenceActionModule], keyboard: torch.Tensor,
                      mouse: torch.Tensor | None, visible_frames: torch.Tensor, tokens_per_frame: int):
    """Turn diffusers' ``WanTransformer3DModel`` into a dense block-causal Matrix-Game: a frame mask in every
    self-attention, and ``actions[i]`` after block ``i``'s cross-attention (added to its residual)."""
    token_mask = visible_frames.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
    handles, processors = [], []
    for index, block in enumerate(model.blocks):
        original = block.attn1.processor
        processors.append((block.attn1, original))

        def masked(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                   _original=original):
            return _original(attn, hidden_states, encoder_hidden_states, token_mask, rotary_emb)

        block.attn1.processor = masked
        if index < len(actions):
            captured = {}

            def before_norm(module, args, _captured=captured):
                _captured["x"] = args[0]

            def after_cross(module, args, output, _captured=captured, _action=actions[index]):
                x1 = _captured["x"] + output  # the residual stream after cross-attention
                return output + _action(x1[0], keyboard, mouse, visible_frames)[None]

            handles.append(block.norm2.register_forward_pre_hook(before_norm))
            handles.append(block.attn2.register_forward_hook(after_cross))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for attn, original in processors:
            attn.processor = original


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
