"""``TritonBackend(graph_dequant_prefill=True)``: a mixed CUDA-graph step over an 8-bit cache
plans its prefill rows' 16-bit copy with shapes from the bucket alone (the scratch sized for
the most blocks the bucket's prefill rows can read, the table of the bucket's rows and width,
the real count on the device), so every replay of the bucket launches what was captured.

The plan is checked here with the Hopper kernel made to look possible (on a CPU the attention
itself then runs the Triton prefill kernel, and its output is checked too); the Hopper kernel
over the copy, eager and captured in a CUDA graph, is checked on an sm_90 GPU in
tests/test_prefill_hopper.py."""

from __future__ import annotations

import pytest
import torch

import attention.triton_backend as backend_module
from attention.errors import UnsupportedSettingError
from attention.spec import AttentionSpec
from attention.staging import StepCapacity
from attention.triton_backend import TritonBackend, TritonStepPlan
from tests.paged_case import make_case, make_spec, reference_output, rel_err

pytestmark = pytest.mark.kernel

# (context, new tokens) per row; rows of more than 8 new tokens are prefill rows.
STEPS = [
    [(3, 1), (0, 37), (90, 1)],
    [(70, 20), (31, 1), (0, 12), (150, 1), (12, 33)],
    [(64, 1), (5, 1)],  # no prefill rows: nothing to copy
]
BUCKET_ROWS, BUCKET_TOKENS, BLOCK = 6, 96, 32


