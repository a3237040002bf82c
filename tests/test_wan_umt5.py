"""umT5, Wan's text encoder, in Flax NNX (``ardiff_jax.models.wan._umt5``) against transformers.

No weights can be downloaded here, so the encoder is proven on a tiny random
``transformers.UMT5EncoderModel`` (umT5's 32 buckets / max distance 128, every parameter
re-randomised, the relative-position tables included) written in each real format with the
real names: transformers' ``save_pretrained`` directory (``shared.weight`` only), a sharded
diffusers-style directory storing both embeddings, a bare ``.safetensors`` with
``encoder.embed_tokens.weight`` only, Wan's ``.pth`` naming (float32, bf16 inside a Wan model
directory, and wrapped under a top-level key with a prefix). Each load runs a padded batch
(two prompts of different lengths, an attention mask) against transformers' forward, with
the padded rows zeroed as Wan does. The parameters are bf16-representable, so the bf16
file loaded in float32 is the same network.

The tokenizer is a tiny Unigram ``tokenizer.json`` built here in umT5's layout (``<pad>`` 0,
``</s>`` 1, ``<unk>`` 2, Metaspace, ``$A </s>`` post-processor); its ids are compared with
transformers' tokenizers called as Wan calls them (``padding="max_length", truncation=True``).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ardiff_jax.models.wan._checkpoint import CheckpointError  # noqa: E402
from ardiff_jax.models.wan._umt5 import (  # noqa: E402
    WAN_UMT5_FILE,
    UMT5Config,
    UMT5Encoder,
    WanTextEncoder,
    clean_prompt,
    load_umt5,
    relative_position_buckets,
    umt5_config,
    umt5_names,
)

CONFIG = UMT5Config.tiny()  # d_model 32, d_ff 48, 4 heads x 8, 2 layers, 32 buckets / 128, vocab 300
SEQ = 40  # long enough to reach umT5's logarithmic buckets (offsets 8+, boundaries at 16 and 32)
LENGTHS = (17, 40)
TEXT_LEN = 16
EXACT = 1e-5  # float32 parity with transformers (measured ~3e-6 on outputs of magnitude ~4)
BF16_RELATIVE = 0.05  # bf16 parameters and matmuls vs the float32 reference, relative to max |reference|

# Wan's names <- transformers' (written out independently of the loader).
_WAN_FROM_HF = {
    "layer.0.layer_norm": "norm1", "layer.0.SelfAttention.q": "attn.q", "layer.0.SelfAttention.k": "attn.k",
    "layer.0.SelfAttention.v": "attn.v", "layer.0.SelfAttention.o": "attn.o",
    "layer.0.SelfAttention.relative_attention_bias": "pos_embedding.embedding",
    "layer.1.layer_norm": "norm2", "layer.1.DenseReluDense.wi_0": "ffn.gate.0",
    "layer.1.DenseReluDense.wi_1": "ffn.fc1", "layer.1.DenseReluDense.wo": "ffn.fc2",
}


def _wan_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"token_embedding.weight": hf_state["shared.weight"]}
    for i in range(CONFIG.num_layers):
        for theirs, ours in _WAN_FROM_HF.items():
            out[f"blocks.{i}.{ours}.weight"] = hf_state[f"encoder.block.{i}.{theirs}.weight"]
    out["norm.weight"] = hf_state["encoder.final_layer_norm.weight"]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, mask):
    return nnx.merge(graphdef, state)(ids, mask)


def _run(encoder: UMT5Encoder, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The encoder on a padded batch, padded rows zeroed (as Wan); one compile per config."""
    graphdef, state = nnx.split(encoder)
    return np.asarray(_forward(graphdef, state, ids, mask)) * mask[..., None]


