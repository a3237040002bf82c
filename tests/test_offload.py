"""The host offload tier: evicted sessions kept in host memory and restored exactly.

* Bit-exactness: round-robin rollouts of 6 sessions on capacity 2 with offload equal the
  same rollouts on capacity 6, block for block, past ring wrap, for both reference
  pipelines and the trained world's pipeline (and a stepwise session evicted mid-block).
* Lifecycle: the host tier is LRU-bounded by bytes; a session dropped from it, closed or
  reset while offloaded, or left offloaded at ``engine.close()`` gets its hook exactly once.
* Isolation: a restore writes its own slot's pages only, all of them.
* Faults: a failure while offloading releases the session as without offload; a failure
  before the import leaves it offloaded; a failing import releases it with its close
  hook; never half restored. A refused request for an offloaded session changes nothing.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from ardiff_jax import (
    ARDiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    StepSchedulerOutput,
    SupportsARDiffusionSessionExport,
    plan_memory,
)
from ardiff_jax.cli import main as cli_main
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import (
    CFGPipelineConfig,
    CFGWorldActionPipeline,
    DiTModules,
    SpriteWorldPipeline,
    SpriteWorldPipelineConfig,
    WorldPipeline,
    WorldPipelineConfig,
    dit_preset,
)
from ardiff_jax.runtime import HostSessionTier, OffloadedSession

HOST = 10**8  # plenty: every offloaded session fits


def _config(host_offload_bytes: int = 0, **fields) -> EngineConfig:
    """No warmup: nothing here is about compiling, and warmup would compile every batch bucket (2, 4, 6 at
    capacity 6) of programs these tests never run. The programs they use compile on their first request."""
    return EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                        host_offload_bytes=host_offload_bytes, **{"warmup": False, **fields})


@pytest.fixture(scope="module")
def world_modules():
    return WorldPipeline("tiny").modules


@pytest.fixture(scope="module")
def cfg_modules():
    return CFGWorldActionPipeline("tiny").modules


def _world(modules, capacity, host=0, **fields):
    pipeline = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=capacity), modules=modules)
    return pipeline, ARDiffusionEngine(pipeline, _config(host, **fields))


def _world_request(sid: str, block: int) -> DiffusionRequest:
    return DiffusionRequest(f"r-{sid}-{block}", prompt=f"prompt {sid}" if block == 0 else None,
                            extra_args={"session_id": sid}, inputs={"seed": 100 + int(sid[1:])})


def _cfg_request(pipeline, sid: str, block: int) -> DiffusionRequest:
    observation = pipeline.schema.example(1 if block == 0 else 4, seed=10 * block + int(sid[1:]))
    return DiffusionRequest(f"r-{sid}-{block}", prompt=f"task {sid}" if block == 0 else None,
                            extra_args={"session_id": sid}, inputs={"observation": observation})


def _events(engine):
    events = []
    engine.runner.add_session_listener(events.append)
    return events


def _round_robin(engine, make_request, output, sessions: int, rounds: int) -> dict[str, list]:
    outs: dict[str, list] = {}
    for block in range(rounds):
        for i in range(sessions):
            sid = f"s{i}"
            outs.setdefault(sid, []).append(output(engine.generate(make_request(sid, block))))
    return outs


def _assert_same(a: dict[str, list], b: dict[str, list]) -> None:
    assert a.keys() == b.keys()
    for sid in a:
        for block, (x, y) in enumerate(zip(a[sid], b[sid], strict=True)):
            for xi, yi in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
                assert np.array_equal(np.asarray(xi), np.asarray(yi)), f"session {sid} block {block} differs"


def _committed(engine, sid: str, branch: str) -> int:
    return engine.runner.session_table.get(sid).describe()["branches"][branch]["committed_frames"]


# -- bit-exactness ------------------------------------------------------------------------------------


def test_world_round_robin_with_offload_equals_all_resident(world_modules):
    cfg = dit_preset("tiny")
    rounds = (cfg.sink_frames + 2 * cfg.window_frames) // cfg.frames_per_block + 1  # the ring wraps twice
    latents = lambda out: np.asarray(out.latents)  # noqa: E731
    _, resident = _world(world_modules, capacity=6)
    expected = _round_robin(resident, _world_request, latents, 6, rounds)
    _, engine = _world(world_modules, capacity=2, host=HOST)
    events = _events(engine)
    got = _round_robin(engine, _world_request, latents, 6, rounds)
    _assert_same(expected, got)
    kinds = {(e.kind, e.reason) for e in events}
    assert ("offloaded", "lru_eviction") in kinds and ("restored", "offload") in kinds
    assert not [e for e in events if e.kind == "released"]  # nobody was forgotten
    assert len(engine.sessions) == 2 and len(engine.offloaded_sessions) == 4
    assert _committed(engine, engine.sessions[-1], "main") > cfg.sink_frames + 2 * cfg.window_frames


def test_cfg_round_robin_with_offload_equals_all_resident(cfg_modules):
    cfg = dit_preset("tiny")
    make = lambda capacity: CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=capacity),  # noqa: E731
                                                   modules=cfg_modules)
    rounds = cfg.sink_frames + cfg.window_frames + 2  # one observed frame committed per request: past ring wrap
    output = lambda out: (np.asarray(out["video"]), np.asarray(out["actions"]))  # noqa: E731
    resident_pipeline = make(6)
    expected = _round_robin(ARDiffusionEngine(resident_pipeline, _config()),
                            lambda sid, b: _cfg_request(resident_pipeline, sid, b), output, 6, rounds)
    pipeline = make(2)
    engine = ARDiffusionEngine(pipeline, _config(HOST))
    events = _events(engine)
    got = _round_robin(engine, lambda sid, b: _cfg_request(pipeline, sid, b), output, 6, rounds)
    _assert_same(expected, got)
    assert sum(e.kind == "restored" for e in events) >= 6 * (rounds - 1)
    assert not [e for e in events if e.kind == "released"]
    sid = engine.sessions[-1]
    assert _committed(engine, sid, "positive") > cfg.sink_frames + cfg.window_frames
    assert _committed(engine, sid, "negative") == _committed(engine, sid, "positive")


def test_sprite_world_sessions_survive_offload():
    modules = DiTModules.create(dit_preset("sprite_world"), 1)

    def run(capacity, host):
        pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity),
                                       modules=modules)
        engine = ARDiffusionEngine(pipeline, _config(host))
        outs = {}
        for block in range(6):  # window 3 + sink 1: wraps
            for i in range(3):
                inputs = {"actions": [(block + i) % 5]}
                if block == 0:
                    inputs["observation"] = SpriteWorld(i).reset()
                out = engine.generate(DiffusionRequest(f"r{i}{block}", extra_args={"session_id": f"s{i}"},
                                                       inputs=inputs))
                outs.setdefault(f"s{i}", []).append(out.frames)
        return outs, engine

    expected, _ = run(3, 0)
    got, engine = run(1, HOST)
    _assert_same(expected, got)
    assert len(engine.offloaded_sessions) == 2


def test_stepwise_session_offloaded_mid_block_continues_exactly(world_modules):
    """The in-flight block (noisy latents, step index) is model-owned state: it travels too."""
    blocks = 2

    def stream(engine, sid, seed):
        request = DiffusionRequest(sid, prompt=f"street {sid}", inputs={"seed": seed, "num_blocks": blocks})
        return request

    def run(capacity, host, interleave):
        _, engine = _world(world_modules, capacity=capacity, host=host, step_execution=True)
        engine.events = _events(engine)
        requests = {sid: stream(engine, sid, seed) for sid, seed in (("A", 1), ("B", 2))}
        outs = {"A": [], "B": []}
        order = ["A", "B"] * 40 if interleave else ["A"] * 40 + ["B"] * 40
        done = set()
        for sid in order:
            if sid in done:
                continue
            result = engine.step(StepSchedulerOutput(scheduled=(requests[sid],)))
            if result.output is not None:
                outs[sid].append(np.asarray(result.output.latents))
            if result.finished:
                done.add(sid)
        return outs, engine

    expected, _ = run(2, 0, interleave=False)
    got, engine = run(1, HOST, interleave=True)
    assert [len(v) for v in got.values()] == [blocks, blocks]
    restores = sum(e.kind == "restored" for e in engine.events)
    assert restores >= 2 * blocks * WorldPipeline("tiny", modules=world_modules).schedule.num_steps - 2
    _assert_same(expected, got)


# -- the host tier's bound and the hooks -----------------------------------------------------------


class _HookCounter:
    def __init__(self, pipeline):
        self.closed: list[str] = []
        self.reset: list[str] = []
        close, reset = pipeline.close_ar_diffusion_session, pipeline.reset_ar_diffusion_session
        pipeline.close_ar_diffusion_session = lambda sid: (self.closed.append(sid), close(sid))[-1]
        pipeline.reset_ar_diffusion_session = lambda sid: (self.reset.append(sid), reset(sid))[-1]


def _record_bytes(world_modules) -> int:
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    nbytes = engine.runner.host_tier.get("s0").nbytes
    assert nbytes <= engine.memory_plan.offload_bytes_per_session  # the plan's bound holds
    engine.close()
    return nbytes


def test_host_tier_is_lru_bounded_and_a_dropped_session_is_closed_once(world_modules):
    nbytes = _record_bytes(world_modules)
    pipeline, engine = _world(world_modules, capacity=1, host=2 * nbytes)  # room for two records
    hooks = _HookCounter(pipeline)
    events = _events(engine)
    for i in range(4):
        engine.generate(_world_request(f"s{i}", 0))
    assert engine.sessions == ("s3",)
    assert engine.offloaded_sessions == ("s1", "s2")  # s0, the oldest record, was dropped
    assert engine.runner.host_tier.bytes_used == 2 * nbytes
    assert hooks.closed == ["s0"]
    assert [(e.kind, e.session_id, e.reason) for e in events if e.kind == "released"] == [
        ("released", "s0", "host_eviction")]
    # s0 is gone: its next request is a new session (it needs a prompt again).
    with pytest.raises(ValueError, match="no prompt yet"):
        engine.generate(DiffusionRequest("again", extra_args={"session_id": "s0"}))
    assert engine.offloaded_sessions == ("s1", "s2") and hooks.closed == ["s0"]


def test_close_reset_and_engine_close_of_offloaded_sessions_call_hooks_once(world_modules):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    hooks = _HookCounter(pipeline)
    events = _events(engine)
    for i in range(4):
        engine.generate(_world_request(f"s{i}", 0))
    assert engine.offloaded_sessions == ("s0", "s1", "s2")
    engine.close_session("s0")
    engine.reset_session("s1")
    assert engine.offloaded_sessions == ("s2",)
    assert hooks.closed == ["s0"] and hooks.reset == ["s1"]
    assert pipeline.session_ids == ("s3",)  # the exported sessions never came back into the pipeline
    engine.close()
    assert sorted(hooks.closed) == ["s0", "s2", "s3"] and hooks.reset == ["s1"]
    released = [(e.session_id, e.reason) for e in events if e.kind == "released"]
    assert released == [("s0", "close"), ("s1", "reset"), ("s3", "close"), ("s2", "close")]
    assert engine.offloaded_sessions == ()


def test_a_session_too_large_for_the_tier_is_evicted_as_without_offload(world_modules):
    pipeline, engine = _world(world_modules, capacity=1, host=1000)  # smaller than one session
    hooks = _HookCounter(pipeline)
    events = _events(engine)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    assert engine.offloaded_sessions == () and hooks.closed == ["s0"]
    assert ("released", "s0", "lru_eviction") in [(e.kind, e.session_id, e.reason) for e in events]


class _NoExport:
    """A WorldPipeline without the export capability (delegates everything else)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name in ("export_ar_diffusion_session", "import_ar_diffusion_session"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_pipeline_without_export_is_evicted_as_before_and_says_so(world_modules, caplog):
    inner = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=1), modules=world_modules)
    pipeline = _NoExport(inner)
    assert not isinstance(pipeline, SupportsARDiffusionSessionExport)
    assert isinstance(inner, SupportsARDiffusionSessionExport)
    with caplog.at_level(logging.WARNING, logger="ardiff_jax.runtime"):
        engine = ARDiffusionEngine(pipeline, _config(HOST))
    assert "does not implement SupportsARDiffusionSessionExport" in caplog.text
    events = _events(engine)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    assert engine.offloaded_sessions == ()
    assert ("released", "s0", "lru_eviction") in [(e.kind, e.session_id, e.reason) for e in events]
    assert engine.runner.host_tier.capacity_bytes == 0


