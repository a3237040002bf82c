"""Batched ticks through the server: sessions due together get their chunks from one engine call.

Three sprite-world players (random weights) on an unpaced server are all due on every round,
so the generation loop hands their ticks to ``engine.generate_batch`` together. Every frame a
player was sent equals a replay of the same ticks one by one on a fresh engine, and when one
session's request fails inside a batch, only that player gets ``generation_failed``: the others
keep streaming.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.models import DiTModules, SpriteWorldPipeline, SpriteWorldPipelineConfig, dit_preset
from ardiff_jax.serve import ServedWorld, ServerSettings, create_app
from ardiff_jax.types import ARDiffusionTickRequest

PATH = "/v1/realtime/video"
CONFIG = EngineConfig(dtype="float32", available_memory_bytes=10**9, gpu_memory_fraction=1.0)


@pytest.fixture(scope="module")
def modules():
    return DiTModules.create(dit_preset("sprite_world"), 1)


def _engine(modules) -> ARDiffusionEngine:
    pipeline = SpriteWorldPipeline("sprite_world", SpriteWorldPipelineConfig(session_capacity=4), modules=modules)
    return ARDiffusionEngine(pipeline, CONFIG)


class BatchSpy:
    """Records ``generate_batch`` calls and every output per session; can fail one session's requests."""

    def __init__(self, engine) -> None:
        self.engine, self.generate_batch, self.generate = engine, engine.generate_batch, engine.generate
        self.batch_sizes: list[int] = []
        self.ticks: list[tuple[str, DiffusionRequest, np.ndarray]] = []
        self.fail_session: str | None = None
        self.lock = threading.Lock()
        engine.generate_batch = self.batched
        engine.generate = self.single

    @staticmethod
    def session(request) -> str:
        return ARDiffusionTickRequest.from_extra_args(request.extra_args).session_id

    def _record(self, request, output) -> None:
        with self.lock:
            self.ticks.append((self.session(request), request, np.asarray(output.frames).copy()))

    def batched(self, requests):
        self.batch_sizes.append(len(requests))
        if self.fail_session is not None:
            pipeline = self.engine.runner.pipeline
            original = pipeline.forward_batch

            def failing(batch_requests):  # the batched forward fails: the engine reruns one by one
                if any(self.session(r) == self.fail_session for r in batch_requests):
                    raise RuntimeError("injected batch failure")
                return original(batch_requests)

            pipeline.forward_batch = failing
            forward = pipeline.forward

            def failing_one(request):
                if self.session(request) == self.fail_session:
                    raise RuntimeError("injected failure for one session")
                return forward(request)

            pipeline.forward = failing_one
            try:
                outputs = self.generate_batch(requests)
            except Exception as error:
                for request, output in zip(requests, getattr(error, "outputs", []), strict=False):
                    if output is not None:
                        self._record(request, output)
                raise
            finally:
                del pipeline.forward_batch, pipeline.forward
        else:
            outputs = self.generate_batch(requests)
        for request, output in zip(requests, outputs, strict=True):
            self._record(request, output)
        return outputs

    def single(self, request):
        output = self.generate(request)
        self._record(request, output)
        return output

    def restore(self) -> None:
        del self.engine.generate_batch, self.engine.generate


def _next(ws) -> dict:
    while True:
        payload = json.loads(ws.receive_text())
        if payload["type"] == "video.chunk_metadata":
            ws.receive_bytes()
            return payload
        if payload["type"] == "error":
            return payload


def _play(engine, rounds: int, fail: int | None = None):
    spy = BatchSpy(engine)
    app = create_app(engine, world=ServedWorld.for_pipeline(engine.runner.pipeline),
                     settings=ServerSettings(paced=False))
    last: dict[int, dict] = {}
    try:
        with TestClient(app) as client:
            sockets = [client.websocket_connect(PATH).__enter__() for _ in range(3)]
            try:
                ids = []
                for seed, ws in enumerate(sockets):
                    ws.send_json({"type": "session.start", "format": "jpeg", "seed": seed})
                    ids.append(ws.receive_json()["request_id"])
                for round_ in range(rounds):
                    if fail is not None and round_ == 2:
                        spy.fail_session = ids[fail]
                    for index, ws in enumerate(sockets):
                        if last.get(index, {}).get("type") == "error":
                            continue
                        last[index] = _next(ws)
                metrics = client.get("/metrics").text
            finally:
                for ws in sockets:
                    ws.send_json({"type": "session.stop"})
                    ws.__exit__(None, None, None)
    finally:
        spy.restore()
    return spy, ids, last, metrics


