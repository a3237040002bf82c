"""The robot-policy server (openpi / RoboArena policy protocol) over a fake policy.

The codec is tested as pure functions first (bit-exact against openpi's own msgpack-numpy encoding, written out
here from the wire format, and every refusal with its message); then real clients (``PolicyClient``, a
``websockets`` sync client, and raw frames) talk to ``create_policy_app`` on uvicorn on a loopback port. The fake
policy records every call, so "changes nothing" is checked as "the policy saw no call". Nothing here waits on
the wall clock: the batching test holds the first batch on an event until the other robots' requests are queued.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

import msgpack
import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("websockets")

import httpx
import uvicorn
from websockets.exceptions import ConnectionClosed, InvalidStatus

from ardiff_jax.serve import (
    PolicyClient,
    PolicyLimits,
    PolicyMessageError,
    PolicyServerConfig,
    PolicyServerError,
    ServerAccess,
    create_policy_app,
    pack_policy_message as pack,
    unpack_policy_message as unpack,
)
from ardiff_jax.serve._access import bearer_or_token
from ardiff_jax.serve._policy import RESET_REPLY, TRANSPORT_MAX_BYTES

KEY = "robot-Key_0123456789"
H, W = 180, 320
ACTION_HORIZON = 24
#: Small enough that an oversize message and an oversize array are cheap to send; one observation fits.
LIMITS = PolicyLimits(max_message_bytes=1_500_000, max_array_bytes=400_000)


def wait_for(condition: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:g} s"
        time.sleep(0.01)


# -- openpi's msgpack-numpy, written out from the wire format: the reference the codec must match ---------------


def openpi_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def openpi_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def openpi_pack(obj: Any) -> bytes:
    return msgpack.Packer(default=openpi_default).pack(obj)


def openpi_unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=openpi_hook)


def observation(*, session_id: str | None = "episode-1", prompt: str = "put the cup in the sink", seed: int = 0,
                endpoint: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A DROID observation as RoboArena's client sends it."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {
        "observation/exterior_image_0_left": rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        "observation/exterior_image_1_left": rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(7),
        "observation/cartesian_position": rng.standard_normal(6),
        "observation/gripper_position": rng.random(1),
        "prompt": prompt,
    }
    if session_id is not None:
        obs["session_id"] = session_id
    if endpoint is not None:
        obs["endpoint"] = endpoint
    obs.update(overrides)
    return obs


def expected_action(obs: dict[str, Any], episode: int) -> np.ndarray:
    """The fake policy's deterministic action chunk: depends on the state, the images and the episode count."""
    state = np.asarray(obs["observation/joint_position"], np.float64)
    base = np.arange(ACTION_HORIZON * 8, dtype=np.float32).reshape(ACTION_HORIZON, 8) / 7.0
    pixels = float(obs["observation/wrist_image_left"][0, 0, 0])
    return (base + np.float32(state.sum()) + np.float32(pixels) + np.float32(episode)).astype(np.float32)