def test_without_offload_eviction_is_the_references(world_modules):
    pipeline, engine = _world(world_modules, capacity=1)
    hooks = _HookCounter(pipeline)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    assert engine.offloaded_sessions == () and hooks.closed == ["s0"] and pipeline.session_ids == ("s1",)


def test_a_pinned_session_is_not_offloaded_and_a_blocked_restore_stays_offloaded(world_modules):
    _, engine = _world(world_modules, capacity=1, host=HOST)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))  # s0 offloaded
    engine.runner.session_table.pin("s1")
    with pytest.raises(RuntimeError, match="pinned"):
        engine.generate(_world_request("s0", 1))
    assert engine.sessions == ("s1",) and engine.offloaded_sessions == ("s0",)
    engine.runner.session_table.unpin("s1")
    engine.generate(_world_request("s0", 1))
    assert engine.sessions == ("s0",) and engine.offloaded_sessions == ("s1",)


# -- isolation ------------------------------------------------------------------------------------------


def _pool_slots(engine) -> np.ndarray:
    cache = engine.runner.kv_cache
    k = np.array(cache.pools.k)
    return k.reshape(k.shape[0], cache.session_capacity, cache.session_pages, *k.shape[2:])


def test_a_restore_writes_all_of_its_own_slot_and_nothing_else(world_modules, monkeypatch):
    pipeline, engine = _world(world_modules, capacity=2, host=HOST)
    for block in range(3):
        for sid in ("s0", "s1", "s2"):  # capacity 2: every request restores one session and offloads another
            engine.generate(_world_request(sid, block))
    offloaded = engine.offloaded_sessions[0]
    record = engine.runner.host_tier.get(offloaded)
    assert isinstance(record, OffloadedSession)
    before = _pool_slots(engine)
    # Stop right after the restore: the forward sees the restored slot exactly as the record holds it.
    seen = {}

    def forward(request):
        state = pipeline._bound_state()
        seen["slot"] = state.slot
        seen["pools"] = _pool_slots(engine)
        raise RuntimeError("stop after restore")

    monkeypatch.setattr(pipeline, "forward", forward)
    with pytest.raises(RuntimeError, match="stop after restore"):
        engine.generate(_world_request(offloaded, 3))
    slot, after = seen["slot"], seen["pools"]
    # Its whole slot holds the record's pages: nothing of the previous occupant survives.
    assert np.array_equal(after[:, slot], np.asarray(record.pages.k))
    assert not np.array_equal(before[:, slot], after[:, slot])
    # Every other slot is untouched, bit for bit.
    others = [s for s in range(engine.session_capacity) if s != slot]
    assert np.array_equal(before[:, others], after[:, others])


