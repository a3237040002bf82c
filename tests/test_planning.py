"""``ardiff_jax.planning``: the model-predictive controller that plans inside the SpriteWorld model."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from PIL import Image

from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
from ardiff_jax.envs import SpriteWorld, SpriteWorldState, next_state, reached_ball, render
from ardiff_jax.models import pretrained
from ardiff_jax.planning import (
    LOST_SCORE,
    POLICIES,
    REACHED_SCORE,
    OraclePlanner,
    WorldModelPlanner,
    add_agent_arguments,
    agent_table,
    candidate_actions,
    greedy_action,
    run_agent_demo,
    run_agent_from_args,
    run_episode,
    score_frames,
)

ENGINE = EngineConfig(dtype="float32", available_memory_bytes=2**28, gpu_memory_fraction=1.0, batch_compile="lazy")
CAPACITY = 4


@pytest.fixture(scope="module")
def engine():
    with ARDiffusionEngine(pretrained("sprite_world", session_capacity=CAPACITY), ENGINE) as engine:
        yield engine


def _walls(n=8, extra=()):
    walls = np.zeros((n, n), bool)
    walls[0, :] = walls[-1, :] = walls[:, 0] = walls[:, -1] = True
    for cell in extra:
        walls[cell] = True
    return walls


def _state(agent, ball, velocity=(1, 1), extra=()):
    return SpriteWorldState(walls=_walls(extra=extra), agent=agent, ball=ball, ball_velocity=velocity)


# -- the predicate, the scorer, the candidates, greedy --------------------------------------------------


def test_reached_ball_means_the_cells_share_an_edge():
    assert reached_ball(_state((3, 3), (3, 4)))
    assert reached_ball(_state((3, 3), (2, 3)))
    assert not reached_ball(_state((3, 3), (4, 4)))  # diagonal: the ball's corners are background, no touch
    assert not reached_ball(_state((3, 3), (3, 5)))
    with pytest.raises(ValueError, match="state"):
        reached_ball("not a state")


def test_reached_ball_is_what_the_simulator_lets_the_agent_get_to():
    # The agent never gets onto the ball: pushing into it is refused.
    assert next_state(_state((3, 3), (3, 4), velocity=(-1, 1)), 4).agent == (3, 3)
    # Stepping beside the ball's next cell reaches it (the simulator moves the agent, then the ball).
    assert reached_ball(next_state(_state((3, 2), (5, 4), velocity=(-1, -1)), 4))


def _frames(*states):
    return np.stack([render(state) for state in states])


def test_score_prefers_reaching_early_then_ending_close_and_punishes_a_lost_ball():
    far, near, touch = _state((1, 1), (5, 5)), _state((2, 2), (4, 4)), _state((4, 3), (4, 4))
    assert score_frames(_frames(touch, far)) == REACHED_SCORE
    assert score_frames(_frames(far, touch)) == REACHED_SCORE - 1
    assert score_frames(_frames(far, near)) > score_frames(_frames(near, far))
    assert score_frames(_frames(far, far)) < 0
    lost = render(near).copy()
    lost[16:20, 16:20] = 0  # the ball's cell (4, 4) painted background: no ball in the frame
    assert score_frames(np.stack([render(far), lost])) == LOST_SCORE
    assert LOST_SCORE < score_frames(_frames(far, far))
    with pytest.raises(ValueError, match="frames"):
        score_frames(np.zeros((0, 32, 32, 3), np.uint8))


def test_candidates_cover_every_first_action_and_are_seeded():
    actions = candidate_actions(8, 6, (0, 200, 3))
    assert actions.shape == (8, 6) and actions.dtype == np.int32
    assert sorted(actions[:5, 0]) == [0, 1, 2, 3, 4]
    assert ((actions >= 0) & (actions < 5)).all()
    np.testing.assert_array_equal(actions, candidate_actions(8, 6, (0, 200, 3)))
    assert not np.array_equal(actions, candidate_actions(8, 6, (0, 200, 4)))
    assert sorted(candidate_actions(5, 1, 7)[:, 0]) == [0, 1, 2, 3, 4]


def test_greedy_walks_towards_the_ball_around_walls():
    assert greedy_action(_state((1, 1), (5, 2))) == 2  # longer axis first: down
    # Down is a wall: the other axis that shortens the distance.
    assert greedy_action(_state((1, 1), (5, 3), extra=[(2, 1)])) == 4
    # Both shortening moves blocked: no-op.
    assert greedy_action(_state((1, 1), (5, 5), extra=[(2, 1), (1, 2)])) == 0


# -- the planners ---------------------------------------------------------------------------------


def _world_where_greedy_fails_and_the_oracle_reaches(budget, planner):
    for world_seed in range(200, 400):
        greedy = run_episode("greedy", world_seed, budget=budget)
        if greedy.reached:
            continue
        oracle = run_episode("oracle planner", world_seed, budget=budget, planner=planner)
        if oracle.reached:
            return world_seed, greedy, oracle
    raise AssertionError("no world where greedy fails and the oracle planner reaches the ball")


def test_the_oracle_planner_reaches_the_ball_where_greedy_does_not():
    world_seed, greedy, oracle = _world_where_greedy_fails_and_the_oracle_reaches(5, OraclePlanner(8, 6, seed=0))
    assert not greedy.reached and greedy.steps == 5
    assert oracle.reached and oracle.steps <= 5
    world = SpriteWorld(world_seed)  # replaying its actions in the simulator reaches the ball too
    world.reset()
    for action in oracle.actions:
        world.step(action)
    assert reached_ball(world.state)


def test_the_oracle_planner_scores_the_simulators_own_rollouts():
    world = SpriteWorld(201)
    world.reset()
    plan = OraclePlanner(5, 3, seed=1).plan(world.state, key=(201, 0))
    assert plan.frames.shape == (5, 3, 32, 32, 3) and plan.scores.shape == (5,)
    assert plan.action == plan.actions[plan.best, 0] and plan.scores[plan.best] == plan.scores.max()
    imagined = world.state
    for h, action in enumerate(plan.actions[2]):
        imagined = next_state(imagined, int(action))
        np.testing.assert_array_equal(plan.frames[2, h], render(imagined))


def test_the_world_model_planner_forks_imagines_and_leaves_only_the_live_session(engine):
    planner = WorldModelPlanner(num_candidates=CAPACITY - 1, horizon=2, seed=0)
    world = SpriteWorld(205)
    frame = world.reset()
    first = planner.plan(engine, "live", observation=frame, key=(205, 0))  # no live session yet: from the frame
    assert not first.forked and engine.sessions == ()
    out = engine.generate(DiffusionRequest("live-0", extra_args={"session_id": "live"},
                                           inputs={"actions": np.array([first.action]), "observation": frame}))
    plan = planner.plan(engine, "live", key=(205, 1))
    assert plan.forked and 0 <= plan.action < 5 and plan.action == plan.actions[plan.best, 0]
    assert plan.frames.shape == (CAPACITY - 1, 2, 32, 32, 3) and plan.frames.dtype == np.uint8
    assert engine.sessions == ("live",)
    # A fork continues from exactly the live session: feeding candidate 0's first action to the
    # live session gives candidate 0's first imagined frame.
    out = engine.generate(DiffusionRequest("live-1", extra_args={"session_id": "live"},
                                           inputs={"actions": plan.actions[0, :1]}))
    np.testing.assert_array_equal(out.frames[-1], plan.frames[0, 0])
    engine.close_session("live")


def test_a_failing_candidate_close_closes_every_other_candidate_and_raises_the_first_error(engine, monkeypatch):
    """Issue 43, item 9: cleanup goes on past a failing close_session, so only the candidates whose
    close failed stay; the first error is raised, the later one noted."""
    planner = WorldModelPlanner(num_candidates=CAPACITY - 1, horizon=1, seed=0)
    frame = SpriteWorld(205).reset()
    engine.generate(DiffusionRequest("live-0", extra_args={"session_id": "live"},
                                     inputs={"actions": np.array([0]), "observation": frame}))
    ids = planner.candidate_ids("live")
    failing = {ids[0]: "first", ids[2]: "second"}
    tried: list[str] = []
    close_session = engine.close_session

    def flaky_close(session_id):
        tried.append(session_id)
        if session_id in failing:
            raise RuntimeError(f"the {failing.pop(session_id)} close failed")
        close_session(session_id)

    monkeypatch.setattr(engine, "close_session", flaky_close)
    with pytest.raises(RuntimeError, match="the first close failed") as raised:
        planner.plan(engine, "live", key=(205, 1))
    assert tried == ids  # every candidate's close was tried
    assert sorted(engine.sessions) == sorted(["live", ids[0], ids[2]])  # only the failed ones stay
    assert any("the second close failed" in note for note in raised.value.__notes__)
    for cid in (ids[0], ids[2]):
        engine.close_session(cid)
    assert planner.plan(engine, "live", key=(205, 2)).forked  # the next plan is not refused
    assert engine.sessions == ("live",)
    monkeypatch.undo()
    engine.close_session("live")
    assert engine.sessions == ()


def test_a_world_model_episode_keeps_the_live_session_in_step_and_cleans_up(engine):
    planner = WorldModelPlanner(num_candidates=CAPACITY - 1, horizon=2, seed=0)
    episode = run_episode("world-model planner", 203, budget=3, engine=engine, planner=planner, record=True)
    assert 1 <= episode.steps <= 3 and len(episode.actions) == len(episode.decision_seconds) == episode.steps
    assert len(episode.real_frames) == len(episode.model_frames) == episode.steps + 1
    assert len(episode.plans) == episode.steps and 0 <= episode.reanchors < episode.steps
    assert engine.sessions == () and engine.offloaded_sessions == ()


# -- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "name"), [
    (lambda: WorldModelPlanner(num_candidates=0), "num_candidates"),
    (lambda: WorldModelPlanner(horizon=0), "horizon"),
    (lambda: OraclePlanner(num_candidates=-1), "num_candidates"),
    (lambda: OraclePlanner(horizon=1.5), "horizon"),
    (lambda: candidate_actions(0, 3), "num_candidates"),
    (lambda: run_episode("greedy", 200, budget=0), "budget"),
    (lambda: run_episode("teleport", 200), "policy"),
    (lambda: run_episode("oracle planner", 200), "OraclePlanner"),
    (lambda: run_agent_demo("/nonexistent/never-written", budget=0), "budget"),
    (lambda: run_agent_demo("/nonexistent/never-written", num_candidates=0), "num_candidates"),
    (lambda: run_agent_demo("/nonexistent/never-written", horizon=0), "horizon"),
    (lambda: run_agent_demo("/nonexistent/never-written", worlds=0), "worlds"),
])
def test_bad_arguments_raise_value_error_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_more_candidates_than_the_engine_has_room_for_is_refused(engine):
    planner = WorldModelPlanner(num_candidates=CAPACITY, horizon=1)
    with pytest.raises(ValueError, match=r"num_candidates \(4\) \+ 1"):
        planner.plan(engine, "live", observation=SpriteWorld(200).reset())
    assert engine.sessions == ()


def test_the_cli_arguments_and_a_refused_run(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    add_agent_arguments(parser)
    args = parser.parse_args(["--out", "x", "--agent", "--worlds", "3", "--budget", "5", "--candidates", "4",
                              "--horizon", "2"])
    assert (args.agent, args.worlds, args.budget, args.candidates, args.horizon) == (True, 3, 5, 4, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--budget", "0"])
    args.worlds = 0
    assert run_agent_from_args(args) == 2
    assert "worlds" in capsys.readouterr().err


# -- the whole comparison, tiny -----------------------------------------------------------------------


def test_run_agent_demo_writes_every_output_with_the_four_policies(tmp_path):
    summary = run_agent_demo(tmp_path, worlds=2, budget=2, num_candidates=2, horizon=2, progress=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["agent_episode.gif", "agent_summary.json",
                                                                 "agent_table.md"]
    written = json.loads((tmp_path / "agent_summary.json").read_text())
    assert list(written["policies"]) == list(POLICIES)
    assert written["world_seeds"] == [200, 201] and written["machine"]["cpu_count"] >= 1
    assert written["policies"]["world-model planner"]["decisions_per_second"] > 0
    assert set(written["kv_pages"]) >= {"with_forks", "copying", "pool_pages"}
    table = (tmp_path / "agent_table.md").read_text()
    assert table == agent_table(summary)
    for name in POLICIES:
        assert f"| {name} |" in table
    gif = Image.open(tmp_path / "agent_episode.gif")
    assert gif.n_frames >= 2 and gif.size[0] > 4 * gif.size[1] // 2


def test_ardiff_jax_demo_agent_runs_the_comparison(tmp_path, capsys):
    from ardiff_jax import cli

    code = cli.main(["demo", "--agent", "--out", str(tmp_path / "agent"), "--worlds", "1", "--budget", "1",
                     "--candidates", "2", "--horizon", "1", "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| world-model planner |" in out and "agent_episode.gif" in out
    assert (tmp_path / "agent" / "agent_summary.json").is_file()

