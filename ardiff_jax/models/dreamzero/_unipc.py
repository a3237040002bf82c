"""DreamZero's sampler: flow-matching UniPC (``FlowUniPCMultistepScheduler``) as a pure function.

The release samples video and actions with two instances of a multistep UniPC solver in its
flow-matching form: ``solver_order=2``, ``predict_x0``, the ``bh2`` variant, ``lower_order_final``,
16 steps of a shift-5 schedule, timesteps truncated to integers. Per step ``s`` with the model's flow
``v`` at the sample ``x``:

* ``m_s = x - sigma_s v`` (the clean estimate);
* from step 1 on, the **UniC corrector** replaces ``x`` with a corrected sample built from the sample
  before the last predictor, ``m_{s-1}`` (and ``m_{s-2}`` at order 2) and ``m_s``;
* the **UniP predictor** steps the (corrected) sample to ``sigma_{s+1}`` from ``m_s`` (and ``m_{s-1}``
  at order 2); order 1 at the first and last steps, 2 otherwise. The last step (``sigma = 0``)
  returns ``m_15`` exactly.

Every coefficient depends only on the schedule, so :class:`UniPCSchedule` computes them once on the
host, in float32 as the release's torch code does, and :func:`unipc_step` is a few fused
multiply-adds per step: a pure, traceable update of :class:`UniPCState`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["UniPCSchedule", "UniPCState", "unipc_schedule", "unipc_init", "unipc_step", "DIT_STEP_MASKS"]

_F32 = np.float32

#: The release's ``NUM_DIT_STEPS`` masks over 16 steps (``dit_step_mask``); any other count runs every step.
DIT_STEP_MASKS: dict[int, tuple[int, ...]] = {
    5: (0, 1, 2, 7, 12),
    6: (0, 1, 5, 10, 14, 15),
    7: (0, 1, 2, 6, 10, 14, 15),
    8: (0, 1, 2, 6, 10, 13, 14, 15),
}


@dataclasses.dataclass(frozen=True, eq=False)
class UniPCSchedule:
    """One scheduler instance's schedule and per-step coefficients (host numpy, float32).

    Attributes:
      sigmas: ``f32[N + 1]`` noise levels (the last is the final one: 0, or 0.8 for decoupled video).
      timesteps: ``i64[N]`` the integer timesteps the transformer sees (``int(sigma * 1000)``, truncated).
      predictor: ``f32[N, 3]`` per step ``(a_x, a_m, a_d)``: ``x_next = a_x x_c + a_m m_s + a_d (m_{s-1} - m_s)``.
      corrector: ``f32[N, 4]`` per step ``(c_x, c_m, c_2, c_t)``: ``x_c = c_x last + c_m m_{s-1} +
        c_2 (m_{s-2} - m_{s-1}) + c_t (m_s - m_{s-1})``; row 0 is unused (no corrector at step 0).
    """

    sigmas: np.ndarray
    timesteps: np.ndarray
    predictor: np.ndarray
    corrector: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


class UniPCState(NamedTuple):
    """The solver's memory between steps (device arrays shaped like the sample).

    Attributes:
      m1: the previous step's clean estimate ``m_{s-1}``.
      m2: the one before, ``m_{s-2}``.
      last: the sample the previous predictor started from (after its correction).
    """

    m1: jax.Array
    m2: jax.Array
    last: jax.Array


def _lambda(sigma: np.float32) -> np.float32:
    """``log(alpha) - log(sigma)`` with ``alpha = 1 - sigma``, in float32 (inf at sigma 0)."""
    with np.errstate(divide="ignore"):
        return _F32(np.log(_F32(1) - sigma)) - _F32(np.log(sigma))


def _phi(sigmas: np.ndarray, target: int, source: int) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """``(alpha_t, h, h_phi_1, B_h)`` of a step from ``sigmas[source]`` to ``sigmas[target]`` (bh2: ``B_h = expm1(-h)``)."""
    sigma_t, sigma_s = sigmas[target], sigmas[source]
    h = _lambda(sigma_t) - _lambda(sigma_s)
    hh = -h
    h_phi_1 = _F32(np.expm1(hh))
    return _F32(1) - sigma_t, h, h_phi_1, h_phi_1


@functools.lru_cache(maxsize=16)
def unipc_schedule(num_steps: int = 16, shift: float = 5.0, final_sigma: float | None = None,
                   num_train_timesteps: int = 1000) -> UniPCSchedule:
    """The release's ``FlowUniPCMultistepScheduler(shift=1).set_timesteps(num_steps, shift=shift)``.

    ``sigma = shift s / (1 + (shift - 1) s)`` for ``s = linspace(sigma_max, 0, num_steps + 1)[:-1]``
    (float64, ``sigma_max`` the float32 of ``0.999``), then a final 0. ``final_sigma`` (decoupled video,
    0.8) rescales the float32 sigmas to ``sigma (sigma_0 - final) / sigma_0 + final`` and re-truncates
    the timesteps, as the release's ``decouple_inference_noise`` does.
    """
    train = np.linspace(1, 1 / num_train_timesteps, num_train_timesteps)[::-1].copy()
    sigma_max = float(np.float32(1.0 - train[0]))  # the float32 table's first entry, read back as a float
    s = np.linspace(sigma_max, 0.0, num_steps + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    timesteps = (s * num_train_timesteps).astype(np.int64)
    sigmas = np.concatenate([s, [0.0]]).astype(_F32)
    if final_sigma is not None:
        top = float(sigmas[0])  # torch: `.item()`, then Python-float arithmetic before the float32 multiply
        sigmas = (sigmas * _F32(top - final_sigma) / _F32(top) + _F32(final_sigma)).astype(_F32)
        timesteps = (sigmas[:-1] * _F32(num_train_timesteps)).astype(np.int64)
    predictor = np.zeros((num_steps, 3), _F32)
    corrector = np.zeros((num_steps, 4), _F32)
    # lower_order_final with solver order 2: order 1 at the first and the last step, 2 in between.
    orders = [min(2, num_steps - s_, s_ + 1) for s_ in range(num_steps)]
    lam = [_lambda(sig) for sig in sigmas]
    for step in range(num_steps):
        alpha_t, h, h_phi_1, b_h = _phi(sigmas, step + 1, step)
        with np.errstate(invalid="ignore", divide="ignore"):
            a_x = _F32(sigmas[step + 1] / sigmas[step])
        a_m = _F32(-alpha_t * h_phi_1)
        a_d = _F32(0)
        if orders[step] == 2:
            rk = _F32((lam[step - 1] - lam[step]) / h)
            a_d = _F32(-alpha_t * b_h * _F32(0.5) / rk)  # rhos_p = 0.5 at order 2
        predictor[step] = (a_x, a_m, a_d)
        if step == 0:
            continue
        order = orders[step - 1]  # the corrector runs at the previous predictor's order
        alpha_t, h, h_phi_1, b_h = _phi(sigmas, step, step - 1)
        c_x, c_m = _F32(sigmas[step] / sigmas[step - 1]), _F32(-alpha_t * h_phi_1)
        hh = -h
        if order == 1:
            rho_prev, rho_t, rk = _F32(0), _F32(0.5), _F32(1)
        else:
            rk = _F32((lam[step - 2] - lam[step - 1]) / h)
            h_phi_k = _F32(h_phi_1 / hh - 1)
            b1 = _F32(h_phi_k / b_h)
            h_phi_k = _F32(h_phi_k / hh - _F32(0.5))
            b2 = _F32(h_phi_k * 2 / b_h)
            rho_prev, rho_t = np.linalg.solve(np.array([[1, 1], [rk, 1]], np.float64), [b1, b2]).astype(_F32)
        corrector[step] = (c_x, c_m, _F32(-alpha_t * b_h * rho_prev / rk), _F32(-alpha_t * b_h * rho_t))
    for array in (sigmas, timesteps, predictor, corrector):
        array.setflags(write=False)
    return UniPCSchedule(sigmas, timesteps, predictor, corrector)


def unipc_init(sample: jax.Array) -> UniPCState:
    """A fresh solver for samples shaped like ``sample`` (the release builds new schedulers every call)."""
    zeros = jnp.zeros_like(sample, jnp.float32)
    return UniPCState(zeros, zeros, zeros)


def unipc_step(
    sample: jax.Array,  # f32[...]: x_s
    flow: jax.Array,  # f32[...]: the model's flow at x_s (or the last one, on a skipped step)
    state: UniPCState,
    sigma: jax.Array,  # f32[]: sigmas[s]
    predictor: jax.Array,  # f32[3]: the schedule's predictor row s
    corrector: jax.Array,  # f32[4]: the schedule's corrector row s
    first: jax.Array,  # bool[]: s == 0 (no corrector)
) -> tuple[jax.Array, UniPCState]:
    """One UniPC step: ``(x_{s+1}, state)``. Traceable; the coefficients come from :class:`UniPCSchedule`."""
    x = jnp.asarray(sample, jnp.float32)
    m = x - sigma * jnp.asarray(flow, jnp.float32)
    corrected = (corrector[0] * state.last + corrector[1] * state.m1 + corrector[2] * (state.m2 - state.m1)
                 + corrector[3] * (m - state.m1))
    x = jnp.where(first, x, corrected)
    x_next = predictor[0] * x + predictor[1] * m + predictor[2] * (state.m1 - m)
    return x_next, UniPCState(m1=m, m2=state.m1, last=x)
