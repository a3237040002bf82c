"""Which XLA programs a block of code made: the one compile counter of the package, its benchmarks and tests.

jax records ``/jax/core/compile/backend_compile_duration`` (with the program's name) around every
compile-or-load of a new executable, so a program loaded from jax's persistent compilation cache
(``JAX_COMPILATION_CACHE_DIR``) counts as one made, with the seconds the load took: a no-recompile
check cannot pass because a recompile was served from disk (tests/test_compile_events.py). A hit in
jax's in-memory cache (the same jitted function at the same shapes) makes no program and records nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["CompiledProgram", "count_compiles", "recording_compiles"]

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One program made: its name (``jit(f)``), the thread that made it, and the seconds it took."""

    name: str
    thread: int
    seconds: float


@contextlib.contextmanager
def recording_compiles(record: Callable[[CompiledProgram], None]) -> Iterator[None]:
    """Calls ``record(program)`` for every XLA program made inside the block, in any thread (jax's listeners
    are process-wide: a compile on a background thread counts, with that thread's id)."""

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            record(CompiledProgram(str(kwargs.get("fun_name", "?")), threading.get_ident(), duration))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def count_compiles() -> Iterator[list[CompiledProgram]]:
    """The programs made inside the block, in order, filled as they are made."""
    programs: list[CompiledProgram] = []
    with recording_compiles(programs.append):
        yield programs
