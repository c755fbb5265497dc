"""The ``triton`` backend: our own paged-attention kernels (:mod:`attention.triton_kernels`).

Plan once per step: :meth:`TritonBackend.plan` sends every one-token row to the decode
kernel and every longer row to the prefill kernel (a mixed batch runs both, on disjoint output
rows), and keeps what every layer of the step reuses: the decode schedule (rows cut into
equal-token chunks) with its device metadata and workspace, and the prefill tile index, all
derived from host-side lengths, so no layer call ever waits on the device.

Runs on CUDA. Under ``TRITON_INTERPRET=1`` (set before this module is imported) it also
accepts CPU tensors and runs the same kernels in Triton's interpreter, slowly, for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from attention.base import AttentionBackend, StepPlan
from attention.checks import same_device
from attention.metadata import AttentionMetadata
from attention.triton_kernels import (
    DecodeConfig,
    DecodePolicy,
    DecodeSchedule,
    DecodeWorkspace,
    PrefillConfig,
    allocate_decode_workspace,
    decode_metadata,
    default_decode_config,
    default_prefill_config,
    interpreter_requested,
    kernels_interpreted,
    paged_decode,
    paged_prefill,
    prefill_tile_index,
    schedule_decode,
    write_kv_cache,
)

__all__ = ["DecodeLaunch", "TritonBackend", "TritonStepPlan"]

#: SMs assumed when planning for the CPU interpreter: the H200's, so tests exercise the same
#: chunking decisions the GPU makes.
INTERPRETER_NUM_SMS = 132

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
    """What the decode launcher needs besides the layer's tensors, made once per step.

    rows: int32 [grid_rows, 4], items: int32 [grid_items, 8] (see decode_schedule), on the
    metadata's device; workspace sized for the schedule."""

    schedule: DecodeSchedule
    rows: torch.Tensor
    items: torch.Tensor
    workspace: DecodeWorkspace


@dataclass(frozen=True)
class TritonStepPlan(StepPlan):
    """One step's plan for the Triton kernels.

    decode_rows:   batch rows with one new token: the decode kernel takes them.
    prefill_rows:  the other rows: the prefill kernel takes them.
    num_sms:       SMs of the metadata's device (drives the chunk length).
    decode_policy: how decode chunks are chosen; ``decode_chunk_len`` forces a length.
    What depends on the layer's shape (decode schedule: its KV heads; workspace: its heads)
    or on the kernel configuration (chunk multiple of block_n; tile index: the tile height)
    is computed at the first layer that needs it and reused by every later layer of the step.
    """

    decode_rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    num_sms: int
    decode_policy: DecodePolicy
    decode_chunk_len: int | None = None
    _derived: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def use_decode(self) -> bool:
        """Every row has one new token: only the decode kernel runs."""
        return not self.prefill_rows

    @property
    def decode_max_seq_len(self) -> int:
        lens = self.metadata.seq_lens_host
        return max((lens[r] for r in self.decode_rows), default=0)

    @property
    def prefill_max_query_len(self) -> int:
        lens = self.metadata.query_lens_host
        return max((lens[r] for r in self.prefill_rows), default=0)

    def decode_schedule(self, num_kv_heads: int, block_n: int) -> DecodeSchedule:
        """The decode rows cut into chunks for a layer with ``num_kv_heads`` KV heads and a
        kernel tile of ``block_n`` tokens: row d of the schedule is batch row
        ``decode_rows[d]`` (its block-table row), attending K/V [0, seq_len) with the query
        token it owns (row i itself in a pure decode step)."""
        key = ("schedule", num_kv_heads, block_n)
        if key not in self._derived:
            meta = self.metadata
            starts = _starts(meta.query_lens_host)
            self._derived[key] = schedule_decode(
                [(0, meta.seq_lens_host[r]) for r in self.decode_rows],
                num_kv_heads=num_kv_heads,
                num_sms=self.num_sms,
                block_n=block_n,
                policy=self.decode_policy,
                chunk_len=self.decode_chunk_len,
                table_rows=self.decode_rows,
                q_tokens=[starts[r] for r in self.decode_rows],
            )
        schedule = self._derived[key]
        assert isinstance(schedule, DecodeSchedule), f"memo holds {type(schedule).__name__} for {key}"
        return schedule

    def decode_launch(self, num_heads: int, num_kv_heads: int, head_dim: int, block_n: int) -> DecodeLaunch:
        """The schedule with its device metadata and a workspace (allocated once per step)."""
        key = ("decode", num_heads, num_kv_heads, head_dim, block_n)
        if key not in self._derived:
            schedule = self.decode_schedule(num_kv_heads, block_n)
            device = self.metadata.device
            rows, items = decode_metadata(schedule, device)
            workspace = allocate_decode_workspace(
                max_rows=schedule.grid_rows,
                max_partials=schedule.num_partials,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                device=device,
            )
            self._derived[key] = DecodeLaunch(schedule, rows, items, workspace)
        launch = self._derived[key]
        assert isinstance(launch, DecodeLaunch), f"memo holds {type(launch).__name__} for {key}"
        return launch

    def first_time(self, key: tuple[object, ...]) -> bool:
        """True the first time ``key`` is asked about in this step (then remembered)."""
        if key in self._derived:
            return False
        self._derived[key] = True
        return True

    def tile_index(self, block_m: int) -> torch.Tensor:
        """int32 [num_tiles, 2] (row, tile) of the prefill rows, heaviest tile first."""
        key = ("tiles", block_m)
        if key not in self._derived:
            meta = self.metadata
            pairs = prefill_tile_index(meta.seq_lens_host, meta.query_lens_host, block_m, self.prefill_rows)
            self._derived[key] = self._to_device(pairs)
        index = self._derived[key]
        assert isinstance(index, torch.Tensor), f"memo holds {type(index).__name__} for {key}"
        return index

    def _to_device(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """Host pairs to the metadata's device with one non-blocking copy from pinned
        memory, so the step never waits for the device."""
        host = torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2)
        if self.metadata.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.metadata.device, non_blocking=True)


