"""The layers of one transformer block: RMSNorm, GQA attention over the paged cache, the
SwiGLU MLP, and the row-parallel linear layer tensor parallelism needs.

Shapes: ``T`` is the step's number of new tokens (all rows together), ``H``/``KVH``
query/KV heads, ``D`` the head dim (heads per rank, when sharded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attention import AttentionBackend, LayerCache, StepPlan
from attention.rotary import RotaryTable
from kvcache.parallel.heads import TensorParallel

from .ops import add_rms_norm, gelu_tanh_mul, offset_rms_norm, rms_norm, silu_mul
from .shape import LlamaShape

__all__ = ["MLP", "AllReduce", "Attention", "Block", "RMSNorm", "RowParallelLinear"]

#: Sums a tensor over the tensor-parallel ranks, in place, and returns it.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, with the statistics in float32 whatever the model dtype
    (:mod:`examples.model.ops`: one kernel on a GPU). ``offset`` (Gemma): scaled by
    ``1 + weight`` in float32 instead, with the weight starting at 0."""

    def __init__(self, dim: int, eps: float, *, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim], same dtype."""
        if self.offset:
            return offset_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm in one: (norm(x + residual), x + residual)."""
        if self.offset:
            total = x + residual
            return offset_rms_norm(total, self.weight, self.eps), total
        return add_rms_norm(x, residual, self.weight, self.eps)


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the tensor-parallel ranks: each
    rank multiplies its slice of the input by its columns of the weight, one all-reduce sums
    the partial outputs, then the (full, replicated) bias is added once.

    With one rank it is exactly ``nn.Linear``. Sharded, it refuses to run before
    :meth:`Llama.connect` gives it the all-reduce (a partial sum would be silently wrong).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, sharded: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.sharded = sharded
        self.all_reduce: AllReduce | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features of this rank] -> [T, out_features], the same on every rank."""
        if not self.sharded:
            return super().forward(x)
        if self.all_reduce is None:
            raise RuntimeError("a tensor-parallel model needs its all-reduce: call model.connect(collective) first")
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class Attention(nn.Module):
    """GQA attention over the paged cache: one fused q/k/v projection, then rotary, the cache
    write and the rotated query in one backend call, then attention over the cache. Sharded,
    it holds this rank's query heads and KV heads only."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        shard = tp.shard(shape.num_heads, shape.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            len(shard.query_heads),
            len(shard.kv_heads),
            shape.head_dim,
        )
        hidden, q_dim, kv_dim = shape.hidden_size, self.num_heads * shape.head_dim, self.num_kv_heads * shape.head_dim
        self.splits = (q_dim, kv_dim, kv_dim)
        #: q, k and v stacked along the output features (examples.model.sharding).
        self.wqkv = nn.Linear(hidden, sum(self.splits), bias=shape.qkv_bias)
        self.wo = RowParallelLinear(q_dim, hidden, bias=shape.o_bias, sharded=tp.is_sharded)
        #: Per-head norms of q and k before rotary (Gemma-3), else None.
        self.q_norm = RMSNorm(shape.head_dim, shape.norm_eps, offset=True) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.norm_eps, offset=True) if shape.qk_norm else None

    def forward(
        self, x: torch.Tensor, layer: LayerCache, backend: AttentionBackend, plan: StepPlan, rotary: RotaryTable
    ) -> torch.Tensor:
        """x: [T, hidden]; layer: this layer's cache; rotary: the model's table. Returns
        [T, hidden]."""
        t = x.shape[0]
        q, k, v = self.wqkv(x).split(self.splits, dim=-1)
        q, k = q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The cache holds K after rotary, so cached positions never need rotating again.
        query = backend.rotary_write_kv(q, k, v.view(t, self.num_kv_heads, self.head_dim), layer, plan, rotary)
        out = backend.attend(query, layer, plan)  # [T, H, D]
        return self.wo(out.view(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one projection (GeGLU with
    ``mlp_activation="gelu_tanh"``). Sharded, it holds this rank's ``intermediate_size /
    tp.size`` channels."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        width = shape.intermediate_size // tp.size
        #: gate then up, stacked along the output features.
        self.w_gate_up = nn.Linear(shape.hidden_size, 2 * width, bias=shape.mlp_bias)
        self.w_down = RowParallelLinear(width, shape.hidden_size, bias=shape.mlp_bias, sharded=tp.is_sharded)
        self.activation_mul = gelu_tanh_mul if shape.mlp_activation == "gelu_tanh" else silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.w_down(self.activation_mul(self.w_gate_up(x)))


class Block(nn.Module):
    """One pre-norm transformer layer. The residual stream is carried beside the layer's
    output, so each residual add runs inside the next norm (:meth:`RMSNorm.add`). With
    ``sandwich_norms`` (Gemma) the attention and MLP outputs are normalised as well before
    they join the residual stream."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        def norm() -> RMSNorm:
            return RMSNorm(shape.hidden_size, shape.norm_eps, offset=shape.norm_offset)

        self.attn_norm = norm()
        self.attn: nn.Module
        if shape.mla is not None:
            from .latent_attention import LatentAttention  # it builds on this module's norms

            self.attn = LatentAttention(shape, tp)
        else:
            self.attn = Attention(shape, tp)
        self.mlp_norm = norm()
        self.mlp = MLP(shape, tp)
        self.attn_post_norm = norm() if shape.sandwich_norms else None
        self.mlp_post_norm = norm() if shape.sandwich_norms else None

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        layer: LayerCache,
        backend: AttentionBackend,
        plan: StepPlan,
        rotary: RotaryTable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """delta: the previous layer's output, still to be added to ``residual`` (None for the
        first layer, whose ``residual`` is the embedding); both [T, hidden]. Returns this
        layer's MLP output and the residual stream it is to be added to."""
        if delta is None:
            x = self.attn_norm(residual)
        else:
            x, residual = self.attn_norm.add(delta, residual)
        attended = self.attn(x, layer, backend, plan, rotary)
        if self.attn_post_norm is not None:
            attended = self.attn_post_norm(attended)
        x, residual = self.mlp_norm.add(attended, residual)
        out = self.mlp(x)
        return (out if self.mlp_post_norm is None else self.mlp_post_norm(out)), residual
