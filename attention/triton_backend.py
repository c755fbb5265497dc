"""The ``triton`` backend: our own paged-attention kernels (:mod:`attention.triton_kernels`).

Plan once per step: :meth:`TritonBackend.plan` sends every one-token row to the split-KV
decode kernel and every longer row to the prefill kernel (a mixed batch runs both, on disjoint
output rows) and decides everything they need -- split counts, the decode row index, the
prefill tile index, kernel configurations -- from host-side lengths and the attention spec.
Per-layer calls only launch, so no layer call waits on the device and a decode step can be
captured in a CUDA graph.

Runs on CUDA. Under ``TRITON_INTERPRET=1`` (set before this module is imported) it also
accepts CPU tensors and runs the same kernels in Triton's interpreter, slowly, for tests.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import torch

from attention.base import AttentionBackend, StepPlan
from attention.errors import MetadataError, UnsupportedSettingError
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.spec import AttentionSpec
from attention.staging import BufferRequest, PlanStaging, StepCapacity
from attention.triton_kernels import (
    DecodeConfig,
    PrefillConfig,
    SplitPolicy,
    choose_num_splits,
    default_decode_config,
    default_prefill_config,
    interpreter_requested,
    kernels_interpreted,
    paged_decode,
    paged_prefill,
    prefill_tile_index,
    write_kv_cache,
)

__all__ = ["DecodeLaunch", "PrefillLaunch", "TritonBackend", "TritonStepPlan"]

#: SMs assumed when planning for the CPU interpreter: the H200's, so tests exercise the same
#: split decisions the GPU makes.
INTERPRETER_NUM_SMS = 132
#: Smallest prefill tile height (rows of Q per program).
_MIN_BLOCK_M = 16

_CPU_REFUSED = "the triton backend needs CUDA tensors; set TRITON_INTERPRET=1 to run it on CPU (slow, for tests)"


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return _cuda_num_sms(torch.cuda.current_device() if device.index is None else device.index)


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode kernel's launch for one step.

    num_splits:   splits per row; max_seq_len: longest decode row (host).
    config:       launch parameters.
    decode_index: int32 [n, 2] (batch row, query token) of the decode rows of a mixed step;
                  None for a pure decode step (row i is query token i).
    """

    num_splits: int
    max_seq_len: int
    config: DecodeConfig
    decode_index: torch.Tensor | None


@dataclass(frozen=True)
class PrefillLaunch:
    """The prefill kernel's launch for one step: its configuration and the int32
    [num_tiles, 2] (row, tile) index, heaviest tile first."""

    config: PrefillConfig
    tile_index: torch.Tensor


@dataclass(frozen=True)
class TritonStepPlan(StepPlan):
    """One step's plan for the Triton kernels (every field decided by ``plan``).

    decode_rows:  batch rows with one new token (the decode kernel takes them).
    prefill_rows: the other rows (the prefill kernel takes them).
    """

    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    decode: DecodeLaunch | None
    prefill: PrefillLaunch | None

    @property
    def use_decode(self) -> bool:
        """Every row has one new token: only the decode kernel runs."""
        return not self.prefill_rows


