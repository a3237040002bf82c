"""The Wan 2.1 VAE port (``ardiff_jax.models.wan._vae``) against diffusers' ``AutoencoderKLWan``.

No weights can be downloaded, so every loader is proven on a tiny random
``AutoencoderKLWan`` (Wan 2.1's layout: ``dim_mult=[1, 2, 4, 4]``, two residual blocks, 16
latent channels; only ``base_dim`` shrunk to 8), every parameter re-randomised with a
seeded generator (diffusers zero-initialises nothing, but gammas of 1 and zero biases would
leave those loads untested), written as a diffusers directory and as an original-named
``Wan2.1_VAE.pth`` (the inverse of diffusers' own ``convert_wan_vae_to_diffusers``, which
the test checks maps it back exactly).

Measured on CPU, float32 (asserted with margin):

* whole-clip decode of 7 latent frames (25 pixel frames, 32x48) vs diffusers' ``decode``:
  max abs 3.6e-6 (outputs of mean magnitude 0.4, 92% inside the clamp); asserted <= 1e-4;
* encode of those 25 frames vs diffusers' ``encode(...).latent_dist.mean``, both normalised
  as Wan does ``(mu - mean) * (1 / std)``: 2.1e-6 (values up to ~2); asserted <= 1e-4;
* streaming ``decode_step`` in blocks of 3 (3, 3, 1) or 1 then 3 (1, 3, 3) vs the
  whole-clip decode (one latent frame per step): 2-3e-6, from batching frames in one conv
  call (the per-frame schedule is bit-identical); asserted <= 2e-5;
* a cache copied to host numpy and back continues bit for bit.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from helpers import count_compiles

from ardiff_jax.models.wan import _vae
from ardiff_jax.models.wan._checkpoint import CheckpointError
from ardiff_jax.models.wan._vae import (
    VAEDecodeCache,
    WanVAE,
    WanVAEConfig,
    cache_nbytes,
    decode_step,
    decoded_frames,
    encode_step,
    init_decode_cache,
    init_encode_cache,
    load_vae,
    vae_names,
)

BASE_DIM = 8
LATENTS, LATENT_HW = 7, (4, 6)  # -> 25 frames of 32x48
PIXEL_HW = (LATENT_HW[0] * 8, LATENT_HW[1] * 8)
DECODE_TOL = ENCODE_TOL = 1e-4  # measured 3.6e-6 / 2.1e-6
STREAM_TOL = 2e-5  # measured 2-3e-6


# -- the reference and its checkpoints ------------------------------------------------------------------


def _randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.02 * noise)
            else:  # conv weights [O, I, *k]: unit-variance outputs
                p.copy_(noise / p[0].numel() ** 0.5)


def to_original(name: str) -> str:
    """diffusers' AutoencoderKLWan name -> Wan's (``wan/modules/vae.py``), written from Wan's module tree."""
    resnet = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."), ("norm2.gamma", "residual.3.gamma"),
              ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))

    def block(prefix: str, rest: str) -> str:
        for theirs, ours in resnet:
            if rest.startswith(theirs):
                return prefix + ours + rest[len(theirs):]
        return prefix + rest

    for side in ("encoder", "decoder"):
        if m := re.fullmatch(rf"{side}\.mid_block\.(resnets|attentions)\.(\d)\.(.*)", name):
            index = {"resnets": {"0": 0, "1": 2}, "attentions": {"0": 1}}[m[1]][m[2]]
            return block(f"{side}.middle.{index}.", m[3]) if m[1] == "resnets" else f"{side}.middle.1.{m[3]}"
        for theirs, ours in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
            if name.startswith(f"{side}.{theirs}"):
                return f"{side}.{ours}{name[len(side) + 1 + len(theirs):]}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.*)", name):
        return block(f"encoder.downsamples.{m[1]}.", m[2])
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.*)", name):
        index = 4 * int(m[1]) + (int(m[3]) if m[3] is not None else 3)  # 3 resnets + 1 upsampler per stage
        return block(f"decoder.upsamples.{index}.", m[4]) if m[3] is not None else f"decoder.upsamples.{index}.{m[4]}"
    return {"quant_conv.weight": "conv1.weight", "quant_conv.bias": "conv1.bias",
            "post_quant_conv.weight": "conv2.weight", "post_quant_conv.bias": "conv2.bias"}[name]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # The reference is tiny; torch's thread pool only fights XLA's for the two cores (5x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    model = diffusers.AutoencoderKLWan(base_dim=BASE_DIM).eval()
    _randomise(model, seed=0)
    return model


