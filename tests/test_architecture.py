"""Architecture guarantees: one session value, one commit rule, layers that hold, policy apart from execution."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec, DiffusionRequest, EngineConfig
from ardiff_jax.rollout import rollout_blocks, rollout_sessions
from ardiff_jax.runtime import (
    ARDiffusionKVCache,
    BranchCursor,
    SessionKV,
    SessionTable,
    branch_cursor_array,
    commit_frames,
    new_session_kv,
)

from runner_pipelines import RecordingPipeline

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ardiff_jax"
SHARED = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0))
MAIN = (ARDiffusionKVBranchSpec("main", 0),)
L, H, D, T = 2, 2, 4, 2


def make_cache(branches=MAIN, capacity=2, **overrides):
    fields = dict(num_layers=L, num_kv_heads=H, head_size=D, tokens_per_frame=T, frames_per_block=2,
                  window_frames=4, sink_frames=1, kv_branches=branches, session_capacity=capacity)
    fields.update(overrides)
    return ARDiffusionKVCache(ARDiffusionKVCacheSpec(**fields), dtype=jnp.float32, available_memory_bytes=10**7,
                              gpu_memory_fraction=1.0)


def block(seed, frames=2):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(L, frames * T, H, D)), jnp.float32)


def commit(state, branch, seed):
    state.get_kv_caches(branch, seq_len=2 * T, commit_current=True)
    state.commit_paged_context(branch, kv=(block(seed), block(seed + 100)))


def block_fn(caches, x):
    k = jnp.broadcast_to(x[:, None, None], (L, 2 * T, H, D)) if x.ndim == 1 else x
    return x, k, k


def pool_bytes(cache):
    return np.asarray(cache.pools.k).copy(), np.asarray(cache.pools.v).copy()


# -- 1. the bug that showed two copies of the commit rule had drifted ----------------------------


def test_rollout_refuses_a_branch_whose_shared_run_another_branch_owns():
    cache = make_cache(SHARED)
    state = cache.create_state("s")
    commit(state, "positive", seed=1)
    before_pools, before_value = pool_bytes(cache), state.snapshot()
    xs = jnp.ones((2, L, 2 * T, H, D), jnp.float32)
    with pytest.raises(RuntimeError, match="share local_index 0"):
        rollout_sessions(cache, [state], jax.tree_util.Partial(block_fn), xs, [0, 0], branch="negative",
                         num_frames=2)
    # Nothing changed: positive's page 0 still holds its block, both cursors as before.
    np.testing.assert_array_equal(pool_bytes(cache)[0], before_pools[0])
    np.testing.assert_array_equal(pool_bytes(cache)[1], before_pools[1])
    assert state.snapshot() == before_value
    assert state.adapter("positive").committed_frames == 2 and state.adapter("negative").committed_frames == 0


def test_rollout_refuses_states_of_another_cache():
    cache, other = make_cache(), make_cache()
    mine = cache.create_state("a")
    foreign = other.create_state("b")
    before = pool_bytes(cache)
    xs = jnp.ones((1, L, 2 * T, H, D), jnp.float32)
    with pytest.raises(ValueError, match="belongs to another ARDiffusionKVCache"):
        rollout_sessions(cache, [foreign], jax.tree_util.Partial(block_fn), xs, [0], branch="main", num_frames=2)
    np.testing.assert_array_equal(pool_bytes(cache)[0], before[0])
    assert mine.adapter("main").committed_frames == 0 and foreign.adapter("main").committed_frames == 0
    mine.close()
    with pytest.raises(RuntimeError, match="closed"):
        rollout_sessions(cache, [mine], jax.tree_util.Partial(block_fn), xs, [0], branch="main", num_frames=2)


def test_rollout_plan_refusal_in_a_later_step_changes_nothing():
    # The second session would exceed max_model_len on its third step: the whole schedule is refused.
    cache = make_cache(capacity=2, max_model_len=4 * T)
    a, b = cache.create_state("a"), cache.create_state("b")
    before = pool_bytes(cache)
    xs = jnp.ones((4, L, 2 * T, H, D), jnp.float32)
    with pytest.raises(RuntimeError, match="max_model_len"):
        rollout_sessions(cache, [a, b], jax.tree_util.Partial(block_fn), xs, [0, 1, 1, 1], branch="main",
                         num_frames=2)
    np.testing.assert_array_equal(pool_bytes(cache)[0], before[0])
    assert a.adapter("main").committed_frames == 0 and b.adapter("main").committed_frames == 0


# -- 2. one session value, one commit path --------------------------------------------------------


def test_session_value_is_an_immutable_pytree():
    cache = make_cache(SHARED)
    state = cache.create_state("s")
    commit(state, "positive", seed=3)
    value = state.snapshot()
    assert isinstance(value, SessionKV) and isinstance(value.cursors["positive"], BranchCursor)
    assert value.cursors["positive"] == BranchCursor(committed_frames=2, visible_start_frame=0)
    assert value.run_owners == ((0, "positive"),)
    leaves, treedef = jax.tree_util.tree_flatten(value)
    assert jax.tree_util.tree_unflatten(treedef, leaves) == value
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.cursors["positive"].committed_frames = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.slot = 3  # type: ignore[misc]


def test_commit_frames_is_pure_and_is_what_the_state_does():
    cache = make_cache(SHARED)
    state = cache.create_state("s")
    spec, layout = cache.spec, cache.layout
    before = state.snapshot()
    predicted = commit_frames(spec, layout, before, "negative", 2)
    assert before.cursors["negative"].committed_frames == 0  # the input is untouched
    commit(state, "negative", seed=4)
    # The cursors, owners and caches are commit_frames' value; the page tables say where the frames went
    # (a session nobody shares with writes its own contiguous run: the written slots are its home pages).
    after = state.snapshot()
    assert dataclasses.replace(after, pages=()) == predicted
    home = list(range(layout.run_pages))  # slot 0's run
    assert [page for page in after.pages[0] if page != layout.null_page] == home[:2]
    # The shared run is now negative's: positive may not commit into it.
    with pytest.raises(RuntimeError, match="share local_index"):
        commit_frames(spec, layout, predicted, "positive", 2)
    with pytest.raises(KeyError, match="Unknown AR-Diffusion KV branch"):
        commit_frames(spec, layout, predicted, "nope", 2)
    with pytest.raises(ValueError, match="exceeds the window"):
        commit_frames(spec, layout, predicted, "negative", 5)


def test_only_the_session_module_constructs_cursors():
    """Nothing outside ``runtime/_session.py`` builds a BranchCursor (so nothing else can move one)."""
    offenders = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                 if "BranchCursor(" in path.read_text(encoding="utf-8") and path.name != "_session.py"]
    assert offenders == []


@pytest.mark.parametrize("reset_at_boundary", [False, True])
def test_device_rollout_advances_cursors_exactly_as_the_commit_rule(reset_at_boundary):
    cache = make_cache(capacity=2, reset_at_boundary=reset_at_boundary)
    spec, layout = cache.spec, cache.layout
    values = [new_session_kv(spec, "a", 0), new_session_kv(spec, "b", 1)]
    order = np.array([0, 1, 1, 0, 1, 0, 0], np.int32)
    cursors = np.stack([branch_cursor_array(spec, layout, value, "main") for value in values])
    xs = jnp.ones((len(order), L, 2 * T, H, D), jnp.float32)
    pools, device_cursors, _ = rollout_blocks(layout, cache.pools, cursors, jax.tree_util.Partial(block_fn), xs,
                                              order, num_frames=2)
    cache._replace_pools(pools)  # the old pools were donated; hand the cache the new ones
    for index in order:
        values[index] = commit_frames(spec, layout, values[index], "main", 2)
    expected = np.stack([branch_cursor_array(spec, layout, value, "main") for value in values])
    np.testing.assert_array_equal(np.asarray(device_cursors), expected)


def test_snapshot_restore_round_trip_and_validation():
    cache = make_cache(SHARED)
    state = cache.create_state("s")
    commit(state, "positive", seed=5)
    snap = state.snapshot()
    commit(state, "positive", seed=6)
    assert state.adapter("positive").committed_frames == 4
    state.restore(snap)
    assert state.snapshot() == snap and state.adapter("positive").committed_frames == 2
    other = cache.create_state("t")
    with pytest.raises(ValueError, match="cannot restore session 't'"):
        other.restore(snap)
    bad = dataclasses.replace(snap, cursors={**snap.cursors,
                                             "positive": BranchCursor(committed_frames=1, visible_start_frame=2)})
    with pytest.raises(ValueError, match="inconsistent"):
        state.restore(bad)
    assert state.snapshot() == snap
    state.get_kv_caches("positive", seq_len=2 * T, commit_current=False)
    with pytest.raises(RuntimeError, match="pending"):
        state.snapshot()


# -- 3. layers that hold ---------------------------------------------------------------------------


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [name for name in names if name.split(".")[0] == "ardiff_jax"]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _private_of_other_subpackage(importer: str, imported: str) -> bool:
    parts = imported.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])  # the package the private module belongs to
            if owner == "ardiff_jax":
                return False  # top-level private modules (_checks, ...) are the shared bottom layer
            return not (importer == owner or importer.startswith(owner + "."))
    return False


def test_no_module_imports_a_private_module_of_another_subpackage():
    violations = [(module, imported) for path in PACKAGE.rglob("*.py")
                  for module in [_module_name(path)] for imported in _imports(path)
                  if _private_of_other_subpackage(module, imported)]
    assert violations == []


def test_dependencies_point_down():
    def deps(module_prefix):
        found = set()
        for path in PACKAGE.rglob("*.py"):
            module = _module_name(path)
            if module == module_prefix or module.startswith(module_prefix + "."):
                found.update(".".join(name.split(".")[:2]) for name in _imports(path))
        found.discard(module_prefix)
        return found

    assert deps("ardiff_jax._checks") == set()
    assert deps("ardiff_jax._files") == set()  # the bounded readers: a bottom layer the models may use
    assert deps("ardiff_jax._checkpoint_files") <= {"ardiff_jax._files"}
    assert deps("ardiff_jax.envs") <= {"ardiff_jax._checks"}
    assert deps("ardiff_jax.types") <= {"ardiff_jax._checks"}
    assert deps("ardiff_jax.kv") <= {"ardiff_jax._checks", "ardiff_jax.types"}
    assert "ardiff_jax.models" not in deps("ardiff_jax.runtime")
    assert "ardiff_jax.runtime" not in deps("ardiff_jax.kv")
    # capability needs the state only for type annotations (under TYPE_CHECKING).
    assert deps("ardiff_jax.capability") <= {"ardiff_jax._checks", "ardiff_jax.types", "ardiff_jax.runtime"}
    # The realtime control plane sits on the runtime (engine-backed consumer and lifecycle), never on models,
    # and nothing beneath it imports it.
    assert deps("ardiff_jax.realtime") <= {"ardiff_jax._checks", "ardiff_jax.types", "ardiff_jax.runtime"}
    for lower in ("_checks", "types", "capability", "kv", "runtime", "models", "envs", "rollout", "training"):
        assert "ardiff_jax.realtime" not in deps(f"ardiff_jax.{lower}"), lower


# -- one denoise-and-commit loop ----------------------------------------------------------------------

#: The pipelines whose loop is the shared one (models/_loop.py): the world pipeline and those built on it
#: (causal Wan, Matrix-Game, the sprite world), and DreamZero.
LOOP_USERS = ("models/_world.py", "models/wan/_pipeline.py", "models/matrix_game/_pipeline.py",
              "models/_sprite.py", "models/dreamzero/_pipeline.py", "models/_cfg.py")
#: What a copy of the loop calls: the paged views, the commits, the rows in and out of a batched program.
LOOP_CALLS = frozenset({"get_kv_caches", "commit_paged_context", "stack_rows", "unstack_rows"})


def _loop_calls(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in LOOP_CALLS:
                found.append(name)
    return found


def _methods(source: str) -> dict[str, set[str]]:
    return {cls.name: {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
            for cls in ast.parse(source).body if isinstance(cls, ast.ClassDef)}


def _loop_violations(sources: dict[str, str]) -> list[str]:
    """What of ``sources`` (path -> text) copies the loop; ``[]`` when they all run the shared one."""
    found = [f"{path}: {calls}" for path, source in sources.items() for calls in [_loop_calls(source)] if calls]
    found += [f"{path}: no _loop import" for path, source in sources.items()
              if "ardiff_jax.models._loop import" not in source and path != "models/wan/_pipeline.py"]
    methods = {name: found for source in sources.values() for name, found in _methods(source).items()}
    found += [f"{name}._denoise_batch" for name, names in methods.items() if "_denoise_batch" in names]
    # The CFG world-action pipeline: a lone call and a batch are the same code, its DreamZero-style
    # paged-view helpers are gone (the loop takes and commits the views).
    if "CFGWorldActionPipeline" in methods:
        cfg = methods["CFGWorldActionPipeline"]
        found += [f"CFGWorldActionPipeline.{name}" for name in sorted({"_kv_get", "_kv_commit"} & cfg)]
        found += [] if {"_calls", "_denoise"} <= cfg else ["CFGWorldActionPipeline without _calls/_denoise"]
    return found


def test_the_world_matrix_game_and_dreamzero_pipelines_run_one_denoise_and_commit_loop():
    """Only ``_loop.py`` reads and commits paged context and stacks rows among these pipelines (the CFG
    world-action pipeline, the fourth user, included): a copy of the loop (a ``_denoise_batch`` of its own,
    DreamZero's or CFG's lone-session loop beside its batched one) fails here."""
    assert _loop_calls("caches = batch.get_kv_caches(MAIN, seq_len=n)\nbatch.commit_paged_context(MAIN, kv=kv)\n"
                       "x = stack_rows(rows, 4)") == ["get_kv_caches", "commit_paged_context", "stack_rows"]
    assert set(_loop_calls((PACKAGE / "models" / "_loop.py").read_text(encoding="utf-8"))) == LOOP_CALLS
    sources = {path: (PACKAGE / path).read_text(encoding="utf-8") for path in LOOP_USERS}
    assert _loop_violations(sources) == []
    # The check catches the CFG pipeline's loops as they were before it joined: DreamZero-style _kv_get on the
    # paged views, a batched loop beside the lone one (forward_batch's own stack_rows), no _calls.
    copied = ("from ardiff_jax.models._loop import Lane\nclass CFGWorldActionPipeline:\n"
              "    def _kv_get(self, state, neg, n, update):\n"
              "        return state.get_kv_caches(neg, seq_len=n, commit_current=update)\n"
              "    def forward_batch(self, requests):\n        return stack_rows(rows, 4)\n")
    assert _loop_violations({"models/_cfg.py": copied}) == [
        "models/_cfg.py: ['get_kv_caches', 'stack_rows']", "CFGWorldActionPipeline._kv_get",
        "CFGWorldActionPipeline without _calls/_denoise"]
    assert "ardiff_jax.models._loop import" not in sources["models/wan/_pipeline.py"]  # it runs the world's code
    methods = {name: found for source in sources.values() for name, found in _methods(source).items()}
    # Matrix-Game supplies rows, a step program and its ring update; the world pipeline's loop runs them.
    assert "_block_program" in methods["MatrixGamePipeline"]
    assert not {"_advance", "_advance_batch", "_denoise", "_forward"} & methods["MatrixGamePipeline"]


# -- policy apart from execution --------------------------------------------------------------------


def test_session_table_policy_without_a_device():
    table: SessionTable[str] = SessionTable(capacity=2)
    assert table.eviction_victims() == []
    table.add("a", "A")
    table.add("b", "B")
    assert table.lru_order == ("a", "b") and table.eviction_victims() == ["a"]
    assert table.touch("a") == "A" and table.lru_order == ("b", "a") and table.eviction_victims() == ["b"]
    table.pin("b")
    assert table.eviction_victims() == ["a"]  # the pinned LRU session is skipped
    table.pin("a")
    with pytest.raises(RuntimeError, match="pinned"):
        table.eviction_victims()
    table.unpin("a")
    table.unpin("b")
    with pytest.raises(RuntimeError, match="full"):
        table.add("c", "C")
    with pytest.raises(ValueError, match="already resident"):
        table.add("a", "A2")
    assert table.remove("b") == "B" and table.remove("ghost") is None
    with pytest.raises(KeyError):
        table.pin("ghost")
    with pytest.raises(ValueError, match="positive integer"):
        SessionTable(capacity=0)


def test_runner_lru_order_is_the_tables():
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(dtype="float32", available_memory_bytes=10**7,
                                                                 gpu_memory_fraction=1.0))
    for sid in ("a", "b", "a", "c"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": sid}, inputs={"commit": False}))
    assert engine.sessions == engine.runner.session_table.lru_order == ("a", "c")


def test_listeners_run_outside_the_runner_lock():
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(dtype="float32", available_memory_bytes=10**7,
                                                                 gpu_memory_fraction=1.0))
    seen = []

    def listener(event):
        # Another thread must be able to use the runner while a listener runs: a listener called under the
        # lock would block it (and the join below would time out).
        worker = threading.Thread(target=lambda: seen.append((event.kind, engine.runner.kv_cache.memory_report()
                                                              ["open_sessions"], engine.sessions)))
        worker.start()
        worker.join(timeout=5)
        assert not worker.is_alive()

    engine.runner.add_session_listener(listener)
    engine.generate(DiffusionRequest("r", extra_args={"session_id": "s"}, inputs={"commit": False}))
    engine.close_session("s")
    assert [kind for kind, _, _ in seen] == ["created", "released"]


def test_device_rollout_uses_the_caches_attention_backend():
    from ardiff_jax.kv import paged_attention, register_attention_backend, unregister_attention_backend

    calls = []

    def recording(*args, **kwargs):
        calls.append("traced")
        return paged_attention(*args, **kwargs)

    register_attention_backend("recording_rollout", recording)
    try:
        spec = make_cache().spec
        cache = ARDiffusionKVCache(spec, dtype=jnp.float32, available_memory_bytes=10**7, gpu_memory_fraction=1.0,
                                   attention_backend="recording_rollout")
        state = cache.create_state("a")

        def attending(caches, x):
            q = x[0]
            out = caches.attend(0, q, q, q)
            return out, x, x

        xs = jnp.ones((2, L, 2 * T, H, D), jnp.float32)
        rollout_sessions(cache, [state], jax.tree_util.Partial(attending), xs, [0, 0], branch="main", num_frames=2)
        assert calls and state.adapter("main").committed_frames == 4
    finally:
        unregister_attention_backend("recording_rollout")


# -- the runner as a shell: one gate to pipeline code ------------------------------------------------

RUNTIME = PACKAGE / "runtime"

#: Every method of the capability protocols (what "pipeline code" is), read from capability.py itself.
CAPABILITY_METHODS = frozenset(
    node.name
    for cls in ast.parse((PACKAGE / "capability.py").read_text(encoding="utf-8")).body
    if isinstance(cls, ast.ClassDef) and cls.name.startswith("Supports")
    for node in cls.body if isinstance(node, ast.FunctionDef))

#: Capability names other runtime objects share (an engine's ``step``): flagged only on a pipeline-ish receiver.
GENERIC_NAMES = frozenset({"step", "forward"})


def _pipeline_calls(source: str) -> list[str]:
    """Each ``receiver.method`` of ``source`` that reaches a capability method (called or kept as a bound method)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in CAPABILITY_METHODS:
            receiver = ast.unparse(node.value)
            if node.attr in GENERIC_NAMES and not any(word in receiver.lower() for word in
                                                      ("pipeline", "batcher", "exporter", "twin")):
                continue
            found.append(f"{receiver}.{node.attr}")
    return found


