"""KV groups in the example engine: a Gemma-3-style model (five windowed layers to one full)
served with one block table per group, so the windowed layers hold a window's K/V instead of
the whole sequence's.

Each run is checked against transformers' own greedy generation with the same weights and
against the same engine with one table for every layer (``kv_groups=False``); the cache is
poisoned with NaN, and the reference backend refuses to read a table entry that is not a
block, so a read behind a window or a wrong group's slot shows. Memory is measured as layer
blocks in use (block ids in use times the layers each holds), sampled after every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention import PAD_BLOCK, get_backend  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.loop import RunReport, run_requests  # noqa: E402
from examples.engine.parts import Engine  # noqa: E402
from examples.engine.scheduler import Request, Scheduler, make_preemption  # noqa: E402
from examples.model import Llama, from_transformers  # noqa: E402
from kvcache import HybridBlockManager, KVCacheTensors, MetadataBuilder, ScheduledRow, group_layout  # noqa: E402
from kvcache.blocks.manager import BlockManager  # noqa: E402
from tests.test_checkpoints import LOGITS_ATOL, VOCAB, _hf_generate, _hf_model  # noqa: E402

WINDOW = 32
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
NEW_TOKENS = 24


def _gemma3() -> Any:
    return _hf_model(
        "gemma3",
        num_hidden_layers=len(LAYER_TYPES),
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        layer_types=LAYER_TYPES,
        max_position_embeddings=1024,  # the flash-attn test's 600-token prompt and its new tokens
    )


def _prompts(lengths: tuple[int, ...], seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Served:
    requests: list[Request]
    report: RunReport
    engine: Engine
    #: Layer blocks in use (block ids in use x layers per id) after each step.
    layer_blocks: list[int]


def _serve(
    model: Llama,
    prompts: list[list[int]],
    *,
    kv_groups: bool,
    num_blocks: int,
    new_tokens: int = NEW_TOKENS,
    backend: str = "reference",
    device: str = "cpu",
    prefix_caching: bool = False,
    draft_tokens: int = 0,
    use_graphs: bool = False,
    max_running: int = 4,
    block_size: int = 32,
    dtype: str = "float32",
) -> Served:
    config = cache_config_for(
        model.shape, block_size=block_size, dtype=dtype, num_blocks=num_blocks, device=device, backend=backend,
        prefix_caching=prefix_caching,
    )  # fmt: skip
    chosen = get_backend(backend, model.shape.attention_spec(dtype))
    engine = engine_for(config, model.shape, backend=chosen, fill=float("nan"), kv_groups=kv_groups)
    requests = [Request(i, p, new_tokens, arrival_step=i) for i, p in enumerate(prompts)]
    used: list[int] = []

    def on_step(step: int, scheduler: Scheduler, elapsed: float, generated: int) -> None:
        used.append(scheduler.manager.allocator.num_used * engine.cache.num_tensors)

    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=64,
        max_running=max_running, record_logits=not draft_tokens, on_step=on_step, draft_tokens=draft_tokens,
        use_graphs=use_graphs,
    )  # fmt: skip
    assert report.finished == len(prompts)
    return Served(requests, report, engine, used)


def test_kv_groups_serve_transformers_tokens_in_a_fraction_of_the_memory() -> None:
    hf = _gemma3()
    model = from_transformers(hf)
    prompts = _prompts((150, 200, 97, 260, 33, 180))
    grouped = _serve(model, prompts, kv_groups=True, num_blocks=64)
    single = _serve(model, prompts, kv_groups=False, num_blocks=64)
    manager = grouped.engine.manager
    assert isinstance(manager, HybridBlockManager) and isinstance(single.engine.manager, BlockManager)
    assert [g.window for g in manager.layout.groups] == [None] + [WINDOW] * 5
    assert grouped.engine.cache.num_tensors == 1 and manager.num_blocks == 6 * 64  # the same memory
    for prompt, ours, theirs in zip(prompts, grouped.requests, single.requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, NEW_TOKENS)
        assert ours.output == tokens == theirs.output, f"prompt of {len(prompt)}"
        torch.testing.assert_close(torch.stack(grouped.report.logits[ours.req_id]), logits, atol=LOGITS_ATOL, rtol=0)
    # Windowed groups keep at most ceil((32 - 1) / 32) + 1 = 2 blocks a sequence after its
    # prefill; every layer of the single table keeps the whole sequence.
    mean_grouped = sum(grouped.layer_blocks) / len(grouped.layer_blocks)
    mean_single = sum(single.layer_blocks) / len(single.layer_blocks)
    assert mean_grouped < 0.6 * mean_single, (mean_grouped, mean_single)
    print(f"layer blocks in use, mean over steps: {mean_grouped:.1f} with KV groups, {mean_single:.1f} without")


def test_kv_groups_with_preemption_prefix_hits_and_drafts() -> None:
    """A pool too small for every request, prompts sharing a prefix, prompt-lookup drafts
    (rolled back on the windowed groups too): the tokens of one table for every layer."""
    hf = _gemma3()
    model = from_transformers(hf)
    shared = _prompts((40,), seed=3)[0]
    motif = _prompts((9,), seed=4)[0]
    prompts = [shared + motif * 4 + tail for tail in _prompts((5, 20, 17, 31, 2), seed=5)]
    # 7 blocks of every layer = 42 block ids of one layer; a request peaks at 6 full-group
    # blocks and 2-3 in each windowed group, after taking 3-4 in every group at admission.
    grouped = _serve(model, prompts, kv_groups=True, num_blocks=7, prefix_caching=True, draft_tokens=3, new_tokens=64)
    single = _serve(model, prompts, kv_groups=False, num_blocks=40, prefix_caching=True, new_tokens=64)
    for prompt, ours, theirs in zip(prompts, grouped.requests, single.requests, strict=True):
        assert ours.output == theirs.output, f"prompt of {len(prompt)}"
    report = grouped.report
    assert report.preemptions > 0, "the pool is meant to be too small"
    assert (report.prefix_hit_tokens or 0) > 0, "the shared prefix is meant to hit"
    assert sum(r.accepted for r in grouped.requests) > 0, "the repeated motif is meant to be drafted"
    assert grouped.engine.manager.window_lag == 3


def test_a_long_prompt_is_reserved_chunk_by_chunk() -> None:
    """With KV groups a prompt takes its blocks as its chunks are scheduled: the windowed
    groups never hold the whole prompt, not even at admission."""
    hf = _gemma3()
    model = from_transformers(hf)
    (prompt,) = _prompts((450,), seed=9)
    grouped = _serve(model, [prompt], kv_groups=True, num_blocks=24, new_tokens=4)
    single = _serve(model, [prompt], kv_groups=False, num_blocks=24, new_tokens=4)
    assert grouped.requests[0].output == single.requests[0].output == _hf_generate(hf, prompt, 4)[0]
    # 453 tokens, 6 layers: one table holds 15 blocks x 6 layers at the end; the full group
    # 15 x 1, and each windowed group at most a window (2 blocks) and a 64-token chunk (3).
    assert max(single.layer_blocks) == 15 * 6
    assert max(grouped.layer_blocks) <= 15 + 5 * 5, grouped.layer_blocks


def test_the_builder_writes_each_groups_tables_and_slots() -> None:
    layout = group_layout(6, WINDOW, (True,) * 5 + (False,))
    manager = HybridBlockManager(layout, 64, 32)
    backend = get_backend("reference", _gemma3_spec())
    builder = MetadataBuilder("cpu", backend=backend, kv_groups=len(layout.groups), device_check=True)
    manager.allocate("a", 150)
    manager.allocate("b", 40)
    rows = [ScheduledRow("a", 64, start=0), ScheduledRow("b", 40, start=0)]
    for _ in range(4):
        plan = builder.plan(manager, rows)
        assert len(plan.groups) == len(layout.groups)
        for g in range(len(layout.groups)):
            meta = plan.group(g).metadata
            for i, row in enumerate(rows):
                table = manager.block_tables(row.seq_id)[g]
                assert meta.block_tables[i, : len(table)].tolist() == table
                start = meta.seq_lens_host[i] - row.num_new
                first = sum(r.num_new for r in rows[:i])
                slots = meta.slot_mapping[first : first + row.num_new].tolist()
                assert slots == manager.slots(row.seq_id, start, start + row.num_new)[g]
        builder.raise_if_violated()
        manager.commit(rows)
        computed = manager.num_computed("a")
        if computed < 150:
            rows = [ScheduledRow("a", min(64, 150 - computed), start=computed)]
        else:
            manager.append_slots("a", 1)
            rows = [ScheduledRow("a", 1, start=computed)]
    windowed = manager.block_tables("a")[1]
    assert windowed[0] == PAD_BLOCK, "blocks behind the window are released in the windowed groups"
    assert PAD_BLOCK not in manager.block_tables("a")[0]
    with pytest.raises(ValueError, match=r"kv_groups=6"):
        MetadataBuilder("cpu", backend=backend).plan(manager, rows)


def test_layers_of_different_groups_alias_one_tensor_at_different_blocks() -> None:
    layout = group_layout(6, WINDOW, (True,) * 5 + (False,))
    storage = torch.zeros(layout.group_size, 2, 8, 32, 2, 16)
    cache = KVCacheTensors(storage, None, layout)
    assert cache.num_layers == 6 and cache.num_tensors == 1
    assert [cache.group_of(i) for i in range(6)] == [1, 2, 3, 4, 5, 0]
    assert all(cache.layer(i).key.data_ptr() == storage[0, 0].data_ptr() for i in range(6))
    with pytest.raises(ValueError, match="layout"):
        KVCacheTensors(torch.zeros(2, 2, 8, 32, 2, 16), None, layout)


def test_what_kv_groups_do_not_have_yet_is_refused_with_the_fix() -> None:
    hf = _gemma3()
    model = from_transformers(hf)
    config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=8, device="cpu",
                              backend="reference", swap_space="1MiB")  # fmt: skip
    engine = engine_for(config, model.shape)
    with pytest.raises(ValueError, match=r"--preempt swap.*--no-kv-groups"):
        make_preemption("swap", engine.manager, engine.cache, config.cache.swap_space)
    flat = engine_for(config, model.shape, kv_groups=False)
    assert make_preemption("swap", flat.manager, flat.cache, config.cache.swap_space).name == "swap"
    hosted = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=8, device="cpu",
                              backend="reference", prefix_caching=True, host_cache_space="1MiB")  # fmt: skip
    with pytest.raises(ValueError, match=r"host_cache_space.*no host tier yet"):
        engine_for(hosted, model.shape)
    # A layout of another model, and a cache whose groups do not follow the spec's windows.
    from kvcache import allocate_kv_cache, manager_for

    with pytest.raises(ValueError, match=r"layout: expected the KV groups of a 6-layer model"):
        allocate_kv_cache(config, layout=group_layout(4, WINDOW, (True, False, True, False)))
    swapped = allocate_kv_cache(config, layout=group_layout(6, WINDOW, (False,) + (True,) * 5))
    with pytest.raises(ValueError, match=r"do not follow the model's window pattern"):
        manager_for(config, swapped, spec=model.shape.attention_spec("float32"))


@pytest.mark.gpu
def test_kv_groups_replay_cuda_graphs_with_transformers_tokens() -> None:
    """Triton kernels on the GPU with CUDA graphs (decode and mixed buckets over every group's
    tables): transformers' tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    hf = _gemma3().cuda()
    model = from_transformers(hf)
    prompts = _prompts((150, 200, 97, 33))
    grouped = _serve(model, prompts, kv_groups=True, num_blocks=48, backend="triton", device="cuda", use_graphs=True)
    assert isinstance(grouped.engine.manager, HybridBlockManager)
    replays = grouped.report.graph_replays
    assert replays.get("decode", 0) > 0 and replays.get("mixed", 0) > 0, replays
    for prompt, req in zip(prompts, grouped.requests, strict=True):
        tokens, logits = _hf_generate(hf, prompt, NEW_TOKENS)
        assert req.output == tokens, f"prompt of {len(prompt)}"
        torch.testing.assert_close(torch.stack(grouped.report.logits[req.req_id]).cpu(), logits.cpu(),
                                   atol=LOGITS_ATOL, rtol=0)  # fmt: skip


