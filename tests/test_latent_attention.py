"""Multi-head latent attention (DeepSeek-V3's MLA): a latent cache (one tensor per layer, a
latent per token shared by every head), served by the example engine in the absorbed form
(MQA over the latent: ``examples.model.latent_attention``), against transformers' own
``DeepseekV3ForCausalLM`` with the same weights; the config's MLA fields and their refusals.

The models are tiny and random (2 layers, hidden 64, 4 heads, kv_lora_rank 32, rope 8, nope
16, v 16; dense MLPs), with the norms' weights drawn away from 1 so a missing or misplaced
norm shows. transformers runs each prompt alone with eager attention over decompressed K/V.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention import AttentionSpec, choose_backend, get_backend  # noqa: E402
from attention.errors import UnsupportedSettingError  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.calibration import calibrate_kv_scales  # noqa: E402
from examples.engine.loop import run_requests  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.model import from_transformers, latent_attention, shape_for_cache, shape_from_config  # noqa: E402
from kvcache import ConfigError, allocate_kv_cache, parse_config  # noqa: E402
from tests.test_checkpoints import LOGITS_ATOL, VOCAB, _hf_generate  # noqa: E402

pytestmark = pytest.mark.kernel

NEW_TOKENS = 8


@pytest.fixture
def few_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Triton's CPU interpreter, plan the MLA launches for 4 SMs instead of 132: at these
    sizes a program takes at least 256 latents, so the busy programs and their work are the same,
    and the interpreter no longer runs ~128 empty programs a call (half the time). A GPU plans
    for its own SMs either way."""
    import attention.triton_backend as triton_backend

    monkeypatch.setattr(triton_backend, "INTERPRETER_NUM_SMS", 4)


def _deepseek(q_lora_rank: int | None, **options: Any) -> Any:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "first_k_dense_replace": 2,  # every layer dense
        "max_position_embeddings": 512,
        "initializer_range": 64**-0.5,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attn_implementation": "eager",
    }
    torch.manual_seed(5)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**settings, **options}))
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (96, 1, 64, 100, 33, 130)]


