"""The attention-backend seam: :meth:`PagedKVCaches.attend` calls a backend chosen by name.

A backend is a pure function with the signature of :func:`~ardiff_jax.kv.paged_attention`::

    backend(layout, pools, cursor, layer, q, k, v, extra_k, extra_v, *, scale) -> out

``"xla"`` (the default) is the contiguous-run read with a shared log-sum-exp;
:func:`~ardiff_jax.kv.ref_paged_attention` stays the oracle every backend is tested
against. The backend name is a *static* field of the cache view, so switching backends
recompiles once and callers (models, rollouts) never change. A GPU backend registers
itself here under its own name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ardiff_jax.kv._attention import paged_attention

__all__ = ["AttentionBackend", "attention_backend", "attention_backends", "register_attention_backend"]

#: ``(layout, pools, cursor, layer, q, k, v, extra_k, extra_v, *, scale) -> out``.
AttentionBackend = Callable[..., jax.Array]

_BACKENDS: dict[str, AttentionBackend] = {}
_JITTED: dict[str, AttentionBackend] = {}


def register_attention_backend(name: str, fn: AttentionBackend) -> None:
    """Make ``fn`` selectable as ``backend=name``. Re-registering a name replaces it."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"attention backend names must be non-blank strings, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend {name!r} must be callable, got {type(fn).__name__}")
    _BACKENDS[name] = fn
    _JITTED[name] = jax.jit(fn, static_argnums=0)


def attention_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    return tuple(_BACKENDS)


def attention_backend(name: str, *, jitted: bool = True) -> AttentionBackend:
    """The backend registered as ``name`` (jitted with the layout static, unless ``jitted=False``)."""
    table = _JITTED if jitted else _BACKENDS
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; registered: {list(_BACKENDS)}") from None


def check_attention_backend(name: Any) -> str:
    """``name`` if it is registered, else ValueError listing the registered ones."""
    attention_backend(name)
    return name


register_attention_backend("xla", paged_attention)
