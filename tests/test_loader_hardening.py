"""What a hostile or careless checkpoint cannot do to the loaders (Wan DiT, LoRA, umT5, VAE, CLIP, side files).

Every file here is tiny and written in the real formats (safetensors, ``torch.save``, JSON);
no model is downloaded and nothing needs diffusers.

* Memory is bounded by the file: a ``.pt`` of stride-0 (``expand``-ed) or overlapping views
  is refused before it can expand (it used to load as a large network from a few KB), and a
  safetensors header larger than the expected tensors can need is refused before it is parsed.
* Side files (config.json, shard indexes, adapter_config.json, tokenizer.json) and weight
  files must be regular files of bounded size: a FIFO is refused without blocking, a device
  or a directory without reading, deep nesting and NaN/Infinity without a bare error.
* A LoRA whose alpha or factors are not finite, whose merge could overflow, that names a factor
  twice, has integer factors or rank 0 is refused by name before anything is merged or placed.
* Float and integer config fields (Wan ``eps``, the VAE's latent statistics, umT5's
  ``layer_norm_epsilon``) are refused when non-finite, non-positive, bool or not numbers.
* A shard index names only files of its own directory (no ``..``, absolute paths or symlinks
  out, the Hugging Face cache's blob symlinks aside), and no error quotes a file's bytes.
* Fuzz (hypothesis): random safetensors headers, ``.pt`` strides and config.json values either
  load exactly or raise ``CheckpointError`` naming the file, and never place more than a few
  times the file's bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import threading
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from safetensors.numpy import save_file  # noqa: E402

from ardiff_jax._files import MAX_JSON_BYTES, read_json_file  # noqa: E402
from ardiff_jax.models import CausalDiTConfig  # noqa: E402
from ardiff_jax.models.matrix_game._clip import load_clip_vision  # noqa: E402
from ardiff_jax.models.wan._checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    wan_names,
)
from ardiff_jax.models.wan._safetensors import SafetensorsError, SafetensorsFile  # noqa: E402
from ardiff_jax.models.wan._umt5 import UMT5Config, WanTextEncoder, load_umt5, umt5_names  # noqa: E402
from ardiff_jax.models.wan._vae import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, WanVAEConfig, load_vae  # noqa: E402

CONFIG = CausalDiTConfig(num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=8,
                         latent_width=12, text_len=8, text_dim=16, frames_per_block=3, window_frames=3, freq_dim=32)
NAMES = wan_names(CONFIG)
WAN_JSON = {"_class_name": "WanModel", "dim": 24, "eps": 1e-6, "ffn_dim": 32, "freq_dim": 32, "in_dim": 4,
            "model_type": "t2v", "num_heads": 2, "num_layers": 2, "out_dim": 4, "text_len": 8, "text_dim": 16,
            "patch_size": [1, 2, 2]}


class Literal(str):
    """A JSON token written as is (``1e999``: Python's json would write ``Infinity``)."""


def _dumps(data: dict) -> str:
    """JSON of ``data`` with :class:`Literal` values (also inside lists) written as their text."""
    literals = {}

    def mark(value):
        if isinstance(value, Literal):
            literals[f"__literal_{len(literals)}__"] = str(value)
            return f"__literal_{len(literals) - 1}__"
        return [mark(v) for v in value] if isinstance(value, list) else value

    text = json.dumps({k: mark(v) for k, v in data.items()})
    for marker, literal in literals.items():
        text = text.replace(f'"{marker}"', literal)
    return text


def _tensors(seed: int = 0, names: dict | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in (names or NAMES).items()}


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return _tensors()


def _wan_dir(path: Path, weights: dict, **fields) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**WAN_JSON, **fields}))
    save_file(weights, str(path / "diffusion_pytorch_model.safetensors"))
    return path


@pytest.fixture
def placed(monkeypatch) -> list[int]:
    """Bytes of every host array put on a device during the test."""
    sizes: list[int] = []
    real = jax.device_put

    def spy(x, *args, **kwargs):
        sizes.append(int(getattr(x, "nbytes", 0)))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    return sizes


