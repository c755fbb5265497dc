"""The MLA decode kernel (attention.triton_kernels.mla_decode) against a float64 reference.

Without a GPU it runs in Triton's CPU interpreter (tests/conftest.py), so shapes stay small.
The latent cache holds NaN in every slot no row owns, and block ids are shuffled, so a read of
an unowned slot, of a padded table entry or of a token past a row's length turns the output
NaN or wrong.
"""

from __future__ import annotations

import pytest
import torch

from attention.errors import InvalidArgumentError
from attention.triton_kernels.mla_decode import causal_queries, mla_attention, mla_decode
from attention.triton_kernels.paging import kernels_interpreted

pytestmark = pytest.mark.kernel

DEVICE = "cpu" if kernels_interpreted() else "cuda"


def _case(lens: list[int], heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.full((num_blocks, block_size, 1, rank + rope), float("nan"), dtype=torch.float64)
    width = max([*per_row, 1]) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    latents = []
    for r, n in enumerate(lens):
        blocks = [ids.pop() for _ in range(per_row[r])]
        tables[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lat = torch.randn(n, rank + rope, generator=gen, dtype=torch.float64)
        for t in range(n):
            cache[blocks[t // block_size], t % block_size, 0] = lat[t]
        latents.append(lat)
    query = torch.randn(len(lens), heads, rank + rope, generator=gen, dtype=torch.float64)
    return query, cache, tables, latents


def _reference(query: torch.Tensor, latents: list[torch.Tensor], rank: int, scale: float) -> torch.Tensor:
    out = torch.zeros(query.shape[0], query.shape[1], rank, dtype=torch.float64)
    for r, lat in enumerate(latents):
        if len(lat):
            p = torch.softmax(query[r] @ lat.T * scale, dim=-1)  # [H, n]
            out[r] = p @ lat[:, :rank]
    return out


@pytest.mark.parametrize(
    ("lens", "heads", "rank", "rope", "block_size", "splits"),
    [
        ([1, 37, 64, 5], 4, 32, 16, 32, 1),  # partial blocks, a one-token row, fewer heads than a tile
        ([100, 33, 7], 16, 64, 16, 16, 3),  # blocks of 16 under tiles of 32, three splits
        ([250, 1], 20, 32, 8, 32, 4),  # a second head tile, a rotary part narrower than a dot
        ([0, 65], 4, 32, 16, 64, 2),  # an empty row
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_decode_matches_float64(lens, heads, rank, rope, block_size, splits, dtype) -> None:  # type: ignore[no-untyped-def]
    query, cache, tables, latents = _case(lens, heads, rank, rope, block_size, dtype)
    scale = (rope + 24) ** -0.5
    out = mla_decode(
        query.to(DEVICE, dtype), cache.to(DEVICE, dtype), tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=rank, scale=scale, num_splits=splits,
    )  # fmt: skip
    # The reference over the same rounded inputs.
    rounded = [lat.to(dtype).double() for lat in latents]
    want = _reference(query.to(dtype).double(), rounded, rank, scale)
    assert out.shape == (len(lens), heads, rank) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "read an unowned (NaN) slot"
    err = (out.double().cpu() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    assert err < (2e-3 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("split_len", [7, 32, 100])
def test_the_split_length_read_on_the_device_sets_the_chunk(split_len: int) -> None:
    """``split_len`` (a device value, as a CUDA graph replays it) cuts the latents: chunks off
    the tile width, many splits, and splits beyond short rows (skipped by both kernels) give
    the reference."""
    lens = [1, 37, 100, 0, 64]
    query, cache, tables, latents = _case(lens, 4, 32, 16, 32, torch.float32, seed=2)
    splits = -(-max(lens) // split_len)
    out = mla_decode(
        query.float().to(DEVICE), cache.float().to(DEVICE), tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=32, scale=0.2, num_splits=splits,
        split_len=torch.tensor([split_len], dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    want = _reference(query.float().double(), [lat.float().double() for lat in latents], 32, 0.2)
    assert torch.isfinite(out).all()
    assert (out.double().cpu() - want).abs().max().item() < 2e-3


@pytest.mark.parametrize("block_size", [32, 16], ids=["tile-in-block", "per-token-pages"])
def test_an_fp8_latent_with_its_scale_matches_the_dequantized_reference(block_size: int) -> None:
    """An fp8 (e4m3) cache: the kernel converts latents to the query's dtype and applies the
    scale to scores and output; the reference attends over the dequantized values."""
    lens = [1, 37, 70]
    query, cache, tables, latents = _case(lens, 4, 32, 16, block_size, torch.float32, seed=5)
    kv_scale = 0.05
    stored = (cache / kv_scale).to(torch.float8_e4m3fn)  # NaN slots stay NaN
    q = query.to(torch.bfloat16)
    out = mla_decode(
        q.to(DEVICE), stored.to(DEVICE), tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        kv_lora_rank=32, scale=0.2, num_splits=2, kv_scale=torch.tensor([kv_scale], device=DEVICE),
    )  # fmt: skip
    dequantized = [(lat / kv_scale).to(torch.float8_e4m3fn).double() * kv_scale for lat in latents]
    want = _reference(q.double(), dequantized, 32, 0.2)
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 2e-2, err
    with pytest.raises(InvalidArgumentError, match="kv_scale: an fp8 latent cache takes"):
        mla_decode(q.to(DEVICE), stored.to(DEVICE), tables.to(DEVICE),
                   torch.tensor(lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=32, scale=0.2)  # fmt: skip


def test_bad_block_ids_are_masked_not_read() -> None:
    query, cache, tables, _ = _case([40, 40], 4, 32, 16, 32, torch.float32)
    tables[1, 0] = 10**6  # out of the cache
    tables[1, 1] = -5
    out = mla_decode(query.float().to(DEVICE), cache.float().to(DEVICE), tables.to(DEVICE),
                     torch.tensor([40, 40], dtype=torch.int32, device=DEVICE), kv_lora_rank=32, scale=0.1)  # fmt: skip
    assert torch.isfinite(out).all()
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu())), "a row with no valid block attends to nothing"


def test_the_output_goes_where_asked() -> None:
    """``out`` (the channels before the rotary part of a bf16 attention output, as the backend
    passes it) gets the first R channels of every token and head and nothing else, launch
    after launch; a second head tile and tokens that see nothing included."""
    lens, heads, rank, rope = [90, 3, 64, 0, 41], 20, 32, 16
    query, cache, tables, latents = _case(lens, heads, rank, rope, 16, torch.float32, seed=6)
    q, c, t = query.to(DEVICE, torch.bfloat16), cache.to(DEVICE, torch.bfloat16), tables.to(DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = _reference(q.double().cpu(), [lat.to(torch.bfloat16).double() for lat in latents], rank, 0.2)
    target = torch.full((len(lens), heads, rank + rope), 7.0, dtype=torch.bfloat16, device=DEVICE)
    for splits in (1, 4):
        got = mla_decode(q, c, t, seq, kv_lora_rank=rank, scale=0.2, num_splits=splits, out=target)
        assert got.data_ptr() == target.data_ptr() and got.shape == (len(lens), heads, rank)
        err = (target[..., :rank].double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < 2e-2, err
        assert (target[..., rank:] == 7.0).all(), "only the first kv_lora_rank channels are written"
        assert not target[3, :, :rank].any(), "a token that sees nothing gets zeros"
    mla_decode(q, c, t, seq, kv_lora_rank=rank, scale=0.2, num_splits=2, out=target[..., : rank + 5], zero_rest=True)
    assert not target[..., rank : rank + 5].any(), "zero_rest: the channels after R up to out's width are zeroed"
    assert (target[..., rank + 5 :] == 7.0).all(), "and none past out's width"
    err = (target[..., :rank].double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 2e-2, err


def test_bad_arguments_are_refused_naming_them() -> None:
    query, cache, tables, _ = _case([8], 4, 32, 16, 32, torch.float32)
    q, c, lens = query.float(), cache.float(), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="kv_lora_rank"):
        mla_decode(q, c, tables, lens, kv_lora_rank=48, scale=0.1)
    with pytest.raises(InvalidArgumentError, match="query"):
        mla_decode(q.double(), c, tables, lens, kv_lora_rank=32, scale=0.1)
    with pytest.raises(InvalidArgumentError, match="int32"):
        mla_decode(q, c, tables.long(), lens, kv_lora_rank=32, scale=0.1)
    with pytest.raises(InvalidArgumentError, match="query_lens"):
        causal_queries([3], [4])
    assert causal_queries([5, 4, 3], [2, 3, 1], skip={1}) == ([0, 0, -1, -1, -1, 2], [4, 5, 0, 0, 0, 3])
    # A decode step (one token a row) takes a shortcut: the same answer, the same refusal.
    assert causal_queries((5, 4, 3), (1, 1, 1)) == ([0, 1, 2], [5, 4, 3])
    assert causal_queries((5, 4), (1, 1), skip={0}) == ([-1, 1], [0, 4])
    with pytest.raises(InvalidArgumentError, match=r"query_lens\[1\]: 1 new tokens in a row of 0"):
        causal_queries([3, 0], [1, 1])
    with pytest.raises(ValueError):
        causal_queries([3, 2], [1])
    with pytest.raises(InvalidArgumentError, match="num_splits"):
        mla_decode(q, c, tables, lens, kv_lora_rank=32, scale=0.1, num_splits=0)
    with pytest.raises(InvalidArgumentError, match="split_len: expected an int32 \\[1\\] tensor"):
        mla_decode(q, c, tables, lens, kv_lora_rank=32, scale=0.1, split_len=torch.tensor([8]))
    for bad_out in (torch.empty(1, 4, 16), torch.empty(1, 4, 32, dtype=torch.float64), torch.empty(1, 32, 4).mT):
        with pytest.raises(InvalidArgumentError, match="out: expected"):
            mla_decode(q, c, tables, lens, kv_lora_rank=32, scale=0.1, out=bad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_of_several_new_tokens_attend_causally(dtype: torch.dtype) -> None:
    """Prefill, extend and verification rows: each new token sees its row up to itself."""
    lens, new = [70, 33, 9, 40], [70, 5, 1, 17]  # a whole prompt, an extend, a decode row, a chunk
    rank, rope, heads = 32, 16, 4
    _, cache, tables, latents = _case(lens, heads, rank, rope, 32, dtype, seed=3)
    rows, token_lens = causal_queries(lens, new)
    assert len(rows) == sum(new) and token_lens[:3] == [1, 2, 3] and token_lens[70:75] == [29, 30, 31, 32, 33]
    gen = torch.Generator().manual_seed(4)
    queries = torch.randn(sum(new), heads, rank + rope, generator=gen, dtype=torch.float64)
    scale = 0.2
    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    out = mla_attention(
        queries.to(DEVICE, dtype), cache.to(DEVICE, dtype), tables.to(DEVICE), ints(rows), ints(token_lens),
        kv_lora_rank=rank, scale=scale, num_splits=2,
    )  # fmt: skip
    q64 = queries.to(dtype).double()
    want = torch.stack([
        _reference(q64[t : t + 1], [latents[r][:n].to(dtype).double()], rank, scale)[0]
        for t, (r, n) in enumerate(zip(rows, token_lens, strict=True))
    ])  # fmt: skip
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < (2e-3 if dtype == torch.float32 else 2e-2), err


def test_tokens_naming_no_row_or_too_many_latents_stay_inside_the_cache() -> None:
    """Rows that do not exist and negative lengths attend to nothing; a length past the row's
    table is clamped to the table (it reads the row's own blocks, garbage past its tokens,
    never memory outside the cache: the metadata check reports such lengths)."""
    query, cache, tables, _ = _case([40, 12], 4, 32, 16, 32, torch.float32)
    rows = torch.tensor([7, -3, 0, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40, 40, 10**6, -5], dtype=torch.int32, device=DEVICE)
    q = torch.cat([query, query]).float().to(DEVICE)
    out = mla_attention(q, cache.float().to(DEVICE), tables.to(DEVICE), rows, lens, kv_lora_rank=32, scale=0.1)
    assert out.shape == (4, 4, 32)
    assert not out[[0, 1, 3]].abs().any(), "no row, or no latent: attends to nothing"


def test_latent_specs_are_checked() -> None:
    from attention import AttentionSpec

    assert AttentionSpec(4, 1, 40, "float32", latent_rank=32).latent_attention
    for bad, field in (({"latent_rank": 0}, "latent_rank"), ({"latent_rank": 40}, "latent_rank")):
        with pytest.raises(InvalidArgumentError, match=field):
            AttentionSpec(4, 1, 40, "float32", **bad)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        AttentionSpec(4, 2, 40, "float32", latent_rank=32)
