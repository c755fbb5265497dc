"""Shared pytest setup.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, i.e. when the kernel module is imported, so
it is set here, at import time, before any test module imports a kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device() -> str:
    """Where the Triton backend's tests put their tensors: CPU when the kernels run in the
    interpreter, else the GPU (so the interpreter tests also pass on a CUDA machine)."""
    from attention.triton_kernels import kernels_interpreted

    return "cpu" if kernels_interpreted() else "cuda"


def _share_the_cores() -> None:
    """Under pytest-xdist each worker's torch takes its share of the cores: by default every
    worker's intra-op pool is as large as the machine, and N workers oversubscribe it N times."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores()
