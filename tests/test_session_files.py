"""Session files: ``engine.save_session`` / ``engine.load_session``.

* Exactness: a session saved past ring wrap continues bit-exactly after a load, in a fresh
  Python process (both reference pipelines) and in the same process under another id,
  while the original keeps running on its own; saving is invisible to the saved session
  (LRU position, outputs), and an offloaded session saves from the host tier.
* Refusals: every corruption (manifest, arrays, geometry, pipeline, cursors, recorded
  shapes) is a SessionFileError naming what is wrong, and the engine it was loaded into is
  unchanged (resident sessions, pool bytes, no events); save to an existing path, of an
  unknown id, or by a pipeline without the export capability is refused.
* The manifest is sealed: an edit of any field (a prompt, an id, a cursor, a recorded
  digest) that is not re-sealed is refused by ``manifest_sha256``; a version-1 file (before
  the seal) is refused saying why; a manifest that is a FIFO, a device, a directory or over
  the size bound is refused without being read (nothing blocks), and saving refuses a
  manifest that reading would refuse. (Corruption tests below that test a deeper check
  re-seal their edit with ``seal_manifest``, as a writer of such values would.)
* Storage: a bfloat16 engine's pages (uint16 bits on CPU) load into another bfloat16
  engine, and a file whose pages are stored as bfloat16 loads into one that keeps uint16.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import (
    ARDiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    SupportsARDiffusionSessionExport,
)
from ardiff_jax.models import (
    CFGPipelineConfig,
    CFGWorldActionPipeline,
    WorldPipeline,
    WorldPipelineConfig,
    dit_preset,
)
from ardiff_jax.runtime import SessionFileError
from ardiff_jax.runtime._persist import MAX_MANIFEST_BYTES, seal_manifest

HOST = 10**8  # plenty: every offloaded session fits
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _config(dtype: str = "float32", **fields) -> EngineConfig:
    """No warmup (here and in the fresh process): nothing here is about compiling, and warmup would compile
    the batch programs of every bucket, which no test runs; each program used compiles on first use."""
    return EngineConfig(dtype=dtype, available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                        **{"warmup": False, **fields})


def _ring_frames(engine: ARDiffusionEngine) -> int:
    spec = engine.runner.kv_cache.spec
    return spec.sink_frames + spec.window_frames


#: Blocks run before a save: the world pipeline commits 2 frames a block, the CFG pipeline one
#: latent frame a request (1, then 4 observed frames), so both rings (sink 1 + window 5) have wrapped.
WORLD_BLOCKS = 5
CFG_BLOCKS = 8
#: Blocks run after the save / load.
MORE_BLOCKS = 3


# -- requests, the same in this process and in the fresh one ------------------------------------------


def _world_request(sid: str, block: int) -> DiffusionRequest:
    cfg = dit_preset("tiny")
    action = np.random.default_rng(1000 + block).standard_normal(
        (cfg.num_register_tokens, cfg.register_dim)).astype(np.float32)
    inputs = {"action": action, **({"seed": 7} if block == 0 else {})}
    return DiffusionRequest(f"w-{sid}-{block}", prompt="a red car" if block == 0 else None,
                            extra_args={"session_id": sid}, inputs=inputs)


def _world_output(out) -> tuple[np.ndarray, ...]:
    return (np.asarray(out.latents),)


def _cfg_request(pipeline: CFGWorldActionPipeline, sid: str, block: int) -> DiffusionRequest:
    observation = pipeline.schema.example(1 if block == 0 else 4, seed=20 + block)
    return DiffusionRequest(f"c-{sid}-{block}", prompt="pick up the cup" if block == 0 else None,
                            extra_args={"session_id": sid}, inputs={"observation": observation})


def _cfg_output(out) -> tuple[np.ndarray, ...]:
    return (np.asarray(out["video"]), np.asarray(out["actions"]))


def _run_world(engine: ARDiffusionEngine, sid: str, blocks: range) -> list[tuple[np.ndarray, ...]]:
    return [_world_output(engine.generate(_world_request(sid, block))) for block in blocks]


def _run_cfg(engine: ARDiffusionEngine, sid: str, blocks: range) -> list[tuple[np.ndarray, ...]]:
    pipeline = engine.runner.pipeline
    return [_cfg_output(engine.generate(_cfg_request(pipeline, sid, block))) for block in blocks]


def _assert_same_blocks(expected: list, got: list, what: str) -> None:
    assert len(expected) == len(got), what
    for block, (a, b) in enumerate(zip(expected, got, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y), f"{what}: block {block} differs"


# -- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_base() -> WorldPipeline:
    return WorldPipeline("tiny")


@pytest.fixture(scope="module")
def cfg_base() -> CFGWorldActionPipeline:
    return CFGWorldActionPipeline("tiny")


def _world(base: WorldPipeline, capacity: int = 2, dtype: str = "float32", **fields) -> ARDiffusionEngine:
    pipeline = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=capacity), modules=base.modules)
    return ARDiffusionEngine(pipeline, _config(dtype, **fields))


def _cfg(base: CFGWorldActionPipeline, capacity: int = 2, **fields) -> ARDiffusionEngine:
    pipeline = CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=capacity), modules=base.modules)
    return ARDiffusionEngine(pipeline, _config(**fields))


@pytest.fixture(scope="module")
def world_file(world_base, tmp_path_factory) -> Path:
    """A world session saved past ring wrap (read-only: tests corrupt copies of it)."""
    engine = _world(world_base)
    _run_world(engine, "saved", range(WORLD_BLOCKS))
    path = engine.save_session("saved", tmp_path_factory.mktemp("world") / "session")
    engine.close()
    return path


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text(encoding="utf-8"))


def _write_manifest(path: Path, manifest: dict) -> None:
    """Write an edited manifest re-sealed (its digest recomputed): what a writer of these values would produce,
    so the check under test is the one the edit breaks, not the seal."""
    (path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)), encoding="utf-8")


def _write_unsealed(path: Path, manifest: dict) -> None:
    """Write an edited manifest as an editor would: its recorded digest left as it was."""
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def _events(engine: ARDiffusionEngine) -> list:
    events: list = []
    engine.runner.add_session_listener(events.append)
    return events


def _snapshot(engine: ARDiffusionEngine) -> tuple:
    """What a refused load must leave alone (copies: the pools are donated and rewritten in place)."""
    pools = engine.runner.kv_cache.pools
    return (engine.sessions, engine.offloaded_sessions, engine.runner.pipeline.session_ids,
            np.array(pools.k, copy=True), np.array(pools.v, copy=True))


def _assert_unchanged(engine: ARDiffusionEngine, before: tuple, events: list) -> None:
    after = _snapshot(engine)
    assert after[:3] == before[:3], f"sessions changed: {before[:3]} -> {after[:3]}"
    assert np.array_equal(after[3], before[3]) and np.array_equal(after[4], before[4]), "pool bytes changed"
    assert events == [], f"a refused load emitted {events}"


def _full_world_target(base: WorldPipeline) -> ARDiffusionEngine:
    """Both slots taken and no host tier: a load that made room first would close ``x``."""
    engine = _world(base, capacity=2)
    for sid in ("x", "y"):
        _run_world(engine, sid, range(2))
    assert engine.sessions == ("x", "y")
    return engine


# -- 1. a fresh process ----------------------------------------------------------------------------------


def _continue_in_this_process(world_path: str, cfg_path: str, out_path: str) -> None:
    """Run in a fresh interpreter: build both reference pipelines anew (default weights), load, continue."""
    world = ARDiffusionEngine(WorldPipeline("tiny", WorldPipelineConfig(session_capacity=2)), _config())
    cfg = ARDiffusionEngine(CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=2)), _config())
    outputs: dict[str, np.ndarray] = {}
    for name, engine, path, run, first in (("world", world, world_path, _run_world, WORLD_BLOCKS),
                                           ("cfg", cfg, cfg_path, _run_cfg, CFG_BLOCKS)):
        sid = engine.load_session(path)
        for block, arrays in enumerate(run(engine, sid, range(first, first + MORE_BLOCKS))):
            for index, array in enumerate(arrays):
                outputs[f"{name}_{block}_{index}"] = array
    np.savez(out_path, **outputs)


FRESH_PROCESS = """
import sys
sys.path.insert(0, {tests!r})
import test_session_files
test_session_files._continue_in_this_process({world!r}, {cfg!r}, {out!r})
"""


def test_saved_sessions_continue_bit_exactly_in_a_fresh_process(world_base, cfg_base, tmp_path):
    world, cfg = _world(world_base), _cfg(cfg_base)
    _run_world(world, "w", range(WORLD_BLOCKS))
    _run_cfg(cfg, "c", range(CFG_BLOCKS))
    world_path, cfg_path = world.save_session("w", tmp_path / "world"), cfg.save_session("c", tmp_path / "cfg")
    for path, engine in ((world_path, world), (cfg_path, cfg)):
        cursors = _manifest(path)["cursors"]
        assert all(committed > _ring_frames(engine) for committed, _ in cursors.values()), cursors  # ring wrapped
    expected = {"world": _run_world(world, "w", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS)),
                "cfg": _run_cfg(cfg, "c", range(CFG_BLOCKS, CFG_BLOCKS + MORE_BLOCKS))}
    out = tmp_path / "continued.npz"
    script = FRESH_PROCESS.format(tests=str(TESTS), world=str(world_path), cfg=str(cfg_path), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the fresh process failed:\n{done.stderr[-4000:]}"
    with np.load(out) as continued:
        for name, blocks in expected.items():
            got = [tuple(continued[f"{name}_{block}_{index}"] for index in range(len(arrays)))
                   for block, arrays in enumerate(blocks)]
            _assert_same_blocks(blocks, got, f"{name} pipeline in a fresh process")


# -- 2. the same process, another id ---------------------------------------------------------------------


def test_a_loaded_copy_continues_exactly_beside_its_original(world_base, tmp_path):
    reference = _world(world_base)
    expected = _run_world(reference, "ref", range(WORLD_BLOCKS + MORE_BLOCKS))[WORLD_BLOCKS:]
    engine = _world(world_base, capacity=2, host_offload_bytes=HOST)
    _run_world(engine, "orig", range(WORLD_BLOCKS))
    path = engine.save_session("orig", tmp_path / "orig")
    events = _events(engine)
    assert engine.load_session(path, session_id="copy") == "copy"
    assert [(e.kind, e.session_id, e.reason) for e in events] == [("restored", "copy", "load")]
    assert engine.sessions == ("orig", "copy")
    orig, copy = [], []
    for block in range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS):  # interleaved: each keeps its own slot
        orig += _run_world(engine, "orig", range(block, block + 1))
        copy += _run_world(engine, "copy", range(block, block + 1))
    _assert_same_blocks(expected, orig, "the original after its copy was loaded")
    _assert_same_blocks(expected, copy, "the copy loaded under another id")

    # The saved id is resident: refused, nothing changes.
    events.clear()
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="'orig' already exists"):
        engine.load_session(path)
    _assert_unchanged(engine, before, events)
    # A third session offloads the least recently used one; loading over it is refused too.
    _run_world(engine, "third", range(1))
    assert engine.offloaded_sessions == ("orig",)
    events.clear()
    before = _snapshot(engine)
    with pytest.raises(ValueError, match="'orig' already exists"):
        engine.load_session(path, session_id="orig")
    _assert_unchanged(engine, before, events)


# -- 3. corruption ---------------------------------------------------------------------------------------


def _edit_manifest(edit):
    def corrupt(path: Path) -> None:
        manifest = _manifest(path)
        edit(manifest)
        _write_manifest(path, manifest)
    return corrupt


def _largest_array_file(path: Path) -> Path:
    files = [f for f in (path / "arrays").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files, f"no array data files under {path / 'arrays'}"
    return max(files, key=lambda f: f.stat().st_size)


def _flip_a_byte(path: Path) -> None:
    target = _largest_array_file(path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _truncate_file(target: Path) -> None:
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])


def _state_array_name(manifest: dict) -> str:
    """The array that holds the world session's last block (a float array of the pipeline state)."""
    return manifest["pipeline_state"]["dict"]["last_block"]["array"]


