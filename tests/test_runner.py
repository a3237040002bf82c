"""Runner and engine: the reference runner's behaviour in this API, plus the fail-closed guarantees.

The behaviour is specified in ``docs/reference_behaviour.md``, "Runner".
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ardiff_jax import (
    WARMUP_SESSION_ID,
    ARDiffusionControlInput,
    ARDiffusionEngine,
    ARDiffusionModelRunner,
    ARDiffusionTickRequest,
    DiffusionRequest,
    EngineConfig,
    StepSchedulerOutput,
)
from runner_pipelines import CFG, RecordingPipeline, StepPipeline, WarmupPipeline, small_spec

F32 = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)


def make_runner(pipeline=None, **config):
    pipeline = RecordingPipeline() if pipeline is None else pipeline
    return ARDiffusionModelRunner(pipeline, EngineConfig(**{**F32, **config}))


def request(session_id=None, request_id="r", **inputs):
    extra = {}
    for key in ("reset", "close_session"):
        if key in inputs:
            extra[key] = inputs.pop(key)
    if session_id is not None:
        extra["session_id"] = session_id
    return DiffusionRequest(request_id, extra_args=extra, inputs=inputs)


def run_pages(runner, session_id, branch="main"):
    """Host copies of the K and V pages of one session branch's run."""
    state = runner.session_table.get(session_id)
    layout = runner.kv_cache.layout
    base = state._run_base(state.adapter(branch).local_index) if state._bound else (
        (state.slot * runner.kv_cache.spec.num_local_kv_branches + runner.kv_cache.spec.branch(branch).local_index)
        * layout.run_pages)
    pages = slice(base, base + layout.run_pages)
    pools = runner.kv_cache.pools
    return np.asarray(pools.k[:, pages]).copy(), np.asarray(pools.v[:, pages]).copy()


def committed(runner, session_id, branch="main"):
    state = runner.session_table.get(session_id)
    return state._adapters[branch].committed_frames


# -- load ----------------------------------------------------------------------------------------

def test_pipeline_without_capability_is_a_type_error():
    class NotAPipeline:
        def forward(self, request): ...

    with pytest.raises(TypeError, match="SupportsARDiffusionPipeline.*bind_ar_diffusion_state"):
        ARDiffusionModelRunner(NotAPipeline(), EngineConfig(**F32))


def test_load_checks():
    with pytest.raises(ValueError, match="max_num_seqs=1"):
        make_runner(max_num_seqs=2)
    with pytest.raises(ValueError, match="step_execution=True"):
        make_runner(step_execution=True)
    batch = RecordingPipeline()
    batch.supports_request_batch = True
    with pytest.raises(ValueError, match="request-batch"):
        make_runner(batch)
    wrong_spec = RecordingPipeline()
    wrong_spec.ar_diffusion_kv_cache_spec = lambda: {"num_layers": 2}
    with pytest.raises(TypeError, match="ARDiffusionKVCacheSpec"):
        make_runner(wrong_spec)
    assert make_runner(StepPipeline(), step_execution=True).config.step_execution


def test_load_check_order_step_execution_first():
    class NotAPipeline:
        pass

    with pytest.raises(ValueError, match="step_execution=True"):
        ARDiffusionModelRunner(NotAPipeline(), EngineConfig(step_execution=True, **F32))


def test_geometry_state_identity_and_lifecycle_hooks():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    assert runner.kv_cache.spec == small_spec()
    assert runner.session_capacity == 2 and runner.memory_plan.session_capacity == 2
    runner.execute_model(request("world-a", populate="text", value=3.0))
    first = pipeline.states_seen[-1]
    runner.execute_model(request("world-a"))
    assert pipeline.states_seen[-1] is first  # same id -> same state
    assert ("text", "main") in first._value.cross_attention  # populated during the forward
    runner.reset_session("world-a")
    assert ("reset_hook", "world-a") in pipeline.log
    assert runner.sessions == () and first.closed and first._value.cross_attention == {}
    runner.execute_model(request("world-a"))
    assert pipeline.states_seen[-1] is not first
    second = pipeline.states_seen[-1]
    second._bound = True  # peek inside, as the pipeline would during a forward
    assert not second.is_cross_attention_populated("main", "text")
    second._bound = False
    runner.close_session("world-a")
    assert pipeline.log[-1] == ("close_hook", "world-a")
    assert runner.sessions == ()


# -- request selection and ticks ------------------------------------------------------------------

