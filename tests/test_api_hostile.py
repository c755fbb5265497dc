"""Hostile calls on the cache tensors, the step builder and the backend's per-layer calls: a
typed error from the documented hierarchy (KVCacheError) naming the argument, and nothing
changed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attention import ReferenceBackend
from kvcache import (
    ArgumentTypeError,
    InvalidArgumentError,
    KVCacheError,
    MetadataBuilder,
    ScheduledRow,
    allocate_kv_cache,
    load_config,
    manager_for,
    parse_config,
)

FP8 = """
model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16, dtype: float32}
cache: {block_size: 32, dtype: float8_e4m3, num_blocks: 6, device: cpu}
attention: {backend: reference}
"""


@pytest.fixture
def cache_parts() -> tuple[object, ...]:
    config = load_config("tiny-cpu")
    cache = allocate_kv_cache(config, fill=1.0)
    manager = manager_for(config, cache)
    manager.allocate("a", 3)
    backend = ReferenceBackend(config.attention_spec())
    return config, cache, manager, backend


CALLS: dict[str, tuple[Callable[..., object], type[KVCacheError], str]] = {
    "layer past the last": (lambda c, cache, m, b: cache.layer(2), InvalidArgumentError, "layer: 2"),
    "layer -1": (lambda c, cache, m, b: cache.layer(-1), InvalidArgumentError, "layer: -1"),
    "layer 1.0": (lambda c, cache, m, b: cache.layer(1.0), ArgumentTypeError, "layer"),
    "copy_blocks with a 1-tuple": (lambda c, cache, m, b: cache.copy_blocks([(1,)]), InvalidArgumentError, "copies"),
    "copy_blocks with a string pair": (
        lambda c, cache, m, b: cache.copy_blocks(["ab"]),
        InvalidArgumentError,
        r"copies\[0\]",
    ),
    "copy_blocks with a number": (lambda c, cache, m, b: cache.copy_blocks(3), ArgumentTypeError, "copies"),
    "allocate 0 blocks": (
        lambda c, cache, m, b: allocate_kv_cache(c, num_blocks=0),
        InvalidArgumentError,
        "num_blocks",
    ),
    "allocate 1.5 blocks": (
        lambda c, cache, m, b: allocate_kv_cache(c, num_blocks=1.5),
        ArgumentTypeError,
        "num_blocks",
    ),
    "builder on no device": (lambda c, cache, m, b: MetadataBuilder("nope"), InvalidArgumentError, "device: 'nope'"),
    "builder with a tuple capacity": (
        lambda c, cache, m, b: MetadataBuilder("cpu", capacity=(1, 2, 3)),
        ArgumentTypeError,
        "capacity",
    ),
    "builder with a string backend": (
        lambda c, cache, m, b: MetadataBuilder("cpu", backend="triton"),
        ArgumentTypeError,
        "backend",
    ),
    "plan rows=None": (
        lambda c, cache, m, b: MetadataBuilder("cpu", backend=b).plan(m, None),
        ArgumentTypeError,
        "rows",
    ),
    "write_kv into a tuple": (
        lambda c, cache, m, b: b.write_kv(*_kv(c, 3), (1, 2), _plan(m, b)),
        ArgumentTypeError,
        "layer",
    ),
    "attend over a tuple": (
        lambda c, cache, m, b: b.attend(torch.zeros(3, 4, 16), (1, 2), _plan(m, b)),
        ArgumentTypeError,
        "layer",
    ),
}


def _kv(config: object, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(tokens, 2, 16)
    return k, k.clone()


def _plan(manager: object, backend: ReferenceBackend) -> object:
    return MetadataBuilder("cpu", backend=backend).plan(manager, [ScheduledRow("a", 3, start=0)])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CALLS))
def test_hostile_call_raises_a_typed_error_and_changes_nothing(name: str, cache_parts: tuple[object, ...]) -> None:
    call, expected, match = CALLS[name]
    config, cache, manager, backend = cache_parts
    before = cache.storage.clone()  # type: ignore[attr-defined]
    with pytest.raises(expected, match=match):
        call(config, cache, manager, backend)
    assert torch.equal(cache.storage, before)  # type: ignore[attr-defined]


def test_set_scales_names_a_layer_outside_the_cache() -> None:
    cache = allocate_kv_cache(parse_config(FP8))
    scales = cache.scales.clone()
    for layer, error in ((2, InvalidArgumentError), (-1, InvalidArgumentError), (0.0, ArgumentTypeError)):
        with pytest.raises(error, match="layer"):
            cache.set_scales(layer, torch.ones(2), torch.ones(2))  # type: ignore[arg-type]
    assert torch.equal(cache.scales, scales)
    cache.set_scales(1, torch.full((2,), 0.5), torch.full((2,), 0.25))
    assert cache.scales[1, 0].tolist() == [0.5, 0.5] and cache.scales[1, 1].tolist() == [0.25, 0.25]
