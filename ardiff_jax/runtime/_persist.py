"""Sessions on disk: an :class:`~ardiff_jax.runtime.OffloadedSession` as an orbax checkpoint plus a JSON manifest.

A session file is a directory::

    <path>/manifest.json   format, version, geometry fingerprint, pipeline, cursors,
                           cross caches, the pipeline state's structure, the shape,
                           dtype and SHA-256 of every array, and ``manifest_sha256``: the
                           SHA-256 of every other field (canonical JSON), so that the
                           manifest and, through the array digests, the arrays are sealed
    <path>/arrays/         an orbax-checkpoint of the arrays (a flat dict of numpy arrays)

Nothing is unpickled: the manifest is JSON and the arrays are read with a target built
from the manifest. Reading validates, in order and before any pool is touched: the
manifest is a regular file of at most :data:`MAX_MANIFEST_BYTES` (a FIFO, a device or a
directory is refused, never read), parses, is nested at most :data:`MAX_MANIFEST_DEPTH` levels, holds no integer
outside the int32 range the device computes in (the geometry aside: it must equal the
engine's), and names this format and version; the geometry fingerprint and the pipeline
class equal the engine's (the error names every field that differs); the weights
fingerprint, when both the file and the pipeline have one, equals the pipeline's unless
the caller allows other weights; every array has the shape and dtype the engine's
geometry implies; orbax reads them; each read array has its recorded shape, dtype and
SHA-256 (a truncated or corrupted file fails here even when orbax does not notice); the
cursors are ones the spec could produce; and last, the manifest equals what was written:
its ``manifest_sha256`` matches every field. A manifest edited after it was written (a
prompt, a cursor, a recorded array digest) is refused even when each field is plausible:
the session's KV was computed from the old values, and loading it would generate from
them while reporting the new ones. (The digest detects edits and corruption; it is not a
signature: whoever can write the file can recompute it.) Files of format version 1,
written before manifests were sealed, are refused with a message that says so: nothing
tells an edited one from an intact one. Writing refuses a pipeline state that reading
would refuse (an int outside int32, nesting too deep, a manifest over the size bound), so
every file written can be read.

Writing goes to a temporary directory next to ``path`` that is renamed into place at the
end, so an interrupted save never leaves a half-written session at ``path``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ardiff_jax._files import read_json_file
from ardiff_jax.capability import ARDiffusionKVCacheSpec, spec_summary
from ardiff_jax.kv import KVLayout, KVPools
from ardiff_jax.runtime._offload import OffloadedSession, record_nbytes
from ardiff_jax.runtime._session import (
    CrossAttentionKV,
    SessionKV,
    session_kv_from_saved,
)

__all__ = ["MAX_MANIFEST_BYTES", "MAX_MANIFEST_DEPTH", "SESSION_FORMAT", "SESSION_FORMAT_VERSION", "SessionFileError",
           "check_weights_fingerprint", "seal_manifest", "session_fingerprint", "read_session_file",
           "write_session_file"]

SESSION_FORMAT = "ardiff_jax.session"
#: 2: the manifest carries ``manifest_sha256`` over every other field (version 1 files are refused).
SESSION_FORMAT_VERSION = 2
#: The manifest field holding the SHA-256 of all the others.
MANIFEST_DIGEST = "manifest_sha256"
MANIFEST = "manifest.json"
ARRAYS = "arrays"

#: The range of every integer in a manifest: cursors, indices and counts reach the device as int32.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: Levels of JSON nesting a manifest may have (the pipeline state takes two per level of its own).
MAX_MANIFEST_DEPTH = 64
#: The largest manifest read or written (bytes): arrays live in ``arrays/``, the manifest is a few KB.
MAX_MANIFEST_BYTES = 4 * 2**20
#: Manifest fields compared for equality with the engine's own values, not range-checked.
_COMPARED_FIELDS = ("geometry",)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class SessionFileError(ValueError):
    """A session file that cannot be loaded: corrupt, truncated, another format, or another geometry/pipeline."""


#: Fields of ``spec_summary`` that size an engine without changing what a page holds.
_POLICY_FIELDS = ("max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session", "session_capacity")


def session_fingerprint(spec: ARDiffusionKVCacheSpec, layout: KVLayout) -> dict[str, Any]:
    """What a saved session's KV depends on: equal fingerprints mean its pages mean the same thing.

    Policy that does not change the meaning of a page (session capacity, scratch, the
    model-owned byte bound) is left out, so a session moves between engines sized
    differently. JSON-normalised, so it compares equal to one read back from a manifest.
    """
    fingerprint = {key: value for key, value in spec_summary(spec).items() if key not in _POLICY_FIELDS}
    fingerprint.update(
        max_model_len=spec.max_model_len,
        # Resolved per cache: an unset head count (None, the self-attention heads) and an explicit
        # equal one mean the same pages.
        cross_attention_kv_heads={name: spec.cross_attention_heads(name) for name in spec.cross_attention_lengths},
        kv_dtype=layout.dtype,
    )
    return json.loads(json.dumps(fingerprint))


def check_weights_fingerprint(fingerprint: Any, what: str) -> str:
    """``fingerprint`` if it is a SHA-256 hex digest (64 lowercase hex characters), else ValueError naming ``what``."""
    if not (isinstance(fingerprint, str) and _SHA256_HEX.fullmatch(fingerprint)):
        raise ValueError(f"{what} must be a SHA-256 hex digest, got {fingerprint!r}")
    return fingerprint


def pipeline_name(pipeline: Any) -> str:
    cls = type(pipeline)
    return f"{cls.__module__}.{cls.__qualname__}"


def _checkpointing() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:  # pragma: no cover - the [sessions] extra is missing
        raise ImportError("saving and loading sessions needs orbax-checkpoint: pip install 'ardiff_jax[sessions]'"
                          ) from error
    return ocp


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _host_array(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


# -- the pipeline state tree <-> JSON + named arrays -----------------------------------------------


def _encode_tree(tree: Any, arrays: dict[str, np.ndarray], where: str = "state", level: int = 2) -> Any:
    """The JSON form of a pipeline state; ``level`` is the manifest nesting level it lands at (the state: 2).

    Refuses (ValueError) what :func:`read_session_file` would refuse, so that every file
    written can be read: ints outside int32, nesting beyond :data:`MAX_MANIFEST_DEPTH`.
    """
    if tree is None or isinstance(tree, (bool, str, float)):
        return tree
    if isinstance(tree, int):
        if not INT32_MIN <= tree <= INT32_MAX:
            raise ValueError(f"pipeline state {where} is {tree}, outside the int32 range [{INT32_MIN}, {INT32_MAX}] "
                             "a session file holds; keep such a value in an array")
        return tree
    # A container takes two manifest levels ({"dict": {...}}), an array's entry one ({"array": ...}).
    deepest = level + 1 if isinstance(tree, (dict, list, tuple)) else level
    if deepest > MAX_MANIFEST_DEPTH:
        raise ValueError(f"pipeline state {where} is nested deeper than a session file holds (manifest level "
                         f"{deepest} of at most {MAX_MANIFEST_DEPTH})")
    if isinstance(tree, dict):
        if not all(isinstance(key, str) for key in tree):
            raise TypeError(f"pipeline state {where}: dict keys must be strings to be saved, got {list(tree)}")
        return {"dict": {key: _encode_tree(value, arrays, f"{where}.{key}", level + 2) for key, value in tree.items()}}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {kind: [_encode_tree(value, arrays, f"{where}[{i}]", level + 2) for i, value in enumerate(tree)]}
    if isinstance(tree, (jax.Array, np.ndarray, np.generic)):
        name = f"state_{len(arrays)}"
        entry: dict[str, Any] = {"array": name}
        if isinstance(tree, jax.Array) and jax.dtypes.issubdtype(tree.dtype, jax.dtypes.prng_key):
            entry.update(kind="prng_key", impl=str(jax.random.key_impl(tree)))
        elif isinstance(tree, jax.Array):
            entry["kind"] = "jax"
        else:
            entry["kind"] = "numpy_scalar" if isinstance(tree, np.generic) else "numpy"
        arrays[name] = _host_array(tree)
        return entry
    raise TypeError(f"pipeline state {where} is a {type(tree).__name__}, which a session file cannot hold (dicts with "
                    "string keys, lists, tuples, None, bool, int, float, str and arrays only)")


def _decode_tree(encoded: Any, arrays: dict[str, np.ndarray], device: Any, where: str = "state") -> Any:
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    if not isinstance(encoded, dict) or len(encoded) not in (1, 2, 3):
        raise SessionFileError(f"pipeline state {where} in the manifest is malformed: {encoded!r}")
    if "dict" in encoded and isinstance(encoded["dict"], dict):
        return {key: _decode_tree(value, arrays, device, f"{where}.{key}") for key, value in encoded["dict"].items()}
    for kind, container in (("list", list), ("tuple", tuple)):
        if kind in encoded and isinstance(encoded[kind], list):
            return container(_decode_tree(value, arrays, device, f"{where}[{i}]")
                             for i, value in enumerate(encoded[kind]))
    name = encoded.get("array")
    if not isinstance(name, str) or name not in arrays:
        raise SessionFileError(f"pipeline state {where} names an array that is not in the file: {encoded!r}")
    array = arrays[name]
    kind = encoded.get("kind")
    if kind == "numpy":
        return array
    if kind == "numpy_scalar":
        return array[()]
    if kind == "jax":
        return jax.device_put(array, device)
    if kind == "prng_key":
        try:
            return jax.device_put(jax.random.wrap_key_data(array, impl=encoded.get("impl")), device)
        except Exception as error:
            raise SessionFileError(f"pipeline state {where}: key data {array.shape} {array.dtype} is not a "
                                   f"{encoded.get('impl')!r} key: {error}") from None
    raise SessionFileError(f"pipeline state {where} has an unknown array kind {kind!r}")


# -- writing ------------------------------------------------------------------------------------------


def write_session_file(path: str | os.PathLike[str], record: OffloadedSession, *, fingerprint: dict[str, Any],
                       pipeline: str, layout: KVLayout, weights: str | None = None) -> Path:
    """Write ``record`` to the directory ``path`` (which must not exist yet); returns the path.

    ``weights`` is the pipeline's weights fingerprint, recorded when it has one.
    """
    ocp = _checkpointing()
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} already exists; choose a new path (a session file is never overwritten)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the directory {path.parent} does not exist")
    session = record.session
    arrays: dict[str, np.ndarray] = {"pages_k": _host_array(record.pages.k), "pages_v": _host_array(record.pages.v)}
    cross = []
    for index, ((cache_name, branch), kv) in enumerate(sorted(session.cross_attention.items())):
        arrays[f"cross_{index}_k"], arrays[f"cross_{index}_v"] = _host_array(kv.k), _host_array(kv.v)
        cross.append([cache_name, branch])
    state = _encode_tree(record.pipeline_state, arrays)
    manifest = {
        "format": SESSION_FORMAT,
        "format_version": SESSION_FORMAT_VERSION,
        "saved_unix": time.time(),
        "session_id": session.session_id,
        "pipeline": pipeline,
        **({} if weights is None else {"weights_fingerprint": weights}),
        "geometry": fingerprint,
        "storage_dtype": layout.storage_dtype,
        "committed_frames": {name: int(cursor.committed_frames) for name, cursor in session.cursors.items()},
        "cursors": {name: [int(cursor.committed_frames), int(cursor.visible_start_frame)]
                    for name, cursor in session.cursors.items()},
        "run_owners": [[int(index), branch] for index, branch in session.run_owners],
        "cross_attention": cross,
        "pipeline_state": state,
        "arrays": {name: {"shape": list(array.shape), "dtype": array.dtype.name, "sha256": _sha256(array)}
                   for name, array in arrays.items()},
    }
    text = json.dumps(seal_manifest(manifest), indent=1, allow_nan=True)
    if len(text.encode("utf-8")) > MAX_MANIFEST_BYTES:
        raise ValueError(f"the session's manifest would be {len(text.encode('utf-8'))} bytes, more than the "
                         f"{MAX_MANIFEST_BYTES} a session file holds; keep large pipeline state in arrays")
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(staging / ARRAYS, arrays)
        checkpointer.wait_until_finished()
        checkpointer.close()
        (staging / MANIFEST).write_text(text, encoding="utf-8")
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces, NaN spelled ``NaN``) of every field but the digest."""
    fields = {key: value for key, value in manifest.items() if key != MANIFEST_DIGEST}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as JSON gives it back, with ``manifest_sha256`` over every other field (what a reader checks).

    Written files are sealed by :func:`write_session_file`; this is for tools (and tests) that
    write a manifest on purpose.
    """
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}, allow_nan=True))
    body[MANIFEST_DIGEST] = _manifest_digest(body)
    return body


def _check_manifest_digest(path: Path, manifest: dict[str, Any]) -> None:
    """SessionFileError unless the manifest's ``manifest_sha256`` is the digest of its other fields."""
    recorded = manifest.get(MANIFEST_DIGEST)
    if not (isinstance(recorded, str) and _SHA256_HEX.fullmatch(recorded)):
        raise SessionFileError(f"{path / MANIFEST} has no valid {MANIFEST_DIGEST} (got {str(recorded)[:80]!r}): "
                               "corrupt or edited")
    if _manifest_digest(manifest) != recorded:
        raise SessionFileError(f"{path / MANIFEST} does not match its {MANIFEST_DIGEST}: the manifest was edited or "
                               "corrupted after it was written (a session's KV was computed from the values it was "
                               "saved with; an edited prompt, cursor or array record would not describe it)")


