"""An int8 cache with a scale per (token, KV head): where the scales live and the arithmetic.

Each row of K or V (one token, one KV head: ``head_dim`` values) is stored as int8 with its own
fp16 scale, ``scale = max|row| / 127``; the real value is ``int8 * scale``. A scale fitted to
every row keeps int8's 8 bits of precision wherever the row's range is, which one scale per
layer and head cannot do on a real model (on SmolLM2-135M-Instruct, teacher-forced top-1
agreement with the bf16 cache: per-token int8 96.8%, calibrated per-head fp8 94.4%;
``benchmarks/results/kv-quant-schemes-2026-12-03.json``).

Memory: a block of K (or of V) is one contiguous run of ``rows_per_block(block_size,
head_dim)`` rows of ``kv_heads * head_dim`` bytes (:meth:`attention.dtypes.DtypeInfo.rows_per_block`):

- the values, ``block_size * kv_heads * head_dim`` bytes: K laid out ``[block_size, kv_heads,
  head_dim]``, V token-major ``[kv_heads, head_dim, block_size]`` (:mod:`attention.value_layout`);
- then the scales, fp16 ``[kv_heads, block_size]`` (one head's scales side by side, so a
  kernel reads a tile's scales in one vector load);
- then padding up to the row boundary (and, for a head_dim that is not a power of two, up to
  rows that keep every block aligned: :meth:`attention.dtypes.DtypeInfo.rows_per_block`).

So the scales travel with their block: block copies, swap, the host and disk tiers and digests
move whole blocks without knowing the format. The tensors a backend sees are views of that
memory with the usual logical shapes: ``key``/``value`` ``[num_blocks, block_size, kv_heads,
head_dim]`` int8 and ``k_scale``/``v_scale`` fp16 ``[num_blocks, block_size, kv_heads]``.

Rounding: ``x / scale`` in fp32 (the scale as stored, in fp16), to nearest with ties away
from zero (``floor(|y| + 0.5)`` with the sign of y), clamped to +-127. A row of zeros stores scale 0
and values 0. Scales saturate at fp16's largest finite value (65504).
"""

from __future__ import annotations

import torch

from attention.dtypes import dtype_info
from attention.layer_cache import LayerCache

__all__ = [
    "INT8_MAX",
    "SCALE_DTYPE",
    "SCALE_MAX",
    "dequantize_rows",
    "layer_views",
    "layout_problem",
    "quantize_rows",
    "quantized_layer",
    "split_block_memory",
]

#: Largest stored magnitude (the format is symmetric: -128 is never written).
INT8_MAX = 127
#: The dtype of a stored scale.
SCALE_DTYPE = torch.float16
#: Largest scale (fp16's largest finite value): rows above 127 times it saturate.
SCALE_MAX = 65504.0


