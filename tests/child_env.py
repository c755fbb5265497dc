"""The import path a test's child process gets: the directories it names first, then the
parent's PYTHONPATH entries other than this checkout. Those hold what the project needs but
the interpreter lacks (on the GPU machine, pydantic comes from the staged extras in
/tmp/site, put on PYTHONPATH by .device-extras/activate.sh), so a child that must import the
project from one place still finds its dependencies. Also the runner of the ahead-of-time
kernel compiles, which need a fresh interpreter without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath(*first: str | Path) -> str:
    inherited = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT
    ]
    return os.pathsep.join([*(str(p) for p in first), *inherited])


def compile_report(script: str) -> dict[str, Any]:
    """Run ``script`` (which compiles kernels ahead of time and prints a JSON report last) in
    a fresh interpreter without TRITON_INTERPRET, the checkout first on its path; return the
    report. Skips when Triton has no bundled ptxas here; fails with the child's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip(f"triton has no bundled ptxas here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
