"""The device check of step metadata (attention.metadata_check): its two implementations (the
Triton kernel, and the plain-torch twin a deployment without Triton runs) agree, a valid step
passes untouched, and what the hostile-metadata fuzz (tests/test_backend_metadata_fuzz.py)
found is kept here as fixed examples.

Without a GPU the Triton kernel runs in Triton's CPU interpreter (tests/conftest.py), which
runs the check's programs one after another.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from attention.errors import MetadataError
from attention.metadata import AttentionMetadata
from attention.metadata_check import VIOLATIONS, DeviceCheck
from tests.hostile_metadata import WINDOW, Step, corrupt, hostile_case, steps
from tests.paged_case import PagedCase, UnderTest

pytestmark = pytest.mark.kernel

DEVICE_FIELDS = ("block_tables", "seq_lens", "query_start_loc", "slot_mapping", "positions")


@pytest.fixture(params=["triton-kernel", "torch"])
def use_triton(request: pytest.FixtureRequest) -> bool:
    """Which implementation of the check runs."""
    return bool(request.param == "triton-kernel")


def _device() -> str:
    """Where the Triton kernel runs (as the ``triton_device`` fixture)."""
    from attention.triton_kernels import kernels_interpreted

    return "cpu" if kernels_interpreted() else "cuda"


def _case(device: str, step: Step, use_triton: bool) -> tuple[PagedCase, DeviceCheck]:
    case = hostile_case(UnderTest("triton", device, 32), step)
    check = case.builder._check if case.builder is not None else None
    assert check is not None, "make_case(device_check=True) keeps its builder"
    check._use_triton = use_triton
    return case, check


def _reported(check: DeviceCheck) -> None:
    """``raise_if_violated`` once the check's flag has reached the host (it never waits)."""
    if check.device.type == "cuda":
        torch.cuda.synchronize(check.device)
    check.raise_if_violated()


def _copy(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, **{name: getattr(meta, name).clone() for name in DEVICE_FIELDS})


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_valid_step_passes_untouched(use_triton: bool, window: int | None, triton_device: str) -> None:
    case, check = _case(triton_device, Step([(40, 1), (3, 9), (0, 1)], pad=2, window=window), use_triton)
    before = _copy(case.meta)
    check.run(case.meta, case.layer.num_blocks, window)
    _reported(check)
    for name in DEVICE_FIELDS:
        assert torch.equal(getattr(case.meta, name), getattr(before, name)), f"the check changed a valid {name}"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(step=steps(), data=st.data())
def test_the_kernel_and_its_torch_twin_agree(step: Step, data: st.DataObject) -> None:
    """On hostile metadata both implementations repair the same entries the same way and
    both flag it. (In the interpreter the kernel's programs run in order, as the twin's loop
    does; slots and positions stay within int32, see the test below.)"""
    case, _ = _case(_device(), step, use_triton=True)
    _, planted = corrupt(data, case, step.window)
    for name in ("slot_mapping", "positions"):
        field = getattr(case.meta, name)
        field.clamp_(-(2**31), 2**31 - 1)
    repaired = []
    for use_triton in (True, False):
        meta = _copy(case.meta)
        check = DeviceCheck(meta.device)
        check._use_triton = use_triton
        check.run(meta, case.layer.num_blocks, step.window)
        with pytest.raises(MetadataError):
            _reported(check)
        repaired.append(meta)
    starts_broken = any("query_start_loc" in p for p in planted)
    for name in DEVICE_FIELDS:
        kernel, twin = (getattr(m, name) for m in repaired)
        if starts_broken and name != "query_start_loc" and repaired[0].device.type == "cuda":
            # On a GPU the kernel's programs read the starts while program 0 repairs them, so
            # a row may see them broken or repaired: the step is garbage either way (every
            # slot becomes -1, below); only the repaired starts must agree.
            continue
        assert torch.equal(kernel, twin), f"{name} after {planted}: kernel {kernel.tolist()}, torch {twin.tolist()}"
    if starts_broken:
        for meta in repaired:
            assert bool((meta.slot_mapping == -1).all()), "a step with broken starts must write nothing"


@pytest.mark.parametrize("scenario", ["token-in-no-row", "padding-token-moved-into-row-0"])
def test_no_token_keeps_a_slot_of_another_row(use_triton: bool, scenario: str, triton_device: str) -> None:
    """Repairing query_start_loc changes which row a token belongs to. A token the repair
    leaves in no row, or moves into another row, must not keep a slot of another row (the
    check's promise: "a write can only land in the row's own block")."""
    if scenario == "token-in-no-row":
        # Starts [0, 1, 2, 3]; the last one pulled below 0 is repaired to 2: token 2 is in no
        # row, and its slot is token 0's (row 0's).
        case, check = _case(triton_device, Step([(5, 1), (40, 1), (3, 1)]), use_triton)
        token, index, start, victim = 2, 3, -3, 0
    else:
        # Rows of 3 and 1 tokens, then two padding rows (tokens 4, 5). The first start, past
        # the step's 6 tokens, is repaired to 6: row 0 takes every token, and token 4, a padding
        # token, now sits at row 0's position 47, whose slot token 4 was given: token 1's.
        case, check = _case(triton_device, Step([(46, 3), (51, 1)], pad=2), use_triton)
        token, index, start, victim = 4, 1, 7, 1
    meta = case.meta
    stolen = int(meta.slot_mapping[victim])
    meta.query_start_loc[index] = start
    meta.slot_mapping[token] = stolen
    check.run(meta, case.layer.num_blocks, None)
    with pytest.raises(MetadataError, match=re.escape(VIOLATIONS[2])):
        _reported(check)
    assert int(meta.slot_mapping[token]) != stolen, (
        f"after the check, query_start_loc {meta.query_start_loc.tolist()}, slot_mapping "
        f"{meta.slot_mapping.tolist()}: token {token} still writes slot {stolen}, token {victim}'s (another row's)"
    )


