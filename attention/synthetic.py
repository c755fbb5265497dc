"""Synthetic steps over a small scratch cache, for compiling kernels before serving.

A backend's :meth:`~attention.base.AttentionBackend.warmup` runs its kernels once per variant
a configuration can reach on throw-away data; the metadata here is built directly (rows get
consecutive blocks), without a block manager.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from attention.checks import cdiv
from attention.dtypes import dtype_info
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.spec import AttentionSpec
from attention.token_scales import layer_views

__all__ = ["scratch_layer", "synthetic_metadata"]


def synthetic_metadata(
    rows: list[tuple[int, int]], block_size: int, device: torch.device, table_width: int | None = None
) -> AttentionMetadata:
    """Metadata for ``rows`` of (seq_len, num_new): row i owns the next ``cdiv(seq_len,
    block_size)`` blocks; every row samples. Needs ``sum(cdiv(seq_len, block_size))`` blocks."""
    tables, seq_lens, q_lens, slots, positions, next_block = [], [], [], [], [], 0
    width = table_width or max(cdiv(s, block_size) for s, _ in rows)
    for seq_len, new in rows:
        blocks = list(range(next_block, next_block + cdiv(seq_len, block_size)))
        next_block += len(blocks)
        tables.append(blocks + [-1] * (width - len(blocks)))
        seq_lens.append(seq_len)
        q_lens.append(new)
        for p in range(seq_len - new, seq_len):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
            positions.append(p)
    ends = list(accumulate(q_lens))

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor([0, *ends], torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        positions=tensor(positions, torch.int64),
        logits_indices=tensor([e - 1 for e in ends], torch.int64),
        block_size=block_size,
        seq_lens_host=tuple(seq_lens),
        query_lens_host=tuple(q_lens),
        sampling_rows_host=tuple(range(len(rows))),
    )


def scratch_layer(
    spec: AttentionSpec, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype, index: int = 0
) -> LayerCache:
    """A zeroed one-layer cache of ``num_blocks`` blocks (unit scales for an fp8 cache; an
    int8 cache laid out as :func:`attention.token_scales.layer_views` lays it out,
    its scales zero)."""
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if spec.token_scaled_cache:
        rows = dtype_info(spec.cache_dtype).rows_per_block(block_size, spec.head_dim)
        memory = torch.zeros((2, num_blocks, rows, spec.num_kv_heads, spec.head_dim), dtype=torch.int8, device=device)
        return layer_views(memory, block_size, index)
    scales = torch.ones(spec.num_kv_heads, dtype=torch.float32, device=device) if spec.quantized_cache else None
    return LayerCache(
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
        index=index,
        k_scale=scales,
        v_scale=scales,
    )
