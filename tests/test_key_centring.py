"""Key centring of the int8 cache (``LayerCache.k_centre``, ``KVCacheTensors.set_key_centres``,
``kvcache.memory.calibration.key_centres_from_cache``): keys are stored less a fixed per-(KV
head, channel) centre, which moves every score of a query by the same amount.

The writes (reference, and the Triton cache and fused rotary writes, in the CPU interpreter
without a GPU) store exactly ``quantize_rows(k - centre)``; attention over centred keys stays
the attention of the original keys, with a smaller error when the keys carry a per-channel
bias (as a trained model's do); what centring cannot keep exact (a score cap, sinks) or is not
built for (caches other than int8) is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attention import BACKENDS, LayerCache
from attention.errors import InvalidArgumentError, UnsupportedSettingError
from attention.reference import scatter_kv
from attention.rotary import RotaryTable, rotate
from attention.token_scales import dequantize_rows, quantize_rows
from attention.triton_kernels import rotary_write_kv, write_kv_cache
from examples.engine.parts import cache_config_for
from examples.model import LlamaShape
from kvcache import KVCacheConfig, allocate_kv_cache
from kvcache.memory.calibration import key_centres_from_cache
from tests.paged_case import BACKENDS_UNDER_TEST, UnderTest, int8_layer, int8_views, make_case, make_spec

pytestmark = pytest.mark.kernel


def _biased_keys(tokens: int, kv_heads: int, head_dim: int, seed: int, bias: float = 8.0) -> torch.Tensor:
    """Keys with a large per-(head, channel) offset, as a trained model's keys have."""
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(kv_heads, head_dim, generator=gen) * bias
    return offset + torch.randn(tokens, kv_heads, head_dim, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True], ids=["write", "rotary-write"])