def test_default_session_id():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(DiffusionRequest("r"))
    assert runner.sessions == ("default",)
    # A present but blank id is refused, never coerced to "default" (hardening issue).
    with pytest.raises(ValueError, match="non-blank"):
        runner.execute_model(DiffusionRequest("r", extra_args={"session_id": ""}))
    assert runner.sessions == ("default",)


def test_typed_tick_is_authoritative():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    tick = ARDiffusionTickRequest("world-7", "tick-req-1", 0, applied_event_ids=(1, 2), prompt="a cat",
                                  controls=(ARDiffusionControlInput("camera", "pose", {"yaw": 0.5}),))
    extra = {**tick.to_extra_args(), "session_id": "ignored", "close_session": True}
    req = DiffusionRequest("engine-req-9", extra_args=extra)
    runner.execute_model(req)
    assert runner.sessions == ("world-7",)  # top-level session_id and close_session ignored
    assert ARDiffusionTickRequest.from_extra_args(req.extra_args) == tick
    assert dict(req.extra_args) == extra  # unchanged
    # A tick with close_session closes after the forward.
    closing = ARDiffusionTickRequest("world-7", "tick-req-2", 1, close_session=True)
    runner.execute_model(DiffusionRequest("engine-req-10", extra_args=closing.to_extra_args()))
    assert runner.sessions == () and pipeline.log[-1] == ("close_hook", "world-7")


def test_malformed_tick_rejected_before_binding():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("s"))
    before = run_pages(runner, "s")
    log_len = len(pipeline.log)
    with pytest.raises(ValueError, match="chunk_index"):
        runner.execute_model(DiffusionRequest("r", extra_args={"ar_diffusion_tick": {
            "session_id": "s", "request_id": "x", "chunk_index": -1}}))
    assert len(pipeline.log) == log_len and runner.sessions == ("s",)
    np.testing.assert_array_equal(run_pages(runner, "s")[0], before[0])
    with pytest.raises(TypeError, match="DiffusionRequest"):
        runner.execute_model({"request_id": "r"})


# -- hook order -----------------------------------------------------------------------------------

def test_hook_order_for_reset_and_close_in_one_request():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    events = []
    runner.add_session_listener(lambda event: events.append((event.kind, event.session_id, event.reason)))
    # KV first, then the hook: at each hook the session is no longer resident.
    resident_at_hook = []
    for name in ("reset_ar_diffusion_session", "close_ar_diffusion_session"):
        hook = getattr(pipeline, name)
        setattr(pipeline, name, lambda sid, hook=hook: (resident_at_hook.append(sid in runner.sessions), hook(sid)))
    runner.execute_model(request("s"))
    del pipeline.log[:], events[:]
    runner.execute_model(request("s", reset=True, close_session=True))
    assert pipeline.log == [("reset_hook", "s"), ("bind", "s"), ("forward", "s"), ("unbind", "s"),
                            ("close_hook", "s")]
    assert resident_at_hook == [False, False]
    # Listeners run after the runner's lock is released, in event order.
    assert events == [("released", "s", "reset"), ("created", "s", None), ("released", "s", "close")]


def test_reset_hook_called_for_never_resident_id():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.reset_session("ghost")
    runner.close_session("ghost")
    assert pipeline.log == [("reset_hook", "ghost"), ("close_hook", "ghost")]
    with pytest.raises(ValueError, match="non-blank"):
        runner.close_session("")


# -- interleaving, sink, branches ----------------------------------------------------------------

def test_interleaved_sessions_and_lru_order():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    for sid in ("world-a", "world-b", "world-a"):
        runner.execute_model(request(sid))
    assert committed(runner, "world-a") == 6 and committed(runner, "world-b") == 3
    assert runner.sessions == ("world-b", "world-a")
    a, b = runner.session_table.get("world-a"), runner.session_table.get("world-b")
    assert a._adapters["main"].request_id == "ar::world-a::main"
    assert b._adapters["main"].request_id == "ar::world-b::main"
    assert a.slot != b.slot  # disjoint page runs


def test_sink_survives_eviction():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    for i in range(8):
        runner.execute_model(request("s", frames=1))
    state = runner.session_table.get("s")
    state._bound = True
    caches = state.get_kv_caches("main", seq_len=1, commit_current=False)
    state._bound = False
    assert caches.visible_frames().tolist() == [0, 4, 5, 6, 7]  # + the current frame = 6 visible


def test_two_branches_are_independent():
    pipeline = RecordingPipeline(small_spec(kv_branches=CFG))
    runner = make_runner(pipeline)
    assert runner.kv_cache.spec.num_local_kv_branches == 2
    runner.execute_model(request("s", branch="positive"))
    assert committed(runner, "s", "positive") == 3 and committed(runner, "s", "negative") == 0