def _set_shape(name_of, shape):
    return _edit_manifest(lambda m: m["arrays"][name_of(m)].__setitem__("shape", shape))


CORRUPTIONS = {
    "manifest_truncated": (lambda p: _truncate_file(p / "manifest.json"),
                           r"manifest\.json is not valid JSON \(truncated or malformed"),
    "manifest_not_json": (lambda p: (p / "manifest.json").write_bytes(b"\xff\xfe not json"),
                          r"manifest\.json is not valid JSON \(truncated or malformed: not UTF-8 at byte 0"),
    "manifest_not_an_object": (lambda p: (p / "manifest.json").write_text("[1, 2]"), r"is not a manifest"),
    "manifest_missing": (lambda p: (p / "manifest.json").unlink(), r"has no manifest\.json"),
    "session_is_a_file": (lambda p: (shutil.rmtree(p), p.write_text("{}")), r"is not a session file"),
    "wrong_format": (_edit_manifest(lambda m: m.__setitem__("format", "someone.else")),
                     r"not an ardiff_jax session file \(format 'someone\.else'\)"),
    "wrong_version": (_edit_manifest(lambda m: m.__setitem__("format_version", 99)), r"format version 99"),
    "field_missing": (_edit_manifest(lambda m: m.pop("run_owners")), r"lacks \['run_owners'\]"),
    "array_byte_flipped": (_flip_a_byte, r"SHA-256: corrupt|corrupt or truncated"),
    "array_file_truncated": (lambda p: _truncate_file(_largest_array_file(p)), r"corrupt or truncated"),
    "arrays_deleted": (lambda p: shutil.rmtree(p / "arrays"), r"arrays of session file .* cannot be read"),
    "sha256_edited": (_edit_manifest(lambda m: m["arrays"]["pages_v"].__setitem__("sha256", "0" * 64)),
                      r"'pages_v' .* does not match its SHA-256"),
    "geometry_window_frames": (_edit_manifest(lambda m: m["geometry"].__setitem__("window_frames", 7)),
                               r"geometry\.window_frames: file 7, engine 5"),
    "geometry_kv_dtype": (_edit_manifest(lambda m: m["geometry"].__setitem__("kv_dtype", "bfloat16")),
                          r"geometry\.kv_dtype: file 'bfloat16', engine 'float32'"),
    "cursor_negative": (_edit_manifest(lambda m: m["cursors"].__setitem__("main", [-2, 0])),
                        r"not one this engine could have produced: cursor 'main' committed_frames .* got -2"),
    "cursor_visible_start_inconsistent": (_edit_manifest(lambda m: m["cursors"]["main"].__setitem__(1, 4)),
                                          r"cursor 'main' is inconsistent: visible_start_frame 4"),
    "cursor_branch_unknown": (_edit_manifest(lambda m: m["cursors"].__setitem__("other", [0, 0])),
                              r"branches \['main', 'other'\] differ"),
    "committed_frames_disagree": (_edit_manifest(lambda m: m["committed_frames"].__setitem__("main", 3)),
                                  r"committed_frames \{'main': 3\} disagree with its cursors"),
    "pages_shape_edited": (_set_shape(lambda m: "pages_k", [2, 3, 16, 2, 16]),
                           r"array 'pages_k' .* is float32\[2, 3, 16, 2, 16\]; this engine needs"),
    "state_shape_edited": (_set_shape(_state_array_name, [4, 2, 8, 8]),
                           r"read back as float32\[2, 4, 8, 8\], not float32\[4, 2, 8, 8\]"),
}