class Reference:
    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        hf_config = transformers.UMT5Config(
            vocab_size=CONFIG.vocab_size, d_model=CONFIG.d_model, d_ff=CONFIG.d_ff, d_kv=CONFIG.d_kv,
            num_heads=CONFIG.num_heads, num_layers=CONFIG.num_layers,
            relative_attention_num_buckets=CONFIG.num_buckets, relative_attention_max_distance=CONFIG.max_distance,
            feed_forward_proj="gated-gelu", dropout_rate=0.0, attn_implementation="eager")
        model = transformers.UMT5EncoderModel(hf_config).eval()
        assert model.encoder.embed_tokens.weight is model.shared.weight  # tied in memory
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "layer_norm" in name:
                    value = 1.0 + 0.3 * torch.randn_like(param)
                elif "relative_attention_bias" in name:
                    value = 2.0 * torch.randn_like(param)  # large enough that a wrong bucket shows
                elif name == "shared.weight":
                    value = torch.randn_like(param)
                else:
                    value = torch.randn_like(param) * param.shape[-1] ** -0.5
                # bf16-representable, so the bf16 file holds the same network
                param.copy_(value.to(torch.bfloat16).to(torch.float32))
        self.model = model
        rng = np.random.default_rng(0)
        self.ids = rng.integers(3, CONFIG.vocab_size, (len(LENGTHS), SEQ)).astype(np.int32)
        self.mask = (np.arange(SEQ)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int32)
        self.ids[self.mask == 0] = 0  # <pad>
        self.output = self.forward(self.ids, self.mask)

        hf_state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        wan = _wan_state(hf_state)
        self.paths: dict[str, Path] = {}
        # transformers' own save: config.json + model.safetensors with shared.weight only.
        model.save_pretrained(root / "hf")
        self.paths["hf"] = root / "hf"
        # diffusers-style: both embeddings stored, two shards, tie_word_embeddings false.
        sharded = root / "hf_sharded"
        sharded.mkdir()
        names = sorted(hf_state)
        first = [n for n in names if n in ("shared.weight", "encoder.embed_tokens.weight") or ".block.0." in n]
        shards = {"model-00001-of-00002.safetensors": first,
                  "model-00002-of-00002.safetensors": [n for n in names if n not in first]}
        for shard, members in shards.items():
            safetensors_torch.save_file({n: hf_state[n] for n in members}, sharded / shard)
        (sharded / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: s for s, members in shards.items() for n in members}}))
        config_json = json.loads((root / "hf" / "config.json").read_text())
        (sharded / "config.json").write_text(json.dumps({**config_json, "tie_word_embeddings": False}))
        self.paths["hf_sharded"] = sharded
        self.hf_json = config_json
        # a bare file with encoder.embed_tokens.weight and no shared.weight
        bare = {("encoder.embed_tokens.weight" if n == "shared.weight" else n): t for n, t in hf_state.items()
                if n != "encoder.embed_tokens.weight"}
        safetensors_torch.save_file(bare, root / "embed_tokens.safetensors")
        self.paths["embed_tokens"] = root / "embed_tokens.safetensors"
        # Wan's naming: a float32 .pth; the bf16 file inside a Wan model directory; one wrapped
        torch.save(wan, root / "wan.pth")
        self.paths["wan"] = root / "wan.pth"
        (root / "wan_dir").mkdir()
        torch.save({k: v.to(torch.bfloat16) for k, v in wan.items()}, root / "wan_dir" / WAN_UMT5_FILE)
        self.paths["wan_dir_bf16"] = root / "wan_dir"
        torch.save({"state_dict": {f"module.{k}": v for k, v in wan.items()}, "step": torch.tensor(3)},
                   root / "wrapped.pth")
        self.paths["wrapped"] = root / "wrapped.pth"
        self.wan_state = wan
        self.hf_state = hf_state
        self.root = root

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(ids).long(),
                             attention_mask=torch.from_numpy(mask).long()).last_hidden_state
        return out.numpy() * mask[..., None]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("umt5"))


@pytest.fixture(scope="module")
def encoder(ref) -> UMT5Encoder:
    return load_umt5(ref.paths["hf"], device="host")


# -- architecture pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets,distance", [(32, 128), (32, 64), (16, 40), (8, 20)])
def test_relative_position_buckets_match_transformers(buckets, distance):
    config = transformers.UMT5Config(relative_attention_num_buckets=buckets, relative_attention_max_distance=distance,
                                     num_heads=1, d_model=8, d_kv=8)
    attention = transformers.models.umt5.modeling_umt5.UMT5Attention(config, has_relative_attention_bias=True)
    offsets = np.arange(-1100, 1101)
    theirs = attention._relative_position_bucket(torch.from_numpy(offsets)).numpy()
    np.testing.assert_array_equal(relative_position_buckets(offsets, buckets, distance), theirs)


def test_xxl_geometry():
    """umT5-XXL: 5.7B parameters; 242 tensors in Wan's state dict (10 per layer + embedding + norm)."""
    config = UMT5Config()
    assert (config.inner_dim, config.d_ff, config.num_layers, config.num_buckets) == (4096, 10240, 24, 32)
    abstract = nnx.eval_shape(lambda: UMT5Encoder(config, rngs=nnx.Rngs(0)))
    assert abstract.num_params == 5_680_910_336  # 256384*4096 + 24*(4*4096^2 + 3*4096*10240 + 32*64 + 2*4096) + 4096
    names = umt5_names(config)
    assert len(names) == 242 and names["blocks.23.pos_embedding.embedding.weight"] == (32, 64)
    assert names["blocks.0.ffn.gate.0.weight"] == (10240, 4096) and names["token_embedding.weight"] == (256384, 4096)
    with pytest.raises(ValueError, match="max_distance"):
        UMT5Config(num_buckets=32, max_distance=8)