class FakePolicy:
    """Records each call (``events``: ``(name, key)``) and each batch's keys; a DROID-shaped ``validate``.

    ``infer_batch`` fails one robot when its prompt is ``"fail"`` (a per-item Exception) and the whole call when
    one prompt is ``"explode"``; with ``gate`` set, the first call waits on it (``entered`` says it began)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.batches: list[list[str]] = []
        self.episodes: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.validated = 0

    def validate(self, session_key: str, obs: dict[str, Any]) -> None:
        self.validated += 1
        for name in ("observation/exterior_image_0_left", "observation/exterior_image_1_left",
                     "observation/wrist_image_left"):
            image = obs.get(name)
            if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.shape[-3:] != (H, W, 3):
                raise ValueError(f"{name} must be uint8 (H, W, 3) of {H} x {W}")
        state = obs.get("observation/joint_position")
        if not isinstance(state, np.ndarray) or state.shape != (7,):
            raise ValueError("observation/joint_position must be an array of shape (7,)")
        if not np.all(np.isfinite(state)):
            raise ValueError("observation/joint_position holds NaN or infinity")

    def infer_batch(self, items: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        self.batches.append([key for key, _ in items])
        self.events.extend(("infer", key) for key, _ in items)
        if self.gate is not None and len(self.batches) == 1:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        if any(obs["prompt"] == "explode" for _, obs in items):
            raise RuntimeError("the engine tick failed")
        return [RuntimeError("arm out of reach") if obs["prompt"] == "fail"
                else expected_action(obs, self.episodes.get(key, 0)) for key, obs in items]

    def reset(self, session_key: str) -> None:
        self.events.append(("reset", session_key))
        self.episodes[session_key] = self.episodes.get(session_key, 0) + 1

    def close(self, session_key: str) -> None:
        self.events.append(("close", session_key))

    def calls(self, key: str) -> list[str]:
        return [name for name, k in self.events if k == key]


class LivePolicyServer:
    """``create_policy_app(policy, ...)`` on uvicorn in a thread on a loopback port."""

    def __init__(self, policy: FakePolicy, **app_kwargs: Any) -> None:
        self.policy = policy
        app_kwargs.setdefault("limits", LIMITS)
        # as TRANSPORT_MAX_BYTES is to the default limits: a frame past the message limit is still read and answered
        self.ws_max_size = 2 * app_kwargs["limits"].max_message_bytes
        self.app = create_policy_app(policy, name="fake", **app_kwargs)
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        self.url = f"ws://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_config=None, log_level="warning",
                                                     proxy_headers=False, ws_max_size=self.ws_max_size,
                                                     timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, 30, "uvicorn's start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        if self.policy.gate is not None:
            self.policy.gate.set()
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not shut down"

    def client(self, **kwargs: Any) -> PolicyClient:
        return self.stack.enter_context(PolicyClient(self.url, timeout_s=30, ping_interval=None, **kwargs))

    @property
    def dispatcher(self) -> Any:
        return self.app.state.dispatcher


@pytest.fixture
def live() -> Iterator[LivePolicyServer]:
    with LivePolicyServer(FakePolicy()) as server:
        yield server


# -- the codec (pure) ----------------------------------------------------------------------------------------


def test_the_codec_writes_openpis_bytes_and_reads_them_back_bit_exact():
    obs = observation()
    obs["scalars"] = [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(7)]
    obs["video"] = np.arange(2 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 4, 5, 3)
    obs["empty"] = np.zeros((0, 8), np.float16)
    obs["zero_d"] = np.array(2.5)
    wire = pack(obs)
    assert wire == openpi_pack(obs)  # byte for byte what openpi's Packer writes
    for decoded in (unpack(wire), unpack(openpi_pack(obs))):
        assert decoded.keys() == obs.keys()
        for name, value in obs.items():
            if isinstance(value, np.ndarray):
                assert decoded[name].dtype == value.dtype and decoded[name].shape == value.shape
                assert decoded[name].tobytes() == value.tobytes(), name
            elif name == "scalars":
                assert [type(v) for v in decoded[name]] == [type(v) for v in value] and decoded[name] == value
            else:
                assert decoded[name] == value
    # openpi's client reads what the server writes (an action chunk) back bit-exact
    action = expected_action(obs, 0)
    assert openpi_unpack(pack(action)).tobytes() == action.tobytes()
    # a non-contiguous array is written in C order
    transposed = np.arange(12, dtype=np.int32).reshape(3, 4).T
    np.testing.assert_array_equal(unpack(pack({"a": transposed}))["a"], transposed)


@pytest.mark.parametrize("dtype", [np.complex64, object])
def test_pack_refuses_dtypes_msgpack_numpy_does_not_carry(dtype):
    with pytest.raises(TypeError, match="dtype"):
        pack({"a": np.zeros(2, dtype)})


def array_map(data: bytes, dtype: Any, shape: Any, **extra: Any) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape, **extra}


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


REFUSED = {
    "garbage bytes": (b"\xc1\x00garbage", "not msgpack"),
    "truncated": (pack({"a": np.zeros(10, np.float32)})[:-3], "not msgpack"),
    "trailing bytes": (pack({"a": 1}) + b"\x00", "bytes follow"),
    "a list": (pack([1, 2, 3]), "must be a map (an observation dict), got a list"),
    "an array at the top": (pack(np.zeros(3)), "must be a map"),
    "an integer key": (msgpack.packb({1: 2}), "not msgpack"),
    "a bytes key": (msgpack.packb({b"k": 2}), "keys must be strings"),
    "short data": (msgpack.packb({"a": array_map(b"abc", "<f4", [1])}), "3 data bytes for shape (1,)"),
    "long data": (msgpack.packb({"a": array_map(b"\x00" * 8, "<f4", [1])}), "8 data bytes for shape (1,)"),
    "missing shape": (msgpack.packb({"a": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4"}}), "bad array map"),
    "extra key": (msgpack.packb({"a": array_map(b"", "<f4", [0], x=1)}), "bad array map"),
    "shape not a list": (msgpack.packb({"a": array_map(b"", "<f4", "abc")}), "shape must be a list"),
    "negative shape": (msgpack.packb({"a": array_map(b"", "<f4", [-1])}), "shape must be a list of non-negative"),
    "data not bytes": (msgpack.packb({"a": array_map("abcd", "<f4", [1])}), "data must be bytes"),
    "object dtype": (msgpack.packb({"a": array_map(b"\x00" * 8, "|O", [1])}), "dtype '|O' is not allowed"),
    "complex dtype": (msgpack.packb({"a": array_map(b"\x00" * 8, "<c8", [1])}), "dtype '<c8' is not allowed"),
    "void dtype": (msgpack.packb({"a": array_map(b"\x00" * 4, "|V4", [1])}), "dtype '|V4' is not allowed"),
    "big endian": (msgpack.packb({"a": array_map(b"\x00" * 4, ">f4", [1])}), "dtype '>f4' is not allowed"),
    "a string dtype": (msgpack.packb({"a": array_map(b"\x00" * 4, "<U1", [1])}), "dtype '<U1' is not allowed"),
    "too many dims": (pack({"a": np.zeros((1,) * 7, np.uint8)}), "7 dimensions; at most 6"),
    "a huge shape": (msgpack.packb({"a": array_map(b"", "<f4", [2**40, 2**40])}), "bytes; at most 33554432"),
    "a zero huge shape": (msgpack.packb({"a": array_map(b"", "<f4", [0, 2**63])}), "bad array map: shape"),
    "scalar overflow": (msgpack.packb({"a": {b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}}),
                        "300 is not a uint8"),
    "scalar object dtype": (msgpack.packb({"a": {b"__npgeneric__": True, b"data": 1, b"dtype": "|O"}}),
                            "not allowed"),
    "deep nesting": (pack({"a": nested(20)}), "deeper than 8 levels"),
    "deeper than msgpack's stack": (b"\x91" * 3000 + b"\xc0", "deeper than 8 levels"),
    "a long list": (pack({"a": list(range(2000))}), "a list of 2000 entries; at most 1024"),
    "many entries": (pack({"a": [list(range(1000)) for _ in range(20)]}), "more than 16384"),
    "a long string": (pack({"prompt": "x" * 70_000}), "a string of 70000 bytes; at most 65536"),
    "an extension type": (msgpack.packb({"a": msgpack.ExtType(1, b"x")}), "extension type"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unpack_refuses_anything_else_with_a_clear_message(case):
    data, message = REFUSED[case]
    with pytest.raises(PolicyMessageError, match=_escaped(message)):
        unpack(data)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_unpack_holds_the_size_limits():
    data = pack({"a": np.zeros(500_000, np.uint8)})
    with pytest.raises(PolicyMessageError, match=r"message of \d+ bytes; at most 100000"):
        unpack(data, PolicyLimits(max_message_bytes=100_000))
    with pytest.raises(PolicyMessageError, match="array data.* of 500000 bytes; at most 1000"):
        unpack(data, PolicyLimits(max_array_bytes=1000))
    # the shape's size is checked before its data: a map declaring more than the limit, data or not
    declared = msgpack.packb({"a": array_map(b"", "<f8", [1000, 1000])})
    with pytest.raises(PolicyMessageError, match=r"is 8000000 bytes; at most 1000"):
        unpack(declared, PolicyLimits(max_array_bytes=1000))
    assert unpack(data, PolicyLimits(max_array_bytes=500_000))["a"].nbytes == 500_000
    with pytest.raises(ValueError, match="max_depth"):
        PolicyLimits(max_depth=0)


def test_the_config_goes_on_the_wire_as_roboarena_reads_it():
    wire = openpi_unpack(pack(PolicyServerConfig().as_wire()))
    assert wire == {"image_resolution": [180, 320], "needs_wrist_camera": True, "n_external_cameras": 2,
                    "needs_stereo_camera": False, "needs_session_id": True, "action_space": "joint_position"}
    with pytest.raises(ValueError, match="image_resolution"):
        PolicyServerConfig(image_resolution=(180,))
    with pytest.raises(TypeError, match="needs_wrist_camera"):
        PolicyServerConfig(needs_wrist_camera=1)


def test_the_key_may_come_as_openpis_api_key_header():
    assert bearer_or_token({"authorization": f"Api-Key {KEY}"}, {}) == KEY
    assert bearer_or_token({"authorization": f"api-key  {KEY} "}, {}) == KEY
    assert bearer_or_token({"authorization": f"Bearer {KEY}"}, {}) == KEY
    assert bearer_or_token({"authorization": f"Basic {KEY}"}, {}) is None
    assert bearer_or_token({"authorization": "Api-Key "}, {"token": "t"}) == "t"


def test_create_policy_app_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"a callable validate\(\) \(see RobotPolicy\)"):
        create_policy_app(object())
    with pytest.raises(TypeError, match="config must be a PolicyServerConfig"):
        create_policy_app(FakePolicy(), config={"image_resolution": [1, 1]})
    with pytest.raises(ValueError, match="max_batch_size"):
        create_policy_app(FakePolicy(), max_batch_size=0)


# -- a real server -------------------------------------------------------------------------------------------


def test_config_on_connect_then_an_inference_round_trips_bit_exact(live):
    robot = live.client()
    assert robot.server_config == PolicyServerConfig().as_wire()
    obs = observation()
    action = robot.infer(obs)
    assert isinstance(action, np.ndarray) and action.dtype == np.float32 and action.shape == (ACTION_HORIZON, 8)
    assert action.tobytes() == expected_action(obs, 0).tobytes()
    assert live.policy.calls("robot-1") == ["infer"]  # the first session_id starts the first episode: no reset
    health = httpx.get(f"http://127.0.0.1:{live.port}/healthz", timeout=10).json()
    assert health == {"status": "ok", "model": "fake", "robots": 1, "batches": 1, "largest_batch": 1,
                      "connected_robots": [{"robot": "robot-1", "session_id": "episode-1", "inferences": 1,
                                            "viewers": 0}],
                      "config": PolicyServerConfig().as_wire()}


def test_reset_answers_reset_successful_and_a_message_without_endpoint_infers(live):
    robot = live.client()
    obs = observation(endpoint="infer")
    assert robot.infer(obs).tobytes() == expected_action(obs, 0).tobytes()
    assert robot.reset() == RESET_REPLY
    assert live.policy.calls("robot-1") == ["infer", "reset"]
    # openpi's client sends no endpoint: an inference, in the episode the reset started
    no_endpoint = observation(seed=1)
    assert "endpoint" not in no_endpoint
    assert robot.infer(no_endpoint).tobytes() == expected_action(no_endpoint, 1).tobytes()
    # the raw frame of a reset is text, as RoboArena's client compares it
    assert robot.send_raw(pack({"endpoint": "reset"})) == "reset successful"
    assert live.policy.calls("robot-1") == ["infer", "reset", "infer", "reset"]


def test_a_new_session_id_resets_before_its_inference_and_the_same_one_does_not(live):
    robot = live.client()
    robot.infer(observation(session_id="episode-1"))
    robot.infer(observation(session_id="episode-1", seed=1))
    robot.infer(observation(session_id=None, seed=2))  # no session_id: the episode goes on
    obs = observation(session_id="episode-2", seed=3)
    assert robot.infer(obs).tobytes() == expected_action(obs, 1).tobytes()  # served in the new episode
    assert live.policy.calls("robot-1") == ["infer", "infer", "infer", "reset", "infer"]
    # a reset naming a new session_id resets once, and the id is taken: its first inference resets nothing
    assert robot.reset({"session_id": "episode-3"}) == RESET_REPLY
    robot.infer(observation(session_id="episode-3"))
    assert live.policy.calls("robot-1")[5:] == ["reset", "infer"]


def malformed_frames(seed: int) -> dict[str, tuple[bytes | str, str]]:
    """Each malformed frame, and what its error text must say; each carries a new session_id where it can."""
    good = observation(session_id="episode-NEW", seed=seed)
    nan_state = dict(good, **{"observation/joint_position": np.full(7, np.nan)})
    wrong_dtype = dict(good, **{"observation/wrist_image_left": good["observation/wrist_image_left"].astype(np.float16)})
    complex_map = msgpack.packb({**{k: v for k, v in good.items() if not isinstance(v, np.ndarray)},
                                 "observation/joint_position": array_map(b"\x00" * 56, "<c8", [7])})
    bad_map = msgpack.packb({"session_id": "episode-NEW", "observation/joint_position": array_map(b"\x00", "<f8", [7])})
    oversize_array = dict(good, **{"observation/extra": np.zeros(450_000, np.uint8)})
    oversize_message = dict(good, **{f"observation/extra_{i}": np.zeros(300_000, np.uint8) for i in range(4)})
    wrong_shape = dict(good, **{"observation/joint_position": np.zeros(6)})
    missing = {k: v for k, v in good.items() if k != "observation/wrist_image_left"}
    return {
        "garbage bytes": (b"\xc1not msgpack at all", "invalid message: message is not msgpack"),
        "msgpack of a list": (pack([good["prompt"]]), "invalid message: message must be a map"),
        "a bad ndarray map": (bad_map, "invalid message: bad array map: 1 data bytes for shape (7,)"),
        "a complex dtype": (complex_map, "invalid message: dtype '<c8' is not allowed"),
        "an image of the wrong dtype": (pack(wrong_dtype), "invalid observation: observation/wrist_image_left"),
        "a state of the wrong shape": (pack(wrong_shape), "invalid observation: observation/joint_position must"),
        "a missing camera": (pack(missing), "invalid observation: observation/wrist_image_left"),
        "an oversize array": (pack(oversize_array), "invalid message: message holds a bytes value (array data) of "
                                                    "450000 bytes; at most 400000"),
        "an oversize message": (pack(oversize_message), "invalid message: message of"),
        "a NaN state": (pack(nan_state), "invalid observation: observation/joint_position holds NaN"),
        "an unknown endpoint": (pack(dict(good, endpoint="dance")), "invalid message: endpoint must be 'infer' or 'reset', got 'dance'"),
        "a session_id not a string": (pack(dict(good, session_id=7)), "invalid message: session_id must be a non-empty string"),
        "a text frame": ("{\"endpoint\": \"infer\"}", "invalid message: a text frame"),
    }


def test_malformed_messages_get_a_text_error_and_change_nothing(live):
    robot = live.client()
    obs = observation(session_id="episode-1")
    first = robot.infer(obs)
    assert first.tobytes() == expected_action(obs, 0).tobytes()
    for case, (frame, message) in malformed_frames(seed=5).items():
        reply = robot.send_raw(frame)
        assert isinstance(reply, str) and reply.startswith(message), (case, reply)
        # the policy saw neither an inference nor a reset (its session_id was new), and the connection serves on
        # in the same episode: the same observation gives the same action, bit for bit
        assert live.policy.calls("robot-1") == ["infer"], case
        assert robot.infer(obs).tobytes() == first.tobytes(), case
        assert live.policy.calls("robot-1") == ["infer", "infer"], case
        live.policy.events.clear()
        live.policy.events.append(("infer", "robot-1"))
    # openpi's client raises RuntimeError with the server's text
    with pytest.raises(RuntimeError, match="holds NaN"):
        robot.infer(dict(obs, **{"observation/joint_position": np.full(7, np.nan)}))


def test_a_message_past_the_transport_limit_closes_only_that_connection(live):
    """Past uvicorn's ``ws_max_size`` (``TRANSPORT_MAX_BYTES`` under the default limits) the transport refuses the
    frame itself (1009): that robot's connection ends and its key is closed; another robot keeps being served."""
    assert TRANSPORT_MAX_BYTES > PolicyLimits().max_message_bytes
    other = live.client()
    robot = live.client()
    other.infer(observation())
    with pytest.raises(ConnectionClosed):
        robot.send_raw(b"\x00" * (live.ws_max_size + 1))
    wait_for(lambda: ("close", "robot-2") in live.policy.events, 20, "robot-2 closed")
    obs = observation(seed=3)
    assert other.infer(obs).tobytes() == expected_action(obs, 0).tobytes()
    assert live.policy.calls("robot-2") == ["close"]