#: A failed orbax read leaves tensorstore callbacks that hit a closed asyncio loop later (orbax's own
#: noise, reported as an unraisable exception whether or not the checkpointer is closed).
_ORBAX_LOOP_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.parametrize("corruption", [
    pytest.param(name, marks=_ORBAX_LOOP_NOISE) if name == "array_file_truncated" else name
    for name in sorted(CORRUPTIONS)])
def test_a_corrupt_file_is_refused_and_changes_nothing(world_base, world_file, tmp_path, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    corrupt(path)
    engine = _full_world_target(world_base)
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match=message) as refused:
        engine.load_session(path, session_id="loaded")
    assert isinstance(refused.value, ValueError)
    _assert_unchanged(engine, before, events)
    # The intact file still loads: the refusal was the corruption's doing.
    engine.close_session("x")
    assert engine.load_session(world_file, session_id="loaded") == "loaded"


def test_a_file_of_another_pipeline_is_refused_naming_both(world_file, cfg_base):
    engine = _cfg(cfg_base)
    for sid in ("c", "d"):  # full: a load that made room first would close "c"
        _run_cfg(engine, sid, range(1))
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match=r"pipeline: file '[\w.]+\.WorldPipeline', engine "
                                               r"'[\w.]+\.CFGWorldActionPipeline'"):
        engine.load_session(world_file)
    _assert_unchanged(engine, before, events)


