"""Pools and attention on a ``jax.sharding.Mesh``: KV heads on ``"tp"``, runs on ``"cfg"``.

:class:`KVSharding` is the static description a sharded layout carries: the mesh and the
two axis names. Pools ``[L, P, T, H, D]`` are created already sharded
(``NamedSharding``): KV heads split over ``"tp"`` and the page axis split over ``"cfg"``,
so every device holds ``1 / (tp * cfg)`` of the pool bytes.

Which pages a ``"cfg"`` group holds is a layout decision of the runtime: with ``cfg > 1``
runs are numbered branch-major (``run = local_branch * capacity + slot``), so when a
pipeline has as many local branches as ``"cfg"`` groups, branch ``b`` of *every* session
lives on group ``b``; a single-branch pipeline gets its sessions split over the groups.

Every operation that touches the pools runs per shard inside ``jax.shard_map``, so no
pool is ever gathered to one device:

* :func:`sharded_write_block`: each shard writes the frames whose pages it holds (page ids
  made shard-local; the others fall outside ``[0, P_local)`` and are dropped, exactly as
  the unsharded write drops the null page);
* :func:`sharded_attention`: each shard runs the attention backend on its local pool with
  its local KV heads. With ``cfg > 1`` only the group holding the run has the history, so
  the groups exchange the *attention output* (one ``psum`` of ``q``-sized activations,
  non-owners contribute zeros);
* under ``jax.vmap`` over branches with one branch per ``"cfg"`` group (the CFG pipeline's
  one-call step), :func:`sharded_attention`'s batching rule maps the branch axis onto
  ``"cfg"``: each group attends for its own branch over its own pages and nothing is
  exchanged at all. A branch whose run is not on the group the batch position maps it to
  comes back as NaN, never as another branch's answer.

Host offload and session files copy whole runs (:func:`sharded_read_runs`,
:func:`sharded_write_runs`): each group reads or writes only the runs it holds, and the
copy's bytes (never the pool's) cross groups once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ardiff_jax.kv._layout import KVLayout, KVPools
from ardiff_jax.kv._ops import read_pages, write_block, write_pages

__all__ = ["KVSharding", "check_mesh", "sharded_write_block", "sharded_attention", "sharded_read_runs",
           "sharded_write_runs", "shard_zeros"]

#: The mesh axis names the runtime understands.
TP_AXIS = "tp"
CFG_AXIS = "cfg"


def check_mesh(mesh: Any) -> Mesh:
    """``mesh`` if it is a ``jax.sharding.Mesh`` whose axes are ``"tp"`` and/or ``"cfg"`` (others of size 1)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    other = {name: size for name, size in mesh.shape.items() if name not in (TP_AXIS, CFG_AXIS) and size != 1}
    if other:
        raise ValueError(
            f"AR-Diffusion mesh axes must be {TP_AXIS!r} (KV heads) and {CFG_AXIS!r} (CFG branches); axes {other} "
            "have size > 1 (replicate across sessions with ARDiffusionRouter instead)")
    return mesh


