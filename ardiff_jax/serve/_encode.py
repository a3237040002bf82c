"""Chunk encoders: one generated chunk of frames in, the bytes of one binary WebSocket frame out.

Two formats, chosen per session:

* ``"m4s"``: fragmented MP4 (H.264 through PyAV). The first chunk's bytes are the
  initialisation segment (``ftyp`` + ``moov``) followed by the chunk's fragment
  (``moof`` + ``mdat``); every later chunk's bytes are one more fragment. The
  concatenation of all chunks is one valid fragmented MP4 stream: PyAV
  (``av.open(io.BytesIO(b"".join(chunks)), format="mp4")``) decodes it, and a browser
  appends each chunk to a Media Source Extensions ``SourceBuffer`` created with
  :attr:`M4sEncoder.mime`.
* ``"jpeg"``: each chunk's frames as JPEGs, framed as a 4-byte big-endian frame count
  ``N`` followed by ``N`` times (4-byte big-endian length, JPEG bytes). No inter-frame
  state, so the lowest latency and any chunk decodes alone; :func:`decode_jpeg_chunk`
  reads the framing back.

Every m4s chunk starts with an IDR frame, so a chunk is self-contained apart from the
initialisation segment: a client that misses chunks (a bounded send queue dropped them)
decodes the next one it receives.

Why one muxer per chunk: the MP4 muxer writes a fragment only when the next one starts
(or on an explicit flush that PyAV does not expose), so a long-lived muxer would hold
each chunk's last frame back until the following chunk. Closing a muxer flushes its
fragment, so each chunk is muxed by its own short-lived muxer fed by one long-lived
encoder; the muxer is told the fragment's sequence number (``fragment_index``) and keeps
absolute timestamps (``frag_discont`` with ``avoid_negative_ts=disabled``), and only the
first chunk keeps the initialisation segment, which is identical for every muxer.

An encoder holds per-session state (the H.264 reference frames, the running timestamp)
and is meant for one worker thread per session; a lock makes a ``close`` from another
thread safe.
"""

from __future__ import annotations

import fractions
import io
import struct
import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ardiff_jax._checks import check_positive_int

__all__ = [
    "CHUNK_FORMATS",
    "ChunkEncoder",
    "ChunkInfo",
    "JpegEncoder",
    "M4sEncoder",
    "decode_jpeg_chunk",
    "make_encoder",
    "upscale_frames",
]

CHUNK_FORMATS = ("m4s", "jpeg")
JPEG_QUALITY = 90
_H264_ENCODER = "libx264"
_FALLBACK_ENCODER = "mpeg4"
_FRAME_HEADER = struct.Struct(">I")  # big-endian uint32: frame count, then each JPEG's length


@dataclass(frozen=True)
class ChunkInfo:
    """What the server reports about one encoded chunk: its 0-based index, frame count and byte length."""

    index: int
    num_frames: int
    byte_length: int


@runtime_checkable
class ChunkEncoder(Protocol):
    """Turns one chunk of frames ``uint8[f, H, W, 3]`` into the bytes of one binary message."""

    format: str
    mime: str
    last_chunk: ChunkInfo | None

    def encode(self, frames: np.ndarray) -> bytes: ...

    def close(self) -> None: ...


def make_encoder(format: str, *, width: int, height: int, fps: int, scale: int = 1,
                 codec: str | None = None) -> ChunkEncoder:
    """A fresh encoder for one session's stream of ``height x width`` RGB frames at ``fps``.

    ``scale`` upscales every frame by that integer factor (nearest neighbour) before
    encoding, so small frames (32x32) show up at a visible size in a player. ``codec``
    (m4s only) picks the video encoder; ``None`` uses libx264 where PyAV's FFmpeg has it
    and mpeg4 otherwise (decodable by PyAV and desktop players, not by browsers' MSE).
    """
    if format == "m4s":
        return M4sEncoder(width=width, height=height, fps=fps, scale=scale, codec=codec)
    if format == "jpeg":
        if codec is not None:
            raise ValueError(f"codec applies to the m4s format only, got codec={codec!r} for jpeg")
        return JpegEncoder(width=width, height=height, fps=fps, scale=scale)
    raise ValueError(f"format must be one of {', '.join(repr(f) for f in CHUNK_FORMATS)}, got {format!r}")


