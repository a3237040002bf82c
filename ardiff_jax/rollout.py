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
    PagedKVCaches,
    advance_cursor,
    block_pages,
    make_cursor,
    write_block,
)

__all__ = ["BlockFn", "rollout_blocks", "rollout_sessions"]

#: ``block_fn(caches, x) -> (y, k, v)`` with ``k, v: [L, f*T, H, D]``.
BlockFn = Callable[[PagedKVCaches, Any], tuple[Any, jax.Array, jax.Array]]


@functools.partial(jax.jit, static_argnames=("layout", "block_fn", "num_frames"), donate_argnames=("pools",))
def rollout_blocks(
    layout: KVLayout,
    pools: KVPools,
    cursors: jax.Array,  # i32[num_sessions, 3]: (run_base, committed, visible_start) per session
    block_fn: BlockFn,
    xs: Any,  # pytree, leading axis = num_steps: per-step model inputs
    session_index: jax.Array,  # i32[num_steps]: which session each step advances
    *,
    num_frames: int,
) -> tuple[KVPools, jax.Array, Any]:
    """Run ``num_steps`` committing blocks, each on the session ``session_index[i]``.

    DONATES ``pools``. Returns ``(pools, cursors, ys)``; ``ys`` stacks each step's ``y``.
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
    def step(carry: tuple[KVPools, jax.Array, tuple[jax.Array, jax.Array, jax.Array]], inputs: tuple[jax.Array, Any]):
        pools, cursors, (pending_pages, pending_k, pending_v) = carry
        pools = write_block(layout, pools, pending_pages, pending_k, pending_v)
        index, x = inputs
        cursor = cursors[index]
        caches = PagedKVCaches(pools=pools, cursor=cursor, layout=layout, seq_len=seq_len)
        y, k, v = block_fn(caches, x)
        pages = block_pages(layout, cursor[0], cursor[1], num_frames, jnp)
        cursors = cursors.at[index].set(advance_cursor(layout, cursor, num_frames, jnp))
        pending = (pages, k.reshape(block_shape).astype(layout.dtype), v.reshape(block_shape).astype(layout.dtype))
        return (pools, cursors, pending), y

    # Nothing pending before the first step: out-of-range pages drop the write.
    nothing = (layout.null_page + jnp.arange(num_frames, dtype=jnp.int32), jnp.zeros(block_shape, layout.dtype),
               jnp.zeros(block_shape, layout.dtype))
    (pools, cursors, pending), ys = jax.lax.scan(step, (pools, cursors, nothing), (session_index, xs))
    pools = write_block(layout, pools, *pending)
    return pools, cursors, ys


def rollout_sessions(
    cache: Any,
    states: Sequence[Any],
    block_fn: BlockFn,
    xs: Any,
    session_index: Sequence[int] | np.ndarray,
    *,
    branch: str,
    num_frames: int,
) -> Any:
    """Run a device-side rollout over sessions of an :class:`~ardiff_jax.ARDiffusionKVCache`.

    Reads each state's cursor for ``branch``, runs :func:`rollout_blocks` on the cache's
    pools (donated; the cache gets the new pools back) and advances the states' cursors
    after the call returned, exactly as ``commit_paged_context`` would. Validation happens
    on the host before anything is dispatched. Returns the stacked ``ys``.
    """
    layout = cache.layout
    session_index = np.asarray(session_index, dtype=np.int32)
    if session_index.ndim != 1 or session_index.size == 0:
        raise ValueError(f"session_index must be a non-empty 1-d sequence, got shape {session_index.shape}")
    if session_index.min() < 0 or session_index.max() >= len(states):
        raise ValueError(f"session_index values must lie in [0, {len(states)}), got {session_index.tolist()}")
    if not 0 < num_frames <= layout.window_frames:
        raise ValueError(f"num_frames must be in [1, {layout.window_frames}], got {num_frames}")
    adapters = [state.adapter(branch) for state in states]  # closed/unknown/unbound -> raises here
    for state in states:
        if branch in state._pending:
            raise RuntimeError(f"session {state.session_id!r} has a pending context on branch {branch!r}")
    counts = np.bincount(session_index, minlength=len(states))
    for adapter, count in zip(adapters, counts):
        if (adapter.committed_frames + count * num_frames) * layout.tokens_per_frame > layout.max_model_len:
            raise RuntimeError(f"{adapter.request_id} would exceed max_model_len ({layout.max_model_len} tokens)")
    owners = {(state.slot, adapter.local_index) for state, adapter in zip(states, adapters)}
    if len(owners) != len(states):
        raise ValueError("rollout_sessions needs distinct sessions (each state once)")
    cursors = np.stack([
        make_cursor(state._run_base(adapter.local_index), adapter.committed_frames, adapter.visible_start_frame)
        for state, adapter in zip(states, adapters)
    ])
    cache.check_pools()
    pools, new_cursors, ys = rollout_blocks(layout, cache.pools, cursors, block_fn, xs, session_index,
                                            num_frames=num_frames)
    cache._pools = pools
    # Bookkeeping after the device call returned; one host read of the final cursors.
    final = np.asarray(new_cursors)
    for state, adapter, cursor in zip(states, adapters, final):
        adapter._committed = int(cursor[1])
        adapter._visible_start = int(cursor[2])
        if adapter.committed_frames:
            state._run_owner[adapter.local_index] = branch
    return ys
