"""The example decode loop on a CUDA GPU: every backend produces the reference backend's
greedy tokens (block_size 256, fp16, continuous batching with preemption).

Skipped without a CUDA device; each backend is skipped when its library is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from attention import get_backend
from attention.triton_backend import TritonBackend
from examples.decode_loop import VOCAB_SIZE
from examples.engine.loop import RunReport, run_requests
from examples.engine.scheduler import Request, make_preemption
from examples.engine.workload import make_workload
from examples.model import random_llama, shape_for_cache
from kvcache import BlockManager, allocate_kv_cache, load_config
from kvcache.step.graphs import StepGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cuda-256.yaml"
# Backends see the same fp16 K/V but round their fp32 attention output to fp16 at slightly
# different points, so logits differ by ~1e-3. A greedy token may only differ where the
# reference's top two logits are closer than this (a near-tie), and then the sequences part.
TIE_TOLERANCE = 2e-2


def _serve(
    backend_name: str,
    preempt: str,
    use_graphs: bool = False,
    overlap: bool = True,
    window: tuple[int, tuple[bool, ...] | None] | None = None,
    triton_kw: dict[str, object] | None = None,
) -> RunReport:
    """The workload through the loop; ``window``: (sliding window, per-layer pattern) for
    the attention spec (blocks behind the window are released when every layer has it);
    ``triton_kw``: a TritonBackend made with these arguments instead of the registry's."""
    config = load_config(CONFIG)
    cache = allocate_kv_cache(config, device="cuda", fill=float("nan"))
    spec = config.attention_spec()
    release = None
    if window is not None:
        spec = dataclasses.replace(spec, sliding_window=window[0], window_layers=window[1])
        release = window[0] if window[1] is None else None
    manager = BlockManager(cache.num_blocks, config.cache.block_size, sliding_window=release)
    shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
    model = random_llama(shape, seed=0, dtype=torch.float16, device="cuda")
    requests = make_workload("default", 12, seed=3, block_size=config.cache.block_size, vocab_size=VOCAB_SIZE)
    report = run_requests(
        model,
        requests,
        manager=manager,
        cache=cache,
        backend=get_backend(backend_name, spec) if triton_kw is None else TritonBackend(spec, **triton_kw),  # type: ignore[arg-type]
        preemption=make_preemption(preempt, manager, cache, config.cache.swap_space),
        token_budget=512,
        use_graphs=use_graphs,
        overlap=overlap,
        record_logits=True,
    )
    assert report.finished == len(requests)
    return report


def _run(
    backend_name: str, preempt: str, use_graphs: bool = False, overlap: bool = True
) -> tuple[list[Request], dict[int, list[torch.Tensor]], dict[str, int]]:
    report = _serve(backend_name, preempt, use_graphs, overlap)
    return report.requests, report.logits, report.preemptions_by_mode


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_backend_tokens_match_reference_on_cuda(backend: str, preempt: str) -> None:
    library = {"flash_attn": "flash_attn", "triton": "triton"}[backend]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"needs {library}")
    ref_requests, ref_logits, _ = _run("reference", preempt)
    requests, _, modes = _run(backend, preempt)
    assert modes[preempt] >= 1, f"the workload is meant to preempt ({modes})"
    identical = 0
    for ref, ours in zip(ref_requests, requests, strict=True):
        mismatch = next((j for j, (a, b) in enumerate(zip(ref.output, ours.output, strict=True)) if a != b), None)
        if mismatch is None:
            identical += 1
            continue
        logits = ref_logits[ref.req_id][mismatch]
        gap = float(logits[ref.output[mismatch]] - logits[ours.output[mismatch]])
        assert gap < TIE_TOLERANCE, (
            f"request {ref.req_id}: token {mismatch} is {ours.output[mismatch]} with {backend}, "
            f"{ref.output[mismatch]} with reference, and the reference's logits differ by {gap:.3g}"
        )
    print(f"{backend}/{preempt}: {identical} of {len(requests)} requests token-identical to reference")
    assert identical >= len(requests) - 1, "more than one near-tie in 12 short requests is not chance"


