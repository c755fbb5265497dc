"""The serving loop: schedule -> one model step -> sample -> commit, until every request is done.

One step is: the scheduler picks rows (:mod:`examples.engine.scheduler`), the runner plans the
step once and queues the model over every row and the greedy sampling on the device
(:mod:`examples.engine.runner`), and the scheduler records what was computed and appends the
sampled tokens. :func:`run_requests` returns a :class:`RunReport`; :func:`format_summary`
turns it into the lines the example prints.

Overlapped (the default, :class:`StepPipeline`): step N+1 is scheduled, planned and queued
while the device runs step N, and step N's results are applied after that (its decode rows'
next tokens reach step N+1 on the device, through ``feed``). The host's work then hides
behind the device's instead of adding to it; the tokens are the same as with ``overlap=False``,
which applies each step's results before scheduling the next.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from attention import AttentionBackend, StepCapacity
from attention.checks import cdiv
from attention.errors import InvalidArgumentError
from kvcache import AnyBlockManager, KVCacheTensors
from kvcache.memory.host_tier import HostPrefixTier, HostTierStats
from kvcache.parallel.agreement import RankAgreement
from kvcache.parallel.collective import Collective

from ..model.llama import Llama
from .compile_watch import CompileWatch, describe_compiles
from .request_checks import check_fits_runner
from .runner import LaunchedStep, ModelRunner, WarmupReport
from .scheduler import Preemption, Request, Scheduler, StepBatch

__all__ = ["ProgressHook", "RunReport", "StepPipeline", "format_summary", "run_requests"]


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
    #: Whether steps overlapped, and the rows whose input token came from the previous step's
    #: samples on the device (scheduled before the host knew it).
    overlap: bool = False
    fed_rows: int = 0
    #: Steps replayed from CUDA graphs, by kind ("decode", "mixed", and "verify" with drafts);
    #: empty without graphs.
    graph_replays: dict[str, int] = field(default_factory=dict)
    #: The prefix cache's host tier, when there is one.
    host_tier: HostTierStats | None = None
    #: Prompt-lookup drafting: draft tokens per decode row (0: off), and the most running
    #: requests a drafting step may have (None: any).
    draft_tokens: int = 0
    draft_max_rows: int | None = None
    #: KV groups (1: one table for every layer) and the model layers one block id holds
    #: (``num_blocks`` and ``peak_blocks`` count block ids).
    kv_groups: int = 1
    layers_per_block: int = 0
    #: On CUDA: the Triton / Gluon kernels compiled after the warm-up, by name (empty: none,
    #: as the warm-up promises; each one stalled the step that first needed it). None on a
    #: CPU, or where Triton has no compile hook to tell.
    compiles_after_warmup: list[str] | None = None

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.requests)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.requests)

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
#: Called with each step's batch, its launch and its sampled tokens, before they are applied.
ResultHook = Callable[[StepBatch, LaunchedStep, list[int]], None]


class StepPipeline:
    """Queues steps on the runner and applies their results to the scheduler, one step late
    when ``overlap`` (so the host schedules and plans the next step while the device runs
    this one), at once otherwise. Sets ``scheduler.drain``, so a preemption first applies
    the step in flight, ``scheduler.vocab_size`` and ``max_positions`` from the model when
    they are unset, and ``scheduler.max_request_tokens`` to the runner's longest sequence,
    so a request submitted from now on is checked against them. Refuses (InvalidArgumentError,
    nothing set) a scheduler whose steps or requests do not fit the runner's capacity."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        overlap: bool = True,
        keep_logits: bool = False,
        on_result: ResultHook | None = None,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.overlap = overlap
        self.keep_logits = keep_logits
        self.on_result = on_result
        self._in_flight: tuple[StepBatch, LaunchedStep] | None = None
        #: Tokens sampled and applied so far.
        self.generated = 0
        #: Host seconds the last :meth:`submit` spent planning and queueing its step.
        self.launch_seconds = 0.0
        longest = self._check_fits(runner, scheduler)  # before anything is set
        scheduler.drain = self.drain
        if scheduler.vocab_size is None:
            scheduler.vocab_size = runner.model.shape.vocab_size
        if scheduler.max_positions is None:
            scheduler.max_positions = runner.model.shape.max_positions
        if scheduler.max_request_tokens is None or scheduler.max_request_tokens > longest:
            scheduler.max_request_tokens = longest

    @staticmethod
    def _check_fits(runner: ModelRunner, scheduler: Scheduler) -> int:
        """Raise InvalidArgumentError unless every step ``scheduler`` can make fits the
        runner's step buffers (rows, tokens, and each request's block-table columns): a step
        that does not would fail after its rows were recorded. Changes nothing; returns the
        most tokens a sequence may reach in the runner."""
        cap = runner.builder.capacity
        if scheduler.max_running > cap.max_rows or scheduler.token_budget > cap.max_tokens:
            raise InvalidArgumentError(
                f"scheduler: max_running {scheduler.max_running} and token_budget {scheduler.token_budget} "
                f"exceed the runner's capacity of {cap.max_rows} rows and {cap.max_tokens} tokens a step; "
                f"lower them or build the runner with a larger StepCapacity"
            )
        longest = cap.max_blocks_per_seq * runner.manager.block_size
        for queue in (scheduler.pending, scheduler.waiting, scheduler.running):
            for req in queue:
                check_fits_runner(req, longest)
        return longest

    @property
    def busy(self) -> bool:
        """Whether a step's results are still to be applied."""
        return self._in_flight is not None

    def submit(self, batch: StepBatch) -> LaunchedStep:
        """Queue ``batch``; apply the step before it (overlap) or this one (no overlap). A
        step carrying draft tokens is verified and applied at once; it must be scheduled with
        no step in flight (:meth:`drain` first: its drafts follow tokens the host must know)."""
        started = time.perf_counter()
        if batch.has_drafts:
            if self._in_flight is not None:
                raise ValueError("batch: a step with draft tokens was scheduled with a step in flight; drain first")
            draft_rows = [i for i, d in enumerate(batch.drafts) if d]
            launched = self.runner.verify(batch.rows, batch.token_ids, draft_rows)
            self.launch_seconds = time.perf_counter() - started
            self._in_flight = (batch, launched)
            self.drain()
            return launched
        launched = self.runner.launch(batch.rows, batch.token_ids, batch.feed, keep_logits=self.keep_logits)
        self.launch_seconds = time.perf_counter() - started
        if self.overlap:
            self.drain()
        self._in_flight = (batch, launched)
        if not self.overlap:
            self.drain()
        return launched

    def drain(self) -> None:
        """Apply the step in flight, if any (waits for the device)."""
        if self._in_flight is None:
            return
        batch, launched = self._in_flight
        self._in_flight = None
        tokens = launched.tokens()
        if self.on_result is not None:
            self.on_result(batch, launched, tokens)
        rows = launched.plan.metadata.sampling_rows_host
        before = sum(len(r.output) for r in batch.requests)
        self.scheduler.finish_step(batch, dict(zip(rows, tokens, strict=True)), launched.verified)
        self.generated += sum(len(r.output) for r in batch.requests) - before


