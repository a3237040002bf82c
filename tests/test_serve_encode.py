"""The server's chunk encoders (m4s, jpeg) and its Prometheus metrics."""

from __future__ import annotations

import io
import struct
import sys

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("prometheus_client")

from ardiff_jax import SessionEvent  # noqa: E402
from ardiff_jax.serve._encode import (  # noqa: E402
    ChunkEncoder,
    ChunkInfo,
    M4sEncoder,
    _top_level_boxes,
    decode_jpeg_chunk,
    make_encoder,
    upscale_frames,
)
from ardiff_jax.serve._metrics import INTERACTION_OUTCOMES, ServerMetrics  # noqa: E402

SIZE, FPS, FRAMES_PER_CHUNK = 32, 8, 4


def _colour(index: int) -> np.ndarray:
    """A distinct, saturated-enough RGB colour per frame index (lossy codecs keep flat colours close)."""
    return np.array([(40 + 50 * index) % 220 + 20, (200 - 30 * index) % 220 + 20, (90 + 70 * index) % 220 + 20],
                    dtype=np.uint8)


def _chunk(first: int, count: int = FRAMES_PER_CHUNK, size: int = SIZE) -> np.ndarray:
    return np.stack([np.broadcast_to(_colour(first + i), (size, size, 3)) for i in range(count)]).copy()


def _decode_mp4(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), format="mp4") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def _assert_colours(frames: list[np.ndarray], first: int, tolerance: float = 12.0) -> None:
    for offset, frame in enumerate(frames):
        mean = frame.reshape(-1, 3).mean(axis=0)
        expected = _colour(first + offset).astype(float)
        assert np.abs(mean - expected).max() < tolerance, (first + offset, mean, expected)


def _box_kinds(data: bytes) -> list[bytes]:
    return [kind for kind, _, _ in _top_level_boxes(data)]


def _encode_stream(encoder: ChunkEncoder, chunks: int) -> list[bytes]:
    return [encoder.encode(_chunk(k * FRAMES_PER_CHUNK)) for k in range(chunks)]


# -- m4s -----------------------------------------------------------------------------------------
@pytest.fixture(params=[None, "mpeg4"], ids=["default", "mpeg4"])
def m4s(request):
    encoder = make_encoder("m4s", width=SIZE, height=SIZE, fps=FPS, codec=request.param)
    yield encoder
    encoder.close()


def test_m4s_concatenation_decodes_every_frame_in_order(m4s):
    chunks = _encode_stream(m4s, 4)
    frames = _decode_mp4(b"".join(chunks))
    assert len(frames) == 4 * FRAMES_PER_CHUNK
    assert all(frame.shape == (SIZE, SIZE, 3) for frame in frames)
    _assert_colours(frames, 0)


def test_m4s_first_chunk_is_init_segment_plus_its_own_frames(m4s):
    chunks = _encode_stream(m4s, 3)
    assert _box_kinds(chunks[0]) == [b"ftyp", b"moov", b"moof", b"mdat"]
    assert all(_box_kinds(chunk) == [b"moof", b"mdat"] for chunk in chunks[1:])
    first = _decode_mp4(chunks[0])  # no frame of chunk 1 is held back until chunk 2
    assert len(first) == FRAMES_PER_CHUNK
    _assert_colours(first, 0)


def test_m4s_every_chunk_starts_with_a_keyframe_so_a_dropped_chunk_is_survivable(m4s):
    chunks = _encode_stream(m4s, 3)
    with av.open(io.BytesIO(b"".join(chunks)), format="mp4") as container:
        keyframes = [frame.key_frame for frame in container.decode(video=0)]
    assert [i for i, key in enumerate(keyframes) if key] == [0, FRAMES_PER_CHUNK, 2 * FRAMES_PER_CHUNK]
    frames = _decode_mp4(chunks[0] + chunks[2])  # chunk 1 lost in a full send queue
    assert len(frames) == 2 * FRAMES_PER_CHUNK
    _assert_colours(frames[FRAMES_PER_CHUNK:], 2 * FRAMES_PER_CHUNK)


