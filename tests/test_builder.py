"""The persistent metadata builder: rows that keep their blocks across steps, padding rows,
staged token ids, capacity, and token ids given as tensors."""

from __future__ import annotations

import pytest
import torch

from attention import PAD_BLOCK, PAD_SLOT, ReferenceBackend, StepCapacity
from attention.errors import UnsupportedSettingError
from kvcache import BlockManager, InvalidArgumentError, MetadataBuilder, MetadataError, ScheduledRow
from tests.manager_state import snapshot
from tests.paged_case import make_spec

SENTINEL = 99  # never a block id in these pools


def table(builder_meta: object, row: int, n: int) -> list[int]:
    return builder_meta.block_tables[row, :n].tolist()  # type: ignore[attr-defined]


def test_a_row_keeps_its_blocks_and_only_appended_blocks_are_written() -> None:
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 7)  # blocks 0, 1
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("a", 7)])
    assert table(meta, 0, 2) == [0, 1]
    # Mark the written entries (CPU: the metadata tensors are views of the builder's buffer).
    meta.block_tables[0, :2] = SENTINEL
    m.append_slots("a", 1)  # position 7: still block 1
    meta = builder.build(m, [ScheduledRow("a", 1)])
    assert table(meta, 0, 2) == [SENTINEL, SENTINEL], "a row whose blocks did not change is not rewritten"
    m.append_slots("a", 2)  # positions 8, 9: block 2 is appended
    meta = builder.build(m, [ScheduledRow("a", 2)])
    assert table(meta, 0, 3) == [SENTINEL, SENTINEL, 2], "only the appended block is written"
    assert meta.slot_mapping.tolist() == [8, 9] and meta.seq_lens.tolist() == [10]


def test_a_row_taken_by_another_sequence_is_rewritten() -> None:
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("long", 20)  # blocks 0..4
    m.allocate("short", 6)  # blocks 5, 6
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("long", 20), ScheduledRow("short", 6)])
    assert [table(meta, 0, 5), table(meta, 1, 2)] == [[0, 1, 2, 3, 4], [5, 6]]
    meta.block_tables[:, :] = SENTINEL
    meta = builder.build(m, [ScheduledRow("short", 1, start=5)])  # row 0 changes hands
    assert table(meta, 0, 2) == [5, 6]
    # The previous owner's longer tail is hidden, never shown as the new owner's blocks.
    assert set(meta.block_tables[0, 2:5].tolist()) <= {PAD_BLOCK, SENTINEL}
    assert meta.seq_lens.tolist() == [6] and meta.slot_mapping.tolist() == [6 * 4 + 1]


