"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over the paged cache: absorbed, or
decompressed for long rows.

Each token caches one latent per layer: ``c`` (``kv_lora_rank`` values: ``kv_a_proj_with_mqa``
then ``kv_a_layernorm``) and ``k_pe`` (``qk_rope_head_dim`` values, rotated), shared by every
head. Head ``h``'s key would be ``[W_UK[h] c, k_pe]`` and its value ``W_UV[h] c`` (``W_UK`` and
``W_UV`` are the two halves of ``kv_b_proj``), so

    q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe
    out[h]      = W_UV[h] (sum_i p_i c_i)

and attention runs over the latents themselves: MQA with one KV head of ``kv_lora_rank +
qk_rope_head_dim`` channels, the query ``[W_UK[h]^T q_nope[h], q_pe[h]]``, and the latent as
its own value (the backend's K and V views of a latent cache are one tensor,
``AttentionSpec.latent_attention``); the first ``kv_lora_rank`` channels of the output are
``sum_i p_i c_i``. Nothing per head is cached.

Rows with many new tokens (the plan's ``latent_prefill``, on eager steps) are compute-bound and
cheaper decompressed: their keys' latents go through ``kv_b_proj`` to per-head ``k_nope`` and
values, and the backend attends them as ordinary heads (:mod:`attention.latent_prefill`).

Shapes: ``T`` new tokens, ``H`` heads, ``r`` = kv_lora_rank, ``e`` = qk_rope_head_dim, ``n`` =
qk_nope_head_dim, ``v`` = v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from attention import AttentionBackend, LayerCache, StepPlan
from attention.rotary import RotaryTable
from kvcache.parallel.heads import TensorParallel

from .layers import RMSNorm, RowParallelLinear
from .shape import LlamaShape

__all__ = ["LatentAttention"]

#: transformers builds DeepSeek's two inner norms with its RMSNorm default, not rms_norm_eps.
INNER_NORM_EPS = 1e-6
#: Steps with at least this many tokens attending decompressed (``plan.latent_prefill``) run
#: the absorbed query and value products on the other tokens only, gathered and scattered
#: back (four more launches a layer, against ~110 KB a skipped token and layer at
#: DeepSeek-V2-Lite's sizes: a conservative point, not a measured crossover).
ABSORBED_SUBSET_MIN_TOKENS = 512


class LatentAttention(nn.Module):
    """MLA attention of one layer (parameter names as transformers' ``DeepseekV3Attention``,
    but for two: ``wo`` is its ``o_proj``, and ``wqkv_a`` stacks the two projections of the
    block's input along the output features, ``q_proj`` (or, with a query LoRA, ``q_a_proj``)
    then ``kv_a_proj_with_mqa``: one matrix product where transformers runs two, as vLLM's
    ``fused_qkv_a_proj``). Sharded over tensor-parallel ranks, it holds its rank's query heads
    (their rows of ``q_proj``/``q_b_proj`` and ``kv_b_proj``, their columns of ``wo``) and the
    whole latent projections: every rank writes and reads the same latent cache."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel | None = None):
        super().__init__()
        mla = shape.mla
        if mla is None:
            raise ValueError("shape.mla: LatentAttention needs the shape's latent sizes")
        tp = tp or TensorParallel()
        self.num_heads = len(tp.shard(shape.num_heads, 1).query_heads)
        self.mla = mla
        hidden, heads = shape.hidden_size, self.num_heads
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        #: wqkv_a's output features: the query (q_proj's rows, or q_a_proj's), then the latent.
        self.splits = (heads * qk if mla.q_lora_rank is None else mla.q_lora_rank, mla.latent_dim)
        self.wqkv_a = nn.Linear(hidden, sum(self.splits), bias=False)
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, INNER_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, INNER_NORM_EPS)
        #: Per head, the key half (n rows) then the value half (v rows), of r columns each.
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=False, sharded=tp.is_sharded)

    def forward(
        self, x: torch.Tensor, layer: LayerCache, backend: AttentionBackend, plan: StepPlan, rotary: RotaryTable
    ) -> torch.Tensor:
        """x: [T, hidden]; layer: this layer's latent cache; rotary: the model's table (over
        qk_rope_head_dim channels). Returns [T, hidden]."""
        m, t, heads = self.mla, x.shape[0], self.num_heads
        nope, rope, rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q, ckv = self.wqkv_a(x).split(self.splits, dim=-1)
        if self.q_a_layernorm is not None and self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(t, heads, nope + rope).split([nope, rope], dim=-1)
        c, k_pe = ckv.split([rank, rope], dim=-1)
        w = self.kv_b_proj.weight.view(heads, nope + m.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, n, r], [H, v, r]
        prefill = plan.latent_prefill
        # With many tokens attending decompressed, the absorbed products run on the others
        # only (the boundary leaves the absorbed channels of the skipped ones unset).
        subset = None if prefill is None or prefill.num_tokens < ABSORBED_SUBSET_MIN_TOKENS else prefill
        if subset is None:
            q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        else:
            q_latent = q_nope.new_empty(t, heads, rank)  # the decompressed tokens' rows: unset, unused
            index, span = subset.absorbed_index, subset.absorbed_span
            _put_rows(q_latent, index, span, torch.einsum("thn,hnr->thr", _rows(q_nope, index, span), w_uk))
        # Rotary on q_pe and k_pe, the latent [c, k_pe] into the cache, and the query
        # [q_latent, q_pe] (rotary channels as halves) in one backend call.
        query = backend.rotary_write_latent(
            q_latent, q_pe, self.kv_a_layernorm(c), k_pe, layer, plan, rotary, pairs=m.rope_interleave
        )  # [T, H, r + e]
        out = backend.attend(query, layer, plan)  # [T, H, r + e]; the first r: sum_i p_i c_i
        # Per head, [T, r] @ [r, v] into a token-major [T, H, v] (the batched product writes
        # through the transposed view: wo reads it as it is, with no copy in between).
        values = torch.empty(t, heads, m.v_head_dim, dtype=out.dtype, device=out.device)
        if subset is None:
            torch.bmm(out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2), out=values.transpose(0, 1))
        else:
            index, span = subset.absorbed_index, subset.absorbed_span
            absorbed = _rows(out, index, span)[..., :rank].transpose(0, 1)  # [H, D, r]
            _put_rows(values, index, span, torch.bmm(absorbed, w_uv.transpose(1, 2)).transpose(0, 1))
        if prefill is not None:
            # Long rows attend decompressed (attention.latent_prefill): every key's latent
            # through kv_b_proj gives each head its k_nope and value.
            keys = backend.gather_latent_keys(layer, plan)  # [K, r + e]
            kv = self.kv_b_proj(keys[:, :rank]).view(keys.shape[0], heads, nope + m.v_head_dim)
            # Their queries [q_nope, rotated q_pe]: the rotated part into q's own (q_pe is
            # spent), so the rows of q are the query, a view where the tokens are one span.
            span = prefill.token_span
            lo, hi = span if span is not None else (0, t)
            q_pe[lo:hi].copy_(query[lo:hi, :, rank:])
            q_rows = _rows(q.view(t, heads, nope + rope), prefill.token_index, span)  # [P, H, n + e]
            if span is not None:  # written in place
                backend.attend_latent_prefill(q_rows, kv, keys[:, rank:], plan, out=values[span[0] : span[1]])
            else:
                decompressed = backend.attend_latent_prefill(q_rows, kv, keys[:, rank:], plan)  # [P, H, v]
                values.index_copy_(0, prefill.token_index, decompressed.to(values.dtype))
        return self.wo(values.reshape(t, heads * m.v_head_dim))


def _rows(x: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
    """Rows ``index`` of ``x`` (dim 0): a view where they are the span ``[start, stop)``."""
    return x[span[0] : span[1]] if span is not None else x.index_select(0, index)


def _put_rows(x: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None, rows: torch.Tensor) -> None:
    """``x[index] = rows`` (dim 0), as a slice copy where the rows are the span."""
    if span is not None:
        x[span[0] : span[1]].copy_(rows)
    else:
        x.index_copy_(0, index, rows)