def upscale_frames(frames: np.ndarray, scale: int) -> np.ndarray:
    """``uint8[f, H, W, 3]`` -> ``uint8[f, H*scale, W*scale, 3]``, each pixel repeated (nearest neighbour)."""
    scale = check_positive_int("scale", scale)
    if scale == 1:
        return frames
    return np.repeat(np.repeat(frames, scale, axis=1), scale, axis=2)


class _EncoderBase:
    """Argument checks, the frame check and the chunk bookkeeping shared by both formats."""

    format: str
    mime: str

    def __init__(self, *, width: int, height: int, fps: int, scale: int) -> None:
        self.width = check_positive_int("width", width)
        self.height = check_positive_int("height", height)
        self.fps = check_positive_int("fps", fps)
        self.scale = check_positive_int("scale", scale)
        self.last_chunk: ChunkInfo | None = None
        self.chunks_encoded = 0
        self._lock = threading.Lock()
        self._closed = False

    def _check_frames(self, frames: Any) -> np.ndarray:
        if not isinstance(frames, np.ndarray):
            raise ValueError(f"frames must be a numpy array uint8[f, {self.height}, {self.width}, 3], "
                             f"got {type(frames).__name__}")
        if frames.dtype != np.uint8:
            raise ValueError(f"frames must have dtype uint8, got {frames.dtype}")
        expected = (self.height, self.width, 3)
        if frames.ndim != 4 or frames.shape[1:] != expected or frames.shape[0] == 0:
            raise ValueError(f"frames must have shape [f >= 1, {self.height}, {self.width}, 3], "
                             f"got {tuple(frames.shape)}")
        return np.ascontiguousarray(upscale_frames(frames, self.scale))

    def _record(self, num_frames: int, data: bytes) -> bytes:
        self.last_chunk = ChunkInfo(index=self.chunks_encoded, num_frames=num_frames, byte_length=len(data))
        self.chunks_encoded += 1
        return data

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self.format} encoder is closed")

    def encode(self, frames: np.ndarray) -> bytes:
        """The bytes of one binary message for ``frames: uint8[f, H, W, 3]``; records :attr:`last_chunk`."""
        with self._lock:
            self._check_open()
            checked = self._check_frames(frames)
            return self._record(checked.shape[0], self._encode(checked))

    def _encode(self, frames: np.ndarray) -> bytes:  # pragma: no cover - both formats override
        raise NotImplementedError

    def close(self) -> None:
        """Release the encoder; later ``encode`` calls raise ``RuntimeError``. Idempotent."""
        with self._lock:
            self._closed = True
            self._release()

    def _release(self) -> None:
        pass


# -- jpeg --------------------------------------------------------------------------------------
class JpegEncoder(_EncoderBase):
    """One chunk -> ``N`` JPEGs (quality :data:`JPEG_QUALITY`) in the count + length-prefixed framing."""

    format = "jpeg"
    mime = "image/jpeg"

    def _encode(self, frames: np.ndarray) -> bytes:
        from PIL import Image

        out = bytearray(_FRAME_HEADER.pack(frames.shape[0]))
        for frame in frames:
            buffer = io.BytesIO()
            Image.fromarray(frame, mode="RGB").save(buffer, format="JPEG", quality=JPEG_QUALITY)
            picture = buffer.getvalue()
            out += _FRAME_HEADER.pack(len(picture))
            out += picture
        return bytes(out)


