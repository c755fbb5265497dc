"""Per-step batch metadata: what every paged-attention kernel reads besides Q, K and V.

Built once per batch step (``kvcache.batch.build_metadata``) and reused by every layer.

A batch has ``batch`` rows (sequences). Row ``i`` brings ``query_len[i]`` new tokens, which
sit at positions ``seq_len[i] - query_len[i] .. seq_len[i] - 1`` of its sequence: a decode row
has one new token, a prefill or extend row has many. New tokens attend causally to every
token before them, cached or new.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PAD_BLOCK", "AttentionMetadata"]

#: Block-table entry for "no block": never a valid block id, so a kernel that dereferenced it
#: would fault instead of silently reading another sequence's K/V.
PAD_BLOCK = -1


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors and host scalars for one batch step.

    Tensors (all on the cache's device):
      block_tables:    int32 [batch, max_blocks_per_seq]; row i lists the blocks covering
                       the first seq_lens[i] tokens, then PAD_BLOCK.
      seq_lens:        int32 [batch]; tokens of K/V each row attends to, new ones included.
      query_start_loc: int32 [batch + 1]; row i's new tokens are query rows
                       query_start_loc[i] .. query_start_loc[i+1]-1 of the step's Q.
      slot_mapping:    int64 [num_tokens]; cache slot (block * block_size + offset) of each new
                       token; -1 for a padded token whose K/V must not be written.
    Host scalars (no device sync is needed to read them):
      seq_lens_host, query_lens_host: the same lengths as Python tuples.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    seq_lens_host: tuple[int, ...]
    query_lens_host: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        """Rows of Q: the new tokens, then any padding tokens (slot -1) after them."""
        return self.slot_mapping.shape[0]

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

    def check(self) -> None:
        """Check dtypes, shapes and devices (no device sync). Raises ValueError naming the field."""
        b = self.batch
        if len(self.query_lens_host) != b:
            raise ValueError(f"metadata: {len(self.query_lens_host)} query lengths for {b} sequence lengths")
        expect = {
            "block_tables": (self.block_tables, torch.int32, 2),
            "seq_lens": (self.seq_lens, torch.int32, 1),
            "query_start_loc": (self.query_start_loc, torch.int32, 1),
            "slot_mapping": (self.slot_mapping, torch.int64, 1),
        }
        for name, (t, dtype, ndim) in expect.items():
            if t.dtype != dtype or t.dim() != ndim:
                raise ValueError(
                    f"metadata.{name}: expected {dtype} with {ndim} dims, got {t.dtype} "
                    f"with shape {tuple(t.shape)}"
                )
            if t.device != self.device:
                raise ValueError(f"metadata.{name}: on {t.device}, but block_tables is on {self.device}")
        if self.block_tables.shape[0] != b or self.seq_lens.shape[0] != b:
            raise ValueError(
                f"metadata: block_tables has {self.block_tables.shape[0]} rows and seq_lens "
                f"{self.seq_lens.shape[0]}, expected batch {b}"
            )
        if self.query_start_loc.shape[0] != b + 1:
            raise ValueError(f"metadata.query_start_loc: expected {b + 1} entries, got {self.query_start_loc.shape[0]}")
        if sum(self.query_lens_host) > self.num_tokens:
            raise ValueError(
                f"metadata: query lengths sum to {sum(self.query_lens_host)} but slot_mapping "
                f"has only {self.num_tokens} entries"
            )
        for i, (q, s) in enumerate(zip(self.query_lens_host, self.seq_lens_host, strict=True)):
            if not 0 < q <= s:
                raise ValueError(f"metadata row {i}: query_len {q} must be in [1, seq_len {s}]")
            if -(-s // self.block_size) > self.block_tables.shape[1]:
                raise ValueError(
                    f"metadata row {i}: seq_len {s} needs {-(-s // self.block_size)} blocks, "
                    f"block_tables has {self.block_tables.shape[1]} columns"
                )
