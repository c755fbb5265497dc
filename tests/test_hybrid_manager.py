"""KV groups (``kvcache.blocks.groups``) and the hybrid block manager
(``kvcache.blocks.hybrid``): layers grouped by attention type over one pool, windowed groups
releasing blocks behind their windows whatever the full group holds, every action all or
nothing across groups, prefix hits common to every group, and the memory a Gemma-3-style
layout saves at 32k context."""

from __future__ import annotations

import random

import pytest

from attention.metadata import PAD_BLOCK
from kvcache import ArgumentTypeError, BlockManager, InvalidArgumentError, OutOfBlocksError, ScheduledRow
from kvcache.blocks.groups import group_layout
from kvcache.blocks.hybrid import HybridBlockManager

BS = 32


def gemma3_pattern(num_layers: int) -> tuple[bool, ...]:
    """Five windowed layers, then one full, repeated (Gemma-3)."""
    return tuple((i + 1) % 6 != 0 for i in range(num_layers))


def test_layouts_group_layers_by_type_in_equal_groups() -> None:
    layout = group_layout(26, 512, gemma3_pattern(26))  # Gemma-3 1B: 4 full, 22 windowed
    assert layout.group_size == 4 and layout.is_hybrid
    assert [g.window for g in layout.groups] == [None] + [512] * 6
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 2]  # the last windowed group pads
    places = [layout.place(i) for i in range(26)]
    assert len(set(places)) == 26 and all(0 <= t < 4 for _, t in places)
    alternating = group_layout(42, 4096, tuple(i % 2 == 0 for i in range(42)))  # Gemma-2
    assert alternating.group_size == 21 and [g.window for g in alternating.groups] == [None, 4096]
    uniform = group_layout(32, None, None)
    assert not uniform.is_hybrid and uniform.group_size == 32 and uniform.groups[0].window is None
    all_windowed = group_layout(8, 128, None)
    assert not all_windowed.is_hybrid and all_windowed.groups[0].window == 128


def test_layouts_refuse_patterns_that_do_not_fit() -> None:
    with pytest.raises(InvalidArgumentError, match="window_layers: 3 entries for 4 layers"):
        group_layout(4, 128, (True, False, True))
    with pytest.raises(InvalidArgumentError, match="need sliding_window"):
        group_layout(2, None, (True, False))
    with pytest.raises(InvalidArgumentError, match="layer"):
        group_layout(4, 128, (True, False, True, False)).place(4)


def run_sequence(m: HybridBlockManager | BlockManager, seq: str, prompt: int, decode: int, chunk: int = 2048) -> None:
    """Prefill ``prompt`` tokens in chunks, reserving each chunk as it is scheduled (``allocate``
    reserves a whole prompt in every group), then decode ``decode`` tokens, committing each step."""
    done = 0
    while done < prompt:
        n = min(chunk, prompt - done)
        if done == 0:
            m.allocate(seq, n)
        else:
            m.append_slots(seq, n)
        m.commit([ScheduledRow(seq, n, done)])
        done += n
    for _ in range(decode):
        m.append_slots(seq, 1)
        m.commit([ScheduledRow(seq, 1)])


