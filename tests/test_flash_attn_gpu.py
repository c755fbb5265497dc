"""flash_attn backend against the reference, and its declared limits against the library.

Runs on a CUDA GPU with flash-attn 2 installed (e.g. the H200 test machine); skipped otherwise.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attention import get_backend
from kvcache import ConfigError, parse_config
from tests.paged_case import make_case, reference_output, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn 2 installed"),
]

# bf16 keeps 8 bits of mantissa: a softmax-weighted sum over many tokens lands around 4e-3
# relative to a float64 oracle; fp16 (11 bits) about 8x tighter.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

MIXED = [(0, 1), (0, 31), (0, 97), (255, 1), (256, 1), (257, 1), (600, 33), (1000, 1), (0, 513), (31, 300)]
DECODE = [(c, 1) for c in (0, 1, 31, 255, 256, 257, 1000, 2047, 3001)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows", [MIXED, DECODE], ids=["mixed", "decode"])
def test_matches_reference(dtype: torch.dtype, group: int, head_dim: int, rows: list[tuple[int, int]]) -> None:
    kv_heads = 2
    case = make_case(rows, heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim, block_size=256,
                     dtype=dtype, device="cuda", seed=group * 1000 + head_dim)
    backend = get_backend("flash_attn")
    out = backend.attend(case.query, case.k_cache, case.v_cache, backend.plan(case.meta))
    assert rel_err(out, reference_output(case)) < TOLERANCE[dtype]


def test_block_512_and_write_kv() -> None:
    case = make_case(MIXED, heads=8, kv_heads=2, head_dim=128, block_size=512, dtype=torch.bfloat16, device="cuda")
    backend = get_backend("flash_attn")
    k_before = case.k_cache.clone()
    # Rewrite the new tokens' K/V through the backend: the cache must not change at all.
    backend.write_kv(case.new_key, case.new_value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    assert torch.equal(k_before.nan_to_num(7.0), case.k_cache.nan_to_num(7.0))
    out = backend.attend(case.query, case.k_cache, case.v_cache, backend.plan(case.meta))
    assert rel_err(out, reference_output(case)) < TOLERANCE[torch.bfloat16]


def test_write_kv_skips_padding_and_touches_nothing_else() -> None:
    backend = get_backend("flash_attn")
    k = torch.full((3, 256, 2, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    v = k.clone()
    slots = torch.tensor([5, -1, 700, 256], device="cuda")
    key = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    backend.write_kv(key, value, k, v, slots)
    flat = k.view(-1, 2, 64)
    assert torch.equal(flat[[5, 700, 256]], key[[0, 2, 3]])
    assert torch.equal(v.view(-1, 2, 64)[[5, 700, 256]], value[[0, 2, 3]])
    assert int((~torch.isnan(flat)).any(-1).any(-1).sum()) == 3


CONFIG = """
model: {{num_layers: 1, num_heads: 8, num_kv_heads: 2, head_dim: {head_dim}}}
cache: {{block_size: {block_size}, dtype: {dtype}, num_blocks: 4, device: cuda}}
attention: {{backend: flash_attn}}
"""


def _library_call(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Call flash-attn directly, bypassing our checks."""
    from flash_attn import flash_attn_with_kvcache

    cache = torch.randn(4, block_size, 2, head_dim, dtype=dtype, device="cuda")
    q = torch.randn(1, 1, 8, head_dim, dtype=dtype, device="cuda")
    table = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    lens = torch.tensor([block_size + 1], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table, causal=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize(
    ("inside", "outside", "field"),
    [
        ({"block_size": 256, "head_dim": 128, "dtype": "bfloat16"},
         {"block_size": 224, "head_dim": 128, "dtype": "bfloat16"}, "cache.block_size"),
        ({"block_size": 256, "head_dim": 256, "dtype": "float16"},
         {"block_size": 256, "head_dim": 264, "dtype": "float16"}, "model.head_dim"),
        ({"block_size": 256, "head_dim": 64, "dtype": "float16"},
         {"block_size": 256, "head_dim": 64, "dtype": "float32"}, "cache.dtype"),
    ],
    ids=["block_size", "head_dim", "dtype"],
)
def test_declared_limits_match_the_library(inside: dict[str, object], outside: dict[str, object], field: str) -> None:
    """Just inside a limit: our config accepts and flash-attn runs. Just outside: our config
    refuses, naming the field, and flash-attn itself refuses too (so the limit is real)."""
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    parse_config(CONFIG.format(**inside))
    _library_call(int(inside["block_size"]), int(inside["head_dim"]), dtypes[str(inside["dtype"])])  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match=field):
        parse_config(CONFIG.format(**outside))
    with pytest.raises(RuntimeError):
        _library_call(int(outside["block_size"]), int(outside["head_dim"]), dtypes[str(outside["dtype"])])  # type: ignore[call-overload]


def test_compute_capability_is_at_least_the_declared_minimum() -> None:
    """The H200 is 9.0; the declared minimum (8.0, Ampere) cannot be probed from below here."""
    assert torch.cuda.get_device_capability() >= (8, 0)
