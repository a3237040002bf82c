"""DreamZero's transformer and checkpoint against the release's own outputs (``tests/fixtures/dreamzero*``).

The fixtures were written by the release's PyTorch code (``dreamzero0/dreamzero`` at ``ab790c1``) on tiny
random DreamZero-DROID networks saved in the release's checkpoint layout; ``tests/fixtures/dreamzero/README.md``
documents every array. Here the checkpoint is loaded as a real one, and every DiT call of the release's 4-call
episode is replayed with its stored inputs through our paged KV pools: the commit passes write both CFG
branches' caches, every denoising evaluation of both branches reads them without writing. Errors cannot
compound in this replay, so each call is compared at float32 (atol 1e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ardiff_jax import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCache
from ardiff_jax.models import ActionStateInputs
from ardiff_jax.models._common import dit_kv_spec
from ardiff_jax.models._dit import CausalDiT
from ardiff_jax.models.dreamzero import CheckpointError, DIT_PREFIX, load_dreamzero
from ardiff_jax.models.wan import _dreamzero as dz_checkpoint
from ardiff_jax.models.wan import wan_names

FIXTURES = Path(__file__).parent / "fixtures"
#: The release's fixture (seed 7, dim 64, 2 heads, 3 layers, hidden 40) and a second one with other sizes
#: (seed 11, dim 128, 4 heads, 2 layers, hidden 56), so nothing here depends on one fixture's sizes.
FIXTURE_DIRS = ["dreamzero", "dreamzero_seed11"]
BRANCHES = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
ATOL = 1e-4


def _run_dit(graphdef, params, latents, t, start, text, image, attention, condition, action_state):
    model = nnx.merge(graphdef, params)
    out = model(latents, t, start, text, image, attention=attention, condition=condition, action_state=action_state)
    return out.video, out.registers, out.k, out.v


#: One program per input shape (a 1-frame commit, a 2-frame commit, a denoising call) and per network.
run_dit = jax.jit(_run_dit, static_argnums=0)


def _cross_kv(graphdef, params, text_pos, text_neg, clip):
    model = nnx.merge(graphdef, params)
    return model.text_cross_kv(text_pos), model.text_cross_kv(text_neg), model.image_cross_kv(clip)


#: Both prompts' and the CLIP tokens' cross-attention K/V in one program per network (as the pipeline jits them;
#: run eagerly, each of their operations was compiled on its own).
cross_kv = jax.jit(_cross_kv, static_argnums=0)


def _teacher_forcing(graphdef, params, like_inference, noisy, clean, t, text, clip, register, condition):
    model = nnx.merge(graphdef, params)
    out = model.forward_teacher_forcing(noisy, clean, t, model.text_cross_kv(text), model.image_cross_kv(clip),
                                        register, condition=condition, state_attends_like_inference=like_inference)
    return out.video, out.registers


#: The whole-sequence forward, one program per network and visibility (eagerly, its hundreds of operations were
#: each compiled on their own).
teacher_forcing = jax.jit(_teacher_forcing, static_argnums=(0, 2))


class Replay:
    """A fixture's network, loaded from its checkpoint, and an episode's caches in our paged KV pools."""

    def __init__(self, name: str, dtype: str = "float32") -> None:
        self.root = FIXTURES / name
        self.ref = dict(np.load(self.root / "reference_rollout.npz"))
        self.model, self.info = load_dreamzero(self.root / "DreamZero-DROID-tiny", dtype=dtype)
        self.config = self.model.config
        self.graphdef, self.params = nnx.split(self.model)
        self.dtype = dtype

    def new_episode(self):
        cfg = self.config
        cross = (ARDiffusionCrossAttentionKVSpec("text", cfg.text_len), ARDiffusionCrossAttentionKVSpec("image", 257))
        spec = dit_kv_spec(cfg, kv_branches=BRANCHES, cross_attention=cross, session_capacity=1, model_owned_bytes=0)
        spec = type(spec)(**{**spec.__dict__, "max_scratch_tokens_per_branch": cfg.action_register.num_tokens})
        cache = ARDiffusionKVCache(spec, dtype=self.dtype, available_memory_bytes=10**10, gpu_memory_fraction=1.0)
        state = cache.create_state("episode")
        text_pos, text_neg, image = cross_kv(self.graphdef, self.params, jnp.asarray(self.ref["context_pos"]),
                                             jnp.asarray(self.ref["context_neg"]), jnp.asarray(self.ref["clip"]))
        for branch, text in (("positive", text_pos), ("negative", text_neg)):
            state.populate_cross_attention(branch, "text", zip(*text, strict=True))
            state.populate_cross_attention(branch, "image", zip(*image, strict=True))
        return cache, state

    def call(self, state, branch, latents, t, start, condition, action_state=None, commit=False):
        cfg = self.config
        seq_len = latents.shape[0] * cfg.tokens_per_frame
        attention = state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit)
        text = state.get_cross_attention_kv(branch, "text")
        image = state.get_cross_attention_kv(branch, "image")
        video, actions, k, v = run_dit(self.graphdef, self.params, jnp.asarray(latents, jnp.float32),
                                       jnp.asarray(t, jnp.float32), jnp.int32(start), (text.k, text.v),
                                       (image.k, image.v), attention, jnp.asarray(condition, jnp.float32),
                                       action_state)
        state.commit_paged_context(branch, kv=(k, v) if commit else None)
        return np.asarray(video), None if actions is None else np.asarray(actions)

    def commit(self, state, chunk):
        """Chunk ``chunk``'s commit pass on both branches: ``flow [2 branches, f, C, H, W]``."""
        ref = self.ref
        ys = ref["ys"]
        start = int(ref["commit_start_frame"][chunk])
        if chunk == 0:
            latents, condition = ys[0:1, 4:], ys[0:1]
        else:
            latents, condition = ref["obs_latents"][chunk - 1], ys[start: start + 2]
        flows = [self.call(state, branch, latents, np.zeros(len(latents)), start, condition, commit=True)[0]
                 for branch in ("positive", "negative")]
        return np.stack(flows)

    def evaluate(self, state, chunk, evaluation, step=None):
        """One denoising evaluation of both branches with the stored inputs: ``((video pos, neg), (action pos, neg))``."""
        ref = self.ref
        step = int(ref["eval_step"][evaluation]) if step is None else step
        t = np.float32(ref["timesteps"][step])
        register = ActionStateInputs(jnp.asarray(ref["xt_action"][chunk, step]), jnp.full((24,), t, jnp.float32),
                                     jnp.asarray(ref["state"][chunk][None]))
        outs = [self.call(state, branch, ref["xt_video"][chunk, step], t, int(ref["start_frame"][chunk]),
                          ref["eval_y"][chunk], register) for branch in ("positive", "negative")]
        return (outs[0][0], outs[1][0]), (outs[0][1], outs[1][1])


