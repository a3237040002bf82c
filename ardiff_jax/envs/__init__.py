"""Procedural environments that world models train on: no downloads, deterministic from a seed.

* :class:`SpriteWorld`: a grid world (an agent moved by discrete actions, walls, a bouncing
  ball whose colour shows its direction) in which every frame shows the whole state, so the
  next frame is a function of the frame and the action. Its pure core works on pixels
  alone (:func:`decode`, :func:`transition`) or on :class:`SpriteWorldState`
  (:func:`initial_state`, :func:`next_state`, :func:`render`); :func:`reached_ball` says
  when the agent has reached the ball (their cells share an edge);
* :func:`sprite_world_clips`: batches of random-action clips (frames plus the action before
  each frame) for training, stepped as arrays over the batch; :func:`clip_world_seeds` names
  the world of each clip.

Host-side numpy only: nothing here touches a device.

SpriteWorld
===========

SpriteWorld exists to train a small action-conditioned world model: the next frame must be a
deterministic function of the current frame and the action, so a model that sees one frame
and the action has everything it needs, and nothing it predicts is noise. The world is kept
crisp (flat colours, cell-aligned sprites) so that a model on 4x4 or 8x8 patches can learn it
on a CPU.

Layout
------
A frame is ``uint8[size, size, 3]``: a square grid of ``size // CELL_SIZE`` cells of
``CELL_SIZE x CELL_SIZE`` (4x4) pixels, so ``size`` must be a multiple of 4, and at least
``MIN_SIZE`` (24, 6x6 cells) so that every seed has room for an agent and a free-moving ball.
Cells are addressed ``(row, col)``, row 0 at the top.

* **walls**: the border ring of cells plus ``(m * m) // 9`` seeded interior obstacle cells,
  where ``m = size // 4 - 2`` is the interior width (4 obstacles at ``size=32``). Solid.
  Colour ``WALL_COLOUR`` (blue), full cell.
* **agent**: one cell, full square, ``AGENT_COLOUR`` (green). Actions ``ACTION_NAMES``:
  ``("no-op", "up", "down", "left", "right")``.
* **ball**: one cell, a square with its four corner pixels left as background (so its shape,
  not only its colour, sets it apart from the agent). It moves one cell diagonally per step;
  its velocity ``(d_row, d_col)``, each ``+-1``, is its colour: red channel 255, green 255 iff
  it moves down, blue 255 iff it moves right (``ball_colour``): up-left red, up-right
  magenta, down-left yellow, down-right white.
* everything else is ``BACKGROUND_COLOUR`` (black).

Dynamics (``next_state``; a pure function of what the frame shows)
--------------------------------------------------------------------
1. **The agent moves first.** Its target cell is its cell plus the action's offset. If the
   target is a wall or the ball's *current* cell, the agent stays (the ball is solid to it:
   pushing into the ball does nothing).
2. **Then the ball moves**, treating walls and the agent's *new* cell as solid (so the
   agent can step into the ball's path and the ball bounces off it; the two never share a
   cell). With velocity ``(dr, dc)`` at ``(r, c)``:

   * if ``(r + dr, c)`` is solid, ``dr`` flips; if ``(r, c + dc)`` is solid, ``dc`` flips
     (both solid, an inside corner: both flip);
   * the ball then moves one cell along the bounced velocity if that cell is free;
   * otherwise (an obstacle's outer corner dead ahead, or a wall where the bounce leads)
     it goes back the way it came, to ``(r - dr, c - dc)`` with velocity ``(-dr, -dc)``,
     if that cell is free;
   * otherwise (boxed in) it stays where it is with velocity ``(-dr, -dc)``: it turns
     round, visibly, and tries again next step.

Reset (``initial_state``)
-------------------------
The reset state is a pure function of ``(seed, size)``, drawn from a counter-based hash
(SplitMix64) of the seed rather than a stateful generator, so that a whole batch of worlds is
built with array operations and the batch generator and :class:`SpriteWorld` share one code
path. An attempt shuffles the interior cells: the first ``(m * m) // 9`` become obstacles and
the next one the agent; the ball takes the first (cell, direction) in a second seeded order
whose three cells ahead (vertical, horizontal, diagonal) are free, so its first step is a
clean diagonal move (it never starts stuck). An attempt is kept only if the free cells are
4-connected (the agent can reach all of them) and such a ball placement exists; otherwise the
next attempt is drawn. After 32 rejected attempts the world is drawn without
interior obstacles, which always succeeds at ``MIN_SIZE`` and above, so every seed has a
world.

Training clips
--------------
:func:`sprite_world_clips` steps a batch of worlds at once: each clip gets its own world
(:func:`clip_world_seeds`) and random actions that repeat the previous action with
``repeat_probability``, so clips travel instead of jittering in place. ``actions[:, t]`` is
the action that produced ``frames[:, t]`` from ``frames[:, t - 1]``; ``actions[:, 0]`` is
the no-op before the reset frame.
"""

from ardiff_jax.envs._sprite_world import (
    ACTION_NAMES,
    AGENT_COLOUR,
    BACKGROUND_COLOUR,
    CELL_SIZE,
    MIN_SIZE,
    WALL_COLOUR,
    SpriteWorld,
    SpriteWorldState,
    ball_colour,
    cell_codes,
    cell_templates,
    clip_world_seeds,
    decode,
    initial_state,
    next_state,
    reached_ball,
    render,
    sprite_world_clips,
    transition,
)

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
