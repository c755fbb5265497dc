"""Load a cache config from YAML, turning every failure into messages a person can act on.

Each message names the file (and line where known), the dotted field path, the value (a
short excerpt), why it is refused, and a fix. Every problem in a file is reported in one
pass: per-field problems, duplicate keys, and cross-field ones (pydantic runs a model validator
only when every field is valid, so the cross-field rules of :mod:`kvcache.config.rules` are run
here again on the raw values). Whatever a file holds, :func:`load_config` and
:func:`parse_config` raise :class:`ConfigError` and nothing else.

A bare name such as ``"tiny-cpu"`` (no path separator, no ``.yaml``) names a config shipped
with the package (:mod:`kvcache.config.bundled`); anything else is a path.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from attention.dtypes import DTYPES
from attention.errors import ArgumentTypeError, ConfigError, ConfigProblem, quote
from kvcache.config.bundled import bundled_config_dir, bundled_configs, is_bare_name
from kvcache.config.rules import cross_field_problems
from kvcache.config.safe_read import InputRefused, one_line, printable, read_config_text
from kvcache.config.safe_yaml import AmbiguousNumber, parse_yaml, path_part
from kvcache.config.schema import ConfigProblems, KVCacheConfig

__all__ = ["ConfigError", "bundled_config_dir", "bundled_configs", "load_config", "parse_config"]

#: At most this many problems are listed for one file (a hostile file can have thousands).
MAX_PROBLEMS = 50

# Names people write, mapped to the ones the config takes (dtype aliases from the dtype table).
_ALIASES = {alias: info.name for info in DTYPES.values() for alias in info.aliases}
_ALIASES.update({"flash-attn": "flash_attn", "flashattn": "flash_attn"})
_RANGE_WORDS = {
    "greater_than_equal": "at least",
    "greater_than": "above",
    "less_than_equal": "at most",
    "less_than": "below",
}
_TYPE_WORDS = {
    "int": "a whole number",
    "float": "a number",
    "bool": "true or false",
    "string": "text",
    "tuple": "a list such as [true, false]",
    "list": "a list",
}

#: What a document that is not a mapping holds, by its Python type's name.
_KIND_WORDS = {"list": "a list", "str": "text", "int": "a number", "float": "a number", "bool": "true or false"}
_SECTION_KINDS = ("model_type", "model_attributes_type", "dict_type")
#: What to write for a text field left empty, by field name.
_TEXT_FIXES = {"disk_cache_dir": "a directory path such as /mnt/nvme/kvcache"}
#: A whole number with a leading zero that YAML 1.1 reads as text (a digit 8 or 9: not octal).
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]{1,39}", re.ASCII)


# --- locating a config -------------------------------------------------------------------------


def _locate(path: str | os.PathLike[str]) -> tuple[str | os.PathLike[str], str]:
    """The file to read for ``path`` and the name to print for it."""
    if is_bare_name(path):
        name = str(path)
        bundled = bundled_configs()
        if name in bundled:
            return bundled[name], printable(str(bundled[name]))
        if not os.path.lexists(name):
            known = ", ".join(bundled) or "none"
            close = difflib.get_close_matches(name, list(bundled), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                printable(name),
                [
                    ConfigProblem(
                        "",
                        f"is neither a file nor a bundled config; {hint}check the path, or name a "
                        f"bundled config ({known}; `kvcache list-configs`)",
                    )
                ],
            )
    return path, printable(os.fsdecode(path))


# --- loading -----------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str]) -> KVCacheConfig:
    """Read and validate a config: a YAML file's path, or the bare name of a bundled config
    (``load_config("tiny-cpu")``). Raises ConfigError listing every problem, and nothing else
    (ArgumentTypeError when ``path`` is not a str or path: a caller's bug)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path: expected a str or a path, got {type(path).__name__} {quote(path)}")
    file, source = _locate(path)
    try:
        text = read_config_text(file)
    except InputRefused as refused:
        raise ConfigError(source, [ConfigProblem("", refused.message)], _line(refused)) from None
    return parse_config(text, source=source)


def parse_config(text: str, source: str = "<string>") -> KVCacheConfig:
    """Validate YAML text. Raises ConfigError listing every problem, and nothing else
    (ArgumentTypeError when ``text`` is not a str: a caller's bug, not the text's)."""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"text: expected the YAML as str, got {type(text).__name__}; decode it first")
    try:
        return _parse(text, source)
    except ConfigError:
        raise
    except Exception as err:  # the last resort: a bug of ours must not become a traceback
        raise ConfigError(
            source,
            [
                ConfigProblem(
                    "",
                    f"could not be checked ({type(err).__name__}: {one_line(err)}); this is a bug "
                    f"in kvcache: please report it with the file",
                )
            ],
        ) from err


