"""CUDA graphs of an engine's decode step, one per batch-size bucket.

A decode step (every row brings one token) is captured once per bucket of ``B`` rows (1, 2,
4, 8, ... up to the builder's ``max_rows``). Capture and replay both run over the builder's
persistent buffers: a step with ``n <= B`` rows is planned padded to ``B`` rows
(``MetadataBuilder.plan(..., pad_to=B)``), which writes this step's metadata, plan arrays and
token ids into the same device addresses the graph recorded, in the step's one copy; then the
graph replays. Padding rows have ``seq_len`` 0 and slot -1: they read and write no K/V. The
backend plans graph steps from the bucket size alone (never from this step's lengths), so
every replay launches exactly what was captured. The graph starts with
``MetadataBuilder.input_ids``, so tokens fed from the previous step's samples are gathered
inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention.base import StepPlan
from attention.errors import InvalidArgumentError, UnsupportedSettingError
from kvcache.blocks.manager import BlockManager
from kvcache.blocks.rows import ScheduledRow
from kvcache.step.builder import MetadataBuilder

__all__ = ["DecodeGraphs", "default_buckets"]

#: ``forward(token_ids, plan) -> output``: token_ids int64 [B] (``builder.input_ids(B)``),
#: output [B, ...]; it must only launch device work (no host sync, no new tensor shapes).
Forward = Callable[[torch.Tensor, StepPlan], torch.Tensor]


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... below ``max_rows``, then ``max_rows``."""
    buckets, b = [], 1
    while b < max_rows:
        buckets.append(b)
        b *= 2
    return [*buckets, max_rows]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class DecodeGraphs:
    """Captured decode steps over ``builder``'s buffers (its backend must allow graphs)."""

    def __init__(self, builder: MetadataBuilder, forward: Forward, buckets: Sequence[int] | None = None):
        if builder.backend is None or not builder.fixed:
            raise InvalidArgumentError("builder: CUDA graphs need a MetadataBuilder with a capacity and a backend")
        if not builder.backend.info.cuda_graphs:
            raise UnsupportedSettingError(f"backend {builder.backend.name} cannot be captured in a CUDA graph")
        if builder.device.type != "cuda":
            raise UnsupportedSettingError(f"CUDA graphs need a CUDA device; the builder is on {builder.device}")
        max_rows = builder.capacity.max_rows
        self.buckets = sorted(set(buckets or default_buckets(max_rows)))
        if self.buckets[0] < 1 or self.buckets[-1] > max_rows:
            raise InvalidArgumentError(f"buckets: {self.buckets} must lie in [1, max_rows={max_rows}]")
        self.builder = builder
        self.forward = forward
        self._graphs: dict[int, _Captured] = {}
        self._pool: Any = None  # the graphs' shared memory pool (an opaque handle)
        self._last: int | None = None  # the bucket of the last step run

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` rows (None: more rows than the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def capture(self, manager: BlockManager) -> int:
        """Capture every bucket, largest first (they share one memory pool). Each is run
        twice eagerly first, so every kernel is compiled before capture. Returns how many
        graphs were captured.

        Python's cyclic garbage collector is off during each capture (after one collection
        first): a dead cycle collected mid-capture (an engine's earlier runner, with its pinned
        buffers and CUDA events) would free CUDA resources, a call that invalidates the
        capture."""
        gc.collect()
        for bucket in reversed(self.buckets):
            plan = self.builder.plan(manager, [], pad_to=bucket, token_ids=[])
            for _ in range(2):
                self.forward(self.builder.input_ids(bucket), plan)
            torch.cuda.synchronize(self.builder.device)
            graph = torch.cuda.CUDAGraph()
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    output = self.forward(self.builder.input_ids(bucket), plan)
            finally:
                if collecting:
                    gc.enable()
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[bucket] = _Captured(graph, output)
        torch.cuda.synchronize(self.builder.device)
        return len(self._graphs)

    def run(
        self,
        manager: BlockManager,
        rows: Sequence[ScheduledRow],
        token_ids: Sequence[int],
        feed: Sequence[int] | None = None,
    ) -> tuple[StepPlan, torch.Tensor]:
        """Plan a pure decode step padded to its bucket and replay that bucket's graph
        (``feed`` as in ``MetadataBuilder.plan``). Returns the plan and the output rows of the
        real rows (a view into the graph's output, valid until the next replay). Raises
        InvalidArgumentError when the step is not a pure decode step or has more rows than
        the largest bucket."""
        bucket = self.bucket_for(len(rows))
        if bucket is None or bucket not in self._graphs:
            raise InvalidArgumentError(
                f"rows: {len(rows)} rows; captured buckets are {sorted(self._graphs)} (capture first)"
            )
        if any(row.num_new != 1 for row in rows):
            raise InvalidArgumentError("rows: only decode steps (one new token per row) replay a graph")
        plan = self.builder.plan(manager, rows, pad_to=bucket, token_ids=token_ids, feed=feed)
        captured = self._graphs[bucket]
        captured.graph.replay()
        self._last = bucket
        return plan, captured.output[: len(rows)]

    def replay_last(self) -> None:
        """Replay the last step's graph again over the buffers as they are: it recomputes that
        step and writes the same K/V to the same slots (for timing the step's GPU work alone,
        with nothing planned in between). Raises InvalidArgumentError before any step ran."""
        if self._last is None:
            raise InvalidArgumentError("replay_last: no step has been run from a graph yet")
        self._graphs[self._last].graph.replay()
