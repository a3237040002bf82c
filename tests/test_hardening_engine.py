"""Hardening, second round: nothing lost or mixed behind the engine (the issue's items 9-13).

9.  A restore that fails after another session was moved to the host tier to make room costs
    only the session being restored: the moved one stays offloaded (no close hook, no event)
    and continues bit for bit.
10. Every integer of a session file's manifest is range-checked against the int32 range the
    device uses (cursors, committed frames, run owners, array shapes, the pipeline state's
    ints): a SessionFileError naming the field and the value, before any session, pool or
    event changes; a pipeline state a file could not load back is refused at save.
11. A manifest nested too deeply is a SessionFileError, never a bare RecursionError.
12. A session file records the fingerprint of the weights it was saved under; a file of other
    weights is refused naming both fingerprints unless the caller passes
    ``allow_other_weights=True`` (engine and router); a file without one still loads.
13. The router's placements follow its replicas' session events: a session a replica released
    (LRU, a record dropped from a host tier, a failure) is no longer placed, and a replica's
    load is what it holds (resident plus offloaded).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import WorldPipeline, WorldPipelineConfig
from ardiff_jax.runtime import SessionFileError
from ardiff_jax.runtime._ray import EngineReplica
from ardiff_jax.runtime._router import ARDiffusionRouter
from ardiff_jax.runtime._persist import seal_manifest
from runner_pipelines import RecordingPipeline

HOST = 10**8  # plenty: every offloaded session fits
F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)
INT32_MAX = 2**31 - 1


def _config(**fields) -> EngineConfig:
    """No warmup: nothing here is about compiling, and warmup would compile the batch bucket (capacity 2)
    no test runs and replay the warmup blocks in every engine; each program used compiles on first use."""
    return EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                        **{"warmup": False, **fields})


@pytest.fixture(scope="module")
def world_base() -> WorldPipeline:
    return WorldPipeline("tiny")


def _world(base: WorldPipeline, capacity: int = 2, **fields) -> tuple[WorldPipeline, ARDiffusionEngine]:
    pipeline = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=capacity), modules=base.modules)
    return pipeline, ARDiffusionEngine(pipeline, _config(**fields))


def _world_request(sid: str, block: int) -> DiffusionRequest:
    return DiffusionRequest(f"r-{sid}-{block}", prompt=f"prompt {sid}" if block == 0 else None,
                            extra_args={"session_id": sid}, inputs={"seed": 100 + ord(sid[0])})


def _latents(engine: ARDiffusionEngine, sid: str, block: int) -> np.ndarray:
    return np.asarray(engine.generate(_world_request(sid, block)).latents)


def _events(engine) -> list:
    events: list = []
    engine.runner.add_session_listener(events.append)
    return events


def _closed_hooks(pipeline) -> list[str]:
    """The ids whose close hook ran, in order (the pipeline's hook is wrapped)."""
    closed: list[str] = []
    close = pipeline.close_ar_diffusion_session
    pipeline.close_ar_diffusion_session = lambda sid: (closed.append(sid), close(sid))[-1]
    return closed


# -- 9. a failed restore costs only its own session ---------------------------------------------------


def _record_nbytes(base: WorldPipeline) -> int:
    _, engine = _world(base, capacity=1, host_offload_bytes=HOST)
    engine.generate(_world_request("B", 0))
    engine.generate(_world_request("A", 0))
    nbytes = engine.runner.host_tier.get("B").nbytes
    engine.close()
    return nbytes


@pytest.mark.parametrize("records", [1, 2], ids=["tier_of_one_record", "tier_of_two_records"])
def test_a_failed_restore_costs_only_the_session_being_restored(world_base, monkeypatch, records):
    _, reference = _world(world_base, capacity=2)
    expected = {sid: [_latents(reference, sid, block) for block in range(3)] for sid in ("A", "B")}
    nbytes = _record_nbytes(world_base)
    pipeline, engine = _world(world_base, capacity=1, host_offload_bytes=records * nbytes + nbytes // 2)
    closed = _closed_hooks(pipeline)
    events = _events(engine)
    _latents(engine, "B", 0)
    got_a = [_latents(engine, "A", 0)]  # B offloaded; A resident, and idle from now on
    cache = engine.runner.kv_cache
    real_write = cache.write_slot

    def failing_write(slot, pages):
        raise RuntimeError("H2D failed")

    monkeypatch.setattr(cache, "write_slot", failing_write)
    with pytest.raises(RuntimeError, match="H2D failed"):
        engine.generate(_world_request("B", 1))
    # A went to the host tier to make room for B, and stays there: no close hook, no release.
    assert "A" in engine.offloaded_sessions and engine.sessions == ()
    assert "A" not in closed and not [e for e in events if e.session_id == "A" and e.kind == "released"]
    if records == 2:  # room for both: B is offloaded again, as before its request
        assert sorted(engine.offloaded_sessions) == ["A", "B"] and closed == []
    else:  # room for one: B, the session whose restore failed, gives way
        assert engine.offloaded_sessions == ("A",) and closed == ["B"]
        assert [(e.kind, e.session_id, e.reason) for e in events if e.kind == "released"] == [
            ("released", "B", "restore_failed")]
    assert engine.runner.host_tier.bytes_used <= engine.runner.host_tier.capacity_bytes
    monkeypatch.setattr(cache, "write_slot", real_write)
    got_a += [_latents(engine, "A", block) for block in (1, 2)]
    for block, (want, got) in enumerate(zip(expected["A"], got_a, strict=True)):
        assert np.array_equal(want, got), f"A's block {block} differs after B's failed restore"
    if records == 2:
        assert np.array_equal(_latents(engine, "B", 1), expected["B"][1])


def test_a_failed_load_keeps_the_session_evicted_for_it(world_base, tmp_path, monkeypatch):
    _, source = _world(world_base, capacity=1)
    _latents(source, "S", 0)
    path = source.save_session("S", tmp_path / "S")
    _, reference = _world(world_base, capacity=1)
    expected = [_latents(reference, "A", block) for block in range(2)]
    pipeline, engine = _world(world_base, capacity=1, host_offload_bytes=HOST)
    closed = _closed_hooks(pipeline)
    _latents(engine, "A", 0)
    cache = engine.runner.kv_cache
    real_write = cache.write_slot
    monkeypatch.setattr(cache, "write_slot", lambda slot, pages: (_ for _ in ()).throw(RuntimeError("H2D failed")))
    with pytest.raises(RuntimeError, match="H2D failed"):
        engine.load_session(path)
    assert engine.offloaded_sessions == ("A",) and engine.sessions == () and closed == []
    monkeypatch.setattr(cache, "write_slot", real_write)
    assert np.array_equal(_latents(engine, "A", 1), expected[1])


# -- 10. integers past the device's int32 range --------------------------------------------------------


@pytest.fixture(scope="module")
def world_file(world_base, tmp_path_factory) -> Path:
    """A world session saved after two blocks (read-only: tests edit copies of it)."""
    _, engine = _world(world_base)
    for block in range(2):
        _latents(engine, "saved", block)
    path = engine.save_session("saved", tmp_path_factory.mktemp("world") / "session")
    engine.close()
    return path


@pytest.fixture(scope="module")
def full_target(world_base) -> ARDiffusionEngine:
    """Both slots taken and no host tier: a load that made room first would close ``x``."""
    _, engine = _world(world_base, capacity=2)
    for sid in ("x", "y"):
        _latents(engine, sid, 0)
    return engine


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text(encoding="utf-8"))


def _write_manifest(path: Path, manifest: dict) -> None:
    # Re-sealed: these tests edit a field on purpose to test its own check, not the digest's.
    (path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)), encoding="utf-8")


