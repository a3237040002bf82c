"""Model-predictive control inside the world model: plan in imagined SpriteWorld frames, act in the real one.

The task: in a random :class:`~ardiff_jax.envs.SpriteWorld` the agent must reach the ball
(:func:`~ardiff_jax.envs.reached_ball`: their cells share an edge, as the simulator decides)
within a step budget.

The method (:class:`WorldModelPlanner`), at every real step:

1. **fork** the live session into ``N`` candidates (``engine.fork_session(live, f"{live}/cand{i}")``:
   each continues from exactly the live session's committed history, sharing its KV pages
   copy-on-write, so a fork costs nothing until a candidate writes);
2. **imagine**: roll out ``H`` steps of ``N`` candidate action sequences
   (:func:`candidate_actions`: seeded, every first action covered when ``N >= 5``) as one
   batched rollout, one ``engine.generate_batch`` of ``N`` requests per step;
3. **score** each imagined frame sequence (:func:`score_frames`, from the frames' pixels
   alone: reaching the ball earlier scores higher, otherwise the distance left at the horizon;
   a frame that does not show one agent and one ball scores worst), close the forks, and
4. **act**: execute the best candidate's first action in the simulator and feed the same
   action to the live session, which so stays in step with what happened; when the model's
   frame differs from the observed one, the live session is **re-anchored**: reset, and
   started again from the observed frame (``inputs["observation"]``) with the next action.
   Until then the next plan starts its candidates from that observed frame instead of forking
   (there is no history to fork).

Receding horizon: only the first action is executed, and the next step plans again.

Compared on the same worlds (:func:`run_agent_demo`, ``ardiff-jax demo --agent``):

* ``random``: uniform random actions (seeded);
* ``greedy``: one step towards the ball's current cell from the true state
  (:func:`greedy_action`);
* ``oracle planner``: :class:`OraclePlanner`, the same ``N``, ``H``, candidates and scorer
  with the true simulator (:func:`~ardiff_jax.envs.next_state`) as its model: what the
  planner reaches with a perfect model;
* ``world-model planner``: :class:`WorldModelPlanner` with the trained model.

Outputs: ``agent_summary.json`` (success rate, mean steps to reach, re-anchors, decisions/s
and the machine, KV pages with forks and with copying), ``agent_table.md`` and
``agent_episode.gif`` (one planned episode: the real frame, the model's frame and every
candidate's imagined frame at the horizon, side by side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ardiff_jax._checks import check_non_negative_int, check_positive_int, is_integer
from ardiff_jax._machine import machine_summary
from ardiff_jax.envs import ACTION_NAMES, SpriteWorld, SpriteWorldState, cell_codes, next_state, reached_ball, render
from ardiff_jax.types import DiffusionRequest

__all__ = [
    "AGENT_FIRST_WORLD",
    "POLICIES",
    "Plan",
    "Episode",
    "WorldModelPlanner",
    "OraclePlanner",
    "candidate_actions",
    "score_frames",
    "greedy_action",
    "run_episode",
    "run_agent_demo",
    "agent_table",
    "add_agent_arguments",
    "run_agent_from_args",
]

#: The first world seed the comparison plays: disjoint from the demo's (0-3) and the evaluation's (100-131).
AGENT_FIRST_WORLD = 200

#: The compared policies, in table order.
POLICIES = ("random", "greedy", "oracle planner", "world-model planner")

#: :func:`score_frames`: reaching the ball at imagined step ``h`` scores ``REACHED_SCORE - h``; a frame
#: that does not show one agent and one ball scores ``LOST_SCORE`` (below any distance on the grid).
REACHED_SCORE = 100.0
LOST_SCORE = -100.0

_NUM_ACTIONS = len(ACTION_NAMES)
_OFFSETS = ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1))  # (d_row, d_col) per action, as ACTION_NAMES
_AGENT_CODE, _FIRST_BALL_CODE = 2, 3  # cell_codes: 0 background, 1 wall, 2 agent, 3-6 the ball


# -- arguments -----------------------------------------------------------------------------------


def _check_seed(name: str, value: Any) -> int:
    return check_non_negative_int(name, value)


def _check_key(key: Any) -> tuple[int, ...]:
    values = (key,) if is_integer(key) else tuple(key)
    return tuple(check_non_negative_int("key", value) for value in values)


# -- candidates and the scorer -------------------------------------------------------------------


def candidate_actions(num_candidates: int, horizon: int, seed: int | Sequence[int] = 0) -> np.ndarray:
    """``N`` candidate action sequences of ``H`` steps, deterministic given ``seed``.

    Each candidate is an L-shaped path: its first action for a seeded number of steps
    (at least one), then a second seeded action for the rest of the horizon. The first
    actions of the first ``min(N, 5)`` candidates are the five actions in a seeded order, so
    with ``N >= 5`` every first action is tried; later candidates draw theirs at random.

    Shapes:
      returns: i32[num_candidates, horizon]
    """
    num_candidates = check_positive_int("num_candidates", num_candidates)
    horizon = check_positive_int("horizon", horizon)
    words = [seed] if is_integer(seed) else list(seed)
    rng = np.random.default_rng([check_non_negative_int("seed", word) for word in words])
    first = rng.permutation(_NUM_ACTIONS)
    actions = np.empty((num_candidates, horizon), np.int32)
    for i in range(num_candidates):
        a = int(first[i]) if i < _NUM_ACTIONS else int(rng.integers(_NUM_ACTIONS))
        b = int(rng.integers(_NUM_ACTIONS))
        turn = int(rng.integers(1, horizon + 1))  # steps of the first leg
        actions[i, :turn] = a
        actions[i, turn:] = b
    return actions


def _positions(frame: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The agent's and the ball's cells in a frame, or None unless it shows exactly one of each."""
    codes = cell_codes(frame)
    agents = np.argwhere(codes == _AGENT_CODE)
    balls = np.argwhere(codes >= _FIRST_BALL_CODE)
    if len(agents) != 1 or len(balls) != 1:
        return None
    return (int(agents[0, 0]), int(agents[0, 1])), (int(balls[0, 0]), int(balls[0, 1]))


