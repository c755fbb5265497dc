"""Greedy decoding with continuous batching over the paged KV cache.

    python -m examples.decode_loop                          # tiny model on CPU, a few seconds
    python -m examples.decode_loop --workload shared-prefix # prefix caching on a shared prompt
    python -m examples.decode_loop --device cuda --backend auto --config configs/llama3-8b.yaml
    python -m examples.decode_loop --checkpoint path/to/Qwen2.5-0.5B   # real weights (safetensors)
    torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2          # tensor parallel, 2 CPU processes (gloo)

A workload of requests with different prompt lengths arrives over time; the scheduler
(:mod:`examples.scheduler`) admits, chunks, decodes, preempts and frees them, and each step
runs the model (:mod:`examples.llama`, random weights from ``--seed``, or a Llama / Qwen2 /
Mistral checkpoint with ``--checkpoint``: then the config's ``model`` section is the
checkpoint's) once over every scheduled row. One step is: schedule -> build metadata once -> ``backend.plan`` once ->
every layer writes K/V and attends -> sample -> ``mark_computed``.

With ``--tp N`` under torchrun each process is one tensor-parallel rank: it holds its share of
the weights and of the KV heads (:mod:`kvcache.parallel`), runs the same scheduler and block
manager on the same seeded requests as every other rank, and checks each step that all ranks
decided the same (:mod:`kvcache.agreement`). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attention import AttentionBackend, StepCapacity
from attention.capabilities import BACKEND_NAMES
from attention.checks import cdiv
from attention.dtypes import torch_dtype
from attention.errors import RankDivergenceError
from examples.distributed import ParallelRun, start_parallel, stop_parallel
from examples.engine import engine_for
from examples.llama import Llama, random_llama, shape_for_cache
from examples.runner import ModelRunner, WarmupReport
from examples.scheduler import Preemption, Request, Scheduler, make_preemption
from kvcache import BlockManager, KVCacheConfig, KVCacheError, KVCacheTensors, load_config, resolve_device
from kvcache.agreement import RankAgreement
from kvcache.collective import Collective

__all__ = ["RunReport", "format_summary", "main", "make_workload", "run_requests"]

#: The repository's tiny CPU config, found from this file so any working directory works.
DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml")
#: Example-only model sizes: the cache config describes attention only (and forbids extra keys).
VOCAB_SIZE = 256


@dataclass
class RunReport:
    """What a run did. ``logits[req_id][j]``: float32 [vocab] logits that produced the
    request's j-th generated token (only when asked to record them)."""

    requests: list[Request]
    #: Forward passes run (idle clock steps waiting for an arrival are not counted).
    steps: int
    wall_s: float
    num_blocks: int
    peak_blocks: int
    preemptions: int
    #: Preemptions by mode (``recompute``/``swap``), and blocks swapped out and back in.
    preemptions_by_mode: dict[str, int]
    swapped_blocks: tuple[int, int]
    #: Tokens run through the model: prefill chunks, recomputation and decode tokens.
    computed_tokens: int
    prefix_query_tokens: int | None = None
    prefix_hit_tokens: int | None = None
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    warmup: WarmupReport | None = None
    #: ``margins[req_id][j]``: top-1 minus top-2 logit of its j-th generated token (only when
    #: asked to record them): how close greedy decoding came to picking another token.
    margins: dict[int, list[float]] = field(default_factory=dict)
    #: Tensor-parallel ranks, and the agreement checks they passed (digest exchanges).
    tp_size: int = 1
    agreement_checks: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    @property
    def finished(self) -> int:
        return sum(r.is_finished for r in self.requests)


#: Called after each step with (step, scheduler, seconds since start, tokens generated so far).
ProgressHook = Callable[[int, Scheduler, float, int], None]