# -- every format against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["hf", "hf_sharded", "embed_tokens", "wan", "wan_dir_bf16", "wrapped"])
def test_load_matches_transformers(ref, variant):
    dtype = "float32" if variant == "wan_dir_bf16" else None
    loaded = load_umt5(ref.paths[variant], dtype=dtype, device="host")
    assert loaded.config == CONFIG
    assert {d for leaf in jax.tree_util.tree_leaves(nnx.state(loaded)) for d in leaf.devices()} == {
        jax.devices("cpu")[0]}
    out = _run(loaded, ref.ids, ref.mask)
    diff = float(np.abs(out - ref.output).max())
    print(f"umT5 {variant}: max abs diff vs transformers {diff:.2e} (outputs up to {np.abs(ref.output).max():.2f})")
    assert diff <= EXACT
    assert not np.any(out[0, LENGTHS[0]:])


def test_single_sequence_and_config_inference(ref, encoder):
    """``i32[N]`` without a batch axis; configs inferred from each file (dtype from the stored embedding)."""
    n = LENGTHS[0]
    single = np.asarray(encoder(ref.ids[0, :n]))  # no mask: all real
    np.testing.assert_allclose(single, ref.output[0, :n], atol=EXACT, rtol=0)
    assert umt5_config(ref.paths["wan"]) == CONFIG
    assert umt5_config(ref.paths["wan_dir_bf16"]) == CONFIG.replace(dtype="bfloat16", param_dtype="bfloat16")
    assert umt5_config(ref.paths["hf_sharded"]) == CONFIG


def test_bf16_close_to_float32(ref):
    """Wan's bf16 file run in bf16 (the inferred config): within a few percent of the float32 reference."""
    loaded = load_umt5(ref.paths["wan_dir_bf16"], device="host")
    assert loaded.config.dtype == "bfloat16" and loaded.token_embedding[...].dtype == jax.numpy.bfloat16
    out = _run(loaded, ref.ids, ref.mask)
    relative = float(np.abs(out - ref.output).max() / np.abs(ref.output).max())
    print(f"umT5 bf16 vs float32 transformers: max abs diff / max |ref| = {relative:.2e}")
    assert relative <= BF16_RELATIVE


# -- refusals -----------------------------------------------------------------------------------------


def _write(root: Path, name: str, state: dict[str, torch.Tensor]) -> Path:
    path = root / name
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