def score_frames(frames: np.ndarray) -> float:
    """How good an imagined rollout is, from its frames' pixels alone (higher is better).

    Frame ``h`` (0-based) is the world after the rollout's action ``h``. The first frame in
    which the agent's and the ball's cells share an edge (:func:`~ardiff_jax.envs.reached_ball`
    on pixels) scores ``REACHED_SCORE - h``: reaching earlier is better. A frame before that
    which does not show exactly one agent and one ball (the model lost one) scores
    ``LOST_SCORE``. Otherwise the rollout scores minus the Manhattan distance from the
    agent's cell to the ball's at the horizon, minus a tenth of the mean distance over the
    rollout (a tie-break: of two ends equally far, the one that stayed closer).

    Shapes:
      frames: u8[H, size, size, 3]
    """
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] < 1 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8[H >= 1, size, size, 3], got {frames.dtype}{list(frames.shape)}")
    distances = []
    for h, frame in enumerate(frames):
        positions = _positions(frame)
        if positions is None:
            return LOST_SCORE
        (ar, ac), (br, bc) = positions
        distance = abs(ar - br) + abs(ac - bc)
        if distance == 1:
            return REACHED_SCORE - h
        distances.append(distance)
    return -float(distances[-1]) - 0.1 * float(np.mean(distances))


# -- baselines -----------------------------------------------------------------------------------


def greedy_action(state: SpriteWorldState) -> int:
    """One step towards the ball's current cell, from the true state.

    Of the moves that shorten the Manhattan distance (the longer axis first), the first that
    is not blocked by a wall or the ball; the no-op when neither is free (or the agent is
    already beside the ball).
    """
    if not isinstance(state, SpriteWorldState):
        raise ValueError(f"state must be a SpriteWorldState, got {state!r}")
    (ar, ac), (br, bc) = state.agent, state.ball
    d_row, d_col = br - ar, bc - ac
    moves = []
    if d_row:
        moves.append((abs(d_row), 1 if d_row < 0 else 2))
    if d_col:
        moves.append((abs(d_col), 3 if d_col < 0 else 4))
    for _, action in sorted(moves, key=lambda move: -move[0]):  # stable: rows first on a tie
        row, col = ar + _OFFSETS[action][0], ac + _OFFSETS[action][1]
        if not state.walls[row][col] and (row, col) != state.ball:
            return action
    return 0


