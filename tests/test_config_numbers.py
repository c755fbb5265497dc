"""Config values read as the user means them, or refused saying so: YAML 1.1's octal and
base-60 integers, YAML 1.2 floats, exact budget fractions, cross-field rules over values that
failed validation, and the messages for near-miss names and empty or non-finite values."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvcache import ConfigError, parse_config
from kvcache.config.planning import plan_capacity
from kvcache.config.safe_yaml import _LOADERS, AmbiguousNumber, parse_yaml
from kvcache.config.schema import MemoryBudget

MODEL = "model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16}\n"
CACHE = "cache: {block_size: 32, dtype: float32, num_blocks: 8, device: cpu}\n"


def _errors(text: str) -> list[str]:
    """The problem lines of ``text`` without the file name."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="bad.yaml")
    return [line.split(": ", 1)[1] for line in str(info.value).splitlines()]


# --- exact budgets (finding 3) ----------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.7, 0.9, 0.3, 0.1, 0.95, 1 / 3, 1.0])
@pytest.mark.parametrize("free", [90 * 2**30, 80 * 2**30, 10**9 + 7, 1])
def test_a_fraction_of_free_memory_is_exact(fraction: float, free: int) -> None:
    """The oracle: the fraction as written (its shortest repr), times the bytes, rounded down."""
    exact = Fraction(repr(fraction)) * free
    assert MemoryBudget(fraction=fraction).bytes_given(free) == exact.numerator // exact.denominator


def test_the_plan_counts_every_block_of_a_fractional_budget() -> None:
    """0.7 of 90 GiB is 63 GiB: 16,128 blocks of 4 MiB, not 16,127 (floats: a byte short)."""
    config = parse_config(
        "model: {num_layers: 32, num_heads: 32, num_kv_heads: 8, head_dim: 128}\n"
        "cache: {block_size: 32, memory_budget: 0.7}\n"
    )
    plan = plan_capacity(config, 90 * 2**30, 8192)
    assert plan.num_blocks == 16_128 and plan.sequences_that_fit == 63
    from kvcache.memory.cache_tensors import num_blocks_for  # the allocator's count

    assert num_blocks_for(config, 90 * 2**30) == plan.num_blocks


# --- YAML 1.1 numbers (findings 4 and 5) ------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("model: {num_layers: 032, num_heads: 4, num_kv_heads: 2, head_dim: 16}\n",
         "model.num_layers: '032' has a leading zero (YAML reads it as octal 26); write 32"),
        (MODEL.replace("}", ", sliding_window: 1:30}"),
         "model.sliding_window: '1:30' is a base-60 number to YAML 1.1, which reads it as 90; "
         "write 90 if that is meant"),
        (MODEL.replace("head_dim: 16", "head_dim: 016"),
         "model.head_dim: '016' has a leading zero (YAML reads it as octal 14); write 16"),
        (MODEL.replace("head_dim: 16", "head_dim: 08"),
         "model.head_dim: '08' has a leading zero, so YAML reads it as text; write 8"),
    ],
)
def test_a_number_yaml_reads_in_another_base_is_refused_by_name(line: str, message: str) -> None:
    assert _errors(line + CACHE) == [message]


def test_octal_in_the_cache_section_and_a_text_field() -> None:
    cache = "cache: {block_size: 32, num_blocks: 0100, disk_cache_dir: 0755, disk_cache_space: 1GiB}\n"
    errors = _errors(MODEL + cache)
    assert "cache.num_blocks: '0100' has a leading zero (YAML reads it as octal 64); write 100" in errors
    octal_dir = "cache.disk_cache_dir: '0755' has a leading zero (YAML reads it as octal 493); quote it for text: "
    assert octal_dir + "'0755'" in errors


