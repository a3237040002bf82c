"""Random-init weights: one compiled init per config, whatever the seed, and the same weights as before.

The seed's key is an argument of the jitted init (``DiTModules.create``, ``WanModules.create``), so a
second pipeline of the same config compiles nothing; a seed compiled in as a constant (the old program)
gives bit-identical weights, so every stored figure made from random weights still holds.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from ardiff_jax.models import dit_preset
from ardiff_jax.models._common import DiTModules, weights_key
from ardiff_jax.models._dit import CausalDiT
from ardiff_jax.models.wan import WanModules
from helpers import count_compiles


@functools.partial(jax.jit, static_argnums=(0, 1))
def _seed_compiled_in(config, seed):
    return nnx.split(DiTModules(config, seed))[1]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _wan_seed_compiled_in(config, seed):
    return nnx.split(WanModules(CausalDiT(config, rngs=nnx.Rngs(weights_key(seed)))))[1]


def _same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                                  for x, y in zip(leaves_a, leaves_b, strict=True))


@pytest.mark.parametrize("modules, reference, preset", [
    (DiTModules, _seed_compiled_in, "sprite-world-tiny"),
    (WanModules, _wan_seed_compiled_in, "matrix-game-tiny"),
])
def test_every_seed_reuses_one_compiled_init_and_gets_the_weights_a_compiled_in_seed_gave(modules, reference, preset):
    config = dit_preset(preset)
    first = nnx.split(modules.create(config, 0))[1]
    with count_compiles() as compiled:
        others = {seed: nnx.split(modules.create(config, seed))[1] for seed in (1, 2**31 + 7)}
    assert not [name for name in compiled if "init" in name], compiled
    # One seed against the old program (each seed compiled in is a compile of its own): a large one, which a
    # key made outside the program must carry whole.
    assert _same(others[2**31 + 7], reference(config, 2**31 + 7))
    assert not _same(others[1], first)  # the seed still matters