def run_requests(
    model: Llama,
    requests: Sequence[Request],
    *,
    manager: BlockManager,
    cache: KVCacheTensors,
    backend: AttentionBackend,
    preemption: Preemption,
    token_budget: int = 64,
    max_running: int = 16,
    use_graphs: bool = False,
    record_logits: bool = False,
    record_margins: bool = False,
    on_step: ProgressHook | None = None,
    on_warmup: Callable[[WarmupReport], None] | None = None,
    collective: Collective | None = None,
) -> RunReport:
    """Generate ``max_new_tokens`` greedy tokens for every request (outputs land in
    ``request.output``). The model, cache and metadata all live on ``cache.device``.
    ``use_graphs``: replay decode steps from CUDA graphs (captured, with every kernel
    compiled, before the first request runs).

    ``collective``: the tensor-parallel group this rank belongs to (the model already
    connected to it). Every rank calls this with the same requests; before each step's
    forward pass the ranks compare a digest of what their managers decided, and at the end
    the outputs, raising RankDivergenceError on every rank at the first difference."""
    agreement = RankAgreement(collective) if collective is not None and collective.size > 1 else None
    if agreement is not None:
        agreement.check(
            "start-up values (block count, block size, requests)",
            manager.num_blocks,
            manager.block_size,
            [(r.req_id, r.prompt, r.max_new_tokens, r.arrival_step) for r in requests],
        )
    scheduler = Scheduler(manager, requests, preemption, token_budget=token_budget, max_running=max_running)
    longest = max((r.peak_tokens for r in requests), default=1)
    capacity = StepCapacity(
        max_rows=max_running,
        max_tokens=max(token_budget, max_running),
        max_blocks_per_seq=cdiv(longest, manager.block_size),
    )
    runner = ModelRunner(model, cache, manager, backend, capacity, use_graphs=use_graphs)
    report = runner.warmup()
    if on_warmup is not None:
        on_warmup(report)
    logits_of: dict[int, list[torch.Tensor]] = {r.req_id: [] for r in requests}
    margins_of: dict[int, list[float]] = {r.req_id: [] for r in requests}
    computed = generated = forward_steps = 0
    step = 0  # the clock request arrivals are given in
    start = time.perf_counter()
    while not scheduler.done:
        batch = scheduler.schedule(step)
        if agreement is not None:  # before the forward: a diverged rank must not enter its collectives
            agreement.step(step, manager, batch.rows if batch else (), batch.token_ids if batch else ())
        if batch is None:  # nothing has arrived yet: jump to the next arrival
            arrival = scheduler.next_arrival()
            if arrival is None or arrival <= step:
                raise RuntimeError("the scheduler is idle but no request is due to arrive")
            step = arrival
            continue
        plan, logits = runner.step(batch.rows, batch.token_ids)  # once per step
        rows = plan.metadata.sampling_rows_host
        next_tokens = dict(zip(rows, logits.argmax(dim=-1).tolist(), strict=True))  # the step's one sync
        if record_logits:
            for j, i in enumerate(rows):
                logits_of[batch.requests[i].req_id].append(logits[j].float().cpu())
        if record_margins:
            top2 = logits.float().topk(2, dim=-1).values.cpu() if logits.shape[-1] > 1 else None
            for j, i in enumerate(rows):
                margin = float(top2[j, 0] - top2[j, 1]) if top2 is not None else float("inf")
                margins_of[batch.requests[i].req_id].append(margin)
        computed += len(batch.token_ids)
        generated += len(rows)
        scheduler.finish_step(batch, next_tokens)
        forward_steps += 1
        if on_step is not None:
            on_step(step, scheduler, time.perf_counter() - start, generated)
        step += 1
    wall = time.perf_counter() - start
    if agreement is not None:  # a rank that stopped early meets the others' step check here
        agreement.check("outputs", forward_steps, [r.output for r in requests])
    manager.check_integrity()
    cache_stats = manager.prefix_cache
    return RunReport(
        requests=list(requests),
        steps=forward_steps,
        wall_s=wall,
        num_blocks=manager.num_blocks,
        peak_blocks=scheduler.peak_blocks,
        preemptions=scheduler.num_preemptions,
        preemptions_by_mode=dict(manager.preemptions),
        swapped_blocks=_swapped_blocks(preemption),
        computed_tokens=computed,
        prefix_query_tokens=None if cache_stats is None else cache_stats.query_tokens,
        prefix_hit_tokens=None if cache_stats is None else cache_stats.hit_tokens,
        logits=logits_of if record_logits else {},
        warmup=report,
        margins=margins_of if record_margins else {},
        tp_size=1 if collective is None else collective.size,
        agreement_checks=0 if agreement is None else agreement.checks,
    )


def _swapped_blocks(preemption: Preemption) -> tuple[int, int]:
    space = getattr(preemption, "space", None)
    return (space.swapped_out_blocks, space.swapped_in_blocks) if space is not None else (0, 0)