def _snapshot(engine: ARDiffusionEngine) -> tuple:
    pools = engine.runner.kv_cache.pools
    return (engine.sessions, engine.offloaded_sessions, engine.runner.pipeline.session_ids,
            {sid: engine.runner.session_table.get(sid).describe() for sid in engine.sessions},
            np.array(pools.k, copy=True), np.array(pools.v, copy=True))


def _assert_unchanged(engine: ARDiffusionEngine, before: tuple, events: list) -> None:
    after = _snapshot(engine)
    assert after[:4] == before[:4], f"sessions changed: {before[:4]} -> {after[:4]}"
    assert np.array_equal(after[4], before[4]) and np.array_equal(after[5], before[5]), "pool bytes changed"
    assert events == [], f"a refused load emitted {events}"


def _refused_load(engine: ARDiffusionEngine, path: Path, message: str, **keywords) -> SessionFileError:
    events = _events(engine)
    before = _snapshot(engine)
    with pytest.raises(SessionFileError, match=message) as refused:
        engine.load_session(path, session_id="loaded", **keywords)
    _assert_unchanged(engine, before, events)
    return refused.value


def _set_cursor(manifest: dict, value: int) -> None:
    manifest["cursors"]["main"][0] = value
    manifest["committed_frames"]["main"] = value


