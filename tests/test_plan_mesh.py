"""The memory plan on a mesh: ``plan_memory(tp=, cfg=)`` arithmetic and ``ardiff-jax plan --tp/--cfg/--devices``.

On a ``tp x cfg`` mesh the plan is one device's: pages and scratch split over every
device, cross-attention caches over ``tp`` only (every ``cfg`` group keeps them),
model-owned state replicated; the capacity is rounded down so that local branches x
capacity divides by ``cfg`` (each group holds whole runs).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

from ardiff_jax.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_jax.cli import main as cli_main
from ardiff_jax.geometries import example_spec
from ardiff_jax.runtime import plan_memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

MAIN = (ARDiffusionKVBranchSpec("main", 0),)
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))

# wan_1_3b in bf16: one page is a frame of K and V over 30 layers; a session holds 21 pages
# (sink 3 + window 18) and a 512-token text cross cache; scratch is one 3-frame block.
WAN_PAGE = 2 * 30 * 1560 * 12 * 128 * 2
WAN_CROSS = 2 * 512 * 12 * 128 * 2 * 30
WAN_SESSION = 21 * WAN_PAGE + WAN_CROSS
# required(c) = scratch 3P + (21c + 3 + 2) pages + c cross = 8P + c * WAN_SESSION on one device.
WAN_FIXED = 8 * WAN_PAGE


def _plan_json(capsys, *argv: str) -> dict:
    assert cli_main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _odd_spec(branches=MAIN, capacity: int = 6, heads: int = 2, cross_heads: int | None = None,
              owned: int = 7) -> ARDiffusionKVCacheSpec:
    # Odd sizes so that every per-device division rounds.
    return ARDiffusionKVCacheSpec(
        num_layers=3, num_kv_heads=heads, head_size=5, tokens_per_frame=7, frames_per_block=2, window_frames=3,
        sink_frames=1, kv_branches=branches,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 11, cross_heads),),
        max_scratch_tokens_per_branch=9, model_owned_state_bytes_per_session=owned, session_capacity=capacity)


# -- plan_memory -------------------------------------------------------------------------------------


@pytest.mark.parametrize("branches", [MAIN, CFG], ids=["one_branch", "cfg_branches"])
@pytest.mark.parametrize("tp,cfg", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_required_bytes_per_device(branches, tp, cfg):
    """required(c) = ceil((X + N(c) P) / (tp cfg)) + c (ceil(C / tp) + M), from the spec's numbers."""
    spec = _odd_spec(branches)
    plan = plan_memory(spec, dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                       scratch_override=0, tp=tp, cfg=cfg)
    local = len(branches)
    page = 2 * 3 * 7 * 2 * 5 * 4
    scratch = local * (2 + math.ceil(9 / 7)) * page
    cross = 2 * local * 11 * 2 * 5 * 4 * 3
    for sessions in range(1, 5):
        pages = local * (sessions * 4 + 2) + 2
        expected = _ceil_div(scratch + pages * page, tp * cfg) + sessions * (_ceil_div(cross, tp) + 7)
        assert plan.required_bytes(sessions) == expected, sessions
    assert (plan.tp, plan.cfg, plan.num_shards) == (tp, cfg, tp * cfg)
    assert plan.page_bytes == page and plan.page_bytes_per_device == _ceil_div(page, tp * cfg)
    assert plan.cross_attention_bytes_per_session_per_device == _ceil_div(cross, tp)
    assert plan.pool_bytes_per_device == plan.pool_bytes // (tp * cfg)


def test_cross_attention_splits_over_tp_not_cfg():
    """Each cfg group keeps every branch's cross caches: cfg=2 halves the pages, not the cross term."""
    spec = _odd_spec(CFG, owned=0)
    plans = {(tp, cfg): plan_memory(spec, dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                                    scratch_override=0, tp=tp, cfg=cfg) for tp, cfg in [(1, 1), (2, 1), (1, 2)]}
    cross = plans[1, 1].cross_attention_bytes_per_session
    assert plans[1, 2].cross_attention_bytes_per_session_per_device == cross
    assert plans[2, 1].cross_attention_bytes_per_session_per_device == cross // 2
    # The cross term is the only part of a session's marginal cost that cfg leaves whole.
    marginal = {key: plan.required_bytes(2) - plan.required_bytes(1) for key, plan in plans.items()}
    run_bytes = 2 * 4 * plans[1, 1].page_bytes  # two local branches x (sink 1 + window 3) pages
    assert marginal[1, 1] == run_bytes + cross
    assert marginal[1, 2] == run_bytes // 2 + cross
    assert marginal[2, 1] == run_bytes // 2 + cross // 2


