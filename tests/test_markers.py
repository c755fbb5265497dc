"""The GPU suite is ``pytest -m "gpu or kernel"``: ``gpu`` tests need CUDA, ``kernel`` tests run
our kernels wherever they are (on the GPU when CUDA is present, else in Triton's CPU
interpreter). A kernel test module without the ``kernel`` marker would run its kernels on CPU
in CI only and never on a GPU, so every module that picks its device the kernels' way carries
the marker."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent
#: What a module that runs kernels on the kernels' device says: the fixture, the check, or the
#: module constant another kernel test module exports.
KERNEL_DEVICE = re.compile(r"\btriton_device\b|\bkernels_interpreted\b|^DEVICE\s*=|import[^\n]*\bDEVICE\b", re.M)
MARKED = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.kernel\b", re.M)


def kernel_modules() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if KERNEL_DEVICE.search(p.read_text()))


def test_every_kernel_test_module_is_in_the_gpu_suite() -> None:
    modules = kernel_modules()
    assert len(modules) >= 20, [p.name for p in modules]  # the pattern still finds them
    unmarked = [p.name for p in modules if p.name != Path(__file__).name and not MARKED.search(p.read_text())]
    assert not unmarked, f"add 'pytestmark = pytest.mark.kernel' to {unmarked} so that -m 'gpu or kernel' runs them"