def run_requests(
    model: Llama,
    requests: Sequence[Request],
    *,
    manager: AnyBlockManager,
    cache: KVCacheTensors,
    backend: AttentionBackend,
    preemption: Preemption,
    token_budget: int = 64,
    max_running: int = 16,
    use_graphs: bool = False,
    overlap: bool = True,
    record_logits: bool = False,
    record_margins: bool = False,
    on_step: ProgressHook | None = None,
    on_warmup: Callable[[WarmupReport], None] | None = None,
    collective: Collective | None = None,
    draft_tokens: int = 0,
    draft_max_rows: int | None = None,
) -> RunReport:
    """Generate ``max_new_tokens`` greedy tokens for every request (outputs land in
    ``request.output``). The model, cache and metadata all live on ``cache.device``.
    ``use_graphs``: replay steps from CUDA graphs (captured, with every kernel
    compiled, before the first request runs). ``overlap``: schedule each step while the
    device runs the one before (:class:`StepPipeline`); the tokens are the same either way.

    ``collective``: the tensor-parallel group this rank belongs to (the model already
    connected to it). Every rank calls this with the same requests; before each step's
    forward pass the ranks compare a digest of what their managers decided, and at the end
    the outputs, raising RankDivergenceError on every rank at the first difference.

    ``draft_tokens``: prompt-lookup drafts per decode row (:mod:`.drafting`), verified
    exactly, so the tokens equal plain greedy decoding's (not with recorded logits or
    margins). A step drafts only while at most ``draft_max_rows`` requests run (None: any
    number): a drafting step is scheduled after the step before it is applied, since its
    drafts follow the tokens that step samples, so the host's work no longer hides behind the
    device's (with ``overlap``); past that many rows the loop overlaps instead, which pays
    more there (speculative decoding pays most at small batches).

    Every request is checked before anything runs (:meth:`Scheduler.submit`'s checks: its
    fields, token ids within the model's vocabulary, ids of their own, a pool each fits);
    a bad one raises a typed error naming it and nothing is changed. When the run fails
    later, the blocks its requests hold are given back before the error propagates, so the
    manager serves later requests, with the same ids too."""
    if draft_tokens and (record_logits or record_margins):
        raise ValueError("draft_tokens: drafting records no logits or margins; pass draft_tokens=0 to record them")
    if draft_max_rows is not None and draft_max_rows < 1:
        raise ValueError(f"draft_max_rows: {draft_max_rows} must be at least 1 (None: draft at any batch size)")
    if overlap and any(r.forced is not None for r in requests):
        raise ValueError("overlap: teacher-forced requests (Request.forced) need overlap=False")
    agreement = RankAgreement(collective) if collective is not None and collective.size > 1 else None
    if agreement is not None:  # first: ranks given different requests must not fail apart
        agreement.check(
            "start-up values (block count, block size, requests)",
            manager.num_blocks,
            manager.block_size,
            [(r.req_id, r.prompt, r.max_new_tokens, r.arrival_step) for r in requests],
        )
    scheduler = Scheduler(  # checks every request; changes nothing when one is refused
        manager,
        requests,
        preemption,
        token_budget=token_budget,
        max_running=max_running,
        draft_tokens=draft_tokens,
        copy_blocks=cache.copy_blocks,
        vocab_size=model.shape.vocab_size,
        max_positions=model.shape.max_positions,
    )
    try:
        longest = max((r.peak_tokens for r in requests), default=1)
        capacity = StepCapacity(
            max_rows=max_running,
            max_tokens=max(token_budget, max_running),
            max_blocks_per_seq=cdiv(longest, manager.block_size),
        )
        runner = ModelRunner(model, cache, manager, backend, capacity, use_graphs=use_graphs, draft_tokens=draft_tokens)
        report = runner.warmup()
        if on_warmup is not None:
            on_warmup(report)
        logits_of: dict[int, list[torch.Tensor]] = {r.req_id: [] for r in requests}
        margins_of: dict[int, list[float]] = {r.req_id: [] for r in requests}

        def record(batch: StepBatch, launched: LaunchedStep, tokens: list[int]) -> None:
            if launched.logits is None:
                return
            logits = launched.logits.cpu()
            rows = launched.plan.metadata.sampling_rows_host
            top2 = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else None
            for j, i in enumerate(rows):
                req_id = batch.requests[i].req_id
                if record_logits:
                    logits_of[req_id].append(logits[j])
                if record_margins:
                    margins_of[req_id].append(float(top2[j, 0] - top2[j, 1]) if top2 is not None else float("inf"))

        keep = record_logits or record_margins
        on_result = record if keep else None
        pipeline = StepPipeline(runner, scheduler, overlap=overlap, keep_logits=keep, on_result=on_result)
        computed = forward_steps = fed_rows = 0
        step = 0  # the clock request arrivals are given in
        start = time.perf_counter()
        with CompileWatch() as watch:  # after the warm-up: nothing should compile
            while not scheduler.done:
                if draft_tokens:
                    scheduler.drafting = draft_max_rows is None or len(scheduler.running) <= draft_max_rows
                    if scheduler.drafting and pipeline.busy:
                        pipeline.drain()  # drafts follow the tokens of the step in flight
                        continue  # which may have finished requests: look again
                batch = scheduler.schedule(step)
                if agreement is not None:  # before the forward: a diverged rank must not enter its collectives
                    agreement.step(step, manager, batch.rows if batch else (), batch.token_ids if batch else ())
                if batch is None:
                    if pipeline.busy:  # everything running waits on the step in flight
                        pipeline.drain()
                        continue
                    if scheduler.done:  # scheduling applied the step in flight, which finished the rest
                        continue
                    arrival = scheduler.next_arrival()  # nothing has arrived yet: jump to the next arrival
                    if arrival is None or arrival <= step:
                        raise RuntimeError("the scheduler is idle but no request is due to arrive")
                    step = arrival
                    continue
                pipeline.submit(batch)
                fed_rows += sum(1 for j in batch.feed if j >= 0)
                computed += len(batch.token_ids)
                forward_steps += 1
                if on_step is not None:
                    on_step(step, scheduler, time.perf_counter() - start, pipeline.generated)
                step += 1
            pipeline.drain()
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
            host_tier=_host_tier_stats(manager),
            draft_tokens=draft_tokens,
            draft_max_rows=draft_max_rows,
            logits=logits_of if record_logits else {},
            warmup=report,
            margins=margins_of if record_margins else {},
            tp_size=1 if collective is None else collective.size,
            agreement_checks=0 if agreement is None else agreement.checks,
            overlap=overlap,
            fed_rows=fed_rows,
            graph_replays=_graph_replays(runner),
            kv_groups=1 if cache.layout is None else len(cache.layout.groups),
            layers_per_block=cache.num_tensors,
            compiles_after_warmup=watch.names() if watch.available and cache.device.type == "cuda" else None,
        )
    except BaseException:
        _abandon(scheduler, cache)
        raise