def _count_decompressed(backend: Any) -> list[int]:
    """Counts the new tokens the backend attends decompressed (``attend_latent_prefill``)."""
    seen = [0]
    inner = backend.attend_latent_prefill

    def counted(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen[0] += query.shape[0]
        return inner(query, *args, **kwargs)

    backend.attend_latent_prefill = counted
    return seen


@pytest.mark.parametrize(
    ("q_lora_rank", "decompress_from", "subset", "gathered"),
    [(None, None, False, False), (24, None, False, False), (None, 16, False, False), (24, 2, False, False),
     (24, 2, True, False), (None, 16, False, True), (24, 2, True, True)],
    ids=["q-proj", "q-lora", "q-proj-decompressed", "q-lora-decompressed", "q-lora-absorbed-subset",
         "q-proj-decompressed-gathered", "q-lora-absorbed-subset-gathered"],
)  # fmt: skip
def test_latent_attention_serves_transformers_tokens(
    q_lora_rank: int | None,
    decompress_from: int | None,
    subset: bool,
    gathered: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Absorbed for every row, or decompressed for rows of at least ``decompress_from`` new
    tokens (``latent_prefill_min_tokens``): transformers' tokens either way. ``subset``: every
    step with decompressed rows runs the absorbed products on its other tokens only.
    ``gathered``: the plan gives no spans, so the model gathers and scatters every token set
    by index (as for decompressed rows that are not adjacent in the batch)."""
    if subset:
        monkeypatch.setattr(latent_attention, "ABSORBED_SUBSET_MIN_TOKENS", 1)
    if gathered:
        import attention.latent_prefill

        monkeypatch.setattr(attention.latent_prefill, "_span", lambda indices: None)
    hf = _deepseek(q_lora_rank)
    model = from_transformers(hf)
    assert model.shape.mla is not None and model.shape.mla.q_lora_rank == q_lora_rank
    # 7 blocks of 32 tokens for peaks adding up to 18 blocks: preemption happens.
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=7, device="cpu",
                              backend="reference", prefix_caching=True)  # fmt: skip
    engine = engine_for(config, model.shape, fill=float("nan"))
    assert engine.spec.latent_attention and engine.spec.head_dim == 40 and engine.spec.num_kv_heads == 1
    assert engine.cache.storage.shape == (2, 1, 7, 32, 1, 40), "one latent of 32 + 8 values per token and layer"
    engine.backend.latent_prefill_min_tokens = decompress_from
    decompressed = _count_decompressed(engine.backend)
    prompts = _prompts()
    requests = [Request(i, p, NEW_TOKENS, arrival_step=i // 2) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=32, max_running=4,
        record_logits=True,
    )  # fmt: skip
    assert report.finished == len(prompts) and report.preemptions >= 1
    assert (report.prefix_hit_tokens or 0) > 0, "the preempted request finds its blocks again"
    layers = model.shape.num_layers
    if decompress_from is None:
        assert decompressed[0] == 0
    else:  # prompt chunks, in every layer
        assert decompressed[0] > 0 and decompressed[0] % layers == 0, decompressed
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, NEW_TOKENS)
        assert req.output == tokens, f"prompt of {len(prompt)}"
        torch.testing.assert_close(torch.stack(report.logits[req.req_id]), logits, atol=LOGITS_ATOL, rtol=0)


def _note_direct(plan, seen: list[bool]):  # type: ignore[no-untyped-def]
    """``plan``, after noting whether its latent launch was planned direct."""
    if plan.latent is not None:
        seen.append(plan.latent.work.direct)
    return plan


@pytest.mark.parametrize(
    ("graphs", "decompress_from", "direct", "subset", "mixed_graphs"),
    [(False, None, False, False, False), (False, None, True, False, False), (False, 16, False, False, False),
     (False, 16, True, True, False), (False, 16, False, False, True), (True, 16, False, False, False),
     (True, 16, True, False, False), (True, None, False, False, True)],
    ids=["eager", "eager-direct", "eager-decompressed", "eager-absorbed-subset", "eager-mixed-buckets",
         "cuda-graphs-decompressed", "cuda-graphs-direct", "cuda-graphs-mixed"],
)  # fmt: skip
@pytest.mark.usefixtures("few_sms")
def test_latent_attention_on_triton_matches_transformers(
    graphs: bool,
    decompress_from: int | None,
    direct: bool,
    subset: bool,
    mixed_graphs: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The triton backend's MLA kernels (absorbed for every token, or decompressed prefill
    rows beside absorbed decode rows; Triton's CPU interpreter without a GPU, and CUDA graphs
    for decode steps on one): transformers' tokens and logits. ``direct``: every step planned
    direct (tokens of one segment stored by their program), as steps of many tokens are.
    ``subset``: steps with decompressed rows run the absorbed products on the other tokens
    only, and the boundary kernel leaves the decompressed tokens' absorbed query unset.
    ``mixed_graphs`` (``TritonBackend(latent_mixed_graphs=True)``): steps with prefill rows are
    padded to the mixed buckets and, on a GPU, replayed from graphs, every row absorbed."""
    if subset:
        monkeypatch.setattr(latent_attention, "ABSORBED_SUBSET_MIN_TOKENS", 1)
    pytest.importorskip("triton")
    import attention.triton_kernels.mla_balanced as balanced

    if direct:
        monkeypatch.setattr(balanced, "DIRECT_STORE_BYTES", -1)
    from attention.triton_kernels import kernels_interpreted

    if not kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
    device = "cpu" if kernels_interpreted() else "cuda"
    if graphs and device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    hf = _deepseek(24)
    model = from_transformers(hf, share=False, device=device)
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=7, device=device,
                              prefix_caching=True)  # fmt: skip
    triton = get_backend("triton", model.shape.attention_spec("float32"))
    triton.latent_mixed_graphs = mixed_graphs  # type: ignore[attr-defined]
    assert triton.info.mixed_cuda_graphs == mixed_graphs
    engine = engine_for(config, model.shape, backend=triton, fill=float("nan"))
    assert engine.backend.name == "triton" and engine.spec.latent_rank == 32
    engine.backend.latent_prefill_min_tokens = decompress_from
    decompressed = _count_decompressed(engine.backend)
    plan = engine.backend.plan
    directs: list[bool] = []
    monkeypatch.setattr(engine.backend, "plan", lambda *a, **k: _note_direct(plan(*a, **k), directs))
    prompts = [_prompts()[i] for i in (0, 2, 4)]
    requests = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=48, max_running=3,
        record_logits=True, use_graphs=graphs,
    )  # fmt: skip
    if graphs:
        assert report.graph_replays.get("decode", 0) > 0, report.graph_replays
        assert (report.graph_replays.get("mixed", 0) > 0) == mixed_graphs, report.graph_replays
    # With mixed buckets every step here (48 tokens at most) is planned as its graph: absorbed.
    assert (decompressed[0] > 0) == (decompress_from is not None and not mixed_graphs), decompressed
    assert directs and set(directs) == {direct}, "the steps were planned as asked"
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, NEW_TOKENS)
        assert req.output == tokens, f"prompt of {len(prompt)}"
        torch.testing.assert_close(torch.stack(report.logits[req.req_id]).cpu(), logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.usefixtures("few_sms")
def test_latent_attention_on_triton_verifies_drafts_with_transformers_tokens(graphs: bool) -> None:
    """Prompt-lookup drafts on a latent model over the triton backend (its default: steps with
    prefill rows, verification steps among them, in the mixed buckets; on a GPU with CUDA
    graphs, verification steps replay their own graphs, every row absorbed): the tokens are
    transformers' greedy tokens, drafts were proposed, and on the GPU verified in graphs."""
    pytest.importorskip("triton")
    from attention.triton_kernels import kernels_interpreted

    if not kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
    device = "cpu" if kernels_interpreted() else "cuda"
    if graphs and device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    hf = _deepseek(None)
    model = from_transformers(hf, share=False, device=device)
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=12, device=device,
                              prefix_caching=True)  # fmt: skip
    triton = get_backend("triton", model.shape.attention_spec("float32"))
    assert triton.info.mixed_cuda_graphs, "the default captures steps with prefill rows"
    engine = engine_for(config, model.shape, backend=triton, fill=float("nan"))
    gen = torch.Generator().manual_seed(11)
    # Phrases repeated: each prompt ends on an n-gram seen earlier in it, so drafts are proposed.
    prompts = [(torch.randint(0, VOCAB, (n,), generator=gen).tolist() * 9)[:length]
               for n, length in ((3, 40), (5, 61), (7, 33))]  # fmt: skip
    requests = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=48, max_running=3,
        draft_tokens=4, use_graphs=graphs,
    )  # fmt: skip
    assert report.drafted > 0, "the repeated phrases give drafts"
    if graphs:
        assert report.graph_replays.get("verify", 0) > 0, report.graph_replays
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, _ = _hf_generate(hf, prompt, NEW_TOKENS)
        assert req.output == tokens, f"prompt of {len(prompt)}"


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.usefixtures("few_sms")
def test_an_fp8_latent_with_calibrated_scales_tracks_the_bf16_latent(backend_name: str) -> None:
    """An fp8 latent cache (one scale per layer, calibrated on two prompts) on ``backend_name``,
    teacher-forced on the bf16 cache's greedy tokens: its logits stay close to the bf16 cache's,
    decompressed prefill rows and absorbed decode rows alike. The bf16 run is the reference
    backend's (the triton backend's bf16 latent path is held to transformers' logits above), so
    the triton case compares its fp8 path with the exact one (and in the CPU interpreter runs
    its kernels for one of the two runs only)."""
    device = "cpu"
    if backend_name == "triton":
        pytest.importorskip("triton")
        from attention.triton_kernels import kernels_interpreted

        if not kernels_interpreted() and not torch.cuda.is_available():
            pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
        device = "cpu" if kernels_interpreted() else "cuda"
    model = from_transformers(_deepseek(24), share=False, dtype=torch.bfloat16, device=device)
    prompts = [_prompts()[i] for i in (0, 2, 4)]

    def serve(cache_dtype: str, forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor], Any]:
        config = cache_config_for(model.shape, block_size=32, dtype=cache_dtype, num_blocks=16, device=device,
                                  backend="reference", compute_dtype="bfloat16")  # fmt: skip
        on_triton = backend_name == "triton" and cache_dtype == "float8_e4m3"
        backend = get_backend(backend_name, config.attention_spec()) if on_triton else None
        engine = engine_for(config, model.shape, backend=backend, fill=0.0)
        engine.backend.latent_prefill_min_tokens = 16
        if cache_dtype == "float8_e4m3":
            calibrate_kv_scales(model, config, engine.cache, prompts[:2])
        requests = [Request(i, p, NEW_TOKENS, forced=None if forced is None else forced[i]) for i, p in
                    enumerate(prompts)]  # fmt: skip
        report = run_requests(
            model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=48, max_running=3,
            record_logits=True, overlap=False,
        )  # fmt: skip
        return [r.output for r in requests], [torch.stack(report.logits[r.req_id]).float() for r in requests], engine

    tokens, logits, _ = serve("bfloat16", None)
    _, fp8_logits, engine = serve("float8_e4m3", tokens)
    assert engine.cache.storage.dtype == torch.float8_e4m3fn and engine.cache.storage.shape[-1] == 40
    assert engine.cache.scales is not None and torch.equal(engine.cache.scales[:, 0], engine.cache.scales[:, 1])
    worst = max(float((a - b).abs().max()) for a, b in zip(fp8_logits, logits, strict=True))
    spread = max(float(a.std()) for a in logits)
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(fp8_logits, logits, strict=True))
    mean = sum(float((a - b).abs().mean()) for a, b in zip(fp8_logits, logits, strict=True)) / len(logits)
    # e4m3 keeps 3 mantissa bits (up to 6% per value): on CPU the reference measured a mean
    # difference of 2.8% of the logits' spread, the largest 22%, and 22 of 24 top-1 equal.
    assert mean < 0.05 * spread and worst < 0.4 * spread, (mean, worst, spread)
    assert agree >= 0.85 * len(prompts) * NEW_TOKENS, agree


