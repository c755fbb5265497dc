"""Prompt-lookup decoding in the example engine (``examples.engine.drafting``): the n-gram
index proposes what a brute-force search would, a verified row appends exactly the agreed
drafts and the model's own next token, and a whole run with drafting gives transformers'
greedy tokens, with prefix caching and preemption (drafts taken back with ``truncate``)."""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention import get_backend  # noqa: E402
from examples.engine.drafting import NgramIndex, accepted_tokens  # noqa: E402
from examples.engine.loop import RunReport, run_requests  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.model import Llama  # noqa: E402
from kvcache import BlockManager, allocate_kv_cache  # noqa: E402
from tests.test_decode_loop import BLOCK_SIZE, Case, _cache_config, _hf_generate, hf_model, our_model  # noqa: E402

__all__ = ["hf_model", "our_model"]  # fixtures, shared with test_decode_loop


def brute_force(tokens: list[int], k: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_index_proposes_what_a_search_finds() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        index = NgramIndex(max_n=3)
        cut = rng.randint(0, len(tokens))
        index.extend(tokens[:cut])
        index.extend(tokens[cut:])  # in two pieces, as a request grows
        k = rng.randint(1, 6)
        assert index.propose(k) == brute_force(tokens, k, 3), tokens
    assert NgramIndex().propose(3) == []


def test_a_verified_row_appends_the_agreed_drafts_and_the_models_token() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all agreed, plus a bonus
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # stops at the first disagreement
    assert accepted_tokens([5], [4, 1]) == [4]
    with pytest.raises(ValueError, match="expected one more"):
        accepted_tokens([5, 6], [5, 6])


def repetitive_cases(n: int) -> list[Case]:
    """Prompts that repeat a phrase: a model that continues them finds drafts in them."""
    rng = random.Random(7)
    cases = []
    for i in range(n):
        phrase = [rng.randrange(128) for _ in range(rng.randint(3, 9))]
        prompt = (phrase * 12)[: rng.randint(10, 80)]
        cases.append(Case(prompt, rng.randint(8, 40), i // 2))
    return cases


def ours_with_drafts(
    model: Llama,
    cases: list[Case],
    *,
    num_blocks: int,
    prefix_caching: bool,
    draft: int,
    device: str = "cpu",
    backend: str = "reference",
    use_graphs: bool = False,
    stop_token_ids: list[frozenset[int]] | None = None,
    overlap: bool = False,
    draft_max_rows: int | None = None,
) -> tuple[list[Request], RunReport]:
    config = _cache_config(num_blocks)
    cache = allocate_kv_cache(config, device=device, fill=float("nan"))
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    requests = [Request(i, c.prompt, c.max_new_tokens, c.arrival_step) for i, c in enumerate(cases)]
    for req, stops in zip(requests, stop_token_ids or [], strict=False):
        req.stop_token_ids = stops
    report = run_requests(
        model,
        requests,
        manager=manager,
        cache=cache,
        backend=get_backend(backend, config.attention_spec()),
        preemption=make_preemption("recompute", manager, cache),
        token_budget=48,
        max_running=6,
        overlap=overlap,
        draft_tokens=draft,
        draft_max_rows=draft_max_rows,
        use_graphs=use_graphs,
    )
    return requests, report


@pytest.mark.parametrize(("num_blocks", "prefix_caching"), [(64, False), (10, True)])
def test_drafting_gives_transformers_greedy_tokens(
    hf_model: torch.nn.Module, our_model: Llama, num_blocks: int, prefix_caching: bool
) -> None:
    cases = repetitive_cases(10)
    requests, report = ours_with_drafts(our_model, cases, num_blocks=num_blocks, prefix_caching=prefix_caching, draft=4)
    for case, req in zip(cases, requests, strict=True):
        tokens, _ = _hf_generate(hf_model, case)
        assert req.output == tokens, f"request {req.req_id}: ours {req.output} vs transformers {tokens}"
    drafted = sum(r.drafted for r in requests)
    accepted = sum(r.accepted for r in requests)
    assert 0 < accepted < drafted  # drafts were both kept and taken back
    assert report.steps < sum(c.max_new_tokens for c in cases)  # fewer steps than tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verification_steps_replay_graphs_with_transformers_tokens(
    hf_model: torch.nn.Module, our_model: Llama
) -> None:
    """On the GPU with CUDA graphs, verification steps (rows of the last token and its
    drafts) replay their own graphs, which compute the greedy token of every position; the
    tokens are still transformers' greedy tokens (float32, triton, prefix caching on)."""
    model = copy.deepcopy(our_model).to("cuda")
    cases = repetitive_cases(10)
    requests, report = ours_with_drafts(
        model, cases, num_blocks=64, prefix_caching=True, draft=4, device="cuda", backend="triton", use_graphs=True
    )
    for case, req in zip(cases, requests, strict=True):
        tokens, _ = _hf_generate(hf_model, case)
        assert req.output == tokens, f"request {req.req_id}: ours {req.output} vs transformers {tokens}"
    assert report.graph_replays["verify"] > 0 and report.graph_replays["decode"] > 0, report.graph_replays
    assert 0 < report.accepted < report.drafted


def test_a_verified_row_stops_at_its_first_stop_token(our_model: Llama) -> None:
    """A stop token among a row's agreed drafts ends the request there: the drafts after it
    are taken back like rejected ones."""
    cases = repetitive_cases(10)
    plain, _ = ours_with_drafts(our_model, cases, num_blocks=64, prefix_caching=True, draft=0)
    stops = [frozenset({r.output[len(r.output) // 2]}) for r in plain]
    expected = [r.output[: r.output.index(next(iter(s))) + 1] for r, s in zip(plain, stops, strict=True)]
    drafted, report = ours_with_drafts(
        our_model, cases, num_blocks=64, prefix_caching=True, draft=4, stop_token_ids=stops
    )
    assert [r.output for r in drafted] == expected
    assert all(r.stopped for r in drafted) and report.accepted > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(record_logits=True), "records no logits"), (dict(draft_max_rows=0), "draft_max_rows: 0")],
)
def test_drafting_refuses_recorded_logits_and_a_bad_row_limit(
    our_model: Llama, kwargs: dict[str, object], match: str
) -> None:
    config = _cache_config(8)
    cache = allocate_kv_cache(config, device="cpu")
    manager = BlockManager(8, BLOCK_SIZE)
    with pytest.raises(ValueError, match=match):
        run_requests(
            our_model,
            [Request(0, [1, 2, 3], 4)],
            manager=manager,
            cache=cache,
            backend=get_backend("reference", config.attention_spec()),
            preemption=make_preemption("recompute", manager, cache),
            draft_tokens=2,
            overlap=False,
            **kwargs,  # type: ignore[arg-type]
        )
    assert manager.num_sequences == 0


def test_drafting_below_a_row_limit_overlaps_the_other_steps(hf_model: torch.nn.Module, our_model: Llama) -> None:
    """With ``draft_max_rows``, steps with more running requests overlap (tokens fed on the
    device) and the others draft; the tokens are still transformers' greedy tokens."""
    cases = repetitive_cases(10)
    requests, report = ours_with_drafts(
        our_model, cases, num_blocks=64, prefix_caching=True, draft=4, overlap=True, draft_max_rows=3
    )
    for case, req in zip(cases, requests, strict=True):
        tokens, _ = _hf_generate(hf_model, case)
        assert req.output == tokens, f"request {req.req_id}: ours {req.output} vs transformers {tokens}"
    assert report.fed_rows > 0 and report.accepted > 0, (report.fed_rows, report.accepted)


def test_cli_reports_prompt_lookup(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.decode_loop import main

    assert main(["--draft", "4", "--draft-max-rows", "3", "--quiet", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "prompt lookup: up to 4 drafts per decode row while at most 3 requests run" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--draft", "9"], "--draft: 9 must be in [0, 8]"),
        (["--draft-max-rows", "3"], "needs --draft K"),
        (["--draft", "2", "--tokens-out", "x.json"], "drop --draft or --tokens-out"),
    ],
)
def test_cli_refuses_bad_draft_options(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    from examples.decode_loop import main

    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_copy_task_accepts_drafts_with_plain_tokens(tmp_path: Path) -> None:
    """A real trained model asked to repeat a passage: prompt lookup's drafts are accepted,
    it takes fewer steps than plain decoding, and every request's tokens equal plain greedy
    decoding's (the benchmark exits 1 otherwise)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    pytest.importorskip("gguf", reason="loading the SmolLM2 GGUF needs the gguf package")
    import bench_prompt_lookup
    import fp8_real_model

    try:
        gguf = fp8_real_model.find_gguf(None)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    out = tmp_path / "pl.json"
    threads = torch.get_num_threads()
    try:
        args = ["--gguf", str(gguf), "--device", "cpu", "--prompts", "4", "--new-tokens", "24", "--drafts", "4"]
        assert bench_prompt_lookup.main([*args, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    runs = json.loads(out.read_text())["runs"]
    assert all(r["same_as_plain"] for r in runs.values())
    assert runs["draft-4"]["accepted"] > 0.3 * runs["draft-4"]["drafted"] > 0
    assert runs["draft-4"]["steps"] < runs["plain"]["steps"]