def _starts(query_lens: tuple[int, ...]) -> list[int]:
    """First query token of each row (query_start_loc, on the host)."""
    starts, total = [], 0
    for q in query_lens:
        starts.append(total)
        total += q
    return starts


class TritonBackend(AttentionBackend):
    """Paged attention with our Triton kernels.

    All arguments are optional tuning knobs (the registry builds it with none):
      decode_config / prefill_config: fixed launch parameters instead of the per-shape
                      defaults (``default_decode_config`` / ``default_prefill_config``);
      decode_policy:  how the decode chunk length follows the batch and the GPU size;
      decode_chunk_len: force this decode chunk length (tests, sweeps);
      num_sms:        plan as if the GPU had this many SMs.
    """

    name = "triton"

    def __init__(
        self,
        *,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        decode_policy: DecodePolicy | None = None,
        decode_chunk_len: int | None = None,
        num_sms: int | None = None,
    ):
        super().__init__()
        if decode_chunk_len is not None and decode_chunk_len < 1:
            raise ValueError(f"decode_chunk_len: {decode_chunk_len} must be >= 1 (or None to choose per step)")
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self.decode_policy = decode_policy or DecodePolicy()
        self.decode_chunk_len = decode_chunk_len
        self.num_sms = num_sms

    def _plan(self, metadata: AttentionMetadata) -> TritonStepPlan:
        lens = metadata.query_lens_host
        return TritonStepPlan(
            metadata=metadata,
            decode_rows=tuple(r for r, q in enumerate(lens) if q == 1),
            prefill_rows=tuple(r for r, q in enumerate(lens) if q > 1),
            num_sms=self.num_sms or _num_sms(metadata.device),
            decode_policy=self.decode_policy,
            decode_chunk_len=self.decode_chunk_len,
        )

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: StepPlan,
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if not isinstance(plan, TritonStepPlan):
            plan = self._plan(plan.metadata)  # a plan made by another backend
        meta = plan.metadata
        if not same_device(meta.device, k_cache.device):
            raise ValueError(
                f"metadata: on {meta.device}, but k_cache is on {k_cache.device}; build the "
                f"metadata for the cache's device"
            )
        result = torch.empty_like(query) if out is None else out
        # The kernels store rows with unit stride along head_dim; anything else goes
        # through a temporary.
        target = result if result.stride(-1) == 1 else torch.empty_like(query)
        head_dim, kv_heads = k_cache.shape[3], k_cache.shape[2]
        if plan.decode_rows:
            decode_config = self.decode_config or default_decode_config(head_dim, query.dtype)
            launch = plan.decode_launch(query.shape[1], kv_heads, head_dim, decode_config.block_n)
            # The launcher's host checks once per step and shape: later layers pass tensors
            # of the same shapes (the base class checks each call's shapes and dtypes).
            shapes = ("decode checked", decode_config, *query.shape, *query.stride(), *target.stride(), *k_cache.shape)
            paged_decode(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                launch.rows,
                launch.items,
                launch.schedule,
                launch.workspace,
                softmax_scale=softmax_scale,
                out=target,
                config=decode_config,
                check=plan.first_time(shapes),
            )
        if plan.prefill_rows:
            config = self.prefill_config or default_prefill_config(head_dim, query.dtype, plan.prefill_max_query_len)
            paged_prefill(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                plan.tile_index(config.block_m),
                softmax_scale=softmax_scale,
                out=target,
                config=config,
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
            raise ValueError(_CPU_REFUSED)
        if not kernels_interpreted():
            raise ValueError(
                "the triton backend got CPU tensors and TRITON_INTERPRET=1, but its kernels "
                "were imported before TRITON_INTERPRET was set and are compiled for CUDA; "
                "set TRITON_INTERPRET=1 before importing attention.triton_backend"
            )
        return "cuda"