def gated(live: LivePolicyServer) -> threading.Event:
    live.policy.gate = threading.Event()
    return live.policy.gate


def test_concurrent_robots_are_served_in_one_batched_call(live):
    gate = gated(live)
    robots = [live.client() for _ in range(3)]
    observations = [observation(seed=i, session_id=f"episode-{i}") for i in range(3)]
    robots[0].connection.send(pack(observations[0]))
    assert live.policy.entered.wait(30)  # robot-1's batch runs on the policy thread, held at the gate
    for robot, obs in zip(robots[1:], observations[1:]):
        robot.connection.send(pack(obs))
    wait_for(lambda: live.dispatcher.pending() == 2, 20, "two requests queued behind the running batch")
    gate.set()
    for robot, obs in zip(robots, observations):
        reply = robot.connection.recv(timeout=30)
        assert openpi_unpack(reply).tobytes() == expected_action(obs, 0).tobytes()
    # (the queued two in whichever order the server read them)
    assert [sorted(batch) for batch in live.policy.batches] == [["robot-1"], ["robot-2", "robot-3"]]
    assert live.dispatcher.largest_batch == 2


def test_one_robots_failure_reaches_only_that_robot(live):
    gate = gated(live)
    robots = [live.client() for _ in range(3)]
    robots[0].connection.send(pack(observation(seed=0)))
    assert live.policy.entered.wait(30)
    failing, fine = observation(seed=1, prompt="fail"), observation(seed=2)
    robots[1].connection.send(pack(failing))
    robots[2].connection.send(pack(fine))
    wait_for(lambda: live.dispatcher.pending() == 2, 20, "two requests queued")
    gate.set()
    assert isinstance(robots[0].connection.recv(timeout=30), bytes)
    assert robots[1].connection.recv(timeout=30) == "inference failed: RuntimeError: arm out of reach"
    assert openpi_unpack(robots[2].connection.recv(timeout=30)).tobytes() == expected_action(fine, 0).tobytes()
    assert sorted(live.policy.batches[1]) == ["robot-2", "robot-3"]  # one batch: the failure was that item's alone
    # the failed robot's connection serves on
    again = observation(seed=4)
    assert robots[1].infer(again).tobytes() == expected_action(again, 0).tobytes()
    # a whole tick that raises tells each robot in it; every connection stays usable
    with pytest.raises(PolicyServerError, match="inference failed: RuntimeError: the engine tick failed"):
        robots[2].infer(observation(prompt="explode"))
    assert robots[2].infer(again).tobytes() == expected_action(again, 0).tobytes()


