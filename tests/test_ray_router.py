"""``ARDiffusionRouter`` over Ray actors (``RayReplica`` / ``RayEngineProxy`` / ``ray_replicas``).

A local Ray cluster on 2 CPUs runs two actors, each with a small engine of session capacity
2 (single-threaded JAX on CPU). Routing spreads new sessions and sticks; a session's outputs
equal the same session run alone on a local engine; one id never lives on two actors; an
actor's LRU eviction releases the evicted id's placement, and it starts fresh; the engine's
exceptions and session events cross the actor boundary; closing reaches every actor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray replicas need the ray package (the [ray] extra)")

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig  # noqa: E402
from ardiff_jax import SessionEvent, StepSchedulerOutput  # noqa: E402
from ardiff_jax.runtime._ray import EngineReplica, RayEngineProxy, ray_replica_class, ray_replicas  # noqa: E402
from ardiff_jax.runtime._router import ARDiffusionRouter  # noqa: E402
from runner_pipelines import RecordingPipeline, StepPipeline  # noqa: E402

F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)
#: The actors import this module (the engine factory lives here) and run JAX on one thread each.
ACTOR_ENV = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent), "JAX_PLATFORMS": "cpu",
                          "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}}


def small_engine() -> ARDiffusionEngine:
    """Runs in the actor: session capacity 2."""
    return ARDiffusionEngine(RecordingPipeline(), EngineConfig(**F32))


def request(session_id, seed, **inputs):
    return DiffusionRequest(f"r-{session_id}-{seed}", extra_args={"session_id": session_id},
                            inputs={"seed": seed, **inputs})


def alone(requests) -> list[np.ndarray]:
    with small_engine() as engine:
        return [np.asarray(engine.generate(r)) for r in requests]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def proxies(cluster):
    return ray_replicas(small_engine, 2, num_cpus=1, runtime_env=ACTOR_ENV)


@pytest.fixture
def router(proxies):
    router = ARDiffusionRouter(proxies)
    yield router
    for proxy in proxies:  # the actors outlive the test: leave them empty
        for session_id in proxy.sessions:
            proxy.close_session(session_id)


def seen_by(proxy) -> list[str]:
    """Session ids in the events of ``proxy``'s engine from now on."""
    seen: list[str] = []
    proxy.add_session_listener(lambda event: seen.append(event.session_id))
    return seen


def test_sessions_spread_over_the_actors_and_stick(router, proxies):
    for seed, session_id in enumerate("abcd"):
        out = router.generate(request(session_id, seed))
        assert isinstance(out, np.ndarray)  # converted in the actor
    assert [router.replica_of(s) for s in "abcd"] == [0, 1, 0, 1]
    on_one = seen_by(proxies[1])
    for seed in range(3):
        router.generate(request("a", 10 + seed))
    assert router.replica_of("a") == 0 and on_one == []
    assert proxies[0].sessions == ("c", "a") and proxies[1].sessions == ("b", "d")
    assert router.session_capacity == 4 and router.memory_plan.session_capacity == 4


def test_a_session_on_an_actor_equals_the_session_run_alone(router):
    plan = [("a", 0), ("b", 1), ("a", 2), ("b", 3), ("a", 4)]
    outputs: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for session_id, seed in plan:
        outputs[session_id].append(router.generate(request(session_id, seed)))
    for session_id, got in outputs.items():
        expected = alone([request(s, seed) for s, seed in plan if s == session_id])
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_fork_lives_on_its_sources_actor_and_continues_as_the_source_would(router, proxies):
    router.generate(request("a", 0))
    router.generate(request("b", 1))
    router.fork_session("b", "b2")
    assert router.replica_of("b2") == router.replica_of("b") == 1 and set(proxies[1].sessions) == {"b", "b2"}
    got = router.generate(request("b2", 5))
    np.testing.assert_array_equal(got, alone([request("b", 1), request("b", 5)])[-1])
    with pytest.raises(ValueError, match="taken"):
        router.fork_session("a", "b2")
    with pytest.raises(KeyError, match="neither resident nor offloaded"):
        router.fork_session("nobody", "x")
    assert router.replica_of("x") is None


def test_one_session_id_never_lives_on_two_actors(router, proxies, tmp_path):
    router.generate(request("first", 0))
    router.generate(request("s", 1))
    assert router.replica_of("s") == 1
    on_zero = seen_by(proxies[0])
    with pytest.raises(ValueError, match="'s' is placed on replica 1, not 0"):
        router.load_session(tmp_path / "anything", "s", replica=0)
    router.generate(DiffusionRequest("t", extra_args={"session_id": "s", "reset": True}, inputs={"seed": 2}))
    router.reset_session("s")
    router.generate(request("s", 3))
    router.close_session("s")
    assert on_zero == [] and router.replica_of("s") is None
    assert "s" not in proxies[0].sessions + proxies[1].sessions


def test_lru_eviction_inside_one_actor_releases_the_id_and_it_starts_fresh(router, proxies):
    for seed, session_id in enumerate("abcde"):
        router.generate(request(session_id, seed))
    assert proxies[0].sessions == ("c", "e")  # a was evicted by e
    assert router.replica_of("a") is None and router.replica_loads == (2, 2)  # the release event came back
    out = router.generate(request("a", 9))
    np.testing.assert_array_equal(out, alone([request("a", 9)])[0])  # a new session, as after an eviction
    assert proxies[0].sessions == ("e", "a") and proxies[1].sessions == ("b", "d")


