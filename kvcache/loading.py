"""Load a cache config from YAML, turning every failure into messages a person can act on.

Each message names the file (and line where known), the dotted field path, the value, why it
is refused, and a fix. All problems in a file are reported together.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from attention.dtypes import DTYPES
from attention.errors import ConfigError, ConfigProblem
from kvcache.config import ConfigProblems, KVCacheConfig

__all__ = ["ConfigError", "load_config", "parse_config"]

# Names people write, mapped to the ones the config takes (dtype aliases from the dtype table).
_ALIASES = {alias: info.name for info in DTYPES.values() for alias in info.aliases}
_ALIASES.update({"flash-attn": "flash_attn", "flashattn": "flash_attn"})


def load_config(path: str | Path) -> KVCacheConfig:
    """Read and validate a YAML config file. Raises ConfigError listing every problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, [ConfigProblem("", "no such file; check the path")]) from None
    except IsADirectoryError:
        raise ConfigError(source, [ConfigProblem("", "is a directory; give a .yaml file")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(source, [ConfigProblem("", f"cannot be read: {err}")]) from None
    return parse_config(text, source=source)


def parse_config(text: str, source: str = "<string>") -> KVCacheConfig:
    """Validate YAML text. Raises ConfigError listing every problem."""
    try:
        data = yaml.safe_load(text)
        lines = _field_lines(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(
            source, [ConfigProblem("", f"is not valid YAML{where}: {problem}; fix the syntax there")]
        ) from None
    if data is None:
        raise ConfigError(
            source, [ConfigProblem("", "is empty; it needs the sections model, cache and attention")]
        )
    if not isinstance(data, dict):
        raise ConfigError(
            source,
            [ConfigProblem("", f"holds a {type(data).__name__}, not a mapping; write `model:`, "
                               "`cache:` and `attention:` sections at the top level")],
        )
    try:
        return KVCacheConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(source, list(_problems_from(err, data)), lines) from None


def _problems_from(err: ValidationError, data: dict[str, Any]) -> Iterable[ConfigProblem]:
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        path = ".".join(loc)
        cause = e.get("ctx", {}).get("error")
        if isinstance(cause, ConfigProblems):
            for p in cause.problems:
                yield ConfigProblem(f"{path}.{p.path}" if path else p.path, p.message)
            continue
        yield ConfigProblem(path, _message(e, loc, data))


def _message(e: Any, loc: list[str], data: dict[str, Any]) -> str:
    kind = e["type"]
    value = e.get("input")
    if kind == "value_error":
        return str(e["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], fields, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known keys here: {', '.join(fields)}"
        return f"unknown key; {hint}"
    if kind == "missing":
        return "is required; add it"
    if kind == "literal_error":
        allowed = e["ctx"]["expected"]
        choices = re.findall(r"'([^']*)'", allowed)
        guess = _ALIASES.get(str(value).lower()) or next(
            iter(difflib.get_close_matches(str(value), choices, n=1)), None
        )
        hint = f"; did you mean {guess}?" if guess else ""
        return f"{value!r} is not one of {allowed}{hint}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(e["ctx"].values()))
        relation = {"greater_than_equal": "at least", "greater_than": "above",
                    "less_than_equal": "at most", "less_than": "below"}[kind]
        return f"{value!r} is out of range; it must be {relation} {bound}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{value!r} is not a section; write it as a mapping of keys to values"
    if kind.startswith(("int_", "float_", "bool_", "string_")) and kind.endswith("_type"):
        expected = {"int": "a whole number", "float": "a number", "bool": "true or false",
                    "string": "text"}[kind.split("_")[0]]
        return f"{value!r} is not {expected}; write {expected}"
    return f"{value!r}: {e['msg']}"


def _fields_at(loc: list[str]) -> list[str]:
    model: type[BaseModel] = KVCacheConfig
    for part in loc:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _field_lines(text: str) -> dict[str, int]:
    """Map each dotted key path in the YAML to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = f"{prefix}.{key.value}" if prefix else str(key.value)
                lines[path] = key.start_mark.line + 1
                walk(value, path)

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return lines