#: ``field: (edit(manifest, value), the field as the error names it)``.
INT_FIELDS = {
    "cursor": (_set_cursor, "cursors.main[0]"),
    "visible_start": (lambda m, v: m["cursors"]["main"].__setitem__(1, v), "cursors.main[1]"),
    "committed_frames": (lambda m, v: m["committed_frames"].__setitem__("main", v), "committed_frames.main"),
    "run_owner_index": (lambda m, v: m["run_owners"][0].__setitem__(0, v), "run_owners[0][0]"),
    "block_index": (lambda m, v: m["pipeline_state"]["dict"].__setitem__("block_index", v),
                    "pipeline_state.dict.block_index"),
    "state_array_shape": (lambda m, v: m["arrays"][m["pipeline_state"]["dict"]["last_block"]["array"]]["shape"]
                          .__setitem__(0, v), "arrays.state_5.shape[0]"),
}


@pytest.mark.parametrize("value", [2**40, 10**30, 10**400], ids=["2**40", "10**30", "10**400"])
@pytest.mark.parametrize("field", sorted(INT_FIELDS))
def test_a_manifest_integer_past_int32_is_refused_before_anything_changes(full_target, world_file, tmp_path,
                                                                          field, value):
    edit, where = INT_FIELDS[field]
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    if field == "state_array_shape":
        where = where.replace("state_5", manifest["pipeline_state"]["dict"]["last_block"]["array"])
    edit(manifest, value)
    _write_manifest(path, manifest)
    error = _refused_load(full_target, path, re.escape(where))
    assert str(value) in str(error) and "int32" in str(error)


#: ``field: the error``, for -3 where a count or an index belongs (cursors as the spec check words it).
NEGATIVE = {
    "run_owner_index": r"run_owners\[0\]\[0\] must be a non-negative integer, got -3",
    "state_array_shape": r"arrays\.state_\d+\.shape\[0\] must be a non-negative integer, got -3",
    "visible_start": r"cursor 'main' visible_start_frame must be a non-negative integer, got -3",
}


@pytest.mark.parametrize("field", sorted(NEGATIVE))
def test_a_negative_count_in_a_manifest_is_refused_before_anything_changes(full_target, world_file, tmp_path,
                                                                          field):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    INT_FIELDS[field][0](manifest, -3)
    _write_manifest(path, manifest)
    _refused_load(full_target, path, NEGATIVE[field])


@pytest.mark.parametrize("value", [3.0, True, "4"], ids=["float", "bool", "str"])
def test_a_cursor_that_is_not_an_integer_is_refused(full_target, world_file, tmp_path, value):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest["cursors"]["main"][0] = value
    _write_manifest(path, manifest)
    _refused_load(full_target, path, r"cursors\.main\[0\] must be an integer")


def test_the_largest_int32_cursor_still_loads(world_base, world_file, tmp_path):
    """The bound is the device's: ``2**31 - 1`` itself is a cursor the ``i32[3+K+W]`` vector holds."""
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    _set_cursor(manifest, INT32_MAX)
    _write_manifest(path, manifest)
    _, engine = _world(world_base, capacity=1)
    assert engine.load_session(path) == "saved"
    state = engine.runner.session_table.get("saved")
    assert state.describe()["branches"]["main"]["committed_frames"] == INT32_MAX


# -- 11. deep nesting --------------------------------------------------------------------------------------


def _nested_lists(depth: int) -> str:
    return '{"list": [' * depth + "]}" * depth


