"""Published causal-Wan checkpoints load into ``CausalDiT`` (``ardiff_jax.models.wan._checkpoint``).

No weights can be downloaded here, so every loader is proven on a tiny random
``diffusers.WanTransformer3DModel`` written in each real format with the real names: the
diffusers directory (single file, sharded, under a pipeline root), the original Wan
directory (single file, sharded), Self-Forcing / LongLive ``.pt`` training checkpoints
(``generator_ema`` / ``generator`` / ``critic``, ``model.`` and FSDP prefixes), a
``model.``-prefixed ``.safetensors`` (Krea realtime), BF16 files and a PEFT LoRA. Each load
is checked against diffusers' forward on the same input (per-frame timesteps, text
zero-padded to ``text_len`` as Wan pads it before the text MLP).

Why diffusers' timestep projection is patched for the exact comparison: the original Wan
evaluates the timestep sinusoid in float64 (``sinusoidal_embedding_1d`` casts the position
to float64) and ``CausalDiT`` reproduces that; diffusers evaluates ``t * freq`` in
float32, which at ``t`` near 1000 is off by up to ~6e-5 rad, and that difference (not the
loader) dominates an unpatched comparison (~7e-5 on these outputs of magnitude ~7). With
diffusers' ``Timesteps`` evaluated in float64 the two agree to float32 rounding (~5e-6).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ardiff_jax.models import CausalDiTConfig, DenseAttention  # noqa: E402
from ardiff_jax.models.wan import _checkpoint  # noqa: E402
from ardiff_jax.models.wan._checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    wan_names,
)
from ardiff_jax.models.wan._safetensors import SafetensorsError, SafetensorsFile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# The tiny network: 2 layers, 2 heads x 12, FFN 32, 4 channels, text 16-wide; an 8x12 latent.
LAYERS, HEADS, HEAD_DIM, FFN, CHANNELS, TEXT_DIM = 2, 2, 12, 32, 4, 16
DIM = HEADS * HEAD_DIM
FRAMES, HEIGHT, WIDTH, TEXT_LEN, PROMPT_TOKENS = 3, 8, 12, 8, 5
TOKENS_PER_FRAME = (HEIGHT // 2) * (WIDTH // 2)
TIMESTEPS = np.array([937.5, 833.33, 625.0], np.float32)
CONFIG = CausalDiTConfig(num_layers=LAYERS, dim=DIM, num_heads=HEADS, ffn_dim=FFN, latent_channels=CHANNELS,
                         latent_height=HEIGHT, latent_width=WIDTH, text_len=TEXT_LEN, text_dim=TEXT_DIM,
                         frames_per_block=3, window_frames=3, dtype="float32", param_dtype="float32")

#: Parity bounds (max abs on outputs of magnitude ~7), float32.
EXACT = 1e-5  # against diffusers with its timestep sinusoid in float64, as the original Wan
UNPATCHED = 2e-4  # against stock diffusers (float32 sinusoid); measured ~7e-5
BF16_RELATIVE = 0.03  # a bf16 model vs the float32 reference, relative to max |reference|: measured ~1%
# (diffusers itself run in bf16 is as far: 5.8e-2 on these outputs)

LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_MODULES = [f"blocks.{i}.{m}" for i in range(LAYERS)
                for m in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                          "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")]


# -- the original Wan names -> diffusers, written out independently of the loader ------------------------

_TOP = {"text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj", "head.head": "proj_out",
        "patch_embedding": "patch_embedding"}
_BLOCK = {"norm3": "norm2", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
for _wan, _diff in (("self_attn", "attn1"), ("cross_attn", "attn2")):
    _BLOCK.update({f"{_wan}.q": f"{_diff}.to_q", f"{_wan}.k": f"{_diff}.to_k", f"{_wan}.v": f"{_diff}.to_v",
                   f"{_wan}.o": f"{_diff}.to_out.0", f"{_wan}.norm_q": f"{_diff}.norm_q",
                   f"{_wan}.norm_k": f"{_diff}.norm_k"})


def wan_module_to_diffusers(module: str) -> str:
    if module.startswith("blocks."):
        _, index, rest = module.split(".", 2)
        return f"blocks.{index}.{_BLOCK[rest]}"
    return _TOP[module]


def wan_to_diffusers(name: str) -> str:
    if name == "head.modulation":
        return "scale_shift_table"
    if name.startswith("blocks.") and name.endswith(".modulation"):
        return name.replace(".modulation", ".scale_shift_table")
    module, _, leaf = name.rpartition(".")
    return f"{wan_module_to_diffusers(module)}.{leaf}"


# -- the reference: a random diffusers model, its outputs, and every format on disk ----------------------


@contextlib.contextmanager
def float64_timesteps(model):
    """diffusers' timestep sinusoid evaluated in float64, as the original Wan (see the module docstring)."""
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


