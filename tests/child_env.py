"""The import path a test's child process gets: the directories it names first, then the
parent's PYTHONPATH entries other than this checkout. Those hold what the project needs but
the interpreter lacks (on the GPU machine, pydantic comes from the staged extras in
/tmp/site, put on PYTHONPATH by .device-extras/activate.sh), so a child that must import the
project from one place still finds its dependencies."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath(*first: str | Path) -> str:
    inherited = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT
    ]
    return os.pathsep.join([*(str(p) for p in first), *inherited])
