"""``ServedWorld``: how one pipeline is driven over the wire.

The control plane is model-agnostic: it carries a prompt and opaque control tracks. This
module is the model-specific part of the server, kept pure so it is testable without a socket:

* which ``session.start`` values a session may use (:meth:`ServedWorld.plan_start`);
* which interactions the world accepts and the control-plane event they become
  (:meth:`ServedWorld.event_update`);
* the pipeline inputs of a tick (:meth:`ServedWorld.inputs`, :meth:`ServedWorld.prompt`) and
  the RGB frames of its output (:meth:`ServedWorld.frames`);
* what ``video.start.config`` reports (:meth:`ServedWorld.config`).

Two worlds are served:

``"sprite"`` (:class:`~ardiff_jax.models.SpriteWorldPipeline`, e.g. ``pretrained("sprite_world")``)
  The session's first chunk carries the observation ``SpriteWorld(seed).reset()``; every
  chunk carries ``inputs["actions"]``, the current action repeated over the chunk's frames.
  The world is not text-conditioned: a start prompt is ignored and prompt updates are
  refused. Controls: one track ``"action"`` (schema ``"discrete"``, data ``{"value": name}``)
  set either directly (``multi_modal_data.action: {"value": "left"}``, names from
  :data:`ardiff_jax.envs.ACTION_NAMES`) or from a camera in ``velocity`` mode, seen from
  above: translation ``+x`` -> ``right``, ``-x`` -> ``left``, ``+z`` (forward) -> ``up``,
  ``-z`` -> ``down``, all zero -> ``no-op``. When both x and z are non-zero the axis with the
  larger magnitude wins (x on a tie); y and the rotation are ignored. An action persists until
  an event replaces it (velocity semantics: the control plane keeps each track's last value).
  A camera in ``target`` mode sends the agent to an absolute cell over ``transition_chunks``
  chunks (default :data:`DEFAULT_TRANSITION_CHUNKS`): translation ``x`` is the column from the
  left, ``z`` the row from the bottom (+Z forward is up on the screen, as in velocity mode), in
  cells, rounded and clipped to the grid. Each chunk's actions are read off the frames the
  player last saw: the agent's cell and the walls in the session's last generated frame, a
  shortest path around the walls to the target (or to the reachable cell nearest it), and as
  many steps of it as keep the agent on schedule to arrive by the transition's last chunk
  (one cell per frame at most, spread evenly over the chunk's frames, no-ops between). The
  agent then waits at the target until another event replaces the control.

``"wan"`` (:class:`~ardiff_jax.models.wan.CausalWanPipeline` with a VAE and a text encoder)
  Text-to-video with a published causal Wan: ``session.start`` needs a prompt and
  ``event.prompt`` switches it at the next block boundary (the pipeline encodes it inside the
  engine call, never on the event loop). Frames are the VAE's decoded video: a session's
  first chunk has ``1 + 4(f-1)`` frames (9 for 3-latent blocks), every later one ``4f`` (12);
  the decoder's cache lives and dies with the session. Native rate 16 fps. No camera or
  action controls.

``"latent"`` (:class:`~ardiff_jax.models.WorldPipeline`, e.g. ``WorldPipeline("tiny")``, random weights)
  Text-conditioned: ``session.start`` needs a prompt and ``event.prompt`` updates it. No
  action controls. The pipeline outputs latents ``f32[f, C, H, W]``, not pixels; for viewing,
  the first three channels (a single channel repeated when ``C < 3``) map ``[-1, 1]`` to
  ``[0, 255]`` (clipped), the convention of the pixel-space models.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from ardiff_jax.envs import (
    ACTION_NAMES,
    AGENT_COLOUR,
    CELL_SIZE,
    WALL_COLOUR,
    SpriteWorld,
    cell_codes,
    cell_templates,
)
from ardiff_jax.serve._protocol import (
    FORMATS,
    MAX_FPS,
    ProtocolError,
    SessionInteraction,
    SessionStart,
)
from ardiff_jax.types import ARDiffusionControlInput, ARDiffusionTickRequest

__all__ = ["DEFAULT_TRANSITION_CHUNKS", "EventUpdate", "ServedWorld", "StartPlan", "camera_action", "target_actions"]

#: The control track of discrete actions and its schema.
ACTION_TRACK = "action"
ACTION_SCHEMA = "discrete"
#: The pseudo-track an event's prompt occupies in the event bookkeeping (started/active/completed ids).
PROMPT_FIELD = "prompt"
#: Largest integer upscale of the native frame size a session may ask for (``width``/``height``).
MAX_SCALE = 32
WORLD_KINDS = ("sprite", "latent", "wan", "matrix-game")
#: The release's interactive camera step: a mouse row of 0.1 (pitch or yaw) per video frame.
MATRIX_GAME_CAMERA_STEP = 0.1
#: Largest decoded ``image_reference`` (bytes of the data URL's payload).
MAX_IMAGE_BYTES = 16 * 2**20
#: Largest start picture read, in multiples of the frame's pixel count (16: four times the frame's width and height).
#: The bound is checked on the picture's header, before any pixel is decoded: a PNG of a few kilobytes can declare
#: 12000 x 12000 pixels (seconds and gigabytes to decode), and the network takes one frame's worth anyway. PIL's
#: own bomb limit (89 M pixels) is far above what any frame needs.
MAX_IMAGE_AREA = 16
#: Picture formats a start picture may have (PIL's names): what a browser or a camera produces, nothing exotic.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
#: Key names of the published Matrix-Game variants, in keyboard-row order; the browser keys that press them.
MATRIX_GAME_KEYS = {
    4: ("forward", "back", "left", "right"),  # universal: W, S, A, D
    2: ("forward", "back"),  # GTA driving: W, S (A and D steer, through the mouse yaw)
    7: ("no-op", "jump", "slide", "turn-left", "turn-right", "left-side", "right-side"),  # Temple Run, one-hot
}
MATRIX_GAME_BINDINGS = {
    4: {"KeyW": "forward", "KeyS": "back", "KeyA": "left", "KeyD": "right"},
    2: {"KeyW": "forward", "KeyS": "back", "KeyA": "steer-left", "KeyD": "steer-right"},
    7: {"KeyW": "jump", "Space": "jump", "KeyS": "slide", "KeyZ": "turn-left", "KeyC": "turn-right",
        "KeyA": "left-side", "KeyD": "right-side"},
}
#: The control tracks of a Matrix-Game session: held keys, and the per-frame mouse (camera) rotation.
KEYBOARD_TRACK, MOUSE_TRACK = "keyboard", "mouse"

#: The action track's schema of a camera in ``target`` mode (data: the target cell and the transition).
TARGET_SCHEMA = "target"
#: Chunks a ``target`` camera move takes when the event gives no ``transition_chunks``.
DEFAULT_TRANSITION_CHUNKS = 4


def camera_action(translation: tuple[float, float, float]) -> str:
    """The discrete action of a velocity camera translation (see the module docstring for the mapping)."""
    x, _, z = translation
    if x == 0 and z == 0:
        return "no-op"
    if abs(x) >= abs(z):
        return "right" if x > 0 else "left"
    return "up" if z > 0 else "down"


def _code_of(colour: tuple[int, int, int]) -> int:
    """The cell code whose template is ``colour`` over the whole cell (the agent, a wall)."""
    full = (cell_templates() == np.asarray(colour, np.uint8)).all(axis=(1, 2, 3))
    return int(np.flatnonzero(full)[0])


def target_actions(frame: np.ndarray, target: tuple[int, int], frames: int, chunks_left: int) -> np.ndarray:
    """``i64[frames]``: the actions of one chunk of a ``target`` camera move (see the module docstring).

    ``frame`` (``u8[size, size, 3]``) is the last frame the player saw, ``target`` the ``(row, col)``
    cell to reach, ``chunks_left`` the chunks of the transition left including this one (at least 1).
    No agent in the frame, or the agent already there: all no-ops.
    """
    codes = cell_codes(frame)
    agents = np.argwhere(codes == _code_of(AGENT_COLOUR))
    actions = np.zeros(frames, np.int64)
    if len(agents) != 1:
        return actions
    free = codes != _code_of(WALL_COLOUR)
    path = _shortest_path(free, (int(agents[0][0]), int(agents[0][1])), target)
    steps = min(frames, len(path), -(-len(path) // max(1, chunks_left)))
    for index in range(steps):  # spread over the chunk: frame floor(i * frames / steps) takes step i
        actions[index * frames // steps] = path[index]
    return actions


def _shortest_path(free: np.ndarray, start: tuple[int, int], target: tuple[int, int]) -> list[int]:
    """Actions (``ACTION_NAMES`` indices) of a shortest path over ``free`` cells from ``start`` to ``target``, or to
    the reachable cell nearest ``target`` (Manhattan; of those, the nearest to ``start``) when it cannot be
    reached; breadth first."""
    offsets = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}  # up, down, left, right
    parent: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for cell in frontier:
            for action, (dr, dc) in offsets.items():
                nxt = (cell[0] + dr, cell[1] + dc)
                if (0 <= nxt[0] < free.shape[0] and 0 <= nxt[1] < free.shape[1] and free[nxt]
                        and nxt not in parent):
                    parent[nxt] = (cell, action)
                    following.append(nxt)
        frontier = following
    order = {cell: index for index, cell in enumerate(parent)}  # breadth-first: nearer the start first
    goal = min(parent, key=lambda c: (abs(c[0] - target[0]) + abs(c[1] - target[1]), order[c]))
    path: list[int] = []
    while parent[goal] is not None:
        goal, action = parent[goal]  # type: ignore[misc]
        path.append(action)
    return path[::-1]


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """A validated ``session.start``: everything a session needs, defaults filled in.

    ``scale`` is the integer upscale of the native frames (``width = native_width * scale``).
    ``image`` is a Matrix-Game session's start picture; ``image_url`` the client's picture while it is not
    decoded yet (``plan_start(..., decode_image=False)``; :meth:`ServedWorld.decode_start_image` reads it).
    """

    format: str
    seed: int
    prompt: str | None
    num_frames: int | None
    scale: int
    width: int
    height: int
    fps: int
    ignored_fields: tuple[str, ...] = ()
    image: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    image_url: str | None = dataclasses.field(default=None, compare=False, repr=False)


def _image_refusal(why: str) -> ProtocolError:
    return ProtocolError("invalid_field", f"image_reference.image_url {why}")


def check_image_url(url: str) -> str:
    """The base64 payload of a ``data:image/...;base64,...`` URL (nothing decoded); ProtocolError ``invalid_field``
    when ``url`` is not such a URL or its payload is larger than :data:`MAX_IMAGE_BYTES`."""
    head, comma, payload = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise _image_refusal("must be a data URL (data:image/png;base64,...); the server does not fetch URLs")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise _image_refusal(f"is larger than {MAX_IMAGE_BYTES} bytes")
    return payload


def _cover_size(picture_width: int, picture_height: int, height: int, width: int) -> tuple[int, int]:
    """``(w, h)`` a picture is resized to before its center crop to ``height x width`` (the smallest cover)."""
    scale = max(width / picture_width, height / picture_height)
    return max(width, round(picture_width * scale)), max(height, round(picture_height * scale))


def decode_image_url(url: str, height: int, width: int) -> np.ndarray:
    """``u8[height, width, 3]``: a ``data:image/...;base64,...`` URL's picture, center-cropped to the aspect of
    ``height x width`` and resized to it (bicubic), as the release prepares its start image.

    Only data URLs are read: fetching a client's ``https://`` URL would let any client make the server
    reach whatever the URL names. Only PNG, JPEG and WebP (:data:`IMAGE_FORMATS`) are read, and only a
    picture whose header declares at most :data:`MAX_IMAGE_AREA` times the frame's pixels (and whose resize
    before the crop stays within that): the header is read first, so a decompression bomb costs nothing.
    Blocking (a large picture takes a while): the server calls it on a worker thread. ProtocolError
    ``invalid_field`` naming the problem otherwise.
    """
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    payload = check_image_url(url)
    limit = MAX_IMAGE_AREA * height * width
    try:
        data = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as picture:
            declared_width, declared_height = picture.size  # the header's: no pixel has been decoded yet
            if declared_width * declared_height > limit:
                raise _image_refusal(f"declares {declared_width}x{declared_height} pixels; at most {limit} pixels "
                                     f"({MAX_IMAGE_AREA} times the {width}x{height} frame) are read: scale it down")
            cover_width, cover_height = _cover_size(declared_width, declared_height, height, width)
            if cover_width * cover_height > limit:
                raise _image_refusal(f"of {declared_width}x{declared_height} pixels would be resized to "
                                     f"{cover_width}x{cover_height} pixels before its crop to the {width}x{height} "
                                     f"frame; at most {limit} pixels are: crop it closer to the frame's aspect")
            picture = picture.convert("RGB")
    except ProtocolError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # the warning, where warnings raise
        raise _image_refusal(f"declares more pixels than can be read; at most {limit} pixels are") from None
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as error:
        raise _image_refusal(f"is not a readable image ({', '.join(IMAGE_FORMATS)}): {error}") from None
    return _fit(np.asarray(picture, dtype=np.uint8), height, width)


def _fit(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``image`` (``u8[h, w, 3]``) center-cropped to the aspect of ``height x width`` and resized to it (bicubic)."""
    from PIL import Image

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"a start image must be uint8[h, w, 3], got {image.dtype}{list(image.shape)}")
    picture = Image.fromarray(image)
    resized = picture.resize(_cover_size(picture.width, picture.height, height, width), Image.Resampling.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)), dtype=np.uint8)