def _peak(fn) -> tuple[object, int]:
    """``(fn()'s result or the exception it raised, peak traced bytes)``."""
    tracemalloc.start()
    try:
        try:
            result: object = fn()
        except Exception as error:  # noqa: BLE001 - returned for the caller to check
            result = error
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _without_blocking(fn, *fifos: Path, timeout: float = 60.0):
    """``fn()``'s result (or exception) run in a thread; fails if it blocks (then unblocks it: a FIFO is opened
    for writing and closed, giving the blocked reader its end of file)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed back
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    blocked = worker.is_alive()
    while worker.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        worker.join(1)
    assert not blocked, f"reading {[str(f) for f in fifos]} blocked"
    return outcome[0]


def _params(model) -> dict[str, np.ndarray]:
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


# -- 5. memory bounded by the file ----------------------------------------------------------------------


def test_a_stride0_pt_is_refused_before_it_expands(tmp_path):
    # The shapes of a 1.3B-parameter Wan, every tensor torch.zeros(1).expand(shape): a few KB on disk. It used
    # to be taken for wan2.1-t2v-1.3b and materialised (gigabytes); now refused from the strides alone.
    from ardiff_jax.models import dit_preset

    big = {f"model.{k}": torch.zeros(1).expand(*s) for k, s in wan_names(dit_preset("wan2.1-t2v-1.3b")).items()}
    path = tmp_path / "expanded.pt"
    torch.save({"generator": big}, path)
    assert path.stat().st_size < 2**20
    result, peak = _peak(lambda: checkpoint_config(path))
    assert isinstance(result, CheckpointError), result
    assert "expanded.pt holds tensors whose data the file does not store" in str(result)
    assert "stride-0 (expanded) or overlapping view" in str(result)
    assert peak < 64 * 2**20, peak


def test_an_expanded_pt_for_the_given_config_is_refused_before_anything_is_placed(tmp_path, weights, placed):
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    state["blocks.1.ffn.0.weight"] = torch.zeros(1).expand(*NAMES["blocks.1.ffn.0.weight"])
    path = tmp_path / "one_expanded.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\.0\.weight is a stride-0 \(expanded\)"):
        load_checkpoint(path, CONFIG)
    assert placed == []
    # A transposed (non-contiguous but storage-backed) view is an ordinary tensor: it loads, exactly.
    state["blocks.1.ffn.0.weight"] = torch.from_numpy(np.ascontiguousarray(weights["blocks.1.ffn.0.weight"].T)).T
    torch.save(state, path)
    model = load_checkpoint(path, CONFIG)
    np.testing.assert_array_equal(np.asarray(model.blocks.ffn_in.kernel[...])[1], weights["blocks.1.ffn.0.weight"].T)


def test_views_sharing_one_storage_cannot_span_more_than_the_file(tmp_path):
    # Every tensor a (plain, in-bounds) view of the same 1 MB storage: each alone is fine, together they
    # would load 60 MB of network from a 1 MB file.
    config = CONFIG.replace(num_layers=4, dim=256, ffn_dim=1024, num_heads=4)
    names = wan_names(config)
    storage = torch.zeros(max(math.prod(s) for s in names.values()))
    shared = {k: storage[: math.prod(s)].view(*s) for k, s in names.items()}
    path = tmp_path / "shared.pt"
    torch.save(shared, path)
    assert path.stat().st_size < 2 * 2**20
    with pytest.raises(CheckpointError, match=r"shared\.pt: its tensors span \d+ bytes but the file holds only"):
        checkpoint_config(path)


def _raw_safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_header_larger_than_the_expected_tensors_need_is_refused_before_it_is_parsed(tmp_path, weights):
    # 12 MB of header (the format allows 100 MB) for one tensor: parsing such a header costs ~15x its size.
    header = {"__metadata__": {"pad": "x" * (12 * 2**20)}, "patch_embedding.bias": {
        "dtype": "F32", "shape": [24], "data_offsets": [0, 96]}}
    path = _raw_safetensors(tmp_path / "padded.safetensors", header, bytes(96))
    result, peak = _peak(lambda: checkpoint_config(path))
    assert isinstance(result, CheckpointError), result
    assert "declares a header longer than the" in str(result) and "bytes the tensors this loader expects" in str(
        result)
    assert peak < 2**20, peak  # 8 bytes read, nothing parsed
    # With the config known, the bound is the config's tensor count: a 2 MB header is already too much.
    header["__metadata__"]["pad"] = "x" * (2 * 2**20)
    _raw_safetensors(path, header, bytes(96))
    with pytest.raises(CheckpointError, match="bytes the tensors this loader expects can need"):
        load_checkpoint(path, CONFIG)
    # Real files are far inside the bound: the tiny network's header is 6 KB.
    good = tmp_path / "good.safetensors"
    save_file(weights, str(good))
    assert load_checkpoint(good, CONFIG).config == CONFIG


def _zero_size_entries(path: Path, count: int) -> Path:
    """A safetensors file of ``count`` zero-size F32 entries (the cheapest header entry there is)."""
    body = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(count))
    raw = ("{" + body + "}").encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


def test_a_header_with_too_many_entries_is_refused_before_they_are_all_built(tmp_path, monkeypatch):
    """Issue 43 item 11: a 90 MB header of 1.4M zero-size entries cost 1.3 GB and 15 s to open. The parser
    now stops at the entry limit: with the limit at 50, a 20,000-entry header is refused having built ~50."""
    import ardiff_jax._checkpoint_files as files

    path = _zero_size_entries(tmp_path / "many.safetensors", 20_000)
    header_bytes = path.stat().st_size
    monkeypatch.setattr(files, "MAX_HEADER_TENSORS", 50)
    result, peak = _peak(lambda: SafetensorsFile(path))
    assert isinstance(result, CheckpointError), result  # SafetensorsError is a CheckpointError
    assert "many.safetensors" in str(result) and "more than 50 entries" in str(result), result
    # The raw header and its decoded text (2x its size), not 20,000 parsed entries (~20x).
    assert peak < 4 * header_bytes, (peak, header_bytes)
    monkeypatch.undo()
    # At the real limit, far above any checkpoint (Wan 14B ~1100 tensors, a VLA ~3000).
    path = _zero_size_entries(tmp_path / "limit.safetensors", files.MAX_HEADER_TENSORS + 1)
    with pytest.raises(CheckpointError, match=rf"limit\.safetensors .*has {files.MAX_HEADER_TENSORS + 1} entries"):
        SafetensorsFile(path)
    assert len(SafetensorsFile(_zero_size_entries(tmp_path / "real.safetensors", 3000))) == 3000


@pytest.mark.parametrize("dtype, shape", [("F32", [0, 2**63]), ("U8", [0, 2**63]), ("F32", [0, 2**62, 4]),
                                          ("BF16", [2**40, 0, 2**40])])
def test_a_zero_size_tensor_no_array_can_have_is_a_checkpoint_error_naming_the_file(tmp_path, dtype, shape):
    """Issue 43 item 11: shape [0, 2**63] holds no bytes, so the offsets agree with it; numpy then refused it
    with a bare ValueError when the tensor was read. It is refused with the header, naming the file."""
    path = _raw_safetensors(tmp_path / "huge.safetensors", {"t": {"dtype": dtype, "shape": shape,
                                                                  "data_offsets": [0, 0]}})
    with pytest.raises(CheckpointError, match=r"huge\.safetensors .*shape .* for tensor 't'.*beyond what an array"):
        SafetensorsFile(path).read("t")
    # The largest such shape numpy can make is still read (as an empty array).
    fine = [0, (2**63 - 1) // np.dtype(np.float32).itemsize]
    path = _raw_safetensors(tmp_path / "fine.safetensors", {"t": {"dtype": "F32", "shape": fine,
                                                                  "data_offsets": [0, 0]}})
    assert SafetensorsFile(path).read("t").shape == tuple(fine)


# -- 6. side files and weight files are regular files of bounded size --------------------------------------


def test_clip_files_are_read_lazily_and_checked_like_the_other_loaders(tmp_path):
    # The CLIP loader used to materialise every tensor of the file (the unused text tower included) in
    # float32 before checking a name; now headers first, then only the tensors used, each storage-backed.
    from ardiff_jax.models.matrix_game._clip import ClipVisionConfig, clip_vision_names

    config = ClipVisionConfig(image_size=28, patch_size=14, dim=32, heads=4, layers=3, output_blocks=2)
    arrays = _tensors(4, clip_vision_names(config, "wan"))
    arrays["textual.token_embedding.weight"] = np.zeros((4, 4), np.float32)  # skipped: never read
    from_dict = _params(load_clip_vision(arrays, config))
    save_file(arrays, str(tmp_path / "clip.safetensors"))
    torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, tmp_path / "clip.pth")
    for path in (tmp_path / "clip.safetensors", tmp_path / "clip.pth"):
        loaded = _params(load_clip_vision(path, config))
        assert loaded.keys() == from_dict.keys()
        for key in from_dict:
            np.testing.assert_array_equal(loaded[key], from_dict[key], err_msg=f"{path.name} {key}")
    expanded = {k: torch.from_numpy(v) for k, v in arrays.items()}
    expanded["visual.transformer.0.mlp.0.weight"] = torch.zeros(1).expand(128, 32)
    torch.save(expanded, tmp_path / "expanded.pth")
    with pytest.raises(CheckpointError, match=r"expanded\.pth holds tensors whose data the file does not store: "
                                              r"visual\.transformer\.0\.mlp\.0\.weight is a stride-0"):
        load_clip_vision(tmp_path / "expanded.pth", config)
    arrays["visual.pre_norm.bias"] = np.ones(32, np.int32)
    save_file(arrays, str(tmp_path / "int.safetensors"))
    with pytest.raises(CheckpointError, match=r"CLIP vision checkpoint .*int\.safetensors does not fit .*"
                                              r"visual\.pre_norm\.bias is int32, not floating-point"):
        load_clip_vision(tmp_path / "int.safetensors", config)


def test_side_and_weight_files_that_are_fifos_are_refused_without_blocking(tmp_path, weights):
    # config.json, the shard index, the weights and adapter_config.json as FIFOs: each used to block forever.
    cases = []
    config_fifo = tmp_path / "config_fifo"
    _wan_dir(config_fifo, weights)
    (config_fifo / "config.json").unlink()
    os.mkfifo(config_fifo / "config.json")
    cases.append((lambda: load_checkpoint(config_fifo, CONFIG), config_fifo / "config.json",
                  r"config_fifo/config\.json is a FIFO \(named pipe\), not a regular file"))
    index_fifo = _wan_dir(tmp_path / "index_fifo", weights)
    os.mkfifo(index_fifo / "diffusion_pytorch_model.safetensors.index.json")
    cases.append((lambda: load_checkpoint(index_fifo, CONFIG),
                  index_fifo / "diffusion_pytorch_model.safetensors.index.json", r"index\.json is a FIFO"))
    weights_fifo = tmp_path / "weights_fifo.safetensors"
    os.mkfifo(weights_fifo)
    cases.append((lambda: load_checkpoint(weights_fifo, CONFIG), weights_fifo,
                  r"weights_fifo\.safetensors is a FIFO"))
    pt_fifo = tmp_path / "weights_fifo.pt"
    os.mkfifo(pt_fifo)
    cases.append((lambda: load_checkpoint(pt_fifo, CONFIG), pt_fifo, r"weights_fifo\.pt is a FIFO"))
    lora = tmp_path / "lora"
    lora.mkdir()
    save_file({"blocks.0.self_attn.q.lora_A.weight": np.ones((2, 24), np.float32),
               "blocks.0.self_attn.q.lora_B.weight": np.ones((24, 2), np.float32)},
              str(lora / "adapter_model.safetensors"))
    os.mkfifo(lora / "adapter_config.json")
    good = _wan_dir(tmp_path / "good", weights)
    cases.append((lambda: load_checkpoint(good, CONFIG, lora=lora), lora / "adapter_config.json",
                  r"adapter_config\.json is a FIFO"))
    clip_fifo = tmp_path / "clip.safetensors"
    os.mkfifo(clip_fifo)
    cases.append((lambda: load_clip_vision(clip_fifo), clip_fifo, r"clip\.safetensors is a FIFO"))
    for call, fifo, message in cases:
        result = _without_blocking(call, fifo)
        assert isinstance(result, CheckpointError), (fifo, result)
        assert re.search(message, str(result)), (message, str(result))


def test_side_files_that_are_devices_directories_or_too_large_are_refused(tmp_path, weights):
    directory = _wan_dir(tmp_path / "wan", weights)
    config = directory / "config.json"
    config.unlink()
    config.symlink_to("/dev/null")  # /dev/zero would be read until MemoryError
    with pytest.raises(CheckpointError, match=r"config\.json is a character device, not a regular file"):
        load_checkpoint(directory, CONFIG)
    config.unlink()
    config.write_text(json.dumps(WAN_JSON)[:-1] + " " * MAX_JSON_BYTES + "}")
    with pytest.raises(CheckpointError, match=rf"config\.json is \d+ bytes, more than the {MAX_JSON_BYTES}"):
        load_checkpoint(directory, CONFIG)
    config.unlink()
    config.write_text(json.dumps(WAN_JSON))
    weights_file = directory / "diffusion_pytorch_model.safetensors"
    weights_file.unlink()
    weights_file.mkdir()
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors is a directory"):
        load_checkpoint(directory, CONFIG)


def test_a_tokenizer_file_that_is_a_fifo_or_device_is_refused(tmp_path):
    from ardiff_jax.models.wan._umt5 import UMT5Encoder
    from flax import nnx

    encoder = nnx.eval_shape(lambda: UMT5Encoder(UMT5Config.tiny(), rngs=nnx.Rngs(0)))
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    result = _without_blocking(lambda: WanTextEncoder(encoder, fifo), fifo)
    assert isinstance(result, ValueError) and "tokenizer.json is a FIFO" in str(result), result
    device = tmp_path / "device.json"
    device.symlink_to("/dev/null")
    with pytest.raises(ValueError, match=r"device\.json is a character device"):
        WanTextEncoder(encoder, device)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["config", "index", "adapter_config", "vae_config", "umt5_config"])
def test_deeply_nested_json_is_a_checkpoint_error_not_a_recursion_error(tmp_path, weights, where):
    deep = '{"a": ' + _nested(100_000) + "}"
    if where in ("config", "index"):
        directory = _wan_dir(tmp_path / "wan", weights)
        target = directory / ("config.json" if where == "config" else "diffusion_pytorch_model.safetensors.index.json")
        target.write_text(deep)
        call = lambda: load_checkpoint(directory, CONFIG)  # noqa: E731
    elif where == "adapter_config":
        directory = _wan_dir(tmp_path / "wan", weights)
        lora = tmp_path / "lora"
        lora.mkdir()
        save_file({"blocks.0.self_attn.q.lora_A.weight": np.ones((2, 24), np.float32),
                   "blocks.0.self_attn.q.lora_B.weight": np.ones((24, 2), np.float32)},
                  str(lora / "adapter_model.safetensors"))
        target = lora / "adapter_config.json"
        target.write_text(deep)
        call = lambda: load_checkpoint(directory, CONFIG, lora=lora)  # noqa: E731
    else:
        directory = tmp_path / where
        directory.mkdir()
        target = directory / "config.json"
        target.write_text(deep)
        save_file({"x": np.zeros(1, np.float32)}, str(directory / (
            "diffusion_pytorch_model.safetensors" if where == "vae_config" else "model.safetensors")))
        call = (lambda: load_vae(directory)) if where == "vae_config" else (lambda: load_umt5(directory))
    with pytest.raises(CheckpointError, match=rf"{target.name} is not valid JSON \(truncated or malformed: nested "
                                              "deeper than the parser allows"):
        call()
    # A bounded depth that still parses is refused by the reader's own depth bound.
    target.write_text('{"a": ' + _nested(100) + "}")
    with pytest.raises(CheckpointError, match=rf"{target.name} is nested deeper than 64 levels"):
        call()


def test_the_json_reader_refuses_nan_and_overflow_and_never_quotes_the_file(tmp_path):
    path = tmp_path / "side.json"
    for text, message in (('{"eps": NaN}', "NaN is not a JSON value"), ('{"eps": Infinity}', "Infinity is not"),
                          ('{"eps": -Infinity}', "-Infinity is not"), ('{"eps": 1e999}', "too large for a float")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_json_file(path)
        assert math.isnan(read_json_file(path, allow_nan=True)["eps"]) or math.isinf(
            read_json_file(path, allow_nan=True)["eps"])
    path.write_bytes(b'{"secret": "\xffTOP-SECRET"}')
    with pytest.raises(ValueError, match=r"not UTF-8 at byte 12\)") as error:
        read_json_file(path)
    assert "SECRET" not in str(error.value) and "xff" not in str(error.value)


# -- 7. LoRAs ---------------------------------------------------------------------------------------------

LORA_MODULE = "blocks.0.self_attn.q"


def _lora(path: Path, a=None, b=None, extra: dict | None = None) -> Path:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 24)).astype(np.float32) if a is None else a
    b = rng.standard_normal((24, 2)).astype(np.float32) if b is None else b
    save_file({f"{LORA_MODULE}.lora_A.weight": a, f"{LORA_MODULE}.lora_B.weight": b, **(extra or {})}, str(path))
    return path


def _peft(path: Path, config: dict | str) -> Path:
    path.mkdir()
    _lora(path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


@pytest.fixture(scope="module")
def wan_file(tmp_path_factory, weights) -> Path:
    path = tmp_path_factory.mktemp("wan") / "wan.safetensors"
    save_file(weights, str(path))
    return path


def test_a_good_lora_still_merges_exactly(tmp_path, wan_file, weights):
    lora = _lora(tmp_path / "lora.safetensors")
    model = load_checkpoint(wan_file, CONFIG, lora=lora, lora_alpha=3.0)
    a, b = (SafetensorsFile(lora).read(f"{LORA_MODULE}.lora_{x}.weight") for x in "AB")
    expected = weights[f"{LORA_MODULE}.weight"] + np.float32(1.5) * (b @ a)
    np.testing.assert_allclose(np.asarray(model.blocks.self_attn.q.kernel[...])[0], expected.T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("alpha, message", [
    (float("nan"), r"lora_alpha must be a finite number, got nan"),
    (float("inf"), r"lora_alpha must be a finite number, got inf"),
    (1e308, r"blocks\.0\.self_attn\.q: the scale alpha / r = 1e\+308 / 2 is beyond float32's range"),
    ([8.0], r"lora_alpha must be a finite number, got \[8\.0\]"),
    ("8", r"lora_alpha must be a finite number, got '8'"),
    (True, r"lora_alpha must be a finite number, got True"),
])
def test_a_lora_alpha_that_is_not_a_usable_number_is_refused(tmp_path, wan_file, placed, alpha, message):
    lora = _lora(tmp_path / "lora.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(wan_file, CONFIG, lora=lora, lora_alpha=alpha)
    assert placed == []


@pytest.mark.parametrize("config, message", [
    ('{"r": 2, "lora_alpha": NaN}', r"adapter_config\.json is not valid JSON .*NaN is not a JSON value"),
    ('{"r": 2, "lora_alpha": Infinity}', r"Infinity is not a JSON value"),
    ('{"r": 2, "lora_alpha": 1e999}', r"too large for a float"),
    ({"r": 2, "lora_alpha": [1, 2]}, r"\(adapter_config\.json\): lora_alpha must be a finite number, got \[1, 2\]"),
    ({"r": 2, "lora_alpha": "8"}, r"lora_alpha must be a finite number, got '8'"),
    ({"r": 2, "lora_alpha": 1e308}, r"beyond float32's range"),
    ({"r": "2", "lora_alpha": 8}, r"r must be a positive integer, got '2'"),
    ({"r": True}, r"r must be a positive integer, got True"),
    ({"r": 2, "use_rslora": "false"}, r"use_rslora must be true or false, got 'false'"),
])
def test_an_adapter_config_with_bad_values_is_refused(tmp_path, wan_file, placed, config, message):
    lora = _peft(tmp_path / "peft", config)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(wan_file, CONFIG, lora=lora)
    assert placed == []


def test_loras_with_bad_factors_are_refused_by_name(tmp_path, wan_file, placed):
    nan = np.ones((2, 24), np.float32)
    nan[1, 3] = np.nan
    cases = [
        (dict(a=nan), rf"{LORA_MODULE}\.lora_A\.weight holds NaN or infinite values"),
        (dict(b=np.full((24, 2), np.inf, np.float32)), rf"{LORA_MODULE}\.lora_B\.weight holds NaN or infinite"),
        (dict(a=np.full((2, 24), 1e30, np.float32), b=np.full((24, 2), 1e30, np.float32)),
         rf"{LORA_MODULE}: scale 1 x r 2 x max\|A\| 1e\+30 x max\|B\| 1e\+30 can overflow float32"),
        (dict(a=np.ones((2, 24), np.int32)), rf"{LORA_MODULE}\.lora_A\.weight is int32, not floating-point"),
        (dict(a=np.ones((0, 24), np.float32), b=np.ones((24, 0), np.float32)), r"have rank 0"),
        (dict(extra={f"{LORA_MODULE}.lora_A.default.weight": np.ones((2, 24), np.float32)}),
         rf"names the same factor twice .*lora_A(\.default)?\.weight and .*lora_A(\.default)?\.weight "
         rf"\(both {LORA_MODULE}\.lora_A\)"),
    ]
    for index, (factors, message) in enumerate(cases):
        lora = _lora(tmp_path / f"bad{index}.safetensors", **factors)
        with pytest.raises(CheckpointError, match=rf"LoRA .*bad{index}\.safetensors .*{message}"):
            load_checkpoint(wan_file, CONFIG, lora=lora)
    # Two spellings of one factor (Wan's and diffusers' names, as LoRA trainers mix them).
    mixed = _lora(tmp_path / "mixed.safetensors", extra={
        "blocks.0.attn1.to_q.lora_B.weight": np.ones((24, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"names the same factor twice"):
        load_checkpoint(wan_file, CONFIG, lora=mixed)
    assert placed == []


@pytest.mark.parametrize("change, message", [
    ({"patch_embedding.weight": np.zeros((24, 4, 1, 0, 0), np.float32)}, r"patch_embedding\.weight \[24, 4, 1, 0, 0\]"),
    ({"blocks.99999999.norm3.weight": np.zeros(24, np.float32)},
     r"blocks\.99999999\.\* makes a network of 100000000 blocks \(2700000015 tensors\) but the checkpoint holds 70"),
])
def test_degenerate_shapes_are_checkpoint_errors_and_do_not_size_the_network(tmp_path, weights, change, message):
    # A zero patch used to raise ZeroDivisionError; one stray block index used to size a network of 10**8 blocks
    # (its tensor table alone exhausting memory) when config.json gives the heads.
    directory = _wan_dir(tmp_path / "wan", {**weights, **change})
    if "blocks.99999999.norm3.weight" in change:
        (directory / "config.json").write_text(json.dumps({k: v for k, v in WAN_JSON.items() if k != "num_layers"}))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(directory)
        umt5 = _umt5_dir(tmp_path / "umt5")
        tensors = {**_tensors(2, umt5_names(UMT5Config.tiny())), "blocks.99999999.norm1.weight": np.ones(32, "f4")}
        save_file(tensors, str(umt5 / "model.safetensors"))
        data = json.loads((umt5 / "config.json").read_text())
        (umt5 / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k != "num_layers"}))
        with pytest.raises(CheckpointError, match=r"makes an encoder of 100000000 layers"):
            load_umt5(umt5)
    else:
        for config in (None, CONFIG):
            with pytest.raises(CheckpointError, match=message):
                load_checkpoint(directory, config)


# -- 8 / 12. config fields --------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("eps", -1, r"eps must be a finite positive number, got -1"),
    ("eps", 0, r"eps must be a finite positive number, got 0"),
    ("eps", "1e-6", r"eps must be a finite positive number, got '1e-6'"),
    ("eps", True, r"eps must be a finite positive number, got True"),
    ("eps", Literal("1e999"), r"not valid JSON .*too large for a float"),
    ("eps", float("inf"), r"not valid JSON .*Infinity is not a JSON value"),
    ("eps", float("nan"), r"not valid JSON .*NaN is not a JSON value"),
    ("num_heads", "2", r"num_heads must be a positive integer, got '2'"),
    ("num_heads", 2.0, r"num_heads must be a positive integer, got 2\.0"),
    ("text_len", True, r"text_len must be a positive integer, got True"),
    ("text_len", 0, r"text_len must be a positive integer, got 0"),
    ("patch_size", [1, True, True], r"patch_size must be \[t, h, w\] \(positive integers\)"),
    ("dim", [24], r"dim must be a positive integer, got \[24\]"),
])
def test_wan_config_json_fields_are_checked_naming_the_file(tmp_path, weights, placed, field, value, message):
    directory = tmp_path / "wan"
    _wan_dir(directory, weights)
    (directory / "config.json").write_text(_dumps({**WAN_JSON, field: value}))
    for config in (None, CONFIG):
        with pytest.raises(CheckpointError, match=rf"wan/config\.json.*{message}"):
            load_checkpoint(directory, config)
    assert placed == []


def _umt5_dir(path: Path, **fields) -> Path:
    path.mkdir()
    config = UMT5Config.tiny()
    save_file(_tensors(2, umt5_names(config)), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "umt5", "vocab_size": 300, "d_model": 32, "d_ff": 48, "d_kv": 8, "num_heads": 4,
        "num_layers": 2, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
        "layer_norm_epsilon": 1e-6, **fields}))
    return path


@pytest.mark.parametrize("value, message", [
    (float("inf"), r"Infinity is not a JSON value"), (True, r"layer_norm_epsilon must be a finite positive number"),
    (0, r"layer_norm_epsilon must be a finite positive number, got 0"), ("1e-6", r"got '1e-6'"),
])
def test_umt5_layer_norm_epsilon_is_checked(tmp_path, value, message):
    directory = _umt5_dir(tmp_path / "umt5", layer_norm_epsilon=value)
    for config in (None, UMT5Config.tiny()):
        with pytest.raises(CheckpointError, match=rf"umt5/config\.json.*{message}"):
            load_umt5(directory, config)
    with pytest.raises(CheckpointError, match=r"d_model must be a positive integer, got '32'"):
        load_umt5(_umt5_dir(tmp_path / "other", d_model="32"))
    for eps in (True, float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="UMT5Config.eps must be a finite positive number"):
            UMT5Config.tiny(eps=eps)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> Path:
    from ardiff_jax.models.wan._vae import vae_names

    path = tmp_path_factory.mktemp("vae") / "vae"
    path.mkdir()
    save_file(_tensors(3, vae_names(WanVAEConfig.tiny(), "diffusers")),
              str(path / "diffusion_pytorch_model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKLWan", "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
        "temperal_downsample": [False, True, True], "latents_mean": list(WAN21_LATENTS_MEAN),
        "latents_std": list(WAN21_LATENTS_STD)}))
    return path


@pytest.mark.parametrize("field, entry, message", [
    ("latents_mean", float("nan"), r"NaN is not a JSON value"),
    ("latents_mean", float("inf"), r"Infinity is not a JSON value"),
    ("latents_std", float("inf"), r"Infinity is not a JSON value"),
    ("latents_mean", Literal("1e999"), r"too large for a float"),
    ("latents_std", 0, r"latents_std must be a list of finite positive numbers, got 0 in it"),
    ("latents_std", -1.5, r"latents_std must be a list of finite positive numbers, got -1\.5 in it"),
    ("latents_mean", True, r"latents_mean must be a list of finite numbers, got True in it"),
    ("latents_mean", "0.5", r"latents_mean must be a list of finite numbers, got '0\.5' in it"),
    ("dim_mult", True, r"dim_mult must be a list of positive integers, got True in it"),
    ("temperal_downsample", 1, r"temperal_downsample must be a list of true/false values, got 1 in it"),
])
def test_vae_config_json_fields_are_checked(tmp_path, vae_dir, field, entry, message):
    directory = Path(shutil.copytree(vae_dir, tmp_path / "vae"))
    data = json.loads((directory / "config.json").read_text())
    data[field][1] = entry
    (directory / "config.json").write_text(_dumps(data))
    with pytest.raises(CheckpointError, match=rf"vae/config\.json.*{message}"):
        load_vae(directory)


def test_vae_config_values_and_size_are_checked(tmp_path, vae_dir):
    for field, value in (("latents_mean", float("nan")), ("latents_std", float("inf")), ("latents_std", 0.0),
                         ("latents_mean", True), ("latents_mean", "0.5")):
        values = list(getattr(WanVAEConfig(), field))
        values[0] = value
        with pytest.raises(ValueError, match=rf"WanVAEConfig {field} must"):
            WanVAEConfig(**{field: tuple(values)})
    # A config.json describing a VAE far larger than the file holds is refused before the network is built.
    directory = Path(shutil.copytree(vae_dir, tmp_path / "vae"))
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, "num_res_blocks": 10**6}))
    with pytest.raises(CheckpointError, match=r"describes a VAE of at least 48000024 tensors"):
        load_vae(directory)


# -- 15. shard indexes stay in their directory; no error quotes a file -------------------------------------


def _sharded(path: Path, weights: dict, name_of=lambda k: "part-1.safetensors") -> Path:
    directory = _wan_dir(path, weights)
    (directory / "diffusion_pytorch_model.safetensors").unlink()
    save_file(weights, str(directory / "part-1.safetensors"))
    (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: name_of(k) for k in weights}}))
    return directory


def test_shard_indexes_name_only_files_of_their_directory(tmp_path, weights):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-PASSWORD-1234567890")
    directory = _sharded(tmp_path / "wan", weights)
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    for entry in ("../secret.txt", str(secret), "sub/part-1.safetensors", "..", ""):
        index.write_text(json.dumps({"weight_map": {k: entry for k in weights}}))
        with pytest.raises(CheckpointError, match=r"is not a shard file name in .*a shard index may only name files "
                                                  r"of its own directory") as error:
            load_checkpoint(directory, CONFIG)
        assert "TOP-SECRET" not in str(error.value)
    (directory / "link.safetensors").symlink_to(secret)
    index.write_text(json.dumps({"weight_map": {k: "link.safetensors" for k in weights}}))
    with pytest.raises(CheckpointError, match=r"the shard 'link\.safetensors' resolves outside") as error:
        load_checkpoint(directory, CONFIG)
    assert "TOP-SECRET" not in str(error.value)
    # The Hugging Face cache's layout (snapshot files are symlinks into the repo's blobs/) still loads.
    repo = tmp_path / "models--org--wan"
    snapshot = _sharded(repo / "snapshots" / "abc123", weights)
    (repo / "blobs").mkdir()
    (snapshot / "part-1.safetensors").rename(repo / "blobs" / "9f86d08")
    (snapshot / "part-1.safetensors").symlink_to(Path("../../blobs/9f86d08"))
    assert load_checkpoint(snapshot, CONFIG).config == CONFIG


def test_safetensors_errors_never_quote_the_file(tmp_path):
    # A path naming some other file: its first 8 bytes, read as the header length, used to be printed.
    other = tmp_path / "passwd.safetensors"
    other.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(SafetensorsError) as error:
        SafetensorsFile(other)
    (length,) = struct.unpack("<Q", b"root:x:0")
    assert str(length) not in str(error.value) and "root" not in str(error.value).replace(str(tmp_path), "")
    not_utf8 = _raw_safetensors(tmp_path / "latin.safetensors", {})
    raw = b'{"\xe9t\xe9": 1}'
    not_utf8.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(SafetensorsError, match=r"not UTF-8 at byte 2\)") as error:
        SafetensorsFile(not_utf8)
    assert "xe9" not in str(error.value)


# -- fuzz ---------------------------------------------------------------------------------------------------

DTYPES = ["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "Q4", 7]
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, print_blob=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
#: Fewer examples where most loads succeed (each builds the tiny network: ~0.3 s on a small CPU).
FUZZ_LOADS = settings(FUZZ, max_examples=12)
_NAME_LIST = sorted(NAMES)


def _valid_header() -> tuple[dict, int]:
    header, offset = {}, 0
    for name in _NAME_LIST:
        size = math.prod(NAMES[name]) * 4
        header[name] = {"dtype": "F32", "shape": list(NAMES[name]), "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


_mutation = st.one_of(
    st.tuples(st.just("shape"), st.sampled_from(_NAME_LIST),
              st.lists(st.one_of(st.integers(0, 40), st.sampled_from([10**9, 2**62, -1])), max_size=5)),
    st.tuples(st.just("dtype"), st.sampled_from(_NAME_LIST), st.sampled_from(DTYPES)),
    st.tuples(st.just("offsets"), st.sampled_from(_NAME_LIST), st.lists(st.integers(-5, 200_000), max_size=3)),
    st.tuples(st.just("drop"), st.sampled_from(_NAME_LIST), st.none()),
    st.tuples(st.just("add"), st.sampled_from(["blocks.2.norm3.weight", "extra", "model.x", "__metadata__"]),
              st.one_of(st.none(), st.integers(), st.text(max_size=5))),
    st.tuples(st.just("entry"), st.sampled_from(_NAME_LIST),
              st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2), st.text(max_size=3))),
    st.tuples(st.just("pad"), st.just("__metadata__"), st.sampled_from([16, 4096, 24 * 2**20])),
)
#: Peak host memory (traced) opening a file's headers may take, whatever the header.
HEADER_PEAK = 32 * 2**20


def _outcome(fn):
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - checked by _check_outcome
        return error


def _check_outcome(result, path: Path, placed: list[int]) -> None:
    """Refused with CheckpointError naming the file, or loaded; and never more than 4x the file's bytes built and
    placed (an fp8 file upcast to float32): each parameter is built on the host, then placed, one at a time."""
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())
    assert sum(placed) <= 4 * size + 4096, (sum(placed), size)
    if isinstance(result, Exception):
        assert isinstance(result, CheckpointError), f"{type(result).__name__}: {result}"
        assert path.name in str(result), str(result)
    else:  # loaded "correctly": the network's numeric fields are usable numbers
        _assert_usable_config(result.config)


def _assert_usable_config(config) -> None:
    """Every float field of a loaded network's config is a finite float (positive where it must be)."""
    for field, positive in (("eps", True), ("rope_theta", True), ("latents_mean", False), ("latents_std", True)):
        if not hasattr(config, field):
            continue
        for value in np.atleast_1d(np.asarray(getattr(config, field), dtype=object)).tolist():
            assert type(value) is float and math.isfinite(value) and (value > 0 or not positive), (field, value)


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "U8": 1, "BOOL": 1, "F8_E4M3": 1}