@dataclasses.dataclass(frozen=True)
class KVSharding:
    """Static: how a layout's pools and attention are split over a mesh (hashable, a jit static).

    Attributes:
      mesh: a ``jax.sharding.Mesh`` with axes ``"tp"`` and/or ``"cfg"`` (either may be absent
        or of size 1; other axes must have size 1).
    """

    mesh: Mesh

    def __post_init__(self) -> None:
        check_mesh(self.mesh)

    @property
    def tp(self) -> int:
        """Tensor-parallel shards: KV heads (and the model's attention heads, FFN hidden) split this way."""
        return int(self.mesh.shape.get(TP_AXIS, 1))

    @property
    def cfg(self) -> int:
        """Device groups the pages (CFG branches) are split over."""
        return int(self.mesh.shape.get(CFG_AXIS, 1))

    @property
    def num_shards(self) -> int:
        return self.tp * self.cfg

    @property
    def tp_axis(self) -> str | None:
        return TP_AXIS if self.tp > 1 else None

    @property
    def cfg_axis(self) -> str | None:
        return CFG_AXIS if self.cfg > 1 else None

    # -- specs -------------------------------------------------------------------------------
    @property
    def pool_spec(self) -> P:
        """``[L, P, T, H, D]``: pages over ``"cfg"``, KV heads over ``"tp"``."""
        return P(None, self.cfg_axis, None, self.tp_axis, None)

    @property
    def pool_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.pool_spec)

    def heads_spec(self, ndim: int) -> P:
        """An array whose second-to-last axis is heads (``[..., H, D]``): heads over ``"tp"``."""
        return P(*([None] * (ndim - 2)), self.tp_axis, None)

    def heads_sharding(self, ndim: int) -> NamedSharding:
        """Where a cross-attention cache ``[L, N, H, D]`` (or any ``[..., H, D]`` array) lives."""
        return NamedSharding(self.mesh, self.heads_spec(ndim))

    def copy_spec(self, layout: KVLayout) -> P:
        """A slot copy ``[L, n, T, H, D]``: heads over ``"tp"``, layers over ``"cfg"`` where they split evenly.

        Splitting the layers keeps one copy of a session in all (host) memory together, not
        one per ``"cfg"`` group; with layers that do not split, every group holds it whole.
        """
        split_layers = self.cfg > 1 and layout.num_layers % self.cfg == 0
        return P(CFG_AXIS if split_layers else None, None, None, self.tp_axis, None)

    def copy_sharding(self, layout: KVLayout) -> NamedSharding:
        return NamedSharding(self.mesh, self.copy_spec(layout))

    @property
    def replicated(self) -> NamedSharding:
        """Every device holds the whole array (model inputs, PRNG keys, small state)."""
        return NamedSharding(self.mesh, P())

    # -- geometry ----------------------------------------------------------------------------
    def check_layout(self, layout: KVLayout) -> None:
        """ValueError unless ``layout`` splits evenly: KV heads over ``tp``, whole runs over ``cfg``."""
        if layout.num_kv_heads % self.tp:
            raise ValueError(
                f"AR-Diffusion tensor parallelism: {layout.num_kv_heads} KV heads do not split over tp={self.tp}")
        if layout.num_runs % self.cfg:
            raise ValueError(
                f"AR-Diffusion CFG parallelism: {layout.num_runs} runs of {layout.run_pages} pages do not split "
                f"over cfg={self.cfg} device groups")

    def local_layout(self, layout: KVLayout) -> KVLayout:
        """The layout one shard sees: ``P / cfg`` pages, ``H / tp`` KV heads."""
        self.check_layout(layout)
        return dataclasses.replace(layout, num_pages=layout.num_pages // self.cfg,
                                   num_kv_heads=layout.num_kv_heads // self.tp)


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype: str, sharding: NamedSharding) -> Any:
    # The *function* is cached, not the array: each call allocates fresh zeros directly in
    # their shards (no full-size buffer on one device first).
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def shard_zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    """Zeros created already sharded (each device allocates only its shard)."""
    return _zeros_program(tuple(shape), jnp.dtype(dtype).name, sharding)()


def _group_offset(sharding: KVSharding, local: KVLayout) -> jax.Array:
    """First global page of this shard's ``"cfg"`` group (inside ``shard_map``)."""
    if sharding.cfg == 1:
        return jnp.int32(0)
    return jax.lax.axis_index(CFG_AXIS).astype(jnp.int32) * local.num_pages