class WrongCountPolicy(FakePolicy):
    def infer_batch(self, items):
        super().infer_batch(items)
        return []


class UnpackablePolicy(FakePolicy):
    def infer_batch(self, items):
        super().infer_batch(items)
        return [object() for _ in items]


@pytest.mark.parametrize("policy, message", [
    (WrongCountPolicy(), "inference failed: RuntimeError: the policy returned 0 results for 1 observations"),
    (UnpackablePolicy(), "inference failed: the policy's result cannot be sent: TypeError: cannot pack a object"),
])
def test_a_policy_result_the_server_cannot_send_is_an_error_for_that_robot(policy, message):
    with LivePolicyServer(policy) as live:
        robot = live.client()
        with pytest.raises(PolicyServerError) as error:
            robot.infer(observation())
        assert str(error.value) == message
        assert robot.reset() == RESET_REPLY  # the connection serves on


def test_a_robot_that_disconnects_mid_inference_is_closed_after_it_and_others_never_notice(live):
    gate = gated(live)
    first, leaving, third = live.client(), live.client(), live.client()
    first.connection.send(pack(observation(seed=0)))
    assert live.policy.entered.wait(30)
    leaving.connection.send(pack(observation(seed=1)))
    wait_for(lambda: live.dispatcher.pending() == 1, 20, "the leaving robot's request queued")
    leaving.close()
    gate.set()
    assert isinstance(first.connection.recv(timeout=30), bytes)
    wait_for(lambda: ("close", "robot-2") in live.policy.events, 20, "robot-2 closed")
    assert live.policy.calls("robot-2") == ["infer", "close"]  # its close comes after its last call
    obs = observation(seed=2)
    assert third.infer(obs).tobytes() == expected_action(obs, 0).tobytes()
    assert first.infer(obs).tobytes() == expected_action(obs, 0).tobytes()
    assert "close" not in live.policy.calls("robot-1") + live.policy.calls("robot-3")