def _relayout(header: dict) -> int:
    """Offsets recomputed for every well-formed entry (so a mutated shape or dtype reaches the loader's own
    checks, past the format's); returns the data size."""
    offset = 0
    for entry in header.values():
        if (isinstance(entry, dict) and entry.get("dtype") in _ITEMSIZE and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and 0 <= d < 10**6 for d in entry["shape"])):
            size = math.prod(entry["shape"]) * _ITEMSIZE[entry["dtype"]]
            entry["data_offsets"] = [offset, offset + size]
            offset += size
    return offset


@FUZZ
@given(mutations=st.lists(_mutation, max_size=3), data_delta=st.integers(-64, 64), relayout=st.booleans(),
       use_config=st.booleans())
@example(mutations=[("pad", "__metadata__", 24 * 2**20)], data_delta=0, relayout=False, use_config=True)
@example(mutations=[("shape", "patch_embedding.weight", [24, 4, 1, 0, 0])], data_delta=0, relayout=True,
         use_config=True)
def test_fuzz_safetensors_headers(tmp_path_factory, placed, mutations, data_delta, relayout, use_config):
    header, data_size = _valid_header()
    for kind, name, value in mutations:
        if kind == "drop":
            header.pop(name, None)
        elif kind == "add":
            header[name] = {"dtype": "F32", "shape": [value if isinstance(value, int) else 1], "data_offsets": [0, 4]} \
                if name != "__metadata__" else ({"k": value} if value is not None else value)
        elif kind == "entry" and name in header:
            header[name] = value
        elif kind == "pad":
            header["__metadata__"] = {"pad": "x" * value}
        elif name in header and isinstance(header[name], dict):
            header[name][{"shape": "shape", "dtype": "dtype", "offsets": "data_offsets"}[kind]] = value
    if relayout:
        data_size = _relayout(header)
    rng = np.random.default_rng(len(mutations))
    data = rng.standard_normal(max(0, data_size + data_delta) // 4 + 1).astype(np.float32).tobytes()[
        :max(0, data_size + data_delta)]
    path = _raw_safetensors(tmp_path_factory.mktemp("fuzz") / "fuzzed.safetensors", header, data)
    headers, peak = _peak(lambda: checkpoint_config(path))  # headers only: bounded whatever the header holds
    assert peak <= HEADER_PEAK, peak
    assert not isinstance(headers, Exception) or isinstance(headers, CheckpointError), repr(headers)
    placed.clear()
    result = _outcome(lambda: load_checkpoint(path, CONFIG if use_config else None))
    _check_outcome(result, path, placed)
    if not isinstance(result, Exception):  # loaded: exactly the file's values (in the model's dtype)
        file = SafetensorsFile(path)
        dtype = result.config.param_dtype
        np.testing.assert_array_equal(np.asarray(result.patch_embedding.bias[...], np.float32),
                                      file.read("patch_embedding.bias").astype(dtype).astype(np.float32))