def test_m4s_timestamps_continue_across_chunks(m4s):
    chunks = _encode_stream(m4s, 3)
    with av.open(io.BytesIO(b"".join(chunks)), format="mp4") as container:
        stream = container.streams.video[0]
        seconds = [float(frame.pts * stream.time_base) for frame in container.decode(video=0)]
    assert seconds == pytest.approx([i / FPS for i in range(3 * FRAMES_PER_CHUNK)])


def test_m4s_records_chunk_info(m4s):
    assert m4s.last_chunk is None
    first = m4s.encode(_chunk(0, count=3))
    assert m4s.last_chunk == ChunkInfo(index=0, num_frames=3, byte_length=len(first))
    second = m4s.encode(_chunk(3, count=5))
    assert m4s.last_chunk == ChunkInfo(index=1, num_frames=5, byte_length=len(second))
    assert m4s.chunks_encoded == 2


def test_m4s_mime_names_the_stream_actually_written():
    encoder = make_encoder("m4s", width=SIZE, height=SIZE, fps=FPS, scale=4)
    if encoder.codec != "libx264":
        pytest.skip("this PyAV build's FFmpeg has no libx264")
    assert isinstance(encoder, M4sEncoder) and isinstance(encoder, ChunkEncoder)
    mime = encoder.mime  # known before the first chunk: the client creates its SourceBuffer from video.start
    data = encoder.encode(_chunk(0))
    avcc = data[data.index(b"avcC") + 4:]
    assert mime == f'video/mp4; codecs="avc1.{avcc[1]:02X}{avcc[2]:02X}{avcc[3]:02X}"'
    assert avcc[1] == 0x42  # Constrained Baseline (66): no B-frames, the widest browser support


def test_m4s_scale_and_odd_sizes():
    scaled = make_encoder("m4s", width=SIZE, height=SIZE, fps=FPS, scale=3)
    frames = _decode_mp4(scaled.encode(_chunk(0)))
    assert [frame.shape for frame in frames] == [(3 * SIZE, 3 * SIZE, 3)] * FRAMES_PER_CHUNK
    _assert_colours(frames, 0)

    odd = make_encoder("m4s", width=17, height=9, fps=FPS)
    assert (odd.video_width, odd.video_height) == (18, 10)
    frames = _decode_mp4(odd.encode(np.stack([np.broadcast_to(_colour(i), (9, 17, 3)) for i in range(2)])))
    assert [frame.shape for frame in frames] == [(10, 18, 3)] * 2
    _assert_colours(frames, 0)


# -- jpeg ----------------------------------------------------------------------------------------
def test_jpeg_round_trip_and_framing():
    encoder = make_encoder("jpeg", width=SIZE, height=SIZE, fps=FPS)
    assert encoder.format == "jpeg" and isinstance(encoder, ChunkEncoder)
    data = encoder.encode(_chunk(0, count=3))
    assert struct.unpack(">I", data[:4]) == (3,)
    (first_length,) = struct.unpack(">I", data[4:8])
    assert data[8:10] == b"\xff\xd8" and data[8 + first_length - 2:8 + first_length] == b"\xff\xd9"
    assert encoder.last_chunk == ChunkInfo(index=0, num_frames=3, byte_length=len(data))
    frames = decode_jpeg_chunk(data)
    assert [frame.shape for frame in frames] == [(SIZE, SIZE, 3)] * 3
    assert all(frame.dtype == np.uint8 for frame in frames)
    _assert_colours(frames, 0, tolerance=4.0)


def test_jpeg_scale_repeats_pixels():
    pattern = np.zeros((1, 4, 4, 3), np.uint8)
    pattern[0, ::2, ::2] = 255
    scaled = upscale_frames(pattern, 8)
    assert scaled.shape == (1, 32, 32, 3)
    assert np.array_equal(scaled[0, :8, :8], np.full((8, 8, 3), 255)) and not scaled[0, 8:16, :8].any()
    frames = decode_jpeg_chunk(make_encoder("jpeg", width=4, height=4, fps=FPS, scale=8).encode(pattern))
    assert frames[0].shape == (32, 32, 3)
    assert frames[0][2:6, 2:6].min() > 200 and frames[0][10:14, 2:6].max() < 60


