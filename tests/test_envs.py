"""SpriteWorld: deterministic worlds, the rules (walls, bounces, corners), frames that show the whole state, clips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ardiff_jax.envs import (
    ACTION_NAMES,
    AGENT_COLOUR,
    BACKGROUND_COLOUR,
    CELL_SIZE,
    WALL_COLOUR,
    SpriteWorld,
    SpriteWorldState,
    _sprite_world,
    ball_colour,
    clip_world_seeds,
    decode,
    initial_state,
    next_state,
    render,
    sprite_world_clips,
    transition,
)

NOOP, UP, DOWN, LEFT, RIGHT = range(5)


def world(picture: str, velocity=(1, 1)) -> SpriteWorldState:
    """A state drawn as text: ``#`` wall, ``A`` agent, ``o`` ball, ``.`` free."""
    rows = picture.split()
    cells = {char: [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == char] for char in "Ao"}
    walls = tuple(tuple(ch == "#" for ch in row) for row in rows)
    return SpriteWorldState(walls=walls, agent=cells["A"][0], ball=cells["o"][0], ball_velocity=velocity)


def ball_after(picture: str, velocity, action=NOOP):
    state = next_state(world(picture, velocity), action)
    return state.ball, state.ball_velocity


def free_cells_connected(walls: np.ndarray) -> bool:
    free = {tuple(cell) for cell in np.argwhere(~walls)}
    start = next(iter(free))
    seen, frontier = {start}, [start]
    while frontier:
        r, c = frontier.pop()
        for cell in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if cell in free and cell not in seen:
                seen.add(cell)
                frontier.append(cell)
    return seen == free


def random_actions(rng: np.random.Generator, steps: int) -> list[int]:
    actions, previous = [], int(rng.integers(5))
    for _ in range(steps):
        previous = previous if rng.random() < 0.6 else int(rng.integers(5))
        actions.append(previous)
    return actions


# -- the seed decides the world -------------------------------------------------------------------


def test_reset_is_a_function_of_the_seed():
    env, twin = SpriteWorld(7), SpriteWorld(7)
    first = env.reset()
    assert first.shape == (32, 32, 3) and first.dtype == np.uint8
    np.testing.assert_array_equal(twin.reset(), first)
    actions = random_actions(np.random.default_rng(0), 40)
    rollout = [env.step(a) for a in actions]
    np.testing.assert_array_equal(np.stack([twin.step(a) for a in actions]), np.stack(rollout))
    assert not np.array_equal(rollout[-1], first)  # it moved, and reset brings it back
    first[:] = 0  # frames are the caller's: scribbling on one changes nothing
    np.testing.assert_array_equal(env.reset(), twin.reset().copy())
    np.testing.assert_array_equal(env.reset(), render(initial_state(7)))
    assert decode(env.reset()) == initial_state(7) == env.state


def test_different_seeds_give_different_worlds():
    frames = [SpriteWorld(seed).reset() for seed in range(64)]
    assert len({frame.tobytes() for frame in frames}) == 64
    walls = {initial_state(seed).walls for seed in range(64)}
    assert len(walls) > 32  # the obstacles move, not only the sprites


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), size=st.sampled_from([24, 32, 48]))
def test_reset_layout_invariants(seed, size):
    state = initial_state(seed, size)  # SpriteWorldState itself refuses overlaps and a missing border
    walls = np.asarray(state.walls)
    n = size // CELL_SIZE
    assert walls.shape == (n, n) and state.size == size
    assert walls[1:-1, 1:-1].sum() == (n - 2) ** 2 // 9
    assert free_cells_connected(walls)
    # The ball never starts stuck: with the agent standing still its first step is a clean diagonal move.
    moved = next_state(state, NOOP)
    assert moved.ball == tuple(np.add(state.ball, state.ball_velocity)) and moved.ball_velocity == state.ball_velocity


