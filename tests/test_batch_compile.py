"""When the batched programs compile: ``EngineConfig.batch_compile`` = eager, background or lazy.

The no-recompile guarantee per mode: eager compiles every bucket at load and nothing after;
background compiles them on its own thread and never on a request's (a batch whose bucket is
not built yet runs through a built larger one, or one by one), and after
``wait_for_batch_compilation()`` nothing compiles; lazy compiles each bucket on its first batch,
then never again.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import compiles_by_thread

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, SpriteWorldPipelineConfig, dit_preset
from ardiff_jax.runtime import ARDiffusionModelRunner
from ardiff_jax.runtime._batch_runner import BucketCompiler, Warmup

CONFIG = dict(dtype="float32", available_memory_bytes=1 << 30, gpu_memory_fraction=1.0)
OBSERVATIONS = [SpriteWorld(seed=seed).reset() for seed in range(4)]
PLAYERS = ("a", "b")


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules, mode: str, capacity: int = 4) -> tuple[SpriteWorldPipeline, ARDiffusionEngine]:
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=capacity),
                                   modules=modules)
    return pipeline, ARDiffusionEngine(pipeline, EngineConfig(**CONFIG, batch_compile=mode))


def _requests(tick: int, sessions=("a", "b", "c")) -> list[DiffusionRequest]:
    requests = []
    for index, sid in enumerate(sessions):
        inputs = {"actions": np.array([(tick + index) % 5])}
        if tick == 0:
            inputs["observation"] = OBSERVATIONS[index]
        requests.append(DiffusionRequest(f"{sid}-{tick}", extra_args={"session_id": sid}, inputs=inputs))
    return requests


def _frames(outputs) -> np.ndarray:
    return np.stack([np.asarray(output.latents) for output in outputs])


def test_the_mode_is_checked_and_eager_is_the_default():
    assert EngineConfig().batch_compile == "eager"
    for bad in ("later", "", None, 1):
        with pytest.raises(ValueError, match="batch_compile must be one of eager, background, lazy"):
            EngineConfig(batch_compile=bad)


def test_eager_compiles_every_bucket_at_load_and_nothing_after(modules):
    pipeline, engine = _engine(modules, "eager")
    try:
        assert engine.runner.compiled_batch_buckets == engine.batch_buckets == (2, 4)
        assert engine.runner.wait_for_batch_compilation(0)
        with compiles_by_thread() as compiles:
            for tick in range(2):
                engine.generate_batch(_requests(tick))
            engine.generate_batch(_requests(2, ("a", "b")))
        assert compiles == []
    finally:
        engine.close()


def test_lazy_compiles_each_bucket_on_its_first_batch_only(modules):
    pipeline, engine = _engine(modules, "lazy")
    try:
        assert engine.runner.compiled_batch_buckets == ()
        engine.generate_batch(_requests(0))  # bucket 4: compiled here
        assert engine.runner.compiled_batch_buckets == (4,)
        with compiles_by_thread() as compiles:
            engine.generate_batch(_requests(1))
        assert compiles == []
    finally:
        engine.close()


def _spy_batches(monkeypatch) -> list[tuple[int, int]]:
    """``(id(pipeline), batch size)`` of every ``forward_batch`` call, the twin's included."""
    calls: list[tuple[int, int]] = []
    original = SpriteWorldPipeline.forward_batch

    def spy(self, requests):
        calls.append((id(self), len(requests)))
        return original(self, requests)

    monkeypatch.setattr(SpriteWorldPipeline, "forward_batch", spy)
    return calls


def _spy_runners(monkeypatch) -> list[ARDiffusionModelRunner]:
    """Every ``ARDiffusionModelRunner`` built from now on, in order."""
    runners: list[ARDiffusionModelRunner] = []
    original_init = ARDiffusionModelRunner.__init__

    def remember(self, *args, **kwargs):
        runners.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(ARDiffusionModelRunner, "__init__", remember)
    return runners


def _spy_compilers(monkeypatch, before_bucket=lambda compiler, bucket: None) -> list[tuple[BucketCompiler, int]]:
    """``(compiler, bucket)`` of every bucket a twin's ``BucketCompiler`` starts; ``before_bucket`` runs first."""
    started: list[tuple[BucketCompiler, int]] = []
    original = BucketCompiler._warm_up_bucket

    def spy(self, bucket):
        started.append((self, bucket))
        before_bucket(self, bucket)
        return original(self, bucket)

    monkeypatch.setattr(BucketCompiler, "_warm_up_bucket", spy)
    return started