def _parse(text: str, source: str) -> KVCacheConfig:
    try:
        document = parse_yaml(text)
    except InputRefused as refused:
        raise ConfigError(source, [ConfigProblem("", refused.message)], _line(refused)) from None
    data = document.data
    if data is None:
        raise ConfigError(source, [ConfigProblem("", "is empty; it needs the sections model, cache and attention")])
    if not isinstance(data, dict):
        raise ConfigError(
            source,
            [
                ConfigProblem(
                    "",
                    f"holds {_KIND_WORDS.get(type(data).__name__, 'a single value')}, not a mapping; write `model:`, "
                    "`cache:` and `attention:` sections at the top level",
                )
            ],
        )
    problems = list(document.problems)
    config = None
    try:
        config = KVCacheConfig.model_validate(data)
    except ValidationError as err:
        per_field, cross_field = _problems_from(err)
        # The model validator ran only if every field passed; else run its rules on the raw values.
        problems += per_field + (cross_field or cross_field_problems(_raw_values(data)))
    if problems or config is None:
        raise _error(source, problems, document.lines)
    return config


def _line(refused: InputRefused) -> dict[str, int] | None:
    """A file-level problem's line, in the form ConfigError reads (the path "" is the file)."""
    return None if refused.line is None else {"": refused.line}


def _error(source: str, problems: list[ConfigProblem], lines: dict[str, int]) -> ConfigError:
    """The ConfigError for ``problems`` (duplicates dropped), listing at most MAX_PROBLEMS of
    them, first by line."""
    error = ConfigError(source, list(dict.fromkeys(problems)), lines)
    if len(error.problems) <= MAX_PROBLEMS:
        return error
    header = ConfigProblem("", f"has {len(error.problems)} problems; the first {MAX_PROBLEMS} by line follow")
    return ConfigError(source, [header, *error.problems[:MAX_PROBLEMS]], lines)


# --- pydantic errors -> problems ---------------------------------------------------------------


def _problems_from(err: ValidationError) -> tuple[list[ConfigProblem], list[ConfigProblem]]:
    """The per-field problems of ``err``, and the cross-field ones its model validator raised."""
    per_field: list[ConfigProblem] = []
    cross_field: list[ConfigProblem] = []
    for e in err.errors(include_url=False):
        cause = e.get("ctx", {}).get("error")
        if isinstance(cause, ConfigProblems):
            cross_field += cause.problems
            continue
        loc = list(e["loc"])
        per_field.append(ConfigProblem(".".join(path_part(part) for part in loc), _message(e, loc)))
    return per_field, cross_field


def _raw_values(data: dict[Any, Any]) -> dict[str, object]:
    """Dotted path -> raw value (or default) for each field of each section that is a mapping
    (or absent with a default), as :func:`cross_field_problems` reads them."""
    values: dict[str, object] = {}
    for name, section_field in KVCacheConfig.model_fields.items():
        section_type = section_field.annotation
        if not (isinstance(section_type, type) and issubclass(section_type, BaseModel)):
            continue
        raw = data.get(name, {} if not section_field.is_required() else None)
        if not isinstance(raw, dict):
            continue
        for field, info in section_type.model_fields.items():
            if field in raw:
                values[f"{name}.{field}"] = raw[field]
            elif not info.is_required():
                values[f"{name}.{field}"] = info.get_default(call_default_factory=True)
    return values


