"""The CLIP image encoder (open-clip ViT-H/14 layout, penultimate block) equals transformers' CLIPVisionModel.

A tiny random ``CLIPVisionModel`` (pre-LN, exact GELU, class token, learned positions, as
open-clip ViT-H) is the reference: our encoder loaded from its weights (transformers names)
and from the same weights under the original ``.pth``'s names (``visual.*``, fused qkv)
must give its ``hidden_states[-2]``; the release's preprocessing (torch bicubic resize to
the model's size, CLIP normalisation) is compared with torch's ``F.interpolate``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp

from ardiff_jax.models.matrix_game import (
    CLIP_MEAN,
    CLIP_STD,
    ClipVisionConfig,
    bicubic_matrix,
    clip_vision_names,
    load_clip_vision,
)

CONFIG = ClipVisionConfig(image_size=28, patch_size=14, dim=32, heads=4, layers=3, output_blocks=2)
#: Relative to the largest output (18 here); measured 9e-7 (1.6e-5 absolute).
EXACT = 4e-6


@pytest.fixture(scope="module")
def ref():
    hf_config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=3,
                                              num_attention_heads=4, image_size=28, patch_size=14, hidden_act="gelu",
                                              layer_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.CLIPVisionModel(hf_config).eval()
    gen = torch.Generator().manual_seed(1)
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith("position_ids"):
            state[name] = value
            continue
        noise = torch.randn(value.shape, generator=gen)
        state[name] = 1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise
    model.load_state_dict(state)
    image = torch.rand(3, 40, 52, generator=gen) * 2 - 1
    resized = torch.nn.functional.interpolate(image[None], size=(28, 28), mode="bicubic", align_corners=False)
    pixels = (resized * 0.5 + 0.5 - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]
    with torch.no_grad():
        out = model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][0].numpy()
    return state, image.numpy(), pixels.numpy(), resized.numpy(), out


def _wan_names(state):
    """The same weights under the original open-clip names (Wan's clip.py): fused qkv, visual.* prefix."""
    out = {"visual.patch_embedding.weight": state["embeddings.patch_embedding.weight"],
           "visual.cls_embedding": state["embeddings.class_embedding"].reshape(1, 1, -1),
           "visual.pos_embedding": state["embeddings.position_embedding.weight"][None],
           "visual.pre_norm.weight": state["pre_layrnorm.weight"],
           "visual.pre_norm.bias": state["pre_layrnorm.bias"],
           "visual.post_norm.weight": state["post_layernorm.weight"], "log_scale": torch.ones(())}
    for i in range(3):
        h, w = f"encoder.layers.{i}.", f"visual.transformer.{i}."
        for leaf in ("weight", "bias"):
            out[w + "attn.to_qkv." + leaf] = torch.cat([state[f"{h}self_attn.{x}_proj.{leaf}"] for x in "qkv"])
            out[w + "attn.proj." + leaf] = state[f"{h}self_attn.out_proj.{leaf}"]
            out[w + "norm1." + leaf] = state[f"{h}layer_norm1.{leaf}"]
            out[w + "norm2." + leaf] = state[f"{h}layer_norm2.{leaf}"]
            out[w + "mlp.0." + leaf] = state[f"{h}mlp.fc1.{leaf}"]
            out[w + "mlp.2." + leaf] = state[f"{h}mlp.fc2.{leaf}"]
    out["textual.token_embedding.weight"] = torch.zeros(4, 4)  # the text tower is skipped
    return {k: v.numpy() for k, v in out.items()}


def test_penultimate_block_tokens_equal_transformers(ref):
    state, image, pixels, _, expected = ref
    for source in ({k: v.numpy() for k, v in state.items()}, _wan_names(state)):
        encoder = load_clip_vision(source, CONFIG)
        got = np.asarray(encoder(jnp.asarray(pixels)))[0]
        assert got.shape == (5, 32)
        scale = float(np.abs(expected).max())
        assert float(np.abs(got - expected).max()) < EXACT * scale
        print(f"CLIP vision vs transformers: max |diff| = {float(np.abs(got - expected).max()):.3g} "
              f"(outputs up to {scale:.3g})")
        # The release's preprocessing from a [-1, 1] frame of any size.
        preprocessed = np.asarray(encoder.encode_image(jnp.asarray(image)))
        assert float(np.abs(preprocessed - expected).max()) < 10 * EXACT * scale


def test_bicubic_resize_is_torchs(ref):
    _, image, _, resized, _ = ref
    ours = np.einsum("oh,chw,pw->cop", bicubic_matrix(40, 28), image, bicubic_matrix(52, 28))
    assert float(np.abs(ours - resized[0]).max()) < 1e-5
    up = torch.nn.functional.interpolate(torch.from_numpy(image)[None], size=(64, 80), mode="bicubic",
                                         align_corners=False)[0].numpy()
    ours_up = np.einsum("oh,chw,pw->cop", bicubic_matrix(40, 64), image, bicubic_matrix(52, 80))
    assert float(np.abs(ours_up - up).max()) < 1e-5


def test_checkpoints_that_do_not_fit_are_refused(ref):
    state = {k: v.numpy() for k, v in ref[0].items()}
    del state["encoder.layers.1.mlp.fc1.bias"]
    with pytest.raises(ValueError, match="missing tensors: encoder.layers.1.mlp.fc1.bias"):
        load_clip_vision(state, CONFIG)
    wan = _wan_names(ref[0])
    wan["visual.transformer.0.attn.proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"attn.proj.weight is \[3, 3\], needs \[32, 32\]"):
        load_clip_vision(wan, CONFIG)
    names = clip_vision_names(ClipVisionConfig())
    assert names["visual.pos_embedding"] == (1, 257, 1280) and "visual.transformer.30.mlp.0.weight" in names
    assert "visual.transformer.31.mlp.0.weight" not in names  # the last block's output is never read
