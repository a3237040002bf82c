"""Checkpoint files, whatever model they hold: the readers every loader shares.

* :class:`SafetensorsFile`: a lazy, validating ``.safetensors`` reader on ``np.memmap`` (BF16
  included). The ``safetensors`` library's numpy backend cannot return BF16 tensors
  (``TypeError: data type 'bfloat16' not understood``), and published video DiTs ship in BF16.
  This reader parses the format itself (an 8-byte little-endian header length, a JSON header,
  then the raw little-endian tensor bytes), maps the file read-only and hands out tensors one
  at a time as views of the map (BF16 and FP8 through ``ml_dtypes``, a jax dependency), so a
  multi-gigabyte file costs no host memory until a tensor is actually read.
* :func:`torch_load`, :func:`tensor_dict`, :func:`torch_tensors`: a ``torch.save`` file read with
  torch's safe unpickler (``weights_only=True``, memory-mapped), its state dict checked to be
  tensors, each tensor a plain view of bytes the file stores.
* :class:`StoredTensor`: one tensor of a file, described (name, shape, dtype, bytes) before it
  is read; :func:`safetensors_tensors` and :func:`torch_tensors` list a file's.
* :class:`CheckpointError` (a ValueError): a checkpoint that cannot be loaded;
  :func:`as_checkpoint_error` turns a corrupt safetensors file into one.

Every safetensors header is checked before any tensor is handed out: offsets in range and
non-overlapping, byte sizes equal to ``prod(shape) * itemsize``, the file not truncated; a
malformed file raises :class:`SafetensorsError` naming the file and what is wrong.

What opening a file may cost is bounded before anything is allocated: the path must be a
regular file (a FIFO or device is refused, never read), and the JSON header at most
``max_header_bytes`` (the format's 100 MB by default; the checkpoint loaders pass
:func:`header_budget` of the tensor count they expect, a few KB per tensor, since parsing a
JSON header costs about 15 times its size). Every tensor's bytes lie in the file, so a
file can describe no more data than it holds. A ``.pt`` tensor must be a plain view of bytes
the file stores (stride-0 ``expand``-ed or self-overlapping views are refused, and one state
dict's tensors may span at most twice the file). Errors never quote the file's bytes (a
header length that is out of range is not printed: it would be the first 8 bytes of whatever
file the path names).

Model-independent: this module imports nothing of ``ardiff_jax`` but :mod:`ardiff_jax._files`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ardiff_jax._files import check_regular_file, open_regular_file

__all__ = [
    "MAX_EXPECTED_TENSORS",
    "MAX_HEADER_TENSORS",
    "SAFETENSORS_DTYPES",
    "CheckpointError",
    "SafetensorsError",
    "SafetensorsFile",
    "StoredTensor",
    "TensorInfo",
    "as_checkpoint_error",
    "header_budget",
    "import_torch",
    "safetensors_tensors",
    "shown_names",
    "tensor_dict",
    "torch_load",
    "torch_tensors",
]

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
#: Tensor entries any safetensors header may have. Real checkpoints have a few thousand (Wan 14B
#: ~1100, umT5-XXL ~500, a whole VLA checkpoint ~3000); without a bound, a 90 MB header of 1.4M
#: zero-size entries costs 1.3 GB and 15 s of parsing, all before any tensor is looked at.
MAX_HEADER_TENSORS = 65_536
#: The largest byte count (and, zeros aside, element count) an array may have: numpy's ``intp``.
_MAX_ARRAY_BYTES = np.iinfo(np.intp).max


def header_budget(tensors: int) -> int:
    """The header size (bytes) a file of ``tensors`` tensors may need: a few KB each, plus 1 MiB of metadata."""
    return min(_MAX_HEADER_BYTES, _HEADER_METADATA_BYTES + _HEADER_BYTES_PER_TENSOR * max(int(tensors), 1))


class CheckpointError(ValueError):
    """A checkpoint (or LoRA, or config) that cannot be loaded into the requested model."""


class SafetensorsError(CheckpointError):
    """A ``.safetensors`` file that is not a valid one (truncated, corrupt header, bad offsets).

    A :class:`CheckpointError`, so that a caller reading a file directly (not through a
    loader's :func:`as_checkpoint_error`) catches it as one too.
    """


class _TooManyEntries(Exception):
    """Raised inside the JSON parser to stop it at the header entry limit (not a ValueError: json's own)."""


@dataclasses.dataclass(frozen=True)
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
        limit = MAX_HEADER_TENSORS
        objects = 0

        # The parser counts the JSON objects it builds (each tensor entry is one, plus the top level and the
        # metadata) and stops at the first past the limit: a header of a million entries is refused after
        # `limit` of them, not materialised whole (1.3 GB for 90 MB) and then looked at.
        def counted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            nonlocal objects
            objects += 1
            if objects > limit + 2:
                raise _TooManyEntries
            return dict(pairs)  # what json.loads builds: the last of duplicate keys wins

        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=counted)
        except _TooManyEntries:
            raise self._error(f"has more than {limit} entries in its header, more than it may have (real "
                              "checkpoints have a few thousand tensors; corrupt, or built to exhaust memory)") from None
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
        if len(header) > limit:  # (the parser's count allows for the top level and the metadata)
            raise self._error(f"has {len(header)} entries in its header, more than the {limit} it may have (real "
                              "checkpoints have a few thousand tensors)")
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
            # numpy refuses (a bare ValueError, at read time) a shape whose dimensions, zeros skipped, span more
            # bytes than an address can: [0, 2**63] holds no bytes, so the checks above let it through.
            if math.prod(max(d, 1) for d in shape) * dtype.itemsize > _MAX_ARRAY_BYTES:
                shown = shape if len(shape) <= 8 else f"of {len(shape)} dimensions"
                raise self._error(f"has shape {shown} for tensor {name!r} ({entry['dtype']}), beyond what an array "
                                  f"can address ({_MAX_ARRAY_BYTES} bytes, zero dimensions aside)")
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


# -- checkpoint refusals ---------------------------------------------------------------------------


def shown_names(names: Iterable[str], limit: int = 12) -> str:
    """``names`` joined by commas, the first ``limit`` of them and a count of the rest."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


@contextlib.contextmanager
def as_checkpoint_error() -> Iterator[None]:
    """A corrupt safetensors file is one kind of checkpoint refusal."""
    try:
        yield
    except SafetensorsError as error:
        raise CheckpointError(str(error)) from None


# -- tensor sources --------------------------------------------------------------------------------


@dataclasses.dataclass
class StoredTensor:
    """One tensor of a checkpoint file, described before it is read (``read()`` reads it)."""

    stored: str  # the name in the file
    where: str  # the file, for messages
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    read: Callable[[], np.ndarray]


def import_torch() -> Any:
    """The ``torch`` module, or an ImportError naming the extra that installs it."""
    try:
        import torch
    except ImportError:
        raise ImportError('reading .pt checkpoints needs torch: pip install "ardiff_jax[torch]"') from None
    return torch


def _torch_numpy(tensor: Any) -> np.ndarray:
    """A CPU torch tensor -> numpy without a float32 detour (bf16/fp8 reinterpreted bit for bit)."""
    torch = import_torch()
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    fp8 = {getattr(torch, "float8_e4m3fn", None): ml_dtypes.float8_e4m3fn,
           getattr(torch, "float8_e5m2", None): ml_dtypes.float8_e5m2}
    if tensor.dtype in fp8:
        return tensor.view(torch.int8).numpy().view(fp8[tensor.dtype])
    return tensor.numpy()


def _torch_dtype(tensor: Any) -> np.dtype:
    torch = import_torch()
    special = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}
    if tensor.dtype in special:
        return special[tensor.dtype]
    try:
        return np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        return np.dtype(ml_dtypes.float8_e4m3fn) if "e4m3" in str(tensor.dtype) else np.dtype(np.uint8)


def torch_load(path: Path) -> Any:
    """``torch.load`` of ``path`` with the safe (``weights_only``) unpickler, memory-mapped where it can be;
    a file that is not a regular file, or that torch cannot read, is a :class:`CheckpointError`."""
    torch = import_torch()
    # A FIFO or device would block torch or run it out of memory: a regular file, or refused.
    check_regular_file(path, error=CheckpointError, what="torch checkpoint")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            # A legacy (non-zip) torch.save file cannot be memory-mapped: read it whole.
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist") from None
    except Exception as error:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"{path} could not be read as a torch checkpoint with the safe (weights_only) "
                              f"unpickler: {type(error).__name__}: {error}") from None


def tensor_dict(obj: Any, path: Path, what: str) -> dict[str, Any]:
    """``obj`` when it is a non-empty dict of torch tensors keyed by strings, else a :class:`CheckpointError`."""
    torch = import_torch()
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path}: {what} is not a state dict (a non-empty dict of tensors)")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: {what} holds entries that are not tensors: {shown_names(bad)}")
    return obj


#: How many times the file's size the tensors of one state dict may span (tied weights, such as
#: umT5's two token embeddings, are stored once and named twice).
_LOGICAL_BYTES_PER_FILE_BYTE = 2
#: ... plus this much, for tiny files.
_LOGICAL_BYTES_SLACK = 2**20


def _storage_problem(tensor: Any) -> str | None:
    """Why ``tensor`` is not a plain view of its own stored elements (None: it is): a stride-0
    (``expand``-ed) or otherwise self-overlapping view, or one reaching past its storage, would make a
    few stored bytes load as an arbitrarily large tensor."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if any(size == 0 for size in shape):
        return None
    if any(stride < 0 for stride in strides):
        return f"has negative strides {list(strides)}"
    span = 1  # elements spanned by the dimensions of smaller stride, which a larger one must step over
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1):
        if stride < span:
            return (f"is a stride-0 (expanded) or overlapping view (shape {list(shape)}, strides {list(strides)}): "
                    f"its {tensor.numel()} elements are not each stored once")
        span += stride * (size - 1)
    end = (tensor.storage_offset() + span) * tensor.element_size()
    stored = tensor.untyped_storage().nbytes()
    if end > stored:
        return f"reaches byte {end} of a {stored}-byte storage"
    return None