def sharded_write_block(
    layout: KVLayout,
    sharding: KVSharding,
    pools: KVPools,
    pages: jax.Array,  # global destination page per frame; an id outside [0, P) drops the frame
    k: jax.Array,
    v: jax.Array,
) -> KVPools:
    """:func:`~ardiff_jax.kv.write_block` per shard: each shard writes the frames it holds, in place.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      pages: i32[f]
      k, v: float[L, f*T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    return _write_program(layout, sharding)(pools, jnp.asarray(pages, jnp.int32), k, v)


@functools.cache
def _write_program(layout: KVLayout, sharding: KVSharding) -> Any:
    """The per-shard write as one jitted program (inlined under an outer ``jit``).

    Jitted here so that an eager call compiles once: an eager ``shard_map`` runs op by op,
    measured at ~5 s per call on CPU for a small pool.
    """
    local = sharding.local_layout(layout)
    block_spec = sharding.heads_spec(4)

    def write_local(pools: KVPools, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVPools:
        # Pages of another group land outside [0, P_local) and are dropped like the null page.
        local_pages = pages - _group_offset(sharding, local)
        local_pages = jnp.where(pages >= layout.num_pages, local.num_pages, local_pages)
        return write_block(local, pools, local_pages, k, v)

    pool_specs = KVPools(k=sharding.pool_spec, v=sharding.pool_spec)
    return jax.jit(jax.shard_map(write_local, mesh=sharding.mesh, in_specs=(pool_specs, P(), block_spec, block_spec),
                                 out_specs=pool_specs))


def sharded_read_runs(
    layout: KVLayout,
    sharding: KVSharding,
    pools: KVPools,
    run_starts: jax.Array,  # global first page of each run; the runtime checks them on the host
) -> KVPools:
    """Copy whole runs out of split pools, wherever their ``"cfg"`` group is: one session's KV.

    The runs come out concatenated in ``run_starts`` order, exactly as
    :func:`~ardiff_jax.kv.read_pages` returns adjacent runs of an unsharded pool, so a copy
    taken on a mesh and one taken on one device are the same array. Each group reads the
    runs it holds (zeros for the others) and one reduction over ``"cfg"`` on the stored bits
    (as unsigned integers, so ``-0.0`` and NaN payloads survive) assembles the copy: a
    reduce-scatter over the layers where they split evenly (each device keeps
    ``1 / (tp * cfg)`` of the copy, :meth:`KVSharding.copy_spec`), else an all-reduce;
    heads stay split over ``"tp"``.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      run_starts: i32[R]
      returns: KVPools; k, v: storage[L, R*(K+W), T, H, D]
    """
    run_starts = jnp.asarray(run_starts, jnp.int32)
    return _read_runs_program(layout, sharding, int(run_starts.shape[0]))(pools, run_starts)


def sharded_write_runs(
    layout: KVLayout,
    sharding: KVSharding,
    pools: KVPools,
    run_starts: jax.Array,  # global first page of each run; the runtime checks them on the host
    pages: KVPools,  # what sharded_read_runs (or read_pages) returned
) -> KVPools:
    """Write whole runs back into split pools: the inverse of :func:`sharded_read_runs`.

    Each group writes the runs it holds and leaves every other page as it was; the stored
    bits are written unchanged, so a round trip is bit-exact.

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      run_starts: i32[R]
      pages: KVPools; k, v: storage[L, R*(K+W), T, H, D]
      returns: KVPools; k, v: storage[L, P, T, H, D]
    """
    run_starts = jnp.asarray(run_starts, jnp.int32)
    return _write_runs_program(layout, sharding, int(run_starts.shape[0]))(pools, run_starts, pages)


def _local_run(sharding: KVSharding, local: KVLayout, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(first local page, whether this shard's group holds the run)`` of a run at global ``start``."""
    local_start = start - _group_offset(sharding, local)
    owner = (local_start >= 0) & (local_start < local.num_pages)
    return jnp.clip(local_start, 0, local.num_pages - local.run_pages), owner


def _unsigned(x: jax.Array) -> jax.Array:
    """The stored bits of ``x`` as an unsigned integer of the same width (integer sums keep them exact)."""
    bits = jnp.dtype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize])
    return x if x.dtype == bits else jax.lax.bitcast_convert_type(x, bits)


def _bits_as(x: jax.Array, dtype: Any) -> jax.Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


@functools.cache
def _read_runs_program(layout: KVLayout, sharding: KVSharding, num_runs: int) -> Any:
    local = sharding.local_layout(layout)
    pool_specs = KVPools(k=sharding.pool_spec, v=sharding.pool_spec)
    copy_spec = sharding.copy_spec(layout)
    scatter_layers = copy_spec[0] is not None

    def exchange(x: jax.Array) -> jax.Array:
        # Exactly one group holds each run; the others add zero bits.
        bits = _unsigned(x)
        if scatter_layers:
            return _bits_as(jax.lax.psum_scatter(bits, CFG_AXIS, scatter_dimension=0, tiled=True), x.dtype)
        return _bits_as(jax.lax.psum(bits, CFG_AXIS), x.dtype)

    def read_local(pools: KVPools, run_starts: jax.Array) -> KVPools:
        runs = []
        for r in range(num_runs):
            first, owner = _local_run(sharding, local, run_starts[r])
            run = read_pages(local, pools, first, local.run_pages)
            runs.append(jax.tree.map(lambda x: jnp.where(owner, x, jnp.zeros_like(x)), run))
        copy = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *runs)
        return copy if sharding.cfg == 1 else jax.tree.map(exchange, copy)

    return jax.jit(jax.shard_map(read_local, mesh=sharding.mesh, in_specs=(pool_specs, P()),
                                 out_specs=KVPools(k=copy_spec, v=copy_spec)))


