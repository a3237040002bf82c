"""Host-side argument checks shared by every layer (the bottom of the import graph).

Each check raises ``ValueError`` (or ``TypeError`` where noted) with a message that names
the argument and the offending value, and returns the value normalised to a plain Python
type. ``bool`` is rejected wherever an integer is expected: ``True`` layers or a ``1.0``
head size are bugs, not values. numpy integer scalars are accepted (``np.int64(2)`` is an
integer); jax arrays are not, and tracers are refused with a message that says why.

This module imports nothing else of ours.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "check_positive_int",
    "check_non_negative_int",
    "check_int",
    "check_flag",
    "check_session_id",
    "check_not_traced",
    "is_integer",
]


def is_integer(value: Any) -> bool:
    """A Python or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any) -> int:
    """An integer (Python or numpy, not bool) as a Python ``int``."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """An integer ``>= 1`` (Python or numpy, not bool) as a Python ``int``."""
    if not is_integer(value) or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """An integer ``>= 0`` (Python or numpy, not bool) as a Python ``int``."""
    if not is_integer(value) or int(value) < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """A real ``bool`` (or ``numpy.bool_``). Strings such as ``"false"`` are refused, never coerced."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


def check_session_id(value: Any, name: str = "session id") -> str:
    """A non-blank ``str``; nothing is coerced (``0``, ``None``, ``5``, ``" "`` are refused)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"AR-Diffusion {name} must be a non-blank string, got {value!r}")
    return value


def check_not_traced(name: str, *values: Any) -> None:
    """Refuse jax tracers: host bookkeeping cannot follow a value that exists only inside a trace.

    Runtime entry points (``generate``, ``commit_paged_context``, ...) mutate host state; run
    under ``jax.jit`` they would store a tracer that every later call then trips over. Call
    them outside ``jit`` and jit only the model (pass ``PagedKVCaches`` into it).

    Plain values and arrays are checked with one ``isinstance`` each (this runs on every
    tick); only containers are flattened.
    """
    import jax  # local: keeps this module importable without initialising a backend

    tracer = jax.core.Tracer
    for value in values:
        if isinstance(value, tracer):
            leaves: Any = (value,)
        elif isinstance(value, (list, tuple, dict)) or hasattr(value, "__dataclass_fields__"):
            leaves = jax.tree_util.tree_leaves(value)
        else:
            continue
        if any(isinstance(leaf, tracer) for leaf in leaves):
            raise TypeError(
                f"{name} was called with a traced value (inside jax.jit, vmap or grad); runtime calls update "
                "host bookkeeping and must run outside any transformation: jit the model, not the runtime call"
            )