def test_the_capability_method_list_is_complete_and_the_checker_bites():
    assert {"forward", "forward_batch", "step", "bind_ar_diffusion_state", "bind_ar_diffusion_batch",
            "reset_ar_diffusion_session", "close_ar_diffusion_session", "export_ar_diffusion_session",
            "import_ar_diffusion_session", "validate_ar_diffusion_request", "fork_ar_diffusion_session",
            "ar_diffusion_warmup_requests", "ar_diffusion_compile_twin"} <= CAPABILITY_METHODS
    # What the runner did before the gate existed, and what it must never do again.
    assert _pipeline_calls("out = self._pipeline.forward(request)") == ["self._pipeline.forward"]
    assert _pipeline_calls("v = pipeline.validate_ar_diffusion_request") == ["pipeline.validate_ar_diffusion_request"]
    assert _pipeline_calls("self._exporter.import_ar_diffusion_session(s, x)") == [
        "self._exporter.import_ar_diffusion_session"]
    assert _pipeline_calls("replica.step(out)") == []  # an engine's step (the router's replicas)
    assert _pipeline_calls((RUNTIME / "_gate.py").read_text(encoding="utf-8"))  # the gate does call them


def test_the_gate_is_the_only_runtime_module_that_calls_pipeline_code():
    offenders = {path.name: calls for path in sorted(RUNTIME.glob("*.py")) if path.name != "_gate.py"
                 for calls in [_pipeline_calls(path.read_text(encoding="utf-8"))] if calls}
    assert offenders == {}


