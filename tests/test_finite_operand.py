"""``paging.finite_operand`` and ``paging.finite_e4m3_operand``, the guards that keep a
token-major V tile's stale slots (any bits) from turning p = 0 into NaN: every output finite,
every finite input unchanged, bit for bit. Under the interpreter on a CPU, compiled on a GPU
(where fp16 takes packed min / max)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import finite_e4m3_operand, finite_operand, kernels_interpreted

pytestmark = pytest.mark.kernel

DEVICE = "cpu" if kernels_interpreted() else "cuda"


@triton.jit
def _finite_kernel(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(out_ptr + i, finite_operand(tl.load(x_ptr + i)))


@triton.jit
def _finite_e4m3_kernel(x_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(out_ptr + i, finite_e4m3_operand(tl.load(x_ptr + i).to(tl.float16)))


def test_e4m3_guard_fixes_nan_and_keeps_every_other_byte() -> None:
    """All 256 float8_e4m3fn bytes, converted to fp16 in the kernel as the decode loop does:
    the two NaN bytes (0x7F, 0xFF) come out finite (65504 on a GPU), the 254 others keep
    their exact value."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.view(torch.float8_e4m3fn)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _finite_e4m3_kernel[(1,)](x.to(DEVICE), out, N=256)
    out = out.cpu()
    expected = x.to(torch.float16)
    nan = torch.isnan(expected)
    assert nan.sum() == 2 and set(codes[nan].tolist()) == {0x7F, 0xFF}
    assert torch.isfinite(out).all(), out[~torch.isfinite(out)]
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    # The GPU converts the NaN bytes to fp16 NaN, which the guard makes 65504; the interpreter's
    # conversion reads them as +-480 (finite already), which it keeps.
    fixed = torch.tensor([480.0, -480.0], dtype=torch.float16) if kernels_interpreted() else 65504.0
    assert torch.equal(out[nan], torch.as_tensor(fixed, dtype=torch.float16).expand(2))


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
