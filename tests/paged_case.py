"""Random paged-attention cases shared by the backend tests.

A case is a batch of rows, each with ``context`` cached tokens and ``new`` tokens this step,
laid out through a real BlockManager whose free queue was scrambled (block ids shuffled and
non-contiguous), in a NaN-poisoned cache with one NaN block on each side of it (a kernel that
reads an unwritten slot, a padding entry, or past either end of the cache produces NaN, which
never passes a comparison). The K/V of every cached token is written by the reference backend,
so a backend under test sees exactly what a serving engine would have written; the step's
new K/V is left for the backend under test to write.

``BACKENDS_UNDER_TEST`` lists every backend available here (from the backend table), for the
suites parametrized over backends.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from dataclasses import dataclass, field

import pytest
import torch

from attention import BACKENDS, AttentionMetadata, AttentionSpec, LayerCache, ReferenceBackend, get_backend
from attention.base import AttentionBackend
from attention.dtypes import dtype_info, dtype_name
from attention.quantize import dequantize
from attention.token_scales import layer_views
from attention.value_layout import token_major_view, uses_token_major_values
from kvcache import BlockManager, MetadataBuilder, ScheduledRow

# Element-wise tolerances against a float64 oracle on the same (rounded) inputs; outputs are
# O(1). fp32: summation order (~1e-6; on a GPU also tf32x3 products, ~2^-21 each). fp16: P is
# rounded to 11 bits before the P@V product and the output is stored in fp16 (~5e-4 relative
# each). bf16: the same with 8 bits (~4e-3 each). Split rows add nothing (partials and their
# merge stay in fp32); fp8 caches are compared with the dequantised values, so they add no
# error beyond the query's dtype.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# Norm-relative error of the GPU-sized cases (rows of thousands of tokens). bf16 keeps 8
# mantissa bits (P and the output are rounded to it: ~4e-3 relative each); fp16 keeps 11, about
# 8x tighter. fp32 runs its products as "tf32x3" (~2^-21 each) with approximate exp2: ~1e-6.
REL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-5}


def int8_output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose tolerance an int8 cache's output meets with ``dtype`` queries: the
    kernels take P times the per-token V scales in bf16 for 16-bit queries
    (``attention.triton_kernels.paging.int8_values``), so fp16 queries get bf16's."""
    return torch.bfloat16 if dtype == torch.float16 else dtype
#: Odd token counts: one token, either side of a 32-token block, a partial last block.
ODD = [1, 31, 32, 33, 97]


@dataclass
class PagedCase:
    spec: AttentionSpec
    query: torch.Tensor  # [num_tokens, heads, d] (padding tokens included)
    new_key: torch.Tensor  # [num_tokens, kv_heads, d]
    new_value: torch.Tensor
    layer: LayerCache  # holds every cached token's K/V; the new tokens' slots are NaN
    storage: torch.Tensor  # [2, num_blocks + 2, block_size, kv_heads, d]: the layer plus a NaN block each side
    meta: AttentionMetadata
    all_key: torch.Tensor  # [context + new tokens of every row, kv_heads, d], row-major
    all_value: torch.Tensor
    builder: MetadataBuilder | None = field(default=None, repr=False)  # built ``meta``


def make_spec(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, **kw: object) -> AttentionSpec:
    return AttentionSpec(heads, kv_heads, head_dim, dtype=dtype_name(dtype), **kw)  # type: ignore[arg-type]


def scrambled_manager(blocks: int, block_size: int, seed: int) -> BlockManager:
    """A manager whose free queue hands out blocks in a random order."""
    manager = BlockManager(blocks, block_size)
    for i in range(blocks):
        manager.allocate(("filler", i), 1)
    order = list(range(blocks))
    random.Random(seed).shuffle(order)
    for i in order:
        manager.free(("filler", i))
    return manager


