"""Matrix-Game 2.0 on the causal Wan transformer: the released formats load, and the cached rollout is the network.

The reference is independent of our code (``tests/matrix_game_reference.py``): diffusers'
``WanTransformer3DModel`` with a 36-channel-style input and image-token context, a dense
block-causal frame mask in every self-attention, and a dense torch ``ActionModule`` (written
from the release's behaviour) inserted after the cross-attention of the first blocks. Its
random weights are written in both released formats (the original ``model.``-prefixed
safetensors and FastVideo's diffusers directory), loaded by ``load_checkpoint``, and our
block-by-block rollout (main K/V history handed in, action keys/values in the session's ring)
must equal the dense whole-sequence pass frame for frame.
"""

from __future__ import annotations

import contextlib
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from matrix_game_reference import (
    ReferenceActionModule,
    frame_visibility,
    matrix_game_hooks,
)

from ardiff_jax.models import DenseAttention, dit_preset
from ardiff_jax.models._dit import (
    ActionInputs,
    ActionKV,
    action_cache_nbytes,
    action_history_mask,
    commit_action_cache,
    init_action_cache,
)
from ardiff_jax.models.matrix_game import action_windows
from ardiff_jax.models.wan import (
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    wan_names,
)

CONFIG = dit_preset("matrix-game-tiny", dtype="float32", param_dtype="float32")
ACTION = CONFIG.action
TOKENS = CONFIG.tokens_per_frame
BLOCKS = 3  # 9 latent frames: with a 4-frame window, blocks 1 and 2 see one history frame
FRAMES = BLOCKS * CONFIG.frames_per_block
NOISY_T = 713.98  # the last block is noisy; history is clean (t = 0), as after a commit
#: float32 parity bound on outputs up to ~12 (measured 2.2e-6).
EXACT = 2e-5

_TOP = {"img_emb.proj.0": "condition_embedder.image_embedder.norm1",
        "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
        "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
        "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj", "head.head": "proj_out",
        "patch_embedding": "patch_embedding"}
_BLOCK = {"norm3": "norm2", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
for _wan, _diff in (("self_attn", "attn1"), ("cross_attn", "attn2")):
    _BLOCK.update({f"{_wan}.{a}": f"{_diff}.{b}" for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"),
                                                             ("o", "to_out.0"), ("norm_q", "norm_q"),
                                                             ("norm_k", "norm_k"))})


def release_to_diffusers(name: str) -> str:
    """The original (release) name of a tensor -> FastVideo's diffusers name (action modules unchanged)."""
    if name == "head.modulation":
        return "scale_shift_table"
    if ".action_model." in name:
        return name
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        if rest == "modulation":
            return f"blocks.{index}.scale_shift_table"
        module, _, leaf = rest.rpartition(".")
        return f"blocks.{index}.{_BLOCK[module]}.{leaf}"
    module, _, leaf = name.rpartition(".")
    return f"{_TOP[module]}.{leaf}"


@contextlib.contextmanager
def float64_timesteps(model):
    """diffusers' timestep sinusoid in float64, as the original Wan (and ours) evaluate it."""
    proj = model.condition_embedder.timesteps_proj
    half = proj.num_channels // 2

    def forward(timesteps):
        freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half)
        angles = timesteps.to(torch.float64)[:, None] * freqs[None]
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(torch.float32)

    proj.forward = forward
    try:
        yield
    finally:
        del proj.forward


