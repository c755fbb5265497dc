"""Paged-attention backends behind one interface.

Importing this package imports no kernel library (triton, flash_attn); backends are loaded
by name through :func:`get_backend`.
"""

from attention.base import AttentionBackend, StepPlan
from attention.capabilities import BACKEND_CAPABILITIES, BackendCapabilities, capabilities_of
from attention.metadata import PAD_BLOCK, AttentionMetadata
from attention.reference import ReferenceBackend
from attention.registry import BackendChoice, available_backends, choose_backend, get_backend

__all__ = [
    "BACKEND_CAPABILITIES",
    "PAD_BLOCK",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "BackendChoice",
    "ReferenceBackend",
    "StepPlan",
    "available_backends",
    "capabilities_of",
    "choose_backend",
    "get_backend",
]
