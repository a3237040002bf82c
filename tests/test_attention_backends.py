"""The attention-backend seam and the checks ``PagedKVCaches.attend`` runs before any backend.

* ``"xla"`` is the default backend and equals :func:`ref_paged_attention`;
* a backend registered under a new name is the one ``attend`` calls when the view names it,
  directly, through ``ARDiffusionKVCache(attention_backend=...)`` and through
  ``EngineConfig(attention_backend=...)``; unknown names fail at construction, before any pool
  is allocated; the name is static (a different treedef, a separate compilation);
* layer and dtype checks: concrete layers (Python, numpy, concrete jax integers) are
  range-checked, traced layers pass (``lax.scan`` / ``fori_loop`` over layers), non-integer
  layers are a TypeError and non-floating arrays a ValueError naming the argument.

Test backends are unregistered by their fixture. Tolerance ``rtol = atol = 1e-5``: float32
on O(1) values, the fast path and the dense reference sum in different orders.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ardiff_jax.runtime._kv_cache as kv_cache_module
from ardiff_jax import ARDiffusionEngine, ARDiffusionKVCache, DiffusionRequest, EngineConfig
from ardiff_jax.kv import (
    attention_backend,
    attention_backends,
    check_attention_backend,
    gather_pages,
    paged_attention,
    read_run,
    ref_paged_attention,
    register_attention_backend,
    unregister_attention_backend,
)
from helpers import AMPLE, make_cache, make_spec, randn
from runner_pipelines import RecordingPipeline

F32_TOL = dict(rtol=1e-5, atol=1e-5)
_ref_jit = jax.jit(ref_paged_attention, static_argnums=0)


def filled_cache(**overrides):
    """A 2-layer float32 cache (GQA-ready: 2 KV heads) with 4 committed frames in session ``s``."""
    cache = make_cache(**{"frames_per_block": 1, **overrides})
    state = cache.create_state("s")
    rng = np.random.default_rng(0)
    L, T, H, D = cache.layout.num_layers, cache.layout.tokens_per_frame, cache.layout.num_kv_heads, \
        cache.layout.head_size
    for _ in range(4):
        state.get_kv_caches("main", seq_len=T, commit_current=True)
        state.commit_paged_context("main", kv=(randn(rng, L, T, H, D), randn(rng, L, T, H, D)))
    return cache, state


def attention_inputs(layout, seed=1, num_q_heads=None, num_extra=2):
    rng = np.random.default_rng(seed)
    T, H, D = layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    return dict(q=randn(rng, 3, num_q_heads or 2 * H, D), k=randn(rng, T, H, D), v=randn(rng, T, H, D),
                extra_k=randn(rng, num_extra, H, D), extra_v=randn(rng, num_extra, H, D))


def reference(caches, layer, x):
    return np.asarray(_ref_jit(caches.layout, caches.pools, caches.cursor, layer, x["q"], x["k"], x["v"],
                               x["extra_k"], x["extra_v"]))


def attend(caches, layer, x, method="attend"):
    return getattr(caches, method)(layer, x["q"], x["k"], x["v"], extra_k=x["extra_k"], extra_v=x["extra_v"])


@pytest.fixture
def recording_backend():
    """Registers ``"test-recording"``: records each trace, returns *minus* the reference (so its output shows)."""
    calls = []

    def backend(layout, pools, cursor, layer, q, k, v, extra_k=None, extra_v=None, *, scale=None):
        calls.append(dict(layout=layout, q_shape=q.shape, k_shape=k.shape, has_extra=extra_k is not None))
        return -ref_paged_attention(layout, pools, cursor, layer, q, k, v, extra_k, extra_v, scale=scale)

    register_attention_backend("test-recording", backend)
    try:
        yield calls
    finally:
        unregister_attention_backend("test-recording")
    assert "test-recording" not in attention_backends()


# -- the default backend ---------------------------------------------------------------------------------


def test_xla_is_the_default_backend_and_is_paged_attention():
    assert attention_backends()[0] == "xla"
    assert attention_backend("xla", jitted=False) is paged_attention
    assert make_cache().attention_backend == "xla"
    cache, state = filled_cache()
    assert state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame).backend == "xla"


@pytest.mark.parametrize("num_q_heads", [2, 4], ids=["mha", "gqa"])
def test_xla_backend_equals_ref_paged_attention(num_q_heads):
    cache, state = filled_cache()
    caches = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    x = attention_inputs(cache.layout, num_q_heads=num_q_heads)
    for layer in range(cache.layout.num_layers):
        want = reference(caches, layer, x)
        np.testing.assert_allclose(np.asarray(attend(caches, layer, x)), want, **F32_TOL)
        np.testing.assert_allclose(np.asarray(attend(caches, layer, x, "ref_attend")), want, **F32_TOL)
    # The comparison can fail: another layer's history gives a different result.
    assert not np.allclose(np.asarray(attend(caches, 0, x)), reference(caches, 1, x), **F32_TOL)


# -- a custom backend ----------------------------------------------------------------------------------------


def test_attend_calls_the_backend_the_view_names(recording_backend):
    cache, state = filled_cache()
    xla_view = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    custom_view = dataclasses.replace(xla_view, backend="test-recording")
    x = attention_inputs(cache.layout)
    want = reference(xla_view, 1, x)

    np.testing.assert_allclose(np.asarray(attend(xla_view, 1, x)), want, **F32_TOL)
    assert recording_backend == []
    np.testing.assert_allclose(np.asarray(attend(custom_view, 1, x)), -want, **F32_TOL)
    assert recording_backend == [dict(layout=cache.layout, q_shape=(3, 4, 4), k_shape=(2, 2, 4), has_extra=True)]
    # Per-layer views and a model's own jit go through the same backend.
    np.testing.assert_allclose(np.asarray(custom_view[1].attend(x["q"], x["k"], x["v"], extra_k=x["extra_k"],
                                                                extra_v=x["extra_v"])), -want, **F32_TOL)
    model = jax.jit(lambda caches, x: attend(caches, 1, x))
    np.testing.assert_allclose(np.asarray(model(custom_view, x)), -want, **F32_TOL)
    # The backend is traced once per shape (jax reuses its trace inside the model's jit), not per call.
    assert len(recording_backend) == 1
    # ref_attend is the reference whatever the backend.
    np.testing.assert_allclose(np.asarray(attend(custom_view, 1, x, "ref_attend")), want, **F32_TOL)


def test_custom_backend_through_the_kv_cache(recording_backend):
    spec = make_spec()
    cache = ARDiffusionKVCache(spec, dtype="float32", available_memory_bytes=AMPLE, gpu_memory_fraction=1.0,
                               attention_backend="test-recording")
    assert cache.attention_backend == "test-recording"
    state = cache.create_state("s")
    T = spec.tokens_per_frame
    caches = state.get_kv_caches("main", seq_len=T)
    assert caches.backend == "test-recording"
    x = attention_inputs(cache.layout)
    np.testing.assert_allclose(np.asarray(attend(caches, 0, x)), -reference(caches, 0, x), **F32_TOL)
    assert [call["layout"] for call in recording_backend] == [cache.layout]


def test_custom_backend_through_the_engine(recording_backend):
    pipeline = RecordingPipeline()
    config = EngineConfig(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0,
                          attention_backend="test-recording")
    with ARDiffusionEngine(pipeline, config) as engine:
        assert engine.runner.kv_cache.attention_backend == "test-recording"
        engine.generate(DiffusionRequest("r1", extra_args={"session_id": "s"}))
        # RecordingPipeline attends once per layer with the same shapes: one trace of the backend.
        assert [call["layout"] for call in recording_backend] == [engine.runner.kv_cache.layout]
        assert pipeline.states_seen[-1].session_id == "s"


def test_unknown_backend_fails_at_construction_before_any_pool(monkeypatch, recording_backend):
    allocations = []
    real_allocate = kv_cache_module.allocate_pools
    monkeypatch.setattr(kv_cache_module, "allocate_pools",
                        lambda *args, **kwargs: allocations.append(args) or real_allocate(*args, **kwargs))
    listed = r"'no-such-backend'; registered: 'xla', 'cudnn', 'test-recording'"
    with pytest.raises(ValueError, match=listed):
        ARDiffusionKVCache(make_spec(), dtype="float32", available_memory_bytes=AMPLE,
                           attention_backend="no-such-backend")
    pipeline = RecordingPipeline()
    config = dict(dtype="float32", available_memory_bytes=10**7, gpu_memory_fraction=1.0)
    with pytest.raises(ValueError, match=listed):
        ARDiffusionEngine(pipeline, EngineConfig(**config, attention_backend="no-such-backend"))
    assert allocations == []
    # The failed load left nothing behind: the same pipeline loads with a known backend.
    with ARDiffusionEngine(pipeline, EngineConfig(**config)) as engine:
        assert engine.runner.kv_cache.attention_backend == "xla"
    assert len(allocations) == 1
    # A view cannot name an unknown backend either.
    cache, state = filled_cache()
    caches = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    with pytest.raises(ValueError, match=listed):
        dataclasses.replace(caches, backend="no-such-backend")


def test_backend_name_is_static(recording_backend):
    cache, state = filled_cache()
    xla_view = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    custom_view = dataclasses.replace(xla_view, backend="test-recording")
    assert jax.tree.structure(xla_view) != jax.tree.structure(custom_view)
    for a, b in zip(jax.tree.leaves(xla_view), jax.tree.leaves(custom_view)):
        assert a is b
    traces = []

    @jax.jit
    def model(caches, x):
        traces.append(caches.backend)  # runs once per compilation
        return attend(caches, 0, x)

    x = attention_inputs(cache.layout)
    model(xla_view, x)
    model(custom_view, x)
    model(xla_view, x)
    assert traces == ["xla", "test-recording"]


def test_registry_rejects_bad_registrations_and_protects_xla(recording_backend):
    def fn(*args, **kwargs):
        return None

    for name in ("", "  ", None, 3):
        with pytest.raises(ValueError, match="non-blank strings"):
            register_attention_backend(name, fn)
    with pytest.raises(TypeError, match="callable"):
        register_attention_backend("test-other", "not a function")
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_attention_backend("test-recording", fn)
    for call in (lambda: register_attention_backend("xla", fn, replace=True),
                 lambda: unregister_attention_backend("xla")):
        with pytest.raises(ValueError, match="built-in"):
            call()
    with pytest.raises(ValueError, match="unknown attention backend 'test-other'; registered: 'xla', 'cudnn', 'test-recording'"):
        unregister_attention_backend("test-other")
    for name in ("test-other", 3, None, ["xla"]):
        with pytest.raises(ValueError, match="unknown attention backend"):
            check_attention_backend(name)
    assert check_attention_backend("test-recording") == "test-recording"
    assert attention_backends() == ("xla", "cudnn", "test-recording")
    assert attention_backend("xla", jitted=False) is paged_attention


def test_replacing_a_backend_takes_effect_for_new_calls(recording_backend):
    cache, state = filled_cache()
    caches = dataclasses.replace(state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame),
                                 backend="test-recording")
    x = attention_inputs(cache.layout)
    want = reference(caches, 0, x)
    np.testing.assert_allclose(np.asarray(attend(caches, 0, x)), -want, **F32_TOL)
    register_attention_backend("test-recording", paged_attention, replace=True)
    np.testing.assert_allclose(np.asarray(attend(caches, 0, x)), want, **F32_TOL)


# -- checks before any backend runs -------------------------------------------------------------------


@pytest.fixture
def view(recording_backend):
    """A 2-layer view on the recording backend: a check that passes would show up as a call."""
    cache, state = filled_cache()
    caches = dataclasses.replace(state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame),
                                 backend="test-recording")
    return caches, attention_inputs(cache.layout), recording_backend


@pytest.mark.parametrize("layer", [2, -3, 7, np.int64(2), np.int32(-3), jnp.int32(7), jnp.asarray(2, jnp.uint32),
                                   np.asarray(5)], ids=repr)
@pytest.mark.parametrize("method", ["attend", "ref_attend"])
def test_concrete_out_of_range_layers_raise_index_error(view, layer, method):
    caches, x, calls = view
    with pytest.raises(IndexError, match=rf"^layer {int(layer)} out of range for 2 layers$"):
        attend(caches, layer, x, method)
    assert calls == []
    with pytest.raises(IndexError, match=rf"layer {int(layer)} out of range"):
        caches[layer]


@pytest.mark.parametrize("layer", [1.0, True, np.bool_(False), jnp.float32(1), jnp.asarray(True), "1", None,
                                   jnp.zeros((1,), jnp.int32)], ids=repr)
@pytest.mark.parametrize("method", ["attend", "ref_attend"])
def test_non_integer_layers_raise_type_error(view, layer, method):
    caches, x, calls = view
    with pytest.raises(TypeError, match="layer must be an integer"):
        attend(caches, layer, x, method)
    assert calls == []
    with pytest.raises(TypeError):
        caches[layer]


def test_traced_non_integer_layer_raises_type_error(view):
    caches, x, calls = view
    with pytest.raises(TypeError, match="traced float32"):
        jax.jit(lambda c, layer, x: attend(c, layer, x))(caches, jnp.float32(1), x)
    assert calls == []


@pytest.mark.parametrize("method", ["attend", "ref_attend"])
def test_concrete_jax_and_numpy_layers_read_the_same_layer_as_python_ints(method):
    cache, state = filled_cache()
    caches = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    x = attention_inputs(cache.layout)
    want = [np.asarray(attend(caches, layer, x, method)) for layer in range(2)]
    assert not np.allclose(want[0], want[1])
    for layer, index in [(jnp.int32(1), 1), (jnp.int32(-1), 1), (np.int64(0), 0), (np.asarray(-2), 0),
                         (jnp.asarray(1, jnp.uint8), 1)]:
        np.testing.assert_array_equal(np.asarray(attend(caches, layer, x, method)), want[index])
    assert caches[jnp.int32(-1)].layer == 1 and isinstance(caches[np.int64(1)].layer, int)


def test_traced_layers_work_in_scan_and_fori_loop():
    cache, state = filled_cache()
    caches = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    x = attention_inputs(cache.layout)
    num_layers = cache.layout.num_layers

    def step(layer, q):
        return caches.attend(layer, q, x["k"], x["v"], extra_k=x["extra_k"], extra_v=x["extra_v"])

    want = x["q"]
    for layer in range(num_layers):
        want = step(layer, want)

    @jax.jit
    def scanned(q):
        return jax.lax.scan(lambda q, layer: (step(layer, q), None), q, jnp.arange(num_layers))[0]

    @jax.jit
    def looped(q):
        return jax.lax.fori_loop(0, num_layers, step, q)

    @jax.jit
    def negative(q):  # traced negative layers count from the end, like Python ints
        return jax.lax.scan(lambda q, layer: (step(layer, q), None), q, jnp.arange(-num_layers, 0))[0]

    for fn in (scanned, looped, negative):
        np.testing.assert_allclose(np.asarray(fn(x["q"])), np.asarray(want), **F32_TOL)


@pytest.mark.parametrize("name", ["q", "k", "v", "extra_k", "extra_v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("method", ["attend", "ref_attend"])
def test_non_floating_arrays_raise_value_error(view, name, dtype, method):
    caches, x, calls = view
    bad = dict(x, **{name: np.asarray(x[name]).astype(dtype)})
    dtype_name = jnp.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"^{name} must be a floating-point array, got dtype {dtype_name}$"):
        attend(caches, 0, bad, method)
    assert calls == []
    # The functional core refuses them too (here at trace time).
    for fn in (paged_attention, ref_paged_attention):
        with pytest.raises(ValueError, match=rf"^{name} must be a floating-point array"):
            jax.jit(fn, static_argnums=0)(caches.layout, caches.pools, caches.cursor, 0, bad["q"], bad["k"],
                                          bad["v"], bad["extra_k"], bad["extra_v"])


def test_float_inputs_of_any_width_are_accepted(view):
    caches, x, calls = view
    half = {name: jnp.asarray(value, jnp.bfloat16) for name, value in x.items()}
    out = attend(caches, 0, half)
    assert out.dtype == jnp.bfloat16 and out.shape == x["q"].shape and len(calls) == 1


def test_wrong_shapes_never_reach_the_backend(view):
    caches, x, calls = view
    with pytest.raises(ValueError, match="seq_len="):
        attend(caches, 0, dict(x, k=jnp.concatenate([x["k"]] * 2), v=jnp.concatenate([x["v"]] * 2)))
    with pytest.raises(ValueError, match="KV heads"):
        attend(caches, 0, dict(x, extra_k=x["extra_k"][:, :1], extra_v=x["extra_v"][:, :1]))
    assert calls == []


@pytest.mark.parametrize("layer", [2, -3, jnp.int32(5)], ids=repr)
def test_functional_core_range_checks_concrete_layers(layer):
    cache, state = filled_cache()
    caches = state.get_kv_caches("main", seq_len=cache.layout.tokens_per_frame)
    layout, pools, x = cache.layout, cache.pools, attention_inputs(cache.layout)
    calls = [
        lambda: paged_attention(layout, pools, caches.cursor, layer, x["q"], x["k"], x["v"]),
        lambda: ref_paged_attention(layout, pools, caches.cursor, layer, x["q"], x["k"], x["v"]),
        lambda: gather_pages(layout, pools, layer, np.arange(3, dtype=np.int32)),
        lambda: read_run(layout, pools, layer, np.int32(0)),
    ]
    for call in calls:
        with pytest.raises(IndexError, match="out of range for 2 layers"):
            call()
    np.testing.assert_array_equal(np.asarray(read_run(layout, pools, -1, np.int32(0))[0]),
                                  np.asarray(read_run(layout, pools, 1, np.int32(0))[0]))


def test_auto_backend_picks_cudnn_only_where_it_can_run_and_says_why(caplog):
    caplog.set_level("INFO", logger="ardiff_jax.runtime")
    cache = ARDiffusionKVCache(make_spec(), dtype="bfloat16", available_memory_bytes=AMPLE, attention_backend="auto")
    try:
        assert cache.attention_backend == "xla"  # this machine has no GPU
        assert "attention backend 'xla': cuDNN flash attention unavailable" in caplog.text
        assert EngineConfig().attention_backend == "auto"
    finally:
        cache.close()