@pytest.mark.parametrize("loader", _LOADERS, ids=[cls.__name__ for cls in _LOADERS])
def test_both_loaders_read_numbers_alike(loader: type, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcache.config import safe_yaml

    monkeypatch.setattr(safe_yaml, "_Loader", loader)
    data = parse_yaml("[1e-3, 5E-3, 1.5e2, 3e1, -2e+2, .5e1, 1.0e-3, 0, 10, 0x1f, 1_000, 032, 1:30, '032', e3]").data
    assert isinstance(data, list)
    assert data[:11] == [0.001, 0.005, 150.0, 30.0, -200.0, 5.0, 0.001, 0, 10, 31, 1000]
    assert data[11] == AmbiguousNumber("032", 26) and data[12] == AmbiguousNumber("1:30", 90)
    assert data[13:] == ["032", "e3"]


@pytest.mark.parametrize(("text", "value"), [("1e-3", 0.001), ("5E-3", 0.005), ("1.5e2", 150.0), ("3e1", 30.0)])
def test_kv_scale_takes_yaml_12_floats(text: str, value: float) -> None:
    config = parse_config(MODEL + CACHE.replace("device: cpu", f"device: cpu, kv_scale: {text}"))
    assert config.cache.kv_scale == value


def test_memory_budget_takes_an_exponent() -> None:
    config = parse_config(MODEL + "cache: {block_size: 32, memory_budget: 9e-1}\n")
    assert config.cache.memory_budget == MemoryBudget(fraction=0.9)


# --- cross-field rules over invalid values (finding 7) ----------------------------------------


def test_a_size_written_as_text_counts_when_another_field_fails() -> None:
    """block_size 48 fails, so the tier rules run on raw values: "200GiB" is a size there too."""
    cache = (
        "cache: {block_size: 48, num_blocks: 24, enable_prefix_caching: true, host_cache_space: 16GiB,\n"
        "        disk_cache_space: 200GiB, disk_cache_dir: /tmp/kvd}\n"
    )
    assert _errors(MODEL + cache) == [
        "cache.block_size: 48 is not a positive multiple of 32 (the kernel tile); use 32 or 64"
    ]


def test_a_bad_size_raises_no_cross_field_problem() -> None:
    cache = "cache: {block_size: 32, num_blocks: 8, enable_prefix_caching: true, host_cache_space: lots,\n"
    cache += "        disk_cache_space: 1GiB, disk_cache_dir: /tmp/kvd}\n"
    errors = _errors(MODEL + cache)
    assert len(errors) == 1 and errors[0].startswith("cache.host_cache_space: 'lots' is not a size"), errors


def test_the_tier_rules_still_fire_on_raw_values() -> None:
    cache = "cache: {block_size: 48, num_blocks: 8, disk_cache_space: 1GiB, disk_cache_dir: /tmp/kvd}\n"
    errors = _errors(MODEL + cache)
    assert any("no host tier to feed it" in e for e in errors), errors


def test_a_latent_model_with_a_bad_kv_head_count_gets_one_message() -> None:
    model = (
        "model: {num_layers: 2, num_heads: 4, num_kv_heads: '1', head_dim: 192, kv_lora_rank: 512,\n"
        "        qk_rope_head_dim: 64, qk_nope_head_dim: 128, v_head_dim: 128}\n"
    )
    errors = _errors(model + CACHE)
    assert errors == ["model.num_kv_heads: '1' is not a whole number; write a whole number"], errors


# --- names and messages (finding 8) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "line", "words"),
    [
        ("cache", "dtype: BFloat16", ["'BFloat16' is not one of", "did you mean bfloat16?"]),
        ("cache", "dtype: FLOAT32", ["did you mean float32?"]),
        ("model", "dtype: float8_e4m3", ["model.dtype: 'float8_e4m3' is not one of", "storage format for the KV cache",
                                         "set it as cache.dtype"]),
        ("model", "dtype: fp8", ["float8_e4m3 is a storage format", "cache.dtype"]),
        ("model", "dtype: int8", ["int8 is a storage format", "cache.dtype"]),
        ("cache", "disk_cache_dir: ''", ["cache.disk_cache_dir: '' is empty; write a directory path"]),
        ("cache", "kv_scale: .nan", ["cache.kv_scale: nan is not a finite number; write a number such as 1.0"]),
        ("cache", f"disk_cache_dir: {'d' * 5000}", ["cache.disk_cache_dir: is 5,000 characters; at most 4,096"]),
    ],
)
def test_messages_name_the_fix(section: str, line: str, words: list[str]) -> None:
    text = MODEL + "cache: {block_size: 32, num_blocks: 8, device: cpu}\n"
    head = f"{section}: {{"
    text = text.replace(head, f"{head}{line}, ")
    message = "\n".join(_errors(text))
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    assert "should" not in message  # no raw pydantic wording ("String should have ...")


@pytest.mark.parametrize(("text", "words"), [("3\n", "holds a number, not a mapping"), ("[1]\n", "holds a list"),
                                             ("just text\n", "holds text, not a mapping")])
def test_a_document_that_is_not_a_mapping(text: str, words: str) -> None:
    assert words in _errors(text)[0]