def test_refusals_name_the_tensors(ref, monkeypatch):
    placed = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: placed.append(1) or real_put(*a, **k))
    root, wan = ref.root, ref.wan_state

    missing = _write(root, "missing.safetensors", {k: v for k, v in wan.items() if k != "blocks.1.ffn.fc1.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensors: blocks\.1\.ffn\.fc1\.weight"):
        load_umt5(missing)
    extra = _write(root, "extra.safetensors", {**wan, "blocks.0.attn.extra.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors: blocks\.0\.attn\.extra\.weight"):
        load_umt5(extra)
    shaped = _write(root, "shaped.safetensors", {**wan, "blocks.1.pos_embedding.embedding.weight": torch.zeros(16, 4)})
    with pytest.raises(CheckpointError, match=r"blocks\.1\.pos_embedding\.embedding\.weight is \[16, 4\], the "
                                              r"encoder needs \[32, 4\]"):
        load_umt5(shaped)
    with pytest.raises(CheckpointError, match=r"d_ff = 64 but blocks\.0\.ffn\.fc1\.weight"):
        load_umt5(ref.paths["wan"], CONFIG.replace(d_ff=64))
    with pytest.raises(CheckpointError, match="max_distance = 64 but relative_attention_max_distance = 128"):
        load_umt5(ref.paths["hf"], CONFIG.replace(max_distance=64))

    untied = {**ref.hf_state, "encoder.embed_tokens.weight": ref.hf_state["shared.weight"] + 1.0}
    with pytest.raises(CheckpointError, match="two different token embeddings"):
        load_umt5(_write(root, "untied.safetensors", untied))
    decoder = {**ref.hf_state, "decoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(32, 32)}
    with pytest.raises(CheckpointError, match="full encoder-decoder"):
        load_umt5(_write(root, "seq2seq.safetensors", decoder))

    bad_json = root / "bad_json"
    shutil.copytree(ref.paths["hf"], bad_json)
    (bad_json / "config.json").write_text(json.dumps({**ref.hf_json, "num_heads": 8}))
    with pytest.raises(CheckpointError, match=r"num_heads = 8 but .*relative_attention_bias"):
        load_umt5(bad_json)
    (bad_json / "config.json").write_text(json.dumps({**ref.hf_json, "model_type": "t5"}))
    with pytest.raises(CheckpointError, match="not 'umt5'"):
        load_umt5(bad_json)
    truncated = root / "truncated.safetensors"
    truncated.write_bytes((ref.paths["embed_tokens"]).read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_umt5(truncated)
    assert not placed  # every refusal came before anything was placed


# -- prompts -> embeddings ------------------------------------------------------------------------------

_WORDS = ["a", "cat", "dog", "surf", "ing", "on", "the", "wave", "and", "under", "sun", "red", "blue"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz&"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    """A tiny umT5-shaped Unigram tokenizer.json: <pad> 0, </s> 1, <unk> 2, Metaspace, ``$A </s>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -3.0 - 0.1 * i) for i, w in enumerate(_WORDS)] + [("ing", -6.0), ("s", -6.5)]
    vocab += [(c, -8.0) for c in _LETTERS if c != "s"] + [("▁" + c, -9.0) for c in _LETTERS if c not in _WORDS]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


PROMPTS = ["a cat surfing a wave", "  A  cat\n\ton &amp;amp; the   wave  ", "red " * 30, "", "über the sun"]


def test_clean_prompt():
    assert clean_prompt("  a  &amp;amp;\n\n b\t c ") == "a & b c"
    assert clean_prompt("&lt;b&gt;") == "<b>"


def test_tokenizer_matches_transformers(encoder, tokenizer_path):
    """Our ids = transformers' fast tokenizer (as Wan's AutoTokenizer) and T5Tokenizer, called as Wan calls them."""
    text = WanTextEncoder(encoder, tokenizer_path, text_len=TEXT_LEN)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>")
    t5 = transformers.T5Tokenizer(tokenizer_file=str(tokenizer_path), extra_ids=0)
    for prompt in PROMPTS:
        ids = text.tokenize(prompt)
        assert ids[-1] == 1 and len(ids) <= TEXT_LEN  # </s> last, truncated to text_len
        for theirs in (fast, t5):
            batch = theirs([clean_prompt(prompt)], padding="max_length", truncation=True, max_length=TEXT_LEN)
            length = sum(batch["attention_mask"][0])
            assert ids.tolist() == batch["input_ids"][0][:length], (prompt, theirs)
    assert len(text.tokenize("red " * 30)) == TEXT_LEN
    assert text.tokenize("").tolist() == [1]
    assert text.tokenize(PROMPTS[1]).tolist() == text.tokenize("A cat on & the wave").tolist()


def test_encode_matches_transformers_and_caches(ref, encoder, tokenizer_path):
    text = WanTextEncoder(encoder, tokenizer_path.parent, text_len=TEXT_LEN, cache_size=3)  # a directory works too
    worst = 0.0
    for prompt in PROMPTS:
        ids = text.tokenize(prompt)
        length = len(ids)
        padded_ids = np.zeros((1, TEXT_LEN), np.int32)
        padded_ids[0, :length] = ids
        mask = (np.arange(TEXT_LEN) < length).astype(np.int32)[None]
        expected = ref.forward(padded_ids, mask)[0]
        embeds, padded = text.encode(prompt), text.encode_padded(prompt)
        assert embeds.shape == (length, CONFIG.d_model) and embeds.dtype == np.float32
        assert padded.shape == (TEXT_LEN, CONFIG.d_model) and not np.any(padded[length:])
        worst = max(worst, float(np.abs(padded - expected).max()))
        np.testing.assert_array_equal(embeds, padded[:length])
    print(f"WanTextEncoder vs transformers: max abs diff {worst:.2e}")
    assert worst <= EXACT
    assert text.traces == 1  # one program for every prompt length
    # The cache: five prompts through a 3-entry LRU; the last three are held.
    assert text.cache_info() == {"hits": len(PROMPTS), "misses": len(PROMPTS), "size": 3, "maxsize": 3}
    first = text.encode(PROMPTS[-1])
    assert text.encode(PROMPTS[-1]) is first and text.cache_info()["misses"] == len(PROMPTS)
    with pytest.raises(ValueError):
        first[0, 0] = 1.0  # read-only: a caller cannot corrupt the cache
    text.encode(PROMPTS[0])  # evicted earlier: recomputed, same values, no new compile
    assert text.cache_info()["misses"] == len(PROMPTS) + 1 and text.traces == 1


def test_from_checkpoint_and_tokenizer_refusals(ref, encoder, tokenizer_path, tmp_path):
    from tokenizers import Tokenizer, models

    text = WanTextEncoder.from_checkpoint(ref.paths["wan"], tokenizer_path, device="host", text_len=TEXT_LEN)
    assert text.encoder.config == CONFIG and "text_len=16" in repr(text)

    bare = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"no </s> and no <pad>"):
        WanTextEncoder(encoder, tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError):
        WanTextEncoder(encoder, tmp_path / "absent.json")
