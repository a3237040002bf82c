"""A lazy, validating ``.safetensors`` reader on ``np.memmap`` (BF16 included).

The ``safetensors`` library's numpy backend cannot return BF16 tensors (``TypeError: data
type 'bfloat16' not understood``), and published video DiTs ship in BF16. This reader
parses the format itself (an 8-byte little-endian header length, a JSON header, then the
raw little-endian tensor bytes), maps the file read-only and hands out tensors one at a
time as views of the map (BF16 and FP8 through ``ml_dtypes``, a jax dependency), so a
multi-gigabyte file costs no host memory until a tensor is actually read.

Every header is checked before any tensor is handed out: offsets in range and
non-overlapping, byte sizes equal to ``prod(shape) * itemsize``, the file not truncated;
a malformed file raises :class:`SafetensorsError` naming the file and what is wrong.

What opening a file may cost is bounded before anything is allocated: the path must be a
regular file (a FIFO or device is refused, never read), and the JSON header at most
``max_header_bytes`` (the format's 100 MB by default; the checkpoint loaders pass
:func:`header_budget` of the tensor count they expect, a few KB per tensor, since parsing a
JSON header costs about 15 times its size). Every tensor's bytes lie in the file, so a
file can describe no more data than it holds. Errors never quote the file's bytes (a
header length that is out of range is not printed: it would be the first 8 bytes of
whatever file the path names).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ardiff_jax._files import open_regular_file

__all__ = ["SafetensorsError", "SafetensorsFile", "TensorInfo", "SAFETENSORS_DTYPES", "header_budget",
           "MAX_EXPECTED_TENSORS"]

#: safetensors dtype codes -> numpy dtypes (little-endian, as the format stores them).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"), "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

#: The format's own limit on the JSON header (the reference implementation refuses larger ones).
_MAX_HEADER_BYTES = 100_000_000
#: Header bytes allowed per expected tensor (a real entry is ~100-200 bytes) and for ``__metadata__``.
_HEADER_BYTES_PER_TENSOR = 2048
_HEADER_METADATA_BYTES = 2**20
#: The tensor count a loader expects when it does not know the network yet (the largest
#: published networks it reads have ~1100: Wan 14B's 40 blocks).
MAX_EXPECTED_TENSORS = 4096


def header_budget(tensors: int) -> int:
    """The header size (bytes) a file of ``tensors`` tensors may need: a few KB each, plus 1 MiB of metadata."""
    return min(_MAX_HEADER_BYTES, _HEADER_METADATA_BYTES + _HEADER_BYTES_PER_TENSOR * max(int(tensors), 1))


class SafetensorsError(ValueError):
    """A ``.safetensors`` file that is not a valid one (truncated, corrupt header, bad offsets)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``dtype`` (numpy), ``shape``, and ``[start, end)`` byte offsets in the file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """One ``.safetensors`` file, header parsed and validated, tensors read lazily.

    Example::

        file = SafetensorsFile("diffusion_pytorch_model.safetensors")
        file.info("patch_embedding.weight").shape
        array = file.read("patch_embedding.weight")  # a read-only view of the memory map
    """

    def __init__(self, path: str | os.PathLike[str], *, max_header_bytes: int | None = None) -> None:
        self.path = Path(path)
        self._map: np.memmap | None = None
        limit = _MAX_HEADER_BYTES if max_header_bytes is None else min(int(max_header_bytes), _MAX_HEADER_BYTES)
        with open_regular_file(self.path, error=SafetensorsError, what="safetensors file") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise self._error(f"is {size} bytes long, shorter than the 8-byte header length (truncated?)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > limit:  # the value is not shown: it is the first 8 bytes of whatever file this is
                raise self._error("declares a header longer than " + (
                    f"the {limit} bytes the format allows (corrupt header length)" if limit == _MAX_HEADER_BYTES
                    else f"the {limit} bytes the tensors this loader expects can need (corrupt header length, "
                         "or a file of another model)"))
            if 8 + header_len > size:
                raise self._error(f"declares a header longer than the file's {size} bytes (truncated)")
            raw = handle.read(header_len)
        if len(raw) < header_len:
            raise self._error(f"ends inside its {header_len}-byte header (truncated while reading)")
        self._size = size
        self._data_start = 8 + header_len
        self.metadata, self._tensors = self._parse(raw, size - self._data_start)

    def _error(self, what: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path} is not a valid safetensors file: it {what}")

    def _parse(self, raw: bytes, data_size: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        try:
            header = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:  # (its message would quote the byte)
            raise self._error(f"has a corrupt JSON header (not UTF-8 at byte {error.start})") from None
        except RecursionError:
            raise self._error("has a corrupt JSON header (nested too deeply)") from None
        except json.JSONDecodeError as error:
            raise self._error(f"has a corrupt JSON header ({error.msg} at byte {error.pos})") from None
        except ValueError as error:  # an integer too long to convert
            raise self._error(f"has a corrupt JSON header ({error})") from None
        if not isinstance(header, dict):
            raise self._error("has a JSON header that is not an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._error("has a '__metadata__' entry that is not an object")
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
                raise self._error(f"has a header entry for tensor {name!r} without dtype, shape and data_offsets")
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
            if dtype is None:
                raise self._error(f"stores tensor {name!r} as dtype {entry['dtype']!r}, which this reader does not "
                                  f"know (known: {', '.join(SAFETENSORS_DTYPES)})")
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                raise self._error(f"has an invalid shape {shape!r} for tensor {name!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise self._error(f"has invalid data_offsets {offsets!r} for tensor {name!r}")
            expected = math.prod(shape) * dtype.itemsize
            if offsets[1] - offsets[0] != expected:
                raise self._error(f"gives tensor {name!r} ({entry['dtype']}{shape}) {offsets[1] - offsets[0]} bytes "
                                  f"at offsets {offsets}, its shape needs {expected}")
            if offsets[1] > data_size:
                raise self._error(f"places tensor {name!r} at bytes {offsets} of a {data_size}-byte data section "
                                  "(truncated)")
            tensors[name] = TensorInfo(name, dtype, tuple(shape), self._data_start + offsets[0],
                                       self._data_start + offsets[1])
        ranges = sorted((info.start, info.end, name) for name, info in tensors.items() if info.nbytes)
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise self._error(f"stores tensors {first!r} and {second!r} in overlapping bytes")
        return {str(k): str(v) for k, v in metadata.items()}, tensors

    # -- access ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(info.nbytes for info in self._tensors.values())

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``: a read-only view of the file's memory map (nothing is copied until used)."""
        info = self.info(name)
        if info.nbytes == 0:
            return np.zeros(info.shape, info.dtype)
        if self._map is None:
            with open_regular_file(self.path, error=SafetensorsError, what="safetensors file") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size < self._size:
                    raise self._error(f"shrank from {self._size} to {size} bytes since its header was read")
                self._map = np.memmap(handle, dtype=np.uint8, mode="r", shape=(self._size,))
        return self._map[info.start:info.end].view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        """Drop the memory map (arrays already read keep it alive until they are dropped)."""
        self._map = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"