@pytest.fixture(scope="module", params=FIXTURE_DIRS)
def replay(request) -> Replay:
    return Replay(request.param)


def test_the_checkpoint_loads_as_the_release_saved_it(replay: Replay) -> None:
    """The transformer's keys are taken (the bf16 values upcast exactly), the encoders' stand-ins skipped, the
    register width read from the weights (not the head config's hidden_size field), a preset recognised."""
    from safetensors.torch import load_file

    cfg = replay.config
    assert cfg.action_register.hidden_size == replay.model.state_encoder.layer1.W.shape[2]
    head_hidden = json.loads((replay.root / "DreamZero-DROID-tiny" / "config.json").read_text())[
        "action_head_cfg"]["config"]["hidden_size"]
    assert cfg.action_register.hidden_size != head_hidden  # the fixture makes the two fields differ on purpose
    assert replay.info.skipped == ("action_head.image_encoder.model.visual.patch_embedding.weight",
                                   "action_head.text_encoder.token_embedding.weight",
                                   "action_head.vae.model.encoder.conv1.weight")
    stored = {}
    for shard in sorted((replay.root / "DreamZero-DROID-tiny").glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    as_f32 = {k[len(DIT_PREFIX):]: v.float().numpy() for k, v in stored.items() if k.startswith(DIT_PREFIX)}
    assert set(as_f32) == set(wan_names(cfg))  # 133 on the 3-layer network, 101 on the 2-layer one
    np.testing.assert_array_equal(replay.model.state_encoder.layer1.W[...], as_f32["state_encoder.layer1.W"])
    np.testing.assert_array_equal(replay.model.action_encoder.W2.b[...], as_f32["action_encoder.W2.b"])
    last = cfg.num_layers - 1
    np.testing.assert_array_equal(replay.model.blocks.cross_attn.k_img.kernel[...][last],
                                  as_f32[f"blocks.{last}.cross_attn.k_img.weight"].T)
    np.testing.assert_array_equal(replay.model.image_in.kernel[...], as_f32["img_emb.proj.1.weight"].T)


def test_every_dit_call_of_the_episode_through_paged_kv(replay: Replay) -> None:
    """Per chunk: the commit passes write both branches' paged caches (``first_commit_flow``, ``obs_commit_flow``),
    then every DiT evaluation of both branches reads them without writing (the four ``flow_*`` arrays)."""
    ref = replay.ref
    _, state = replay.new_episode()
    worst = {}
    for chunk in range(4):
        commit = replay.commit(state, chunk)
        want = ref["first_commit_flow"] if chunk == 0 else ref["obs_commit_flow"][chunk - 1]
        worst["commit"] = max(worst.get("commit", 0.0), float(np.abs(commit - want).max()))
        assert state.adapter("positive").committed_frames == ref["cache_frames"][chunk]
        for evaluation in range(len(ref["eval_step"])):
            (video_pos, video_neg), (action_pos, action_neg) = replay.evaluate(state, chunk, evaluation)
            for key, got in (("flow_video_cond", video_pos), ("flow_video_uncond", video_neg),
                             ("flow_action_cond", action_pos), ("flow_action_uncond", action_neg)):
                worst[key] = max(worst.get(key, 0.0), float(np.abs(got - ref[key][chunk, evaluation]).max()))
    print(f"{replay.root.name}: worst |diff| per output over the episode: {worst}")
    assert all(value < ATOL for value in worst.values()), worst


def test_bf16_weights_and_pools_stay_within_the_releases_own_bf16_error() -> None:
    """bf16 weights, activations and KV pools: the first evaluation within 0.1 of the float32 release (the
    release itself in bf16 is 2.8e-2 / 2.0e-2 away from it there)."""
    replay = Replay("dreamzero", dtype="bfloat16")
    assert replay.params["blocks"]["self_attn"]["q"]["kernel"][...].dtype == jnp.bfloat16
    _, state = replay.new_episode()
    replay.commit(state, 0)
    (video_pos, video_neg), (action_pos, _) = replay.evaluate(state, 0, 0)
    ref = replay.ref
    video_err = max(np.abs(video_pos - ref["flow_video_cond"][0, 0]).max(),
                    np.abs(video_neg - ref["flow_video_uncond"][0, 0]).max())
    action_err = np.abs(action_pos - ref["flow_action_cond"][0, 0]).max()
    assert video_err < 0.1 and action_err < 0.1, (video_err, action_err)
    assert video_err > 1e-4  # bf16 really ran


def test_a_wrong_register_rope_index_is_caught_by_the_replay() -> None:
    """The replay can fail: a register at the wrong block position (the release's action_state_index off by
    one) moves the action flow far past the tolerance."""
    replay = Replay("dreamzero")
    _, state = replay.new_episode()
    replay.commit(state, 0)
    replay.commit(state, 1)  # the cache now holds 3 frames; chunk 1 denoises at start frame 3 (register block 1)
    ref = replay.ref
    t = np.float32(ref["timesteps"][0])
    register = ActionStateInputs(jnp.asarray(ref["xt_action"][1, 0]), jnp.full((24,), t, jnp.float32),
                                 jnp.asarray(ref["state"][1][None]))
    _, right = replay.call(state, "positive", ref["xt_video"][1, 0], t, 3, ref["eval_y"][1], register)
    assert np.abs(right - ref["flow_action_cond"][1, 0]).max() < ATOL
    # Start frame 4 puts the register at block (4 - 1) // 2 = 1 too; 5 puts it at block 2 (and moves the video).
    _, wrong = replay.call(state, "positive", ref["xt_video"][1, 0], t, 5, ref["eval_y"][1], register)
    assert np.abs(wrong - ref["flow_action_cond"][1, 0]).max() > 1e-3


# -- the loader's refusals: each by name, before anything is placed ----------------------------------------


@pytest.fixture
def checkpoint_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the fixture's checkpoint; building the model (the first device placement) is made to fail,
    so a refusal that comes later than the checks shows up as that failure instead."""
    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dreamzero" / "DreamZero-DROID-tiny", target)

    def placed(*args, **kwargs):
        raise AssertionError("the loader placed weights before refusing the checkpoint")

    monkeypatch.setattr(dz_checkpoint, "build_checked_model", placed)
    return target


def _rewrite_shard(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    edit(tensors, index["weight_map"])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_truncated_shard_is_refused_by_name(checkpoint_copy: Path) -> None:
    shard = checkpoint_copy / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_dreamzero(checkpoint_copy, dtype="float32")


def test_a_wrong_shape_is_refused_by_name(checkpoint_copy: Path) -> None:
    import torch

    def edit(tensors, weight_map):
        key = DIT_PREFIX + "blocks.1.self_attn.q.weight"
        tensors[key] = torch.zeros((tensors[key].shape[0], tensors[key].shape[1] + 2), dtype=torch.bfloat16)

    _rewrite_shard(checkpoint_copy, edit)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.self_attn\.q\.weight"):
        load_dreamzero(checkpoint_copy, dtype="float32")


def test_a_missing_tensor_is_refused_by_name(checkpoint_copy: Path) -> None:
    def edit(tensors, weight_map):
        key = DIT_PREFIX + "action_decoder.layer2.b"
        del tensors[key]
        del weight_map[key]

    _rewrite_shard(checkpoint_copy, edit)
    with pytest.raises(CheckpointError, match=r"missing tensors: action_decoder\.layer2\.b"):
        load_dreamzero(checkpoint_copy, dtype="float32")


def test_a_foreign_key_set_is_refused_by_name(checkpoint_copy: Path) -> None:
    """A checkpoint whose transformer keys are not DreamZero's (here: Matrix-Game's action module in a block)."""
    import torch

    def edit(tensors, weight_map):
        key = DIT_PREFIX + "blocks.0.action_model.keyboard_embed.0.weight"
        tensors[key] = torch.zeros((8, 4), dtype=torch.bfloat16)
        weight_map[key] = "model-00001-of-00002.safetensors"

    _rewrite_shard(checkpoint_copy, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: .*blocks\.0\.action_model\.keyboard_embed"):
        load_dreamzero(checkpoint_copy, dtype="float32")


def test_a_config_that_is_not_dreamzeros_is_refused(checkpoint_copy: Path) -> None:
    config = json.loads((checkpoint_copy / "config.json").read_text())
    old = config["action_head_cfg"]["_target_"]
    config["action_head_cfg"]["_target_"] = "groot.vla.model.n1_5.action_head.FlowmatchingActionHead"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not a DreamZero"):
        load_dreamzero(checkpoint_copy, dtype="float32")
    # The first public release's module name is accepted (it reaches the placement, made to fail here).
    config["action_head_cfg"]["_target_"] = old.replace("wan_flow_matching_action_tf.",
                                                        "wan_flow_matching_action_tf_efficient_weighted.")
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="placed weights"):
        load_dreamzero(checkpoint_copy, dtype="float32")


def test_a_lora_checkpoint_saved_whole_is_merged(tmp_path: Path) -> None:
    """``base_model.model.`` + ``.base_layer.`` + ``lora_A/B`` (peft's layout when saved whole) load as the
    merged weight ``W + alpha / r * B @ A``, the config's ``lora_alpha`` / ``lora_rank``."""
    import torch
    from safetensors.torch import load_file

    target = tmp_path / "lora"
    shutil.copytree(FIXTURES / "dreamzero" / "DreamZero-DROID-tiny", target)
    rng = np.random.default_rng(0)
    base = "blocks.0.self_attn.q"
    dim = 64
    a = torch.from_numpy(rng.standard_normal((4, dim)).astype(np.float32)).to(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal((dim, 4)).astype(np.float32)).to(torch.bfloat16)

    def edit(tensors, weight_map):
        for name in list(tensors):
            if name.startswith(DIT_PREFIX + base + "."):
                suffix = name[len(DIT_PREFIX + base):]
                new = f"{DIT_PREFIX}base_model.model.{base}.base_layer{suffix}"
                tensors[new] = tensors.pop(name)
                weight_map[new] = weight_map.pop(name)
        for tag, value in (("A", a), ("B", b)):
            key = f"{DIT_PREFIX}base_model.model.{base}.lora_{tag}.default.weight"
            tensors[key] = value
            weight_map[key] = "model-00001-of-00002.safetensors"

    original = load_file(str(target / "model-00001-of-00002.safetensors"))[DIT_PREFIX + base + ".weight"].float()
    _rewrite_shard(target, edit)
    model, info = load_dreamzero(target, dtype="float32")
    assert info.merged_lora == (f"{base}.weight",)
    head = json.loads((target / "config.json").read_text())["action_head_cfg"]["config"]
    merged = original.numpy() + head["lora_alpha"] / head["lora_rank"] * (b.float().numpy() @ a.float().numpy())
    np.testing.assert_allclose(model.blocks.self_attn.q.kernel[...][0], merged.T, rtol=1e-6, atol=1e-6)


def test_the_presets_build_shape_wise() -> None:
    """The DROID and the Wan2.2-5B geometries build (shapes only). Counted from the shapes: the I2V backbone
    (Wan2.1-I2V-14B: 16.4e9 with its per-block image keys/values and img_emb) plus the register."""
    from ardiff_jax.models import dit_preset

    counts = {}
    for name in ("dreamzero-droid", "dreamzero-wan22-5b"):
        abstract = nnx.eval_shape(lambda name=name: CausalDiT(dit_preset(name), rngs=nnx.Rngs(0)))
        counts[name] = abstract.num_params
    assert counts["dreamzero-droid"] == 16_484_292_448
    assert counts["dreamzero-wan22-5b"] == 5_606_692_832


def test_the_training_forward_equals_the_releases(replay: Replay) -> None:
    """The teacher-forcing whole-sequence forward (clean + noisy frames, every block's register) against the
    release's ``_forward_train`` (``whole_flow_video``, ``whole_flow_action``); the release's state token
    attends only to itself there, and giving it the inference visibility moves the outputs (the mask matters)."""
    ref = replay.ref
    frames = ref["whole_x"].shape[0]
    register = ActionStateInputs(jnp.asarray(ref["whole_action"]), jnp.asarray(ref["whole_t_action"]),
                                 jnp.asarray(ref["whole_state"]))

    outs = {}
    for like_inference in (False, True):
        video, registers = teacher_forcing(replay.graphdef, replay.params, like_inference, jnp.asarray(ref["whole_x"]),
                                           jnp.asarray(ref["whole_clean_x"]), jnp.asarray(ref["whole_t"]),
                                           jnp.asarray(ref["context_pos"]), jnp.asarray(ref["clip"]), register,
                                           jnp.asarray(ref["ys"][:frames]))
        outs[like_inference] = (np.asarray(video), np.asarray(registers))
    video, actions = outs[False]
    assert np.abs(video - ref["whole_flow_video"]).max() < ATOL
    assert np.abs(actions - ref["whole_flow_action"]).max() < ATOL
    assert np.abs(outs[True][1] - ref["whole_flow_action"]).max() > 1e-3


def test_a_single_file_checkpoint_loads_like_the_sharded_one(tmp_path: Path, replay: Replay) -> None:
    """``model.safetensors`` alone (no index) is the other layout ``save_pretrained`` writes."""
    from safetensors.torch import load_file, save_file

    source = replay.root / "DreamZero-DROID-tiny"
    target = tmp_path / "single"
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    model, info = load_dreamzero(target, dtype="float32")
    assert info.config == replay.config and len(info.skipped) == 3
    for ours, theirs in ((model.head.kernel, replay.model.head.kernel),
                         (model.blocks.ffn_in.kernel, replay.model.blocks.ffn_in.kernel)):
        np.testing.assert_array_equal(ours[...], theirs[...])
