"""CUDA graphs of an engine's steps, one per bucket (:mod:`kvcache.step.buckets`).

A decode step (every row brings one token) is captured once per bucket of ``B`` rows (1, 2,
4, 8, ... up to the builder's ``max_rows``); with a backend that has ``mixed_cuda_graphs``, a
mixed step (prefill rows beside decode rows) is captured once per token bucket of ``T``
tokens (``min(max_rows, T - 1)`` rows). Capture and replay both run over the builder's
persistent buffers: a step is planned padded to its bucket (``MetadataBuilder.plan(...,
pad_to=rows, pad_tokens=tokens)``), which writes this step's metadata, plan arrays and token
ids into the same device addresses the graph recorded, in the step's one copy; then the graph
replays. Padding rows have ``seq_len`` 0 and padding tokens slot -1: they read and write no
K/V. The backend plans graph steps from the bucket alone (never from this step's lengths), so
every replay launches exactly what was captured. A backend may capture a bucket in several
variants (``AttentionBackend.graph_variants``: for example with and without a kernel that only
some steps need); a step replays the one its plan names (``StepPlan.graph_variant``). The graph
starts with ``MetadataBuilder.input_ids``, so tokens fed from the previous step's samples are
gathered inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention.base import StepPlan
from attention.errors import InvalidArgumentError, UnsupportedSettingError
from kvcache.blocks.hybrid import AnyBlockManager
from kvcache.blocks.rows import ScheduledRow
from kvcache.step.buckets import StepBuckets, StepShape, default_buckets, default_token_buckets
from kvcache.step.builder import MetadataBuilder

__all__ = ["DecodeGraphs", "StepGraphs", "VerifyGraphs", "default_buckets"]

#: ``forward(token_ids, plan) -> output``: token_ids int64 [T] (``builder.input_ids(T)``),
#: output [plan's logits rows, ...]; it must only launch device work (no host sync, no new
#: tensor shapes).
Forward = Callable[[torch.Tensor, StepPlan], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class StepGraphs:
    """Captured steps over ``builder``'s buffers (its backend must allow graphs).

    buckets:       decode buckets (rows); default 1, 2, 4, ... up to ``max_rows``.
    token_buckets: mixed-step token buckets; default :func:`default_token_buckets` of the
                   builder's ``max_tokens`` when the backend has ``mixed_cuda_graphs``, else
                   none. Pass ``()`` to capture decode steps only.
    """

    def __init__(
        self,
        builder: MetadataBuilder,
        forward: Forward,
        buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
    ):
        if builder.backend is None or not builder.fixed:
            raise InvalidArgumentError("builder: CUDA graphs need a MetadataBuilder with a capacity and a backend")
        info = builder.backend.info
        if not info.cuda_graphs:
            raise UnsupportedSettingError(f"backend {builder.backend.name} cannot be captured in a CUDA graph")
        if builder.device.type != "cuda":
            raise UnsupportedSettingError(f"CUDA graphs need a CUDA device; the builder is on {builder.device}")
        cap = builder.capacity
        if token_buckets is None:
            token_buckets = default_token_buckets(cap.max_tokens) if info.mixed_cuda_graphs else ()
        elif token_buckets and not info.mixed_cuda_graphs:
            raise UnsupportedSettingError(
                f"token_buckets: backend {builder.backend.name} captures decode steps only; pass token_buckets=()"
            )
        self.shapes = StepBuckets(cap.max_rows, cap.max_tokens, decode=buckets, tokens=token_buckets)
        self.buckets = list(self.shapes.decode)
        self.builder = builder
        self.forward = forward
        #: Captured graphs by (bucket, the backend's variant of it).
        self._graphs: dict[tuple[StepShape, str | None], _Captured] = {}
        self._variants = builder.backend.graph_variants()
        self._pool: Any = None  # the graphs' shared memory pool (an opaque handle)
        self._last: tuple[StepShape, str | None] | None = None  # the graph of the last step run
        #: Steps replayed so far, by kind ("decode", "mixed"; "verify" for :class:`VerifyGraphs`).
        self.replays = dict.fromkeys(self.kinds, 0)

    #: The kinds of step these graphs replay (keys of :attr:`replays`).
    kinds: tuple[str, ...] = ("decode", "mixed")
    #: Whether :meth:`run` returns the output of every token of the bucket (else the rows of
    #: the step's sampling rows).
    every_token = False

    @property
    def max_rows(self) -> int:
        """The builder's row capacity."""
        return self.shapes.max_rows

    @property
    def pool(self) -> Any:
        """The captured graphs' memory pool (an opaque handle; None before the first capture)."""
        return self._pool

    def bucket_for(self, rows: int) -> int | None:
        """The smallest decode bucket holding ``rows`` rows (None: more rows than the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def shape_for(self, rows: Sequence[ScheduledRow]) -> StepShape | None:
        """The captured bucket a step of ``rows`` replays (None: it runs eagerly)."""
        shape = self.shapes.shape_for([row.num_new for row in rows])
        return shape if shape is not None and self.has(shape) else None

    def has(self, shape: StepShape) -> bool:
        """Whether ``shape`` has been captured (in every variant)."""
        return all((shape, variant) in self._graphs for variant in self._variants)

    def capture(self, manager: AnyBlockManager, *, pool: Any = None) -> int:
        """Capture every bucket, largest first (they share one memory pool: ``pool``, another
        set's :attr:`pool`, to share that set's too; its outputs are then valid only until any
        graph of either set replays). Each is run twice eagerly first, so every kernel is
        compiled before capture; a backend with several graph variants has each bucket
        captured once per variant. Returns how many graphs were captured.

        Python's cyclic garbage collector is off during each capture (after one collection
        first): a dead cycle collected mid-capture (an engine's earlier runner, with its pinned
        buffers and CUDA events) would free CUDA resources, a call that invalidates the
        capture."""
        gc.collect()
        if self._pool is None and pool is not None:
            self._pool = pool
        for shape in self.shapes.shapes():
            pad_tokens = shape.tokens if shape.mixed else None
            padded = self.builder.plan(manager, [], pad_to=shape.rows, pad_tokens=pad_tokens, token_ids=[])
            for variant in self._variants:
                plan = padded.as_graph_variant(variant)
                for _ in range(2):
                    self.forward(self.builder.input_ids(shape.tokens), plan)
                torch.cuda.synchronize(self.builder.device)
                graph = torch.cuda.CUDAGraph()
                collecting = gc.isenabled()
                gc.disable()
                try:
                    with torch.cuda.graph(graph, pool=self._pool):
                        output = self.forward(self.builder.input_ids(shape.tokens), plan)
                finally:
                    if collecting:
                        gc.enable()
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[(shape, variant)] = _Captured(graph, output)
        torch.cuda.synchronize(self.builder.device)
        return len(self._graphs)

    def run(
        self,
        manager: AnyBlockManager,
        rows: Sequence[ScheduledRow],
        token_ids: Sequence[int],
        feed: Sequence[int] | None = None,
        *,
        shape: StepShape | None = None,
    ) -> tuple[StepPlan, torch.Tensor]:
        """Plan a step padded to its bucket and replay that bucket's graph (``feed`` as in
        ``MetadataBuilder.plan``; ``shape``: the bucket, when the caller already has it from
        ``shapes.shape_for``; a bucket too small for the step is refused by the builder or
        the backend). Returns the plan and the output rows of the step's sampling
        rows (a view into the graph's output, valid until the next replay). Raises
        InvalidArgumentError when no captured bucket holds the step (see :meth:`shape_for`).
        :class:`VerifyGraphs` returns the output of every token instead."""
        if shape is None:
            shape = self.shape_for(rows)
        if shape is None or not self.has(shape):
            have = sorted({(s.rows, s.tokens) for s, _ in self._graphs})
            raise InvalidArgumentError(
                f"rows: no captured bucket holds a step of {len(rows)} rows and "
                f"{sum(r.num_new for r in rows)} tokens; captured (rows, tokens): {have} (capture first, "
                "or run the step eagerly)"
            )
        pad_tokens = shape.tokens if shape.mixed else None
        plan = self.builder.plan(
            manager, rows, pad_to=shape.rows, pad_tokens=pad_tokens, token_ids=token_ids, feed=feed
        )
        key = (shape, plan.graph_variant)
        captured = self._graphs.get(key)
        if captured is None:  # a backend's plan names a variant its graph_variants() lacks
            raise InvalidArgumentError(
                f"plan: graph variant {key[1]!r}, captured {list(self._variants)!r} (backend {plan.backend})"
            )
        captured.graph.replay()
        self._last = key
        self.replays[self._kind(shape)] += 1
        if self.every_token:
            return plan, captured.output
        return plan, captured.output[: len(plan.metadata.sampling_rows_host)]

    def _kind(self, shape: StepShape) -> str:
        return "mixed" if shape.mixed else "decode"

    def replay_last(self) -> None:
        """Replay the last step's graph again over the buffers as they are: it recomputes that
        step and writes the same K/V to the same slots (for timing the step's GPU work alone,
        with nothing planned in between). Raises InvalidArgumentError before any step ran."""
        if self._last is None:
            raise InvalidArgumentError("replay_last: no step has been run from a graph yet")
        self._graphs[self._last].graph.replay()


class DecodeGraphs(StepGraphs):
    """:class:`StepGraphs` of decode steps only (no token buckets)."""

    def __init__(self, builder: MetadataBuilder, forward: Forward, buckets: Sequence[int] | None = None):
        super().__init__(builder, forward, buckets, token_buckets=())


class VerifyGraphs(StepGraphs):
    """Captured verification steps (rows carrying draft tokens, speculative decoding): mixed
    buckets only (``token_buckets``; a step of one token per row has none), and ``forward``
    returns a result for *every* token of the bucket (for example the greedy token after
    each position: int64 [T]), which :meth:`run` returns whole: row ``t`` is query token ``t``,
    rows past ``plan.metadata.num_real_tokens`` are padding."""

    kinds = ("verify",)
    every_token = True

    def __init__(self, builder: MetadataBuilder, forward: Forward, token_buckets: Sequence[int]):
        if not token_buckets:
            raise InvalidArgumentError("token_buckets: verification graphs need at least one token bucket")
        super().__init__(builder, forward, buckets=(), token_buckets=token_buckets)

    def _kind(self, shape: StepShape) -> str:
        return "verify"
