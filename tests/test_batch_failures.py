"""A batched tick that fails only when its device work is awaited moves no model state.

On an accelerator, dispatch returns before the device ran: an out-of-memory at execution time
(an asynchronous device error) surfaces only where the runner awaits the batch's outputs
(``runner._gate.synchronize``). The fault is injected exactly there. The runner then reruns the
requests one by one, and the rerun must start from exactly the model state before the batch
(noise key position, block counter, decoder / encoder / action caches): its outputs equal, bit for
bit, the same requests run one by one on a twin engine with the same history, and so do the next
blocks. Every pipeline with ``forward_batch``: world, the sprite world, CFG, Wan (with its VAE),
Matrix-Game.

``transient``: only the batch's await fails; the rerun succeeds and no error is raised.
``s2_fails``: the await of s2's own rerun fails too; only s2 fails (``ARDiffusionBatchError``,
released as ``generate`` leaves it), the others equal the one-by-one run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.runtime import ARDiffusionBatchError

SESSIONS = ("s1", "s2", "s3")
ENGINE = {"dtype": "float32", "available_memory_bytes": 10**9, "gpu_memory_fraction": 1.0, "warmup": False}


class AwaitFault(RuntimeError):
    """What an asynchronous device error looks like to the runner: raised when it waits."""


class _Kind:
    """One pipeline family: ``new_pipeline()`` on shared weights, and its requests per tick."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name in ("world", "sprite"):
            from ardiff_jax.models import SpriteWorldPipeline, SpriteWorldPipelineConfig, WorldPipeline
            from ardiff_jax.models import WorldPipelineConfig

            cls, config, pipeline_config = ((WorldPipeline, "tiny", WorldPipelineConfig) if name == "world" else
                                            (SpriteWorldPipeline, "sprite_world", SpriteWorldPipelineConfig))
            base = cls(config)
            self._make = lambda: cls(config, pipeline_config(session_capacity=3), modules=base.modules)
        elif name == "cfg":
            from ardiff_jax.models import CFGPipelineConfig, CFGWorldActionPipeline

            base = CFGWorldActionPipeline("tiny")
            self._make = lambda: CFGWorldActionPipeline("tiny", CFGPipelineConfig(session_capacity=3),
                                                        modules=base.modules)
            self._schema = base.schema
        elif name == "wan":
            from test_wan_video import TINY_VAE, TINY_WAN

            from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig, random_vae

            base, vae = CausalWanPipeline(TINY_WAN), random_vae(TINY_VAE, 3)
            self._make = lambda: CausalWanPipeline(TINY_WAN, CausalWanPipelineConfig(session_capacity=3),
                                                   modules=base.modules, vae=vae)
            self._text_dim = TINY_WAN.text_dim
        else:
            from test_matrix_game_pipeline import CONFIG, Player, random_vae

            from ardiff_jax.models.matrix_game import MatrixGamePipeline, MatrixGamePipelineConfig

            base = MatrixGamePipeline(CONFIG, vae=random_vae())
            self._make = lambda: MatrixGamePipeline(CONFIG, MatrixGamePipelineConfig(session_capacity=3),
                                                    modules=base.modules, vae=base.vae)
            self._player = Player

    def engine(self):
        pipeline = self._make()
        return pipeline, ARDiffusionEngine(pipeline, EngineConfig(**ENGINE))

    def requests(self, tick: int, session_ids, players: dict) -> list[DiffusionRequest]:
        """One request per session; the same objects go to both engines."""
        out = []
        for index, sid in enumerate(session_ids):
            seed = 10 * tick + index + int(sid[1:])
            extra = {"session_id": sid}
            if self.name == "world":
                inputs = {"seed": int(sid[1:])} if tick == 0 else {}
                out.append(DiffusionRequest(f"{sid}-{tick}", prompt=f"walk {sid}" if tick == 0 else None,
                                            extra_args=extra, inputs=inputs))
            elif self.name == "sprite":
                from ardiff_jax.envs import SpriteWorld

                inputs = {"actions": np.array([seed % 5])}
                if tick == 0:
                    inputs["observation"] = SpriteWorld(int(sid[1:]), size=32).reset()
                out.append(DiffusionRequest(f"{sid}-{tick}", extra_args=extra, inputs=inputs))
            elif self.name == "cfg":
                out.append(DiffusionRequest(f"{sid}-{tick}", prompt=f"pick {sid}" if tick == 0 else None,
                                            extra_args=extra, inputs={"observation": self._schema.example(1, seed)}))
            elif self.name == "wan":
                inputs = {} if tick else {"prompt_embeds": np.random.default_rng(seed).standard_normal(
                    (5, self._text_dim)).astype(np.float32)}
                out.append(DiffusionRequest(f"{sid}-{tick}", extra_args=extra, inputs=inputs))
            else:
                player = players.setdefault(sid, self._player(30 + int(sid[1:]), blocks=4))
                out.append(player.request(sid))
        return out