def _abandon(scheduler: Scheduler, cache: KVCacheTensors) -> None:
    """After a failed run: wait for the device (a launched step may still write the blocks),
    then give back every block the run's requests hold (:meth:`Scheduler.abort`). A failure
    here is not raised: the run's own error is the one the caller needs."""
    if cache.device.type == "cuda":
        with contextlib.suppress(Exception):  # a device that failed (a device-side assert) fails every call after
            torch.cuda.synchronize(cache.device)
    with contextlib.suppress(Exception):  # the run's own error matters more than a second one from cleaning up
        scheduler.abort()


def _groups_note(report: RunReport) -> str:
    """' (block ids of 1 layer each, 6 KV groups)' for a run with KV groups; else nothing."""
    if report.kv_groups <= 1:
        return ""
    return f" (block ids of {report.layers_per_block} layer(s) each, {report.kv_groups} KV groups)"


def _graph_line(report: RunReport) -> str:
    """'3 decode and 2 mixed steps replayed of 9' (with drafts: '3 decode, 2 mixed and 4 verify ...')."""
    r = report.graph_replays
    if not r:
        return "off"
    kinds = [f"{r.get('decode', 0)} decode", f"{r.get('mixed', 0)} mixed"]
    if "verify" in r:
        kinds.append(f"{r['verify']} verify")
    return f"{', '.join(kinds[:-1])} and {kinds[-1]} steps replayed of {report.steps}"