def test_a_pipeline_state_the_pipeline_cannot_import_is_refused_before_anything_changes(world_base, world_file,
                                                                                       tmp_path):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest["pipeline_state"]["dict"]["block_index"] = "x"  # the pipeline could never have exported this
    _write_manifest(path, manifest)
    engine = _full_world_target(world_base)
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match="block_index"):
        engine.load_session(path, session_id="loaded")
    _assert_unchanged(engine, before, events)


def test_a_malformed_cross_attention_list_is_a_session_file_error(world_base, world_file, tmp_path):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest["cross_attention"] = 5
    _write_manifest(path, manifest)
    engine = _full_world_target(world_base)
    with pytest.raises(SessionFileError, match="cross"):
        engine.load_session(path, session_id="loaded")


def test_a_blank_saved_session_id_is_refused_before_anything_changes(world_base, world_file, tmp_path):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest["session_id"] = " "
    _write_manifest(path, manifest)
    engine = _full_world_target(world_base)
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match="session id"):
        engine.load_session(path)
    _assert_unchanged(engine, before, events)


#: ``name: edit(manifest)``, each a plausible value the loader would accept if the manifest were not sealed.
EDITS = {
    "prompt": lambda m: m["pipeline_state"]["dict"].__setitem__("prompt", "a blue boat"),
    "session_id": lambda m: m.__setitem__("session_id", "someone-else"),
    "saved_unix": lambda m: m.__setitem__("saved_unix", m["saved_unix"] + 1.0),
    "block_index": lambda m: m["pipeline_state"]["dict"].__setitem__("block_index",
                                                                    m["pipeline_state"]["dict"]["block_index"] + 1),
    "weights_fingerprint_dropped": lambda m: m.pop("weights_fingerprint"),
    "storage_dtype": lambda m: m.__setitem__("storage_dtype", "anything"),
}