def test_restore_is_one_donated_write_and_offload_copies_one_slot(world_modules):
    # Capacity 6: the round-robin tests' resident engine, so its programs are already compiled.
    _, engine = _world(world_modules, capacity=6)
    engine.generate(_world_request("s0", 0))
    cache = engine.runner.kv_cache
    pages = cache.read_slot(0)
    assert pages.k.shape[1] == cache.session_pages < cache.layout.num_pages
    assert pages.k.nbytes == cache.session_pages * cache.layout.page_bytes // 2
    old = cache.pools
    cache.write_slot(2, pages)
    assert old.k.is_deleted() and old.v.is_deleted()  # donated: written in place, no second pool
    assert np.array_equal(np.asarray(cache.read_slot(2).k), np.asarray(pages.k))
    # The runtime's path: one program writes the slot into host memory, one donated program writes it back.
    host_pages = cache.offload_slot(0)
    assert host_pages.k.sharding.memory_kind == "pinned_host"
    assert np.array_equal(np.asarray(host_pages.k), np.asarray(pages.k))
    old = cache.pools
    cache.write_slot(1, host_pages)
    assert old.k.is_deleted() and old.v.is_deleted()
    assert np.array_equal(np.asarray(cache.read_slot(1).v), np.asarray(pages.v))
    with pytest.raises(ValueError, match="slot pages k must be"):
        cache.write_slot(1, type(pages)(k=pages.k[:, :1], v=pages.v))
    with pytest.raises(IndexError, match="slot 6 out of range"):
        cache.read_slot(6)


