"""What is specific to the flash_attn backend: its declared limits (the backend table) against
flash-attn itself, and the compute capability it needs.

The config half runs everywhere; the library half needs a CUDA GPU with flash-attn 2 installed
(e.g. the H200 test machine) and is skipped otherwise. flash_attn against the reference is
tests/test_backend_contract.py, like every backend.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attention import BACKENDS
from kvcache import ConfigError, parse_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_flash_attn = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn 2 installed"
)

CONFIG = """
model: {{num_layers: 1, num_heads: 8, num_kv_heads: 2, head_dim: {head_dim}}}
cache: {{block_size: {block_size}, dtype: {dtype}, num_blocks: 4, device: cuda}}
attention: {{backend: flash_attn}}
"""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Just inside and just outside each declared limit, and the config field that names it.
LIMITS = [
    pytest.param(
        {"block_size": 256, "head_dim": 128, "dtype": "bfloat16"},
        {"block_size": 224, "head_dim": 128, "dtype": "bfloat16"},
        "cache.block_size",
        id="block_size",
    ),
    pytest.param(
        {"block_size": 256, "head_dim": 256, "dtype": "float16"},
        {"block_size": 256, "head_dim": 264, "dtype": "float16"},
        "model.head_dim",
        id="head_dim",
    ),
    pytest.param(
        {"block_size": 256, "head_dim": 64, "dtype": "float16"},
        {"block_size": 256, "head_dim": 64, "dtype": "float32"},
        "cache.dtype",
        id="dtype",
    ),
]


def _library_call(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Call flash-attn directly, bypassing our checks."""
    from flash_attn import flash_attn_with_kvcache

    cache = torch.randn(4, block_size, 2, head_dim, dtype=dtype, device="cuda")
    q = torch.randn(1, 1, 8, head_dim, dtype=dtype, device="cuda")
    table = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    lens = torch.tensor([block_size + 1], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table, causal=True)
    torch.cuda.synchronize()


@pytest.mark.parametrize(("inside", "outside", "field"), LIMITS)
def test_config_takes_the_declared_limits(inside: dict[str, object], outside: dict[str, object], field: str) -> None:
    """Just inside a limit our config accepts; just outside it refuses, naming the field."""
    parse_config(CONFIG.format(**inside))
    with pytest.raises(ConfigError, match=field):
        parse_config(CONFIG.format(**outside))


@pytest.mark.gpu
@needs_cuda
@needs_flash_attn
@pytest.mark.parametrize(("inside", "outside", "field"), LIMITS)
def test_declared_limits_match_the_library(inside: dict[str, object], outside: dict[str, object], field: str) -> None:
    """Just inside a limit flash-attn runs; just outside it refuses too (so the limit is
    real, not ours alone)."""
    _library_call(int(inside["block_size"]), int(inside["head_dim"]), DTYPES[str(inside["dtype"])])  # type: ignore[call-overload]
    with pytest.raises(RuntimeError):
        _library_call(int(outside["block_size"]), int(outside["head_dim"]), DTYPES[str(outside["dtype"])])  # type: ignore[call-overload]


@pytest.mark.gpu
@needs_cuda
@needs_flash_attn
def test_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU here meets the declared minimum (the H200 is 9.0); an older one is refused
    with the backends to use instead."""
    from attention.flash_attn_backend import _check_compute_capability

    minimum = BACKENDS["flash_attn"].min_compute_capability
    assert minimum == (8, 0)
    assert torch.cuda.get_device_capability() >= minimum
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(RuntimeError, match=r"compute capability >= 8\.0, .* has 7\.5; use attention\.backend triton"):
        _check_compute_capability.__wrapped__(torch.device("cuda"), minimum)