def decode_jpeg_chunk(data: bytes) -> list[np.ndarray]:
    """The frames ``uint8[H, W, 3]`` of one jpeg-format message; ``ValueError`` for bad framing or JPEG data."""
    from PIL import Image

    view = memoryview(bytes(data))
    if len(view) < _FRAME_HEADER.size:
        raise ValueError(f"jpeg chunk is truncated: {len(view)} bytes, less than the 4-byte frame count")
    (count,) = _FRAME_HEADER.unpack_from(view, 0)
    offset = _FRAME_HEADER.size
    frames = []
    for index in range(count):
        if offset + _FRAME_HEADER.size > len(view):
            raise ValueError(f"jpeg chunk is truncated: frame {index} of {count} has no length "
                             f"(byte {offset} of {len(view)})")
        (length,) = _FRAME_HEADER.unpack_from(view, offset)
        offset += _FRAME_HEADER.size
        if offset + length > len(view):
            raise ValueError(f"jpeg chunk is truncated: frame {index} of {count} declares {length} bytes, "
                             f"{len(view) - offset} remain")
        try:
            with Image.open(io.BytesIO(view[offset:offset + length])) as picture:
                frames.append(np.asarray(picture.convert("RGB"), dtype=np.uint8))
        except Exception as error:
            raise ValueError(f"jpeg chunk frame {index} of {count} is not a JPEG: {error}") from None
        offset += length
    if offset != len(view):
        raise ValueError(f"jpeg chunk has {len(view) - offset} trailing bytes after its {count} frames")
    return frames


# -- m4s ---------------------------------------------------------------------------------------
def _import_av() -> Any:
    try:
        import av
    except ImportError as error:
        raise ImportError("the m4s format needs PyAV; install the serve extra: pip install 'ardiff_jax[serve]'"
                          ) from error
    return av


class _ByteSink:
    """A write-only file object: PyAV muxes into it and ``drain`` takes what was written (never seeks)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


def _top_level_boxes(data: bytes) -> list[tuple[bytes, int, int]]:
    """``(type, offset, size)`` of each top-level ISO BMFF box; ``ValueError`` when the sizes do not add up."""
    boxes, offset = [], 0
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"MP4 box header truncated at byte {offset} of {len(data)}")
        size, kind = struct.unpack_from(">I4s", data, offset)
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, offset + 8)
        if size < 8 or offset + size > len(data):
            raise ValueError(f"MP4 box {kind!r} at byte {offset} has size {size}, {len(data) - offset} bytes remain")
        boxes.append((kind, offset, size))
        offset += size
    return boxes


def _strip_init_segment(data: bytes) -> bytes:
    return b"".join(data[offset:offset + size] for kind, offset, size in _top_level_boxes(data)
                    if kind not in (b"ftyp", b"moov"))


def _annexb_units(data: bytes) -> list[bytes]:
    """The NAL units (or MPEG-4 start-code units) of an Annex B byte string, start codes removed."""
    units, start = [], None
    i = 0
    while i + 3 <= len(data):
        if data[i:i + 3] == b"\x00\x00\x01":
            if start is not None:
                units.append(data[start:i].rstrip(b"\x00"))
            start = i = i + 3
            continue
        i += 1
    if start is not None:
        units.append(data[start:])
    return units


def _codecs_string(codec_name: str, extradata: bytes) -> str:
    """The RFC 6381 ``codecs`` value for the encoder's global header (SPS for H.264, VOS for MPEG-4)."""
    if codec_name == _H264_ENCODER:
        for unit in _annexb_units(extradata):
            if unit and unit[0] & 0x1F == 7:  # sequence parameter set: profile_idc, constraint flags, level_idc
                return f"avc1.{unit[1]:02X}{unit[2]:02X}{unit[3]:02X}"
        raise RuntimeError(f"libx264 produced no sequence parameter set in its header ({extradata[:16].hex()})")
    for unit in _annexb_units(extradata):
        if unit and unit[0] == 0xB0:  # visual object sequence: profile_and_level_indication
            return f"mp4v.20.{unit[1]}"
    return "mp4v.20.9"  # Simple Profile level 0 when the encoder omits the sequence header