def _graph_replays(runner: ModelRunner) -> dict[str, int]:
    replays: dict[str, int] = {}
    for graphs in (runner.graphs, runner.verify_graphs):
        if graphs is not None:
            replays.update(graphs.replays)
    return replays


def _host_tier_stats(manager: AnyBlockManager) -> HostTierStats | None:
    tier = manager.lower_tier
    if not isinstance(tier, HostPrefixTier):
        return None
    tier.synchronize()
    return tier.stats()


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
        f"peak blocks in use: {report.peak_blocks} / {report.num_blocks}" + _groups_note(report),
        f"overlap: {'on' if report.overlap else 'off'} ({report.fed_rows} rows fed their token on the device)",
        "CUDA graphs: " + _graph_line(report),
        f"preemptions: {report.preemptions} ("
        + ", ".join(f"{mode} {n}" for mode, n in report.preemptions_by_mode.items())
        + f"; blocks swapped out/in {report.swapped_blocks[0]}/{report.swapped_blocks[1]})",
    ]
    if report.compiles_after_warmup is not None:
        late = describe_compiles(report.compiles_after_warmup, after_warmup=True)
        lines.append(f"kernels compiled after warm-up: {late}")
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
    if report.draft_tokens:
        rate = report.accepted / max(report.drafted, 1)
        upto = "" if report.draft_max_rows is None else f" while at most {report.draft_max_rows} requests run"
        lines.append(
            f"prompt lookup: up to {report.draft_tokens} drafts per decode row{upto}; {report.accepted} of "
            f"{report.drafted} drafts accepted ({rate:.0%}); {report.generated_tokens / max(report.steps, 1):.2f} "
            f"generated tokens per step (every row)"
        )
    if report.host_tier is not None:
        h = report.host_tier
        lines.append(
            f"host tier: {h.hit_blocks} blocks hit, {h.offloaded_blocks} offloaded, {h.dropped_blocks} dropped; "
            f"{h.blocks_used} / {h.blocks_total} blocks held; {(h.bytes_to_host + h.bytes_to_device) / 2**20:.1f} MiB "
            f"copied in {h.copy_seconds * 1e3:.1f} ms"
        )
        if h.disk is not None:
            d = h.disk
            lines.append(
                f"disk tier: {d.hit_blocks} blocks read back, {d.written_blocks} written, {d.dropped_blocks} deleted "
                f"for room, {d.corrupt_blocks} damaged (recomputed); {d.files} / {d.blocks_total} files held"
            )
    return lines