def split_block_memory(
    memory: torch.Tensor, block_size: int, *, token_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K (or V) memory -> (values, scales), views into it.

    memory: int8, contiguous ``[num_blocks, rows, kv_heads, head_dim]`` with ``rows =
            rows_per_block(block_size, head_dim)``.
    Returns values int8 ``[num_blocks, block_size, kv_heads, head_dim]`` (contiguous within a
    block, or token-major when ``token_major``; the block stride is ``rows * kv_heads *
    head_dim``) and scales fp16 ``[num_blocks, block_size, kv_heads]`` (stored ``[kv_heads,
    block_size]`` per block, right after the values)."""
    if memory.dtype != torch.int8 or memory.dim() != 4 or not memory.is_contiguous():
        raise ValueError(
            f"memory: expected a contiguous int8 [num_blocks, rows, kv_heads, head_dim] tensor, got "
            f"{tuple(memory.shape)} {memory.dtype}"
        )
    n, rows, kvh, d = memory.shape
    per_block = rows * kvh * d
    n_values = block_size * kvh * d
    if n_values + 2 * block_size * kvh > per_block:
        raise ValueError(f"memory: {rows} rows per block cannot hold {block_size} tokens and their scales")
    flat = memory.view(n, per_block)
    stored = flat[:, :n_values]
    if token_major:
        values = stored.view(n, kvh, d, block_size).permute(0, 3, 1, 2)
    else:
        values = stored.view(n, block_size, kvh, d)
    scales = flat[:, n_values : n_values + 2 * block_size * kvh].view(SCALE_DTYPE)
    return values, scales.view(n, kvh, block_size).transpose(1, 2)


def layer_views(memory: torch.Tensor, block_size: int, index: int = 0) -> LayerCache:
    """One layer's int8 memory, ``[2, num_blocks, rows, kv_heads, head_dim]`` (K, then V; each
    part contiguous), as the :class:`~attention.LayerCache` the backends take: K's and V's
    values and scales from :func:`split_block_memory`, V token-major."""
    key, k_scale = split_block_memory(memory[0], block_size, token_major=False)
    value, v_scale = split_block_memory(memory[1], block_size, token_major=True)
    return LayerCache(key, value, index=index, k_scale=k_scale, v_scale=v_scale)


def quantized_layer(key: torch.Tensor, value: torch.Tensor, index: int = 0) -> LayerCache:
    """A new int8 layer cache holding ``key`` and ``value`` (dense ``[num_blocks, block_size,
    kv_heads, head_dim]``, any float dtype), every row quantized as the cache write quantizes
    it (benchmarks and tests build caches this way)."""
    n, bs, kvh, d = key.shape
    rows = dtype_info("int8").rows_per_block(bs, d)
    layer = layer_views(torch.empty((2, n, rows, kvh, d), dtype=torch.int8, device=key.device), bs, index)
    for dense, values, scales in ((key, layer.key, layer.k_scale), (value, layer.value, layer.v_scale)):
        q, scale = quantize_rows(dense)
        values.copy_(q)
        scales.copy_(scale)  # type: ignore[union-attr]
    return layer


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: ``[..., head_dim]`` (any float dtype) -> (int8 values ``[..., head_dim]``, fp16
    scales ``[...]``), one scale per row, as described in the module docstring."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp(max=SCALE_MAX).to(SCALE_DTYPE)
    s = scale.float()[..., None]
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values: int8 ``[..., head_dim]``, scales ``[...]`` -> ``values * scales`` in ``dtype``."""
    return values.to(dtype) * scales.to(dtype)[..., None]


def layout_problem(key: torch.Tensor, value: torch.Tensor, k_scale: object, v_scale: object) -> str | None:
    """Why an int8 layer cache is not laid out as :func:`split_block_memory` lays it out (the
    layout the kernels address), or None when it is. ``key``/``value`` must already have
    been checked to be int8 ``[num_blocks, block_size, kv_heads, head_dim]``."""
    n, bs, kvh, d = key.shape
    stride = dtype_info("int8").rows_per_block(bs, d) * kvh * d
    want_k = (stride, kvh * d, d, 1)
    want_v = (stride, 1, d * bs, bs)
    if not _strides_match(key, want_k):
        return f"layer.key: strides {key.stride()}, expected {want_k}"
    if not _strides_match(value, want_v):
        return f"layer.value: strides {value.stride()}, expected {want_v} (token-major)"
    for name, scale, part in (("k_scale", k_scale, key), ("v_scale", v_scale, value)):
        if not isinstance(scale, torch.Tensor):
            return f"layer.{name}: expected the fp16 per-token scales, got {type(scale).__name__}"
        if scale.dtype != SCALE_DTYPE or tuple(scale.shape) != (n, bs, kvh) or scale.device != key.device:
            return (
                f"layer.{name}: expected {SCALE_DTYPE} [{n}, {bs}, {kvh}] on {key.device}, got "
                f"{scale.dtype} {list(scale.shape)} on {scale.device}"
            )
        if not _strides_match(scale, (stride // 2, 1, bs)):
            return f"layer.{name}: strides {scale.stride()}, expected {(stride // 2, 1, bs)}"
        if scale.data_ptr() != part.data_ptr() + bs * kvh * d:
            return f"layer.{name}: not stored right after its block's values"
    return None


def _strides_match(t: torch.Tensor, want: tuple[int, ...]) -> bool:
    return all(size == 1 or got == w for size, got, w in zip(t.shape, t.stride(), want, strict=True))
