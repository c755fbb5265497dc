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
from examples.model.rotary import apply_rotary
from examples.model.shape import LlamaShape
from kvcache.parallel.heads import TensorParallel

__all__ = ["MLP", "AllReduce", "Attention", "Block", "RMSNorm", "RowParallelLinear"]

#: Sums a tensor over the tensor-parallel ranks, in place, and returns it.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, with the statistics in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] -> [T, dim], same dtype."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


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
    """GQA attention over the paged cache: write this step's K/V, then attend causally.
    Sharded, it holds this rank's query heads and KV heads only."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        shard = tp.shard(shape.num_heads, shape.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            len(shard.query_heads),
            len(shard.kv_heads),
            shape.head_dim,
        )
        hidden, q_dim, kv_dim = shape.hidden_size, self.num_heads * shape.head_dim, self.num_kv_heads * shape.head_dim
        self.wq = nn.Linear(hidden, q_dim, bias=shape.qkv_bias)
        self.wk = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.wv = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.wo = RowParallelLinear(q_dim, hidden, bias=shape.o_bias, sharded=tp.is_sharded)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerCache,
        backend: AttentionBackend,
        plan: StepPlan,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D]; layer: this layer's cache. Returns [T, hidden]."""
        t = x.shape[0]
        q = apply_rotary(self.wq(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(t, self.num_kv_heads, self.head_dim)
        # The cache holds K after rotary, so cached positions never need rotating again.
        backend.write_kv(k, v, layer, plan)
        out = backend.attend(q, layer, plan)  # [T, H, D]
        return self.wo(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. Sharded, it holds this rank's
    ``intermediate_size / tp.size`` channels."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        width = shape.intermediate_size // tp.size
        self.w_gate = nn.Linear(shape.hidden_size, width, bias=shape.mlp_bias)
        self.w_up = nn.Linear(shape.hidden_size, width, bias=shape.mlp_bias)
        self.w_down = RowParallelLinear(width, shape.hidden_size, bias=shape.mlp_bias, sharded=tp.is_sharded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.attn = Attention(shape, tp)
        self.mlp_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = MLP(shape, tp)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerCache,
        backend: AttentionBackend,
        plan: StepPlan,
    ) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; the cache arguments are as in :class:`Attention`."""
        h = h + self.attn(self.attn_norm(h), cos, sin, layer, backend, plan)
        return h + self.mlp(self.mlp_norm(h))