@pytest.mark.parametrize(("field", "code"), [("slot_mapping", 5), ("positions", 6)])
def test_values_past_int32_are_reported(use_triton: bool, field: str, code: int, triton_device: str) -> None:
    """slot_mapping and positions are int64; a corrupt value past int32 is reported as a
    MetadataError like any other (the flag that carries it holds int32)."""
    case, check = _case(triton_device, Step([(5, 1), (40, 1), (3, 1)]), use_triton)
    getattr(case.meta, field)[1] = 2**40
    check.run(case.meta, case.layer.num_blocks, None)
    with pytest.raises(MetadataError, match=re.escape(VIOLATIONS[code])):
        _reported(check)


def _unsafe_host_columns(case: PagedCase, window: int | None) -> list[tuple[int, int, int]]:
    """(row, column, entry) of every block-table entry outside [0, num_blocks) that a backend
    planning from the host's lengths reads (flash-attn: its K lengths are staged from
    ``seq_lens_host``; a padding row reads column 0)."""
    meta, bs, num_blocks = case.meta, case.meta.block_size, case.layer.num_blocks
    tables = meta.block_tables.tolist()
    read: list[tuple[int, int]] = []
    for row, (s, q) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
        first = 0 if window is None else max(0, s - q - window + 1) // bs
        read += [(row, col) for col in range(first, -(-s // bs))]
    read += [(row, 0) for row in range(meta.batch, meta.padded_batch)]
    return [(r, c, tables[r][c]) for r, c in read if not 0 <= tables[r][c] < num_blocks]


def _unsafe_device_columns(case: PagedCase, window: int | None) -> list[tuple[int, int, int]]:
    """(row, column, entry) of every block-table entry outside [0, num_blocks) that a backend
    reading the table through the device lengths reads once the check has run: columns below
    each row's length (at least 1: flash-attn's padding and emptied rows read column 0), from
    its window's first when there is one, as the check left lengths and query starts."""
    meta, bs, num_blocks = case.meta, case.meta.block_size, case.layer.num_blocks
    tables, lens, starts = meta.block_tables.tolist(), meta.seq_lens.tolist(), meta.query_start_loc.tolist()
    read: list[tuple[int, int]] = []
    for row, s in enumerate(lens):
        q = starts[row + 1] - starts[row]
        first = 0 if window is None or s == 0 else max(0, s - q - window + 1) // bs
        read += [(row, col) for col in range(first, max(-(-s // bs), 1))]
    return [(r, c, tables[r][c]) for r, c in read if not 0 <= tables[r][c] < num_blocks]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(step=steps(), data=st.data(), use_triton=st.booleans())
def test_every_entry_read_through_the_checked_lengths_is_repaired(
    step: Step, data: st.DataObject, use_triton: bool
) -> None:
    """Whatever was corrupted, a backend that reads the table through the device lengths as
    the check leaves them (our kernels, and flash-attn, whose lengths come from there at its
    first attend) finds only blocks in range. A length cut short hides the table past it from
    the check: that is why flash-attn no longer takes its lengths from the host."""
    case, check = _case(_device(), step, use_triton)
    _, planted = corrupt(data, case, step.window)
    check.run(case.meta, case.layer.num_blocks, step.window)
    with pytest.raises(MetadataError):
        _reported(check)
    unsafe = _unsafe_device_columns(case, step.window)
    assert not unsafe, f"after {planted}: (row, column, block) {unsafe} left for a backend reading them"


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_length_cut_short_leaves_the_table_past_it_to_the_readers(
    use_triton: bool, window: int | None, triton_device: str
) -> None:
    """Row 0 (54 tokens, 2 blocks) gets length 20 and a bad id in column 1: the check reports
    the row (its positions no longer match) and leaves column 1 alone, which the readers of the
    device length never reach."""
    case, check = _case(triton_device, Step([(53, 1), (42, 1)], window=window), use_triton)
    case.meta.seq_lens[0] = 20
    case.meta.block_tables[0, 1] = 2**31 - 1
    check.run(case.meta, case.layer.num_blocks, window)
    with pytest.raises(MetadataError, match=re.escape(VIOLATIONS[6]) + "|" + re.escape(VIOLATIONS[5])):
        _reported(check)
    assert int(case.meta.block_tables[0, 1]) == 2**31 - 1 and _unsafe_device_columns(case, window) == []


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_row_zeroed_for_its_starts_has_its_table_repaired(
    use_triton: bool, window: int | None, triton_device: str
) -> None:
    """The H200 fuzz example, fixed: row 1's block id corrupt and its end start pulled back to
    0. The repaired starts give row 1 no token, so its length is set to 0; its table entry is
    repaired all the same."""
    case, check = _case(triton_device, Step([(54, 1), (42, 1)], window=window), use_triton)
    case.meta.block_tables[1, 0] = 2**31 - 1
    case.meta.query_start_loc[2] = 0
    check.run(case.meta, case.layer.num_blocks, window)
    with pytest.raises(MetadataError, match=re.escape(VIOLATIONS[2])):
        _reported(check)
    assert int(case.meta.seq_lens[1]) == 0
    assert _unsafe_host_columns(case, window) == []
