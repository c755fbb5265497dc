"""Runs the model one step at a time over the paged cache.

Each step is planned once (metadata, the backend's plan and the input tokens in one
host-to-device copy), padded to its bucket (:mod:`kvcache.step.buckets`): a decode step to
its batch bucket, a step with prefill rows to its token bucket when the backend can capture
those. Then the step replays the CUDA graph captured for its bucket; a step no bucket holds
(or every step, with ``use_graphs=False``) runs the model eagerly over the same plan.

:meth:`ModelRunner.launch` only queues a step: the greedy tokens are sampled on the device
into the builder's ``sampled`` buffer (the next step can feed them to its rows without a
round trip) and copied to pinned host memory behind the step; :meth:`LaunchedStep.tokens`
waits for that copy. So the host can schedule and plan step N+1 while the device runs step N.

On CUDA the warm-up also runs a few eager steps of throw-away sequences (prefill rows of each
tile height, extend rows, mixed decode + prefill steps and decode rows of lengths that reach
each split count), so kernels that compile on first use -- the backend's prefill and mixed
decode variants, which ``backend.warmup`` may not cover -- compile before serving, not during
the first requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention import AttentionBackend, StepCapacity, StepPlan
from kvcache import AnyBlockManager, KVCacheTensors, MetadataBuilder, ScheduledRow
from kvcache.step.buckets import StepBuckets, StepShape, default_token_buckets
from kvcache.step.graphs import StepGraphs, VerifyGraphs

from ..model import Llama

__all__ = ["LaunchedStep", "ModelRunner", "WarmupReport"]


#: Ids of the throw-away sequences of the eager warm-up steps.
WARMUP_SEQ = "__warmup__"


@dataclass(frozen=True)
class WarmupReport:
    """What :meth:`ModelRunner.warmup` did: kernel variants the backend compiled, eager
    warm-up steps run, graphs captured; ``seconds`` in all, ``capture_seconds`` of them
    capturing graphs (kernels a graph step needs that nothing compiled before compile then)."""

    kernel_variants: int
    graphs: int
    seconds: float
    eager_steps: int = 0
    capture_seconds: float = 0.0

    def line(self) -> str:
        """One line for a log: what was compiled, run and captured, and how long it took."""
        graphs = (
            f"{self.graphs} CUDA graphs captured ({self.capture_seconds:.1f} s)" if self.graphs else "no CUDA graphs"
        )
        return (
            f"warm-up: {self.kernel_variants} kernel variants compiled, {self.eager_steps} eager warm-up steps, "
            f"{graphs}, {self.seconds:.1f} s in all"
        )


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device.

    plan:    the step's plan (``plan.metadata.sampling_rows_host[j]`` is the row of sample j).
    verified: for a step whose rows carry draft tokens (:meth:`ModelRunner.verify`), the
             greedy token after each position of each such row.
    samples: int64 [k] host tensor (pinned on CUDA) that the step's greedy tokens are copied
             into, valid once :meth:`tokens` returns.
    logits:  float32 [k, vocab] device copy of the sampled rows' logits (when asked for).
    """

    plan: StepPlan
    samples: torch.Tensor
    done: torch.cuda.Event | None
    logits: torch.Tensor | None = None
    #: A step with draft rows: per such row, the greedy token after each of its positions.
    verified: dict[int, list[int]] | None = None

    def tokens(self) -> list[int]:
        """The step's sampled token ids, in sampling-row order (waits for the device)."""
        if self.done is not None:
            self.done.synchronize()
        return list(self.samples.tolist())