_layout = st.sampled_from(["plain", "transposed", "expanded", "overlapping", "slice", "offset_view", "empty"])


@pytest.fixture(scope="module")
def reference(wan_file) -> dict[str, np.ndarray]:
    return _params(load_checkpoint(wan_file, CONFIG))


def _self_overlapping(layout: str, shape: tuple[int, ...]) -> bool:
    """Whether ``layout`` gives a tensor of ``shape`` whose elements are not each stored once (or a wrong shape)."""
    if layout == "empty":
        return True
    if layout == "expanded":
        return math.prod(shape) > 1
    if layout == "overlapping":
        return sum(size > 1 for size in shape) >= 2
    return False


@FUZZ_LOADS
@given(layouts=st.dictionaries(st.sampled_from(_NAME_LIST), _layout, max_size=4), key=st.sampled_from(
    ["generator_ema", "generator", "model", None]))
@example(layouts={"blocks.0.ffn.0.weight": "expanded", "head.head.weight": "transposed"}, key="generator")
def test_fuzz_pt_strides(tmp_path_factory, placed, weights, reference, layouts, key):
    state = {}
    for name in _NAME_LIST:
        value = torch.from_numpy(weights[name].copy())
        layout = layouts.get(name, "plain")
        if layout == "transposed" and value.dim() == 2:
            value = value.T.contiguous().T
        elif layout == "expanded":
            value = value.reshape(-1)[:1].expand(*value.shape) if value.numel() > 1 else value
        elif layout == "overlapping" and value.numel() > 1:
            value = torch.as_strided(value.reshape(-1).clone(), value.shape, (1,) * value.dim())
        elif layout == "slice":
            value = torch.cat([value.reshape(-1), torch.zeros(7)])[: value.numel()].view(*value.shape)
        elif layout == "offset_view":
            value = torch.cat([torch.zeros(3), value.reshape(-1)])[3:].view(*value.shape)
        elif layout == "empty":
            value = torch.zeros(0)
        state[f"model.{name}"] = value
    path = tmp_path_factory.mktemp("fuzz_pt") / "fuzzed.pt"
    torch.save(state if key is None else {key: state, "step": 3}, path)
    placed.clear()
    result = _outcome(lambda: load_checkpoint(path, CONFIG))
    _check_outcome(result, path, placed)
    bad = {n for n, layout in layouts.items() if _self_overlapping(layout, NAMES[n])}
    assert isinstance(result, Exception) == bool(bad), (layouts, result)
    if not bad:  # loaded: exactly the values, whatever the layout
        loaded = _params(result)
        for k in reference:
            np.testing.assert_array_equal(loaded[k], reference[k], err_msg=k)


