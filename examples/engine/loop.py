"""The serving loop: schedule -> one model step -> sample -> commit, until every request is done.

One step is: the scheduler picks rows (:mod:`examples.engine.scheduler`), the runner plans the
step once and runs the model over every row (:mod:`examples.engine.runner`), the greedy token
of every row that reached the end of what is known is sampled, and the scheduler records what
was computed and appends the sampled tokens. :func:`run_requests` returns a
:class:`RunReport`; :func:`format_summary` turns it into the lines the example prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from attention import AttentionBackend, StepCapacity
from attention.checks import cdiv
from examples.engine.runner import ModelRunner, WarmupReport
from examples.engine.scheduler import Preemption, Request, Scheduler
from examples.model.llama import Llama
from kvcache import BlockManager, KVCacheTensors
from kvcache.parallel.agreement import RankAgreement
from kvcache.parallel.collective import Collective

__all__ = ["ProgressHook", "RunReport", "format_summary", "run_requests"]


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