# -- reading ------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise SessionFileError(f"{path} is not a session file (expected a directory with {MANIFEST} and {ARRAYS}/)")
    try:  # a regular file of bounded size (a FIFO or /dev/zero is refused, never read); nesting checked below
        manifest = read_json_file(path / MANIFEST, error=SessionFileError, what="session manifest",
                                  max_bytes=MAX_MANIFEST_BYTES, max_depth=None, allow_nan=True)
    except FileNotFoundError:
        raise SessionFileError(f"{path} has no {MANIFEST}: not a session file, or a truncated one") from None
    _check_manifest_values(path, manifest)
    if not isinstance(manifest, dict) or manifest.get("format") != SESSION_FORMAT:
        raise SessionFileError(f"{path} is not an ardiff_jax session file (format {manifest.get('format')!r})"
                               if isinstance(manifest, dict) else f"{path / MANIFEST} is not a manifest")
    if manifest.get("format_version") == 1:
        raise SessionFileError(f"{path} has session format version 1, written before manifests were sealed by a "
                               f"digest: an edited one cannot be told from an intact one, so it is not loaded; this "
                               f"ardiff_jax reads version {SESSION_FORMAT_VERSION} (start the session anew and save "
                               "it with this version)")
    if manifest.get("format_version") != SESSION_FORMAT_VERSION:
        raise SessionFileError(f"{path} has session format version {manifest.get('format_version')!r}; this ardiff_jax "
                               f"reads version {SESSION_FORMAT_VERSION}")
    required = ("session_id", "pipeline", "geometry", "cursors", "run_owners", "cross_attention", "pipeline_state",
                "arrays")
    missing = [key for key in required if key not in manifest]
    if missing:
        raise SessionFileError(f"{path / MANIFEST} lacks {missing}: corrupt or truncated")
    return manifest


