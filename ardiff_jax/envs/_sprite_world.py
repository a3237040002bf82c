"""SpriteWorld's functional core and stateful shell; the world and its rules are described in
:mod:`ardiff_jax.envs`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from ardiff_jax._checks import check_int, check_positive_int, is_integer

__all__ = [
    "ACTION_NAMES",
    "AGENT_COLOUR",
    "BACKGROUND_COLOUR",
    "CELL_SIZE",
    "MIN_SIZE",
    "WALL_COLOUR",
    "SpriteWorld",
    "SpriteWorldState",
    "ball_colour",
    "cell_codes",
    "cell_templates",
    "clip_world_seeds",
    "decode",
    "initial_state",
    "next_state",
    "reached_ball",
    "render",
    "sprite_world_clips",
    "transition",
]

CELL_SIZE = 4
MIN_SIZE = 24
ACTION_NAMES = ("no-op", "up", "down", "left", "right")
BACKGROUND_COLOUR = (0, 0, 0)
WALL_COLOUR = (0, 0, 255)
AGENT_COLOUR = (0, 255, 0)

_MAX_SEED = 2**63  # exclusive: seeds fit int64, so clip_world_seeds can return an int64 array
_MAX_ATTEMPTS = 32  # ardiff_jax.envs' docstring quotes this number
# (d_row, d_col) per action, indexed by action.
_ACTION_OFFSETS = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]], np.int64)
# Cell codes: what a cell shows. Ball codes are 3 + velocity index (see _velocity_index).
_BACKGROUND, _WALL, _AGENT, _BALL = 0, 1, 2, 3


# Rendering palette indexed by cell code; ball velocity index v = 2 * (d_row > 0) + (d_col > 0).
_VELOCITIES = np.array([[-1, -1], [-1, 1], [1, -1], [1, 1]], np.int64)
# Red 255 marks the ball (nothing else on screen has red); green 255 iff it moves down, blue
# 255 iff it moves right.
_PALETTE = np.array([BACKGROUND_COLOUR, WALL_COLOUR, AGENT_COLOUR,
                     *((255, 255 * (d_row > 0), 255 * (d_col > 0)) for d_row, d_col in _VELOCITIES)], np.uint8)
# Pixel offsets inside the ball's cell that stay background: its four corners.
_BALL_CORNERS = np.array([[0, 0], [0, CELL_SIZE - 1], [CELL_SIZE - 1, 0], [CELL_SIZE - 1, CELL_SIZE - 1]], np.int64)


# -- validation ----------------------------------------------------------------------------------


def _check_seed(name: str, value: Any) -> int:
    if not is_integer(value) or not 0 <= int(value) < _MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}")
    return int(value)


def _check_size(value: Any) -> int:
    if not is_integer(value) or int(value) < MIN_SIZE or int(value) % CELL_SIZE:
        raise ValueError(f"size must be an integer multiple of {CELL_SIZE} that is at least {MIN_SIZE} "
                         f"(pixels per side), got {value!r}")
    return int(value)


def _check_action(value: Any) -> int:
    if not is_integer(value) or not 0 <= int(value) < len(ACTION_NAMES):
        raise ValueError(f"action must be an integer in [0, {len(ACTION_NAMES)}) "
                         f"(one of {ACTION_NAMES}), got {value!r}")
    return int(value)


def _check_cell(name: str, value: Any) -> tuple[int, int]:
    try:
        row, col = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (row, col) pair of integers, got {value!r}") from None
    return check_int(f"{name} row", row), check_int(f"{name} col", col)


def _check_velocity(name: str, value: Any) -> tuple[int, int]:
    try:
        d_row, d_col = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (d_row, d_col) pair, each -1 or 1, got {value!r}") from None
    if not all(is_integer(d) and int(d) in (-1, 1) for d in (d_row, d_col)):
        raise ValueError(f"{name} must be a (d_row, d_col) pair, each -1 or 1, got {value!r}")
    return int(d_row), int(d_col)


def ball_colour(velocity: tuple[int, int]) -> tuple[int, int, int]:
    """The ball's colour for ``velocity = (d_row, d_col)``: how a frame shows the ball's direction."""
    d_row, d_col = _check_velocity("velocity", velocity)
    return tuple(int(x) for x in _PALETTE[_BALL + 2 * (d_row > 0) + (d_col > 0)])


# -- the state -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpriteWorldState:
    """Everything a SpriteWorld frame shows (and so everything the next frame depends on).

    Fields are plain tuples, so states compare and hash by value.

    Attributes:
      walls: ``bool[n, n]`` as a tuple of row tuples, ``n = size // CELL_SIZE``; the border
        ring must be walls (it keeps the agent and ball inside the grid).
      agent: the agent's ``(row, col)`` cell.
      ball: the ball's ``(row, col)`` cell.
      ball_velocity: ``(d_row, d_col)``, each ``-1`` or ``1``.
    """

    walls: tuple[tuple[bool, ...], ...]
    agent: tuple[int, int]
    ball: tuple[int, int]
    ball_velocity: tuple[int, int]

    def __post_init__(self) -> None:
        walls = np.asarray(self.walls)
        if walls.dtype != np.bool_ or walls.ndim != 2 or walls.shape[0] != walls.shape[1]:
            raise ValueError(f"walls must be a square bool grid, got {self.walls!r}")
        n = walls.shape[0]
        _check_size(n * CELL_SIZE)
        border = np.ones((n, n), bool)
        border[1:-1, 1:-1] = False
        if not walls[border].all():
            raise ValueError("walls must include the whole border ring; missing at cells "
                             f"{[tuple(int(i) for i in cell) for cell in np.argwhere(border & ~walls)]}")
        agent = _check_cell("agent", self.agent)
        ball = _check_cell("ball", self.ball)
        velocity = _check_velocity("ball_velocity", self.ball_velocity)
        for name, (row, col) in (("agent", agent), ("ball", ball)):
            if not (0 <= row < n and 0 <= col < n) or walls[row, col]:
                raise ValueError(f"{name} must be on a free cell of the {n}x{n} grid, got {(row, col)}")
        if agent == ball:
            raise ValueError(f"agent and ball must be on different cells, both are at {agent}")
        object.__setattr__(self, "walls", tuple(tuple(bool(w) for w in row) for row in walls))
        object.__setattr__(self, "agent", agent)
        object.__setattr__(self, "ball", ball)
        object.__setattr__(self, "ball_velocity", velocity)

    @property
    def size(self) -> int:
        """Frame side in pixels."""
        return len(self.walls) * CELL_SIZE


class _Worlds(NamedTuple):
    """A batch of states as arrays: the functional core steps and renders these."""

    walls: np.ndarray  # bool[B, n, n]
    agent: np.ndarray  # i64[B, 2]
    ball: np.ndarray  # i64[B, 2]
    velocity: np.ndarray  # i64[B, 2]


def _stack(state: SpriteWorldState) -> _Worlds:
    return _Worlds(np.asarray(state.walls, bool)[None], np.array([state.agent], np.int64),
                   np.array([state.ball], np.int64), np.array([state.ball_velocity], np.int64))


def _unstack(worlds: _Worlds, index: int) -> SpriteWorldState:
    return SpriteWorldState(walls=worlds.walls[index], agent=tuple(worlds.agent[index]),
                            ball=tuple(worlds.ball[index]), ball_velocity=tuple(worlds.velocity[index]))


# -- the functional core (batched) -------------------------------------------------------------------


def _velocity_index(velocity: np.ndarray) -> np.ndarray:  # i64[B, 2] -> i64[B]
    return 2 * (velocity[:, 0] > 0) + (velocity[:, 1] > 0)


def _render_worlds(worlds: _Worlds, out: np.ndarray | None = None) -> np.ndarray:
    """u8[B, size, size, 3] frames of a batch of worlds (written into ``out`` when given)."""
    batch, n = worlds.walls.shape[:2]
    rows = np.arange(batch)
    codes = np.where(worlds.walls, _WALL, _BACKGROUND)
    codes[rows, worlds.agent[:, 0], worlds.agent[:, 1]] = _AGENT
    codes[rows, worlds.ball[:, 0], worlds.ball[:, 1]] = _BALL + _velocity_index(worlds.velocity)
    cells = _PALETTE[codes]  # u8[B, n, n, 3]
    size = n * CELL_SIZE
    pixels = np.broadcast_to(cells[:, :, None, :, None, :],
                             (batch, n, CELL_SIZE, n, CELL_SIZE, 3)).reshape(batch, size, size, 3)
    corner_rows = worlds.ball[:, 0, None] * CELL_SIZE + _BALL_CORNERS[None, :, 0]
    corner_cols = worlds.ball[:, 1, None] * CELL_SIZE + _BALL_CORNERS[None, :, 1]
    pixels[rows[:, None], corner_rows, corner_cols] = BACKGROUND_COLOUR
    if out is None:
        return pixels
    out[...] = pixels
    return out


def _step_worlds(worlds: _Worlds, actions: np.ndarray) -> _Worlds:
    """One step of every world in the batch; ``actions: int[B]`` (rules: :mod:`ardiff_jax.envs`)."""
    walls, agent, ball, velocity = worlds
    rows = np.arange(walls.shape[0])

    target = agent + _ACTION_OFFSETS[actions]
    agent_blocked = walls[rows, target[:, 0], target[:, 1]] | (target == ball).all(axis=1)
    agent = np.where(agent_blocked[:, None], agent, target)

    solid = walls.copy()
    solid[rows, agent[:, 0], agent[:, 1]] = True

    def blocked(cells: np.ndarray) -> np.ndarray:  # i64[B, 2] -> bool[B]
        return solid[rows, cells[:, 0], cells[:, 1]]

    flip = np.stack([blocked(ball + velocity * [1, 0]), blocked(ball + velocity * [0, 1])], axis=1)
    bounced = np.where(flip, -velocity, velocity)
    forward_free = ~blocked(ball + bounced)
    back_free = ~blocked(ball - velocity)
    new_ball = np.where(forward_free[:, None], ball + bounced,
                        np.where(back_free[:, None], ball - velocity, ball))
    new_velocity = np.where(forward_free[:, None], bounced, -velocity)
    return _Worlds(walls, agent, new_ball, new_velocity)


# -- reset: a counter-based hash of the seed -------------------------------------------------------

_U64 = np.uint64
_SPLITMIX_GAMMA = _U64(0x9E3779B97F4A7C15)
_SPLITMIX_M1, _SPLITMIX_M2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
# Stream tags keep the hash draws for different purposes independent.
_OBSTACLE_STREAM, _BALL_STREAM, _CLIP_STREAM, _ACTION_STREAM, _CHASE_STREAM = 1, 2, 3, 4, 5


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _SPLITMIX_GAMMA
        x = (x ^ (x >> _U64(30))) * _SPLITMIX_M1
        x = (x ^ (x >> _U64(27))) * _SPLITMIX_M2
    return x ^ (x >> _U64(31))


def _hash(*words: Any) -> np.ndarray:
    """u64 hash of broadcastable integer words (order matters)."""
    value = _splitmix(np.asarray(words[0], _U64))
    for word in words[1:]:
        value = _splitmix(value ^ np.asarray(word, _U64))
    return value


def _try_layouts(seeds: np.ndarray, n: int, attempt: int, num_obstacles: int) -> tuple[_Worlds, np.ndarray]:
    """One attempt at the reset state of each seed (u64[B]); returns the worlds and ``ok: bool[B]``."""
    batch, m = len(seeds), n - 2
    rows = np.arange(batch)
    cell_rows = 1 + np.arange(m * m) // m
    cell_cols = 1 + np.arange(m * m) % m

    order = np.argsort(_hash(seeds[:, None], attempt, _OBSTACLE_STREAM, np.arange(m * m)[None, :]), axis=1)
    walls = np.ones((batch, n, n), bool)
    walls[:, 1:-1, 1:-1] = False
    obstacles = order[:, :num_obstacles]
    walls[rows[:, None], cell_rows[obstacles], cell_cols[obstacles]] = True
    agent_cell = order[:, num_obstacles]
    agent = np.stack([cell_rows[agent_cell], cell_cols[agent_cell]], axis=1)

    # Ball candidates: every (interior cell, velocity); valid when its cell and the three cells
    # ahead are free of walls and the agent.
    solid = walls.copy()
    solid[rows, agent[:, 0], agent[:, 1]] = True
    cand_rows = np.repeat(cell_rows, 4)
    cand_cols = np.repeat(cell_cols, 4)
    cand_velocity = np.tile(_VELOCITIES, (m * m, 1))
    valid = np.ones((batch, 4 * m * m), bool)
    for d_row, d_col in ((0, 0), (1, 0), (0, 1), (1, 1)):
        valid &= ~solid[:, cand_rows + d_row * cand_velocity[:, 0], cand_cols + d_col * cand_velocity[:, 1]]
    keys = _hash(seeds[:, None], attempt, _BALL_STREAM, np.arange(4 * m * m)[None, :])
    choice = np.argmin(np.where(valid, keys, _U64(np.iinfo(_U64).max)), axis=1)
    has_ball = valid[rows, choice]
    ball = np.stack([cand_rows[choice], cand_cols[choice]], axis=1)
    velocity = cand_velocity[choice]

    # The free cells are connected iff a flood fill from the agent reaches all of them.
    free = ~walls
    reached = np.zeros_like(free)
    reached[rows, agent[:, 0], agent[:, 1]] = True
    while True:
        grown = reached.copy()
        grown[:, 1:] |= reached[:, :-1]
        grown[:, :-1] |= reached[:, 1:]
        grown[:, :, 1:] |= reached[:, :, :-1]
        grown[:, :, :-1] |= reached[:, :, 1:]
        grown &= free
        if np.array_equal(grown, reached):
            break
        reached = grown
    connected = (reached == free).all(axis=(1, 2))
    return _Worlds(walls, agent, ball, velocity), has_ball & connected


def _initial_worlds(seeds: np.ndarray, size: int, max_attempts: int = _MAX_ATTEMPTS) -> _Worlds:
    """The reset state of each world seed (u64[B]); see "Reset" in :mod:`ardiff_jax.envs`."""
    n = size // CELL_SIZE
    num_obstacles = (n - 2) ** 2 // 9
    batch = len(seeds)
    worlds = _Worlds(np.zeros((batch, n, n), bool), *(np.zeros((batch, 2), np.int64) for _ in range(3)))
    pending = np.arange(batch)
    for attempt in range(max_attempts + 1):
        obstacles = num_obstacles if attempt < max_attempts else 0
        tried, ok = _try_layouts(seeds[pending], n, attempt, obstacles)
        for field, value in zip(worlds, tried):
            field[pending[ok]] = value[ok]
        pending = pending[~ok]
        if not len(pending):
            break
    # Without obstacles an m x m interior (m >= 4) always has a free 2x2 block beside the agent.
    assert not len(pending), f"no layout for world seeds {seeds[pending]}"
    worlds.walls.flags.writeable = False  # shared by every later step of these worlds
    return worlds


# -- public pure functions -------------------------------------------------------------------------


def initial_state(seed: int, size: int = 32) -> SpriteWorldState:
    """The reset state of world ``seed`` (what :meth:`SpriteWorld.reset` shows)."""
    seed = _check_seed("seed", seed)
    size = _check_size(size)
    return _unstack(_initial_worlds(np.array([seed], _U64), size), 0)


def next_state(state: SpriteWorldState, action: int) -> SpriteWorldState:
    """The state after ``action`` (an index into ``ACTION_NAMES``); the rules: :mod:`ardiff_jax.envs`."""
    if not isinstance(state, SpriteWorldState):
        raise ValueError(f"state must be a SpriteWorldState, got {state!r}")
    action = _check_action(action)
    return _unstack(_step_worlds(_stack(state), np.array([action])), 0)


def reached_ball(state: SpriteWorldState) -> bool:
    """Whether the agent has reached the ball: their cells share an edge.

    The two never share a cell (the ball is solid to the agent, and the agent's new cell is
    solid to the ball), so sharing an edge is as close as the agent gets: the ball is then
    in the cell the agent would step into, and pushing into it does nothing. A diagonal
    neighbour does not count: the ball's corner pixels are background, so the two sprites
    do not touch on screen (the ball may still bounce off the agent from there).
    """
    if not isinstance(state, SpriteWorldState):
        raise ValueError(f"state must be a SpriteWorldState, got {state!r}")
    return abs(state.agent[0] - state.ball[0]) + abs(state.agent[1] - state.ball[1]) == 1


def render(state: SpriteWorldState) -> np.ndarray:
    """The frame that shows ``state``.

    Shapes:
      returns: u8[size, size, 3]
    """
    if not isinstance(state, SpriteWorldState):
        raise ValueError(f"state must be a SpriteWorldState, got {state!r}")
    return _render_worlds(_stack(state))[0]


def cell_templates() -> np.ndarray:
    """Every way one cell of a SpriteWorld frame can look, indexed by cell code.

    Background, wall, agent, then the ball in each of its four colours (up-left, up-right,
    down-left, down-right), corners left as background. Every frame is a grid of these
    cells, which is what a palette-aware decoder snaps a predicted frame to.

    Shapes:
      returns: u8[7, CELL_SIZE, CELL_SIZE, 3]
    """
    cells = np.broadcast_to(_PALETTE[:, None, None, :], (len(_PALETTE), CELL_SIZE, CELL_SIZE, 3)).copy()
    cells[_BALL:, _BALL_CORNERS[:, 0], _BALL_CORNERS[:, 1]] = BACKGROUND_COLOUR
    return cells


def cell_codes(frame: np.ndarray) -> np.ndarray:
    """``i64[n, n]``: the code of each cell (the index into :func:`cell_templates` it equals), -1 if none.

    Unlike :func:`decode` this never refuses a frame: a model's prediction may show two
    agents or no ball, and evaluation counts such cells.

    Shapes:
      frame: u8[size, size, 3]
      returns: i64[size // CELL_SIZE, size // CELL_SIZE]
    """
    frame = np.asarray(frame)
    n = frame.shape[0] // CELL_SIZE
    cells = frame.reshape(n, CELL_SIZE, n, CELL_SIZE, 3).transpose(0, 2, 1, 3, 4)
    equal = (cells[:, :, None] == cell_templates()[None, None]).all(axis=(-1, -2, -3))  # [n, n, 7]
    return np.where(equal.any(-1), equal.argmax(-1), -1)


def decode(frame: np.ndarray) -> SpriteWorldState:
    """The state a frame shows, read from its pixels alone.

    Each cell's identity is read from one inner pixel; the frame must then equal the
    rendering of the decoded state exactly, so anything that is not a SpriteWorld frame
    (stray pixels, unknown colours, two agents, a missing border wall) is refused.

    Shapes:
      frame: u8[size, size, 3]
      returns: SpriteWorldState
    """
    frame = np.asarray(frame)
    if frame.dtype != np.uint8:
        raise ValueError(f"frame must be a uint8 array, got dtype {frame.dtype}")
    if frame.ndim != 3 or frame.shape[0] != frame.shape[1] or frame.shape[2] != 3:
        raise ValueError(f"frame must have shape (size, size, 3), got {frame.shape}")
    _check_size(frame.shape[0])
    inner = frame[1::CELL_SIZE, 1::CELL_SIZE]  # u8[n, n, 3]: pixel (1, 1) of each cell
    matches = (inner[:, :, None, :] == _PALETTE[None, None]).all(axis=-1)
    unknown = np.argwhere(~matches.any(axis=-1))
    if len(unknown):
        row, col = (int(i) for i in unknown[0])
        raise ValueError(f"frame cell {(row, col)} has colour {tuple(int(x) for x in inner[row, col])}, "
                         "which no SpriteWorld sprite has")
    codes = matches.argmax(axis=-1)
    agents = [tuple(int(i) for i in cell) for cell in np.argwhere(codes == _AGENT)]
    balls = [tuple(int(i) for i in cell) for cell in np.argwhere(codes >= _BALL)]
    if len(agents) != 1 or len(balls) != 1:
        raise ValueError(f"frame must show exactly one agent and one ball, found agents at {agents} "
                         f"and balls at {balls}")
    state = SpriteWorldState(walls=codes == _WALL, agent=agents[0], ball=balls[0],
                             ball_velocity=tuple(int(x) for x in _VELOCITIES[codes[balls[0]] - _BALL]))
    differs = np.argwhere((render(state) != frame).any(axis=-1))
    if len(differs):
        raise ValueError(f"frame is not a SpriteWorld frame: pixel {tuple(int(i) for i in differs[0])} "
                         "differs from the rendering of the state its cells show")
    return state


def transition(frame: np.ndarray, action: int) -> np.ndarray:
    """The next frame, from the current frame and the action alone.

    This is the world's whole dynamics as a function of pixels: it holds for every frame a
    :class:`SpriteWorld` shows, which is what makes the world learnable from single frames.

    Shapes:
      frame: u8[size, size, 3]
      returns: u8[size, size, 3]
    """
    return render(next_state(decode(frame), action))


# -- the stateful shell ----------------------------------------------------------------------------


class SpriteWorld:
    """One SpriteWorld, stepped by actions (the imperative shell over the pure functions).

    ``SpriteWorld(seed, size)`` builds world ``seed``; :meth:`reset` returns it to its
    reset state (always the same one) and :meth:`step` applies an action. Frames are new
    arrays the caller may keep.
    """

    num_actions = len(ACTION_NAMES)
    action_names = ACTION_NAMES

    def __init__(self, seed: int, size: int = 32):
        self._seed = _check_seed("seed", seed)
        self._size = _check_size(size)
        self._initial = _initial_worlds(np.array([self._seed], _U64), self._size)
        self._worlds: _Worlds | None = None

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def size(self) -> int:
        """Frame side in pixels."""
        return self._size

    @property
    def state(self) -> SpriteWorldState:
        """The current state (what the last returned frame shows)."""
        return _unstack(self._current("state"), 0)

    def reset(self) -> np.ndarray:
        """Return to the seed's reset state.

        Shapes:
          returns: u8[size, size, 3]
        """
        self._worlds = self._initial
        return _render_worlds(self._worlds)[0]

    def step(self, action: int) -> np.ndarray:
        """Apply ``action`` (an index into ``action_names``; 0 is the no-op).

        Shapes:
          returns: u8[size, size, 3]
        """
        action = _check_action(action)
        worlds = self._current("step")
        self._worlds = _step_worlds(worlds, np.array([action]))
        return _render_worlds(self._worlds)[0]

    def _current(self, what: str) -> _Worlds:
        if self._worlds is None:
            raise RuntimeError(f"SpriteWorld(seed={self._seed}).{what}: call reset() first")
        return self._worlds

    def __repr__(self) -> str:
        return f"SpriteWorld(seed={self._seed}, size={self._size})"


# -- training clips --------------------------------------------------------------------------------


def clip_world_seeds(seed: int, batch: int) -> np.ndarray:
    """The world seed of each clip :func:`sprite_world_clips` draws for ``seed``.

    Hashed from ``(seed, clip index)`` rather than ``seed + index`` so that the clips of
    nearby seeds (a training and a validation seed, say) do not share worlds, as
    ``seed + index`` would make them do.

    Shapes:
      returns: i64[batch]
    """
    seed = _check_seed("seed", seed)
    batch = check_positive_int("batch", batch)
    return (_hash(seed, _CLIP_STREAM, np.arange(batch)) >> _U64(1)).astype(np.int64)


def _check_probability(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(value) <= 1.0:  # NaN fails the comparison too
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _random_actions(seed: int, batch: int, length: int, repeat_probability: float) -> np.ndarray:
    rng = np.random.default_rng([seed, _ACTION_STREAM])
    fresh = rng.integers(0, len(ACTION_NAMES), size=(batch, length))
    repeat = rng.random((batch, length)) < repeat_probability
    actions = np.zeros((batch, length), np.int32)
    if length > 1:
        actions[:, 1] = fresh[:, 1]  # actions[:, 0] is the placeholder no-op: nothing to repeat
    for t in range(2, length):
        actions[:, t] = np.where(repeat[:, t], actions[:, t - 1], fresh[:, t])
    return actions


def _chase_actions(worlds: _Worlds) -> np.ndarray:
    """i32[B]: the action that moves each agent one cell towards where its ball goes next (rows first on a tie)."""
    d = worlds.ball + worlds.velocity - worlds.agent  # i64[B, 2]
    rows = np.abs(d[:, 0]) >= np.abs(d[:, 1])
    # ACTION_NAMES: 1 up, 2 down, 3 left, 4 right; 0 when the agent is already there.
    vertical = np.where(d[:, 0] < 0, 1, 2)
    horizontal = np.where(d[:, 1] < 0, 3, 4)
    action = np.where(rows, vertical, horizontal)
    return np.where((d == 0).all(axis=1), 0, action).astype(np.int32)


def sprite_world_clips(
    seed: int,
    batch: int,
    length: int,
    size: int = 32,
    repeat_probability: float = 0.75,
    chase_probability: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of random-action clips for training, stepped as arrays over the batch.

    Clip ``i`` is world ``clip_world_seeds(seed, batch)[i]`` from its reset frame.
    ``actions[:, 0]`` is 0 (the no-op before the reset frame); ``frames[:, t]`` is
    ``frames[:, t - 1]`` after ``actions[:, t]``, exactly as :meth:`SpriteWorld.step` gives it.
    From ``t = 2`` each action repeats the previous one with ``repeat_probability`` and is
    otherwise uniform over all actions (numpy's default generator seeded from ``seed``).
    With ``chase_probability``, each step's action is instead, with that probability, the
    one that moves the agent towards the ball's next cell (a player chasing the ball), so
    the agent meets the ball far more often than random actions make it; 0 gives exactly
    the clips from before the option existed.

    Shapes:
      returns: frames: u8[batch, length, size, size, 3]; actions: i32[batch, length]
    """
    seed = _check_seed("seed", seed)
    batch = check_positive_int("batch", batch)
    length = check_positive_int("length", length)
    size = _check_size(size)
    repeat_probability = _check_probability("repeat_probability", repeat_probability)
    chase_probability = _check_probability("chase_probability", chase_probability)

    worlds = _initial_worlds(clip_world_seeds(seed, batch).astype(_U64), size)
    actions = _random_actions(seed, batch, length, repeat_probability)
    chase = np.random.default_rng([seed, _CHASE_STREAM]).random((batch, length)) < chase_probability
    frames = np.empty((batch, length, size, size, 3), np.uint8)
    _render_worlds(worlds, out=frames[:, 0])
    for t in range(1, length):
        if chase_probability > 0:
            actions[:, t] = np.where(chase[:, t], _chase_actions(worlds), actions[:, t])
        worlds = _step_worlds(worlds, actions[:, t])
        _render_worlds(worlds, out=frames[:, t])
    return frames, actions
