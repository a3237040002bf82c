"""``ardiff_jax._compile_events``: the one compile counter counts a backend compile and a load from jax's
persistent compilation cache alike (a no-recompile check must not pass because a recompile came from disk),
and a hit in jax's in-memory cache not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from ardiff_jax._compile_events import count_compiles

_PROBE = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    from ardiff_jax._compile_events import count_compiles
    x = np.ones(5, np.float32)
    with count_compiles() as programs:
        jax.jit(lambda x: jnp.sin(x) * 3.0)(x).block_until_ready()
    print(json.dumps([[p.name, p.seconds] for p in programs]))
""")


def test_a_backend_compile_is_counted_and_an_in_memory_hit_is_not() -> None:
    double, x = jax.jit(lambda x: x * 2.0), np.ones(3, np.float32)
    with count_compiles() as first:
        double(x).block_until_ready()
    with count_compiles() as again:
        double(x).block_until_ready()
    assert [p.name for p in first] == ["jit(<lambda>)"] and first[0].seconds > 0
    assert again == []


def test_a_program_loaded_from_the_persistent_cache_counts_as_made(tmp_path) -> None:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", JAX_PLATFORMS="cpu")

    def probe() -> list[list]:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    compiled = probe()
    written = sorted(path.name for path in tmp_path.iterdir())
    loaded = probe()  # a second process finds the first one's executable on disk and compiles nothing
    assert [name for name, _ in compiled] == [name for name, _ in loaded] == ["jit(<lambda>)"]
    assert any(name.startswith("jit__lambda-") for name in written), written
    assert sorted(path.name for path in tmp_path.iterdir()) == written  # nothing new was compiled and written


def test_the_suite_shares_one_compilation_cache_per_run() -> None:
    """tests/conftest.py gives the run one fresh persistent cache: this worker's jax writes there, every program
    counts however small, and a subprocess a test starts (the CLI, the notebooks, the mesh suite) inherits it."""
    path = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert os.path.isdir(path)
    assert jax.config.jax_compilation_cache_dir == path
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    seen = subprocess.run([sys.executable, "-c", "import jax; print(jax.config.jax_compilation_cache_dir)"],
                          capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert seen == path
