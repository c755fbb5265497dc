"""Tensor parallelism: head ownership, per-rank caches and plans, the sharded model, and
agreement between ranks.

Three ways of running ranks, cheapest first:

* the ownership rule and per-rank shapes are plain functions (checked for every small shape);
* the sharded model runs as N threads of one process (``tests/tp_threads.py``), whose
  all-reduce sums the shards in rank order: tp=2 and tp=4 with 2 KV heads (each KV head
  replicated on two ranks), with every kind of bias, against transformers' own tokens;
* two real processes under ``torchrun`` over gloo: the example's CLI with ``--tp 2`` against
  ``--tp 1`` (the CI test of the issue), and a rank forced to diverge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from attention import AttentionSpec
from attention.errors import ArgumentTypeError, InvalidArgumentError, RankDivergenceError
from examples.decode_loop import main as decode_main
from examples.engine import cache_config_for, engine_for
from examples.engine.loop import run_requests
from examples.engine.scheduler import Request, make_preemption
from examples.model import Llama, LlamaShape, random_llama, shard_parameter
from kvcache import BlockManager, ScheduledRow, allocate_kv_cache, load_config
from kvcache.cli import main as kvcache_main
from kvcache.memory.cache_tensors import num_blocks_for
from kvcache.parallel.agreement import RankAgreement, StepDigest
from kvcache.parallel.collective import SingleProcess
from kvcache.parallel.heads import TensorParallel, head_problems, rank_spec, valid_tp_sizes
from tests.child_env import child_pythonpath
from tests.tp_threads import ThreadCollective, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # Tiny matrices, and several ranks share the CPU: more OpenMP threads only add latency.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- who owns which heads ----------------------------------------------------------------


def _small_shapes() -> list[tuple[int, int]]:
    return [(h, kvh) for h in range(1, 17) for kvh in range(1, h + 1) if h % kvh == 0]


@pytest.mark.parametrize(("heads", "kv_heads"), _small_shapes())
def test_every_query_head_reads_its_gqa_kv_head_on_its_rank(heads: int, kv_heads: int) -> None:
    group = heads // kv_heads
    valid = valid_tp_sizes(heads, kv_heads)
    for size in range(1, 2 * heads + 1):
        if head_problems(heads, kv_heads, size):
            assert size not in valid
            with pytest.raises(InvalidArgumentError, match=f"tensor-parallel size {size}"):
                TensorParallel(size, 0).shard(heads, kv_heads)
            continue
        assert size in valid
        owner: dict[int, int] = {}
        holders: dict[int, set[int]] = {k: set() for k in range(kv_heads)}
        for rank in range(size):
            tp = TensorParallel(size, rank)
            shard = tp.shard(heads, kv_heads)
            assert len(shard.kv_heads) == tp.kv_heads_per_rank(kv_heads) >= 1
            for kv in shard.kv_heads:
                holders[kv].add(rank)
            for h in shard.query_heads:
                assert h not in owner, f"query head {h} on ranks {owner[h]} and {rank}"
                owner[h] = rank
                # The rank's own GQA rule over its local heads picks the global GQA KV head.
                assert shard.kv_heads[shard.kv_head_of(h)] == h // group, (heads, kv_heads, size, rank, h)
            local = rank_spec(AttentionSpec(heads, kv_heads, 16, "float32"), tp)
            assert (local.num_heads, local.num_kv_heads) == (len(shard.query_heads), len(shard.kv_heads))
        assert sorted(owner) == list(range(heads))
        # Every KV head is on exactly kv_replicas ranks.
        replicas = TensorParallel(size, 0).kv_replicas(kv_heads)
        assert all(len(ranks) == replicas for ranks in holders.values()), holders


def test_refusals_name_the_sizes_that_work() -> None:
    # Qwen2.5-7B: 28 query heads, 4 KV heads.
    assert valid_tp_sizes(28, 4) == [1, 2, 4, 28]
    problems = head_problems(28, 4, 7)
    assert len(problems) == 1 and "replicate 4 KV heads" in problems[0] and "1, 2, 4 or 28" in problems[0]
    assert head_problems(32, 8, 16) == []  # each KV head on two ranks
    with pytest.raises(InvalidArgumentError, match=r"tp\.rank: 2 is not a rank of a group of 2"):
        TensorParallel(2, 2)
    with pytest.raises(InvalidArgumentError, match=r"tp\.size: 0 is below the minimum 1"):
        TensorParallel(0)
    with pytest.raises(ArgumentTypeError, match=r"tp\.size: expected an integer, got bool"):
        TensorParallel(True)


# ---- per-rank caches and plans -----------------------------------------------------------


def test_per_rank_bytes_spec_and_cache_shape() -> None:
    big = load_config("llama3-8b")  # 32 layers, 32 heads, 8 KV heads, head_dim 128, bf16
    full = big.bytes_per_block
    assert big.bytes_per_block_per_rank(TensorParallel(2, 1)) == full // 2
    assert big.bytes_per_block_per_rank(TensorParallel(8, 3)) == full // 8
    # 16 ranks: one KV head each, replicated twice: no smaller than with 8.
    assert big.bytes_per_block_per_rank(TensorParallel(16, 15)) == full // 8
    assert big.bytes_per_token_per_rank(TensorParallel(4, 0)) == big.bytes_per_token // 4
    spec = big.attention_spec(TensorParallel(4, 2))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 2, 128)
    with pytest.raises(InvalidArgumentError, match="tensor-parallel size 3"):
        big.bytes_per_block_per_rank(TensorParallel(3, 0))
    # A memory budget buys twice the blocks per rank at tp=2: each block is half as big.
    assert num_blocks_for(big, 80 * 2**30, TensorParallel(2, 0)) == 2 * num_blocks_for(big, 80 * 2**30)

    tiny = load_config("tiny-cpu")  # 2 layers, 4 heads, 2 KV heads, head_dim 16, 24 blocks
    for size, kv_heads in ((1, 2), (2, 1), (4, 1)):
        cache = allocate_kv_cache(tiny, device="cpu", tp=TensorParallel(size, size - 1))
        assert tuple(cache.storage.shape) == (2, 2, 24, 32, kv_heads, 16)
        assert cache.bytes_per_block == tiny.bytes_per_block_per_rank(TensorParallel(size, 0))


def test_plan_prints_per_rank_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvcache_main(["plan", "llama3-8b", "--memory", "80GiB", "--max-seq-len", "8192", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks: 16 query heads and 4 KV heads per rank" in out
    assert "2,097,152 (2.00 MiB) per rank" in out  # bytes per block: half of tp=1's 4 MiB
    assert "36,864 per rank" in out  # blocks: 72 GiB / 2 MiB
    assert "72.00 GiB per rank, 144.00 GiB in all 2 ranks" in out
    assert "144 at once" in out

    assert kvcache_main(["plan", "llama3-8b", "--memory", "80GiB", "--tp", "16"]) == 0
    out = capsys.readouterr().out
    assert "1 KV head per rank (each KV head on 2 ranks)" in out and "524,288" in out


def test_plan_refuses_a_size_that_does_not_split_the_heads(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvcache_main(["plan", "qwen2.5-7b", "--tp", "7"]) == 1
    err = capsys.readouterr().err
    assert "--tp 7" in err and "4 KV heads" in err and "1, 2, 4 or 28" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        kvcache_main(["plan", "tiny-cpu", "--tp", "0"])
    assert info.value.code == 2


def test_plan_with_tp_imports_no_torch() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from kvcache.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', 'llama3-8b', '--memory', '80GiB', '--tp', '4']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---- the step digest ---------------------------------------------------------------------


def _step(digest: StepDigest, step: int, manager: BlockManager, rows: list[ScheduledRow]) -> int:
    return digest.update(step, manager, rows, [7] * sum(r.num_new for r in rows))


def test_digest_is_equal_for_equal_decisions_and_differs_at_the_first_difference() -> None:
    def run(detour: bool) -> list[int]:
        manager, digest = BlockManager(16, 32), StepDigest()
        if detour:  # the same counts afterwards, but "a" and "b" get other block ids
            manager.allocate("tmp", 32)
        manager.allocate("a", 40)
        manager.allocate("b", 33)
        if detour:
            manager.free("tmp")
        out = [_step(digest, 0, manager, [ScheduledRow("a", 40, start=0), ScheduledRow("b", 33, start=0)])]
        manager.append_slots("a", 1)
        out.append(_step(digest, 1, manager, [ScheduledRow("a", 1), ScheduledRow("b", 1, start=32)]))
        return out

    assert run(False) == run(False)
    plain, detour = run(False), run(True)
    assert plain[0] != detour[0] and plain[1] != detour[1]


def test_digest_covers_blocks_appended_after_the_first_step() -> None:
    def run(move: bool) -> list[int]:
        manager, digest = BlockManager(8, 32), StepDigest()
        manager.allocate("a", 32)
        out = [_step(digest, 0, manager, [ScheduledRow("a", 32, start=0)])]
        if move:  # the free queue's order changes: "a"'s appended block gets another id
            manager.allocate("x", 1)
            manager.allocate("y", 1)
            manager.free("x")
            manager.free("y")
        manager.append_slots("a", 1)
        out.append(_step(digest, 1, manager, [ScheduledRow("a", 1)]))
        return out

    same, moved = run(False), run(True)
    assert same[0] == moved[0]
    assert same[1] != moved[1], "only the appended block differs, and the digest must see it"


# ---- the sharded model, ranks as threads -------------------------------------------------

BIASED = LlamaShape(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
)


def _requests() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    lengths, new, arrivals = [33, 1, 64, 70, 5], [9, 12, 6, 8, 10], [0, 0, 1, 3, 3]
    return [
        Request(i, torch.randint(0, 128, (n,), generator=gen).tolist(), m, a)
        for i, (n, m, a) in enumerate(zip(lengths, new, arrivals, strict=True))
    ]


def _biased_model(seed: int, tp: TensorParallel | None) -> Llama:
    """Random weights with non-zero biases everywhere (init_random_ zeroes them)."""
    model = random_llama(BIASED, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    if tp is None or not tp.is_sharded:
        return model
    shard = Llama(BIASED, tp)
    params = dict(shard.named_parameters())
    with torch.no_grad():
        for name, full in model.named_parameters():
            params[name].copy_(shard_parameter(name, full, BIASED, tp))
    return shard.eval()


def _serve(model: Llama, collective: Any, num_blocks: int = 5) -> tuple[list[Request], Any]:
    tp = model.tp
    config = cache_config_for(
        BIASED, block_size=32, dtype="float32", num_blocks=num_blocks, device="cpu", backend="reference"
    )
    engine = engine_for(config, BIASED, fill=float("nan"), tp=tp, collective=collective)
    model.connect(collective)
    requests = _requests()
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
        collective=collective,
    )
    return requests, report


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_model_gives_the_single_rank_tokens_and_logits(size: int) -> None:
    """tp=4 over 2 KV heads: each KV head replicated on two ranks, one query head per rank.
    Biases on q/k/v (split), o and down (added once after the all-reduce), gate/up (split)."""
    single, single_report = _serve(_biased_model(0, None), SingleProcess())
    assert single_report.preemptions >= 1, "5 blocks are meant to be too few for every request at once"

    def rank(collective: ThreadCollective) -> tuple[list[Request], Any]:
        return _serve(_biased_model(0, TensorParallel(size, collective.rank)), collective)

    results = run_ranks(size, rank)
    for requests, report in results:
        assert report.tp_size == size and report.agreement_checks > report.steps
        for ours, theirs in zip(requests, single, strict=True):
            assert ours.output == theirs.output, f"request {ours.req_id}: tp={size} {ours.output} vs {theirs.output}"
            # Float32; the only difference is the order of the all-reduce sum (shard by
            # shard instead of one matmul), ~1e-6 on logits of magnitude ~1.
            torch.testing.assert_close(
                torch.stack(report.logits[ours.req_id]),
                torch.stack(single_report.logits[ours.req_id]),
                atol=1e-4,
                rtol=0,
            )
    # Every rank sampled from the same logits, bit for bit (lm_head replicated, input all-reduced).
    first = results[0][1].logits
    for _, report in results[1:]:
        for req_id, rows in report.logits.items():
            assert all(torch.equal(a, b) for a, b in zip(rows, first[req_id], strict=True))


def test_kv_groups_under_tensor_parallelism_give_the_single_rank_tokens() -> None:
    """A model mixing a windowed and a full layer (two KV groups, each rank its share of the
    heads in every group): two ranks agree on every block-manager decision and give one
    rank's tokens."""
    import dataclasses

    from kvcache import HybridBlockManager

    shape = dataclasses.replace(BIASED, sliding_window=40, window_layers=(True, False))

    def serve(tp: TensorParallel, collective: Any) -> tuple[list[Request], Any]:
        model = random_llama(shape, seed=0, tp=tp)
        config = cache_config_for(
            shape, block_size=32, dtype="float32", num_blocks=5, device="cpu", backend="reference"
        )
        engine = engine_for(config, shape, fill=float("nan"), tp=tp, collective=collective)
        assert isinstance(engine.manager, HybridBlockManager) and len(engine.manager.groups) == 2
        model.connect(collective)
        requests = _requests()
        report = run_requests(
            model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=32, max_running=4,
            collective=collective,
        )  # fmt: skip
        return requests, report

    single, _ = serve(TensorParallel(), SingleProcess())
    for requests, report in run_ranks(2, lambda c: serve(TensorParallel(2, c.rank), c)):
        assert report.tp_size == 2 and report.agreement_checks > report.steps
        assert [r.output for r in requests] == [r.output for r in single]


