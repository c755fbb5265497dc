"""The README's embedding example, the embedding guide (docs/embedding.md) and every other
page's Python blocks run as written, from a directory outside the repository, so none can go
stale.

A page's ```python blocks run in order as one script, in a subprocess whose working directory
is a temporary directory (nothing may depend on the repository being the working directory);
the package is importable through PYTHONPATH, as from an installed venv. A block preceded by
an HTML comment ``<!-- not run: why -->`` is shown, not run (it needs a GPU or a checkpoint).
Script lines keep their Markdown line numbers, so a traceback points into the page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run\b.*?-->\s*$")


def python_blocks(markdown: str) -> list[tuple[int, str, bool]]:
    """(first line number, code, runs) of each ```python block, in order."""
    blocks = []
    for match in FENCE.finditer(markdown):
        before = markdown[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        first = markdown.count("\n", 0, match.start(1)) + 1
        blocks.append((first, match.group(1), NOT_RUN.search(before) is None))
    return blocks


def script_of(markdown: str) -> str:
    """The runnable blocks as one script, each at its own line numbers of the page."""
    lines: list[str] = []
    for first, code, runs in python_blocks(markdown):
        if runs:
            lines += [""] * (first - 1 - len(lines))
            lines += code.splitlines()
    return "\n".join(lines) + "\n"


def run_page(path: Path, tmp_path: Path) -> str:
    script = tmp_path / (path.stem + "_page.py")
    script.write_text(script_of(path.read_text(encoding="utf-8")), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = child_pythonpath(ROOT)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    where = f"{path.relative_to(ROOT)} (lines as in the page)"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def test_python_blocks_are_found() -> None:
    page = "text\n\n```python\nprint(1)\n```\n\n<!-- not run: needs CUDA -->\n```python\ncuda()\n```\n"
    assert python_blocks(page) == [(4, "print(1)\n", True), (9, "cuda()\n", False)]
    assert script_of(page).splitlines()[3] == "print(1)"


def test_readme_embedding_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert any(runs for _, _, runs in python_blocks(readme)), "README.md has no runnable ```python block"
    out = run_page(ROOT / "README.md", tmp_path)
    assert "backend: reference" in out, out


def test_embedding_guide_runs(tmp_path: Path) -> None:
    out = run_page(ROOT / "docs" / "embedding.md", tmp_path)
    for expected in (
        "backend: reference (set in the config)",
        "already cached",
        "MetadataError: metadata checked on the device",
        "preemptions: 2 (recompute 1, swap 1)",
    ):
        assert expected in out, f"{expected!r} not in the guide's output:\n{out}"


PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
#: The other pages with runnable blocks (backends.md, errors.md, ...).
OTHER_PAGES = [
    page
    for page in PAGES
    if page not in ("README.md", "docs/embedding.md")
    and any(runs for _, _, runs in python_blocks((ROOT / page).read_text(encoding="utf-8")))
]


@pytest.mark.parametrize("page", OTHER_PAGES)
def test_other_pages_python_blocks_run(page: str, tmp_path: Path) -> None:
    run_page(ROOT / page, tmp_path)


@pytest.mark.parametrize("page", PAGES)
def test_not_run_blocks_say_why(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    for comment in re.findall(r"<!--\s*not run\b(.*?)-->", text):
        assert comment.strip(" :"), f"{page}: a 'not run' block must say why"