def test_the_rotary_pairs_are_deepseeks() -> None:
    """Without DeepSeek's interleaved rotary layout the logits move (so the test above checks it)."""
    hf = _deepseek(None)
    ours = from_transformers(hf)
    flat = _deepseek(None, rope_interleave=False)
    flat.load_state_dict(hf.state_dict())
    prompt = _prompts()[0]
    _, interleaved = _hf_generate(hf, prompt, 2)
    _, halves = _hf_generate(flat, prompt, 2)
    assert (interleaved - halves).abs().max().item() > 1e-2
    assert ours.shape.mla is not None and ours.shape.mla.rope_interleave


LATENT = """
model: {num_layers: 2, num_heads: 4, num_kv_heads: 1, head_dim: 24, kv_lora_rank: 32, qk_rope_head_dim: 8,
        qk_nope_head_dim: 16, v_head_dim: 16}
cache: {block_size: 32, dtype: float32, num_blocks: 8, device: cpu}
attention: {backend: reference}
"""


def test_the_config_sizes_a_latent_cache() -> None:
    config = parse_config(LATENT)
    assert config.bytes_per_token == 2 * 40 * 4  # layers x (kv_lora_rank + rope) x float32
    cache = allocate_kv_cache(config)
    assert cache.storage.shape == (2, 1, 8, 32, 1, 40)
    assert cache.layer(1).key.data_ptr() == cache.layer(1).value.data_ptr()
    spec = config.attention_spec()
    assert spec.latent_attention and spec.head_dim == 40 and spec.scale == pytest.approx(24**-0.5)
    shape = shape_for_cache(config.model)
    assert shape.mla is not None and shape.mla.latent_dim == 40 and shape.attention_spec("float32") == spec


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (("v_head_dim: 16", ""), "model.v_head_dim", "is missing"),
        (("num_kv_heads: 1", "num_kv_heads: 2"), "model.num_kv_heads", "use 1"),
        (("head_dim: 24,", "head_dim: 32,"), "model.head_dim", "use 24"),
        (("qk_rope_head_dim: 8", "qk_rope_head_dim: 7"), "model.qk_rope_head_dim", "odd"),
        (("kv_lora_rank: 32", "kv_lora_rank: 30"), "model.kv_lora_rank", "use 32"),
        (("v_head_dim: 16}", "v_head_dim: 16, sliding_window: 64}"), "model.sliding_window", "latent attention"),
        (("backend: reference", "backend: flash_attn"), "model.kv_lora_rank", "no latent attention"),
    ],
)
def test_bad_latent_configs_are_refused_naming_the_field(edit: tuple[str, str], field: str, words: str) -> None:
    text = LATENT.replace(*edit)
    if "float8" in edit[1]:
        text = text.replace("num_layers: 2,", "num_layers: 2, dtype: bfloat16,")
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert any(field in line and words in line for line in str(caught.value).splitlines()), str(caught.value)