@pytest.fixture(scope="module")
def paths(reference, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wan_vae")
    reference.save_pretrained(root / "diffusers")
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    original = {to_original(k): v for k, v in state.items()}
    torch.save(original, root / "Wan2.1_VAE.pth")
    return {"root": root, "diffusers": root / "diffusers", "pth": root / "Wan2.1_VAE.pth", "state": state,
            "original": original}


@pytest.fixture(scope="module")
def vae(paths) -> WanVAE:
    return load_vae(paths["diffusers"])


@pytest.fixture(scope="module")
def latents() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((LATENTS, 16, *LATENT_HW)).astype(np.float32)


def _raw_latents(config: WanVAEConfig, z: np.ndarray) -> torch.Tensor:
    """Normalised ``[f, C, h, w]`` -> what diffusers decodes, ``[1, C, f, h, w]``: Wan's ``z / (1/std) + mean``."""
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    return torch.from_numpy(z).permute(1, 0, 2, 3)[None] / inv_std + mean


@pytest.fixture(scope="module")
def want_video(reference, vae, latents) -> np.ndarray:
    with torch.no_grad():
        return reference.decode(_raw_latents(vae.config, latents)).sample[0].permute(1, 0, 2, 3).numpy()


@pytest.fixture(scope="module")
def whole_video(vae, latents) -> np.ndarray:
    return np.asarray(vae.decode(latents))


@pytest.fixture(scope="module")
def video() -> np.ndarray:
    x = np.random.default_rng(2).standard_normal((1 + 4 * (LATENTS - 1), 3, *PIXEL_HW)).astype(np.float32)
    return np.clip(0.5 * x, -1, 1)


@pytest.fixture(scope="module")
def whole_latents(vae, video) -> np.ndarray:
    return np.asarray(vae.encode(video))


def _params(model: WanVAE) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]


def _stream(model: WanVAE, z: np.ndarray, sizes: list[int]) -> np.ndarray:
    cache, start, out = init_decode_cache(model.config, z.shape[2:]), 0, []
    for size in sizes:
        video, cache = decode_step(model, z[start:start + size], cache)
        assert video.shape[0] == decoded_frames(model.config, size, first=start == 0)
        out.append(np.asarray(video))
        start += size
    return np.concatenate(out)


# -- names and sizes ----------------------------------------------------------------------------------


def test_published_size_and_names():
    """126.9M parameters in 194 tensors; our diffusers names/shapes are AutoencoderKLWan's (built on meta)."""
    config = WanVAEConfig()
    assert config.num_params == 126_892_531
    original, named = vae_names(config), vae_names(config, "diffusers")
    assert len(original) == len(named) == 194
    with torch.device("meta"):
        full = diffusers.AutoencoderKLWan()
    assert named == {k: tuple(v.shape) for k, v in full.state_dict().items()}
    assert set(original) == {to_original(k) for k in named}
    assert "decoder.upsamples.4.shortcut.weight" in original and "decoder.upsamples.11.resample.1.weight" in original


