"""``ARDiffusionRouter`` over in-process engines: placement, stickiness, isolation, lifecycle, serving.

* placement: a new session goes to the least loaded replica (ties: lowest index) and every
  later call for it (request, typed tick, stepwise tick, finished id, reset, close, save,
  load) reaches that replica and no other; an LRU-evicted session is forgotten (its replica
  holds nothing of it), as are closed and failed sessions; loads are what the replicas hold;
* isolation: a session's outputs through the router equal the same session run alone;
* bad input raises what the engine raises and changes nothing (placements, loads, hooks);
* the realtime server runs on a router of two engines.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from ardiff_jax import (
    ARDiffusionEngine,
    ARDiffusionTickRequest,
    DiffusionRequest,
    EngineConfig,
    StepSchedulerOutput,
)
from ardiff_jax.runtime import SessionFileError
from ardiff_jax.runtime._router import ARDiffusionRouter, ReplicaAssignments
from runner_pipelines import RecordingPipeline, StepPipeline

F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)


class ExportingPipeline(RecordingPipeline):
    """RecordingPipeline whose model state (a forward count per session) can be saved and loaded."""

    def export_ar_diffusion_session(self, session_id):
        return {"forwards": self.model_state.pop(session_id, 0)}

    def import_ar_diffusion_session(self, session_id, state):
        if not isinstance(state, dict) or set(state) != {"forwards"}:
            raise ValueError(f"not an exported RecordingPipeline state: {state!r}")
        self.model_state[session_id] = int(state["forwards"])


def make_router(n=2, pipeline_cls=RecordingPipeline, **config) -> ARDiffusionRouter:
    return ARDiffusionRouter([ARDiffusionEngine(pipeline_cls(), EngineConfig(**{**F32, **config}))
                              for _ in range(n)])


def request(session_id, seed=0, fail=None, **extra_args):
    """A request of ``session_id`` whose block values come from ``seed`` (``fail``: see runner_pipelines)."""
    inputs = {"seed": seed} if fail is None else {"seed": seed, "fail": fail}
    return DiffusionRequest(f"r-{session_id}-{seed}", extra_args={"session_id": session_id, **extra_args},
                            inputs=inputs)


def seen_by(router, index) -> set[str]:
    """Session ids replica ``index``'s pipeline saw in any call (forward, hooks, binds)."""
    return {entry[1] for entry in router.replicas[index].runner.pipeline.log}


def logs(router) -> list[list]:
    return [list(replica.runner.pipeline.log) for replica in router.replicas]


def alone(requests) -> list[np.ndarray]:
    """The outputs of ``requests`` on a fresh engine of their own."""
    with ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32)) as engine:
        return [np.asarray(engine.generate(r)) for r in requests]


# -- the policy ---------------------------------------------------------------------------------------


def test_assignments_pick_the_least_loaded_replica_lowest_index_first():
    table = ReplicaAssignments(3)
    assert table.least_loaded() == 0
    table.assign("a", 0)
    table.assign("b", 2)
    assert table.least_loaded() == 1 and table.loads == (1, 0, 1)
    table.assign("c", 1)
    assert table.least_loaded() == 0
    with pytest.raises(ValueError, match="'a' is placed on replica 0"):
        table.assign("a", 1)
    assert not table.unassign("a", 2) and table.replica_of("a") == 0  # only its owner forgets it
    assert table.unassign("a", 0) and "a" not in table and table.loads == (0, 1, 1)
    assert table.placed_on(2) == ("b",) and len(table) == 2
    for bad in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="replica"):
            table.check_replica(bad)
    with pytest.raises(ValueError, match="positive integer"):
        ReplicaAssignments(0)


# -- placement and stickiness -------------------------------------------------------------------------


def test_new_sessions_go_to_the_least_loaded_replica_and_stay_there():
    with make_router(3) as router:
        for index, session_id in enumerate("abcd"):
            router.generate(request(session_id, seed=index))
        assert [router.replica_of(s) for s in "abcd"] == [0, 1, 2, 0]
        assert router.replica_loads == (2, 1, 1)
        router.close_session("b")
        assert router.replica_of("b") is None and router.replica_loads == (2, 0, 1)
        router.generate(request("e"))
        assert router.replica_of("e") == 1  # the replica b left
        for seed in range(3):  # stickiness: a keeps going to replica 0 whatever the loads are
            router.generate(request("a", seed=10 + seed))
        assert router.replica_of("a") == 0
        assert "a" in router.replicas[0].sessions
        assert "a" not in seen_by(router, 1) | seen_by(router, 2)
        assert router.replica_loads == (2, 1, 1) and sorted(router.sessions) == ["a", "c", "d", "e"]