# -- planners ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """One planning decision.

    Attributes:
      action: the first action of the best candidate (an index into ``ACTION_NAMES``).
      best: that candidate's index.
      actions: ``i32[N, H]`` the candidates' action sequences.
      frames: ``u8[N, H, size, size, 3]`` each candidate's imagined frames (frame ``h``: after action ``h``).
      scores: ``f64[N]`` :func:`score_frames` of each candidate.
      seconds: wall time of the decision (forks, rollout, scoring, closing the forks).
      forked: whether the candidates were forked from the live session (else started from the observation).
      pages: ``pages_in_use`` of the KV cache before the forks, right after them, and at the
        rollout's peak (None when the cache does not count pages, and for the oracle).
    """

    action: int
    best: int
    actions: np.ndarray
    frames: np.ndarray
    scores: np.ndarray
    seconds: float
    forked: bool = False
    pages: dict[str, int] | None = None


def _config(num_candidates: Any, horizon: Any, seed: Any) -> tuple[int, int, int]:
    return (check_positive_int("num_candidates", num_candidates), check_positive_int("horizon", horizon),
            _check_seed("seed", seed))


def _best(actions: np.ndarray, frames: np.ndarray, start: float, **extra: Any) -> Plan:
    scores = np.array([score_frames(candidate) for candidate in frames], np.float64)
    best = int(np.argmax(scores))  # ties: the earliest candidate (their order is seeded)
    return Plan(action=int(actions[best, 0]), best=best, actions=actions, frames=frames, scores=scores,
                seconds=time.perf_counter() - start, **extra)


@dataclasses.dataclass(frozen=True)
class OraclePlanner:
    """The planner with the true simulator as its model: same candidates and scorer as :class:`WorldModelPlanner`."""

    num_candidates: int = 8
    horizon: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        _config(self.num_candidates, self.horizon, self.seed)

    def plan(self, state: SpriteWorldState, *, key: int | Sequence[int] = ()) -> Plan:
        """Roll every candidate on the simulator from ``state`` and pick the best first action.

        ``key`` (non-negative integers, e.g. ``(world seed, step)``) seeds the candidates
        together with :attr:`seed`, exactly as :meth:`WorldModelPlanner.plan` does.
        """
        if not isinstance(state, SpriteWorldState):
            raise ValueError(f"state must be a SpriteWorldState, got {state!r}")
        start = time.perf_counter()
        actions = candidate_actions(self.num_candidates, self.horizon, (self.seed, *_check_key(key)))
        frames = np.empty((self.num_candidates, self.horizon, state.size, state.size, 3), np.uint8)
        for i, sequence in enumerate(actions):
            imagined = state
            for h, action in enumerate(sequence):
                imagined = next_state(imagined, int(action))
                frames[i, h] = render(imagined)
        return _best(actions, frames, start)


def _close_sessions(engine: Any, session_ids: Sequence[str]) -> None:
    """Close every one of ``session_ids`` the engine holds, whatever fails; then raise the first failure.

    A close that raises must not leave the others resident (a planner's leftover candidates would
    refuse every later plan): each is tried, and the first error is raised with the later ones as
    notes.
    """
    errors: list[tuple[str, Exception]] = []
    for session_id in session_ids:
        try:
            if session_id in engine.sessions or session_id in engine.offloaded_sessions:
                engine.close_session(session_id)
        except Exception as error:  # noqa: BLE001 - collected, the first raised below
            errors.append((session_id, error))
    if errors:
        first = errors[0][1]
        first.add_note(f"closing session {errors[0][0]!r} failed; every other session was closed"
                       + ("" if len(errors) == 1 else ", except:"))
        for session_id, error in errors[1:]:
            first.add_note(f"  closing session {session_id!r} also failed: {type(error).__name__}: {error}")
        raise first


def _pages_in_use(engine: Any) -> int:
    """Distinct KV pages the engine's sessions hold (a page the candidates share counts once)."""
    return int(engine.runner.kv_cache.pages_in_use)