@pytest.mark.parametrize("decompress_from", [None, 16], ids=["absorbed", "decompressed-prefill"])
def test_latent_attention_under_tensor_parallelism_gives_transformers_tokens(decompress_from: int | None) -> None:
    """DeepSeek-V3's MLA over two ranks (two of the four query heads each, the latent cache
    whole on both): the ranks agree on every step and give transformers' greedy tokens, with
    prompts absorbed or decompressed."""
    pytest.importorskip("transformers")
    from examples.model import from_transformers
    from tests.test_checkpoints import _hf_generate
    from tests.test_latent_attention import NEW_TOKENS, _deepseek, _prompts

    hf = _deepseek(24, v_head_dim=12)  # values narrower than q_nope: each projection splits by its own width
    prompts = [_prompts()[i] for i in (0, 2, 4, 1)]
    want = [_hf_generate(hf, p, NEW_TOKENS)[0] for p in prompts]
    full = from_transformers(hf)

    def serve(tp: TensorParallel, collective: Any) -> tuple[list[Request], Any]:
        model = from_transformers(hf, share=False, tp=tp)
        assert model.layers[0].attn.num_heads == 4 // tp.size
        assert model.layers[0].attn.kv_b_proj.weight.shape[0] == 4 // tp.size * (16 + 12)
        config = cache_config_for(full.shape, block_size=32, dtype="float32", num_blocks=9, device="cpu",
                                  backend="reference")  # fmt: skip
        engine = engine_for(config, full.shape, fill=float("nan"), tp=tp, collective=collective)
        assert engine.spec.num_heads == 4 // tp.size and engine.spec.num_kv_heads == 1
        engine.backend.latent_prefill_min_tokens = decompress_from
        model.connect(collective)
        requests = [Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
        report = run_requests(
            model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=48, max_running=3,
            collective=collective,
        )  # fmt: skip
        return requests, report

    for requests, report in run_ranks(2, lambda c: serve(TensorParallel(2, c.rank), c)):
        assert report.tp_size == 2 and report.agreement_checks > report.steps
        assert [r.output for r in requests] == want


def test_checkpoint_shards_serve_transformers_tokens(tmp_path: Path) -> None:
    """A Qwen2 checkpoint (q/k/v biases, tied embeddings) loaded per rank from safetensors
    slices, served at tp=2, gives transformers' own greedy tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from examples.model import load_checkpoint

    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=64**-0.5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(5)
    hf = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")

    full = load_checkpoint(tmp_path)
    prompts = [r.prompt for r in _requests()[:3]]

    def rank(collective: ThreadCollective) -> list[list[int]]:
        tp = TensorParallel(2, collective.rank)
        model = load_checkpoint(tmp_path, tp=tp)
        whole = dict(full.named_parameters())
        for name, param in model.named_parameters():  # each rank holds exactly its share
            assert torch.equal(param, shard_parameter(name, whole[name], model.shape, tp))
        params = dict(model.named_parameters())
        # 2 of 4 query heads, then 1 of 2 KV heads for k and for v, x head_dim 16
        assert params["layers.0.attn.wqkv.weight"].shape == (32 + 16 + 16, 64)
        q_full = full.layers[0].attn.wqkv.weight[:64]
        k_full = full.layers[0].attn.wqkv.weight[64:96]
        rows = params["layers.0.attn.wqkv.weight"]
        assert torch.equal(rows[:32], q_full[32 * tp.rank : 32 * tp.rank + 32])
        assert torch.equal(rows[32:48], k_full[16 * tp.rank : 16 * tp.rank + 16])
        assert params["layers.0.attn.wo.weight"].shape == (64, 32)  # the columns of its query heads
        cache_config = cache_config_for(
            model.shape, block_size=32, dtype="float32", num_blocks=12, device="cpu", backend="reference"
        )
        engine = engine_for(cache_config, model.shape, tp=tp, collective=collective)
        model.connect(collective)
        requests = [Request(i, p, 6) for i, p in enumerate(prompts)]
        run_requests(
            model,
            requests,
            manager=engine.manager,
            cache=engine.cache,
            backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache),
            collective=collective,
        )
        return [r.output for r in requests]

    outputs = run_ranks(2, rank)
    for prompt, ours in zip(prompts, outputs[0], strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False)[0, len(prompt):].tolist()  # fmt: skip
        assert ours == theirs
    assert outputs[0] == outputs[1]


def test_ranks_agree_on_the_smallest_block_count_a_budget_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fractional budget of each device's free memory: rank 1's device has less free, so
    both ranks size their pool from rank 1's (their managers must hand out the same ids)."""
    import threading

    import examples.engine.parts

    free = {"tp-rank-0": 8 << 20, "tp-rank-1": 4 << 20}  # bytes free "on each device"
    monkeypatch.setattr(examples.engine.parts, "free_device_memory", lambda _: free[threading.current_thread().name])
    config = cache_config_for(BIASED, block_size=32, dtype="float32", memory_budget=0.5, device="cpu")
    per_block = config.bytes_per_block_per_rank(TensorParallel(2, 0))  # 8 KiB: 2 layers x K,V x 32 x 1 x 16 x 4

    def rank(collective: ThreadCollective) -> int:
        engine = engine_for(config, BIASED, tp=TensorParallel(2, collective.rank), collective=collective)
        assert engine.cache.num_blocks == engine.manager.num_blocks
        return engine.manager.num_blocks

    assert run_ranks(2, rank) == [(2 << 20) // per_block] * 2


def test_a_sharded_model_refuses_to_run_unconnected() -> None:
    model = random_llama(BIASED, seed=0, tp=TensorParallel(2, 0))
    config = cache_config_for(BIASED, block_size=32, dtype="float32", num_blocks=4, device="cpu", backend="reference")
    engine = engine_for(config, BIASED, tp=TensorParallel(2, 0))
    requests = [Request(0, [1, 2, 3], 2)]
    with pytest.raises(RuntimeError, match=r"model.connect\(collective\)"):
        run_requests(
            model,
            requests,
            manager=engine.manager,
            cache=engine.cache,
            backend=engine.backend,
            preemption=make_preemption("recompute", engine.manager, engine.cache),
        )
    with pytest.raises(InvalidArgumentError, match="rank 0 of 1, but the model was built for rank 0 of 2"):
        model.connect(SingleProcess())


def test_diverged_threads_stop_at_the_same_step() -> None:
    def rank(collective: ThreadCollective) -> None:
        requests = _requests()
        if collective.rank == 1:
            requests[2].max_new_tokens += 1  # an input only rank 1 sees
        manager = BlockManager(8, 32)
        agreement = RankAgreement(collective)
        for step, req in enumerate(requests):
            manager.allocate(req.req_id, len(req.prompt) + req.max_new_tokens)
            agreement.step(step, manager, [ScheduledRow(req.req_id, len(req.prompt), start=0)], req.prompt)

    with pytest.raises(RankDivergenceError, match=r"^step 2: the tensor-parallel ranks disagree") as info:
        run_ranks(2, rank)
    assert info.value.step == 2 and len(set(info.value.digests)) == 2


# ---- two processes under torchrun (gloo) -------------------------------------------------


def _torchrun(args: list[str], tmp_path: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    if not TORCHRUN.exists() or not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torchrun and torch.distributed with gloo")
    # --standalone: a free port on localhost, so parallel CI jobs do not collide.
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *args],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout,
    )  # fmt: skip


def test_torchrun_two_ranks_give_the_single_rank_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command: ``torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2``
    on CPU over gloo, against the same CLI with ``--tp 1``."""
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    assert decode_main(["--quiet", "--requests", "6", "--tokens-out", str(one)]) == 0
    capsys.readouterr()
    start = time.perf_counter()
    result = _torchrun(["-m", "examples.decode_loop", "--tp", "2", "--quiet", "--requests", "6",
                        "--tokens-out", str(two)], tmp_path)  # fmt: skip
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("summary") == 1, "only rank 0 prints"
    assert "tensor parallel: 2 ranks" in result.stdout
    single, sharded = json.loads(one.read_text()), json.loads(two.read_text())
    assert sharded["tp"] == 2 and single["tp"] == 1
    # float32: the all-reduce sums in another order than one matmul, moving logits by ~1e-6.
    # Tokens must match exactly, except after a near tie (top-2 gap under 1e-3) at tp=1,
    # where the order of a sum may decide; then the rest of that request may differ.
    for req_id, tokens in single["tokens"].items():
        theirs = sharded["tokens"][req_id]
        assert len(theirs) == len(tokens)
        first = next((j for j, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), None)
        if first is not None:
            gap = single["margins"][req_id][first]
            assert gap < 1e-3, f"request {req_id} differs at token {first}, where the top-2 gap was {gap:.2e}"
    print(f"torchrun --nproc-per-node 2: {seconds:.1f} s; tokens equal: {single['tokens'] == sharded['tokens']}")


def test_torchrun_ranks_that_diverge_stop_cleanly_at_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = ROOT / "tests" / "tp_diverge.py"
    result = _torchrun([str(script), str(out)], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outcomes = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for outcome in outcomes:
        assert outcome["error"] == "RankDivergenceError", outcome
        assert outcome["step"] > outcome["diverge_at"]
        assert (
            f"step {outcome['step']}: the tensor-parallel ranks disagree on the block-manager decisions"
            in (outcome["message"])
        )
    assert outcomes[0]["step"] == outcomes[1]["step"]


def test_tp_without_torchrun_says_how_to_start_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert decode_main(["--tp", "2", "--quiet"]) == 1
    assert "torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2" in capsys.readouterr().err