def test_a_disconnect_closes_the_connections_key(live):
    robot = live.client()
    robot.infer(observation())
    idle = live.client()  # connected, never sent anything
    robot.close()
    idle.close()
    wait_for(lambda: live.policy.calls("robot-1") == ["infer", "close"] and live.policy.calls("robot-2") == ["close"],
             20, "both keys closed")
    wait_for(lambda: not live.app.state.robots, 20, "no robot connected")


def test_the_api_key_is_required_when_configured():
    policy = FakePolicy()
    with LivePolicyServer(policy, access=ServerAccess(api_key=KEY)) as live:
        for kwargs in ({}, {"api_key": KEY[:-1] + "x"}, {"additional_headers": {"Authorization": "Bearer nope"}}):
            with pytest.raises(InvalidStatus) as refused:
                PolicyClient(live.url, timeout_s=10, **kwargs)
            assert refused.value.response.status_code == 401
            assert refused.value.response.body.decode() == "unauthorized"
        assert policy.events == [] and policy.validated == 0  # refused before any key was given out
        # openpi's spelling, Authorization: Api-Key <key>
        obs = observation()
        assert live.client(api_key=KEY).infer(obs).tobytes() == expected_action(obs, 0).tobytes()
        with PolicyClient(f"{live.url}/?token={KEY}", timeout_s=10) as by_token:
            assert by_token.reset() == RESET_REPLY