# -- faults ---------------------------------------------------------------------------------------------


def _reference_blocks(world_modules, schedule):
    _, engine = _world(world_modules, capacity=6)
    return [np.asarray(engine.generate(_world_request(sid, block)).latents) for sid, block in schedule]


def test_a_failing_offload_releases_the_session_as_without_offload(world_modules, monkeypatch):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    hooks = _HookCounter(pipeline)
    engine.generate(_world_request("s0", 0))
    cache = engine.runner.kv_cache
    monkeypatch.setattr(cache, "offload_slot", lambda slot, *written: (_ for _ in ()).throw(RuntimeError("DMA failed")))
    engine.generate(_world_request("s1", 0))
    assert engine.sessions == ("s1",) and engine.offloaded_sessions == () and hooks.closed == ["s0"]


def test_a_failing_export_releases_the_session_with_its_close_hook(world_modules, monkeypatch):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    hooks = _HookCounter(pipeline)
    engine.generate(_world_request("s0", 0))

    def export(sid):
        raise RuntimeError("export failed")

    monkeypatch.setattr(pipeline, "export_ar_diffusion_session", export)
    engine.generate(_world_request("s1", 0))
    assert engine.sessions == ("s1",) and engine.offloaded_sessions == () and hooks.closed == ["s0"]
    assert "s0" not in pipeline.session_ids


