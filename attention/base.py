"""The interface every paged-attention backend implements.

A backend is built once per model for one :class:`~attention.spec.AttentionSpec` (query and KV
heads, head_dim, dtypes, window). Then, per step:

1. :meth:`AttentionBackend.plan` reads the step's
   :class:`~attention.metadata.AttentionMetadata` once and decides everything the kernels need
   (which rows go to which kernel, split counts, work lists, tile indices, kernel
   configurations), putting the device-side part through a :class:`~attention.staging.PlanStaging`.
   The result is a frozen :class:`StepPlan`: a plain value, filled completely by ``plan``.
2. Per layer, :meth:`write_kv` and :meth:`attend` only check their tensors and launch.

Checks read only shapes, dtypes and host values, never device data, so they cost no sync. A
layer's cache tensors are checked the first time they are seen and remembered.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from attention.capabilities import BackendInfo, backend_info
from attention.checks import check_tensor, same_device
from attention.dtypes import dtype_name, torch_dtype
from attention.errors import ArgumentTypeError, InvalidArgumentError, MetadataError, UnsupportedSettingError
from attention.kv_rotation import rotate as rotate_basis
from attention.kv_rotation import rotate_back
from attention.latent_boundary import check_latent_boundary, compose_latent_boundary
from attention.latent_prefill import LatentPrefill, latent_key_slots, reference_latent_prefill
from attention.layer_cache import LayerCache
from attention.metadata import AttentionMetadata
from attention.quantize import dequantize
from attention.rotary import RotaryTable, rotate
from attention.spec import AttentionSpec
from attention.staging import BufferRequest, DirectStaging, PlanStaging, StepCapacity
from attention.token_scales import layout_problem
from attention.value_layout import is_token_major, value_is_readable

__all__ = ["LATENT_PREFILL_MIN_TOKENS", "AttentionBackend", "StepPlan"]

#: Default of ``AttentionBackend.latent_prefill_min_tokens``.
LATENT_PREFILL_MIN_TOKENS = 64


@dataclass(frozen=True)
class StepPlan:
    """Everything a backend decided for one step; every layer of the step reuses it.

    metadata: the step's metadata.
    spec:     the attention shape it was planned for (the backend's).
    backend:  the name of the backend that made it.
    Backends subclass it with their own decisions; every field is set by ``plan``.
    """

    metadata: AttentionMetadata
    spec: AttentionSpec
    backend: str
    #: KV groups (:mod:`kvcache.blocks.groups`): per group, this plan over the group's block
    #: tables and slot mapping (everything else is shared). Empty: one group, this plan.
    groups: tuple[StepPlan, ...] = field(default=(), kw_only=True, repr=False, compare=False)
    #: Latent attention (MLA): the rows that attend decompressed (None: every row attends
    #: through :meth:`AttentionBackend.attend`). See :mod:`attention.latent_prefill`.
    latent_prefill: LatentPrefill | None = field(default=None, kw_only=True, repr=False, compare=False)

    @property
    def graph_variant(self) -> str | None:
        """Which of its backend's captured variants of a CUDA-graph bucket this step replays
        (:meth:`AttentionBackend.graph_variants`): None where a backend captures one."""
        return None

    def as_graph_variant(self, variant: str | None) -> StepPlan:
        """This plan launching ``variant``'s kernels, to capture that variant of its bucket
        (a backend with variants overrides it). InvalidArgumentError for a variant this plan
        cannot take."""
        if variant != self.graph_variant:
            raise InvalidArgumentError(
                f"variant: {variant!r}; a {self.backend} plan has the one graph variant {self.graph_variant!r}"
            )
        return self

    def group(self, index: int) -> StepPlan:
        """The plan a layer of KV group ``index`` runs with (this plan without groups)."""
        return self.groups[index] if self.groups else self

    def for_group(self, metadata: AttentionMetadata) -> StepPlan:
        """This plan over another KV group's metadata (the same step, its own block tables and
        slots): the work split is the same, since it depends only on lengths and windows,
        which the groups share (a windowed group's tables hold ``PAD_BLOCK`` behind each row's
        window, which the kernels never read)."""
        return replace(self, metadata=metadata, groups=())


class AttentionBackend(ABC):
    """Paged attention over caches laid out ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Subclasses set ``name`` (a key of the backend table) and implement ``_plan``,
    ``_write_kv`` and ``_attend``; they may override ``buffer_requests`` and ``warmup``.
    Raises UnsupportedSettingError at construction when the table says the backend cannot
    serve ``spec``.
    """

    name: ClassVar[str]
    #: Whether the backend reads a token-major V (``attention.value_layout``, what kvcache
    #: allocates for 8-bit caches) besides a contiguous one.
    reads_token_major_values: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec):
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        info = self.info
        refused = [
            p
            # (the block size is checked per cache, when one is seen)
            for p in info.spec_problems(spec, block_size=info.block_sizes.factor, device_type=None)
        ]
        if refused:
            raise UnsupportedSettingError(
                "; ".join(f"spec.{p.parameter}: {p.value} is refused: {p.reason}; {p.fix}" for p in refused)
            )
        self.spec = spec
        self.compute_dtype = torch_dtype(spec.dtype)
        self.cache_dtype = torch_dtype(spec.cache_dtype)
        #: (K pointer, V pointer, shape, device) of layer caches already checked.
        self._accepted: set[tuple[object, ...]] = set()
        #: Latent attention: on eager steps, rows of at least this many new tokens attend
        #: decompressed (:mod:`attention.latent_prefill`); None: every row absorbed.
        self.latent_prefill_min_tokens: int | None = LATENT_PREFILL_MIN_TOKENS if spec.latent_attention else None
        #: The last plan whose decompressed keys' slots were found, and those slots.
        self._latent_slots: tuple[StepPlan, torch.Tensor] | None = None
        #: Rotated caches' matrices in the compute dtype, by the fp32 matrix's address (kept).
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def info(self) -> BackendInfo:
        """This backend's entry in the backend table."""
        return backend_info(self.name)

    def graph_variants(self) -> tuple[str | None, ...]:
        """The variants of each CUDA-graph bucket to capture: steps of one bucket whose plans
        launch different kernels (``StepPlan.graph_variant`` names a step's). One by default."""
        return (None,)

    # ---- per step ----------------------------------------------------------------------

    def plan(self, metadata: AttentionMetadata, *, staging: PlanStaging | None = None, graph: bool = False) -> StepPlan:
        """Decide everything for one step. Checks the metadata (shapes, dtypes, host lengths;
        no device sync) and raises MetadataError.

        staging: where device-side plan arrays go (default: fresh tensors, copied now).
        graph:   plan for CUDA-graph capture/replay: launch parameters depend only on the
                 bucket -- the padded batch and the number of tokens -- never on this step's
                 lengths. A bucket with more tokens than rows holds prefill rows (backends
                 with ``mixed_cuda_graphs`` only).
        """
        metadata.check()
        if metadata.tree_masks is not None:
            if not self.info.tree_masks:
                raise UnsupportedSettingError(
                    f"metadata.tree_masks: backend {self.name} has no draft-tree masks; "
                    "use the triton or reference backend"
                )
            if self.spec.sliding_window is not None:
                raise UnsupportedSettingError(
                    "metadata.tree_masks: not with a sliding window (a tree token's position is its depth, not its "
                    "index); verify drafts as a chain (tree_masks=None)"
                )
        if graph:
            self.check_graph_bucket(metadata.padded_batch, metadata.num_tokens, prefill_rows=metadata.max_query_len > 1)
        return self._plan(metadata, staging or DirectStaging(metadata.device), graph)

    def check_graph_bucket(self, padded_batch: int, num_tokens: int, *, prefill_rows: bool) -> None:
        """Raise unless this backend can plan a CUDA-graph step of ``padded_batch`` rows and
        ``num_tokens`` tokens (``prefill_rows``: some row brings more than one token):
        UnsupportedSettingError for a backend that cannot be captured (or not with room for
        prefill rows), MetadataError for prefill rows in a decode bucket (as many tokens as
        rows). A persistent builder calls it before writing the step."""
        if not self.info.cuda_graphs:
            raise UnsupportedSettingError(
                f"graph: backend {self.name} cannot be captured in a CUDA graph; use triton or flash_attn"
            )
        if num_tokens > padded_batch and not self.info.mixed_cuda_graphs:
            raise UnsupportedSettingError(
                f"graph: backend {self.name} captures pure decode steps only (one token per row), but this "
                f"bucket has {num_tokens} tokens for {padded_batch} rows; run steps with prefill rows eagerly, "
                "or use the triton backend"
            )
        if prefill_rows and num_tokens <= padded_batch:
            raise MetadataError(
                f"graph: this step has prefill rows but its bucket has {num_tokens} tokens for {padded_batch} "
                "rows; plan it in a bucket with more tokens than rows (pad_tokens)"
            )

    def buffer_requests(self, capacity: StepCapacity) -> list[BufferRequest]:
        """The staged arrays and scratch buffers plans may ask for, at most, for steps within
        ``capacity`` (a persistent builder allocates them once). Default: none."""
        return []

    # ---- per layer ---------------------------------------------------------------------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None:
        """Write the step's new tokens' K/V into their cache slots.

        key, value: [num_tokens, num_kv_heads, head_dim], the compute dtype (any token/head
                    strides; an fp8 cache quantizes with the layer's scales).
        layer:      this layer's cache (``kvcache.KVCacheTensors.layer(i)``).
        plan:       this step's plan; token t goes to slot ``plan.metadata.slot_mapping[t]``;
                    slots of -1 are skipped. Every other slot is left untouched.
        """
        meta = self._check_step(layer, plan)
        shape = (meta.num_tokens, self.spec.num_kv_heads, self.spec.head_dim)
        check_tensor("key", key, shape=shape, dtype=self.compute_dtype, device=layer.key.device)
        check_tensor("value", value, shape=shape, dtype=self.compute_dtype, device=layer.key.device)
        if layer.rotation is not None:  # the cache holds K and V rotated (attention.kv_rotation)
            rotation = self._rotation_of(layer.rotation)
            key, value = rotate_basis(key, rotation), rotate_basis(value, rotation)
        self._write_kv(key, value, layer, plan)

    def attend(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        *,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's new tokens over the paged K/V.

        query: [num_tokens, num_heads, head_dim], the compute dtype.
        layer: this layer's cache, already holding this step's new K/V (``write_kv`` first).
        out:   optional [num_tokens, num_heads, head_dim] to write into.
        sinks: float32 [num_heads], this layer's learned sink logits (finite), given exactly
               when the spec has ``attention_sinks``: head h's softmax denominator gains
               ``exp(sinks[h])`` (in the units of the scaled scores).
        Returns [num_tokens, num_heads, head_dim]. Rows of padding tokens are unspecified, and
        so are those of tokens that attend decompressed (``plan.latent_prefill``: their output
        comes from :meth:`attend_latent_prefill`).
        """
        meta = self._check_step(layer, plan)
        shape = (meta.num_tokens, self.spec.num_heads, self.spec.head_dim)
        check_tensor("query", query, shape=shape, dtype=self.compute_dtype, device=layer.key.device)
        if out is not None:
            check_tensor("out", out, shape=shape, dtype=self.compute_dtype, device=layer.key.device)
        if self.spec.attention_sinks:
            if sinks is None:
                raise InvalidArgumentError(
                    "sinks: the spec has attention_sinks; pass this layer's learned sink logits, float32 [num_heads]"
                )
            heads = (self.spec.num_heads,)
            check_tensor("sinks", sinks, shape=heads, dtype=torch.float32, device=layer.key.device)
        elif sinks is not None:
            raise InvalidArgumentError(
                "sinks: given, but the spec has no attention_sinks (AttentionSpec(attention_sinks=True))"
            )
        if layer.rotation is None:
            return self._attend(query, layer, plan, out, sinks)
        # K and V are stored rotated: so is the query (scores unchanged), and the output,
        # a mix of rotated values, is rotated back.
        rotation = self._rotation_of(layer.rotation)
        rotated = self._attend(rotate_basis(query, rotation), layer, plan, None, sinks)
        result = rotate_back(rotated, rotation)
        if out is None:
            return result
        return out.copy_(result)

    def gather_latent_keys(self, layer: LayerCache, plan: StepPlan) -> torch.Tensor:
        """The latents of ``plan.latent_prefill``'s keys, [num_keys, latent_dim] in the compute
        dtype (an fp8 latent dequantized), row by row (``layer`` already holds this step's;
        ``write_kv`` first)."""
        prefill = self._latent_prefill_of(plan)
        self._check_step(layer, plan)
        latents = layer.key.reshape(-1, 1, self.spec.head_dim)
        if self._latent_slots is None or self._latent_slots[0] is not plan:
            self._latent_slots = (plan, latent_key_slots(prefill, plan.metadata, layer.key.shape[0]))
        gathered = latents.index_select(0, self._latent_slots[1])
        return dequantize(gathered, layer.k_scale, self.compute_dtype)[:, 0]

    def attend_latent_prefill(
        self,
        query: torch.Tensor,
        kv: torch.Tensor,
        key_pe: torch.Tensor,
        plan: StepPlan,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``plan.latent_prefill``'s new tokens over their decompressed keys.

        query:  [P, H, n + e]: those tokens' ``q_nope`` and rotated ``q_pe`` per head (P =
                ``latent_prefill.num_tokens``; the compute dtype; channels contiguous, any
                token and head strides, e.g. a view of the query projection's output).
        kv:     [K, H, n + v]: per key (``gather_latent_keys``' order) and head, ``k_nope`` then
                the value (``kv_b_proj`` of the key's latent).
        key_pe: [K, e]: the keys' rotated shared part (the latents' last ``e`` channels).
        out:    [P, H, v] to write (channels contiguous; e.g. the rows of the layer's value
                buffer, ``latent_prefill.token_span``), else a new tensor.
        Returns ``out`` [P, H, v]. ``e`` is the spec's ``head_dim - latent_rank``.
        """
        prefill = self._latent_prefill_of(plan)
        rank = self.spec.latent_rank or 0
        rope = self.spec.head_dim - rank
        tokens, keys, heads = prefill.num_tokens, prefill.num_keys, self.spec.num_heads
        device = prefill.token_index.device
        check_tensor("query", query, shape=(tokens, heads, None), dtype=self.compute_dtype, device=device)
        nope = query.shape[2] - rope
        if nope < 1:
            raise InvalidArgumentError(f"query: {query.shape[2]} channels, not above the rotary part's {rope}")
        check_tensor("kv", kv, shape=(keys, heads, None), dtype=self.compute_dtype, device=device)
        if kv.shape[2] <= nope:
            raise InvalidArgumentError(f"kv: {kv.shape[2]} channels, not above qk_nope_head_dim {nope}")
        check_tensor("key_pe", key_pe, shape=(keys, rope), dtype=self.compute_dtype, device=device)
        if out is not None:
            check_tensor("out", out, shape=(tokens, heads, kv.shape[2] - nope), dtype=self.compute_dtype, device=device)
            if out.stride(-1) != 1:
                raise InvalidArgumentError(f"out: strides {tuple(out.stride())}; its channels must be contiguous")
        return self._attend_latent_prefill(query, kv, key_pe, plan, prefill, nope, out)

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
        """Torch, in :attr:`torch_math_dtype`; a backend with a kernel overrides it."""
        return reference_latent_prefill(
            query, kv, key_pe, prefill, qk_nope_head_dim=nope, scale=self.spec.scale, math_dtype=self.torch_math_dtype,
            out=out,
        )  # fmt: skip

    @property
    def torch_math_dtype(self) -> torch.dtype:
        """The precision of this backend's torch fallbacks (float32; the reference backend's
        is its ``compute_dtype``)."""
        return torch.float32

    def _latent_prefill_of(self, plan: StepPlan) -> LatentPrefill:
        if not isinstance(plan, StepPlan) or plan.backend != self.name or plan.spec != self.spec:
            raise MetadataError(f"plan: not made by this {self.name} backend for its spec; call its plan()")
        if plan.latent_prefill is None:
            raise MetadataError("plan.latent_prefill: this step has no decompressed rows (check it before calling)")
        return plan.latent_prefill

    def rotary_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        rotary: RotaryTable,
    ) -> torch.Tensor:
        """The layer's boundary before attention in one call: rotate ``query`` and ``key`` at
        the step's positions (:mod:`attention.rotary`), write the rotated key and ``value``
        into their cache slots as :meth:`write_kv` does, and return the rotated query.

        query:      [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
                    head_dim]; the compute dtype, any token and head strides with unit stride
                    along head_dim (e.g. views of one fused QKV projection). Not modified.
        rotary:     the model's table, on the cache's device, covering every position of the
                    step (each row's seq_len <= ``rotary.max_positions``).
        Returns the rotated query, a new contiguous [num_tokens, num_heads, head_dim] tensor
        (padding tokens' rows are rotated too; their K/V is not written). Backends whose
        table entry says ``fused_rotary`` do it in one kernel; the others compose it.
        """
        meta = self._check_step(layer, plan)
        spec, device = self.spec, layer.key.device
        t = meta.num_tokens
        check_tensor("query", query, shape=(t, spec.num_heads, spec.head_dim), dtype=self.compute_dtype, device=device)
        for name, x in (("key", key), ("value", value)):
            check_tensor(name, x, shape=(t, spec.num_kv_heads, spec.head_dim), dtype=self.compute_dtype, device=device)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if t and x.stride(-1) != 1:
                raise InvalidArgumentError(f"{name}: expected unit stride along head_dim, got strides {x.stride()}")
        _check_rotary(rotary, spec.head_dim, device, meta)
        if layer.rotation is not None and not self.rotates_kv_in_rotary_write:  # composed
            positions = meta.positions
            rotation = self._rotation_of(layer.rotation)
            self._write_kv(
                rotate_basis(rotate(key, positions, rotary), rotation), rotate_basis(value, rotation), layer, plan
            )
            return rotate(query, positions, rotary)
        return self._rotary_write_kv(query, key, value, layer, plan, rotary)

    def rotary_write_latent(
        self,
        query_latent: torch.Tensor,
        query_pe: torch.Tensor,
        latent: torch.Tensor,
        key_pe: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        rotary: RotaryTable,
        *,
        pairs: bool = False,
    ) -> torch.Tensor:
        """MLA's boundary before attention in one call (:mod:`attention.latent_boundary`):
        rotate ``query_pe`` and ``key_pe`` at the step's positions, write ``[latent,
        rotate(key_pe)]`` into each token's cache slot as :meth:`write_kv` writes a latent, and
        return the query ``[query_latent, rotate(query_pe)]`` for :meth:`attend`.

        query_latent: [num_tokens, num_heads, r], the absorbed query (r = ``spec.latent_rank``);
        query_pe:     [num_tokens, num_heads, e], the unrotated rotary query (e = ``head_dim - r``);
        latent:       [num_tokens, r], the normalised latent; key_pe: [num_tokens, e], unrotated;
                      the compute dtype, any token/head strides with unit stride along channels.
                      Not modified.
        rotary:       the model's table over the e rotary channels, on the cache's device,
                      covering every position of the step.
        pairs:        the rotary channels come interleaved (DeepSeek's ``rope_interleave``).
        Returns a new contiguous [num_tokens, num_heads, r + e] (padding tokens' rows included;
        their latent is not written). On a step with decompressed rows (``plan.latent_prefill``),
        the tokens :meth:`attend` does not take (those rows', and any padding) may get their
        rotary channels only: their first r are unspecified, so their rows of ``query_latent``
        need not be set. Backends whose table entry says ``fused_rotary`` do it in one kernel;
        the others compose it.
        """
        meta = self._check_step(layer, plan)
        device = layer.key.device
        check_latent_boundary(
            self.spec, self.compute_dtype, meta.num_tokens, device, query_latent, query_pe, latent, key_pe
        )
        _check_rotary(rotary, self.spec.head_dim - (self.spec.latent_rank or 0), device, meta)
        if not isinstance(pairs, bool):
            raise ArgumentTypeError(f"pairs: expected a bool, got {type(pairs).__name__}")
        return self._rotary_write_latent(query_latent, query_pe, latent, key_pe, layer, plan, rotary, pairs)

    # ---- warm-up -----------------------------------------------------------------------

    def warmup(self, block_size: int, capacity: StepCapacity, device: torch.device) -> int:
        """Compile every kernel variant steps within ``capacity`` can reach, so none compiles
        while serving. Returns how many variants it ran. Default: nothing to compile."""
        return 0

    # ---- for subclasses ----------------------------------------------------------------

    @abstractmethod
    def _plan(self, metadata: AttentionMetadata, staging: PlanStaging, graph: bool) -> StepPlan: ...

    @abstractmethod
    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, layer: LayerCache, plan: StepPlan) -> None: ...

    @abstractmethod
    def _attend(
        self,
        query: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def _rotary_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: LayerCache,
        plan: StepPlan,
        rotary: RotaryTable,
    ) -> torch.Tensor:
        """Composed from torch ops and :meth:`_write_kv`; a fused kernel overrides it."""
        positions = plan.metadata.positions
        self._write_kv(rotate(key, positions, rotary), value, layer, plan)
        return rotate(query, positions, rotary)

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
        """Composed from torch ops and :meth:`_write_kv`; a fused kernel overrides it."""
        query, rows = compose_latent_boundary(
            query_latent, query_pe, latent, key_pe, plan.metadata.positions, rotary, pairs=pairs
        )
        self._write_kv(rows, rows, layer, plan)
        return query

    def _device_type_for_checks(self, device_type: str) -> str:
        """The device type checked against the capabilities (the Triton backend maps its CPU
        interpreter mode to "cuda")."""
        return device_type

    # ---- checks ------------------------------------------------------------------------

    def _check_step(self, layer: LayerCache, plan: StepPlan) -> AttentionMetadata:
        if not isinstance(plan, StepPlan) or plan.backend != self.name or plan.spec != self.spec:
            made = f"backend {plan.backend!r}" if isinstance(plan, StepPlan) else type(plan).__name__
            raise MetadataError(
                f"plan: made by {made} for another spec; call plan() of this {self.name} backend for the step"
            )
        meta = plan.metadata
        meta.check_current()
        if not isinstance(layer, LayerCache):
            raise ArgumentTypeError(
                f"layer: expected a LayerCache (KVCacheTensors.layer(i)), got {type(layer).__name__}"
            )
        k = layer.key
        # The scales' addresses too: an int8 cache's kernels address them from the key's layout.
        ks, vs = layer.k_scale, layer.v_scale
        scales = None if ks is None else (ks.data_ptr(), None if vs is None else vs.data_ptr())
        centre = None if layer.k_centre is None else layer.k_centre.data_ptr()
        rotation = None if layer.rotation is None else layer.rotation.data_ptr()
        seen = (k.data_ptr(), layer.value.data_ptr(), k.shape, k.device, k.dtype, scales, centre, rotation)
        if seen not in self._accepted:
            self._check_layer(layer, meta)
            self._accepted.add(seen)
        if k.shape[1] != meta.block_size:
            raise MetadataError(
                f"layer.key: block_size {k.shape[1]} differs from the metadata's block_size "
                f"{meta.block_size}; build the metadata from the manager that owns this cache"
            )
        if k.device != meta.device and not same_device(k.device, meta.device):
            raise MetadataError(
                f"metadata: on {meta.device}, but the cache is on {k.device}; build it for the cache's device"
            )
        return meta

    @property
    def rotates_kv_in_rotary_write(self) -> bool:
        """Whether ``_rotary_write_kv`` stores K and V in a rotated cache's basis itself (it
        then gets ``layer.rotation``); otherwise ``rotary_write_kv`` composes rotary, the
        products and ``_write_kv``. Default: no."""
        return False

    def _rotation_of(self, rotation: torch.Tensor) -> torch.Tensor:
        """``rotation`` in the compute dtype and row-major (the fused kernels index it so,
        whatever the strides it came with), made once per matrix: each product is then one
        kernel in the compute dtype (accumulating in fp32), with no casts of the activations
        (in a 16-bit dtype the matrix's entries round once, about as much as the product's
        result does)."""
        entry = self._rotations.get(rotation.data_ptr())
        if entry is None or entry[0] is not rotation:  # (held: its address is not reused)
            entry = (rotation, rotation.to(self.compute_dtype).contiguous())
            self._rotations[rotation.data_ptr()] = entry
        return entry[1]

    def _check_rotation(self, layer: LayerCache, rotation: torch.Tensor, head_dim: int) -> None:
        """A rotated cache (``LayerCache.rotation``): an fp32 [head_dim, head_dim] matrix on the
        cache's device, not with key centring, not for a latent (MLA) cache (its latent is
        read by the decompressed prefill too, which knows no rotation). That it is orthonormal
        is checked where it is set (``kvcache.KVCacheTensors``), on the host: no device sync here."""
        check_tensor(
            "layer.rotation", rotation, shape=(head_dim, head_dim), dtype=torch.float32, device=layer.key.device
        )
        if self.spec.latent_attention:
            raise UnsupportedSettingError(
                "layer.rotation: a latent (MLA) cache is stored unrotated; pass a layer without a rotation"
            )
        if layer.k_centre is not None:
            raise UnsupportedSettingError(
                "layer.rotation: with key centring (layer.k_centre); keep one of them (kvcache refuses both)"
            )

    def _check_key_centre(self, centre: torch.Tensor, kv_heads: int, head_dim: int, device: torch.device) -> None:
        """Key centring (``LayerCache.k_centre``) is exact only where a common shift of a
        query's scores changes nothing, and built for the int8 cache only."""
        spec = self.spec
        if not spec.token_scaled_cache:
            raise UnsupportedSettingError(
                f"layer.k_centre: key centring is built for the int8 cache, not {spec.cache_dtype}; "
                "pass a layer without it"
            )
        if spec.logit_softcap is not None or spec.attention_sinks:
            what = "a score cap" if spec.logit_softcap is not None else "attention sinks"
            raise UnsupportedSettingError(
                f"layer.k_centre: with {what} a common shift of a query's scores changes the softmax, so "
                "centred keys would change the output; leave the keys uncentred for this model"
            )
        check_tensor("layer.k_centre", centre, shape=(kv_heads, head_dim), dtype=torch.float32, device=device)
        if not centre.is_contiguous():
            raise UnsupportedSettingError(f"layer.k_centre: strides {centre.stride()}; pass a contiguous tensor")

    def _check_layer(self, layer: LayerCache, meta: AttentionMetadata) -> None:
        spec = self.spec
        check_tensor(
            "layer.key", layer.key, shape=(None, None, spec.num_kv_heads, spec.head_dim), dtype=self.cache_dtype
        )
        n, bs, kvh, d = layer.key.shape
        check_tensor("layer.value", layer.value, shape=(n, bs, kvh, d), dtype=self.cache_dtype, device=layer.key.device)
        if is_token_major(layer.value) and not self.reads_token_major_values:
            raise UnsupportedSettingError(
                f"layer.value: token-major (attention.value_layout), which backend {self.name} does not read; "
                "pass a contiguous value tensor"
            )
        if spec.token_scaled_cache:
            problem = layout_problem(layer.key, layer.value, layer.k_scale, layer.v_scale)
            if problem is not None:
                raise UnsupportedSettingError(
                    f"{problem}: an int8 cache's values and per-token scales share each block's memory "
                    "(attention.token_scales); allocate it with kvcache"
                )
        elif not layer.key.is_contiguous() or not value_is_readable(layer.value):
            raise UnsupportedSettingError(
                "layer.key/layer.value: expected contiguous tensors (the value may also be token-major, "
                f"attention.value_layout), got strides {layer.key.stride()} and {layer.value.stride()}; "
                "allocate them with kvcache"
            )
        problems = self.info.spec_problems(
            spec,
            block_size=bs,
            device_type=self._device_type_for_checks(layer.key.device.type),
            kv_cache_dtype=dtype_name(layer.key.dtype),
        )
        if problems:
            p = problems[0]
            raise UnsupportedSettingError(f"layer.key: {p.parameter} {p.value} is refused: {p.reason}; {p.fix}")
        if spec.quantized_cache and not spec.token_scaled_cache:
            for name, scale in (("k_scale", layer.k_scale), ("v_scale", layer.v_scale)):
                check_tensor(f"layer.{name}", scale, shape=(kvh,), dtype=torch.float32, device=layer.key.device)
        if layer.k_centre is not None:
            self._check_key_centre(layer.k_centre, kvh, d, layer.key.device)
        if layer.rotation is not None:
            self._check_rotation(layer, layer.rotation, d)
        if spec.window_layers is not None:
            spec.window_of(layer.index)  # raises for a layer index outside the pattern


def _check_rotary(rotary: object, head_dim: int, device: torch.device, meta: AttentionMetadata) -> None:
    """Raise unless ``rotary`` is a RotaryTable of ``head_dim`` channels on ``device`` covering
    every position of the step."""
    if not isinstance(rotary, RotaryTable):
        raise ArgumentTypeError(f"rotary: expected a RotaryTable, got {type(rotary).__name__}")
    if rotary.head_dim != head_dim or not same_device(rotary.device, device):
        raise InvalidArgumentError(
            f"rotary: a table of head_dim {rotary.head_dim} on {rotary.device}; the layer needs head_dim "
            f"{head_dim} on {device} (RotaryTable.build with this model's inv_freq on the cache's device)"
        )
    longest = max(meta.seq_lens_host, default=0)
    if longest > rotary.max_positions:
        raise InvalidArgumentError(
            f"rotary: the table covers {rotary.max_positions} positions, but a row of this step reaches "
            f"{longest}; build the table for the longest sequence the engine serves"
        )