# -- LRU and capacity -------------------------------------------------------------------------------

def test_lru_capacity_two_three_ids():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("a", populate="text"))
    evicted_state = pipeline.states_seen[-1]
    slot_a = evicted_state.slot
    runner.execute_model(request("b"))
    assert runner.kv_cache.num_free_slots == 0
    runner.execute_model(request("c"))
    assert runner.sessions == ("b", "c")
    assert ("close_hook", "a") in pipeline.log
    assert evicted_state.closed and evicted_state.cross_attention_bytes == 0  # cross caches gone
    assert runner.session_table.get("c").slot == slot_a  # slot reused
    assert runner.kv_cache.num_free_slots == 0


def test_budget_limited_capacity_one_evicts():
    spec = small_spec(num_layers=1, head_size=1, frames_per_block=3, window_frames=3, sink_frames=3,
                      session_capacity=2, cross_attention=())
    pipeline = RecordingPipeline(spec)
    runner = ARDiffusionModelRunner(pipeline, EngineConfig(dtype="float32", available_memory_bytes=112,
                                                           gpu_memory_fraction=1.0))
    assert runner.session_capacity == 1
    runner.execute_model(request("a"))
    runner.execute_model(request("b"))
    assert runner.sessions == ("b",) and ("close_hook", "a") in pipeline.log


def test_eviction_cleanup_error_is_raised_before_forward():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("a"))
    runner.execute_model(request("b"))

    def broken_close(session_id):
        raise OSError("hook failed")

    pipeline.close_ar_diffusion_session = broken_close
    forwards = pipeline.forward_count
    with pytest.raises(OSError, match="hook failed"):
        runner.execute_model(request("c"))
    assert pipeline.forward_count == forwards  # aborted before the forward
    assert runner.sessions == ("b",)  # a's KV was released first anyway


# -- failure cleanup ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fail", ["before", "after_commit"])
def test_forward_exception_fails_closed(fail):
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("other"))
    runner.execute_model(request("s"))
    other_before = run_pages(runner, "other")
    free_before = runner.kv_cache.num_free_slots
    times_before = len(runner.e2e_times)
    with pytest.raises(RuntimeError, match="model failed"):
        runner.execute_model(request("s", fail=fail))
    assert runner.sessions == ("other",)
    assert pipeline.log[-1] == ("close_hook", "s")
    assert pipeline.current_state is None
    assert runner.kv_cache.num_free_slots == free_before + 1
    assert len(runner.e2e_times) == times_before
    other_after = run_pages(runner, "other")
    np.testing.assert_array_equal(other_after[0], other_before[0])
    np.testing.assert_array_equal(other_after[1], other_before[1])
    runner.execute_model(request("s", frames=1, commit=False))
    assert committed(runner, "s") == 0  # starts empty


def test_bind_error_fails_closed():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    pipeline.bind_error = KeyError("bind broke")
    with pytest.raises(KeyError, match="bind broke"):
        runner.execute_model(request("s"))
    assert runner.sessions == () and pipeline.log[-1] == ("close_hook", "s")


def test_synchronize_failure_fails_closed(monkeypatch):
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)

    def broken_sync():
        raise RuntimeError("device error surfaced at synchronize")

    monkeypatch.setattr(runner.kv_cache, "block_until_ready", broken_sync)
    with pytest.raises(RuntimeError, match="synchronize"):
        runner.execute_model(request("s"))
    assert runner.sessions == () and pipeline.log[-1] == ("close_hook", "s")
    assert runner.e2e_times == ()


def test_failure_cleanup_errors_are_suppressed(caplog):
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)

    def broken_close(session_id):
        raise OSError("close hook failed")

    pipeline.close_ar_diffusion_session = broken_close
    with caplog.at_level(logging.WARNING, logger="ardiff_jax.runtime"):
        with pytest.raises(RuntimeError, match="model failed"):  # the original error, not the hook's
            runner.execute_model(request("s", fail="before"))
    assert "close hook failed" in caplog.text
    assert runner.sessions == ()


def test_retained_state_is_detected_and_refused():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("other"))
    other_before = run_pages(runner, "other")
    with pytest.raises(RuntimeError, match="retained the bound ARDiffusionKVState"):
        runner.execute_model(request("s", fail="retain"))
    assert runner.sessions == ("other",) and pipeline.log[-1] == ("close_hook", "s")
    # The retained handle is dead: any use raises instead of touching KV.
    with pytest.raises(RuntimeError, match="is closed"):
        pipeline.retained.get_kv_caches("main", seq_len=3)
    np.testing.assert_array_equal(run_pages(runner, "other")[0], other_before[0])