class ModelRunner:
    """The model, its cache and backend, and the step's persistent buffers.

    use_graphs: capture steps in CUDA graphs (CUDA and a backend that allows it only): decode
    steps, and mixed steps when the backend has ``mixed_cuda_graphs``. Without graphs, steps
    are still padded to the same buckets when the backend can be captured, so ``use_graphs``
    changes how a step is launched, never what it computes (greedy tokens are identical with
    and without graphs).
    draft_tokens: the most draft tokens a row carries (speculative decoding, :meth:`verify`).
    With graphs and a backend with ``mixed_cuda_graphs``, verification steps of up to
    ``max_rows * (draft_tokens + 1)`` tokens are captured too (:class:`VerifyGraphs`: the greedy
    token after every position, computed in the graph).
    """

    def __init__(
        self,
        model: Llama,
        cache: KVCacheTensors,
        manager: AnyBlockManager,
        backend: AttentionBackend,
        capacity: StepCapacity,
        *,
        use_graphs: bool = False,
        draft_tokens: int = 0,
    ):
        self.model = model
        self.cache = cache
        self.manager = manager
        self.backend = backend
        self.builder = MetadataBuilder(
            cache.device,
            capacity=capacity,
            backend=backend,
            num_cache_blocks=cache.num_blocks,
            kv_groups=1 if cache.layout is None else len(cache.layout.groups),
        )
        self.graphs = StepGraphs(self.builder, self._forward) if use_graphs else None
        #: Verification steps' graphs (None: verification runs eagerly).
        self.verify_graphs: VerifyGraphs | None = None
        verify_buckets = _verify_buckets(capacity, draft_tokens) if backend.info.mixed_cuda_graphs else []
        #: Query token indices 0 .. max_tokens - 1 (the rows a verification graph's logits cover).
        self._token_rows: torch.Tensor | None = None
        if self.graphs is not None and verify_buckets:
            self.verify_graphs = VerifyGraphs(self.builder, self._greedy_forward, verify_buckets)
            self._token_rows = torch.arange(capacity.max_tokens, dtype=torch.int64, device=cache.device)
        #: The buckets steps are padded to (None: the backend is never captured; no padding):
        #: the graphs' own, so an eager step computes what its graph would.
        self.shapes: StepBuckets | None = None
        if self.graphs is not None:
            self.shapes = self.graphs.shapes
        elif backend.info.cuda_graphs:
            tokens = default_token_buckets(capacity.max_tokens) if backend.info.mixed_cuda_graphs else []
            self.shapes = StepBuckets(capacity.max_rows, capacity.max_tokens, tokens=tokens)
        # The rotary tables for the longest sequence, built before any graph reads them.
        for local in (False, True):
            model.rotary_table(capacity.max_blocks_per_seq * manager.block_size, cache.device, local=local)
        pin = cache.device.type == "cuda"
        #: Two host buffers for sampled ids: step N+1 is launched before step N's are read.
        self._samples = [torch.empty(capacity.max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._parity = 0

    def warmup(self, *, eager: bool | None = None) -> WarmupReport:
        """Compile every kernel variant the capacity can reach and capture the step graphs,
        so nothing compiles while serving. ``eager``: run the eager warm-up steps (default:
        on CUDA only, where kernels compile). The manager must have no sequences with the
        warm-up's ids (it leaves none behind)."""
        start = time.perf_counter()
        variants = self.backend.warmup(self.manager.block_size, self.builder.capacity, self.cache.device)
        if eager is None:
            eager = self.cache.device.type == "cuda"
        eager_steps = self._warm_eager() if eager else 0
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        capture_start = time.perf_counter()
        graphs = self.graphs.capture(self.manager) if self.graphs is not None else 0
        if self.graphs is not None and self.verify_graphs is not None:
            graphs += self.verify_graphs.capture(self.manager, pool=self.graphs.pool)
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)
        end = time.perf_counter()
        return WarmupReport(variants, graphs, end - start, eager_steps, capture_seconds=end - capture_start)

    def warmup_steps(self) -> list[list[tuple[int, int]]]:
        """The eager warm-up steps: per step, (seq_len, num_new) of each row, within the
        capacity. Prefill rows whose longest is 9, 17, 33 and ``max_tokens`` tokens (each tile
        height of a prefill kernel), an extend row, then for decode lengths of 1, 2, 4, ...
        blocks up to the longest sequence (each split count of a split-KV decode): a decode
        row alone and a decode row beside a prefill row (a mixed step). With latent attention,
        rows of ``backend.latent_prefill_min_tokens`` new tokens too (those attend
        decompressed): fresh, extending, two in a step, and beside a decode row."""
        cap = self.builder.capacity
        bs = self.manager.block_size
        longest = cap.max_blocks_per_seq * bs
        top = min(cap.max_tokens, longest)
        steps = [[(q, q)] for q in sorted({min(q, top) for q in (9, 17, 33, top)}) if q > 1]
        if longest > 33:
            steps.append([(longest, min(33, top))])  # extend: new tokens after cached ones
        lengths, n = [], bs
        while n < longest:
            lengths.append(n)
            n *= 2
        lengths.append(longest)
        mixed_q = min(17, cap.max_tokens - 1)
        for length in lengths:
            steps.append([(length, 1)])
            if cap.max_rows >= 2 and mixed_q > 1:
                steps.append([(length, 1), (mixed_q, mixed_q)])
        wide = getattr(self.backend, "latent_prefill_min_tokens", None)
        if wide is not None and wide <= min(top, cap.max_tokens - 1):
            steps.append([(wide, wide)])
            if longest > wide:
                steps.append([(longest, wide)])
            if cap.max_rows >= 2 and 2 * wide <= cap.max_tokens:
                steps.append([(wide, wide), (wide, wide)])
            if cap.max_rows >= 2:
                steps.append([(bs, 1), (wide, wide)])
        return steps

    def _warm_eager(self) -> int:
        """Run :meth:`warmup_steps` over throw-away sequences (their K/V lands in blocks that
        are free again afterwards). Steps that do not fit in the free blocks are skipped."""
        done = 0
        for rows in self.warmup_steps():
            ids = [(WARMUP_SEQ, i) for i in range(len(rows))]
            blocks = sum(self.manager.blocks_for(seq_len) for seq_len, _ in rows)
            if blocks > self.manager.num_free_blocks:
                continue
            for seq_id, (seq_len, num_new) in zip(ids, rows, strict=True):
                self.manager.allocate(seq_id, seq_len)
                if seq_len > num_new:  # stands for a context computed earlier (its K/V is garbage)
                    self.manager.mark_computed(seq_id, seq_len - num_new)
            try:
                scheduled = [
                    ScheduledRow(seq_id, num_new, start=seq_len - num_new)
                    for seq_id, (seq_len, num_new) in zip(ids, rows, strict=True)
                ]
                plan = self._plan(scheduled, [0] * sum(n for _, n in rows), None, self._shape(scheduled))
                self._forward(self.builder.input_ids(plan.metadata.num_tokens), plan)
                done += 1
            finally:
                for seq_id in ids:
                    self.manager.free(seq_id, reason="aborted")
        return done

    def step(
        self, rows: Sequence[ScheduledRow], token_ids: Sequence[int], feed: Sequence[int] | None = None
    ) -> tuple[StepPlan, torch.Tensor]:
        """Run one step (``feed`` as in ``MetadataBuilder.plan``). Returns the plan and float
        logits [len(plan.metadata.sampling_rows_host), vocab]: row ``sampling_rows_host[j]``'s
        next-token logits are row j (a view of the graph's output on a graph step: valid
        until the next step)."""
        shape = self._shape(rows)
        graphs = self.graphs
        if graphs is not None and shape is not None and graphs.has(shape):
            return graphs.run(self.manager, rows, token_ids, feed, shape=shape)
        plan = self._plan(rows, token_ids, feed, shape)
        logits = self._forward(self.builder.input_ids(plan.metadata.num_tokens), plan)
        return plan, logits[: len(plan.metadata.sampling_rows_host)]

    def _shape(self, rows: Sequence[ScheduledRow]) -> StepShape | None:
        """The bucket ``rows`` are padded to (None: none holds them, or no padding)."""
        return None if self.shapes is None else self.shapes.shape_for([row.num_new for row in rows])

    def _plan(
        self,
        rows: Sequence[ScheduledRow],
        token_ids: Sequence[int],
        feed: Sequence[int] | None,
        shape: StepShape | None,
    ) -> StepPlan:
        if shape is None:
            return self.builder.plan(self.manager, rows, token_ids=token_ids, feed=feed)
        pad_tokens = shape.tokens if shape.mixed else None
        return self.builder.plan(
            self.manager, rows, pad_to=shape.rows, pad_tokens=pad_tokens, token_ids=token_ids, feed=feed
        )

    def launch(
        self,
        rows: Sequence[ScheduledRow],
        token_ids: Sequence[int],
        feed: Sequence[int] | None = None,
        *,
        keep_logits: bool = False,
    ) -> LaunchedStep:
        """Queue one step and its greedy sampling; return without waiting for the device.

        The sampled ids land in ``builder.sampled`` (for the next step's ``feed``) and, behind
        the step, in a pinned host buffer (:meth:`LaunchedStep.tokens`). Two host buffers
        alternate, so a step's tokens must be read before the step after next is launched.
        ``keep_logits``: keep a float32 copy of the sampled rows' logits.
        """
        plan, logits = self.step(rows, token_ids, feed)
        k = len(plan.metadata.sampling_rows_host)
        sampled = self.builder.sampled[:k]
        torch.argmax(logits[:k], dim=-1, out=sampled)
        host = self._samples[self._parity][:k]
        self._parity ^= 1
        host.copy_(sampled, non_blocking=True)
        done = None
        if self.cache.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        kept = logits[:k].float().clone() if keep_logits else None
        return LaunchedStep(plan, host, done, kept)

    def verify(self, rows: Sequence[ScheduledRow], token_ids: Sequence[int], draft_rows: Sequence[int]) -> LaunchedStep:
        """Run a step whose rows ``draft_rows`` carry draft tokens (no feed) and wait for it:
        the greedy token after every position of those rows (the verification), and after
        the last token of every other sampling row. Every draft row must be a sampling row
        (it reaches the end of its sequence). The step replays a verification graph when one
        holds it (the greedy token of every position is computed in the graph and the host
        picks), else it runs eagerly and computes the picked positions' logits only."""
        shape = self.verify_graphs.shape_for(rows) if self.verify_graphs is not None else None
        greedy_all: torch.Tensor | None = None
        if self.verify_graphs is not None and shape is not None:
            plan, greedy_all = self.verify_graphs.run(self.manager, rows, token_ids, None, shape=shape)
        else:
            plan = self._plan(rows, token_ids, None, None)
        meta = plan.metadata
        starts = [0]
        for row in rows:
            starts.append(starts[-1] + row.num_new)
        picks: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        drafted = set(draft_rows)
        for i in meta.sampling_rows_host:
            if i in drafted:
                spans[i] = (len(picks), rows[i].num_new)
                picks += range(starts[i], starts[i + 1])
            else:
                spans[i] = (len(picks), 1)
                picks.append(starts[i + 1] - 1)
        if not drafted <= set(spans):
            raise ValueError(f"draft_rows: {sorted(drafted - set(spans))} are not sampling rows of the step")
        if greedy_all is not None:
            every = greedy_all[: starts[-1]].tolist()
            greedy = [every[p] for p in picks]
        else:
            index = torch.tensor(picks, dtype=torch.int64, device=meta.positions.device)
            logits = self._forward(self.builder.input_ids(meta.num_tokens), plan, index)
            greedy = torch.argmax(logits, dim=-1).tolist()
        verified = {i: greedy[first : first + n] for i, (first, n) in spans.items() if i in drafted}
        last = torch.tensor([greedy[first + n - 1] for first, n in spans.values()], dtype=torch.int64)
        k = len(meta.sampling_rows_host)
        self.builder.sampled[:k].copy_(last)
        return LaunchedStep(plan, last, None, None, verified)

    def _forward(
        self, token_ids: torch.Tensor, plan: StepPlan, logits_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        with torch.no_grad():
            return self.model(token_ids, self.cache, self.backend, plan, logits_rows)

    def _greedy_forward(self, token_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """int64 [T]: the greedy token after each of the step's T query tokens (padding too)."""
        if self._token_rows is None:
            raise RuntimeError("_greedy_forward: only verification graphs call it")
        logits = self._forward(token_ids, plan, self._token_rows[: token_ids.shape[0]])
        return torch.argmax(logits, dim=-1)


def _verify_buckets(capacity: StepCapacity, draft_tokens: int) -> list[int]:
    """The mixed token buckets a verification step of up to ``draft_tokens`` drafts per row
    can need: every default token bucket up to the first that holds ``max_rows`` rows of
    ``draft_tokens + 1`` tokens (longer steps, with prompt chunks, run eagerly). None without
    drafts."""
    if draft_tokens <= 0:
        return []
    need = min(capacity.max_tokens, capacity.max_rows * (draft_tokens + 1))
    buckets = default_token_buckets(capacity.max_tokens)
    last = next((i for i, t in enumerate(buckets) if t >= need), len(buckets) - 1)
    return buckets[: last + 1]