def _check_manifest_values(path: Path, manifest: Any) -> None:
    """SessionFileError for nesting beyond :data:`MAX_MANIFEST_DEPTH` or an integer outside int32, naming where.

    Iterative, so no manifest can exhaust the stack; it runs before anything else reads the
    manifest, so every later reader (recursive ones included) sees bounded depth and
    integers the device can hold. Fields compared for equality with the engine's own
    values (:data:`_COMPARED_FIELDS`) are only depth-checked.
    """
    pending: list[tuple[Any, str, int, bool]] = [(manifest, "", 1, True)]
    while pending:
        value, where, level, check_ints = pending.pop()
        if isinstance(value, (dict, list)):
            if level > MAX_MANIFEST_DEPTH:
                raise SessionFileError(f"{path / MANIFEST} is nested deeper than {MAX_MANIFEST_DEPTH} levels (at "
                                       f"{where}): corrupt or not a session file")
            if isinstance(value, dict):
                children = [(f"{where}.{key}" if where else key, item) for key, item in value.items()]
            else:
                children = [(f"{where}[{index}]", item) for index, item in enumerate(value)]
            pending.extend((item, child, level + 1, check_ints and not (level == 1 and child in _COMPARED_FIELDS))
                           for child, item in children)
        elif check_ints and isinstance(value, int) and not isinstance(value, bool) \
                and not INT32_MIN <= value <= INT32_MAX:
            raise SessionFileError(f"session file {path}: manifest field {where} is {value}, outside the int32 range "
                                   f"[{INT32_MIN}, {INT32_MAX}] the device uses")