_json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from([1e-6, 2, 24, 32, 16, 8, 4, 1e308, 10**20]), st.text(max_size=4)),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children,
                                                                                 max_size=2)),
    max_leaves=5)


@FUZZ_LOADS
@given(changes=st.dictionaries(st.sampled_from(sorted(WAN_JSON) + ["cross_attn_norm", "qk_norm", "action_config",
                                                                   "image_dim"]), _json_value, max_size=3),
       use_config=st.booleans())
@example(changes={"eps": -1.0}, use_config=False)
@example(changes={"eps": "1e-6"}, use_config=True)
def test_fuzz_config_json(tmp_path_factory, placed, weights, changes, use_config):
    directory = tmp_path_factory.mktemp("fuzz_json") / "wan"
    _wan_dir(directory, weights)
    (directory / "config.json").write_text(json.dumps({**WAN_JSON, **changes}))
    placed.clear()
    result = _outcome(lambda: load_checkpoint(directory, CONFIG if use_config else None))
    _check_outcome(result, directory, placed)
    if not isinstance(result, Exception):
        assert result.config.num_layers == 2 and result.config.dim == 24
        dtype = result.config.param_dtype  # bf16 when inferred (the published networks' dtype)
        np.testing.assert_array_equal(np.asarray(result.patch_embedding.bias[...], np.float32),
                                      weights["patch_embedding.bias"].astype(dtype).astype(np.float32))