def test_engine_errors_and_session_events_cross_the_actor_boundary(router, proxies):
    router.generate(request("a", 0))
    router.generate(request("b", 1))
    with pytest.raises(RuntimeError, match="model failed after committing") as raised:
        router.generate(request("b", 2, fail="after_commit"))
    assert any("raised in the Ray replica" in note for note in raised.value.__notes__)
    assert router.replica_of("b") is None and proxies[1].sessions == ()  # the release event came back
    with pytest.raises(TypeError, match="save_session needs a pipeline that implements"):
        router.save_session("a", "/nonexistent/a")
    assert router.replica_of("a") == 0 and proxies[0].sessions == ("a",)


def test_closing_reaches_every_actor(cluster):
    pairs = ray_replicas(small_engine, 2, num_cpus=0, runtime_env=ACTOR_ENV)  # beside the shared pair
    router = ARDiffusionRouter(pairs)
    released: list[tuple[str, str]] = []
    router.add_session_listener(lambda event: event.kind == "released" and released.append(
        (event.session_id, event.reason)))
    for seed, session_id in enumerate("abcd"):
        router.generate(request(session_id, seed))
    router.close_session("b")  # on actor 1
    assert released == [("b", "close")] and pairs[1].sessions == ("d",)
    router.close()
    assert sorted(released) == [("a", "close"), ("b", "close"), ("c", "close"), ("d", "close")]
    for proxy in pairs:  # the proxies owned their actors: gone (ray.kill is asynchronous)
        assert _dies(proxy.actor), "the proxies from ray_replicas own their actors and kill them on close"
    with pytest.raises(TypeError, match="RayReplica actor handles"):
        RayEngineProxy(object())


class _RefusingPipeline(RecordingPipeline):
    """A host whose forward refuses ``inputs["refuse"]`` (the other host of the test replica runs it)."""

    def forward(self, request):
        if request.inputs.get("refuse"):
            raise ValueError("this host refuses the request")
        return super().forward(request)


def refusing_engine() -> ARDiffusionEngine:
    return ARDiffusionEngine(_RefusingPipeline(), EngineConfig(**F32))


def test_a_replica_over_several_actors_runs_every_call_on_each_and_answers_with_process_0(cluster):
    actor_class = ray_replica_class().options(num_cpus=0, runtime_env=ACTOR_ENV)
    actors = [actor_class.remote(small_engine), actor_class.remote(refusing_engine)]
    replica = RayEngineProxy(actors, owns_actor=True)
    try:
        assert replica.actor is actors[0] and replica.actors == tuple(actors)
        out = replica.generate(request("fan", 0))
        np.testing.assert_array_equal(out, alone([request("fan", 0)])[0])
        for actor in actors:  # both hosts ran it
            assert ray.get(actor.read.remote("sessions")) == ("fan",)
        with pytest.raises(RuntimeError, match="disagree on generate.*1: ValueError"):
            replica.generate(request("fan", 1, refuse=True))
        replica.close_session("fan")
        assert [ray.get(actor.read.remote("sessions")) for actor in actors] == [(), ()]
    finally:
        replica.close()
    for actor in actors:
        assert _dies(actor), "the proxy that owns its actors kills them on close"


def _dies(actor, within_s: float = 30.0) -> bool:
    """Whether calls to ``actor`` start failing with RayActorError within ``within_s`` (ray.kill is asynchronous)."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


class _Unpicklable(Exception):
    def __init__(self):
        super().__init__("holds a lock")
        self.lock = __import__("threading").Lock()


def test_the_actor_body_converts_outputs_and_carries_errors_and_events():
    """In this process (no actor): what a RayReplica answers."""
    def step_engine():
        return ARDiffusionEngine(StepPipeline(), EngineConfig(**F32, step_execution=True))

    body = EngineReplica(step_engine)
    try:
        reply = body.call("step", (StepSchedulerOutput(scheduled=(DiffusionRequest("x"),)),))
        assert reply.error is None and isinstance(reply.value.output, np.ndarray)  # a StepResult's jax output
        assert [(e.kind, e.session_id) for e in reply.events] == [("created", "x")]
        released = body.call("step", (StepSchedulerOutput(finished_req_ids={"x"}),), False)
        assert released == (None, None, (SessionEvent("released", "x", "close"),))
        failed = body.call("reset_session", (" ",))
        assert isinstance(failed.error, ValueError) and "raised in the Ray replica" in failed.error.__notes__[0]
        with pytest.raises(ValueError, match="not 'runner'"):
            body.call("runner", ())
        with pytest.raises(ValueError, match="not 'pipeline'"):
            body.read("pipeline")
        body._engine.reset_session = lambda session_id: (_ for _ in ()).throw(_Unpicklable())
        lost = body.call("reset_session", ("x",)).error
        assert type(lost) is RuntimeError and "_Unpicklable: holds a lock" in str(lost)
    finally:
        body.call("close", ())
    closed = []

    class NotAnEngine:
        def close(self):
            closed.append(True)

    with pytest.raises(TypeError, match="must build an ARDiffusionEngine, got NotAnEngine"):
        EngineReplica(NotAnEngine)
    assert closed == [True]


def test_importing_the_ray_module_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, ardiff_jax, ardiff_jax.runtime._ray, ardiff_jax.runtime._router; print('ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
