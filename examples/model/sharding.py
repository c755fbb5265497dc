"""Tensor-parallel shares of the model's parameters (Megatron-style): which slices of each full
tensor a rank keeps. Random weights and checkpoints both load full tensors and cut them here,
so every tensor-parallel size runs the same model.

Two projections are *fused*: ``attn.wqkv`` is q, k and v stacked along the output features
(dim 0), ``mlp.w_gate_up`` is gate then up. A fused tensor is made of *parts*, each split over
the ranks by its own rule, and a rank's fused parameter stacks its share of every part in the
same order (its q heads, then its k heads, then its v heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.parallel.heads import TensorParallel

from .shape import LlamaShape

__all__ = ["Part", "param_parts", "shard_parameter"]

#: What a part of a parameter is split by over the ranks.
#: "query heads" / "kv heads": the rows (or columns) of the rank's heads; "mlp": its share of
#: the MLP width; None: not split (every rank keeps it whole).
Split = str | None

#: Sharded modules (suffix of the parameter's module path) -> (weight dim, the split of each
#: part along it, in order). Dim 0 is column-parallel (output features; the bias is split with
#: them), dim 1 row-parallel (input features; the bias stays whole). Everything else is
#: replicated.
_SHARDED: dict[str, tuple[int, tuple[Split, ...]]] = {
    "attn.wqkv": (0, ("query heads", "kv heads", "kv heads")),
    "attn.wo": (1, ("query heads",)),
    "mlp.w_gate_up": (0, ("mlp", "mlp")),
    "mlp.w_down": (1, ("mlp",)),
}


#: Latent attention (MLA): the per-head projections split by query heads, each head's rows (or
#: columns) as wide as that projection's part per head; the latent projections stay whole.
#: ``attn.wqkv_a`` (see :func:`_mla_rules`) is q_proj's rows (by query heads; with a query
#: LoRA q_a_proj's, whole) then kv_a_proj_with_mqa's (whole).
_SHARDED_MLA: dict[str, tuple[int, tuple[Split, ...]]] = {
    "attn.q_b_proj": (0, ("query heads",)),
    "attn.kv_b_proj": (0, ("latent kv_b heads",)),
    "attn.wo": (1, ("latent value heads",)),
}


def _mla_rules(shape: LlamaShape) -> dict[str, tuple[int, tuple[Split, ...]]]:
    """The latent-attention block's rules for ``shape`` (its fused input projection's query
    part is split by heads only without a query LoRA)."""
    query: Split = "query heads" if shape.mla is None or shape.mla.q_lora_rank is None else "q lora"
    return {"attn.wqkv_a": (0, (query, "latent")), **_SHARDED_MLA}


@dataclass(frozen=True)
class Part:
    """One part of a parameter and a rank's share of it.

    dim:       the dimension it is cut along (and, for a fused parameter, stacked along).
    full:      its length along ``dim`` in the full tensor.
    start, length: the rank's share of it along ``dim`` (``0, full``: the whole part).
    offset:    where that share starts along ``dim`` in the rank's parameter.
    """

    dim: int
    full: int
    start: int
    length: int
    offset: int


def _head_width(split: Split, shape: LlamaShape) -> int:
    """Rows (or columns) per head of a part split by heads."""
    mla = shape.mla
    if split == "latent kv_b heads" and mla is not None:
        return mla.qk_nope_head_dim + mla.v_head_dim
    if split == "latent value heads" and mla is not None:
        return mla.v_head_dim
    return shape.head_dim


#: Parts every rank keeps whole: the latent (MLA) and a query LoRA's down-projection.
_WHOLE: tuple[Split, ...] = ("latent", "q lora")


def _part_length(split: Split, shape: LlamaShape) -> int:
    mla = shape.mla
    if split == "latent" and mla is not None:
        return mla.latent_dim
    if split == "q lora" and mla is not None and mla.q_lora_rank is not None:
        return mla.q_lora_rank
    if split in ("query heads", "latent kv_b heads", "latent value heads"):
        return shape.num_heads * _head_width(split, shape)
    if split == "kv heads":
        return shape.num_kv_heads * shape.head_dim
    return shape.intermediate_size


def _share(split: Split, shape: LlamaShape, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of rank ``tp.rank``'s share of a part split by ``split``."""
    if split is None or split in _WHOLE or not tp.is_sharded:
        return 0, _part_length(split, shape)
    if split == "mlp":
        width = shape.intermediate_size // tp.size
        return tp.rank * width, width
    heads = tp.shard(shape.num_heads, 1 if shape.mla is not None else shape.num_kv_heads)
    owned = heads.kv_heads if split == "kv heads" else heads.query_heads
    width = _head_width(split, shape)
    return owned.start * width, len(owned) * width


def param_parts(name: str, full_shape: tuple[int, ...], shape: LlamaShape, tp: TensorParallel) -> list[Part]:
    """The parts of parameter ``name`` (ours, e.g. ``layers.0.attn.wqkv.weight``) whose full
    tensor has ``full_shape``, each with rank ``tp.rank``'s share; one part covering the whole
    tensor for an unfused, unsplit parameter.

    wqkv: the rows of the rank's query heads, then of its KV heads for k and for v (the same
    rows on every rank sharing a replicated KV head); wo: the columns of its query heads;
    gate_up: its rows of the MLP width, of gate then of up; down: its columns. Biases follow
    their rows; wo's and down's bias (added after the all-reduce) stay whole. Latent
    attention: the rows of the rank's query heads of q_proj (the first part of wqkv_a) and
    q_b_proj (``head_dim`` each) and kv_b_proj (``qk_nope_head_dim + v_head_dim`` each),
    wo's columns (``v_head_dim`` each); kv_a_proj_with_mqa (wqkv_a's last part), q_a_proj
    (its first, with a query LoRA) and the two inner norms stay whole.
    """
    module, _, kind = name.rpartition(".")
    rules = _mla_rules(shape) if shape.mla is not None and ".attn." in name else _SHARDED
    rule = next((r for suffix, r in rules.items() if module.endswith(suffix)), None)
    if rule is None or (kind == "bias" and rule[0] == 1):
        return [Part(0, full_shape[0], 0, full_shape[0], 0)] if full_shape else []
    dim, splits = rule
    dim = 0 if kind == "bias" else dim
    parts, offset = [], 0
    for split in splits:
        start, length = _share(split, shape, tp)
        parts.append(Part(dim, _part_length(split, shape), start, length, offset))
        offset += length
    return parts


def shard_parameter(name: str, full: torch.Tensor, shape: LlamaShape, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s share of the full parameter ``name`` (see :func:`param_parts`):
    ``full`` itself when the rank keeps it whole, a view when its share is one slice, else a
    new tensor stacking its slices."""
    parts = param_parts(name, tuple(full.shape), shape, tp)
    if len(parts) <= 1 and (not parts or (parts[0].start, parts[0].length) == (0, parts[0].full)):
        return full
    pieces, begin = [], 0
    for part in parts:
        pieces.append(full.narrow(part.dim, begin + part.start, part.length))
        begin += part.full
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=parts[0].dim)