def test_admission_refusal_is_pure_and_made_before_anything_moves():
    """``Residency.admission_refusal`` reads the table only: a refused batch leaves LRU order and pins as they were."""
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(dtype="float32", available_memory_bytes=10**7,
                                                                 gpu_memory_fraction=1.0))
    runner = engine.runner
    residency = runner._residency
    capacity = runner.session_capacity
    for sid in ("a", "b"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": sid}, inputs={"commit": False}))
    runner.session_table.pin("a")
    before = (runner.sessions, runner.session_table.is_pinned("a"), runner.kv_cache.num_free_slots)
    assert residency.admission_refusal(["a", "b"]) is None
    assert "repeated: ['b']" in residency.admission_refusal(["b", "c", "b"])
    too_many = [f"s{i}" for i in range(capacity + 1)]
    assert "exceeds the session capacity" in residency.admission_refusal(too_many)
    beside_pin = [f"s{i}" for i in range(capacity)]  # fits alone, not beside the pinned "a"
    assert "pinned sessions ['a']" in residency.admission_refusal(beside_pin)
    assert (runner.sessions, runner.session_table.is_pinned("a"), runner.kv_cache.num_free_slots) == before
    with pytest.raises(ValueError, match="pinned sessions"):  # the batch entry point asks it before anything moves
        engine.generate_batch([DiffusionRequest("r", extra_args={"session_id": sid}, inputs={"commit": False})
                               for sid in beside_pin])
    assert (runner.sessions, runner.session_table.is_pinned("a"), runner.kv_cache.num_free_slots) == before
    runner.session_table.unpin("a")
    engine.close()


_MUTATORS = frozenset({"pop", "popitem", "clear", "update", "setdefault", "append", "extend", "add", "discard",
                       "remove", "insert"})


def _foreign_private_writes(source: str) -> list[str]:
    """Each write of another object's private field (``x._f = ...``, ``x._f[k] = ...``, ``del``, ``x._f.pop()``)."""
    def foreign(node: ast.expr) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))

    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found.extend(ast.unparse(target) for target in targets if foreign(target))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                and foreign(node.func.value)):
            found.append(ast.unparse(node.func))
    return found


