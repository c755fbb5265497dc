"""MLA decode on the Hopper kernel (attention/triton_kernels/mla_decode_hopper.py) and the
launch that selects it.

``mla_attention(..., hopper=True)`` on a schedule of 64-latent tiles runs the Gluon kernel on
an sm_90 GPU and the Triton balanced kernel elsewhere (the interpreter included): the
float64 checks below hold for both, on DeepSeek-V3's latent (512 + 64) with partial tiles and
blocks, stale NaN slots, empty rows, 8 and 16 heads, bf16 and fp16, slot and direct plans. On
an sm_90 GPU they also assert that the Gluon kernel ran, and run again on its deeper-ring
form (``hopper_ring``; attention/triton_kernels/mla_decode_hopper_ring.py), its
split-warpgroup form (``hopper_split``; attention/triton_kernels/mla_decode_hopper_split.py)
and with the merge in the kernel (``hopper_fused_merge``); the two-tile kernel's one-barrier
maxima (``mla_decode_hopper.ONE_BARRIER_MAX``) must keep its output bits.
An fp8 latent under bf16 queries runs the fp8 kernels (mla_decode_hopper_fp8_ws.py, the
backend's, and the opt-in mla_decode_hopper_fp8.py) against float64 over the dequantized latents.
The backend's choice of launch is checked without a GPU; tests/test_mla_decode_hopper_compile.py,
tests/test_mla_decode_hopper_ring_compile.py and tests/test_mla_decode_hopper_split_compile.py
compile the kernels for sm_90.
"""

from __future__ import annotations

import functools

import pytest
import torch

import attention.triton_backend as triton_backend
import attention.triton_kernels.mla_decode as mla_decode_module
from attention.errors import InvalidArgumentError
from attention.spec import AttentionSpec
from attention.triton_backend import TritonBackend
from attention.triton_kernels.mla_balanced import MLAWork, mla_work_len, plan_mla_work
from attention.triton_kernels.mla_decode import default_mla_launch, hopper_mla_launch, mla_attention
from attention.triton_kernels.mla_decode_hopper import MLA_HOPPER_BLOCK_N, mla_decode_hopper_shape_ok
from attention.triton_kernels.prefill_hopper import gluon_available
from tests.test_mla_decode import DEVICE, _case, _reference

pytestmark = pytest.mark.kernel

RANK, ROPE = 512, 64
ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0) and gluon_available()
#: The Hopper kernel's forms a test runs (without one, all run the same Triton fallback).
FORMS = ["pair", "ring", "split", "fused"] if ON_HOPPER else ["pair"]
#: The fp8 kernels a test runs: the partitioned one (what the backend launches) and the opt-in
#: one-warpgroup one (``launch_mla_hopper(..., fp8_one_warpgroup=True)``).
FP8_KERNELS = ["partitioned", "one-warpgroup"] if ON_HOPPER else ["partitioned"]


def _fp8_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Every Hopper launch of the test on ``kernel`` (one of :data:`FP8_KERNELS`)."""
    if kernel == "one-warpgroup":
        launch = mla_decode_module.launch_mla_hopper
        monkeypatch.setattr(mla_decode_module, "launch_mla_hopper", functools.partial(launch, fp8_one_warpgroup=True))


@pytest.fixture
def hopper_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Gluon kernel's launches: the form each ran ("pair", "ring" or "split")."""
    calls: list[str] = []
    real = mla_decode_module.launch_mla_hopper

    def counted(*args: object, **kw: object) -> None:
        calls.append("ring" if kw.get("ring") else "split" if kw.get("split") else "fused" if kw.get("fused_merge")
                     else "pair")  # fmt: skip
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(mla_decode_module, "launch_mla_hopper", counted)
    return calls


