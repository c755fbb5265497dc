"""MLA's boundary before attention: what :meth:`AttentionBackend.rotary_write_latent` takes,
checks and, composed from torch ops, computes.

DeepSeek's attention block (``examples.model.latent_attention``) brings, per new token, the
absorbed query of each head (``W_UK[h]^T q_nope[h]``, ``r`` = latent_rank channels), each
head's unrotated rotary query ``q_pe`` (``e`` channels), the normalised latent ``c`` (``r``)
and the shared unrotated rotary key ``k_pe`` (``e``). The boundary rotates ``q_pe`` and
``k_pe`` at the step's positions, writes ``[c, rotate(k_pe)]`` into the token's cache slot
and returns the attention query ``[absorbed, rotate(q_pe)]``. With ``pairs`` the rotary
channels come interleaved ``(x0, x1), (x2, x3), ...`` (DeepSeek's ``rope_interleave``): they
are read as halves ``(x0, x2, ...), (x1, x3, ...)`` for q and k alike (every q . k is
unchanged), and both leave as halves.

Shapes: ``T`` new tokens, ``H`` heads, ``r`` latent rank, ``e`` the rotary channels
(``spec.head_dim - r``).
"""

from __future__ import annotations

import torch

from attention.checks import check_tensor
from attention.errors import InvalidArgumentError, UnsupportedSettingError
from attention.rotary import RotaryTable, rotate
from attention.spec import AttentionSpec

__all__ = ["check_latent_boundary", "compose_latent_boundary", "pairs_to_halves"]


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary channels ``(x0, x1), (x2, x3), ...`` reordered as halves ``(x0, x2,
    ..., x1, x3, ...)``, the layout :func:`attention.rotary.rotate` turns: [..., e] -> a new
    [..., e]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def check_latent_boundary(
    spec: AttentionSpec,
    compute_dtype: torch.dtype,
    num_tokens: int,
    device: torch.device,
    query_latent: object,
    query_pe: object,
    latent: object,
    key_pe: object,
) -> None:
    """Raise (naming the argument, what it got and what it needs) unless the four inputs fit
    ``spec``'s latent for a step of ``num_tokens`` tokens on ``device``: query_latent [T, H,
    r], query_pe [T, H, e], latent [T, r], key_pe [T, e], all ``compute_dtype`` with unit
    stride along channels. UnsupportedSettingError for a spec without a latent."""
    rank = spec.latent_rank
    if rank is None:
        raise UnsupportedSettingError(
            "rotary_write_latent: this spec has no latent (latent_rank None); an ordinary cache takes rotary_write_kv"
        )
    rope, heads = spec.head_dim - rank, spec.num_heads
    shapes = {
        "query_latent": (num_tokens, heads, rank),
        "query_pe": (num_tokens, heads, rope),
        "latent": (num_tokens, rank),
        "key_pe": (num_tokens, rope),
    }
    given = {"query_latent": query_latent, "query_pe": query_pe, "latent": latent, "key_pe": key_pe}
    for name, shape in shapes.items():
        x = check_tensor(name, given[name], shape=shape, dtype=compute_dtype, device=device)
        if num_tokens and x.stride(-1) != 1:
            raise InvalidArgumentError(f"{name}: expected unit stride along channels, got strides {x.stride()}")


def compose_latent_boundary(
    query_latent: torch.Tensor,
    query_pe: torch.Tensor,
    latent: torch.Tensor,
    key_pe: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryTable,
    *,
    pairs: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The boundary in torch ops: (query [T, H, r + e] contiguous, the cache rows [T, 1, r + e]
    to write), both in the inputs' dtype, the rotations float32 rounded once
    (:func:`attention.rotary.rotate`)."""
    if pairs:
        query_pe, key_pe = pairs_to_halves(query_pe), pairs_to_halves(key_pe)
    rotated_q = rotate(query_pe, positions, rotary)  # [T, H, e]
    rotated_k = rotate(key_pe.unsqueeze(1), positions, rotary)  # [T, 1, e]
    rows = torch.cat((latent.unsqueeze(1), rotated_k), dim=-1)
    return torch.cat((query_latent, rotated_q), dim=-1), rows