def make_case(
    rows: list[tuple[int, int]],
    spec: AttentionSpec,
    *,
    block_size: int,
    device: str,
    seed: int = 0,
    spare_blocks: int = 3,
    pad_to: int | None = None,
    pad_tokens: int | None = None,
    layer_index: int = 0,
    cache_dtype: torch.dtype | None = None,
    device_check: bool | None = None,
    token_major_values: bool | None = None,
) -> PagedCase:
    """``rows``: (context, new) per row. The layer holds the context tokens' K/V; the step's
    metadata covers the new tokens (padded to ``pad_to`` rows and ``pad_tokens`` tokens when
    given), built by
    ``MetadataBuilder(device, device_check=device_check)`` (kept in ``case.builder``).
    ``token_major_values``: V's memory layout (:mod:`attention.value_layout`); None: as
    ``kvcache`` allocates it (token-major for an 8-bit cache)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    store_dtype = cache_dtype or getattr(torch, spec.cache_dtype.replace("float8_e4m3", "float8_e4m3fn"))
    kvh, d = spec.num_kv_heads, spec.head_dim
    need = sum(-(-(c + n) // block_size) for c, n in rows)
    manager = scrambled_manager(need + spare_blocks, block_size, seed)
    for i, (context, new) in enumerate(rows):
        manager.allocate(i, context + new)
    if store_dtype == torch.int8:  # values and per-token scales share each block's memory
        storage, layer = int8_layer(manager.num_blocks, block_size, kvh, d, device, layer_index)
    else:
        storage = torch.full((2, manager.num_blocks + 2, block_size, kvh, d), float("nan"), device=device)
        storage = storage.to(store_dtype)
        scales = None
        if spec.quantized_cache:
            scales = (torch.rand(2, kvh, generator=gen) * 0.02 + 0.005).to(device)
        if token_major_values is None:
            token_major_values = uses_token_major_values(store_dtype)
        layer = LayerCache(
            storage[0, 1:-1],
            token_major_view(storage[1, 1:-1]) if token_major_values else storage[1, 1:-1],
            index=layer_index,
            k_scale=None if scales is None else scales[0],
            v_scale=None if scales is None else scales[1],
        )
    total = sum(c + n for c, n in rows)
    all_key = torch.randn(total, kvh, d, generator=gen).to(dtype=dtype, device=device)
    all_value = torch.randn(total, kvh, d, generator=gen).to(dtype=dtype, device=device)
    # Write the context tokens' K/V with the reference backend (float32 math spec for writing).
    context_rows = [ScheduledRow(i, c, start=0) for i, (c, _) in enumerate(rows) if c > 0]
    starts = [0]
    for c, n in rows:
        starts.append(starts[-1] + c + n)
    if context_rows:
        writer = ReferenceBackend(spec)
        ctx_plan = writer.plan(MetadataBuilder(device).build(manager, context_rows))
        ctx_index = torch.cat([torch.arange(starts[i], starts[i] + c) for i, (c, _) in enumerate(rows) if c > 0])
        writer.write_kv(all_key[ctx_index.to(device)], all_value[ctx_index.to(device)], layer, ctx_plan)
    builder = MetadataBuilder(device, device_check=device_check)
    meta = builder.build(
        manager, [ScheduledRow(i, n, start=c) for i, (c, n) in enumerate(rows)], pad_to=pad_to, pad_tokens=pad_tokens
    )
    new_index = torch.cat([torch.arange(starts[i] + c, starts[i] + c + n) for i, (c, n) in enumerate(rows)])
    pad = meta.num_tokens - meta.num_real_tokens
    new_key = torch.cat(
        [all_key[new_index.to(device)], torch.randn(pad, kvh, d, generator=gen).to(dtype=dtype, device=device)]
    )
    new_value = torch.cat(
        [all_value[new_index.to(device)], torch.randn(pad, kvh, d, generator=gen).to(dtype=dtype, device=device)]
    )
    query = torch.randn(meta.num_tokens, spec.num_heads, d, generator=gen).to(dtype=dtype, device=device)
    return PagedCase(spec, query, new_key, new_value, layer, storage, meta, all_key, all_value, builder)


def int8_layer(
    num_blocks: int, block_size: int, kvh: int, d: int, device: str, index: int = 0
) -> tuple[torch.Tensor, LayerCache]:
    """An int8 layer (:mod:`attention.token_scales`) of ``num_blocks`` blocks inside a storage
    of ``num_blocks + 2`` (a guard block at each end), every byte 0x7E: the scales of slots
    never written read as NaN."""
    rows = dtype_info("int8").rows_per_block(block_size, d)
    storage = torch.full((2, num_blocks + 2, rows, kvh, d), 0x7E, dtype=torch.int8, device=device)
    return storage, int8_views(storage, block_size, index)


def int8_views(storage: torch.Tensor, block_size: int, index: int = 0) -> LayerCache:
    """The int8 layer cache of a case's storage ``[2, num_blocks + 2, rows, kvh, d]`` (views)."""
    return layer_views(storage[:, 1:-1], block_size, index)


def copy_layer(case: PagedCase) -> LayerCache:
    """A copy of the case's layer cache that writes do not share (an int8 cache's scales live
    in its blocks, so its whole memory is copied)."""
    layer = case.layer
    if layer.key.dtype == torch.int8:
        return int8_views(case.storage.clone(), layer.block_size, layer.index)
    return LayerCache(layer.key.clone(), layer.value.clone(), layer.index, layer.k_scale, layer.v_scale)


