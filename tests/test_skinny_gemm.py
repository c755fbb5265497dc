"""The skinny matrix product for decode steps (examples.model.skinny_gemm) against float64, in
Triton's CPU interpreter (tests/conftest.py) on small shapes: every split of K, partial
column tiles, 1-17 rows; split results are the same bits every run (the last program adds
the partials in slice order) and the counters are left at zero for the next launch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from examples.model.skinny_gemm import (
    _WORKSPACE,
    SkinnyConfig,
    default_skinny_config,
    skinny_linear,
    skinny_supported,
)


@pytest.mark.parametrize(
    ("rows", "n", "k", "config"),
    [
        (1, 64, 128, SkinnyConfig(32, 64, 1)),
        (5, 96, 256, SkinnyConfig(32, 128, 2)),
        (16, 50, 512, SkinnyConfig(32, 64, 4)),  # a partial last column tile
        (17, 64, 512, SkinnyConfig(64, 64, 8)),  # 17 rows: a 32-row tile
    ],
)
def test_matches_float64(rows: int, n: int, k: int, config: SkinnyConfig, triton_device: str) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(torch.float16).to(triton_device)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.float16).to(triton_device)
    out = skinny_linear(x, w, config)
    ref = x.double() @ w.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    again = skinny_linear(x, w, config)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "split-K sums in a fixed order"
    if config.split_k > 1:
        _, counters = _WORKSPACE.get(x.device, n, max(16, 1 << (rows - 1).bit_length()), config)
        assert counters.tolist() == [0] * counters.numel(), "the last program resets its tile's counter"


def test_default_config_splits_until_every_sm_has_two_programs() -> None:
    assert default_skinny_config(128, 4096, 4096, 132) == SkinnyConfig(64, 128, 8)  # 64 tiles x 8 >= 264
    assert default_skinny_config(128, 28672, 4096, 132) == SkinnyConfig(64, 128, 1)  # 448 tiles of 64
    assert default_skinny_config(128, 4096, 14336, 132) == SkinnyConfig(64, 128, 8)
    assert default_skinny_config(129, 4096, 4096, 132) is None  # more rows than one tile
    assert default_skinny_config(8, 4096, 4000, 132) is None  # K not a multiple of 128


def test_supported_only_where_it_applies() -> None:
    x, w = torch.zeros(4, 256, dtype=torch.float16), torch.zeros(64, 256, dtype=torch.float16)
    assert not skinny_supported(x, w), "CPU tensors take F.linear"
    with pytest.raises(ValueError, match="split_k"):
        skinny_linear(x, w, SkinnyConfig(64, 128, 4))  # 256 is not a multiple of 4 x 128
