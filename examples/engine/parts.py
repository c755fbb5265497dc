"""From a model shape and a cache config to the parts a serving loop runs: the attention spec
(with the checkpoint's sliding window), the backend, the cache tensors and the block manager.

    shape = load_checkpoint(path, device="cuda", dtype=torch.bfloat16).shape
    config = cache_config_for(shape, block_size=256, dtype="bfloat16", num_blocks=4096, device="cuda")
    engine = engine_for(config, shape, backend="triton")

The backend is built from :meth:`LlamaShape.attention_spec`, not from
``KVCacheConfig.attention_spec()``: the config's ``model`` section may come from a file
written for another purpose (without the checkpoint's window, or Gemma's softmax scale, which
it has no field for), and a spec built from it would silently attend differently.

KV groups: a model mixing full and windowed layers (Gemma-2, Gemma-3, Qwen2 with
``max_window_layers``) gets a cache of ``group_size`` layer tensors and a
:class:`~kvcache.HybridBlockManager` (:mod:`kvcache.blocks.groups`): each windowed group
releases the blocks behind its window, so those layers hold a window's K/V, not the whole
sequence's. The same memory holds ``num_layers / group_size`` times as many block ids, so
``manager.num_blocks`` is that many times ``num_blocks``. Such a manager has no swap space
and no host tier yet (refused with the fix); ``engine_for(..., kv_groups=False)`` keeps one
table for every layer instead.

Tensor parallelism: ``engine_for(..., tp=TensorParallel(size, rank), collective=...)`` builds
rank ``rank``'s engine: a backend for its heads, a cache of its KV heads, and the same block
manager as every other rank (same block count, same settings). When the block count comes
from a fractional memory budget it depends on each device's free memory, so the ranks take
the minimum (one all-gather) before allocating: every rank's manager must hand out the same
block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attention import AttentionBackend, AttentionSpec, choose_backend
from kvcache import AnyBlockManager, KVCacheConfig, KVCacheTensors, allocate_kv_cache, manager_for, resolve_device
from kvcache.blocks.groups import group_layout
from kvcache.memory.cache_tensors import free_device_memory, num_blocks_for
from kvcache.parallel.collective import Collective, SingleProcess
from kvcache.parallel.heads import TensorParallel

from ..model import LlamaShape

__all__ = ["Engine", "cache_config_for", "engine_for"]


@dataclass
class Engine:
    """What :func:`engine_for` built. ``reason``: why this backend (``auto`` explained).
    ``spec``: the attention shape this rank serves (its heads, under tensor parallelism)."""

    config: KVCacheConfig
    spec: AttentionSpec
    backend: AttentionBackend
    reason: str
    cache: KVCacheTensors
    manager: AnyBlockManager
    tp: TensorParallel = field(default_factory=TensorParallel)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def graphs_allowed(self) -> bool:
        """Whether steps may replay CUDA graphs: a CUDA device and a backend that allows
        capture (sliding windows included: the decode kernels read each row's window range,
        planned per step like any other length)."""
        return self.device.type == "cuda" and self.backend.info.cuda_graphs


def cache_config_for(
    shape: LlamaShape,
    *,
    block_size: int,
    dtype: str,
    num_blocks: int | None = None,
    memory_budget: float | str | None = None,
    device: str = "auto",
    backend: str = "auto",
    prefix_caching: bool = False,
    swap_space: int | str = 0,
    host_cache_space: int | str = 0,
    compute_dtype: str | None = None,
    disk_cache_dir: str | None = None,
    disk_cache_space: int | str = 0,
    kv_rotation: str = "none",
) -> KVCacheConfig:
    """A validated cache config whose ``model`` section is ``shape``'s (give ``num_blocks``
    or ``memory_budget``); ``compute_dtype`` is ``model.dtype`` (required for an fp8
    ``dtype``); ``kv_rotation``: ``cache.kv_rotation``. Raises pydantic's ValidationError
    naming the field."""
    cache: dict[str, object] = {
        "block_size": block_size,
        "dtype": dtype,
        "device": device,
        "enable_prefix_caching": prefix_caching,
        "swap_space": swap_space,
        "host_cache_space": host_cache_space,
        "disk_cache_space": disk_cache_space,
        "disk_cache_dir": disk_cache_dir,
        "kv_rotation": kv_rotation,
    }
    if num_blocks is not None:
        cache["num_blocks"] = num_blocks
    if memory_budget is not None:
        cache["memory_budget"] = memory_budget
    model = shape.model_section().model_dump()
    if compute_dtype is not None:
        model["dtype"] = compute_dtype
    return KVCacheConfig.model_validate(
        {"model": model, "cache": cache, "attention": {"backend": backend}},
        strict=False,
    )


def engine_for(
    config: KVCacheConfig,
    shape: LlamaShape,
    *,
    device: torch.device | str | None = None,
    num_blocks: int | None = None,
    backend: str | AttentionBackend | None = None,
    prefix_caching: bool | None = None,
    fill: float | None = None,
    tp: TensorParallel | None = None,
    collective: Collective | None = None,
    kv_groups: bool = True,
) -> Engine:
    """Build the spec, backend, cache and manager for ``shape`` under ``config``.

    device, num_blocks, backend, prefix_caching: override the config's values; ``backend``
    may also be a backend already built for ``shape.attention_spec(...)`` (tests run the
    triton backend on CPU under its interpreter that way).
    fill: initialise every cache element (tests poison with NaN).
    tp, collective: build this rank's engine of a tensor-parallel group (``collective`` is
    needed only to agree on a block count computed from a memory budget).
    kv_groups: give a model that mixes full and windowed layers one block table per KV group
    (default); False: one table for every layer, as for any other model (each layer keeps the
    whole sequence's K/V; swap and host tiers need this for now).
    Raises ValueError when the config's ``model`` section differs from ``shape`` or the model
    does not split over ``tp.size`` ranks, and the kvcache errors (UnsupportedSettingError,
    BackendUnavailableError, CacheAllocationError) with their fixes.
    """
    shape.check_cache(config.model)
    tp = tp or TensorParallel()
    shape.check_tp(tp)
    collective = collective or SingleProcess()
    if (collective.rank, collective.size) != (tp.rank, tp.size) and collective.size > 1:
        raise ValueError(f"collective: rank {collective.rank} of {collective.size}, but tp is {tp}")
    dev = resolve_device(str(device) if device is not None else config.cache.device)
    spec = shape.attention_spec(config.compute_dtype, config.cache.dtype, tp=tp)
    if isinstance(backend, AttentionBackend):
        if backend.spec != spec:
            raise ValueError(f"backend: built for {backend.spec}, but the model needs {spec}")
        chosen, reason = backend, f"{backend.name} (given)"
    else:
        choice = choose_backend(
            backend or config.attention.backend, spec, device_type=dev.type, block_size=config.cache.block_size
        )
        chosen, reason = choice.backend, choice.reason
    if num_blocks is None and config.cache.num_blocks is None and tp.is_sharded:
        if collective.size != tp.size:
            raise ValueError(
                f"collective: a memory budget with {tp.size} ranks needs the group's collective to agree on "
                f"one block count; pass collective= (or num_blocks=)"
            )
        # Free memory differs between devices: every rank takes the smallest count.
        num_blocks = collective.min_int(num_blocks_for(config, free_device_memory(dev), tp))
    # KV groups when the model mixes full and windowed layers (and they are wanted); a layout
    # of one group means one table for every layer.
    windows = (spec.sliding_window, spec.window_layers) if kv_groups else (None, None)
    layout = group_layout(shape.num_layers, *windows)
    cache = allocate_kv_cache(config, num_blocks=num_blocks, device=dev, fill=fill, tp=tp, layout=layout)
    manager = manager_for(config, cache, prefix_caching=prefix_caching, spec=spec)  # with its tiers
    return Engine(config, spec, chosen, reason, cache, manager, tp)