@pytest.mark.parametrize("cut, message", [
    (lambda d: d[:3], "frame count"),
    (lambda d: d[:6], "has no length"),
    (lambda d: d[:-1], "declares"),
    (lambda d: struct.pack(">I", 3) + d[4:], "has no length"),
    (lambda d: d + b"\x00", "trailing"),
    (lambda d: d[:8] + b"\x00" * (len(d) - 8), "not a JPEG"),
])
def test_jpeg_bad_framing_raises(cut, message):
    data = make_encoder("jpeg", width=SIZE, height=SIZE, fps=FPS).encode(_chunk(0, count=2))
    with pytest.raises(ValueError, match=message):
        decode_jpeg_chunk(cut(data))


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["m4s", "jpeg"])
@pytest.mark.parametrize("frames, message", [
    (np.zeros((2, SIZE, SIZE, 3), np.float32), "dtype uint8"),
    (np.zeros((2, SIZE, SIZE), np.uint8), "shape"),
    (np.zeros((2, SIZE, SIZE + 1, 3), np.uint8), "shape"),
    (np.zeros((2, SIZE, SIZE, 4), np.uint8), "shape"),
    (np.zeros((0, SIZE, SIZE, 3), np.uint8), "shape"),
    ([[0]], "numpy array"),
])
def test_bad_frames_raise_and_change_nothing(fmt, frames, message):
    encoder = make_encoder(fmt, width=SIZE, height=SIZE, fps=FPS)
    encoder.encode(_chunk(0))
    before = encoder.last_chunk
    with pytest.raises(ValueError, match=message):
        encoder.encode(frames)
    assert encoder.last_chunk == before
    assert encoder.encode(_chunk(4)) and encoder.last_chunk.index == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "webm"}, r"'m4s', 'jpeg'.*'webm'"),
    ({"width": 0}, "width"),
    ({"height": True}, "height"),
    ({"fps": 2.5}, "fps"),
    ({"scale": 0}, "scale"),
    ({"codec": "vp9"}, "codec"),
    ({"format": "jpeg", "codec": "mpeg4"}, "m4s format only"),
])
def test_bad_encoder_arguments_raise(kwargs, message):
    arguments = {"format": "m4s", "width": SIZE, "height": SIZE, "fps": FPS, **kwargs}
    fmt = arguments.pop("format")
    with pytest.raises(ValueError, match=message):
        make_encoder(fmt, **arguments)


@pytest.mark.parametrize("fmt", ["m4s", "jpeg"])
def test_encode_after_close_raises(fmt):
    encoder = make_encoder(fmt, width=SIZE, height=SIZE, fps=FPS)
    encoder.close()
    encoder.close()
    with pytest.raises(RuntimeError, match="closed"):
        encoder.encode(_chunk(0))


def test_m4s_without_pyav_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=r"ardiff_jax\[serve\]"):
        make_encoder("m4s", width=SIZE, height=SIZE, fps=FPS)


# -- metrics -------------------------------------------------------------------------------------
METRIC_NAMES = [
    "ardiff_sessions_resident", "ardiff_sessions_connected", "ardiff_evictions_total",
    "ardiff_sessions_offloaded_total", "ardiff_sessions_restored_total", "ardiff_interactions_total",
    "ardiff_chunks_total", "ardiff_chunk_bytes_total", "ardiff_chunk_latency_seconds_bucket",
    "ardiff_send_queue_depth", "ardiff_send_queue_dropped_total", "ardiff_errors_total",
]


