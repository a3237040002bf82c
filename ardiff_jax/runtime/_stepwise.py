"""``StepwiseRuns``: the stepwise path's bookkeeping of an ``ARDiffusionModelRunner``.

One stepwise request is a chunk produced over several ``pipeline.step`` calls: its session is
the request id, its pending contexts and committed pages survive between calls, and its wall
time runs from the chunk's first step to the step that emits it. This object carries one
scheduled step out: admit the session, mark the chunk in flight (the residency's
``stepwise_started``: a session in flight cannot be forked, offloaded or evicted), run the
step through the :class:`~ardiff_jax.runtime._gate.PipelineGate`, record the chunk's wall time,
and release the session when its request finishes or errors. The runner keeps the lock, the
refusals (made before this runs) and the fail-closed policy, handed in as ``fail_closed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ardiff_jax.runtime._gate import PipelineGate
from ardiff_jax.runtime._residency import Residency
from ardiff_jax.types import DiffusionRequest, StepResult

__all__ = ["StepwiseRuns"]


class StepwiseRuns:
    """Start, step, time and end the stepwise chunks of one runner (called under the runner lock).

    Args:
      gate: the runner's pipeline gate (``step``, the device wait).
      residency: the runner's residency (admission, release, the in-flight marks).
      fail_closed: ``fail_closed(session_id, error)``: the runner's release of a failed session.
      record_e2e: ``record_e2e(seconds)``: the runner's record of an emitted chunk's wall time.
    """

    def __init__(self, gate: PipelineGate, residency: Residency, *,
                 fail_closed: Callable[[str, BaseException], None], record_e2e: Callable[[float], None]) -> None:
        self._gate = gate
        self._residency = residency
        self._fail_closed = fail_closed
        self._record_e2e = record_e2e

    def finish(self, request_ids: Iterable[str]) -> None:
        """End the chunks of ``request_ids`` (the scheduler's finished requests): release each session, in id order.

        A session neither resident nor offloaded is skipped; a release's hook errors are logged.
        """
        residency = self._residency
        for request_id in sorted(request_ids):
            residency.stepwise_started.pop(request_id, None)
            if request_id in residency:
                residency.release(request_id, reset_model=False, reason="close", suppress_errors=True)

    def step(self, request: DiffusionRequest) -> StepResult:
        """One ``pipeline.step`` of the validated ``request`` on its session (the request id).

        The chunk's start is marked at its first step and forgotten when the step emits it
        (its wall time recorded), fails or ends. A raising step fails the session closed and
        re-raises; a result that is ``finished`` releases the session (``"close"``), one with
        an ``error`` releases it as a failed forward (``"forward_exception"``); hook errors of
        those releases are logged.
        """
        residency = self._residency
        session_id = request.request_id
        started = time.perf_counter()
        state = residency.admit(session_id)
        residency.stepwise_started.setdefault(session_id, started)
        try:
            result = self._gate.step(session_id, state, request)
            if result.chunk_emitted:
                self._gate.synchronize(result.output)
        except BaseException as error:
            residency.stepwise_started.pop(session_id, None)
            self._fail_closed(session_id, error)
            raise
        if result.chunk_emitted:
            started = residency.stepwise_started.pop(session_id, None)
            if started is not None:
                self._record_e2e(time.perf_counter() - started)
        if result.finished or result.error:
            residency.stepwise_started.pop(session_id, None)
            residency.release(session_id, reset_model=False, reason="forward_exception" if result.error else "close",
                              suppress_errors=True)
        return result
