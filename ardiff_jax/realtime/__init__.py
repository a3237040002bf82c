"""The realtime control plane: client events in, one typed tick per chunk, commit only on success.

A realtime client (a WebSocket, a game loop) drives a session chunk by chunk and sends prompt
and control changes whenever it likes. This package turns that into the engine's unit of
work, one typed tick (:class:`~ardiff_jax.types.ARDiffusionTickRequest`) per AR block:

* :class:`ARDiffusionSession` queues :class:`ARDiffusionSessionEvent` s (bounded queue,
  monotonic ids, duplicates recognised), and ``next_chunk`` applies every pending event to
  one tick, runs it on an :class:`ARDiffusionTickConsumer` and commits the events only when
  the consumer succeeded and reported exactly that tick's
  :class:`~ardiff_jax.types.ARDiffusionChunkMetadata`. A failed chunk leaves the session
  FAILED with its events still queued and closes the model-side session through an
  :class:`ARDiffusionSessionLifecycle`; ``reset`` starts over, ``close`` ends it.
* :class:`ARDiffusionSessionManager` owns the sessions that share a consumer and a lifecycle.
* :class:`ARDiffusionControlReducer` (optional) lets a model fold events into stateful
  controls, prepared per chunk and committed with it.
* Backends: :class:`EngineTickConsumer` and :class:`EngineSessionLifecycle` serve ticks from
  an in-process :class:`~ardiff_jax.runtime.ARDiffusionEngine` off the event loop;
  :class:`ARDiffusionWorkerLifecycle` releases sessions through a serving frontend's
  collective RPC.

Behaviour and error messages follow the reference runtime (``docs/reference_behaviour.md``,
"Ticks"). The package sits above :mod:`ardiff_jax.runtime` and :mod:`ardiff_jax.types`;
nothing below imports it.
"""

from ardiff_jax.realtime._consumer import EngineTickConsumer
from ardiff_jax.realtime._lifecycle import (
    ARDiffusionCollectiveRPCClient,
    ARDiffusionWorkerLifecycle,
    EngineSessionLifecycle,
)
from ardiff_jax.realtime._session import (
    ARDiffusionChunkMetadataError,
    ARDiffusionControlReducer,
    ARDiffusionEventAcceptance,
    ARDiffusionEventAcceptanceStatus,
    ARDiffusionEventQueueFullError,
    ARDiffusionPreparedControls,
    ARDiffusionSession,
    ARDiffusionSessionError,
    ARDiffusionSessionEvent,
    ARDiffusionSessionLifecycle,
    ARDiffusionSessionManager,
    ARDiffusionSessionStateError,
    ARDiffusionSessionStatus,
    ARDiffusionStaleEventError,
    ARDiffusionTickConsumer,
)

__all__ = [
    "ARDiffusionChunkMetadataError",
    "ARDiffusionCollectiveRPCClient",
    "ARDiffusionControlReducer",
    "ARDiffusionEventAcceptance",
    "ARDiffusionEventAcceptanceStatus",
    "ARDiffusionEventQueueFullError",
    "ARDiffusionPreparedControls",
    "ARDiffusionSession",
    "ARDiffusionSessionError",
    "ARDiffusionSessionEvent",
    "ARDiffusionSessionLifecycle",
    "ARDiffusionSessionManager",
    "ARDiffusionSessionStateError",
    "ARDiffusionSessionStatus",
    "ARDiffusionStaleEventError",
    "ARDiffusionTickConsumer",
    "ARDiffusionWorkerLifecycle",
    "EngineSessionLifecycle",
    "EngineTickConsumer",
]