def test_background_compiles_on_a_twin_while_requests_run_and_then_batches_without_compiling(modules, monkeypatch):
    reference_pipeline, reference = _engine(modules, "eager")  # built first: the runners below are watched
    inside, gate = threading.Event(), threading.Event()

    def held(compiler, bucket):  # the twin's first bucket, on the compiler thread
        inside.set()
        gate.wait(60)

    started = _spy_compilers(monkeypatch, held)
    calls = _spy_batches(monkeypatch)
    runners = _spy_runners(monkeypatch)
    pipeline, engine = _engine(modules, "background")
    events = []
    engine.runner.add_session_listener(events.append)
    try:
        assert inside.wait(60)  # the twin is compiling its first bucket now, and holds no lock of ours
        assert engine.runner.compiled_batch_buckets == ()
        me = threading.get_ident()
        with compiles_by_thread() as compiles:
            before = engine.generate_batch(_requests(0, PLAYERS))  # no bucket built: one by one, on built programs
        assert [name for thread, name in compiles if thread == me] == []
        assert [size for owner, size in calls if owner == id(pipeline)] == []
        expected = reference.generate_batch(_requests(0, PLAYERS))
        np.testing.assert_allclose(_frames(before), _frames(expected), atol=1e-5)

        gate.set()
        assert engine.runner.wait_for_batch_compilation(120)
        assert engine.runner.compiled_batch_buckets == (2, 4)
        assert not any(event.session_id.startswith("__ardiffusion_warmup__") for event in events)
        assert sorted(engine.runner.session_table.lru_order) == ["a", "b"]  # the twin's sessions were its own
        calls.clear()
        with compiles_by_thread() as compiles:
            after = engine.generate_batch(_requests(1, PLAYERS))
        assert compiles == [] and calls == [(id(pipeline), 2)]  # one batched forward, built on the twin
        np.testing.assert_allclose(_frames(after), _frames(reference.generate_batch(_requests(1, PLAYERS))), atol=1e-5)
        assert runners == [engine.runner]  # the twin is a BucketCompiler, no second runner
        assert [bucket for _, bucket in started] == [2, 4]
    finally:
        gate.set()
        engine.close()
        reference.close()


def test_the_twin_is_a_bucket_compiler_whose_pools_and_sessions_are_freed_once_it_compiled(modules, monkeypatch):
    """The compile twin is no second runner: a gate, pools of the serving layout (the plan's bytes
    again, while it compiles) and a batch runner, with two warmup sessions per bucket; once the
    compiler thread is done its pools are freed and the twin pipeline holds no session (issue 48, item 1)."""
    held: list[tuple[int, tuple[str, ...], int]] = []  # per bucket: live pool bytes, open sessions, twin's sessions

    def census(compiler, bucket):
        held.append((compiler.kv_cache.memory_report()["pool_bytes"], compiler.kv_cache.session_ids,
                     len(compiler._gate.pipeline._sessions)))

    runners = _spy_runners(monkeypatch)
    calls = _spy_batches(monkeypatch)
    started = _spy_compilers(monkeypatch, census)
    pipeline, engine = _engine(modules, "background")
    try:
        assert engine.runner.wait_for_batch_compilation(120)
        assert engine.runner.compiled_batch_buckets == (2, 4)
        assert runners == [engine.runner]
        (compiler, _), (same, _) = started
        assert compiler is same and compiler._gate.pipeline is not pipeline
        assert compiler.kv_cache.layout == engine.runner.kv_cache.layout
        pool_bytes = engine.runner.kv_cache.layout.pool_bytes
        assert held == [(pool_bytes, (), 0), (pool_bytes, (), 0)]  # each bucket starts from no session
        assert {size for owner, size in calls if owner == id(compiler._gate.pipeline)} == {2}
        assert compiler.kv_cache.closed and compiler.kv_cache.memory_report()["pool_bytes"] == 0
        assert compiler.kv_cache.session_ids == () and compiler._gate.pipeline._sessions == {}
        # Two sessions padded to a bucket built the program a full bucket, and a partly filled one, run.
        with compiles_by_thread() as compiles:
            engine.generate_batch(_requests(0, ("a", "b", "c", "d")))
            engine.generate_batch(_requests(1, ("a", "b", "c")))
            engine.generate_batch(_requests(2, ("a", "b")))
        assert compiles == []
    finally:
        engine.close()


