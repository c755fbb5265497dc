"""Hostile step metadata for the fuzz tests: a valid step, then its device tensors corrupted
the way a bug in an engine or a bad copy would.

Corruptions (each a real violation of what :mod:`attention.metadata_check` checks):
block-table entries a row reads set out of range or negative; slots out of range, negative or
pointing into another row's block; sequence lengths past the table or negative; query starts
decreasing or past the step's tokens; positions off. Magnitudes reach far (a billion): a kernel
that trusted a length would read far outside its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from attention.metadata_check import VIOLATIONS
from tests.paged_case import PagedCase, UnderTest, make_case, make_spec

__all__ = ["CODES", "FAR", "WINDOW", "Step", "corrupt", "hostile_case", "steps"]

#: Violation codes (VIOLATIONS) each corruption may be reported as. Query starts shift the
#: rows' tokens, so the rows' lengths, slots and positions may be reported first (the check's
#: programs run in any order on a GPU).
CODES = {"table": {4}, "slot": {5}, "seq_len": {1}, "query_start": {2, 3, 5, 6}, "position": {6}, "shorter": {5, 6}}
assert all(c in VIOLATIONS for codes in CODES.values() for c in codes), "a code the check does not have"
#: A length far outside any tensor.
FAR = 10**9
#: The sliding window of the windowed cases.
WINDOW = 20


@dataclass(frozen=True)
class Step:
    """rows: (context, new) per row; pad: padding rows after them; window: the spec's sliding
    window; dtype: picks the kernels' key tile (fp16: tiles of 128 tokens, wider than a
    32-token block, one block id per token; fp32: tiles of 32, one block id per tile)."""

    rows: list[tuple[int, int]]
    pad: int = 0
    window: int | None = None
    dtype: torch.dtype = torch.float16


@st.composite
def steps(draw: st.DrawFn) -> Step:
    """1-4 rows, mostly decode rows, some short prefill or extend rows; 0-2 padding rows."""
    row = st.tuples(st.integers(0, 90), st.one_of(st.just(1), st.just(1), st.integers(2, 12)))
    return Step(
        draw(st.lists(row, min_size=1, max_size=4)),
        draw(st.integers(0, 2)),
        draw(st.sampled_from([None, WINDOW])),
        draw(st.sampled_from([torch.float16, torch.float32])),
    )


def hostile_case(under: UnderTest, step: Step) -> PagedCase:
    """A small case of ``step`` (2 query heads, 1 KV head, head_dim 16; fp16 where the backend
    has no fp32), built by a builder with the device check on."""
    dtype = step.dtype if under.supports(step.dtype) else torch.float16
    spec = make_spec(2, 1, 16, dtype, sliding_window=step.window)
    return make_case(
        step.rows,
        spec,
        block_size=under.block_size,
        device=under.device,
        seed=len(step.rows),
        pad_to=len(step.rows) + step.pad if step.pad else None,
        device_check=True,
    )


def corrupt(data: st.DataObject, case: PagedCase, window: int | None) -> tuple[set[int], list[str]]:
    """Corrupt 1-3 things in the case's device metadata, in place. Returns the violation
    codes the device check may report for them, and what was planted (for messages)."""
    meta = case.meta
    bs, width, num_blocks = meta.block_size, meta.table_width, case.layer.num_blocks
    num_slots, tokens, padded = case.layer.num_slots, meta.num_tokens, meta.padded_batch
    seq_lens, q_lens = meta.seq_lens_host, meta.query_lens_host
    starts = [sum(q_lens[:r]) for r in range(meta.batch)]
    real_tokens = [(r, starts[r] + j) for r in range(meta.batch) for j in range(q_lens[r])]
    codes: set[int] = set()
    planted: list[str] = []
    for kind in data.draw(st.lists(st.sampled_from(sorted(CODES)), min_size=1, max_size=3), label="corruptions"):
        if kind == "shorter":
            # A row's length cut to a valid shorter one (so its positions and slots no longer
            # match it), and a bad block id in a column the true length reads but the cut one
            # does not: the check looks below the device length only, so whoever reads the
            # table must read through the device lengths too.
            cuttable = [r for r in range(meta.batch) if -(-seq_lens[r] // bs) - 1 >= -(-q_lens[r] // bs)]
            if not cuttable:
                kind = "position"
            else:
                row = data.draw(st.sampled_from(cuttable), label="shorter row")
                s, q = seq_lens[row], q_lens[row]
                cut = data.draw(st.integers(q, (-(-s // bs) - 1) * bs), label="shorter length")
                col = data.draw(st.integers(-(-cut // bs), -(-s // bs) - 1), label="column past it")
                bad = data.draw(st.sampled_from([-5, num_blocks, 2**31 - 1]), label="block id past it")
                meta.seq_lens[row] = cut
                meta.block_tables[row, col] = bad
                planted += [f"seq_lens[{row}] = {cut}", f"block_tables[{row}, {col}] = {bad}"]
        if kind == "table":
            # An entry the row reads (the check looks at the window only, when there is one).
            row = data.draw(st.integers(0, meta.batch - 1), label="table row")
            s, q = seq_lens[row], q_lens[row]
            first = 0 if window is None else max(0, s - q - window + 1) // bs
            col = data.draw(st.integers(first, -(-s // bs) - 1), label="table column")
            bad = data.draw(st.sampled_from([-5, num_blocks, num_blocks + 7, 2**31 - 1]), label="block id")
            meta.block_tables[row, col] = bad
            planted.append(f"block_tables[{row}, {col}] = {bad}")
        elif kind == "slot":
            token = data.draw(st.integers(0, tokens - 1), label="token")
            owner = next((r for r, t in real_tokens if t == token), None)
            others = [t for r, t in real_tokens if r != owner]
            choices = [-5, num_slots, num_slots + 100, 2**40]
            if others:  # the slot of a token of another row: inside the cache, not this row's
                choices.append(int(meta.slot_mapping[data.draw(st.sampled_from(others), label="other token")]))
            bad = data.draw(st.sampled_from(choices), label="slot")
            meta.slot_mapping[token] = bad
            planted.append(f"slot_mapping[{token}] = {bad}")
        elif kind == "seq_len":
            row = data.draw(st.integers(0, padded - 1), label="seq_len row")
            past = width * bs  # the longest row the table can describe
            bad = data.draw(st.sampled_from([past + 1, past + FAR, -1, -5, -FAR, -(2**31)]), label="seq_len")
            meta.seq_lens[row] = bad
            planted.append(f"seq_lens[{row}] = {bad}")
        elif kind == "query_start":
            i = data.draw(st.integers(0, padded), label="query start")
            decreasing = int(meta.query_start_loc[i - 1]) - 1 if i > 0 else 1  # the first start must be 0
            bad = data.draw(st.sampled_from([tokens + 1, tokens + FAR, -3, -FAR, decreasing]), label="start")
            meta.query_start_loc[i] = bad
            planted.append(f"query_start_loc[{i}] = {bad}")
        elif kind == "position":
            _, token = data.draw(st.sampled_from(real_tokens), label="position token")
            # Shifts of one sign, so two of them on one token never cancel.
            shift = data.draw(st.sampled_from([1, 1000]), label="position shift")
            meta.positions[token] += shift
            planted.append(f"positions[{token}] += {shift}")
        codes |= CODES[kind]
    return codes, planted