def save_safetensors(tensors: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, str(path))
    return path


def write_wan_dir(directory: Path, wan: dict, shards: int = 1, **overrides) -> Path:
    """The original Wan layout: config.json with Wan's fields + one file or an index and shards."""
    directory.mkdir(parents=True)
    config = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": DIM, "eps": 1e-06, "ffn_dim": FFN,
              "freq_dim": 256, "in_dim": CHANNELS, "model_type": "t2v", "num_heads": HEADS, "num_layers": LAYERS,
              "out_dim": CHANNELS, "text_len": TEXT_LEN, **overrides}
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_safetensors(wan, directory / "diffusion_pytorch_model.safetensors")
        return directory
    names = list(wan)
    weight_map = {}
    for k in range(shards):
        file = f"diffusion_pytorch_model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_safetensors({n: wan[n] for n in part}, directory / file)
        weight_map.update({n: file for n in part})
    total = sum(v.numel() * v.element_size() for v in wan.values())
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return directory


def fsdp_name(name: str) -> str:
    """How an FSDP-wrapped Self-Forcing generator spells a parameter (blocks wrapped too)."""
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        name = f"blocks.{index}._fsdp_wrapped_module.{rest}"
    return f"model._fsdp_wrapped_module.{name}"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    start_mesh_check(tmp_path_factory.mktemp("wan_mesh"))  # runs alongside the rest of the module
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=CHANNELS,
        out_channels=CHANNELS, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=FFN, num_layers=LAYERS,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    # diffusers zero-initialises some parameters: re-randomise all of them (norm scales around 1).
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for name, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=gen)
        sd[name] = 1.0 + 0.2 * noise if (".norm" in name and name.endswith("weight")) else 0.2 * noise
    model.load_state_dict(sd)
    wan = {}
    for name in wan_names(CONFIG):
        wan[name] = sd[wan_to_diffusers(name)].clone()

    latents = torch.randn(1, CHANNELS, FRAMES, HEIGHT, WIDTH, generator=gen)
    text = torch.zeros(1, TEXT_LEN, TEXT_DIM)
    text[:, :PROMPT_TOKENS] = torch.randn(1, PROMPT_TOKENS, TEXT_DIM, generator=gen)
    per_token = torch.from_numpy(TIMESTEPS).repeat_interleave(TOKENS_PER_FRAME)[None]  # [1, F*T]

    def forward(state_dict=None):
        if state_dict is not None:
            model.load_state_dict(state_dict)
        with torch.no_grad():
            out = model(latents, per_token, text, return_dict=False)[0]
        model.load_state_dict(sd)
        return out[0].permute(1, 0, 2, 3).numpy()  # [1, C, F, H, W] -> [F, C, H, W]

    unpatched = forward()
    with float64_timesteps(model):
        exact = forward()
        bf16_weights = {k: v.to(torch.bfloat16).float() for k, v in sd.items()}
        exact_bf16 = forward(bf16_weights)
        lora_a = {m: 0.1 * torch.randn(LORA_RANK, sd[wan_module_to_diffusers(m) + ".weight"].shape[1], generator=gen)
                  for m in LORA_MODULES}
        lora_b = {m: 0.1 * torch.randn(sd[wan_module_to_diffusers(m) + ".weight"].shape[0], LORA_RANK, generator=gen)
                  for m in LORA_MODULES}
        merged = dict(sd)
        for m in LORA_MODULES:
            name = wan_module_to_diffusers(m) + ".weight"
            merged[name] = sd[name] + (LORA_ALPHA / LORA_RANK) * (lora_b[m] @ lora_a[m])
        exact_lora = forward(merged)

    # Every format on disk.
    root = tmp_path_factory.mktemp("wan_checkpoints")
    paths = {}
    model.save_pretrained(root / "diffusers")
    paths["diffusers"] = root / "diffusers"
    paths["diffusers-file"] = root / "diffusers" / "diffusion_pytorch_model.safetensors"
    pipeline = root / "pipeline"
    model.save_pretrained(pipeline / "transformer", max_shard_size="30KB")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                           "transformer": ["diffusers", "WanTransformer3DModel"]}))
    assert len(list((pipeline / "transformer").glob("*.safetensors"))) > 1
    paths["diffusers-sharded-pipeline"] = pipeline
    paths["wan"] = write_wan_dir(root / "wan", wan)
    paths["wan-sharded"] = write_wan_dir(root / "wan_sharded", wan, shards=3)
    critic = {f"model.{k}": v + 1.0 for k, v in wan.items()}
    torch.save({"generator_ema": {f"model.{k}": v for k, v in wan.items()},
                "generator": {f"model.{k}": v.to(torch.bfloat16) for k, v in wan.items()},
                "critic": critic, "step": 1200}, root / "self_forcing.pt")
    paths["pt"] = root / "self_forcing.pt"
    torch.save({"generator": {fsdp_name(k): v for k, v in wan.items()}}, root / "fsdp.pt")
    paths["pt-fsdp"] = root / "fsdp.pt"
    paths["safetensors-model-prefix"] = save_safetensors({f"model.{k}": v for k, v in wan.items()},
                                                         root / "krea.safetensors")
    paths["bf16"] = save_safetensors({k: v.to(torch.bfloat16) for k, v in wan.items()}, root / "bf16.safetensors")
    peft = root / "lora_peft"
    save_safetensors({f"base_model.model.{m}.lora_{ab}.weight": (lora_a if ab == "A" else lora_b)[m]
                      for m in LORA_MODULES for ab in "AB"}, peft / "adapter_model.safetensors")
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": LORA_RANK,
                                                          "lora_alpha": LORA_ALPHA,
                                                          "target_modules": ["q", "k", "v", "o", "ffn.0", "ffn.2"]}))
    paths["lora-peft"] = peft
    torch.save({"generator_lora": {f"base_model.model.{m}.lora_{ab}.weight": (lora_a if ab == "A" else lora_b)[m]
                                   for m in LORA_MODULES for ab in "AB"}}, root / "longlive_lora.pt")
    paths["lora-pt"] = root / "longlive_lora.pt"
    yield types.SimpleNamespace(
        model=model, sd=sd, wan=wan, critic=critic, root=root, paths=paths, unpatched=unpatched, exact=exact,
        exact_bf16=exact_bf16, exact_lora=exact_lora, lora_a=lora_a, lora_b=lora_b,
        latents=jnp.asarray(latents[0].permute(1, 0, 2, 3).numpy()), text=jnp.asarray(text[0].numpy()))
    mesh_check = _MESH_RUN.pop("process", None)  # still here: its test was not selected
    if mesh_check is not None and mesh_check.poll() is None:
        mesh_check.kill()
        mesh_check.wait()