@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_cuda_graphs_give_the_same_tokens_as_eager(backend: str) -> None:
    """Steps replayed from CUDA graphs (captured per bucket over the persistent buffers)
    compute exactly what the same steps compute eagerly: identical greedy tokens. With
    triton, mixed steps (prefill chunks beside decode rows) replay graphs too."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"needs {backend}")
    eager = _serve(backend, "recompute", use_graphs=False)
    graphed = _serve(backend, "recompute", use_graphs=True)
    for a, b in zip(eager.requests, graphed.requests, strict=True):
        assert a.output == b.output, f"request {a.req_id}: eager {a.output} vs graphs {b.output}"
    assert eager.graph_replays == {}
    assert graphed.graph_replays["decode"] > 0, graphed.graph_replays
    if backend == "triton":
        assert graphed.graph_replays["mixed"] > 0, graphed.graph_replays
    else:
        assert graphed.graph_replays["mixed"] == 0, graphed.graph_replays


def test_direct_decode_graphs_give_the_eager_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TritonBackend(direct_decode_graphs=True)`` captures each bucket with and without the
    decode combine kernel, and a step replays the one its plan names ("direct" only where no
    row splits): the same tokens as the same backend's eager steps. Planned for 1 SM no row
    splits; for 132 a small batch's rows split to fill the SMs: both variants replay."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    seen: list[str | None] = []
    run = StepGraphs.run

    def recording(self: StepGraphs, *args: Any, **kwargs: Any) -> Any:
        plan, output = run(self, *args, **kwargs)
        seen.append(plan.graph_variant)
        return plan, output

    monkeypatch.setattr(StepGraphs, "run", recording)
    for sms in (1, 132):
        kw: dict[str, object] = {"direct_decode_graphs": True, "num_sms": sms}
        eager = _serve("triton", "recompute", use_graphs=False, triton_kw=kw)
        graphed = _serve("triton", "recompute", use_graphs=True, triton_kw=kw)
        for a, b in zip(eager.requests, graphed.requests, strict=True):
            assert a.output == b.output, f"{sms} SMs, request {a.req_id}: eager {a.output} vs graphs {b.output}"
        assert graphed.graph_replays["decode"] > 0, graphed.graph_replays
    assert {"direct", "combine"} <= set(seen), sorted(map(str, set(seen)))


@pytest.mark.parametrize("pattern", [None, (True, False)], ids=["every-layer", "alternating"])
def test_windowed_model_replays_graphs_with_the_eager_tokens(pattern: tuple[bool, ...] | None) -> None:
    """A sliding-window model (every layer, blocks behind the window released; or every
    other layer) replays decode and mixed steps from graphs, with the eager loop's tokens and
    the reference backend's (up to near-ties)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    window = (300, pattern)
    eager = _serve("triton", "recompute", use_graphs=False, window=window)
    graphed = _serve("triton", "recompute", use_graphs=True, window=window)
    reference = _serve("reference", "recompute", window=window)
    assert [r.output for r in graphed.requests] == [r.output for r in eager.requests]
    assert graphed.graph_replays["decode"] > 0 and graphed.graph_replays["mixed"] > 0, graphed.graph_replays
    identical = sum(a.output == b.output for a, b in zip(reference.requests, graphed.requests, strict=True))
    assert identical >= len(graphed.requests) - 1, f"{identical} of {len(graphed.requests)} match the reference"


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_overlapped_graph_loop_gives_the_sequential_tokens(backend: str, preempt: str) -> None:
    """On the GPU, with graphs: the overlapped loop (tokens fed to the next step on the
    device, the host a step behind, drains before preemption) gives the tokens of the loop
    that applies each step before scheduling the next."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"needs {backend}")
    sequential, _, modes = _run(backend, preempt, use_graphs=True, overlap=False)
    overlapped, _, _ = _run(backend, preempt, use_graphs=True, overlap=True)
    assert modes[preempt] >= 1, f"the workload is meant to preempt ({modes})"
    assert [r.output for r in overlapped] == [r.output for r in sequential]


def test_prompt_lookup_gives_the_plain_greedy_tokens_on_cuda() -> None:
    """Drafting (verify rows through the triton prefill path, rejected drafts truncated) gives
    plain greedy decoding's tokens, up to near-ties between the two paths' rounding."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    outputs = {}
    for draft in (0, 4):
        config = load_config(CONFIG)
        cache = allocate_kv_cache(config, device="cuda", fill=float("nan"))
        manager = BlockManager(cache.num_blocks, config.cache.block_size, enable_prefix_caching=True)
        shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
        model = random_llama(shape, seed=0, dtype=torch.float16, device="cuda")
        requests = make_workload("default", 12, seed=3, block_size=config.cache.block_size, vocab_size=VOCAB_SIZE)
        report = run_requests(
            model,
            requests,
            manager=manager,
            cache=cache,
            backend=get_backend("triton", config.attention_spec()),
            preemption=make_preemption("recompute", manager, cache),
            token_budget=512,
            overlap=False,
            draft_tokens=draft,
        )
        assert report.finished == len(requests)
        outputs[draft] = [r.output for r in report.requests]
        if draft:
            assert report.drafted > 0, "the workload is meant to find drafts"
            print(f"prompt lookup on CUDA: {report.accepted} of {report.drafted} drafts accepted")
    identical = sum(a == b for a, b in zip(outputs[0], outputs[4], strict=True))
    assert identical >= len(outputs[0]) - 1, f"{identical} of {len(outputs[0])} requests match plain decoding"