UMT5_JSON_FIELDS = ["vocab_size", "d_model", "d_ff", "d_kv", "num_heads", "num_layers",
                    "relative_attention_num_buckets", "relative_attention_max_distance", "layer_norm_epsilon",
                    "model_type", "feed_forward_proj", "dense_act_fn"]
VAE_JSON_FIELDS = ["base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "latents_mean",
                   "latents_std", "is_residual", "patch_size", "in_channels", "attn_scales", "decoder_base_dim",
                   "_class_name"]


@pytest.fixture(scope="module")
def umt5_dir(tmp_path_factory) -> Path:
    return _umt5_dir(tmp_path_factory.mktemp("umt5") / "umt5")


_side_change = st.one_of(
    st.tuples(st.just("vae"), st.dictionaries(st.sampled_from(VAE_JSON_FIELDS), _json_value, max_size=2),
              st.one_of(st.none(), st.tuples(st.sampled_from(["latents_mean", "latents_std", "dim_mult"]),
                                             st.integers(0, 3), _json_value))),
    st.tuples(st.just("umt5"), st.dictionaries(st.sampled_from(UMT5_JSON_FIELDS), _json_value, max_size=2),
              st.none()))


@FUZZ_LOADS
@given(change=_side_change)
@example(change=("vae", {}, ("latents_std", 1, float("inf"))))
@example(change=("umt5", {"layer_norm_epsilon": True}, None))
def test_fuzz_vae_and_umt5_config_json(tmp_path_factory, placed, vae_dir, umt5_dir, change):
    which, changes, entry = change
    source = vae_dir if which == "vae" else umt5_dir
    directory = Path(shutil.copytree(source, tmp_path_factory.mktemp("fuzz_side") / which))
    stored = json.loads((directory / "config.json").read_text())
    if entry is not None:  # one entry of a list replaced: the values near a valid config
        field, index, value = entry
        values = list(stored[field])
        values[index] = value
        changes = {**changes, field: values}
    (directory / "config.json").write_text(json.dumps({**stored, **changes}))  # NaN/Infinity written as such
    placed.clear()
    result = _outcome(lambda: load_vae(directory) if which == "vae" else load_umt5(directory))
    _check_outcome(result, directory, placed)