def make_workload(
    kind: str, num_requests: int, *, seed: int, block_size: int, vocab_size: int
) -> list[Request]:
    """Seeded requests arriving over time, with prompt lengths and max_new_tokens varying.

    ``default``: the first prompts have the lengths that break paged caches (1, exactly one
    and two blocks, one past a block boundary), the rest are random up to ~3 blocks.
    ``shared-prefix``: every prompt is one long common system prompt (3 blocks and a bit)
    followed by a short user part, the case prefix caching is for.
    """
    rng = random.Random(seed)
    edge = [1, block_size, 5, 2 * block_size, block_size + 1, 3 * block_size + 1, block_size - 1]
    system = [rng.randrange(vocab_size) for _ in range(3 * block_size + 7)]
    requests, arrival = [], 0
    for i in range(num_requests):
        if kind == "shared-prefix":
            prompt = system + [
                rng.randrange(vocab_size) for _ in range(rng.randint(1, block_size + 8))
            ]
        else:
            length = edge[i] if i < len(edge) else rng.randint(2, 3 * block_size + 8)
            prompt = [rng.randrange(vocab_size) for _ in range(length)]
        requests.append(Request(i, prompt, max_new_tokens=rng.randint(4, 40), arrival_step=arrival))
        arrival += rng.choice((0, 0, 1, 2, 3))
    return requests


