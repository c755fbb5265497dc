"""The reference backend: paged attention in plain torch, on any device.

Readable first; it is the oracle every other backend is tested against. Each row's K/V is
gathered through its block table in one indexing op (a Python loop per sequence, never per
token) and attention runs in float32, or float64 when asked.
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend, StepPlan

__all__ = ["ReferenceBackend", "scatter_kv"]


class ReferenceBackend(AttentionBackend):
    """Pure-torch paged attention. ``compute_dtype`` is the precision of the math."""

    name = "reference"

    def __init__(self, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.compute_dtype = compute_dtype

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        scatter_kv(key, value, k_cache, v_cache, slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        meta = plan.metadata
        n, bs, kvh, d = k_cache.shape
        group = query.shape[1] // kvh
        tables = meta.block_tables
        _check_tables(tables, meta.seq_lens_host, bs, n)
        result = torch.empty_like(query) if out is None else out
        start = 0
        for row, (seq_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
            blocks = tables[row, : -(-seq_len // bs)].long()
            k = k_cache[blocks].reshape(-1, kvh, d)[:seq_len]  # [seq_len, kvh, d]
            v = v_cache[blocks].reshape(-1, kvh, d)[:seq_len]
            q = query[start : start + q_len]  # [q_len, heads, d]
            result[start : start + q_len] = _causal_attention(
                q, k, v, group, softmax_scale, self.compute_dtype
            ).to(query.dtype)
            start += q_len
        return result


def scatter_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The cache write in plain torch (shapes as in ``AttentionBackend.write_kv``): slots of -1
    are skipped; a slot past the cache raises ValueError. Reads the slots on the host, so on
    CUDA it syncs: the fallback when no kernel is available."""
    n, bs, kvh, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if slots.numel() and int(slots.max()) >= n * bs:
        raise ValueError(
            f"slot_mapping: slot {int(slots.max())} is outside the cache's {n * bs} slots ({n} blocks x {bs})"
        )
    k_cache.view(n * bs, kvh, d)[slots] = key[keep]
    v_cache.view(n * bs, kvh, d)[slots] = value[keep]


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """q: [q_len, heads, d] (the last q_len positions); k, v: [seq_len, kv_heads, d]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def _check_tables(tables: torch.Tensor, seq_lens: tuple[int, ...], block_size: int, num_blocks: int) -> None:
    """Every block-table entry a row needs must be a real block (one device sync, oracle only)."""
    needed = torch.tensor([-(-s // block_size) for s in seq_lens], device=tables.device)
    cols = torch.arange(tables.shape[1], device=tables.device)
    used = cols[None, :] < needed[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{row}, {col}] = {int(tables[row, col])} is not a block in "
            f"[0, {num_blocks}) but row {row} needs it for seq_len {seq_lens[row]}"
        )