@pytest.mark.parametrize("where,depth", [("pipeline_state", 100_000), ("pipeline_state", 300), ("geometry", 900)])
def test_a_deeply_nested_manifest_is_a_session_file_error(full_target, world_file, tmp_path, where, depth):
    path = tmp_path / "session"
    shutil.copytree(world_file, path)
    manifest = _manifest(path)
    manifest[where] = "NESTED"
    nested = _nested_lists(depth) if where == "pipeline_state" else '{"a": ' * depth + "1" + "}" * depth
    (path / "manifest.json").write_text(json.dumps(manifest).replace('"NESTED"', nested), encoding="utf-8")
    _refused_load(full_target, path, "nested deeper than")
    with make_router(1) as router:  # the router reads the saved id from the manifest itself
        with pytest.raises(SessionFileError, match="nested deeper than"):
            router.load_session(path)
        assert router.replica_loads == (0,)


class ExportingPipeline(RecordingPipeline):
    """RecordingPipeline whose model state (a forward count, plus ``extra``) can be offloaded, saved and loaded."""

    extra: object = None

    def export_ar_diffusion_session(self, session_id):
        return {"forwards": self.model_state.pop(session_id, 0), "extra": self.extra}

    def import_ar_diffusion_session(self, session_id, state):
        if not isinstance(state, dict) or set(state) != {"forwards", "extra"}:
            raise ValueError(f"not an exported ExportingPipeline state: {state!r}")
        self.model_state[session_id] = int(state["forwards"])


def _nested(depth: int) -> object:
    tree: object = 0
    for _ in range(depth):
        tree = [tree]
    return tree


@pytest.mark.parametrize("extra,message", [(2**40, r"state\.extra is 1099511627776, outside the int32 range"),
                                           (-(2**31) - 1, r"outside the int32 range"),
                                           (_nested(200), r"nested deeper than")],
                         ids=["int_too_large", "int_too_small", "too_deep"])
def test_save_refuses_a_pipeline_state_no_file_could_load_back(tmp_path, extra, message):
    pipeline = ExportingPipeline()
    with ARDiffusionEngine(pipeline, EngineConfig(**F32)) as engine:
        engine.generate(request("a"))
        pipeline.extra = extra
        with pytest.raises(ValueError, match=message):
            engine.save_session("a", tmp_path / "a")
        assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
        assert engine.sessions == ("a",) and pipeline.model_state == {"a": 1}  # the session is untouched
        pipeline.extra = INT32_MAX
        engine.save_session("a", tmp_path / "a")
        assert engine.load_session(tmp_path / "a", "b") == "b"


# -- 12. the weights a session was saved under --------------------------------------------------------------


@pytest.fixture(scope="module")
def other_weights() -> WorldPipeline:
    return WorldPipeline("tiny", WorldPipelineConfig(session_capacity=2, weights_seed=1))


def test_the_weights_fingerprint_is_computed_once_and_follows_the_weights(world_base, other_weights):
    fingerprint = world_base.ar_diffusion_weights_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    assert world_base.ar_diffusion_weights_fingerprint() is fingerprint  # computed once
    assert WorldPipeline("tiny", modules=world_base.modules).ar_diffusion_weights_fingerprint() == fingerprint
    assert other_weights.ar_diffusion_weights_fingerprint() != fingerprint


def test_a_session_saved_under_other_weights_is_refused_unless_allowed(world_base, world_file, other_weights,
                                                                       tmp_path):
    saved = _manifest(world_file)["weights_fingerprint"]
    assert saved == world_base.ar_diffusion_weights_fingerprint()
    engine = ARDiffusionEngine(other_weights, _config())
    try:
        _latents(engine, "x", 0)
        mine = other_weights.ar_diffusion_weights_fingerprint()
        error = _refused_load(engine, world_file, "other weights")
        assert saved in str(error) and mine in str(error) and "allow_other_weights=True" in str(error)
        assert engine.load_session(world_file, allow_other_weights=True) == "saved"
        assert engine.sessions == ("x", "saved")
        _latents(engine, "saved", 2)  # it continues, under this engine's weights
    finally:
        engine.close()


