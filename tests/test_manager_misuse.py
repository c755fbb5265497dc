"""Misuse of the bookkeeping API found by probing it: each case raised an untyped error,
changed state before refusing, or was accepted and corrupted the manager. Every test here
fails on the code before its fix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attention import AttentionSpec, get_backend
from attention.errors import ArgumentTypeError, InvalidArgumentError, MetadataError
from attention.metadata import AttentionMetadata
from attention.synthetic import synthetic_metadata
from kvcache import (
    BlockManager,
    KVCacheTensors,
    MetadataBuilder,
    ScheduledRow,
    SwapSpace,
    allocate_kv_cache,
    backend_for,
    load_config,
    manager_for,
)
from kvcache.parallel.agreement import StepDigest
from tests.manager_state import snapshot


def _windowed_with_deferred_ids() -> BlockManager:
    """Prefix caching, a window of 4 tokens, blocks of 4; 11 tokens appended with their ids
    deferred, so blocks are released behind the window before their ids are known."""
    m = BlockManager(8, 4, enable_prefix_caching=True, sliding_window=4)
    m.allocate("a", token_ids=[1])
    m.commit([ScheduledRow("a", 1, start=0)])
    for _ in range(11):
        m.append_slots("a", 1, defer_ids=True)
        m.commit([ScheduledRow("a", 1)])
    m.fill_token_ids("a", list(range(2, 13)))
    return m


def test_blocks_released_before_their_ids_came_are_not_indexed() -> None:
    m = _windowed_with_deferred_ids()
    assert m.block_table("a")[:2] == [-1, -1]
    m.check_integrity()
    assert -1 not in m.prefix_cache.holders  # type: ignore[union-attr]
    # A prompt with the same first tokens finds nothing cached: blocks 0 and 1 are gone.
    assert m.allocate("b", token_ids=list(range(1, 7))) == 0
    assert -1 not in m.block_table("b")
    m.check_integrity()


@pytest.mark.parametrize("lag", [-1, -100, "2", 1.5, None, True])
def test_window_lag_takes_only_an_int_at_least_zero(lag: object) -> None:
    m = BlockManager(8, 4, sliding_window=8)
    with pytest.raises((InvalidArgumentError, ArgumentTypeError), match="window_lag"):
        m.window_lag = lag  # type: ignore[assignment]
    assert m.window_lag == 0
    m.window_lag = 3
    assert m.window_lag == 3


@pytest.mark.parametrize(
    "ids",
    [
        [np.int64(1), np.int64(2), np.int64(3)],
        [np.int32(1), np.uint16(2), 3],
        list(torch.tensor([1, 2, 3])),
    ],
    ids=["numpy-int64", "numpy-mixed", "tensor-elements"],
)
def test_integer_scalars_are_stored_as_python_ints(ids: list[object]) -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    swap = SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 8, 4, 1, 8)), 4)
    m.allocate("a", token_ids=ids)
    m.append_slots("a", 1, token_ids=[np.int64(4)])
    assert {type(t) for t in m.sequence("a").token_ids or []} == {int}
    swap.swap_out("a")
    swap.swap_in("a")  # refused before: the stored ids were not plain ints
    assert m.sequence("a").token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [torch.tensor(True), np.bool_(True)], ids=["tensor-bool", "numpy-bool"])
def test_boolean_scalars_are_not_token_ids(bad: object) -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    before = snapshot(m)
    with pytest.raises(ArgumentTypeError, match=r"token_ids\[1\]"):
        m.allocate("a", token_ids=[1, bad, 3])
    assert snapshot(m) == before


def test_a_row_may_not_start_before_position_zero() -> None:
    m = BlockManager(16, 4)
    m.allocate("a", 34)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match=r"rows\[0\]\.start"):
        m.commit([ScheduledRow("a", 34, start=-2)])
    assert snapshot(m) == before
    with pytest.raises(MetadataError, match=r"rows\[0\]\.start: -2 is negative"):
        MetadataBuilder("cpu").build(m, [ScheduledRow("a", 6, start=-2)])


def test_attach_tier_refuses_what_is_not_a_tier_and_keeps_none() -> None:
    m = BlockManager(8, 4, enable_prefix_caching=True)
    with pytest.raises(ArgumentTypeError, match="not a lower tier"):
        m.attach_tier(object())  # type: ignore[arg-type]
    assert m.lower_tier is None
    assert m.allocate("a", token_ids=[1, 2, 3, 4, 5]) == 0  # admission still works


def _cpu_engine_parts() -> tuple[object, object, BlockManager, object]:
    config = load_config("tiny-cpu")
    cache = allocate_kv_cache(config, fill=0.0)
    backend = backend_for(config, "cpu").backend
    return config, cache, manager_for(config, cache), backend


def test_a_plan_is_refused_once_its_builder_planned_the_next_step() -> None:
    _, cache, m, backend = _cpu_engine_parts()
    builder = MetadataBuilder(cache.device, backend=backend, num_cache_blocks=cache.num_blocks)  # type: ignore[attr-defined]
    m.allocate("a", 40)
    m.allocate("b", 40)
    first = builder.plan(m, [ScheduledRow("a", 40, start=0)])
    layer = cache.layer(0)  # type: ignore[attr-defined]
    spec = backend.spec  # type: ignore[attr-defined]
    k = torch.randn(40, spec.num_kv_heads, spec.head_dim)
    backend.write_kv(k, k, layer, first)  # type: ignore[attr-defined]
    second = builder.plan(m, [ScheduledRow("b", 40, start=0)])
    stored = layer.key.clone()
    with pytest.raises(MetadataError, match="plan: made for step 1 of its builder, whose buffers now hold step 2"):
        backend.write_kv(k, k, layer, first)  # type: ignore[attr-defined]
    assert torch.equal(layer.key, stored), "nothing written through the stale plan"
    backend.write_kv(k, k, layer, second)  # type: ignore[attr-defined]
    # A plan the builder refused does not end the current one.
    with pytest.raises(ArgumentTypeError):
        builder.plan(m, [ScheduledRow("a", 40, start=0)], token_ids=[1.5] * 40)
    backend.write_kv(k, k, layer, second)  # type: ignore[attr-defined]


def test_a_refused_plan_leaves_the_previous_step_as_planned() -> None:
    _, cache, m, backend = _cpu_engine_parts()
    builder = MetadataBuilder(cache.device, backend=backend, num_cache_blocks=cache.num_blocks)  # type: ignore[attr-defined]
    m.allocate("a", 40)
    m.allocate("b", 50)
    plan = builder.plan(m, [ScheduledRow("a", 40, start=0)], token_ids=list(range(40)))
    tables, slots = plan.metadata.block_tables.clone(), plan.metadata.slot_mapping.clone()
    for bad in ([1.5] * 50, 5, (i for i in range(50))):
        with pytest.raises(ArgumentTypeError, match="token_ids"):
            builder.plan(m, [ScheduledRow("b", 50, start=0)], token_ids=bad)  # type: ignore[arg-type]
    assert torch.equal(plan.metadata.block_tables, tables) and torch.equal(plan.metadata.slot_mapping, slots)
    with pytest.raises(ArgumentTypeError, match="manager: expected a BlockManager"):
        builder.plan(object(), [ScheduledRow("a", 40, start=0)])  # type: ignore[arg-type]


def test_step_digest_changes_nothing_when_refusing() -> None:
    m = BlockManager(8, 4)
    m.allocate("a", 3)
    digest = StepDigest()
    value = digest.value
    for kwargs in ({"token_ids": [2**70]}, {"token_ids": [1.5]}, {"step": 1.5}):
        args: dict[str, object] = {"step": 0, "manager": m, "rows": [ScheduledRow("a", 3, start=0)], **kwargs}
        with pytest.raises(ArgumentTypeError):
            digest.update(**args)  # type: ignore[arg-type]
        assert digest.value == value
    same = StepDigest()
    assert digest.update(0, m, [ScheduledRow("a", 3, start=0)], [1, 2, 3]) == same.update(
        0, m, [ScheduledRow("a", 3, start=0)], [1, 2, 3]
    )


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, torch.full_like(x, 5)], -1).reshape(-1)[::2]


@pytest.mark.parametrize("name", ["slot_mapping", "seq_lens", "query_start_loc", "positions", "block_tables"])
def test_metadata_that_is_not_contiguous_is_refused(name: str) -> None:
    meta = synthetic_metadata([(40, 40), (7, 7), (70, 1)], 32, torch.device("cpu"))
    value = getattr(meta, name)
    strided = value.t().contiguous().t() if value.dim() == 2 else _strided(value)
    assert torch.equal(strided, value) and not strided.is_contiguous()
    bad = dataclasses.replace(meta, **{name: strided})
    with pytest.raises(MetadataError, match=rf"metadata\.{name}: strides"):
        bad.check()
    backend = get_backend("reference", AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32"))
    with pytest.raises(MetadataError, match=rf"metadata\.{name}"):
        backend.plan(bad)


@pytest.mark.parametrize("block_size", [0, -32, 32.0])
def test_metadata_block_size_must_be_a_positive_int(block_size: object) -> None:
    meta = synthetic_metadata([(40, 40)], 32, torch.device("cpu"))
    bad: AttentionMetadata = dataclasses.replace(meta, block_size=block_size)  # type: ignore[arg-type]
    with pytest.raises(MetadataError, match=r"metadata\.block_size"):
        bad.check()



def test_one_table_tools_tell_a_hybrid_manager_what_it_can_do() -> None:
    from kvcache import HybridBlockManager, collect_stats, group_layout, preempt

    hybrid = HybridBlockManager(group_layout(4, 128, (True, False, True, False)), 16, 32)
    hybrid.allocate("a", 40)
    cache = KVCacheTensors(torch.zeros(4, 2, 16, 32, 1, 8))
    for call in (
        lambda: SwapSpace(hybrid, cache, 4),  # type: ignore[arg-type]
        lambda: collect_stats(hybrid),  # type: ignore[arg-type]
        lambda: preempt(hybrid, "a"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ArgumentTypeError, match=r"HybridBlockManager \(KV groups\) has no swap space"):
            call()
    assert hybrid.num_sequences == 1


@pytest.mark.parametrize("flag", [torch.tensor(True), np.bool_(False)], ids=["tensor", "numpy"])
def test_counts_refuse_boolean_scalars(flag: object) -> None:
    m = BlockManager(8, 4)
    with pytest.raises(ArgumentTypeError, match="num_tokens: expected an integer, got bool"):
        m.allocate("a", flag)  # type: ignore[arg-type]
    assert m.num_sequences == 0


def test_manager_for_checks_its_arguments() -> None:
    config = load_config("tiny-cpu")
    other = config.model_copy(update={"cache": config.cache.model_copy(update={"block_size": 64})})
    with pytest.raises(InvalidArgumentError, match="cache: blocks of 64 tokens"):
        manager_for(config, allocate_kv_cache(other))
    with pytest.raises(ArgumentTypeError, match="prefix_caching: expected True, False or None"):
        manager_for(config, allocate_kv_cache(config), prefix_caching="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("keys", "ab", "record.keys: expected a list of BlockKey"),
        ("keys", [1], "record.keys: expected a list of BlockKey"),
        ("extra_key", ["salt"], "record.extra_key: list is not hashable"),
    ],
)
def test_attach_refuses_a_record_with_foreign_keys_or_salt(field: str, value: object, message: str) -> None:
    m = BlockManager(num_blocks=8, block_size=32, enable_prefix_caching=True)
    m.allocate(1, token_ids=list(range(40)))
    m.commit([ScheduledRow(1, 40)])
    record = m.detach(1)
    assert len(record.keys) == 1  # the full block was keyed
    before = snapshot(m)
    with pytest.raises(ArgumentTypeError, match=message):
        m.attach(1, dataclasses.replace(record, **{field: value}))
    assert snapshot(m) == before
    assert m.attach(1, record) and m.num_sequences == 1
    m.check_integrity()