def test_a_failing_page_restore_leaves_the_session_offloaded_and_it_continues_exactly(world_modules, monkeypatch):
    schedule = [("s0", 0), ("s1", 0), ("s0", 1), ("s0", 2)]
    expected = _reference_blocks(world_modules, schedule)
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    hooks = _HookCounter(pipeline)
    got = [np.asarray(engine.generate(_world_request(sid, block)).latents) for sid, block in schedule[:2]]
    cache = engine.runner.kv_cache
    real_write = cache.write_slot
    monkeypatch.setattr(cache, "write_slot", lambda slot, pages: (_ for _ in ()).throw(RuntimeError("H2D failed")))
    with pytest.raises(RuntimeError, match="H2D failed"):
        engine.generate(_world_request("s0", 1))
    # Fully offloaded again (s1 went to the host tier to make room, and stays there intact).
    assert "s0" in engine.offloaded_sessions and "s0" not in engine.sessions
    assert cache.num_free_slots == 1 and hooks.closed == []
    monkeypatch.setattr(cache, "write_slot", real_write)
    got += [np.asarray(engine.generate(_world_request(sid, block)).latents) for sid, block in schedule[2:]]
    for block, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert np.array_equal(a, b), f"block {block} differs after the failed restore"


def test_a_failing_import_releases_the_session_with_its_close_hook(world_modules, monkeypatch):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    hooks = _HookCounter(pipeline)
    events = _events(engine)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    real_import = pipeline.import_ar_diffusion_session
    calls = []

    def import_(sid, state):
        calls.append(sid)
        if len(calls) == 2:  # the first import serves the request's validation; the second is the restore
            raise RuntimeError("import failed")
        real_import(sid, state)

    monkeypatch.setattr(pipeline, "import_ar_diffusion_session", import_)
    with pytest.raises(RuntimeError, match="import failed"):
        engine.generate(_world_request("s0", 1))
    assert "s0" not in engine.sessions and "s0" not in engine.offloaded_sessions
    assert hooks.closed == ["s0"] and "s0" not in pipeline.session_ids
    assert ("released", "s0", "restore_failed") in [(e.kind, e.session_id, e.reason) for e in events]
    assert engine.runner.kv_cache.num_free_slots == 1  # its slot is free again