def test_state_used_outside_its_invocation_raises():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("s"))
    leaked = pipeline.states_seen[-1]  # a pipeline that kept a reference somewhere else
    with pytest.raises(RuntimeError, match="outside its runner invocation"):
        leaked.get_kv_caches("main", seq_len=3)
    with pytest.raises(RuntimeError, match="outside its runner invocation"):
        leaked.reset()
    assert committed(runner, "s") == 3


def test_lost_pools_fail_closed_and_recover():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("other"))
    with pytest.raises(RuntimeError, match="pools were deleted or donated"):
        runner.execute_model(request("s", fail="delete_pools"))
    assert runner.sessions == ()  # every session's KV was lost with the pools
    assert ("close_hook", "other") in pipeline.log
    runner.execute_model(request("s"))  # fresh pools: the runner keeps serving
    assert committed(runner, "s") == 3


# -- batch and stepwise -------------------------------------------------------------------------------

def test_batch_and_stepwise_rejections():
    runner = make_runner()
    # Batches run now (tests/test_batch.py); a pipeline without SupportsARDiffusionBatch runs them one by one.
    assert not runner.supports_batched_forward
    assert len(runner.execute_model_batch([request("s")])) == 1 and runner.sessions == ("s",)
    with pytest.raises(RuntimeError, match="step execution"):
        runner.execute_stepwise(StepSchedulerOutput((request("s"),)))


def step_runner():
    pipeline = StepPipeline()
    return pipeline, make_runner(pipeline, step_execution=True)


def test_stepwise_bind_keeps_session():
    pipeline, runner = step_runner()
    req = DiffusionRequest("req-1", inputs={"results": ("none", "none", "none", "output")})
    assert runner.execute_stepwise(StepSchedulerOutput((req,))).finished is False
    assert pipeline.bound_during_step == [True]
    assert pipeline.current_state is None
    assert ("bind", "req-1") in pipeline.log
    assert runner.sessions == ("req-1",) and not any(e[0] == "close_hook" for e in pipeline.log)


def test_stepwise_chunk_timing_and_finish():
    pipeline, runner = step_runner()
    req = DiffusionRequest("req-1", inputs={"results": ("none", "none", "none", "output", "none", "finish")})
    step = StepSchedulerOutput((req,))
    for _ in range(3):
        assert runner.execute_stepwise(step).output is None
    assert runner.e2e_times == ()
    assert runner.execute_stepwise(step).output is not None
    assert len(runner.e2e_times) == 1  # one sample per emitted chunk, not per step
    assert committed(runner, "req-1") == 3
    runner.execute_stepwise(step)
    result = runner.execute_stepwise(step)
    assert result.finished and runner.sessions == () and pipeline.log[-1] == ("close_hook", "req-1")
    assert len(runner.e2e_times) == 2


def test_stepwise_error_result_and_exception_release():
    pipeline, runner = step_runner()
    req = DiffusionRequest("req-1", inputs={"results": ("error",)})
    result = runner.execute_stepwise(StepSchedulerOutput((req,)))
    assert result.error and runner.sessions == () and pipeline.log[-1] == ("close_hook", "req-1")
    req2 = DiffusionRequest("req-2", inputs={"results": ("none", "raise")})
    runner.execute_stepwise(StepSchedulerOutput((req2,)))
    first_state = pipeline.states_seen[-1]
    with pytest.raises(RuntimeError, match="step failed"):
        runner.execute_stepwise(StepSchedulerOutput((req2,)))
    assert runner.sessions == () and first_state.closed
    pipeline.step_calls["req-2"] = 0
    runner.execute_stepwise(StepSchedulerOutput((req2,)))
    assert pipeline.states_seen[-1] is not first_state


def test_stepwise_abort_and_one_request_at_a_time():
    pipeline, runner = step_runner()
    req = DiffusionRequest("req-1", inputs={"results": ("none",) * 5})
    runner.execute_stepwise(StepSchedulerOutput((req,)))
    assert runner.execute_stepwise(StepSchedulerOutput((), finished_req_ids=frozenset({"req-1"}))) is None
    assert runner.sessions == () and pipeline.log[-1] == ("close_hook", "req-1")
    with pytest.raises(RuntimeError, match="one request at a time"):
        runner.execute_stepwise(StepSchedulerOutput((req, DiffusionRequest("req-2"))))