def random_rows(gen, count: int, width: int) -> torch.Tensor:
    return torch.randn(count, width, generator=gen)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=CONFIG.num_heads, attention_head_dim=CONFIG.head_dim,
        in_channels=CONFIG.in_channels, out_channels=CONFIG.latent_channels, text_dim=CONFIG.text_dim,
        freq_dim=CONFIG.freq_dim, ffn_dim=CONFIG.ffn_dim, num_layers=CONFIG.num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", image_dim=CONFIG.text_dim, rope_max_seq_len=32).eval()
    rope_split = (ACTION.rope_dim, (ACTION.mouse_head_dim - ACTION.rope_dim) // 2,
                  (ACTION.mouse_head_dim - ACTION.rope_dim) // 2)
    actions = [ReferenceActionModule(CONFIG.dim, ACTION.keyboard_dim, ACTION.mouse_dim, ACTION.heads,
                                     ACTION.keyboard_embed_dim, ACTION.keyboard_hidden_dim, ACTION.mouse_hidden_dim,
                                     rope_split).eval() for _ in range(ACTION.num_blocks)]
    gen = torch.Generator().manual_seed(0)

    def randomise(module):  # norm scales around 1 (the action norms' too: the release ignores them)
        sd = {}
        for name, value in module.state_dict().items():
            noise = torch.randn(value.shape, generator=gen)
            is_scale = ("norm" in name or name.startswith("mouse_mlp.3")) and name.endswith("weight")
            sd[name] = 1.0 + 0.2 * noise if is_scale else 0.3 * noise
        module.load_state_dict(sd)
        return sd

    sd = randomise(model)
    action_sd = [randomise(a) for a in actions]
    release = {name: (action_sd[int(name.split(".")[1])][name.split(".action_model.")[1]] if ".action_model." in name
                      else sd[release_to_diffusers(name)]).clone() for name in wan_names(CONFIG)}

    root = tmp_path_factory.mktemp("matrix_game")
    paths = {"release": root / "base_distill.safetensors"}
    safetensors_torch.save_file({f"model.{k}": v.contiguous() for k, v in release.items()}, str(paths["release"]))
    fastvideo = root / "fastvideo" / "transformer"
    fastvideo.mkdir(parents=True)
    safetensors_torch.save_file({release_to_diffusers(k): v.contiguous() for k, v in release.items()},
                                str(fastvideo / "diffusion_pytorch_model.safetensors"))
    (fastvideo / "config.json").write_text(json.dumps({
        "_class_name": "CausalMatrixGameWanModel", "patch_size": [1, 2, 2], "num_attention_heads": CONFIG.num_heads,
        "attention_head_dim": CONFIG.head_dim, "in_channels": CONFIG.in_channels,
        "out_channels": CONFIG.latent_channels, "num_layers": CONFIG.num_layers, "ffn_dim": CONFIG.ffn_dim,
        "freq_dim": CONFIG.freq_dim, "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True, "eps": 1e-6,
        "image_dim": CONFIG.text_dim, "text_dim": 0, "local_attn_size": 6, "sink_size": 0,
        "action_config": {"keyboard_dim_in": ACTION.keyboard_dim, "enable_mouse": True,
                          "blocks": list(range(ACTION.num_blocks))}}))
    paths["fastvideo"] = root / "fastvideo"

    latents = torch.randn(FRAMES, CONFIG.latent_channels, CONFIG.latent_height, CONFIG.latent_width, generator=gen)
    condition = torch.randn(FRAMES, CONFIG.in_channels - CONFIG.latent_channels, CONFIG.latent_height,
                            CONFIG.latent_width, generator=gen)
    image_tokens = torch.randn(CONFIG.text_len, CONFIG.text_dim, generator=gen)
    rows = ACTION.num_rows(FRAMES)
    keyboards = [random_rows(gen, rows, ACTION.keyboard_dim) for _ in range(2)]
    mice = [0.1 * random_rows(gen, rows, ACTION.mouse_dim) for _ in range(2)]
    times = torch.tensor([0.0] * (FRAMES - 3) + [NOISY_T] * 3)
    visible = frame_visibility(FRAMES, CONFIG.frames_per_block, CONFIG.window_frames)

    def dense(keyboard, mouse, modules=actions):
        hidden = torch.cat([latents, condition], dim=1).permute(1, 0, 2, 3)[None]  # [1, C_in, F, H, W]
        per_token = times.repeat_interleave(TOKENS)[None]
        with torch.no_grad(), float64_timesteps(model), matrix_game_hooks(model, modules, keyboard, mouse, visible,
                                                                          TOKENS):
            out = model(hidden, per_token, torch.zeros(1, 0, CONFIG.text_dim), return_dict=False,
                        encoder_hidden_states_image=image_tokens[None])[0]
        return out[0].permute(1, 0, 2, 3).numpy()  # [F, C, H, W]

    outputs = [dense(k, m) for k, m in zip(keyboards, mice, strict=True)]
    for module, state in zip(actions, action_sd, strict=True):
        module.apply_norm_weight = True
    weighted = dense(keyboards[0], mice[0])
    return types.SimpleNamespace(
        paths=paths, release=release, outputs=outputs, weighted=weighted, latents=latents.numpy(),
        condition=condition.numpy(), image_tokens=image_tokens.numpy(), keyboards=[k.numpy() for k in keyboards],
        mice=[m.numpy() for m in mice], times=times.numpy())


@pytest.fixture(scope="module")
def loaded(ref):
    return load_checkpoint(ref.paths["release"], CONFIG)


def _block_fn(graphdef):
    def run(state, latents, condition, t, start, history_k, history_v, history_mask, image_tokens, actions, ring):
        model = nnx.merge(graphdef, state)
        context = model.text_cross_kv(image_tokens)
        attention = DenseAttention(history_k, history_v, history_mask)
        out = model(latents, t, start, context, attention=attention, condition=condition, actions=actions,
                    action_history=ring)
        return out.video, out.k, out.v, out.action_kv

    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


_RUNS: dict = {}


def rollout(model, ref, keyboard, mouse) -> np.ndarray:
    """Our block-by-block rollout: each block's forward sees the window's history K/V and the action ring;
    committed blocks are run clean at t = 0 (their outputs compared too), the last one noisy."""
    graphdef, state = nnx.split(model)
    fn = _RUNS.setdefault(id(graphdef), _block_fn(graphdef))
    f, window = CONFIG.frames_per_block, CONFIG.window_frames
    history_frames = window - f
    ring = init_action_cache(CONFIG)
    committed_k, committed_v = [], []  # per frame: [L, T, H, D]
    outputs = []
    for block in range(BLOCKS):
        start = block * f
        frames = slice(start, start + f)
        seen = [committed_k[i] for i in range(max(0, start - history_frames), start)]
        pad = history_frames - len(seen)
        zeros = jnp.zeros((CONFIG.num_layers, TOKENS, CONFIG.num_heads, CONFIG.head_dim))
        hist_k = jnp.concatenate([zeros] * pad + seen, axis=1)
        hist_v = jnp.concatenate([zeros] * pad + [committed_v[i] for i in range(max(0, start - history_frames),
                                                                                start)], axis=1)
        mask = jnp.asarray(np.repeat(np.arange(history_frames) >= pad, TOKENS))
        windows = action_windows(CONFIG, keyboard, mouse, start)
        video, k, v, action_kv = fn(state, jnp.asarray(ref.latents[frames]), jnp.asarray(ref.condition[frames]),
                                    jnp.float32(ref.times[start]), jnp.int32(start), hist_k, hist_v, mask,
                                    jnp.asarray(ref.image_tokens), ActionInputs(*map(jnp.asarray, windows)), ring)
        outputs.append(np.asarray(video))
        ring = commit_action_cache(CONFIG, ring, action_kv, jnp.int32(start))
        for i in range(f):
            committed_k.append(k[:, i * TOKENS:(i + 1) * TOKENS])
            committed_v.append(v[:, i * TOKENS:(i + 1) * TOKENS])
    return np.concatenate(outputs)


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def ours(ref, loaded):
    return [rollout(loaded, ref, k, m) for k, m in zip(ref.keyboards, ref.mice, strict=True)]


def test_cached_rollout_equals_the_dense_reference_and_follows_the_actions(ref, ours):
    for mine, theirs in zip(ours, ref.outputs, strict=True):
        assert max_diff(mine, theirs) < EXACT, max_diff(mine, theirs)
    print(f"Matrix-Game cached rollout vs dense torch reference: max |diff| = "
          f"{max(max_diff(m, t) for m, t in zip(ours, ref.outputs, strict=True)):.3g} "
          f"(outputs up to {float(np.abs(ref.outputs[0]).max()):.3g})")
    # Another action sequence gives another video, in both; block 0 reads rows 0-7 only.
    assert max_diff(ours[0], ours[1]) > 1e-2
    assert max_diff(ref.outputs[0], ref.outputs[1]) > 1e-2


def test_the_action_norms_ignore_their_stored_scale_as_the_release_does(ref, ours):
    # Our rollout matches the weight-ignoring reference (above) and differs from one that applies the
    # (non-unit, random) scales: the choice is observable and tested.
    assert max_diff(ours[0], ref.outputs[0]) < EXACT
    assert max_diff(ours[0], ref.weighted) > 1e-3


def test_release_and_fastvideo_formats_load_the_same_parameters(ref, loaded):
    fastvideo = load_checkpoint(ref.paths["fastvideo"], CONFIG)
    flat = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(flat(loaded), flat(fastvideo), strict=True))
    # The first action block's keyboard embedding, transposed as nn.Linear weights are.
    kernel = np.asarray(loaded.action_blocks.keyboard_embed_in.kernel[...])
    np.testing.assert_array_equal(kernel[1], ref.release["blocks.1.action_model.keyboard_embed.0.weight"].numpy().T)


