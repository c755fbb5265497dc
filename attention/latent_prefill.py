"""Decompressed prefill rows of a latent-attention (MLA) step.

A backend serving latent attention attends decode rows in the absorbed form (MQA over the
latents, :meth:`AttentionBackend.attend`). A row with many new tokens is compute-bound, and the
absorbed form costs ``2 * (r + e) / (n + e + v)`` times the multiply-adds of attention over
decompressed keys and values (3.4x for DeepSeek-V3), so on eager steps rows of at least
``AttentionBackend.latent_prefill_min_tokens`` new tokens attend decompressed instead: the model
gathers their keys' latents (:meth:`AttentionBackend.gather_latent_keys`), up-projects them
through ``kv_b_proj`` and calls :meth:`AttentionBackend.attend_latent_prefill`. Measured on the
H200 (``benchmarks/bench_mla_prefill.py``): 7-13x faster than the absorbed kernel on prompts.

:class:`LatentPrefill` is the plan's part for those rows; :func:`plan_latent_prefill` makes it
from host lengths; :func:`latent_key_slots` finds the keys' cache slots on the device.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from attention.metadata import AttentionMetadata
from attention.staging import DirectStaging

__all__ = ["LatentPrefill", "latent_key_slots", "plan_latent_prefill", "reference_latent_prefill"]


@dataclass(frozen=True)
class LatentPrefill:
    """The rows of a step that attend decompressed, in step order.

    rows:        their indices in the step's batch.
    query_lens:  their new tokens; key_lens: the keys each sees (its sequence length).
    token_index: int64 [sum(query_lens)] on the device: their new tokens' indices among the
                 step's tokens, row by row.
    absorbed_index: int64 [num_tokens - sum(query_lens)] on the device: the step's other
                 tokens' indices (the rows attending absorbed, then any padding), in order.
    key_rows, key_positions: int32 [sum(key_lens)] on the device: per key (row by row, position
                 0 first), its batch row and position; :func:`latent_key_slots` makes slots.
    token_span, absorbed_span: ``(start, stop)`` where ``token_index`` / ``absorbed_index`` is
                 exactly ``range(start, stop)`` (the usual step: rows continuing in the front,
                 new prompts behind them), else None. Where set, a caller takes and puts
                 those tokens' rows as slices, without a gather or a scatter.
    absorbed_bounds: ``(first, last + 1)`` of ``absorbed_index`` (``(0, 0)`` if empty): the
                 absorbed kernel's merge need not run on the tokens outside it.
    """

    rows: tuple[int, ...]
    query_lens: tuple[int, ...]
    key_lens: tuple[int, ...]
    token_index: torch.Tensor
    key_rows: torch.Tensor
    key_positions: torch.Tensor
    absorbed_index: torch.Tensor
    token_span: tuple[int, int] | None = None
    absorbed_span: tuple[int, int] | None = None
    absorbed_bounds: tuple[int, int] = (0, 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_keys(self) -> int:
        return sum(self.key_lens)


def plan_latent_prefill(meta: AttentionMetadata, min_tokens: int | None) -> LatentPrefill | None:
    """The step's rows of at least ``min_tokens`` new tokens (None: no row; also None on a
    step with draft-tree masks, which the decompressed kernel does not take). Their arrays
    are copied to the device now (their size follows the rows' keys, so they have no
    persistent buffer)."""
    if min_tokens is None or meta.tree_masks is not None:
        return None
    rows, tokens, key_rows, key_positions = [], array("i"), array("i"), array("i")
    absorbed = array("i")
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
        if q_len >= min_tokens:
            rows.append(row)
            tokens += array("i", range(start, start + q_len))
            key_rows += array("i", [row]) * seq_len
            key_positions += array("i", range(seq_len))
        else:
            absorbed += array("i", range(start, start + q_len))
        start += q_len
    if not rows:
        return None
    absorbed += array("i", range(start, meta.num_tokens))  # padding tokens
    q_lens = tuple(meta.query_lens_host[r] for r in rows)
    k_lens = tuple(meta.seq_lens_host[r] for r in rows)
    staging = DirectStaging(meta.device)
    return LatentPrefill(
        tuple(rows),
        q_lens,
        k_lens,
        staging.stage("latent_prefill_tokens", tokens).long(),
        staging.stage("latent_prefill_key_rows", key_rows),
        staging.stage("latent_prefill_key_positions", key_positions),
        staging.stage("latent_prefill_absorbed", absorbed).long(),
        token_span=_span(tokens),
        absorbed_span=_span(absorbed),
        absorbed_bounds=(absorbed[0], absorbed[-1] + 1) if absorbed else (0, 0),
    )


def _span(indices: array[int]) -> tuple[int, int] | None:
    """``(start, stop)`` if the increasing ``indices`` are exactly ``range(start, stop)``."""
    if not indices:
        return None
    start = indices[0]
    return (start, start + len(indices)) if indices[-1] - start + 1 == len(indices) else None


def latent_key_slots(prefill: LatentPrefill, meta: AttentionMetadata, num_blocks: int) -> torch.Tensor:
    """int64 [num_keys] cache slots of the decompressed rows' keys, row by row, read from the
    block tables on the device. A table entry outside ``[0, num_blocks)``, or a position past
    the table's width (never in a valid step), gives slot 0 or the table's last entry, so a
    gather never leaves the cache or the table."""
    bs, width = meta.block_size, meta.block_tables.shape[1]
    positions = prefill.key_positions.long()
    columns = (positions // bs).clamp(max=max(width - 1, 0))  # a short table reads its last entry
    blocks = meta.block_tables[prefill.key_rows.long(), columns].long()
    slots = blocks * bs + positions % bs
    return torch.where((blocks >= 0) & (blocks < num_blocks), slots, torch.zeros_like(slots))


def reference_latent_prefill(
    query: torch.Tensor,
    kv: torch.Tensor,
    key_pe: torch.Tensor,
    prefill: LatentPrefill,
    *,
    qk_nope_head_dim: int,
    scale: float,
    math_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decompressed causal attention in torch (shapes as in
    :meth:`AttentionBackend.attend_latent_prefill`); math in ``math_dtype``; written into
    ``out`` [P, H, v] when given."""
    heads, nope = query.shape[1], qk_nope_head_dim
    if out is None:
        out = torch.empty(query.shape[0], heads, kv.shape[2] - nope, dtype=query.dtype, device=query.device)
    q0 = k0 = 0
    for q_len, k_len in zip(prefill.query_lens, prefill.key_lens, strict=True):
        q = query[q0 : q0 + q_len].to(math_dtype)
        k_nope = kv[k0 : k0 + k_len, :, :nope].to(math_dtype)
        value = kv[k0 : k0 + k_len, :, nope:].to(math_dtype)
        pe = key_pe[k0 : k0 + k_len].to(math_dtype)
        scores = torch.einsum("qhn,khn->hqk", q[..., :nope], k_nope) + torch.einsum("qhe,ke->hqk", q[..., nope:], pe)
        visible = (
            torch.arange(k_len, device=q.device)[None, :]
            <= (k_len - q_len + torch.arange(q_len, device=q.device))[:, None]
        )
        p = (scores * scale).masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q0 : q0 + q_len] = torch.einsum("hqk,khv->qhv", p, value).to(query.dtype)
        q0, k0 = q0 + q_len, k0 + k_len
    return out
