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
from array import array
from dataclasses import dataclass, field, replace
from functools import cache
from itertools import accumulate

import torch

from attention.base import AttentionBackend, StepPlan
from attention.errors import MetadataError
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.reference import scatter_kv
from attention.staging import BufferRequest, PlanStaging, StepCapacity

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError as err:  # pragma: no cover - the registry checks first and names the extra
    raise ImportError(
        "the flash_attn backend needs flash-attn 2: in the project checkout, pip install "
        "--no-build-isolation -e '.[flash-attn]' (builds from source; needs a CUDA toolkit matching torch)"
    ) from err

__all__ = ["FlashAttnBackend", "FlashAttnPlan"]


@dataclass(frozen=True)
class FlashAttnPlan(StepPlan):
    """cu_seqlens_k: int32 [batch + 1], cumulative K/V lengths (varlen path only; None for a
    pure decode step, which goes through flash_attn_with_kvcache).
    cache_seqlens: int32 [padded_batch] lengths the decode call reads: the real rows',
    then 1 for each padding row (flash-attn's paged decode misbehaves on empty rows).
    block_table: the metadata's block tables (padding rows name block 0 in column 0).

    Both length arrays are staged from the host's lengths and then, at the step's first
    attend, recomputed on the device from ``metadata.seq_lens`` (``device_lengths``), which
    the device check has repaired by then: flash-attn reads every table entry below a row's
    length, and the check validates the entries below the device length, so the two must
    agree even when the device lengths were corrupted."""

    cu_seqlens_k: torch.Tensor | None
    cache_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    #: Non-empty once this plan's lengths were taken from the device (its first attend).
    device_lengths: list[bool] = field(default_factory=list, compare=False, repr=False)

    def for_group(self, metadata: AttentionMetadata) -> StepPlan:
        table = None if self.block_table is None else metadata.block_tables
        return replace(self, metadata=metadata, groups=(), block_table=table, device_lengths=[])


class FlashAttnBackend(AttentionBackend):
    """Paged attention through flash-attn 2 (CUDA, fp16/bf16, block_size % 256 == 0)."""

    name = "flash_attn"
    reads_token_major_values = False  # flash-attn's kernels take contiguous K/V caches

    def buffer_requests(self, capacity: StepCapacity) -> list[BufferRequest]:
        return [
            BufferRequest("fa_cache_seqlens", torch.int32, capacity.max_rows, staged=True),
            BufferRequest("fa_cu_seqlens_k", torch.int32, capacity.max_rows + 1, staged=True),
        ]

    def _plan(self, metadata: AttentionMetadata, staging: PlanStaging, graph: bool) -> StepPlan:
        """Everything from host values, staged with the metadata (a plan never reads the
        metadata's device tensors: they are copied after it)."""
        _check_compute_capability(metadata.device, self.info.min_compute_capability)
        lens = metadata.seq_lens_host
        if metadata.is_pure_decode or (graph and metadata.batch == 0):
            # Padding rows attend one token (block 0, which the builder puts in their column
            # 0): flash-attn's paged decode misbehaves on empty rows.
            pad = metadata.padded_batch - metadata.batch
            seqlens = staging.stage("fa_cache_seqlens", array("i", [*lens, *([1] * pad)]))
            return FlashAttnPlan(metadata, self.spec, self.name, None, seqlens, metadata.block_tables)
        if graph:
            raise MetadataError("graph: only pure decode steps are captured; this step has prefill rows")
        cu_k = staging.stage("fa_cu_seqlens_k", array("i", [0, *accumulate(lens)]))
        return FlashAttnPlan(metadata, self.spec, self.name, cu_k)

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None:
        if _triton_available():
            from attention.triton_kernels.cache_write import write_kv_cache

            write_kv_cache(key, value, layer.key, layer.value, plan.metadata.slot_mapping)
            return
        scatter_kv(key, value, layer, plan.metadata.slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,  # never given: the backend table refuses attention_sinks
    ) -> torch.Tensor:
        assert isinstance(plan, FlashAttnPlan), "checked by AttentionBackend._check_step"
        meta = plan.metadata
        _lengths_from_device(plan)
        window = self.spec.window_of(layer.index)
        # flash-attn's window counts keys left of the query; ours counts the query too.
        window_size = (-1, -1) if window is None else (window - 1, 0)
        if plan.cu_seqlens_k is None:
            b = meta.padded_batch
            # Decode: [batch, 1, heads, d]; cache_seqlens counts the token just written.
            result = flash_attn_with_kvcache(
                query[:b].unsqueeze(1),
                layer.key,
                layer.value,
                cache_seqlens=plan.cache_seqlens,
                block_table=plan.block_table,
                softmax_scale=self.spec.scale,
                causal=True,
                window_size=window_size,
                softcap=self.spec.logit_softcap or 0.0,  # flash-attn: 0 turns the cap off
            ).squeeze(1)
        else:
            # The whole query (padding included): query_start_loc never points past it, even
            # after the device check repaired corrupt starts.
            result = flash_attn_varlen_func(
                query,
                layer.key,
                layer.value,
                cu_seqlens_q=meta.query_start_loc[: meta.batch + 1],
                cu_seqlens_k=plan.cu_seqlens_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=self.spec.scale,
                causal=True,
                window_size=window_size,
                softcap=self.spec.logit_softcap or 0.0,  # flash-attn: 0 turns the cap off
                block_table=meta.block_tables[: meta.batch],
            )
        rows = result.shape[0]
        if out is None:
            if rows == query.shape[0]:
                return result
            out = torch.empty_like(query)
        out[:rows] = result
        return out


def _lengths_from_device(plan: FlashAttnPlan) -> None:
    """At the plan's first attend (captured with it in a CUDA graph): the K lengths flash-attn
    reads, from the metadata's device lengths (as the device check left them): a padding or
    repaired row of length 0 reads 1, whose column 0 the check validates."""
    if plan.device_lengths:
        return
    meta = plan.metadata
    if plan.cu_seqlens_k is None:
        assert plan.cache_seqlens is not None, "set by _plan with cu_seqlens_k None"
        torch.clamp(meta.seq_lens, min=1, out=plan.cache_seqlens)
    else:
        torch.cumsum(meta.seq_lens[: meta.batch], 0, dtype=torch.int32, out=plan.cu_seqlens_k[1:])
    plan.device_lengths.append(True)


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
