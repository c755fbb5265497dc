"""Random paged-attention cases shared by the backend tests.

A case is a batch of rows, each with ``context`` cached tokens and ``new`` tokens this step,
laid out in a NaN-poisoned cache through a real BlockManager whose free queue was scrambled,
so block ids are shuffled and non-contiguous. The K/V of every token (cached and new) is
written with the reference backend, so a backend under test sees exactly what a serving
engine would have written.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attention import AttentionMetadata, ReferenceBackend
from kvcache import BlockManager, ScheduledRow, build_metadata


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_new_tokens, heads, d]
    new_key: torch.Tensor  # [num_new_tokens, kv_heads, d]
    new_value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, d], holds every token's K
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_case(
    rows: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 7,
) -> PagedCase:
    """``rows``: (context, new) per row. Returns a case whose cache already holds all K/V."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + n) // block_size) for c, n in rows)
    manager = BlockManager(need + spare_blocks, block_size)
    # Scramble the free queue: take every block, free them in a random order.
    rng = random.Random(seed)
    for i in range(need + spare_blocks):
        manager.allocate(("filler", i), 1)
    order = list(range(need + spare_blocks))
    rng.shuffle(order)
    for i in order:
        manager.free(("filler", i))
    for i, (context, new) in enumerate(rows):
        manager.allocate(i, context + new)
    shape = (manager.num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    everything = build_metadata(manager, [ScheduledRow(i, c + n, start=0) for i, (c, n) in enumerate(rows)], device)
    total = everything.num_tokens
    keys = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    values = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    ReferenceBackend().write_kv(keys, values, k_cache, v_cache, everything.slot_mapping)
    meta = build_metadata(manager, [ScheduledRow(i, n, start=c) for i, (c, n) in enumerate(rows)], device)
    starts = everything.query_start_loc.tolist()
    new_rows = torch.cat([torch.arange(starts[i] + c, starts[i] + c + n) for i, (c, n) in enumerate(rows)])
    new_rows = new_rows.to(device)
    query = torch.randn(meta.num_tokens, heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    return PagedCase(query, keys[new_rows], values[new_rows], k_cache, v_cache, meta)


def reference_output(case: PagedCase, scale: float | None = None) -> torch.Tensor:
    """Reference attention of the case computed in float64 on float32 copies of the inputs
    (so the oracle's output is not rounded to bf16/fp16), [num_new_tokens, heads, d] float32."""
    backend = ReferenceBackend(compute_dtype=torch.float64)
    q, k, v = case.query.float(), case.k_cache.float(), case.v_cache.float()
    return backend.attend(q, k, v, backend.plan(case.meta), scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere makes it NaN (never passes)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())
