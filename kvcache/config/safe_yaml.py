"""Parse a config's YAML without letting a hostile document turn against the host.

A config is two levels deep, a few dozen values, with no need for YAML's aliases, so
everything beyond that is refused before it can cost time or memory:

- no aliases (``*name``): a few hundred bytes of nested aliases expand to billions of nodes
  in whatever walks the data; no merge keys (``<<``);
- nesting at most :data:`MAX_DEPTH` levels (a deeper document would exhaust Python's stack in
  the recursive composer), and at most :data:`MAX_NODES` values;
- numbers of at most :data:`MAX_NUMBER_CHARS` characters (no 60,000-digit integers);
- mapping keys that are names (scalars), each given once per mapping.

Numbers are read as people mean them, where YAML 1.1 (PyYAML's dialect) would read them
otherwise: ``1e-3`` and ``1.5e2`` are floats (YAML 1.2's syntax; 1.1 wants ``1.0e-3`` and
takes the rest for text), and a number YAML 1.1 reads in another base (``032``: octal 26;
``1:30``: base 60, 90) is kept as an :class:`AmbiguousNumber`, which every field refuses,
saying what was written and what to write.

The limits are checked on the parser's event stream, which is built without recursion, before
any node tree or Python value exists. Failures raise :class:`InputRefused` with a message and
the line; duplicate keys are returned as problems, so they are reported with the rest.
libyaml's loader is used when present (about 10x faster); the pure-Python one is as safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from attention.errors import ConfigProblem, quote
from kvcache.config.safe_read import MAX_FILE_BYTES, InputRefused, one_line, too_big

__all__ = ["MAX_DEPTH", "MAX_NODES", "MAX_NUMBER_CHARS", "AmbiguousNumber", "YamlDocument", "parse_yaml", "path_part"]

#: Deepest nesting of mappings and lists accepted (a config is 3 levels deep at most).
MAX_DEPTH = 16
#: Most values (scalars, lists, mappings) in one document: a config has a few dozen, or a few
#: thousand with a window_pattern for every layer. Bounds the work per file whatever it holds.
MAX_NODES = 10_000
#: Longest number accepted, in characters.
MAX_NUMBER_CHARS = 40

_MERGE_TAG = "tag:yaml.org,2002:merge"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)


@dataclass
class YamlDocument:
    """A parsed document: the Python value, the line of every key path, and the problems that
    do not stop validation (duplicate keys)."""

    data: object
    lines: dict[str, int] = field(default_factory=dict)
    problems: list[ConfigProblem] = field(default_factory=list)


def path_part(key: object) -> str:
    """One part of a dotted field path: a plain name or index as it is, anything else quoted
    and cut short (a key can be any scalar, of any length)."""
    if isinstance(key, str) and _NAME.fullmatch(key):
        return key
    if isinstance(key, int) and not isinstance(key, bool) and -(10**12) < key < 10**12:
        return str(key)
    return quote(key)


class _SafeConstruction:
    """Value construction that raises only YAMLError (a mixin for the safe loaders)."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)  # type: ignore[misc]
        except yaml.YAMLError:
            raise
        except Exception as err:  # a timestamp out of range, ...: a value, not a bug
            raise ConstructorError(None, None, f"this value cannot be read: {one_line(err)}", node.start_mark) from None


@dataclass(frozen=True, repr=False)
class AmbiguousNumber:
    """A number YAML 1.1 reads in another base than people mean: ``text`` as written (``032``,
    ``1:30``) and ``reading``, YAML 1.1's value (26, 90). It stands in the data for the number,
    so validation refuses the field with :meth:`message`; its repr is ``text``'s."""

    text: str
    reading: int | float

    def __repr__(self) -> str:
        return repr(self.text)

    def message(self, text_expected: bool = False) -> str:
        """Why the value is refused and the fix (``text_expected``: the field takes text, so the
        fix is to quote it)."""
        if ":" in self.text:
            why = f"{self.text!r} is a base-60 number to YAML 1.1, which reads it as {self.reading}"
            fix = f"write {self.reading} if that is meant"
        else:
            why = f"{self.text!r} has a leading zero (YAML reads it as octal {self.reading})"
            fix = f"write {int(self.text.replace('_', ''), 10)}"
        return f"{why}; {f'quote it for text: {self.text!r}' if text_expected else fix}"


#: YAML 1.1's octal integers: a leading zero and more digits.
_OCTAL = re.compile(r"[-+]?0[0-7_]+", re.ASCII)
#: YAML 1.2's floats with an exponent that YAML 1.1 takes for text (1e-3, 5E-3, 1.5e2, 3e1).
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$", re.ASCII)


def _bounded_number(loader: Any, node: yaml.ScalarNode, kind: str) -> Any:
    if len(node.value) > MAX_NUMBER_CHARS:
        raise ConstructorError(
            None,
            None,
            f"a number of {len(node.value):,} characters is refused; numbers in a config have at most "
            f"{MAX_NUMBER_CHARS}",
            node.start_mark,
        )
    value = getattr(yaml.SafeLoader, f"construct_yaml_{kind}")(loader, node)
    if ":" in node.value or (kind == "int" and _OCTAL.fullmatch(node.value)):
        return AmbiguousNumber(node.value, value)
    return value


