"""The "h" schemes of benchmarks/kv_quant_schemes.py (attention.kv_rotation's rotation, whose
own tests are in test_kv_rotation.py): it leaves K/V unchanged when nothing is quantized, and
what it does to the error of an int8 and an fp8 per-token quantizer on keys with outlier
channels (int8: far smaller; fp8: larger)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attention.kv_rotation import hadamard_rotation
from tests.bench_script import load_bench


def test_rotating_a_quantizer_spreads_outlier_channels() -> None:
    """Keys [batch, heads, tokens, 64] with two outlier channels (as real keys have): in the
    rotated basis int8 per token loses far less (its one step per row no longer set by the
    outliers), fp8 per token more; unquantized, the round trip is exact to float32 rounding."""
    kvq = load_bench("kv_quant_schemes")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 257, 64, generator=g)
    x[..., 5] *= 40
    x[..., 17] += 25
    r = hadamard_rotation(64)
    torch.testing.assert_close(kvq.rotated(kvq.ident, r)(x, 0), x, atol=2e-4, rtol=1e-5)

    def rel_err(fn: object) -> float:
        y = fn(x, 0)  # type: ignore[operator]
        return float(((y - x) ** 2).sum() / (x**2).sum())

    int8 = kvq.make_q("int8", "token")
    assert rel_err(kvq.rotated(int8, r)) < 0.2 * rel_err(int8)
    fp8 = kvq.make_q("e4m3", "token")
    # fp8's error is relative per element, so its outlier channels cost it little; spread over
    # every channel by the rotation, they raise the error of the others: larger, not smaller.
    assert rel_err(kvq.rotated(fp8, r)) > 2 * rel_err(fp8)