def test_published_shapes_and_names():
    universal = dit_preset("matrix-game-2-universal")
    names = wan_names(universal)
    assert names["patch_embedding.weight"] == (1536, 36, 1, 2, 2)
    assert names["img_emb.proj.0.weight"] == (1280,) and names["img_emb.proj.3.weight"] == (1536, 1280)
    assert names["blocks.14.action_model.mouse_mlp.0.weight"] == (1024, 1560)
    assert names["blocks.14.action_model.keyboard_attn_kv.weight"] == (2048, 1536)
    assert names["blocks.0.action_model.img_attn_q_norm.weight"] == (64,)
    assert "blocks.15.action_model.t_qkv.weight" not in names and "text_embedding.0.weight" not in names
    templerun = wan_names(dit_preset("matrix-game-2-templerun"))
    assert templerun["blocks.0.action_model.keyboard_embed.0.weight"] == (128, 7)
    assert not any(part in n for n in templerun for part in ("mouse_mlp", "t_qkv", "proj_mouse", "img_attn"))
    assert action_cache_nbytes(universal) == 15 * 6 * 2 * (880 * 1024 + 1024) * 2


def test_the_action_ring_shows_the_window_of_the_self_attention():
    # gta-drive: 3-frame blocks, 4 visible frames -> one history frame per block.
    gta = dit_preset("matrix-game-2-gta-drive")
    assert np.asarray(action_history_mask(gta, 0)).tolist() == [False] * 4
    # Block at frame 6: frame 5 visible (slot 1); slots 2, 3 hold frames 2, 3 and slot 0 frame 4: hidden.
    assert np.asarray(action_history_mask(gta, 6)).tolist() == [False, True, False, False]
    universal = dit_preset("matrix-game-2-universal")
    assert np.asarray(action_history_mask(universal, 3)).tolist() == [True, True, True, False, False, False]
    assert np.asarray(action_history_mask(universal, 9)).tolist() == [True, True, True, False, False, False]
    ring = init_action_cache(CONFIG)
    block = ActionKV(*(None if r is None else jnp.ones((r.shape[0], 3, *r.shape[2:])) for r in ring))
    written = commit_action_cache(CONFIG, ring, block, jnp.int32(3))  # frames 3, 4, 5 -> slots 3, 0, 1
    assert np.asarray(written.keyboard_k[0, :, 0, 0]).tolist() == [1, 1, 0, 1]


