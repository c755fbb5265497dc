"""Calibrating an fp8 cache's scales from real prompts (:mod:`kvcache.memory.calibration`).

The calibration prompts are prefilled once into a zero-filled cache in the model's compute
dtype (bf16 or fp32), through the same backend; the largest K and V magnitude per layer and KV
head, times a margin, becomes that layer's and head's fp8 scale, fixed from then on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import KVCacheConfig, KVCacheTensors
from kvcache.memory.calibration import apply_scales, scales_from_cache

from ..model import Llama
from .loop import run_requests
from .parts import engine_for
from .scheduler import Request, make_preemption

__all__ = ["calibrate_kv_scales"]


def calibrate_kv_scales(
    model: Llama,
    config: KVCacheConfig,
    fp8_cache: KVCacheTensors,
    prompts: Sequence[Sequence[int]],
    *,
    margin: float = 1.25,
    backend: str | None = None,
) -> torch.Tensor:
    """Prefill ``prompts`` into a scratch cache in ``config``'s compute dtype, set
    ``fp8_cache``'s per-layer, per-head scales from what was written, and return them
    (``[num_layers, 2, num_kv_heads]``). Raises ValueError for no prompts."""
    if not prompts:
        raise ValueError("prompts: give at least one calibration prompt")
    compute = config.compute_dtype
    bs = config.cache.block_size
    blocks = sum(-(-(len(p) + 1) // bs) for p in prompts) + 2
    section = {**config.cache.model_dump(), "dtype": compute, "num_blocks": blocks, "memory_budget": None}
    section.update(
        enable_prefix_caching=False, host_cache_space=0, swap_space=0, disk_cache_space=0, disk_cache_dir=None
    )
    scratch = KVCacheConfig.model_validate({**config.model_dump(), "cache": section}, strict=False)
    engine = engine_for(scratch, model.shape, device=fp8_cache.device, backend=backend, fill=0.0)
    requests = [Request(i, list(p), 1) for i, p in enumerate(prompts)]
    run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), overlap=False,
        token_budget=max(64, max(len(p) for p in prompts)), max_running=len(prompts),
    )  # fmt: skip
    scales = scales_from_cache(engine.cache, margin)
    apply_scales(fp8_cache, scales)
    return scales
