"""Tensor-parallel shares of the model's parameters (Megatron-style): which slice of each full
tensor a rank keeps. Random weights and checkpoints both load full tensors and cut them here,
so every tensor-parallel size runs the same model."""

from __future__ import annotations

import torch

from examples.model.shape import LlamaShape
from kvcache.parallel.heads import TensorParallel

__all__ = ["shard_parameter", "shard_range"]

#: Sharded modules (suffix of the parameter's module path) -> (what is split, weight dim).
#: Dim 0 is column-parallel (output features; the bias is split with them), dim 1
#: row-parallel (input features; the bias stays whole). Everything else is replicated.
_SHARDED: dict[str, tuple[str, int]] = {
    "attn.wq": ("query heads", 0),
    "attn.wk": ("kv heads", 0),
    "attn.wv": ("kv heads", 0),
    "attn.wo": ("query heads", 1),
    "mlp.w_gate": ("mlp", 0),
    "mlp.w_up": ("mlp", 0),
    "mlp.w_down": ("mlp", 1),
}


def shard_range(name: str, shape: LlamaShape, tp: TensorParallel) -> tuple[int, int, int] | None:
    """Where rank ``tp.rank``'s share of the full parameter ``name`` (our parameter name,
    e.g. ``layers.0.attn.wq.weight``) lies: ``(dim, start, length)``, or None when the rank
    keeps the whole tensor (replicated parameters, and everything with one rank).

    wq: the rows of the rank's query heads; wk/wv: the rows of its KV heads (the same rows on
    every rank sharing a replicated KV head); wo: the columns of its query heads; gate/up:
    its rows of the MLP width; down: its columns. Biases follow their rows; wo's and down's
    bias (added after the all-reduce) stay whole.
    """
    module, _, kind = name.rpartition(".")
    rule = next((r for suffix, r in _SHARDED.items() if module.endswith(suffix)), None)
    if rule is None or not tp.is_sharded:
        return None
    split, dim = rule
    if kind == "bias" and dim == 1:
        return None
    if split == "mlp":
        width = shape.intermediate_size // tp.size
        return dim, tp.rank * width, width
    heads = tp.shard(shape.num_heads, shape.num_kv_heads)
    owned = heads.query_heads if split == "query heads" else heads.kv_heads
    d = shape.head_dim
    return (0 if kind == "bias" else dim), owned.start * d, len(owned) * d


def shard_parameter(name: str, full: torch.Tensor, shape: LlamaShape, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s share of the full parameter ``name`` (see :func:`shard_range`): a
    view of ``full``, or ``full`` itself when the rank keeps it whole."""
    where = shard_range(name, shape, tp)
    return full if where is None else full.narrow(*where)
