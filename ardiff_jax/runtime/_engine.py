"""``ARDiffusionEngine``: the user-facing entry point.

The engine's only decision is routing: it selects :class:`ARDiffusionModelRunner` (or a
subclass given as ``runner_cls``), which owns pools, sessions, capacity, LRU and failure
cleanup. Everything else is delegation.
"""

from __future__ import annotations

from typing import Any

from ardiff_jax.runtime._memory import MemoryPlan
from ardiff_jax.types import DiffusionRequest, EngineConfig, StepResult, StepSchedulerOutput
from ardiff_jax.runtime._runner import ARDiffusionModelRunner

__all__ = ["ARDiffusionEngine"]


class ARDiffusionEngine:
    """Load a pipeline with the AR-Diffusion runner and drive it.

    Example::

        engine = ARDiffusionEngine(pipeline, EngineConfig(dtype="float32"))
        out = engine.generate(DiffusionRequest("r1", prompt="a cat", extra_args={"session_id": "s1"}))
        engine.close_session("s1")
    """

    runner_cls: type[ARDiffusionModelRunner] = ARDiffusionModelRunner

    def __init__(self, pipeline: Any, config: EngineConfig | None = None, *,
                 runner_cls: type[ARDiffusionModelRunner] | None = None) -> None:
        runner_cls = self.runner_cls if runner_cls is None else runner_cls
        if not (isinstance(runner_cls, type) and issubclass(runner_cls, ARDiffusionModelRunner)):
            raise TypeError(f"runner_cls must be an ARDiffusionModelRunner subclass, got {runner_cls!r}")
        self._runner = runner_cls(pipeline, config)

    @property
    def runner(self) -> ARDiffusionModelRunner:
        return self._runner

    @property
    def memory_plan(self) -> MemoryPlan:
        return self._runner.memory_plan

    @property
    def session_capacity(self) -> int:
        return self._runner.session_capacity

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident session ids, least recently used first."""
        return self._runner.sessions

    def generate(self, request: DiffusionRequest) -> Any:
        """Run one request (one AR block in tick mode) on its session."""
        return self._runner.execute_model(request)

    def step(self, scheduler_output: StepSchedulerOutput) -> StepResult | None:
        """One stepwise tick (requires ``EngineConfig(step_execution=True)``)."""
        return self._runner.execute_stepwise(scheduler_output)

    def reset_session(self, session_id: str) -> None:
        self._runner.reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        self._runner.close_session(session_id)

    def close(self) -> None:
        """Release every session and free the device pools."""
        self._runner.close()

    def __enter__(self) -> ARDiffusionEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