def test_a_twin_of_another_layout_is_freed_and_the_buckets_compile_under_the_lock(modules, monkeypatch, caplog):
    """A twin whose pools plan out in another layout builds nothing: its pools go, and the thread
    compiles under the runner lock instead (two warmup sessions of the serving pipeline)."""
    compilers: list[BucketCompiler] = []
    original_init = BucketCompiler.__init__

    def other_layout(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        compilers.append(self)
        self.fits = False

    monkeypatch.setattr(BucketCompiler, "__init__", other_layout)
    calls = _spy_batches(monkeypatch)
    pipeline, engine = _engine(modules, "background")
    try:
        assert engine.runner.wait_for_batch_compilation(120)
        assert engine.runner.compiled_batch_buckets == (2, 4)
        assert "twin pipeline planned another layout" in caplog.text
        assert len(compilers) == 1 and compilers[0].kv_cache.closed
        assert {owner for owner, _ in calls} == {id(pipeline)}  # every bucket built on the serving pipeline
    finally:
        engine.close()


def test_background_without_a_twin_compiles_under_the_lock_while_two_slots_are_free(modules, monkeypatch):
    def no_twin(self):
        raise MemoryError("no room for a second set of pools")

    monkeypatch.setattr(SpriteWorldPipeline, "ar_diffusion_compile_twin", no_twin)
    calls = _spy_batches(monkeypatch)
    pipeline, engine = _engine(modules, "background")
    try:
        assert engine.runner.wait_for_batch_compilation(120)
        assert engine.runner.compiled_batch_buckets == (2, 4)
        assert {size for _, size in calls} == {2}  # two warmup sessions, padded to each bucket
        assert engine.runner.session_table.lru_order == ()
        calls.clear()
        engine.generate_batch(_requests(0))
        with compiles_by_thread() as compiles:
            engine.generate_batch(_requests(1))
        assert compiles == [] and calls == [(id(pipeline), 3), (id(pipeline), 3)]
    finally:
        engine.close()


def test_background_routes_a_batch_through_a_built_larger_bucket(modules, monkeypatch):
    """With only bucket 4 built, a batch of two runs padded in it (one batched call), compiling nothing."""
    monkeypatch.setattr(Warmup, "_compile_in_background", lambda self: None)
    pipeline, engine = _engine(modules, "background")
    try:
        engine.generate_batch(_requests(0, PLAYERS))  # one by one: nothing built
        runner = engine.runner
        runner._batches.forced_bucket = 4  # what the compiler thread does for bucket 4 alone
        runner._warmup.warm_up_bucket(4, num_sessions=2)
        runner._batches.forced_bucket = None
        runner._batches.compiled |= {4}
        calls = []
        forward_batch = pipeline.forward_batch
        monkeypatch.setattr(pipeline, "forward_batch", lambda requests: calls.append(len(requests))
                            or forward_batch(requests))
        with compiles_by_thread() as compiles:
            engine.generate_batch(_requests(1, PLAYERS))
        assert compiles == [] and calls == [2]
    finally:
        engine.close()


def test_close_stops_the_background_compiler(modules, monkeypatch):
    started = threading.Event()
    _spy_compilers(monkeypatch, lambda compiler, bucket: started.set())
    pipeline, engine = _engine(modules, "background")
    assert started.wait(60)
    engine.close()
    assert engine.runner.wait_for_batch_compilation(60)


def test_close_stops_the_twin_between_buckets_waits_for_it_and_frees_its_pools(modules, monkeypatch):
    """close() during the twin's first bucket: the twin builds no other bucket, and once close()
    returns the compiler thread is gone and the twin's pools are freed (issue 43, item 4)."""
    inside = threading.Event()
    runners = _spy_runners(monkeypatch)

    def held(compiler, bucket):  # the twin's first bucket, on the compiler thread
        inside.set()
        runners[0]._warmup._stop.wait(60)  # go on once close() has asked the compiler to stop

    twins = _spy_compilers(monkeypatch, held)
    pipeline, engine = _engine(modules, "background")
    try:
        assert inside.wait(60)
    finally:
        engine.close()
    compiler = engine.runner._warmup.thread
    assert compiler is not None and not compiler.is_alive()  # close() waited for the compiler
    assert [bucket for _, bucket in twins] == [2]  # stopped between buckets: bucket 4 never started
    twin = twins[0][0]
    assert twin.kv_cache.closed and twin._gate.pipeline._sessions == {}  # the second set of pools is freed
    assert engine.runner.compiled_batch_buckets == ()  # a stopped twin's buckets are not adopted


def test_interpreter_exit_during_a_background_compile_is_clean(tmp_path):
    """A process that exits while the compiler thread compiles exits 0, not SIGABRT (issue 43, item 4)."""
    import subprocess
    import sys

    script = tmp_path / "exit_while_compiling.py"
    script.write_text(
        "from ardiff_jax import ARDiffusionEngine, EngineConfig\n"
        "from ardiff_jax.models import SpriteWorldPipeline, SpriteWorldPipelineConfig\n"
        "pipeline = SpriteWorldPipeline('sprite_world', SpriteWorldPipelineConfig(session_capacity=4))\n"
        f"engine = ARDiffusionEngine(pipeline, EngineConfig(**{CONFIG!r}, batch_compile='background'))\n"
        "assert engine.runner._warmup.thread.is_alive()\n"
        "print('exiting while compiling', flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert "exiting while compiling" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Aborted" not in done.stderr and "terminate called" not in done.stderr