def test_what_the_example_model_lacks_is_refused() -> None:
    config = _deepseek(None).config.to_dict()
    with pytest.raises(ValueError, match=r"first_k_dense_replace.*mixtures of experts"):
        shape_from_config({**config, "first_k_dense_replace": 1, "n_routed_experts": 4})
    with pytest.raises(ValueError, match=r"attention_bias"):
        shape_from_config({**config, "attention_bias": True})
    spec = shape_from_config(config).attention_spec("bfloat16")
    from attention.capabilities import BACKENDS

    problems = BACKENDS["flash_attn"].problems(block_size=256, head_dim=40, dtype="bfloat16", device_type="cuda",
                                               latent_attention=spec.latent_attention)  # fmt: skip
    assert [p.parameter for p in problems] == ["latent_attention"]


def test_a_latent_config_naming_triton_gets_the_triton_backend() -> None:
    """What a config's ``attention.backend`` resolves to (``choose_backend``, which
    ``engine_for`` calls): a latent spec (DeepSeek-V3's 576-wide latent, past the 256 of
    per-head K/V) goes to triton when named and under ``auto`` on a GPU; flash_attn is refused
    for having no latent attention. (The choice used to check the latent's width against the
    per-head limit and refused triton for every MLA model.)"""
    spec = AttentionSpec(16, 1, 576, "bfloat16", latent_rank=512)
    assert choose_backend("triton", spec, device_type="cuda", block_size=64).backend.name == "triton"
    auto = choose_backend("auto", spec, device_type="cuda", block_size=64)
    assert auto.backend.name == "triton", auto.reason
    with pytest.raises(UnsupportedSettingError, match="no latent attention") as refused:
        choose_backend("flash_attn", spec, device_type="cuda", block_size=256)
    assert "head_dim" not in str(refused.value)
    text = LATENT.replace("backend: reference", "backend: triton").replace("device: cpu", "device: cuda")
    config = parse_config(text.replace("block_size: 32", "block_size: 64"))
    chosen = choose_backend(config.attention.backend, config.attention_spec(), device_type="cuda", block_size=64)
    assert chosen.backend.name == "triton" and chosen.backend.spec.latent_attention