def test_rejected_layouts_are_redrawn_and_the_fallback_has_no_obstacles():
    seeds = np.arange(300, dtype=np.uint64)
    _, first_ok = _sprite_world._try_layouts(seeds, 8, attempt=0, num_obstacles=4)
    rejected = [int(s) for s in seeds[~first_ok]]
    assert rejected, "no seed's first attempt was rejected: the test needs a seed that is"
    for seed in rejected:
        walls = np.asarray(initial_state(seed).walls)
        assert walls[1:-1, 1:-1].sum() == 4 and free_cells_connected(walls)
    fallback = _sprite_world._initial_worlds(np.arange(50, dtype=np.uint64), 24, max_attempts=0)
    assert not fallback.walls[:, 1:-1, 1:-1].any()
    for index in range(50):
        state = _sprite_world._unstack(fallback, index)
        assert next_state(state, NOOP).ball == tuple(np.add(state.ball, state.ball_velocity))


# -- the rules --------------------------------------------------------------------------------------

ROOM = """
######
#....#
#....#
#.#..#
#...A#
######
"""


def test_walls_block_the_agent():
    corner = world("""
        ######
        #A...#
        #.#..#
        #....#
        #...o#
        ######""", velocity=(-1, -1))
    assert next_state(corner, UP).agent == (1, 1)
    assert next_state(corner, LEFT).agent == (1, 1)
    assert next_state(corner, RIGHT).agent == (1, 2)
    assert next_state(corner, DOWN).agent == (2, 1)
    assert next_state(corner, NOOP).agent == (1, 1)
    beside_obstacle = world("""
        ######
        #....#
        #.#A.#
        #....#
        #o...#
        ######""", velocity=(-1, 1))
    assert next_state(beside_obstacle, LEFT).agent == (2, 3)  # the interior obstacle is solid
    assert next_state(beside_obstacle, UP).agent == (1, 3)


def test_the_agent_cannot_push_into_the_ball():
    # The ball is leaving (2, 2) this step, but the agent moves first and the ball is still there.
    state = next_state(world("""
        ######
        #....#
        #.oA.#
        #....#
        #....#
        ######""", velocity=(-1, -1)), LEFT)
    assert state.agent == (2, 3) and state.ball == (1, 1)


def test_ball_moves_diagonally_through_free_space():
    assert ball_after("""
        ######
        #....#
        #.o..#
        #....#
        #...A#
        ######""", (1, 1)) == ((3, 3), (1, 1))


@pytest.mark.parametrize("picture, velocity, expected", [
    # wall above: d_row flips
    ("######\n#.o..#\n#....#\n#....#\n#...A#\n######", (-1, 1), ((2, 3), (1, 1))),
    # wall to the right: d_col flips
    ("######\n#....#\n#...o#\n#....#\n#A...#\n######", (1, 1), ((3, 3), (1, -1))),
    # inside corner (both neighbours solid): both flip, it goes back
    ("######\n#o...#\n#....#\n#....#\n#...A#\n######", (-1, -1), ((2, 2), (1, 1))),
    # an obstacle's outer corner dead ahead (only the diagonal solid): back the way it came
    ("######\n#....#\n#.o..#\n#..#.#\n#A...#\n######", (1, 1), ((1, 1), (-1, -1))),
    # bounced off the ceiling into an obstacle: back the way it came
    ("######\n#.o..#\n#..#.#\n#....#\n#...A#\n######", (-1, 1), ((2, 1), (1, -1))),
    # boxed in on all four diagonals: stays, and turns round
    ("######\n##.#.#\n#.o..#\n##.#.#\n#...A#\n######", (1, 1), ((2, 2), (-1, -1))),
    # the agent is solid to the ball
    ("######\n#....#\n#.o..#\n#..A.#\n#....#\n######", (1, 1), ((1, 1), (-1, -1))),
])
def test_ball_bounces(picture, velocity, expected):
    assert ball_after(picture, velocity) == expected


