"""Per-step batch metadata: what every paged-attention kernel (and the model around it) reads
besides Q, K and V.

Built once per batch step (``kvcache.MetadataBuilder``) and reused by every layer.

A batch has ``batch`` rows (sequences). Row ``i`` brings ``query_len[i]`` new tokens, which
sit at positions ``seq_len[i] - query_len[i] .. seq_len[i] - 1`` of its sequence: a decode row
has one new token, a prefill or extend row has many. New tokens attend causally to every
token before them, cached or new (or to the last ``sliding_window`` of them).

A batch may be *padded* to a fixed size (a CUDA-graph bucket): rows past ``batch`` have
``seq_len`` 0 and read and write nothing. In a decode bucket (as many tokens as rows) each
padding row has one query token; in a bucket with more tokens than rows (room for prefill
rows) padding rows have none, and the padding tokens follow the last row's. Padding tokens
have slot -1.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from attention.checks import cdiv
from attention.errors import MetadataError

__all__ = ["PAD_BLOCK", "PAD_SLOT", "AttentionMetadata", "StepCounter"]

#: Block-table entry for "no block": never a valid block id.
PAD_BLOCK = -1
#: Slot of a token whose K/V must not be written (padding).
PAD_SLOT = -1


class StepCounter:
    """The steps a metadata builder has written into its persistent buffers. A step's metadata
    views that memory, so it shows its step only until the next one is planned over it:
    ``AttentionMetadata.written_at`` holds the counter and the step, and a backend refuses a
    plan whose step is no longer the current one."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors and host values for one batch step.

    Device tensors (all on one device; padded rows/tokens included):
      block_tables:    int32 [padded_batch, table_width]; row i lists the blocks covering
                       the first seq_lens[i] tokens; later entries are unspecified (never read).
      seq_lens:        int32 [padded_batch]; tokens of K/V each row attends to, new ones included.
      query_start_loc: int32 [padded_batch + 1]; row i's new tokens are query rows
                       query_start_loc[i] .. query_start_loc[i+1]-1 of the step's Q.
      slot_mapping:    int64 [num_tokens]; cache slot (block * block_size + offset) of each new
                       token; PAD_SLOT (-1) for a padding token.
      positions:       int64 [num_tokens]; position of each new token in its sequence (rotary).
      logits_indices:  int64 [num_logits]; query rows whose logits the step needs: the last new
                       token of every row that reaches the end of its known tokens (every decode
                       row, the last chunk of a prompt), in row order; then, in a padded batch,
                       padding entries (any token; their logits are not used) up to at most
                       padded_batch entries in all.
      tree_masks:      int32 [num_tokens] or None. None: new tokens see each other causally.
                       Given (draft trees): new token t of a row sees the row's cached tokens
                       and the row's new tokens j whose bit j is set in tree_masks[t] (its own
                       bit among them); rows bring at most 31 new tokens. Backends declare
                       support (``tree_masks`` in the backend table).
    Host values (no device sync needed to read them):
      seq_lens_host, query_lens_host: the real rows' lengths.
      sampling_rows_host: the real rows that have an entry in logits_indices, in order.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    seq_lens_host: tuple[int, ...]
    query_lens_host: tuple[int, ...]
    sampling_rows_host: tuple[int, ...]
    tree_masks: torch.Tensor | None = None
    #: ``(counter, step)`` for metadata viewing a builder's reused buffers (None: tensors of
    #: its own); see :class:`StepCounter` and :meth:`check_current`.
    written_at: tuple[StepCounter, int] | None = field(default=None, compare=False, repr=False)

    @property
    def batch(self) -> int:
        """Real rows."""
        return len(self.seq_lens_host)

    @property
    def padded_batch(self) -> int:
        """Rows of the device tensors (>= batch; larger for a CUDA-graph bucket)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Rows of Q: the new tokens, then any padding tokens (slot -1) after them."""
        return int(self.slot_mapping.shape[0])

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def table_width(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def is_pure_decode(self) -> bool:
        """Every row brings exactly one new token."""
        return self.max_query_len == 1

    @property
    def device(self) -> torch.device:
        return self.block_tables.device

    def check_current(self) -> None:
        """Raise MetadataError when this metadata's buffers now hold a later step (its builder
        planned another step since: the tensors show that step's tables and slots)."""
        stamp = self.written_at
        if stamp is not None and stamp[0].current != stamp[1]:
            raise MetadataError(
                f"plan: made for step {stamp[1]} of its builder, whose buffers now hold step {stamp[0].current}; "
                "a plan is good until its builder plans the next step: run each step before planning another"
            )

    def check(self) -> None:
        """Check dtypes, shapes, devices and the host lengths (no device sync). Raises
        MetadataError naming the field."""
        if type(self.block_size) is not int or self.block_size < 1:
            raise MetadataError(f"metadata.block_size: {self.block_size!r:.40} is not a positive int (the cache's)")
        b = self.batch
        if len(self.query_lens_host) != b:
            raise MetadataError(f"metadata: {len(self.query_lens_host)} query lengths for {b} sequence lengths")
        expect = {
            "block_tables": (self.block_tables, torch.int32, 2),
            "seq_lens": (self.seq_lens, torch.int32, 1),
            "query_start_loc": (self.query_start_loc, torch.int32, 1),
            "slot_mapping": (self.slot_mapping, torch.int64, 1),
            "positions": (self.positions, torch.int64, 1),
            "logits_indices": (self.logits_indices, torch.int64, 1),
        }
        for name, (t, dtype, ndim) in expect.items():
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != ndim:
                got = f"{t.dtype} with shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise MetadataError(f"metadata.{name}: expected {dtype} with {ndim} dims, got {got}")
            if t.device != self.device:
                raise MetadataError(f"metadata.{name}: on {t.device}, but block_tables is on {self.device}")
            if not t.is_contiguous():
                raise MetadataError(
                    f"metadata.{name}: strides {t.stride()} for shape {tuple(t.shape)}; the kernels index it as "
                    "a contiguous tensor: pass .contiguous()"
                )
        pb = self.padded_batch
        if pb < b or self.block_tables.shape[0] != pb or self.query_start_loc.shape[0] != pb + 1:
            raise MetadataError(
                f"metadata: block_tables has {self.block_tables.shape[0]} rows, seq_lens {pb}, "
                f"query_start_loc {self.query_start_loc.shape[0]} entries; expected >= {b} rows and rows + 1 starts"
            )
        tree = self.tree_masks
        if tree is not None and (not isinstance(tree, torch.Tensor) or tree.dtype != torch.int32 or tree.dim() != 1):
            kind = type(tree).__name__
            if isinstance(tree, torch.Tensor):
                kind = f"{tree.dtype} with shape {tuple(tree.shape)}"
            raise MetadataError(f"metadata.tree_masks: expected int32 [num_tokens] or None, got {kind}")
        if tree is not None and not tree.is_contiguous():
            raise MetadataError(f"metadata.tree_masks: stride {tree.stride()}; pass .contiguous()")
        if tree is not None and (tree.shape[0] != self.num_tokens or tree.device != self.device):
            raise MetadataError(
                f"metadata.tree_masks: {tree.shape[0]} entries on {tree.device}, expected {self.num_tokens} "
                f"on {self.device}"
            )
        if tree is not None and self.max_query_len > 31:
            raise MetadataError(
                f"metadata.tree_masks: a row brings {self.max_query_len} new tokens; an int32 mask covers at most 31"
            )
        if self.positions.shape[0] != self.num_tokens:
            raise MetadataError(f"metadata.positions: {self.positions.shape[0]} entries for {self.num_tokens} tokens")
        if self.num_real_tokens > self.num_tokens:
            raise MetadataError(
                f"metadata: query lengths sum to {self.num_real_tokens} but slot_mapping has only "
                f"{self.num_tokens} entries"
            )
        sampled = len(self.sampling_rows_host)
        num_logits = self.logits_indices.shape[0]
        if not sampled <= num_logits <= max(pb, sampled):
            raise MetadataError(
                f"metadata.logits_indices: {num_logits} entries for {sampled} sampling rows; expected "
                f"between {sampled} and padded_batch {pb}"
            )
        width = self.table_width
        q_lens, s_lens = self.query_lens_host, self.seq_lens_host
        # C-speed scans on the passing path; the row is located only to report a failure.
        if b and (min(q_lens) < 1 or not all(map(operator.le, q_lens, s_lens))):
            i = next(i for i, (q, s) in enumerate(zip(q_lens, s_lens, strict=True)) if not 0 < q <= s)
            raise MetadataError(f"metadata row {i}: query_len {q_lens[i]} must be in [1, seq_len {s_lens[i]}]")
        if b and max(s_lens) > width * self.block_size:
            i = s_lens.index(max(s_lens))
            raise MetadataError(
                f"metadata row {i}: seq_len {s_lens[i]} needs {cdiv(s_lens[i], self.block_size)} blocks, "
                f"block_tables has {width} columns"
            )