def _refuse(engine: ARDiffusionEngine, path: Path, message: str) -> None:
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match=message):
        engine.load_session(path, session_id="loaded")
    _assert_unchanged(engine, before, events)


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_manifest_is_refused_by_its_digest(world_base, world_file, tmp_path, edit):
    # An edited prompt used to load: the session then generated from the old prompt's cross-attention
    # while reporting the new one. Every field is sealed by manifest_sha256.
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    assert "prompt" in manifest["pipeline_state"]["dict"] and "weights_fingerprint" in manifest
    EDITS[edit](manifest)
    _write_unsealed(path, manifest)
    _refuse(_full_world_target(world_base), path,
            r"manifest\.json does not match its manifest_sha256: the manifest was edited")
    # Sealed anew (a writer of these values), an edit that keeps the session plausible loads: the seal is
    # what refused it, not a check of the value.
    if edit in ("saved_unix", "weights_fingerprint_dropped"):
        _write_manifest(path, manifest)
        engine = _world(world_base)
        assert engine.load_session(path, session_id="resealed") == "resealed"


@pytest.mark.parametrize("digest", [None, 5, "0" * 63, "z" * 64])
def test_a_missing_or_malformed_digest_is_refused(world_base, world_file, tmp_path, digest):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    if digest is None:
        del manifest["manifest_sha256"]
    else:
        manifest["manifest_sha256"] = digest
    _write_unsealed(path, manifest)
    _refuse(_full_world_target(world_base), path, r"has no valid manifest_sha256")