@functools.cache
def _write_runs_program(layout: KVLayout, sharding: KVSharding, num_runs: int) -> Any:
    local = sharding.local_layout(layout)
    pool_specs = KVPools(k=sharding.pool_spec, v=sharding.pool_spec)
    # Every group needs all layers of the runs it holds: a copy split over "cfg" (copy_spec) is
    # gathered on the way in; only the copy's bytes move.
    copy_spec = sharding.heads_spec(5)

    def write_local(pools: KVPools, run_starts: jax.Array, pages: KVPools) -> KVPools:
        for r in range(num_runs):
            first, owner = _local_run(sharding, local, run_starts[r])
            new = jax.tree.map(lambda x: x[:, r * local.run_pages:(r + 1) * local.run_pages], pages)
            old = read_pages(local, pools, first, local.run_pages)
            pools = write_pages(local, pools, first, jax.tree.map(lambda n, o: jnp.where(owner, n, o), new, old))
        return pools

    return jax.jit(jax.shard_map(write_local, mesh=sharding.mesh,
                                 in_specs=(pool_specs, P(), KVPools(k=copy_spec, v=copy_spec)),
                                 out_specs=pool_specs))


def _scale_array(layout: KVLayout, scale: Any) -> jax.Array:
    return jnp.asarray(1.0 / math.sqrt(layout.head_size) if scale is None else scale, jnp.float32)


def sharded_attention(
    backend: Any,
    layout: KVLayout,
    sharding: KVSharding,
    pools: KVPools,
    cursor: jax.Array,  # (global run_base, committed, visible_start, *page table of global page ids)
    layer: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    extra_k: jax.Array | None = None,
    extra_v: jax.Array | None = None,
    *,
    scale: Any = None,
) -> jax.Array:
    """Run the attention ``backend`` per shard on local pools and local heads (see the module docstring).

    ``backend`` is a registered backend function (the signature of
    :func:`~ardiff_jax.kv.paged_attention`); it sees a shard-local layout (``P / cfg``
    pages, ``H / tp`` KV heads) and a cursor whose run base and page table are shard-local (a page
    another group holds becomes the local null page, which reads as zeros; only the group that
    holds the run's home page answers).

    Shapes:
      pools: KVPools; k, v: storage[L, P, T, H, D]
      cursor: i32[3+K+W]
      layer: i32[]
      q: float[S, Hq, D]
      k, v: float[f*T, H, D]
      extra_k, extra_v: float[E, H, D]
      scale: f32[]
      returns: q.dtype[S, Hq, D]
    """
    fn = _attention_program(backend, layout, sharding, extra_k is not None)
    extras = () if extra_k is None else (extra_k, extra_v)
    return fn(pools, jnp.asarray(cursor, jnp.int32), jnp.asarray(layer, jnp.int32), _scale_array(layout, scale), q,
              k, v, *extras)