def test_the_checker_of_private_writes_bites():
    # What the runner, the batch and the batch runner did before the state wrote its own fields.
    assert _foreign_private_writes("state._bound = True") == ["state._bound"]
    assert _foreign_private_writes("state._pending[b] = p") == ["state._pending[b]"]
    assert _foreign_private_writes("del state._pending[b]") == ["state._pending[b]"]
    assert _foreign_private_writes("state._pending.pop(b, None)") == ["state._pending.pop"]
    assert _foreign_private_writes("self._x = 1\nself._d[k] = 2\nstate._set_bound(True)") == []


def test_nothing_outside_the_state_module_writes_a_state_s_private_fields():
    """The runtime (and the rollouts) write only their own objects' private fields; a state's are written by
    ``runtime/_state.py`` alone (the residency, the gate, the batch and the batch runner ask it)."""
    paths = sorted(RUNTIME.glob("*.py")) + [PACKAGE / "rollout.py"]
    offenders = {path.name: writes for path in paths if path.name != "_state.py"
                 for writes in [_foreign_private_writes(path.read_text(encoding="utf-8"))] if writes}
    assert offenders == {}


def _state_private_uses(source: str) -> list[str]:
    """Each use (read, call or write) of a state handle's private member: ``state._value``, ``states[i]._x``,
    ``table.get(sid)._pending``: a receiver named as a state (or a session table's lookup), never ``self``."""
    def names_a_state(node: ast.expr) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Name):
            return "state" in node.id.lower()
        if isinstance(node, ast.Attribute):
            return "state" in node.attr.lower()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr in ("get", "remove", "touch") and "table" in ast.unparse(node.func.value).lower()
        return False

    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and names_a_state(node.value)]


