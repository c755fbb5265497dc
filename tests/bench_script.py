"""Loading a benchmark script (``benchmarks/<name>.py``) as a module, for the tests that run
its code path on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(name: str) -> Any:
    """``benchmarks/<name>.py`` executed as the module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up there), with ``benchmarks/`` on ``sys.path`` for the
    ``common`` module the scripts import."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load benchmarks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
