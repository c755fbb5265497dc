"""The package layout: imports point down the layers, and module paths from before the
subpackages still import (the same module object, with a DeprecationWarning naming the new
path)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What each part of kvcache may import from the project (besides itself). The order of the
#: layers is the order of the rows: each imports only parts above it.
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvcache.parallel.heads": ("attention",),
    "kvcache.parallel.collective": ("attention",),
    # kvcache.blocks.groups: the KV-group layout of a model's layers (pure; imports attention
    # only), for the plan's per-group figures.
    "kvcache.config": ("attention", "kvcache.moved", "kvcache.parallel.heads", "kvcache.blocks.groups"),
    "kvcache.blocks": ("attention",),
    "kvcache.memory": ("attention", "kvcache.config", "kvcache.blocks", "kvcache.parallel.heads"),
    "kvcache.step": ("attention", "kvcache.blocks"),
    "kvcache.parallel.agreement": ("attention", "kvcache.blocks", "kvcache.parallel.collective"),
    "kvcache.parallel": ("kvcache.moved",),  # the package's __init__: forwards names lazily
    "kvcache.metrics": ("attention", "kvcache.blocks", "kvcache.memory"),
    "kvcache.setup": ("attention", "kvcache.config", "kvcache.blocks", "kvcache.memory", "kvcache.parallel.heads"),
    "kvcache.cli": ("kvcache.config", "kvcache.parallel.heads"),
    "kvcache.__main__": ("kvcache.cli",),
    "kvcache.moved": (),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_imports(path: Path) -> set[str]:
    """Every project module ``path`` imports (``kvcache``, ``attention``, ``examples``,
    ``benchmarks``), also inside functions and ``TYPE_CHECKING`` blocks."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found.update(n for n in names if n.split(".")[0] in ("kvcache", "attention", "examples", "benchmarks"))
    return found


def _part(module: str) -> str:
    """The most specific key of ALLOWED that ``module`` belongs to."""
    keys = [k for k in ALLOWED if module == k or module.startswith(k + ".")]
    if not keys:
        raise AssertionError(f"{module} is in no layer of ALLOWED: add it to the table in {__file__}")
    return max(keys, key=len)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_kvcache_imports_point_down_the_layers() -> None:
    wrong = []
    for path in sorted((ROOT / "kvcache").rglob("*.py")):
        module = _module_name(path)
        if module == "kvcache":
            continue  # the public face imports everything, lazily
        part = _part(module)
        for name in sorted(_project_imports(path)):
            if not (_within(name, (part,)) or _within(name, ALLOWED[part])):
                wrong.append(f"{module} imports {name} (allowed: {part} itself, {', '.join(ALLOWED[part])})")
    assert not wrong, "\n".join(wrong)


def test_attention_never_imports_kvcache_or_examples() -> None:
    wrong = [
        f"{_module_name(path)} imports {name}"
        for path in sorted((ROOT / "attention").rglob("*.py"))
        for name in _project_imports(path)
        if not name.startswith("attention")
    ]
    assert not wrong, "\n".join(wrong)


def test_examples_never_import_benchmarks() -> None:
    wrong = [
        f"{_module_name(path)} imports {name}"
        for path in sorted((ROOT / "examples").rglob("*.py"))
        for name in _project_imports(path)
        if name.startswith("benchmarks")
    ]
    assert not wrong, "\n".join(wrong)


def test_old_module_paths_import_the_new_module() -> None:
    """Every old path of kvcache and examples, in a fresh interpreter (in this one the old
    names may be imported already): the new module itself, and a warning naming it."""
    code = (
        "import importlib, warnings, kvcache.moved, examples\n"
        "table = {**kvcache.moved.MOVED_MODULES, **examples.MOVED_MODULES}\n"
        "for old, new in table.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    assert module is importlib.import_module(new), (old, module)\n"
        "    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "    assert any(new in m for m in messages), (old, messages)\n"
        "print(len(table))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 25


def test_old_names_of_modules_that_became_packages() -> None:
    from kvcache.config import KVCacheConfig, config_json_schema
    from kvcache.config.schema import KVCacheConfig as Schema
    from kvcache.parallel import MAX_TP_SIZE, TensorParallel
    from kvcache.parallel.heads import TensorParallel as Heads

    assert KVCacheConfig is Schema and TensorParallel is Heads
    assert callable(config_json_schema) and MAX_TP_SIZE > 1
    with pytest.raises(AttributeError, match=r"kvcache\.config.*no_such_name"):
        importlib.import_module("kvcache.config").no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        from kvcache.parallel import no_such_name  # type: ignore[attr-defined]  # noqa: F401


def test_unknown_old_names_still_fail() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvcache.no_such_module")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module("kvcache.blocks.manager")  # new paths never warn
