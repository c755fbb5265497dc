"""A griffe extension for the API reference: renders the docstrings' own conventions.

The docstrings are free-form text, not Google/NumPy/Sphinx sections. Two conventions would
render badly as plain Markdown, so this extension rewrites them once the package is loaded:

- Sphinx roles (``:class:`~attention.staging.StepCapacity```, ``:meth:`plan```) become
  optional cross-references, resolved in the docstring's own scope (``:meth:`plan``` in a
  class's docstring links to that class's method). A target the reference does not render
  stays plain code, with no warning, so ``mkdocs build --strict`` fails only on real problems.
- Argument lists written as ``name:   meaning`` lines (continuation lines indented) become
  bullet lists, instead of one run-on paragraph.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([\w.]+)(?:\(\))?`")
_ROOTS = ("kvcache", "attention", "examples")
#: ``name: meaning`` / ``a, b: meaning`` at the start of a line (at most 2 spaces in); names
#: are lower case, so labels such as "Default:" or "Note:" stay text.
_FIELD = re.compile(r"^ {0,2}([a-z_][\w.]*(?:, [a-z_][\w.]*)*):\s+(\S.*)$")


def _target(obj: griffe.Object | griffe.Alias, name: str) -> str | None:
    head, _, rest = name.partition(".")
    if head in _ROOTS:
        return name
    try:
        base = obj.resolve(head)
    except Exception:  # a name outside the loaded packages (torch, builtins): no link
        return None
    return f"{base}.{rest}" if rest else base


def _rewrite(obj: griffe.Object | griffe.Alias, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        short, name = match.group(1), match.group(2)
        title = name.rsplit(".", 1)[-1] if short else name
        target = _target(obj, name)
        if target is None:
            return f"`{title}`"
        return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'

    return _ROLE.sub(link, text)


def _field_lists(text: str) -> str:
    """Turn runs of ``name: meaning`` lines into Markdown bullet lists."""
    out: list[str] = []
    item: list[str] | None = None  # the current item's words
    indent = 0
    in_code = False
    for number, line in enumerate(text.splitlines()):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
        field = None if in_code or number == 0 else _FIELD.match(line)  # never the summary line
        if field is not None:
            if item is None and out and out[-1].strip():
                out.append("")  # a list must not continue a paragraph
            if item is not None:
                out.append(" ".join(item))
            item = [f"- `{field.group(1)}`: {field.group(2)}"]
            indent = len(line) - len(line.lstrip())
            continue
        if item is not None and stripped and len(line) - len(line.lstrip()) > indent:
            item.append(stripped)  # a continuation line
            continue
        if item is not None:
            out.append(" ".join(item))
            item = None
            if stripped:
                out.append("")  # the next paragraph is not part of the list
        out.append(line)
    if item is not None:
        out.append(" ".join(item))
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = _field_lists(_rewrite(obj, obj.docstring.value))
            stack.extend(m for m in obj.members.values() if isinstance(m, griffe.Object))
