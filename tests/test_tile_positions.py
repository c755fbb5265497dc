"""``paging.tile_columns`` and ``paging.in_block_positions``: the block-table column and the
position inside its block of every token of a tile, for tiles inside one block, tiles of whole
blocks (block 32 or 64 under 64- or 128-token tiles: a loop-invariant form) and tiles whose
blocks do not divide them (block 96), against plain integer arithmetic. Under the interpreter
on a CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from attention.triton_kernels.paging import in_block_positions, kernels_interpreted, tile_columns

pytestmark = pytest.mark.kernel

DEVICE = "cpu" if kernels_interpreted() else "cuda"


@triton.jit
def _positions_kernel(  # type: ignore[no-untyped-def]
    starts_ptr, cols_ptr, pos_ptr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    t = tl.program_id(0)
    n0 = tl.load(starts_ptr + t)
    offs_n = tl.arange(0, BLOCK_N)
    tl.store(cols_ptr + t * BLOCK_N + offs_n, tile_columns(n0, offs_n, BLOCK_SIZE, BLOCK_N))
    tl.store(pos_ptr + t * BLOCK_N + offs_n, in_block_positions(n0, offs_n, BLOCK_SIZE, BLOCK_N))


@pytest.mark.parametrize(
    ("block_size", "block_n"),
    [(32, 64), (32, 128), (64, 128), (96, 64), (96, 128), (160, 64), (256, 128), (256, 64)],
    ids=lambda v: str(v),
)
def test_columns_and_positions_match_integer_arithmetic(block_size: int, block_n: int) -> None:
    tiles = [0, 1, 2, 3, 5, 7, 11, 100, 1001]  # tile indices: starts are multiples of block_n
    starts = torch.tensor([i * block_n for i in tiles], dtype=torch.int32, device=DEVICE)
    cols = torch.full((len(tiles), block_n), -1, dtype=torch.int32, device=DEVICE)
    pos = torch.full_like(cols, -1)
    _positions_kernel[(len(tiles),)](starts, cols, pos, BLOCK_SIZE=block_size, BLOCK_N=block_n)
    tokens = starts.cpu().long()[:, None] + torch.arange(block_n)[None, :]
    assert torch.equal(cols.cpu().long(), tokens // block_size)
    assert torch.equal(pos.cpu().long(), tokens % block_size)