def test_tp_that_does_not_divide_cross_attention_heads_is_refused():
    spec = _odd_spec(heads=4, cross_heads=3)
    with pytest.raises(ValueError, match=r"cross-attention 'text' has 3 heads, which do not split over tp=2"):
        plan_memory(spec, dtype="float32", available_memory_bytes=10**9, tp=2)


def test_one_branch_capacity_rounds_down_to_a_multiple_of_cfg():
    """Sessions are split over the cfg groups whole: 3 fit the memory, 2 are planned."""
    spec = _odd_spec(MAIN, capacity=10)
    probe = plan_memory(spec, dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                        scratch_override=0, cfg=2)
    budget = probe.required_bytes(3)  # exactly three sessions' bytes per device
    plan = plan_memory(spec, dtype="float32", available_memory_bytes=budget, gpu_memory_fraction=1.0,
                       scratch_override=0, cfg=2)
    assert plan.required_bytes(3) <= plan.budget_bytes < plan.required_bytes(4)
    assert plan.session_capacity == 2 and plan.pool_pages == 2 * 4
    # Two local branches fill both groups with any session count: no rounding.
    cfg_spec = _odd_spec(CFG, capacity=10)
    cfg_budget = plan_memory(cfg_spec, dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0,
                             scratch_override=0, cfg=2).required_bytes(3)
    assert plan_memory(cfg_spec, dtype="float32", available_memory_bytes=cfg_budget, gpu_memory_fraction=1.0,
                       scratch_override=0, cfg=2).session_capacity == 3


def test_one_branch_on_cfg_groups_needs_two_sessions():
    spec = _odd_spec(MAIN, capacity=1)
    with pytest.raises(ValueError, match=r"cfg=2 device groups need sessions in multiples of 2, but only 1 fit"):
        plan_memory(spec, dtype="float32", available_memory_bytes=10**9, cfg=2)


# -- ardiff-jax plan --tp/--cfg/--devices ------------------------------------------------------------


def test_cli_tp2_halves_page_and_pool_bytes_per_device(capsys):
    """At a budget where both meshes reach the requested 8 sessions, tp=2 halves every per-device page term."""
    common = ("--geometry", "wan_1_3b", "--available-gib", "141", "--fraction", "1")
    one = _plan_json(capsys, *common)["plan"]
    two = _plan_json(capsys, *common, "--tp", "2")["plan"]
    assert one["session_capacity"] == two["session_capacity"] == 8
    assert (one["tp"], two["tp"], two["num_shards"]) == (1, 2, 2)
    assert one["page_bytes"] == two["page_bytes"] == WAN_PAGE
    assert one["page_bytes_per_device"] == WAN_PAGE and two["page_bytes_per_device"] == WAN_PAGE // 2
    assert one["pool_bytes_per_device"] == 8 * 21 * WAN_PAGE
    assert two["pool_bytes_per_device"] == one["pool_bytes_per_device"] // 2
    assert two["cross_attention_bytes_per_session_per_device"] == WAN_CROSS // 2
    assert two["required_one_session_bytes"] == (WAN_FIXED + WAN_SESSION) // 2


def test_cli_tp2_doubles_capacity_at_a_tight_budget(capsys):
    """Per device a session costs half on tp=2: a budget of two tp=1 sessions holds four."""
    budget = WAN_FIXED + 2 * WAN_SESSION
    common = ("--geometry", "wan_1_3b", "--available-bytes", str(budget), "--fraction", "1")
    one = _plan_json(capsys, *common)["plan"]
    two = _plan_json(capsys, *common, "--tp", "2")["plan"]
    assert one["session_capacity"] == 2 and one["planned_bytes"] == budget
    assert two["session_capacity"] == 4 and two["planned_bytes"] == (WAN_FIXED + 4 * WAN_SESSION) // 2
    assert two["pool_bytes_per_device"] == 4 * 21 * WAN_PAGE // 2 == one["pool_bytes_per_device"]