@functools.cache
def _attention_program(backend: Any, layout: KVLayout, sharding: KVSharding, has_extra: bool) -> Any:
    """A ``custom_vmap`` function: unbatched = owner-select over groups; batched over branches = one group each."""
    local = sharding.local_layout(layout)
    pool_specs = KVPools(k=sharding.pool_spec, v=sharding.pool_spec)

    def local_attend(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array,
                     k: jax.Array, v: jax.Array, *extras: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Attention on this shard; also whether this shard's group holds the run."""
        offset = _group_offset(sharding, local)
        local_base = cursor[0] - offset
        owner = (local_base >= 0) & (local_base < local.num_pages)
        # The page table holds global ids: this group's pages, the local null page elsewhere.
        table = cursor[3:] - offset
        mine = owner & (table >= 0) & (table < local.num_pages)
        local_cursor = cursor.at[0].set(jnp.where(owner, local_base, 0)).at[3:].set(
            jnp.where(mine, table, local.null_page))
        extra_k, extra_v = extras if extras else (None, None)
        out = backend(local, pools, local_cursor, layer, q, k, v, extra_k, extra_v, scale=scale)
        return out, owner

    def owner_select(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array,
                     k: jax.Array, v: jax.Array, *extras: jax.Array) -> jax.Array:
        out, owner = local_attend(pools, cursor, layer, scale, q, k, v, *extras)
        if sharding.cfg == 1:
            return out
        # Only the group holding the run read real history: the groups exchange the
        # attention output (q-sized), never pool pages.
        return jax.lax.psum(jnp.where(owner, out, jnp.zeros_like(out)), CFG_AXIS)

    @functools.cache
    def unbatched_program(ndims: tuple[int, ...]) -> Any:
        # Jitted so that an eager call compiles once (an eager shard_map runs op by op, ~5 s a call).
        return jax.jit(jax.shard_map(owner_select, mesh=sharding.mesh,
                                     in_specs=(pool_specs, P(), P(), P(), *(sharding.heads_spec(n) for n in ndims)),
                                     out_specs=sharding.heads_spec(ndims[0])))

    def attend_own_branch(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array,
                          *rest: jax.Array) -> jax.Array:
        out, owner = local_attend(pools, cursor[0], layer, scale, q[0], *(x[0] for x in rest))
        # A branch whose run lives on another group cannot be answered here: NaN, not a wrong answer.
        return jnp.where(owner, out, jnp.full_like(out, jnp.nan))[None]

    @functools.cache
    def branch_program(ndims: tuple[int, ...]) -> Any:
        # [B, ..., H, D] arrays: the branch axis over "cfg", heads over "tp".
        specs = tuple(P(CFG_AXIS, *sharding.heads_spec(n - 1)) for n in ndims)
        return jax.jit(jax.shard_map(attend_own_branch, mesh=sharding.mesh,
                                     in_specs=(pool_specs, P(CFG_AXIS), P(), P(), *specs),
                                     out_specs=P(CFG_AXIS, *sharding.heads_spec(ndims[0] - 1))))

    @custom_vmap
    def attend(pools: KVPools, cursor: jax.Array, layer: jax.Array, scale: jax.Array, q: jax.Array,
               k: jax.Array, v: jax.Array, *extras: jax.Array) -> jax.Array:
        arrays = (q, k, v, *extras)
        return unbatched_program(tuple(x.ndim for x in arrays))(pools, cursor, layer, scale, *arrays)

    @attend.def_vmap
    def attend_batched(axis_size: int, in_batched: list[Any], pools: KVPools, cursor: jax.Array, layer: jax.Array,
                       scale: jax.Array, q: jax.Array, *rest: jax.Array) -> tuple[jax.Array, bool]:
        pools_batched = any(jax.tree_util.tree_leaves(in_batched[0]))
        one_branch_per_group = (sharding.cfg > 1 and axis_size == sharding.cfg and not pools_batched
                                and not in_batched[2] and not in_batched[3])
        if not one_branch_per_group:
            # Not the CFG layout: attend element by element with the unbatched rule.
            args = (pools, cursor, layer, scale, q, *rest)

            def element(i: int) -> jax.Array:
                picked = [jax.tree_util.tree_map(lambda x: x[i], a) if any(jax.tree_util.tree_leaves(b)) else a
                          for a, b in zip(args, in_batched)]
                return attend(*picked)
            return jnp.stack([element(i) for i in range(axis_size)]), True

        batched = [q, *rest]
        flags = in_batched[4:]
        # Broadcast the unbatched current/extra arrays so every array carries the branch axis.
        batched = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(batched, flags)]
        cursor = cursor if in_batched[1] else jnp.broadcast_to(cursor, (axis_size, *cursor.shape))
        return branch_program(tuple(x.ndim for x in batched))(pools, cursor, layer, scale, *batched), True

    return attend