def test_a_refused_request_for_an_offloaded_session_changes_nothing(world_modules):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST)
    events = _events(engine)
    engine.generate(_world_request("s0", 0))
    engine.generate(_world_request("s1", 0))
    before = (engine.sessions, engine.offloaded_sessions, pipeline.session_ids, len(events))
    pools = np.array(engine.runner.kv_cache.pools.k)
    with pytest.raises(ValueError, match="seed"):
        engine.generate(DiffusionRequest("bad", extra_args={"session_id": "s0"}, inputs={"seed": -1}))
    assert (engine.sessions, engine.offloaded_sessions, pipeline.session_ids, len(events)) == before
    assert np.array_equal(pools, np.asarray(engine.runner.kv_cache.pools.k))
    # The validation saw the offloaded state: a request without a prompt is fine for s0.
    engine.generate(DiffusionRequest("ok", extra_args={"session_id": "s0"}))
    assert engine.sessions == ("s0",)


def test_imports_refuse_a_state_the_pipeline_could_not_have_exported(world_modules):
    pipeline, engine = _world(world_modules, capacity=2)
    engine.generate(_world_request("s0", 0))
    state = pipeline.export_ar_diffusion_session("s0")
    assert pipeline.export_ar_diffusion_session("s0") == {}  # moved out: a second export has nothing
    bad = dict(state, last_block=state["last_block"][:1])
    with pytest.raises(ValueError, match="last_block must be float32"):
        pipeline.import_ar_diffusion_session("s0", bad)
    with pytest.raises(ValueError, match="fields"):
        pipeline.import_ar_diffusion_session("s0", {k: v for k, v in state.items() if k != "prompt"})
    with pytest.raises(ValueError, match="PRNG key"):
        pipeline.import_ar_diffusion_session("s0", dict(state, key=jax.numpy.zeros(4, jax.numpy.uint32)))
    assert "s0" not in pipeline.session_ids  # every refusal changed nothing
    pipeline.import_ar_diffusion_session("s0", state)
    with pytest.raises(ValueError, match="already holds"):
        pipeline.import_ar_diffusion_session("s0", state)


# -- the plan -------------------------------------------------------------------------------------------


def test_plan_shows_the_host_tier(world_modules, capsys):
    pipeline = WorldPipeline("tiny", WorldPipelineConfig(session_capacity=2), modules=world_modules)
    spec = pipeline.ar_diffusion_kv_cache_spec()
    plan = plan_memory(spec, dtype="float32", available_memory_bytes=10**9, host_offload_bytes=10**6)
    per_session = (spec.num_local_kv_branches * (spec.sink_frames + spec.window_frames) * plan.page_bytes
                   + plan.cross_attention_bytes_per_session + plan.model_owned_bytes_per_session)
    assert plan.offload_bytes_per_session == per_session
    assert plan.host_session_capacity == 10**6 // per_session
    assert plan.as_dict()["host_session_capacity"] == plan.host_session_capacity
    assert "offloaded sessions that fit" in str(plan)
    assert plan_memory(spec, dtype="float32", available_memory_bytes=10**9).host_session_capacity == 0
    engine = ARDiffusionEngine(pipeline, _config(10**6))
    assert engine.memory_plan.host_offload_bytes == 10**6
    assert cli_main(["plan", "--geometry", "tiny", "--available-gib", "1", "--host-offload-bytes", "1000000000",
                     "--json"]) == 0
    printed = capsys.readouterr().out
    assert '"host_offload_bytes": 1000000000' in printed and '"host_session_capacity"' in printed
    with pytest.raises(ValueError, match="host_offload_bytes"):
        EngineConfig(host_offload_bytes=-1)