def test_a_version_1_file_is_refused_saying_why(world_base, world_file, tmp_path):
    # Files written before the seal cannot be checked: refused (not accepted unverified), with the reason.
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest["format_version"] = 1
    del manifest["manifest_sha256"]
    _write_unsealed(path, manifest)
    _refuse(_full_world_target(world_base), path, r"format version 1, written before manifests were sealed by a digest")


def _unblock_fifo(fifo: Path) -> None:
    """Give a reader blocked on opening ``fifo`` its end of file (opening for writing, non-blocking)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader is blocked on it
        pass


def test_a_manifest_that_is_not_a_regular_file_is_refused_without_reading_it(world_base, world_file, tmp_path):
    import threading

    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = path / "manifest.json"
    target = _full_world_target(world_base)
    # A FIFO: opening it to read used to block forever.
    manifest.unlink()
    os.mkfifo(manifest)
    outcome: list = []

    def load() -> None:
        try:
            _refuse(target, path, r"manifest\.json is a FIFO \(named pipe\), not a regular file")
            outcome.append("refused")
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome.append(error)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=120)
    blocked = worker.is_alive()
    while worker.is_alive():
        _unblock_fifo(manifest)
        worker.join(timeout=1)
    assert not blocked, "loading a session whose manifest is a FIFO blocked"
    assert outcome == ["refused"], outcome
    # A device (/dev/zero would run to MemoryError; /dev/null is as much a device) and a directory.
    manifest.unlink()
    manifest.symlink_to("/dev/null")
    _refuse(target, path, r"manifest\.json is a character device, not a regular file")
    manifest.unlink()
    manifest.mkdir()
    _refuse(target, path, r"manifest\.json is a directory, not a regular file")
    # Larger than any manifest: refused by its size, before it is read (a valid one, padded).
    manifest.rmdir()
    text = json.dumps(_manifest(world_file))
    manifest.write_text(text[:-1] + " " * MAX_MANIFEST_BYTES + "}", encoding="utf-8")
    _refuse(target, path, rf"manifest\.json is \d+ bytes, more than the {MAX_MANIFEST_BYTES}")


# -- 4. saving -------------------------------------------------------------------------------------------


def test_save_refuses_an_unknown_id_and_an_existing_path(world_base, tmp_path):
    engine = _world(world_base)
    _run_world(engine, "a", range(1))
    with pytest.raises(KeyError, match="'nobody' is neither resident nor offloaded"):
        engine.save_session("nobody", tmp_path / "nobody")
    assert sorted(tmp_path.iterdir()) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    listing = sorted(tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="existing already exists"):
        engine.save_session("a", existing)
    assert sorted(tmp_path.rglob("*")) == listing and (existing / "keep.txt").read_text() == "mine"
    assert engine.sessions == ("a",)


def test_save_refuses_a_manifest_reading_would_refuse(world_base, tmp_path):
    # A prompt of 5 MiB lands in the manifest's pipeline state: more than a manifest may have, refused at save
    # (it used to be written, and every later load would refuse it).
    engine = _world(world_base)
    huge = "a red car " * (MAX_MANIFEST_BYTES // 10 + 1)
    engine.generate(DiffusionRequest("big", prompt=huge, extra_args={"session_id": "big"},
                                     inputs=_world_request("big", 0).inputs))
    with pytest.raises(ValueError, match=rf"more than the {MAX_MANIFEST_BYTES} a session file holds"):
        engine.save_session("big", tmp_path / "big")
    assert list(tmp_path.iterdir()) == []
    assert engine.sessions == ("big",)


def test_saving_is_invisible_to_the_saved_session(world_base, tmp_path):
    plain, saving = _world(world_base), _world(world_base)
    outputs = {"plain": [], "saving": []}
    events = _events(saving)
    for block in range(WORLD_BLOCKS + MORE_BLOCKS):
        for name, engine in (("plain", plain), ("saving", saving)):
            outputs[name] += _run_world(engine, "a", range(block, block + 1))
            outputs[name] += _run_world(engine, "b", range(block, block + 1))
        assert saving.sessions == ("a", "b")
        events.clear()
        saving.save_session("a", tmp_path / f"a-{block}")  # the least recently used one: it stays that
        assert saving.sessions == ("a", "b") and events == []
        assert set(saving.runner.pipeline.session_ids) == {"a", "b"}
    _assert_same_blocks(outputs["plain"], outputs["saving"], "a session saved after every block")


# -- 5. an offloaded session ----------------------------------------------------------------------------


def test_an_offloaded_session_saves_from_the_host_tier_and_continues_exactly(world_base, tmp_path):
    source = _world(world_base, capacity=1, host_offload_bytes=HOST)
    for block in range(WORLD_BLOCKS):
        for sid in ("s0", "s1"):
            _run_world(source, sid, range(block, block + 1))
    assert source.sessions == ("s1",) and source.offloaded_sessions == ("s0",)
    record = source.runner.host_tier.get("s0")
    path = source.save_session("s0", tmp_path / "s0")
    assert source.runner.host_tier.get("s0") is record and source.sessions == ("s1",)  # nothing moved
    expected = _run_world(source, "s0", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS))
    target = _world(world_base, capacity=2)
    assert target.load_session(path) == "s0"
    got = _run_world(target, "s0", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS))
    _assert_same_blocks(expected, got, "an offloaded session saved and loaded")


# -- 6. a pipeline without the export capability ---------------------------------------------------------


class _NoExport:
    """A WorldPipeline without the export capability (delegates everything else)."""

    def __init__(self, inner: WorldPipeline) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name in ("export_ar_diffusion_session", "import_ar_diffusion_session"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_pipeline_without_export_cannot_save_or_load(world_base, world_file, tmp_path):
    pipeline = _NoExport(WorldPipeline("tiny", WorldPipelineConfig(session_capacity=2), modules=world_base.modules))
    assert not isinstance(pipeline, SupportsARDiffusionSessionExport)
    engine = ARDiffusionEngine(pipeline, _config())
    _run_world(engine, "a", range(1))
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(TypeError, match="save_session needs a pipeline that implements "
                                        "SupportsARDiffusionSessionExport; _NoExport does not"):
        engine.save_session("a", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(TypeError, match="load_session needs .*SupportsARDiffusionSessionExport"):
        engine.load_session(world_file, session_id="loaded")
    _assert_unchanged(engine, before, events)


# -- 7. storage portability ------------------------------------------------------------------------------


def _rewrite_pages_as(path: Path, dtype) -> None:
    """Rewrite the file's page arrays in ``dtype`` (same bits), as an engine with that storage would save."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    arrays = {name: np.asarray(array) for name, array in checkpointer.restore(path / "arrays").items()}
    manifest = _manifest(path)
    for name in ("pages_k", "pages_v"):
        arrays[name] = arrays[name].view(np.dtype(dtype))
        manifest["arrays"][name].update(dtype=arrays[name].dtype.name,
                                        sha256=hashlib.sha256(arrays[name].tobytes()).hexdigest())
    shutil.rmtree(path / "arrays")
    checkpointer.save(path / "arrays", arrays)
    checkpointer.wait_until_finished()
    checkpointer.close()
    _write_manifest(path, manifest)


