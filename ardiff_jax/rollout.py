"""Device-side rollouts: many blocks of one or more sessions inside one ``jax.jit``.

Research code that wants the whole autoregressive loop on device uses this instead of
the runner: a ``lax.scan`` over a schedule of (session, block) steps with the pools and
all session cursors in the **carry** (never as scan ``xs``/``ys``, which would cost a
full-pool temporary), cursors as traced int32 values, and the same table arithmetic,
attention and block write as the runner path (:mod:`ardiff_jax.kv`). Nothing is read back
to the host inside the loop.

The model is a ``block_fn(caches, x) -> (y, k, v)``: given the session's
:class:`~ardiff_jax.kv.PagedKVCaches` and this step's inputs ``x``, it runs whatever
forwards the block needs (e.g. denoise probes, which need no write, and the clean pass)
and returns its output ``y`` plus the block's K/V ``[L, f*T, H, D]`` to commit.

Example::

    pools, cursors, ys = rollout_blocks(layout, pools, cursors, block_fn, xs, session_index,
                                        num_frames=3)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax.kv import (
    KVLayout,
    KVPools,
    KVSharding,
    PagedKVCaches,
    advance_cursor,
    cursor_block_pages,
    sharded_write_block,
    write_block,
    write_blocks,
)
from ardiff_jax._checks import check_not_traced
from ardiff_jax.runtime import (
    ARDiffusionKVCache,
    ARDiffusionKVState,
    branch_cursor_array,
    own_rollout_pages,
    plan_rollout,
    publish_commit,
)

__all__ = ["BlockFn", "rollout_batched_blocks", "rollout_blocks", "rollout_sessions", "scan_batched_blocks"]

#: ``block_fn(caches, x) -> (y, k, v)`` with ``k, v: [L, f*T, H, D]``.
BlockFn = Callable[[PagedKVCaches, Any], tuple[Any, jax.Array, jax.Array]]


@functools.partial(jax.jit, static_argnames=("layout", "block_fn", "num_frames", "backend", "sharding"),
                   donate_argnames=("pools",))
def rollout_blocks(
    layout: KVLayout,
    pools: KVPools,
    cursors: jax.Array,  # i32[num_sessions, 3+K+W]: (run_base, committed, visible_start, *page table)
    block_fn: BlockFn,
    xs: Any,  # pytree, leading axis = num_steps: per-step model inputs
    session_index: jax.Array,  # i32[num_steps]: which session each step advances
    *,
    num_frames: int,
    backend: str = "xla",
    sharding: KVSharding | None = None,
) -> tuple[KVPools, jax.Array, Any]:
    """Run ``num_steps`` committing blocks, each on the session ``session_index[i]``.

    DONATES ``pools``. Returns ``(pools, cursors, ys)``; ``ys`` stacks each step's ``y``.
    ``backend`` names the attention backend of the views ``block_fn`` receives
    (:func:`rollout_sessions` passes its cache's). ``sharding`` is the mesh the pools are
    split over (``None``: one device): block writes and attention then run per shard, so
    the loop never gathers a pool.
    Shapes depend only on the layout, ``num_frames`` and the step count, so every fill
    level, ring wrap and session mix runs the same program.
    """
    seq_len = num_frames * layout.tokens_per_frame
    block_shape = (layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)

    # Each step first writes the *previous* step's block, then runs its own forward. Writing
    # before reading lets XLA update the carried pools in place; a read followed by a
    # write of the same carried buffer makes it copy a whole pool per step. The deferral is
    # exact: a committed block is written before any later forward runs, and its pages are
    # invisible to the forward that produced it.
    def write(pools: KVPools, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVPools:
        if sharding is None:
            return write_block(layout, pools, pages, k, v)
        return sharded_write_block(layout, sharding, pools, pages, k, v)

    def step(carry: tuple[KVPools, jax.Array, tuple[jax.Array, jax.Array, jax.Array]], inputs: tuple[jax.Array, Any]):
        pools, cursors, (pending_pages, pending_k, pending_v) = carry
        pools = write(pools, pending_pages, pending_k, pending_v)
        index, x = inputs
        cursor = cursors[index]
        caches = PagedKVCaches(pools=pools, cursor=cursor, layout=layout, seq_len=seq_len, backend=backend,
                               sharding=sharding)
        y, k, v = block_fn(caches, x)
        pages = cursor_block_pages(layout, cursor, num_frames, jnp)
        cursors = cursors.at[index].set(advance_cursor(layout, cursor, num_frames, jnp))
        pending = (pages, k.reshape(block_shape).astype(layout.dtype), v.reshape(block_shape).astype(layout.dtype))
        return (pools, cursors, pending), y

    # Nothing pending before the first step: out-of-range pages drop the write.
    nothing = (layout.null_page + jnp.arange(num_frames, dtype=jnp.int32), jnp.zeros(block_shape, layout.dtype),
               jnp.zeros(block_shape, layout.dtype))
    (pools, cursors, pending), ys = jax.lax.scan(step, (pools, cursors, nothing), (session_index, xs))
    pools = write(pools, *pending)
    return pools, cursors, ys


@functools.partial(jax.jit, static_argnames=("layout", "block_fn", "num_frames", "backend"),
                   donate_argnames=("pools",))
def rollout_batched_blocks(
    layout: KVLayout,
    pools: KVPools,
    cursors: jax.Array,  # i32[B, 3+K+W]: (run_base, committed, visible_start, *page table)
    block_fn: BlockFn,
    xs: Any,  # pytree, leading axes [num_steps, B]: per-step, per-session model inputs
    *,
    num_frames: int,
    backend: str = "xla",
) -> tuple[KVPools, jax.Array, Any]:
    """Run ``num_steps`` batched ticks: every step commits one block of **every** session at once.

    The batched form of :func:`rollout_blocks` (the device-side twin of
    ``engine.generate_batch``): each step runs ``block_fn`` under ``jax.vmap`` over the
    sessions with one batched :class:`~ardiff_jax.kv.PagedKVCaches` (cursor ``i32[B, 3 + K + W]``,
    each row reading its own session's window) and commits every row's block with one
    :func:`~ardiff_jax.kv.write_blocks`, deferred to the next step like :func:`rollout_blocks`'
    writes. DONATES ``pools``. Returns ``(pools, cursors, ys)``; ``ys`` has leading axes
    ``[num_steps, B]``. Pools on one device only. A ``block_fn`` that draws noise from
    ``"rbg"`` keys draws other numbers under ``vmap`` than alone (draw it with ``lax.map``
    to match a one-session run).
    """
    def batched_fn(caches: PagedKVCaches, carry: None, x: Any) -> tuple[None, Any, jax.Array, jax.Array]:
        y, k, v = jax.vmap(block_fn, in_axes=(caches.vmap_axes(), 0))(caches, x)
        return carry, y, k, v

    pools, cursors, _, ys = scan_batched_blocks(layout, pools, cursors, batched_fn, xs, None, num_frames=num_frames,
                                                backend=backend)
    return pools, cursors, ys


def scan_batched_blocks(
    layout: KVLayout,
    pools: KVPools,
    cursors: jax.Array,  # i32[B, 3+K+W]: (run_base, committed, visible_start, *page table)
    block_fn: Callable[[PagedKVCaches, Any, Any], tuple[Any, Any, jax.Array, jax.Array]],
    xs: Any,  # pytree, leading axis = num_steps
    carry: Any,  # pytree the block function threads from step to step (model-owned state), or None
    *,
    num_frames: int,
    backend: str = "xla",
) -> tuple[KVPools, jax.Array, Any, Any]:
    """The scan behind :func:`rollout_batched_blocks` (traceable, not jitted; pools are not donated here).

    ``block_fn(caches, carry, x) -> (carry, y, k, v)`` runs one step of **every** session:
    ``caches`` is the batched paged view (cursor ``i32[B, 3 + K + W]``), ``k, v`` are
    ``[B, L, f*T, H, D]``, the blocks to commit. Each step first writes the previous step's
    blocks (in place, :func:`~ardiff_jax.kv.write_blocks`), then runs ``block_fn``; cursors
    advance with the runtime's one rule. Returns ``(pools, cursors, carry, ys)``. Used inside
    larger programs too (``ardiff_jax.training.self_rollout`` differentiates through it).
    """
    seq_len = num_frames * layout.tokens_per_frame
    num_sessions = cursors.shape[0]
    block_shape = (num_sessions, layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)
    row_pages = jax.vmap(lambda cursor: cursor_block_pages(layout, cursor, num_frames, jnp))
    row_advance = jax.vmap(lambda cursor: advance_cursor(layout, cursor, num_frames, jnp))

    def step(state: tuple[KVPools, jax.Array, tuple[jax.Array, jax.Array, jax.Array], Any], x: Any):
        pools, cursors, (pending_pages, pending_k, pending_v), carry = state
        pools = write_blocks(layout, pools, pending_pages, pending_k, pending_v)  # write first: in place
        caches = PagedKVCaches(pools=pools, cursor=cursors, layout=layout, seq_len=seq_len, backend=backend)
        carry, y, k, v = block_fn(caches, carry, x)
        pending = (row_pages(cursors), k.reshape(block_shape).astype(layout.dtype),
                   v.reshape(block_shape).astype(layout.dtype))
        return (pools, row_advance(cursors), pending, carry), y

    nothing = (jnp.full((num_sessions, num_frames), layout.null_page, jnp.int32), jnp.zeros(block_shape, layout.dtype),
               jnp.zeros(block_shape, layout.dtype))
    (pools, cursors, pending, carry), ys = jax.lax.scan(step, (pools, cursors, nothing, carry), xs)
    pools = write_blocks(layout, pools, *pending)
    return pools, cursors, carry, ys


def rollout_sessions(
    cache: ARDiffusionKVCache,
    states: Sequence[ARDiffusionKVState],
    block_fn: BlockFn,
    xs: Any,
    session_index: Sequence[int] | np.ndarray | None,  # i32[num_steps]: index into ``states`` per step
    *,
    branch: str,
    num_frames: int,
    batched: bool = False,
) -> Any:
    """Run a device-side rollout over sessions of an :class:`~ardiff_jax.ARDiffusionKVCache`.

    Every step goes through the same commit transaction as ``state.commit_paged_context``
    (:func:`~ardiff_jax.runtime.plan_rollout`, the one commit rule): the whole schedule is planned on the host
    first, so an unknown branch, a foreign or closed state, a pending context, a run owned
    by another branch or an overlong session raises before anything is dispatched and
    changes nothing. Then :func:`rollout_blocks` runs on the cache's pools (donated; the
    cache gets the new pools back) and the planned session values are published. Returns
    the stacked ``ys``.

    With ``batched=True`` every step advances **every** session (``session_index`` must be
    ``None``; ``xs`` has leading axes ``[num_steps, len(states)]``) through
    :func:`rollout_batched_blocks`: one vmapped ``block_fn`` per step over all sessions and
    one write of all their blocks, as ``engine.generate_batch`` does. ``ys`` then has
    leading axes ``[num_steps, len(states)]``. Pools on one device only.
    """
    layout, spec = cache.layout, cache.spec
    check_not_traced("rollout_sessions", xs, session_index)
    if not isinstance(batched, bool):
        raise TypeError(f"batched must be a bool, got {batched!r}")
    if batched:
        if session_index is not None:
            raise ValueError("a batched rollout advances every session each step: pass session_index=None")
        if cache.sharding is not None:
            raise ValueError("batched rollouts need pools on one device")
        leading = {tuple(np.shape(leaf)[:2]) for leaf in jax.tree_util.tree_leaves(xs)}
        if len(leading) != 1 or len(next(iter(leading))) != 2 or next(iter(leading))[1] != len(states) \
                or next(iter(leading))[0] == 0:
            raise ValueError(f"batched xs leaves must share leading axes [num_steps >= 1, {len(states)}], got "
                             f"{sorted(leading)}")
        num_steps = next(iter(leading))[0]
        session_index = np.tile(np.arange(len(states), dtype=np.int32), num_steps)  # the commit plan, step-major
    session_index = np.asarray(session_index)
    if session_index.ndim != 1 or session_index.size == 0 or not np.issubdtype(session_index.dtype, np.integer):
        raise ValueError(f"session_index must be a non-empty 1-d sequence of integers, got {session_index!r}")
    if session_index.min() < 0 or session_index.max() >= len(states):
        raise ValueError(f"session_index values must lie in [0, {len(states)}), got {session_index.tolist()}")
    session_index = session_index.astype(np.int32)
    if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or not (
            0 < num_frames <= layout.window_frames):
        raise ValueError(f"num_frames must be an integer in [1, {layout.window_frames}], got {num_frames!r}")
    for state in states:
        cache.check_owned(state)
    if len({id(state) for state in states}) != len(states):
        raise ValueError("rollout_sessions needs distinct sessions (each state once)")
    for state in states:
        if state.has_pending_context(branch):  # unknown branch / unbound state raise here too
            raise RuntimeError(f"session {state.session_id!r} has a pending context on branch {branch!r}")
    # Plan every step with the one commit rule; any refusal raises before dispatch. The page tables stay constant
    # inside the scan: every slot the rollout writes gets a page its session alone holds first (a fork's shared
    # history is copied into fresh pages, once), and the plan follows the tables.
    plan = own_rollout_pages(plan_rollout(states, branch, session_index, int(num_frames)), branch)
    cursors = np.stack([branch_cursor_array(spec, layout, state.snapshot(), branch, branch_major=cache.branch_major)
                        for state in states])
    cache.check_pools()
    if batched:
        pools, _, ys = rollout_batched_blocks(layout, cache.pools, cursors, block_fn, xs, num_frames=num_frames,
                                              backend=cache.attention_backend)
    else:
        pools, _, ys = rollout_blocks(layout, cache.pools, cursors, block_fn, xs, session_index,
                                      num_frames=num_frames, backend=cache.attention_backend, sharding=cache.sharding)
    # Under an enclosing jax transformation nothing ran (and nothing was donated): refuse before publishing.
    check_not_traced("rollout_sessions (inside jax.jit or another transformation)", pools.k)
    cache._replace_pools(pools)
    # Bookkeeping after the device call returned: the device advanced the cursors with the same arithmetic.
    publish_commit(plan)
    return ys
