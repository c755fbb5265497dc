"""The reference backend: paged attention in plain torch, on any device.

Readable first; it is the oracle every other backend is tested against. Each row's K/V is
gathered through its block table in one indexing op (a Python loop per sequence, never per
token) and attention runs in float32, or float64 when asked. It reads the block tables on the
host to refuse an entry outside the cache, so on CUDA it syncs: it is not for serving speed.
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend, StepPlan
from attention.checks import cdiv
from attention.errors import MetadataError
from attention.latent_prefill import plan_latent_prefill
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.quantize import dequantize, quantize
from attention.spec import AttentionSpec
from attention.staging import PlanStaging
from attention.token_scales import quantize_rows

__all__ = ["ReferenceBackend", "scatter_kv"]


class ReferenceBackend(AttentionBackend):
    """Pure-torch paged attention. ``compute_dtype`` is the precision of the math (the
    inputs and outputs keep the spec's dtype)."""

    name = "reference"

    def __init__(self, spec: AttentionSpec, compute_dtype: torch.dtype = torch.float32):
        super().__init__(spec)
        self.math_dtype = compute_dtype
        #: The last plan whose device values were checked (once per step, at its first layer
        #: call: a persistent builder copies them to the device after planning).
        self._checked: StepPlan | None = None

    def _plan(self, metadata: AttentionMetadata, staging: PlanStaging, graph: bool) -> StepPlan:
        # Latent attention: attend() still computes every row absorbed (this backend is the
        # oracle of both forms); the model overwrites the decompressed rows' outputs.
        prefill = plan_latent_prefill(metadata, None if graph else self.latent_prefill_min_tokens)
        return StepPlan(metadata, self.spec, self.name, latent_prefill=prefill)

    @property
    def torch_math_dtype(self) -> torch.dtype:
        return self.math_dtype

    def _check_once(self, plan: StepPlan) -> None:
        if plan is not self._checked:
            _check_device_values(plan.metadata)
            self._checked = plan

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None:
        self._check_once(plan)
        scatter_kv(key, value, layer, plan.metadata.slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        self._check_once(plan)
        meta, spec = plan.metadata, self.spec
        n, bs, kvh, d = layer.key.shape
        tables = meta.block_tables
        window = self.spec.window_of(layer.index)
        firsts = [
            _first_column(s, q, bs, window) for s, q in zip(meta.seq_lens_host, meta.query_lens_host, strict=True)
        ]
        _check_tables(tables, meta.seq_lens_host, firsts, bs, n)
        k_cache = dequantize(layer.key, layer.k_scale, self.math_dtype)
        v_cache = dequantize(layer.value, layer.v_scale, self.math_dtype)
        result = torch.empty_like(query) if out is None else out
        start = 0
        for row, (seq_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
            # Only the blocks the row's queries can see: with a sliding window, the ones
            # before the window may have been released (PAD_BLOCK).
            first = firsts[row]
            blocks = tables[row, first : cdiv(seq_len, bs)].long()
            skip = first * bs
            k = k_cache[blocks].reshape(-1, kvh, d)[: seq_len - skip]  # [seq_len - skip, kvh, d]
            v = v_cache[blocks].reshape(-1, kvh, d)[: seq_len - skip]
            q = query[start : start + q_len]  # [q_len, heads, d]
            tree = None if meta.tree_masks is None else meta.tree_masks[start : start + q_len]
            result[start : start + q_len] = _causal_attention(
                q, k, v, spec.group_size, spec.scale, self.math_dtype, window, skip, spec.logit_softcap, sinks, tree
            ).to(query.dtype)
            start += q_len
        return result


def _check_device_values(meta: AttentionMetadata) -> None:
    """The device tensors agree with the host lengths this backend computes from, and no two
    new tokens write one slot (reads them on the host: this backend syncs anyway). Raises
    MetadataError naming the field: hand-made metadata that contradicts itself would write
    one token's K/V over another's."""
    b = meta.batch
    lens = meta.seq_lens[:b].tolist()
    if lens != list(meta.seq_lens_host):
        row = next(i for i, (a, h) in enumerate(zip(lens, meta.seq_lens_host, strict=True)) if a != h)
        raise MetadataError(
            f"metadata.seq_lens[{row}]: {lens[row]} on the device, {meta.seq_lens_host[row]} on the host"
        )
    starts, total = [0], 0
    for q in meta.query_lens_host:
        total += q
        starts.append(total)
    got = meta.query_start_loc[: b + 1].tolist()
    if got != starts:
        row = next(i for i, (a, h) in enumerate(zip(got, starts, strict=True)) if a != h)
        raise MetadataError(
            f"metadata.query_start_loc[{row}]: {got[row]} on the device; the host query lengths give {starts[row]}"
        )
    slots = meta.slot_mapping[:total]
    written = slots[slots >= 0]
    if written.numel() != torch.unique(written).numel():
        values, counts = torch.unique(written, return_counts=True)
        raise MetadataError(
            f"metadata.slot_mapping: slot {int(values[counts > 1][0])} is written by two tokens of the step; "
            "each new token needs its own slot"
        )


def _first_column(seq_len: int, query_len: int, block_size: int, window: int | None) -> int:
    """The first block-table column a row's queries read (0 without a window)."""
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1) // block_size


def scatter_kv(key: torch.Tensor, value: torch.Tensor, layer: LayerCache, slot_mapping: torch.Tensor) -> None:
    """The cache write in plain torch (shapes as in ``AttentionBackend.write_kv``): slots of
    -1 are skipped; any other slot outside the cache raises MetadataError and writes nothing.
    An fp8 cache stores ``value / scale``, saturated to the format's range; an int8 cache
    stores each row with its own scale (:mod:`attention.token_scales`), K less its
    ``layer.k_centre`` (in float32) when the layer has one. Reads the slots on
    the host, so on CUDA it syncs: the fallback when no kernel is available."""
    n, bs = layer.key.shape[:2]
    keep = slot_mapping != -1
    slots = slot_mapping[keep]
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= n * bs:
            bad = low if low < 0 else high
            raise MetadataError(
                f"slot_mapping: slot {bad} is outside the cache's {n * bs} slots ({n} blocks x {bs}); "
                f"use -1 for a token whose K/V must not be written"
            )
    # Indexed by (block, offset): a token-major V (attention.value_layout) and an int8 cache's
    # blocks (their scales follow the values) have no flat view.
    blocks, offsets = slots // bs, slots % bs
    if layer.key.dtype == torch.int8:
        centred = key[keep].float() - layer.k_centre if layer.k_centre is not None else key[keep]
        for cache, scales, x in ((layer.key, layer.k_scale, centred), (layer.value, layer.v_scale, value[keep])):
            if scales is None:
                raise ValueError("layer: an int8 cache needs its per-token scales")
            q, s = quantize_rows(x)
            cache[blocks, offsets] = q
            scales[blocks, offsets] = s
        return
    layer.key[blocks, offsets] = quantize(key[keep], layer.k_scale, layer.key.dtype)
    layer.value[blocks, offsets] = quantize(value[keep], layer.v_scale, layer.value.dtype)


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: int,
    scale: float,
    dtype: torch.dtype,
    window: int | None,
    skip: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [q_len, heads, d] (the last q_len positions); k, v: [seq_len - skip, kv_heads, d],
    the keys from position ``skip`` on. A query at position p sees keys at positions
    p - window < k <= p (every k <= p without window). ``softcap``: scaled scores s become
    ``softcap * tanh(s / softcap)`` before the softmax. ``sinks``: [heads] logits that join
    each head's softmax as a key with a zero value. ``tree``: int32 [q_len] ancestor masks:
    new token t sees the keys before the new tokens and new token j iff bit j of tree[t]."""
    q_len, seq_len = q.shape[0], k.shape[0] + skip
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(skip, seq_len, device=q.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if tree is not None:
        j = (k_pos - (seq_len - q_len)).clamp(min=0)  # index among the new tokens
        bits = (tree.to(torch.int64)[:, None] >> j[None, :]) & 1
        hidden = (k_pos[None, :] >= seq_len - q_len) & (bits == 0)
    if window is not None:
        hidden = hidden | (k_pos[None, :] <= q_pos[:, None] - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    sink = sinks.to(dtype)[:, None, None].expand(-1, q_len, 1)  # [heads, q_len, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def _check_tables(
    tables: torch.Tensor, seq_lens: tuple[int, ...], firsts: list[int], block_size: int, num_blocks: int
) -> None:
    """Every block-table entry a row reads (columns ``firsts[i]`` up to its length) must be a
    real block (one device sync, oracle only)."""
    if not seq_lens:
        return
    needed = torch.tensor([cdiv(s, block_size) for s in seq_lens], device=tables.device)
    first = torch.tensor(firsts, device=tables.device)
    cols = torch.arange(tables.shape[1], device=tables.device)
    used = (cols[None, :] < needed[:, None]) & (cols[None, :] >= first[:, None])
    rows = tables[: len(seq_lens)]
    bad = used & ((rows < 0) | (rows >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise MetadataError(
            f"block_tables[{row}, {col}] = {int(rows[row, col])} is not a block in "
            f"[0, {num_blocks}) but row {row} needs it for seq_len {seq_lens[row]}"
        )