def torch_tensors(state: dict[str, Any], path: Path) -> dict[str, StoredTensor]:
    """The state dict's tensors, each a view of bytes the file holds, their total bounded by the file's size.

    Checked before any tensor is read: nothing here materialises a tensor.
    """
    out = {}
    bad = []
    for name, tensor in state.items():
        if tensor.layout != import_torch().strided:
            raise CheckpointError(f"{path}: tensor {name} is {tensor.layout}, not a dense tensor")
        problem = _storage_problem(tensor)
        if problem is not None:
            bad.append(f"{name} {problem}")
            continue
        out[name] = StoredTensor(name, str(path), tuple(tensor.shape), _torch_dtype(tensor),
                                 tensor.numel() * tensor.element_size(), lambda t=tensor: _torch_numpy(t))
    if bad:
        raise CheckpointError(f"{path} holds tensors whose data the file does not store: " + "; ".join(bad[:6])
                              + (f"; ... ({len(bad) - 6} more)" if len(bad) > 6 else ""))
    size = os.stat(path).st_size
    logical = sum(t.nbytes for t in out.values())
    if logical > _LOGICAL_BYTES_PER_FILE_BYTE * size + _LOGICAL_BYTES_SLACK:
        raise CheckpointError(f"{path}: its tensors span {logical} bytes but the file holds only {size} (views "
                              "sharing their storage: a tiny file that would load as a large network)")
    return out


def safetensors_tensors(files: dict[str, SafetensorsFile],
                        only: dict[str, str] | None = None) -> dict[str, StoredTensor]:
    """Tensors of ``files`` (by file name); ``only``: name -> file name (a shard index's weight map)."""
    out = {}
    for file_name, file in files.items():
        for name in file.keys():
            if only is not None and only.get(name) != file_name:
                continue
            info = file.info(name)
            out[name] = StoredTensor(name, str(file.path), info.shape, info.dtype, info.nbytes,
                                     lambda f=file, n=name: f.read(n))
    return out