def format_summary(report: RunReport) -> list[str]:
    """The summary lines: ``name: value`` each, easy to read and to parse."""
    tok_s = report.generated_tokens / report.wall_s if report.wall_s > 0 else 0.0
    lines = [
        f"requests: {len(report.requests)} ({report.finished} finished, {report.steps} steps)",
        f"prompt tokens: {report.prompt_tokens}",
        f"tokens generated: {report.generated_tokens}",
        f"tokens computed: {report.computed_tokens} (prefill chunks, recomputation and decode)",
        f"wall time: {report.wall_s:.2f} s",
        f"tokens/s: {tok_s:.1f} generated",
        f"peak blocks in use: {report.peak_blocks} / {report.num_blocks}",
        f"preemptions: {report.preemptions} ("
        + ", ".join(f"{mode} {n}" for mode, n in report.preemptions_by_mode.items())
        + f"; blocks swapped out/in {report.swapped_blocks[0]}/{report.swapped_blocks[1]})",
    ]
    if report.tp_size > 1:
        lines.append(
            f"tensor parallel: {report.tp_size} ranks; {report.agreement_checks} agreement checks passed "
            f"(identical block-manager decisions and outputs on every rank)"
        )
    if report.prefix_query_tokens is not None and report.prefix_hit_tokens is not None:
        rate = report.prefix_hit_tokens / max(report.prefix_query_tokens, 1)
        lines.append(
            f"prefix cache hits: {report.prefix_hit_tokens} / {report.prefix_query_tokens} tokens "
            f"({rate:.1%}); prefill tokens saved: {report.prefix_hit_tokens}"
        )
    return lines


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.decode_loop", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help="cache config YAML (default configs/tiny-cpu.yaml)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="overrides cache.device")
    p.add_argument(
        "--backend",
        choices=("auto", *BACKEND_NAMES),
        help="overrides attention.backend",
    )
    p.add_argument(
        "--num-blocks", type=_positive, help="overrides cache.num_blocks / cache.memory_budget"
    )
    p.add_argument(
        "--preempt",
        choices=("recompute", "swap"),
        default="recompute",
        help="what a preempted request loses",
    )
    p.add_argument("--workload", choices=("default", "shared-prefix"), default="default")
    p.add_argument("--requests", type=_positive, default=20, help="number of requests (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the workload")
    p.add_argument(
        "--token-budget", type=_positive, default=64, help="most tokens per step (chunked prefill)"
    )
    p.add_argument("--log-every", type=_positive, default=5, help="progress line every N steps")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: run every step eagerly")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="Llama/Qwen2/Mistral checkpoint (config.json + safetensors) instead of random weights",
    )
    p.add_argument("--quiet", action="store_true", help="print the summary only")
    p.add_argument(
        "--tp",
        type=_positive,
        default=1,
        help="tensor-parallel ranks: run under torchrun --nproc-per-node N with --tp N (default 1)",
    )
    p.add_argument(
        "--tokens-out",
        metavar="FILE",
        help="write every request's generated tokens (and each token's top-2 logit margin) as JSON (rank 0)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; returns the exit status (1: bad config, setting or checkpoint)."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        run = start_parallel(args.tp, resolve_device(args.device or config.cache.device))
    except (KVCacheError, ValueError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        return _run(args, config, run)
    finally:
        stop_parallel(run)


def _run(args: argparse.Namespace, config: KVCacheConfig, run: ParallelRun) -> int:
    tp, device = run.tp, run.device
    lead = tp.rank == 0
    say = print if lead and not args.quiet else (lambda *_: None)
    where = f"rank {tp.rank}: " if tp.is_sharded else ""
    try:
        dtype_name = config.attention_spec().dtype
        model: Llama | None = None
        if args.checkpoint:
            from examples.checkpoints import load_checkpoint

            model = load_checkpoint(args.checkpoint, dtype=torch_dtype(dtype_name), device=device, tp=tp)
            shape = model.shape
            # The cache holds this model's K/V: its model section is the checkpoint's.
            config = KVCacheConfig.model_validate(
                {**config.model_dump(), "model": shape.model_section().model_dump()}, strict=False
            )
        else:
            shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
        if device.type == "cpu" and shape.hidden_size <= 1024:
            # Tiny matrices: one thread is fastest, and torch's default of one per core is
            # dozens of times slower when another process shares the cores.
            torch.set_num_threads(1)
        # The shared-prefix workload exists to show prefix caching: turn it on for it.
        turned_on = args.workload == "shared-prefix" and not config.cache.enable_prefix_caching
        engine = engine_for(
            config,
            shape,
            device=device,
            num_blocks=args.num_blocks,
            backend=args.backend,
            prefix_caching=True if turned_on else None,
            tp=tp,
            collective=run.collective,
        )
        reason = f"{args.backend} (--backend)" if args.backend and args.backend != "auto" else engine.reason
        cache, manager = engine.cache, engine.manager
        prefix_caching = manager.prefix_cache is not None
        preemption = make_preemption(args.preempt, manager, cache, config.cache.swap_space)
        use_graphs = engine.graphs_allowed and not args.eager
        if model is None:
            model = random_llama(shape, seed=args.seed, dtype=torch_dtype(dtype_name), device=device, tp=tp)
        model.connect(run.collective)
    except (KVCacheError, ValueError, ImportError, OSError) as err:
        print(f"{where}error: {err}", file=sys.stderr)
        return 1
    m, block_size = config.model, config.cache.block_size
    requests = make_workload(
        args.workload,
        args.requests,
        seed=args.seed,
        block_size=block_size,
        vocab_size=shape.vocab_size,
    )

    lengths = [len(r.prompt) for r in requests]
    say(
        f"config: {_shown(args.config)}: {m.num_layers} layers, {m.num_heads} heads "
        f"({m.num_kv_heads} KV), head_dim {m.head_dim}, {dtype_name} on {device}"
    )
    if tp.is_sharded:
        spec = engine.spec
        say(
            f"tensor parallel: {tp.size} ranks over {run.backend}; per rank {spec.num_heads} query heads, "
            f"{spec.num_kv_heads} KV head(s), {cache.bytes_per_block:,} bytes per block"
        )
    say(f"backend: {reason}")
    say(
        f"cache: {cache.num_blocks} blocks x {block_size} tokens; prefix caching "
        f"{'on' if prefix_caching else 'off'}{' (for this workload)' if turned_on else ''}; "
        f"preempt: {args.preempt}; CUDA graphs: {'on' if use_graphs else 'off'}"
    )
    say(
        f"workload: {args.workload}, {len(requests)} requests, prompts {min(lengths)}-"
        f"{max(lengths)} tokens, arriving over steps 0-{requests[-1].arrival_step}"
    )

    def progress(step: int, s: Scheduler, elapsed: float, generated: int) -> None:
        if step % args.log_every == 0 or s.done:
            used = manager.num_blocks - manager.num_free_blocks
            say(
                f"step {step:4d} | running {len(s.running):2d} waiting {len(s.waiting):2d} "
                f"finished {len(s.finished):2d} | blocks {used:3d}/{manager.num_blocks} | "
                f"{generated / max(elapsed, 1e-9):7.1f} tok/s | preempted {s.num_preemptions}"
            )

    try:
        report = run_requests(
            model,
            requests,
            manager=manager,
            cache=cache,
            backend=engine.backend,
            preemption=preemption,
            token_budget=args.token_budget,
            use_graphs=use_graphs,
            record_margins=args.tokens_out is not None,
            on_step=progress,
            on_warmup=lambda report: say(report.line()),
            collective=run.collective,
        )
    except RankDivergenceError as err:  # raised on every rank at the same step: all exit cleanly
        print(f"{where}error: {err}", file=sys.stderr)
        return 1
    if not lead:
        return 0
    if args.tokens_out:
        _write_tokens(args.tokens_out, report)
    print("summary")
    for line in format_summary(report):
        print(f"  {line}")
    return 0


def _write_tokens(path: str, report: RunReport) -> None:
    """``{"tp": N, "tokens": {req_id: [...]}, "margins": {req_id: [...]}}`` (req ids as strings)."""
    data = {
        "tp": report.tp_size,
        "tokens": {str(r.req_id): r.output for r in report.requests},
        "margins": {str(k): v for k, v in report.margins.items()},
    }
    with open(path, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    sys.exit(main())