def test_nothing_compiles_after_the_warm_up() -> None:
    """The runner's warm-up compiles every kernel variant the loop then runs (the contract of
    ``ModelRunner.warmup``): serving the workload with CUDA graphs and recompute preemption
    compiles nothing more (``RunReport.compiles_after_warmup``, recorded by Triton's
    post-compile hook). Kernels an earlier test compiled in this process are not compiled
    again, so this can pass when run after others; alone, it checks the warm-up's coverage."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    report = _serve("triton", "recompute", use_graphs=True)
    if report.compiles_after_warmup is None:
        pytest.skip("this Triton has no post-compile hook (triton.knobs.runtime.jit_post_compile_hook)")
    assert report.compiles_after_warmup == [], report.compiles_after_warmup


@pytest.mark.parametrize("block_size", [32, 256])
def test_nothing_compiles_after_the_warm_up_over_an_fp8_cache(block_size: int) -> None:
    """The same over a float8_e4m3 cache (bf16 compute): 40 requests at once, so steps carry
    prefill chunks of many rows beside decode rows (eager prefill rows on Hopper read a 16-bit
    copy of their blocks, made by the block dequantization kernel, whose table sizes change
    with every step)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    from examples.engine import cache_config_for, engine_for
    from examples.model import LlamaShape

    shape = LlamaShape(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=64)  # fmt: skip
    config = cache_config_for(shape, block_size=block_size, dtype="float8_e4m3", num_blocks=64 * 1024 // block_size,
                              device="cuda", backend="triton", compute_dtype="bfloat16")  # fmt: skip
    engine = engine_for(config, shape)
    model = random_llama(shape, seed=0, dtype=torch.bfloat16, device="cuda")
    requests = make_workload("default", 40, seed=5, block_size=block_size, vocab_size=VOCAB_SIZE)
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache, 0), token_budget=512, max_running=40,
        use_graphs=True,
    )  # fmt: skip
    assert report.finished == len(requests)
    if report.compiles_after_warmup is None:
        pytest.skip("this Triton has no post-compile hook (triton.knobs.runtime.jit_post_compile_hook)")
    assert report.compiles_after_warmup == [], report.compiles_after_warmup
