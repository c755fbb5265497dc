"""Calibrating an 8-bit cache from real prompts (:mod:`kvcache.memory.calibration`).

The calibration prompts are prefilled once into a zero-filled cache in the model's compute
dtype (bf16 or fp32), through the same backend. For an fp8 cache the largest K and V magnitude
per layer and KV head (of the rotated K/V when the cache stores them rotated, ``cache.kv_rotation``),
times a margin, becomes that layer's and head's scale; for an int8
cache the mean key per layer, KV head and channel becomes its key centre. Either is fixed from
then on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attention.errors import InvalidArgumentError
from kvcache import KVCacheConfig, KVCacheTensors
from kvcache.memory.calibration import apply_scales, key_centres_from_cache, scales_from_cache

from ..model import Llama
from .loop import run_requests
from .parts import engine_for
from .scheduler import Request, make_preemption

__all__ = ["calibrate_key_centres", "calibrate_kv_scales"]


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
    scratch = _calibration_prefill(model, config, fp8_cache.device, prompts, backend)
    scales = scales_from_cache(scratch, margin, rotation=fp8_cache.rotation)
    apply_scales(fp8_cache, scales)
    return scales


def calibrate_key_centres(
    model: Llama,
    config: KVCacheConfig,
    int8_cache: KVCacheTensors,
    prompts: Sequence[Sequence[int]],
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Prefill ``prompts`` into a scratch cache in ``config``'s compute dtype, centre
    ``int8_cache``'s keys on the mean key written there
    (:meth:`~kvcache.KVCacheTensors.set_key_centres`), and return the centres
    (``[num_layers, num_kv_heads, head_dim]``). Call it before the cache's first write.
    Raises ValueError for no prompts, and InvalidArgumentError for a cache other than int8
    (before any prefill)."""
    if int8_cache.dtype != torch.int8:
        raise InvalidArgumentError(f"int8_cache: a {int8_cache.dtype} cache; key centring is built for the int8 cache")
    if int8_cache.rotation is not None:
        raise InvalidArgumentError("int8_cache: stores K and V rotated (cache.kv_rotation); keep one of the two")
    scratch = _calibration_prefill(model, config, int8_cache.device, prompts, backend)
    centres = key_centres_from_cache(scratch)
    int8_cache.set_key_centres(centres)
    return centres


def _calibration_prefill(
    model: Llama, config: KVCacheConfig, device: torch.device, prompts: Sequence[Sequence[int]], backend: str | None
) -> KVCacheTensors:
    """A zero-filled scratch cache in ``config``'s compute dtype with ``prompts`` prefilled."""
    if not prompts:
        raise ValueError("prompts: give at least one calibration prompt")
    compute = config.compute_dtype
    bs = config.cache.block_size
    blocks = sum(-(-(len(p) + 1) // bs) for p in prompts) + 2
    section = {**config.cache.model_dump(), "dtype": compute, "num_blocks": blocks, "memory_budget": None}
    section.update(
        enable_prefix_caching=False, host_cache_space=0, swap_space=0, disk_cache_space=0, disk_cache_dir=None,
        kv_rotation="none",  # the scratch cache holds K/V as computed; scales see them rotated
    )
    scratch = KVCacheConfig.model_validate({**config.model_dump(), "cache": section}, strict=False)
    engine = engine_for(scratch, model.shape, device=device, backend=backend, fill=0.0)
    requests = [Request(i, list(p), 1) for i, p in enumerate(prompts)]
    run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), overlap=False,
        token_budget=max(64, max(len(p) for p in prompts)), max_running=len(prompts),
    )  # fmt: skip
    return engine.cache
