"""The DROID robot's side of DreamZero: observation transforms, normalisation, and the policy through the engine.

The transforms are checked against torch's own operations (the release's eval transform is torchvision's
``CenterCrop`` then ``Resize(bilinear, antialias=True)`` on ``[0, 1]`` tensors, back to ``uint8`` by
truncation), the layout against the release's tiling rule; the policy runs two robots through one engine
with random small encoders (``build_robot_policy``: the path, not the model's quality).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from ardiff_jax import EngineConfig
from ardiff_jax.models.dreamzero import (
    NEGATIVE_PROMPT,
    DroidStatistics,
    FrameBuffer,
    actions_to_targets,
    build_robot_policy,
    droid_prompt,
    normalize_state,
    prepare_views,
    tile_views,
)

VIEWS = ("observation/exterior_image_0_left", "observation/exterior_image_1_left", "observation/wrist_image_left")


def test_a_view_is_cropped_and_resized_as_the_releases_eval_transform() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 180, 320, 3), dtype=np.uint8)
    ours = prepare_views(frames)
    # torchvision CenterCrop((171, 304)): top round(4.5) = 4, left 8; Resize((176, 320), bilinear, antialias).
    tensor = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255
    tensor = torch.nn.functional.interpolate(tensor[:, :, 4:175, 8:312], size=(176, 320), mode="bilinear",
                                             antialias=True, align_corners=False)
    reference = (tensor.permute(0, 2, 3, 1) * 255).to(torch.uint8).numpy()
    difference = np.abs(ours.astype(int) - reference.astype(int))
    # float32 rounding can move a value across an integer before the truncation: at most 1 level, rarely.
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3


def test_the_canvas_puts_the_wrist_view_widened_on_top_and_the_exteriors_below() -> None:
    left, right, wrist = (np.full((2, 4, 6, 3), value, np.uint8) for value in (10, 20, 30))
    wrist[:, :, 1] = 31  # a column that must appear twice, side by side
    canvas = tile_views(left, right, wrist)
    assert canvas.shape == (2, 8, 12, 3)
    assert (canvas[:, :4, 2:4] == 31).all() and (canvas[:, :4, :2] == 30).all()
    assert (canvas[:, 4:, :6] == 10).all() and (canvas[:, 4:, 6:] == 20).all()


def test_frames_per_call_follow_the_release_server() -> None:
    """The first call uses one frame; later calls the last 4, padded with the first when fewer arrived."""
    buffer = FrameBuffer()
    buffer.add(np.full((1, 2, 2, 3), 0, np.uint8))
    assert buffer.take().shape[0] == 1
    buffer.add(np.stack([np.full((2, 2, 3), v, np.uint8) for v in (1, 2)]))
    assert [int(f[0, 0, 0]) for f in buffer.take()] == [0, 0, 1, 2]
    buffer.add(np.stack([np.full((2, 2, 3), v, np.uint8) for v in (3, 4, 5, 6, 7)]))
    assert [int(f[0, 0, 0]) for f in buffer.take()] == [4, 5, 6, 7]


def test_state_and_actions_are_normalised_as_the_release() -> None:
    stats = DroidStatistics.stand_in()
    joint, gripper = np.array([0.0, 1.0, -1.0, 4.0, -4.0, 0.5, 3.0]), np.array([0.25])
    state = normalize_state(stats, joint, gripper)
    assert state.shape == (64,) and not state[8:].any()
    np.testing.assert_allclose(state[:7], np.clip(2 * (joint + np.pi) / (2 * np.pi) - 1, -1, 1), rtol=1e-6)
    np.testing.assert_allclose(state[7], 2 * 0.25 - 1)
    actions = np.zeros((24, 32), np.float32)
    actions[:, 0] = 1.0  # the q99 end of the first joint's delta
    targets = actions_to_targets(stats, actions, joint)
    assert targets.shape == (24, 8) and targets.dtype == np.float32
    np.testing.assert_allclose(targets[:, 0], joint[0] + 0.25, rtol=1e-6)  # relative: added to the state
    np.testing.assert_allclose(targets[:, 1:7], np.broadcast_to(joint[1:7], (24, 6)), atol=1e-6)
    np.testing.assert_allclose(targets[:, 7], 0.5)  # absolute gripper: the middle of [0, 1]


def test_the_prompt_template_is_droids() -> None:
    text = droid_prompt("Put the Marker in the cup.")
    assert text.startswith("A multi-view video shows that a robot put the marker in the cup. The video is split "
                           "into three views:") and text.endswith("The robot put the marker in the cup.")
    assert NEGATIVE_PROMPT.startswith("Vibrant colors, overexposed")


@pytest.fixture(scope="module")
def policy():
    return build_robot_policy(engine_config=EngineConfig(dtype="float32", available_memory_bytes=10**10,
                                                         gpu_memory_fraction=1.0, warmup=False))


def _observation(rng: np.random.Generator, frames: int, prompt: str = "pick up the cup") -> dict:
    obs = {key: rng.integers(0, 256, (frames, 180, 320, 3), dtype=np.uint8) for key in VIEWS}
    obs["observation/joint_position"] = rng.uniform(-1, 1, 7)
    obs["observation/gripper_position"] = rng.uniform(0, 1, 1)
    obs["prompt"] = prompt
    return obs


def test_two_robots_are_served_together_through_a_whole_episode_and_its_restart(policy) -> None:
    rng = np.random.default_rng(1)
    frames_seen = []
    for call in range(5):
        out = policy.infer_batch([("r1", _observation(rng, 1 if call == 0 else 4)),
                                  ("r2", _observation(rng, 1 if call == 0 else 2))])
        assert all(isinstance(o, np.ndarray) and o.shape == (24, 8) and o.dtype == np.float32 for o in out), out
        frames_seen.append(policy.pipeline._sessions["r1"].frames)
    assert frames_seen == [1, 3, 5, 7, 1]  # the fifth call restarts from its last frame, as the release does
    policy.reset("r1")
    policy.reset("r2")


def test_a_bad_observation_fails_its_robot_only_and_changes_nothing(policy) -> None:
    rng = np.random.default_rng(2)
    policy.infer_batch([("good", _observation(rng, 1)), ("bad", _observation(rng, 1))])
    before = policy.pipeline._sessions["good"], policy.pipeline._sessions["bad"]
    broken = _observation(rng, 4)
    broken["observation/joint_position"] = np.full(7, np.nan)
    cases = [broken, {**_observation(rng, 4), VIEWS[0]: np.zeros((4, 180, 320), np.uint8)},
             {**_observation(rng, 4), "prompt": ""}, {k: v for k, v in _observation(rng, 4).items() if k != VIEWS[2]}]
    for case in cases:
        out = policy.infer_batch([("good", _observation(rng, 4)), ("bad", case)])
        assert isinstance(out[0], np.ndarray) and isinstance(out[1], ValueError), out
        assert policy.pipeline._sessions["bad"] is before[1]  # the bad robot's episode is untouched
    for key in ("good", "bad"):
        policy.reset(key)


def test_a_later_call_encodes_its_frames_with_the_programs_the_episode_start_compiled(policy) -> None:
    """The VAE encodes through its own per-chunk programs (weights an argument): a later call's 9 frames are chunked
    1, 4, 4 like the episode start's 33, so they compile no encode program. One jit around the whole encode made a
    program per clip length, with the VAE weights baked in as constants."""
    import jax

    from ardiff_jax._compile_events import count_compiles

    jax.clear_caches()  # what earlier tests compiled must not hide a per-length program
    rng = np.random.default_rng(3)
    with count_compiles() as started:
        policy.infer_batch([("encoder", _observation(rng, 1))])
    assert "jit(_encode_step_split)" in {program.name for program in started}
    with count_compiles() as later:
        policy.infer_batch([("encoder", _observation(rng, 4))])
    made = {program.name for program in later}
    assert not made & {"jit(_encode_step_split)", "jit(<lambda>)"}, made
    policy.reset("encoder")


@contextlib.contextmanager
def serving(policy, access):
    """``create_policy_app(policy)`` on uvicorn in a thread on a free loopback port; yields the port."""
    import socket
    import threading
    import time

    uvicorn = pytest.importorskip("uvicorn")
    from ardiff_jax.serve import POLICY_TRANSPORT_MAX_BYTES, PolicyServerConfig, create_policy_app

    app = create_policy_app(policy, config=PolicyServerConfig(), access=access, name="dreamzero-test")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", proxy_headers=False,
                                          ws_max_size=POLICY_TRANSPORT_MAX_BYTES))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_robots_drive_the_policy_over_the_openpi_protocol(policy) -> None:
    """Two RoboArena-style clients on the policy server (``serve --model dreamzero``'s app): the config on connect,
    ``(24, 8)`` float32 joint targets per inference, a malformed message answered with an error while the robot's
    episode goes on, a reset, and concurrent robots served in batched ticks."""
    import threading

    from ardiff_jax.serve import PolicyClient, ServerAccess

    with serving(policy, ServerAccess()) as port:
        results: dict[str, list] = {}

        def robot(name: str, seed: int) -> None:
            rng = np.random.default_rng(seed)
            with PolicyClient(f"ws://127.0.0.1:{port}", timeout_s=300) as client:
                assert client.server_config["image_resolution"] == [180, 320]
                assert client.server_config["n_external_cameras"] == 2
                replies = []
                for call in range(3):
                    obs = {**_observation(rng, 1 if call == 0 else 4), "session_id": f"{name}-episode"}
                    replies.append(client.infer(obs))
                    if call == 1:  # a malformed message: an error for this robot, its episode goes on
                        with pytest.raises(RuntimeError, match="observation/joint_position"):
                            client.infer({**obs, "observation/joint_position": np.full(7, np.nan)})
                assert client.reset() == "reset successful"
                results[name] = replies

        threads = [threading.Thread(target=robot, args=(name, seed)) for seed, name in enumerate(("a", "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert sorted(results) == ["a", "b"]
        for replies in results.values():
            assert all(isinstance(r, np.ndarray) and r.shape == (24, 8) and r.dtype == np.float32 for r in replies)


@pytest.mark.parametrize("argv, message", [
    (["--model", "dreamzero"], "give --checkpoint"),
    (["--model", "dreamzero", "--random-weights", "--preset", "wan-tiny"], "dreamzero-tiny"),
    (["--model", "dreamzero", "--random-weights", "--variant", "universal"], "takes --checkpoint"),
    (["--model", "wan", "--random-weights", "--checkpoint", "."], "are for --model dreamzero"),
])
def test_serve_dreamzero_checks_its_arguments_before_any_work(argv, message, capsys, monkeypatch) -> None:
    from ardiff_jax import cli
    from ardiff_jax import serve

    monkeypatch.setattr(serve, "build_dreamzero_app", lambda *a, **k: pytest.fail("built before refusing"))
    assert cli.main(["serve", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_serve_dreamzero_serves_a_robot_from_the_command_line(tmp_path) -> None:
    """``ardiff-jax serve --model dreamzero --random-weights`` (the tiny preset): a robot connects, gets its config
    and a (24, 8) reply; Ctrl-C ends it cleanly."""
    import os
    import signal
    import subprocess
    import sys

    from ardiff_jax.serve import PolicyClient

    process = subprocess.Popen([sys.executable, "-m", "ardiff_jax.cli", "serve", "--model", "dreamzero",
                                "--random-weights", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = process.stdout.readline()
        assert line.startswith("serving DreamZero robot policies (dreamzero-tiny"), line
        url = line.split(" on ")[1].split()[0]
        with PolicyClient(url, timeout_s=300) as client:
            assert client.server_config["action_space"] == "joint_position"
            reply = client.infer({**_observation(np.random.default_rng(0), 1), "session_id": "one"})
        assert reply.shape == (24, 8) and reply.dtype == np.float32
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_openpis_own_client_drives_dreamzero_and_gets_what_the_engine_gives_directly(policy) -> None:
    """openpi's ``WebsocketClientPolicy`` (the client robot teams use, ``openpi-client``) against the DreamZero
    policy server: an episode of several calls whose actions equal the same policy called directly, a session-id
    change that starts a new episode, and its API key header.

    The direct calls go to the served policy itself under a key of their own (``"direct"``; the server's robots are
    ``"robot-<n>"``), so its engine's sessions are the only difference: a second, identically built policy would
    trace and compile every program again for the same numbers."""
    websocket_client_policy = pytest.importorskip("openpi_client.websocket_client_policy")
    from ardiff_jax.serve import ServerAccess

    with serving(policy, ServerAccess(api_key="k" * 24)) as port:
        client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port, api_key="k" * 24)
        assert client.get_server_metadata()["needs_session_id"] is True
        rng = np.random.default_rng(7)
        calls = [(_observation(rng, 1 if call in (0, 3) else 4), "first" if call < 3 else "second")
                 for call in range(5)]
        for call, (obs, episode) in enumerate(calls):
            served = client.infer({**obs, "session_id": episode})
            if call == 3:  # a new session_id: the server resets the robot, so the direct one starts over too
                policy.reset("direct")
            expected = policy.infer_batch([("direct", obs)])[0]
            assert isinstance(served, np.ndarray) and served.shape == (24, 8)
            np.testing.assert_array_equal(served, expected)
    policy.reset("direct")
