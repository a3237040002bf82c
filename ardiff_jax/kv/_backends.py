"""The attention-backend seam: :meth:`PagedKVCaches.attend` calls a backend chosen by name.

A backend is a pure function with the signature of :func:`~ardiff_jax.kv.paged_attention`
(see :class:`AttentionBackend`). ``"xla"`` (the default, built in) is
:func:`~ardiff_jax.kv.paged_attention`: the contiguous-run read with a shared log-sum-exp;
:func:`~ardiff_jax.kv.ref_paged_attention` stays the oracle every backend is tested against.
A GPU kernel registers itself here under its own name, and a runtime selects it with
``ARDiffusionKVCache(..., attention_backend=name)`` or
``EngineConfig(attention_backend=name)``; models never change.

The name, not the function, is what a cache view carries: it is a *static* field of
:class:`~ardiff_jax.kv.PagedKVCaches`, so views of two backends have different treedefs and a
jitted model compiles once per backend. Because jit caches are keyed on the name, a program
compiled before a name was re-registered (``replace=True``) keeps calling the old function;
register backends before compiling models with them.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from ardiff_jax.kv._attention import paged_attention
from ardiff_jax.kv._layout import KVLayout, KVPools

__all__ = [
    "AttentionBackend",
    "attention_backend",
    "attention_backends",
    "check_attention_backend",
    "register_attention_backend",
    "unregister_attention_backend",
]

#: The built-in backend: always registered, never replaced or removed.
DEFAULT_BACKEND = "xla"


class AttentionBackend(Protocol):
    """What a registered paged-attention backend implements (the signature of ``paged_attention``).

    :meth:`PagedKVCaches.attend <ardiff_jax.kv.PagedKVCaches.attend>` validates before it
    calls a backend, so every backend receives: arrays of the documented shapes with
    floating dtypes (each of ``q, k, v, extra_k, extra_v`` possibly with a leading batch
    axis of size 1), ``k.shape[-3]`` equal to the view's ``seq_len``, current frames plus
    extra tokens within ``layout.scratch_pages``, and ``layer`` either a concrete
    ``np.int32`` in ``[0, L)`` or a traced ``i32[]`` with negative values wrapped. ``extra_k``
    and ``extra_v`` are both ``None`` or both arrays.

    A backend must be pure and jittable with ``layout`` static (the registry jits it that
    way): it reads the pools and never writes them, and returns ``q``'s shape (batch axis
    included) and dtype. It runs at trace time, once per compilation, not once per call.
    Its result must equal :func:`~ardiff_jax.kv.ref_paged_attention` up to float summation
    order.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
      layer: i32[]
      q: float[S, Hq, D]
      k, v: float[f*T, H, D]
      extra_k, extra_v: float[E, H, D]
      scale: f32[]
      returns: q.dtype[S, Hq, D]
    """

    def __call__(
        self, layout: KVLayout, pools: KVPools, cursor: jax.Array, layer: Any, q: jax.Array, k: jax.Array,
        v: jax.Array, extra_k: jax.Array | None = None, extra_v: jax.Array | None = None, *, scale: Any = None,
    ) -> jax.Array: ...


# name -> (function as registered, the same jitted with the layout static)
_REGISTRY: dict[str, tuple[AttentionBackend, AttentionBackend]] = {}


def _registered_names() -> str:
    return ", ".join(repr(name) for name in _REGISTRY)


def register_attention_backend(name: str, fn: AttentionBackend, *, replace: bool = False) -> None:
    """Make ``fn`` selectable as ``attention_backend=name`` / ``PagedKVCaches(..., backend=name)``.

    Args:
      name: a non-blank string. ValueError if it is already registered, unless ``replace``.
      fn: the backend (see :class:`AttentionBackend`); TypeError unless callable.
      replace: replace an existing registration. Programs already compiled with the old
        function keep it (jit caches are keyed on the name); the built-in ``"xla"`` cannot
        be replaced.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"attention backend names must be non-blank strings, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend {name!r} must be callable, got {type(fn).__name__}")
    if name == DEFAULT_BACKEND and name in _REGISTRY:
        raise ValueError(f"the built-in attention backend {DEFAULT_BACKEND!r} cannot be replaced; pick another name")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"attention backend {name!r} is already registered; pass replace=True to replace it "
            f"(registered: {_registered_names()})"
        )
    _REGISTRY[name] = (fn, jax.jit(fn, static_argnums=0))


def unregister_attention_backend(name: str) -> None:
    """Remove a registered backend (ValueError if unknown or the built-in ``"xla"``).

    Views that still name it stop working: constructing or calling one raises ValueError.
    """
    check_attention_backend(name)
    if name == DEFAULT_BACKEND:
        raise ValueError(f"the built-in attention backend {DEFAULT_BACKEND!r} cannot be unregistered")
    del _REGISTRY[name]


def attention_backends() -> tuple[str, ...]:
    """Names of the registered backends, in registration order (``"xla"`` first)."""
    return tuple(_REGISTRY)


def attention_backend(name: str, *, jitted: bool = True) -> AttentionBackend:
    """The backend registered as ``name``: jitted with the layout static, or as registered.

    ValueError, listing the registered names, if ``name`` is not registered.
    """
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}; registered: {_registered_names()}")
    return entry[1] if jitted else entry[0]


def check_attention_backend(name: Any) -> str:
    """``name`` if it is a registered backend, else ValueError listing the registered ones."""
    attention_backend(name)
    return name


register_attention_backend(DEFAULT_BACKEND, paged_attention)