def test_due_sessions_share_one_engine_call_and_equal_a_one_by_one_replay(modules):
    with _engine(modules) as engine:
        spy, ids, _, metrics = _play(engine, rounds=6)
    assert spy.batch_sizes and max(spy.batch_sizes) >= 2, spy.batch_sizes
    assert sum(spy.batch_sizes) >= 2 * 3  # most chunks came from batched calls
    assert any(line.startswith("ardiff_batch_sessions_count ") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines())
    with _engine(modules) as straight:
        for session in ids:
            for tick_session, request, frames in spy.ticks:
                if tick_session == session:
                    replayed = straight.generate(DiffusionRequest(
                        request.request_id, prompt=request.prompt, extra_args={"session_id": session},
                        inputs=request.inputs))
                    np.testing.assert_allclose(np.asarray(replayed.frames), frames, atol=1)


def test_a_session_failing_inside_a_batch_ends_alone_and_the_others_keep_streaming(modules):
    with _engine(modules) as engine:
        spy, ids, last, _ = _play(engine, rounds=6, fail=1)
        assert last[1]["type"] == "error" and last[1]["code"] == "generation_failed"
        assert "injected" in last[1]["message"]
        for index in (0, 2):
            assert last[index]["type"] == "video.chunk_metadata" and last[index]["generation_chunk_index"] >= 5
        assert ids[1] not in engine.sessions


class FakeEngine:
    """Answers each request with its own metadata; records how it was called."""

    def __init__(self, batched: bool = True) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        if batched:
            self.generate_batch = lambda requests: [self._out(r, "batch", len(requests)) for r in requests]

    def _out(self, request, kind: str, size: int = 1) -> dict:
        tick = ARDiffusionTickRequest.from_extra_args(request.extra_args)
        if not self.calls or self.calls[-1][0] != kind or kind == "one" or len(self.calls[-1][1]) >= size:
            self.calls.append((kind, []))
        self.calls[-1][1].append(tick.session_id)
        return {"ar_diffusion": {"session_id": tick.session_id, "request_id": tick.request_id,
                                 "chunk_index": tick.chunk_index, "applied_event_ids": []}}

    def generate(self, request):
        return self._out(request, "one")

    def close_session(self, session_id):
        pass


def _tick(session: str) -> ARDiffusionTickRequest:
    return ARDiffusionTickRequest(session, f"r-{session}", 0)


@pytest.mark.parametrize("batched", [True, False])
def test_a_tick_batch_waits_for_every_expected_session_and_a_withdrawn_one_never_blocks(batched):
    import asyncio

    from ardiff_jax.realtime import EngineTickConsumer

    engine = FakeEngine(batched)
    consumer = EngineTickConsumer(engine)

    async def scenario():
        with consumer.batch(["a", "b", "c"]) as batch:
            a = asyncio.create_task(consumer.execute_tick(_tick("a")))
            b = asyncio.create_task(consumer.execute_tick(_tick("b")))
            await asyncio.sleep(0.05)
            assert not a.done() and not b.done() and engine.calls == []  # waiting for c
            batch.withdraw("c")  # c's task ended without a tick
            outputs = await asyncio.gather(a, b)
            batch.withdraw("a")  # after submitting: nothing happens
        alone = await consumer.execute_tick(_tick("d"))  # the batch is closed: a tick runs alone
        return outputs, alone

    outputs, alone = asyncio.run(scenario())
    consumer.close()
    assert [o["ar_diffusion"]["session_id"] for o in outputs] == ["a", "b"]
    assert alone["ar_diffusion"]["session_id"] == "d"
    expected = [("batch", ["a", "b"])] if batched else [("one", ["a"]), ("one", ["b"])]
    assert engine.calls == expected + [("one", ["d"])]