@dataclasses.dataclass(frozen=True)
class WorldModelPlanner:
    """Plan by forking the live session into ``num_candidates`` and imagining ``horizon`` steps (module docstring).

    The engine needs room for the live session and every candidate at once:
    ``num_candidates + 1 <= engine.session_capacity``.
    """

    num_candidates: int = 8
    horizon: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        _config(self.num_candidates, self.horizon, self.seed)

    def candidate_ids(self, live_id: str) -> list[str]:
        """The candidates' session ids: ``f"{live_id}/cand{i}"``."""
        return [f"{live_id}/cand{i}" for i in range(self.num_candidates)]

    def plan(self, engine: Any, live_id: str, *, observation: np.ndarray | None = None,
             key: int | Sequence[int] = ()) -> Plan:
        """Fork ``live_id`` into the candidates, imagine ``horizon`` batched steps, score, close the forks.

        With the live session absent (an episode's first step, or just re-anchored) the
        candidates start from ``observation`` instead (each one's first request carries it),
        which is then required. The forks are closed whatever happens; the live session is
        left as it was. ``key`` seeds the candidates with :attr:`seed` (:class:`OraclePlanner`).

        Shapes:
          observation: u8[size, size, 3]
        """
        capacity = engine.session_capacity
        if self.num_candidates + 1 > capacity:
            raise ValueError(f"num_candidates ({self.num_candidates}) + 1 (the live session) must not exceed the "
                             f"engine's session_capacity ({capacity})")
        forked = live_id in engine.sessions or live_id in engine.offloaded_sessions
        if not forked and observation is None:
            raise ValueError(f"live session {live_id!r} does not exist: pass observation (the real frame) to start "
                             "the candidates from")
        start = time.perf_counter()
        actions = candidate_actions(self.num_candidates, self.horizon, (self.seed, *_check_key(key)))
        ids = self.candidate_ids(live_id)
        clash = [cid for cid in ids if cid in engine.sessions or cid in engine.offloaded_sessions]
        if clash:
            raise ValueError(f"candidate session ids {clash} already exist on the engine")
        frames: np.ndarray | None = None
        before = _pages_in_use(engine)
        try:
            if forked:
                for cid in ids:
                    engine.fork_session(live_id, cid)
            pages = {"before": before, "after_fork": _pages_in_use(engine), "peak": _pages_in_use(engine)}
            for h in range(self.horizon):
                requests = []
                for i, cid in enumerate(ids):
                    inputs: dict[str, Any] = {"actions": actions[i, h:h + 1]}
                    if h == 0 and not forked:
                        inputs["observation"] = observation
                    requests.append(DiffusionRequest(f"{cid}/h{h}", extra_args={"session_id": cid}, inputs=inputs))
                outputs = engine.generate_batch(requests)
                step = np.stack([np.asarray(out.frames)[-1] for out in outputs])
                if frames is None:
                    frames = np.empty((self.num_candidates, self.horizon, *step.shape[1:]), np.uint8)
                frames[:, h] = step
                pages["peak"] = max(pages["peak"], _pages_in_use(engine))
        finally:
            _close_sessions(engine, ids)
        assert frames is not None
        return _best(actions, frames, start, forked=forked, pages=pages)


# -- episodes ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Episode:
    """One policy in one world.

    Attributes:
      policy: one of :data:`POLICIES`.
      world_seed: the SpriteWorld seed.
      reached: whether the agent reached the ball within the budget.
      steps: real steps taken (the step that reached the ball, or the budget).
      actions: the executed actions.
      decision_seconds: wall time of each decision.
      reanchors: times the live session was re-anchored (world-model planner only).
      real_frames: ``u8[steps + 1, size, size, 3]`` the simulator's frames (frame 0: reset).
      model_frames: the live session's frame for each real frame, when recorded (world-model planner;
        frame 0 is the observation; the other policies have no model and repeat the real frames).
      plans: each decision's :class:`Plan` (planners), when recorded.
      pages: each forked decision's KV ``pages`` (:attr:`Plan.pages`).
    """

    policy: str
    world_seed: int
    reached: bool = False
    steps: int = 0
    actions: list[int] = dataclasses.field(default_factory=list)
    decision_seconds: list[float] = dataclasses.field(default_factory=list)
    reanchors: int = 0
    real_frames: list[np.ndarray] = dataclasses.field(default_factory=list)
    model_frames: list[np.ndarray] = dataclasses.field(default_factory=list)
    plans: list[Plan] = dataclasses.field(default_factory=list)
    pages: list[dict[str, int]] = dataclasses.field(default_factory=list)


