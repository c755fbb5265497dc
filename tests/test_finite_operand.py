"""``paging.finite_operand``, the guard that keeps a token-major V tile's stale slots (any bits)
from turning p = 0 into NaN: every output finite, every finite input unchanged, bit for bit.
Under the interpreter on a CPU, compiled on a GPU (where fp16 takes packed min / max)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import finite_operand, kernels_interpreted

DEVICE = "cpu" if kernels_interpreted() else "cuda"


@triton.jit
def _finite_kernel(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(out_ptr + i, finite_operand(tl.load(x_ptr + i)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_output_finite_and_finite_inputs_unchanged(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    special = [float("nan"), -float("nan"), float("inf"), -float("inf"), info.max, -info.max, info.tiny, 0.0, -0.0]
    special += [info.tiny / 4, -info.tiny / 8]  # subnormals
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(special), torch.randn(256 - len(special), generator=gen) * 100]).to(dtype)
    x = x[torch.randperm(256, generator=gen)].to(DEVICE)
    out = torch.empty_like(x)
    _finite_kernel[(1,)](x, out, N=256)
    out, x = out.cpu(), x.cpu()
    assert torch.isfinite(out).all(), out[~torch.isfinite(out)]
    keep = torch.isfinite(x)
    bits = torch.int16
    assert torch.equal(out[keep].view(bits), x[keep].view(bits))
    assert (~keep).sum() == 4
