"""``kvcache schema``: it states every rule JSON schema can state, and the configs we ship pass it.

``jsonschema`` is not a dependency, so a small checker for the keywords our schema uses stands
in for it (and jsonschema itself is used too when it is installed).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.capabilities import BACKEND_NAMES
from attention.dtypes import DTYPES
from kvcache.config.rules import COMPUTE_DTYPES, DEVICE_PATTERN, MAX_BLOCKS
from kvcache.config.schema import config_json_schema
from kvcache.config.sizes import MAX_BYTES, SIZE_PATTERN, parse_bytes

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))
SCHEMA = config_json_schema()
DEFS = SCHEMA["$defs"]


def _ecma_search(pattern: str, text: str) -> bool:
    """JSON schema's ``pattern`` (ECMA-262): ``$`` matches only at the very end, where Python's
    also matches before a final newline."""
    return re.search(re.sub(r"\$$", r"\\Z", pattern), text) is not None


def _violations(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Where ``value`` breaks ``schema``; the keywords our schema uses, with draft 2020-12 meanings."""
    if "$ref" in schema:
        return _violations(value, DEFS[schema["$ref"].split("/")[-1]], where)
    if "anyOf" in schema:
        options = [_violations(value, option, where) for option in schema["anyOf"]]
        return [] if any(not found for found in options) else [f"{where}: matches no option of anyOf"]
    found = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        ok = isinstance(value, int) or (kind == "number" and isinstance(value, float))
        if not ok or isinstance(value, bool):
            return [f"{where}: {value!r} is not of type {kind}"]
    elif kind is not None and not isinstance(value, types[kind]):
        return [f"{where}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} not in enum")
    if "pattern" in schema and not _ecma_search(schema["pattern"], value):
        found.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if "minimum" in schema and value < schema["minimum"]:
        found.append(f"{where}: {value!r} < minimum")
    if "maximum" in schema and value > schema["maximum"]:
        found.append(f"{where}: {value!r} > maximum")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        found.append(f"{where}: {value!r} <= exclusiveMinimum")
    if "multipleOf" in schema and value % schema["multipleOf"] != 0:
        found.append(f"{where}: {value!r} is not a multiple of {schema['multipleOf']}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        found.append(f"{where}: more than maxItems")
    for item in value if kind == "array" else []:
        found += _violations(item, schema.get("items", {}), f"{where}[]")
    if kind == "object":
        for name in schema.get("required", []):
            if name not in value:
                found.append(f"{where}.{name}: required")
        for name, item in value.items():
            if name in schema.get("properties", {}):
                found += _violations(item, schema["properties"][name], f"{where}.{name}")
            elif schema.get("additionalProperties") is False:
                found.append(f"{where}.{name}: additional property")
    return found


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_pass_the_schema(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert _violations(data, SCHEMA) == []


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_pass_jsonschema_when_installed(path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is optional; the checker above stands in")
    jsonschema.Draft202012Validator(SCHEMA).validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("cache", "block_size", 48),
        ("cache", "block_size", 2048),
        ("model", "head_dim", 30),
        ("model", "head_dim", 520),
        ("cache", "device", "cuda:0\n"),
        ("cache", "device", "gpu"),
        ("cache", "num_blocks", MAX_BLOCKS + 1),
        ("cache", "num_blocks", True),
        ("cache", "swap_space", MAX_BYTES + 1),
        ("cache", "swap_space", "4 parsecs"),
        ("cache", "memory_budget", 1.5),
        ("cache", "dtype", "fp16"),
        ("model", "dtype", "int8"),
        ("model", "sliding_window", 0),
        ("model", "window_pattern", [True, 1]),
        ("attention", "backend", "flashinfer"),
        ("cache", "blok_size", 32),
    ],
)
def test_schema_refuses_what_the_validator_refuses(section: str, field: str, value: object) -> None:
    data = yaml.safe_load(CONFIGS[0].read_text())
    data[section][field] = value
    assert _violations(data, SCHEMA), f"the schema takes {section}.{field}: {value!r}"


def test_schema_states_the_rules() -> None:
    model, cache = DEFS["ModelSection"]["properties"], DEFS["CacheSection"]["properties"]
    assert {k: cache["block_size"][k] for k in ("multipleOf", "minimum", "maximum")} == {
        "multipleOf": 32, "minimum": 32, "maximum": 1024}
    assert {k: model["head_dim"][k] for k in ("multipleOf", "minimum", "maximum")} == {
        "multipleOf": 8, "minimum": 8, "maximum": 512}
    assert cache["device"]["pattern"] == DEVICE_PATTERN
    assert cache["dtype"]["enum"] == list(DTYPES)
    assert model["dtype"]["anyOf"][0]["enum"] == list(COMPUTE_DTYPES)
    assert DEFS["AttentionSection"]["properties"]["backend"]["enum"] == ["auto", *BACKEND_NAMES]
    assert cache["num_blocks"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert cache["swap_space"]["anyOf"][0]["maximum"] == MAX_BYTES
    for name in ("num_layers", "num_heads", "num_kv_heads"):
        assert model[name]["minimum"] == 1 and model[name]["maximum"] >= 1024
    sizes = [o for o in cache["memory_budget"]["anyOf"] + cache["swap_space"]["anyOf"] if o.get("type") == "string"]
    assert sizes and all(o["pattern"] == SIZE_PATTERN for o in sizes)
    assert "(?" not in SIZE_PATTERN  # no inline flags: ECMA-262 has none


def test_every_field_has_its_docstring_as_description() -> None:
    for section in ("ModelSection", "CacheSection", "AttentionSection"):
        for name, field in DEFS[section]["properties"].items():
            assert field.get("description"), f"{section}.{name} has no description"
            assert "\n" not in field["description"]
    assert "2**31 - 1" in DEFS["CacheSection"]["properties"]["num_blocks"]["description"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789. kKmMgGtTiIbBpP\n\u0661", max_size=24))
def test_size_pattern_of_the_schema_and_the_parser_agree(text: str) -> None:
    """What the schema's pattern takes, parse_bytes takes (up to the 1 PiB bound), and back."""
    in_schema = _ecma_search(SIZE_PATTERN, text)
    try:
        parse_bytes(text, maximum=math.inf)  # type: ignore[arg-type]
        parsed = True
    except ValueError:
        parsed = False
    assert in_schema == parsed, text


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("4gib", 4 * 2**30), ("4 GIB", 4 * 2**30), ("512 mib", 512 * 2**20), ("1.5GB", 1_500_000_000),
     ("0.5KiB", 512), ("7b", 7), ("1.1GB", 1_100_000_000)],
)
def test_units_are_case_insensitive_and_exact(text: str, num_bytes: int) -> None:
    assert parse_bytes(text) == num_bytes
    assert _ecma_search(SIZE_PATTERN, text)