_COMPILED = {}


def forward(model, ref) -> np.ndarray:
    """Our whole-sequence forward (frames 0..2, per-frame timesteps, no history): ``f32[F, C, H, W]``."""
    graphdef, state = nnx.split(model)
    config = model.config
    fn = _COMPILED.get(config)
    if fn is None:
        def run(state, latents, text):
            m = nnx.merge(graphdef, state)
            text_kv = m.text_cross_kv(text.astype(config.dtype))
            attention = DenseAttention.empty(config.num_layers, config.num_heads, config.head_dim)
            return m(latents, jnp.asarray(TIMESTEPS), jnp.int32(0), text_kv, attention=attention).video

        # XLA's backend optimisation level 0 halves the compile time of these tiny programs;
        # the parity bounds hold either way.
        fn = _COMPILED[config] = jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})
    return np.asarray(fn(state, ref.latents, ref.text), np.float32)


def params(model) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture
def reads(monkeypatch):
    """Counts of every tensor name read from a safetensors file during the test."""
    counts: dict[str, int] = {}
    original = SafetensorsFile.read

    def counting(self, name):
        counts[name] = counts.get(name, 0) + 1
        return original(self, name)

    monkeypatch.setattr(SafetensorsFile, "read", counting)
    return counts


# -- the mapping -------------------------------------------------------------------------------------------


