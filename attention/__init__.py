"""Paged-attention backends behind one interface.

Names are imported lazily: ``import attention`` imports nothing else (no torch, no kernel
library), so the config validator and the CLI start fast; backends are loaded by name through
:func:`get_backend` / :func:`choose_backend`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attention.base import (
        AttentionBackend as AttentionBackend,
    )
    from attention.base import (
        StepPlan as StepPlan,
    )
    from attention.capabilities import (
        BACKENDS as BACKENDS,
    )
    from attention.capabilities import (
        BackendInfo as BackendInfo,
    )
    from attention.capabilities import (
        backend_info as backend_info,
    )
    from attention.dtypes import (
        DTYPES as DTYPES,
    )
    from attention.layer_cache import (
        LayerCache as LayerCache,
    )
    from attention.metadata import (
        PAD_BLOCK as PAD_BLOCK,
    )
    from attention.metadata import (
        PAD_SLOT as PAD_SLOT,
    )
    from attention.metadata import (
        AttentionMetadata as AttentionMetadata,
    )
    from attention.reference import (
        ReferenceBackend as ReferenceBackend,
    )
    from attention.registry import (
        BackendChoice as BackendChoice,
    )
    from attention.registry import (
        available_backends as available_backends,
    )
    from attention.registry import (
        choose_backend as choose_backend,
    )
    from attention.registry import (
        get_backend as get_backend,
    )
    from attention.rotary import (
        RotaryTable as RotaryTable,
    )
    from attention.spec import (
        AttentionSpec as AttentionSpec,
    )
    from attention.staging import (
        DirectStaging as DirectStaging,
    )
    from attention.staging import (
        PlanStaging as PlanStaging,
    )
    from attention.staging import (
        StepCapacity as StepCapacity,
    )

#: Public name -> the module that defines it.
_HOME = {
    "AttentionBackend": "attention.base",
    "StepPlan": "attention.base",
    "BACKENDS": "attention.capabilities",
    "BackendInfo": "attention.capabilities",
    "backend_info": "attention.capabilities",
    "DTYPES": "attention.dtypes",
    "LayerCache": "attention.layer_cache",
    "PAD_BLOCK": "attention.metadata",
    "PAD_SLOT": "attention.metadata",
    "AttentionMetadata": "attention.metadata",
    "ReferenceBackend": "attention.reference",
    "BackendChoice": "attention.registry",
    "available_backends": "attention.registry",
    "choose_backend": "attention.registry",
    "get_backend": "attention.registry",
    "RotaryTable": "attention.rotary",
    "AttentionSpec": "attention.spec",
    "DirectStaging": "attention.staging",
    "PlanStaging": "attention.staging",
    "StepCapacity": "attention.staging",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
