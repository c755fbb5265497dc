"""The interface every paged-attention backend implements.

Plan once per step, run once per layer: :meth:`AttentionBackend.plan` reads the step's
:class:`~attention.metadata.AttentionMetadata` once; :meth:`write_kv` and :meth:`attend` are
then called for every layer with that layer's cache tensors. Both check their tensor
arguments (shape, dtype, device, and the backend's declared capabilities) before any kernel
runs; the checks read only shapes and host scalars, never device data, so they cost no sync.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from attention.capabilities import BackendCapabilities, capabilities_of
from attention.checks import check_tensor
from attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "StepPlan"]

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class StepPlan:
    """What a backend derived from one step's metadata; reused by every layer.
    Backends subclass it to carry their own derived values (split counts, varlen indices)."""

    metadata: AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over K/V caches laid out ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Subclasses set ``name`` (a key of the capability table) and implement ``_write_kv`` and
    ``_attend``; they may override ``_plan``.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        #: (block_size, head_dim, dtype, device type) of caches already checked against the
        #: capabilities, so the per-layer path skips that check.
        self._accepted_caches: set[tuple[object, ...]] = set()

    @property
    def capabilities(self) -> BackendCapabilities:
        return capabilities_of(self.name)

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        """Shape of one layer's K (and of its V) cache tensor."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def plan(self, metadata: AttentionMetadata) -> StepPlan:
        """Prepare one step. Checks the metadata's dtypes and shapes; raises ValueError."""
        metadata.check()
        return self._plan(metadata)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter new tokens' K/V into their cache slots.

        key, value:       [num_tokens, num_kv_heads, head_dim], the cache's dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        slot_mapping:     int64 [num_tokens]; token t goes to slot ``slot_mapping[t]``
                          (block ``slot // block_size``, offset ``slot % block_size``);
                          entries of -1 are skipped. Every other slot is left untouched.
        """
        _, _, kvh, d = self._check_caches(k_cache, v_cache)
        t = slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) else None
        for name, x in (("key", key), ("value", value)):
            check_tensor(name, x, shape=(t, kvh, d), dtype=k_cache.dtype, device=k_cache.device)
        check_tensor("slot_mapping", slot_mapping, shape=(None,), dtype=torch.int64, device=k_cache.device)
        self._write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
        softmax_scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's new tokens over paged K/V.

        query: [num_tokens, num_heads, head_dim], the cache's dtype; num_heads a multiple of
               num_kv_heads (query head h reads KV head ``h // (num_heads // num_kv_heads)``).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding
               this step's new K/V (call ``write_kv`` first).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        out:   optional [num_tokens, num_heads, head_dim] to write into.
        Returns [num_tokens, num_heads, head_dim]. Rows past the real tokens (padding) are
        unspecified.
        """
        meta = plan.metadata
        _, bs, kvh, d = self._check_caches(k_cache, v_cache)
        if bs != meta.block_size:
            raise ValueError(
                f"k_cache: block_size {bs} differs from the metadata's block_size "
                f"{meta.block_size}; build the metadata from the manager that owns this cache"
            )
        check_tensor("query", query, shape=(meta.num_tokens, None, d), dtype=k_cache.dtype, device=k_cache.device)
        h = query.shape[1]
        if h % kvh != 0:
            raise ValueError(f"query: {h} heads is not a multiple of the cache's {kvh} KV heads")
        if out is not None:
            check_tensor("out", out, shape=tuple(query.shape), dtype=query.dtype, device=query.device)
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
        if not scale > 0:
            raise ValueError(f"softmax_scale: {softmax_scale} must be positive")
        return self._attend(query, k_cache, v_cache, plan, scale, out)

    # ---- for subclasses ----------------------------------------------------------------

    def _plan(self, metadata: AttentionMetadata) -> StepPlan:
        return StepPlan(metadata)

    @abstractmethod
    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abstractmethod
    def _attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def _check_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
        check_tensor("k_cache", k_cache, shape=(None, None, None, None))
        n, bs, kvh, d = k_cache.shape
        check_tensor("v_cache", v_cache, shape=(n, bs, kvh, d), dtype=k_cache.dtype, device=k_cache.device)
        # Every layer of every step passes caches of one shape: check the capabilities once.
        key = (bs, d, k_cache.dtype, k_cache.device.type)
        if key not in self._accepted_caches:
            self._check_capabilities(k_cache)
            self._accepted_caches.add(key)
        if not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError("k_cache/v_cache: expected contiguous tensors (allocate them with kvcache)")
        return n, bs, kvh, d

    def _check_capabilities(self, k_cache: torch.Tensor) -> None:
        _, bs, _, d = k_cache.shape
        caps = self.capabilities
        dtype = _DTYPE_NAMES.get(k_cache.dtype, str(k_cache.dtype))
        device_type = k_cache.device.type
        problems = caps.problems(
            block_size=bs, head_dim=d, dtype=dtype, device_type=self._device_type_for_checks(device_type)
        )
        if problems:
            p = problems[0]
            raise ValueError(f"k_cache: {p.parameter} {p.value} is refused: {p.reason}; {p.fix}")

    def _device_type_for_checks(self, device_type: str) -> str:
        """The device type checked against the capabilities (the Triton backend maps its
        CPU interpreter mode to "cuda")."""
        return device_type