class TritonBackend(AttentionBackend):
    """Paged attention with our Triton kernels.

    Tuning knobs (the registry builds it with none):
      decode_config / prefill_config: fixed launch parameters instead of the per-shape defaults;
      split_policy: how the decode split count follows the batch and the GPU size;
      num_splits:   force this many decode splits (tests, sweeps);
      num_sms:      plan as if the GPU had this many SMs.
    """

    name = "triton"

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        split_policy: SplitPolicy | None = None,
        num_splits: int | None = None,
        num_sms: int | None = None,
    ):
        super().__init__(spec)
        if num_splits is not None and num_splits < 1:
            raise UnsupportedSettingError(f"num_splits: {num_splits} must be >= 1 (or None to choose per step)")
        self.decode_config = decode_config or default_decode_config(spec.head_dim, self.compute_dtype)
        self.prefill_config = prefill_config
        self.split_policy = split_policy or SplitPolicy()
        self.num_splits = num_splits
        self.num_sms = num_sms

    # ---- plan --------------------------------------------------------------------------

    def buffer_requests(self, capacity: StepCapacity) -> list[BufferRequest]:
        tiles = capacity.max_tokens // _MIN_BLOCK_M + capacity.max_rows
        return [
            BufferRequest("decode_index", torch.int32, 2 * capacity.max_rows, staged=True),
            BufferRequest("prefill_tiles", torch.int32, 2 * tiles, staged=True),
        ]

    def _plan(self, metadata: AttentionMetadata, staging: PlanStaging, graph: bool) -> TritonStepPlan:
        q_lens, s_lens = metadata.query_lens_host, metadata.seq_lens_host
        decode_rows = tuple(r for r, q in enumerate(q_lens) if q == 1)
        prefill_rows = tuple(r for r, q in enumerate(q_lens) if q > 1)
        if (self.spec.sliding_window is not None or self.spec.quantized_cache) and not graph:
            # The decode kernel reads whole rows of 16/32-bit K/V; windowed and fp8 steps go
            # through the prefill kernel.
            decode_rows, prefill_rows = (), tuple(range(len(q_lens)))
        if graph:
            if prefill_rows:
                raise MetadataError("graph: only pure decode steps are captured; this step has prefill rows")
            # Every row of the bucket, padding included: the launch depends on the bucket only.
            decode_rows = tuple(range(metadata.padded_batch))
        decode = None
        if decode_rows:
            pure = not prefill_rows
            if graph:
                max_len = metadata.table_width * metadata.block_size  # the bucket's bound
            else:
                max_len = max(s_lens[r] for r in decode_rows)
            splits = self.num_splits or choose_num_splits(
                len(decode_rows),
                self.spec.num_kv_heads,
                max_len,
                self.num_sms or _num_sms(metadata.device),
                self.split_policy,
            )
            index = None
            if not pure:
                starts = _starts(q_lens)
                index = staging.stage("decode_index", array("i", [v for r in decode_rows for v in (r, starts[r])]))
                index = index.view(-1, 2)
            decode = DecodeLaunch(splits, max_len, self.decode_config, index)
        prefill = None
        if prefill_rows:
            longest = max(q_lens[r] for r in prefill_rows)
            config = self.prefill_config or default_prefill_config(self.spec.head_dim, self.compute_dtype, longest)
            pairs = prefill_tile_index(s_lens, q_lens, config.block_m, prefill_rows)
            tiles = staging.stage("prefill_tiles", array("i", [v for pair in pairs for v in pair])).view(-1, 2)
            prefill = PrefillLaunch(config, tiles)
        return TritonStepPlan(metadata, self.spec, self.name, decode_rows, prefill_rows, decode, prefill)

    # ---- per layer ---------------------------------------------------------------------

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None:
        write_kv_cache(key, value, layer.key, layer.value, plan.metadata.slot_mapping, layer.k_scale, layer.v_scale)

    def _attend(self, query: torch.Tensor, layer: LayerCache, plan: StepPlan, out: torch.Tensor | None) -> torch.Tensor:
        assert isinstance(plan, TritonStepPlan), "checked by AttentionBackend._check_step"
        meta = plan.metadata
        result = torch.empty_like(query) if out is None else out
        # The kernels store rows with unit stride along head_dim; anything else goes through
        # a temporary.
        target = result if result.stride(-1) == 1 else torch.empty_like(query)
        scale = self.spec.scale
        if plan.decode is not None:
            d = plan.decode
            paged_decode(
                query,
                layer.key,
                layer.value,
                meta.block_tables,
                meta.seq_lens,
                max_seq_len=d.max_seq_len,
                softmax_scale=scale,
                out=target,
                num_splits=d.num_splits,
                config=d.config,
                decode_index=d.decode_index,
            )
        if plan.prefill is not None:
            p = plan.prefill
            paged_prefill(
                query,
                layer.key,
                layer.value,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                p.tile_index,
                softmax_scale=scale,
                out=target,
                config=p.config,
                window=self.spec.window_of(layer.index),
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
            )
        if target is not result:
            result.copy_(target)
        return result

    def _device_type_for_checks(self, device_type: str) -> str:
        """CPU tensors count as "cuda" only under the interpreter; otherwise they are refused
        here with the fix, before the generic capability message."""
        if device_type != "cpu":
            return device_type
        if not interpreter_requested():
            raise UnsupportedSettingError(_CPU_REFUSED)
        if not kernels_interpreted():
            raise UnsupportedSettingError(
                "the triton backend got CPU tensors and TRITON_INTERPRET=1, but its kernels "
                "were imported before TRITON_INTERPRET was set and are compiled for CUDA; "
                "set TRITON_INTERPRET=1 before importing attention.triton_backend"
            )
        return "cuda"


def _starts(query_lens: tuple[int, ...]) -> list[int]:
    """First query token of each row (query_start_loc, on the host)."""
    starts, total = [], 0
    for q in query_lens:
        starts.append(total)
        total += q
    return starts