def _check_policy(policy: Any) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def run_episode(policy: str, world_seed: int, *, budget: int = 6, engine: Any = None,
                planner: WorldModelPlanner | OraclePlanner | None = None, seed: int = 0,
                record: bool = False) -> Episode:
    """Play ``policy`` in ``SpriteWorld(world_seed)`` until the agent reaches the ball or ``budget`` steps pass.

    ``"world-model planner"`` needs ``engine`` and a :class:`WorldModelPlanner`; ``"oracle
    planner"`` an :class:`OraclePlanner`; ``"random"`` draws from ``seed`` and the world seed.
    The world-model planner keeps a live session (``f"agent-world-{world_seed}"``) in step
    with the simulator: every executed action is fed to it, and when its frame differs from
    the observed one it is reset and restarted from the observed frame (a re-anchor). The
    live session is closed at the end. With ``record``, the frames and plans are kept (for
    the GIF).
    """
    policy = _check_policy(policy)
    world_seed = _check_seed("world_seed", world_seed)
    budget = check_positive_int("budget", budget)
    seed = _check_seed("seed", seed)
    if policy == "world-model planner":
        if not isinstance(planner, WorldModelPlanner) or engine is None:
            raise ValueError("policy 'world-model planner' needs engine and a WorldModelPlanner as planner")
    elif policy == "oracle planner" and not isinstance(planner, OraclePlanner):
        raise ValueError("policy 'oracle planner' needs an OraclePlanner as planner")
    size = engine.runner.pipeline.config.latent_height if engine is not None else 32
    world = SpriteWorld(world_seed, size=size)
    frame = world.reset()
    episode = Episode(policy=policy, world_seed=world_seed)
    rng = np.random.default_rng([seed, world_seed])
    live = f"agent-world-{world_seed}"
    if engine is not None and (live in engine.sessions or live in engine.offloaded_sessions):
        raise ValueError(f"the episode's live session id {live!r} is already taken on the engine")
    started = False
    if record:
        episode.real_frames.append(frame)
        episode.model_frames.append(frame)
    try:
        for t in range(budget):
            state = world.state
            start = time.perf_counter()
            plan = None
            if policy == "world-model planner":
                plan = planner.plan(engine, live, observation=None if started else frame, key=(world_seed, t))
                action = plan.action
                if plan.pages is not None and plan.forked:
                    episode.pages.append(plan.pages)
            elif policy == "oracle planner":
                plan = planner.plan(state, key=(world_seed, t))
                action = plan.action
            elif policy == "greedy":
                action = greedy_action(state)
            else:
                action = int(rng.integers(_NUM_ACTIONS))
            episode.decision_seconds.append(time.perf_counter() - start)
            episode.actions.append(action)
            new_frame = world.step(action)
            episode.steps = t + 1
            episode.reached = reached_ball(world.state)
            model_frame = None
            if policy == "world-model planner":
                inputs: dict[str, Any] = {"actions": np.array([action], np.int32)}
                if not started:
                    inputs["observation"] = frame
                out = engine.generate(DiffusionRequest(f"{live}/t{t}", extra_args={"session_id": live},
                                                       inputs=inputs))
                started = True
                model_frame = np.asarray(out.frames)[-1]
                if not np.array_equal(model_frame, new_frame):
                    engine.reset_session(live)  # re-anchor: the next request starts it from the observed frame
                    started = False
                    episode.reanchors += 1
            if record:
                episode.real_frames.append(new_frame)
                episode.model_frames.append(new_frame if model_frame is None else model_frame)
                if plan is not None:
                    episode.plans.append(plan)
            frame = new_frame
            if episode.reached:
                break
    finally:
        if engine is not None and (live in engine.sessions or live in engine.offloaded_sessions):
            engine.close_session(live)
    return episode


# -- the comparison ------------------------------------------------------------------------------


def _policy_row(episodes: Sequence[Episode]) -> dict[str, Any]:
    reached = [e for e in episodes if e.reached]
    decisions = sum(len(e.decision_seconds) for e in episodes)
    seconds = sum(sum(e.decision_seconds) for e in episodes)
    return {
        "worlds": len(episodes),
        "reached": len(reached),
        "success_rate": len(reached) / len(episodes),
        "mean_steps_to_reach": statistics.fmean(e.steps for e in reached) if reached else None,
        "decisions": decisions,
        "decisions_per_second": decisions / seconds if seconds > 0 else None,
        "reanchors": sum(e.reanchors for e in episodes),
    }


