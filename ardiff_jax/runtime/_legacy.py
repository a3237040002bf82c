"""Deprecated spellings of the former experimental KV API, kept working with a ``DeprecationWarning``.

Each shim translates mechanically to the current call and says which one in its warning
(``docs/migration.md`` has the table). They exist so DreamZero-era model code runs while it
is migrated; new code should never need them.

* ``state.pos`` / ``state.neg`` -> ``state.adapter("positive")`` / ``state.adapter("negative")``;
* a boolean ``is_negative`` as the branch of ``get_kv_caches`` / ``commit_paged_context``;
* ``state.get_cross_kv_caches(is_negative)`` -> ``get_cross_attention_kv(branch, name)``;
* ``state.reset(keep_cross_text=...)`` -> ``state.reset(keep_cross_attention=("text",))``;
* ``write_cross_attention_kv`` per layer + ``mark_cross_attention_populated``: the layers
  are staged and published only at the mark, through the transactional
  ``populate_cross_attention``;
* the old ``ARDiffusionKVCache`` keywords (``num_frame_per_block``, ``local_branches``,
  ``cross_attn_length``, ``cross_attn_img_length``, ``frame_seqlen``) -> a capability spec.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ardiff_jax.capability import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec

__all__ = ["LegacyStateAPI", "branch_of", "spec_from_kwargs"]

POSITIVE, NEGATIVE = "positive", "negative"

#: Legacy DreamZero defaults: LRU of 64 sessions by count.
_LEGACY_SESSION_CAPACITY = 64


def deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new} (see docs/migration.md)", DeprecationWarning, stacklevel=3)


def branch_of(kv_branch: Any, method: str) -> Any:
    """Map a legacy boolean ``is_negative`` to its branch name (with a warning); pass names through."""
    if isinstance(kv_branch, bool):
        name = NEGATIVE if kv_branch else POSITIVE
        deprecated(f"{method}(is_negative={kv_branch})", f"{method}({name!r}, ...)")
        return name
    return kv_branch


class LegacyStateAPI:
    """Deprecated methods of :class:`~ardiff_jax.ARDiffusionKVState`, implemented on its current API."""

    @property
    def pos(self) -> Any:
        deprecated("state.pos", 'state.adapter("positive")')
        return self.adapter(POSITIVE)  # type: ignore[attr-defined]

    @property
    def neg(self) -> Any:
        deprecated("state.neg", 'state.adapter("negative")')
        return self.adapter(NEGATIVE)  # type: ignore[attr-defined]

    def get_cross_kv_caches(self, is_negative: bool) -> dict[str, Any]:
        """``{cache name: CrossAttentionKV}`` of every populated cache of the branch (``"text"``, ``"image"``)."""
        branch = NEGATIVE if is_negative else POSITIVE
        deprecated("state.get_cross_kv_caches(is_negative)", f'state.get_cross_attention_kv({branch!r}, "text")')
        names = self._cache.spec.cross_attention_lengths  # type: ignore[attr-defined]
        return {name: self.get_cross_attention_kv(branch, name)  # type: ignore[attr-defined]
                for name in names if self.is_cross_attention_populated(branch, name)}  # type: ignore[attr-defined]

    def write_cross_attention_kv(self, cache_name: str, layer_index: int, kv_branch: str, key: Any, value: Any) -> None:
        """Stage one layer; nothing is readable until :meth:`mark_cross_attention_populated`."""
        deprecated("state.write_cross_attention_kv + mark_cross_attention_populated",
                   "state.populate_cross_attention(branch, name, layer_kv_pairs)")
        self.adapter(kv_branch)  # type: ignore[attr-defined]
        self._check_cross_name(cache_name)  # type: ignore[attr-defined]
        num_layers = self._cache.spec.num_layers  # type: ignore[attr-defined]
        if isinstance(layer_index, bool) or not isinstance(layer_index, int) or not 0 <= layer_index < num_layers:
            raise IndexError(f"layer_index must be in [0, {num_layers}), got {layer_index!r}")
        staged = self.__dict__.setdefault("_legacy_staged", {})
        staged.setdefault((kv_branch, cache_name), {})[layer_index] = (key, value)

    def mark_cross_attention_populated(self, kv_branch: str, cache_name: str) -> None:
        """Publish the staged layers with one transactional ``populate_cross_attention``."""
        deprecated("state.mark_cross_attention_populated", "state.populate_cross_attention(branch, name, pairs)")
        staged: dict[tuple[str, str], dict[int, Any]] = self.__dict__.get("_legacy_staged", {})
        layers = staged.get((kv_branch, cache_name), {})
        num_layers = self._cache.spec.num_layers  # type: ignore[attr-defined]
        missing = [i for i in range(num_layers) if i not in layers]
        if missing:
            raise ValueError(f"AR-Diffusion cross-attention {cache_name!r} of branch {kv_branch!r}: layers {missing} "
                             "were never written; nothing was published")
        self.populate_cross_attention(kv_branch, cache_name,  # type: ignore[attr-defined]
                                      (layers[i] for i in range(num_layers)))
        del staged[(kv_branch, cache_name)]


_LEGACY_KEYWORDS = {
    "num_frame_per_block": "frames_per_block",
    "frame_seqlen": "tokens_per_frame",
}


def spec_from_kwargs(kwargs: Mapping[str, Any]) -> ARDiffusionKVCacheSpec:
    """Build a spec from ``ARDiffusionKVCache`` keywords, translating (and warning about) the legacy ones."""
    fields = dict(kwargs)
    for old, new in _LEGACY_KEYWORDS.items():
        if old in fields:
            deprecated(f"ARDiffusionKVCache({old}=...)", f"ARDiffusionKVCacheSpec({new}=...)")
            if new in fields:
                raise TypeError(f"pass {new} or its legacy name {old}, not both")
            fields[new] = fields.pop(old)
    if "local_branches" in fields:
        deprecated("ARDiffusionKVCache(local_branches=...)", "ARDiffusionKVCacheSpec(kv_branches=...)")
        count = fields.pop("local_branches")
        if count not in (1, 2) or isinstance(count, bool):
            raise ValueError(f"local_branches must be 1 or 2, got {count!r}")
        branches = [ARDiffusionKVBranchSpec(POSITIVE, 0)] + ([ARDiffusionKVBranchSpec(NEGATIVE, 1)] if count == 2 else [])
        fields.setdefault("kv_branches", tuple(branches))
        fields.setdefault("session_capacity", _LEGACY_SESSION_CAPACITY)
    cross = list(fields.pop("cross_attention", ()))
    lengths = dict(fields.pop("cross_attention_lengths", {}) or {})
    for old, name in (("cross_attn_length", "text"), ("cross_attn_img_length", "image")):
        if old in fields:
            deprecated(f"ARDiffusionKVCache({old}=...)", f'cross_attention_lengths={{"{name}": ...}}')
            length = fields.pop(old)
            if length:
                lengths[name] = length
    heads = dict(fields.pop("cross_attention_kv_heads", {}) or {})
    cross += [ARDiffusionCrossAttentionKVSpec(name, length, heads.get(name)) for name, length in lengths.items()]
    try:
        return ARDiffusionKVCacheSpec(**fields, cross_attention=tuple(cross))
    except TypeError as error:
        raise TypeError(f"ARDiffusionKVCache without a spec takes the spec's fields as keywords: {error}") from None