def test_a_file_without_a_weights_fingerprint_still_loads_and_a_malformed_one_is_refused(full_target,
                                                                                        world_file, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(world_file, older)
    manifest = _manifest(older)
    del manifest["weights_fingerprint"]
    _write_manifest(older, manifest)
    malformed = tmp_path / "malformed"
    shutil.copytree(world_file, malformed)
    manifest["weights_fingerprint"] = 5
    _write_manifest(malformed, manifest)
    _refused_load(full_target, malformed, r"weights_fingerprint must be a SHA-256 hex digest, got 5")
    full_target.close_session("y")
    try:
        assert full_target.load_session(older, session_id="older") == "older"
    finally:
        full_target.close_session("older")
        _latents(full_target, "y", 0)


def test_the_override_reaches_through_the_router_and_a_ray_replica(world_file, other_weights):
    with ARDiffusionRouter([ARDiffusionEngine(other_weights, _config())]) as router:
        with pytest.raises(SessionFileError, match="other weights"):
            router.load_session(world_file, "r")
        assert router.replica_of("r") is None and router.replica_loads == (0,)
        assert router.load_session(world_file, "r", allow_other_weights=True) == "r"
        assert router.replica_of("r") == 0 and router.sessions == ("r",)
    # What a RayReplica actor runs (no ray needed on the success path): the keyword reaches the engine.
    pipeline = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=2), modules=other_weights.modules)
    replica = EngineReplica(lambda: ARDiffusionEngine(pipeline, _config()))
    reply = replica.call("load_session", (str(world_file), "r"), True, {"allow_other_weights": True})
    assert reply.error is None and reply.value == "r"
    assert [(e.kind, e.session_id, e.reason) for e in reply.events] == [("restored", "r", "load")]
    replica.call("close", ())


# -- 13. the router follows its replicas ---------------------------------------------------------------------


def make_router(n: int = 2, pipeline_cls: type = RecordingPipeline, **config) -> ARDiffusionRouter:
    return ARDiffusionRouter([ARDiffusionEngine(pipeline_cls(), EngineConfig(**{**F32, **config}))
                              for _ in range(n)])


def request(session_id: str, seed: int = 0) -> DiffusionRequest:
    return DiffusionRequest(f"r-{session_id}-{seed}", extra_args={"session_id": session_id}, inputs={"seed": seed})


def _held(router: ARDiffusionRouter) -> tuple[int, ...]:
    return tuple(len(replica.sessions) + len(replica.offloaded_sessions) for replica in router.replicas)


def test_one_shot_sessions_released_by_lru_leave_no_placement_and_no_load():
    with make_router(2) as router:  # capacity 2 each
        ids = [f"once-{i}" for i in range(300)]  # 75 times the replicas' capacity: a leak of any kind shows
        for seed, session_id in enumerate(ids):
            router.generate(request(session_id, seed))
        assert router.replica_loads == _held(router) == (2, 2)
        placed = [session_id for session_id in ids if router.replica_of(session_id) is not None]
        assert sorted(placed) == sorted(router.sessions) and len(placed) == 4
        assert router.replica_of(ids[0]) is None and router.replica_of(ids[-1]) is not None


def test_a_live_player_is_not_evicted_while_another_replica_is_empty(tmp_path):
    with make_router(2, ExportingPipeline) as router:
        router.generate(request("player"))
        path = router.save_session("player", tmp_path / "player")
        for i in range(10):  # replica 1's LRU releases all but the last two copies
            router.load_session(path, f"copy-{i}", replica=1)
        router.close_session("copy-8")
        router.close_session("copy-9")
        assert router.replicas[1].sessions == () and router.replica_loads == _held(router) == (1, 0)
        router.generate(request("new-1"))
        router.generate(request("new-2"))
        assert (router.replica_of("new-1"), router.replica_of("new-2")) == (1, 0)
        assert router.replicas[0].sessions == ("player", "new-2")  # the player kept its slot


