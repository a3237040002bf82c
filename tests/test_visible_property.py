"""Property: every forward reads exactly the frames the reference runtime reads.

The reference behaviour is written down in ``docs/reference_behaviour.md`` ("KV state",
"Visible window").

A plain-Python model keeps, per branch, the K/V arrays of every committed frame and derives
the visible frames from the reference's own description: eager eviction of table indices
``[sink, sink + skipped)`` with ``skipped = max(0, n - window - sink)`` (or ``max(0, n - sink)``
under ``reset_at_boundary``), then ``video_block_table`` truncation of ``history + current``
to its first ``sink`` and last ``window`` entries. Random geometries and
random sequences of committing forwards, non-committing probes (with or without clearing
them) and ``state.reset()`` are checked layer by layer:

* ``caches.visible_frames()`` equals the model's visible frame list (in key order);
* ``caches.attend`` and ``caches.ref_attend`` equal :func:`ardiff_jax.kv.ref_attention` over
  ``[visible frames in order][current k, v][extra tokens]``.

Tolerance ``rtol = atol = 1e-5``: all three run in float32 on O(1) random values but sum in
different orders (shared log-sum-exp over the run in ring order vs softmax over a
concatenation); observed differences are ~1e-7.

Speed: shapes vary per example, so each example compiles its own programs; each example
draws at most two (frames, extra tokens) forward shapes, and the model's reference is padded
to one global key length so it compiles once per query shape for the whole test.
"""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ardiff_jax.kv import ref_attention
from helpers import CFG, MAIN, contract_visible, make_cache, randn

TOL = dict(rtol=1e-5, atol=1e-5)
MAX_SINK, MAX_WINDOW, MAX_TOKENS, MAX_EXTRA, MAX_QUERIES = 3, 5, 3, 4, 3
#: Keys of the padded model reference: the largest visible video + the largest extra.
PAD_KEYS = (MAX_SINK + MAX_WINDOW) * MAX_TOKENS + MAX_EXTRA
HEAD_SIZE = 4


@jax.jit
def _padded_ref(q, keys, values, mask):
    return ref_attention(q, keys, values, mask=mask)


def model_attention(q, keys, values):
    """``ref_attention`` over the model's ordered keys, zero-padded (and masked) to ``PAD_KEYS``.

    The queries (independent rows) are zero-padded to ``MAX_QUERIES`` too and cut off again, so the
    reference compiles once per head geometry rather than once per query count as well."""
    n, s = keys.shape[0], q.shape[0]
    assert n <= PAD_KEYS and s <= MAX_QUERIES
    pad = ((0, PAD_KEYS - n), (0, 0), (0, 0))
    mask = np.arange(PAD_KEYS) < n
    q = np.pad(q, ((0, MAX_QUERIES - s), (0, 0), (0, 0)))
    return np.asarray(_padded_ref(q, np.pad(keys, pad), np.pad(values, pad), mask))[:s]


OPS = ["commit"] * 5 + ["probe"] * 2 + ["probe_clear"] * 2 + ["reset"]


@st.composite
def scenarios(draw):
    sink = draw(st.integers(0, MAX_SINK))
    window = draw(st.integers(1, MAX_WINDOW))
    frames_per_block = draw(st.integers(1, window))
    tokens = draw(st.integers(1, MAX_TOKENS))
    extra = draw(st.integers(0, MAX_EXTRA))
    geometry = dict(
        sink_frames=sink, window_frames=window, frames_per_block=frames_per_block, tokens_per_frame=tokens,
        num_layers=draw(st.integers(1, 2)), num_kv_heads=draw(st.integers(1, 2)), head_size=HEAD_SIZE,
        reset_at_boundary=draw(st.booleans()), max_scratch_tokens_per_branch=extra,
        kv_branches=draw(st.sampled_from([MAIN, CFG])),
    )
    shapes = draw(st.lists(st.tuples(st.integers(1, frames_per_block), st.integers(0, extra)), min_size=1,
                           max_size=2, unique=True))
    branches = [b.name for b in geometry["kv_branches"]]
    ops = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, len(shapes) - 1), st.sampled_from(branches)),
                        min_size=1, max_size=3 * (sink + window) + 3))
    return dict(
        geometry=geometry, shapes=shapes, ops=ops, groups=draw(st.integers(1, 2)),
        queries=draw(st.integers(1, MAX_QUERIES)),
        batched=draw(st.booleans()), neighbour=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
    )


