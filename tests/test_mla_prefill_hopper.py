"""The Hopper (sm_90) decompressed MLA prefill kernel (attention/triton_kernels/mla_prefill_hopper.py)
against the float64 oracle: prompts, extend rows over cached keys, decode and empty rows, odd
lengths, DeepSeek-V3's widths (n = v = 128, e = 64) and half of them, bf16 and fp16, one
program per SM and 3 taking every item in turn. The keys of a row no query sees are NaN, so a
read past a row's keys that is not masked turns the output NaN. Needs an sm_90 GPU and a Triton
with Gluon; skipped with the reason otherwise. tests/test_mla_prefill_hopper_compile.py
compiles it for sm_90 without a GPU."""

from __future__ import annotations

import pytest
import torch

import attention.triton_kernels.mla_prefill as mla_prefill_module
from attention.triton_kernels.mla_prefill import MLAPrefillConfig, mla_prefill
from attention.triton_kernels.prefill_hopper import gluon_available
from tests.test_mla_prefill import _reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="the Hopper MLA prefill kernel runs on sm_90 only",
    ),
    pytest.mark.skipif(not gluon_available(), reason="needs a Triton with Gluon (>= 3.6), compiled kernels"),
]

# (new tokens, keys) per row: a prompt, an extend row, a row no query reads (its keys NaN), a
# decode row, a long prompt, a short extend over many cached keys.
ROWS = [(300, 300), (77, 277), (0, 130), (1, 513), (700, 700), (5, 389)]


@pytest.fixture
def hopper_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = mla_prefill_module.mla_prefill_hopper

    def counted(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(mla_prefill_module, "mla_prefill_hopper", counted)
    return calls


def _case(heads: int, nope: int, rope: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens, keys = sum(q for q, _ in ROWS), sum(k for _, k in ROWS)
    query = torch.randn(tokens, heads, nope + rope, generator=gen, dtype=torch.float64)
    kv = torch.randn(keys, heads, 2 * nope, generator=gen, dtype=torch.float64)
    latents = torch.randn(keys, 512 + rope, generator=gen, dtype=torch.float64)
    start = sum(k for _, k in ROWS[:2])
    kv[start : start + ROWS[2][1]] = float("nan")  # the keys of the row without queries
    latents[start : start + ROWS[2][1]] = float("nan")
    return query, kv, latents


def _run(query, kv, latents, nope, dtype, **kw):  # type: ignore[no-untyped-def]
    q_lens, k_lens = [q for q, _ in ROWS], [k for _, k in ROWS]
    return mla_prefill(
        query.to("cuda", dtype), kv.to("cuda", dtype), latents.to("cuda", dtype)[:, 512:], q_lens, k_lens,
        qk_nope_head_dim=nope, scale=(query.shape[2]) ** -0.5, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "nope", "rope"), [(16, 128, 64), (9, 64, 32), (128, 128, 64)])
def test_matches_float64(hopper_calls: list[int], dtype: torch.dtype, heads: int, nope: int, rope: int) -> None:
    query, kv, latents = _case(heads, nope, rope, seed=heads)
    q_lens, k_lens = [q for q, _ in ROWS], [k for _, k in ROWS]
    want = _reference(query, kv, latents[:, 512:], q_lens, k_lens, nope, (nope + rope) ** -0.5)
    got = _run(query, kv, latents, nope, dtype)
    assert hopper_calls, "the call should have run on the Hopper kernel"
    assert torch.isfinite(got).all()
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err


def test_few_programs_and_the_triton_kernel_agree(hopper_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """3 persistent programs (rings and Q buffers wrap across items) write what one per SM
    writes; ``hopper=False`` and an explicit config run the Triton kernel, within bf16 noise."""
    query, kv, latents = _case(16, 128, 64, seed=4)
    full = _run(query, kv, latents, 128, torch.bfloat16)
    monkeypatch.setattr(mla_prefill_module, "_sm_count", lambda device: 3)
    few = _run(query, kv, latents, 128, torch.bfloat16)
    assert len(hopper_calls) == 2 and torch.equal(few, full)
    plain = _run(query, kv, latents, 128, torch.bfloat16, hopper=False)
    tuned = _run(query, kv, latents, 128, torch.bfloat16, config=MLAPrefillConfig())
    assert len(hopper_calls) == 2
    for other in (plain, tuned):
        assert ((other.float() - full.float()).abs().max() / full.float().abs().max()).item() < 2e-2


def test_out_without_tma_gets_the_same_values(hopper_calls: list[int]) -> None:
    """An ``out`` with a padded head stride is written with masked stores: the values equal
    the TMA store's and the padding stays untouched."""
    query, kv, latents = _case(16, 128, 64, seed=5)
    packed = _run(query, kv, latents, 128, torch.bfloat16)
    wide = torch.full((query.shape[0], 16, 136), 5.0, dtype=torch.bfloat16, device="cuda")
    _run(query, kv, latents, 128, torch.bfloat16, out=wide[..., :128])
    assert len(hopper_calls) == 2
    assert torch.equal(wide[..., :128], packed) and bool((wide[..., 128:] == 5.0).all())