def test_action_windows_read_the_release_rows():
    rows = np.arange(ACTION.num_rows(6), dtype=np.float32)[:, None] * np.ones((1, ACTION.keyboard_dim))
    first = action_windows(CONFIG, rows, rows[:, :2], 0)
    assert first.keyboard.shape == (3, 12, ACTION.keyboard_dim)
    assert first.keyboard[0, :, 0].tolist() == [0] * 12  # latent 0: rows -12..-1 -> row 0
    assert first.keyboard[2, :, 0].tolist() == [0] * 4 + list(range(8))  # latent 2: rows -4..7
    second = action_windows(CONFIG, rows, rows[:, :2], 3)
    assert second.keyboard[0, :, 0].tolist() == list(range(12))  # latent 3: rows 0..11
    with pytest.raises(ValueError, match="read action rows up to 19"):
        action_windows(CONFIG, rows[:19], rows[:19, :2], 3)


def test_matrix_game_checkpoints_are_refused_with_named_reasons(ref, tmp_path):
    with pytest.raises(CheckpointError, match="matches none of the published ones"):
        checkpoint_config(ref.paths["release"])  # a tiny Matrix-Game: needs config=
    with pytest.raises(CheckpointError, match="action.keyboard_dim = 4 but"):
        load_checkpoint(ref.paths["release"], CONFIG.replace(action=ACTION.__class__(
            **{**ACTION.__dict__, "keyboard_dim": 4})))
    partial = {f"model.{k}": v for k, v in ref.release.items() if "blocks.1.action_model.t_qkv" not in k}
    path = tmp_path / "partial.safetensors"
    safetensors_torch.save_file(partial, str(path))
    with pytest.raises(CheckpointError, match="missing tensors: blocks.1.action_model.t_qkv.weight"):
        load_checkpoint(path, CONFIG)
    no_mouse = CONFIG.replace(action=ACTION.__class__(**{**ACTION.__dict__, "mouse_dim": 0}))
    with pytest.raises(CheckpointError, match="unexpected tensors: .*mouse_mlp"):
        load_checkpoint(ref.paths["release"], no_mouse)
    with pytest.raises(CheckpointError, match="has no action modules, but .* is a Matrix-Game checkpoint"):
        load_checkpoint(ref.paths["release"], CONFIG.replace(action=None, context_embedding="text"))