def test_original_names_are_what_diffusers_converts(paths):
    """The .pth's names (our inverse rename) go back to diffusers' exactly through diffusers' own converter,
    and are the names (and shapes) ``vae_names`` expects."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    converted = convert_wan_vae_to_diffusers(dict(paths["original"]))
    assert set(converted) == set(paths["state"])
    assert all(converted[k] is paths["state"][k] for k in converted)
    assert vae_names(WanVAEConfig.tiny(BASE_DIM)) == {k: tuple(v.shape) for k, v in paths["original"].items()}


# -- numerics against diffusers ---------------------------------------------------------------------------


def test_loads_agree(vae, paths):
    pth = load_vae(paths["pth"])
    assert pth.config == vae.config == WanVAEConfig.tiny(BASE_DIM)
    for a, b in zip(_params(pth), _params(vae), strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_matches_diffusers(paths, latents, want_video, whole_video):
    assert whole_video.shape == (1 + 4 * (LATENTS - 1), 3, *PIXEL_HW)
    assert (np.abs(want_video) < 1).mean() > 0.8  # mostly inside the clamp: the comparison sees the values
    assert np.abs(whole_video - want_video).max() <= DECODE_TOL
    from_pth = np.asarray(load_vae(paths["pth"]).decode(latents))
    np.testing.assert_array_equal(from_pth, whole_video)


def test_encode_matches_diffusers(reference, vae, video, whole_latents):
    with torch.no_grad():
        mu = reference.encode(torch.from_numpy(video).permute(1, 0, 2, 3)[None]).latent_dist.mean
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    want = ((mu - mean) * inv_std)[0].permute(1, 0, 2, 3).numpy()
    assert whole_latents.shape == want.shape == (LATENTS, 16, *LATENT_HW)
    assert np.abs(whole_latents - want).max() <= ENCODE_TOL


# -- streaming ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[3, 3, 1], [1, 3, 3]])
def test_streaming_decode_equals_whole(vae, latents, whole_video, sizes):
    assert np.abs(_stream(vae, latents, sizes) - whole_video).max() <= STREAM_TOL


def test_cache_survives_host_round_trip(vae, latents):
    first, cache = decode_step(vae, latents[:3], init_decode_cache(vae.config, LATENT_HW))
    host = jax.tree.map(np.array, cache)  # what a session offload keeps; copies (the cache is donated next)
    assert isinstance(host, VAEDecodeCache) and host.started and all(isinstance(c, np.ndarray) for c in host.convs)
    on_device, _ = decode_step(vae, latents[3:6], cache)
    restored, _ = decode_step(vae, latents[3:6], jax.tree.map(jnp.asarray, host))
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(on_device))
    assert first.shape[0] == 9 and on_device.shape[0] == 12


def test_no_recompile_after_two_blocks(vae):
    """Programs: one per (block size, first or not); a stream of 3-latent blocks compiles at most
    (3, first) and (3, later), then nothing, also for a cache restored from the host."""
    z = np.random.default_rng(3).standard_normal((15, 16, *LATENT_HW)).astype(np.float32)
    cache = init_decode_cache(vae.config, LATENT_HW)
    with count_compiles() as warmup:
        for i in range(2):
            video, cache = decode_step(vae, z[3 * i:3 * i + 3], cache)
            video.block_until_ready()
    assert len(warmup) <= 2 and all("decode_step" in name for name in warmup), warmup
    with count_compiles() as later:
        for i in range(2, 5):
            if i == 3:
                cache = jax.tree.map(jnp.asarray, jax.tree.map(np.array, cache))
            video, cache = decode_step(vae, z[3 * i:3 * i + 3], cache)
            video.block_until_ready()
    assert later == []


def test_streaming_encode(vae, video, whole_latents):
    """Image-to-video prefill: the first frame alone gives the clip's first latent (bit for bit: the same
    program), and chunks of 1 + 12 + 12 frames give the clip's latents."""
    first, cache = encode_step(vae, video[:1], init_encode_cache(vae.config, PIXEL_HW))
    np.testing.assert_array_equal(np.asarray(first), whole_latents[:1])
    rest = []
    for start in (1, 13):
        chunk, cache = encode_step(vae, video[start:start + 12], cache)
        rest.append(np.asarray(chunk))
    assert np.abs(np.concatenate([first, *rest]) - whole_latents).max() <= STREAM_TOL
    with pytest.raises(ValueError, match="4k frames"):
        encode_step(vae, video[:3], cache)


def test_decode_cache_size_at_832x480():
    """Resident streaming state of Wan 2.1 at 832x480 (latent 60x104): 32 cached convs, 944.3M elements,
    1801 MiB in bf16; shapes only (eval_shape), and the same layout the real decoder traces."""
    config = WanVAEConfig()
    abstract = jax.eval_shape(lambda: init_decode_cache(config, (60, 104), jnp.bfloat16))
    assert len(abstract.convs) == 32
    elements = sum(int(np.prod(c.shape)) for c in abstract.convs)
    assert elements == 944_286_720
    assert cache_nbytes(config, (60, 104), "bfloat16") == 2 * elements
    assert round(2 * elements / 2**20) == 1801
    # The real network (abstract) decodes one latent frame from that cache and returns the same layout.
    graphdef, params = nnx.split(nnx.eval_shape(lambda: WanVAE(config.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))))
    z = jax.ShapeDtypeStruct((1, 16, 60, 104), jnp.float32)
    started = VAEDecodeCache(abstract.convs, True)
    video, out = jax.eval_shape(lambda p, z, c: _vae._decode_step_split(graphdef, p, z, c), params, z, started)
    assert video.shape == (4, 3, 480, 832)
    assert jax.tree.structure(out) == jax.tree.structure(started)
    assert [c.shape for c in out.convs] == [c.shape for c in abstract.convs]
    assert all(c.dtype == jnp.bfloat16 for c in out.convs)


