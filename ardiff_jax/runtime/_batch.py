"""Batched ticks: one paged view over the slots of many sessions, and the batch bucket sizes.

A batched tick runs the next block of ``B`` distinct sessions as one jitted call. The
runner binds an :class:`ARDiffusionKVBatch` to a pipeline that implements
:class:`~ardiff_jax.capability.SupportsARDiffusionBatch`; the pipeline asks it for one
:class:`~ardiff_jax.kv.PagedKVCaches` whose cursor has one row per session
(``i32[Bp, 3]``), vmaps its single-session forward over the rows, and hands the batch's
per-row K/V back to :meth:`ARDiffusionKVBatch.commit_paged_context`, which writes every
session's block with one donated program.

Batch sizes are padded up to a *bucket* (:func:`batch_buckets`) so that the compiled
programs depend on the bucket only, never on which or how many sessions a tick holds.
Padded rows read nothing (their cursor says nothing is committed, so every page is
invisible) and write nothing (their pages are the null page).

Everything follows the state handle's transaction rule: validate on the host, dispatch
one device call, then publish bookkeeping. A pipeline's own model state of the batch
follows it too, one step later: ``forward_batch`` hands it to
:meth:`ARDiffusionKVBatch.defer_publish`, and the runner installs it only once it has
awaited the batch's device work (an asynchronous device error, as an out-of-memory at
execution time, surfaces only there), so the one-by-one rerun of a failed batch starts
from the model state before the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from ardiff_jax._checks import check_not_traced
from ardiff_jax.kv import PagedKVCaches, make_table_cursor
from ardiff_jax.runtime._legacy import branch_of
from ardiff_jax.runtime._state import commit_planned, plan_commits, prepare_forwards

if TYPE_CHECKING:  # pragma: no cover
    from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
    from ardiff_jax.runtime._state import ARDiffusionKVState

__all__ = ["ARDiffusionBatchError", "ARDiffusionKVBatch", "SessionRestoreError", "batch_buckets", "bucket_for"]


def batch_buckets(capacity: int) -> tuple[int, ...]:
    """The batch sizes compiled for ``capacity`` resident sessions: 2, 4, 8, ... below it, then ``capacity``.

    Why powers of two: ``ceil(log2(capacity))`` programs cover every batch size, and a batch
    is padded to less than twice its size (the padded rows cost compute, never memory
    traffic of their own: they read and write no page). Why not 1: a batch of one runs the
    unbatched program ``generate`` runs, bit for bit. Why ``capacity`` last: no batch is
    larger (admission refuses it), so a bucket above it would never run.
    """
    buckets: list[int] = []
    size = 2
    while size < capacity:
        buckets.append(size)
        size *= 2
    if capacity >= 2:
        buckets.append(capacity)
    return tuple(buckets)


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``size`` rows; ValueError when none does."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise ValueError(f"a batch of {size} exceeds the largest batch bucket {max(buckets, default=1)}")


class ARDiffusionBatchError(RuntimeError):
    """Some requests of a batch failed; the others completed exactly as if run one by one.

    Raised by :meth:`~ardiff_jax.ARDiffusionEngine.generate_batch` after every request ran.
    Each failing session was left as ``generate`` leaves it when the same step fails:

    * a failed forward releases it (fail-closed: KV dropped, close hook, event reason
      ``"forward_exception"``);
    * a failed restore of an offloaded session (its pages could not be written back, or the
      pipeline refused its model state) leaves it offloaded when the failure came before the
      pipeline's import, and releases it (close hook, ``"restore_failed"``) when the import
      failed; its error is a :class:`SessionRestoreError` naming the session, the cause and
      where the session is now (the original exception is its ``__cause__``).

    Every other session advanced by one block and its output is here.

    Attributes:
      outputs: one entry per request, in request order: the output, or ``None`` for a
        request that failed.
      errors: ``{session_id: exception}`` of the failed requests, in request order.
    """

    def __init__(self, outputs: Sequence[Any], errors: dict[str, BaseException]) -> None:
        self.outputs = list(outputs)
        self.errors = dict(errors)
        failed = ", ".join(f"{sid!r}: {error!r}" for sid, error in errors.items())
        super().__init__(f"{len(errors)} of {len(self.outputs)} requests of the batch failed ({failed}); only those "
                         "sessions failed (released, or left offloaded by a restore that failed before the "
                         "pipeline's import), the others' outputs are in .outputs")


class SessionRestoreError(RuntimeError):
    """An offloaded session could not be made resident again for a request of a batch.

    ``session_id`` names it, ``offloaded`` says where it is now: ``True``, still in the host
    tier exactly as before (the failure came before the pipeline's import; its next request
    tries the restore again), or ``False``, released with its close hook (the pipeline's
    import or the check of its model state failed; its next request starts it anew). The
    exception that made the restore fail is ``__cause__``.
    """

    session_id: str = ""
    offloaded: bool = False

    @classmethod
    def wrap(cls, session_id: str, cause: BaseException, *, offloaded: bool) -> SessionRestoreError:
        where = ("it is still offloaded, unchanged, and its next request tries the restore again" if offloaded else
                 "it was released (close hook) and its next request starts it anew")
        error = cls(f"AR-Diffusion session {session_id!r} could not be restored from the host tier "
                    f"({type(cause).__name__}: {cause}); {where}")
        error.session_id = session_id  # attributes, not arguments: the exception pickles (Ray) as it is
        error.offloaded = offloaded
        error.__cause__ = cause
        return error


class ARDiffusionKVBatch:
    """The paged KV of the sessions of one batched tick, bound to the pipeline for one ``forward_batch``.

    ``states[i]`` is the :class:`~ardiff_jax.ARDiffusionKVState` of ``session_ids[i]`` (request
    order); each is bound too, so a pipeline may use a session's own methods (its
    cross-attention caches, a per-session prefill commit) alongside the batched ones.
    ``bucket_size >= size`` is the padded batch size the compiled programs see.

    Like a state, a batch is usable only inside its invocation; it holds no pool array.
    """

    def __init__(self, cache: ARDiffusionKVCache, states: Sequence[ARDiffusionKVState], bucket_size: int) -> None:
        states = tuple(states)
        if not states or bucket_size < len(states):
            raise ValueError(f"ARDiffusionKVBatch needs 1..{bucket_size} states, got {len(states)}")
        if cache.sharding is not None:
            raise ValueError("ARDiffusionKVBatch needs pools on one device; on a mesh the runner runs batches "
                             "one request at a time")
        self._cache = cache
        self._states = states
        self._bucket_size = int(bucket_size)
        self._bound = False
        self._index = {state.session_id: i for i, state in enumerate(states)}
        if len(self._index) != len(states):
            raise ValueError("ARDiffusionKVBatch sessions must be distinct")
        self._deferred: list[tuple[Callable[[], None], Any]] = []  # (publish, arrays): see defer_publish

    # -- a handle, not a value -------------------------------------------------------------------
    def _refuse_copy(self, *args: Any) -> NoReturn:
        raise TypeError("ARDiffusionKVBatch cannot be copied or pickled: it is a handle to sessions' slots")

    __copy__ = _refuse_copy
    __deepcopy__ = _refuse_copy
    __reduce_ex__ = _refuse_copy

    def _set_bound(self, bound: bool) -> None:
        """Bound to (``True``) or unbound from (``False``) the one ``forward_batch`` now running."""
        self._bound = bound

    def _check_bound(self) -> None:
        if not self._bound:
            raise RuntimeError("ARDiffusionKVBatch was used outside its runner invocation; pipelines must not "
                               "retain the bound batch")

    # -- identity ------------------------------------------------------------------------------
    @property
    def states(self) -> tuple[ARDiffusionKVState, ...]:
        self._check_bound()
        return self._states

    @property
    def session_ids(self) -> tuple[str, ...]:
        return tuple(state.session_id for state in self._states)

    @property
    def size(self) -> int:
        """Real rows (sessions)."""
        return len(self._states)

    @property
    def bucket_size(self) -> int:
        """Rows the compiled programs see: ``size`` plus padding."""
        return self._bucket_size

    def state(self, session_id: str) -> ARDiffusionKVState:
        self._check_bound()
        try:
            return self._states[self._index[session_id]]
        except KeyError:
            raise KeyError(f"session {session_id!r} is not in this batch {list(self._index)}") from None

    def __repr__(self) -> str:
        return f"ARDiffusionKVBatch({list(self.session_ids)}, bucket_size={self._bucket_size})"

    # -- the batched paged view ----------------------------------------------------------------
    def get_kv_caches(self, kv_branch: str, seq_len: int | None = None, commit_current: bool = False
                      ) -> PagedKVCaches:
        """One view over ``kv_branch`` of every session: cursor ``i32[bucket_size, 3 + K + W]``, padded rows read nothing.

        Each session is prepared exactly as :meth:`ARDiffusionKVState.get_kv_caches` prepares
        it (same checks, same pending context); if one refuses, no session keeps a new
        pending context. Attend under ``jax.vmap(..., in_axes=caches.vmap_axes())``.
        """
        self._check_bound()
        kv_branch = branch_of(kv_branch, "get_kv_caches")
        views = prepare_forwards(self._states, kv_branch, seq_len, commit_current)  # all or nothing
        layout = self._cache.layout
        padding = make_table_cursor(0, 0, 0, (layout.null_page,) * layout.run_pages)  # committed 0: nothing visible
        cursors = np.stack([np.asarray(view.cursor) for view in views] + [padding] * (self._bucket_size - len(views)))
        first = views[0]
        return PagedKVCaches(pools=self._cache.pools, cursor=cursors, layout=first.layout, seq_len=first.seq_len,
                             backend=first.backend, sharding=None)

    def commit_paged_context(self, kv_branch: str, kv: tuple[jax.Array, jax.Array] | None = None) -> None:
        """Commit the pending forward of ``kv_branch`` of every session: one donated write, then every cursor.

        A committing context needs ``kv=(k, v)``, each ``[bucket_size, num_layers, seq_len, H, D]``
        (row ``i`` is session ``i``'s block; padded rows are ignored). Every session's commit
        is validated (:func:`~ardiff_jax.runtime.commit_frames`) before the write; a refused
        commit changes nothing. A non-committing context is cleared and must not pass ``kv``.
        """
        self._check_bound()
        kv_branch = branch_of(kv_branch, "commit_paged_context")
        check_not_traced("ARDiffusionKVBatch.commit_paged_context", kv)
        pending = [state.pending_context(kv_branch) for state in self._states]  # usable, known branch
        if all(p is None for p in pending):
            if kv is not None:
                raise ValueError(f"AR-Diffusion branch {kv_branch!r} has no pending batched context to commit kv "
                                 "into; call batch.get_kv_caches(branch, seq_len=..., commit_current=True) first")
            return
        if any(p is None for p in pending) or len({(p.seq_len, p.commit_current) for p in pending}) != 1:
            raise RuntimeError(f"AR-Diffusion branch {kv_branch!r}: the sessions of the batch were not prepared "
                               "together (batch.get_kv_caches); commit them one by one")
        context = pending[0]
        if not context.commit_current:
            if kv is not None:
                raise ValueError(f"AR-Diffusion branch {kv_branch!r}: the pending batched context is non-committing "
                                 "(commit_current=False); it cannot be committed with kv")
            for state in self._states:
                state.discard_paged_context(kv_branch)
            return
        if kv is None:
            raise ValueError(f"AR-Diffusion branch {kv_branch!r}: a committing batched context must be committed with "
                             f"kv=(k, v) of shape [{self._bucket_size}, num_layers, {context.seq_len}, H, D]")
        k, v = self._validate_block_kv(kv, context.seq_len)
        # Every refusal before the write; rows planned together (a session and its fork overwrite the same
        # shared pages); every session published only after the one donated write returned.
        commit_planned(plan_commits(self._states, kv_branch, context.num_frames), k, v)

    def discard_paged_context(self, kv_branch: str) -> None:
        """Drop the pending context of ``kv_branch`` of every session without writing."""
        self._check_bound()
        for state in self._states:
            state.discard_paged_context(kv_branch)

    # -- the pipeline's model state: installed only once the batch is known good -----------------
    def defer_publish(self, publish: Callable[[], None], arrays: Any = ()) -> None:
        """Install the batch's staged model state with ``publish()`` once the runner knows the batch good.

        ``forward_batch`` dispatches device work and returns before it ran: a device error
        (an out-of-memory at execution time on an accelerator) surfaces only when the runner
        awaits the outputs. So a pipeline stages its sessions' model state and hands its
        installation here instead of installing it itself. After ``forward_batch`` returns,
        the runner awaits the outputs, the pool writes and ``arrays`` (a pytree: the staged
        state's device arrays), then calls every ``publish``, in order. If ``forward_batch``
        raises or any of that fails, no ``publish`` runs: the runner reruns the requests one by
        one from exactly the model state before the batch. ``publish`` runs on the host and
        must not raise (it installs what was staged, e.g. ``dict.update``); if it does, every
        session of the batch is released (fail-closed), as its state is then half installed.
        """
        self._check_bound()
        if not callable(publish):
            raise TypeError(f"defer_publish(publish) needs a callable, got {type(publish).__name__}")
        self._deferred.append((publish, arrays))

    def _deferred_arrays(self) -> list[Any]:
        """What the runner awaits besides the outputs before it publishes (the staged model state)."""
        return [arrays for _, arrays in self._deferred]

    def _publish_deferred(self) -> None:
        """The runner, after the batch's device work is known good: install the staged model state."""
        deferred, self._deferred = self._deferred, []
        for publish, _ in deferred:
            publish()

    def _drop_deferred(self) -> None:
        """The runner, on a failed batch: the staged model state is never installed (its arrays freed now)."""
        self._deferred = []

    def _validate_block_kv(self, kv: Any, seq_len: int) -> tuple[jax.Array, jax.Array]:
        layout = self._cache.layout
        try:
            k, v = kv
        except (TypeError, ValueError):
            raise ValueError("AR-Diffusion batched kv must be a (k, v) pair") from None
        expected = (self._bucket_size, layout.num_layers, seq_len, layout.num_kv_heads, layout.head_size)
        for name, x in (("k", k), ("v", v)):
            shape = tuple(getattr(x, "shape", ()))
            dtype = getattr(x, "dtype", None)
            if shape != expected or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"AR-Diffusion batched commit {name} must be a float array of shape {expected}, "
                                 f"got {getattr(x, 'dtype', type(x).__name__)}{list(shape)}")
        return k, v