def test_a_foreign_origin_is_refused():
    policy = FakePolicy()
    with LivePolicyServer(policy, access=ServerAccess(allowed_origins=("http://lab.example",))) as live:
        for origin in ("http://evil.example", f"http://127.0.0.1:{live.port + 1}", "null"):
            with pytest.raises(InvalidStatus) as refused:
                PolicyClient(live.url, timeout_s=10, origin=origin)
            assert refused.value.response.status_code == 403
        assert policy.events == []
        for origin in (live.origin, "http://lab.example", None):  # same origin, allow-listed, not a browser
            assert live.client(origin=origin).reset() == RESET_REPLY


def test_connections_per_client_address_are_limited():
    with LivePolicyServer(FakePolicy(), access=ServerAccess(max_connections_per_client=2)) as live:
        first, second = live.client(), live.client()
        with pytest.raises(InvalidStatus) as refused:
            PolicyClient(live.url, timeout_s=10)
        assert refused.value.response.status_code == 429
        second.close()
        wait_for(lambda: len(live.app.state.robots) == 1, 20, "the closed connection released")
        assert live.client().reset() == RESET_REPLY
        assert first.reset() == RESET_REPLY


class FlakyResetPolicy(FakePolicy):
    """Its first reset raises."""

    def reset(self, session_key: str) -> None:
        if not any(name == "reset-failed" for name, _ in self.events):
            self.events.append(("reset-failed", session_key))
            raise RuntimeError("the engine is busy")
        super().reset(session_key)