class _PyLoader(_SafeConstruction, yaml.SafeLoader):
    """The pure-Python safe loader, with bounded numbers."""


_LOADERS: list[Any] = [_PyLoader]
if hasattr(yaml, "CSafeLoader"):

    class _CLoader(_SafeConstruction, yaml.CSafeLoader):
        """libyaml's safe loader (about 10x faster), with bounded numbers."""

    _LOADERS.insert(0, _CLoader)

for _cls in _LOADERS:
    _cls.add_constructor("tag:yaml.org,2002:int", lambda loader, node: _bounded_number(loader, node, "int"))
    _cls.add_constructor("tag:yaml.org,2002:float", lambda loader, node: _bounded_number(loader, node, "float"))
    # Tried after YAML 1.1's own resolvers: only what they take for text becomes a float.
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))

#: The loader in use: libyaml's when present. Both are tested.
_Loader: Any = _LOADERS[0]


def parse_yaml(text: str) -> YamlDocument:
    """Parse one YAML document. Raises InputRefused for what cannot be parsed safely."""
    if len(text) > MAX_FILE_BYTES:
        raise InputRefused(too_big(len(text.encode("utf-8", "surrogatepass"))))
    try:
        _check_events(text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return YamlDocument(None)
            document = YamlDocument(None)
            _walk(loader, node, "", document)
            document.data = loader.construct_document(node)
            return document
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise _syntax_refusal(err, text) from None
    except UnicodeError as err:  # a lone surrogate libyaml cannot encode
        raise InputRefused(f"is not valid text ({one_line(err)}); save it as UTF-8") from None


def _check_events(text: str) -> None:
    """Refuse aliases, deep nesting and too many values, reading the event stream (no recursion,
    no values built)."""
    loader = _Loader(text)
    depth = 0
    nodes = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.NodeEvent):
                nodes += 1
                if nodes > MAX_NODES:
                    raise InputRefused(
                        f"holds more than {MAX_NODES:,} values; a config has a few dozen (a few thousand "
                        f"with a window_pattern for every layer)",
                        _line_of(event.start_mark),
                    )
            if isinstance(event, yaml.AliasEvent):
                raise InputRefused(
                    f"the YAML alias *{path_part(event.anchor)} is refused: a config needs no aliases "
                    f"(&anchor / *alias); write the value out",
                    _line_of(event.start_mark),
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise InputRefused(
                        f"nests deeper than {MAX_DEPTH} levels; a config is sections of keys and values "
                        f"(3 levels at most)",
                        _line_of(event.start_mark),
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    finally:
        loader.dispose()


def _line_of(mark: Any) -> int | None:
    """The 1-based line of a YAML mark (None when the parser gave none)."""
    return None if mark is None else int(mark.line) + 1


def _walk(loader: Any, node: yaml.Node, prefix: str, document: YamlDocument) -> None:
    """Record the line of every key path and refuse keys that are not names; duplicate keys
    become problems. Recursion is bounded by MAX_DEPTH (checked on the events first)."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = f"{prefix}.{index}" if prefix else str(index)
            document.lines[path] = item.start_mark.line + 1
            _walk(loader, item, path, document)
    elif isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            key = _key(loader, key_node)
            path = f"{prefix}.{path_part(key)}" if prefix else path_part(key)
            if key in seen:
                where = f"lines {seen[key]} and {line}" if seen[key] != line else f"both on line {line}"
                document.problems.append(ConfigProblem(path, f"is given twice ({where}); keep one of them"))
            seen[key] = line
            document.lines[path] = line  # the last one wins, in the data as here
            _walk(loader, value_node, path, document)


def _key(loader: Any, node: yaml.Node) -> object:
    line = node.start_mark.line + 1
    if node.tag == _MERGE_TAG:
        raise InputRefused("the merge key << is refused: a config needs no merges; write the keys out", line)
    if not isinstance(node, yaml.ScalarNode):
        raise InputRefused("a key must be a name, not a list or a mapping; write `name: value`", line)
    key = loader.construct_object(node)
    try:
        hash(key)
    except TypeError:
        raise InputRefused("a key must be a name; write `name: value`", line) from None
    return key


def _syntax_refusal(err: yaml.YAMLError, text: str) -> InputRefused:
    if isinstance(err, yaml.reader.ReaderError):
        char = f" (#x{err.character:04x})" if isinstance(err.character, int) else ""
        line = text[: max(0, err.position)].count("\n") + 1 if isinstance(err.position, int) else None
        return InputRefused(f"holds a character YAML does not allow{char}: {one_line(err.reason)}; remove it", line)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    detail = one_line(", ".join(str(p) for p in parts if p) or err)
    what, fix = (
        ("has a value that is refused", "fix the value there")
        if isinstance(err, ConstructorError)
        else ("is not valid YAML", "fix the syntax there")
    )
    if mark is None:
        return InputRefused(f"{what}: {detail}; {fix}")
    return InputRefused(f"{what} (column {mark.column + 1}): {detail}; {fix}", mark.line + 1)