def _fill_neighbour(cache, state, f):
    """A session in the adjacent slot whose every page holds NaN: reading it would poison the output."""
    layout = cache.layout
    nan = np.full((layout.num_layers, f * layout.tokens_per_frame, layout.num_kv_heads, layout.head_size), np.nan,
                  np.float32)
    for branch in state.kv_branch_names:
        for _ in range(-(-layout.run_pages // f) + 1):
            state.get_kv_caches(branch, seq_len=f * layout.tokens_per_frame, commit_current=True)
            state.commit_paged_context(branch, kv=(nan, nan))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_attend_reads_exactly_the_contract_window(scenario):
    geometry = scenario["geometry"]
    cache = make_cache(**geometry)
    layout = cache.layout
    sink, window, reset = layout.sink_frames, layout.window_frames, layout.reset_at_boundary
    L, T, H, D = layout.num_layers, layout.tokens_per_frame, layout.num_kv_heads, layout.head_size
    Hq = H * scenario["groups"]
    rng = np.random.default_rng(scenario["seed"])
    if scenario["neighbour"]:
        _fill_neighbour(cache, cache.create_state("neighbour"), scenario["shapes"][0][0])
    state = cache.create_state("s")
    assert state.slot == (1 if scenario["neighbour"] else 0)
    history: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {b: [] for b in state.kv_branch_names}

    for op, shape_index, branch in scenario["ops"]:
        if op == "reset":
            state.reset()
            history = {b: [] for b in history}
            continue
        f, num_extra = scenario["shapes"][shape_index]
        committing = op == "commit"
        caches = state.get_kv_caches(branch, seq_len=f * T, commit_current=committing)
        frames = history[branch]
        visible = contract_visible(sink, window, reset, len(frames), f)
        assert caches.visible_frames().tolist() == visible
        assert state.adapter(branch).committed_frames == len(frames)

        q = randn(rng, L, scenario["queries"], Hq, D)
        k, v = randn(rng, L, f * T, H, D), randn(rng, L, f * T, H, D)
        ek, ev = randn(rng, L, num_extra, H, D), randn(rng, L, num_extra, H, D)
        for layer in range(L):
            keys = np.concatenate([frames[g][0][layer] for g in visible] + [k[layer], ek[layer]])
            values = np.concatenate([frames[g][1][layer] for g in visible] + [v[layer], ev[layer]])
            want = model_attention(q[layer], keys, values)
            args = (q[layer], k[layer], v[layer])
            extra = dict(extra_k=ek[layer], extra_v=ev[layer]) if num_extra else {}
            if scenario["batched"]:
                args = tuple(x[None] for x in args)
                extra = {name: x[None] for name, x in extra.items()}
            for attend in (caches.attend, caches.ref_attend):
                got = np.asarray(attend(layer, *args, **extra))
                assert got.shape == args[0].shape
                np.testing.assert_allclose(got.reshape(want.shape), want, **TOL)

        if committing:
            state.commit_paged_context(branch, kv=(k, v))
            frames.extend((k[:, i * T:(i + 1) * T], v[:, i * T:(i + 1) * T]) for i in range(f))
        elif op == "probe_clear":
            state.commit_paged_context(branch)
        assert state.adapter(branch).committed_frames == len(frames)


def test_contract_model_worked_examples():
    # The model itself against the worked examples of docs/reference_behaviour.md, "Visible window"
    # (so the property compares with the reference).
    assert contract_visible(1, 5, False, 8, 1) == [0, 4, 5, 6, 7]  # the worked example
    assert contract_visible(0, 3, False, 5, 1) == [3, 4]  # window 3, 3+2 frames -> 3 blocks
    assert contract_visible(2, 3, True, 7, 1) == [0, 1]  # reset_at_boundary keeps the leading sink
    assert contract_visible(0, 2, False, 0, 2) == []
    assert contract_visible(3, 2, False, 2, 2) == [0, 1]  # filling the sink
