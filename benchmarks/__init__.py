"""Benchmarks of ardiff_jax against memory floors and peer KV caches (see README.md).

Not part of the installed package: run from the repository root, e.g.
``python -m benchmarks.bench_kv`` and ``python -m benchmarks.bench_peers``.
"""