def _message(e: Any, loc: list[Any]) -> str:
    kind = e["type"]
    value = e.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "missing":
        return "is required; add it"
    if isinstance(value, AmbiguousNumber) and kind not in _SECTION_KINDS:
        return value.message(text_expected=kind == "string_type")
    if kind == "value_error":
        return str(e["msg"]).removeprefix("Value error, ")
    if kind == "literal_error":
        return _not_one_of(value, e["ctx"]["expected"])
    if kind in _RANGE_WORDS:
        bound = next(iter(e["ctx"].values()))
        return f"{quote(value)} is out of range; it must be {_RANGE_WORDS[kind]} {bound}"
    if kind == "too_long":
        return f"has {len(value)} entries; at most {e['ctx']['max_length']} (one per layer)"
    if kind == "invalid_key":
        return f"{quote(value)} is not a key name; write names such as model, cache, attention"
    if kind in _SECTION_KINDS:
        return f"{quote(value)} is not a section; write it as a mapping of keys to values"
    if kind == "finite_number":
        return f"{quote(value)} is not a finite number; write a number such as 1.0"
    if kind == "string_too_short":
        return f"{quote(value)} is empty; write {_TEXT_FIXES.get(str(loc[-1]), 'some text')}, or remove the key"
    if kind == "string_too_long":
        return f"is {len(value):,} characters; at most {e['ctx']['max_length']:,}"
    if kind == "int_type" and isinstance(value, str) and _LEADING_ZERO.fullmatch(value):
        return f"{quote(value)} has a leading zero, so YAML reads it as text; write {int(value, 10)}"
    if kind.endswith("_type") and kind.split("_")[0] in _TYPE_WORDS:
        expected = _TYPE_WORDS[kind.split("_")[0]]
        return f"{quote(value)} is not {expected}; write {expected}"
    return f"{quote(value)}: {e['msg']}"


def _unknown_key(loc: list[Any]) -> str:
    import difflib  # only on this error path: it is slow to import

    fields = _fields_at(loc[:-1])
    key = loc[-1]
    close = difflib.get_close_matches(key, fields, n=1) if isinstance(key, str) and len(key) <= 64 else []
    hint = f"did you mean {close[0]}?" if close else f"known keys here: {', '.join(fields)}"
    return f"unknown key; {hint}"


def _not_one_of(value: object, allowed: str) -> str:
    """Not one of ``allowed``, with the name meant when there is one: the same name in another
    case (BFloat16), an alias (bf16), a near miss (flash_atn). A cache-only dtype (fp8, int8)
    where a compute dtype is wanted (model.dtype) is sent to cache.dtype instead."""
    import difflib

    choices = re.findall(r"'([^']*)'", allowed)
    text = f"{quote(value)} is not one of {allowed}"
    if not (isinstance(value, str) and len(value) <= 64):
        return text
    lowered = value.lower()
    name = lowered if lowered in choices or lowered in DTYPES else _ALIASES.get(lowered)
    if name is not None and name not in choices and name in DTYPES and DTYPES[name].cache_only:
        return (
            f"{text}: {name} is a storage format for the KV cache only, which the model cannot compute in; "
            f"set it as cache.dtype, and model.dtype to one of these"
        )
    guess = name if name in choices else next(iter(difflib.get_close_matches(lowered, choices, n=1)), None)
    return f"{text}; did you mean {guess}?" if guess else text


def _fields_at(loc: Iterable[Any]) -> list[str]:
    model: type[BaseModel] = KVCacheConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