def test_centred_writes_store_the_rows_less_the_centre(dtype: torch.dtype, fused: bool, triton_device: str) -> None:
    """Both Triton writes store the bytes the reference stores, and those are the int8 rows
    of ``k - centre`` taken in float32 (V is not centred); other bytes stay as they were."""
    kvh, d, bs, blocks, tokens, dev = 3, 24, 32, 3, 7, triton_device
    key = _biased_keys(tokens, kvh, d, seed=1).to(dtype=dtype, device=dev)
    value = torch.randn(tokens, kvh, d, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=dev)
    centre = key.float().mean(0) + 0.37  # not the exact mean: any fixed centre must be applied as given
    slots = torch.tensor([4, -1, 3 * bs - 1, 0, bs, 2 * bs + 5, 9], device=dev)
    got, plain = int8_layer(blocks, bs, kvh, d, dev)
    want = got.clone()
    layer = dataclasses.replace(plain, k_centre=centre)
    oracle = dataclasses.replace(int8_views(want, bs), k_centre=centre)
    if fused:
        table = RotaryTable.build(1.0 / 500.0 ** (torch.arange(0, d, 2, device=dev).float() / d), 64)
        positions = torch.tensor([3, 0, 7, 63, 5, 9, 2], device=dev)
        query = torch.randn(tokens, 2 * kvh, d).to(dtype=dtype, device=dev)
        rotary_write_kv(
            query, key, value, layer.key, layer.value, slots, positions, table.cos_sin, layer.k_scale,
            layer.v_scale, centre,
        )  # fmt: skip
        key = rotate(key, positions, table)
    else:
        write_kv_cache(key, value, layer.key, layer.value, slots, layer.k_scale, layer.v_scale, centre)
    scatter_kv(key, value, oracle, slots)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ from the reference's"
    kept = slots[slots >= 0]
    assert oracle.k_scale is not None and oracle.v_scale is not None
    stored_k = oracle.key.flatten(0, 1)[kept]
    q, s = quantize_rows(key[slots >= 0].float() - centre)
    assert torch.equal(stored_k, q) and torch.equal(oracle.k_scale.flatten(0, 1)[kept], s)
    q_v, _ = quantize_rows(value[slots >= 0])
    assert torch.equal(oracle.value.flatten(0, 1)[kept], q_v), "V must not be centred"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_a_zero_centre_stores_the_uncentred_bytes(under: UnderTest) -> None:
    spec = make_spec(4, 2, 16, torch.float16, kv_cache_dtype="int8")
    if "int8" not in BACKENDS[under.name].kv_cache_dtypes or not under.supports(torch.float16):
        pytest.skip(f"{under.name} has no int8 cache in float16")
    plain = make_case([(0, 9), (5, 3)], spec, block_size=under.block_size, device=under.device, seed=3)
    centred = make_case([(0, 9), (5, 3)], spec, block_size=under.block_size, device=under.device, seed=3)
    zero = torch.zeros(2, 16, device=under.device)
    backend = under.make(spec)
    plan = backend.plan(plain.meta)
    backend.write_kv(plain.new_key, plain.new_value, plain.layer, plan)
    backend.write_kv(centred.new_key, centred.new_value, dataclasses.replace(centred.layer, k_centre=zero), plan)
    assert torch.equal(plain.storage, centred.storage)


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """float64 causal attention of rows of all-new tokens (GQA), [tokens, heads, d]."""
    heads, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    out, start = [], 0
    for n in lens:
        qs = q[start : start + n].double().transpose(0, 1)  # [heads, n, d]
        ks = k[start : start + n].double().repeat_interleave(heads // kvh, 1).transpose(0, 1)
        vs = v[start : start + n].double().repeat_interleave(heads // kvh, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1).to(q.device), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_centred_keys_keep_attention_and_shrink_its_error(under: UnderTest) -> None:
    """Keys with a per-channel offset 8x their spread: stored centred on their mean, the int8
    cache's attention stays that of the original float keys (the common shift of a query's
    scores drops out of the softmax) and its error against float64 falls several-fold."""
    if "int8" not in BACKENDS[under.name].kv_cache_dtypes or not under.supports(torch.float32):
        pytest.skip(f"{under.name} has no int8 cache in float32")
    heads, kvh, d, lens = 4, 2, 32, [37, 11, 1]
    spec = make_spec(heads, kvh, d, torch.float32, kv_cache_dtype="int8")
    errors = {}
    for centring in (False, True):
        case = make_case([(0, n) for n in lens], spec, block_size=under.block_size, device=under.device, seed=5)
        key = _biased_keys(sum(lens), kvh, d, seed=6).to(under.device)
        query = case.query * 4  # sharper softmax: score errors show
        centre = key.mean(0) if centring else None
        layer = dataclasses.replace(case.layer, k_centre=centre)
        backend = under.make(spec)
        plan = backend.plan(case.meta)
        backend.write_kv(key, case.new_value, layer, plan)
        out = backend.attend(query, layer, plan)[: sum(lens)]
        want = _dense_attention(query, key, case.new_value, lens)
        errors[centring] = float((out.double() - want).abs().max() / want.abs().max())
    assert errors[True] < 0.05, errors
    assert errors[True] * 3 < errors[False], f"centring should cut the error several-fold: {errors}"


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    ("spec_kw", "centre_kw", "match"),
    [
        ({"logit_softcap": 30.0}, {}, "score cap"),
        ({"attention_sinks": True}, {}, "attention sinks"),
        ({"kv_cache_dtype": None}, {}, "built for the int8 cache"),
        ({}, {"dtype": torch.float16}, "k_centre"),
        ({}, {"shape": (2, 8)}, "k_centre"),
        ({}, {"transpose": True}, "k_centre"),
    ],
    ids=["softcap", "sinks", "fp16-cache", "fp16-centre", "shape", "strides"],
)
def test_centred_keys_are_refused_where_they_would_change_or_break_attention(
    under: UnderTest, spec_kw: dict[str, object], centre_kw: dict[str, object], match: str
) -> None:
    """Refused by name before anything is written."""
    kw: dict[str, object] = {"kv_cache_dtype": "int8", **spec_kw}
    spec = make_spec(4, 2, 16, torch.float16, **kw)
    if not under.supports(torch.float16) or (spec.cache_dtype not in BACKENDS[under.name].kv_cache_dtypes):
        pytest.skip(f"{under.name} has no {spec.cache_dtype} cache in float16")
    case = make_case([(3, 2)], spec, block_size=under.block_size, device=under.device)
    shape = centre_kw.get("shape", (2, 16))
    centre = torch.zeros(*shape, dtype=centre_kw.get("dtype", torch.float32), device=under.device)  # type: ignore[call-overload]
    if centre_kw.get("transpose"):
        centre = torch.zeros(16, 2, device=under.device).t()
    layer = dataclasses.replace(case.layer, k_centre=centre)
    try:
        backend = under.make(spec)
    except UnsupportedSettingError:
        pytest.skip(f"{under.name} refuses this spec itself")
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    with pytest.raises((UnsupportedSettingError, InvalidArgumentError), match=match):
        backend.write_kv(case.new_key, case.new_value, layer, plan)
    assert torch.equal(case.storage.view(torch.uint8), before.view(torch.uint8)), "a refused write changed the cache"


SHAPE = LlamaShape(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16
)


def _config(dtype: str) -> KVCacheConfig:
    compute = "float32" if dtype in ("int8", "float8_e4m3") else None
    return cache_config_for(SHAPE, block_size=32, dtype=dtype, num_blocks=6, device="cpu", compute_dtype=compute)


def test_set_key_centres_hands_out_centred_layers() -> None:
    cache = allocate_kv_cache(_config("int8"))
    assert cache.layer(1).k_centre is None
    centres = torch.randn(3, 2, 16, dtype=torch.float64)
    cache.set_key_centres(centres)
    assert cache.key_centres is not None and cache.key_centres.dtype == torch.float32
    for i in range(3):
        layer = cache.layer(i)
        assert layer.k_centre is not None and torch.equal(layer.k_centre, centres[i].float())
        assert layer.k_scale is not None, "the scales stay"


@pytest.mark.parametrize(
    ("dtype", "centres", "match"),
    [
        ("float16", torch.zeros(3, 2, 16), "built for the int8 cache"),
        ("float8_e4m3", torch.zeros(3, 2, 16), "built for the int8 cache"),
        ("int8", torch.zeros(2, 2, 16), "shape"),
        ("int8", torch.full((3, 2, 16), float("nan")), "finite"),
        ("int8", torch.zeros(3, 2, 16, dtype=torch.int32), "floating-point"),
        ("int8", [[0.0]], "shape"),
    ],
    ids=["fp16-cache", "fp8-cache", "layers", "nan", "integers", "list"],
)
def test_set_key_centres_refuses_and_changes_nothing(dtype: str, centres: object, match: str) -> None:
    cache = allocate_kv_cache(_config(dtype))
    layers = [cache.layer(i) for i in range(3)]
    with pytest.raises(InvalidArgumentError, match=match):
        cache.set_key_centres(centres)  # type: ignore[arg-type]
    assert cache.key_centres is None and [cache.layer(i) for i in range(3)] == layers


def test_key_centres_are_the_mean_of_the_written_keys() -> None:
    cache = allocate_kv_cache(_config("float32"), fill=0.0)
    keys = cache.storage[:, 0]  # [layers, blocks, block_size, kv_heads, head_dim]
    gen = torch.Generator().manual_seed(7)
    written = torch.randn(3, 40, 2, 16, generator=gen) + 3.0
    keys.view(3, -1, 2, 16)[:, 5:45] = written  # slots 5..44 written, every other slot zeros
    centres = key_centres_from_cache(cache)
    torch.testing.assert_close(centres, written.mean(1))


def test_key_centres_refuse_8_bit_and_empty_caches() -> None:
    with pytest.raises(InvalidArgumentError, match="16- or 32-bit"):
        key_centres_from_cache(allocate_kv_cache(_config("int8")))
    with pytest.raises(InvalidArgumentError, match="no key was written"):
        key_centres_from_cache(allocate_kv_cache(_config("float32"), fill=0.0))


def test_dequantized_centred_keys_differ_from_the_keys_by_the_centre_only() -> None:
    """What the reference stores reads back as ``k - centre`` to int8 precision (the centre is
    not added back: the cache holds the centred keys)."""
    _, plain = int8_layer(2, 32, 2, 16, "cpu")
    key = _biased_keys(5, 2, 16, seed=9)
    centre = key.mean(0)
    layer: LayerCache = dataclasses.replace(plain, k_centre=centre)
    scatter_kv(key, key, layer, torch.arange(5))
    assert layer.k_scale is not None and layer.v_scale is not None
    back = dequantize_rows(layer.key.flatten(0, 1)[:5], layer.k_scale.flatten(0, 1)[:5], torch.float32)
    torch.testing.assert_close(back, key - centre, atol=0.03, rtol=0)
    plain = dequantize_rows(layer.value.flatten(0, 1)[:5], layer.v_scale.flatten(0, 1)[:5], torch.float32)
    assert (plain - key).abs().max() > (back - (key - centre)).abs().max() * 3, "V kept the offset: bigger error"


def test_calibrated_centres_are_the_mean_keys_the_model_writes() -> None:
    """``calibrate_key_centres`` prefills the prompts into a scratch cache of the compute dtype
    and centres the int8 cache on the mean key written there; the engine then serves over it."""
    from examples.engine.calibration import calibrate_key_centres
    from examples.engine.loop import run_requests
    from examples.engine.parts import engine_for
    from examples.engine.scheduler import Request, make_preemption
    from examples.model import random_llama

    model = random_llama(SHAPE, seed=3, dtype=torch.bfloat16)
    config = cache_config_for(
        SHAPE, block_size=32, dtype="int8", num_blocks=16, device="cpu", backend="reference", compute_dtype="bfloat16"
    )
    engine = engine_for(config, SHAPE)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (40, 7, 33)]
    centres = calibrate_key_centres(model, config, engine.cache, prompts)
    ref = engine_for(
        cache_config_for(SHAPE, block_size=32, dtype="bfloat16", num_blocks=16, device="cpu", backend="reference"),
        SHAPE,
        fill=0.0,
    )
    requests = [Request(i, p, 1) for i, p in enumerate(prompts)]
    run_requests(model, requests, manager=ref.manager, cache=ref.cache, backend=ref.backend,
                 preemption=make_preemption("recompute", ref.manager, ref.cache), overlap=False)  # fmt: skip
    torch.testing.assert_close(centres, key_centres_from_cache(ref.cache))
    assert all(engine.cache.layer(i).k_centre is not None for i in range(SHAPE.num_layers))
    requests = [Request(i, p, 4) for i, p in enumerate(prompts)]
    run_requests(model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
                 preemption=make_preemption("recompute", engine.manager, engine.cache))  # fmt: skip
    assert all(len(r.output) == 4 for r in requests)


def test_calibrating_centres_refuses_a_cache_other_than_int8() -> None:
    from examples.engine.calibration import calibrate_key_centres
    from examples.engine.parts import engine_for
    from examples.model import random_llama

    model = random_llama(SHAPE, seed=3, dtype=torch.bfloat16)
    config = cache_config_for(SHAPE, block_size=32, dtype="bfloat16", num_blocks=8, device="cpu", backend="reference")
    engine = engine_for(config, SHAPE)
    with pytest.raises(InvalidArgumentError, match="built for the int8 cache"):
        calibrate_key_centres(model, config, engine.cache, [[1, 2, 3]])
    assert engine.cache.key_centres is None
