"""Old module paths keep working after ``kvcache/`` was split into subpackages.

``kvcache`` was one folder of modules until the block core, the config, the step, memory and
parallelism got a subpackage each. Code that imports an old path (``kvcache.manager``) gets the
module that now lives at the new one (``kvcache.blocks.manager``): the same module object
under both names, so classes and ``isinstance`` agree, with a DeprecationWarning naming the new
path. ``kvcache.config`` and ``kvcache.parallel`` became packages of the same name; they hand
out the names their old module defined (:func:`forwarding_getattr`).

Prefer the names ``kvcache`` itself exports (``from kvcache import BlockManager``): they are
the public face and do not move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "forwarding_getattr", "install"]

#: Old dotted module name -> where that module lives now.
MOVED_MODULES: dict[str, str] = {
    "kvcache.config_rules": "kvcache.config.rules",
    **{f"kvcache.{m}": f"kvcache.config.{m}" for m in ("loading", "safe_yaml", "safe_read", "bundled", "sizes")},
    "kvcache.planning": "kvcache.config.planning",
    **{
        f"kvcache.{m}": f"kvcache.blocks.{m}"
        for m in (
            "allocator",
            "free_queue",
            "manager",
            "sequence",
            "holds",
            "tokens",
            "rows",
            "integrity",
            "prefix_cache",
        )
    },
    **{f"kvcache.{m}": f"kvcache.step.{m}" for m in ("builder", "graphs")},
    **{f"kvcache.{m}": f"kvcache.memory.{m}" for m in ("cache_tensors", "swap", "preemption")},
    **{f"kvcache.{m}": f"kvcache.parallel.{m}" for m in ("agreement", "collective")},
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module already at its new one."""

    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import from there (or from kvcache)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its new name."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of one table; every other name is left to the other finders."""

    def __init__(self, table: Mapping[str, str]):
        self.table = table

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new_name = self.table.get(fullname)
        if new_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new_name))


def install(table: Mapping[str, str] = MOVED_MODULES) -> None:
    """Make the old names of ``table`` (old dotted name -> new one) import, once per table. The
    finder goes last on ``sys.meta_path``: only names nothing else finds reach it."""
    if not any(isinstance(finder, _MovedFinder) and finder.table is table for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder(table))


def forwarding_getattr(package: str, home: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``, which replaced a module of the same name whose
    code moved to ``home``: the old module's names are found there, imported on first use."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return getattr(importlib.import_module(home), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