#: DeepSeek-V3's latent: kv_lora_rank 512 + 64 rotary values (576, past per-head K/V's 256).
WIDE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
#: A greedy token of bf16 logits may part from the reference's only where the reference's top two
#: are closer than this: bf16 steps 1/64 between 2 and 4, where these models' top logits lie,
#: and two paths that round the latent's products differently move a logit by a few steps.
LATENT_TIE_TOLERANCE = 0.1


@pytest.mark.usefixtures("few_sms")
def test_deepseek_v3s_latent_width_serves_on_triton() -> None:
    """A model with DeepSeek-V3's 576-wide latent through the engine on the triton backend
    (Triton's CPU interpreter without a GPU): transformers' tokens and logits, float32. (Every
    other engine test's latent is 40 wide; at 576 the backend's per-step layer check refused
    the cache for its head_dim.)"""
    pytest.importorskip("triton")
    from attention.triton_kernels import kernels_interpreted

    if not kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton kernels are compiled for CUDA in this process and there is no GPU")
    device = "cpu" if kernels_interpreted() else "cuda"
    hf = _deepseek(None, **WIDE, num_hidden_layers=1)
    model = from_transformers(hf, share=False, device=device)
    config = cache_config_for(model.shape, block_size=64, dtype="float32", num_blocks=4, device=device)
    triton = get_backend("triton", model.shape.attention_spec("float32"))
    engine = engine_for(config, model.shape, backend=triton, fill=float("nan"))
    assert engine.spec.head_dim == 576 and engine.spec.latent_rank == 512
    prompts = [_prompts()[i] for i in (1, 4)]  # 1 and 33 tokens
    requests = [Request(i, p, 4) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=64, max_running=2,
        record_logits=True,
    )  # fmt: skip
    for prompt, req in zip(prompts, requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, 4)
        assert req.output == tokens, f"prompt of {len(prompt)}"
        torch.testing.assert_close(torch.stack(report.logits[req.req_id]).cpu(), logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3"])
def test_sixteen_heads_over_a_wide_latent_serve_as_the_reference_does(
    cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3's latent at 16 heads (its share of a rank at 8-way tensor parallelism), bf16,
    blocks of 64, CUDA graphs: the triton backend (on an sm_90 GPU the Gluon Hopper kernels,
    fp8 included) gives the reference backend's greedy tokens over the same cache dtype, up to
    near-ties. The reference runs eagerly, where the 96-token prompt attends decompressed; the
    graphs attend it absorbed (over an fp8 latent with the query split into e4m3 hi + lo), so the
    two round differently: on the H100 the fp8 case's first token parted at a top-two gap of a
    few bf16 steps (the reference's 330 against 185, its logits 2.42 / 2.38 on the CPU)."""
    import attention.triton_kernels.mla_decode as mla_decode_module
    from attention.triton_kernels.prefill_hopper import hopper_prefill_possible

    hopper_calls = [0]
    real = mla_decode_module.launch_mla_hopper

    def counted(*args: Any, **kw: Any) -> None:
        hopper_calls[0] += 1
        real(*args, **kw)

    monkeypatch.setattr(mla_decode_module, "launch_mla_hopper", counted)
    hf = _deepseek(None, **WIDE, num_attention_heads=16, num_key_value_heads=16)
    outputs = {}
    for name in ("reference", "triton"):
        model = from_transformers(hf, share=False, device="cuda").to(torch.bfloat16)
        config = cache_config_for(model.shape, block_size=64, dtype=cache_dtype, num_blocks=12, device="cuda",
                                  compute_dtype="bfloat16" if cache_dtype != "bfloat16" else None)  # fmt: skip
        backend = get_backend(name, model.shape.attention_spec("bfloat16", config.cache.dtype))
        engine = engine_for(config, model.shape, backend=backend, fill=float("nan"))
        prompts = [_prompts()[i] for i in (0, 1, 4)]
        requests = [Request(i, p, 6) for i, p in enumerate(prompts)]
        report = run_requests(
            model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=256, max_running=3,
            use_graphs=name == "triton", record_logits=True,
        )  # fmt: skip
        outputs[name] = [r.output for r in requests]
        if name == "reference":
            reference_logits = report.logits
        else:
            assert report.graph_replays, "the triton run is meant to replay CUDA graphs"
    identical = 0
    for req_id, (ref, ours) in enumerate(zip(outputs["reference"], outputs["triton"], strict=True)):
        part = next((j for j, (a, b) in enumerate(zip(ref, ours, strict=True)) if a != b), None)
        if part is None:
            identical += 1
            continue
        logits = reference_logits[req_id][part].float()
        gap = float(logits[ref[part]] - logits[ours[part]])
        assert gap < LATENT_TIE_TOLERANCE, (
            f"request {req_id}: token {part} is {ours[part]} on triton, {ref[part]} on the reference, "
            f"whose logits differ by {gap:.3g} (a near-tie is under {LATENT_TIE_TOLERANCE})"
        )
    assert identical >= len(outputs["reference"]) - 1, (outputs, "more than one near-tie in 3 requests")
    assert (hopper_calls[0] > 0) == hopper_prefill_possible(torch.device("cuda")), hopper_calls


def test_the_warm_up_runs_decompressed_rows_in_every_step_form() -> None:
    """With latent attention the runner's eager warm-up also runs rows long enough to attend
    decompressed (their prefill kernel compiles per form): fresh, extending cached tokens, two
    in a step and beside a decode row; each such step plans those rows decompressed. (Without
    them a DeepSeek-shaped burst compiled two Hopper prefill variants while serving, 2.3 s each.)"""
    from attention.staging import StepCapacity
    from examples.engine.runner import ModelRunner

    hf = _deepseek(None)
    model = from_transformers(hf, share=False)
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=64, device="cpu")
    engine = engine_for(config, model.shape)
    engine.backend.latent_prefill_min_tokens = 48
    runner = ModelRunner(model, engine.cache, engine.manager, engine.backend, StepCapacity(4, 160, 8))
    steps = runner.warmup_steps()
    wide = [rows for rows in steps if any(n >= 48 for _, n in rows)]
    forms = {
        "fresh": [(48, 48)] in wide,
        "extend": any(len(r) == 1 and r[0][0] > r[0][1] == 48 for r in wide),
        "two": [(48, 48), (48, 48)] in wide,
        "mixed": any(len(r) == 2 and (32, 1) in r and (48, 48) in r for r in wide),
    }
    assert all(forms.values()), (forms, steps)
    decompressed = _count_decompressed(engine.backend)
    assert runner.warmup(eager=True).eager_steps == len(steps)
    # Every row of >= 48 new tokens, in every layer, and no other.
    expected = sum(n for rows in steps for _, n in rows if n >= 48) * model.shape.num_layers
    assert decompressed[0] == expected, (decompressed, expected)
    assert engine.manager.num_free_blocks == engine.manager.num_blocks, "the warm-up leaves no blocks behind"


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_each_rank_holds_its_heads_query_rows_and_the_whole_latent_projection(q_lora_rank: int | None) -> None:
    """``wqkv_a`` stacks q_proj's (or q_a_proj's) rows and kv_a_proj_with_mqa's: over two ranks
    each holds its two heads' q_proj rows (q_a_proj whole) and the whole latent projection."""
    from kvcache.parallel.heads import TensorParallel

    hf = _deepseek(q_lora_rank)
    attn = hf.model.layers[1].self_attn
    kv_a = attn.kv_a_proj_with_mqa.weight
    for rank in range(2):
        ours = from_transformers(hf, share=False, tp=TensorParallel(2, rank)).layers[1].attn
        query = attn.q_a_proj.weight if q_lora_rank else attn.q_proj.weight[rank * 48 : (rank + 1) * 48]  # 2 x 24
        assert torch.equal(ours.wqkv_a.weight, torch.cat((query, kv_a)))
        assert ours.splits == (query.shape[0], 32 + 8)