def test_step_input_checks(vae, latents):
    cache = init_decode_cache(vae.config, LATENT_HW)
    with pytest.raises(ValueError, match="cache was made for"):
        decode_step(vae, np.zeros((1, 16, 2, 2), np.float32), cache)
    with pytest.raises(ValueError, match=r"\[F, 16, H, W\]"):
        decode_step(vae, latents[:, :4], cache)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        vae.encode(np.zeros((4, 3, *PIXEL_HW), np.float32))


# -- formats and refusals ------------------------------------------------------------------------------------


def test_other_formats_load_the_same(vae, paths):
    root = paths["root"]
    pipeline = root / "pipeline"
    (pipeline / "vae").mkdir(parents=True)
    for f in paths["diffusers"].iterdir():
        (pipeline / "vae" / f.name).write_bytes(f.read_bytes())
    keyed = root / "keyed.pth"  # under a key, with a prefix
    torch.save({"state_dict": {f"vae.{k}": v for k, v in paths["original"].items()}, "step": torch.tensor(3)}, keyed)
    comfy = root / "wan_2.1_vae.safetensors"  # original names in a safetensors file (ComfyUI's repack)
    safetensors_torch.save_file({k: v.contiguous() for k, v in paths["original"].items()}, comfy)
    bare = paths["diffusers"] / "diffusion_pytorch_model.safetensors"
    want = _params(vae)
    for path in (pipeline, keyed, comfy, bare):
        for a, b in zip(_params(load_vae(path)), want, strict=True):
            np.testing.assert_array_equal(a, b)
    bf16 = load_vae(paths["diffusers"], dtype="bfloat16")
    assert bf16.config.dtype == "bfloat16"
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree_util.tree_leaves(nnx.state(bf16, nnx.Param)))


def _write_pth(paths, tmp_path, change) -> str:
    state = dict(paths["original"])
    change(state)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("decoder.upsamples.7.time_conv.bias"), r"missing tensors: decoder\.upsamples\.7\.time_conv\.bias"),
    (lambda s: s.update({"decoder.extra.weight": torch.zeros(2)}), r"unexpected tensors: decoder\.extra\.weight"),
    (lambda s: s.update({"decoder.head.2.weight": torch.zeros(3, 8, 3, 3, 1)}),
     r"mis-shaped tensors: decoder\.head\.2\.weight \[3, 8, 3, 3, 1\] \(expected \[3, 8, 3, 3, 3\]\)"),
    (lambda s: s.update({"conv1.bias": torch.zeros(32, dtype=torch.int32)}), r"non-float tensors: conv1\.bias"),
])
def test_bad_checkpoints_are_refused_before_placement(paths, tmp_path, monkeypatch, change, message):
    path = _write_pth(paths, tmp_path, change)
    placed = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(1) or real_put(*a, **k))
    with pytest.raises(CheckpointError, match=message):
        load_vae(path)
    assert placed == []


def test_bad_configs_are_refused(vae, paths, tmp_path):
    with pytest.raises(CheckpointError, match="base_dim: config 12, checkpoint 8"):
        load_vae(paths["diffusers"], WanVAEConfig.tiny(12))
    with pytest.raises(CheckpointError, match="Wan2.1_VAE.pth disagrees with the given config: base_dim"):
        load_vae(paths["pth"], WanVAEConfig.tiny(12))  # no config.json: the width read off the tensors
    wan22 = tmp_path / "wan22"
    wan22.mkdir()
    data = json.loads((paths["diffusers"] / "config.json").read_text())
    (wan22 / "config.json").write_text(json.dumps({**data, "is_residual": True, "z_dim": 48}))
    (wan22 / "diffusion_pytorch_model.safetensors").write_bytes(
        (paths["diffusers"] / "diffusion_pytorch_model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="is_residual"):
        load_vae(wan22)
    junk = tmp_path / "junk.pth"
    torch.save({"step": 3, "optimizer": {"lr": 1.0}}, junk)
    with pytest.raises(CheckpointError, match="state dict"):
        load_vae(junk)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((paths["diffusers"] / "diffusion_pytorch_model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_vae(truncated)
