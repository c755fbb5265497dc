"""Where a serving iteration's GPU time goes: the kernels of a torch.profiler trace, summed by
class, per iteration, beside the iterations' wall time (what is left is host time the GPU
waited for).

Classes, by kernel name (the first pattern that matches wins):

- ``attention``: our paged decode and prefill kernels (Triton and Gluon, MLA's included),
  their combine and merge kernels and the fp8 prefill's block dequantization, flash-attn's;
- ``gemm``: cuBLAS / cuBLASLt / CUTLASS matrix products (``nvjet``, ``sm90_xmma``, ``gemm``,
  ``gemv``, ``cutlass``) and their split-K reductions (``splitKreduce``);
- ``boundary``: the fused rotary + cache write (``_rotary_write_kernel``, and
  ``_value_runs_kernel``, which writes prefill rows' token-major V beside it), MLA's
  (``_latent_boundary_kernel``) and the plain cache write;
- ``copy``: memcpy / memset;
- ``elementwise``: everything else (norms, SiLU x up, embedding gather, argmax, the
  metadata check, torch's elementwise and reduction kernels).

Attention is also split into parts (:data:`ATTENTION_PARTS`): latent attention (MLA), the
decode combine, the decode chunks, prefill (with the fp8 prefill's block dequantization), and
flash-attn's kernels, which do both.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTENTION_PARTS",
    "CLASSES",
    "KernelBreakdown",
    "attention_part",
    "attention_parts_text",
    "breakdown",
    "classify",
]

#: Parts of the attention class, by kernel name (the first pattern that matches wins).
ATTENTION_PARTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("mla", re.compile(r"_mla_\w*kernel", re.I)),
    ("combine", re.compile(r"decode_combine", re.I)),
    ("decode", re.compile(r"decode_items_kernel|_decode_hopper_kernel|_decode_hopper_ws_kernel", re.I)),
    ("prefill", re.compile(r"_prefill_kernel|_prefill_hopper_kernel|_dequantize_blocks_kernel", re.I)),
    ("flash-attn", re.compile(r"flash_fwd|flash::|fmha", re.I)),
)

CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile("|".join(pattern.pattern for _, pattern in ATTENTION_PARTS), re.I)),
    ("gemm", re.compile(r"nvjet|xmma|gemm|gemv|cutlass|splitKreduce|cublas", re.I)),
    (
        "boundary",
        re.compile(
            r"_rotary_write_kernel|_value_runs_kernel|_latent_boundary_kernel|_cache_write_kernel|reshape_and_cache",
            re.I,
        ),
    ),
    ("copy", re.compile(r"memcpy|memset", re.I)),
)


def classify(name: str) -> str:
    """The class of a kernel named ``name`` (see the module docstring)."""
    return next((label for label, pattern in CLASSES if pattern.search(name)), "elementwise")


def attention_part(name: str) -> str:
    """The part of the attention class a kernel named ``name`` is (:data:`ATTENTION_PARTS`;
    "other" for none)."""
    return next((label for label, pattern in ATTENTION_PARTS if pattern.search(name)), "other")


def attention_parts_text(parts: dict[str, float]) -> str:
    """" (decode 2.42, combine 0.13)": ms per iteration by attention part, largest first;
    empty for fewer than two parts."""
    if len(parts) < 2:
        return ""
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    return " (" + ", ".join(f"{k} {v:.2f}" for k, v in ranked) + ")"


@dataclass
class KernelBreakdown:
    """GPU kernel time of ``iterations`` iterations, per iteration.

    ms:        class -> milliseconds per iteration.
    attention_ms: the attention class's milliseconds per iteration by part (:func:`attention_part`).
    launches:  class -> kernels per iteration.
    top:       the kernels with the most time: (name, ms per iteration, launches per iteration).
    wall_ms:   wall time per iteration (host clock), when the caller measured it.
    """

    iterations: int
    ms: dict[str, float] = field(default_factory=dict)
    attention_ms: dict[str, float] = field(default_factory=dict)
    launches: dict[str, float] = field(default_factory=dict)
    top: list[tuple[str, float, float]] = field(default_factory=list)
    wall_ms: float | None = None
    #: One replay of the last iteration's CUDA graph, back to back (no host work between):
    #: the step's GPU time with the gaps between its kernels, when the iterations were graphs.
    replay_ms: float | None = None

    @property
    def gpu_ms(self) -> float:
        return sum(self.ms.values())

    @property
    def idle_ms(self) -> float | None:
        """Wall time per iteration with no kernel running (host waits and the gaps between
        kernels together)."""
        return None if self.wall_ms is None else max(0.0, self.wall_ms - self.gpu_ms)

    @property
    def host_wait_ms(self) -> float | None:
        """Wall time per iteration beyond the graph's own back-to-back replay: what the GPU
        waited for the host (None without a replay time)."""
        if self.wall_ms is None or self.replay_ms is None:
            return None
        return max(0.0, self.wall_ms - self.replay_ms)

    def as_json(self) -> dict[str, Any]:
        return {
            "iterations": self.iterations,
            "ms_per_iteration": {k: round(v, 4) for k, v in sorted(self.ms.items())},
            "attention_ms_per_iteration": {k: round(v, 4) for k, v in sorted(self.attention_ms.items())},
            "kernels_per_iteration": {k: round(v, 2) for k, v in sorted(self.launches.items())},
            "gpu_ms_per_iteration": round(self.gpu_ms, 4),
            "wall_ms_per_iteration": None if self.wall_ms is None else round(self.wall_ms, 4),
            "gpu_idle_ms_per_iteration": None if self.idle_ms is None else round(self.idle_ms, 4),
            "graph_replay_ms": None if self.replay_ms is None else round(self.replay_ms, 4),
            "host_wait_ms_per_iteration": None if self.host_wait_ms is None else round(self.host_wait_ms, 4),
            "top_kernels": [
                {"name": n[:120], "ms_per_iteration": round(t, 4), "launches_per_iteration": round(c, 2)}
                for n, t, c in self.top
            ],
        }

    def line(self) -> str:
        split = attention_parts_text(self.attention_ms)
        parts = ", ".join(f"{k} {v:.2f}{split if k == 'attention' else ''}"
                          for k, v in sorted(self.ms.items(), key=lambda kv: -kv[1]))  # fmt: skip
        idle = "" if self.idle_ms is None else f"; wall {self.wall_ms:.2f}, no kernel running {self.idle_ms:.2f}"
        if self.replay_ms is not None:
            idle += f"; graph replay {self.replay_ms:.2f}, host wait {self.host_wait_ms:.2f}"
        return f"per iteration (ms): GPU {self.gpu_ms:.2f} = {parts}{idle}"


def breakdown(events: Any, iterations: int, wall_s: float | None = None, top: int = 20) -> KernelBreakdown:
    """Sum the CUDA kernel events of a finished ``torch.profiler.profile`` (its
    ``events()``) by class, per iteration. ``wall_s``: the host time of those iterations.

    An attention kernel that starts before the previous attention kernel ended (a dependent
    launch: the MLA merge starts while the decode kernel's last programs run and waits for
    them) counts from that end, so the overlap is not counted twice."""
    total: dict[str, float] = defaultdict(float)
    attention: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    per_kernel: dict[str, float] = defaultdict(float)
    per_kernel_count: Counter[str] = Counter()
    # Kernels (and device copies) are the events on the device; a host op's device time
    # would count its kernels twice.
    device = [e for e in events if str(getattr(e, "device_type", "")) == "DeviceType.CUDA"]
    attention_end = float("-inf")
    for event in sorted(device, key=lambda e: float(e.time_range.start)):
        start, end = float(event.time_range.start), float(event.time_range.end)
        if end - start <= 0:
            continue
        label = classify(event.name)
        if label == "attention":
            start, attention_end = max(start, attention_end), max(end, attention_end)
        us = max(0.0, end - start)
        total[label] += us
        count[label] += 1
        if label == "attention":
            attention[attention_part(event.name)] += us
        per_kernel[event.name] += us
        per_kernel_count[event.name] += 1
    n = max(iterations, 1)
    result = KernelBreakdown(iterations)
    result.ms = {k: v / 1e3 / n for k, v in total.items()}
    result.attention_ms = {k: v / 1e3 / n for k, v in attention.items()}
    result.launches = {k: v / n for k, v in count.items()}
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    result.top = [(name, us / 1e3 / n, per_kernel_count[name] / n) for name, us in ranked]
    if wall_s is not None:
        result.wall_ms = 1e3 * wall_s / n
    return result