def test_a_new_record_under_the_same_id_is_rewritten() -> None:
    """Freed and allocated again (a recompute), or swapped out and back in: the same id, new
    blocks. The row must show the new blocks, not the old ones."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 8)  # blocks 0, 1
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("a", 8)])
    meta.block_tables[0, :] = SENTINEL
    m.allocate("other", 4)  # block 2
    m.free("a")
    m.allocate("a", 12)  # blocks 0, 1 again (freed plain, head reused first), then 3
    assert m.block_table("a") == [0, 1, 3]
    meta = builder.build(m, [ScheduledRow("a", 12)])
    assert table(meta, 0, 3) == [0, 1, 3], "the whole row is rewritten, not only the appended block"


def test_released_blocks_behind_a_sliding_window_rewrite_the_row() -> None:
    m = BlockManager(num_blocks=16, block_size=4, sliding_window=4)
    m.allocate("a", 8)  # blocks 0, 1
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("a", 8)])
    meta.block_tables[0, :] = SENTINEL
    m.commit([ScheduledRow("a", 8, start=0)])  # position 7 sees 4..7: block 0 is behind the window
    assert m.block_table("a") == [PAD_BLOCK, 1] and m.sequence("a").num_released == 1
    assert m.allocator.is_free(0)
    m.append_slots("a", 1)  # takes block 0 again: the released block is free for anyone
    meta = builder.build(m, [ScheduledRow("a", 1)])
    assert table(meta, 0, 3) == [PAD_BLOCK, 1, 0]
    assert meta.slot_mapping.tolist() == [0 * 4]
    m.check_integrity()


def test_padding_rows() -> None:
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 5)
    m.allocate("b", 3)
    m.mark_computed("a", 5)
    m.append_slots("a", 1)
    builder = MetadataBuilder("cpu")
    rows = [ScheduledRow("a", 1), ScheduledRow("b", 3)]
    meta = builder.build(m, rows, pad_to=4, token_ids=[11, 21, 22, 23])
    assert (meta.batch, meta.padded_batch, meta.num_tokens, meta.num_real_tokens) == (2, 4, 6, 4)
    assert meta.seq_lens.tolist() == [6, 3, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 5, 6]  # one query token per padding row
    assert meta.slot_mapping.tolist() == [5, 8, 9, 10, PAD_SLOT, PAD_SLOT]
    assert meta.positions.tolist() == [5, 0, 1, 2, 0, 0]
    # Logits: the last token of every real row that reaches its end, then one per padding row.
    assert meta.logits_indices.tolist() == [0, 3, 4, 5]
    assert meta.sampling_rows_host == (0, 1)
    assert (meta.seq_lens_host, meta.query_lens_host) == ((6, 3), (1, 3))
    assert meta.block_tables.shape[0] == 4
    assert builder.token_ids(meta.num_tokens).tolist() == [11, 21, 22, 23, 0, 0]
    meta.check()


def test_pad_to_with_no_rows_is_all_padding() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    meta = MetadataBuilder("cpu").build(m, [], pad_to=2)
    assert (meta.batch, meta.padded_batch) == (0, 2)
    assert meta.seq_lens.tolist() == [0, 0] and meta.slot_mapping.tolist() == [PAD_SLOT, PAD_SLOT]
    assert meta.logits_indices.tolist() == [0, 1] and meta.sampling_rows_host == ()
    meta.check()


def test_pad_to_below_the_rows_is_refused() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 1)
    m.allocate("b", 1)
    with pytest.raises(InvalidArgumentError, match="pad_to"):
        MetadataBuilder("cpu").build(m, [ScheduledRow("a", 1), ScheduledRow("b", 1)], pad_to=1)


def test_pad_tokens_gives_empty_padding_rows_and_trailing_tokens() -> None:
    """A bucket with room for prefill rows: padding rows bring no token, the step's tokens are
    padded after the last row's, and logits are padded to one entry per row (a row that
    does not sample, a prompt's middle chunk, is padded too)."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 5)
    m.allocate("b", 9)
    m.mark_computed("a", 5)
    m.mark_computed("b", 2)
    m.append_slots("a", 1)
    builder = MetadataBuilder("cpu")
    rows = [ScheduledRow("a", 1), ScheduledRow("b", 3, start=2)]  # b: a middle chunk, no logits
    meta = builder.build(m, rows, pad_to=4, pad_tokens=8, token_ids=[11, 21, 22, 23])
    assert (meta.batch, meta.padded_batch, meta.num_tokens, meta.num_real_tokens) == (2, 4, 8, 4)
    assert meta.seq_lens.tolist() == [6, 5, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 4, 4]
    assert meta.slot_mapping.tolist()[4:] == [PAD_SLOT] * 4 and meta.positions.tolist()[4:] == [0] * 4
    assert meta.sampling_rows_host == (0,)
    assert meta.logits_indices.tolist() == [0, 7, 7, 7]
    assert builder.token_ids(meta.num_tokens).tolist() == [11, 21, 22, 23, 0, 0, 0, 0]
    meta.check()
    full = builder.build(m, rows, pad_to=2, pad_tokens=4, token_ids=[11, 21, 22, 23])
    assert full.logits_indices.tolist() == [0, 3] and full.query_start_loc.tolist() == [0, 1, 4]
    full.check()


def test_bad_pad_tokens_are_refused_before_anything_changes() -> None:
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 5)
    builder = MetadataBuilder("cpu", capacity=StepCapacity(4, 8, 4))
    before = snapshot(m)
    rows = [ScheduledRow("a", 5)]
    with pytest.raises(InvalidArgumentError, match=r"pad_tokens: .*give pad_to"):
        builder.build(m, rows, pad_tokens=8)
    with pytest.raises(InvalidArgumentError, match="pad_tokens"):
        builder.build(m, rows, pad_to=2, pad_tokens=4)  # fewer than the step's 5 tokens
    with pytest.raises(InvalidArgumentError, match="capacity"):
        builder.build(m, rows, pad_to=2, pad_tokens=9)
    assert snapshot(m) == before
    assert builder.build(m, rows, pad_to=2, pad_tokens=8).num_tokens == 8


