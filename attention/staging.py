"""Where a plan puts what its kernels read on the device.

A plan decides on the host (work lists, tile indices) and the kernels read the result on the
device. :class:`PlanStaging` is how the plan gets device memory for that:

- ``stage(name, values)``: an int32 array computed on the host; the returned device tensor
  holds it by the time the step's kernels run;
- ``scratch(name, dtype, numel)``: device working memory (partial outputs, counters).

:class:`DirectStaging` (the default of ``AttentionBackend.plan``) allocates and copies per
call. A persistent step builder (``kvcache.MetadataBuilder`` with fixed capacities) hands out
fixed regions of buffers allocated once, filled on the host and copied to the device together
with the metadata in the step's one host-to-device copy, so a CUDA graph captured over them
sees each step's plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass

import torch

from attention.checks import require_int
from attention.errors import InvalidArgumentError

__all__ = ["BufferRequest", "DirectStaging", "PlanStaging", "StepCapacity"]


@dataclass(frozen=True)
class StepCapacity:
    """The most one step can hold; fixed buffers are sized from it.

    max_rows:           rows (sequences) in one step.
    max_tokens:         new tokens in one step (all rows together).
    max_blocks_per_seq: block-table columns (``ceil(max_model_len / block_size)``).
    """

    max_rows: int
    max_tokens: int
    max_blocks_per_seq: int

    def __post_init__(self) -> None:
        require_int("max_rows", self.max_rows, minimum=1, maximum=1 << 20)
        require_int("max_tokens", self.max_tokens, minimum=1, maximum=1 << 24)
        require_int("max_blocks_per_seq", self.max_blocks_per_seq, minimum=1, maximum=1 << 24)
        if self.max_tokens < self.max_rows:
            raise InvalidArgumentError(
                f"max_tokens: {self.max_tokens} is below max_rows {self.max_rows}; every row brings >= 1 token"
            )


@dataclass(frozen=True)
class BufferRequest:
    """A buffer a backend's plans may ask for, sized for a :class:`StepCapacity`.

    staged: an int32 host-computed array (``stage``); else device scratch (``scratch``).
    zeroed: scratch that must start as zeros and that kernels leave as zeros (counters).
    """

    name: str
    dtype: torch.dtype
    numel: int
    staged: bool
    zeroed: bool = False


class PlanStaging(ABC):
    """Device memory for one step's plan (see the module docstring)."""

    device: torch.device

    @abstractmethod
    def stage(self, name: str, values: array) -> torch.Tensor:
        """int32 device tensor [len(values)] holding ``values`` (an ``array('i')``) when the
        step's kernels run."""

    @abstractmethod
    def scratch(self, name: str, dtype: torch.dtype, numel: int, *, zeroed: bool = False) -> torch.Tensor:
        """Device tensor [numel] of ``dtype`` for the kernels' own use; ``zeroed``: it starts
        as zeros (kernels that use it must leave it zeroed)."""


class DirectStaging(PlanStaging):
    """Fresh device tensors per plan: one non-blocking copy per staged array (from pinned
    memory on CUDA, so the host never waits)."""

    def __init__(self, device: torch.device):
        self.device = device

    def stage(self, name: str, values: array) -> torch.Tensor:
        host = torch.frombuffer(values, dtype=torch.int32) if len(values) else torch.empty(0, dtype=torch.int32)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.clone() if self.device.type == "cpu" else host.to(self.device)

    def scratch(self, name: str, dtype: torch.dtype, numel: int, *, zeroed: bool = False) -> torch.Tensor:
        if zeroed:
            return torch.zeros(numel, dtype=dtype, device=self.device)
        return torch.empty(numel, dtype=dtype, device=self.device)
