"""Tensor-parallel ranks agree on every block-manager decision: a digest per step.

Every rank runs the same deterministic scheduler and block manager on the same inputs, so
every rank makes the same decisions without being told them. Nothing enforces "the same
inputs" or "deterministic", though (a request added on one rank only, a sampled token that
differs, a timing-dependent poll), and a rank whose block tables differ writes K/V into the
wrong slots silently. So each step every rank folds what its manager decided into a running
64-bit digest and the ranks compare digests with one tiny collective
(:meth:`RankAgreement.step`), *before* the step's forward pass: a divergence raises
:class:`~attention.errors.RankDivergenceError` on every rank at the same step, and no rank is
left waiting in a model collective whose shapes no longer match.

The digest covers, per step: the step number, the free-block and sequence counts, each
scheduled row's (seq_id, start, num_new, num_tokens, table length) and its block table, and
the step's input token ids (which carry the previous step's sampled tokens). A row's table is
hashed whole when the row is new or its table changed other than by appending (the
manager's ``epoch``), else only the blocks appended since the previous step: the chain makes
that enough, and a decode step costs O(rows), not O(rows x blocks).

The alternative, vLLM's, is that one process schedules and broadcasts each step's rows and
block edits to the workers. That needs a per-step host broadcast of the block edits and a
worker-side copy of the block tables; the replicated manager needs neither, but every rank
must see the same requests at the same steps (an online server broadcasts *new requests*
from its front end instead: usually smaller, and empty most steps).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

from attention.errors import ArgumentTypeError, RankDivergenceError, UnknownSequenceError
from kvcache.blocks.hybrid import AnyBlockManager, HybridBlockManager
from kvcache.blocks.rows import ScheduledRow
from kvcache.blocks.sequence import SequenceBlocks
from kvcache.blocks.tokens import token_list
from kvcache.parallel.collective import Collective

__all__ = ["RankAgreement", "StepDigest", "digest_of"]

_SEPARATOR = b"\x1f"


def digest_of(*values: object) -> int:
    """A signed 64-bit digest of ``repr`` of each value (for one-off checks: a config, a
    block count, the generated tokens). Stable across processes (no ``hash()``)."""
    h = hashlib.blake2b(digest_size=8)
    for value in values:
        h.update(repr(value).encode())
        h.update(_SEPARATOR)
    return int.from_bytes(h.digest(), "little", signed=True)


class StepDigest:
    """A running 64-bit digest of a block manager's decisions, one :meth:`update` per step.

    Two managers that made the same decisions on the same rows give the same value; the
    first step at which anything differs changes it, and every later value too (each step's
    digest covers the previous one).
    """

    def __init__(self) -> None:
        #: The digest so far (signed 64-bit).
        self.value = 0
        #: seq_id -> (record, epoch, blocks hashed) of the previous step's rows.
        self._shown: dict[Hashable, tuple[SequenceBlocks, int, int]] = {}

    def update(
        self, step: int, manager: AnyBlockManager, rows: Sequence[ScheduledRow], token_ids: Sequence[int] = ()
    ) -> int:
        """Fold one step into the digest and return the new value. ``rows`` and
        ``token_ids``: what the step runs (empty for a step that runs nothing). Reads the
        manager; changes nothing in it. Raises UnknownSequenceError for a row's unknown id.
        With KV groups the first group's tables are folded (the others follow from the same
        calls), with the pool's free count of every group."""
        h = hashlib.blake2b(self.value.to_bytes(8, "little", signed=True), digest_size=8)
        first = manager.groups[0] if isinstance(manager, HybridBlockManager) else manager
        seqs = first._seqs  # read-only, as the metadata builder reads it
        previous = self._shown
        shown: dict[Hashable, tuple[SequenceBlocks, int, int]] = {}
        fields = [step, len(rows), len(token_ids), manager.num_free_blocks, manager.num_sequences]
        blocks: list[int] = []
        for row in rows:
            seq_id = row.seq_id
            seq = seqs.get(seq_id)
            if seq is None:
                raise UnknownSequenceError(seq_id, "a scheduled row must name a sequence of the manager")
            before = previous.get(seq_id)
            table = seq.blocks
            done = before[2] if before is not None and before[0] is seq and before[1] == seq.epoch else 0
            start = seq.num_tokens - row.num_new if row.start is None else row.start
            fields += (start, row.num_new, seq.num_tokens, len(table), done)
            blocks += table[done:]
            shown[seq_id] = (seq, seq.epoch, len(table))
        try:
            packed_fields = array("q", fields).tobytes()
        except (TypeError, OverflowError):
            raise ArgumentTypeError(
                f"step and rows: step {step!r:.20} and each row's start and num_new must be ints in int64 range"
            ) from None
        packed_ids = array("q", token_list(token_ids)).tobytes()
        self._shown = shown  # every argument checked: the digest changes from here on
        h.update(packed_fields)
        h.update(array("q", blocks).tobytes())
        h.update(repr([row.seq_id for row in rows]).encode())
        h.update(packed_ids)
        self.value = int.from_bytes(h.digest(), "little", signed=True)
        return self.value


class RankAgreement:
    """Checks that every rank of ``collective`` made the same decisions.

    :meth:`step` once per scheduler step (idle steps included), before the step's forward
    pass; :meth:`check` for one-off values (the block count at start-up, the outputs at the
    end). Each call is one ``all_gather`` of 8 bytes per rank over the host group. Every rank
    must make the same sequence of calls: a rank that stops early (its scheduler is done)
    makes a :meth:`check` the others answer with a :meth:`step`, and that mismatch raises too.
    """

    def __init__(self, collective: Collective):
        self.collective = collective
        self.digest = StepDigest()
        #: Exchanges made so far.
        self.checks = 0

    def step(self, step: int, manager: AnyBlockManager, rows: Sequence[ScheduledRow], token_ids: Sequence[int]) -> None:
        """Fold the step into the running digest and compare it across ranks. Raises
        RankDivergenceError (on every rank) naming the step when the ranks differ."""
        self._compare(self.digest.update(step, manager, rows, token_ids), "block-manager decisions", step)

    def check(self, what: str, *values: object) -> None:
        """Compare ``values`` (by ``repr``) across ranks, chained to the step digest. Raises
        RankDivergenceError naming ``what`` when the ranks differ."""
        self.digest.value = digest_of(self.digest.value, what, *values)
        self._compare(self.digest.value, what, None)

    def _compare(self, value: int, what: str, step: int | None) -> None:
        self.checks += 1
        if self.collective.size == 1:
            return
        digests = self.collective.all_gather_int(value)
        if any(d != digests[0] for d in digests):
            raise RankDivergenceError(digests, what, step)
