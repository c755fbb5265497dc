"""A checkpoint directory is untrusted input: every size in config.json is bounded and typed,
broken JSON and broken safetensors files are named in the error, and an index may only name
shard files beside it. Nothing is allocated for a config that is refused."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.model import shape_from_config
from examples.model.checkpoints import checkpoint_files, load_checkpoint, read_config

safetensors_torch = pytest.importorskip("safetensors.torch")

TINY: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def _dir(tmp_path: Path, config: dict[str, Any] | str, weights: bool = True) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        safetensors_torch.save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_hidden_layers": 10**9}, r"num_hidden_layers: 1000000000 is outside \[1, 1024\]"),
        ({"num_attention_heads": 0}, r"num_attention_heads: 0 is outside"),
        ({"num_attention_heads": -4}, r"num_attention_heads: -4 is outside"),
        ({"hidden_size": "4096"}, r"hidden_size: '4096' is not an integer"),
        ({"intermediate_size": 1.5}, r"intermediate_size: 1.5 is not an integer"),
        ({"vocab_size": True}, r"vocab_size: True is not an integer"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads: 3 does not divide num_attention_heads 4"),
        ({"vocab_size": None}, r"vocab_size: missing"),
        ({"rms_norm_eps": -1}, r"rms_norm_eps: -1 is not a positive finite number"),
        ({"rope_theta": "big"}, r"rope_theta: 'big' is not a positive finite number"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_parameters.factor: missing"),
        ({"rope_scaling": [1, 2]}, r"rope_parameters: \[1, 2\] is not a mapping"),
        ({"head_dim": 10**6}, r"head_dim: 1000000 is outside"),
    ],
)
def test_hostile_sizes_are_refused_naming_the_key(change: dict[str, Any], match: str) -> None:
    config = {**TINY, **change}
    started = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        shape_from_config(config)
    assert time.perf_counter() - started < 1.0, "a refused config must not build anything"


def test_the_tiny_config_itself_is_accepted() -> None:
    shape = shape_from_config(TINY)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 8)


@pytest.mark.parametrize(
    "text", ['{"model_type": "llama", "vocab_', "[1, 2]", "\xff\xfe"], ids=["truncated", "list", "bytes"]
)
def test_unreadable_config_json_is_named(tmp_path: Path, text: str) -> None:
    root = _dir(tmp_path, text, weights=False)
    with pytest.raises(ValueError, match=r"config\.json"):
        read_config(root)


def test_an_index_may_only_name_shards_beside_it(tmp_path: Path) -> None:
    root = _dir(tmp_path, TINY)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(elsewhere / "model.safetensors"))
    index = root / "model.safetensors.index.json"
    for name in ("../elsewhere/model.safetensors", str(elsewhere / "model.safetensors"), "sub/x.safetensors", ".."):
        index.write_text(json.dumps({"weight_map": {"x": name}}))
        with pytest.raises(ValueError, match="only name files beside it"):
            checkpoint_files(root)
    index.write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors: listed in"):
        checkpoint_files(root)
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(ValueError, match="weight_map must map"):
        checkpoint_files(root)
    index.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match="safetensors index"):
        checkpoint_files(root)


def _header(tensors: dict[str, Any]) -> bytes:
    raw = json.dumps(tensors).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda good: good[: len(good) // 2], id="truncated"),
        pytest.param(lambda good: struct.pack("<Q", 1 << 40) + good[8:], id="header-claims-a-terabyte"),
        pytest.param(
            lambda good: (
                _header(
                    {"model.embed_tokens.weight": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 1 << 20]}}
                )
                + b"\0" * 64
            ),
            id="tensor-past-the-end",
        ),
    ],
)
def test_broken_safetensors_files_are_named(tmp_path: Path, content: Any) -> None:
    root = _dir(tmp_path, TINY)
    weights = root / "model.safetensors"
    weights.write_bytes(content(weights.read_bytes()))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(root)


_VALUES = st.one_of(
    st.sampled_from(["llama", "qwen2", "mistral", "full_attention", "sliding_attention"]),
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(
        st.one_of(st.integers(0, 3), st.sampled_from(["full_attention", "sliding_attention"]), st.none()), max_size=3
    ),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "type"]), st.integers(-2, 9), max_size=2),
)


_KEYS = sorted(
    {
        *TINY,
        "head_dim",
        "rope_scaling",
        "rope_theta",
        "sliding_window",
        "use_sliding_window",
        "layer_types",
        "max_window_layers",
    }
)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=4))
def test_any_config_gives_a_shape_or_a_value_error(changes: dict[str, Any]) -> None:
    """Random values of random types in any key: a shape within the bounds, or ValueError;
    never another exception (a bare int(), a ZeroDivisionError) and never a slow build."""
    started = time.perf_counter()
    try:
        shape = shape_from_config({**TINY, **changes})
    except ValueError:
        return
    finally:
        assert time.perf_counter() - started < 1.0
    assert 1 <= shape.num_layers <= 1024 and 1 <= shape.num_kv_heads <= shape.num_heads <= 1024
    assert shape.num_heads % shape.num_kv_heads == 0 and 1 <= shape.head_dim <= 1024