def _logical_storage(monkeypatch) -> None:
    """Engines built next keep bfloat16 pools as bfloat16, as on GPU and TPU."""
    monkeypatch.setattr("ardiff_jax.runtime._kv_cache.default_storage_dtype",
                        lambda dtype, platform: jnp.dtype(dtype).name)


@pytest.fixture(scope="module")
def bf16_saved(world_base, tmp_path_factory):
    """A bfloat16 world session saved past ring wrap, and its uninterrupted continuation."""
    engine = _world(world_base, dtype="bfloat16")
    _run_world(engine, "h", range(WORLD_BLOCKS))
    path = engine.save_session("h", tmp_path_factory.mktemp("bf16") / "session")
    storage = engine.runner.kv_cache.layout.storage_dtype
    expected = _run_world(engine, "h", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS))
    return path, storage, expected


def test_bfloat16_pages_load_into_another_bfloat16_engine(world_base, bf16_saved):
    path, storage, expected = bf16_saved
    manifest = _manifest(path)
    assert manifest["storage_dtype"] == storage
    assert jax.devices()[0].platform != "cpu" or storage == "uint16"
    assert manifest["arrays"]["pages_k"]["dtype"] == storage and manifest["geometry"]["kv_dtype"] == "bfloat16"
    target = _world(world_base, dtype="bfloat16")
    assert target.load_session(path) == "h"
    _assert_same_blocks(expected, _run_world(target, "h", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS)),
                        "bfloat16 pages loaded into another bfloat16 engine")


