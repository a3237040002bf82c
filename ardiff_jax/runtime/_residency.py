"""``Residency``: which sessions are resident, which are on the host, and every move between them.

It composes the two policy objects (:class:`~ardiff_jax.runtime.SessionTable`: LRU order,
capacity, pins; :class:`~ardiff_jax.runtime.HostSessionTier`: the host records and their
bytes) and carries out their decisions: admit a session (create, or restore from the host
tier), make room (evict: offload where possible, else release), offload on request, restore
(from the tier or a file), admit a batch without evicting its own sessions, release (KV
first, then the pipeline hook). Pipeline code (hooks, export, import) runs through the
:class:`~ardiff_jax.runtime._gate.PipelineGate`; events go to the
:class:`~ardiff_jax.runtime._events.EventLog`.

:meth:`Residency.admission_refusal` is the pure "can these be resident together" check,
made before anything moves; a page budget can replace it without touching the moves.
:meth:`Residency.fork_refusal` and :meth:`Residency.offload_refusal` are the same for a
fork and an offload on request: they read, change nothing, and name the exception a
refused call raises (a :class:`Refusal`). :meth:`Residency.validate_request` runs the
pipeline's check of a request, against an offloaded session's model state where the session
is on the host (imported for the call and exported straight back). The runner holds the
lock and decides when; this decides nothing about requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence

from ardiff_jax.runtime._batch import SessionRestoreError
from ardiff_jax.runtime._events import EventLog
from ardiff_jax.runtime._gate import PipelineGate, committing
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._offload import (
    HostSessionTier,
    OffloadedSession,
    host_cross_attention,
    record_nbytes,
    to_device,
)
from ardiff_jax.runtime._session import SessionKV, check_session_kv
from ardiff_jax.runtime._session_table import SessionTable
from ardiff_jax.runtime._state import ARDiffusionKVState
from ardiff_jax.types import DiffusionRequest

__all__ = ["Refusal", "Residency", "repeated_sessions"]

logger = logging.getLogger("ardiff_jax.runtime")


def repeated_sessions(session_ids: Sequence[str]) -> list[str]:
    """The session ids that appear more than once, sorted."""
    seen: set[str] = set()
    return sorted({sid for sid in session_ids if sid in seen or seen.add(sid)})


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a call is refused, and as what: ``error(message)`` is what the refused call raises."""

    error: type[Exception]
    message: str

    def exception(self) -> Exception:
        return self.error(self.message)


