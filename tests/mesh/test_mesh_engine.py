"""Both reference pipelines through the engine on a mesh equal the one-device run.

Meshes (tp=2, cfg=2), (tp=4), (tp=8) and (cfg=2): multi-session rollouts with LRU churn
and ring wrap through :class:`~ardiff_jax.ARDiffusionEngine` give the unsharded outputs to
float32 tolerance, compile nothing new after warmup, hold the planned bytes per device,
and the CFG pipeline's one-call step moves no pool and exchanges only the guidance combine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.kv import KVSharding, PagedKVCaches
from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline, WorldPipeline, WorldPipelineConfig, dit_preset
from ardiff_jax.rollout import rollout_sessions
from ardiff_jax.runtime import ARDiffusionKVCache
from helpers import count_compiles
from meshes import MESH_SHAPES, assert_no_pool_collective, collectives, make_mesh
from runner_pipelines import RecordingPipeline, small_spec

#: 8 heads of 8, so tp=8 splits them; everything else the "tiny" preset.
CONFIG = dit_preset("tiny", num_heads=8, dim=64, ffn_dim=128)
SESSIONS = ("a", "b", "c")
ROUNDS = 3  # blocks per session: 6 frames through a 5-frame window of 2-frame blocks wrap the ring


def _world(modules=None):
    return WorldPipeline(CONFIG, WorldPipelineConfig(session_capacity=2), modules=modules)


def _cfg(modules=None):
    return CFGWorldActionPipeline(CONFIG, CFGPipelineConfig(session_capacity=2), modules=modules)


def _requests(kind: str, pipeline) -> list[DiffusionRequest]:
    """Round-robin over 3 sessions on capacity 2: every request after the second evicts someone."""
    rng = np.random.default_rng(0)
    requests = []
    for round_index in range(ROUNDS):
        for i, sid in enumerate(SESSIONS):
            if kind == "world":
                action = rng.standard_normal((CONFIG.num_register_tokens, CONFIG.register_dim)).astype(np.float32)
                inputs = {"seed": i, "action": action}
                prompt = "a red car"
            else:
                inputs = {"observation": pipeline.schema.example(1 if round_index == 0 else 4, seed=round_index + i)}
                prompt = "pick up the cup"
            requests.append(DiffusionRequest(f"{sid}{round_index}", prompt=prompt, extra_args={"session_id": sid},
                                             inputs=inputs))
    return requests


def _outputs(output) -> list[np.ndarray]:
    if isinstance(output, dict):
        return [np.asarray(output[key]) for key in sorted(output) if hasattr(output[key], "shape")]
    return [np.asarray(output.latents)]


def _engine(kind: str, mesh, modules=None, host_offload_bytes: int = 0) -> ARDiffusionEngine:
    pipeline = (_world if kind == "world" else _cfg)(modules)
    return ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**30, mesh=mesh,
                                                    warmup=False, host_offload_bytes=host_offload_bytes))


def _run(kind: str, mesh, modules=None, host_offload_bytes: int = 0) -> tuple[list[list[np.ndarray]],
                                                                              ARDiffusionEngine]:
    # The first pass is the warm-up the no-recompile check runs after.
    engine = _engine(kind, mesh, modules, host_offload_bytes)
    return [_outputs(engine.generate(r)) for r in _requests(kind, engine.runner.pipeline)], engine


@pytest.fixture(scope="module")
def baselines():
    """One-device outputs of both pipelines (shared weights with the meshed runs)."""
    out = {}
    for kind in ("world", "cfg"):
        pipeline = (_world if kind == "world" else _cfg)()
        outputs, engine = _run(kind, None, pipeline.modules)
        engine.close()
        out[kind] = (outputs, pipeline.modules)
    return out


@pytest.mark.parametrize("mesh_name", list(MESH_SHAPES))
@pytest.mark.parametrize("kind", ["world", "cfg"])
def test_engine_rollout_on_a_mesh_equals_the_one_device_run(baselines, kind, mesh_name):
    shape = MESH_SHAPES[mesh_name]
    expected, modules = baselines[kind]
    mesh = make_mesh(shape)
    outputs, engine = _run(kind, mesh, modules)
    try:
        for got, want in zip(outputs, expected, strict=True):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4)
        cache = engine.runner.kv_cache
        plan = engine.memory_plan
        assert (plan.tp, plan.cfg) == (shape[1], shape[0])
        assert cache.pools.k.sharding.spec == KVSharding(mesh).pool_spec
        held = sum(x.addressable_shards[0].data.nbytes for x in (cache.pools.k, cache.pools.v))
        assert held == plan.pool_bytes_per_device == plan.pool_bytes // (shape[0] * shape[1])
        # Cross caches split by heads over tp: each device holds 1/tp of a resident session's.
        state = cache.get_state(engine.sessions[-1])
        text = next(iter(state._value.cross_attention.values()))  # snapshot() is for bound states only
        assert text.k.addressable_shards[0].data.nbytes == text.k.nbytes // shape[1]
        # Churn after warmup compiles nothing new: new ids, evictions, ring wrap.
        more = _requests(kind, engine.runner.pipeline)
        with count_compiles() as compiled:
            for request in more:
                engine.generate(DiffusionRequest("x" + request.request_id, prompt=request.prompt,
                                                 extra_args={"session_id": "x" + request.extra_args["session_id"]},
                                                 inputs=request.inputs))
        assert compiled == []
    finally:
        engine.close()


def test_cfg_step_runs_both_branches_in_one_call_and_exchanges_only_the_combine(baselines, monkeypatch):
    from ardiff_jax.models import _cfg

    calls = []
    original = _cfg.cfg_step_parallel

    def recording(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(_cfg, "cfg_step_parallel", recording)
    sequential = []
    monkeypatch.setattr(_cfg, "cfg_step", lambda *args: sequential.append(args) or pytest.fail("sequential step ran"))
    # The observation's commit too: both branches in one program through the loop's commit_together.
    together = []
    original_together = _cfg.commit_together
    monkeypatch.setattr(_cfg, "commit_together",
                        lambda *args: together.append(args[1]) or original_together(*args))
    monkeypatch.setattr(_cfg, "commit_pass", lambda *args: pytest.fail("a branch committed alone"))
    _, modules = baselines["cfg"]
    mesh = make_mesh((2, 2))
    outputs, engine = _run("cfg", mesh, modules)
    try:
        assert calls and not sequential
        assert together == [("positive", "negative")] * len(SESSIONS) * ROUNDS
        args = calls[-1]
        hlo = original.lower(*args).compile().as_text()
        num_pages = engine.runner.kv_cache.layout.num_pages
        assert_no_pool_collective(hlo, num_pages, 2)
        # tp all-reduces are per layer (row-parallel projections); what crosses "cfg" groups is
        # the guidance combine: collectives whose groups span the two halves of the mesh.
        video_elements = int(np.prod(CONFIG.block_shape))
        gathers = [shapes for kind, shapes in collectives(hlo) if kind in ("all-gather", "collective-permute")]
        for shapes in gathers:
            assert all(int(np.prod(s)) <= 2 * video_elements for s in shapes), shapes
    finally:
        engine.close()


def test_device_side_rollout_on_a_mesh_equals_the_one_device_rollout():
    spec = small_spec(num_kv_heads=4, head_size=4, tokens_per_frame=2, frames_per_block=2, window_frames=4,
                      session_capacity=2)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(6, 4, 4, 4)), jnp.float32)  # per step: q [4, H, D] seeds the block

    def block_fn(caches: PagedKVCaches, x):
        y = caches.attend(0, x, x, x)
        kv = jnp.stack([x + 1.0, x - 1.0])  # [L, f*T, H, D]
        return y, kv, kv * 0.5

    results = []
    for mesh in (None, make_mesh((2, 2))):
        cache = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=2**28, mesh=mesh)
        states = [cache.create_state(sid) for sid in ("p", "q")]
        ys = rollout_sessions(cache, states, block_fn, xs, [0, 1, 0, 0, 1, 0], branch="main", num_frames=2)
        results.append((np.asarray(ys), np.asarray(cache.pools.k), [s.adapter("main").committed_frames
                                                                     for s in states]))
        cache.close()
    (ys0, k0, c0), (ys1, k1, c1) = results
    np.testing.assert_allclose(ys1, ys0, atol=2e-6)
    np.testing.assert_array_equal(k1, k0)
    assert c0 == c1 == [8, 4]


def test_cfg_mesh_keeps_each_branch_on_its_device_group():
    cache = ARDiffusionKVCache(small_spec(kv_branches=(
        __import__("ardiff_jax").ARDiffusionKVBranchSpec("positive", 0),
        __import__("ardiff_jax").ARDiffusionKVBranchSpec("negative", 1)), num_kv_heads=2), dtype="float32",
        available_memory_bytes=2**28, mesh=make_mesh((2, 1)))
    try:
        assert cache.branch_major
        half = cache.layout.num_pages // 2
        for sid in ("s0", "s1"):
            state = cache.create_state(sid)
            assert state.get_kv_caches("positive", seq_len=3).cursor[0] < half
            assert state.get_kv_caches("negative", seq_len=3).cursor[0] >= half
    finally:
        cache.close()


def test_bad_mesh_configurations_are_refused_before_anything_runs():
    mesh = make_mesh((1, 4))
    with pytest.raises(TypeError, match="SupportsARDiffusionMesh"):
        ARDiffusionEngine(RecordingPipeline(small_spec(num_kv_heads=4), []), EngineConfig(mesh=mesh))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        EngineConfig(mesh="tp=4")
    # "tiny" has 2 heads: they do not split 4 ways (the plan refuses before any pool exists).
    pipeline = WorldPipeline("tiny")
    with pytest.raises(ValueError, match="2 KV heads do not split over tp=4"):
        ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**28, mesh=mesh))
    assert pipeline.device == jax.devices()[0]  # nothing was placed
    # The FFN must split too.
    odd_ffn = WorldPipeline(dit_preset("tiny", num_heads=4, dim=32, ffn_dim=66))
    with pytest.raises(ValueError, match="66 FFN hidden units over tp=4"):
        ARDiffusionEngine(odd_ffn, EngineConfig(dtype="float32", available_memory_bytes=2**28, mesh=mesh))


HOST = 2**26


def _assert_same(got, want, **tolerance):
    for g_block, w_block in zip(got, want, strict=True):
        for g, w in zip(g_block, w_block, strict=True):
            np.testing.assert_allclose(g, w, **tolerance)


@pytest.fixture(scope="module")
def offload_baselines(baselines):
    """One-device outputs with host offload (evicted sessions continue instead of restarting)."""
    out = {}
    for kind in ("world", "cfg"):
        outputs, engine = _run(kind, None, baselines[kind][1], host_offload_bytes=HOST)
        engine.close()
        out[kind] = outputs
    return out


@pytest.mark.parametrize("kind,mesh_name", [("world", "cfg2"), ("world", "tp2-cfg2"), ("cfg", "tp2-cfg2")])
def test_sessions_offloaded_on_a_mesh_continue_as_on_one_device(baselines, offload_baselines, kind, mesh_name):
    """Round robin on capacity 2: every eviction is an offload, every return a restore, on a mesh as on one device."""
    _, modules = baselines[kind]
    expected = offload_baselines[kind]
    shape = MESH_SHAPES[mesh_name]
    engine = _engine(kind, make_mesh(shape), modules, host_offload_bytes=HOST)
    events = []
    engine.runner.add_session_listener(lambda event: events.append((event.kind, event.session_id)))
    try:
        got = [_outputs(engine.generate(r)) for r in _requests(kind, engine.runner.pipeline)]
        _assert_same(got, expected, atol=5e-5, rtol=1e-4)
        restored = [sid for event_kind, sid in events if event_kind == "restored"]
        assert len(restored) >= len(SESSIONS) and not [e for e in events if e[0] == "released"]
        # Restored state is where it was: pools and cross caches split as planned, nothing on one device.
        cache = engine.runner.kv_cache
        assert cache.pools.k.sharding.spec == KVSharding(cache.sharding.mesh).pool_spec
        state = cache.get_state(restored[-1])
        for kv in state._value.cross_attention.values():
            assert kv.k.sharding == cache.cross_attention_placement
        # An offloaded session is held in host memory once: heads over tp, layers over cfg (2 layers split).
        record = engine.runner._host.get(engine.offloaded_sessions[0])
        assert record.pages.k.sharding.memory_kind == "pinned_host"
        assert record.pages.k.addressable_shards[0].data.nbytes == record.pages.k.nbytes // (shape[0] * shape[1])
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["world", "cfg"])
def test_session_files_move_between_a_mesh_and_one_device(baselines, kind, tmp_path):
    """Saved on (tp=2, cfg=2), loaded on one device (and back): the session continues as if never moved."""
    _, modules = baselines[kind]
    straight = _engine(kind, None, modules)
    requests = [r for r in _requests(kind, straight.runner.pipeline) if r.extra_args["session_id"] == "a"]
    expected = [_outputs(straight.generate(r)) for r in requests]
    straight.close()
    meshed, single = _engine(kind, make_mesh((2, 2)), modules), _engine(kind, None, modules)
    try:
        got = [_outputs(meshed.generate(requests[0]))]
        meshed.save_session("a", tmp_path / "from-mesh")
        meshed.close_session("a")
        assert single.load_session(tmp_path / "from-mesh") == "a"
        got.append(_outputs(single.generate(requests[1])))
        single.save_session("a", tmp_path / "from-device")
        assert meshed.load_session(tmp_path / "from-device") == "a"
        got.append(_outputs(meshed.generate(requests[2])))
        _assert_same(got, expected, atol=5e-5, rtol=1e-4)
    finally:
        meshed.close()
        single.close()


def test_causal_wan_on_a_tp_mesh_equals_the_one_device_run():
    """The published-model pipeline splits its heads and FFN over "tp" as the reference pipelines do (the 14B path)."""
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig

    config = dit_preset("wan-tiny", num_heads=4, dim=48, ffn_dim=64)
    base = CausalWanPipeline(config, CausalWanPipelineConfig(session_capacity=2))
    rng = np.random.default_rng(0)
    embeds = {sid: rng.standard_normal((5, config.text_dim)).astype(np.float32) for sid in SESSIONS}
    schedule = ["a", "b", "c", "a", "b", "a", "a"]  # evictions, ring wrap past the 3-frame sink

    def run(mesh):
        pipeline = CausalWanPipeline(config, CausalWanPipelineConfig(session_capacity=2), modules=base.modules)
        engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32", available_memory_bytes=2**30, mesh=mesh,
                                                          warmup=False))
        try:
            return [np.asarray(engine.generate(DiffusionRequest(
                f"r{i}", inputs={"prompt_embeds": embeds[sid]}, extra_args={"session_id": sid})).latents)
                for i, sid in enumerate(schedule)]
        finally:
            engine.close()

    for got, want in zip(run(make_mesh((1, 4))), run(None), strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-4)
