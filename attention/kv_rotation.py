"""K and V stored in a rotated basis: an 8-bit cache's outlier channels spread over every channel.

A real model's keys carry a few channels far larger than the rest, so one int8 step per row
(per token and KV head) is set by them and the other channels keep few levels. An orthonormal
rotation ``R`` of the head dimension mixes every channel into every other: the cache stores
``k @ R`` and ``v @ R``; attention takes ``q @ R`` (scores are unchanged: ``(q R) . (k R) =
q . k``) and rotates its output back, ``o @ R^T``, since ``softmax(.) (V R) = (softmax(.) V) R``.
Exact in exact arithmetic; what changes is only what the quantizer sees. The rotation is
QuaRot's (arXiv:2404.00456): Sylvester's Hadamard matrix over ``sqrt(head_dim)`` with its rows'
signs flipped at random, from a fixed seed, so every process builds the same one.

Measured on SmolLM2-135M-Instruct (``benchmarks/kv_quant_schemes.py``, teacher-forced, 64
prompts x 64 tokens, ``benchmarks/results/kv-quant-hadamard-2026-12-05.json``), mean KL of the
next-token distributions against the bf16 cache: int8 per token 2.78e-3, with keys centred
2.41e-3, rotated 2.05e-3 (fp32 compute's own 1.10e-3); fp8 with static per-head scales 8.91e-3,
rotated 7.70e-3. fp8 with per-token scales gains nothing (its error is relative per element).
Centring the keys as well adds nothing to speak of (2.02e-3, a paired difference of -3.8e-5,
95% CI [-1.5e-4, 1.0e-4]: ``kv-quant-hadamard-centred-2026-12-05.json``), so a cache takes one
or the other.

Applied by :class:`attention.base.AttentionBackend` around the backends' kernels, in the
compute dtype (the matrix rounded to it once): the query and the output on every backend; K
and V too, except where the fused rotary + cache-write kernel multiplies them itself
(``rotates_kv_in_rotary_write``: the Triton backend, head_dim up to 128). On the H200 an 8B-shaped model's
128-row decode iteration over an int8 cache took 8.26 ms rotated against 7.92 unrotated with K
and V in the fused kernel, 9.82 ms with all four products around the kernels
(``benchmarks/results/e2e-int8-rotation-fused-2026-12-05.json``, ``-composed-bf16-``).
"""

from __future__ import annotations

import torch

from attention.errors import InvalidArgumentError

__all__ = ["ROTATIONS", "hadamard_rotation", "rotate", "rotate_back"]

#: The ``cache.kv_rotation`` names.
ROTATIONS = ("none", "hadamard")
#: The seed of the rotation's signs: fixed, so every process and rank builds the same one.
SEED = 0


def hadamard_rotation(head_dim: int, *, device: torch.device | str | None = None, seed: int = SEED) -> torch.Tensor:
    """fp32 ``[head_dim, head_dim]`` orthonormal: Sylvester's Hadamard matrix over
    ``sqrt(head_dim)``, row ``i`` negated where a seeded coin says so. Raises
    InvalidArgumentError unless ``head_dim`` is a power of two."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or head_dim & (head_dim - 1):
        raise InvalidArgumentError(f"head_dim: {head_dim!r}; a Hadamard rotation needs a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return ((signs[:, None].float() * h) / head_dim**0.5).to(device)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation`` over the last dimension, in ``x``'s dtype: one product when
    ``rotation`` has that dtype (the backends pass it so), else computed in float32."""
    if rotation.dtype == x.dtype:
        return x @ rotation
    return (x.float() @ rotation.float()).to(x.dtype)


def rotate_back(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation^T`` (the inverse of :func:`rotate`), as :func:`rotate` computes it."""
    return rotate(x, rotation.T)