class M4sEncoder(_EncoderBase):
    """Fragmented MP4: the first chunk carries the initialisation segment, each chunk one fragment.

    The video is ``height*scale`` by ``width*scale`` pixels, each rounded up to even
    (yuv420p needs even sizes; the extra row or column repeats the edge), available as
    :attr:`video_height` and :attr:`video_width`. libx264 runs with ``preset=ultrafast``
    (Constrained Baseline: no B-frames, no CABAC, the widest browser support),
    ``tune=zerolatency`` (each input frame yields its packet at once) and one thread.
    :attr:`mime` is the MSE type, e.g. ``video/mp4; codecs="avc1.42C00D"``, read from
    the encoder's own sequence parameter set at construction, before any chunk.
    """

    format = "m4s"

    def __init__(self, *, width: int, height: int, fps: int, scale: int = 1, codec: str | None = None) -> None:
        super().__init__(width=width, height=height, fps=fps, scale=scale)
        av = _import_av()
        available = av.codecs_available
        if codec is None:
            codec = _H264_ENCODER if _H264_ENCODER in available else _FALLBACK_ENCODER
        if codec not in (_H264_ENCODER, _FALLBACK_ENCODER):
            raise ValueError(f"codec must be {_H264_ENCODER!r} or {_FALLBACK_ENCODER!r}, got {codec!r}")
        if codec not in available:
            raise ValueError(f"codec {codec!r} is not in this PyAV build's FFmpeg")
        self.codec = codec
        self.video_width = self.width * self.scale + (self.width * self.scale) % 2
        self.video_height = self.height * self.scale + (self.height * self.scale) % 2
        self._av = av
        self.mime = f'video/mp4; codecs="{_codecs_string(codec, self._probe_header())}"'
        # In-band parameter sets (no global header): PyAV reads each muxer's extradata from the first IDR.
        self._context = self._open_context(global_header=False)
        self._next_pts = 0

    def _open_context(self, *, global_header: bool) -> Any:
        context = self._av.CodecContext.create(self.codec, "w")
        context.width = self.video_width
        context.height = self.video_height
        context.pix_fmt = "yuv420p"
        context.time_base = fractions.Fraction(1, self.fps)
        context.framerate = fractions.Fraction(self.fps)
        if self.codec == _H264_ENCODER:
            context.options = {"preset": "ultrafast", "tune": "zerolatency", "bf": "0", "forced-idr": "1",
                               "threads": "1"}
        else:
            context.options = {"bf": "0", "threads": "1"}
            context.qscale = 3  # mpeg4's default rate control smears small frames into grey blocks
            context.flags |= self._av.codec.context.Flags.qscale
        if global_header:
            context.flags |= self._av.codec.context.Flags.global_header
        context.open()
        return context

    def _probe_header(self) -> bytes:
        """The global header an identically configured encoder writes (its SPS names profile and level)."""
        return bytes(self._open_context(global_header=True).extradata or b"")

    def _pad(self, frames: np.ndarray) -> np.ndarray:
        rows, cols = self.video_height - frames.shape[1], self.video_width - frames.shape[2]
        if rows or cols:
            frames = np.pad(frames, ((0, 0), (0, rows), (0, cols), (0, 0)), mode="edge")
        return frames

    def _encode(self, frames: np.ndarray) -> bytes:
        av = self._av
        sink = _ByteSink()
        options = {"movflags": "frag_keyframe+empty_moov+default_base_moof+skip_trailer+frag_discont",
                   "fragment_index": str(self.chunks_encoded + 1), "avoid_negative_ts": "disabled",
                   "use_editlist": "0"}
        container = av.open(sink, mode="w", format="mp4", options=options)
        try:
            stream = container.add_mux_stream("h264" if self.codec == _H264_ENCODER else "mpeg4", rate=self.fps,
                                              width=self.video_width, height=self.video_height)
            stream.time_base = fractions.Fraction(1, self.fps)
            packets = 0
            for position, pixels in enumerate(self._pad(frames)):
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts = self._next_pts + position
                if position == 0:  # every chunk (every fragment) opens with an IDR frame
                    frame.pict_type = av.video.frame.PictureType.I
                for packet in self._context.encode(frame):
                    packet.stream = stream
                    container.mux(packet)
                    packets += 1
            if packets != frames.shape[0]:  # zerolatency and no B-frames make this one packet per frame
                raise RuntimeError(f"{self.codec} returned {packets} packets for {frames.shape[0]} frames; "
                                   "the chunk's frames would leak into the next chunk")
        finally:
            container.close()  # writes the chunk's fragment (skip_trailer: no mfra index)
        self._next_pts += frames.shape[0]
        data = sink.drain()
        if self.chunks_encoded > 0:
            data = _strip_init_segment(data)
        return data

    def _release(self) -> None:
        self._context = None
