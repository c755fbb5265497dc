"""What is specific to the reference backend, the oracle of every other backend: it agrees
with a naive float64 attention that never touches a block table, it refuses metadata that
points outside the cache (it checks on the host), and the packages import no kernel library.

What every backend must do (the reference included) is tests/test_backend_contract.py.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from attention import ReferenceBackend, get_backend
from attention.errors import BackendUnavailableError, InvalidArgumentError, MetadataError
from tests.paged_case import PagedCase, make_case, make_spec, rel_err


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, float64, a Python loop over query tokens: q [n, h, d], k/v [s, kvh, d]."""
    n, h, _ = q.shape
    s, kvh, _ = k.shape
    out = torch.empty(n, h, q.shape[2], dtype=torch.float64)
    for i in range(n):
        visible = s - n + i + 1
        for head in range(h):
            kv = head // (h // kvh)
            w = (k[:visible, kv].double() @ q[i, head].double()) * scale
            out[i, head] = w.softmax(0) @ v[:visible, kv].double()
    return out


ROWS = [(0, 1), (0, 31), (0, 32), (0, 33), (30, 1), (31, 1), (32, 1), (64, 33), (97, 1), (5, 97), (999, 1)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("math_dtype", [torch.float32, torch.float64])
def test_mixed_batch_matches_naive_float64(group: int, math_dtype: torch.dtype) -> None:
    kv_heads, d, bs = 2, 16, 32
    spec = make_spec(kv_heads * group, kv_heads, d, torch.float32)
    case = make_case(ROWS, spec, block_size=bs, device="cpu", seed=group)
    backend = ReferenceBackend(spec, compute_dtype=math_dtype)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)
    assert torch.isfinite(out).all(), "NaN: a never-written (poisoned) slot was read"
    meta = case.meta
    tables = meta.block_tables
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
        # Rebuild the row's K/V token by token from slots, independently of the backend.
        slots = [int(tables[row, p // bs]) * bs + p % bs for p in range(seq_len)]
        k = case.layer.key.view(-1, kv_heads, d)[slots]
        v = case.layer.value.view(-1, kv_heads, d)[slots]
        want = naive_attention(case.query[start : start + q_len], k, v, 1 / math.sqrt(d))
        # float32 math vs float64: differences are rounding only (~1e-7 relative); the output
        # is stored in the spec's float32 either way.
        torch.testing.assert_close(out[start : start + q_len].double(), want, atol=1e-5, rtol=1e-5)
        start += q_len


def _small(seed: int = 0) -> tuple[ReferenceBackend, PagedCase]:
    spec = make_spec(4, 2, 8, torch.float32)
    case = make_case([(3, 2), (40, 1)], spec, block_size=32, device="cpu", seed=seed)
    return ReferenceBackend(spec), case


@pytest.mark.parametrize("slot", ["one past the end", -5, 2**40])
def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(slot: int | str) -> None:
    backend, case = _small()
    num_slots = case.layer.num_slots
    bad = num_slots if isinstance(slot, str) else slot
    slots = case.meta.slot_mapping.clone()
    slots[0] = bad
    meta = dataclasses.replace(case.meta, slot_mapping=slots)
    before = case.storage.clone()
    with pytest.raises(MetadataError, match=rf"slot_mapping: slot {bad} is outside the cache's {num_slots} slots"):
        backend.write_kv(case.new_key, case.new_value, case.layer, backend.plan(meta))
    assert torch.equal(case.storage.view(torch.int32), before.view(torch.int32)), "a refused write wrote"


@pytest.mark.parametrize("entry", [-1, "num_blocks"])
def test_a_block_table_entry_outside_the_cache_is_refused(entry: int | str) -> None:
    backend, case = _small()
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    bad = case.layer.num_blocks if entry == "num_blocks" else entry
    case.meta.block_tables[1, 1] = bad  # row 1 (41 tokens) needs columns 0 and 1
    with pytest.raises(MetadataError, match=rf"block_tables\[1, 1\] = {bad} is not a block in \[0, "):
        backend.attend(case.query, case.layer, plan)


def test_importing_the_packages_imports_no_kernel_library_nor_torch() -> None:
    """``import attention, kvcache`` stays light: the config validator and the CLI start fast
    and run where no kernel library is installed (backends load by name, lazily)."""
    code = (
        "import sys, attention, kvcache; "
        "print(sorted(m for m in ('triton', 'flash_attn', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_registry_names_the_install() -> None:
    spec = make_spec(4, 2, 16, torch.float32)
    assert isinstance(get_backend("reference", spec), ReferenceBackend)
    with pytest.raises(InvalidArgumentError, match="choose one of"):
        get_backend("flashinfer", spec)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match=r"pip install -e '\.\[flash-attn\]'"):
            get_backend("flash_attn", make_spec(4, 2, 16, torch.float16))


def test_rel_err_never_passes_nan() -> None:
    assert math.isnan(rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])))