def test_cli_cfg2_splits_the_branches_pages_but_not_cross_attention(capsys):
    common = ("--geometry", "medium", "--available-gib", "64")
    flat = _plan_json(capsys, *common)
    out = _plan_json(capsys, *common, "--cfg", "2")
    plan = out["plan"]
    assert out["spec"]["kv_branches"] == {"positive": 0, "negative": 1}
    assert (plan["tp"], plan["cfg"], plan["num_shards"]) == (1, 2, 2)
    assert plan["session_capacity"] == flat["plan"]["session_capacity"] == 4
    assert plan["page_bytes_per_device"] == plan["page_bytes"] // 2
    assert plan["pool_bytes_per_device"] == flat["plan"]["pool_bytes"] // 2
    assert plan["cross_attention_bytes_per_session_per_device"] == plan["cross_attention_bytes_per_session"]
    assert out["mesh"] == {"tp": 1, "cfg": 2, "devices_per_replica": 2, "sessions_per_replica": 4}
    both = _plan_json(capsys, *common, "--tp", "2", "--cfg", "2")["plan"]
    assert both["page_bytes_per_device"] == plan["page_bytes"] // 4
    assert both["cross_attention_bytes_per_session_per_device"] == plan["cross_attention_bytes_per_session"] // 2


def test_cli_text_plan_on_a_mesh(capsys):
    assert cli_main(["plan", "--geometry", "medium", "--available-gib", "64", "--tp", "2", "--cfg", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 x cfg=2" in out and "pool bytes per device" in out
    assert f"per device: page {example_spec('medium').num_layers * 2 * 220 * 4 * 128 * 2 // 4:,} B" in out
    assert "devices per replica: 4 (tp=2 x cfg=2), 4 sessions each" in out
    assert "replicas x" not in out  # no replica count without --devices
    # Every byte figure says whose it is: one device's share or the sum over the replica's devices.
    for label in ("budget [per device]", "required for one session [per device]", "planned for capacity [per device]",
                  "page (frame, all layers, K+V) [all devices]", "allocated pool pages [all devices]"):
        assert label in out, label
    assert cli_main(["plan", "--geometry", "medium", "--available-gib", "64"]) == 0
    assert "[per device]" not in capsys.readouterr().out  # one device: nothing to tell apart


@pytest.mark.parametrize("devices,replicas,unused", [(8, 2, 0), (6, 1, 2)])
def test_cli_devices_counts_replicas_and_sessions(devices, replicas, unused, capsys):
    common = ("--geometry", "wan_1_3b", "--available-bytes", str(WAN_FIXED + 2 * WAN_SESSION), "--fraction", "1",
              "--tp", "2", "--cfg", "2")
    mesh = _plan_json(capsys, *common, "--devices", str(devices))["mesh"]
    # Per device a session costs about a quarter: the requested eight fit one replica (a multiple of cfg=2).
    assert mesh == {"tp": 2, "cfg": 2, "devices_per_replica": 4, "sessions_per_replica": 8, "devices": devices,
                    "replicas": replicas, "total_sessions": replicas * 8}
    assert cli_main(["plan", *common, "--devices", str(devices)]) == 0
    out = capsys.readouterr().out
    line = f"on {devices} devices: {replicas} replica{'s' if replicas != 1 else ''} x 8 sessions = {replicas * 8} sessions"
    assert line + (f" ({unused} devices unused)" if unused else "") + "\n" in out


def test_cli_devices_fewer_than_one_replica_is_refused(capsys):
    assert cli_main(["plan", "--geometry", "medium", "--available-gib", "64", "--tp", "2", "--cfg", "2",
                     "--devices", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--devices 3 cannot hold one tp=2 x cfg=2 replica (4 devices)" in captured.err


@pytest.mark.parametrize("argv,message", [
    (["--geometry", "wan_1_3b", "--available-gib", "141", "--tp", "5"], "12 KV heads do not split over tp=5"),
    (["--geometry", "lingbot_world", "--available-gib", "141", "--tp", "3", "--json"],
     "40 KV heads do not split over tp=3"),
    (["--geometry", "lingbot_world", "--available-gib", "141", "--fraction", "0.01", "--cfg", "2"],
     "need sessions in multiples of 2, but only 1 fit"),
    (["--geometry", "dreamzero_droid", "--available-gib", "8", "--tp", "2"], "cannot fit one session"),
])
def test_cli_mesh_the_geometry_cannot_take_exits_2_and_prints_nothing(argv, message, capsys):
    assert cli_main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("ardiff-jax plan: error: --geometry ") and message in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("flag", ["--tp", "--cfg", "--devices"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_cli_mesh_flags_must_be_positive_integers(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--geometry", "tiny", flag, value])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and flag in captured.err and "positive integer" in captured.err


# -- benchmarks/bench_mesh.py --smoke ---------------------------------------------------------------


def test_bench_mesh_smoke(tmp_path):
    """The benchmark re-runs itself on 8 virtual devices; every mesh agrees with no mesh and holds 1/(tp cfg)."""
    from benchmarks import bench_mesh

    assert bench_mesh.main(["--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "mesh_smoke.json").read_text())
    assert "CPU proxy" in record["note"] and "--xla_force_host_platform_device_count=8" in record["machine"]["xla_flags"]
    assert len(record["machine"]["jax_devices"]) == 8
    meshes = {m["mesh"]: m for m in record["meshes"]}
    assert list(meshes) == ["none", "tp=2", "tp=4", "cfg=2", "tp=2 x cfg=2"]
    pool_bytes = record["config"]["pool_bytes"]
    for mesh in meshes.values():
        assert mesh["devices"] == mesh["tp"] * mesh["cfg"]
        assert mesh["pool_bytes_per_device"] == mesh["planned_pool_bytes_per_device"] == pool_bytes // mesh["devices"]
        for part in ("commit", "attend", "attend_2_branches", "slot_copy", "slot_restore"):
            assert mesh[part]["n"] == 1 and math.isfinite(mesh[part]["median_ms"]) and mesh[part]["median_ms"] > 0
            assert mesh["ratio_to_unsharded"][part] > 0
        assert all(diff <= 1e-2 for diff in mesh["max_abs_diff_vs_unsharded"].values()), mesh
        # One slot copy split over every device (tiny's 2 layers split over cfg=2), equal to the unsharded bits.
        assert mesh["slot_copy_bytes_per_device"] == mesh["slot_copy_bytes"] // mesh["devices"]
        assert mesh["slot_copy_equals_unsharded_bitwise"] is True
    assert set(meshes["none"]["ratio_to_unsharded"].values()) == {1.0}


# -- docs/scaling.md --------------------------------------------------------------------------------


def test_scaling_doc_tables_are_the_scripts_output():
    """The doc's tables are plan_memory's numbers today: regenerate them when the plan changes."""
    from benchmarks import scaling_tables

    doc = ROOT / "docs" / "scaling.md"
    assert scaling_tables.generated_block(doc) == scaling_tables.render(), (
        "docs/scaling.md is stale: run python -m benchmarks.scaling_tables --write docs/scaling.md")


def test_scaling_tables_use_the_mesh_plan():
    """Spot checks of the arithmetic behind the doc: weights split over tp, KV per session split over the mesh."""
    from benchmarks import scaling_tables

    dreamzero = next(m for m in scaling_tables.MODELS if m.name == "DreamZero-14B")
    assert scaling_tables.kv_budget_bytes(dreamzero, 1) == int(141e9 * 0.9) - 28 * 10**9
    assert scaling_tables.kv_budget_bytes(dreamzero, 4) == int(141e9 * 0.9) - 7 * 10**9
    one, mesh = scaling_tables.plan(dreamzero), scaling_tables.plan(dreamzero, tp=2, cfg=2)
    runs = 2 * 9 * one.page_bytes  # two local branches x 9-frame window
    assert scaling_tables.session_bytes_per_device(one) == (
        runs + one.cross_attention_bytes_per_session + 603 * 2**20)
    assert scaling_tables.session_bytes_per_device(mesh) == (
        runs // 4 + one.cross_attention_bytes_per_session // 2 + 603 * 2**20)
    assert mesh.required_bytes(mesh.session_capacity) <= mesh.budget_bytes < mesh.required_bytes(
        mesh.session_capacity + 1)
    wan = scaling_tables.wan_14b_cfg()
    assert (wan.num_layers, wan.num_kv_heads, wan.tokens_per_frame, wan.sink_frames + wan.window_frames) == (
        40, 40, 1560, 21)
    assert scaling_tables.meshes(wan) == [(1, 1), (2, 1), (4, 1), (5, 1), (8, 1), (1, 2), (2, 2), (4, 2)]