def _attend(lens: list[int], heads: int, block_size: int, dtype: torch.dtype, *, programs: int, direct: bool,
            seed: int = 0, tables: torch.Tensor | None = None, out: torch.Tensor | None = None,
            form: str = "pair", magnitude: float = 1.0, fp8_scale: float | None = None):  # type: ignore[no-untyped-def]  # fmt: skip
    """``magnitude``: the latents times it, the queries divided by it (the same scores);
    ``fp8_scale``: the cache stored as float8_e4m3fn over that scale (the latents returned
    are then the dequantized ones, float64)."""
    query, cache, case_tables, latents = _case(lens, heads, RANK, ROPE, block_size, torch.float64, seed=seed)
    query, cache, latents = query / magnitude, cache * magnitude, [lat * magnitude for lat in latents]
    kv_scale = None
    if fp8_scale is None:
        stored = cache.to(DEVICE, dtype)
    else:
        stored = (cache / fp8_scale).to(torch.float8_e4m3fn).to(DEVICE)  # (NaN slots stay NaN)
        latents = [(lat / fp8_scale).to(torch.float8_e4m3fn).double() * fp8_scale for lat in latents]
        kv_scale = torch.tensor([fp8_scale], device=DEVICE)
    fused = form == "fused"  # (its plan carries the counters it merges on)
    plan = plan_mla_work(lens, programs, MLA_HOPPER_BLOCK_N, 64, direct=direct, counters=fused)
    work = MLAWork(torch.tensor(plan, dtype=torch.int32, device=DEVICE), programs, direct, fused)
    result = mla_attention(
        query.to(DEVICE, dtype), stored, (case_tables if tables is None else tables).to(DEVICE),
        torch.arange(len(lens), dtype=torch.int32, device=DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        kv_lora_rank=RANK, scale=0.05, work=work, kv_scale=kv_scale,
        block_n=MLA_HOPPER_BLOCK_N, num_stages=2, hopper=True, out=out, zero_rest=out is not None,
        hopper_ring=form == "ring", hopper_split=form == "split", hopper_fused_merge=fused,
    )  # fmt: skip
    return result, query, latents


#: (lens, heads, block_size, programs) of the launch tests.
LAUNCH_CASES = [
    ([1, 37, 64, 200, 129, 0, 300], 16, 64, 5),  # partial tiles, a one-latent and an empty row
    ([65, 500, 3], 8, 128, 3),  # fewer heads than the MMA's 16, blocks of two tiles
    ([40, 41, 42, 43, 1000], 16, 64, 2),  # programs of several segments
    ([0, 130, 0, 0, 64, 1, 0, 700], 16, 64, 3),  # empty rows inside a program's range
]


@pytest.mark.parametrize(("lens", "heads", "block_size", "programs"), LAUNCH_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
@pytest.mark.parametrize("form", FORMS)
def test_the_hopper_launch_matches_float64(  # type: ignore[no-untyped-def]
    hopper_calls, lens, heads, block_size, programs, dtype, direct, form
) -> None:
    out, query, latents = _attend(lens, heads, block_size, dtype, programs=programs, direct=direct, form=form)
    want = _reference(query.to(dtype).double(), [lat.to(dtype).double() for lat in latents], RANK, 0.05)
    assert out.shape == (len(lens), heads, RANK) and torch.isfinite(out).all(), "read a stale (NaN) slot"
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, err
    assert hopper_calls == ([form] if ON_HOPPER else [])  # (the split form runs a direct plan on the pair)


@pytest.mark.skipif(not ON_HOPPER, reason="the two-tile Gluon kernel runs on an sm_90 GPU only")
@pytest.mark.parametrize(("lens", "heads", "block_size", "programs"), LAUNCH_CASES[:3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
@pytest.mark.parametrize("form", ["pair", "fused"])
def test_the_one_barrier_max_keeps_the_bits(  # type: ignore[no-untyped-def]
    monkeypatch, hopper_calls, lens, heads, block_size, programs, dtype, direct, form
) -> None:
    """``mla_decode_hopper.ONE_BARRIER_MAX`` changes how the tile's maxima are gathered, not
    their values: the same output bits with it on and off (NaN slots and partial tiles included)."""
    from attention.triton_kernels import mla_decode_hopper

    outs = []
    for on in (False, True):
        monkeypatch.setattr(mla_decode_hopper, "ONE_BARRIER_MAX", on)
        out, _, _ = _attend(lens, heads, block_size, dtype, programs=programs, direct=direct, form=form)
        outs.append(out)
    assert hopper_calls == [form, form]
    assert torch.isfinite(outs[0]).all() and outs[0].abs().max() > 0
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("magnitude", [2.0**14, 2.0**-20], ids=["large", "small"])
@pytest.mark.parametrize("form", FORMS)
def test_latents_of_any_size_keep_their_precision(hopper_calls: list[str], form: str, magnitude: float) -> None:
    """The partial outputs are fp16 scaled per head by a power of two: an unnormalized sum of
    1,000 latents of ~2^14 (past fp16's 65504) or of ~2^-20 (fp16 subnormals) merges to the
    float64 result as closely as latents of ~1 do."""
    lens = [40, 500, 1000, 77]
    out, query, latents = _attend(lens, 16, 64, torch.bfloat16, programs=3, direct=False, form=form,
                                  magnitude=magnitude)  # fmt: skip
    want = _reference(query.to(torch.bfloat16).double(), [lat.to(torch.bfloat16).double() for lat in latents], RANK,
                      0.05)  # fmt: skip
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, err
    assert hopper_calls == ([form] if ON_HOPPER else [])


@pytest.mark.parametrize(
    ("lens", "heads", "block_size", "programs"),
    [
        ([1, 37, 64, 200, 129, 0, 300], 16, 64, 5),  # partial tiles, a one-latent and an empty row
        ([65, 500, 3], 8, 128, 3),  # fewer heads than the MMA's 16, blocks of two tiles
        ([40, 41, 42, 43, 1000], 16, 64, 2),  # programs of several segments
    ],
)
@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**12, 2.0**-12], ids=["unit", "large", "small"])
@pytest.mark.parametrize("kernel", FP8_KERNELS)
def test_an_fp8_latent_under_bf16_queries_matches_float64(  # type: ignore[no-untyped-def]
    hopper_calls, monkeypatch, lens, heads, block_size, programs, direct, magnitude, kernel
) -> None:
    """A float8_e4m3fn latent with its scale (on an sm_90 GPU the fp8 Gluon kernels: scores from
    the fp8 tile against the query split hi + lo, P V over the tile turned fp16, in the
    partitioned kernel and in the one-warpgroup one; elsewhere the Triton kernel) against float64
    over the dequantized latents, stale NaN slots included;
    latents of 2^12 and 2^-12 with queries the inverse (the query's split is scaled per head;
    the Triton kernel's fp16 dots clamp queries past 65504, which 2^-16 would reach)."""
    _fp8_kernel(monkeypatch, kernel)
    scale = 0.05 * magnitude
    out, query, latents = _attend(lens, heads, block_size, torch.bfloat16, programs=programs, direct=direct,
                                  magnitude=magnitude, fp8_scale=scale)  # fmt: skip
    want = _reference(query.to(torch.bfloat16).double(), latents, RANK, 0.05)
    assert torch.isfinite(out).all(), "read a stale (NaN) slot"
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, err
    assert hopper_calls == (["pair"] if ON_HOPPER else [])


@pytest.mark.parametrize("form", FORMS)
def test_the_output_in_place_gets_its_rotary_channels_zeroed(hopper_calls: list[str], form: str) -> None:
    """As the triton backend calls it: into a bf16 [T, H, 576] output, channels past 512 zeroed,
    the rows of a larger tensor around it untouched."""
    lens = [70, 5, 130]
    outer = torch.full((5, 16, RANK + ROPE), 3.0, dtype=torch.bfloat16, device=DEVICE)
    out, query, latents = _attend(lens, 16, 64, torch.bfloat16, programs=4, direct=False, out=outer[1:4], form=form)
    want = _reference(query.to(torch.bfloat16).double(), [lat.to(torch.bfloat16).double() for lat in latents], RANK,
                      0.05)  # fmt: skip
    err = (out.double().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, err
    assert bool((outer[1:4, :, RANK:] == 0).all()) and bool((outer[0] == 3.0).all()) and bool((outer[4] == 3.0).all())
    assert bool(hopper_calls) == ON_HOPPER


@pytest.mark.parametrize("form", FORMS)
def test_block_ids_outside_the_cache_stay_finite(hopper_calls: list[str], form: str) -> None:
    """Ids outside [0, num_blocks) read block 0 and leave their latents out: no fault, finite
    output, and the rows whose tables are sound match the oracle."""
    lens = [300, 77, 129]
    query, cache, tables, latents = _case(lens, 16, RANK, ROPE, 64, torch.float64)
    bad = tables.clone()
    bad[0, 1], bad[1, 0] = -3, cache.shape[0] + 5
    out, query, latents = _attend(lens, 16, 64, torch.bfloat16, programs=3, direct=False, tables=bad, form=form)
    assert torch.isfinite(out).all()
    want = _reference(query.to(torch.bfloat16).double(), [lat.to(torch.bfloat16).double() for lat in latents], RANK,
                      0.05)  # fmt: skip
    err = (out[2].double().cpu() - want[2]).abs().max().item() / want[2].abs().max().item()
    assert err < 1e-2, err
    assert bool(hopper_calls) == ON_HOPPER


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy on garbage sums)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("form", [*FORMS, *(f"fp8-{kernel}" for kernel in FP8_KERNELS)])
def test_any_work_array_stays_inside_the_buffers(monkeypatch: pytest.MonkeyPatch, seed: int, form: str) -> None:
    """A work array of random values reads and writes nothing outside the cache, the partial
    buffers and the output (seed 1: planned direct); "fp8-*": over an fp8 latent, on that fp8
    kernel."""
    lens = [140, 12, 70]
    query, cache, tables, _ = _case(lens, 16, RANK, ROPE, 64, torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    programs = 3
    fused = form == "fused"
    junk = torch.randint(-(2**31), 2**31 - 1, (mla_work_len(3, programs, fused),), generator=gen, dtype=torch.int64)
    junk[torch.rand(junk.shape, generator=gen) < 0.5] %= 50
    fp8 = form.startswith("fp8-")
    if fp8:
        _fp8_kernel(monkeypatch, form.removeprefix("fp8-"))
    c = cache.to(DEVICE, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    before = c.float()
    outer = torch.full((5, 16, RANK + ROPE), 3.0, dtype=torch.bfloat16, device=DEVICE)
    mla_attention(
        query.to(DEVICE, torch.bfloat16), c, tables.to(DEVICE), torch.arange(3, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), kv_lora_rank=RANK, scale=0.05,
        block_n=MLA_HOPPER_BLOCK_N, num_stages=2, hopper=True,
        work=MLAWork(junk.to(torch.int32).to(DEVICE), programs, direct=seed > 0, counters=fused), out=outer[1:4],
        hopper_ring=form == "ring", hopper_split=form == "split", hopper_fused_merge=fused,
        kv_scale=torch.tensor([0.5], device=DEVICE) if fp8 else None,
    )  # fmt: skip
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    after = c.float()
    assert torch.equal(after.isnan(), before.isnan()) and torch.equal(after.nan_to_num(), before.nan_to_num())
    assert (outer[0] == 3.0).all() and (outer[4] == 3.0).all() and (outer[1:4, :, RANK:] == 3.0).all()


@pytest.mark.parametrize("direct", [False, True], ids=["slots", "direct"])
def test_the_merge_in_the_kernel_matches_the_merge_launch_layer_after_layer(direct: bool) -> None:
    """``hopper_fused_merge`` (on an sm_90 GPU the last program to finish a split token merges
    it; elsewhere the Triton fallback): the same output as the merge launch, into a bf16 output
    in place with its rotary channels zeroed, padding tokens (row -1) and an empty row zeroed
    too; three launches over one work array, as a step's layers run, each giving the same
    result and leaving the work array as staged (its counters back at zero)."""
    lens, heads = [300, 0, 1000, 65, 130, 7], 16
    query, cache, tables, _ = _case(lens, heads, RANK, ROPE, 64, torch.float64, seed=4)
    rows = [0, 1, -1, 2, 3, 4, 5, -1]  # two padding tokens
    token_lens = [lens[r] if r >= 0 else 0 for r in rows]
    q = torch.cat([query, query[:2]]).to(DEVICE, torch.bfloat16)
    plan = plan_mla_work(token_lens, 5, MLA_HOPPER_BLOCK_N, 64, direct=direct, counters=True)
    work = MLAWork(torch.tensor(plan, dtype=torch.int32, device=DEVICE), 5, direct, counters=True)
    staged = work.data.clone()
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
    args = (q, cache.to(DEVICE, torch.bfloat16), tables.to(DEVICE), ints(rows), ints(token_lens))
    kw = dict(kv_lora_rank=RANK, scale=0.05, work=work, block_n=MLA_HOPPER_BLOCK_N, num_stages=2, hopper=True,
              zero_rest=True)  # fmt: skip
    want = torch.full((len(rows), heads, RANK + ROPE), 3.0, dtype=torch.bfloat16, device=DEVICE)
    mla_attention(*args, out=want, **kw)  # type: ignore[arg-type]
    assert not want[[1, 2, 7]].any() and not want[..., RANK:].any()
    for _ in range(3):
        got = torch.full_like(want, 3.0)
        mla_attention(*args, out=got, hopper_fused_merge=True, **kw)  # type: ignore[arg-type]
        assert torch.equal(work.data, staged), "the counters are back at zero"
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    bare = MLAWork(torch.tensor(plan_mla_work(token_lens, 5, MLA_HOPPER_BLOCK_N, 64, direct=direct),
                                dtype=torch.int32, device=DEVICE), 5, direct)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="hopper_fused_merge: the work array has no counters"):
        mla_attention(*args, out=got, hopper_fused_merge=True, **{**kw, "work": bare})  # type: ignore[arg-type]


def _latent_spec(heads: int = 16, **kw: object) -> AttentionSpec:
    return AttentionSpec(heads, 1, RANK + ROPE, "bfloat16", latent_rank=RANK, **kw)  # type: ignore[arg-type]


def test_the_backend_takes_the_hopper_launch_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an sm_90 GPU declared: <= 16 heads over a 16-bit 512 + 64 latent, or an fp8 one under
    bf16 queries, in blocks of a multiple of 64 get the Hopper launch (one program an SM); 32
    heads, blocks of 32, an fp8 latent under fp16 queries, a float32 spec and
    ``hopper_mla_decode=False`` keep the default launch."""
    monkeypatch.setattr(triton_backend, "hopper_prefill_possible", lambda device: True)
    cuda = torch.device("cuda")
    backend = TritonBackend(_latent_spec(), num_sms=132)
    for block_size in (64, 128, 256):
        launch = backend._mla_launch(cuda, block_size)
        assert launch == hopper_mla_launch() and launch.hopper, block_size
        assert backend._mla_programs(launch, cuda) == 132
    assert TritonBackend(_latent_spec(8), num_sms=132)._mla_launch(cuda, 64).hopper
    assert TritonBackend(_latent_spec(kv_cache_dtype="float8_e4m3"), num_sms=132)._mla_launch(cuda, 64).hopper
    fp16_queries = AttentionSpec(16, 1, RANK + ROPE, "float16", latent_rank=RANK, kv_cache_dtype="float8_e4m3")
    fp32 = AttentionSpec(16, 1, RANK + ROPE, "float32", latent_rank=RANK)
    keeps = [
        (TritonBackend(_latent_spec(), num_sms=132), 32),
        (TritonBackend(_latent_spec(32), num_sms=132), 64),
        (TritonBackend(fp16_queries, num_sms=132), 64),
        (TritonBackend(fp32, num_sms=132), 64),
        (TritonBackend(_latent_spec(), num_sms=132, hopper_mla_decode=False), 64),
    ]
    for other, block_size in keeps:
        launch = other._mla_launch(cuda, block_size)
        assert not launch.hopper and launch == default_mla_launch(other.spec.num_heads), (other.spec, block_size)
    assert not backend._mla_launch(cuda, 64).hopper_ring
    ring = TritonBackend(_latent_spec(), num_sms=132, hopper_mla_ring=True)._mla_launch(cuda, 64)
    assert ring.hopper and ring.hopper_ring and ring.kernel_args()["hopper_ring"]
    assert not backend._mla_launch(cuda, 64).hopper_split
    split = TritonBackend(_latent_spec(), num_sms=132, hopper_mla_split=True)._mla_launch(cuda, 64)
    assert split.hopper and split.hopper_split and split.kernel_args()["hopper_split"]
    assert split.programs_per_sm == 1  # one program an SM, as the two-tile kernel
    assert not backend._mla_launch(cuda, 64).hopper_fused_merge
    fused_backend = TritonBackend(_latent_spec(), num_sms=132, hopper_mla_fused_merge=True)
    fused = fused_backend._mla_launch(cuda, 64)
    assert fused.hopper and fused.hopper_fused_merge and fused.kernel_args()["hopper_fused_merge"]
    # Only a backend with the fused merge stages its counters (16 a token).
    assert fused_backend._latent_work_len(100) == backend._latent_work_len(100) + 16 * 100
    # The work buffer holds the larger plan of the two launches (the default's 2 programs an SM).
    assert backend._most_mla_programs() == 264
    monkeypatch.setattr(triton_backend, "hopper_prefill_possible", lambda device: False)
    assert not backend._mla_launch(cuda, 64).hopper


def test_the_form_flags_reach_the_hopper_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mla_attention(..., hopper_ring=, hopper_split=)`` pick the Gluon kernel's form where
    it applies."""
    seen: list[object] = []
    monkeypatch.setattr(mla_decode_module, "mla_decode_hopper_applies", lambda *args: True)
    monkeypatch.setattr(
        mla_decode_module, "launch_mla_hopper", lambda *args, **kw: seen.append((kw.get("ring"), kw.get("split")))
    )
    for form in ("pair", "ring", "split"):
        _attend([70, 5], 16, 64, torch.bfloat16, programs=2, direct=False, form=form)
    assert seen == [(False, False), (True, False), (False, True)]


def test_the_kernel_shape_rule() -> None:
    assert mla_decode_hopper_shape_ok(16, 512, 64, 64) and mla_decode_hopper_shape_ok(1, 512, 64, 192)
    assert not mla_decode_hopper_shape_ok(17, 512, 64, 64)
    assert not mla_decode_hopper_shape_ok(16, 256, 64, 64)
    assert not mla_decode_hopper_shape_ok(16, 512, 32, 64)
    assert not mla_decode_hopper_shape_ok(16, 512, 64, 32)
    assert not mla_decode_hopper_shape_ok(0, 512, 64, 64)