def test_the_agent_moves_first_and_the_ball_bounces_off_its_new_cell():
    picture = """
        ######
        #....#
        #.o..#
        #....#
        #..A.#
        ######"""
    assert ball_after(picture, (1, 1), NOOP) == ((3, 3), (1, 1))
    state = next_state(world(picture, (1, 1)), UP)  # the agent steps into (3, 3), where the ball was headed
    assert state.agent == (3, 3) and (state.ball, state.ball_velocity) == ((1, 1), (-1, -1))


def test_ball_colour_encodes_its_direction_and_its_shape_sets_it_apart():
    expected = {(-1, -1): (255, 0, 0), (-1, 1): (255, 0, 255), (1, -1): (255, 255, 0), (1, 1): (255, 255, 255)}
    others = {BACKGROUND_COLOUR, WALL_COLOUR, AGENT_COLOUR}
    assert len(set(expected.values()) | others) == 7
    for velocity, colour in expected.items():
        assert ball_colour(velocity) == colour
        state = world(ROOM.replace("#....#\n#.#", "#.o..#\n#.#", 1), velocity)
        frame = render(state)
        r, c = (CELL_SIZE * x for x in state.ball)
        sprite = frame[r:r + CELL_SIZE, c:c + CELL_SIZE]
        corners = sprite[[0, 0, -1, -1], [0, -1, 0, -1]]
        assert (corners == BACKGROUND_COLOUR).all()
        assert (sprite[1:-1].reshape(-1, 3) == colour).all() and (sprite[:, 1:-1].reshape(-1, 3) == colour).all()
        ar, ac = (CELL_SIZE * x for x in state.agent)
        assert (frame[ar:ar + CELL_SIZE, ac:ac + CELL_SIZE] == AGENT_COLOUR).all()  # the agent is a full square
        assert (frame[:CELL_SIZE] == WALL_COLOUR).all()
        assert decode(frame).ball_velocity == velocity


# -- every frame shows the whole state ----------------------------------------------------------------


def test_transition_from_pixels_equals_step_over_long_random_rollouts():
    rng = np.random.default_rng(1)
    for seed in range(16):
        size = (24, 32, 40)[seed % 3]
        env = SpriteWorld(seed, size=size)
        frame = env.reset()
        balls = set()
        for action in random_actions(rng, 150):
            predicted = transition(frame, action)
            frame = env.step(action)
            np.testing.assert_array_equal(predicted, frame, err_msg=f"seed {seed}")
            balls.add(env.state.ball)
        assert len(balls) > 3, f"seed {seed}: the ball hardly moved"


# -- clips -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [24, 32])
def test_clips_equal_stepping_each_world(size):
    frames, actions = sprite_world_clips(seed=11, batch=6, length=40, size=size)
    assert frames.shape == (6, 40, size, size, 3) and frames.dtype == np.uint8
    assert actions.shape == (6, 40) and actions.dtype == np.int32
    assert (actions[:, 0] == 0).all() and ((actions >= 0) & (actions < 5)).all()
    for index, world_seed in enumerate(clip_world_seeds(11, 6)):
        env = SpriteWorld(int(world_seed), size=size)
        expected = [env.reset()] + [env.step(int(a)) for a in actions[index, 1:]]
        np.testing.assert_array_equal(frames[index], np.stack(expected), err_msg=f"clip {index}")


def test_clips_are_deterministic_and_seeds_do_not_share_worlds():
    frames, actions = sprite_world_clips(seed=3, batch=4, length=8)
    again_frames, again_actions = sprite_world_clips(seed=3, batch=4, length=8)
    np.testing.assert_array_equal(frames, again_frames)
    np.testing.assert_array_equal(actions, again_actions)
    other_frames, _ = sprite_world_clips(seed=4, batch=4, length=8)
    assert not np.array_equal(frames[:, 0], other_frames[:, 0])
    assert not set(clip_world_seeds(3, 64).tolist()) & set(clip_world_seeds(4, 64).tolist())
    assert len(set(clip_world_seeds(3, 64).tolist())) == 64
    one_frame, no_op = sprite_world_clips(seed=3, batch=4, length=1)
    np.testing.assert_array_equal(one_frame[:, 0], frames[:, 0])
    assert no_op.tolist() == [[0]] * 4