def agent_table(summary: dict[str, Any]) -> str:
    """The success table of a :func:`run_agent_demo` summary, as markdown."""
    rows = summary["policies"]
    lines = [f"SpriteWorld: reach the ball within {summary['budget']} steps, {summary['worlds']} worlds "
             f"(seeds {summary['world_seeds'][0]}-{summary['world_seeds'][-1]}); planners: "
             f"N = {summary['num_candidates']} candidates, H = {summary['horizon']} steps.", "",
             "| policy | success | mean steps to reach | decisions/s | re-anchors |",
             "|---|---|---|---|---|"]
    for name in POLICIES:
        row = rows[name]
        steps = "-" if row["mean_steps_to_reach"] is None else f"{row['mean_steps_to_reach']:.2f}"
        planner = name.endswith("planner")  # the baselines' decisions take microseconds: not a figure to compare
        rate = "-" if row["decisions_per_second"] is None or not planner else f"{row['decisions_per_second']:.1f}"
        reanchors = str(row["reanchors"]) if name == "world-model planner" else "-"
        lines.append(f"| {name} | {row['reached']}/{row['worlds']} ({row['success_rate']:.0%}) | {steps} | {rate} | "
                     f"{reanchors} |")
    target = summary["target"]
    machine = summary["machine"]
    lines += ["", f"World-model planner / oracle success: {target['ratio_to_oracle']:.2f} (target >= 0.9: "
                  f"{'met' if target['ratio_to_oracle_met'] else 'not met'}); beats greedy: "
                  f"{'yes' if target['beats_greedy'] else 'no'}.",
              f"Decisions/s measured on {machine.get('cpu_model', '?')} ({machine.get('cpu_count', '?')} cores "
              f"visible; {machine.get('device', '?')}).", ""]
    pages = summary["kv_pages"]
    lines += ["| KV pages (pool: %s) | at fork | rollout peak |" % pages["pool_pages"], "|---|---|---|"]
    for label, key in (("with forks", "with_forks"), ("copying", "copying")):
        value = pages[key]
        if isinstance(value, dict):
            lines.append(f"| {label} | {value['at_fork']} | {value['peak']} |")
        else:
            lines.append(f"| {label} | {value} | {value} |")
    return "\n".join(lines) + "\n"


