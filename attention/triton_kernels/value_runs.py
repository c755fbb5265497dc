"""Runs of a step's tokens whose token-major V the cache write stores coalesced.

A token-major V cache (:mod:`attention.value_layout`: the 8-bit caches) keeps each (KV head,
dimension)'s values of a block's tokens side by side. A write that takes one token at a time
stores each of its ``kv_heads * head_dim`` values a block apart: one 1-byte store per value,
none of which a warp can merge with another. Prefill rows write many tokens into consecutive
slots, so there the same bytes can go as runs: ``RUN`` tokens whose slots are consecutive
and start at a multiple of ``RUN`` (hence within one block, ``RUN`` dividing the block size)
are written by one program, a (dimension, token) tile whose tokens are contiguous in memory.

The run of token ``t`` (whose slot ``s`` is valid) starts at token ``lead = t - s % RUN``; it
exists when tokens ``lead .. lead + RUN - 1`` all exist and hold slots ``s - s % RUN ..``
in order. At most one run starts among any ``RUN`` consecutive tokens (a second start would
sit inside the first run, at a slot that is not a multiple of ``RUN``), so a fixed grid, one
program per ``RUN`` tokens, finds each run exactly once (:func:`_value_run_in_window`), and a
per-token writer tells the same tokens apart with :func:`_in_value_run`; the two read the same
slots with the same test, so every token's V is written exactly once. Slots outside the
cache and padding tokens (slot -1) are never in a run, nor are decode rows (a token each, in
blocks of different sequences): the per-token path keeps them.

On an H100 (``benchmarks/results/value-runs-h100-2026-12-05.md``, the Poisson run's mixed
steps, 32 layers) the fused rotary + fp8 cache write took 0.357 ms an iteration token by token
(0.105 over bf16, whose V is contiguous); with runs 0.193, plus 0.077 for the runs kernel. Over
int8 the runs kernel (per-token scales) took 0.236 for a saving of 0.139, so by default int8
writes token by token (:func:`~.rotary_write.rotary_write_kv`'s ``value_runs``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["value_run_length", "value_runs_for"]

#: Tokens a run holds where the block size allows it: 32 one-byte values fill a 32-byte sector.
_LONGEST_RUN = 32
#: The shortest run worth a program (the rotated cache's product takes tiles of >= 16 rows).
_SHORTEST_RUN = 16


def value_run_length(block_size: int) -> int:
    """Tokens per run in blocks of ``block_size``: the largest power of two up to 32 that
    divides it, or 0 (no runs) where that is under 16."""
    run = _LONGEST_RUN
    while run >= _SHORTEST_RUN:
        if block_size % run == 0:
            return run
        run //= 2
    return 0


def value_runs_for(value_cache: torch.Tensor) -> int:
    """Tokens per run for a write into ``value_cache`` (``[num_blocks, block_size, kv_heads,
    head_dim]``): :func:`value_run_length` of its block size where a block's tokens are adjacent
    in memory (unit stride along them: the token-major V of the fp8 cache, and of the int8
    cache, whose blocks also hold the scales), else 0."""
    if value_cache.dim() != 4 or value_cache.shape[1] < 2 or value_cache.stride(1) != 1:
        return 0
    return value_run_length(value_cache.shape[1])


@triton.jit
def _run_is_whole(slot_ptr, lead, first, num_tokens, num_slots, RUN: tl.constexpr):  # type: ignore[no-untyped-def]
    """Whether tokens ``lead .. lead + RUN - 1`` exist and hold slots ``first ..`` in order,
    ``first`` a multiple of RUN and the run inside the cache's ``num_slots`` slots."""
    k = tl.arange(0, RUN)
    idx = lead + k
    slots = tl.load(slot_ptr + idx, mask=(idx >= 0) & (idx < num_tokens), other=-1)
    in_order = tl.sum((slots == first + k).to(tl.int32)) == RUN
    bounds = (lead >= 0) & (lead + RUN <= num_tokens) & (first >= 0) & (first + RUN <= num_slots)
    return in_order & bounds & (first % RUN == 0)


@triton.jit
def _in_value_run(slot_ptr, t, slot, num_tokens, num_slots, RUN: tl.constexpr):  # type: ignore[no-untyped-def]
    """Whether token ``t`` (slot ``slot``, any value) is in a run."""
    valid = (slot >= 0) & (slot < num_slots)
    offset = tl.where(valid, slot % RUN, 0)
    whole = _run_is_whole(slot_ptr, t - offset, slot - offset, num_tokens, num_slots, RUN)
    return valid & whole


@triton.jit
def _value_run_in_window(slot_ptr, window, num_tokens, num_slots, RUN: tl.constexpr):  # type: ignore[no-untyped-def]
    """The run starting among tokens ``window * RUN ..`` (``RUN`` of them): ``(found, lead,
    first)``, its first token and first slot (int64; both 0 where none is found)."""
    i = tl.arange(0, RUN)
    k = tl.arange(0, RUN)
    leads = window * RUN + i
    first = tl.load(slot_ptr + leads, mask=leads < num_tokens, other=-1)
    idx = leads[:, None] + k[None, :]
    slots = tl.load(slot_ptr + idx, mask=idx < num_tokens, other=-1)
    in_order = tl.sum((slots == first[:, None] + k[None, :]).to(tl.int32), axis=1) == RUN
    bounds = (leads + RUN <= num_tokens) & (first >= 0) & (first + RUN <= num_slots) & (first % RUN == 0)
    starts = in_order & bounds
    found = tl.max(starts.to(tl.int32), axis=0) > 0
    lead = tl.sum(tl.where(starts, leads, 0), axis=0)
    first_slot = tl.sum(tl.where(starts, first, 0), axis=0)
    return found, lead, first_slot
