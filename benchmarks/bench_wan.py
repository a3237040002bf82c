"""One causal-Wan block through the engine, end to end: the 4 denoise steps, the commit pass, the streaming VAE
decode and the runtime's overhead; the umT5 text encode of one prompt; end-to-end frames/s.

The network is Wan2.1-T2V-1.3B (30 layers, 12 heads x 128, dim 1536, FFN 8960, bf16
parameters, activations and KV) in :class:`~ardiff_jax.models.wan.CausalWanPipeline` with
Self-Forcing's policy and sampler (3-latent-frame blocks, sink 0 + window 21 frames; per
block 4 denoise forwards at the warped timesteps 1000 / 937.5 / 833.3 / 625 and one commit
forward at ``t = 0``) and the full-size Wan 2.1 VAE (:class:`~ardiff_jax.models.wan.WanVAE`,
126.9M parameters, bf16, random weights), which decodes every block with a streaming decoder
whose cache is the session's state (``WanBlock.video``), driven through
:class:`~ardiff_jax.ARDiffusionEngine` (one session, one block per request). Weights are
random by default (``--random-weights``: the real geometry, nothing downloaded);
``--checkpoint PATH`` times published transformer weights instead
(``CausalWanPipeline.from_checkpoint``; the VAE stays random). The session is conditioned on
random ``prompt_embeds f32[64, 4096]``; the text encoder is timed on its own (below).
``--no-vae`` drops the VAE (transformer only, the previous form of this benchmark).

How a block's time is split. Every forward of a block runs the one jitted
``ardiff_jax.models._world.world_step`` and its decode the one jitted
``ardiff_jax.models.wan._vae._decode_step_jit`` (through ``_pipeline``). During one untimed
engine block we wrap both and record the arguments of their 5 + 1 calls (the KV pools and the
VAE cache are copied at the call: the commit after the last forward donates the pools, the
decode donates its cache), then time these cases **interleaved** (``benchmarks/common.py``
rules: one sync per sample, medians):

* ``engine_block``: ``engine.generate`` of the session's next block, until its latents and
  its uint8 video are ready;
* ``denoise``: the 4 recorded denoise calls of the same ``world_step``, chained as the
  pipeline chains them (step ``i + 1`` takes step ``i``'s ``x_next``, which is exactly its
  recorded ``x_t``), one sync at the end;
* ``commit``: the recorded commit forward (``t = sigma = 0``), alone;
* ``vae_decode``: the recorded ``decode_step`` of the block (steady state: the session's
  cache has started, 3 latents -> 12 video frames) on a fresh copy of the recorded cache,
  made untimed before each sample (the call donates it);
* ``text_encode``: one prompt through :class:`~ardiff_jax.models.wan.WanTextEncoder`
  (tokenize, the umT5 forward at the full text length 512, the padded rows zeroed, the
  features copied to the host; its per-prompt cache off), as ``CausalWanPipeline`` runs it
  once per prompt. The tokenizer is a stand-in ``tokenizer.json`` of a few words (the real one
  is umT5's 256k-piece Unigram; tokenizing a prompt is host work of well under a millisecond
  either way); every prompt is padded to 512 tokens, so the forward is the real one.

``transformer = denoise + commit``, ``model = transformer + vae_decode`` is the pure device
time of a block and ``overhead = engine_block - model`` is everything the runtime adds around
it: request validation, session lookup, the paged views, noise, the donated KV commit write,
the uint8 conversion of the video, host dispatch. Target: ``overhead <= 5%`` of the model time
(recorded as met or not). ``denoise``, ``commit`` and ``vae_decode`` each end with a sync where
the engine dispatches its calls back to back, so the isolated model time carries two more
exposed dispatches than the engine block does (overhead is, if anything, under-counted by ~2 ms).

A drift-free cross-check follows the rounds (``runtime_self_time``): engine blocks with every
``world_step`` call and the decode synced and timed inside the block;
``block - sum(forwards) - decode`` is the runtime's own time, all terms from the same block.
On a shared CPU, where samples of the same forward vary by 2x between rounds, this is the
number that resolves a few percent; it counts host work that the unsynced engine hides behind
device work, so it is an upper bound of what the runtime exposes.

Throughput. **End to end** (``e2e``): video frames/s = the 12 video frames a steady-state block
decodes (Wan's causal VAE: 4 per latent frame after the session's first) / the engine block's
median: transformer + VAE + runtime; the text encode runs once per prompt and is reported
separately, with frames/s amortised over a prompt held for 1, 7 and 28 blocks. Also from the
medians: transformer only (``denoise + commit``) and model only. Next to the published H100
figures of Self-Forcing (17 FPS reported, ~13 FPS measured end to end by users) and LongLive
(20.7 FPS), and our goal on one H200: **end-to-end >= 17 video frames/s** at 480x832 (on CPU
at the reduced size the comparison is only recorded, it means nothing). The VAE cache of one
session (``cache_nbytes``: what capacity planning counts per session) is reported at the run's
resolution and at 832x480 (1801 MiB in bf16).

On CPU the full 480x832 frame (a 60x104 latent, 1,560 tokens/frame) takes minutes per
block, so the CPU run uses a reduced latent (``--latent HxW``, default 8x12 = a 64x96 video:
24 tokens per frame, 72 per block) with the full 30-layer 1.3B network, Self-Forcing's 3-frame
blocks and 21-frame window, and the full-width VAE at that resolution (0.60 TFLOP per block,
against 40.5 TFLOP at 480x832; XLA's cost analysis). The text encoder on CPU is a reduced
umT5: the XXL's layer (d_model 4096, FFN 10240, 64 heads x 64, its relative-position buckets)
but 2 of its 24 layers and 32,128 embedding rows (the embedding is a gather: rows cost memory,
not time), 0.52B parameters instead of 5.68B (11.4 GB in bf16); its time x 12 estimates the
XXL's (the layers are all the per-token work). On an accelerator the default is the umT5-XXL
itself (``--umt5-layers``). ``--budget-s`` (default 570 s, from the start) bounds the CPU run:
rounds stop when the slowest round so far no longer fits, the cross-check block runs only if it
fits; the CPU run also skips the engine's two warmup blocks (its first block compiles instead, the
untimed capture block the steady-state decode) and the warmup round. ``benchmarks/gpu_check.py`` runs the same split at the full size on a GPU. ``--smoke``:
a 2-layer Wan-shaped model, a width-8 VAE and a 2-layer width-16 umT5 (seconds;
``tests/test_benchmarks_smoke.py``).

Run: ``python -m benchmarks.bench_wan [--latent 8x12] [--blocks 3] [--checkpoint PATH]``;
writes ``benchmarks/results/bench_wan.json`` (``bench_wan_smoke.json`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS_DIR, Case, Stats, format_table, machine_info, machine_line, write_json

__all__ = [
    "DEFAULT_LATENT",
    "FULL_LATENT",
    "GOAL_E2E_VIDEO_FRAMES_PER_S",
    "OVERHEAD_TARGET",
    "PRESET",
    "REFERENCE_FPS",
    "REFERENCE_LABEL",
    "TEXT_LEN",
    "VIDEO_FRAMES_PER_LATENT_FRAME",
    "ForwardRecorder",
    "ForwardTimer",
    "amortised_fps",
    "capture_block_forwards",
    "e2e_summary",
    "main",
    "make_pipeline",
    "make_text_encoder",
    "make_vae",
    "measure_text_encode",
    "prompt_embeds",
    "run",
    "runtime_self_time",
    "smoke_config",
    "split_block",
    "text_encode_case",
    "text_encoder_config",
    "throughput",
    "umt5_flops",
    "vae_config",
    "vae_decode_flops",
    "vae_summary",
]

#: The published network this benchmark times.
PRESET = "wan2.1-t2v-1.3b"
#: The CPU run's latent (H, W): 24 tokens per frame, a 64x96 video.
DEFAULT_LATENT = (8, 12)
#: The real latent: 480x832 video, 1,560 tokens per frame.
FULL_LATENT = (60, 104)
#: Wan's causal VAE: every latent frame after the first decodes to 4 video frames.
VIDEO_FRAMES_PER_LATENT_FRAME = 4
#: Runtime overhead budget, as a fraction of the block's pure model time.
OVERHEAD_TARGET = 0.05
#: Rows of the random prompt embeddings (padded to the model's text_len, 512, as Wan pads).
PROMPT_ROWS = 64
#: Wan's text length: every prompt is tokenized, padded and encoded at 512 tokens.
TEXT_LEN = 512
#: umT5-XXL's depth; the CPU run keeps 2 of its layers and this many embedding rows.
UMT5_XXL_LAYERS = 24
CPU_UMT5_LAYERS = 2
REDUCED_UMT5_VOCAB = 32128
#: Blocks a prompt is held for in the amortised end-to-end figures (7 blocks ~ Wan's 81-frame clip).
AMORTISE_BLOCKS = (1, 7, 28)
#: The CPU run's wall-clock budget (s): rounds stop when the next would not fit.
DEFAULT_BUDGET_S = 570.0

#: Our goal for the causal Wan2.1-1.3B on one H200: end-to-end (transformer + VAE) video frames/s at 480x832.
GOAL_E2E_VIDEO_FRAMES_PER_S = 17.0

#: Published end-to-end figures of 1.3B causal Wan models, for context only: other code,
#: other hardware (one H100), VAE decode included, and numbers we did not measure.
REFERENCE_FPS = {
    "LongLive-1.3B": {"video_frames_per_s": 20.7, "hardware": "1x H100", "source": "reported by its authors"},
    "Self-Forcing (chunk-wise, Wan2.1-1.3B)": {
        "video_frames_per_s": 17.0, "hardware": "1x H100", "source": "reported by its authors",
        "measured_by_users_video_frames_per_s": 13.1,
        "measured_by_users_source": "81 frames in ~6.2 s end to end on one H100 (a user's report, "
                                    "JaydenLyh/Reward-Forcing issue #13); ~13 FPS"},
}
REFERENCE_LABEL = "reported by their authors (their own end-to-end runs on one H100); context, not measured here"


def _progress(message: str) -> None:
    print(f"[bench_wan] {message}", file=sys.stderr, flush=True)


def smoke_config() -> Any:
    """A Wan-shaped bf16 transformer small enough for a smoke run: 2 layers, 6 tokens/frame, Self-Forcing's
    3-frame blocks with no sink (window 6 frames)."""
    from ardiff_jax.models import CausalDiTConfig

    return CausalDiTConfig(
        name="wan-smoke", num_layers=2, dim=24, num_heads=2, ffn_dim=32, latent_channels=4, latent_height=4,
        latent_width=6, text_len=8, text_dim=16, frames_per_block=3, window_frames=6, sink_frames=0, freq_dim=32,
        dtype="bfloat16", param_dtype="bfloat16")


def wan_config(latent: tuple[int, int] | None = None, *, smoke: bool = False) -> Any:
    """The 1.3B preset (Self-Forcing policy) at ``latent`` (None: the real 60x104), or the smoke config."""
    from ardiff_jax.models import dit_preset

    if smoke:
        return smoke_config()
    config = dit_preset(PRESET)
    if latent is not None:
        config = config.replace(latent_height=int(latent[0]), latent_width=int(latent[1]))
    return config


def vae_config(transformer_config: Any = None, *, smoke: bool = False) -> Any:
    """Wan 2.1's VAE in bf16, or (``smoke``) its layout at width 8 with the smoke transformer's latent channels."""
    from ardiff_jax.models.wan import WanVAEConfig

    if not smoke:
        return WanVAEConfig(dtype="bfloat16")
    channels = smoke_config().latent_channels if transformer_config is None else transformer_config.latent_channels
    return WanVAEConfig.tiny(base_dim=8, z_dim=channels, latents_mean=(0.0,) * channels,
                             latents_std=(1.0,) * channels, dtype="bfloat16")


def _jit_init(make: Callable[[Any], Any]) -> Any:
    """``make(rngs)`` with random weights drawn in one compiled program (rbg keys: compiles fast on CPU)."""
    import jax
    from flax import nnx

    from ardiff_jax.models._common import NOISE_PRNG_IMPL

    def rngs() -> Any:
        return nnx.Rngs(jax.random.key(0, impl=NOISE_PRNG_IMPL))

    graphdef = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))[0]
    state = jax.jit(lambda: nnx.split(make(rngs()))[1])()
    return nnx.merge(graphdef, state)


def make_vae(config: Any, seed: int = 0) -> Any:
    """A :class:`WanVAE` of ``config`` with random weights of the module's own distribution (every conv kernel
    ``N(0, 1) / sqrt(fan_in)``, biases 0, norm gains 1), drawn on the host with numpy: no XLA program to
    compile (a jitted init of its ~200 tensors compiles for ~10-20 s on a CPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ardiff_jax.models.wan import WanVAE

    graphdef, state = nnx.split(nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path: Any, leaf: Any) -> Any:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        name = names[-1] if names else None
        if name == "kernel":
            value = rng.standard_normal(leaf.shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(leaf.shape[:-1])))
        elif name == "bias":
            value = np.zeros(leaf.shape, np.float32)
        elif name == "gamma":
            value = np.ones(leaf.shape, np.float32)
        else:  # a parameter this init does not know: refuse rather than guess its distribution
            raise ValueError(f"make_vae: no random init for the WanVAE parameter {jax.tree_util.keystr(path)}")
        return jnp.asarray(value, leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def vae_decode_flops(config: Any, latent_hw: tuple[int, int], latents: int = 3) -> float:
    """FLOPs of one steady-state ``decode_step`` of ``latents`` frames at ``latent_hw`` (XLA's cost analysis
    of the program, from shapes only: nothing is allocated or compiled)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ardiff_jax.models.wan import WanVAE, init_decode_cache
    from ardiff_jax.models.wan._vae import _decode_step_jit

    graphdef, params = nnx.split(nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: init_decode_cache(config, latent_hw))
    cache = type(cache)(cache.convs, True)
    z = jax.ShapeDtypeStruct((latents, config.z_dim, *latent_hw), jnp.float32)
    cost = _decode_step_jit.lower(graphdef, params, z, cache).cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", float("nan")))


def text_encoder_config(kind: str) -> Any:
    """The umT5 of the text-encode case: ``"xxl"`` (Wan's umT5-XXL, bf16), ``"reduced"`` (the XXL's layer, 2 of
    its 24 layers, 32,128 embedding rows) or ``"smoke"`` (2 layers of width 16)."""
    from ardiff_jax.models.wan import UMT5Config

    if kind == "xxl":
        return UMT5Config()
    if kind == "reduced":
        return UMT5Config(num_layers=CPU_UMT5_LAYERS, vocab_size=REDUCED_UMT5_VOCAB)
    if kind == "smoke":
        return UMT5Config.tiny(d_model=16, dtype="bfloat16", param_dtype="bfloat16")
    raise ValueError(f"text encoder kind must be 'xxl', 'reduced' or 'smoke', got {kind!r}")


def umt5_flops(config: Any, tokens: int = TEXT_LEN) -> float:
    """FLOPs of one umT5 forward over ``tokens`` tokens: per layer the q/k/v/o and gated-FFN matmuls
    (``2 n (4 d inner + 3 d d_ff)``) and the scores and weighted values (``4 n^2 inner``); the embedding is a
    gather (XLA's cost analysis agrees on one layer: 0.202 TFLOP for the XXL at 512 tokens)."""
    d, inner, ff, n = config.d_model, config.inner_dim, config.d_ff, tokens
    return float(config.num_layers * (2 * n * (4 * d * inner + 3 * d * ff) + 4 * n * n * inner))


_PROMPT = "a corgi surfing a wave at sunset cinematic slow motion"


def _stand_in_tokenizer(directory: Path) -> Path:
    """A umT5-shaped ``tokenizer.json`` (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, a few words): the real one's
    layout, not its 256k pieces (tokenizing is host work of well under a millisecond either way)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(_PROMPT.split()) | {str(i) for i in range(10)})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


class _ProgramEncoder:
    """Without ``tokenizers``: :class:`WanTextEncoder`'s jitted program (ids padded to ``text_len``, the padded
    rows zeroed, the features copied to the host) on fixed ids."""

    def __init__(self, encoder: Any, text_len: int) -> None:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        graphdef, self._state = nnx.split(encoder)

        def program(state: Any, ids: Any, length: Any) -> Any:
            valid = jnp.arange(text_len) < length
            return jnp.where(valid[:, None], nnx.merge(graphdef, state)(ids, valid), 0.0)

        self._program = jax.jit(program)
        self._ids = np.full((text_len,), 0, np.int32)
        self._ids[:12] = np.arange(3, 15)
        self._ids[12] = 1

    def encode(self, prompt: str) -> np.ndarray:
        return np.asarray(self._program(self._state, self._ids, np.int32(13)))[:13]


def make_text_encoder(kind: str, workdir: Path) -> tuple[Any, dict[str, Any]]:
    """A umT5 text encoder of :func:`text_encoder_config` ``(kind)`` with random weights, behind
    :class:`WanTextEncoder` (a stand-in tokenizer written to ``workdir``; its per-prompt cache off), or behind
    the same jitted program when ``tokenizers`` is missing. Returns it and its description (init seconds)."""
    import jax
    from flax import nnx

    from ardiff_jax.models.wan import UMT5Encoder, WanTextEncoder
    from benchmarks.common import sync

    config = text_encoder_config(kind)
    start = time.perf_counter()
    encoder = _jit_init(lambda rngs: UMT5Encoder(config, rngs=rngs))
    sync(nnx.state(encoder))
    init_s = time.perf_counter() - start
    try:
        text: Any = WanTextEncoder(encoder, _stand_in_tokenizer(workdir), text_len=TEXT_LEN, cache_size=0)
        path = "WanTextEncoder.encode (stand-in tokenizer.json, cache off)"
    except ImportError:
        text = _ProgramEncoder(encoder, TEXT_LEN)
        path = "WanTextEncoder's program on fixed ids (tokenizers not installed)"
    info = {
        "kind": kind, "path": path, "num_layers": config.num_layers, "d_model": config.d_model, "d_ff": config.d_ff,
        "num_heads": config.num_heads, "d_kv": config.d_kv, "vocab_size": config.vocab_size, "dtype": config.dtype,
        "param_dtype": config.param_dtype, "params": int(encoder.num_params),
        "param_bytes": sum(x.nbytes for x in jax.tree.leaves(nnx.state(encoder))),
        "text_len": TEXT_LEN, "flops_per_prompt": umt5_flops(config), "init_s": init_s,
        "xxl_flops_per_prompt": umt5_flops(text_encoder_config("xxl")),
    }
    return text, info


def text_encode_case(text: Any) -> Case:
    """One prompt through ``text`` per sample (a new prompt string each time: nothing cached)."""
    counter = [0]

    def encode() -> np.ndarray:
        counter[0] += 1
        return text.encode(f"{_PROMPT} {counter[0]}")

    return Case("text_encode", encode)


def _xxl_estimate(info: dict[str, Any], median_ms: float) -> float | None:
    """The XXL's time from a reduced run's: x 24 / layers (the layers are all the per-token work)."""
    if info["num_layers"] == UMT5_XXL_LAYERS or info["kind"] != "reduced":
        return None
    return median_ms * UMT5_XXL_LAYERS / info["num_layers"]


def measure_text_encode(kind: str, *, warmup: int = 1, rounds: int = 5,
                        keep_going: Callable[[float], bool] | None = None) -> dict[str, Any]:
    """The text encode of one prompt on its own (``gpu_check``'s form): build, first encode (compiles), then
    ``rounds`` samples (``keep_going`` may stop them); the weights are dropped at the end."""
    with tempfile.TemporaryDirectory() as workdir:
        text, info = make_text_encoder(kind, Path(workdir))
        start = time.perf_counter()
        first = text.encode(_PROMPT)
        info["first_encode_s"] = time.perf_counter() - start  # includes the compile
        info["features_shape"] = list(first.shape)
        info["features_finite"] = bool(np.isfinite(first).all())
        case = text_encode_case(text)
        stats, samples = _interleave([case], warmup=warmup, rounds=rounds, keep_going=keep_going)
    del text
    median = stats["text_encode"].median_ms
    return {**info, "stats": stats["text_encode"], "median_ms": median, "samples_ms": [1e3 * x for x in
                                                                                      samples["text_encode"]],
            "xxl_estimate_ms": _xxl_estimate(info, median)}


def make_pipeline(config: Any, *, checkpoint: str | Path | None = None, session_capacity: int = 1,
                  vae: Any = None) -> Any:
    """A :class:`CausalWanPipeline` of ``config``: random weights, or ``checkpoint``'s (same geometry); with
    ``vae`` every block is decoded to video."""
    from ardiff_jax.models.wan import CausalWanPipeline, CausalWanPipelineConfig

    pipeline_config = CausalWanPipelineConfig(session_capacity=session_capacity)
    if checkpoint is not None:
        return CausalWanPipeline.from_checkpoint(checkpoint, config, pipeline_config=pipeline_config, vae=vae)
    return CausalWanPipeline(config, pipeline_config, vae=vae)


def prompt_embeds(config: Any, seed: int = 0) -> np.ndarray:
    """Random text-encoder features ``f32[min(64, text_len), text_dim]`` (the session's conditioning)."""
    rows = min(PROMPT_ROWS, config.text_len)
    return np.random.default_rng(seed).standard_normal((rows, config.text_dim)).astype(np.float32)


def engine_config(backend: str = "auto", *, warmup: bool = True) -> Any:
    """bf16 KV; on CPU a fixed 4 GiB plan (the pools of one session fit), on an accelerator 30% of free memory.
    ``warmup=False`` skips the engine's warmup blocks (the first blocks then compile)."""
    import jax

    from ardiff_jax import EngineConfig

    if jax.default_backend() == "cpu":
        return EngineConfig(dtype="bfloat16", available_memory_bytes=2**32, gpu_memory_fraction=1.0,
                            attention_backend=backend, warmup=warmup)
    return EngineConfig(dtype="bfloat16", gpu_memory_fraction=0.3, attention_backend=backend, warmup=warmup)


# -- recording the forwards of one block ------------------------------------------------------------------
def _world_module() -> Any:
    from ardiff_jax.models import _world

    return _world


def _vae_module() -> Any:
    from ardiff_jax.models.wan import _pipeline

    return _pipeline


class ForwardRecorder:
    """Wraps ``module.name`` (default ``ardiff_jax.models._world.world_step``) while active and records every
    call's arguments.

    The pipeline looks ``world_step`` (and ``_decode_step_jit``, in ``models.wan._pipeline``) up in
    its module at each call, so the engine runs through the wrapper unchanged. Each recorded call
    keeps the same graphdef and parameters (never donated) and a copy of every other array
    argument, made at the call: the KV pools in the paged views are donated by the commit that
    follows the block's last forward, the VAE cache by the decode. An array shared by several
    calls (the pools, the text K/V) is copied once.
    """

    def __init__(self, module: Any = None, name: str = "world_step") -> None:
        self._module = _world_module() if module is None else module
        self._name = name
        self.original: Callable[..., Any] = getattr(self._module, name)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._copies: dict[int, tuple[Any, Any]] = {}

    def _copy(self, tree: Any) -> Any:
        import jax

        def leaf(x: Any) -> Any:
            if not isinstance(x, jax.Array):
                return x
            if id(x) not in self._copies:  # keep the original alive so its id is not reused
                self._copies[id(x)] = (x, x.copy())
            return self._copies[id(x)][1]

        return jax.tree.map(leaf, tree)

    def __call__(self, graphdef: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(((graphdef, params, *self._copy(args)), dict(self._copy(kwargs))))
        return self.original(graphdef, params, *args, **kwargs)

    def __enter__(self) -> ForwardRecorder:
        setattr(self._module, self._name, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(self._module, self._name, self.original)
        self._copies.clear()


class ForwardTimer:
    """Wraps ``module.name`` (default ``world_step``) while active: waits for each call's inputs, then times
    the call to its outputs. A block run under it (and a second one on the VAE decode) splits into its
    device calls and the runtime's own time around them (``block - sum(calls)``), all from the same
    block: immune to drift between samples, but with every call synced (no host work hidden behind
    device work)."""

    def __init__(self, module: Any = None, name: str = "world_step") -> None:
        self._module = _world_module() if module is None else module
        self._name = name
        self.original: Callable[..., Any] = getattr(self._module, name)
        self.forward_s: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from benchmarks.common import sync

        sync((args, kwargs))  # the runtime's pending device work (noise, views) counts as the runtime's
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        sync(out)
        self.forward_s.append(time.perf_counter() - start)
        return out

    def __enter__(self) -> ForwardTimer:
        setattr(self._module, self._name, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(self._module, self._name, self.original)


def _generate(engine: Any, request_id: str, session_id: str) -> Any:
    """One engine block of ``session_id``, synced: its latents and (with a VAE) its video are ready."""
    from ardiff_jax import DiffusionRequest
    from benchmarks.common import sync

    out = engine.generate(DiffusionRequest(request_id, extra_args={"session_id": session_id}))
    sync(out)
    return out


def capture_block_forwards(engine: Any, session_id: str, request_id: str) -> tuple[Callable[..., Any], list[Any]]:
    """Run one engine block on ``session_id`` through a :class:`ForwardRecorder`: ``(world_step, calls)``."""
    step, calls, _, _ = _capture_block(engine, session_id, request_id)
    return step, calls


def _capture_block(engine: Any, session_id: str, request_id: str) -> tuple[Any, list[Any], Any, list[Any]]:
    """One engine block with both recorders: ``(world_step, its calls, decode program, its calls)``."""
    with ForwardRecorder() as recorder, ForwardRecorder(_vae_module(), "_decode_step_jit") as vae_recorder:
        _generate(engine, request_id, session_id)
    return recorder.original, recorder.calls, vae_recorder.original, vae_recorder.calls


# -- the split ----------------------------------------------------------------------------------------------
def _interleave(cases: Sequence[Case], *, warmup: int, rounds: int,
                keep_going: Callable[[float], bool] | None = None) -> tuple[dict[str, Stats], dict[str, list[float]]]:
    """``common.run_interleaved`` (warm every case up, then rounds of every case in turn, one sync per
    sample), with ``keep_going(slowest round so far, s)`` asked before each round after the first.
    Returns the stats and the samples (seconds) in round order."""
    for case in cases:
        for _ in range(warmup):
            case.once()
    samples: dict[str, list[float]] = {case.name: [] for case in cases}
    faults: dict[str, list[int]] = {case.name: [] for case in cases}
    slowest = 0.0
    for round_index in range(rounds):
        if round_index and keep_going is not None and not keep_going(slowest):
            break
        began = time.perf_counter()
        for case in cases:
            elapsed, minflt = case.once()
            samples[case.name].append(elapsed)
            faults[case.name].append(minflt)
        slowest = max(slowest, time.perf_counter() - began)
    return {name: Stats.of(samples[name], faults[name]) for name in samples}, samples


def runtime_self_time(engine: Any, session_id: str, blocks: int = 2) -> dict[str, Any]:
    """``blocks`` engine blocks under :class:`ForwardTimer` s (the forwards, the VAE decode): each block's
    time outside its device calls."""
    per_block = []
    for index in range(blocks):
        with ForwardTimer() as timer, ForwardTimer(_vae_module(), "_decode_step_jit") as vae_timer:
            start = time.perf_counter()
            _generate(engine, f"{session_id}-timed-{index}", session_id)
            total = time.perf_counter() - start
        forwards, vae = sum(timer.forward_s), sum(vae_timer.forward_s)
        model = forwards + vae
        per_block.append({"block_ms": 1e3 * total, "forwards_ms": 1e3 * forwards, "forwards": len(timer.forward_s),
                          "vae_decode_ms": 1e3 * vae, "vae_decodes": len(vae_timer.forward_s),
                          "runtime_ms": 1e3 * (total - model), "runtime_fraction_of_model": (total - model) / model})
    return {
        "blocks": per_block,
        "runtime_ms_median": float(np.median([b["runtime_ms"] for b in per_block])),
        "runtime_fraction_of_model_median": float(np.median([b["runtime_fraction_of_model"] for b in per_block])),
    }


def _copy_tree(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def split_block(engine: Any, session_id: str, *, frames_per_block: int, warmup: int = 1, rounds: int = 5,
                keep_going: Callable[[float], bool] | None = None, self_time_blocks: int = 2,
                extra_cases: Sequence[Case] = ()) -> dict[str, Any]:
    """Time ``session_id``'s next blocks through ``engine`` against its recorded forwards and decode, interleaved.

    The session must have had its first block (prompt and compilation done; with a VAE, its
    first decode, so the recorded one is a steady-state block). Returns the medians of the cases
    (``extra_cases`` run in the same rounds), the split (denoise / commit / VAE decode / overhead,
    ms), the throughputs and whether the overhead target holds; ``keep_going`` may stop the rounds
    early (time guards). Then ``self_time_blocks`` blocks under :func:`runtime_self_time` (when
    ``keep_going`` allows): the runtime's time around synced device calls, a drift-free cross-check.
    """
    from benchmarks.bench_e2e import _CompileClock

    step, calls, vae_step, vae_calls = _capture_block(engine, session_id, f"{session_id}-capture")
    if len(calls) < 2:
        raise RuntimeError(f"expected the block's denoise forwards and one commit forward, recorded {len(calls)}")
    if len(vae_calls) > 1:
        raise RuntimeError(f"expected at most one VAE decode per block, recorded {len(vae_calls)}")
    *denoise_calls, commit_call = calls
    counter = [0]
    last: list[Any] = [None]

    def engine_block() -> Any:
        from ardiff_jax import DiffusionRequest

        counter[0] += 1
        request = DiffusionRequest(f"{session_id}-split-{counter[0]}", extra_args={"session_id": session_id})
        last[0] = engine.generate(request)
        return last[0]  # synced whole: the latents and the video

    def denoise() -> Any:
        out = None
        for args, kwargs in denoise_calls:
            if out is not None:  # the pipeline's chain: this step's x_t is the previous step's x_next
                args = (*args[:3], out[0], *args[4:])
            out = step(*args, **kwargs)
        return out

    def commit() -> Any:
        args, kwargs = commit_call
        return step(*args, **kwargs)

    cases = [Case("engine_block", engine_block), Case("denoise", denoise), Case("commit", commit)]
    vae_info: dict[str, Any] = {}
    if vae_calls:
        (vae_graphdef, vae_params, z, recorded_cache, *rest), vae_kwargs = vae_calls[0]
        fresh: list[Any] = []

        def vae_setup() -> Any:  # untimed: the decode donates its cache, so each sample gets a copy
            fresh.append(_copy_tree(recorded_cache))
            return fresh[-1]

        def vae_decode() -> Any:
            return vae_step(vae_graphdef, vae_params, z, fresh.pop(), *rest, **vae_kwargs)

        cases.append(Case("vae_decode", vae_decode, setup=vae_setup))
        vae_info = {"vae_latents_per_decode": int(z.shape[0]), "vae_cache_started": bool(recorded_cache.started)}
    cases += list(extra_cases)
    with _CompileClock() as clock:
        stats, samples = _interleave(cases, warmup=warmup, rounds=rounds, keep_going=keep_going)
    denoise_ms, commit_ms = stats["denoise"].median_ms, stats["commit"].median_ms
    vae_ms = stats["vae_decode"].median_ms if vae_calls else 0.0
    block_ms = stats["engine_block"].median_ms
    transformer_ms = denoise_ms + commit_ms
    model_ms = transformer_ms + vae_ms
    overhead_ms = block_ms - model_ms
    fraction = overhead_ms / model_ms
    # The same per round (the cases ran back to back): robust to drift between rounds.
    vae_samples = samples["vae_decode"] if vae_calls else [0.0] * len(samples["denoise"])
    per_round = [(e - d - c - v) / (d + c + v) for e, d, c, v in zip(
        samples["engine_block"], samples["denoise"], samples["commit"], vae_samples, strict=True)]
    slowest_block = max(samples["engine_block"])
    block = last[0]
    video = getattr(block, "video", None)
    checks = {"latents_finite": bool(np.isfinite(np.asarray(block.latents)).all()),
              "latents_shape": list(block.latents.shape),
              "video_shape": None if video is None else list(video.shape)}
    self_time: dict[str, Any] = {"skipped": "no blocks requested"}
    if self_time_blocks > 0:
        if keep_going is None or keep_going(self_time_blocks * slowest_block):
            self_time = runtime_self_time(engine, session_id, self_time_blocks)
        else:
            self_time = {"skipped": "time guard"}
    video_frames = VIDEO_FRAMES_PER_LATENT_FRAME * frames_per_block
    if video is not None:
        video_frames = int(video.shape[0])  # what the steady-state block decoded
    split = {
        "stats": stats,
        "forwards_recorded": len(calls),
        "denoise_steps": len(denoise_calls),
        "vae_decodes_recorded": len(vae_calls),
        **vae_info,
        "engine_block_ms": block_ms,
        "denoise_ms": denoise_ms,
        "denoise_ms_per_step": denoise_ms / len(denoise_calls),
        "commit_ms": commit_ms,
        "transformer_ms": transformer_ms,
        "model_ms": model_ms,
        "overhead_ms": overhead_ms,
        "overhead_fraction_of_model": fraction,
        "overhead_target_fraction": OVERHEAD_TARGET,
        "overhead_target_met": bool(fraction <= OVERHEAD_TARGET),
        "overhead_fraction_per_round": per_round,
        "overhead_fraction_per_round_median": float(np.median(per_round)),
        "samples_ms": {name: [1e3 * x for x in values] for name, values in samples.items()},
        "runtime_self_time": self_time,
        "rounds": stats["engine_block"].n,
        "xla_compiles_during_split": clock.count,
        "video_frames_per_block": video_frames,
        "throughput": throughput(frames_per_block, block_ms),
        "throughput_model_only": throughput(frames_per_block, model_ms),
        "throughput_transformer_only": throughput(frames_per_block, transformer_ms),
        **checks,
    }
    if vae_calls:
        split["vae_decode_ms"] = vae_ms
        split["vae_decode_fraction_of_model"] = vae_ms / model_ms
    return split


#: The release's reported rate: "real-time, 25 fps" (Matrix-Game 2.0's README; one A100/H100-class GPU).
MATRIX_GAME_REPORTED_FPS = 25.0


def matrix_game_blocks(*, smoke: bool = False, blocks: int = 4, preset: str | None = None) -> dict[str, Any]:
    """Matrix-Game 2.0 through the engine, one session: per steady-state block the transformer (its 3 denoise
    forwards and the commit pass, action modules included), the streaming VAE decode and the runtime's own
    time, and end-to-end frames/s next to the release's 25.

    Random weights of ``preset`` (``matrix-game-2-universal``, bf16; ``--smoke``: ``matrix-game-tiny``,
    float32): the real geometry (352 x 640, 880 tokens per latent frame, window 6) without any download.
    A block is 3 latent frames = 12 video frames (9 for the session's first). Timed blocks alternate: an
    unsynced engine block (``block``), then a block with every transformer call and the decode synced and
    timed inside it (``transformer``, ``vae_decode``, ``runtime = block - transformer - decode`` of that
    same block). The image encoder runs once per session, inside the first block (untimed warm-up).
    """
    from ardiff_jax import ARDiffusionEngine, DiffusionRequest, EngineConfig
    from ardiff_jax.models.matrix_game import _pipeline as mg_pipeline
    from ardiff_jax.models.matrix_game import build_matrix_game
    from ardiff_jax.models.wan import _pipeline as wan_pipeline
    from benchmarks.common import sync

    preset = preset or ("matrix-game-tiny" if smoke else "matrix-game-2-universal")
    dtype = "float32" if smoke else "bfloat16"
    pipeline = build_matrix_game(preset=preset, random_weights=True, dtype=dtype, session_capacity=1)
    cfg, action = pipeline.config, pipeline.config.action
    h, w = pipeline.pixel_hw
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    config = engine_config() if not smoke else EngineConfig(dtype="float32", available_memory_bytes=2**30,
                                                             gpu_memory_fraction=1.0)
    engine = ARDiffusionEngine(pipeline, dataclasses.replace(config, warmup=False))
    per_block = action.frames_per_latent * cfg.frames_per_block
    sent = [0]

    def request() -> Any:
        first = sent[0] == 0
        rows = action.num_rows(cfg.frames_per_block) if first else per_block
        inputs: dict[str, Any] = {"keyboard": np.eye(action.keyboard_dim, dtype=np.float32)[
            rng.integers(0, action.keyboard_dim, rows)]}
        if action.mouse_dim:
            inputs["mouse"] = (0.1 * rng.standard_normal((rows, action.mouse_dim))).astype(np.float32)
        if first:
            inputs.update(image=image, seed=0)
        sent[0] += 1
        return DiffusionRequest(f"mg-{sent[0]}", extra_args={"session_id": "mg"}, inputs=inputs)

    def block() -> float:
        start = time.perf_counter()
        out = engine.generate(request())
        np.asarray(out.video)
        return time.perf_counter() - start

    try:
        for _ in range(2):  # compile: the first block (image encode, prefill shapes) and a steady one
            block()
        wall, split = [], []
        for _ in range(max(1, blocks)):
            wall.append(block())
            with ForwardTimer(mg_pipeline, "matrix_game_step") as step, \
                    ForwardTimer(wan_pipeline, "_decode_step_jit") as decode:
                timed = block()
            sync(None)
            transformer, vae = sum(step.forward_s), sum(decode.forward_s)
            split.append({"block_s": timed, "transformer_s": transformer, "vae_decode_s": vae,
                          "runtime_s": timed - transformer - vae, "transformer_calls": len(step.forward_s)})
    finally:
        engine.close()
    block_ms = 1e3 * float(np.median(wall))
    fps = per_block / (block_ms / 1e3)
    median = {key: 1e3 * float(np.median([s[key] for s in split]))
              for key in ("block_s", "transformer_s", "vae_decode_s", "runtime_s")}
    return {
        "preset": preset, "dtype": dtype, "pixels": [h, w], "tokens_per_latent_frame": cfg.tokens_per_frame,
        "window_frames": cfg.window_frames, "video_frames_per_block": per_block, "blocks_timed": len(wall),
        "block_ms_median": block_ms, "frames_per_s": fps,
        "split_ms_median": {"synced_block": median["block_s"], "transformer": median["transformer_s"],
                            "vae_decode": median["vae_decode_s"], "runtime": median["runtime_s"]},
        "transformer_calls_per_block": split[-1]["transformer_calls"],
        "release_reported_fps": MATRIX_GAME_REPORTED_FPS, "ratio_to_release": fps / MATRIX_GAME_REPORTED_FPS,
    }


def throughput(frames_per_block: int, block_ms: float) -> dict[str, float]:
    """Latent frames/s of one block every ``block_ms``, and video frames/s at Wan's steady-state VAE rate."""
    latent = frames_per_block / (block_ms / 1e3)
    return {"latent_frames_per_s": latent, "video_frames_per_s": VIDEO_FRAMES_PER_LATENT_FRAME * latent}


def amortised_fps(video_frames_per_block: int, block_ms: float, text_encode_ms: float,
                  blocks_per_prompt: Sequence[int] = AMORTISE_BLOCKS) -> list[dict[str, float]]:
    """End-to-end video frames/s with one text encode per prompt held for ``n`` blocks:
    ``n F / (n block + text)``."""
    return [{"blocks_per_prompt": n, "video_frames": n * video_frames_per_block,
             "video_frames_per_s": n * video_frames_per_block / ((n * block_ms + text_encode_ms) / 1e3)}
            for n in blocks_per_prompt]


def e2e_summary(split: dict[str, Any], *, text: dict[str, Any] | None, on_target_hardware: bool) -> dict[str, Any]:
    """The end-to-end figures of a split (engine block with its VAE decode) next to the references and the goal."""
    fps = split["video_frames_per_block"] / (split["engine_block_ms"] / 1e3)
    summary: dict[str, Any] = {
        "what": "video frames/s = video frames a steady-state block decodes / engine block median (transformer + "
                "VAE decode + runtime); the text encode runs once per prompt, reported separately",
        "video_frames_per_block": split["video_frames_per_block"],
        "video_frames_per_s": fps,
        "model_only_video_frames_per_s": split["video_frames_per_block"] / (split["model_ms"] / 1e3),
        "transformer_only_video_frames_per_s": split["video_frames_per_block"] / (split["transformer_ms"] / 1e3),
        "vae_decode_only_video_frames_per_s": (split["video_frames_per_block"] / (split["vae_decode_ms"] / 1e3)
                                               if split.get("vae_decode_ms") else None),
        "reference_fps": {"label": REFERENCE_LABEL, **REFERENCE_FPS},
        "over_reference": {ref: fps / figures["video_frames_per_s"] for ref, figures in REFERENCE_FPS.items()},
        "goal": {"video_frames_per_s": GOAL_E2E_VIDEO_FRAMES_PER_S, "hardware": "1x H200",
                 "what": "end-to-end (transformer + VAE) video frames/s at 480x832"},
        "goal_met": bool(fps >= GOAL_E2E_VIDEO_FRAMES_PER_S),
        "goal_applies": on_target_hardware,
    }
    if text is not None and "median_ms" in text:
        summary["text_encode_ms_per_prompt"] = text["median_ms"]
        summary["text_encoder"] = text.get("kind")
        summary["amortised_with_text_encode"] = amortised_fps(split["video_frames_per_block"],
                                                              split["engine_block_ms"], text["median_ms"])
        if text.get("xxl_estimate_ms"):
            summary["text_encode_xxl_estimate_ms"] = text["xxl_estimate_ms"]
            summary["amortised_with_xxl_estimate"] = amortised_fps(split["video_frames_per_block"],
                                                                   split["engine_block_ms"], text["xxl_estimate_ms"])
    return summary


def vae_summary(vae: Any, transformer_config: Any, *, smoke: bool = False) -> dict[str, Any]:
    """The VAE's size, one session's cache bytes at the run's latent and at 832x480, and the decode's FLOPs."""
    from ardiff_jax.models.wan import cache_nbytes

    config = vae.config
    latent = (transformer_config.latent_height, transformer_config.latent_width)
    return {
        "config": "wan2.1 (base 96, dims 96 x [1, 2, 4, 4])" if not smoke else f"tiny (base {config.base_dim})",
        "dtype": config.dtype, "params": int(vae.num_params),
        "cache_bytes_per_session": cache_nbytes(config, latent),
        "cache_resolution": [8 * latent[0], 8 * latent[1]],
        "cache_bytes_per_session_832x480": cache_nbytes(config, FULL_LATENT),
        "cache_bytes_per_session_832x480_f32": cache_nbytes(config, FULL_LATENT, "float32"),
        "decode_flops_per_block": vae_decode_flops(config, latent, transformer_config.frames_per_block),
        "decode_flops_per_block_832x480": vae_decode_flops(config, FULL_LATENT, transformer_config.frames_per_block),
    }


# -- the benchmark ------------------------------------------------------------------------------------------
def run(*, latent: tuple[int, int] | None = DEFAULT_LATENT, blocks: int = 3, checkpoint: str | Path | None = None,
        smoke: bool = False, backend: str = "auto", out_dir: Path = RESULTS_DIR, write: bool = True,
        vae: bool = True, umt5_layers: int | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """Build the pipeline (with its VAE), the text encoder and the engine, run the session's first block, then
    the split over ``blocks`` rounds (fewer when ``budget_s``, counted from here, runs out)."""
    import jax
    from flax import nnx

    from ardiff_jax import ARDiffusionEngine, DiffusionRequest
    from benchmarks.bench_e2e import _CompileClock
    from benchmarks.common import sync

    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    began = time.monotonic()

    def keep_going(needed_s: float) -> bool:
        return budget_s is None or budget_s - (time.monotonic() - began) >= needed_s

    config = wan_config(latent, smoke=smoke)
    on_cpu = jax.default_backend() == "cpu"
    if smoke:
        text_kind = "smoke"
    elif umt5_layers is None:
        text_kind = "reduced" if on_cpu else "xxl"
    else:
        text_kind = "xxl" if umt5_layers >= UMT5_XXL_LAYERS else "reduced"
    setup: dict[str, Any] = {}
    workdir = tempfile.TemporaryDirectory()
    with _CompileClock() as clock:
        start = time.perf_counter()
        wan_vae = make_vae(vae_config(config, smoke=smoke)) if vae else None
        if wan_vae is not None:
            sync(nnx.state(wan_vae))
        setup["vae_init_s"] = time.perf_counter() - start
        start, before = time.perf_counter(), clock.seconds
        pipeline = make_pipeline(config, checkpoint=checkpoint, vae=wan_vae)
        sync(nnx.state(pipeline.modules))
        setup["weights_s"] = time.perf_counter() - start
        setup["weights_compile_s"] = clock.seconds - before
        _progress(f"VAE {setup['vae_init_s']:.1f} s, transformer {setup['weights_s']:.1f} s; text encoder "
                  f"({text_kind})")
        if umt5_layers is not None and text_kind == "reduced" and umt5_layers != CPU_UMT5_LAYERS:
            raise ValueError(f"--umt5-layers takes {CPU_UMT5_LAYERS} (reduced) or {UMT5_XXL_LAYERS} (XXL), "
                             f"got {umt5_layers}")
        text, text_info = make_text_encoder(text_kind, Path(workdir.name))
        start = time.perf_counter()
        first_features = text.encode(_PROMPT)
        text_info["first_encode_s"] = time.perf_counter() - start  # includes the compile
        text_info["features_shape"] = list(first_features.shape)
        text_info["features_finite"] = bool(np.isfinite(first_features).all())
        _progress(f"text encoder init {text_info['init_s']:.1f} s, first encode {text_info['first_encode_s']:.1f} s; "
                  "loading the engine")
        # The full-size CPU run skips the engine's warmup blocks (two blocks of a minute each there): the
        # session's first block compiles instead, and the capture block (untimed) the steady-state decode.
        warmup = smoke or not on_cpu
        setup["engine_warmup"] = warmup
        start, before = time.perf_counter(), clock.seconds
        engine = ARDiffusionEngine(pipeline, engine_config(backend, warmup=warmup))
        setup["engine_load_s"] = time.perf_counter() - start  # with warmup: the warmup blocks (compiles)
        setup["engine_load_compile_s"] = clock.seconds - before
        _progress(f"engine load: {setup['engine_load_s']:.1f} s; first block")
        session = "bench-wan"
        try:
            start, before = time.perf_counter(), clock.seconds  # the session's first block: the prompt's text K/V
            first = engine.generate(DiffusionRequest("bench-wan-b0",
                                                     inputs={"prompt_embeds": prompt_embeds(config)},
                                                     extra_args={"session_id": session}))
            sync(first)
            setup["first_block_s"] = time.perf_counter() - start
            setup["first_block_compile_s"] = clock.seconds - before
        except BaseException:
            engine.close()
            raise
    latents = np.asarray(first.latents)
    first_video_shape = None if getattr(first, "video", None) is None else list(first.video.shape)
    try:
        _progress(f"first block: {setup['first_block_s']:.1f} s; capture + up to {blocks} rounds"
                  + (f" (budget {budget_s:.0f} s, {time.monotonic() - began:.0f} s used)" if budget_s else ""))
        # On CPU a sample is a minute and the untimed capture block compiles what the first block did not
        # (the steady-state decode): it stands in for the warmup round.
        split = split_block(engine, session, frames_per_block=config.frames_per_block,
                            warmup=1 if (smoke or not on_cpu) else 0, rounds=blocks,
                            keep_going=keep_going if budget_s is not None else None,
                            self_time_blocks=2 if (smoke or not on_cpu) else 1,
                            extra_cases=[text_encode_case(text)])
        attention_backend = engine.runner.kv_cache.attention_backend
        capacity = engine.session_capacity
    finally:
        engine.close()
        workdir.cleanup()
    text_median = split["stats"]["text_encode"].median_ms
    text_record = {**text_info, "stats": split["stats"]["text_encode"], "median_ms": text_median,
                   "samples_ms": split["samples_ms"]["text_encode"],
                   "xxl_estimate_ms": _xxl_estimate(text_info, text_median)}
    finite = bool(np.isfinite(latents).all() and split["latents_finite"])
    record = {
        "benchmark": "bench_wan",
        "machine": machine_info(),
        "config": {
            "preset": config.name, "smoke": smoke, "weights": str(checkpoint) if checkpoint else "random",
            "policy": "self-forcing", "num_layers": config.num_layers, "dim": config.dim,
            "num_heads": config.num_heads, "head_dim": config.head_dim, "ffn_dim": config.ffn_dim,
            "latent": [config.latent_height, config.latent_width],
            "video_resolution": [8 * config.latent_height, 8 * config.latent_width],
            "tokens_per_frame": config.tokens_per_frame, "frames_per_block": config.frames_per_block,
            "window_frames": config.window_frames, "sink_frames": config.sink_frames,
            "timesteps": list(pipeline.schedule.timesteps), "dtype": "bfloat16",
            "param_dtype": config.param_dtype, "attention_backend": attention_backend,
            "session_capacity": capacity, "blocks": blocks, "prompt_rows": min(PROMPT_ROWS, config.text_len),
            "backend": jax.default_backend(), "vae": vae, "text_encoder": text_kind, "budget_s": budget_s,
            "elapsed_s": time.monotonic() - began,
        },
        "setup": setup,
        "block": split,
        "vae": vae_summary(wan_vae, config, smoke=smoke) if wan_vae is not None else None,
        "pipeline_vae_cache_bytes": pipeline.vae_cache_bytes,
        "text_encode": text_record,
        "e2e": e2e_summary(split, text=text_record, on_target_hardware=not on_cpu and not smoke
                           and (config.latent_height, config.latent_width) == FULL_LATENT),
        "latents_shape": list(latents.shape),
        "first_video_shape": first_video_shape,
        "latents_finite": finite,
        "notes": {
            "video_frames": "video frames per steady-state block = 4 x latent frames (Wan's VAE); the session's "
                            "first block decodes 1 + 4 x 2 = 9",
            "overhead": "engine block median - (denoise + commit + VAE decode medians) of the same programs on the "
                        "block's recorded arguments, interleaved",
            "text_encode": "timed in the same rounds, once per prompt in a real session (CausalWanPipeline caches "
                           "per prompt); the session itself is conditioned on random prompt_embeds",
        },
    }
    if write:
        path = write_json(out_dir / ("bench_wan_smoke.json" if smoke else "bench_wan.json"), record)
        print_report(record, path)
    return record


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_report(record: dict[str, Any], path: Path | None = None) -> None:
    config, split = record["config"], record["block"]
    print(f"\n== bench_wan: {config['preset']} ({config['weights']} weights), {config['num_layers']} layers, "
          f"latent {config['latent'][0]}x{config['latent'][1]} ({config['tokens_per_frame']} tokens/frame, video "
          f"{config['video_resolution'][1]}x{config['video_resolution'][0]}), {config['frames_per_block']}-frame "
          f"blocks, window {config['window_frames']} + sink {config['sink_frames']}, {config['attention_backend']} "
          f"attention, bf16; VAE {'on' if config['vae'] else 'off'}; text encoder {config['text_encoder']} ==")
    print(machine_line(record["machine"]))
    stats = split["stats"]

    def spread(name: str) -> str:
        s = stats[name]
        return f"[{s.p10_ms:.4g}-{s.p90_ms:.4g}]" if isinstance(s, Stats) else ""

    model = split["model_ms"]
    rows = [
        (f"{split['denoise_steps']} denoise steps", split["denoise_ms"], spread("denoise"),
         f"{100 * split['denoise_ms'] / model:.1f}% of model"),
        ("commit pass (t = 0)", split["commit_ms"], spread("commit"),
         f"{100 * split['commit_ms'] / model:.1f}% of model"),
    ]
    if "vae_decode_ms" in split:
        label = f"VAE decode ({split['vae_latents_per_decode']} latents -> {split['video_frames_per_block']} frames)"
        rows.append((label, split["vae_decode_ms"], spread("vae_decode"),
                     f"{100 * split['vae_decode_ms'] / model:.1f}% of model"))
    rows += [
        ("runtime overhead", split["overhead_ms"], "", f"{100 * split['overhead_fraction_of_model']:.2f}% of model"),
        ("engine block", split["engine_block_ms"], spread("engine_block"), f"n = {split['rounds']}"),
    ]
    if "text_encode" in stats:
        text = record.get("text_encode", {})
        rows.append((f"text encode, once per prompt ({text.get('kind')} umT5, {text.get('num_layers')} layers)",
                     stats["text_encode"].median_ms, spread("text_encode"), ""))
    print(format_table(("part", "ms (median)", "[p10-p90]", "share"), rows))
    verdict = "met" if split["overhead_target_met"] else "NOT met"
    self_time = split["runtime_self_time"]
    if "runtime_ms_median" in self_time:
        print(f"runtime's own time in a block with synced device calls ({len(self_time['blocks'])} blocks): "
              f"{self_time['runtime_ms_median']:.1f} ms = "
              f"{100 * self_time['runtime_fraction_of_model_median']:.3f}% of its forwards and decode")
    print(f"target: runtime overhead <= {100 * OVERHEAD_TARGET:.0f}% of model time: {verdict} "
          f"({100 * split['overhead_fraction_of_model']:.2f}% from the medians; per round, paired: median "
          f"{100 * split['overhead_fraction_per_round_median']:.2f}%, rounds "
          f"{', '.join(f'{100 * x:.1f}%' for x in split['overhead_fraction_per_round'])})")
    e2e = record["e2e"]
    rows = [("end to end (engine block)", e2e["video_frames_per_s"]),
            ("model only (transformer + VAE)", e2e["model_only_video_frames_per_s"]),
            ("transformer only", e2e["transformer_only_video_frames_per_s"])]
    if e2e.get("vae_decode_only_video_frames_per_s"):
        rows.append(("VAE decode only", e2e["vae_decode_only_video_frames_per_s"]))
    for entry in e2e.get("amortised_with_text_encode", []):
        rows.append((f"end to end + one text encode per {entry['blocks_per_prompt']} blocks",
                     entry["video_frames_per_s"]))
    for entry in e2e.get("amortised_with_xxl_estimate", []):
        rows.append((f"same, umT5-XXL estimate, per {entry['blocks_per_prompt']} blocks", entry["video_frames_per_s"]))
    print(format_table(("throughput", "video frames/s"), rows))
    for ref, figures in REFERENCE_FPS.items():
        users = figures.get("measured_by_users_video_frames_per_s")
        print(f"reference {ref}: {figures['video_frames_per_s']} video frames/s reported ({figures['hardware']})"
              + (f", ~{users:.0f} measured end to end by users" if users else "") + "; not measured here")
    goal = e2e["goal"]
    print(f"goal: end to end >= {goal['video_frames_per_s']:.0f} video frames/s on {goal['hardware']} at 480x832: "
          + (("met" if e2e["goal_met"] else "not met") if e2e["goal_applies"]
             else f"not applicable here ({config['backend']}, {config['video_resolution'][1]}x"
                  f"{config['video_resolution'][0]}; {e2e['video_frames_per_s']:.3g} frames/s)"))
    if record.get("vae"):
        vae = record["vae"]
        print(f"VAE cache per session: {_mib(vae['cache_bytes_per_session'])} at {vae['cache_resolution'][1]}x"
              f"{vae['cache_resolution'][0]}, {_mib(vae['cache_bytes_per_session_832x480'])} at 832x480 "
              f"({vae['dtype']}); decode {vae['decode_flops_per_block'] / 1e12:.3g} TFLOP per block here, "
              f"{vae['decode_flops_per_block_832x480'] / 1e12:.3g} at 832x480")
    text = record.get("text_encode", {})
    if text.get("xxl_estimate_ms"):
        print(f"text encode: {text['median_ms']:.0f} ms for {text['num_layers']} layers -> umT5-XXL (24 layers) "
              f"estimate {text['xxl_estimate_ms']:.0f} ms on this machine ({text['xxl_flops_per_prompt'] / 1e12:.2f} "
              "TFLOP per prompt)")
    print(format_table(("setup (excluded above)", "s"), list(record["setup"].items())))
    print(f"XLA compiles during the split: {split['xla_compiles_during_split']}; latents finite: "
          f"{record['latents_finite']}; run {config['elapsed_s']:.0f} s")
    if path is not None:
        print(f"  wrote {path}")


def _latent(text: str) -> tuple[int, int]:
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--latent takes HxW (e.g. 8x12), got {text!r}") from None
    return h, w


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_wan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent", type=_latent, default=DEFAULT_LATENT,
                        help="latent HxW (default 8x12 for a CPU; 60x104 is the real 480x832 video)")
    parser.add_argument("--blocks", type=int, default=3,
                        help="timed rounds (engine block + its forwards, decode and a text encode), default 3")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--random-weights", action="store_true", help="random weights of the real geometry (default)")
    weights.add_argument("--checkpoint", type=Path, default=None,
                         help="a published causal-Wan checkpoint (CausalWanPipeline.from_checkpoint)")
    parser.add_argument("--backend", default="auto", help="attention backend (auto, xla, cudnn)")
    parser.add_argument("--no-vae", action="store_true", help="no VAE decode (transformer only)")
    parser.add_argument("--umt5-layers", type=int, default=None, choices=(CPU_UMT5_LAYERS, UMT5_XXL_LAYERS),
                        help="umT5 depth of the text encode: 24 = umT5-XXL (default on an accelerator), 2 = the "
                             "reduced CPU encoder (default on CPU)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall-clock budget; rounds stop when the next would not fit (default "
                             f"{DEFAULT_BUDGET_S:.0f}; 0 = none)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer Wan-shaped model, 2 rounds: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    blocks = 2 if args.smoke else args.blocks
    budget = None if (args.smoke or not args.budget_s) else args.budget_s
    run(latent=args.latent, blocks=blocks, checkpoint=args.checkpoint, smoke=args.smoke, backend=args.backend,
        out_dir=args.out, vae=not args.no_vae, umt5_layers=args.umt5_layers, budget_s=budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
