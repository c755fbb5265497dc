"""The README's "Embedding in a serving engine" example runs as written, so it cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Embedding in a serving engine"


def _first_python_block(markdown: str, heading: str) -> str:
    """The first ```python block between ``heading`` and the next ``## `` heading."""
    start = markdown.index(heading) + len(heading)
    section = re.split(r"^## ", markdown[start:], maxsplit=1, flags=re.MULTILINE)[0]
    match = re.search(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    assert match is not None, f"no ```python block under {heading!r} in README.md"
    return match.group(1)


def test_readme_embedding_example_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    code = _first_python_block((ROOT / "README.md").read_text(encoding="utf-8"), HEADING)
    monkeypatch.chdir(ROOT)  # the example loads configs/tiny-cpu.yaml by relative path
    exec(compile(code, "README.md: " + HEADING, "exec"), {"__name__": "readme_example"})
