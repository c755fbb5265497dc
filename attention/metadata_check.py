"""Metadata checked on the device, once per step, without a host sync.

One small kernel (one program per row) checks what the kernels will trust and repairs what
would make a kernel (ours, or a library's such as flash-attn) touch memory it must not:

- lengths: ``0 <= seq_len <= table_width * block_size``; query starts non-decreasing from 0,
  ending within the step's tokens; a real row (``seq_len > 0``) has ``1 <= query_len <=
  seq_len``;
- block tables: every entry a row reads (positions below ``seq_len``, or within the sliding
  window when every layer is windowed) is a block in ``[0, num_blocks)``, and column 0 of
  every row. A row whose length is repaired to 0 still has its table checked over the length
  as given (the whole width when that length is out of range), for a backend that plans from
  the host's lengths. Entries past a valid device length are not looked at, so a length cut
  short hides them: a backend must read the table through the device lengths as the check
  leaves them (flash-attn's recomputes its lengths from them at a step's first attend);
- slots: each new token's slot is ``-1`` or exactly the slot of its position through the
  row's block table (so a write can only land in the row's own block); padding rows, tokens
  after the last row, and every token of a step whose query starts needed repair get -1;
- positions: each new token's position is ``seq_len - query_len + j``.

A violation is recorded in a 4-int flag (code, row, index, value: the first one found) and
repaired in place: a bad table entry becomes block 0, a bad slot -1, a bad length 0, so later
kernels stay inside the cache (their output for that row is garbage; the engine learns of it
from the flag). The flag is copied to pinned host memory asynchronously;
:class:`DeviceCheck.raise_if_violated` reads it after the engine's own sync point.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attention.errors import MetadataError
from attention.metadata import AttentionMetadata

__all__ = ["VIOLATIONS", "DeviceCheck"]

#: Flag codes, in the order the kernel tests them.
VIOLATIONS = {
    1: "seq_len outside [0, table_width * block_size]",
    2: "query_start_loc not non-decreasing from 0 within the step's tokens",
    3: "query_len outside [1, seq_len] for a real row",
    4: "block-table entry a row reads is not a block in [0, num_blocks)",
    5: "slot is neither -1 nor the slot of its position (row's block table)",
    6: "position differs from seq_len - query_len + j",
}


class DeviceCheck:
    """The per-step check of one builder's metadata on one device.

    ``run(meta, num_blocks, window)`` launches the check (no sync); ``raise_if_violated()``
    raises MetadataError for a violation seen by a check whose flag copy has completed (call
    it after the engine's own sync point: it never waits)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flag = torch.zeros(4, dtype=torch.int32, device=device)
        self._host = torch.zeros(4, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self._use_triton = _triton_usable(device)

    def run(self, meta: AttentionMetadata, num_blocks: int, window: int | None = None) -> None:
        """Check (and repair) ``meta``'s device tensors for a cache of ``num_blocks`` blocks."""
        self.run_groups([(meta, window)], num_blocks)

    def run_groups(self, checks: Sequence[tuple[AttentionMetadata, int | None]], num_blocks: int) -> None:
        """:meth:`run` for several metadata of one step (one per KV group: each its tables,
        slots and window), with one flag copy."""
        for meta, window in checks:
            if self._use_triton:
                from attention.triton_kernels.metadata_check import check_metadata

                check_metadata(meta, num_blocks, window, self.flag)
            else:
                _check_in_torch(meta, num_blocks, window, self.flag)
        self._host.copy_(self.flag, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def raise_if_violated(self) -> None:
        """Raise MetadataError (and clear the flag) when a completed check found a violation."""
        if self._copied is not None and not self._copied.query():
            return  # the step has not finished on the device yet: look again next time
        code, row, index, value = (int(x) for x in self._host.tolist())
        if code == 0:
            return
        self.flag.zero_()
        self._host.zero_()
        raise MetadataError(
            f"metadata checked on the device: row {row}, index {index}, value {value}: "
            f"{VIOLATIONS.get(code, f'code {code}')}; the row's output was garbage and nothing outside the cache "
            f"was touched; rebuild the metadata from the manager (MetadataBuilder.build)"
        )


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        import importlib.util

        return importlib.util.find_spec("triton") is not None
    try:
        from attention.triton_kernels.paging import kernels_interpreted
    except ImportError:
        return False
    return kernels_interpreted()


def _check_in_torch(meta: AttentionMetadata, num_blocks: int, window: int | None, flag: torch.Tensor) -> None:
    """The same check in plain torch (CPU, or no triton); syncs, so only for CPU use."""
    bs, width = meta.block_size, meta.table_width
    seq_lens, qsl = meta.seq_lens, meta.query_start_loc
    tables, slots, positions = meta.block_tables, meta.slot_mapping, meta.positions
    found: list[tuple[int, int, int, int]] = []

    def note(code: int, row: int, index: int, value: int) -> None:
        if not found:
            found.append((code, row, index, value))

    rows = seq_lens.shape[0]
    t = slots.shape[0]
    running = 0
    repaired = False
    for r in range(rows + 1):  # starts: non-decreasing from 0, within the step's tokens
        fixed = 0 if r == 0 else max(running, min(max(int(qsl[r]), 0), t))
        if fixed != int(qsl[r]):
            note(2, r, r, int(qsl[r]))
            qsl[r] = fixed
            repaired = True
        running = fixed
    # Tokens after the last row belong to no row; after a repair of the starts no token's row
    # is known: those write nothing.
    for tok in range(0 if repaired else running, t):
        if int(slots[tok]) != -1:
            note(5, rows, tok, int(slots[tok]))
            slots[tok] = -1
    for i in range(rows):
        s = int(seq_lens[i])
        table_len = s  # the columns to check, as the kernel's table_len
        if not 0 <= s <= width * bs:
            note(1, i, i, s)
            seq_lens[i] = s = 0
            table_len = width * bs
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        q = q1 - q0
        if s > 0 and not 1 <= q <= s:
            note(3, i, i, q)
            seq_lens[i] = s = 0
        first = 0 if window is None or s == 0 else max(0, s - q - window + 1) // bs
        for col in range(first, max(-(-table_len // bs), 1)):
            b = int(tables[i, col])
            if not 0 <= b < num_blocks:
                note(4, i, col, b)
                tables[i, col] = 0
        for j in range(q):
            tok = q0 + j
            pos = s - q + j
            slot = int(slots[tok])
            want = int(tables[i, pos // bs]) * bs + pos % bs if s > 0 else -1
            if slot != -1 and slot != want:
                note(5, i, tok, slot)
                slots[tok] = -1
            if s > 0 and int(positions[tok]) != pos:
                note(6, i, tok, int(positions[tok]))
    if found and int(flag[0]) == 0:
        # Values past int32 are reported clamped (the flag is int32, like the kernel's).
        limit = 2**31 - 1
        flag.copy_(torch.tensor([max(-limit, min(limit, v)) for v in found[0]], dtype=torch.int32))
