"""``SessionFiles``: what a session file must match here, reading and writing one, and the importable probe.

The runner's ``save_session`` / ``load_session`` take the lock and move sessions (through the
residency); this owns the file side: the identity a file must match (geometry fingerprint,
pipeline class, weights fingerprint when the pipeline reports one), the complete validation
of a file before any pool is touched, the write of a host record, and the probe that the
pipeline accepts a file's model state before anything is evicted for it.
"""

from __future__ import annotations

import uuid
from typing import Any

from ardiff_jax.runtime._gate import PipelineGate
from ardiff_jax.runtime._kv_cache import ARDiffusionKVCache
from ardiff_jax.runtime._offload import OffloadedSession
from ardiff_jax.runtime._persist import (
    SessionFileError,
    check_weights_fingerprint,
    pipeline_name,
    read_session_file,
    session_fingerprint,
    write_session_file,
)

__all__ = ["SessionFiles"]


class SessionFiles:
    """Session files of one runner's geometry and pipeline.

    Args:
      gate: the runner's pipeline gate (fingerprint, the importable probe).
      kv_cache: the runner's cache (spec, layout, placement).
    """

    def __init__(self, gate: PipelineGate, kv_cache: ARDiffusionKVCache) -> None:
        self._gate = gate
        self._kv_cache = kv_cache

    def require_exporter(self, what: str) -> None:
        """TypeError unless the pipeline can hand over its model state (``SupportsARDiffusionSessionExport``)."""
        if not self._gate.can_export:
            raise TypeError(f"{what} needs a pipeline that implements SupportsARDiffusionSessionExport; "
                            f"{self._gate.name} does not")

    def identity(self) -> dict[str, Any]:
        """What a session file must match here: geometry, pipeline class and (when reported) the weights.

        Called outside the runner lock: the first call may hash the weights.
        """
        weights = self._gate.weights_fingerprint()
        if weights is not None:
            weights = check_weights_fingerprint(weights, f"{self._gate.name}.ar_diffusion_weights_fingerprint()")
        return {"fingerprint": session_fingerprint(self._kv_cache.spec, self._kv_cache.layout),
                "pipeline": pipeline_name(self._gate.pipeline), "weights": weights}

    def read(self, path: Any, identity: dict[str, Any], *, session_id: str | None,
             allow_other_weights: bool) -> OffloadedSession:
        """The file's host record, validated completely (SessionFileError / ValueError) and renamed if asked."""
        cache = self._kv_cache
        record = read_session_file(path, spec=cache.spec, layout=cache.layout, fingerprint=identity["fingerprint"],
                                   pipeline=identity["pipeline"], session_pages=cache.session_pages,
                                   device=cache.state_placement, weights=identity["weights"],
                                   allow_other_weights=allow_other_weights)
        if session_id is not None and session_id != record.session_id:
            record = record.renamed(session_id)
        return record

    def write(self, path: Any, record: OffloadedSession, identity: dict[str, Any]) -> Any:
        """Write ``record`` to the new directory ``path`` (an immutable host value: outside the lock)."""
        return write_session_file(path, record, fingerprint=identity["fingerprint"], pipeline=identity["pipeline"],
                                  layout=self._kv_cache.layout, weights=identity["weights"])

    def check_importable(self, record: OffloadedSession, path: Any) -> None:
        """SessionFileError unless the pipeline accepts the file's model state, checked before anything changes.

        The pipeline validates on import, so the state is imported under a throwaway id and
        exported straight back: nothing is evicted or written for a file whose state is bad.
        """
        probe = f"__ardiff_load_check_{uuid.uuid4().hex}__"
        try:
            self._gate.import_session(probe, record.pipeline_state)
        except Exception as error:
            raise SessionFileError(f"the pipeline state in session file {path} is not one "
                                   f"{self._gate.name} could have exported: {error}") from None
        self._gate.export_session(probe)