@pytest.mark.parametrize(
    ("field", "index", "value", "match"),
    [
        ("seq_lens", 1, 7, r"metadata.seq_lens\[1\]: 7 on the device, 6 on the host"),
        ("query_start_loc", 1, 2, r"metadata.query_start_loc\[1\]: 2 on the device; the host query lengths give 3"),
        ("slot_mapping", 3, None, r"metadata.slot_mapping: slot \d+ is written by two tokens"),
    ],
)
def test_device_values_that_contradict_the_host_are_refused(
    field: str, index: int, value: int | None, match: str
) -> None:
    """Hand-made metadata whose device tensors disagree with its host lengths (or that sends
    two new tokens to one slot) is refused at the step's first layer call, before anything
    is written."""
    spec = make_spec(2, 1, 16, torch.float32)
    case = make_case([(0, 3), (5, 1)], spec, block_size=32, device="cpu")
    tensor = getattr(case.meta, field)
    tensor[index] = tensor[0] if value is None else value  # slot 3 := slot 0
    before = case.storage.clone()
    backend = ReferenceBackend(spec)
    plan = backend.plan(case.meta)
    with pytest.raises(MetadataError, match=match):
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    with pytest.raises(MetadataError, match=match):
        backend.attend(case.query, case.layer, plan)
    assert torch.equal(case.storage.isnan(), before.isnan())


def test_logit_softcap_is_c_tanh_of_the_scaled_scores() -> None:
    """The oracle's cap, against the formula written out for one decode row."""
    spec = make_spec(2, 1, 8, torch.float32, logit_softcap=1.5, softmax_scale=0.7)
    case = make_case([(9, 1)], spec, block_size=32, device="cpu", seed=2)
    backend = ReferenceBackend(spec, compute_dtype=torch.float64)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan)  # float64 math, float32 out
    k, v = case.all_key.double()[:10], case.all_value.double()[:10]  # [10, 1, 8]
    q = case.query.double()[0]  # [2, 8]
    scores = 1.5 * torch.tanh(0.7 * (q @ k[:, 0].T) / 1.5)  # [2, 10]
    want = scores.softmax(-1) @ v[:, 0]
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-6)


def test_attention_sinks_join_the_denominator() -> None:
    """The oracle's sinks, against the formula written out for one decode row: each head's
    softmax gains a key whose logit is the sink and whose value is zero."""
    spec = make_spec(2, 1, 8, torch.float32, attention_sinks=True)
    case = make_case([(9, 1)], spec, block_size=32, device="cpu", seed=4)
    sinks = torch.tensor([0.5, 3.0])
    backend = ReferenceBackend(spec, compute_dtype=torch.float64)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    out = backend.attend(case.query, case.layer, plan, sinks=sinks)
    k, v = case.all_key.double()[:10, 0], case.all_value.double()[:10, 0]  # [10, 8]
    q = case.query.double()[0]  # [2, 8]
    scores = (q @ k.T) * spec.scale  # [2, 10]
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.double().exp()[:, None])
    torch.testing.assert_close(out[0].double(), weights @ v, rtol=1e-5, atol=1e-6)