def _manifest_int(where: str, value: Any, *, non_negative: bool) -> int:
    """A manifest integer (a JSON integer, not a float or bool; int32 is checked already), else SessionFileError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SessionFileError(f"manifest field {where} must be an integer, got {value!r}")
    if non_negative and value < 0:
        raise SessionFileError(f"manifest field {where} must be a non-negative integer, got {value}")
    return value


def _compare(what: str, saved: Any, expected: Any) -> list[str]:
    if isinstance(saved, dict) and isinstance(expected, dict):
        return [line for key in sorted(set(saved) | set(expected))
                for line in _compare(f"{what}.{key}", saved.get(key), expected.get(key))]
    return [] if saved == expected else [f"{what}: file {saved!r}, engine {expected!r}"]


def _expected_shapes(manifest: dict[str, Any], spec: ARDiffusionKVCacheSpec, layout: KVLayout,
                     session_pages: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """``{array name: (shape, allowed dtypes)}`` the engine's geometry implies for the file's non-state arrays."""
    pages = (layout.num_layers, session_pages, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size)
    # The logical dtype, or its bits: a 16-bit float is stored as uint16 on CPU and as itself elsewhere.
    page_dtypes = tuple(dict.fromkeys((layout.storage_dtype, layout.dtype) + (
        ("uint16",) if np.dtype(jax.numpy.dtype(layout.dtype)).itemsize == 2 else ())))
    expected = {"pages_k": (pages, page_dtypes), "pages_v": (pages, page_dtypes)}
    entries = manifest["cross_attention"]
    if not isinstance(entries, list):
        raise SessionFileError(f"the manifest's cross_attention must be a list of [cache, branch], got {entries!r}")
    for index, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(name, str) for name in entry)
                and entry[0] in spec.cross_attention_lengths and entry[1] in spec.kv_branch_names):
            raise SessionFileError(f"cross-attention entry {entry!r} names an unknown cache or branch")
        shape = (spec.num_layers, spec.cross_attention_lengths[entry[0]], spec.cross_attention_heads(entry[0]),
                 spec.head_size)
        for part in ("k", "v"):
            expected[f"cross_{index}_{part}"] = (shape, (layout.dtype,))
    return expected


def read_session_file(path: str | os.PathLike[str], *, spec: ARDiffusionKVCacheSpec, layout: KVLayout,
                      fingerprint: dict[str, Any], pipeline: str, session_pages: int, device: Any,
                      weights: str | None = None, allow_other_weights: bool = False) -> OffloadedSession:
    """The validated record in ``path`` (host arrays; the pipeline state's jax arrays at ``device``).

    ``device`` is a device or a sharding (on a mesh: replicated over it). ``weights`` is the
    loading pipeline's weights fingerprint (``None``: it has none); a file recorded under
    another one is refused unless ``allow_other_weights``.

    SessionFileError (a ValueError) naming what is wrong; nothing outside the file is touched.
    """
    path = Path(path).absolute()
    manifest = _read_manifest(path)
    mismatches = _compare("geometry", manifest["geometry"], fingerprint)
    if manifest["pipeline"] != pipeline:
        mismatches.append(f"pipeline: file {manifest['pipeline']!r}, engine {pipeline!r}")
    if mismatches:
        raise SessionFileError(f"session file {path} does not fit this engine: " + "; ".join(mismatches))
    _check_weights(path, manifest, weights, allow_other_weights)
    recorded = manifest["arrays"]
    if not isinstance(recorded, dict):
        raise SessionFileError(f"{path / MANIFEST}: 'arrays' is malformed")
    expected = _expected_shapes(manifest, spec, layout, session_pages)
    targets: dict[str, Any] = {}
    for name, entry in recorded.items():
        try:
            shape, dtype, digest = tuple(entry["shape"]), np.dtype(entry["dtype"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError) as error:
            raise SessionFileError(f"{path / MANIFEST}: array {name!r} is described wrongly ({error})") from None
        shape = tuple(_manifest_int(f"arrays.{name}.shape[{axis}]", size, non_negative=True)
                      for axis, size in enumerate(shape))
        if name in expected:
            want_shape, want_dtypes = expected[name]
            if shape != want_shape or dtype.name not in want_dtypes:
                raise SessionFileError(f"array {name!r} of {path} is {dtype.name}{list(shape)}; this engine needs "
                                       f"{' or '.join(want_dtypes)}{list(want_shape)}")
        elif not name.startswith("state_"):
            raise SessionFileError(f"{path} holds an unexpected array {name!r}")
        targets[name] = (shape, dtype, digest)
    absent = sorted(set(expected) - set(targets))
    if absent:
        raise SessionFileError(f"{path} lacks the arrays {absent}: corrupt or truncated")
    arrays = _read_arrays(path, targets)
    pages = KVPools(k=_as_storage(arrays["pages_k"], layout), v=_as_storage(arrays["pages_v"], layout))
    session = _session_value(manifest, arrays, spec)
    # Last of the checks on the file: every field above was plausible; the manifest must also be the one
    # written (an edit of any field, a prompt in the pipeline state included, is refused here).
    _check_manifest_digest(path, manifest)
    state = _decode_tree(manifest["pipeline_state"], arrays, device)
    return OffloadedSession(session=session, pages=pages, pipeline_state=state,
                            nbytes=record_nbytes(session, pages, state))


def _check_weights(path: Path, manifest: dict[str, Any], weights: str | None, allow_other_weights: bool) -> None:
    """SessionFileError when the file was saved under other weights than ``weights`` (and that is not allowed).

    A file without a fingerprint (written before they were recorded, or by a pipeline that
    reports none) and a pipeline without one cannot be compared: they load as before.
    """
    if "weights_fingerprint" not in manifest:
        return
    try:
        saved = check_weights_fingerprint(manifest["weights_fingerprint"], "the manifest's weights_fingerprint")
    except ValueError as error:
        raise SessionFileError(f"session file {path}: {error}") from None
    if weights is not None and saved != weights and not allow_other_weights:
        raise SessionFileError(f"session file {path} was saved under other weights: file weights_fingerprint "
                               f"{saved}, this pipeline's {weights}. Its KV and model state were computed by those "
                               "weights; load it anyway with allow_other_weights=True")


def _read_arrays(path: Path, targets: dict[str, tuple[tuple[int, ...], np.dtype, str]]) -> dict[str, np.ndarray]:
    ocp = _checkpointing()
    abstract = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype, _) in targets.items()}
    restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in targets}
    try:
        checkpointer = ocp.PyTreeCheckpointer()
        restored = checkpointer.restore(path / ARRAYS, item=abstract, restore_args=restore_args)
        checkpointer.close()
    except Exception as error:
        raise SessionFileError(f"the arrays of session file {path} cannot be read (corrupt or truncated): "
                               f"{type(error).__name__}: {error}") from None
    arrays: dict[str, np.ndarray] = {}
    for name, (shape, dtype, digest) in targets.items():
        array = np.asarray(restored.get(name)) if isinstance(restored, dict) and name in restored else None
        if array is None or array.shape != shape or array.dtype != dtype:
            got = None if array is None else f"{array.dtype}{list(array.shape)}"
            raise SessionFileError(f"array {name!r} of session file {path} read back as {got}, not "
                                   f"{dtype.name}{list(shape)}: corrupt or truncated")
        if _sha256(array) != digest:
            raise SessionFileError(f"array {name!r} of session file {path} does not match its SHA-256: corrupt")
        arrays[name] = array
    return arrays


def _as_storage(array: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Pages in this engine's storage dtype: bits move between ``uint16`` (CPU) and ``bfloat16`` unchanged."""
    storage = np.dtype(jax.numpy.dtype(layout.storage_dtype))
    return array if array.dtype == storage else array.view(storage)


def _session_value(manifest: dict[str, Any], arrays: dict[str, np.ndarray], spec: ARDiffusionKVCacheSpec
                   ) -> SessionKV:
    session_id = manifest["session_id"]
    if not isinstance(session_id, str) or not session_id.strip():
        raise SessionFileError(f"the saved session id must be a non-blank string, got {session_id!r}")
    saved_cursors, saved_owners = manifest["cursors"], manifest["run_owners"]
    if not isinstance(saved_cursors, dict) or not all(isinstance(pair, list) and len(pair) == 2
                                                      for pair in saved_cursors.values()):
        raise SessionFileError(f"the manifest's cursors must map branches to [committed, visible_start], got "
                               f"{saved_cursors!r}")
    if not isinstance(saved_owners, list) or not all(isinstance(pair, list) and len(pair) == 2
                                                     for pair in saved_owners):
        raise SessionFileError(f"the manifest's run_owners must be a list of [local_index, branch], got "
                               f"{saved_owners!r}")
    # Cursor values are checked against the spec by session_kv_from_saved; only their type here.
    cursors = {name: (_manifest_int(f"cursors.{name}[0]", pair[0], non_negative=False),
                      _manifest_int(f"cursors.{name}[1]", pair[1], non_negative=False))
               for name, pair in saved_cursors.items()}
    owners = [(_manifest_int(f"run_owners[{i}][0]", index, non_negative=True), branch)
              for i, (index, branch) in enumerate(saved_owners)]
    try:
        cross = {(cache, branch): CrossAttentionKV(k=arrays[f"cross_{index}_k"], v=arrays[f"cross_{index}_v"])
                 for index, (cache, branch) in enumerate(manifest["cross_attention"])}
        value = session_kv_from_saved(spec, session_id, cursors, owners, cross)
        committed = {name: pair[0] for name, pair in cursors.items()}
        if manifest.get("committed_frames", committed) != committed:
            raise SessionFileError(f"the manifest's committed_frames {manifest.get('committed_frames')!r} disagree "
                                   f"with its cursors {committed}")
        return value
    except SessionFileError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as error:
        raise SessionFileError(f"the session in the manifest is not one this engine could have produced: {error}"
                               ) from None