def _kv_pages(engine: Any, episodes: Sequence[Episode], num_candidates: int, horizon: int) -> dict[str, Any]:
    """KV pages of the forked decisions with forks (measured) and with copying (computed), at the fullest live session.

    A copy holds every page of the live session at once; each of its ``H`` writes then
    fills a slot of its own, up to ``sink + window`` slots per run. Forks share the live
    session's pages and take a page only for a slot they write.
    """
    cache = engine.runner.kv_cache
    spec = cache.spec
    slots = spec.sink_frames + spec.window_frames
    runs = max(1, cache.session_pages // slots)
    measured = [pages for episode in episodes for pages in episode.pages]
    result: dict[str, Any] = {"pool_pages": int(cache.layout.num_pages), "session_pages": int(cache.session_pages),
                              "forked_decisions": len(measured)}
    if not measured:
        result["with_forks"] = result["copying"] = "pending"
        return result
    live = max(pages["before"] for pages in measured)
    fullest = [pages for pages in measured if pages["before"] == live]
    copy_peak = live + num_candidates * runs * min(slots, live // runs + horizon)
    result["live_session_pages"] = live
    result["copying"] = {"at_fork": live * (1 + num_candidates), "peak": copy_peak,
                         "how": "computed: each of the N candidates holds a private copy of the live session's pages"}
    figures = {"at_fork": max(p["after_fork"] for p in fullest), "peak": max(p["peak"] for p in fullest)}
    module = getattr(getattr(type(engine), "fork_session", None), "__module__", "") or ""
    if module.startswith("ardiff_jax."):
        result["with_forks"] = figures | {"how": "measured: engine.runner.kv_cache.pages_in_use"}
    else:  # a stand-in (a test's copying fork_session): what it used is not the forks' figure
        result["with_forks"] = "pending"
        result["stand_in_measured"] = figures | {"how": f"pages_in_use under the stand-in fork_session ({module})"}
    return result


def _scaled(frame: np.ndarray, scale: int) -> np.ndarray:
    return np.repeat(np.repeat(frame, scale, axis=0), scale, axis=1)


def _episode_gif(episode: Episode, path: Path, *, scale: int = 3) -> None:
    """One GIF frame per decision: real | model | each candidate's imagined frame at the horizon, labelled."""
    from PIL import Image, ImageDraw

    from ardiff_jax.demo import GIF_LEGEND

    if not episode.plans:
        raise ValueError("the episode has no recorded plans")
    side = episode.real_frames[0].shape[0] * scale
    pad, header, footer = 4, 24, 38
    panels = 2 + len(episode.plans[0].actions)
    width = panels * (side + pad) + pad
    pictures = []
    for t, plan in enumerate([*episode.plans, None]):
        picture = Image.new("RGB", (width, header + side + footer), (255, 255, 255))
        draw = ImageDraw.Draw(picture)
        done = plan is None
        caption = (f"seed {episode.world_seed}, step {t}: " +
                   ("reached the ball" if done and episode.reached else "end" if done else
                    f"plays {ACTION_NAMES[plan.action]}"))
        draw.text((pad, 1), caption, fill=(0, 0, 0))
        tiles = [("real", episode.real_frames[t], None), ("model", episode.model_frames[t], None)]
        if plan is not None:
            for a, frames, score in zip(plan.actions, plan.frames, plan.scores, strict=True):
                h = int(REACHED_SCORE - score) if score > REACHED_SCORE / 2 else len(frames) - 1
                tiles.append((f"{ACTION_NAMES[int(a[0])]}", frames[h], score))
        for i, (label, frame, score) in enumerate(tiles):
            x = pad + i * (side + pad)
            if plan is not None and i - 2 == plan.best:
                draw.rectangle([x - 2, header - 2, x + side + 1, header + side + 1], outline=(255, 0, 0), width=2)
            picture.paste(Image.fromarray(_scaled(frame, scale)), (x, header))
            draw.text((x, header + side + 2), label, fill=(0, 0, 0))
            if score is not None:
                text = (f"{score:.0f} (reach @{int(REACHED_SCORE - score) + 1})" if score > REACHED_SCORE / 2
                        else "lost the ball" if score == LOST_SCORE else f"{score:.1f}")
                draw.text((x, header + side + 13), text, fill=(96, 96, 96))
        draw.text((pad, header + side + 25), "   ".join(GIF_LEGEND), fill=(96, 96, 96))
        if plan is not None:
            draw.text((2 * (side + pad) + pad, 12), f"imagined: where it reaches the ball, else at the horizon "
                                                   f"(H = {plan.frames.shape[1]}); label: first action, score; "
                                                   "red: chosen", fill=(96, 96, 96))
        pictures.append(picture)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=700, loop=0)


def _pick_gif_episode(episodes: dict[str, list[Episode]]) -> Episode:
    """A world-model episode that reached the ball where greedy did not (else the longest one that reached)."""
    model = episodes["world-model planner"]
    greedy = {e.world_seed: e for e in episodes["greedy"]}
    for episode in model:
        if episode.reached and not greedy[episode.world_seed].reached and len(episode.plans) > 1:
            return episode
    reached = [e for e in model if e.reached] or model
    return max(reached, key=lambda e: len(e.plans))


def run_agent_demo(out_dir: str | Path, *, worlds: int = 32, budget: int = 6, num_candidates: int = 8,
                   horizon: int = 6, seed: int = 0, progress: bool = True,
                   weights: str | Path | None = None) -> dict[str, Any]:
    """Compare the four :data:`POLICIES` on the same worlds; write the outputs into ``out_dir``; returns the summary.

    Worlds ``AGENT_FIRST_WORLD + seed + i`` for ``i < worlds``; ``seed`` also seeds the
    random policy and the planners' candidates. The engine gets room for the live session
    and the candidates (``session_capacity = num_candidates + 1``). Writes
    ``agent_summary.json``, ``agent_table.md`` and ``agent_episode.gif``.
    """
    from tqdm.auto import tqdm

    from ardiff_jax.models import pretrained
    from ardiff_jax.runtime import ARDiffusionEngine
    from ardiff_jax.types import EngineConfig

    worlds = check_positive_int("worlds", worlds)
    budget = check_positive_int("budget", budget)
    num_candidates, horizon, seed = _config(num_candidates, horizon, seed)
    out = Path(out_dir)
    started = time.perf_counter()
    world_seeds = [AGENT_FIRST_WORLD + seed + i for i in range(worlds)]
    oracle = OraclePlanner(num_candidates, horizon, seed)
    planner = WorldModelPlanner(num_candidates, horizon, seed)
    pipeline = pretrained("sprite_world", session_capacity=num_candidates + 1, weights=weights)
    config = EngineConfig(dtype="float32", available_memory_bytes=2**28, gpu_memory_fraction=1.0)
    episodes: dict[str, list[Episode]] = {name: [] for name in POLICIES}
    with ARDiffusionEngine(pipeline, config) as engine:
        if engine.session_capacity < num_candidates + 1:
            raise ValueError(f"num_candidates ({num_candidates}) + 1 exceeds the session capacity the memory "
                             f"budget allows ({engine.session_capacity})")
        with tqdm(total=len(POLICIES) * worlds, unit="episode", disable=not progress) as bar:
            for name in POLICIES:
                bar.set_description(name)
                for world_seed in world_seeds:
                    episodes[name].append(run_episode(
                        name, world_seed, budget=budget, seed=seed, record=name == "world-model planner",
                        engine=engine if name == "world-model planner" else None,
                        planner={"oracle planner": oracle, "world-model planner": planner}.get(name)))
                    bar.update(1)
        kv_pages = _kv_pages(engine, episodes["world-model planner"], num_candidates, horizon)
        fork = getattr(type(engine), "fork_session", None)
    rows = {name: _policy_row(episodes[name]) for name in POLICIES}
    model_rate, oracle_rate = rows["world-model planner"]["success_rate"], rows["oracle planner"]["success_rate"]
    ratio = model_rate / oracle_rate if oracle_rate > 0 else float("nan")
    summary: dict[str, Any] = {
        "task": "reach the ball (ardiff_jax.envs.reached_ball: agent and ball cells share an edge) within the budget",
        "worlds": worlds,
        "world_seeds": world_seeds,
        "budget": budget,
        "num_candidates": num_candidates,
        "horizon": horizon,
        "seed": seed,
        "policies": rows,
        "target": {"ratio_to_oracle": ratio, "ratio_to_oracle_met": bool(ratio >= 0.9),
                   "beats_greedy": bool(model_rate > rows["greedy"]["success_rate"])},
        "machine": machine_summary(),
        "fork_session": f"{getattr(fork, '__module__', '?')}.{getattr(fork, '__qualname__', '?')}",
        "kv_pages": kv_pages,
        "per_world": [{"world_seed": world_seed} | {name: {"reached": episodes[name][i].reached,
                                                          "steps": episodes[name][i].steps} for name in POLICIES}
                      for i, world_seed in enumerate(world_seeds)],
        "wall_seconds": None,
    }
    out.mkdir(parents=True, exist_ok=True)
    gif_episode = _pick_gif_episode(episodes)
    summary["gif_world_seed"] = gif_episode.world_seed
    _episode_gif(gif_episode, out / "agent_episode.gif")
    summary["wall_seconds"] = time.perf_counter() - started
    (out / "agent_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "agent_table.md").write_text(agent_table(summary))
    return summary


# -- the command line ----------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--agent``, ``--worlds``, ``--budget``, ``--candidates``, ``--horizon`` (``ardiff-jax demo --agent``).

    :func:`run_agent_from_args` also reads the demo's ``--out``, ``--seed``, ``--weights`` and
    ``--no-progress`` when the parser has them.
    """
    group = parser.add_argument_group("agent (--agent: plan inside the world model; ardiff_jax.planning)")
    group.add_argument("--agent", action="store_true",
                       help="run the model-predictive controller comparison instead of the tracking demo")
    group.add_argument("--worlds", type=_positive, default=32, help="worlds (seeds from 200 + --seed) per policy")
    group.add_argument("--budget", type=_positive, default=6, help="real steps the agent has to reach the ball")
    group.add_argument("--candidates", type=_positive, default=8, help="candidate action sequences per decision (N)")
    group.add_argument("--horizon", type=_positive, default=6, help="imagined steps per candidate (H)")


def run_agent_from_args(args: argparse.Namespace) -> int:
    """Run :func:`run_agent_demo` from parsed arguments, print the table; returns the exit status (2: refused)."""
    import sys

    try:
        summary = run_agent_demo(args.out, worlds=args.worlds, budget=args.budget, num_candidates=args.candidates,
                                 horizon=args.horizon, seed=getattr(args, "seed", 0),
                                 progress=not getattr(args, "no_progress", False),
                                 weights=getattr(args, "weights", None))
    except ValueError as error:
        print(f"ardiff-jax demo --agent: error: {error}", file=sys.stderr)
        return 2
    print(agent_table(summary), end="")
    print(f"outputs in {args.out}: agent_summary.json, agent_table.md, agent_episode.gif")
    return 0