#: The private members of a state the runtime still uses outside ``_state.py``, by module: the slot's lifecycle only.
#: ``_adopt`` (the residency hands a state it made to the runner) and ``_release`` (freeing the slot: the residency's
#: and the cache's release path, which a pipeline must not reach as ``close()`` is refused for a runner's state) and
#: ``_set_bound`` (the gate binds a state to the one invocation running). Commits, rollouts and the batch's prepare go
#: through the commit transaction (``plan_commits`` / ``plan_rollout`` -> ``dispatch_commit`` -> ``publish_commit``).
#: A ceiling: a module may drop a name, never add one; a module not named here uses none.
STATE_PRIVATE_USES_ALLOWED = {
    "_gate.py": {"_set_bound"},
    "_kv_cache.py": {"_release"},
    "_residency.py": {"_adopt", "_release"},
}


def test_the_checker_of_state_private_uses_bites():
    # What the batch runner, the runner and the residency did before the public checkpoint / rollback pair.
    assert _state_private_uses("before = [state._saved() for state in states]") == ["state._saved"]
    assert _state_private_uses("state._roll_back(saved)") == ["state._roll_back"]
    assert _state_private_uses("if self._table.get(source_id)._pending:\n    pass") == [
        "self._table.get(source_id)._pending"]
    assert _state_private_uses("record = copy_out(sid, states[sid]._value)") == ["states[sid]._value"]
    assert _state_private_uses("self._states[sid]._release()") == ["self._states[sid]._release"]
    # Its own fields, public members and other objects' private members are not a state's private members.
    assert _state_private_uses("self._value = v\nstate.checkpoint()\nbatch._set_bound(True)\nrunner._gate") == []