def test_the_mapping_is_diffusers_rename_and_uses_every_tensor_once(ref, reads):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    # The Wan names a CausalDiT needs are exactly the original state dict's (825 for 30 layers).
    names = wan_names(CONFIG)
    assert len(names) == 15 + 27 * LAYERS == len(ref.sd)
    assert len(wan_names(CONFIG.replace(num_layers=30))) == 825
    # diffusers' own converter maps them 1:1 onto WanTransformer3DModel's state dict.
    converted = convert_wan_transformer_to_diffusers(dict(ref.wan))
    assert set(converted) == set(ref.sd)
    assert all(torch.equal(converted[k], ref.sd[k]) for k in ref.sd)
    assert {k: tuple(v.shape) for k, v in ref.wan.items()} == names
    # A load reads every tensor of the file exactly once and fills every parameter.
    model = load_checkpoint(ref.paths["diffusers"], CONFIG)
    assert reads == {name: 1 for name in ref.sd}
    assert len(params(model)) == 42


def test_the_loader_asserts_the_bijection(ref, monkeypatch):
    # A mapping that read one tensor twice would be caught by the loader's own check.
    original = _checkpoint._BY_PATH["blocks.self_attn.k.kernel"]
    monkeypatch.setitem(_checkpoint._BY_PATH, "blocks.self_attn.k.kernel",
                        _checkpoint._Entry(original.path, "blocks.{i}.self_attn.q.weight", "linear"))
    with pytest.raises(RuntimeError, match=r"not used exactly once: .*blocks\.0\.self_attn\.k\.weight x0"):
        load_checkpoint(ref.paths["wan"], CONFIG)


# -- parity with diffusers ---------------------------------------------------------------------------------