def test_a_gemma3_layout_holds_a_fifth_of_the_kv_at_32k() -> None:
    """The issue's target: 5:1, window 1024, 32k context: <= 0.22x the K/V bytes of the same
    model with every layer full, counted as layer-blocks in use."""
    layers = 62  # Gemma-3 27B: 10 full layers, 52 windowed
    layout = group_layout(layers, 1024, gemma3_pattern(layers))
    hybrid = HybridBlockManager(layout, 4096, BS)
    full = BlockManager(2048, BS)
    for m in (hybrid, full):
        run_sequence(m, "s", 32_000, 768)
    hybrid.check_integrity()
    assert hybrid.num_tokens("s") == full.num_tokens("s") == 32_768
    full_layer_blocks = full.allocator.num_used * layers
    hybrid_layer_blocks = layout.layer_blocks(hybrid.num_used_blocks)
    assert full.allocator.num_used == 1024
    # The full group holds all 1024 blocks; each windowed group the 32 its next query sees.
    assert hybrid.num_used_blocks == 1024 + 6 * (1024 // BS)
    assert hybrid_layer_blocks / full_layer_blocks <= 0.22


def test_windowed_groups_release_blocks_while_the_full_group_keeps_them() -> None:
    layout = group_layout(4, 64, (True, False, True, False))
    m = HybridBlockManager(layout, 64, BS)
    run_sequence(m, "s", 300, 0, chunk=100)
    full_table, window_table = m.block_tables("s")
    assert all(b >= 0 for b in full_table) and len(full_table) == 10
    assert window_table[:7] == [-1] * 7 and all(b >= 0 for b in window_table[7:])  # (300 - 64 + 1) // 32 = 7
    assert m.num_used_blocks == 10 + 3
    m.free("s")
    assert m.num_free_blocks == 64
    m.check_integrity()


def snapshot(m: HybridBlockManager) -> tuple[object, ...]:
    return (
        m.allocator.num_free,
        [dict((k, (s.blocks[:], s.num_tokens, s.num_computed)) for k, s in g._seqs.items()) for g in m.groups],
        m.allocator.free_blocks_in_eviction_order(),
    )


def test_actions_are_all_or_nothing_across_groups() -> None:
    layout = group_layout(4, 64, (True, False, True, False))
    m = HybridBlockManager(layout, 12, BS)
    m.allocate("a", 5 * BS)  # 5 blocks in each group: 10 of 12
    before = snapshot(m)
    assert not m.can_allocate(BS + 1)  # 2 blocks per group, 2 free: the first group would fit alone
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", BS + 1)
    assert snapshot(m) == before
    assert m.can_append("a", BS) and not m.can_append("a", BS + 1)
    with pytest.raises(OutOfBlocksError):
        m.append_slots("a", BS + 1)
    assert snapshot(m) == before
    with pytest.raises(InvalidArgumentError):
        m.commit([ScheduledRow("a", 2 * BS, 0), ScheduledRow("a", 5, 9 * BS)])
    assert snapshot(m) == before
    m.check_integrity()


def evict(m: HybridBlockManager, group: int, block: int) -> None:
    """Take a cached free block of one group out of the index (as an eviction does)."""
    cache = m.groups[group].prefix_cache
    assert cache is not None and m.allocator.is_free(block)
    m.allocator.revive(block)
    cache.forget(block)
    m.allocator.decref(block)


def test_prefix_hits_are_common_to_every_group_and_windows_need_only_their_window() -> None:
    layout = group_layout(4, 64, (True, False, True, False))  # group 1: window 64 (two blocks)
    m = HybridBlockManager(layout, 64, BS, enable_prefix_caching=True)
    prompt = list(range(1000, 1000 + 6 * BS + 3))
    m.allocate("a", token_ids=prompt)
    m.commit([ScheduledRow("a", len(prompt), 0)])
    m.free("a")
    assert m.allocate("b", token_ids=prompt) == 6 * BS  # every group still holds every block
    full_b, window_b = m.block_tables("b")
    assert all(x >= 0 for x in full_b) and window_b[:4] == [PAD_BLOCK] * 4  # the window needs blocks 4, 5
    m.free("b")
    window = m.groups[1].prefix_cache
    assert window is not None
    blocks = window.match(prompt, None)[0]
    evict(m, 1, blocks[0])  # behind the window of a 6-block hit: costs nothing
    assert m.allocate("c", token_ids=prompt) == 6 * BS
    m.free("c")
    evict(m, 1, blocks[5])  # the window's last block: the run ends before it
    assert m.allocate("d", token_ids=prompt) == 5 * BS
    m.free("d")
    full = m.groups[0].prefix_cache
    assert full is not None
    evict(m, 0, full.match(prompt, None)[0][2])  # the full group needs every block: at most 2
    # A run of 2 blocks (64 tokens) would need the window's blocks 0 and 1; block 0 is gone.
    assert m.allocate("e", token_ids=prompt) == 0
    m.commit([ScheduledRow("e", len(prompt), 0)])
    m.check_integrity()


def test_reset_prefix_cache_forgets_every_group() -> None:
    """After a reset (new weights, say) a prompt computed before hits nothing in any group,
    its blocks are reused as plain free blocks, and the pool stays consistent."""
    layout = group_layout(4, 64, (True, False, True, False))
    m = HybridBlockManager(layout, 40, BS, enable_prefix_caching=True)
    prompt = list(range(2000, 2000 + 4 * BS + 5))
    m.allocate("a", token_ids=prompt)
    m.commit([ScheduledRow("a", len(prompt), 0)])
    m.free("a")
    assert m.cached_tokens(token_ids=prompt) == 4 * BS
    assert m.reset_prefix_cache() == 8  # 4 full blocks keyed in each of the two groups
    assert m.cached_tokens(token_ids=prompt) == 0 and m.reset_prefix_cache() == 0
    assert m.allocate("b", token_ids=prompt) == 0
    m.commit([ScheduledRow("b", len(prompt), 0)])
    m.check_integrity()
    assert HybridBlockManager(layout, 8, BS).reset_prefix_cache() == 0
    with pytest.raises(ArgumentTypeError, match="rows"):
        m.commit(5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="num_tokens"):
        m.blocks_for("3")  # type: ignore[arg-type]


def test_random_operations_keep_every_group_consistent() -> None:
    rng = random.Random(0)
    layout = group_layout(6, 96, gemma3_pattern(6))
    m = HybridBlockManager(layout, 40, BS, enable_prefix_caching=True)
    pieces = [[rng.randrange(50) for _ in range(BS)] for _ in range(3)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            ids = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(pieces)][: rng.randint(1, 4 * BS)]
            if m.can_allocate(token_ids=ids):
                seq = f"s{step}"
                m.allocate(seq, token_ids=ids)
                live[seq] = ids
            else:
                with pytest.raises(OutOfBlocksError):
                    m.allocate(f"s{step}", token_ids=ids)
        elif op < 0.6:
            seq = rng.choice(sorted(live))
            computed = m.num_computed(seq)
            if computed < m.num_tokens(seq):
                m.commit([ScheduledRow(seq, m.num_tokens(seq) - computed, computed)])
            new = [rng.randrange(50) for _ in range(rng.randint(1, 40))]
            if m.can_append(seq, len(new)):
                m.append_slots(seq, len(new), new)
                live[seq] += new
        elif op < 0.68:  # take back a few tokens (rejected drafts): all groups or none
            seq = rng.choice(sorted(live))
            keep = m.num_tokens(seq) - rng.randint(0, 6)
            before = snapshot(m)
            try:
                copies = m.truncate(seq, keep)
            except (InvalidArgumentError, OutOfBlocksError):  # behind a window, or no block to copy into
                assert snapshot(m) == before
            else:
                assert all(m.allocator.ref_count(dst) == 1 for _, dst in copies)
                live[seq] = live[seq][:keep]
        elif op < 0.72:  # the cached run a chunked admission would start from
            ids = [t for _ in range(3) for t in rng.choice(pieces)]
            cached = m.cached_tokens(token_ids=ids)
            assert cached % BS == 0 and cached < len(ids)
            if m.can_allocate(token_ids=ids[: cached + 1]):
                assert m.allocate(f"c{step}", token_ids=ids[: cached + 1]) == cached
                live[f"c{step}"] = ids[: cached + 1]
        elif op < 0.78:
            seq = rng.choice(sorted(live))
            if m.can_fork(seq):
                child = f"{seq}-f{step}"
                m.fork(seq, child)
                live[child] = list(live[seq])
        else:
            seq = rng.choice(sorted(live))
            m.free(seq)
            del live[seq]
        m.check_integrity()
        for seq, ids in live.items():
            assert m.num_tokens(seq) == len(ids)
    for seq in list(live):
        m.free(seq)
    assert m.num_free_blocks == 40
    m.check_integrity()


def test_the_plan_reports_what_kv_groups_hold() -> None:
    """``kvcache plan`` for a Gemma-3-27B layout: the block ids per sequence it reports bound
    what the hybrid manager holds for sequences of that length (equal when the window
    straddles a block boundary), and far more sequences fit than with every layer full."""
    from kvcache import KVCacheConfig, plan_capacity

    layers, window = 62, 1024
    pattern = gemma3_pattern(layers)
    config = KVCacheConfig.model_validate(
        {
            "model": {"num_layers": layers, "num_heads": 32, "num_kv_heads": 16, "head_dim": 128,
                      "sliding_window": window, "window_pattern": list(pattern)},
            "cache": {"block_size": BS, "num_blocks": 2642},
        }
    )  # fmt: skip
    for seq_len in (100, 5_000, 32_768, 32_000 + 17):
        plan = plan_capacity(config, None, max_seq_len=seq_len)
        assert plan.groups is not None and plan.group_block_ids == 2642 * layers // 10
        m = HybridBlockManager(group_layout(layers, window, pattern), plan.group_block_ids, BS)
        run_sequence(m, "s", seq_len - 1, 1, chunk=4096)
        held = m.blocks_held("s")
        assert held <= plan.group_blocks_per_sequence(seq_len) <= held + 6, seq_len
        rows = dict(plan.lines())
        fit = rows[f"sequences of {seq_len:,} tokens, KV groups"]
        assert fit.startswith(f"{plan.group_block_ids // plan.group_blocks_per_sequence(seq_len):,} at once")
    assert plan.group_block_ids // plan.group_blocks_per_sequence(32_017) > 5 * plan.sequences_that_fit
    assert "window 1,024" in "".join(dict(plan.lines()))
    uniform = KVCacheConfig.model_validate(
        {
            "model": {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64},
            "cache": {"block_size": BS, "num_blocks": 8},
        }
    )
    assert plan_capacity(uniform, None, max_seq_len=64).groups is None