def test_host_tier_policy():
    tier = HostSessionTier(100)
    make = lambda sid, n: OffloadedSession(session=_FakeSession(sid), pages=None, pipeline_state={},  # noqa: E731
                                           nbytes=n)
    assert tier.fits(100) and not tier.fits(101) and not tier.fits(0)
    tier.add(make("a", 40))
    tier.add(make("b", 40))
    assert tier.admission_victims(20) == [] and tier.admission_victims(30) == ["a"]
    assert tier.admission_victims(100) == ["a", "b"]
    with pytest.raises(RuntimeError, match="full"):
        tier.add(make("c", 30))
    with pytest.raises(ValueError, match="already offloaded"):
        tier.add(make("a", 1))
    assert tier.pop("a").nbytes == 40 and tier.bytes_used == 40 and tier.pop("zz") is None
    assert tier.lru_order == ("b",) and "b" in tier and len(tier) == 1


class _FakeSession:
    def __init__(self, session_id):
        self.session_id = session_id


def test_a_finished_stepwise_request_releases_its_offloaded_session(world_modules):
    pipeline, engine = _world(world_modules, capacity=1, host=HOST, step_execution=True)
    hooks = _HookCounter(pipeline)
    stream = DiffusionRequest("A", prompt="street", inputs={"seed": 1, "num_blocks": 2})
    engine.step(StepSchedulerOutput(scheduled=(stream,)))  # A mid-block
    engine.step(StepSchedulerOutput(scheduled=(DiffusionRequest("B", prompt="sea", inputs={"num_blocks": 2}),)))
    assert engine.offloaded_sessions == ("A",)
    engine.step(StepSchedulerOutput(finished_req_ids=frozenset({"A"})))  # the scheduler aborts A
    assert engine.offloaded_sessions == () and hooks.closed == ["A"] and "A" not in pipeline.session_ids


def test_an_offload_record_holds_zeros_where_its_session_wrote_nothing(world_modules):
    """Issue 43, item 3: a session that has not filled its window sits on pages that still hold the previous
    occupant's frames; its host record copies what it wrote and zeros, and it continues exactly after a restore."""
    _, engine = _world(world_modules, capacity=1, host=HOST)
    for block in range(5):  # fills every page of slot 0
        engine.generate(_world_request("s0", block))
    engine.close_session("s0")
    first = engine.generate(_world_request("s1", 0))  # slot 0 again: one block (the sink and one ring frame)
    cache = engine.runner.kv_cache
    run_pages, committed = cache.layout.run_pages, _committed(engine, "s1", "main")
    assert 0 < committed < run_pages and np.asarray(cache.pools.k)[:, committed:run_pages].any()
    engine.generate(_world_request("s2", 0))  # s1 offloaded
    record = engine.runner.host_tier.get("s1")
    assert record.pages.k.sharding.memory_kind == "pinned_host"
    for pages in (record.pages.k, record.pages.v):
        pages = np.asarray(pages)
        assert not pages[:, committed:run_pages].any() and pages[:, :committed].any()
    later = [engine.generate(_world_request("s1", block)).latents for block in (1, 2)]  # restored: exact
    _, reference = _world(world_modules, capacity=2)
    assert np.array_equal(np.asarray(reference.generate(_world_request("s1", 0)).latents), np.asarray(first.latents))
    for block, got in zip((1, 2), later, strict=True):
        assert np.array_equal(np.asarray(reference.generate(_world_request("s1", block)).latents), np.asarray(got))