def test_feed_names_a_sampling_row_of_the_last_committed_step() -> None:
    """``feed`` picks the previous step's sampled id on the device; a plan the backend refused
    is not a step: the one before it stays the one ``feed`` refers to."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 3)
    m.allocate("b", 2)
    builder = MetadataBuilder("cpu", backend=ReferenceBackend(make_spec(2, 1, 8, torch.float32)))
    builder.plan(m, [ScheduledRow("a", 3, start=0), ScheduledRow("b", 2, start=0)], token_ids=[1, 2, 3, 4, 5])
    builder.sampled[:2] = torch.tensor([70, 80])
    m.append_slots("a", 1, defer_ids=True)
    with pytest.raises(UnsupportedSettingError):  # the reference backend cannot be captured
        builder.plan(m, [ScheduledRow("a", 1)], pad_to=2, token_ids=[0], feed=[1])
    plan = builder.plan(m, [ScheduledRow("a", 1)], token_ids=[0], feed=[1])
    assert builder.input_ids(plan.metadata.num_tokens).tolist() == [80]
    with pytest.raises(InvalidArgumentError, match=r"feed\[0\]: 1 is not -1 or a sampling row"):
        builder.plan(m, [ScheduledRow("a", 1)], token_ids=[0], feed=[1])  # that step sampled one row


def test_two_builders_keep_their_own_metadata() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("a", 3)
    m.allocate("b", 5)
    first, second = MetadataBuilder("cpu"), MetadataBuilder("cpu")
    meta_a = first.build(m, [ScheduledRow("a", 3)])
    meta_b = second.build(m, [ScheduledRow("b", 5)])
    assert meta_a.slot_mapping.tolist() == [0, 1, 2]
    assert meta_b.slot_mapping.tolist() == [4, 5, 6, 7, 8]


def test_token_ids_are_checked() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("a", 3)
    builder = MetadataBuilder("cpu")
    with pytest.raises(InvalidArgumentError, match="token_ids: 2 ids"):
        builder.build(m, [ScheduledRow("a", 3)], token_ids=[1, 2])
    meta = builder.build(m, [ScheduledRow("a", 3)], token_ids=torch.tensor([7, 8, 9]))
    assert builder.token_ids(meta.num_tokens).tolist() == [7, 8, 9]


def test_bad_rows_are_refused_naming_the_row() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("a", 3)
    m.mark_computed("a", 2)
    builder = MetadataBuilder("cpu")
    with pytest.raises(MetadataError, match=r"rows\[1\]"):
        builder.build(m, [ScheduledRow("a", 1), ScheduledRow("a", 4, start=0)])
    with pytest.raises(MetadataError, match=r"rows\[1\]: sequence 'a' is already scheduled in rows\[0\]"):
        builder.build(m, [ScheduledRow("a", 1), ScheduledRow("a", 2, start=0)])  # both within its tokens
    with pytest.raises(MetadataError, match=r"rows\[0\].num_new: 0 must be at least 1"):
        builder.build(m, [ScheduledRow("a", 0, start=2)])
    m.allocate("b", 6)
    with pytest.raises(MetadataError, match=r"start after its first 0 tokens.*schedule them first \(start=0\)"):
        builder.build(m, [ScheduledRow("b", 2, start=4)])  # would attend over K/V never written
    with pytest.raises(InvalidArgumentError, match=r"rows\[0\]: expected a ScheduledRow"):
        builder.build(m, [("a", 1)])  # type: ignore[list-item]
    with pytest.raises(KeyError, match="'nope' is unknown"):
        builder.build(m, [ScheduledRow("nope", 1)])


def test_capacity_grows_unless_fixed() -> None:
    m = BlockManager(num_blocks=100, block_size=4)
    for i in range(10):
        m.allocate(i, 40)  # 10 blocks each: more rows and columns than the default capacity
    rows = [ScheduledRow(i, 40) for i in range(10)]
    grown = MetadataBuilder("cpu")
    meta = grown.build(m, rows)
    cap = grown.capacity
    assert cap.max_rows >= 10 and cap.max_tokens >= 400 and cap.max_blocks_per_seq >= 10
    assert [table(meta, i, 10) for i in range(10)] == [m.block_table(i) for i in range(10)]
    fixed = MetadataBuilder("cpu", capacity=StepCapacity(4, 64, 8))
    with pytest.raises(InvalidArgumentError, match="capacity"):
        fixed.build(m, rows)
    assert fixed.capacity == StepCapacity(4, 64, 8)


# ---- token ids as tensors behave exactly like lists ---------------------------------------

FORMS = {
    "list": lambda ids: list(ids),
    "tuple": lambda ids: tuple(ids),
    "int64 tensor": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "int32 tensor": lambda ids: torch.tensor(ids, dtype=torch.int32),
}


def _script(form, prefix_caching: bool) -> tuple[list[object], dict]:  # type: ignore[no-untyped-def]
    """One scripted run with every token-id argument given in ``form``; returns what each call
    returned and the manager's final snapshot."""
    m = BlockManager(12, 4, enable_prefix_caching=prefix_caching)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    out: list[object] = []
    out.append(m.can_allocate(token_ids=form(prompt)))
    out.append(m.allocate("a", token_ids=form(prompt)))
    m.commit([ScheduledRow("a", 9, start=0)])
    out.append(m.append_slots("a", 3, token_ids=form([10, 11, 12])))
    m.commit([ScheduledRow("a", 3)])
    out.append(m.can_allocate(token_ids=form([*prompt, 10, 11, 12, 13])))
    out.append(m.allocate("b", token_ids=form([*prompt, 10, 11, 12, 13])))
    out.append(m.allocate("c", 5, token_ids=form([1, 2, 3, 4, 0])))
    out.append(m.append_slots("c", 1, token_ids=form([4])))
    out.append(m.can_allocate(token_ids=form(list(range(100, 140)))))  # 10 blocks: too many
    m.mark_computed("c", 5)  # their contexts ran (a decode row starts where computing stopped)
    m.mark_computed("b", 12)
    builder = MetadataBuilder("cpu")
    meta = builder.build(m, [ScheduledRow("c", 1), ScheduledRow("b", 1)], token_ids=form([4, 13]))
    out.append(builder.token_ids(meta.num_tokens).tolist())
    out.append(meta.slot_mapping.tolist())
    return out, snapshot(m)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("form", [f for f in FORMS if f != "list"])
