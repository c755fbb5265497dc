"""The reference backend against a naive float64 attention that never touches a block table."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from attention import AttentionMetadata, ReferenceBackend, get_backend
from tests.paged_case import make_case, rel_err


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
def test_mixed_batch_matches_naive_float64(group: int) -> None:
    kv_heads, d, bs = 2, 16, 32
    case = make_case(ROWS, heads=kv_heads * group, kv_heads=kv_heads, head_dim=d, block_size=bs,
                     dtype=torch.float32, device="cpu", seed=group)
    backend = ReferenceBackend()
    out = backend.attend(case.query, case.k_cache, case.v_cache, backend.plan(case.meta))
    assert torch.isfinite(out).all(), "NaN: a never-written (poisoned) slot was read"
    meta = case.meta
    tables = meta.block_tables
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host, strict=True)):
        # Rebuild the row's K/V token by token from slots, independently of the backend.
        slots = [int(tables[row, p // bs]) * bs + p % bs for p in range(seq_len)]
        k = case.k_cache.view(-1, kv_heads, d)[slots]
        v = case.v_cache.view(-1, kv_heads, d)[slots]
        want = naive_attention(case.query[start : start + q_len], k, v, 1 / math.sqrt(d))
        # float32 math vs float64: differences are rounding only (~1e-7 relative)
        torch.testing.assert_close(out[start : start + q_len].double(), want, atol=1e-5, rtol=1e-5)
        start += q_len


def test_write_kv_writes_exactly_the_given_slots() -> None:
    backend = ReferenceBackend()
    k_cache = torch.full((4, 32, 2, 8), float("nan"))
    v_cache = torch.full((4, 32, 2, 8), float("nan"))
    slots = torch.tensor([70, -1, 3, 127, 32])
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    backend.write_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    written = {70, 3, 127, 32}
    untouched = [s for s in range(128) if s not in written]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    backend = ReferenceBackend()
    cache = torch.zeros(2, 32, 1, 8)
    with pytest.raises(ValueError, match="slot 64 is outside the cache's 64 slots"):
        backend.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, cache.clone(), torch.tensor([64]))


def _small_case() -> tuple[ReferenceBackend, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    case = make_case([(3, 2)], heads=4, kv_heads=2, head_dim=8, block_size=32, dtype=torch.float32, device="cpu")
    return ReferenceBackend(), case.query, case.k_cache, case.v_cache, case.meta


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda q, k, v: (q[:, :3], k, v), "not a multiple of the cache's 2 KV heads"),
        (lambda q, k, v: (q.double(), k, v), "query: expected dtype torch.float32"),
        (lambda q, k, v: (q[:1], k, v), r"query: expected shape \[2, \*, 8\]"),
        (lambda q, k, v: (q, k, v[:1]), "v_cache: expected shape"),
        (lambda q, k, v: (q, k.half(), v.half()), "query: expected dtype torch.float16"),
        (lambda q, k, v: (q, k[:, :16].contiguous(), v[:, :16].contiguous()), "block_size 16"),
    ],
)
def test_bad_arguments_raise_before_any_work(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    backend, q, k, v, meta = _small_case()
    q2, k2, v2 = mutate(q, k, v)
    with pytest.raises(ValueError, match=message):
        backend.attend(q2, k2, v2, backend.plan(meta))


def test_padded_block_table_entry_needed_by_a_row_is_refused() -> None:
    backend, q, k, v, meta = _small_case()
    meta.block_tables[0, 0] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = -1"):
        backend.attend(q, k, v, backend.plan(meta))


def test_importing_the_packages_imports_no_kernel_library() -> None:
    code = "import sys, attention, kvcache; print(sorted(m for m in ('triton', 'flash_attn') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_registry_names_the_install() -> None:
    assert isinstance(get_backend("reference"), ReferenceBackend)
    with pytest.raises(KeyError, match="choose one of"):
        get_backend("flashinfer")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'paged-kvcache\[flash-attn\]'"):
            get_backend("flash_attn")


def test_rel_err_never_passes_nan() -> None:
    assert math.isnan(rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])))