def test_a_session_through_the_router_equals_the_session_run_alone():
    plan = [("a", 0), ("b", 1), ("a", 2), ("c", 3), ("b", 4), ("a", 5), ("c", 6)]
    with make_router(2) as router:
        outputs = {s: [] for s, _ in plan}
        for session_id, seed in plan:
            out = router.generate(request(session_id, seed))
            outputs[session_id].append(np.asarray(out))
        assert (router.replica_of("a"), router.replica_of("b"), router.replica_of("c")) == (0, 1, 0)
    for session_id in outputs:
        expected = alone([request(session_id, seed) for s, seed in plan if s == session_id])
        for got, want in zip(outputs[session_id], expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_every_public_path_of_a_session_reaches_only_its_replica(tmp_path):
    with make_router(2, ExportingPipeline) as router:
        router.generate(request("first"))  # replica 0
        router.generate(request("s"))  # replica 1
        tick = ARDiffusionTickRequest("s", "tick-1", 0)
        router.generate(DiffusionRequest("tick-1", extra_args=tick.to_extra_args(), inputs={"seed": 3}))
        # A typed tick is authoritative over a conflicting top-level session id, as in the runner.
        mixed = {**tick.to_extra_args(), "session_id": "first"}
        router.generate(DiffusionRequest("tick-2", extra_args=mixed, inputs={"seed": 4}))
        router.generate(request("s", seed=5, reset=True))
        router.reset_session("s")
        router.generate(request("s", seed=6))
        saved = router.save_session("s", tmp_path / "s")
        with pytest.raises(ValueError, match="placed on replica 1, not 0"):
            router.load_session(saved, replica=0)
        with pytest.raises(ValueError, match="already exists"):  # its own replica refuses the duplicate
            router.load_session(saved)
        assert router.replica_loads == (1, 1)
        router.close_session("s")
        assert "s" in seen_by(router, 1) and "s" not in seen_by(router, 0)
        assert router.replica_of("s") is None and router.sessions == ("first",)
        assert router.replicas[0].runner.pipeline.forward_count == 1  # only "first" ever ran there


def test_stepwise_ticks_route_by_request_id_and_finished_ids_release_on_their_owners():
    def scheduled(request_id, *results):
        return StepSchedulerOutput(scheduled=(DiffusionRequest(request_id, inputs={"results": results}),))

    with make_router(2, StepPipeline, step_execution=True) as router:
        assert router.step(scheduled("x", "none", "none", "output")).finished is False
        assert router.step(scheduled("y", "output")).output is not None
        assert (router.replica_of("x"), router.replica_of("y")) == (0, 1)
        # x's next step on replica 0 carries the finished y; replica 1 gets a tick of its own.
        result = router.step(StepSchedulerOutput(scheduled=(DiffusionRequest("x", inputs={"results": ("none",) * 3}),),
                                                 finished_req_ids={"y", "never-placed"}))
        assert result.output is None and not result.finished
        assert router.replica_of("y") is None and router.replicas[1].sessions == ()
        assert ("close_hook", "y") in router.replicas[1].runner.pipeline.log
        assert "never-placed" not in seen_by(router, 0) | seen_by(router, 1)
        assert router.step(StepSchedulerOutput(finished_req_ids={"x"})) is None
        assert router.replica_of("x") is None and router.sessions == ()
        # A finishing request is forgotten; a scheduled id that is also finished starts again and stays.
        router.step(scheduled("z", "finish"))
        assert router.replica_of("z") is None
        router.step(scheduled("w", "none"))
        router.step(StepSchedulerOutput(scheduled=(DiffusionRequest("w", inputs={"results": ("none",)}),),
                                        finished_req_ids={"w"}))
        assert router.replica_of("w") == 0 and router.sessions == ("w",)
        with pytest.raises(RuntimeError, match="one request at a time, got 2"):
            router.step(StepSchedulerOutput(scheduled=(DiffusionRequest("p"), DiffusionRequest("q"))))
        with pytest.raises(TypeError, match="StepSchedulerOutput"):
            router.step("tick")
        assert router.replica_of("p") is None and router.replica_loads == (1, 0)


def test_close_and_reset_route_to_the_owner_and_close_forgets():
    with make_router(2) as router:
        router.generate(request("a"))
        router.generate(request("b"))
        before = logs(router)
        router.reset_session("b")
        assert router.replica_of("b") == 1 and router.replicas[1].sessions == ()
        assert logs(router)[1][len(before[1]):] == [("reset_hook", "b")] and logs(router)[0] == before[0]
        router.generate(request("b", seed=1))
        assert router.replicas[1].sessions == ("b",)  # re-entered on its replica after the reset
        router.close_session("b")
        assert logs(router)[1][-1] == ("close_hook", "b") and router.replica_of("b") is None
        # Ids the router never placed hold nothing anywhere: reset and close do nothing.
        before = logs(router)
        router.close_session("nobody")
        router.reset_session("nobody")
        router.close_session("b")
        assert logs(router) == before and router.replica_loads == (1, 0)
        # A request that closes its session forgets it too.
        router.generate(request("c", close_session=True))
        assert router.replica_of("c") is None and router.replica_loads == (1, 0)


def test_lru_eviction_inside_a_replica_releases_the_placement():
    with make_router(2) as router:  # capacity 2 each
        for seed, session_id in enumerate("abcde"):
            router.generate(request(session_id, seed))
        assert router.replicas[0].sessions == ("c", "e")  # a was evicted by e
        assert router.replica_of("a") is None and router.replica_loads == (2, 2)  # released: nothing of it is held
        out = router.generate(request("a", seed=7))  # a new session on the least loaded replica (0), evicting c
        assert router.replicas[0].sessions == ("e", "a") and router.replicas[1].sessions == ("b", "d")
        assert "a" not in seen_by(router, 1) and router.replica_of("c") is None
        np.testing.assert_array_equal(np.asarray(out), alone([request("a", seed=7)])[0])
        router.generate(request("f"))
        assert router.replica_of("f") == 0  # loads (2, 2): the lowest index


def test_a_failed_session_is_forgotten_and_a_refused_first_request_places_nothing():
    with make_router(2) as router:
        router.generate(request("a"))
        router.generate(request("b"))
        with pytest.raises(RuntimeError, match="after committing"):
            router.generate(request("b", seed=1, fail="after_commit"))
        assert router.replica_of("b") is None and router.replica_loads == (1, 0)
        with pytest.raises(RuntimeError, match="before touching KV"):
            router.generate(request("new", fail="before"))
        assert router.replica_of("new") is None and router.replica_loads == (1, 0)
        router.generate(request("b", seed=2))
        assert router.replica_of("b") == 1


class _Unlistened:
    """An engine-like replica without session events."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name in ("runner", "add_session_listener"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    sessions = property(lambda self: self._engine.sessions)
    offloaded_sessions = property(lambda self: self._engine.offloaded_sessions)
    session_capacity = property(lambda self: self._engine.session_capacity)
    memory_plan = property(lambda self: self._engine.memory_plan)


def test_a_replica_without_events_keeps_a_failed_session_on_its_replica():
    engines = [ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32)) for _ in range(2)]
    with ARDiffusionRouter([_Unlistened(engine) for engine in engines]) as router:
        router.generate(request("a"))
        router.generate(request("b"))
        with pytest.raises(RuntimeError):
            router.generate(request("b", seed=1, fail="after_commit"))
        assert router.replica_of("b") == 1 and engines[1].sessions == ()
        router.generate(request("b", seed=2))
        assert engines[1].sessions == ("b",) and engines[0].sessions == ("a",)
        # Without events too, a first request that fails leaves no placement behind.
        with pytest.raises(RuntimeError, match="before touching KV"):
            router.generate(request("new", fail="before"))
        assert router.replica_of("new") is None and router.replica_loads == (1, 1)
        with pytest.raises(TypeError, match=r"replicas \[0, 1\] do not report session events"):
            router.add_session_listener(lambda event: None)


def test_bad_input_raises_what_the_engine_raises_and_changes_nothing(tmp_path):
    with make_router(2, ExportingPipeline) as router, \
            ARDiffusionEngine(ExportingPipeline(), EngineConfig(**F32)) as engine:
        router.generate(request("a"))
        router.generate(request("b"))
        before = (logs(router), router.replica_loads, router.sessions, router.replica_of("a"))
        calls = [
            lambda target: target.generate(DiffusionRequest("r", extra_args={"session_id": 5})),
            lambda target: target.generate(DiffusionRequest("r", extra_args={"session_id": " "})),
            lambda target: target.generate(request("a", reset="false")),
            lambda target: target.generate({"session_id": "a"}),
            lambda target: target.reset_session(""),
            lambda target: target.close_session(None),
            lambda target: target.save_session(7, tmp_path / "x"),
            lambda target: target.save_session("nobody", tmp_path / "nobody"),
            lambda target: target.load_session(tmp_path / "missing"),
        ]
        for call in calls:
            with pytest.raises(Exception) as from_engine:
                call(engine)
            with pytest.raises(type(from_engine.value)) as from_router:
                call(router)
            assert str(from_router.value) == str(from_engine.value)
        with pytest.raises(SessionFileError):
            router.load_session(tmp_path / "missing", "fresh")
        with pytest.raises(ValueError, match=r"replica must be an index in \[0, 2\), got 2"):
            router.load_session(tmp_path / "missing", replica=2)
        assert (logs(router), router.replica_loads, router.sessions, router.replica_of("a")) == before
        assert router.replica_of("fresh") is None


def test_save_and_load_route_and_a_new_id_goes_to_the_least_loaded_or_named_replica(tmp_path):
    with make_router(2, ExportingPipeline) as router:
        for seed, session_id in enumerate("abc"):
            router.generate(request(session_id, seed))
        path = router.save_session("b", tmp_path / "b")
        assert router.replica_loads == (2, 1)
        assert router.load_session(path, "b2") == "b2" and router.replica_of("b2") == 1  # least loaded
        assert router.load_session(path, "b3", replica=0) == "b3" and router.replica_of("b3") == 0
        assert router.replicas[0].runner.pipeline.model_state["b3"] == 1  # the saved model state came along
        router.close_session("b")
        assert router.load_session(path) == "b" and router.replica_of("b") == 1  # its saved id, least loaded
        out = router.generate(request("b", seed=9))
        again = router.generate(request("b2", seed=9))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(again))  # both continue the same saved session


def test_aggregate_views_sum_the_replicas():
    with make_router(2, host_offload_bytes=0) as router:
        plan = router.memory_plan
        assert plan.session_capacity == router.session_capacity == 4
        assert plan.host_offload_bytes == 0 and plan.host_session_capacity == 0
        assert plan.replicas == tuple(replica.memory_plan for replica in router.replicas)
        assert router.runner is router and router.offloaded_sessions == ()
        events = []
        router.add_session_listener(events.append)
        router.generate(request("a"))
        router.generate(request("b"))
        assert [(e.kind, e.session_id) for e in events] == [("created", "a"), ("created", "b")]


def test_router_close_closes_every_replica_even_when_one_fails():
    router = make_router(3)
    router.generate(request("a"))
    engines = router.replicas
    engines[1].close = lambda: (_ for _ in ()).throw(RuntimeError("replica 1 failed to close"))
    with pytest.raises(RuntimeError, match="replica 1 failed"):
        router.close()
    assert engines[0].runner.closed and engines[2].runner.closed and router.closed
    assert ("close_hook", "a") in engines[0].runner.pipeline.log and router.replica_loads == (0, 0, 0)
    router.close()  # idempotent
    with pytest.raises(RuntimeError, match="ARDiffusionRouter is closed"):
        router.generate(request("a"))
    del engines[1].close
    engines[1].close()


def test_constructor_refuses_what_is_not_a_set_of_engines():
    engine = ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32))
    try:
        with pytest.raises(ValueError, match="at least one replica"):
            ARDiffusionRouter([])
        with pytest.raises(TypeError, match="replica 1 .*no generate, step"):
            ARDiffusionRouter([engine, object()])
        with pytest.raises(ValueError, match="appears twice"):
            ARDiffusionRouter([engine, engine])
        with pytest.raises(TypeError, match="sequence of engines"):
            ARDiffusionRouter(engine)
    finally:
        engine.close()


def test_from_devices_builds_one_engine_per_device_and_closes_them_when_one_fails(monkeypatch):
    import ardiff_jax.runtime._router as router_module

    device = jax.devices()[0]
    seen = []

    class MeshRecording(RecordingPipeline):
        def shard_ar_diffusion_model(self, mesh):
            self.mesh = mesh

    def factory(item):
        seen.append(item)
        return MeshRecording()

    with ARDiffusionRouter.from_devices(factory, EngineConfig(**F32), [device, device]) as router:
        assert seen == [device, device] and len(router.replicas) == 2
        assert router.replicas[0].runner.pipeline is not router.replicas[1].runner.pipeline
        # A plain device becomes a one-device mesh: the replica's pools live on that device.
        for replica in router.replicas:
            assert list(replica.runner.config.mesh.devices.flat) == [device]
            assert replica.runner.pipeline.mesh is replica.runner.config.mesh
            assert replica.runner.kv_cache.pools.k.devices() == {device}
    built = []

    class Recorded(ARDiffusionEngine):
        def __init__(self, pipeline, config):
            super().__init__(pipeline, config)
            built.append(self)

    monkeypatch.setattr(router_module, "ARDiffusionEngine", Recorded)

    def failing(item):
        if len(built) == 1:
            raise RuntimeError("second pipeline failed")
        return MeshRecording()

    with pytest.raises(RuntimeError, match="second pipeline failed"):
        ARDiffusionRouter.from_devices(failing, EngineConfig(**F32), [device, device])
    assert len(built) == 1 and built[0].runner.closed
    with pytest.raises(TypeError, match="jax devices or jax.sharding.Mesh"):
        ARDiffusionRouter.from_devices(factory, EngineConfig(**F32), ["cpu:0"])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    configs = []

    def recording(pipeline, config):
        configs.append(config)
        return ARDiffusionEngine(pipeline, EngineConfig(**F32))

    monkeypatch.setattr(router_module, "ARDiffusionEngine", recording)
    with ARDiffusionRouter.from_devices(factory, EngineConfig(**F32), [mesh, device]) as router:
        assert configs[0] == EngineConfig(**F32, mesh=mesh) and list(configs[1].mesh.devices.flat) == [device]
        assert seen[-2:] == [mesh, device] and len(router.replicas) == 2


def test_concurrent_callers_never_put_a_session_on_two_replicas():
    with make_router(2) as router:
        violations = []
        for index, replica in enumerate(router.replicas):
            def check(event, index=index):
                if event.kind == "created" and router.replica_of(event.session_id) != index:
                    violations.append((event.session_id, index))
            replica.runner.add_session_listener(check)
        errors = []

        def worker(names):
            try:
                for round_ in range(15):
                    for name in names:
                        router.generate(request(name, seed=round_))
                        if round_ % 4 == 3:
                            router.close_session(name)
            except Exception as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(names,)) for names in (["a", "b"], ["b", "c"], ["c", "a"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [] and violations == []
        residents = [set(replica.sessions) for replica in router.replicas]
        assert not residents[0] & residents[1]
        for index, resident in enumerate(residents):
            assert all(router.replica_of(s) == index for s in resident)


# -- the realtime server on a router -----------------------------------------------------------------


class _Validating(RecordingPipeline):
    """RecordingPipeline whose validator refuses ``inputs["invalid"]`` (before anything runs)."""

    def validate_ar_diffusion_request(self, session_id, request):
        if request.inputs.get("invalid"):
            raise ValueError("invalid request")


def test_generate_batch_runs_each_owner_share_and_equals_each_session_alone():
    from ardiff_jax.runtime import ARDiffusionBatchError

    sent = {}  # session id -> the requests that ran, in order

    def ran(*requests):
        for r in requests:
            sent.setdefault(r.extra_args["session_id"], []).append(r)
        return requests

    with make_router(2, pipeline_cls=_Validating) as router:
        router.generate(*ran(request("a", 0)))
        batch = ran(request("b", 1), request("c", 2), request("a", 3), request("d", 4))
        outputs = dict(zip("bcad", router.generate_batch(list(batch)), strict=True))
        # New sessions spread over the replicas as generate places them, counting the batch's own.
        assert [router.replica_of(s) for s in "abcd"] == [0, 1, 0, 1] and router.replica_loads == (2, 2)
        np.testing.assert_array_equal(np.asarray(outputs["a"]), alone(sent["a"])[-1])
        for sid in "bcd":
            np.testing.assert_array_equal(np.asarray(outputs[sid]), alone(sent[sid])[0])
        # Refused before anything runs anywhere: a bad request on replica 1 stops replica 0's share too.
        before = logs(router)
        bad = DiffusionRequest("bad", extra_args={"session_id": "b"}, inputs={"seed": 9, "invalid": True})
        with pytest.raises(ValueError, match="invalid request"):
            router.generate_batch([request("a", 5), request("e", 6), bad])
        with pytest.raises(ValueError, match="repeated"):
            router.generate_batch([request("a", 7), request("a", 8)])
        assert logs(router) == before and router.replica_of("e") is None and router.replica_loads == (2, 2)
        # A failure releases its own session only; the others' outputs are there.
        with pytest.raises(ARDiffusionBatchError) as raised:
            router.generate_batch([*ran(request("a", 10)), request("b", 11, fail="after_commit"),
                                   *ran(request("c", 12))])
        assert set(raised.value.errors) == {"b"} and raised.value.outputs[1] is None
        assert router.replica_of("b") is None and router.replica_loads == (2, 1)
        np.testing.assert_array_equal(np.asarray(raised.value.outputs[0]), alone(sent["a"])[-1])
        np.testing.assert_array_equal(np.asarray(raised.value.outputs[2]), alone(sent["c"])[-1])
        # A share over its replica's capacity (2) runs as several batches there; a closed session is forgotten.
        more = ran(request("f", 13), request("g", 14), request("h", 15), request("c", 16, close_session=True))
        outputs = router.generate_batch(list(more))
        assert len(outputs) == 4 and router.replica_of("c") is None
        for r, out in zip(more, outputs, strict=True):
            np.testing.assert_array_equal(np.asarray(out), alone(sent[r.extra_args["session_id"]])[-1])


class _ValidatingExporting(ExportingPipeline):
    """ExportingPipeline with a validator: an offloaded session's model state is imported to check its request."""

    def validate_ar_diffusion_request(self, session_id, request):
        if request.inputs.get("invalid"):
            raise ValueError("invalid request")


@pytest.mark.parametrize("sabotage", ["page_write", "import"])
def test_a_failed_restore_in_a_routed_batch_fails_its_session_only(sabotage):
    """A session offloaded on replica 0 cannot be restored: the router's batch runs everyone else's block.

    ``import``: the pipeline refuses its model state already at validation (``validate_batch`` does not refuse
    the batch for it); it is released there and forgotten. ``page_write``: it stays offloaded and placed.
    """
    from ardiff_jax.runtime import ARDiffusionBatchError
    from ardiff_jax.runtime._batch import SessionRestoreError

    sent = {}

    def ran(*requests):
        for r in requests:
            sent.setdefault(r.extra_args["session_id"], []).append(r)
        return requests

    with make_router(2, pipeline_cls=_ValidatingExporting, host_offload_bytes=10**6) as router:
        for seed, sid in enumerate("abcde"):  # a, c, e on replica 0 (capacity 2): a offloaded
            router.generate(*ran(request(sid, seed)))
        assert router.replicas[0].offloaded_sessions == ("a",) and router.replica_loads == (3, 2)
        replica = router.replicas[0]
        if sabotage == "page_write":
            replica.runner.kv_cache.write_slot = lambda slot, pages: (_ for _ in ()).throw(RuntimeError("H2D failed"))
        else:
            replica.runner.pipeline.import_ar_diffusion_session = lambda sid, state: (_ for _ in ()).throw(
                ValueError("corrupt model state"))
        with pytest.raises(ARDiffusionBatchError) as raised:
            router.generate_batch([request("a", 10), *ran(request("b", 11)), *ran(request("c", 12))])
        vars(replica.runner.kv_cache).pop("write_slot", None)
        vars(replica.runner.pipeline).pop("import_ar_diffusion_session", None)
        error = raised.value
        assert list(error.errors) == ["a"] and error.outputs[0] is None
        assert isinstance(error.errors["a"], SessionRestoreError) and "'a' could not be restored" in str(error)
        for position, sid in ((1, "b"), (2, "c")):
            np.testing.assert_array_equal(np.asarray(error.outputs[position]), alone(sent[sid])[-1])
        if sabotage == "page_write":
            # Still offloaded and placed (e made room for its restore and went to the host tier: it stays there).
            assert replica.offloaded_sessions == ("a", "e") and router.replica_of("a") == 0
            out = router.generate(request("a", 13))  # a continues where it was
            np.testing.assert_array_equal(np.asarray(out), alone(sent["a"] + [request("a", 13)])[-1])
        else:
            assert "a" not in replica.sessions + replica.offloaded_sessions and router.replica_of("a") is None
            assert router.replica_loads == (2, 2)


def test_a_close_whose_hook_fails_frees_the_placement_even_without_events():
    engines = [ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32)) for _ in range(2)]
    with ARDiffusionRouter([_Unlistened(engine) for engine in engines]) as router:
        for sid in "abc":
            router.generate(request(sid))
        assert router.replica_loads == (2, 1)
        pipeline = engines[0].runner.pipeline

        def failing_close(sid):
            raise RuntimeError(f"close hook of {sid} failed")

        pipeline.close_ar_diffusion_session = failing_close
        with pytest.raises(RuntimeError, match="close hook of a failed"):
            router.close_session("a")
        del pipeline.close_ar_diffusion_session
        # The engine released a before its hook ran: nothing of it is held, so nothing of it is placed or loaded.
        assert engines[0].sessions == ("c",) and router.replica_of("a") is None and router.replica_loads == (1, 1)
        router.generate(request("d"))  # the newcomer takes the slot a left: nothing is evicted for it
        assert router.replica_of("d") == 0 and engines[0].sessions == ("c", "d") and router.replica_loads == (2, 1)


