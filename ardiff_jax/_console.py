"""How the command line speaks on stderr: a refusal (exit code 2) and a line before each long step.

Shared by ``ardiff_jax.cli`` and the model registry (``ardiff_jax._registry``), whose checks and runners speak
for the command that called them.
"""

from __future__ import annotations

import sys


def refuse(command: str, message: str) -> int:
    """Print ``ardiff-jax COMMAND: error: MESSAGE`` on stderr; the exit code of a refused command (2)."""
    print(f"ardiff-jax {command}: error: {message}", file=sys.stderr)
    return 2


def say(command: str, message: str) -> None:
    """One line on stderr before a long step (build, compile, generate): a silent terminal looks hung."""
    print(f"ardiff-jax {command}: {message}", file=sys.stderr, flush=True)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
