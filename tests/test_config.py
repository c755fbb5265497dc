"""Config parsing: every shipped YAML validates; every bad config is rejected naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcache import ConfigError, load_config, parse_config
from kvcache.config import KVCacheConfig

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))

GOOD = """
model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16}
cache: {block_size: 32, dtype: float32, num_blocks: 8, device: cpu}
attention: {backend: reference}
"""


def _errors(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="bad.yaml")
    return str(info.value)


def _with(section: str, key: str, value: str) -> str:
    """GOOD with ``section.key`` set to ``value`` (YAML text)."""
    data = {
        "model": {"num_layers": "2", "num_heads": "4", "num_kv_heads": "2", "head_dim": "16"},
        "cache": {"block_size": "32", "dtype": "float32", "num_blocks": "8", "device": "cpu"},
        "attention": {"backend": "reference"},
    }
    data[section][key] = value
    return "\n".join(
        f"{s}:\n" + "\n".join(f"  {k}: {v}" for k, v in fields.items()) for s, fields in data.items()
    )


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path: Path) -> None:
    config = load_config(path)
    assert config.bytes_per_block > 0


def test_shipped_configs_include_the_required_shapes() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"tiny-cpu", "llama3-8b", "llama3-70b", "qwen2.5-7b", "llama3-8b-flash-attn"} <= names
    assert load_config(CONFIGS[0].parent / "llama3-8b-flash-attn.yaml").cache.block_size == 256


def test_good_config_parses_with_derived_values() -> None:
    config = parse_config(GOOD)
    assert config.model.group_size == 2
    # 2 (K,V) x 2 layers x 32 tokens x 2 kv heads x 16 dims x 4 bytes
    assert config.bytes_per_block == 2 * 2 * 32 * 2 * 16 * 4
    assert config.bytes_per_token == config.bytes_per_block // 32


def test_config_is_frozen() -> None:
    config = parse_config(GOOD)
    with pytest.raises(Exception, match="frozen"):
        config.cache.block_size = 64  # type: ignore[misc]


# (section, key, bad value, words the message must contain)
BAD = [
    ("cache", "block_size", "48", ["cache.block_size", "48", "32", "use 32 or 64"]),
    ("cache", "block_size", "0", ["cache.block_size", "0"]),
    ("cache", "block_size", "-32", ["cache.block_size", "-32"]),
    ("cache", "block_size", "2048", ["cache.block_size", "2048", "1024"]),
    ("cache", "block_size", "thirty", ["cache.block_size", "thirty", "whole number"]),
    ("cache", "dtype", "fp16", ["cache.dtype", "fp16", "did you mean float16"]),
    ("cache", "dtype", "int8", ["cache.dtype", "int8", "float16"]),
    ("cache", "device", "gpu", ["cache.device", "gpu", "cuda:N"]),
    ("cache", "num_blocks", "0", ["cache.num_blocks", "0", "at least 1"]),
    ("cache", "swap_space", "lots", ["cache.swap_space", "lots", "GiB"]),
    ("cache", "enable_prefix_caching", "maybe", ["cache.enable_prefix_caching", "true or false"]),
    ("model", "head_dim", "30", ["model.head_dim", "30", "multiple of 8"]),
    ("model", "head_dim", "520", ["model.head_dim", "520", "512"]),
    ("model", "num_kv_heads", "3", ["model.num_kv_heads", "3", "num_heads 4", "use 2 or 4"]),
    ("model", "num_layers", "0", ["model.num_layers", "at least 1"]),
    ("model", "num_heads", "4.5", ["model.num_heads", "4.5", "whole number"]),
    ("attention", "backend", "flashinfer", ["attention.backend", "flashinfer", "flash_attn"]),
]


@pytest.mark.parametrize(("section", "key", "value", "words"), BAD, ids=[f"{s}.{k}={v}" for s, k, v, _ in BAD])
def test_bad_value_is_rejected_naming_field_value_and_fix(section: str, key: str, value: str, words: list[str]) -> None:
    message = _errors(_with(section, key, value))
    assert message.startswith("bad.yaml:")
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_flash_attn_with_block_32_names_256() -> None:
    text = _with("attention", "backend", "flash_attn").replace("device: cpu", "device: cuda")
    text = text.replace("dtype: float32", "dtype: bfloat16")
    message = _errors(text)
    assert "cache.block_size" in message and "256" in message
    assert parse_config(text.replace("block_size: 32", "block_size: 256")).cache.block_size == 256


def test_flash_attn_refuses_float32_cpu_and_big_heads_all_at_once() -> None:
    text = _with("attention", "backend", "flash_attn").replace("head_dim: 16", "head_dim: 264")
    text = text.replace("num_kv_heads: 2", "num_kv_heads: 2").replace("block_size: 32", "block_size: 256")
    message = _errors(text)
    for path in ("model.head_dim", "cache.dtype", "cache.device"):
        assert path in message
    assert len(message.splitlines()) == 3


def test_cuda_config_validates_without_a_gpu() -> None:
    config = parse_config(GOOD.replace("device: cpu", "device: cuda:3"))
    assert config.cache.device_type == "cuda"


def test_several_problems_are_all_reported_in_file_order() -> None:
    text = """
model:
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  head_dim: 30
cache:
  block_size: 48
  blok_size: 32
  dtype: fp16
  num_blocks: 8
"""
    lines = _errors(text).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("bad.yaml:6: model.head_dim")
    assert lines[1].startswith("bad.yaml:8: cache.block_size")
    assert "did you mean block_size" in lines[2]
    assert lines[3].startswith("bad.yaml:10: cache.dtype")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", ["empty"]),
        ("- 1\n- 2\n", ["list", "mapping"]),
        ("model: {num_layers: 2\n", ["bad.yaml:2:", "not valid YAML", "column"]),
        ("just a string", ["str", "mapping"]),
        ("model: 3\ncache: {block_size: 32, num_blocks: 1}\n", ["model", "mapping"]),
        (GOOD.replace("model:", "modle:"), ["modle", "did you mean model"]),
        (GOOD.replace("model: {num_layers: 2, ", "model: {"), ["model.num_layers", "required"]),
        (GOOD.replace("num_blocks: 8", "memory_budget: 1.5"), ["cache.memory_budget", "1.5", "(0, 1]"]),
        (GOOD.replace("num_blocks: 8", "memory_budget: 40 parsecs"), ["cache.memory_budget", "parsecs"]),
        (GOOD.replace("num_blocks: 8", "num_blocks: 8, memory_budget: 0.5"), ["both", "keep one"]),
        (GOOD.replace("num_blocks: 8, ", ""), ["neither", "num_blocks"]),
    ],
)
def test_malformed_files_get_a_clear_message(text: str, words: list[str]) -> None:
    message = _errors(text)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    assert "Traceback" not in message


def test_memory_budget_forms() -> None:
    frac = parse_config(GOOD.replace("num_blocks: 8", "memory_budget: 0.9")).cache.memory_budget
    size = parse_config(GOOD.replace("num_blocks: 8", "memory_budget: 40GiB")).cache.memory_budget
    assert frac is not None and frac.fraction == 0.9 and frac.bytes_given(1000) == 900
    assert size is not None and size.num_bytes == 40 * 2**30 and size.bytes_given(1) == 40 * 2**30


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_json_schema_describes_every_field() -> None:
    schema = KVCacheConfig.model_json_schema()
    for section in ("ModelSection", "CacheSection", "AttentionSection"):
        for name, field in schema["$defs"][section]["properties"].items():
            assert field.get("description"), f"{section}.{name} has no description"