def test_a_failed_reset_is_reported_and_the_new_session_id_resets_again_on_retry():
    with LivePolicyServer(FlakyResetPolicy()) as live:
        robot = live.client()
        robot.infer(observation(session_id="episode-1"))
        new = observation(session_id="episode-2", seed=1)
        with pytest.raises(PolicyServerError, match="reset failed: RuntimeError: the engine is busy"):
            robot.infer(new)
        assert live.policy.calls("robot-1") == ["infer", "reset-failed"]  # no inference without its reset
        assert robot.infer(new).tobytes() == expected_action(new, 1).tobytes()  # the retry resets, then infers
        assert live.policy.calls("robot-1") == ["infer", "reset-failed", "reset", "infer"]


def test_max_batch_size_caps_the_robots_per_call():
    with LivePolicyServer(FakePolicy(), max_batch_size=2) as live:
        gate = gated(live)
        robots = [live.client() for _ in range(4)]
        robots[0].connection.send(pack(observation(seed=0)))
        assert live.policy.entered.wait(30)
        for robot in robots[1:]:
            robot.connection.send(pack(observation(seed=1)))
        wait_for(lambda: live.dispatcher.pending() == 3, 20, "three requests queued")
        gate.set()
        for robot in robots:
            assert isinstance(robot.connection.recv(timeout=30), bytes)
        assert [len(batch) for batch in live.policy.batches] == [1, 2, 1]


class BuggyValidatePolicy(FakePolicy):
    def validate(self, session_key: str, obs: dict[str, Any]) -> None:
        raise KeyError("observation/joint_position")


def test_a_validate_that_raises_something_else_is_reported_and_the_connection_serves_on():
    with LivePolicyServer(BuggyValidatePolicy()) as live:
        robot = live.client()
        with pytest.raises(PolicyServerError, match="invalid observation: the policy's check failed: KeyError"):
            robot.infer(observation())
        assert robot.reset() == RESET_REPLY  # a reset is not validated; the connection is still served
        assert live.policy.calls("robot-1") == ["reset"]