def test_token_ids_as_tensors_behave_exactly_like_lists(form: str, prefix_caching: bool) -> None:
    want_out, want_state = _script(FORMS["list"], prefix_caching)
    got_out, got_state = _script(FORMS[form], prefix_caching)
    assert got_out == want_out
    assert got_state == want_state
    if prefix_caching:
        assert want_out[4] == 12, "b hits a's three full blocks"
        assert want_out[5] == 4, "c hits a's first block"
        records = got_state["seqs"]
        assert all(type(t) is int for r in records.values() for t in r[2]), "token ids kept as Python ints"


def test_a_refused_graph_plan_changes_no_buffer() -> None:
    """A bucket the backend cannot plan is refused before anything is written: the metadata
    of the step before (views of the same buffers on a CPU) is unchanged."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 6)
    m.allocate("b", 9)
    builder = MetadataBuilder("cpu", backend=ReferenceBackend(make_spec(2, 1, 8, torch.float32)))
    plan = builder.plan(m, [ScheduledRow("a", 6, start=0)], token_ids=[1, 2, 3, 4, 5, 6])
    views = [t.clone() for t in (plan.metadata.block_tables, plan.metadata.slot_mapping, plan.metadata.seq_lens)]
    with pytest.raises(UnsupportedSettingError, match="cannot be captured"):
        builder.plan(m, [ScheduledRow("b", 9, start=0)], pad_to=2, token_ids=list(range(9)))
    now = (plan.metadata.block_tables, plan.metadata.slot_mapping, plan.metadata.seq_lens)
    assert all(torch.equal(a, b) for a, b in zip(views, now, strict=True))


def test_the_next_step_may_start_where_the_planned_one_ends() -> None:
    """An overlapped engine plans step N+1 before committing step N: a row may start where a
    committed plan of its sequence ended, not further."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("p", 10)
    builder = MetadataBuilder("cpu")
    builder.build(m, [ScheduledRow("p", 4, start=0)])  # chunk 1, in flight (not committed)
    builder.build(m, [ScheduledRow("p", 4, start=4)])  # chunk 2 follows it
    with pytest.raises(MetadataError, match=r"start after its first 8 tokens"):
        builder.build(m, [ScheduledRow("p", 1, start=9)])
    m.commit([ScheduledRow("p", 4, start=0)])
    m.commit([ScheduledRow("p", 4, start=4)])
    assert builder.build(m, [ScheduledRow("p", 2, start=8)]).num_tokens == 2


def test_a_manager_larger_than_the_cache_is_refused() -> None:
    """With the cache's block count, a manager that could hand out blocks the cache does not
    have is refused before anything is written; the device check holds ids to the cache."""
    m = BlockManager(num_blocks=16, block_size=4)
    m.allocate("a", 3)
    builder = MetadataBuilder("cpu", num_cache_blocks=8)
    with pytest.raises(InvalidArgumentError, match="hands out 16 blocks but the cache has 8"):
        builder.build(m, [ScheduledRow("a", 3, start=0)])
    assert builder.build(BlockManager(8, 4), [], pad_to=1).padded_batch == 1
    with pytest.raises(InvalidArgumentError, match="num_cache_blocks"):
        MetadataBuilder("cpu", num_cache_blocks=0)