def test_an_original_wan_directory_with_an_action_config_loads(ref, loaded, tmp_path):
    directory = tmp_path / "wan_dir"
    directory.mkdir()
    safetensors_torch.save_file({k: v.contiguous() for k, v in ref.release.items()},
                                str(directory / "diffusion_pytorch_model.safetensors"))
    config = {"_class_name": "CausalWanModel", "model_type": "i2v", "dim": CONFIG.dim, "ffn_dim": CONFIG.ffn_dim,
              "num_heads": CONFIG.num_heads, "num_layers": CONFIG.num_layers, "in_dim": CONFIG.in_channels,
              "out_dim": CONFIG.latent_channels, "freq_dim": CONFIG.freq_dim, "eps": 1e-6, "text_len": 512,
              "local_attn_size": 4, "sink_size": 0,
              "action_config": {"keyboard_dim_in": ACTION.keyboard_dim, "enable_mouse": True}}
    (directory / "config.json").write_text(json.dumps(config))
    model = load_checkpoint(directory, CONFIG)
    flat = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(flat(loaded), flat(model), strict=True))
    config["action_config"]["keyboard_dim_in"] = 4
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="action_config.keyboard_dim_in = 4 but"):
        load_checkpoint(directory, CONFIG)
    del config["action_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'i2v'"):
        load_checkpoint(directory, CONFIG)