@pytest.fixture
def hopper_possible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend plans as on an sm_90 GPU with Gluon."""
    monkeypatch.setattr(backend_module, "hopper_prefill_possible", lambda device: True)


def _spec(cache: str = "float8_e4m3") -> AttentionSpec:
    return make_spec(8, 2, 64, torch.bfloat16, kv_cache_dtype=cache)


@pytest.mark.usefixtures("hopper_possible")
@pytest.mark.parametrize("cache", ["float8_e4m3", "int8"])
def test_graph_steps_plan_a_copy_shaped_by_the_bucket(cache: str, triton_device: str) -> None:
    spec = _spec(cache)
    backend = TritonBackend(spec, num_sms=4, graph_dequant_prefill=True)
    shapes = set()
    for i, rows in enumerate(STEPS):
        case = make_case(rows, spec, block_size=BLOCK, device=triton_device, pad_to=BUCKET_ROWS,
                         pad_tokens=BUCKET_TOKENS, seed=i)  # fmt: skip
        plan = backend.plan(case.meta, graph=True)
        assert isinstance(plan, TritonStepPlan) and plan.prefill is not None
        dequant = plan.prefill.dequant
        assert dequant is not None and dequant.count is not None
        batch, width = case.meta.block_tables.shape
        # At most 96 // 9 = 10 prefill rows, and 6 rows in the bucket: 6 x width blocks.
        assert dequant.sources.shape == (BUCKET_ROWS * width, 2) and dequant.tables.shape == (batch, width)
        shapes.add((tuple(dequant.sources.shape), tuple(dequant.tables.shape)))
        blocks = {r: -(-(c + q) // BLOCK) for r, (c, q) in enumerate(rows) if q > 8}
        assert dequant.count.tolist() == [sum(blocks.values())]
        tables, sources = dequant.tables.tolist(), dequant.sources.tolist()
        expected_sources, next_block = [], 0
        for r in range(batch):
            n = blocks.get(r, 0)
            assert tables[r] == [next_block + c for c in range(n)] + [-1] * (width - n), (i, r)
            expected_sources += [[r, c] for c in range(n)]
            next_block += n
        assert sources == expected_sources + [[-1, -1]] * (len(sources) - next_block)
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
        out = backend.attend(case.query, case.layer, plan)
        real = case.meta.num_real_tokens
        assert rel_err(out[:real].float(), reference_output(case)) < 2e-2
    assert len({s for s, _ in shapes}) == 1  # the scratch: one size for the bucket
    eager = backend.plan(make_case([(0, 300), (40, 1)], spec, block_size=BLOCK, device=triton_device).meta)
    assert isinstance(eager, TritonStepPlan) and eager.prefill is not None
    assert eager.prefill.dequant is not None and eager.prefill.dequant.count is None  # eager: as before


@pytest.mark.usefixtures("hopper_possible")
def test_no_copy_off_by_default_over_the_cap_or_over_16_bits(
    monkeypatch: pytest.MonkeyPatch, triton_device: str
) -> None:
    """Off by default; a bucket whose most blocks would pass the scratch cap, and a 16-bit
    cache, plan none (the Triton prefill kernel, or the Hopper one over the cache itself)."""
    case = make_case(STEPS[1], _spec(), block_size=BLOCK, device=triton_device, pad_to=BUCKET_ROWS,
                     pad_tokens=BUCKET_TOKENS)  # fmt: skip
    plan = TritonBackend(_spec(), num_sms=4).plan(case.meta, graph=True)
    assert isinstance(plan, TritonStepPlan) and plan.prefill is not None and plan.prefill.dequant is None
    backend = TritonBackend(_spec(), num_sms=4, graph_dequant_prefill=True)
    width = case.meta.block_tables.shape[1]
    block_bytes = 2 * BLOCK * 2 * 64 * 2  # K and V, 2 KV heads, head_dim 64, bf16
    monkeypatch.setattr(backend_module, "_DEQUANT_SCRATCH_BYTES", BUCKET_ROWS * width * block_bytes - 1)
    over = backend.plan(case.meta, graph=True)
    assert isinstance(over, TritonStepPlan) and over.prefill is not None and over.prefill.dequant is None
    monkeypatch.setattr(backend_module, "_DEQUANT_SCRATCH_BYTES", BUCKET_ROWS * width * block_bytes)
    fits = backend.plan(case.meta, graph=True)
    assert isinstance(fits, TritonStepPlan) and fits.prefill is not None and fits.prefill.dequant is not None
    plain = make_spec(8, 2, 64, torch.bfloat16)
    bf16_case = make_case(STEPS[1], plain, block_size=BLOCK, device=triton_device, pad_to=BUCKET_ROWS,
                          pad_tokens=BUCKET_TOKENS)  # fmt: skip
    bf16 = TritonBackend(plain, num_sms=4, graph_dequant_prefill=True).plan(bf16_case.meta, graph=True)
    assert isinstance(bf16, TritonStepPlan) and bf16.prefill is not None and bf16.prefill.dequant is None


def test_buffers_hold_the_largest_bucket() -> None:
    """A persistent builder's buffers: the copy's sources for the most prefill rows any step
    can have (tokens / 9, at most the rows) x the table's width, its table, its count; none
    without the option or over a 16-bit cache."""
    capacity = StepCapacity(max_rows=8, max_tokens=45, max_blocks_per_seq=16)
    backend = TritonBackend(_spec(), num_sms=4, graph_dequant_prefill=True)
    sizes = {b.name: b.numel for b in backend.buffer_requests(capacity)}
    assert sizes["prefill_dequant_sources"] == 2 * 5 * 16  # 45 // 9 = 5 prefill rows
    assert sizes["prefill_dequant_tables"] == 8 * 16 and sizes["prefill_dequant_count"] == 1
    plain = make_spec(8, 2, 64, torch.bfloat16)
    for other in (TritonBackend(_spec(), num_sms=4), TritonBackend(plain, num_sms=4, graph_dequant_prefill=True)):
        assert not any(b.name.startswith("prefill_dequant") for b in other.buffer_requests(capacity))


def test_the_option_is_a_bool() -> None:
    with pytest.raises(UnsupportedSettingError, match="graph_dequant_prefill"):
        TritonBackend(_spec(), graph_dequant_prefill="yes")  # type: ignore[arg-type]
