"""The example decode loop against a reference no one here wrote: transformers' own greedy
generation of ``LlamaForCausalLM`` with the same weights.

transformers runs each prompt alone, unpadded, with its own contiguous cache. Ours runs all
prompts together: continuous batching, chunked prefill, paged K/V through the reference
backend, and a pool small enough that requests are preempted and recomputed. Same tokens,
and logits equal up to summation order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention import get_backend  # noqa: E402
from examples.decode_loop import VOCAB_SIZE, main  # noqa: E402
from examples.engine.loop import RunReport, run_requests  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.engine.workload import make_workload  # noqa: E402
from examples.model import (  # noqa: E402
    Llama,
    load_state_dict,
    shape_from_config,
)
from kvcache import BlockManager, KVCacheConfig, allocate_kv_cache, parse_config  # noqa: E402

BLOCK_SIZE = 32
# Float32 end to end on both sides, so the only differences are summation order: prefill in
# chunks instead of at once, K/V gathered from pages, a preempted request's prompt recomputed
# in one pass, a different matmul blocking. Those move float32 logits of magnitude ~1 by about
# 1e-6; 1e-4 absolute leaves room for that, while a real bug (a wrong position, a stale or
# misplaced slot, a missing causal mask) moves them by 1e-2 or more.
LOGITS_ATOL = 1e-4


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int


def _cache_config(num_blocks: int) -> KVCacheConfig:
    return parse_config(
        f"""