def test_stepwise_synchronize_failure(monkeypatch):
    pipeline, runner = step_runner()

    def broken_sync():
        raise RuntimeError("barrier failed")

    monkeypatch.setattr(runner.kv_cache, "block_until_ready", broken_sync)
    req = DiffusionRequest("req-1", inputs={"results": ("output",)})
    with pytest.raises(RuntimeError, match="barrier failed"):
        runner.execute_stepwise(StepSchedulerOutput((req,)))
    assert runner.sessions == () and runner.e2e_times == () and pipeline.log[-1] == ("close_hook", "req-1")


def test_in_flight_chunk_survives_between_steps():
    pipeline, runner = step_runner()
    req = DiffusionRequest("req-1", inputs={"results": ("none", "none", "output")})
    runner.execute_stepwise(StepSchedulerOutput((req,)))
    state = runner.session_table.get("req-1")
    assert state.describe()["pending"]["main"]["commit_current"] is False  # pending probe kept
    runner.execute_stepwise(StepSchedulerOutput((req,)))
    runner.execute_stepwise(StepSchedulerOutput((req,)))
    assert committed(runner, "req-1") == 3 and runner.session_table.get("req-1") is state


# -- warmup ----------------------------------------------------------------------------------------------

def test_warmup_runs_in_order_and_releases():
    pipeline = WarmupPipeline(warmup_plan=("ok", "ok", "ok"))
    runner = make_runner(pipeline)
    forwards = [entry for entry in pipeline.log if entry[0] == "forward"]
    assert forwards == [("forward", WARMUP_SESSION_ID)] * 3
    assert pipeline.log[0] == ("warmup_requests", WARMUP_SESSION_ID)
    assert pipeline.log[-1] == ("close_hook", WARMUP_SESSION_ID)
    assert runner.sessions == () and runner.e2e_times == ()
    assert runner.kv_cache.num_free_slots == runner.session_capacity


def test_warmup_failure_logs_and_load_continues(caplog):
    pipeline = WarmupPipeline(warmup_plan=("ok", "fail", "ok"))
    with caplog.at_level(logging.WARNING, logger="ardiff_jax.runtime"):
        runner = make_runner(pipeline)
    assert "warmup request 'warmup-1' failed" in caplog.text
    assert sum(1 for e in pipeline.log if e[0] == "forward") == 3
    assert runner.sessions == ()
    runner.execute_model(request("s"))  # loaded and usable


def test_warmup_skipped_without_provider_or_when_disabled():
    plain = RecordingPipeline()
    make_runner(plain)
    assert plain.log == []
    disabled = WarmupPipeline()
    make_runner(disabled, warmup=False)
    assert disabled.log == []


# -- engine ---------------------------------------------------------------------------------------------

def test_engine_delegates():
    pipeline = RecordingPipeline()
    with ARDiffusionEngine(pipeline, EngineConfig(**F32)) as engine:
        out = engine.generate(request("s"))
        assert out.shape == (2, 3, 1, 4)
        assert engine.sessions == ("s",) and engine.session_capacity == 2
        assert engine.memory_plan.session_capacity == 2
        engine.reset_session("s")
        assert pipeline.log[-1] == ("reset_hook", "s")
        engine.generate(request("t"))
    assert pipeline.log[-1] == ("close_hook", "t")  # closing the engine releases sessions
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(request("s"))
    with pytest.raises(TypeError, match="runner_cls"):
        ARDiffusionEngine(pipeline, EngineConfig(**F32), runner_cls=dict)


def test_non_committing_forward_writes_nothing():
    pipeline = RecordingPipeline()
    runner = make_runner(pipeline)
    runner.execute_model(request("s"))
    before = np.asarray(runner.kv_cache.pools.k).copy()
    pools_before = runner.kv_cache.pools
    runner.execute_model(request("s", commit=False))
    assert runner.kv_cache.pools is pools_before  # no write dispatched at all
    np.testing.assert_array_equal(np.asarray(runner.kv_cache.pools.k), before)



def test_pipeline_validation_rejects_before_touching_the_session():
    class Validating(RecordingPipeline):
        def validate_ar_diffusion_request(self, session_id, request):
            self.log.append(("validate", session_id))
            if request.inputs.get("bad"):
                raise ValueError("bad request")

    pipeline = Validating()
    runner = make_runner(pipeline)
    runner.execute_model(request("s"))
    before = run_pages(runner, "s")
    del pipeline.log[:]
    with pytest.raises(ValueError, match="bad request"):
        runner.execute_model(request("s", bad=True, reset=True, close_session=True))
    assert pipeline.log == [("validate", "s")]  # no reset, bind, forward or hook
    assert runner.sessions == ("s",) and committed(runner, "s") == 3
    np.testing.assert_array_equal(run_pages(runner, "s")[0], before[0])