def camera_mouse(rotation: tuple[float, float, float, float] | None) -> tuple[float, float]:
    """``(pitch_up, yaw_right)`` radians of one frame's camera rotation (a Unity quaternion ``x, y, z, w``).

    Matrix-Game's mouse row is ``[pitch, yaw]``: its camera keys send ``0.1`` for up or right
    (:data:`MATRIX_GAME_CAMERA_STEP`), which a client sends as a rotation of 0.1 rad per frame.
    Unity turns right about +Y and looks down about +X, hence the sign of the pitch.
    """
    if rotation is None:
        return 0.0, 0.0
    x, y, z, w = rotation
    norm = math.sqrt(x * x + y * y + z * z + w * w)
    if norm == 0:
        return 0.0, 0.0
    x, y, z, w = x / norm, y / norm, z / norm, w / norm
    yaw = math.atan2(2 * (w * y + x * z), 1 - 2 * (x * x + y * y))
    pitch_down = math.asin(max(-1.0, min(1.0, 2 * (w * x - y * z))))
    return -pitch_down, yaw


@dataclasses.dataclass(frozen=True)
class EventUpdate:
    """What one accepted interaction changes: the event's prompt and controls, and the fields they occupy."""

    prompt: str | None
    controls: tuple[ARDiffusionControlInput, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        return ((PROMPT_FIELD,) if self.prompt is not None else ()) + tuple(c.track for c in self.controls)


@dataclasses.dataclass(frozen=True)
class ServedWorld:
    """The model-specific half of the server (see the module docstring).

    Attributes:
      name: reported as ``config.model``.
      kind: ``"sprite"`` or ``"latent"``.
      frame_height, frame_width: native frame size in pixels.
      frames_per_chunk: frames per AR block (one chunk on the wire).
      fps: default playback rate written into the media.
      latent_channels: channels of the latent output (``"latent"`` worlds).
      first_chunk_frames: frames of a session's first chunk when it differs (``"wan"``: the
        VAE turns the first latent frame into one video frame); 0: ``frames_per_chunk``.
      keyboard_dim: keys per keyboard row (``"matrix-game"``: 4 universal, 2 GTA driving, 7 Temple Run).
      mouse: whether the world takes a mouse row (``"matrix-game"``; Temple Run does not).
      start_image: the picture a ``"matrix-game"`` session starts from when ``session.start`` has no
        ``image_reference`` (``u8[frame_height, frame_width, 3]``); without it a start must bring one.
    """

    name: str
    kind: str
    frame_height: int
    frame_width: int
    frames_per_chunk: int
    fps: int = 10
    latent_channels: int = 3
    first_chunk_frames: int = 0
    keyboard_dim: int = 0
    mouse: bool = False
    start_image: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in WORLD_KINDS:
            raise ValueError(f"ServedWorld kind must be one of {WORLD_KINDS}, got {self.kind!r}")
        for field in ("frame_height", "frame_width", "frames_per_chunk", "fps", "latent_channels"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ServedWorld {field} must be a positive integer, got {value!r}")
        if isinstance(self.first_chunk_frames, bool) or not isinstance(self.first_chunk_frames, int) \
                or self.first_chunk_frames < 0:
            raise ValueError(f"ServedWorld first_chunk_frames must be a non-negative integer, got "
                             f"{self.first_chunk_frames!r}")
        if self.fps > MAX_FPS:
            raise ValueError(f"ServedWorld fps must be at most {MAX_FPS}, got {self.fps!r}")
        if self.kind == "matrix-game" and (isinstance(self.keyboard_dim, bool) or not isinstance(
                self.keyboard_dim, int) or not 1 <= self.keyboard_dim <= 9):
            raise ValueError(f"ServedWorld keyboard_dim of a matrix-game world must be an integer in [1, 9], got "
                             f"{self.keyboard_dim!r}")
        if self.start_image is not None and (self.start_image.dtype != np.uint8 or self.start_image.shape != (
                self.frame_height, self.frame_width, 3)):
            raise ValueError(f"ServedWorld start_image must be uint8[{self.frame_height}, {self.frame_width}, 3], "
                             f"got {self.start_image.dtype}{list(self.start_image.shape)}")

    @classmethod
    def for_pipeline(cls, pipeline: Any, *, name: str | None = None, fps: int | None = None,
                     start_image: np.ndarray | None = None) -> ServedWorld:
        """The served world of a :class:`~ardiff_jax.models.SpriteWorldPipeline`, a
        :class:`~ardiff_jax.models.WorldPipeline`, a :class:`~ardiff_jax.models.wan.CausalWanPipeline`
        (with a VAE and a text encoder) or a :class:`~ardiff_jax.models.matrix_game.MatrixGamePipeline`
        (with a VAE and an image encoder; ``start_image``, any size, is center-cropped and resized to
        the model's frames); TypeError for any other pipeline. ``fps`` defaults to the model's rate
        (25 for Matrix-Game, 16 for Wan, 10 otherwise)."""
        from ardiff_jax.models import SpriteWorldPipeline, WorldPipeline
        from ardiff_jax.models.matrix_game import MATRIX_GAME_FPS, MatrixGamePipeline
        from ardiff_jax.models.wan import VIDEO_FPS, CausalWanPipeline

        config = getattr(pipeline, "config", None)
        if isinstance(pipeline, MatrixGamePipeline):
            if pipeline.vae is None or getattr(pipeline, "image_encoder", None) is None:
                raise TypeError("a served MatrixGamePipeline needs vae= (players see video) and image_encoder= "
                                "(a session starts from a picture)")
            spatial, temporal = pipeline.vae.config.spatial_factor, pipeline.vae.config.temporal_factor
            f, height, width = config.frames_per_block, config.latent_height * spatial, config.latent_width * spatial
            if start_image is not None:
                start_image = _fit(np.asarray(start_image), height, width)
            return cls(name=name or config.name, kind="matrix-game", frame_height=height, frame_width=width,
                       frames_per_chunk=temporal * f, first_chunk_frames=1 + temporal * (f - 1),
                       fps=MATRIX_GAME_FPS if fps is None else fps, keyboard_dim=config.action.keyboard_dim,
                       mouse=config.action.mouse_dim > 0, start_image=start_image)
        if isinstance(pipeline, CausalWanPipeline):
            if pipeline.vae is None or pipeline.text_encoder is None:
                raise TypeError("a served CausalWanPipeline needs vae= (players see video) and text_encoder= "
                                "(players send text prompts)")
            spatial, temporal = pipeline.vae.config.spatial_factor, pipeline.vae.config.temporal_factor
            f = config.frames_per_block
            return cls(name=name or config.name, kind="wan", frame_height=config.latent_height * spatial,
                       frame_width=config.latent_width * spatial, frames_per_chunk=temporal * f,
                       first_chunk_frames=1 + temporal * (f - 1), fps=VIDEO_FPS if fps is None else fps)
        fps = 10 if fps is None else fps
        if isinstance(pipeline, SpriteWorldPipeline):
            return cls(name=name or config.name, kind="sprite", frame_height=config.latent_height,
                       frame_width=config.latent_width, frames_per_chunk=config.frames_per_block, fps=fps)
        if isinstance(pipeline, WorldPipeline):
            return cls(name=name or config.name, kind="latent", frame_height=config.latent_height,
                       frame_width=config.latent_width, frames_per_chunk=config.frames_per_block, fps=fps,
                       latent_channels=config.latent_channels)
        raise TypeError(f"ServedWorld serves a SpriteWorldPipeline, a WorldPipeline or a CausalWanPipeline, got "
                        f"{type(pipeline).__name__}")

    # -- what the world accepts -------------------------------------------------------------------
    @property
    def text_conditioned(self) -> bool:
        return self.kind in ("latent", "wan")

    def chunk_frames(self, chunk_index: int) -> int:
        """Frames chunk ``chunk_index`` (0-based, per session) carries."""
        return self.first_chunk_frames if chunk_index == 0 and self.first_chunk_frames else self.frames_per_chunk

    @property
    def controls(self) -> tuple[str, ...]:
        """Interaction fields the world acts on: ``"prompt"``, ``"camera"``, ``"action"``."""
        if self.kind == "matrix-game":
            return ("camera", "action") if self.camera_modes else ("action",)
        return ("camera", "action") if self.kind == "sprite" else ("prompt",)

    @property
    def action_values(self) -> tuple[str, ...]:
        """Action names (``multi_modal_data.action.value``); a Matrix-Game world with several keys per row also
        takes held keys joined by ``+`` (``"forward+left"``)."""
        if self.kind == "sprite":
            return tuple(ACTION_NAMES)
        if self.kind == "matrix-game":
            keys = self.key_names
            if self.keyboard_dim == 7:
                return keys
            return ("no-op",) + keys + (("steer-left", "steer-right") if self.keyboard_dim == 2 else ())
        return ()

    @property
    def key_names(self) -> tuple[str, ...]:
        """A Matrix-Game world's keys in keyboard-row order: the published variant's, else ``key-1`` ... (a test
        network of another width; the page binds them to the digit keys)."""
        return MATRIX_GAME_KEYS.get(self.keyboard_dim) or tuple(f"key-{i + 1}" for i in range(self.keyboard_dim))

    @property
    def camera_modes(self) -> tuple[str, ...]:
        if self.kind == "sprite":
            return ("velocity", "target")
        return ("velocity",) if self.kind == "matrix-game" and self.mouse else ()

    @property
    def key_bindings(self) -> dict[str, str]:
        """Browser key codes -> action names (the page joins held keys with ``+``)."""
        if self.kind == "sprite":
            return {"ArrowUp": "up", "KeyW": "up", "ArrowDown": "down", "KeyS": "down", "ArrowLeft": "left",
                    "KeyA": "left", "ArrowRight": "right", "KeyD": "right"}
        if self.kind == "matrix-game":
            return dict(MATRIX_GAME_BINDINGS.get(self.keyboard_dim) or {
                f"Digit{index + 1}": name for index, name in enumerate(self.key_names)})
        return {}

    def plan_start(self, start: SessionStart, *, decode_image: bool = True) -> StartPlan:
        """``start`` checked against this world, defaults filled in; ProtocolError ``invalid_field`` otherwise.

        ``decode_image=False`` leaves a Matrix-Game start picture undecoded (its data URL's form and size
        checked, nothing more) in ``plan.image_url``, for :meth:`decode_start_image`: the server admits the
        start first and decodes the picture off its event loop.
        """
        if self.text_conditioned and not (start.prompt and start.prompt.strip()):
            raise ProtocolError("invalid_field", f"prompt is required by {self.name} (a text-conditioned world), "
                                                 f"got {start.prompt!r}")
        scales = []
        for field, native, value in (("width", self.frame_width, start.width),
                                     ("height", self.frame_height, start.height)):
            if value is None:
                continue
            if value % native or not 1 <= value // native <= MAX_SCALE:
                raise ProtocolError("invalid_field", f"{field} must be a multiple of the native {field} {native} "
                                                     f"up to {native * MAX_SCALE}, got {value}")
            scales.append(value // native)
        if len(set(scales)) > 1:
            raise ProtocolError("invalid_field", f"width {start.width} and height {start.height} must scale the "
                                                 f"native {self.frame_width}x{self.frame_height} frames by the same "
                                                 "factor")
        scale = scales[0] if scales else 1
        ignored = start.ignored_fields + (("prompt",) if start.prompt is not None and not self.text_conditioned
                                          else ())
        image, pending = None, None
        if self.kind == "matrix-game":
            if start.image_url is not None:
                check_image_url(start.image_url)
                if decode_image:
                    image = decode_image_url(start.image_url, self.frame_height, self.frame_width)
                else:
                    pending = start.image_url
            elif self.start_image is not None:
                image = self.start_image
            else:
                raise ProtocolError("invalid_field", f"{self.name} starts from a picture: give image_reference "
                                                     '{"image_url": "data:image/png;base64,..."} (this server has no '
                                                     "default start image)")
        elif start.image_url is not None:
            ignored += ("image_reference",)
        return StartPlan(
            format=start.format if start.format in FORMATS else FORMATS[0],
            seed=secrets.randbelow(2**31) if start.seed is None else start.seed,
            prompt=start.prompt if self.text_conditioned else None,
            num_frames=start.num_frames, scale=scale, width=self.frame_width * scale,
            height=self.frame_height * scale, fps=self.fps if start.fps is None else start.fps,
            ignored_fields=ignored, image=image, image_url=pending)

    def decode_start_image(self, plan: StartPlan) -> StartPlan:
        """``plan`` with its pending start picture (``plan.image_url``) decoded into ``plan.image`` (see
        :func:`decode_image_url`; blocking: the server calls it on a worker thread); ``plan`` itself when none is
        pending. ProtocolError ``invalid_field`` when the picture cannot or may not be read."""
        if plan.image_url is None:
            return plan
        image = decode_image_url(plan.image_url, self.frame_height, self.frame_width)
        return dataclasses.replace(plan, image=image, image_url=None)

    def config(self, plan: StartPlan) -> dict[str, Any]:
        """``video.start.config``: the accepted configuration, the controls and the action values."""
        config: dict[str, Any] = {
            "model": self.name, "format": plan.format, "width": plan.width, "height": plan.height,
            "fps": plan.fps, "frames_per_chunk": self.frames_per_chunk, "num_frames": plan.num_frames,
            "seed": plan.seed, "prompt": plan.prompt, "controls": list(self.controls),
            "actions": list(self.action_values), "ignored_fields": list(plan.ignored_fields),
        }
        config["camera_modes"] = list(self.camera_modes)
        if self.kind == "sprite":
            config["camera_velocity_actions"] = {"+x": "right", "-x": "left", "+z": "up", "-z": "down",
                                                 "zero": "no-op"}
            config["camera_target"] = {"x": "column from the left", "z": "row from the bottom", "unit": "cell",
                                       "grid": [self.frame_height // CELL_SIZE, self.frame_width // CELL_SIZE],
                                       "default_transition_chunks": DEFAULT_TRANSITION_CHUNKS}
        config["key_bindings"] = self.key_bindings
        if self.kind == "matrix-game":
            config["mouse_look"] = self.mouse  # the page locks the pointer and sends its motion as camera velocity
            config["camera_step"] = MATRIX_GAME_CAMERA_STEP
            config["combine_keys"] = self.keyboard_dim != 7  # held keys join with "+"; Temple Run takes one
        return config

    def event_update(self, interaction: SessionInteraction) -> EventUpdate:
        """The prompt and controls ``interaction`` becomes; ProtocolError ``interaction_rejected`` when this
        world cannot apply it (the message says why)."""
        def reject(message: str) -> ProtocolError:
            return ProtocolError("interaction_rejected", message, event_id=interaction.event_id)

        if interaction.unsupported_modalities:
            raise reject(f"{self.name} does not accept multi_modal_data "
                         f"{', '.join(repr(m) for m in interaction.unsupported_modalities)}; it accepts "
                         f"{', '.join(self.controls)}")
        prompt = interaction.prompt
        if prompt is not None and not self.text_conditioned:
            raise reject(f"{self.name} is not text-conditioned: prompt updates are not supported")
        if prompt is not None and not prompt.strip():
            raise reject("event.prompt must not be blank")
        if self.kind in ("latent", "wan") and (interaction.camera is not None or interaction.action is not None):
            raise reject(f"{self.name} has no camera or action controls; it accepts prompt updates only")
        if self.kind == "matrix-game":
            return self._matrix_game_update(interaction, reject)
        controls: tuple[ARDiffusionControlInput, ...] = ()
        if interaction.camera is not None and interaction.action is not None:
            raise reject("give multi_modal_data.camera or multi_modal_data.action, not both: both set the action")
        if interaction.camera is not None and interaction.camera.mode == "target":
            x, _, z = interaction.camera.translation
            rows, cols = self.frame_height // CELL_SIZE, self.frame_width // CELL_SIZE
            cell = (min(rows - 1, max(0, rows - 1 - round(z))), min(cols - 1, max(0, round(x))))
            chunks = interaction.transition_chunks or DEFAULT_TRANSITION_CHUNKS
            # The event's wire id makes two equal targets two moves (each starts its own transition).
            controls = (ARDiffusionControlInput(ACTION_TRACK, TARGET_SCHEMA, {
                "row": cell[0], "col": cell[1], "transition_chunks": chunks, "event": interaction.event_id}),)
        elif interaction.camera is not None:
            controls = (self._action_control(camera_action(interaction.camera.translation)),)
        elif interaction.action is not None:
            if interaction.action not in ACTION_NAMES:
                raise reject(f"unknown action {interaction.action[:40]!r}; choose from {', '.join(ACTION_NAMES)}")
            controls = (self._action_control(interaction.action),)
        if prompt is None and not controls:
            raise reject("the event changes nothing: give a prompt or multi_modal_data")
        return EventUpdate(prompt=prompt, controls=controls)

    def _matrix_game_update(self, interaction: SessionInteraction, reject: Any) -> EventUpdate:
        """Keys (an action, or a velocity camera's translation) and the mouse (a velocity camera's rotation)."""
        keys: tuple[str, ...] | None = None
        mouse: tuple[float, float] | None = None
        if interaction.action is not None:
            names = () if interaction.action == "no-op" else tuple(interaction.action.split("+"))
            allowed = set(self.action_values) - {"no-op"}
            if any(name not in allowed for name in names) or len(set(names)) != len(names) or (
                    self.keyboard_dim == 7 and len(names) > 1):
                how = "one of" if self.keyboard_dim == 7 else "no-op, or held keys joined by '+' from"
                raise reject(f"unknown action {interaction.action[:60]!r}; give {how} "
                             f"{', '.join(sorted(allowed))}")
            steer = [n for n in names if n.startswith("steer-")]
            keys = tuple(n for n in names if not n.startswith("steer-"))
            if steer:  # GTA driving steers with the mouse yaw, as the release's A and D keys do
                mouse = (0.0, sum(MATRIX_GAME_CAMERA_STEP * (1 if n == "steer-right" else -1) for n in steer))
        if interaction.camera is not None:
            if not self.camera_modes:
                raise reject(f"{self.name} has no camera (no mouse input); it accepts actions only")
            if interaction.camera.mode != "velocity":
                raise reject(f"{self.name} supports camera mode 'velocity' only (a turn rate per frame), got "
                             f"{interaction.camera.mode!r}")
            if interaction.action is not None:
                raise reject("give multi_modal_data.camera or multi_modal_data.action, not both")
            x, _, z = interaction.camera.translation
            moving = tuple(name for name, on in (("forward", z > 0), ("back", z < 0), ("left", x < 0),
                                                 ("right", x > 0)) if on and name in self.action_values)
            # A turn alone (rotation, no translation) leaves the held keys as they are: mouse-look while walking.
            if any((x, z)) or interaction.camera.rotation is None:
                keys = moving
            mouse = camera_mouse(interaction.camera.rotation)
            if self.keyboard_dim == 2 and x and interaction.camera.rotation is None:
                mouse = (0.0, MATRIX_GAME_CAMERA_STEP * (1 if x > 0 else -1))
        controls: list[ARDiffusionControlInput] = []
        if keys is not None:
            controls.append(ARDiffusionControlInput(KEYBOARD_TRACK, "keys", {"keys": list(keys)}))
        if mouse is not None and self.mouse:
            controls.append(ARDiffusionControlInput(MOUSE_TRACK, "pitch_yaw", {"pitch": mouse[0], "yaw": mouse[1]}))
        if interaction.prompt is not None or not controls:
            raise reject(f"{self.name} takes keys and the camera, no prompt" if interaction.prompt is not None
                         else "the event changes nothing: give multi_modal_data")
        return EventUpdate(prompt=None, controls=tuple(controls))

    def _matrix_game_inputs(self, tick: ARDiffusionTickRequest, plan: StartPlan) -> dict[str, Any]:
        rows = self.chunk_frames(tick.chunk_index)
        names = self.key_names
        keyboard = np.zeros((rows, self.keyboard_dim), np.float32)
        mouse = np.zeros((rows, 2), np.float32)
        held: list[str] = []
        for control in tick.controls:
            if control.track == KEYBOARD_TRACK:
                held = list(control.data["keys"])
            elif control.track == MOUSE_TRACK:
                mouse[:] = (control.data["pitch"], control.data["yaw"])
        if self.keyboard_dim == 7:  # one-hot, index 0 being no key
            keyboard[:, names.index(held[0]) if held else 0] = 1.0
        else:
            for name in held:
                keyboard[:, names.index(name)] = 1.0
        inputs: dict[str, Any] = {"keyboard": keyboard}
        if self.mouse:
            inputs["mouse"] = mouse
        if tick.chunk_index == 0:
            inputs["image"] = plan.image
            inputs["seed"] = plan.seed
        return inputs

    @staticmethod
    def _action_control(name: str) -> ARDiffusionControlInput:
        return ARDiffusionControlInput(ACTION_TRACK, ACTION_SCHEMA, {"value": name})

    # -- driving the pipeline ---------------------------------------------------------------------
    def inputs(self, tick: ARDiffusionTickRequest, plan: StartPlan,
               state: dict[str, Any] | None = None) -> Mapping[str, Any]:
        """The pipeline inputs of ``tick`` (the first chunk's observation is rebuilt from the seed).

        ``state`` is the session's world state (a dict the server keeps per session, filled by
        :meth:`observe`): a ``target`` camera move reads the last frame the player saw from it and
        remembers in it where its transition began. Without it a target move starts from the
        session's first observation.
        """
        if self.kind == "matrix-game":
            return self._matrix_game_inputs(tick, plan)
        inputs: dict[str, Any] = {}
        state = {} if state is None else state
        if tick.chunk_index == 0:
            inputs["seed"] = plan.seed
        if self.kind == "sprite":
            observation = SpriteWorld(plan.seed, size=self.frame_height).reset() if tick.chunk_index == 0 else None
            control = next((c for c in tick.controls if c.track == ACTION_TRACK), None)
            if control is not None and control.schema == TARGET_SCHEMA:
                data = control.data
                move = (data["event"], data["row"], data["col"])
                if state.get("move") != move:
                    state["move"], state["move_start"] = move, tick.chunk_index
                left = state["move_start"] + int(data["transition_chunks"]) - tick.chunk_index
                seen = state.get("last_frame", observation)
                if seen is None:
                    seen = SpriteWorld(plan.seed, size=self.frame_height).reset()
                inputs["actions"] = target_actions(seen, (int(data["row"]), int(data["col"])),
                                                   self.frames_per_chunk, left)
            else:
                action = "no-op" if control is None else control.data["value"]
                inputs["actions"] = np.full(self.frames_per_chunk, ACTION_NAMES.index(action), np.int64)
            if observation is not None:
                inputs["observation"] = observation
        return inputs

    def observe(self, state: dict[str, Any], frames: np.ndarray) -> None:
        """Remember what the player was sent last (``frames``, this world's :meth:`frames` of a chunk) in ``state``."""
        if self.kind == "sprite" and len(frames):
            state["last_frame"] = frames[-1]

    def prompt(self, tick: ARDiffusionTickRequest, plan: StartPlan) -> str | None:
        """The tick's prompt (the session's start prompt until an event changes it); ``None`` for sprite worlds."""
        if not self.text_conditioned:
            return None
        return tick.prompt if tick.prompt is not None else plan.prompt

    def frames(self, output: Any) -> np.ndarray:
        """``u8[f, H, W, 3]``: the viewable frames of one chunk's output (blocking: may wait for the device)."""
        if self.kind == "sprite":
            frames = np.asarray(output.frames)
        elif self.kind in ("wan", "matrix-game"):
            frames = np.asarray(output.video)
        else:
            latents = np.asarray(output.latents, np.float32)  # f32[f, C, H, W]
            channels = latents[:, :3] if latents.shape[1] >= 3 else np.repeat(latents[:, :1], 3, axis=1)
            frames = np.clip((channels + 1.0) * 127.5, 0, 255).round().astype(np.uint8).transpose(0, 2, 3, 1)
        if frames.dtype != np.uint8 or frames.shape[1:] != (self.frame_height, self.frame_width, 3):
            raise ValueError(f"{self.name} output frames must be uint8[f, {self.frame_height}, {self.frame_width}, 3], "
                             f"got {frames.dtype}{list(frames.shape)}")
        return np.ascontiguousarray(frames)