def test_clip_actions_repeat_with_the_given_probability():
    _, always = sprite_world_clips(seed=5, batch=32, length=16, repeat_probability=1.0)
    assert (always[:, 2:] == always[:, 1:2]).all()
    assert len(set(always[:, 1].tolist())) > 1
    _, never = sprite_world_clips(seed=5, batch=64, length=64, repeat_probability=0)
    repeats = (never[:, 2:] == never[:, 1:-1]).mean()
    assert 0.15 < repeats < 0.25, repeats  # uniform draws match the previous action 1 time in 5


# -- the API and bad input ---------------------------------------------------------------------------


def test_action_space_and_numpy_integers():
    env = SpriteWorld(np.int64(5), size=np.int32(32))
    assert env.num_actions == 5 and env.action_names == ACTION_NAMES and ACTION_NAMES[0] == "no-op"
    assert (env.seed, env.size) == (5, 32) and repr(env) == "SpriteWorld(seed=5, size=32)"
    frame = env.reset()
    np.testing.assert_array_equal(env.step(np.int8(RIGHT)), transition(frame, RIGHT))


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.0, "3", None])
def test_bad_seeds(seed):
    with pytest.raises(ValueError, match="seed must be an integer"):
        SpriteWorld(seed)
    with pytest.raises(ValueError, match="seed must be an integer"):
        sprite_world_clips(seed, batch=2, length=2)
    with pytest.raises(ValueError, match="seed must be an integer"):
        initial_state(seed)


@pytest.mark.parametrize("size", [0, 20, 30, 33, -32, True, 32.0, "32"])
def test_bad_sizes(size):
    with pytest.raises(ValueError, match=f"size must be .*got {size!r}"):
        SpriteWorld(0, size=size)
    with pytest.raises(ValueError, match="size must be"):
        sprite_world_clips(0, batch=2, length=2, size=size)


@pytest.mark.parametrize("action", [True, 1.0, -1, 5, np.int64(5), "1", None])
def test_bad_actions_raise_and_change_nothing(action):
    env = SpriteWorld(2)
    env.reset()
    env.step(RIGHT)
    before = env.state
    with pytest.raises(ValueError, match="action must be an integer in \\[0, 5\\)"):
        env.step(action)
    assert env.state == before
    with pytest.raises(ValueError, match="action must be"):
        next_state(before, action)
    with pytest.raises(ValueError, match="action must be"):
        transition(render(before), action)


def test_step_before_reset_is_refused():
    env = SpriteWorld(2)
    with pytest.raises(RuntimeError, match="call reset\\(\\) first"):
        env.step(NOOP)
    with pytest.raises(RuntimeError, match="call reset\\(\\) first"):
        _ = env.state