def test_pages_stored_as_bfloat16_load_into_a_uint16_engine(world_base, bf16_saved, tmp_path):
    path, storage, expected = bf16_saved
    if storage != "uint16":
        pytest.skip(f"this backend stores bfloat16 pages as {storage}")
    copy = tmp_path / "session"
    shutil.copytree(path, copy)
    _rewrite_pages_as(copy, jnp.bfloat16)
    assert _manifest(copy)["arrays"]["pages_k"]["dtype"] == "bfloat16"
    target = _world(world_base, dtype="bfloat16")
    assert target.runner.kv_cache.layout.storage_dtype == "uint16"
    assert target.load_session(copy) == "h"
    _assert_same_blocks(expected, _run_world(target, "h", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS)),
                        "bfloat16-stored pages loaded into a uint16 engine")


def test_uint16_pages_load_into_an_engine_that_stores_bfloat16(world_base, bf16_saved, tmp_path, monkeypatch):
    path, storage, expected = bf16_saved
    copy = tmp_path / "session"
    shutil.copytree(path, copy)
    if storage != "uint16":
        _rewrite_pages_as(copy, np.uint16)
    _logical_storage(monkeypatch)
    target = _world(world_base, dtype="bfloat16")
    monkeypatch.undo()
    assert target.runner.kv_cache.layout.storage_dtype == "bfloat16"
    assert target.load_session(copy) == "h"
    _assert_same_blocks(expected, _run_world(target, "h", range(WORLD_BLOCKS, WORLD_BLOCKS + MORE_BLOCKS)),
                        "uint16 pages loaded into a bfloat16-storage engine")


# -- 8. a file holds only what its session wrote (issue 43, item 3) ------------------------------------------


def test_a_saved_file_holds_zeros_where_its_session_wrote_nothing(world_base, tmp_path):
    """A session that has not filled its window takes over a slot whose pages hold the previous occupant's
    frames; its file carries its own frames and zeros, never the other user's KV."""
    import orbax.checkpoint as ocp

    engine = _world(world_base, capacity=1)
    _run_world(engine, "previous", range(WORLD_BLOCKS))  # fills every page of slot 0
    engine.close_session("previous")
    _run_world(engine, "next", range(1))  # slot 0 again: one block, the sink and one ring frame
    path = engine.save_session("next", tmp_path / "next.session")
    cache = engine.runner.kv_cache
    run_pages, committed = cache.layout.run_pages, _committed_frames(engine, "next")
    pool = np.asarray(cache.pools.k)
    engine.close()
    checkpointer = ocp.StandardCheckpointer()
    arrays = {name: np.asarray(array) for name, array in checkpointer.restore(path / "arrays").items()}
    checkpointer.close()
    for name in ("pages_k", "pages_v"):
        pages = arrays[name].reshape(arrays[name].shape[0], -1, run_pages, *arrays[name].shape[2:])  # [L, R, K+W, ...]
        assert pages[:, :, committed:].size and not pages[:, :, committed:].any(), f"{name}: unwritten pages not zero"
        assert pages[:, 0, :committed].any()  # what it wrote is there
    assert pool[:, committed:run_pages].any()  # the previous occupant's frames are still in the pool's pages


def _committed_frames(engine: ARDiffusionEngine, sid: str) -> int:
    value = engine.runner.session_table.get(sid)._value
    return max(cursor.committed_frames for cursor in value.cursors.values())
