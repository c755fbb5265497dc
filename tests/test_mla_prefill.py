"""The decompressed MLA prefill kernel (attention.triton_kernels.mla_prefill) against a float64
reference: causal varlen rows with cached keys before their new tokens, a shared rotated key,
values narrower or wider than the key half.

Without a GPU it runs in Triton's CPU interpreter (tests/conftest.py), so shapes stay small.
Keys past each row's end are NaN: a read beyond a row's keys turns the output NaN.
"""

from __future__ import annotations

import pytest
import torch

from attention.errors import InvalidArgumentError, MetadataError
from attention.latent_prefill import latent_key_slots, plan_latent_prefill
from attention.synthetic import synthetic_metadata
from attention.triton_kernels.mla_prefill import MLAPrefillConfig, mla_prefill
from attention.triton_kernels.paging import kernels_interpreted

pytestmark = pytest.mark.kernel

DEVICE = "cpu" if kernels_interpreted() else "cuda"


def _case(query_lens, key_lens, heads, nope, rope, value, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    tokens, keys = sum(query_lens), sum(key_lens)
    query = torch.randn(tokens, heads, nope + rope, generator=gen, dtype=torch.float64)
    kv = torch.randn(keys + 5, heads, nope + value, generator=gen, dtype=torch.float64)
    latents = torch.randn(keys + 5, 32 + rope, generator=gen, dtype=torch.float64)
    kv[keys:] = float("nan")
    latents[keys:] = float("nan")
    return query, kv, latents


def _reference(query, kv, key_pe, query_lens, key_lens, nope, scale):  # type: ignore[no-untyped-def]
    heads = query.shape[1]
    outs = []
    q0 = k0 = 0
    for q_len, k_len in zip(query_lens, key_lens, strict=True):
        q = query[q0 : q0 + q_len]  # [q, H, n + e]
        k_nope, v = kv[k0 : k0 + k_len, :, :nope], kv[k0 : k0 + k_len, :, nope:]
        pe = key_pe[k0 : k0 + k_len]
        keys = torch.cat((k_nope, pe[:, None, :].expand(k_len, heads, pe.shape[-1])), dim=-1)
        s = torch.einsum("qhd,khd->hqk", q, keys) * scale
        visible = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len))[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khv->qhv", p, v))
        q0, k0 = q0 + q_len, k0 + k_len
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("query_lens", "key_lens", "heads", "nope", "rope", "value", "block"),
    [
        ([37, 1, 20], [37, 50, 83], 3, 16, 8, 16, (16, 16)),  # prompts, a decode row, an extend row
        ([70, 0, 33], [70, 12, 33], 2, 32, 16, 24, (32, 16)),  # several tiles, an empty row, v != n
        ([5, 3], [129, 65], 4, 16, 16, 32, (16, 32)),  # short extends over many cached keys (62: one short of a tile)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_prefill_matches_float64(query_lens, key_lens, heads, nope, rope, value, block, dtype) -> None:  # type: ignore[no-untyped-def]
    query, kv, latents = _case(query_lens, key_lens, heads, nope, rope, value)
    scale = (nope + rope) ** -0.5
    keys = sum(key_lens)
    want = _reference(query, kv[:keys], latents[:keys, 32:], query_lens, key_lens, nope, scale)
    cfg = MLAPrefillConfig(block_m=block[0], block_n=block[1], num_warps=4, num_stages=1)
    got = mla_prefill(
        query.to(DEVICE, dtype),
        kv.to(DEVICE, dtype)[:keys],
        latents.to(DEVICE, dtype)[:keys, 32:],
        query_lens,
        key_lens,
        qk_nope_head_dim=nope,
        scale=scale,
        config=cfg,
    )
    assert got.shape == (sum(query_lens), heads, value) and got.dtype == dtype
    err = (got.double().cpu() - want).abs().max().item()
    assert err < (2e-3 if dtype == torch.float32 else 3e-2), err


def test_mla_prefill_refuses_bad_inputs_by_name() -> None:
    query, kv, latents = _case([4], [6], 2, 16, 8, 16)
    q, k, pe = query.float(), kv[:6].float(), latents[:6, 32:].float()
    args = {"qk_nope_head_dim": 16, "scale": 0.2}
    with pytest.raises(InvalidArgumentError, match=r"query_lens\[0\], key_lens\[0\]: 7 new tokens over 6 keys"):
        mla_prefill(q, k, pe, [7], [6], **args)
    with pytest.raises(InvalidArgumentError, match="sum to 3 and 6"):
        mla_prefill(q, k, pe, [3], [6], **args)
    with pytest.raises(InvalidArgumentError, match="qk_nope_head_dim: 12"):
        mla_prefill(q, k, pe, [4], [6], qk_nope_head_dim=12, scale=0.2)
    with pytest.raises(InvalidArgumentError, match=r"key_pe: torch\.float64"):
        mla_prefill(q, k, latents[:6, 32:], [4], [6], **args)
    with pytest.raises(InvalidArgumentError, match="kv, key_pe: expected"):
        mla_prefill(q, k[:, :1], pe, [4], [6], **args)
    with pytest.raises(InvalidArgumentError, match="out: expected"):
        mla_prefill(q, k, pe, [4], [6], out=torch.empty(4, 2, 8), **args)


def test_plan_latent_prefill_picks_long_rows_and_finds_their_key_slots() -> None:
    """Rows of at least ``min_tokens`` new tokens, their token indices and every key's slot
    (row by row, position 0 first) read through the block tables; a hostile table entry gives
    slot 0 instead of leaving the cache."""
    meta = synthetic_metadata([(40, 40), (9, 1), (50, 20)], 16, torch.device("cpu"))
    assert plan_latent_prefill(meta, None) is None and plan_latent_prefill(meta, 41) is None
    prefill = plan_latent_prefill(meta, 20)
    assert prefill is not None and prefill.rows == (0, 2)
    assert prefill.query_lens == (40, 20) and prefill.key_lens == (40, 50)
    assert prefill.token_index.tolist() == [*range(40), *range(41, 61)]
    assert prefill.token_span is None and prefill.absorbed_span == (40, 41), "rows 0 and 2 are not one span"
    assert prefill.absorbed_bounds == (40, 41)
    assert prefill.absorbed_index.tolist() == [40]
    behind = plan_latent_prefill(synthetic_metadata([(9, 1), (4, 1), (40, 40), (50, 20)], 16, torch.device("cpu")), 20)
    assert behind is not None and behind.token_span == (2, 62) and behind.absorbed_span == (0, 2)
    assert behind.absorbed_bounds == (0, 2)
    assert behind.token_index.tolist() == list(range(2, 62))
    alone = plan_latent_prefill(synthetic_metadata([(40, 40)], 16, torch.device("cpu")), 20)
    assert alone is not None and alone.token_span == (0, 40) and alone.absorbed_span is None
    assert alone.absorbed_bounds == (0, 0)
    assert alone.absorbed_index.numel() == 0
    slots = latent_key_slots(prefill, meta, num_blocks=8).tolist()
    tables = meta.block_tables.tolist()
    want = [tables[r][p // 16] * 16 + p % 16 for r, n in ((0, 40), (2, 50)) for p in range(n)]
    assert slots == want
    meta.block_tables[2, 1] = 10**6  # outside the cache
    meta.block_tables[0, 0] = -1
    hostile = latent_key_slots(prefill, meta, num_blocks=8).tolist()
    assert hostile[:16] == [0] * 16 and hostile[40 + 16 : 40 + 32] == [0] * 16
    assert hostile[16:40] == want[16:40] and hostile[40 + 32 :] == want[40 + 32 :]


def test_the_backend_refuses_bad_decompressed_inputs_by_name() -> None:
    """``attend_latent_prefill`` checks every tensor against the plan's rows before running,
    and a plan without decompressed rows (or another backend's) is refused."""
    from attention import AttentionSpec, get_backend

    spec = AttentionSpec(4, 1, 40, dtype="float32", softmax_scale=24**-0.5, latent_rank=32)
    backend = get_backend("reference", spec)
    backend.latent_prefill_min_tokens = 8
    meta = synthetic_metadata([(20, 20), (5, 1)], 32, torch.device("cpu"))
    plan = backend.plan(meta)
    assert plan.latent_prefill is not None and plan.latent_prefill.rows == (0,)
    q, kv, pe = torch.randn(20, 4, 24), torch.randn(20, 4, 32), torch.randn(20, 8)
    got = backend.attend_latent_prefill(q, kv, pe, plan)
    assert got.shape == (20, 4, 16)
    rows = torch.full((30, 4, 16), 7.0)  # a larger buffer whose rows 5..24 take the output
    written = backend.attend_latent_prefill(q, kv, pe, plan, out=rows[5:25])
    assert written.data_ptr() == rows[5:25].data_ptr() and torch.equal(rows[5:25], got)
    assert (rows[:5] == 7.0).all() and (rows[25:] == 7.0).all()
    view = torch.cat((q, torch.randn(20, 4, 3)), dim=-1)[..., :24]  # a strided view of the query
    torch.testing.assert_close(backend.attend_latent_prefill(view, kv, pe, plan), got, rtol=0, atol=0)
    for bad in (torch.empty(20, 4, 15), torch.empty(20, 4, 16, dtype=torch.float64), torch.empty(20, 16, 4).mT):
        with pytest.raises(InvalidArgumentError, match="out"):
            backend.attend_latent_prefill(q, kv, pe, plan, out=bad)
    with pytest.raises(InvalidArgumentError, match="query"):
        backend.attend_latent_prefill(q[:19], kv, pe, plan)
    with pytest.raises(InvalidArgumentError, match="kv"):
        backend.attend_latent_prefill(q, kv[:, :, :16], pe, plan)
    with pytest.raises(InvalidArgumentError, match="key_pe"):
        backend.attend_latent_prefill(q, kv, pe[:, :4], plan)
    with pytest.raises(InvalidArgumentError, match="query"):
        backend.attend_latent_prefill(q.double(), kv, pe, plan)
    backend.latent_prefill_min_tokens = None
    absorbed = backend.plan(meta)
    with pytest.raises(MetadataError, match="no decompressed rows"):
        backend.attend_latent_prefill(q, kv, pe, absorbed)
    other = get_backend("reference", AttentionSpec(8, 1, 40, dtype="float32", latent_rank=32))
    with pytest.raises(MetadataError, match="not made by this"):
        other.attend_latent_prefill(q, kv, pe, plan)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_the_row_and_tile_arrays_start_on_16_bytes_whatever_the_row_count(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The query starts, key starts and tile index the kernels read (one staged array) each
    start on 16 bytes: Triton compiles a kernel per alignment of its pointers, so a row count
    that misaligned them compiled a new variant while serving (2-3 s a step on a GPU)."""
    import attention.triton_kernels.mla_prefill as module

    seen: list[tuple[torch.Tensor, ...]] = []

    class Launch:
        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kwargs: seen.append(args[4:7])

    monkeypatch.setattr(module, "_mla_prefill_kernel", Launch())
    lens = [3 + r for r in range(rows)]
    query, kv, latents = _case(lens, lens, 2, 16, 8, 16)
    keys = sum(lens)
    mla_prefill(query.float().to(DEVICE), kv[:keys].float().to(DEVICE), latents[:keys, 32:].float().to(DEVICE), lens,
                lens, qk_nope_head_dim=16, scale=0.1)  # fmt: skip
    (q_start, k_start, tiles), = seen
    assert all(t.data_ptr() % 16 == 0 for t in (q_start, k_start, tiles))
    assert q_start.tolist() == k_start.tolist() == [sum(lens[:i]) for i in range(rows + 1)]


def test_a_staged_index_serves_every_call_of_its_lengths_and_no_other() -> None:
    """``stage_mla_prefill_index``: the offsets and tile index a step's layers share give the
    result of a call that stages its own; an index of other lengths or another tile height is
    refused by name before the kernel runs, and lengths that do not fit are refused at staging."""
    from attention.triton_kernels.mla_prefill import mla_prefill_block_m, stage_mla_prefill_index

    q_lens, k_lens = [5, 3], [9, 3]
    query, kv, latents = _case(q_lens, k_lens, 2, 16, 8, 16, seed=3)
    q, k, pe = (t.float().to(DEVICE) for t in (query, kv[:12], latents[:12, 32:]))
    cfg = MLAPrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    args = {"qk_nope_head_dim": 16, "scale": 0.2, "config": cfg}
    assert mla_prefill_block_m(q, k, pe, 16, cfg) == 16
    index = stage_mla_prefill_index(q_lens, k_lens, 16, q.device)
    assert index.q_start.tolist() == [0, 5, 8] and index.k_start.tolist() == [0, 9, 12]
    assert index.tile_index.shape == (2, 2)
    want = mla_prefill(q, k, pe, q_lens, k_lens, **args)
    for _ in range(2):
        assert torch.equal(mla_prefill(q, k, pe, q_lens, k_lens, index=index, **args), want)
    other_height = stage_mla_prefill_index(q_lens, k_lens, 32, q.device)
    with pytest.raises(InvalidArgumentError, match=r"index: staged for 2 rows at tiles of 32 on .*this call .* of 16"):
        mla_prefill(q, k, pe, q_lens, k_lens, index=other_height, **args)
    with pytest.raises(InvalidArgumentError, match="index: staged for 2 rows"):
        mla_prefill(q, k, pe, [4, 4], [8, 4], index=index, **args)
    with pytest.raises(InvalidArgumentError, match=r"query_lens\[1\], key_lens\[1\]: 4 new tokens over 3 keys"):
        stage_mla_prefill_index([5, 4], [9, 3], 16, q.device)


@pytest.mark.skipif(DEVICE == "cpu" and not kernels_interpreted(), reason="needs CUDA or the Triton interpreter")
def test_the_triton_backend_stages_a_steps_prefill_index_once_for_all_its_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer of a step attends the same decompressed rows: the backend stages their
    offsets and tile index at the first layer and reuses them (one host-to-device copy a step,
    not one a layer); the next step's plan stages its own."""
    import attention.triton_backend as triton_backend
    from attention import AttentionSpec, get_backend

    staged: list[tuple[int, ...]] = []
    stage = triton_backend.stage_mla_prefill_index

    def counting(query_lens, key_lens, block_m, device):  # type: ignore[no-untyped-def]
        staged.append(tuple(query_lens))
        return stage(query_lens, key_lens, block_m, device)

    monkeypatch.setattr(triton_backend, "stage_mla_prefill_index", counting)
    spec = AttentionSpec(2, 1, 40, dtype="float32", softmax_scale=24**-0.5, latent_rank=32)
    backend = get_backend("triton", spec)
    backend.latent_prefill_min_tokens = 8
    device = torch.device(DEVICE)
    results = []
    for rows in ([(12, 12), (5, 1)], [(20, 9)]):
        plan = backend.plan(synthetic_metadata(rows, 32, device))
        prefill = plan.latent_prefill
        assert prefill is not None
        gen = torch.Generator().manual_seed(len(rows))
        q = torch.randn(prefill.num_tokens, 2, 24, generator=gen).to(device)
        kv = torch.randn(prefill.num_keys, 2, 32, generator=gen).to(device)
        pe = torch.randn(prefill.num_keys, 8, generator=gen).to(device)
        outs = [backend.attend_latent_prefill(q, kv, pe, plan) for _layer in range(3)]
        assert all(torch.equal(o, outs[0]) for o in outs)
        want = _reference(q.double().cpu(), kv.double().cpu(), pe.double().cpu(), prefill.query_lens,
                          prefill.key_lens, 16, 24**-0.5)  # fmt: skip
        assert (outs[0].double().cpu() - want).abs().max().item() < 2e-3
        results.append(prefill.query_lens)
    assert staged == results == [(12,), (9,)]
