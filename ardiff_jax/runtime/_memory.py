"""The memory plan: session capacity from free memory, with the reference arithmetic.

Terms (``docs/reference_behaviour.md``, "Memory plan"), all in bytes unless named otherwise:

* ``P`` page bytes: one frame of K and V across all layers;
* ``S`` scratch pages per local branch: ``max(F + ceil(scratch_tokens / T), env override)``;
* ``X = L_local * S * P`` scratch, charged once (one request runs at a time);
* ``C`` cross-attention bytes per session: every cache, every *logical* branch;
* ``M`` model-owned bytes per session (declared by the pipeline);
* ``N(c) = L_local * (c * (K + W) + F) + 2`` managed pages for ``c`` resident sessions;
* ``required(c) = X + c * C + c * M + N(c) * P``.

The host tier (``EngineConfig(host_offload_bytes=B)``) holds evicted sessions off the
device: one costs ``H = L_local * (K + W) * P + C + M`` bytes of host memory (its runs,
its cross caches, its model-owned state at the declared bound), so ``floor(B / H)`` fit.

``configured = floor(available * fraction)``; one session that does not fit the free
memory is an error; ``budget = max(configured, required(1))`` (the fraction is a soft
floor: one viable session is always admitted); capacity is the largest
``c <= spec.session_capacity`` with ``required(c) <= budget``.

ardiff_jax allocates only what the runs need: ``capacity * L_local * (K + W)`` pages. The
remaining planned terms (the in-flight block, scratch, the +2 headroom) are the
forward's temporaries: the current block and register tokens reach attention as
arguments, never through the pools.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from ardiff_jax._checks import check_non_negative_int, check_positive_int
from ardiff_jax.capability import ARDiffusionKVCacheSpec
from ardiff_jax.types import check_kv_dtype

__all__ = [
    "SCRATCH_BLOCKS_ENV",
    "MemoryPlan",
    "plan_memory",
    "scratch_blocks_override",
    "free_memory_bytes",
]

logger = logging.getLogger("ardiff_jax.runtime")

#: Environment variable that may raise (never lower) the derived scratch pages per branch.
SCRATCH_BLOCKS_ENV = "AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH"


def scratch_blocks_override(environ: Any = None) -> int:
    """The scratch override from the environment (0 when unset); ValueError when invalid."""
    environ = os.environ if environ is None else environ
    raw = environ.get(SCRATCH_BLOCKS_ENV)
    if raw is None or raw.strip() == "":
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{SCRATCH_BLOCKS_ENV} must be a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{SCRATCH_BLOCKS_ENV} must be a non-negative integer, got {raw!r}")
    return value


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device: jax.Device | None = None) -> tuple[int, str]:
    """Free memory of ``device`` and where the number came from ("device" or "host").

    Accelerators report ``memory_stats()`` (``bytes_limit - bytes_in_use``; note JAX's GPU
    allocator preallocates, so ``bytes_limit`` is its pool). CPU backends return ``None``
    there, so the host's available RAM is used instead.
    """
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats:
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit")
        if limit:
            return max(0, int(limit) - int(stats.get("bytes_in_use", 0))), "device"
    return _host_available_bytes(), "host"


def _managed_pages(num_local: int, run_pages: int, frames_per_block: int, sessions: int) -> int:
    # Every resident session keeps a full sink + window per local branch; one request is in
    # flight at a time, so its block is counted once; +2 = null page + transient headroom.
    return num_local * (sessions * run_pages + frames_per_block) + 2


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every term of the capacity computation, in bytes unless named otherwise."""

    available_bytes: int
    memory_source: str
    gpu_memory_fraction: float
    configured_budget_bytes: int
    budget_bytes: int
    page_bytes: int
    scratch_blocks_per_branch: int
    scratch_bytes: int
    cross_attention_bytes_per_session: int
    model_owned_bytes_per_session: int
    num_local_kv_branches: int
    run_pages: int
    frames_per_block: int
    requested_session_capacity: int
    session_capacity: int
    managed_pages: int
    pool_pages: int
    dtype: str
    host_offload_bytes: int = 0
    tp: int = 1
    cfg: int = 1

    # -- derived --------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Devices one replica's pools are split over (``tp * cfg``)."""
        return self.tp * self.cfg

    @property
    def page_bytes_per_device(self) -> int:
        """One page's bytes averaged over the devices: heads split ``tp`` ways, pages ``cfg`` ways."""
        return -(-self.page_bytes // self.num_shards)

    @property
    def cross_attention_bytes_per_session_per_device(self) -> int:
        """Cross caches are split by heads over ``tp`` and held by every ``cfg`` group."""
        return -(-self.cross_attention_bytes_per_session // self.tp)

    @property
    def pool_bytes_per_device(self) -> int:
        """Bytes of the K and V pools one device holds."""
        return self.pool_bytes // self.num_shards
    @property
    def offload_bytes_per_session(self) -> int:
        """``H``: host bytes of one offloaded session (runs, cross caches, model-owned bound)."""
        return (self.num_local_kv_branches * self.run_pages * self.page_bytes
                + self.cross_attention_bytes_per_session + self.model_owned_bytes_per_session)

    @property
    def host_session_capacity(self) -> int:
        """Offloaded sessions the host tier holds at once (0 when offload is off)."""
        return self.host_offload_bytes // self.offload_bytes_per_session

    def managed_pages_for(self, sessions: int) -> int:
        """``N(c)``: managed pages the reference reserves for ``c`` resident sessions."""
        return _managed_pages(self.num_local_kv_branches, self.run_pages, self.frames_per_block, sessions)

    def required_bytes(self, sessions: int) -> int:
        """``required(c)``: bytes the plan charges one device for ``c`` resident sessions.

        On one device this is the reference's ``X + c*C + c*M + N(c)*P``; on a mesh the
        scratch and page terms are divided by ``tp * cfg`` and ``C`` by ``tp`` (rounded up).
        """
        return _required_per_device(self.scratch_bytes, self.cross_attention_bytes_per_session,
                                    self.model_owned_bytes_per_session, self.managed_pages_for(sessions),
                                    self.page_bytes, sessions, self.tp, self.cfg)

    @property
    def required_one_session_bytes(self) -> int:
        return self.required_bytes(1)

    @property
    def planned_bytes(self) -> int:
        """``required(capacity)``: what the plan charges for the effective capacity."""
        return self.required_bytes(self.session_capacity)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K and V pools actually allocated (``pool_pages * page_bytes``)."""
        return self.pool_pages * self.page_bytes

    @property
    def cross_attention_reserved_bytes(self) -> int:
        return self.session_capacity * self.cross_attention_bytes_per_session

    @property
    def model_owned_reserved_bytes(self) -> int:
        return self.session_capacity * self.model_owned_bytes_per_session

    @property
    def budget_raised(self) -> bool:
        """True when the fraction's budget was raised to admit one session."""
        return self.budget_bytes > self.configured_budget_bytes

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            required_one_session_bytes=self.required_one_session_bytes,
            planned_bytes=self.planned_bytes,
            pool_bytes=self.pool_bytes,
            cross_attention_reserved_bytes=self.cross_attention_reserved_bytes,
            model_owned_reserved_bytes=self.model_owned_reserved_bytes,
            budget_raised=self.budget_raised,
            offload_bytes_per_session=self.offload_bytes_per_session,
            host_session_capacity=self.host_session_capacity,
            num_shards=self.num_shards,
            page_bytes_per_device=self.page_bytes_per_device,
            cross_attention_bytes_per_session_per_device=self.cross_attention_bytes_per_session_per_device,
            pool_bytes_per_device=self.pool_bytes_per_device,
        )
        return out

    def __str__(self) -> str:
        def size(n: int) -> str:
            for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
                if n >= scale:
                    return f"{n:,} B ({n / scale:.2f} {unit})"
            return f"{n:,} B"

        rows = [
            ("available memory", f"{size(self.available_bytes)} [{self.memory_source}]"),
            ("memory fraction", f"{self.gpu_memory_fraction:g}"),
            ("configured budget", size(self.configured_budget_bytes)),
            ("budget", size(self.budget_bytes) + ("  (raised to fit one session)" if self.budget_raised else "")),
            ("page (frame, all layers, K+V)", size(self.page_bytes)),
            ("scratch pages per branch", str(self.scratch_blocks_per_branch)),
            ("scratch (charged once)", size(self.scratch_bytes)),
            ("cross-attention per session", size(self.cross_attention_bytes_per_session)),
            ("model-owned per session", size(self.model_owned_bytes_per_session)),
            ("required for one session", size(self.required_one_session_bytes)),
            ("session capacity", f"{self.session_capacity} (requested {self.requested_session_capacity})"),
            ("managed pages N(capacity)", str(self.managed_pages)),
            ("planned for capacity", size(self.planned_bytes)),
            ("allocated pool pages", f"{self.pool_pages} ({size(self.pool_bytes)})"),
            ("KV dtype", self.dtype),
            ("mesh", f"tp={self.tp} x cfg={self.cfg}" if self.num_shards > 1 else "one device"),
            ("pool bytes per device", size(self.pool_bytes_per_device)),
            ("host tier", size(self.host_offload_bytes) if self.host_offload_bytes else "off"),
            ("host bytes per offloaded session", size(self.offload_bytes_per_session)),
            ("offloaded sessions that fit", str(self.host_session_capacity)),
        ]
        header = "AR-Diffusion KV memory plan"
        if self.num_shards > 1:
            # On a mesh some figures are one device's (the budget and what is charged against
            # it) and some the whole replica's (a page holds every head): say which is which.
            per_device = {"available memory", "configured budget", "budget", "required for one session",
                          "planned for capacity", "model-owned per session"}
            unscoped = {"KV dtype", "mesh", "session capacity", "scratch pages per branch", "memory fraction",
                        "pool bytes per device", "host tier", "host bytes per offloaded session",
                        "offloaded sessions that fit"}  # counts, settings and host memory
            rows = [(name if name in unscoped else f"{name} [{'per device' if name in per_device else 'all devices'}]",
                     value) for name, value in rows]
            header += f" (tp={self.tp} x cfg={self.cfg}: [per device] is one device's share, [all devices] the sum)"
        width = max(len(name) for name, _ in rows)
        lines = [header] + [f"  {name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines)


def plan_memory(
    spec: ARDiffusionKVCacheSpec,
    *,
    dtype: Any,
    available_memory_bytes: int,
    gpu_memory_fraction: float = 0.1,
    memory_source: str = "explicit",
    scratch_override: int | None = None,
    host_offload_bytes: int = 0,
    tp: int = 1,
    cfg: int = 1,
) -> MemoryPlan:
    """Compute the plan for ``spec`` given free memory; ValueError if one session cannot fit.

    ``host_offload_bytes`` sizes the host tier (it changes no device term). ``tp`` and
    ``cfg`` plan a mesh: ``available_memory_bytes`` is then one device's, KV heads (self
    and cross) split ``tp`` ways, pages ``cfg`` ways (whole runs per group, so the capacity
    is rounded down until ``local branches * capacity`` divides by ``cfg``).
    """
    if not isinstance(spec, ARDiffusionKVCacheSpec):
        raise TypeError(f"spec must be an ARDiffusionKVCacheSpec, got {type(spec).__name__}")
    available_memory_bytes = check_non_negative_int("available_memory_bytes", available_memory_bytes)
    if isinstance(gpu_memory_fraction, bool) or not isinstance(gpu_memory_fraction, (int, float)) or not (
        0 < gpu_memory_fraction <= 1
    ):
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
    itemsize = jnp.dtype(check_kv_dtype(dtype)).itemsize
    override = scratch_blocks_override() if scratch_override is None else scratch_override
    override = check_non_negative_int("scratch override", override)
    host_offload_bytes = check_non_negative_int("host_offload_bytes", host_offload_bytes)
    tp, cfg = check_positive_int("tp", tp), check_positive_int("cfg", cfg)
    if spec.num_kv_heads % tp:
        raise ValueError(f"AR-Diffusion tensor parallelism: {spec.num_kv_heads} KV heads do not split over tp={tp}")
    for cache in spec.cross_attention:
        if spec.cross_attention_heads(cache.name) % tp:
            raise ValueError(f"AR-Diffusion tensor parallelism: cross-attention {cache.name!r} has "
                             f"{spec.cross_attention_heads(cache.name)} heads, which do not split over tp={tp}")

    num_local = spec.num_local_kv_branches
    tokens = spec.tokens_per_frame
    page_bytes = 2 * spec.num_layers * tokens * spec.num_kv_heads * spec.head_size * itemsize
    derived_scratch = spec.frames_per_block + math.ceil(spec.max_scratch_tokens_per_branch / tokens)
    scratch_blocks = max(derived_scratch, override)
    scratch_bytes = num_local * scratch_blocks * page_bytes
    num_logical = len(spec.kv_branches)
    cross_per_session = sum(
        2 * num_logical * cache.num_tokens * spec.cross_attention_heads(cache.name) * spec.head_size * itemsize
        * spec.num_layers
        for cache in spec.cross_attention
    )
    model_owned = spec.model_owned_state_bytes_per_session
    run_pages = spec.sink_frames + spec.window_frames

    pages_one = _managed_pages(num_local, run_pages, spec.frames_per_block, 1)
    required_one = _required_per_device(scratch_bytes, cross_per_session, model_owned, pages_one, page_bytes, 1,
                                        tp, cfg)

    configured = math.floor(available_memory_bytes * gpu_memory_fraction)
    if required_one > available_memory_bytes:
        raise ValueError(
            "AR-Diffusion KV cache: available device memory cannot fit one session"
            + (f" on a tp={tp} x cfg={cfg} mesh (per device): " if tp * cfg > 1 else ": ") +
            f"available={available_memory_bytes} bytes, required={required_one} bytes "
            f"(scratch {scratch_bytes}, cross-attention {cross_per_session}, model-owned {model_owned}, "
            f"{pages_one} pages of {page_bytes})"
        )
    budget = max(configured, required_one)
    if budget > configured:
        logger.warning(
            "AR-Diffusion memory fraction %.3g gives %d bytes, below the %d one session needs; "
            "admitting one session anyway (it fits the %d bytes free)",
            gpu_memory_fraction, configured, required_one, available_memory_bytes,
        )
    # required(c) is linear in c (up to rounding): the largest c within the budget.
    marginal = _required_per_device(0, cross_per_session, model_owned, num_local * run_pages, page_bytes, 1, tp, cfg)
    capacity = min(spec.session_capacity, 1 + (budget - required_one) // marginal)
    while capacity > 1 and _required_per_device(scratch_bytes, cross_per_session, model_owned,
                                                _managed_pages(num_local, run_pages, spec.frames_per_block, capacity),
                                                page_bytes, capacity, tp, cfg) > budget:
        capacity -= 1  # per-device rounding may cost a session
    # Each "cfg" group holds whole runs: local branches x capacity must split over the groups.
    step = cfg // math.gcd(num_local, cfg)
    capacity -= capacity % step
    if capacity == 0:
        raise ValueError(
            f"AR-Diffusion CFG parallelism: {num_local} local branch(es) per session split over cfg={cfg} device "
            f"groups need sessions in multiples of {step}, but only {min(spec.session_capacity, step - 1)} fit "
            f"(requested session_capacity {spec.session_capacity})")
    return MemoryPlan(
        available_bytes=available_memory_bytes,
        memory_source=memory_source,
        gpu_memory_fraction=float(gpu_memory_fraction),
        configured_budget_bytes=configured,
        budget_bytes=budget,
        page_bytes=page_bytes,
        scratch_blocks_per_branch=scratch_blocks,
        scratch_bytes=scratch_bytes,
        cross_attention_bytes_per_session=cross_per_session,
        model_owned_bytes_per_session=model_owned,
        num_local_kv_branches=num_local,
        run_pages=run_pages,
        frames_per_block=spec.frames_per_block,
        requested_session_capacity=spec.session_capacity,
        session_capacity=capacity,
        managed_pages=_managed_pages(num_local, run_pages, spec.frames_per_block, capacity),
        pool_pages=capacity * num_local * run_pages,
        dtype=jnp.dtype(dtype).name,
        host_offload_bytes=host_offload_bytes,
        tp=tp,
        cfg=cfg,
    )


def _required_per_device(scratch: int, cross: int, model_owned: int, pages: int, page_bytes: int, sessions: int,
                         tp: int, cfg: int) -> int:
    # Pages and scratch split over every shard, cross caches over "tp" only (each "cfg"
    # group keeps every branch's), model-owned state is replicated. Rounded up per device.
    shards = tp * cfg
    return (-(-(scratch + pages * page_bytes) // shards) + sessions * (-(-cross // tp) + model_owned))
