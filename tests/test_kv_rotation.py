"""K and V stored rotated (``cache.kv_rotation: hadamard``, :mod:`attention.kv_rotation`): the
rotation itself, exact attention through every backend (write_kv, attend and rotary_write_kv
take and give unrotated tensors), an int8 cache's error on keys with outlier channels, the
config and cache refusals, fp8 calibration in the rotated basis, and the example engine."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from attention import BACKENDS, LayerCache, ReferenceBackend
from attention.errors import InvalidArgumentError, UnsupportedSettingError
from attention.kv_rotation import hadamard_rotation, rotate, rotate_back
from attention.quantize import dequantize
from attention.rotary import RotaryTable
from attention.token_scales import dequantize_rows
from examples.engine.calibration import calibrate_key_centres, calibrate_kv_scales
from examples.engine.loop import run_requests
from examples.engine.parts import engine_for
from examples.engine.scheduler import Request, make_preemption
from examples.model.llama import random_llama
from examples.model.shape import shape_for_cache
from kvcache import ConfigError, KVCacheConfig, KVCacheTensors, allocate_kv_cache, load_config, parse_config
from kvcache.memory.calibration import scales_from_cache
from tests.paged_case import BACKENDS_UNDER_TEST, UnderTest, make_case, make_spec, reference_output, rel_err

ROWS = [(0, 37), (31, 1), (64, 1), (5, 33), (97, 1)]  # prefill, decode at odd lengths, extend


def test_the_rotation_is_orthonormal_seeded_and_power_of_two() -> None:
    for d in (1, 2, 8, 64, 128, 256):
        r = hadamard_rotation(d)
        assert r.dtype == torch.float32 and r.shape == (d, d)
        torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
        assert torch.equal(r, hadamard_rotation(d))  # every process builds the same one
        if d >= 8:
            assert not torch.equal(r, hadamard_rotation(d, seed=1))
            # Every channel mixes into every one, with one magnitude.
            torch.testing.assert_close(r.abs(), torch.full((d, d), d**-0.5), atol=1e-7, rtol=0)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(rotate_back(rotate(x.float(), hadamard_rotation(64)), hadamard_rotation(64)), x.float())
    for bad in (0, 3, 24, 96, -4, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="power of two"):
            hadamard_rotation(bad)  # type: ignore[arg-type]


def _rotated_copy(layer: LayerCache, rotation: torch.Tensor) -> LayerCache:
    """The case's float cache as a rotated cache holds it (NaN slots stay NaN)."""
    return LayerCache(
        rotate(layer.key, rotation).contiguous(), rotate(layer.value, rotation).contiguous(), layer.index,
        rotation=rotation,
    )  # fmt: skip


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_attention_over_a_rotated_cache_is_unchanged(under: UnderTest) -> None:
    """fp32, GQA 4:2 and 8:1, head_dim 32 and 64: a rotated cache gives the float64 oracle's
    output on prefill, extend and decode rows; write_kv stored the rotated K/V."""
    if not under.supports(torch.float32):
        pytest.skip(f"{under.name} does not compute in float32 (the exact comparison needs it)")
    for heads, kv_heads, d in ((4, 2, 32), (8, 1, 64)):
        spec = make_spec(heads, kv_heads, d, torch.float32)
        case = make_case(ROWS, spec, block_size=under.block_size, device=under.device, seed=d)
        rotation = hadamard_rotation(d, device=under.device)
        layer = _rotated_copy(case.layer, rotation)
        backend = under.make(spec)
        plan = backend.plan(case.meta)
        backend.write_kv(case.new_key, case.new_value, layer, plan)
        slots = case.meta.slot_mapping[case.meta.slot_mapping >= 0]
        stored = layer.key.reshape(-1, kv_heads, d)[slots]
        real = case.meta.num_real_tokens
        torch.testing.assert_close(stored, rotate(case.new_key[:real], rotation), atol=1e-5, rtol=0)
        out = torch.full_like(case.query, float("nan"))
        result = backend.attend(case.query, layer, plan, out=out)
        assert result.data_ptr() == out.data_ptr()
        expected = reference_output(case)
        torch.testing.assert_close(out[:real].float(), expected, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_a_rotated_cache_in_bf16_stays_within_bf16s_error(under: UnderTest) -> None:
    """bf16 compute: the rotation's products run in bf16 (the matrix rounded once), and the
    output stays within bf16's tolerance of the float64 oracle, as an unrotated cache's does."""
    if not under.supports(torch.bfloat16):
        pytest.skip(f"{under.name} does not compute in bfloat16")
    spec = make_spec(8, 2, 64, torch.bfloat16)
    case = make_case(ROWS, spec, block_size=under.block_size, device=under.device, seed=11)
    rotation = hadamard_rotation(64, device=under.device)
    layer = _rotated_copy(case.layer, rotation)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    backend.write_kv(case.new_key, case.new_value, layer, plan)
    out = backend.attend(case.query, layer, plan)
    assert out.dtype == torch.bfloat16
    real = case.meta.num_real_tokens
    err = rel_err(out[:real], reference_output(case))
    plain = dataclasses.replace(case.layer, key=case.layer.key.clone(), value=case.layer.value.clone())
    backend.write_kv(case.new_key, case.new_value, plain, plan)
    plain_err = rel_err(backend.attend(case.query, plain, plan)[:real], reference_output(case))
    assert err < 2e-2 and err < 3 * plain_err, (err, plain_err)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_rotary_write_kv_into_a_rotated_cache(under: UnderTest) -> None:
    """The fused boundary stores rotary(K) rotated, returns the unrotated rotary(query), and
    attention over that cache equals attention over an unrotated one."""
    if not under.supports(torch.float32):
        pytest.skip(f"{under.name} does not compute in float32 (the exact comparison needs it)")
    spec = make_spec(4, 2, 32, torch.float32)
    case = make_case(ROWS, spec, block_size=under.block_size, device=under.device, seed=3)
    rotation = hadamard_rotation(32, device=under.device)
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    table = RotaryTable.build(inv_freq.to(under.device), 140)
    backend = under.make(spec)
    plan = backend.plan(case.meta)
    plain = dataclasses.replace(case.layer, key=case.layer.key.clone(), value=case.layer.value.clone())
    rotated = _rotated_copy(case.layer, rotation)
    q_plain = backend.rotary_write_kv(case.query, case.new_key, case.new_value, plain, plan, table)
    q_rotated = backend.rotary_write_kv(case.query, case.new_key, case.new_value, rotated, plan, table)
    torch.testing.assert_close(q_rotated, q_plain, atol=1e-6, rtol=0)
    real = case.meta.num_real_tokens
    torch.testing.assert_close(
        rotated.key.reshape(-1, 2, 32), rotate(plain.key.reshape(-1, 2, 32), rotation),
        atol=2e-5, rtol=0, equal_nan=True,
    )  # fmt: skip
    a = backend.attend(q_plain, plain, plan)[:real]
    b = backend.attend(q_rotated, rotated, plan)[:real]
    torch.testing.assert_close(b, a, atol=3e-5, rtol=1e-5)


def _stored(layer: LayerCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V a layer holds at ``slots``, dequantized to float64: [slots, kv_heads, d]."""
    kvh, d = layer.key.shape[-2:]
    k, v = layer.key.reshape(-1, kvh, d)[slots], layer.value.reshape(-1, kvh, d)[slots]
    if layer.key.dtype == torch.int8:
        scales = [s.reshape(-1, kvh)[slots] for s in (layer.k_scale, layer.v_scale)]  # type: ignore[union-attr]
        return dequantize_rows(k, scales[0], torch.float64), dequantize_rows(v, scales[1], torch.float64)
    return dequantize(k, layer.k_scale, torch.float64), dequantize(v, layer.v_scale, torch.float64)


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("cache", [None, "int8", "float8_e4m3"])
def test_the_fused_boundary_stores_what_the_composed_one_stores(under: UnderTest, cache: str | None) -> None:
    """A backend whose rotary + cache-write kernel multiplies K and V itself
    (``rotates_kv_in_rotary_write``) stores, in a rotated bf16 / int8 / fp8 cache, what the
    reference's composed boundary (rotary, the products, the write) stores, within one
    rounding of the cache's format; every other byte of the poisoned cache is left as it was,
    and the query comes back unrotated. GQA 8:2 (K/V tiles padded to 16 heads for the dot)."""
    spec = make_spec(8, 2, 64, torch.bfloat16, kv_cache_dtype=cache)
    if not under.supports(torch.bfloat16) or (cache and cache not in BACKENDS[under.name].kv_cache_dtypes):
        pytest.skip(f"{under.name} has no bf16 compute with a {cache} cache")
    if not under.make(spec).rotates_kv_in_rotary_write:
        pytest.skip(f"{under.name} composes the boundary of a rotated cache (the reference for this test)")
    rotation = hadamard_rotation(64, device=under.device)
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    table = RotaryTable.build(inv_freq.to(under.device), 140)
    cases = [make_case(ROWS, spec, block_size=under.block_size, device=under.device, seed=5) for _ in range(2)]
    fused, composed = (dataclasses.replace(c.layer, rotation=rotation) for c in cases)
    before = cases[0].storage.clone()
    old_key, old_value = (x.reshape(-1, 2, 64).clone() for x in (fused.key, fused.value))
    backend, reference = under.make(spec), ReferenceBackend(spec)
    q_fused = backend.rotary_write_kv(
        cases[0].query, cases[0].new_key, cases[0].new_value, fused, backend.plan(cases[0].meta), table
    )
    q_composed = reference.rotary_write_kv(
        cases[1].query, cases[1].new_key, cases[1].new_value, composed, reference.plan(cases[1].meta), table
    )
    torch.testing.assert_close(q_fused, q_composed, atol=1.6e-2, rtol=1.6e-2)
    slots = cases[0].meta.slot_mapping[cases[0].meta.slot_mapping >= 0]
    (k_fused, v_fused), (k_composed, v_composed) = _stored(fused, slots), _stored(composed, slots)
    atol, rtol = {None: (1.6e-2, 1.6e-2), "int8": (0.05, 0.0), "float8_e4m3": (2e-3, 0.07)}[cache]
    for got, want in ((k_fused, k_composed), (v_fused, v_composed)):
        assert got.abs().max() > 0.5  # the step's K/V, not zeros
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    others = torch.ones(old_key.shape[0], dtype=torch.bool, device=slots.device)
    others[slots] = False
    for now, then in ((fused.key, old_key), (fused.value, old_value)):
        assert torch.equal(now.reshape(-1, 2, 64)[others].view(torch.uint8), then[others].view(torch.uint8))
    for edge in (0, -1):
        assert torch.equal(cases[0].storage[:, edge].view(torch.uint8), before[:, edge].view(torch.uint8))


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
def test_the_fused_boundary_takes_any_orthonormal_matrix(under: UnderTest) -> None:
    """A caller's own rotation (``KVCacheTensors(rotation=...)`` takes any orthonormal matrix):
    column-major (as torch.linalg.qr returns it), head_dim 40 (halves padded to 32 lanes), 3 KV
    heads; fp32, so the fused and the composed boundary store the same values."""
    if not under.supports(torch.float32):
        pytest.skip(f"{under.name} does not compute in float32")
    spec = make_spec(6, 3, 40, torch.float32)
    if not under.make(spec).rotates_kv_in_rotary_write:
        pytest.skip(f"{under.name} composes the boundary of a rotated cache (the reference for this test)")
    rotation = torch.linalg.qr(torch.randn(40, 40, generator=torch.Generator().manual_seed(2)))[0]
    assert not rotation.is_contiguous()
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, 40, 2, dtype=torch.float32) / 40)
    table = RotaryTable.build(inv_freq.to(under.device), 140)
    cases = [make_case(ROWS, spec, block_size=under.block_size, device=under.device, seed=9) for _ in range(2)]
    fused, composed = (dataclasses.replace(c.layer, rotation=rotation.to(under.device)) for c in cases)
    for backend, case, layer in ((under.make(spec), cases[0], fused), (ReferenceBackend(spec), cases[1], composed)):
        backend.rotary_write_kv(case.query, case.new_key, case.new_value, layer, backend.plan(case.meta), table)
    slots = cases[0].meta.slot_mapping[cases[0].meta.slot_mapping >= 0]
    for got, want in zip(_stored(fused, slots), _stored(composed, slots), strict=True):
        assert want.abs().max() > 0.5
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_which_boundaries_the_triton_kernel_rotates() -> None:
    """Up to head_dim 128 the fused kernel multiplies K and V; at 256 (its matrix would not
    fit the kernel's shared memory) the boundary is composed; the reference always composes."""
    from attention.triton_backend import TritonBackend

    assert TritonBackend(make_spec(8, 2, 128, torch.bfloat16)).rotates_kv_in_rotary_write
    assert not TritonBackend(make_spec(4, 2, 256, torch.bfloat16)).rotates_kv_in_rotary_write
    assert not ReferenceBackend(make_spec(8, 2, 128, torch.bfloat16)).rotates_kv_in_rotary_write


def test_an_int8_cache_loses_far_less_on_keys_with_outlier_channels() -> None:
    """Keys whose channels 3 and 17 are 30x the rest (as real models' are): through an int8
    cache, attention rotated is several times closer to the float64 oracle than unrotated."""
    spec = make_spec(8, 2, 64, torch.float32, kv_cache_dtype="int8")
    errors = {}
    for rotated in (False, True):
        case = make_case([(0, 200), (0, 150)], spec, block_size=32, device="cpu", seed=5)
        keys = case.new_key.clone()
        keys[..., 3] *= 30
        keys[..., 17] += 30
        case = dataclasses.replace(case, new_key=keys)
        layer = dataclasses.replace(case.layer, rotation=hadamard_rotation(64) if rotated else None)
        backend = ReferenceBackend(spec)
        plan = backend.plan(case.meta)
        backend.write_kv(case.new_key, case.new_value, layer, plan)
        out = backend.attend(case.query, layer, plan)
        f32 = dataclasses.replace(spec, kv_cache_dtype=None)
        exact = make_case([(0, 200), (0, 150)], f32, block_size=32, device="cpu", seed=5)
        exact = dataclasses.replace(exact, new_key=keys)
        errors[rotated] = rel_err(out[: case.meta.num_real_tokens], reference_output(exact))
    assert errors[True] < errors[False] / 3, errors


def _config(dtype: str = "int8", rotation: str = "hadamard", head_dim: int = 16) -> str:
    return f"""
model: {{num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: {head_dim}, dtype: float32}}
cache: {{block_size: 32, dtype: {dtype}, num_blocks: 8, device: cpu, kv_rotation: {rotation}}}
attention: {{backend: reference}}
"""


def test_the_config_takes_it_for_8_bit_caches_and_refuses_it_elsewhere() -> None:
    for dtype in ("int8", "float8_e4m3"):
        config = parse_config(_config(dtype))
        cache = allocate_kv_cache(config)
        assert config.cache.kv_rotation == "hadamard" and cache.rotation is not None
        assert all(torch.equal(cache.layer(i).rotation, hadamard_rotation(16)) for i in range(2))  # type: ignore[arg-type]
    assert allocate_kv_cache(parse_config(_config(rotation="none"))).layer(0).rotation is None
    refusals = [
        (_config("float32"), "cache.kv_rotation: hadamard with cache.dtype float32"),
        (_config(head_dim=24), "needs a power-of-two model.head_dim, got 24"),
        (_config(rotation="givens"), "cache.kv_rotation: 'givens' is not one of"),
    ]
    for text, message in refusals:
        with pytest.raises(ConfigError, match=message):
            parse_config(text)
    latent = """
model: {num_layers: 2, num_heads: 4, num_kv_heads: 1, head_dim: 16, kv_lora_rank: 24, qk_rope_head_dim: 8,
        qk_nope_head_dim: 8, v_head_dim: 16, dtype: bfloat16}
cache: {block_size: 32, dtype: float8_e4m3, num_blocks: 8, device: cpu, kv_rotation: hadamard}
attention: {backend: reference}
"""
    with pytest.raises(ConfigError, match="kv_rotation: is not supported with latent attention"):
        parse_config(latent)


def test_the_cache_and_the_backend_refuse_a_bad_rotation_changing_nothing() -> None:
    storage = torch.zeros(2, 2, 4, 32, 2, 16)
    for bad, message in (
        (torch.eye(16) * 2, "not orthonormal"),
        (torch.full((16, 16), float("nan")), "not orthonormal"),
        (torch.eye(8), r"expected a floating-point \[16, 16\] tensor"),
        (torch.eye(16, dtype=torch.int32), "floating-point"),
        ("hadamard", "floating-point"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            KVCacheTensors(storage, rotation=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="latent"):
        KVCacheTensors(torch.zeros(2, 1, 4, 32, 1, 16), rotation=hadamard_rotation(16))
    int8 = allocate_kv_cache(parse_config(_config()))
    with pytest.raises(InvalidArgumentError, match="set_key_centres: this cache stores K and V rotated"):
        int8.set_key_centres(torch.zeros(2, 2, 16))
    assert int8.key_centres is None and int8.layer(0).k_centre is None
    # The backend: a rotation of the wrong size or dtype, or with key centring.
    spec = make_spec(4, 2, 32, torch.float32)
    case = make_case(ROWS, spec, block_size=32, device="cpu")
    backend = ReferenceBackend(spec)
    plan = backend.plan(case.meta)
    before = case.storage.clone()
    for rotation in (torch.eye(16), torch.eye(32, dtype=torch.float64)):
        layer = dataclasses.replace(case.layer, rotation=rotation)
        with pytest.raises(InvalidArgumentError, match=r"layer\.rotation"):
            backend.write_kv(case.new_key, case.new_value, layer, plan)
    assert torch.equal(case.storage.nan_to_num(7.0), before.nan_to_num(7.0))
    int8_spec = make_spec(4, 2, 32, torch.float32, kv_cache_dtype="int8")
    int8_case = make_case(ROWS, int8_spec, block_size=32, device="cpu")
    both = dataclasses.replace(int8_case.layer, rotation=hadamard_rotation(32), k_centre=torch.zeros(2, 32))
    with pytest.raises(UnsupportedSettingError, match=r"layer\.rotation: with key centring"):
        ReferenceBackend(int8_spec).attend(int8_case.query, both, ReferenceBackend(int8_spec).plan(int8_case.meta))


def _tiny_engine(cache_dtype: str, rotation: str, seed: int = 1) -> list[list[int]]:
    base = load_config("tiny-cpu")
    model = {**base.model.model_dump(), "dtype": "float32"}
    cache = {**base.cache.model_dump(), "dtype": cache_dtype, "kv_rotation": rotation}
    config = KVCacheConfig.model_validate({**base.model_dump(), "model": model, "cache": cache}, strict=False)
    shape = shape_for_cache(config.model, vocab_size=64)
    engine = engine_for(config, shape)
    rng = random.Random(0)
    requests = [Request(i, [rng.randrange(64) for _ in range(rng.randint(5, 60))], 20) for i in range(6)]
    run_requests(
        random_llama(shape, seed=seed), requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=64, max_running=4,
    )  # fmt: skip
    return [r.output for r in requests]


def test_the_engine_serves_a_rotated_int8_cache() -> None:
    """The example engine (rotary boundary, chunked prefill, preemption) over a rotated int8
    cache gives the fp32 cache's greedy tokens on a random model."""
    torch.set_num_threads(1)
    assert _tiny_engine("int8", "hadamard") == _tiny_engine("float32", "none")


def test_fp8_calibration_measures_the_rotated_k_and_v() -> None:
    """calibrate_kv_scales on a rotated fp8 cache takes each head's largest magnitude of the
    rotated K/V (the scratch cache holds them unrotated), and key centring refuses a rotated
    int8 cache before any prefill."""
    text = _config("float8_e4m3")
    config = parse_config(text)
    shape = shape_for_cache(config.model, vocab_size=64)
    model = random_llama(shape, seed=2)
    cache = allocate_kv_cache(config)
    prompts = [[random.Random(i).randrange(64) for _ in range(40)] for i in range(2)]
    scales = calibrate_kv_scales(model, config, cache, prompts, margin=1.0)
    plain = allocate_kv_cache(parse_config(_config("float8_e4m3", rotation="none")))
    unrotated = calibrate_kv_scales(model, config, plain, prompts, margin=1.0)
    assert not torch.allclose(scales, unrotated)
    assert torch.equal(cache.scales, scales)  # type: ignore[arg-type]
    scratch = KVCacheTensors(torch.randn(2, 2, 3, 32, 2, 16))
    expect = (scratch.storage @ hadamard_rotation(16)).abs().amax(dim=(2, 3, 5)) / 448
    torch.testing.assert_close(scales_from_cache(scratch, 1.0, rotation=hadamard_rotation(16)), expect)
    with pytest.raises(InvalidArgumentError, match="int8_cache: stores K and V rotated"):
        calibrate_key_centres(model, config, allocate_kv_cache(parse_config(_config())), prompts)
