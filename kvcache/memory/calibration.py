"""fp8 cache scales that fit the data: per-(layer, KV head) scales from the K/V a model
actually writes.

A single static scale for every layer and head does not fit a real model: on
SmolLM2-135M-Instruct a scale of 1.0 saturates some heads and wastes the range of others
(`benchmarks/fp8_real_model.py`). :func:`scales_from_cache` reads the largest magnitude each
layer's K and each layer's V reach per KV head in a higher-precision cache that a calibration
pass filled (for example the first prompts, prefilled into a bf16 cache), and turns it into
scales that map that magnitude, times ``margin``, onto float8_e4m3's largest finite value. The
scales are then fixed (:meth:`KVCacheTensors.set_scales`), so every later write and read uses
them, as vLLM's and TensorRT-LLM's calibrated per-head KV scales are.

An int8 cache needs no scales (each row has its own) but gains from key centring:
:func:`key_centres_from_cache` takes the mean key per layer, KV head and channel from the same
kind of calibration pass, for :meth:`KVCacheTensors.set_key_centres`.
"""

from __future__ import annotations

import torch

from attention.errors import InvalidArgumentError
from attention.quantize import FP8_MAX
from kvcache.memory.cache_tensors import KVCacheTensors

__all__ = ["apply_scales", "key_centres_from_cache", "scales_from_cache"]


def scales_from_cache(
    cache: KVCacheTensors, margin: float = 1.25, floor: float = 1e-6, rotation: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``[num_layers, 2, num_kv_heads]`` dequantization scales: per layer, K (0) and V
    (1), each KV head's largest magnitude in ``cache`` times ``margin``, over 448 (a latent
    cache's one tensor gives K and V the same scale; with KV groups, a layer takes the largest
    over the layer tensor it shares with one layer of each other group). ``cache``
    holds the calibration K/V in a 16- or 32-bit dtype; slots never written must hold zeros
    (allocate it with ``fill=0``). Heads that saw nothing get ``floor``. ``rotation``: the fp8
    cache stores K and V rotated by it (``KVCacheTensors.rotation``): the magnitudes are those
    of the rotated K/V. Raises InvalidArgumentError for an fp8 cache, a margin below 1 or a
    non-finite value."""
    if cache.scales is not None or cache.dtype.itemsize == 1:
        raise InvalidArgumentError(
            f"cache: {cache.dtype}; calibrate from a 16- or 32-bit cache, not an 8-bit one (an int8 cache "
            "needs no calibration: its scales are per token)"
        )
    if not (isinstance(margin, (int, float)) and 1.0 <= margin <= 1e3):
        raise InvalidArgumentError(f"margin: {margin!r} must be a number in [1, 1000]")
    storage = cache.storage  # [tensors, 2, blocks, block_size, kv_heads, head_dim]
    if rotation is not None:
        storage = storage.float() @ rotation.to(storage.device, torch.float32)
    amax = storage.abs().amax(dim=(2, 3, 5)).float()  # [tensors, 2, kv_heads]
    if amax.shape[1] == 1:  # a latent cache (MLA): K and V are one tensor with one scale
        amax = amax.expand(-1, 2, -1).contiguous()
    if cache.layout is not None:
        # KV groups: tensor t holds one layer of every group, so each of those layers takes
        # the amax of the whole tensor (the largest of them: a scale that fits all).
        tensor_of = [cache.layout.place(i)[1] for i in range(cache.layout.num_layers)]
        amax = amax[torch.tensor(tensor_of, device=amax.device)]
    if not bool(torch.isfinite(amax).all()):
        raise InvalidArgumentError("cache: holds a non-finite value; fill it with zeros before calibrating")
    return (amax * margin / FP8_MAX).clamp_min(floor)


def apply_scales(cache: KVCacheTensors, scales: torch.Tensor) -> None:
    """Set every layer's scales of fp8 ``cache`` from ``scales`` ``[num_layers, 2,
    num_kv_heads]`` (as :func:`scales_from_cache` returns). Set them before the first write."""
    if cache.scales is None or scales.shape != cache.scales.shape:
        want = None if cache.scales is None else list(cache.scales.shape)
        raise InvalidArgumentError(f"scales: expected shape {want} for an fp8 cache, got {list(scales.shape)}")
    for layer in range(cache.num_layers):
        cache.set_scales(layer, scales[layer, 0].to(cache.scales.device), scales[layer, 1].to(cache.scales.device))


def key_centres_from_cache(cache: KVCacheTensors) -> torch.Tensor:
    """fp32 ``[num_layers, num_kv_heads, head_dim]``: per layer, the mean key (after rotary,
    as stored) over the slots a calibration pass wrote into ``cache``, a 16- or 32-bit cache
    allocated with ``fill=0`` (a slot whose key is all zeros counts as never written). With KV
    groups, a layer takes the mean of the layer tensor it shares (any fixed centre is exact;
    the tensor's mean fits the layers that share it). Raises InvalidArgumentError for an 8-bit
    or latent cache, a non-finite value, or a cache nothing was written to."""
    if cache.dtype.itemsize == 1:
        raise InvalidArgumentError(f"cache: {cache.dtype}; take the key centres from a 16- or 32-bit cache")
    if cache.storage.shape[1] != 2:
        raise InvalidArgumentError("cache: a latent (MLA) cache; its latent is both K and V and is not centred")
    keys = cache.storage[:, 0].float()  # [tensors, blocks, block_size, kv_heads, head_dim]
    if not bool(torch.isfinite(keys).all()):
        raise InvalidArgumentError("cache: holds a non-finite value; fill it with zeros before calibrating")
    written = (keys != 0).any(dim=-1, keepdim=True)  # [tensors, blocks, block_size, kv_heads, 1]
    count = written.sum(dim=(1, 2))  # [tensors, kv_heads, 1]
    if not bool((count > 0).all()):
        raise InvalidArgumentError("cache: no key was written for some layer; prefill calibration prompts first")
    means = keys.sum(dim=(1, 2)) / count  # [tensors, kv_heads, head_dim]
    if cache.layout is not None:
        tensor_of = [cache.layout.place(i)[1] for i in range(cache.layout.num_layers)]
        means = means[torch.tensor(tensor_of, device=means.device)]
    return means
