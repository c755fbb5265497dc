"""Tensor parallelism: each rank owns a share of the KV heads; every rank's block manager
makes the same decisions.

| module | what it holds |
| --- | --- |
| ``heads`` | which query and KV heads a rank owns (:class:`TensorParallel`), per-rank specs |
| ``collective`` | the host-side collectives the ranks use (gloo, or one process) |
| ``agreement`` | a per-step digest of each rank's manager decisions, compared across ranks |

The names of :mod:`kvcache.parallel.heads` are also found here (``from kvcache.parallel import
TensorParallel``), as they were when this was one module.
"""

from typing import TYPE_CHECKING

from kvcache.moved import forwarding_getattr

if TYPE_CHECKING:
    from kvcache.parallel.heads import (
        MAX_TP_SIZE as MAX_TP_SIZE,
    )
    from kvcache.parallel.heads import (
        TensorParallel as TensorParallel,
    )
    from kvcache.parallel.heads import (
        rank_spec as rank_spec,
    )

__getattr__ = forwarding_getattr(__name__, "kvcache.parallel.heads")
