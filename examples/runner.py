"""Runs the model one step at a time over the paged cache.

Each step is planned once (metadata, the backend's plan and the input tokens in one
host-to-device copy); then a decode step replays the CUDA graph captured for its batch bucket,
and any other step (prefill chunks, mixed batches, or everything with ``use_graphs=False``)
runs the model eagerly over the same plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention import AttentionBackend, StepCapacity, StepPlan
from examples.llama import Llama
from kvcache import BlockManager, KVCacheTensors, MetadataBuilder, ScheduledRow
from kvcache.graphs import DecodeGraphs

__all__ = ["ModelRunner", "WarmupReport"]


@dataclass(frozen=True)
class WarmupReport:
    """What :meth:`ModelRunner.warmup` did: kernel variants compiled, graphs captured, time."""

    kernel_variants: int
    graphs: int
    seconds: float

    def line(self) -> str:
        return (
            f"warm-up: {self.kernel_variants} kernel variants compiled, {self.graphs} CUDA graphs captured "
            f"in {self.seconds:.1f} s"
        )


class ModelRunner:
    """The model, its cache and backend, and the step's persistent buffers.

    use_graphs: capture decode steps in CUDA graphs (CUDA and a backend that allows it only).
    """

    def __init__(
        self,
        model: Llama,
        cache: KVCacheTensors,
        manager: BlockManager,
        backend: AttentionBackend,
        capacity: StepCapacity,
        *,
        use_graphs: bool = False,
    ):
        self.model = model
        self.cache = cache
        self.manager = manager
        self.backend = backend
        self.builder = MetadataBuilder(cache.device, capacity=capacity, backend=backend)
        self.graphs = DecodeGraphs(self.builder, self._forward) if use_graphs else None

    def warmup(self) -> WarmupReport:
        """Compile every kernel variant the capacity can reach and capture the decode graphs,
        so nothing compiles while serving."""
        start = time.perf_counter()
        variants = self.backend.warmup(self.manager.block_size, self.builder.capacity, self.cache.device)
        graphs = self.graphs.capture(self.manager) if self.graphs is not None else 0
        return WarmupReport(variants, graphs, time.perf_counter() - start)

    def step(self, rows: Sequence[ScheduledRow], token_ids: Sequence[int]) -> tuple[StepPlan, torch.Tensor]:
        """Run one step. Returns the plan and float logits [len(plan.metadata.sampling_rows_host),
        vocab]: row ``sampling_rows_host[j]``'s next-token logits are row j."""
        graphs = self.graphs
        if graphs is not None and len(rows) <= graphs.max_rows and all(r.num_new == 1 for r in rows):
            plan, logits = graphs.run(self.manager, rows, token_ids)
            return plan, logits
        plan = self.builder.plan(self.manager, rows, token_ids=token_ids)
        with torch.no_grad():
            logits = self._forward(self.builder.token_ids(plan.metadata.num_tokens), plan)
        return plan, logits[: len(plan.metadata.sampling_rows_host)]

    def _forward(self, token_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        with torch.no_grad():
            return self.model(token_ids, self.cache, self.backend, plan)