def reference_output(case: PagedCase, *, cache_after_write: LayerCache | None = None) -> torch.Tensor:
    """Attention of the case computed in float64 on float32 copies of the inputs (so the
    oracle's output is not rounded to bf16/fp16), [num_real_tokens, heads, d] float32.

    The oracle's cache holds every token's K/V as written by the reference backend (for an
    fp8 cache: the dequantized values the cache stores)."""
    spec32 = dataclasses.replace(case.spec, dtype="float32", kv_cache_dtype=None)
    oracle = ReferenceBackend(spec32, compute_dtype=torch.float64)
    layer = case.layer
    # Float32 copy of the cache with this step's K/V written as the reference would.
    written = copy_layer(case)
    ReferenceBackend(case.spec).write_kv(case.new_key, case.new_value, written, _plan_for(case))
    k32 = dequantize(written.key, written.k_scale, torch.float32)
    v32 = dequantize(written.value, written.v_scale, torch.float32)
    plain = LayerCache(k32, v32, layer.index)
    out = oracle.attend(case.query.float(), plain, oracle.plan(case.meta))
    return out[: case.meta.num_real_tokens]


def tree_reference(case: PagedCase, masks: list[int], scale: float) -> torch.Tensor:
    """float64 [real tokens, heads, d]: each new token over its row's cached tokens and the
    row's new tokens its draft-tree mask names (bit j: the row's j-th new token), read from
    the case's cache (the new tokens' K/V must be written)."""
    bs, kvh = case.layer.block_size, case.layer.key.shape[2]
    heads = case.query.shape[1]
    k_all, v_all = case.layer.key.double().flatten(0, 1), case.layer.value.double().flatten(0, 1)
    starts, outs = case.meta.query_start_loc.tolist(), []
    for row, (s, q) in enumerate(zip(case.meta.seq_lens_host, case.meta.query_lens_host, strict=True)):
        for t in range(q):
            token = starts[row] + t
            seen = list(range(s - q)) + [s - q + j for j in range(q) if masks[token] >> j & 1]
            pos = torch.tensor(seen, device=case.layer.key.device)
            slots = case.meta.block_tables[row, pos // bs].long() * bs + pos % bs
            k = k_all[slots].repeat_interleave(heads // kvh, dim=1)
            v = v_all[slots].repeat_interleave(heads // kvh, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", case.query[token].double(), k) * scale, dim=-1)
            outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


def ancestor_masks(parents: list[int | None]) -> list[int]:
    """Per node of a draft tree given by its parents, the bitmask of itself and its ancestors."""
    masks = []
    for t in range(len(parents)):
        bits, node = 0, t
        while node is not None:
            bits |= 1 << node
            node = parents[node]
        masks.append(bits)
    return masks


def _plan_for(case: PagedCase):  # type: ignore[no-untyped-def]
    return ReferenceBackend(case.spec).plan(case.meta)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere makes it NaN (never passes)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


# ---- the backends under test --------------------------------------------------------------


@dataclass(frozen=True)
class UnderTest:
    """A backend on a device, with the block size its tests use (the smallest it takes)."""

    name: str
    device: str
    block_size: int

    def make(self, spec: AttentionSpec) -> AttentionBackend:
        return get_backend(self.name, spec)

    def supports(self, dtype: torch.dtype) -> bool:
        return str(dtype).removeprefix("torch.") in BACKENDS[self.name].dtypes


def _under_test() -> list[UnderTest]:
    """Every backend of the table whose library is installed, on each device it runs on here:
    the reference on CPU (and CUDA), triton in Triton's CPU interpreter without a GPU
    (tests/conftest.py) and compiled on a GPU, flash_attn on a GPU."""
    cuda = torch.cuda.is_available()
    found = [UnderTest("reference", "cpu", BACKENDS["reference"].block_sizes.factor)]
    for name, info in BACKENDS.items():
        if info.library is not None and importlib.util.find_spec(info.library) is None:
            continue
        block = info.block_sizes.factor
        if cuda and "cuda" in info.devices:
            found.append(UnderTest(name, "cuda", block))
        elif name == "triton" and not cuda:
            found.append(UnderTest(name, "cpu", block))  # the CPU interpreter (conftest.py)
    return found


BACKENDS_UNDER_TEST = [pytest.param(b, id=f"{b.name}-{b.device}") for b in _under_test()]