def _value(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_render_exposes_every_metric():
    body, content_type = ServerMetrics().render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name in METRIC_NAMES:
        assert name in text, name
    for outcome in INTERACTION_OUTCOMES:
        assert f'ardiff_interactions_total{{outcome="{outcome}"}} 0.0' in text


def test_counters_and_gauges_move():
    metrics = ServerMetrics()
    metrics.observe_chunk(0.02, 1500)
    metrics.observe_chunk(3.0, 500)
    assert _value(metrics, "ardiff_chunks_total") == 2
    assert _value(metrics, "ardiff_chunk_bytes_total") == 2000
    assert _value(metrics, "ardiff_chunk_latency_seconds_count") == 2
    assert _value(metrics, "ardiff_chunk_latency_seconds_bucket", le="0.025") == 1
    assert _value(metrics, "ardiff_chunk_latency_seconds_bucket", le="5.0") == 2
    metrics.interaction("queued")
    metrics.interaction("queued")
    metrics.interaction("duplicate")
    assert _value(metrics, "ardiff_interactions_total", outcome="queued") == 2
    assert _value(metrics, "ardiff_interactions_total", outcome="duplicate") == 1
    assert _value(metrics, "ardiff_interactions_total", outcome="rejected") == 0
    metrics.error("capacity")
    assert _value(metrics, "ardiff_errors_total", code="capacity") == 1
    metrics.set_send_queue_depth(7)
    assert _value(metrics, "ardiff_send_queue_depth") == 7
    metrics.dropped()
    metrics.dropped(2)
    assert _value(metrics, "ardiff_send_queue_dropped_total") == 3
    metrics.connected(+1)
    metrics.connected(+1)
    metrics.connected(-1)
    assert _value(metrics, "ardiff_sessions_connected") == 1


@pytest.mark.parametrize("call, message", [
    (lambda m: m.interaction("accepted"), "outcome"),
    (lambda m: m.observe_chunk(-0.1, 10), "latency_s"),
    (lambda m: m.observe_chunk(float("nan"), 10), "latency_s"),
    (lambda m: m.observe_chunk(0.1, -1), "nbytes"),
    (lambda m: m.error(""), "code"),
    (lambda m: m.set_send_queue_depth(-1), "depth"),
    (lambda m: m.connected(True), "delta"),
    (lambda m: m.on_session_event(SessionEvent("vanished", "s")), "vanished"),
])
def test_bad_metric_updates_raise(call, message):
    metrics = ServerMetrics()
    with pytest.raises(ValueError, match=message):
        call(metrics)
    assert _value(metrics, "ardiff_chunks_total") == 0


def test_two_instances_do_not_clash():
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_chunk(0.01, 10)
    first.interaction("rejected")
    assert _value(first, "ardiff_chunks_total") == 1
    assert _value(second, "ardiff_chunks_total") == 0
    assert _value(second, "ardiff_interactions_total", outcome="rejected") == 0


def test_session_events_drive_residency_evictions_offloads_and_restores():
    metrics = ServerMetrics()
    for event in [SessionEvent("created", "a"), SessionEvent("created", "b")]:
        metrics.on_session_event(event)
    assert _value(metrics, "ardiff_sessions_resident") == 2
    metrics.on_session_event(SessionEvent("offloaded", "a", "lru_eviction"))
    assert (_value(metrics, "ardiff_evictions_total"), _value(metrics, "ardiff_sessions_offloaded_total"),
            _value(metrics, "ardiff_sessions_resident")) == (1, 1, 1)
    metrics.on_session_event(SessionEvent("restored", "a", "offload"))
    assert (_value(metrics, "ardiff_sessions_restored_total"), _value(metrics, "ardiff_sessions_resident")) == (1, 2)
    metrics.on_session_event(SessionEvent("released", "b", "lru_eviction"))
    assert (_value(metrics, "ardiff_evictions_total"), _value(metrics, "ardiff_sessions_resident")) == (2, 1)
    # A session dropped from the host tier was not resident: the gauge must not move.
    metrics.on_session_event(SessionEvent("offloaded", "a", "lru_eviction"))
    metrics.on_session_event(SessionEvent("released", "a", "host_eviction"))
    assert (_value(metrics, "ardiff_evictions_total"), _value(metrics, "ardiff_sessions_resident")) == (3, 0)
    metrics.on_session_event(SessionEvent("released", "ghost", "close"))
    assert _value(metrics, "ardiff_sessions_resident") == 0
    assert _value(metrics, "ardiff_evictions_total") == 3