@pytest.mark.gpu
def test_kv_groups_on_flash_attn_compute_what_one_table_does() -> None:
    """flash-attn (bf16, block 256) with CUDA graphs: a plan per group (its block tables) gives
    the tokens of one table for every layer, bit for bit (the same K/V, read through other
    block ids)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flash_attn")
    hf = _gemma3()
    model = from_transformers(hf, share=False, dtype=torch.bfloat16).cuda()
    prompts = _prompts((150, 600, 97, 333))
    options: dict[str, Any] = {"backend": "flash_attn", "device": "cuda", "use_graphs": True, "block_size": 256,
                               "dtype": "bfloat16", "new_tokens": 16}  # fmt: skip
    grouped = _serve(model, prompts, kv_groups=True, num_blocks=12, **options)
    single = _serve(model, prompts, kv_groups=False, num_blocks=12, **options)
    assert isinstance(grouped.engine.manager, HybridBlockManager)
    assert grouped.report.graph_replays.get("decode", 0) > 0
    assert [r.output for r in grouped.requests] == [r.output for r in single.requests]
    for ours, theirs in zip(grouped.requests, single.requests, strict=True):
        logits = grouped.report.logits[ours.req_id], single.report.logits[theirs.req_id]
        assert torch.equal(torch.stack(logits[0]), torch.stack(logits[1]))


def _gemma3_spec() -> Any:
    from examples.model import shape_from_config

    return shape_from_config(_gemma3().config).attention_spec("float32")


def test_the_serving_benchmark_runs_its_tiny_case(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """benchmarks/bench_hybrid_serving.py on the CPU (its H200 figures come from the same code)."""
    import sys

    from tests.bench_script import load_bench

    module = load_bench("bench_hybrid_serving")
    monkeypatch.setattr(sys, "argv", ["bench_hybrid_serving.py", "--device", "cpu", "--tiny"])
    module.main()
    out = capsys.readouterr().out
    assert "identical requests: 12 / 12" in out, out
    ratios = {line[:24].strip(): float(line.split()[-1]) for line in out.splitlines() if line[:1].isalpha()}
    # KV groups: less K/V per request, so more requests at once in the same memory.
    assert ratios["layer blocks / request"] < 0.8 and ratios["mean running"] > 1.2, out


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_give_the_tokens_of_one_table(seed: int) -> None:
    """Random prompts (some sharing a prefix, some repeating a motif), pools down to the
    largest request, token budgets, prefix caching, drafts, overlap and stop tokens: KV groups
    give exactly the tokens of one table for every layer (a roomy pool, no drafts)."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 40, 70]))]
    motif = [rng.randrange(VOCAB) for _ in range(7)]
    prompts = [
        shared + motif * rng.randint(0, 5) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 120))]
        for _ in range(rng.randint(2, 7))
    ]
    new = rng.randint(4, 40)
    stops = frozenset(rng.randrange(VOCAB) for _ in range(rng.choice([0, 3])))
    least = -(-max(len(p) + new for p in prompts) // 32)
    options: dict[str, Any] = {
        "token_budget": rng.choice([16, 33, 64, 128]),
        "prefix_caching": rng.random() < 0.6,
        "overlap": rng.random() < 0.7,
    }
    model = from_transformers(_gemma3())

    def outputs(kv_groups: bool, num_blocks: int, draft_tokens: int) -> tuple[list[list[int]], RunReport]:
        config = cache_config_for(model.shape, block_size=32, dtype="float32", num_blocks=num_blocks, device="cpu",
                                  backend="reference", prefix_caching=options["prefix_caching"])  # fmt: skip
        engine = engine_for(config, model.shape, fill=float("nan"), kv_groups=kv_groups)
        requests = [Request(i, p, new, arrival_step=i, stop_token_ids=stops) for i, p in enumerate(prompts)]
        report = run_requests(
            model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=options["token_budget"],
            max_running=4, draft_tokens=draft_tokens, overlap=options["overlap"],
        )  # fmt: skip
        return [r.output for r in requests], report

    grouped, report = outputs(True, rng.randint(least, least + 2), rng.choice([0, 3]))
    single, _ = outputs(False, 40, 0)
    assert grouped == single, (options, report.preemptions)