@pytest.mark.parametrize("kwargs, match", [
    ({"batch": 0}, "batch must be a positive integer, got 0"),
    ({"batch": True}, "batch must be a positive integer, got True"),
    ({"length": 0}, "length must be a positive integer, got 0"),
    ({"length": 2.0}, "length must be a positive integer, got 2.0"),
    ({"repeat_probability": 1.5}, "repeat_probability must be a number in \\[0, 1\\], got 1.5"),
    ({"repeat_probability": -0.1}, "repeat_probability must be .*got -0.1"),
    ({"repeat_probability": float("nan")}, "repeat_probability must be .*got nan"),
    ({"repeat_probability": True}, "repeat_probability must be .*got True"),
    ({"repeat_probability": "0.5"}, "repeat_probability must be .*got '0.5'"),
])
def test_bad_clip_arguments(kwargs, match):
    arguments = {"seed": 0, "batch": 2, "length": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        sprite_world_clips(**arguments)


def test_decode_refuses_what_is_not_a_sprite_world_frame():
    frame = SpriteWorld(3).reset()
    state = decode(frame)
    with pytest.raises(ValueError, match="uint8"):
        decode(frame.astype(np.float32))
    with pytest.raises(ValueError, match="shape"):
        decode(frame[..., 0])
    with pytest.raises(ValueError, match="shape"):
        decode(frame[:, :28])
    with pytest.raises(ValueError, match="size must be .*got 20"):
        decode(frame[:20, :20])
    unknown = frame.copy()
    unknown[:4, :4] = (1, 2, 3)
    with pytest.raises(ValueError, match=r"cell \(0, 0\) has colour \(1, 2, 3\)"):
        decode(unknown)
    two_agents = render(state).copy()
    spare = next((r, c) for r in range(1, 7) for c in range(1, 7)
                 if not state.walls[r][c] and (r, c) not in (state.agent, state.ball))
    two_agents[4 * spare[0]:4 * spare[0] + 4, 4 * spare[1]:4 * spare[1] + 4] = AGENT_COLOUR
    with pytest.raises(ValueError, match="exactly one agent and one ball"):
        decode(two_agents)
    no_border = frame.copy()
    no_border[:4, 8:12] = BACKGROUND_COLOUR
    with pytest.raises(ValueError, match=r"border ring; missing at cells \[\(0, 2\)\]"):
        decode(no_border)
    stray_pixel = frame.copy()
    r, c = (4 * x for x in state.ball)
    stray_pixel[r, c] = stray_pixel[r + 1, c + 1]  # a ball corner painted in
    with pytest.raises(ValueError, match=f"pixel \\({r}, {c}\\) differs"):
        decode(stray_pixel)


def test_bad_states_are_refused():
    good = world(ROOM.replace("#....#\n#.#", "#.o..#\n#.#", 1))
    fields = {"walls": good.walls, "agent": good.agent, "ball": good.ball, "ball_velocity": good.ball_velocity}
    for change, match in [
        ({"ball": good.agent}, "agent and ball must be on different cells"),
        ({"agent": (3, 2)}, "agent must be on a free cell"),
        ({"ball": (9, 1)}, "ball must be on a free cell"),
        ({"agent": (1.0, 1)}, "agent row must be an integer"),
        ({"agent": 5}, "agent must be a \\(row, col\\) pair"),
        ({"ball_velocity": (0, 1)}, "ball_velocity must be .* each -1 or 1"),
        ({"ball_velocity": (True, 1)}, "ball_velocity must be"),
        ({"walls": np.ones((6, 6), int)}, "walls must be a square bool grid"),
        ({"walls": np.ones((6, 7), bool)}, "walls must be a square bool grid"),
        ({"walls": np.zeros((6, 6), bool)}, "border ring"),
        ({"walls": np.ones((5, 5), bool)}, "size must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpriteWorldState(**{**fields, **change})
    with pytest.raises(ValueError, match="state must be a SpriteWorldState"):
        next_state(render(good), NOOP)
    with pytest.raises(ValueError, match="state must be a SpriteWorldState"):
        render("state")
    with pytest.raises(ValueError, match="velocity must be"):
        ball_colour((1, 0))


def test_cell_templates_and_codes_read_every_cell_of_a_frame():
    from ardiff_jax.envs import cell_codes, cell_templates

    templates = cell_templates()
    assert templates.shape == (7, CELL_SIZE, CELL_SIZE, 3) and templates.dtype == np.uint8
    assert len({t.tobytes() for t in templates}) == 7  # seven distinct looks
    world = SpriteWorld(11)
    frames = [world.reset()]
    for action in [None, 4, 4, 2, 3, 1, 0, 4]:
        frame = frames[-1] if action is None else world.step(action)
        codes = cell_codes(frame)
        state = world.state
        assert codes[state.agent] == 2 and codes[state.ball] >= 3 and (codes >= 0).all()
        assert (codes == 1).sum() == sum(map(sum, state.walls))
    # A frame with a stray pixel has a cell of no known look: -1 there, every other cell read.
    frame = world.reset().copy()
    frame[1, 1] = (7, 7, 7)
    assert cell_codes(frame)[0, 0] == -1 and (cell_codes(frame)[1:] >= 0).all()
