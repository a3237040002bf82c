"""Reading files a user hands us (configs, indexes, manifests, weights) without trusting them.

One place for what every reader must refuse before it reads a byte: a path that is not a
regular file (a FIFO would block forever, ``/dev/zero`` would run to ``MemoryError``, a
directory is a mistake), a file larger than its kind may be, and, for JSON, text that is
not UTF-8, nesting deeper than a config or manifest has, ``NaN``/``Infinity`` (and numbers
such as ``1e999`` that overflow to them) where no such value belongs, and nesting deep
enough to exhaust the parser (a ``RecursionError`` is turned into the clear error).

Each function takes ``error``, the exception class to raise (``CheckpointError``,
``SessionFileError``, ``ValueError``, ...), so callers keep their own error type; the
message always names the file and never quotes its contents (a symlink to a private file
must not leak its first bytes through an error message). A missing file is a
``FileNotFoundError`` naming it.

Files are opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so
no path swapped for a FIFO between a check and the open can block the reader, and reads
are bounded by the size limit whatever the file claims.

This module imports nothing else of ours.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no O_NONBLOCK to clear either
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "check_regular_file",
    "open_regular_file",
    "read_json_file",
    "read_regular_file",
]

#: The largest JSON side file (config.json, a shard index, a session manifest, an adapter
#: config) any reader accepts: the largest real one is a few hundred KB.
MAX_JSON_BYTES = 4 * 2**20
#: Levels of nesting a JSON side file may have (configs have 2 or 3; a session manifest 64).
MAX_JSON_DEPTH = 64

ErrorType = Callable[[str], Exception]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _check_stat(path: Path, info: os.stat_result, error: ErrorType, what: str, max_bytes: int | None) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} {path} is {_kind(info.st_mode)}, not a regular file")
    if max_bytes is not None and info.st_size > max_bytes:
        raise error(f"{what} {path} is {info.st_size} bytes, more than the {max_bytes} such a file may have")


def check_regular_file(path: str | os.PathLike[str], *, error: ErrorType = ValueError, what: str = "file",
                       max_bytes: int | None = None) -> os.stat_result:
    """``os.stat(path)`` (symlinks followed) if it is a regular file of at most ``max_bytes``, else ``error``.

    For readers that must hand a path to a library (``torch.load``); prefer
    :func:`open_regular_file`, which checks the descriptor it reads.
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    _check_stat(path, info, error, what, max_bytes)
    return info


def open_regular_file(path: str | os.PathLike[str], *, error: ErrorType = ValueError, what: str = "file",
                      max_bytes: int | None = None) -> IO[bytes]:
    """``path`` opened for binary reading, after checking the open descriptor: a regular file of at
    most ``max_bytes`` bytes, else ``error`` naming it (nothing blocks: FIFOs are opened non-blocking)."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except IsADirectoryError:  # (not on Linux, which opens directories read-only)
        raise error(f"{what} {path} is a directory, not a regular file") from None
    try:
        _check_stat(path, os.fstat(fd), error, what, max_bytes)
        if fcntl is not None and getattr(os, "O_NONBLOCK", 0):  # a regular file: back to ordinary blocking reads
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | os.PathLike[str], *, max_bytes: int, error: ErrorType = ValueError,
                      what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them (checked before and while reading)."""
    with open_regular_file(path, error=error, what=what, max_bytes=max_bytes) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew after the check
        raise error(f"{what} {Path(path)} is more than the {max_bytes} bytes such a file may have")
    return data


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/dicts deeper than ``limit`` levels (iterative: no stack to exhaust)."""
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (dict, list)):
            if level > limit:
                return True
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def read_json_file(path: str | os.PathLike[str], *, error: ErrorType = ValueError, what: str = "JSON file",
                   max_bytes: int = MAX_JSON_BYTES, max_depth: int | None = MAX_JSON_DEPTH,
                   allow_nan: bool = False) -> Any:
    """The JSON value in the regular file ``path``; every way it can be unreadable is ``error`` naming the file.

    Refused: not a regular file, more than ``max_bytes``, not UTF-8, not JSON, nested deeper
    than ``max_depth`` (None: only the parser's own limit, still a clear ``error``), and, unless
    ``allow_nan``, ``NaN``/``Infinity`` or a number too large for a float. The message gives
    positions, never the file's bytes.
    """
    path = Path(path)
    raw = read_regular_file(path, max_bytes=max_bytes, error=error, what=what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as decode:
        raise error(f"{what} {path} is not valid JSON (truncated or malformed: not UTF-8 at byte {decode.start})"
                    ) from None

    def finite(token: str) -> float:
        value = float(token)
        if not math.isfinite(value):
            raise ValueError("a number too large for a float (it would be infinite)")
        return value

    def refuse_constant(token: str) -> Any:
        raise ValueError(f"{token} is not a JSON value")

    hooks: dict[str, Any] = {} if allow_nan else {"parse_float": finite, "parse_constant": refuse_constant}
    try:
        data = json.loads(text, **hooks)
    except RecursionError:
        raise error(f"{what} {path} is not valid JSON (truncated or malformed: nested deeper than the parser "
                    "allows)") from None
    except ValueError as parse:  # JSONDecodeError: a position, no content; an integer too long to convert
        message = f"{parse.msg}: line {parse.lineno} column {parse.colno}" if isinstance(
            parse, json.JSONDecodeError) else str(parse)
        raise error(f"{what} {path} is not valid JSON (truncated or malformed: {message})") from None
    if max_depth is not None and _depth_exceeds(data, max_depth):
        raise error(f"{what} {path} is nested deeper than {max_depth} levels (corrupt, or not a {what})")
    return data
