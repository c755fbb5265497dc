"""The ``triton`` backend: our own paged-attention kernels (:mod:`attention.triton_kernels`).

Plan once per step: :meth:`TritonBackend.plan` sends every row of at most
``max_decode_query_len`` new tokens (8: one token, or a row verifying draft tokens) to the
split-KV decode kernel and every longer row to the prefill kernel (a mixed batch runs both, on
disjoint output rows) and decides everything they need -- split counts, the decode row index, the
prefill tile index, kernel configurations -- from host-side lengths and the attention spec.
Per-layer calls only launch, so no layer call waits on the device and a step can be captured
in a CUDA graph: a decode step per batch bucket, a mixed step (prefill rows beside decode
rows) per token bucket, with both kernels on grids fixed by the bucket.

Latent attention (``spec.latent_rank``, DeepSeek's MLA): every query token, of whatever row,
goes to the MLA kernel (:mod:`attention.triton_kernels.mla_decode`) with its table row and the
latents it sees; the plan stages both (padding tokens see nothing), and the split count comes
from the step's shape, so graph steps replay what they captured.

Runs on CUDA. Under ``TRITON_INTERPRET=1`` (set before this module is imported) it also
accepts CPU tensors and runs the same kernels in Triton's interpreter, slowly, for tests.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import cast

import torch

from attention.base import AttentionBackend, StepPlan
from attention.capabilities import BackendInfo, backend_info
from attention.checks import cdiv
from attention.dtypes import torch_dtype
from attention.errors import InvalidArgumentError, MetadataError, UnsupportedSettingError
from attention.latent_prefill import LatentPrefill, plan_latent_prefill
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.rotary import RotaryTable
from attention.spec import AttentionSpec
from attention.staging import BufferRequest, DirectStaging, PlanStaging, StepCapacity
from attention.synthetic import scratch_layer, synthetic_metadata
from attention.triton_kernels import (
    FP8_KV_DTYPES,
    MAX_DECODE_QUERY_LEN,
    DecodeConfig,
    DecodePolicy,
    DecodeSchedule,
    DecodeWorkspace,
    PrefillConfig,
    default_decode_config,
    default_prefill_config,
    hopper_decode_config,
    interpreter_requested,
    kernels_interpreted,
    max_decode_items,
    max_decode_partials,
    max_prefill_tiles,
    paged_decode,
    paged_prefill,
    prefill_tile_index,
    rotary_write_kv,
    schedule_decode,
    write_kv_cache,
)
from attention.triton_kernels.decode import TOKEN_SCALED_KV_DTYPES
from attention.triton_kernels.decode_hopper import decode_hopper_shape_ok, hopper_block_n
from attention.triton_kernels.decode_schedule import ITEM_FIELDS, ROW_FIELDS
from attention.triton_kernels.dequantize_blocks import counted_programs, dequantize_blocks, plan_block_dequant
from attention.triton_kernels.latent_write import rotary_write_latent
from attention.triton_kernels.mla_balanced import (
    MLAWork,
    min_program_latents,
    mla_direct_store,
    mla_work_len,
    mla_work_programs,
    plan_mla_work,
)
from attention.triton_kernels.mla_decode import (
    MLALaunch,
    causal_queries,
    default_mla_launch,
    hopper_mla_launch,
    mla_attention,
)
from attention.triton_kernels.mla_decode_hopper import mla_decode_hopper_dtypes_ok, mla_decode_hopper_shape_ok
from attention.triton_kernels.mla_prefill import (
    MLAPrefillIndex,
    mla_prefill,
    mla_prefill_block_m,
    stage_mla_prefill_index,
)
from attention.triton_kernels.prefill import PAD_TILE
from attention.triton_kernels.prefill_hopper import (
    HOPPER_PREFILL_BLOCK_M,
    hopper_prefill,
    hopper_prefill_applies,
    hopper_prefill_possible,
    hopper_prefill_shape_ok,
)
from attention.triton_kernels.rotary_write import value_runs_launched

__all__ = ["DecodeLaunch", "LatentLaunch", "PrefillLaunch", "TritonBackend", "TritonStepPlan"]

#: SMs assumed when planning for the CPU interpreter: the H200's, so tests exercise the same
#: decisions the GPU makes.
INTERPRETER_NUM_SMS = 132
#: Smallest prefill tile height (rows of Q per program).
_MIN_BLOCK_M = 16
#: The most memory the 16-bit copy of an fp8 step's blocks may take (K and V) for the Hopper
#: prefill kernel; a larger step stays on the Triton kernel (which reads fp8 directly).
_DEQUANT_SCRATCH_BYTES = 1 << 30

#: Persistent prefill programs per SM on a fixed (CUDA-graph) grid.
_PREFILL_PROGRAMS_PER_SM = 2

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
    """The decode kernel's launch for the layers of one window (None: full attention).

    schedule: the host partition of the decode rows into items (grid sizes).
    rows, items: its int32 arrays on the device ([grid_rows, 5], [grid_items, 10]).
    config: the kernel's launch parameters (the schedule was made for its block_n).
    combine: None: the combine kernel runs where the schedule may split a row
             (``schedule.needs_combine``); True / False: a graph variant's choice
             (``TritonBackend(direct_decode_graphs=True)``, the default), False only where
             no row splits.
    """

    window: int | None
    schedule: DecodeSchedule
    rows: torch.Tensor
    items: torch.Tensor
    config: DecodeConfig
    combine: bool | None = None


@dataclass(frozen=True)
class PrefillLaunch:
    """The prefill kernel's launch for one step: its configuration and the int32
    [num_tiles, 2] (row, tile) index, heaviest tile first.

    On a graph step with room for prefill rows the grid is fixed: the index is padded to the
    bucket's :func:`~attention.triton_kernels.max_prefill_tiles` entries, ``tile_count``
    (int32 [1]) holds the real ones, and ``programs`` persistent programs share them."""

    config: PrefillConfig
    tile_index: torch.Tensor
    tile_count: torch.Tensor | None = None
    programs: int | None = None
    dequant: BlockDequant | None = None


@dataclass(frozen=True)
class BlockDequant:
    """A step over an 8-bit cache on the Hopper prefill kernel: the cache blocks its prefill
    rows read, as (row, column) of the step's block table (int32 [n, 2], device), are copied
    dequantized into a 16-bit scratch cache that ``tables`` (int32 [batch, width], device)
    indexes (:mod:`~attention.triton_kernels.dequantize_blocks`).

    count: on a CUDA-graph step (``TritonBackend(graph_dequant_prefill=True)``), int32 [1]
           on the device: the real sources; ``sources`` is padded to the bucket's scratch
           capacity with (-1, -1) and ``tables`` has the bucket's width. None: eager.
    """

    sources: torch.Tensor
    tables: torch.Tensor
    count: torch.Tensor | None = None


@dataclass(frozen=True)
class LatentLaunch:
    """The MLA kernel's launch for one step: per query token (padding included), its table
    row (-1: none, for padding) and the latents it sees (int32 [num_tokens] each, on the
    device); the balanced schedule of its tiles (programs from the step's shape, their tiles
    from its lengths: :func:`plan_mla_work`, staged); the tiles."""

    token_rows: torch.Tensor
    token_lens: torch.Tensor
    work: MLAWork
    launch: MLALaunch


@dataclass(frozen=True)
class TritonStepPlan(StepPlan):
    """One step's plan for the Triton kernels (every field decided by ``plan``).

    decode_rows:  batch rows of at most ``max_decode_query_len`` new tokens (the decode kernel
                  takes them).
    prefill_rows: the other rows (the prefill kernel takes them).
    decode:       one launch per distinct window among the layers (full, windowed, or both).
    workspace:    the decode kernels' partial outputs and counters (shared by the launches:
                  layers run one after another).
    latent:       latent attention (MLA): the one launch every token takes (then the decode
                  and prefill fields are empty: neither kernel runs).
    A graph step of ``TritonBackend(direct_decode_graphs=True)`` (the default) has each decode launch's
    ``combine`` set (:attr:`combine_variants`): its bucket is captured with the combine
    kernel ("combine") and without it ("direct"); the step replays "direct" when none of its
    rows splits.
    """

    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    decode: tuple[DecodeLaunch, ...]
    workspace: DecodeWorkspace | None
    prefill: PrefillLaunch | None
    latent: LatentLaunch | None = None

    @property
    def combine_variants(self) -> bool:
        """Whether the plan's decode launches chose to run the combine kernel or not (a graph
        step of ``direct_decode_graphs``), rather than leaving it to the schedule."""
        return any(launch.combine is not None for launch in self.decode)

    @property
    def graph_variant(self) -> str | None:
        """With ``combine_variants``: "direct" when no decode launch of the step or of its KV
        groups runs the combine kernel, else "combine"; without: None."""
        if not self.combine_variants:
            return None
        launches = [launch for plan in (self, *self.groups) for launch in plan.decode]  # type: ignore[attr-defined]
        return "combine" if any(launch.combine for launch in launches) else "direct"

    def as_graph_variant(self, variant: str | None) -> TritonStepPlan:
        """This plan with every decode launch (its KV groups' too) running the combine kernel
        ("combine") or not ("direct": InvalidArgumentError if a row of the step splits)."""
        if not self.combine_variants:
            return cast(TritonStepPlan, super().as_graph_variant(variant))
        if variant not in ("combine", "direct"):
            raise InvalidArgumentError(f"variant: {variant!r}; this plan's graph variants are 'combine' and 'direct'")
        direct = variant == "direct"
        split = [launch.window for launch in self.decode if launch.schedule.num_partials > 0]
        if direct and split:
            raise InvalidArgumentError(
                f"variant: 'direct' skips the combine kernel, but rows of this step split (window {split[0]}); "
                f"replay 'combine'"
            )
        decode = tuple(replace(launch, combine=not direct) for launch in self.decode)
        groups = tuple(cast(TritonStepPlan, group).as_graph_variant(variant) for group in self.groups)
        return replace(self, decode=decode, groups=groups)

    @property
    def use_decode(self) -> bool:
        """Every row has one new token: only the decode kernel runs."""
        return not self.prefill_rows

    def decode_for(self, window: int | None) -> DecodeLaunch | None:
        return next((d for d in self.decode if d.window == window), None)


class TritonBackend(AttentionBackend):
    """Paged attention with our Triton kernels.

    Tuning knobs (the registry builds it with none):
      decode_config / prefill_config: fixed launch parameters instead of the per-shape defaults
                        (decode_config then also serves rows of several new tokens);
      decode_policy:    how decode rows are cut into chunks (see DecodePolicy);
      decode_chunk_len: force this chunk length (tests, sweeps);
      num_sms:          plan as if the GPU had this many SMs;
      max_decode_query_len: rows of up to this many new tokens (1 .. 8, a power of two) go to
                        the decode kernel; 1 sends every multi-token row to the prefill kernel.
      hopper_prefill:   on an sm_90 GPU, prefill steps the warp-specialized Gluon kernel
                        covers (:func:`~attention.triton_kernels.prefill_hopper.hopper_prefill_applies`)
                        run on it (default), and so do decompressed MLA prompt rows of
                        DeepSeek-shaped heads (:mod:`~attention.triton_kernels.mla_prefill_hopper`);
                        False: always the Triton prefill kernels.
      hopper_decode:    on an sm_90 GPU, one-token decode rows over a float8_e4m3fn cache or
                        one in the compute dtype (bf16 / fp16) run on the Gluon kernel of
                        warpgroup MMAs (:mod:`~attention.triton_kernels.decode_hopper`, launch
                        :func:`~attention.triton_kernels.decode.hopper_decode_config`) where it
                        takes the spec and block size (head_dim 64 or 128, groups of up to 16
                        heads, no cap or sinks). None (default): a cache in the compute dtype
                        at every block size it takes, and a float8_e4m3fn cache under bf16
                        queries (its fp8 dots take the query and P as e4m3 hi + lo, ~8
                        significant bits: a bf16 query's, not an fp16 one's) at every block size
                        it takes. True: wherever it applies. False: never (the Triton kernel
                        everywhere). On the H200
                        (benchmarks/results/decode-hopper-h200-2026-12-05.md) the kernel ran a
                        bf16 cache at 1.00-1.20x the Triton kernel's speed on every shape but
                        64 x 4096 (0.998x), 32 x 512 at 1.12-1.14x flash-attn's where the Triton
                        kernel runs 0.93-0.96x, and the burst's decode attention at 2.81 ms an
                        iteration against 2.97. Over fp8 it ran 0.99-1.13x the Triton kernel's
                        speed, and the burst's attention at 1.80 ms against 1.95 at block 256.
                        On an H100 fp8 in blocks of 256 ran the Triton kernel until the Gluon
                        kernel's tiles lost 39 instructions each (2.36 ms against 2.32 in the
                        burst, stall-e2e-h100-2026-12-05.md); since, it runs bench_decode's
                        shapes at 1.00-1.10x the Triton kernel's speed at block 256 and
                        1.05-1.20x at block 32, the burst's attention at 2.321 ms against 2.322
                        (decode-fp8-gluon-vs-triton-h100-2026-12-07.log,
                        e2e-cache-ratio-h100-2026-12-07-hopper-always.json).
                        (Earlier end-to-end fp8 runs on it had one decode
                        iteration stalled by 0.1-0.5 s: kernels compiled mid-serving on
                        per-step sizes, gone since; none in 8 runs on the H100.)
      hopper_decode_overlap: where one-token rows take that Gluon kernel, its overlapped loop
                        (``DecodeConfig.hopper_overlap``: a tile's score MMAs and softmax while
                        the previous tile's P V MMAs run). Off by default: correct on an
                        H100 and within 1% of the loop in turn
                        (benchmarks/results/decode-overlap-h100-2026-12-06.md).
      hopper_decode_ws_loader: where one-token rows take that Gluon kernel's loop in turn, its TMA
                        loads in a loader warp of their own (``DecodeConfig.hopper_ws_loader``;
                        on by default, off under hopper_decode_overlap).
      hopper_mla_decode: on an sm_90 GPU, MLA steps of up to 16 heads over a latent of 512 + 64
                        channels in blocks of a multiple of 64, 16-bit or fp8 under bf16 queries,
                        run on the Gluon decode kernel
                        (:mod:`~attention.triton_kernels.mla_decode_hopper`, its fp8 forms
                        :mod:`~attention.triton_kernels.mla_decode_hopper_fp8_ws` and
                        :mod:`~attention.triton_kernels.mla_decode_hopper_fp8`; default);
                        False: the Triton MLA kernel.
      graph_dequant_prefill: on an sm_90 GPU, mixed CUDA-graph steps over an 8-bit cache run
                        their prefill rows as eager steps do: on the Hopper prefill kernel over
                        a 16-bit copy of the blocks they read
                        (:mod:`~attention.triton_kernels.dequantize_blocks`), where the
                        bucket's most blocks fit ``_DEQUANT_SCRATCH_BYTES`` (its prefill rows,
                        at most tokens / (max_decode_query_len + 1), times the table's width);
                        else, and by default, on the Triton prefill kernel, which reads the
                        8-bit cache as stored. Opt-in: on an H100, in the Poisson run
                        (benchmarks/results/graph-dequant-prefill-h100-2026-12-05.md), the copy
                        (0.24 ms an iteration) ate most of the Hopper kernel's gain: prefill
                        0.80 ms against 0.82 over fp8, 0.81 against 0.97 over int8, the
                        inter-token latency no better.
      hopper_mla_ring:  that Gluon kernel in its deeper-ring form
                        (:mod:`~attention.triton_kernels.mla_decode_hopper_ring`; same results;
                        off by default: 0.98-0.99x the two-tile kernel's speed on the H200).
      hopper_mla_split: that Gluon kernel in its split-warpgroup form
                        (:mod:`~attention.triton_kernels.mla_decode_hopper_split`: the latent's
                        channels halved between two warpgroups, loads in a producer partition;
                        same results). Off by default: 1.00x the two-tile kernel's speed on an
                        H100 (benchmarks/results/mla-decode-split-h100-2026-12-06.md).
      hopper_mla_fused_merge: that Gluon kernel (two-tile form, 16-bit latent) merges the tokens
                        split across its programs itself (the last program to finish one merges
                        its slots) instead of a merge launch after it; eager steps with
                        decompressed rows keep the merge launch (same results). Off by
                        default: 0.94-0.97x the default's speed on an H100, 1.65 against 1.38 ms
                        of decode attention an iteration end to end
                        (benchmarks/results/mla-fused-merge-h100-2026-12-06.md).
      direct_decode_graphs: capture each CUDA-graph bucket twice (:meth:`graph_variants`):
                        with the decode combine kernel and without it; a step none of whose
                        rows splits replays the one without (default). The combine launch of
                        a bucket's fixed grid costs ~4 us a layer on an H100 even when it
                        merges nothing: end to end (the burst, 128 rows, an fp8 cache) decode
                        attention took 2.42 ms an iteration against 2.55, a bf16 cache 4.17
                        against 4.17 (benchmarks/results/direct-decode-graphs-h100-2026-12-05.md).
                        False: one graph a bucket, half the capture work. A given
                        ``decode_config`` with ``fused_combine`` has no combine launch to
                        drop, so then one graph a bucket either way.
      value_runs:       steps that can have prefill rows write an fp8 cache's token-major V in
                        runs of consecutive slots with a second kernel whose stores are
                        coalesced along the tokens (:mod:`~attention.triton_kernels.value_runs`;
                        the same bytes; default). On an H100 the Poisson run's fused rotary +
                        cache write went from 0.357 to 0.193 ms an iteration, plus 0.077 for
                        the runs (benchmarks/results/value-runs-h100-2026-12-05.md). Not for
                        int8, whose runs kernel (per-token scales) cost more than it saved.
                        False: token by token, a byte a store.
      latent_mixed_graphs: with latent attention, capture steps with prefill rows too
                        (``info.mixed_cuda_graphs``; the buckets' token limit,
                        ``kvcache.step.buckets.MAX_GRAPH_TOKENS``, applies): such a step then
                        attends every row absorbed, and only larger steps run eagerly with long
                        rows decompressed. On by default: eager, a mixed step of
                        DeepSeek-V2-Lite's sizes under the Poisson workload (token budget 256)
                        took 36.6 ms, host work, for 5.3 ms of GPU work on an H100; captured,
                        4.40 ms, and the inter-token latency median went from 36.4 to 3.64 ms,
                        time to first token from 14.3 s to 20 ms
                        (benchmarks/results/e2e-mla-graphs-h100-2026-12-06.md). False: every
                        step with prefill rows eager (the absorbed kernel costs more GPU time
                        than the decompressed path on rows of 64 new tokens or more, which
                        pays only where the host is not the bound).
    """

    name = "triton"

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        decode_policy: DecodePolicy | None = None,
        decode_chunk_len: int | None = None,
        num_sms: int | None = None,
        max_decode_query_len: int = MAX_DECODE_QUERY_LEN,
        hopper_prefill: bool = True,
        hopper_decode: bool | None = None,
        hopper_decode_overlap: bool = False,
        hopper_decode_ws_loader: bool = True,
        hopper_mla_decode: bool = True,
        hopper_mla_ring: bool = False,
        hopper_mla_split: bool = False,
        hopper_mla_fused_merge: bool = False,
        direct_decode_graphs: bool = True,
        graph_dequant_prefill: bool = False,
        value_runs: bool = True,
        latent_mixed_graphs: bool = True,
    ):
        super().__init__(spec)
        flags = (("hopper_prefill", hopper_prefill), ("hopper_decode_overlap", hopper_decode_overlap),
                 ("hopper_decode_ws_loader", hopper_decode_ws_loader), ("hopper_mla_decode", hopper_mla_decode),
                 ("hopper_mla_ring", hopper_mla_ring), ("hopper_mla_split", hopper_mla_split),
                 ("hopper_mla_fused_merge", hopper_mla_fused_merge),
                 ("direct_decode_graphs", direct_decode_graphs),
                 ("graph_dequant_prefill", graph_dequant_prefill), ("value_runs", value_runs),
                 ("latent_mixed_graphs", latent_mixed_graphs))  # fmt: skip
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise UnsupportedSettingError(f"{name}: {flag!r} must be True or False")
        if hopper_decode is not None and not isinstance(hopper_decode, bool):
            raise UnsupportedSettingError(
                f"hopper_decode: {hopper_decode!r} must be True, False or None (the default: where measured faster)"
            )
        if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
            raise UnsupportedSettingError(f"num_sms: {num_sms!r} must be an int >= 1 (or None: the device's count)")
        if decode_chunk_len is not None and decode_chunk_len < 1:
            raise UnsupportedSettingError(f"decode_chunk_len: {decode_chunk_len} must be >= 1 (or None to choose)")
        q = max_decode_query_len
        if not isinstance(q, int) or not 1 <= q <= MAX_DECODE_QUERY_LEN or q & (q - 1):
            raise UnsupportedSettingError(
                f"max_decode_query_len: {q!r} must be a power of two in [1, {MAX_DECODE_QUERY_LEN}]"
            )
        self.max_decode_query_len = q
        kv_dtype = self.cache_dtype if spec.quantized_cache else None
        #: Launch parameters of one-token rows: given, or the default for no particular block
        #: size (plans take :meth:`_decode_launch`'s, which knows the step's).
        self.decode_config = decode_config or default_decode_config(spec.head_dim, self.compute_dtype, kv_dtype)
        #: Launch parameters of rows of several new tokens (verifying drafts).
        self.verify_decode_config = decode_config or default_decode_config(
            spec.head_dim, self.compute_dtype, kv_dtype, query_len=MAX_DECODE_QUERY_LEN
        )
        self.prefill_config = prefill_config
        self._given_decode_config = decode_config is not None
        self._given_decode_policy = decode_policy is not None
        #: The chunking policy (given, or the default); a default-policy launch whose config
        #: names fewer programs per SM schedules for those (:meth:`_decode_launch`), which
        #: never needs more items or partial slots than this policy's bounds; one whose config
        #: names a wave fill may need more (the buffers take :meth:`_bounding_decode_policy`).
        self.decode_policy = decode_policy or DecodePolicy()
        self.decode_chunk_len = decode_chunk_len
        self.num_sms = num_sms
        self.hopper_prefill = hopper_prefill
        self.hopper_decode = hopper_decode
        self.hopper_decode_overlap = hopper_decode_overlap
        self.hopper_decode_ws_loader = hopper_decode_ws_loader
        self.hopper_mla_decode = hopper_mla_decode
        self.hopper_mla_ring = hopper_mla_ring
        self.hopper_mla_split = hopper_mla_split
        self.hopper_mla_fused_merge = hopper_mla_fused_merge
        self.direct_decode_graphs = direct_decode_graphs
        self.graph_dequant_prefill = graph_dequant_prefill
        self.value_runs = value_runs
        self.latent_mixed_graphs = latent_mixed_graphs
        #: The last plan whose decompressed rows' prefill index was staged, and that index.
        self._prefill_index: tuple[StepPlan, MLAPrefillIndex] | None = None

    def graph_variants(self) -> tuple[str | None, ...]:
        """("combine", "direct") with ``direct_decode_graphs`` (not for latent attention,
        whose kernel has no separate combine, nor for a given decode launch that fuses the
        combine into its chunks), else one."""
        fused = self._given_decode_config and self.decode_config.fused_combine
        if self.direct_decode_graphs and not self.spec.latent_attention and not fused:
            return ("combine", "direct")
        return (None,)

    @property
    def info(self) -> BackendInfo:
        """The table's entry; with latent attention and ``latent_mixed_graphs`` off, steps with
        prefill rows are not captured (``mixed_cuda_graphs`` off): they run eagerly, where long
        rows attend decompressed."""
        info = backend_info(self.name)
        spec = getattr(self, "spec", None)  # None while AttentionBackend.__init__ checks the spec
        if spec is None or not spec.latent_attention or getattr(self, "latent_mixed_graphs", True):
            return info
        return replace(info, mixed_cuda_graphs=False)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows among the layers (None: full attention)."""
        spec = self.spec
        if spec.sliding_window is None:
            return (None,)
        if spec.window_layers is None or all(spec.window_layers):
            return (spec.sliding_window,)
        return (None, spec.sliding_window)

    # ---- plan --------------------------------------------------------------------------

    def _graph_query_len(self, padded_batch: int, num_tokens: int) -> int:
        """New tokens per decode row a CUDA-graph bucket is compiled for: 1 in a decode bucket
        (as many tokens as rows), else ``max_decode_query_len`` (rows verifying drafts)."""
        return 1 if num_tokens <= padded_batch else self.max_decode_query_len

    def _latent_work_len(self, max_tokens: int) -> int:
        """The MLA work buffer's length: the larger plan of the two launches, with the fused
        merge's counters where that merge is on (any launch may then plan them)."""
        return mla_work_len(max_tokens, self._most_mla_programs(), self.hopper_mla_fused_merge)

    def buffer_requests(self, capacity: StepCapacity) -> list[BufferRequest]:
        if self.spec.latent_attention:
            return [
                BufferRequest("latent_rows", torch.int32, capacity.max_tokens, staged=True),
                BufferRequest("latent_lens", torch.int32, capacity.max_tokens, staged=True),
                BufferRequest("latent_work", torch.int32, self._latent_work_len(capacity.max_tokens), staged=True),
            ]
        rows = capacity.max_rows
        sms = self._sms(None)
        kvh, heads, d = self.spec.num_kv_heads, self.spec.num_heads, self.spec.head_dim
        bound = self._bounding_decode_policy()
        items = max_decode_items(rows, kvh, sms, bound)
        q = self._graph_query_len(rows, capacity.max_tokens)
        partials = max(1, max_decode_partials(rows, kvh, sms, bound, max_query_len=q))
        tiles = max_prefill_tiles(capacity.max_rows, capacity.max_tokens, _MIN_BLOCK_M)
        found = [
            BufferRequest("prefill_tiles", torch.int32, 2 * tiles, staged=True),
            BufferRequest("prefill_tile_count", torch.int32, 1, staged=True),
        ]
        if self.graph_dequant_prefill and self.spec.quantized_cache:
            most = self._graph_dequant_rows(rows, capacity.max_tokens) * capacity.max_blocks_per_seq
            found += [
                BufferRequest("prefill_dequant_sources", torch.int32, 2 * most, staged=True),
                BufferRequest("prefill_dequant_tables", torch.int32, rows * capacity.max_blocks_per_seq, staged=True),
                BufferRequest("prefill_dequant_count", torch.int32, 1, staged=True),
            ]
        for w in self.windows:
            found.append(BufferRequest(f"decode_items_{w}", torch.int32, ITEM_FIELDS * items, staged=True))
            found.append(BufferRequest(f"decode_rows_{w}", torch.int32, ROW_FIELDS * rows, staged=True))
        found += [
            BufferRequest("decode_part_o", torch.float32, partials * heads * d, staged=False),
            BufferRequest("decode_part_lse", torch.float32, partials * heads, staged=False),
            BufferRequest("decode_counters", torch.int32, rows * kvh, staged=False, zeroed=True),
        ]
        return found

    def _sms(self, device: torch.device | None) -> int:
        if self.num_sms is not None:
            return self.num_sms
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() and not kernels_interpreted() else "cpu")
        return _num_sms(device)

    def _mla_launch(self, device: torch.device, block_size: int) -> MLALaunch:
        """The MLA launch for steps on ``device`` over blocks of ``block_size``: the Hopper
        kernel's where the device, the spec and the block size allow it (a 16-bit latent, or an
        fp8 one under bf16 queries; :func:`~attention.triton_kernels.mla_decode.hopper_mla_launch`),
        else the default."""
        spec = self.spec
        rank = spec.latent_rank or 0
        if (
            self.hopper_mla_decode
            and mla_decode_hopper_dtypes_ok(torch_dtype(spec.dtype), torch_dtype(spec.cache_dtype))
            and mla_decode_hopper_shape_ok(spec.num_heads, rank, spec.head_dim - rank, block_size)
            and hopper_prefill_possible(device)
        ):
            return hopper_mla_launch(self.hopper_mla_ring, self.hopper_mla_split, self.hopper_mla_fused_merge)
        return default_mla_launch(spec.num_heads)

    def _mla_programs(self, launch: MLALaunch, device: torch.device | None) -> int:
        """Programs per head tile of the balanced MLA schedule for ``launch`` on this device."""
        return mla_work_programs(self.spec.num_heads, launch.block_h, launch.programs_per_sm, self._sms(device))

    def _most_mla_programs(self) -> int:
        """The most programs either launch (the default or the Hopper one) plans for: the work
        buffer's size, whichever launch a step takes."""
        default, hopper = default_mla_launch(self.spec.num_heads), hopper_mla_launch()
        return max(self._mla_programs(default, None), self._mla_programs(hopper, None))

    def _plan(self, metadata: AttentionMetadata, staging: PlanStaging, graph: bool) -> TritonStepPlan:
        """On a graph step both kernels' launches depend only on the bucket: the decode grid on
        its rows; the prefill launch exists when the bucket has more tokens than rows (room
        for prefill rows), with a fixed grid over a padded tile index."""
        if self.spec.latent_attention:
            return self._plan_latent(metadata, staging, graph)
        q_lens, most = metadata.query_lens_host, self.max_decode_query_len
        if max(q_lens, default=1) <= most:  # the common step: every row decodes
            decode_rows: tuple[int, ...] = tuple(range(len(q_lens)))
            prefill_rows: tuple[int, ...] = ()
        else:
            decode_rows = tuple(r for r, q in enumerate(q_lens) if q <= most)
            prefill_rows = tuple(r for r, q in enumerate(q_lens) if q > most)
        if metadata.tree_masks is not None and prefill_rows:
            r = prefill_rows[0]
            raise MetadataError(
                f"metadata.tree_masks: row {r} brings {q_lens[r]} new tokens; this backend verifies draft trees of "
                f"at most max_decode_query_len = {most} tokens per row"
            )
        fixed_prefill = graph and metadata.num_tokens > metadata.padded_batch  # checked: see check_graph_bucket
        decode: tuple[DecodeLaunch, ...] = ()
        workspace = None
        if decode_rows or graph:
            decode, workspace = self._plan_decode(metadata, decode_rows, staging, graph)
        prefill = None
        if prefill_rows or fixed_prefill:
            prefill = self._plan_prefill(metadata, prefill_rows, staging, fixed_prefill)
        return TritonStepPlan(metadata, self.spec, self.name, decode_rows, prefill_rows, decode, workspace, prefill)

    def _plan_latent(self, meta: AttentionMetadata, staging: PlanStaging, graph: bool) -> TritonStepPlan:
        """Every query token to the MLA kernel: its row and causal length, padding tokens with
        row -1 (they see nothing). The programs from the device alone (:meth:`_mla_programs`),
        so a graph bucket replays the grid it captured; the tiles each takes from the step's
        lengths (:func:`plan_mla_work`), staged on the device; a step of many tokens planned
        ``direct`` (:func:`mla_direct_store`), which bounds its partial outputs.

        On an eager step, rows of at least ``latent_prefill_min_tokens`` new tokens attend
        decompressed instead (``plan.latent_prefill``): their tokens get row -1 here too."""
        if meta.tree_masks is not None:
            raise MetadataError("metadata.tree_masks: latent attention verifies no draft trees yet")
        prefill = plan_latent_prefill(meta, None if graph else self.latent_prefill_min_tokens)
        skip = frozenset(prefill.rows) if prefill is not None else frozenset()
        rows, lens = causal_queries(meta.seq_lens_host, meta.query_lens_host, skip)
        pad = meta.num_tokens - len(rows)
        token_rows = staging.stage("latent_rows", array("i", rows) + array("i", [-1]) * pad)
        token_lens = staging.stage("latent_lens", array("i", lens) + array("i", [0]) * pad)
        launch = self._mla_launch(meta.device, meta.block_size)
        programs = self._mla_programs(launch, meta.device)
        heads, tokens = self.spec.num_heads, meta.num_tokens
        # Fixed by the token count (the bucket's, padded, in a graph), not by the lengths.
        direct = mla_direct_store(tokens, programs, heads, self.spec.latent_rank or 0)
        counters = launch.hopper_fused_merge  # (the zeros the merge in the kernel counts on)
        work = plan_mla_work(lens + [0] * pad, programs, launch.block_n, min_program_latents(heads), direct=direct,
                             counters=counters)  # fmt: skip
        staged = MLAWork(staging.stage("latent_work", work), programs, direct, counters)
        latent = LatentLaunch(token_rows, token_lens, staged, launch)
        return TritonStepPlan(meta, self.spec, self.name, (), (), (), None, None, latent, latent_prefill=prefill)

    def _attend_latent_prefill(
        self,
        query: torch.Tensor,
        kv: torch.Tensor,
        key_pe: torch.Tensor,
        plan: StepPlan,
        prefill: LatentPrefill,
        nope: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decompressed prefill kernel (on an sm_90 GPU the Gluon kernel for DeepSeek-shaped
        heads unless ``hopper_prefill`` is off); a ``qk_nope_head_dim`` that is not a power of
        two >= 16 (the kernel's dot width) runs the torch form instead."""
        if nope < 16 or nope & (nope - 1):
            return super()._attend_latent_prefill(query, kv, key_pe, plan, prefill, nope, out)
        query = query if query.stride(-1) == 1 else query.contiguous()
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        key_pe = key_pe if key_pe.stride(-1) == 1 else key_pe.contiguous()
        # The rows' offsets and tile index: staged at the step's first layer, reused by the rest.
        block_m = mla_prefill_block_m(query, kv, key_pe, nope, hopper=self.hopper_prefill)
        cached = self._prefill_index
        if cached is None or cached[0] is not plan or cached[1].block_m != block_m:
            index = stage_mla_prefill_index(prefill.query_lens, prefill.key_lens, block_m, query.device)
            cached = self._prefill_index = (plan, index)
        return mla_prefill(
            query,
            kv,
            key_pe,
            prefill.query_lens,
            prefill.key_lens,
            qk_nope_head_dim=nope,
            scale=self.spec.scale,
            hopper=self.hopper_prefill,
            index=cached[1],
            out=out,
        )

    def _plan_prefill(
        self, meta: AttentionMetadata, rows: tuple[int, ...], staging: PlanStaging, fixed: bool
    ) -> PrefillLaunch:
        """The tile index of ``rows``; ``fixed``: padded to the bucket's largest, with the tile
        height fixed too (never shrunk to this step's longest row)."""
        q_lens = meta.query_lens_host
        longest = None if fixed else max(q_lens[r] for r in rows)
        # An fp8 cache keeps the wide tiles at every block size (the small-block tile measured
        # 7-15% slower for it at block 32: benchmarks/results/prefill-blocks-2026-12-04.json).
        fp8 = self.spec.quantized_cache and not self.spec.token_scaled_cache
        config = self.prefill_config or default_prefill_config(
            self.spec.head_dim, self.compute_dtype, longest, None if fp8 else meta.block_size
        )
        pairs = prefill_tile_index(meta.seq_lens_host, q_lens, config.block_m, rows)
        values = array("i", [v for pair in pairs for v in pair])
        if not fixed:
            tiles = staging.stage("prefill_tiles", values).view(-1, 2)
            return PrefillLaunch(config, tiles, dequant=self._plan_dequant(meta, rows, config))
        grid_tiles = max_prefill_tiles(meta.padded_batch, meta.num_tokens, config.block_m)
        values.extend(array("i", PAD_TILE) * (grid_tiles - len(pairs)))
        tiles = staging.stage("prefill_tiles", values).view(-1, 2)
        count = staging.stage("prefill_tile_count", array("i", [len(pairs)]))
        programs = _PREFILL_PROGRAMS_PER_SM * self._sms(meta.device)
        dequant = self._plan_graph_dequant(meta, rows, config, staging) if self.graph_dequant_prefill else None
        return PrefillLaunch(config, tiles, count, programs, dequant=dequant)

    def _plan_dequant(
        self, meta: AttentionMetadata, rows: tuple[int, ...], config: PrefillConfig
    ) -> BlockDequant | None:
        """For an eager step over an 8-bit cache that the Hopper kernel could take (its shapes,
        no cap or sinks in the spec): the blocks to dequantize, unless their 16-bit copy would
        pass ``_DEQUANT_SCRATCH_BYTES``. Its arrays go up in pinned memory, without a host wait."""
        if not self._dequant_possible(meta, config):
            return None
        plan = plan_block_dequant(meta.seq_lens_host, rows, meta.block_size)
        if plan.num_blocks * self._dequant_block_bytes(meta.block_size) > _DEQUANT_SCRATCH_BYTES:
            return None
        direct = DirectStaging(meta.device)
        sources = direct.stage("prefill_dequant_sources", plan.sources).view(-1, 2)
        tables = direct.stage("prefill_dequant_tables", plan.tables).view(plan.batch, plan.width)
        return BlockDequant(sources, tables)

    def _plan_graph_dequant(
        self, meta: AttentionMetadata, rows: tuple[int, ...], config: PrefillConfig, staging: PlanStaging
    ) -> BlockDequant | None:
        """:meth:`_plan_dequant` for a CUDA-graph step (``graph_dequant_prefill``): shapes from
        the bucket alone -- the scratch holds the most blocks the bucket's prefill rows can
        read (:meth:`_graph_dequant_rows` rows x the table's width), the table has the
        bucket's rows and width -- so every replay of the bucket launches what was captured;
        None where that scratch would pass ``_DEQUANT_SCRATCH_BYTES`` (the bucket then runs
        the Triton prefill kernel, every step alike)."""
        if not self._dequant_possible(meta, config):
            return None
        batch, width = meta.block_tables.shape
        capacity = self._graph_dequant_rows(batch, meta.num_tokens) * width
        if capacity == 0 or capacity * self._dequant_block_bytes(meta.block_size) > _DEQUANT_SCRATCH_BYTES:
            return None
        lens = meta.seq_lens_host
        padded = [*lens, *[0] * (batch - len(lens))]  # the bucket's padding rows read nothing
        plan = plan_block_dequant(padded, rows, meta.block_size, width=width)
        if plan.batch != batch or plan.num_blocks > capacity:
            raise MetadataError(
                f"seq_lens_host: {len(lens)} rows reading {plan.num_blocks} blocks do not fit the bucket's "
                f"{batch} table rows and {capacity} scratch blocks"
            )
        sources = array("i", plan.sources)
        sources.extend(array("i", [-1]) * (2 * (capacity - plan.num_blocks)))
        return BlockDequant(
            staging.stage("prefill_dequant_sources", sources).view(-1, 2),
            staging.stage("prefill_dequant_tables", plan.tables).view(batch, width),
            staging.stage("prefill_dequant_count", array("i", [plan.num_blocks])),
        )

    def _counted_dequant_programs(self, layer: LayerCache, device: torch.device) -> int:
        """Programs along the scratch blocks of a graph step's counted block copy."""
        block_size = layer.key.shape[1]
        return counted_programs(self._sms(device), block_size, self.spec.num_kv_heads)

    def _graph_dequant_rows(self, rows: int, tokens: int) -> int:
        """The most prefill rows a graph step of ``rows`` rows and ``tokens`` tokens can have:
        each brings more than ``max_decode_query_len`` tokens (fewer go to the decode kernel)."""
        return min(rows, tokens // (self.max_decode_query_len + 1))

    def _dequant_block_bytes(self, block_size: int) -> int:
        """Bytes of one block's 16-bit copy, K and V."""
        spec = self.spec
        return 2 * block_size * spec.num_kv_heads * spec.head_dim * self.compute_dtype.itemsize

    def _dequant_possible(self, meta: AttentionMetadata, config: PrefillConfig) -> bool:
        """An 8-bit cache whose prefill rows the Hopper kernel could take over a 16-bit copy:
        enabled, no tuning override, its tile height, head size and block size, no cap, a GPU
        that runs it."""
        spec = self.spec
        if not spec.quantized_cache or not self.hopper_prefill:
            return False
        if self.prefill_config is not None or config.block_m != HOPPER_PREFILL_BLOCK_M:
            return False
        if spec.logit_softcap is not None or not hopper_prefill_shape_ok(spec.head_dim, meta.block_size):
            return False
        return hopper_prefill_possible(meta.device)

    def _bounding_decode_policy(self) -> DecodePolicy:
        """A policy whose item and partial-slot bounds (``max_decode_items``,
        ``max_decode_partials``) hold every policy :meth:`_decode_launch` returns, at any block
        size: the backend's own, with wave fill if any launch may take it (a launch's
        ``programs_per_sm`` is never above the policy's, and fewer programs an SM only lower
        the bounds). The fixed buffers are sized from it, before block sizes are known."""
        policy = self.decode_policy
        if self._given_decode_policy:
            return policy
        # Block 1 spans tiles; 2^20 holds whole tiles of any size: the two kinds of default.
        launches = [self._decode_launch(n, b) for n in (1, self.max_decode_query_len) for b in (1, 1 << 20)]
        fills = [p.wave_fill for _, p in launches]
        return replace(policy, wave_fill=max(fills)) if max(fills) > policy.wave_fill else policy

    def _decode_launch(
        self, query_len: int, block_size: int, device: torch.device | None = None
    ) -> tuple[DecodeConfig, DecodePolicy]:
        """The launch parameters and chunking policy for rows of up to ``query_len`` new
        tokens in blocks of ``block_size`` tokens on ``device`` (None: any): the given ones,
        else the defaults (the Hopper kernel's where :meth:`_hopper_decode_applies`, else
        ``default_decode_config``, which knows the block size; the config's
        ``programs_per_sm``, ``wave_fill`` and ``slot_share``, when set, replace the default
        policy's)."""
        if query_len > 1:
            config = self.verify_decode_config
        elif self._given_decode_config:
            config = self.decode_config
        elif device is not None and self._hopper_decode_applies(block_size, device):
            config = hopper_decode_config(
                self.cache_dtype, overlap=self.hopper_decode_overlap, ws_loader=self.hopper_decode_ws_loader
            )
        else:
            kv_dtype = self.cache_dtype if self.spec.quantized_cache else None
            config = default_decode_config(self.spec.head_dim, self.compute_dtype, kv_dtype, block_size=block_size)
        policy = self.decode_policy
        if config.programs_per_sm is not None and not self._given_decode_policy:
            policy = replace(policy, programs_per_sm=min(config.programs_per_sm, policy.programs_per_sm))
        if config.wave_fill is not None and not self._given_decode_policy:
            policy = replace(policy, wave_fill=config.wave_fill)
        if config.slot_share is not None and not self._given_decode_policy:
            policy = replace(policy, slot_share=config.slot_share)
        return config, policy

    def _hopper_decode_applies(self, block_size: int, device: torch.device) -> bool:
        """Whether one-token rows over blocks of ``block_size`` on ``device`` take the Hopper
        decode kernel: ``hopper_decode`` not False, an sm_90 GPU with Gluon, a bf16 / fp16 compute
        dtype over a float8_e4m3fn cache or one of that dtype, no cap or sinks, full attention
        or a window (not latent), and :func:`~attention.triton_kernels.decode_hopper.decode_hopper_shape_ok`;
        with ``hopper_decode`` None, a float8_e4m3fn cache only under bf16 queries."""
        spec, cache = self.spec, self.cache_dtype
        if self.hopper_decode is False or spec.latent_attention:
            return False
        if spec.logit_softcap is not None or spec.attention_sinks:
            return False
        if self.hopper_decode is None and cache == torch.float8_e4m3fn and self.compute_dtype != torch.bfloat16:
            return False
        if self.compute_dtype not in (torch.bfloat16, torch.float16):
            return False
        if cache not in (torch.float8_e4m3fn, self.compute_dtype):
            return False
        group = spec.num_heads // spec.num_kv_heads
        tile = hopper_block_n(cache)
        return decode_hopper_shape_ok(spec.head_dim, group, block_size, 1, tile) and hopper_prefill_possible(device)

    def _plan_decode(
        self, meta: AttentionMetadata, rows: tuple[int, ...], staging: PlanStaging, graph: bool
    ) -> tuple[tuple[DecodeLaunch, ...], DecodeWorkspace]:
        """One schedule per window. On a CUDA-graph step the grid comes from the bucket (the
        padded batch) alone, so every replay of the bucket launches exactly what was captured."""
        s_lens, q_lens = meta.seq_lens_host, meta.query_lens_host
        sms, kvh = self._sms(meta.device), self.spec.num_kv_heads
        every_row = len(rows) == len(q_lens)  # rows ascend: then they are every row, in order
        row_q_lens = list(q_lens) if every_row else [q_lens[r] for r in rows]
        starts = _starts(q_lens)
        row_tokens = starts[: len(rows)] if every_row else [starts[r] for r in rows]
        max_rows = meta.padded_batch if graph else None
        max_query_len = self._graph_query_len(meta.padded_batch, meta.num_tokens) if graph else None
        launch_query_len = max_query_len or max(row_q_lens, default=1)
        config, policy = self._decode_launch(launch_query_len, meta.block_size, meta.device)
        max_items = max_decode_items(meta.padded_batch, kvh, sms, policy) if graph else None
        variants = graph and len(self.graph_variants()) > 1  # each launch then names its combine choice
        launches = []
        partials = 1
        for window in self.windows:
            # A row's first new token sees the most: its window starts the range.
            ranges = [(0 if window is None else max(0, s_lens[r] - q_lens[r] + 1 - window), s_lens[r]) for r in rows]
            schedule = schedule_decode(
                ranges,
                num_kv_heads=kvh,
                num_sms=sms,
                block_n=config.block_n,
                max_items=max_items,
                max_rows=max_rows,
                policy=policy,
                chunk_len=self.decode_chunk_len,
                table_rows=rows,
                q_tokens=row_tokens,
                q_lens=row_q_lens,
                max_query_len=max_query_len,
            )
            items = staging.stage(f"decode_items_{window}", schedule.items).view(-1, ITEM_FIELDS)
            row_arr = staging.stage(f"decode_rows_{window}", schedule.rows).view(-1, ROW_FIELDS)
            combine = schedule.num_partials > 0 if variants else None
            launches.append(DecodeLaunch(window, schedule, row_arr, items, config, combine))
            partials = max(partials, schedule.num_partials)
        if graph:
            q = max_query_len or 1
            partials = max(1, max_decode_partials(meta.padded_batch, kvh, sms, policy, max_query_len=q))
        heads, d = self.spec.num_heads, self.spec.head_dim
        counter_rows = max(1, max(launch.schedule.grid_rows for launch in launches))
        workspace = DecodeWorkspace(
            part_o=staging.scratch("decode_part_o", torch.float32, partials * heads * d).view(partials, heads, d),
            part_lse=staging.scratch("decode_part_lse", torch.float32, partials * heads).view(partials, heads),
            counters=staging.scratch("decode_counters", torch.int32, counter_rows * kvh, zeroed=True).view(-1, kvh),
        )
        return tuple(launches), workspace

    # ---- per layer ---------------------------------------------------------------------

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None:
        meta = plan.metadata
        write_kv_cache(
            key, value, layer.key, layer.value, meta.slot_mapping, layer.k_scale, layer.v_scale, layer.k_centre
        )

    @property
    def rotates_kv_in_rotary_write(self) -> bool:
        """The fused kernel multiplies K and V up to head_dim 128 (its [d, d] matrix in four
        [d/2, d/2] quarters: 32 KiB in bf16). At 256 the quarters took 136 KiB of shared
        memory and spilled (sm_90, Triton 3.6), so those caches compose the boundary."""
        return self.spec.head_dim <= 128

    def _rotary_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        rotary: RotaryTable,
    ) -> torch.Tensor:
        meta = plan.metadata
        return rotary_write_kv(
            query,
            key,
            value,
            layer.key,
            layer.value,
            meta.slot_mapping,
            meta.positions,
            rotary.cos_sin,
            layer.k_scale,
            layer.v_scale,
            layer.k_centre,
            None if layer.rotation is None else self._rotation_of(layer.rotation),
            value_runs=self._value_runs(plan),
        )

    def _rotary_write_latent(
        self,
        query_latent: torch.Tensor,
        query_pe: torch.Tensor,
        latent: torch.Tensor,
        key_pe: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        rotary: RotaryTable,
        pairs: bool,
    ) -> torch.Tensor:
        meta = plan.metadata
        # On a step with decompressed rows, the kernel leaves their absorbed query unset.
        launch = plan.latent if isinstance(plan, TritonStepPlan) and plan.latent_prefill is not None else None
        return rotary_write_latent(
            query_latent,
            query_pe,
            latent,
            key_pe,
            layer.key,
            meta.slot_mapping,
            meta.positions,
            rotary.cos_sin,
            layer.k_scale,
            pairs=pairs,
            token_rows=launch.token_rows if launch is not None else None,
        )

    def _value_runs(self, plan: StepPlan) -> bool | None:
        """``rotary_write_kv``'s ``value_runs`` for a step: the kernel's own choice (None: not
        for int8) where the step can have prefill rows, else False, so a decode step's launches
        stay one kernel (a graph bucket's too: a mixed bucket always plans its prefill launch)."""
        prefill = isinstance(plan, TritonStepPlan) and plan.prefill is not None
        return None if self.value_runs and prefill else False

    def _attend(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        assert isinstance(plan, TritonStepPlan), "checked by AttentionBackend._check_step"
        meta = plan.metadata
        result = torch.empty_like(query) if out is None else out
        if plan.latent is not None and self.spec.latent_rank is not None:
            rank = self.spec.latent_rank
            # The kernel stores the first latent_rank channels of each head in place and zeroes
            # the rotary ones after them (only the first latent_rank are defined) when the
            # channels have unit stride (the dtype is the compute dtype, checked), else it
            # stores into a temporary.
            in_place = result.stride(-1) == 1
            values = mla_attention(
                query if query.stride(-1) == 1 else query.contiguous(),
                layer.key,
                meta.block_tables,
                plan.latent.token_rows,
                plan.latent.token_lens,
                kv_lora_rank=rank,
                scale=self.spec.scale,
                kv_scale=layer.k_scale,
                out=result if in_place else None,
                work=plan.latent.work,
                block_h=plan.latent.launch.block_h,
                block_n=plan.latent.launch.block_n,
                num_warps=plan.latent.launch.num_warps,
                num_stages=plan.latent.launch.num_stages,
                unrolled=plan.latent.launch.unrolled,
                f16_fp8_dots=plan.latent.launch.f16_fp8_dots,
                hopper=plan.latent.launch.hopper,
                hopper_ring=plan.latent.launch.hopper_ring,
                hopper_split=plan.latent.launch.hopper_split,
                hopper_fused_merge=plan.latent.launch.hopper_fused_merge,
                zero_rest=in_place,
                # Tokens attending decompressed: their rows are left unset (attend's contract),
                # and no merge program runs for those outside the absorbed tokens' bounds.
                skip_unseen=plan.latent_prefill is not None,
                merge_tokens=plan.latent_prefill.absorbed_bounds if plan.latent_prefill is not None else None,
            )
            if not in_place:
                result[..., :rank] = values
                result[..., rank:] = 0
            return result
        # The kernels store rows with unit stride along head_dim; anything else goes through
        # a temporary.
        target = result if result.stride(-1) == 1 else torch.empty_like(query)
        if query.stride(-1) != 1:
            query = query.contiguous()
        scale = self.spec.scale
        window = self.spec.window_of(layer.index)
        launch = plan.decode_for(window)
        if launch is not None and plan.workspace is not None:
            # The plan made the schedule from the metadata and the spec, so the launch's host
            # checks (schedule vs tensors) hold by construction; the kernel itself stays
            # inside its tensors whatever the device metadata says.
            paged_decode(
                query,
                layer.key,
                layer.value,
                meta.block_tables,
                launch.rows,
                launch.items,
                launch.schedule,
                plan.workspace,
                softmax_scale=scale,
                out=target,
                config=launch.config,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
                check=False,
                softcap=self.spec.logit_softcap,
                sinks=sinks,
                window=window,
                tree_masks=meta.tree_masks,
                combine=launch.combine is not False,
            )
        if plan.prefill is not None:
            self._prefill(query, layer, target, plan.prefill, meta, window, sinks)
        if target is not result:
            result.copy_(target)
        return result

    def _prefill(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        out: torch.Tensor,
        launch: PrefillLaunch,
        meta: AttentionMetadata,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> None:
        """The step's prefill rows of one layer, on the Hopper kernel where it applies (over a
        dequantized copy of an fp8 step's blocks where the plan made one), else on the Triton
        kernel."""
        scale = self.spec.scale
        common = (meta.seq_lens, meta.query_start_loc, launch.tile_index)
        dequant = launch.dequant
        if (
            dequant is not None
            and layer.k_scale is not None
            and layer.v_scale is not None
            and self._dequant_prefill_applies(query, layer, out, launch, window, sinks)
        ):
            key, value = dequantize_blocks(
                layer.key, layer.value, layer.k_scale, layer.v_scale, meta.block_tables, dequant.sources, query.dtype,
                count=dequant.count, programs=self._counted_dequant_programs(layer, query.device),
            )  # fmt: skip
            hopper_prefill(
                query, key, value, dequant.tables, *common, softmax_scale=scale, out=out,
                programs=self._sms(query.device), tile_count=launch.tile_count,
            )  # fmt: skip
        elif self._hopper_prefill_applies(query, layer, out, launch, window, sinks):
            hopper_prefill(
                query, layer.key, layer.value, meta.block_tables, *common, softmax_scale=scale, out=out,
                programs=self._sms(query.device), tile_count=launch.tile_count,
            )  # fmt: skip
        else:
            paged_prefill(
                query, layer.key, layer.value, meta.block_tables, *common, softmax_scale=scale, out=out,
                config=launch.config, window=window, k_scale=layer.k_scale, v_scale=layer.v_scale,
                tile_count=launch.tile_count, programs=launch.programs, softcap=self.spec.logit_softcap, sinks=sinks,
            )  # fmt: skip

    def _hopper_prefill_applies(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        out: torch.Tensor,
        launch: PrefillLaunch,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> bool:
        """Whether this layer's prefill rows run on the Hopper kernel over the cache itself:
        enabled, no tuning override, and what :func:`hopper_prefill_applies` asks of the tensors.
        (On a fixed CUDA-graph grid it runs one persistent program per SM, as it does eagerly.)"""
        return self._hopper_prefill_takes(
            query,
            out,
            launch,
            window,
            sinks,
            cache_dtype=layer.key.dtype,
            block_size=layer.block_size,
            tma_caches=all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (layer.key, layer.value)),
            quantized=layer.k_scale is not None or self.spec.quantized_cache,
        )

    def _dequant_prefill_applies(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        out: torch.Tensor,
        launch: PrefillLaunch,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> bool:
        """Whether this layer's prefill rows run on the Hopper kernel over a dequantized copy of
        their blocks: the plan made one (an eager step, an 8-bit cache, the kernel's shapes), the
        layer has per-KV-head scales (fp8) or per-token scales of one layout (int8,
        :mod:`attention.token_scales`), and the copy (16-bit, contiguous) suits the kernel."""
        if launch.dequant is None:
            return False
        key, k_scale, v_scale = layer.key, layer.k_scale, layer.v_scale
        if k_scale is None or v_scale is None or key.stride(-1) != 1 or key.stride(2) != key.shape[-1]:
            return False
        if key.dtype in FP8_KV_DTYPES:
            if k_scale.numel() != self.spec.num_kv_heads or v_scale.numel() != self.spec.num_kv_heads:
                return False  # one scale per KV head
        elif key.dtype in TOKEN_SCALED_KV_DTYPES:
            if k_scale.shape != key.shape[:3] or k_scale.stride() != v_scale.stride() or v_scale.shape != key.shape[:3]:
                return False  # one scale per (token, KV head), K's and V's laid out alike
        else:
            return False
        # The copy: fresh contiguous tensors in the query's dtype, without scales.
        return self._hopper_prefill_takes(
            query,
            out,
            launch,
            window,
            sinks,
            cache_dtype=query.dtype,
            block_size=layer.block_size,
            tma_caches=True,
            quantized=False,
        )

    def _hopper_prefill_takes(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        launch: PrefillLaunch,
        window: int | None,
        sinks: torch.Tensor | None,
        *,
        cache_dtype: torch.dtype,
        block_size: int,
        tma_caches: bool,
        quantized: bool,
    ) -> bool:
        """The checks both routes to the Hopper kernel share: it is enabled, no tuning override,
        and :func:`hopper_prefill_applies` for a cache of ``cache_dtype``."""
        if not self.hopper_prefill or self.prefill_config is not None:
            return False
        return hopper_prefill_applies(
            query,
            out,
            cache_dtype=cache_dtype,
            block_size=block_size,
            tma_caches=tma_caches,
            block_m=launch.config.block_m,
            window=window,
            quantized=quantized,
            softcap=self.spec.logit_softcap,
            sinks=sinks,
        )

    # ---- warm-up -----------------------------------------------------------------------

    def warmup(self, block_size: int, capacity: StepCapacity, device: torch.device) -> int:
        """Compile every kernel variant steps within ``capacity`` can reach -- the cache write
        (alone and fused with rotary), the decode kernel with and without the split combine,
        the prefill kernel at each tile height and on the fixed grid of CUDA-graph steps --
        for every window kind of the spec, by
        running each once on a scratch cache. Returns how many variants that is."""
        if self.spec.latent_attention:
            return self._warmup_latent(block_size, capacity, device)
        longest = capacity.max_blocks_per_seq * block_size
        decode_lengths = sorted({min(64, longest), longest})  # one chunk; several chunks
        heights = sorted({min(q, capacity.max_tokens, longest) for q in (9, 17, 33, 129)} - {1})
        steps = [[(n, 1)] for n in decode_lengths] + [[(q, q)] for q in heights]
        # Rows verifying drafts: each power of two of new tokens per row the decode kernel takes.
        q = 2
        while q <= min(self.max_decode_query_len, capacity.max_tokens, longest):
            steps.append([(longest, q)])
            q *= 2
        blocks = max(sum(cdiv(n, block_size) for n, _ in rows) for rows in steps)
        variants: set[tuple[object, ...]] = set()
        rotary = RotaryTable(torch.zeros(longest, self.spec.head_dim, dtype=torch.float32, device=device))
        sinks = torch.zeros(self.spec.num_heads, device=device) if self.spec.attention_sinks else None
        for window in self.windows:
            index = 0
            if self.spec.window_layers is not None:
                index = self.spec.window_layers.index(window is not None)
            layer = scratch_layer(self.spec, blocks, block_size, device, self.cache_dtype, index)
            for rows in steps:
                meta = synthetic_metadata(rows, block_size, device, capacity.max_blocks_per_seq)
                plan = self.plan(meta)
                assert isinstance(plan, TritonStepPlan), "this backend's plan"
                t, kvh, heads, d = meta.num_tokens, self.spec.num_kv_heads, self.spec.num_heads, self.spec.head_dim
                kv = torch.zeros(t, kvh, d, dtype=self.compute_dtype, device=device)
                query = torch.zeros(t, heads, d, dtype=self.compute_dtype, device=device)
                self.write_kv(kv, kv, layer, plan)
                self.rotary_write_kv(query, kv, kv, layer, plan, rotary)
                self.attend(query, layer, plan, sinks=sinks)
                variants.update({("write", self.spec.quantized_cache), ("rotary_write", self.spec.quantized_cache)})
                if value_runs_launched(layer.value, meta.num_tokens, self._value_runs(plan)):
                    variants.add(("rotary_write", "value_runs"))  # with its second kernel
                for launch in plan.decode:
                    variants.add(("decode", window, launch.schedule.query_len))
                    if launch.schedule.needs_combine and not launch.config.fused_combine:
                        variants.add(("combine",))
                if plan.prefill is not None:
                    variants.add(("prefill", window, plan.prefill.config))
                    # The fixed-grid (CUDA-graph) launch of a step with room for prefill rows.
                    fixed = self.plan(meta, graph=True)
                    assert isinstance(fixed, TritonStepPlan) and fixed.prefill is not None, "this backend's plan"
                    self.attend(query, layer, fixed, sinks=sinks)
                    variants.add(("prefill", window, fixed.prefill.config, "persistent"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(variants)

    def _warmup_latent(self, block_size: int, capacity: StepCapacity, device: torch.device) -> int:
        """Compile the cache write and the MLA kernel (one variant: the split count is a grid
        size) by running a decode step and a prompt on a scratch cache."""
        longest = capacity.max_blocks_per_seq * block_size
        steps = [[(longest, 1)], [(min(33, longest, capacity.max_tokens),) * 2]]
        blocks = max(sum(cdiv(n, block_size) for n, _ in rows) for rows in steps)
        layer = scratch_layer(self.spec, blocks, block_size, device, self.cache_dtype, 0)
        for rows in steps:
            meta = synthetic_metadata(rows, block_size, device, capacity.max_blocks_per_seq)
            plan = self.plan(meta)
            t, d = meta.num_tokens, self.spec.head_dim
            latent = torch.zeros(t, 1, d, dtype=self.compute_dtype, device=device)
            self.write_kv(latent, latent, layer, plan)
            self.attend(torch.zeros(t, self.spec.num_heads, d, dtype=self.compute_dtype, device=device), layer, plan)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 2

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
    return list(accumulate(query_lens[:-1], initial=0)) if query_lens else []