class Residency:
    """The session table and the host tier, and the moves between device slots, host memory and nowhere.

    Args:
      kv_cache: the runner's cache (slots, pages, placements).
      gate: the runner's pipeline gate (hooks, export, import).
      events: the runner's event log.
      host_offload_bytes: the host tier's capacity (0: evicted sessions are released).
    """

    def __init__(self, kv_cache: ARDiffusionKVCache, gate: PipelineGate, events: EventLog,
                 host_offload_bytes: int) -> None:
        self._kv_cache = kv_cache
        self._gate = gate
        self._events = events
        self.table: SessionTable[ARDiffusionKVState] = SessionTable(kv_cache.session_capacity)
        self.host = HostSessionTier(host_offload_bytes)
        #: Sessions with a stepwise chunk in flight, by id: when its first step started (the chunk's wall time).
        self.stepwise_started: dict[str, float] = {}

    def __contains__(self, session_id: object) -> bool:
        """Resident or offloaded."""
        return session_id in self.table or session_id in self.host

    def in_use(self, session_id: str) -> bool:
        """Whether resident ``session_id`` cannot move now: a block in flight (committing or stepwise) or a pin."""
        state = self.table.get(session_id)
        return ((state is not None and committing(state)) or session_id in self.stepwise_started
                or self.table.is_pinned(session_id))

    def admission_refusal(self, session_ids: Sequence[str]) -> str | None:
        """Why these sessions cannot all be resident at once (``None``: they can). Pure: reads, changes nothing.

        A repeated id, more sessions than slots, or too few slots beside the sessions a
        serving layer pinned. Made before anything moves, so a refusal changes nothing.
        """
        repeated = repeated_sessions(session_ids)
        if repeated:
            return f"a batch holds each session at most once; repeated: {repeated}"
        capacity = self._kv_cache.session_capacity
        if len(session_ids) > capacity:
            return (f"a batch of {len(session_ids)} sessions exceeds the session capacity {capacity}: the "
                    f"sessions of one batch must all be resident; split it into batches of at most {capacity}")
        wanted = set(session_ids)
        pinned = [sid for sid in self.table.lru_order if self.table.is_pinned(sid) and sid not in wanted]
        if len(session_ids) + len(pinned) > capacity:
            return (f"a batch of {len(session_ids)} sessions cannot be resident beside the pinned sessions "
                    f"{pinned} (capacity {capacity})")
        return None

    def offload_refusal(self, session_id: str) -> Refusal | None:
        """Why resident ``session_id`` cannot move to the host tier now (``None``: it can). Pure: reads only.

        Host offload off (RuntimeError), an offloaded id (ValueError), an unknown one
        (KeyError), then what :meth:`moving_refusal` refuses (RuntimeError).
        """
        if not self.host.capacity_bytes:
            return Refusal(RuntimeError,
                           f"AR-Diffusion cannot offload {session_id!r}: host offload is off (EngineConfig("
                           "host_offload_bytes=0), or the pipeline does not implement SupportsARDiffusionSessionExport)")
        if session_id in self.host:
            return Refusal(ValueError, f"AR-Diffusion session {session_id!r} is offloaded already")
        if session_id not in self.table:
            return Refusal(KeyError, f"AR-Diffusion session {session_id!r} is not resident")
        return self.moving_refusal([session_id], what=f"offload {session_id!r}")

    def moving_refusal(self, session_ids: Sequence[str], *, what: str) -> Refusal | None:
        """Why the resident ``session_ids`` cannot all move to the host tier, losing none (``None``: they can).

        A session in use (a block in flight, a pin), or a tier that holds them only by
        dropping sessions it holds (the per-session estimate of the memory plan). Pure.
        """
        for session_id in session_ids:
            if self.in_use(session_id):
                return Refusal(RuntimeError,
                               f"AR-Diffusion cannot {what}: session {session_id!r} has a block in flight")
        needed = len(session_ids) * self._kv_cache.plan.offload_bytes_per_session
        free = self.host.capacity_bytes - self.host.bytes_used
        if needed > free:
            return Refusal(RuntimeError,
                           f"AR-Diffusion cannot {what}: moving {len(session_ids)} session(s) to the host tier needs "
                           f"about {needed} bytes and {free} of its {self.host.capacity_bytes} are free (it would drop "
                           "sessions it holds; close one)")
        return None

    def fork_victims(self, source_id: str) -> list[str]:
        """The resident sessions a fork of ``source_id`` moves to the host tier to find its slots (LRU first).

        As many as the fork is short of free slots (two for an offloaded source: its own and
        the fork's), never the source nor a pinned session; fewer when too few may go. Pure.
        """
        short = (2 if source_id in self.host else 1) - self._kv_cache.num_free_slots
        if short <= 0:
            return []
        return [sid for sid in self.table.lru_order if sid != source_id and not self.table.is_pinned(sid)][:short]

    def fork_refusal(self, source_id: str, new_id: str) -> Refusal | None:
        """Why ``new_id`` cannot be forked from ``source_id`` now (``None``: it can). Pure: reads only.

        An unknown source (KeyError); ``new_id`` taken (ValueError); a resident source with a
        forward context pending or a stepwise chunk in flight (RuntimeError); too few free
        slots without host offload, too few sessions that may move, or victims that cannot
        move (:meth:`moving_refusal`) (RuntimeError).
        """
        offloaded = source_id in self.host
        if source_id not in self.table and not offloaded:
            return Refusal(KeyError, f"AR-Diffusion session {source_id!r} is neither resident nor offloaded")
        if new_id == source_id or new_id in self:
            return Refusal(ValueError, f"AR-Diffusion session id {new_id!r} is taken; a fork needs a new id")
        if not offloaded and (self.table.get(source_id).checkpoint().pending or source_id in self.stepwise_started):
            return Refusal(RuntimeError,
                           f"AR-Diffusion session {source_id!r} has a block in flight; fork it between blocks")
        needed = 2 if offloaded else 1
        short = needed - self._kv_cache.num_free_slots
        if short <= 0:
            return None
        if not self.host.capacity_bytes:
            return Refusal(RuntimeError,
                           f"AR-Diffusion cannot fork {source_id!r}: {needed} free slot(s) needed, "
                           f"{self._kv_cache.num_free_slots} free of {self._kv_cache.session_capacity} (without host "
                           "offload a fork never evicts a session; close one or turn host offload on)")
        victims = self.fork_victims(source_id)
        if len(victims) < short:
            return Refusal(RuntimeError, f"AR-Diffusion cannot fork {source_id!r}: {needed} free slot(s) needed and "
                           "every other resident session is in use")
        return self.moving_refusal(victims, what=f"fork {source_id!r}")

    def validate_request(self, session_id: str, request: DiffusionRequest,
                         restore_failures: dict[str, BaseException] | None = None, *, dry_run: bool = False) -> None:
        """The pipeline's optional host-side check of ``request``, before any session or KV changes.

        An offloaded session is checked against its model state: the state is imported for
        the call and exported straight back (a copy of the small model state, no pages), so
        a refused request leaves the session offloaded and every other session where it was.
        If that import or export fails, the session cannot be restored: it is released
        (``"restore_failed"``, close hook) and the error raised, as a failed restore's.

        With ``restore_failures`` (a batch) such a failure is recorded there instead of
        raised: only that request fails. With ``dry_run`` (``validate_batch``) a failed import
        is ignored and nothing released: nothing was imported, and the batch that follows
        probes again and reports it as that request's failure.
        """
        gate = self._gate
        record = self.host.get(session_id) if gate.validates else None
        if record is None:
            gate.validate(session_id, request)
            return
        try:
            gate.import_session(session_id, to_device(record.pipeline_state, self._kv_cache.state_placement))
        except Exception as error:
            if dry_run:
                logger.info("AR-Diffusion validation of offloaded session %r could not import its model state "
                            "(%r); its request will fail when it runs", session_id, error)
                return
            self.release(session_id, reset_model=False, reason="restore_failed", suppress_errors=True)
            if restore_failures is None:
                raise
            restore_failures[session_id] = error
            return
        try:
            gate.validate(session_id, request)
        except BaseException:
            if self._export_validated(session_id, restore_failures, dry_run):
                raise
            return  # the session is gone: its request fails as a restore, its refusal is moot
        self._export_validated(session_id, restore_failures, dry_run)

    def _export_validated(self, session_id: str, restore_failures: dict[str, BaseException] | None,
                          dry_run: bool) -> bool:
        """Export the state imported for a validation back out (the record keeps its own copy); whether it could.

        If the pipeline fails at it, it may hold the session's state beside the record: the
        session is released (``"restore_failed"``) and the error raised, or recorded in
        ``restore_failures`` (a batch), or logged (``dry_run``).
        """
        try:
            self._gate.export_session(session_id)
        except Exception as error:
            self.release(session_id, reset_model=False, reason="restore_failed", suppress_errors=True)
            if restore_failures is not None:
                restore_failures[session_id] = error
            elif dry_run:
                logger.warning("AR-Diffusion validation of offloaded session %r could not export its model state back "
                               "(%r); the session was released", session_id, error)
            else:
                raise
            return False
        return True

    def fork(self, source_id: str, new_id: str, noise_seed: int | None) -> None:
        """Start ``new_id`` from where ``source_id`` stands, sharing its pages (after :meth:`fork_refusal`).

        The :meth:`fork_victims` move to the host tier first; an offloaded source is restored;
        the pipeline forks its model state. A failing fork leaves no trace of ``new_id``: its
        slot is freed and the pipeline's close hook drops whatever model state the fork hook
        imported.
        """
        victims = self.fork_victims(source_id)
        if victims:
            self.offload(victims, reason="lru_eviction", what=f"fork {source_id!r}")
        if source_id in self.host:
            self.restore(self.host.pop(source_id), reason="offload", hold_on_failure=True)
        state = self._kv_cache.fork_state(self.table.get(source_id), new_id)  # holds the shared pages: no copy
        try:
            self._gate.fork(source_id, new_id, noise_seed)
        except BaseException:
            state._release()
            # Undo whatever model state the hook imported, also when the hook itself failed
            # after importing: left behind, it would refuse the next fork under new_id and
            # seed a new session under new_id from the source. new_id is neither resident
            # nor offloaded here, so the pipeline holds nothing else under it.
            with contextlib.suppress(Exception):
                self._gate.hook(new_id, reset=False)
            raise
        state._adopt()
        self.table.add(new_id, state)
        self.table.touch(source_id)
        self._events.emit("created", new_id, "fork")
        logger.info("AR-Diffusion session %r forked from %r (slot %s; %d pages shared)", new_id, source_id,
                    state.slot, sum(len(table) for table in state.checkpoint().value.pages))

    def admit(self, session_id: str) -> ARDiffusionKVState:
        state = self.table.get(session_id)
        if state is not None:
            return self.table.touch(session_id)
        # An offloaded session leaves the host tier first, so the eviction below cannot drop it.
        record = self.host.pop(session_id)
        if record is not None:
            return self.restore_making_room(record, reason="offload")
        self._make_room()
        state = self._kv_cache.create_state(session_id)
        state._adopt()
        self.table.add(session_id, state)
        logger.info("AR-Diffusion session %r created (slot %s; %d resident)", session_id, state.slot,
                    len(self.table))
        self._events.emit("created", session_id)
        return state

    def admit_batch(self, session_ids: list[str]
                     ) -> tuple[dict[str, ARDiffusionKVState], dict[str, BaseException]]:
        """Make every session of the batch resident (create or restore); none evicts another of the batch.

        Returns ``(states, failures)`` by session id. The batch's resident sessions are pinned
        first and each admitted one right after its admission, so an admission's LRU eviction
        only picks sessions outside the batch. Offloaded sessions are restored before any new
        session is created: a record displaced from a full host tier by an eviction is then
        never one of the batch's own (the batch would silently start it anew). A session that
        cannot be admitted (its restore fails, or an eviction for it raises) fails alone, as
        ``generate`` would leave it (a restore error is a :class:`SessionRestoreError`); the
        others are admitted all the same. Finally the admitted sessions are touched in request
        order: the LRU order is the one ``generate`` in request order would leave.
        """
        table = self.table
        host = self.host
        pinned: list[str] = []
        states: dict[str, ARDiffusionKVState] = {}
        failures: dict[str, BaseException] = {}
        restores = [sid for sid in session_ids if sid in host]
        order = restores + [sid for sid in session_ids if sid not in host]
        try:
            for session_id in session_ids:
                if session_id in table:
                    table.pin(session_id)
                    pinned.append(session_id)
            for session_id in order:
                try:
                    states[session_id] = self.admit(session_id)
                except Exception as error:
                    logger.warning("AR-Diffusion session %r of a batch could not be made resident (%r); only its "
                                   "request fails", session_id, error)
                    failures[session_id] = error
                    continue
                if session_id not in pinned:
                    table.pin(session_id)
                    pinned.append(session_id)
            for session_id in session_ids:
                if session_id in states and session_id in table:
                    table.touch(session_id)
        finally:
            for session_id in pinned:
                if session_id in table:
                    table.unpin(session_id)
        for session_id in restores:  # where the session is now: after every admission of the batch
            if session_id in failures:
                failures[session_id] = SessionRestoreError.wrap(session_id, failures[session_id],
                                                                offloaded=session_id in host)
        return states, failures

    def _make_room(self, held: list[OffloadedSession] | None = None) -> None:
        """Evict (offload where possible) the least recently used sessions so that one more fits.

        With ``held``, the records of the sessions offloaded go there instead of into the host
        tier (see :meth:`restore_making_room`).
        """
        for victim in self.table.eviction_victims():
            self._evict(victim, held)

    def restore_making_room(self, record: OffloadedSession, *, reason: str) -> ARDiffusionKVState:
        """Make room (evicting the least recently used session) and restore ``record`` (from the tier or a file).

        The sessions evicted to make room enter the host tier only once the restore is over,
        so that a failed restore costs nobody but its own session: an offloaded session whose
        restore failed goes back into the tier first (it fits: nothing entered since its pop),
        and an evicted record that does not fit beside it displaces it rather than another
        session's record. Only what a successful restore displaces too (the oldest records,
        when even that room is short) leaves the tier as any admission's victims do.
        """
        offloaded = reason == "offload"
        held: list[OffloadedSession] = []
        try:
            try:
                self._make_room(held)
            except BaseException:
                if offloaded:
                    self.host.add(record)  # nothing entered the tier since its pop: it fits as it did
                raise
            state = self.restore(record, reason=reason, hold_on_failure=offloaded)
        except BaseException:
            self._admit_evicted(held, failed=record.session_id, suppress_errors=True)
            raise
        self._admit_evicted(held)
        return state

    def _admit_evicted(self, records: list[OffloadedSession], *, failed: str | None = None,
                       suppress_errors: bool = False) -> None:
        """Put the records held by :meth:`restore_making_room` into the host tier, oldest eviction first.

        ``failed`` names the session whose restore failed: if it went back into the tier and a
        held record does not fit beside it, it is the one released (``"restore_failed"``, close
        hook), never another session. Errors of the hooks of dropped records are raised after
        every record is held (logged instead with ``suppress_errors``).
        """
        errors: list[BaseException] = []
        for record in records:
            if failed is not None and failed in self.host and self.host.admission_victims(record.nbytes):
                self.release(failed, reset_model=False, reason="restore_failed", suppress_errors=True)
            try:
                self._hold_offloaded(record)
            except Exception as error:  # a dropped record's close hook: the record is held already
                errors.append(error)
        if not errors:
            return
        if not suppress_errors:
            raise errors[0]
        for error in errors:
            logger.warning("AR-Diffusion close hook of a session dropped from the host tier failed: %r", error)

    def _evict(self, session_id: str, held: list[OffloadedSession] | None = None) -> None:
        """Offload ``session_id`` to the host tier (or ``held``); release it (close hook) if it cannot be offloaded."""
        record = self._offload_record(session_id) if self.host.capacity_bytes else None
        if record is None:
            self.release(session_id, reset_model=False, reason="lru_eviction")
            return
        state = self.table.remove(session_id)
        state._release()
        self._events.emit("offloaded", session_id, "lru_eviction")
        logger.info("AR-Diffusion session %r offloaded to host memory (%d bytes)", session_id, record.nbytes)
        if held is None:
            self._hold_offloaded(record)
        else:
            held.append(record)

    def _offload_record(self, session_id: str) -> OffloadedSession | None:
        """The host record of a resident session, its model state moved out; ``None`` (nothing moved) if impossible."""
        state = self.table.get(session_id)
        value = state.checkpoint().value
        estimate = self._kv_cache.plan.offload_bytes_per_session
        if committing(state) or not self.host.fits(estimate):
            logger.info("AR-Diffusion session %r cannot be offloaded (%s); releasing it", session_id,
                        "a committing forward context is pending" if committing(state) else
                        f"{estimate} bytes exceed the host tier of {self.host.capacity_bytes}")
            return None
        try:
            record = self.copy_out(session_id, value)
        except Exception as error:
            logger.warning("AR-Diffusion offload of session %r failed (%r); releasing it instead", session_id, error)
            return None
        if not self.host.fits(record.nbytes):
            logger.warning("AR-Diffusion session %r needs %d host bytes, more than the tier's %d; releasing it",
                           session_id, record.nbytes, self.host.capacity_bytes)
            return None
        return record

    def copy_out(self, session_id: str, value: SessionKV, *, keep: bool = False) -> OffloadedSession:
        """Copy a resident session's pages and cross caches to host memory and export its model state.

        With ``keep`` the model state is imported straight back (``save_session`` of a resident
        session): the pipeline's only way to hand over its state is to move it.
        """
        device = self._kv_cache.device
        pages = self._kv_cache.offload_session(value)  # a fork's shared pages too: the copy stands alone
        session = host_cross_attention(value, device)
        pipeline_state = self._gate.export_to_host(session_id, device, keep=keep)
        return OffloadedSession(session=session, pages=pages, pipeline_state=pipeline_state,
                                nbytes=record_nbytes(session, pages, pipeline_state))

    def host_copy(self, session_id: str) -> OffloadedSession:
        """A host record of ``session_id`` that leaves it where it is and its LRU position as it was.

        An offloaded session's own record; a resident one's copy (:meth:`copy_out` with
        ``keep``: its model state exported and imported straight back). Refused before
        anything moves: an unknown id (KeyError), a committing forward context pending
        (RuntimeError). A copy that fails releases the session (``"save_failed"``, close hook:
        the pipeline may no longer hold its model state) and raises.
        """
        record = self.host.get(session_id)
        if record is not None:
            return record
        state = self.table.get(session_id)
        if state is None:
            raise KeyError(f"AR-Diffusion session {session_id!r} is neither resident nor offloaded")
        if committing(state):
            raise RuntimeError(f"AR-Diffusion session {session_id!r} has a committing forward context pending")
        try:
            return self.copy_out(session_id, state.checkpoint().value, keep=True)
        except BaseException:
            self.release(session_id, reset_model=False, reason="save_failed", suppress_errors=True)
            raise

    def _hold_offloaded(self, record: OffloadedSession) -> None:
        """Put ``record`` in the host tier, first dropping (close hooks) the oldest records it displaces."""
        errors: list[BaseException] = []
        for dropped in self.host.admission_victims(record.nbytes):
            try:
                self.release(dropped, reset_model=False, reason="host_eviction")
            except Exception as error:  # the record is gone already; report after holding the new one
                errors.append(error)
        self.host.add(record)
        if errors:
            raise errors[0]

    def restore(self, record: OffloadedSession, *, reason: str, hold_on_failure: bool) -> ARDiffusionKVState:
        """Make ``record`` resident in a free slot: one donated write of its pages, then the pipeline's import.

        A failure before the import leaves the session offloaded again (``hold_on_failure``)
        or absent (a file load: the file is still there); a failing import releases the
        session with its close hook. Never half restored.
        """
        session_id = record.session_id
        state = self._kv_cache.create_state(session_id)
        try:
            placement = self._kv_cache.cross_attention_placement  # on a mesh: heads over "tp"
            cross = {key: type(kv)(*to_device((kv.k, kv.v), placement, numpy_too=True))
                     for key, kv in record.session.cross_attention.items()}
            value = check_session_kv(self._kv_cache.spec, SessionKV(
                session_id=session_id, slot=state.slot, cursors=record.session.cursors, cross_attention=cross,
                run_owners=record.session.run_owners))  # on the host, before the pages move
            tables = self._kv_cache.restore_session_pages(state.slot, record.pages)
            state.restore(dataclasses.replace(value, pages=tables))
        except BaseException:
            state._release()
            if hold_on_failure:
                self._hold_offloaded(record)
            raise
        state._adopt()
        self.table.add(session_id, state)
        self._events.emit("restored", session_id, reason)
        logger.info("AR-Diffusion session %r restored (%s; slot %s)", session_id, reason, state.slot)
        try:
            self._gate.import_session(session_id, to_device(record.pipeline_state, self._kv_cache.state_placement))
        except BaseException:
            self.release(session_id, reset_model=False, reason="restore_failed", suppress_errors=True)
            raise
        return state

    def offload(self, session_ids: list[str], *, reason: str, what: str) -> None:
        """Move the resident ``session_ids`` to the host tier, losing none: checked first, refused if any cannot go.

        Unlike :meth:`_evict` (a new session's room), nothing is released instead: a session
        in use, or a tier that would have to drop the sessions it holds, refuses before any
        copy; a copy that fails leaves its session resident (and those before it offloaded).
        """
        refusal = self.moving_refusal(session_ids, what=what)
        if refusal is not None:
            raise refusal.exception()
        for session_id in session_ids:
            record = self._offload_record(session_id)
            if record is None:  # nothing moved: the session stays resident
                raise RuntimeError(f"AR-Diffusion cannot {what}: session {session_id!r} could not be copied to the "
                                   "host tier (see the log); it stays resident")
            self.table.remove(session_id)._release()
            self._events.emit("offloaded", session_id, reason)
            logger.info("AR-Diffusion session %r offloaded to host memory (%s; %d bytes)", session_id, reason,
                        record.nbytes)
            self._hold_offloaded(record)

    def release(self, session_id: str, *, reset_model: bool, reason: str,
                         suppress_errors: bool = False) -> None:
        """KV first, then the pipeline hook (even when nothing was resident).

        Everything the runner keeps for the session goes before the hook runs, so a hook that
        raises leaves no bookkeeping behind: the slot (or host record) is free, the session is
        in neither the table nor the tier, and a stepwise chunk's start time is forgotten.
        """
        errors: list[BaseException] = []
        self.stepwise_started.pop(session_id, None)  # a released chunk is over (close_session, LRU, reset)
        state = self.table.remove(session_id)
        if state is not None:
            try:
                state._release()
            except Exception as error:  # pragma: no cover - release only touches host bookkeeping
                errors.append(error)
            self._events.emit("released", session_id, reason)
        elif self.host.pop(session_id) is not None:  # offloaded: its host copy goes, the hook runs now
            self._events.emit("released", session_id, reason)
        try:
            self._gate.hook(session_id, reset=reset_model)
        except Exception as error:
            errors.append(error)
        log = logger.info if reason in ("lru_eviction", "forward_exception", "pools_lost", "host_eviction",
                                        "restore_failed", "save_failed") else logger.debug
        log("AR-Diffusion session %r released (%s; was resident: %s)", session_id, reason, state is not None)
        if errors:
            if suppress_errors:
                for error in errors:
                    logger.warning("AR-Diffusion cleanup of session %r (%s) failed: %r", session_id, reason, error)
            else:
                raise errors[0]
