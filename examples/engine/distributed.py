"""Starting a tensor-parallel group from torchrun's environment.

    torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2            # CPU, gloo
    torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2 --device cuda --config configs/tiny-cuda-256.yaml

torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the rendezvous address) for
each process. Every process is one tensor-parallel rank (no data or pipeline parallelism
here, so the world is the group). On CUDA a rank runs on ``cuda:LOCAL_RANK`` and the model's
all-reduce uses NCCL, with a second, gloo group for host integers (the step digest), so that
exchange never waits for the GPU; on CPU both are one gloo group.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from attention.errors import InvalidArgumentError
from kvcache.parallel.collective import Collective, SingleProcess, TorchDistributed
from kvcache.parallel.heads import TensorParallel

__all__ = ["ParallelRun", "exit_process", "start_parallel", "stop_parallel"]

#: How long a collective may wait for the other ranks before failing (a rank that crashed).
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class ParallelRun:
    """This process's place in the run: its rank, the group's collective, its device."""

    tp: TensorParallel
    collective: Collective
    device: torch.device
    #: "gloo" or "nccl" (None: one process, nothing initialised).
    backend: str | None


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it; 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


#: The example program's module: examples.decode_loop in a checkout, kvcache_examples.decode_loop
#: when installed.
_PROGRAM = f"{(__package__ or 'examples.engine').rpartition('.')[0]}.decode_loop"


def start_parallel(tp_size: int, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelRun:
    """Join the tensor-parallel group of ``tp_size`` ranks torchrun started.

    ``tp_size`` 1 outside torchrun initialises nothing. Otherwise ``tp_size`` must equal
    ``WORLD_SIZE``; a CUDA ``device`` becomes ``cuda:LOCAL_RANK`` (NCCL), a CPU one stays
    (gloo). Raises InvalidArgumentError naming ``--tp`` and the fix.
    """
    world = world_size_from_env()
    if tp_size != world:
        if world == 1:
            raise InvalidArgumentError(
                f"--tp {tp_size}: this is one process; start {tp_size} with "
                f"torchrun --nproc-per-node {tp_size} -m {_PROGRAM} --tp {tp_size}"
            )
        raise InvalidArgumentError(f"--tp {tp_size}: torchrun started {world} processes; pass --tp {world}")
    if world == 1:
        return ParallelRun(TensorParallel(), SingleProcess(), device, None)
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        # NVLink multicast (NVLS) stays off: it needs fabric support these machines may lack.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return ParallelRun(TensorParallel(world, rank), TorchDistributed(None, cpu_group), device, "nccl")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return ParallelRun(TensorParallel(world, rank), TorchDistributed(), device, "gloo")


def stop_parallel(run: ParallelRun, *, synchronize: bool = False) -> None:
    """Leave the group (after the last collective). ``synchronize`` (the ranks' normal end):
    a barrier first, so no rank tears its group down while another still uses it (a rank that
    exited early once made the store-hosting rank abort at exit under CPU load: "terminate
    called without an active exception"). Not after an error: the other ranks may never
    reach it."""
    if run.backend is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            if synchronize:
                dist.barrier()
            dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """A program's last call: leave the process with ``code``. A torchrun rank
    (``WORLD_SIZE`` > 1; its group already left with :func:`stop_parallel`) skips the
    interpreter's shutdown: gloo's worker threads may still drop their last references to a
    collective's tensors then, and a rank that had finished its work aborted ("terminate called
    without an active exception", exit status -6) under CPU load (once in CI's torchrun test,
    2026-12-06, after the fixes of f411323 and 69f796a)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)
