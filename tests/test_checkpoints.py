"""Real checkpoints: Llama, Qwen2 and Mistral models saved by transformers, loaded by
:mod:`examples.model.checkpoints`, served by the example decode loop, against transformers' own
greedy generation with the same weights.

Each model is a tiny random transformers model (3 layers, hidden 64, vocab 384, float32)
written with ``save_pretrained`` in many small shards. Ours runs the prompts together with
continuous batching, chunked prefill (token budget 32 < prompt lengths) and a pool small
enough to preempt, through the reference backend, with the cache poisoned with NaN.
transformers runs each prompt alone with eager attention. The sliding-window models use a
window of 48 tokens under prompts of ~100, and transformers is checked to really apply it
(its logits move when the window is removed).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attention import get_backend  # noqa: E402
from examples import decode_loop  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.loop import run_requests  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.model import (  # noqa: E402
    Llama,
    attention_spec_for,
    from_transformers,
    load_checkpoint,
    read_config,
    shape_from_config,
)

pytestmark = pytest.mark.kernel

VOCAB = 384
HIDDEN = 64
WINDOW = 48
# Float32 on both sides: the only differences are summation order (chunked prefill, paged
# gathers, recomputation after preemption, matmul blocking), which move logits of magnitude
# ~1 by ~1e-6. A real bug (wrong position, stale slot, a window off by one, a missing bias)
# moves them by 1e-2 or more.
LOGITS_ATOL = 1e-4
NEW_TOKENS = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny matrices: several OpenMP threads only add wake-up latency per GEMM.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str
    options: dict[str, Any]
    windowed: bool = False


VARIANTS = [
    Variant("llama", "llama", {}),
    # Llama 3.1's rotary scaling (edges low enough to matter at these lengths) and biases everywhere.
    Variant(
        "llama-llama3-rope-bias",
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Qwen2 with tied embeddings and a window that must be ignored (use_sliding_window off).
    Variant("qwen2-tied", "qwen2", {"tie_word_embeddings": True, "sliding_window": WINDOW}),
    # Qwen2 windowed from layer 1 on: full and windowed layers mixed.
    Variant(
        "qwen2-window",
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        windowed=True,
    ),
    Variant("mistral-window", "mistral", {"sliding_window": WINDOW}, windowed=True),
    # Gemma-2: alternating windowed and full layers, score and logit soft-capping, a
    # query_pre_attn_scalar unlike head_dim, GeGLU, four norms a block scaled by 1 + weight.
    Variant(
        "gemma2",
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 8.0,
        },
        windowed=True,
    ),
    # Gemma-3: q/k norms, windowed layers with their own rotary base, linear-scaled full layers.
    Variant(
        "gemma3",
        "gemma3",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
        windowed=True,
    ),
]
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def _hf_model(kind: str, **options: Any) -> Any:
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[kind])
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # std 1/sqrt(hidden): attention far from uniform, so position and cache bugs show.
        "initializer_range": HIDDEN**-0.5,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attn_implementation": "eager",
    }
    config = config_cls(**{**settings, **options})
    torch.manual_seed(1234)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases (and Gemma's norm offsets) to 0: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or (kind.startswith("gemma") and "norm" in name):
                param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v.name)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Variant, Any, Path]:
    variant: Variant = request.param
    model = _hf_model(variant.kind, **variant.options)
    path = tmp_path_factory.mktemp(variant.name)
    model.save_pretrained(path, max_shard_size="60KB")  # ~15 shards and an index
    return variant, model, path


def _hf_generate(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # Exactly three blocks (decode crosses into a fourth); 1 token; two blocks; ~100 (two
    # windows); one past a block; beyond four blocks. In this order a pool of 7 blocks preempts.
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (96, 1, 64, 100, 33, 130)]


def _serve(model: Llama, prompts: list[list[int]], *, num_blocks: int) -> tuple[list[Request], Any]:
    config = cache_config_for(
        model.shape, block_size=32, dtype="float32", num_blocks=num_blocks, device="cpu", backend="reference"
    )
    engine = engine_for(config, model.shape, fill=float("nan"))  # a read of an unwritten slot shows
    requests = [Request(i, p, NEW_TOKENS, arrival_step=i // 2) for i, p in enumerate(prompts)]
    report = run_requests(
        model,
        requests,
        manager=engine.manager,
        cache=engine.cache,
        backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache),
        token_budget=32,
        max_running=4,
        record_logits=True,
    )
    return requests, report


def test_loaded_checkpoint_generates_transformers_tokens(saved: tuple[Variant, Any, Path]) -> None:
    variant, hf, path = saved
    assert len(list(path.glob("*.safetensors"))) > 5, "the checkpoint is meant to be sharded"
    model = load_checkpoint(path)
    assert model.shape == shape_from_config(hf.config)
    prompts = _prompts()
    # 7 blocks of 32 tokens; the requests' peaks add up to 18 blocks: preemption happens.
    requests, report = _serve(model, prompts, num_blocks=7)
    assert report.finished == len(prompts)
    shape = model.shape
    releases = shape.sliding_window is not None and (shape.window_layers is None or all(shape.window_layers))
    # With every layer windowed, blocks behind the window go back to the pool, so the pool
    # may never run out; the tokens below are the check then (over released blocks).
    if not releases:
        assert report.preemptions >= 1, "the pool is meant to be too small for every request at once"
    worst = 0.0
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, NEW_TOKENS)
        assert req.output == tokens, f"{variant.name}, prompt of {len(prompt)}: ours {req.output} vs {tokens}"
        ours = torch.stack(report.logits[req.req_id])
        torch.testing.assert_close(ours, logits, atol=LOGITS_ATOL, rtol=0)
        worst = max(worst, (ours - logits).abs().max().item())
    print(f"{variant.name}: max |logit difference| = {worst:.2e} (tolerance {LOGITS_ATOL:g})")


def test_transformers_applies_the_window(saved: tuple[Variant, Any, Path]) -> None:
    """Without this, matching transformers would not show that our window is right."""
    variant, hf, _ = saved
    if not variant.windowed:
        pytest.skip("no sliding window in this model")
    spec = attention_spec_for(hf.config, "float32")
    assert spec.sliding_window == WINDOW
    expect = {"mistral": None, "qwen2": (False, True, True)}.get(variant.kind, (True, False, True))  # Gemma
    assert spec.window_layers == expect
    options = {k: v for k, v in variant.options.items() if k not in ("sliding_window", "use_sliding_window")}
    # Gemma's cache needs a window: one longer than the prompt is none.
    unwindowed = _hf_model(variant.kind, **options, sliding_window=4096 if variant.kind.startswith("gemma") else None)
    unwindowed.load_state_dict(hf.state_dict())
    prompt = _prompts()[3]  # 100 tokens: twice the window
    _, with_window = _hf_generate(hf, prompt, 2)
    _, without = _hf_generate(unwindowed, prompt, 2)
    assert (with_window - without).abs().max().item() > 1e-2


def test_config_json_reads_like_the_transformers_config(saved: tuple[Variant, Any, Path]) -> None:
    _, hf, path = saved
    assert shape_from_config(read_config(path)) == shape_from_config(hf.config)


def test_from_transformers_shares_or_copies(saved: tuple[Variant, Any, Path]) -> None:
    variant, hf, _ = saved
    shared = from_transformers(hf)
    assert shared.embed.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert shared.layers[0].attn.wo.weight.data_ptr() == hf.model.layers[0].self_attn.o_proj.weight.data_ptr()
    # q, k and v are one parameter: a copy of the three, in order.
    attn = hf.model.layers[0].self_attn
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(shared.layers[0].attn.wqkv.weight, qkv)
    if variant.options.get("tie_word_embeddings"):
        assert shared.lm_head.weight is shared.embed.weight
    copy = from_transformers(hf, share=False, dtype=torch.float64)
    assert copy.embed.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    assert copy.lm_head.weight.dtype == torch.float64
    torch.testing.assert_close(copy.lm_head.weight, hf.lm_head.weight.double(), atol=0, rtol=0)


def test_windowed_triton_with_released_blocks_matches_transformers(tmp_path: Path) -> None:
    """Mistral (every layer windowed) on the triton backend, run by Triton's CPU interpreter:
    blocks behind the window are released as the sequences advance, and the prefill kernel
    must never read them."""
    pytest.importorskip("triton")
    from attention.triton_kernels import kernels_interpreted

    if not kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
    device = "cpu" if kernels_interpreted() else "cuda"
    hf = _hf_model("mistral", sliding_window=WINDOW, num_hidden_layers=2)
    hf.save_pretrained(tmp_path)  # one file, no index
    model = load_checkpoint(tmp_path, device=device)
    prompts = [_prompts()[i] for i in (0, 2, 5)]
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=12, device=device)
    engine = engine_for(config, model.shape, backend=get_backend("triton", model.shape.attention_spec("float32")))
    assert engine.manager.sliding_window == WINDOW, "every layer is windowed: blocks behind it are released"
    requests = [Request(i, p, 6) for i, p in enumerate(prompts)]
    report = run_requests(
        model,
        requests,
        manager=engine.manager,
        cache=engine.cache,
        backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache),
        token_budget=32,
        max_running=3,
        record_logits=True,
    )
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, 6)
        assert req.output == tokens
        torch.testing.assert_close(torch.stack(report.logits[req.req_id]).cpu(), logits, atol=LOGITS_ATOL, rtol=0)


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.kind.startswith("gemma")], ids=lambda v: v.name)
def test_gemma_on_triton_matches_transformers(variant: Variant, tmp_path: Path) -> None:
    """Gemma-2 and Gemma-3 through the triton kernels (soft-capping, their softmax scale,
    per-layer windows; Triton's CPU interpreter without a GPU): transformers' tokens and logits."""
    pytest.importorskip("triton")
    from attention.triton_kernels import kernels_interpreted

    if not kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
    device = "cpu" if kernels_interpreted() else "cuda"
    hf = _hf_model(variant.kind, **variant.options)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, device=device)
    prompts = [_prompts()[i] for i in (2, 3)]  # two blocks; ~two windows
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=16, device=device)
    engine = engine_for(config, model.shape, backend=get_backend("triton", model.shape.attention_spec("float32")))
    requests = [Request(i, p, 4) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=48, max_running=2,
        record_logits=True,
    )  # fmt: skip
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, 4)
        assert req.output == tokens
        torch.testing.assert_close(torch.stack(report.logits[req.req_id]).cpu(), logits, atol=LOGITS_ATOL, rtol=0)


def test_unsupported_configs_are_refused_naming_the_field() -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match=r"model_type: 'gemma'.*llama, qwen2, mistral, gemma2, gemma3_text"):
        shape_from_config({**base, "model_type": "gemma"})
    with pytest.raises(ValueError, match="hidden_act: 'gelu'"):
        shape_from_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type: 'yarn'"):
        shape_from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # A 4.x config.json: rope_theta at the top, llama3 scaling under rope_scaling.
    old = shape_from_config(
        {
            **base,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        }
    )  # fmt: skip
    assert old.rope_theta == 500000.0 and old.rope_scaling is not None and old.rope_scaling.kind == "llama3"
    assert shape_from_config({**base, "model_type": "mistral"}).sliding_window == 4096  # transformers' default
    assert shape_from_config({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    gemma = {**base, "model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 64, "head_dim": 8}
    with pytest.raises(ValueError, match="hidden_activation: 'gelu'"):
        shape_from_config({**gemma, "hidden_activation": "gelu"})
    # Gemma-2 without layer_types: every other layer windowed from layer 0; tied embeddings.
    g2 = shape_from_config(gemma)
    assert g2.window_layers == (True, False, True, False) and g2.tie_word_embeddings and g2.softmax_scale == 256**-0.5
    # A 4.x Gemma-3 config.json: five windowed layers in six, a local rotary base of its own.
    g3 = shape_from_config({**gemma, "model_type": "gemma3_text", "num_hidden_layers": 7, "rope_theta": 1e6,
                            "rope_local_base_freq": 10_000.0})  # fmt: skip
    assert g3.window_layers == (True,) * 5 + (False, True) and g3.local_rope_theta == 10_000.0 and g3.qk_norm
    with pytest.raises(ValueError, match=r"rope_parameters\.sliding_attention\.rope_type: 'linear'"):
        shape_from_config(
            {**gemma, "model_type": "gemma3_text",
             "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_type": "linear"}}}
        )  # fmt: skip


def test_checkpoint_problems_are_listed_before_loading(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = _hf_model("llama")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.norm.weight"] = torch.ones(HIDDEN + 1)
    state["model.extra.weight"] = torch.ones(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "missing model.layers.1.mlp.up_proj.weight" in message
    assert "unused model.extra.weight" in message
    assert "model.norm.weight: expected shape [64], got [65]" in message


def test_missing_files_and_library_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_model("llama").config.to_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        load_checkpoint(tmp_path)


def test_decode_loop_cli_serves_a_checkpoint(
    saved: tuple[Variant, Any, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    variant, _, path = saved
    if variant.name != "qwen2-window":
        pytest.skip("one checkpoint is enough for the CLI")
    assert decode_loop.main(["--quiet", "--checkpoint", str(path), "--requests", "6"]) == 0
    out = capsys.readouterr().out
    assert "requests: 6 (6 finished" in out