def test_outside_the_state_module_only_the_named_private_members_of_a_state_are_used():
    """No runtime module (nor the rollouts) reads, calls or writes a state's private members beyond
    :data:`STATE_PRIVATE_USES_ALLOWED`; the batch runner rolls a failed batch back with the public pair."""
    paths = sorted(RUNTIME.glob("*.py")) + [PACKAGE / "rollout.py"]
    used = {path.name: {use.rsplit(".", 1)[1] for use in _state_private_uses(path.read_text(encoding="utf-8"))}
            for path in paths if path.name != "_state.py"}
    beyond = {name: sorted(names - STATE_PRIVATE_USES_ALLOWED.get(name, set()))
              for name, names in used.items() if names - STATE_PRIVATE_USES_ALLOWED.get(name, set())}
    assert beyond == {}
    assert used["_runner.py"] == used["_batch_runner.py"] == used["_batch.py"] == used["rollout.py"] == set()


def test_checkpoint_and_rollback_reinstall_the_value_and_the_pending_contexts():
    cache = make_cache(SHARED)
    state = cache.create_state("s")
    commit(state, "positive", seed=7)
    state.get_kv_caches("negative", seq_len=2 * T, commit_current=False)  # a pending probe: snapshot() refuses
    checkpoint = state.checkpoint()
    assert checkpoint.session_id == "s" and checkpoint.pending_branches == ("negative",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.value = None  # type: ignore[misc]
    state.discard_paged_context("negative")
    commit(state, "positive", seed=8)
    assert state.checkpoint() != checkpoint  # the checkpoint did not follow the state
    state.rollback(checkpoint)
    assert state.checkpoint() == checkpoint and state.adapter("positive").committed_frames == 2
    assert state.has_pending_context("negative")
    state.discard_paged_context("negative")
    # Refused, changing nothing: another session's checkpoint, a value of the wrong type, a closed state.
    other = cache.create_state("t")
    before = state.checkpoint()
    with pytest.raises(ValueError, match="checkpoint of session 't' cannot roll back session 's'"):
        state.rollback(other.checkpoint())
    with pytest.raises(TypeError, match="StateCheckpoint"):
        state.rollback(state.snapshot())
    assert state.checkpoint() == before
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        other.checkpoint()
    with pytest.raises(RuntimeError, match="closed"):
        other.rollback(before)


def test_a_checkpoint_of_another_slot_of_the_same_session_is_refused():
    cache = make_cache(capacity=2)
    blocker = cache.create_state("blocker")
    first = cache.create_state("s")
    checkpoint = first.checkpoint()
    first.close()
    blocker.close()
    again = cache.create_state("s")  # the lowest free slot: not the one the checkpoint names
    assert again.slot != checkpoint.value.slot
    with pytest.raises(ValueError, match="was taken in slot"):
        again.rollback(checkpoint)


def test_fork_and_offload_refusals_are_pure_and_name_the_exception_the_call_raises():
    """``Residency.fork_refusal`` / ``offload_refusal`` read only; the entry points raise exactly what they name."""
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(dtype="float32", available_memory_bytes=10**7,
                                                                 gpu_memory_fraction=1.0))
    runner = engine.runner
    residency = runner._residency
    for sid in ("a", "b"):
        engine.generate(DiffusionRequest("r", extra_args={"session_id": sid}, inputs={"commit": False}))
    while runner.kv_cache.num_free_slots:  # a full engine without host offload: a fork has no slot
        engine.generate(DiffusionRequest("r", extra_args={"session_id": f"f{runner.kv_cache.num_free_slots}"},
                                         inputs={"commit": False}))
    before = (runner.sessions, runner.offloaded_sessions, runner.kv_cache.num_free_slots,
              dict(residency.stepwise_started))
    cases = {
        ("fork", "ghost", "x"): (KeyError, "'ghost' is neither resident nor offloaded"),
        ("fork", "a", "b"): (ValueError, "id 'b' is taken; a fork needs a new id"),
        ("fork", "a", "a"): (ValueError, "id 'a' is taken"),
        ("fork", "a", "x"): (RuntimeError, "free slot(s) needed"),
        ("offload", "a", None): (RuntimeError, "host offload is off"),
    }
    for (call, source, new), (error, words) in cases.items():
        refusal = residency.fork_refusal(source, new) if call == "fork" else residency.offload_refusal(source)
        assert refusal is not None and refusal.error is error and words in refusal.message, (call, source, new)
        assert type(refusal.exception()) is error and refusal.message in str(refusal.exception())
        with pytest.raises(error) as raised:
            runner.fork_session(source, new) if call == "fork" else runner.offload_session(source)
        assert refusal.message in str(raised.value)
    residency.stepwise_started["a"] = 0.0  # a stepwise chunk in flight: the source cannot fork
    assert residency.fork_refusal("a", "x").message.endswith("has a block in flight; fork it between blocks")
    del residency.stepwise_started["a"]
    assert (runner.sessions, runner.offloaded_sessions, runner.kv_cache.num_free_slots,
            dict(residency.stepwise_started)) == before
    engine.close_session("b")  # one free slot: the fork is no longer refused
    assert residency.fork_refusal("a", "x") is None and residency.fork_victims("a") == []
    engine.close()