FORMATS = {
    "diffusers": {}, "diffusers-sharded-pipeline": {}, "diffusers-file": {}, "wan": {}, "wan-sharded": {},
    "pt": {}, "pt-fsdp": {}, "safetensors-model-prefix": {}, "wan-as-format": {"format": "wan"},
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_matches_diffusers(ref, fmt):
    path = ref.paths["wan" if fmt == "wan-as-format" else fmt]
    model = load_checkpoint(path, CONFIG, **FORMATS[fmt])
    out = forward(model, ref)
    diff = max_diff(out, ref.exact)
    print(f"{fmt}: max |ours - diffusers(float64 sinusoid)| = {diff:.2e}, "
          f"vs stock diffusers {max_diff(out, ref.unpatched):.2e}, output scale {np.abs(ref.exact).max():.2f}")
    assert diff <= EXACT
    assert max_diff(out, ref.unpatched) <= UNPATCHED


def test_every_format_loads_the_same_parameters(ref, capsys):
    reference = params(load_checkpoint(ref.paths["diffusers"], CONFIG, progress=True))
    assert "loading diffusers: 100%" in capsys.readouterr().err  # the tqdm bar (bytes)
    for fmt in ("wan-sharded", "pt-fsdp", "safetensors-model-prefix", "diffusers-sharded-pipeline"):
        loaded = params(load_checkpoint(ref.paths[fmt], CONFIG))
        assert loaded.keys() == reference.keys()
        for key in reference:
            np.testing.assert_array_equal(loaded[key], reference[key], err_msg=f"{fmt} {key}")


def test_pt_entries_are_picked_by_checkpoint_key(ref):
    ema = params(load_checkpoint(ref.paths["pt"], CONFIG))  # default: generator_ema
    explicit = params(load_checkpoint(ref.paths["pt"], CONFIG, checkpoint_key="generator_ema"))
    critic = params(load_checkpoint(ref.paths["pt"], CONFIG, checkpoint_key="critic"))
    generator = load_checkpoint(ref.paths["pt"], CONFIG, checkpoint_key="generator")  # stored in bf16
    key = "['patch_embedding']['bias'].value"
    np.testing.assert_array_equal(ema[key], explicit[key])
    np.testing.assert_array_equal(critic[key], ref.critic["model.patch_embedding.bias"].numpy())
    np.testing.assert_array_equal(params(generator)[key],
                                  ref.wan["patch_embedding.bias"].to(torch.bfloat16).float().numpy())
    assert max_diff(forward(generator, ref), ref.exact_bf16) <= EXACT
    with pytest.raises(CheckpointError, match=r"no entry 'teacher' \(it has: generator_ema, generator, critic, step"):
        load_checkpoint(ref.paths["pt"], CONFIG, checkpoint_key="teacher")


def test_bf16_checkpoints(ref):
    # A bf16 file loaded in float32 holds the bf16 values exactly: diffusers with the same
    # bf16-rounded weights agrees to float32 rounding.
    upcast = load_checkpoint(ref.paths["bf16"], CONFIG)
    assert max_diff(forward(upcast, ref), ref.exact_bf16) <= EXACT
    # Loaded as a bf16 model (parameters and activations bf16, as the published presets run):
    # within BF16_RELATIVE of the float32 reference, relative to its magnitude.
    model = load_checkpoint(ref.paths["bf16"], CONFIG, dtype="bfloat16")
    assert model.config.dtype == model.config.param_dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    diff = max_diff(forward(model, ref), ref.exact)
    scale = float(np.abs(ref.exact).max())
    print(f"bf16 model: max |ours - diffusers float32| = {diff:.3e} ({diff / scale:.2%} of max |out| {scale:.2f}); "
          f"bf16 file upcast to float32: {max_diff(forward(upcast, ref), ref.exact_bf16):.2e}")
    assert diff <= BF16_RELATIVE * scale
    # float32 weights cast to bf16 at load round exactly as torch rounds them.
    cast = params(load_checkpoint(ref.paths["wan"], CONFIG, dtype=jnp.bfloat16))
    np.testing.assert_array_equal(cast["['time_in']['bias'].value"].astype(np.float32),
                                  ref.wan["time_embedding.0.bias"].to(torch.bfloat16).float().numpy())


def test_lora_merges_like_torch(ref):
    model = load_checkpoint(ref.paths["wan"], CONFIG, lora=ref.paths["lora-peft"])
    diff = max_diff(forward(model, ref), ref.exact_lora)
    print(f"LoRA (PEFT dir, alpha {LORA_ALPHA}, r {LORA_RANK}): max |ours - torch-merged diffusers| = {diff:.2e}")
    assert diff <= EXACT
    # LongLive's .pt (under "generator_lora", no adapter_config): alpha from lora_alpha=, same merge.
    from_pt = params(load_checkpoint(ref.paths["pt"], CONFIG, lora=ref.paths["lora-pt"], lora_alpha=LORA_ALPHA))
    merged = params(model)
    for key in merged:
        np.testing.assert_allclose(from_pt[key], merged[key], rtol=0, atol=1e-6, err_msg=key)
    # diffusers-named factors (a pipeline LoRA: transformer.blocks.0.attn1.to_q...) merge the same.
    factors = {"A": ref.lora_a, "B": ref.lora_b}
    named = save_safetensors({f"transformer.{wan_module_to_diffusers(m)}.lora_{ab}.weight": factors[ab][m]
                              for m in LORA_MODULES for ab in "AB"}, ref.root / "lora_diffusers.safetensors")
    from_diffusers = params(load_checkpoint(ref.paths["wan"], CONFIG, lora=named, lora_alpha=LORA_ALPHA))
    for key in merged:
        np.testing.assert_allclose(from_diffusers[key], merged[key], rtol=0, atol=1e-6, err_msg=key)
    # Without an alpha the scale is 1 (alpha = r, LongLive's): half of the merged delta here.
    plain = params(load_checkpoint(ref.paths["wan"], CONFIG))
    unit = params(load_checkpoint(ref.paths["wan"], CONFIG, lora=ref.paths["lora-pt"]))
    key = "['blocks']['self_attn']['q']['kernel'].value"
    np.testing.assert_allclose(unit[key] - plain[key], (merged[key] - plain[key]) / 2, atol=1e-6)


# -- configs -----------------------------------------------------------------------------------------------


def test_config_from_config_json_and_from_shapes(ref):
    from_json = checkpoint_config(ref.paths["wan-sharded"])
    assert (from_json.name, from_json.num_layers, from_json.dim, from_json.num_heads, from_json.ffn_dim,
            from_json.latent_channels, from_json.text_dim, from_json.text_len) == (
        "custom", LAYERS, DIM, HEADS, FFN, CHANNELS, TEXT_DIM, TEXT_LEN)
    assert from_json.param_dtype == "bfloat16"  # the published networks' dtype
    assert checkpoint_config(ref.paths["diffusers"]).num_heads == HEADS
    model = load_checkpoint(ref.paths["diffusers"], dtype="float32")  # config built, not passed
    assert model.config.num_layers == LAYERS and model.config.param_dtype == "float32"
    reference = params(load_checkpoint(ref.paths["diffusers"], CONFIG))
    assert all(np.array_equal(v, reference[k]) for k, v in params(model).items())
    # A bare file without config.json: heads are Wan's 128-wide (none here: dim 24).
    with pytest.raises(CheckpointError, match="dim 24 matches no published network"):
        checkpoint_config(ref.paths["bf16"])
    # A preset name is a config too; "tiny" has an image branch and registers: refused.
    with pytest.raises(CheckpointError, match=r"config 'tiny' has image_len=4"):
        load_checkpoint(ref.paths["bf16"], "tiny")


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A valid safetensors file whose data is a hole (headers are all that config inference reads)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return path


def test_a_published_geometry_gets_its_preset(tmp_path):
    from ardiff_jax.models import dit_preset

    published = dit_preset("wan2.1-t2v-1.3b")
    path = _sparse_safetensors(tmp_path / "self_forcing_dmd.safetensors",
                               {f"model.{k}": v for k, v in wan_names(published).items()})
    config = checkpoint_config(path)
    assert config == published  # name, 60x104 latent, 12 heads (dim 1536 / 128), bf16
    assert config.name == "wan2.1-t2v-1.3b" and (config.latent_height, config.latent_width) == (60, 104)
    assert len(SafetensorsFile(path)) == 825


# -- refusals: nothing read, the names spelled out ----------------------------------------------------------


def _without(wan: dict, *names: str) -> dict:
    return {k: v for k, v in wan.items() if k not in names}


def test_missing_unexpected_and_misshaped_tensors_are_refused(ref, tmp_path, reads):
    missing = save_safetensors(_without(ref.wan, "blocks.1.cross_attn.norm_k.weight"), tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: blocks\.1\.cross_attn\.norm_k\.weight"):
        load_checkpoint(missing, CONFIG)
    extra = save_safetensors({**ref.wan, "blocks.0.extra.weight": torch.ones(3)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors: blocks\.0\.extra\.weight"):
        load_checkpoint(extra, CONFIG)
    # diffusers naming: an image-branch tensor has no counterpart, named as stored.
    image = save_safetensors({**{f"{wan_to_diffusers(k)}": v for k, v in ref.wan.items()},
                              "blocks.0.attn2.add_k_proj.weight": torch.ones(DIM, DIM)}, tmp_path / "image.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*blocks\.0\.attn2\.add_k_proj\.weight"):
        load_checkpoint(image, CONFIG)
    shaped = save_safetensors({**ref.wan, "blocks.1.self_attn.q.weight": torch.ones(DIM, 20)},
                              tmp_path / "shape.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.self_attn\.q\.weight is \[24, 20\], the model needs "
                                              r"\[24, 24\]"):
        load_checkpoint(shaped, CONFIG)
    prefixed = save_safetensors({f"model.{k}": v for k, v in _without(ref.wan, "head.head.bias").items()},
                                tmp_path / "prefixed.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: head\.head\.bias"):
        load_checkpoint(prefixed, CONFIG)
    integer = save_safetensors({**ref.wan, "head.head.bias": torch.ones(16, dtype=torch.int32)},
                               tmp_path / "int.safetensors")
    with pytest.raises(CheckpointError, match=r"non-floating-point tensors: head\.head\.bias \(int32\)"):
        load_checkpoint(integer, CONFIG)
    assert reads == {}  # refused before any tensor was read


def _corrupt(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_corrupt_and_truncated_files_are_refused(ref, tmp_path):
    good = ref.paths["bf16"].read_bytes()
    truncated = _corrupt(tmp_path / "truncated.safetensors", good[:-100])
    with pytest.raises(CheckpointError, match=r"truncated\.safetensors is not a valid safetensors file: .*truncated"):
        load_checkpoint(truncated, CONFIG)
    (length,) = struct.unpack("<Q", good[:8])
    garbage = _corrupt(tmp_path / "garbage.safetensors", good[:8] + b"{not json" + good[17:])
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors is not a valid safetensors file: it has a "
                                              r"corrupt JSON header"):
        load_checkpoint(garbage, CONFIG)
    short_header = _corrupt(tmp_path / "short.safetensors", struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(SafetensorsError, match=r"short\.safetensors .*corrupt header length"):
        SafetensorsFile(short_header)
    header = json.loads(good[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    raw = json.dumps(header).encode()
    sized = _corrupt(tmp_path / "sized.safetensors", struct.pack("<Q", len(raw)) + raw + good[8 + length:])
    with pytest.raises(SafetensorsError, match=rf"sized\.safetensors .*gives tensor '{name}'"):
        SafetensorsFile(sized)
    with pytest.raises(SafetensorsError, match=r"tiny\.safetensors .*shorter than the 8-byte header"):
        SafetensorsFile(_corrupt(tmp_path / "tiny.safetensors", b"abc"))
    # A torch file that is not one.
    with pytest.raises(CheckpointError, match=r"broken\.pt could not be read as a torch checkpoint"):
        load_checkpoint(_corrupt(tmp_path / "broken.pt", b"garbage" * 10), CONFIG)


def test_a_missing_shard_is_refused(ref, tmp_path):
    copy = shutil.copytree(ref.paths["wan-sharded"], tmp_path / "wan")
    (copy / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard file\(s\) that do not exist: "
                                              r"diffusion_pytorch_model-00002-of-00003\.safetensors \(holding "):
        load_checkpoint(copy, CONFIG)


def test_configs_that_disagree_are_refused(ref, tmp_path, reads):
    for field, value, says in (("num_layers", 3, "highest block index"), ("ffn_dim", 64, r"blocks\.0\.ffn\.0\.weight"),
                               ("text_dim", 32, r"text_embedding\.0\.weight"), ("dim", 48, r"patch_embedding\.weight"),
                               ("freq_dim", 128, r"time_embedding\.0\.weight \[24, 256\] says 256"),
                               ("latent_channels", 8, r"patch_embedding\.weight")):
        with pytest.raises(CheckpointError, match=rf"disagrees with the checkpoint .*{field} = {value} but .*{says}"):
            load_checkpoint(ref.paths["wan"], CONFIG.replace(**{field: value}))
    with pytest.raises(CheckpointError, match=r"num_heads = 4 but num_attention_heads = 2"):
        load_checkpoint(ref.paths["diffusers"], CONFIG.replace(num_heads=4))
    with pytest.raises(CheckpointError, match=r"image_len=4"):
        load_checkpoint(ref.paths["wan"], CONFIG.replace(image_len=4))
    bad_json = write_wan_dir(tmp_path / "bad_json", {}, dim=48)
    save_safetensors(ref.wan, bad_json / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match=r"config\.json disagrees with the tensors: dim = 48 but "
                                              r"patch_embedding\.weight \[24, 4, 1, 2, 2\] says 24"):
        load_checkpoint(bad_json, CONFIG)
    i2v = write_wan_dir(tmp_path / "i2v", ref.wan, model_type="i2v")
    with pytest.raises(CheckpointError, match=r"model_type 'i2v'"):
        load_checkpoint(i2v)
    assert reads == {}


def test_loras_that_do_not_fit_are_refused(ref, tmp_path, reads):
    def lora(factors: dict, name: str) -> Path:
        return save_safetensors(factors, tmp_path / name)

    a, b = torch.ones(LORA_RANK, DIM), torch.ones(DIM, LORA_RANK)
    other = lora({"base_model.model.blocks.0.self_attn.qkv.lora_A.weight": a,
                  "base_model.model.blocks.0.self_attn.qkv.lora_B.weight": b,
                  "base_model.model.blocks.7.ffn.0.lora_A.weight": a,
                  "base_model.model.blocks.7.ffn.0.lora_B.weight": b}, "other.safetensors")
    with pytest.raises(CheckpointError, match=r"targets modules this model does not have .*blocks\.0\.self_attn\.qkv, "
                                              r"blocks\.7\.ffn\.0"):
        load_checkpoint(ref.paths["wan"], CONFIG, lora=other)
    shaped = lora({"blocks.0.ffn.0.lora_A.weight": a, "blocks.0.ffn.0.lora_B.weight": b}, "shape.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.0: lora_A \[4, 24\] / lora_B \[24, 4\] do not fit its "
                                              r"weight \[32, 24\]"):
        load_checkpoint(ref.paths["wan"], CONFIG, lora=shaped)
    half = lora({"model.blocks.1.cross_attn.o.lora_A.weight": a}, "half.safetensors")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.cross_attn\.o has lora_A but not lora_B"):
        load_checkpoint(ref.paths["wan"], CONFIG, lora=half)
    stray = lora({"blocks.0.ffn.0.lora_A.weight": a, "blocks.0.ffn.0.lora_magnitude_vector": torch.ones(32)},
                 "dora.safetensors")
    with pytest.raises(CheckpointError, match=r"not LoRA factors .*blocks\.0\.ffn\.0\.lora_magnitude_vector"):
        load_checkpoint(ref.paths["wan"], CONFIG, lora=stray)
    assert reads == {}


def test_formats_are_only_unpickled_when_asked(ref, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    renamed = shutil.copy(ref.paths["pt"], tmp_path / "weights.bin")
    with pytest.raises(CheckpointError, match=r"cannot tell the format of .*weights\.bin .*pass format="):
        load_checkpoint(renamed, CONFIG)
    assert loads == []
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
    with pytest.raises(ImportError, match=r'pip install "ardiff_jax\[torch\]"'):
        load_checkpoint(renamed, CONFIG, format="pt")


# -- a mesh: parameters split over "tp" as the model's annotations say ---------------------------------------

_MESH_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax
    from jax.sharding import Mesh, PartitionSpec as P
    from safetensors.numpy import save_file
    from ardiff_jax.models import CausalDiTConfig
    from ardiff_jax.models.wan._checkpoint import load_checkpoint, wan_names
    assert len(jax.devices()) == 8, jax.devices()
    config = CausalDiTConfig(num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=8,
                             latent_width=12, text_len=8, text_dim=16, frames_per_block=3, window_frames=3)
    rng = np.random.default_rng(0)
    path = sys.argv[1]
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in wan_names(config).items()}, path)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("cfg", "tp"))
    sharded = load_checkpoint(path, config, mesh=mesh)
    plain = load_checkpoint(path, config)
    q = sharded.blocks.self_attn.q.kernel[...]
    assert q.sharding.spec == P(None, None, "tp"), q.sharding
    assert {s.data.shape for s in q.addressable_shards} == {(2, 24, 12)}
    ffn_out = sharded.blocks.ffn_out.kernel[...]
    assert ffn_out.sharding.spec == P(None, "tp", None) and ffn_out.addressable_shards[0].data.shape == (2, 16, 24)
    assert sharded.head.kernel[...].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(q), np.asarray(plain.blocks.self_attn.q.kernel[...]))
    try:
        load_checkpoint(path, config, mesh=Mesh(np.array(jax.devices()[:4]), ("tp",)))
    except ValueError as error:
        assert "cannot split 2 attention heads over tp=4" in str(error), error
    else:
        raise AssertionError("tp=4 over 2 heads was not refused")
    print("mesh ok")
""")


_MESH_RUN: dict[str, subprocess.Popen] = {}


def start_mesh_check(directory: Path) -> subprocess.Popen:
    """Run ``_MESH_SCRIPT`` on 8 virtual CPU devices (a fresh process: the flag must precede jax's start).

    Started by the ``ref`` fixture so that it runs while the other tests do.
    """
    if "process" not in _MESH_RUN:
        flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        _MESH_RUN["process"] = subprocess.Popen(
            [sys.executable, "-c", _MESH_SCRIPT, str(directory / "mesh.safetensors")], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _MESH_RUN["process"]


def test_a_mesh_splits_the_weights_over_tp(tmp_path):
    process = start_mesh_check(tmp_path)
    del _MESH_RUN["process"]
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0 and "mesh ok" in output, output[-6000:]


def test_the_readme_snippet_loads_a_checkpoint_and_generates_a_block(ref):
    """The README's three lines, run as written with the tiny checkpoint and its config in place of the real ones."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Run a published causal Wan", 1)[1]
    snippet = re.findall(r"```py\n(.*?)```", section, flags=re.DOTALL)[0]
    assert '"checkpoints/self_forcing_dmd.pt", "wan2.1-t2v-1.3b"' in snippet
    snippet = snippet.replace('"checkpoints/self_forcing_dmd.pt", "wan2.1-t2v-1.3b"', "CHECKPOINT, TINY")
    rng = np.random.default_rng(0)
    namespace = {"CHECKPOINT": str(ref.paths["pt"]), "TINY": CONFIG,
                 "prompt_embeds": rng.standard_normal((5, TEXT_DIM)).astype(np.float32)}
    exec(compile(snippet, "README.md", "exec"), namespace)
    block = namespace["block"]
    assert block.latents.shape == (3, CHANNELS, HEIGHT, WIDTH)
    assert np.isfinite(np.asarray(block.latents)).all()