def test_the_realtime_server_serves_two_sessions_on_two_replicas():
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from ardiff_jax.models import WorldPipeline
    from ardiff_jax.serve import ServedWorld, create_app

    config = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)
    first = WorldPipeline("tiny")
    pipelines = [first, WorldPipeline("tiny", modules=first.modules)]
    with ARDiffusionRouter([ARDiffusionEngine(p, config) for p in pipelines]) as router:
        created: list[list[str]] = [[], []]
        for index, replica in enumerate(router.replicas):
            replica.runner.add_session_listener(
                lambda event, index=index: event.kind == "created" and created[index].append(event.session_id))
        app = create_app(router, world=ServedWorld.for_pipeline(first))
        with TestClient(app) as client, client.websocket_connect("/v1/realtime/video") as one, \
                client.websocket_connect("/v1/realtime/video") as two:
            assert client.get("/healthz").json()["capacity"] == router.session_capacity == 6
            ids = []
            for ws, prompt in ((one, "a red fox"), (two, "a blue car")):
                ws.send_json({"type": "session.start", "prompt": prompt, "format": "jpeg", "num_frames": 4})
                reply = ws.receive_json()
                assert reply["type"] == "video.start", reply
                ids.append(reply["request_id"])
            for ws, request_id in ((one, ids[0]), (two, ids[1])):
                while True:
                    payload = ws.receive_json()
                    if payload["type"] == "video.chunk_metadata":
                        assert payload["request_id"] == request_id
                        assert ws.receive()["bytes"]
                        continue
                    assert payload == {"type": "session.done", "request_id": request_id, "chunks": 2,
                                       "stopped": False}
                    break
            deadline = time.monotonic() + 10
            while (router.sessions or any(router.replica_loads)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert router.sessions == () and router.replica_loads == (0, 0)
            assert "ardiff_sessions_resident 0.0" in client.get("/metrics").text
        # The two players went to the two replicas, and each only there.
        assert sorted(created) == sorted([[ids[0]], [ids[1]]])
