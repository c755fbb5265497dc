"""Draft trees through the backends: ``AttentionMetadata.tree_masks`` gives each new token of a
row the set of the row's new tokens it sees (its ancestors in a draft tree, as EAGLE and
Medusa verify). The reference and triton backends against a float64 oracle written out here,
a chain mask equal to plain causal attention, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention import ReferenceBackend
from attention.errors import MetadataError, UnsupportedSettingError
from attention.triton_backend import TritonBackend, TritonStepPlan
from tests.paged_case import PagedCase, ancestor_masks, make_case, make_spec, tree_reference

pytestmark = pytest.mark.kernel

#: Row 0's tree (7 new tokens): 0 the verified root; 1, 2 and 6 its children; 3 under 1;
#: 4 under 2; 5 under 3. Row 1: a chain of 3 (plain causal).
PARENTS: list[int | None] = [None, 0, 0, 1, 2, 3, 0]


def _masks() -> list[int]:
    return [*ancestor_masks(PARENTS), 0b1, 0b11, 0b111]


def _case(device: str, **spec_kw: object) -> PagedCase:
    spec = make_spec(8, 2, 32, torch.float32, **spec_kw)
    case = make_case([(45, 7), (20, 3)], spec, block_size=32, device=device, seed=3)
    writer = ReferenceBackend(spec)
    writer.write_kv(case.new_key, case.new_value, case.layer, writer.plan(case.meta))
    return case


def _with_tree(case: PagedCase, masks: list[int]) -> PagedCase:
    tree = torch.tensor(masks, dtype=torch.int32, device=case.query.device)
    return dataclasses.replace(case, meta=dataclasses.replace(case.meta, tree_masks=tree))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tree_masks_match_the_oracle_and_a_chain_is_causal(backend: str, triton_device: str) -> None:
    device = "cpu" if backend == "reference" else triton_device
    case = _case(device)
    make = ReferenceBackend if backend == "reference" else TritonBackend
    attn = make(case.spec)
    tree_case = _with_tree(case, _masks())
    plan = attn.plan(tree_case.meta)
    if isinstance(plan, TritonStepPlan):
        assert plan.decode_rows == (0, 1), "draft rows go to the decode kernel"
    out = attn.attend(tree_case.query, tree_case.layer, plan)
    expect = tree_reference(case, _masks(), case.spec.scale)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=2e-5)  # fp32 inputs, float64 oracle
    causal = attn.attend(case.query, case.layer, attn.plan(case.meta))
    torch.testing.assert_close(out[7:], causal[7:], rtol=0, atol=1e-6)  # row 1's chain
    assert (out[:7] - causal[:7]).abs().max() > 1e-3, "the tree changed nothing"


def test_refusals_name_the_field(triton_device: str) -> None:
    case = _case(triton_device)
    triton = TritonBackend(case.spec)
    with pytest.raises(MetadataError, match="tree_masks: expected int32"):
        triton.plan(dataclasses.replace(case.meta, tree_masks=torch.zeros(10, device=triton_device)))
    with pytest.raises(MetadataError, match="tree_masks: 4 entries"):
        triton.plan(_with_tree(case, [1, 3, 7, 15]).meta)
    # A row longer than the decode kernel takes (here with max_decode_query_len 4).
    with pytest.raises(MetadataError, match="row 0 brings 7 new tokens"):
        TritonBackend(case.spec, max_decode_query_len=4).plan(_with_tree(case, _masks()).meta)
    windowed = _case(triton_device, sliding_window=16)
    with pytest.raises(UnsupportedSettingError, match="not with a sliding window"):
        TritonBackend(windowed.spec).plan(_with_tree(windowed, _masks()).meta)