model: {{num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16}}
cache: {{block_size: {BLOCK_SIZE}, dtype: float32, num_blocks: {num_blocks}, device: cpu}}
attention: {{backend: reference}}
"""
    )


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        # std 1/sqrt(hidden): activations keep unit scale, attention scores are O(1) and
        # logits ~1. The default 0.02 makes attention nearly uniform, which would hide
        # position and cache bugs.
        initializer_range=64**-0.5,
        bos_token_id=None,
        eos_token_id=None,  # generate exactly max_new_tokens, as our loop does
        pad_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def our_model(hf_model: torch.nn.Module) -> Llama:
    model = Llama(shape_from_config(hf_model.config)).to(torch.float32).eval()
    load_state_dict(model, hf_model.state_dict())
    return model


def _hf_generate(model: torch.nn.Module, case: Case) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits behind each: int list, float32 [n, vocab]."""
    ids = torch.tensor([case.prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=case.max_new_tokens,
            min_new_tokens=case.max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(case.prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()


def _ours(
    model: Llama,
    cases: list[Case],
    *,
    num_blocks: int,
    token_budget: int,
    prefix_caching: bool,
    preempt: str = "recompute",
) -> tuple[list[Request], RunReport]:
    config = _cache_config(num_blocks)
    model.shape.check_cache(config.model)
    cache = allocate_kv_cache(
        config, device="cpu", fill=float("nan")
    )  # a read of an unwritten slot shows
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    requests = [Request(i, c.prompt, c.max_new_tokens, c.arrival_step) for i, c in enumerate(cases)]
    report = run_requests(
        model,
        requests,
        manager=manager,
        cache=cache,
        backend=get_backend("reference", config.attention_spec()),
        # Host pool of 3 blocks: swaps happen, and a victim too big for it is recomputed.
        preemption=make_preemption(preempt, manager, cache, 3 * config.bytes_per_block),
        token_budget=token_budget,
        max_running=8,
        record_logits=True,
    )
    return requests, report


def _assert_same_as_transformers(
    hf_model: torch.nn.Module, cases: list[Case], requests: list[Request], report: RunReport
) -> None:
    worst = 0.0
    for case, req in zip(cases, requests, strict=True):
        tokens, logits = _hf_generate(hf_model, case)
        assert req.output == tokens, (
            f"prompt of {len(case.prompt)} tokens (preempted {req.num_preemptions}x): "
            f"ours {req.output} vs transformers {tokens}"
        )
        ours = torch.stack(report.logits[req.req_id])
        torch.testing.assert_close(ours, logits, atol=LOGITS_ATOL, rtol=0)
        worst = max(worst, (ours - logits).abs().max().item())
    print(f"max |logit difference| = {worst:.2e} (tolerance {LOGITS_ATOL:g})")


@pytest.mark.parametrize(
    ("preempt", "prefix_caching"), [("recompute", False), ("swap", False), ("swap", True)]
)
def test_same_tokens_as_transformers_with_batching_chunking_and_preemption(
    hf_model: torch.nn.Module, our_model: Llama, preempt: str, prefix_caching: bool
) -> None:
    gen = torch.Generator().manual_seed(7)
    # Prompt lengths that end exactly on a block boundary (32, 64) and odd ones.
    lengths = [32, 64, 1, 5, 33, 97]
    new_tokens = [12, 9, 16, 7, 14, 10]
    arrivals = [0, 0, 1, 2, 2, 4]
    cases = [
        Case(torch.randint(0, 128, (n,), generator=gen).tolist(), m, a)
        for n, m, a in zip(lengths, new_tokens, arrivals, strict=True)
    ]
    token_budget = 32  # prompts of 33, 64 and 97 tokens are prefilled in chunks
    # 5 blocks of 32 hold 160 tokens; the requests' peaks add up to 13 blocks.
    requests, report = _ours(
        our_model, cases, num_blocks=5, token_budget=token_budget, prefix_caching=prefix_caching, preempt=preempt
    )

    assert report.finished == len(cases)
    assert max(lengths) > token_budget
    assert report.preemptions >= 1, "the pool is meant to be too small for every request at once"
    assert report.preemptions_by_mode[preempt] >= 1, report.preemptions_by_mode
    if preempt == "swap":
        assert report.swapped_blocks[0] == report.swapped_blocks[1] > 0
    _assert_same_as_transformers(hf_model, cases, requests, report)


def test_same_tokens_as_transformers_with_prefix_caching(
    hf_model: torch.nn.Module, our_model: Llama
) -> None:
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(0, 128, (70,), generator=gen).tolist()  # two full blocks and 6 tokens
    # Suffixes: 26 makes the prompt end exactly on a block boundary (96); 0 is the system
    # prompt alone, whose last token must still be computed.
    suffixes = [1, 26, 0, 5, 33]
    cases = [
        Case(system + torch.randint(0, 128, (n,), generator=gen).tolist(), 6 + 2 * i, 3 * i)
        for i, n in enumerate(suffixes)
    ]
    requests, report = _ours(our_model, cases, num_blocks=12, token_budget=48, prefix_caching=True)

    assert report.finished == len(cases)
    assert report.prefix_hit_tokens is not None and report.prefix_hit_tokens > 0
    assert sum(r.cached_tokens for r in requests) == report.prefix_hit_tokens
    _assert_same_as_transformers(hf_model, cases, requests, report)


def _summary(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+([a-z/ ]+): (.+)$", text, flags=re.MULTILINE))


def test_cli_default_summary_is_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quiet"]) == 0
    summary = _summary(capsys.readouterr().out)
    workload = make_workload("default", 20, seed=0, block_size=BLOCK_SIZE, vocab_size=VOCAB_SIZE)

    requests = re.match(r"(\d+) \((\d+) finished", summary["requests"])
    assert requests is not None, summary
    assert int(requests[1]) == int(requests[2]) == len(workload)
    assert int(summary["prompt tokens"]) == sum(len(r.prompt) for r in workload)
    assert int(summary["tokens generated"]) == sum(r.max_new_tokens for r in workload)
    computed = int(summary["tokens computed"].split()[0])
    # Every prompt token and every fed-back token is computed at least once (the last
    # sampled token of a request is never fed back); recomputation only adds.
    assert computed >= int(summary["prompt tokens"]) + int(summary["tokens generated"]) - len(
        workload
    )
    peak, total = (int(x) for x in summary["peak blocks in use"].split(" / "))
    assert 0 < peak <= total
    assert int(summary["preemptions"].split()[0]) >= 1, (
        "configs/tiny-cpu.yaml is sized so the example preempts"
    )


def test_cli_shared_prefix_reports_hits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quiet", "--workload", "shared-prefix", "--requests", "8"]) == 0
    hits = _summary(capsys.readouterr().out)["prefix cache hits"]
    assert int(hits.split()[0]) > 0


def test_cli_swap_mode_swaps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quiet", "--preempt", "swap"]) == 0
    preemptions = _summary(capsys.readouterr().out)["preemptions"]
    swaps = re.search(r"swap (\d+); blocks swapped out/in (\d+)/(\d+)", preemptions)
    assert swaps is not None and int(swaps[1]) >= 1 and swaps[2] == swaps[3] != "0", preemptions


def test_cli_too_few_blocks_is_one_line_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quiet", "--num-blocks", "3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: --num-blocks / cache size: request ") and "give the cache at least 5 blocks" in err


def test_cli_summary_says_whether_steps_replayed_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quiet", "--requests", "4"]) == 0
    out = capsys.readouterr().out
    assert "\n  CUDA graphs: off\n" in out  # a CPU run has none
    assert "kernels compiled after warm-up" not in out  # nor compiles to count


def test_summary_names_kernels_compiled_after_the_warm_up() -> None:
    """On CUDA the summary says how many kernels compiled after the warm-up (each one a stalled
    step), and names them; nothing is said where that is unknown (a CPU run)."""
    from dataclasses import replace

    from examples.engine.loop import RunReport, format_summary

    base = RunReport(requests=[], steps=1, wall_s=1.0, num_blocks=4, peak_blocks=1, preemptions=0,
                     preemptions_by_mode={}, swapped_blocks=(0, 0), computed_tokens=1)  # fmt: skip
    assert not any(line.startswith("kernels compiled") for line in format_summary(base))
    assert "kernels compiled after warm-up: none" in format_summary(replace(base, compiles_after_warmup=[]))
    missed = replace(base, compiles_after_warmup=["_decode_hopper_kernel", "_combine", "_decode_hopper_kernel"])
    assert "kernels compiled after warm-up: 3 (_decode_hopper_kernel x2, _combine x1); the warm-up missed them" in (
        format_summary(missed)
    )


def test_cli_multi_turn_host_tier_saves_prefill_with_the_same_tokens(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Conversations whose earlier turns a small pool evicts: with a host tier they come back
    from host memory instead of being recomputed, and every token is the same as with a pool
    large enough to keep them all."""
    runs = {}
    for name, args in {
        "roomy": ["--num-blocks", "96"],
        "small": ["--num-blocks", "16"],
        "tiered": ["--num-blocks", "16", "--host-cache", "200KiB"],
    }.items():
        out = tmp_path / f"{name}.json"
        assert main(["--quiet", "--workload", "multi-turn", "--requests", "24", "--tokens-out", str(out), *args]) == 0
        runs[name] = (_summary(capsys.readouterr().out), json.loads(out.read_text())["tokens"])
    assert runs["tiered"][1] == runs["small"][1] == runs["roomy"][1]
    host = re.match(r"(\d+) blocks hit, (\d+) offloaded", runs["tiered"][0]["host tier"])
    assert host is not None and int(host[1]) > 0 and int(host[2]) > 0
    computed = {name: int(summary["tokens computed"].split()[0]) for name, (summary, _) in runs.items()}
    assert computed["roomy"] <= computed["tiered"] < computed["small"]
    assert "host tier" not in runs["small"][0]
