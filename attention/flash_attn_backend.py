"""The flash_attn backend: flash-attn 2's paged kernels behind our interface.

Decode steps (one new token per row) go through ``flash_attn_with_kvcache`` with a
``block_table``; steps with prefill or extend rows go through ``flash_attn_varlen_func`` with a
``block_table`` (decode rows ride along as rows of query length 1). Both apply the causal mask
aligned to the bottom right, which is what our metadata means: the new tokens of a row are
its last ``query_len`` positions.

flash-attn has no standalone cache-write kernel, so K/V writes use our Triton cache-write
kernel when triton is importable (it ships with CUDA builds of torch), else plain torch.

Limits (declared in :mod:`attention.capabilities`, checked on the H200 against the library
itself by tests/test_flash_attn_gpu.py): block_size a multiple of 256, head_dim a multiple of
8 up to 256, fp16/bf16, CUDA compute capability >= 8.0.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend, StepPlan
from attention.metadata import AttentionMetadata
from attention.reference import scatter_kv

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError as err:  # pragma: no cover - the registry checks first and names the extra
    raise ImportError(
        "the flash_attn backend needs flash-attn 2: pip install 'paged-kvcache[flash-attn]' "
        "(builds from source; needs a CUDA toolkit matching torch)"
    ) from err

__all__ = ["FlashAttnBackend", "FlashAttnPlan"]


@dataclass(frozen=True)
class FlashAttnPlan(StepPlan):
    """cu_seqlens_k: int32 [batch + 1], cumulative K/V lengths (varlen path only)."""

    cu_seqlens_k: torch.Tensor | None


class FlashAttnBackend(AttentionBackend):
    """Paged attention through flash-attn 2 (CUDA, fp16/bf16, block_size % 256 == 0)."""

    name = "flash_attn"

    def _plan(self, metadata: AttentionMetadata) -> StepPlan:
        _check_compute_capability(metadata.device, self.capabilities.min_compute_capability)
        if metadata.is_pure_decode:
            return FlashAttnPlan(metadata, None)
        cu_k = F.pad(metadata.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return FlashAttnPlan(metadata, cu_k)

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if _triton_available():
            from attention.triton_kernels.cache_write import write_kv_cache

            write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        scatter_kv(key, value, k_cache, v_cache, slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        assert isinstance(plan, FlashAttnPlan), "plan() of this backend makes a FlashAttnPlan"
        meta = plan.metadata
        b = meta.batch
        if plan.cu_seqlens_k is None:
            # Decode: [batch, 1, heads, d]; cache_seqlens counts the token just written.
            result = flash_attn_with_kvcache(
                query[:b].unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=softmax_scale,
                causal=True,
            ).squeeze(1)
        else:
            real = int(sum(meta.query_lens_host))
            result = flash_attn_varlen_func(
                query[:real],
                k_cache,
                v_cache,
                cu_seqlens_q=meta.query_start_loc,
                cu_seqlens_k=plan.cu_seqlens_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=softmax_scale,
                causal=True,
                block_table=meta.block_tables,
            )
        rows = result.shape[0]
        if out is None:
            if rows == query.shape[0]:
                return result
            out = torch.empty_like(query)
        out[:rows] = result
        return out


@cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def _check_compute_capability(device: torch.device, minimum: tuple[int, int] | None) -> None:
    """Raises RuntimeError on a GPU older than ``minimum``. Cached: once per device."""
    if device.type != "cuda" or minimum is None:
        return
    have = torch.cuda.get_device_capability(device)
    if have < minimum:
        raise RuntimeError(
            f"the flash_attn backend needs CUDA compute capability >= {minimum[0]}.{minimum[1]}, "
            f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}; use attention.backend "
            f"triton or reference"
        )