def test_offloaded_sessions_stay_placed_until_their_replica_drops_them():
    probe = ARDiffusionEngine(ExportingPipeline(), EngineConfig(**F32))
    per_session = probe.memory_plan.offload_bytes_per_session
    probe.close()
    with make_router(2, ExportingPipeline, host_offload_bytes=per_session) as router:
        events = []
        router.add_session_listener(events.append)
        for seed, session_id in enumerate("abcdefghi"):  # replica 0: a c e g i; replica 1: b d f h
            router.generate(request(session_id, seed))
        assert router.replicas[0].sessions == ("g", "i") and router.replicas[0].offloaded_sessions == ("c", "e")
        assert ("released", "a", "host_eviction") in [(e.kind, e.session_id, e.reason) for e in events]
        assert router.replica_of("a") is None and router.replica_of("c") == 0
        assert router.replica_loads == _held(router) == (4, 4)
        router.generate(request("c", 20))  # restored on its own replica
        assert "c" in router.replicas[0].sessions and "c" not in router.replicas[1].sessions
        router.reset_session("e")  # a reset session holds nothing but stays placed on its replica
        assert router.replica_of("e") == 0 and router.replica_loads == _held(router) == (3, 4)
        router.generate(request("e", 21))
        assert router.replica_of("e") == 0 and "e" in router.replicas[0].sessions
        assert router.replica_loads == _held(router)


def test_a_load_whose_neighbours_hook_fails_afterwards_stays_placed(tmp_path):
    """The load succeeded, then a record it displaced from the tier had a failing close hook: the error is
    raised, and the router keeps the placement of the session its replica now holds."""
    probe = ARDiffusionEngine(ExportingPipeline(), EngineConfig(**F32))
    per_session = probe.memory_plan.offload_bytes_per_session  # two records of these sessions fit, not three
    probe.close()
    with make_router(1, ExportingPipeline, host_offload_bytes=per_session) as router:
        for seed, session_id in enumerate("abcd"):
            router.generate(request(session_id, seed))
        replica = router.replicas[0]
        assert replica.sessions == ("c", "d") and replica.offloaded_sessions == ("a", "b")
        path = router.save_session("d", tmp_path / "d")
        pipeline = replica.runner.pipeline
        close = pipeline.close_ar_diffusion_session

        def failing_close(session_id):
            close(session_id)
            raise RuntimeError(f"close hook of {session_id} failed")

        pipeline.close_ar_diffusion_session = failing_close
        with pytest.raises(RuntimeError, match="close hook of a failed"):
            router.load_session(path, "loaded")  # c goes to the tier once "loaded" is resident; a gives way
        assert replica.sessions == ("d", "loaded") and replica.offloaded_sessions == ("b", "c")
        assert router.replica_of("loaded") == 0 and router.replica_of("a") is None
        assert router.replica_loads == _held(router) == (4,)


# -- a close whose hook fails leaves no bookkeeping behind ----------------------------------------------


def test_a_failed_close_leaves_the_engine_consistent_and_a_newcomer_evicts_nobody():
    """The close hook raises: the session's slot is free, it is in neither tier, no stepwise start time is
    kept for it, and a newcomer takes the freed slot without evicting a session the caller still serves."""
    from ardiff_jax import StepSchedulerOutput
    from runner_pipelines import StepPipeline

    pipeline = StepPipeline()
    engine = ARDiffusionEngine(pipeline, EngineConfig(**F32, step_execution=True))
    closed = _closed_hooks(pipeline)
    engine.generate(DiffusionRequest("r-a", extra_args={"session_id": "a"}, inputs={"seed": 1}))
    chunk = StepSchedulerOutput(scheduled=(DiffusionRequest("q", inputs={"results": ("none", "output")}),))
    assert engine.step(chunk).output is None  # q's chunk is in flight
    assert engine.sessions == ("a", "q") and engine.runner.kv_cache.num_free_slots == 0
    close = pipeline.close_ar_diffusion_session

    def failing_close(session_id):
        close(session_id)
        raise RuntimeError(f"close hook of {session_id} failed")

    pipeline.close_ar_diffusion_session = failing_close
    with pytest.raises(RuntimeError, match="close hook of q failed"):
        engine.close_session("q")
    pipeline.close_ar_diffusion_session = close
    assert engine.sessions == ("a",) and engine.offloaded_sessions == () and closed == ["q"]
    assert engine.runner.kv_cache.num_free_slots == 1 and engine.session_capacity == 2
    assert "q" not in engine.runner._residency.stepwise_started  # a later q starts a chunk of its own
    engine.generate(DiffusionRequest("r-n", extra_args={"session_id": "newcomer"}, inputs={"seed": 2}))
    assert engine.sessions == ("a", "newcomer") and closed == ["q"]  # a was not evicted for it
    engine.close()
