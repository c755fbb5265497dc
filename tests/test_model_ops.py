"""The model's fused elementwise kernels (examples.model.triton_ops) against their torch forms
(examples.model.ops on CPU, which give transformers' values), on the GPU or in Triton's CPU
interpreter: RMSNorm, residual add + RMSNorm, SiLU x up, odd widths, several dtypes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from examples.model import ops, triton_ops

pytestmark = pytest.mark.kernel

#: The kernels round at the same points as the torch forms; what is left is the order of the
#: mean's summation and rsqrt vs 1/sqrt in float32, which can move a result by one unit in
#: the last place of the dtype (2^-23 / 2^-10 / 2^-7 relative).
ULP = {torch.float32: 2.4e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _device(triton_device: str) -> torch.device:
    return torch.device(triton_device)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want.double(), atol=ULP[dtype], rtol=2 * ULP[dtype])


def _torch_forms(fn: str, *args: torch.Tensor | float) -> object:
    """The op's torch form, computed on CPU (where ops uses it) and moved back."""
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return getattr(ops, fn)(*cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (7, 40), (5, 130)])
def test_rms_norm_and_add_rms_norm(triton_device: str, dtype: torch.dtype, rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    device = _device(triton_device)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(rows, dim, generator=gen).to(dtype).to(device)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype).to(device)
    before = residual.clone()

    want = _torch_forms("rms_norm", x, weight, 1e-6)
    _close(triton_ops.rms_norm(x, weight, 1e-6).cpu(), want, dtype)  # type: ignore[arg-type]

    normed, total = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_total = _torch_forms("add_rms_norm", x, residual, weight, 1e-5)  # type: ignore[misc]
    assert torch.equal(total.cpu(), want_total), "the sum is x + residual rounded once"
    _close(normed.cpu(), want_normed, dtype)
    assert torch.equal(residual, before), "the residual input is not modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 32), (3, 1100), (6, 88)])
def test_silu_mul(triton_device: str, dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype).to(_device(triton_device))
    want = _torch_forms("silu_mul", gate_up)
    _close(triton_ops.silu_mul(gate_up).cpu(), want, dtype)  # type: ignore[arg-type]
    # A strided view (the first half of a wider projection) reads the same values.
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * width]
    _close(triton_ops.silu_mul(wide).cpu(), want, dtype)  # type: ignore[arg-type]


def test_empty_rows(triton_device: str) -> None:
    device = _device(triton_device)
    x = torch.empty(0, 16, device=device)
    assert triton_ops.rms_norm(x, torch.ones(16, device=device), 1e-6).shape == (0, 16)
    assert triton_ops.silu_mul(torch.empty(0, 32, device=device)).shape == (0, 16)


def test_ops_use_the_kernels_on_cuda_only() -> None:
    assert not ops.fused_ops_available(torch.device("cpu"))
    assert ops.fused_ops_available(torch.device("cuda")) == (importlib_triton() is not None)


def importlib_triton() -> object:
    import importlib.util

    return importlib.util.find_spec("triton")