KINDS = ("world", "sprite", "cfg", "wan", "matrix_game")


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return _Kind(request.param)


def _leaves(output):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(output)]


def _assert_identical(got, want):
    """Bit for bit: both sides ran the same programs on the same state."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g_leaves, w_leaves = _leaves(g), _leaves(w)
        assert len(g_leaves) == len(w_leaves)
        for a, b in zip(g_leaves, w_leaves, strict=True):
            np.testing.assert_array_equal(a, b)


def _fail_awaits(engine, calls: set[int]) -> list[int]:
    """Make the runner's awaits numbered ``calls`` (0: the batch's, then one per request rerun) raise."""
    runner = engine.runner
    real, seen = runner._gate.synchronize, []

    def synchronize(output):
        seen.append(len(seen))
        real(output)  # the device work ran; the error is what the await reports
        if seen[-1] in calls:
            raise AwaitFault("asynchronous device error (out of memory at execution time)")

    runner._gate.synchronize = synchronize
    return seen


@pytest.mark.parametrize("fault", ["transient", "s2_fails"])
def test_a_batch_that_fails_when_awaited_reruns_from_the_state_before_it(kind, fault):
    pipeline, batched = kind.engine()
    _, sequential = kind.engine()
    players_a, players_b = {}, {}
    try:
        first = kind.requests(0, SESSIONS, players_a)
        kind.requests(0, SESSIONS, players_b)  # the twin players advance alike
        _assert_identical(batched.generate_batch(first), sequential.generate_batch(first))
        assert batched.runner.supports_batched_forward
        before = {sid: pipeline._sessions[sid].block_index for sid in SESSIONS}  # forward changes it in place
        seen = _fail_awaits(batched, {0} if fault == "transient" else {0, 2})
        requests = kind.requests(1, SESSIONS, players_a)
        kind.requests(1, SESSIONS, players_b)
        if fault == "transient":
            got = batched.generate_batch(requests)  # the rerun succeeded: no error
            _assert_identical(got, [sequential.generate(r) for r in requests])
            survivors = SESSIONS
        else:
            with pytest.raises(ARDiffusionBatchError) as raised:
                batched.generate_batch(requests)
            error = raised.value
            assert list(error.errors) == ["s2"] and isinstance(error.errors["s2"], AwaitFault)
            assert error.outputs[1] is None
            _assert_identical([error.outputs[0], error.outputs[2]],
                              [sequential.generate(requests[0]), sequential.generate(requests[2])])
            assert "s2" not in batched.sessions and "s2" not in pipeline.session_ids  # released, as generate
            survivors = ("s1", "s3")
        assert seen == [0, 1, 2, 3]  # the batch's await, then one per rerun request
        for sid in survivors:  # each session advanced by exactly one block, from the state before the batch
            assert pipeline._sessions[sid].block_index == before[sid] + 1
        # Nothing staged by the failed batch leaked: the next blocks are the one-by-one run's too.
        batched.runner._gate.__dict__.pop("synchronize")
        after = kind.requests(2, survivors, players_a)
        kind.requests(2, survivors, players_b)
        _assert_identical([batched.generate(r) for r in after], [sequential.generate(r) for r in after])
    finally:
        batched.close()
        sequential.close()


def test_forward_batch_must_defer_a_callable_and_only_while_bound():
    from ardiff_jax.runtime._batch import ARDiffusionKVBatch

    batch = ARDiffusionKVBatch.__new__(ARDiffusionKVBatch)
    batch._bound, batch._deferred = False, []
    with pytest.raises(RuntimeError, match="outside its runner invocation"):
        batch.defer_publish(lambda: None)
    batch._bound = True
    with pytest.raises(TypeError, match="defer_publish\\(publish\\) needs a callable"):
        batch.defer_publish("not callable")
    assert batch._deferred == []


def test_a_publish_that_raises_releases_every_session_of_the_batch():
    """The staged state could be half installed beside committed KV: nothing consistent to rerun from, so every
    session of the batch fails closed (released, its next request starts it anew), none is left half moved."""
    kind = _Kind("sprite")
    pipeline, engine = kind.engine()
    events = []
    engine.runner.add_session_listener(events.append)
    try:
        engine.generate_batch(kind.requests(0, SESSIONS, {}))
        publish = pipeline._publish_staged

        def half_publish(sessions):
            publish(dict(list(sessions.items())[:1]))
            raise RuntimeError("publish failed halfway")

        pipeline._publish_staged = half_publish
        with pytest.raises(ARDiffusionBatchError) as raised:
            engine.generate_batch(kind.requests(1, SESSIONS, {}))
        assert list(raised.value.errors) == list(SESSIONS) and raised.value.outputs == [None] * 3
        assert engine.sessions == () and pipeline.session_ids == ()
        assert sorted(e.session_id for e in events if e.kind == "released") == list(SESSIONS)
        del pipeline._publish_staged
        assert len(engine.generate_batch(kind.requests(0, SESSIONS, {}))) == 3  # they start anew
    finally:
        engine.close()
