"""What a request asks of an ``ARDiffusionModelRunner``: its session, its flags, a batch's shape. Pure checks.

A request names its session and what to do with it in ``extra_args`` (``session_id``,
``reset``, ``close_session``), or in a typed tick (:class:`~ardiff_jax.types.ARDiffusionTickRequest`),
which is authoritative. These functions read a request and raise (TypeError / ValueError) on
one that is malformed; they change nothing, so the runner and the router call them before
anything moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ardiff_jax._checks import check_flag, check_not_traced, check_session_id
from ardiff_jax.runtime._residency import repeated_sessions
from ardiff_jax.types import AR_DIFFUSION_TICK_KEY, ARDiffusionTickRequest, DiffusionRequest

__all__ = ["check_distinct_sessions", "checked_batch_types", "request_session", "request_values"]


def request_session(request: DiffusionRequest) -> tuple[str, bool, bool, ARDiffusionTickRequest | None]:
    """``(session_id, reset, close_session, tick)``; a typed tick is authoritative.

    A missing ``session_id`` means ``"default"``; a present one must be a non-blank
    ``str`` and the flags real bools (``"false"`` is refused, never coerced).
    """
    extra_args = request.extra_args
    tick = ARDiffusionTickRequest.from_extra_args(extra_args) if AR_DIFFUSION_TICK_KEY in extra_args else None
    if tick is not None:
        return tick.session_id, tick.reset, tick.close_session, tick
    session_id = check_session_id(extra_args["session_id"], "extra_args['session_id']") \
        if "session_id" in extra_args else "default"
    reset = check_flag("extra_args['reset']", extra_args.get("reset", False))
    close_session = check_flag("extra_args['close_session']", extra_args.get("close_session", False))
    return session_id, reset, close_session, None


def checked_batch_types(requests: Any) -> list[DiffusionRequest]:
    """``requests`` as a list, after checking it is a sequence of DiffusionRequests holding no traced value."""
    if isinstance(requests, DiffusionRequest) or not isinstance(requests, Sequence):
        raise TypeError(f"execute_model_batch expects a sequence of DiffusionRequests, got "
                        f"{type(requests).__name__}")
    requests = list(requests)
    for request in requests:
        if not isinstance(request, DiffusionRequest):
            raise TypeError(f"execute_model_batch expects DiffusionRequests, got {type(request).__name__}")
        check_not_traced("engine.generate_batch / execute_model_batch", *request_values(request))
    return requests


def check_distinct_sessions(session_ids: Sequence[str]) -> None:
    """ValueError naming the session ids that appear more than once in one batch."""
    repeated = repeated_sessions(session_ids)
    if repeated:
        raise ValueError(f"a batch holds each session at most once; repeated: {repeated}")


def request_values(request: DiffusionRequest) -> tuple[Any, ...]:
    """Every value a request carries (inputs, extra args, prompt), for the traced-value check."""
    # The request's mappings are read-only proxies (not pytree nodes): hand over their values.
    return (*request.inputs.values(), *request.extra_args.values(), request.prompt)
