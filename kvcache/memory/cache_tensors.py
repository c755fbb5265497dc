"""The KV-cache tensors: one K and one V tensor per layer, carved from one allocation.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (what every backend
declares); an 8-bit cache's V holds each block's memory token-major
(:mod:`attention.value_layout`), a view with that logical shape. All layers live in one
``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` tensor, so the whole cache
is a single allocation that either fits or fails cleanly, and a block copy across every
layer is a single indexing op.

KV groups (a model mixing full and windowed layers, :mod:`kvcache.blocks.groups`): the
allocation has ``group_size`` layer tensors instead of ``num_layers``, and model layer ``i``
uses tensor ``layout.place(i)[1]`` at the block ids of its group's tables (layers of different
groups alias the same memory at different block ids). ``layer(i)`` still takes the model's
layer index, so a model needs no change beyond passing each layer its group's metadata.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from attention.checks import require_int
from attention.dtypes import dtype_info, torch_dtype
from attention.errors import ArgumentTypeError, CacheAllocationError, InvalidArgumentError
from attention.kv_rotation import hadamard_rotation
from attention.layer_cache import LayerCache
from attention.token_scales import layer_views
from attention.value_layout import token_major_view, uses_token_major_values
from kvcache.blocks.groups import KVGroupLayout
from kvcache.config.rules import MAX_BLOCKS
from kvcache.config.schema import KVCacheConfig
from kvcache.config.sizes import format_bytes

if TYPE_CHECKING:
    from kvcache.parallel.heads import TensorParallel

__all__ = [
    "KVCacheTensors",
    "allocate_kv_cache",
    "free_device_memory",
    "num_blocks_for",
    "resolve_device",
]


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when present, else cpu. Raises CacheAllocationError for a CUDA device
    that is not there, naming the fix."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise CacheAllocationError(
                f"cache.device: {device!r}, but torch sees no CUDA device; set cache.device "
                f"to cpu or auto, or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise CacheAllocationError(
                f"cache.device: {device!r}, but only {count} CUDA device(s) exist; use cuda:0"
                f"{f' to cuda:{count - 1}' if count > 1 else ''}"
            )
    return resolved


def free_device_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now (CUDA: driver's free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for(config: KVCacheConfig, free_bytes: int, tp: TensorParallel | None = None) -> int:
    """Blocks the config asks for: ``num_blocks``, or its budget over the bytes per block of
    one rank's cache (``tp``: a tensor-parallel rank; the budget is per rank, like vLLM's
    ``gpu_memory_utilization``).

    With a fractional budget the answer depends on this device's free memory, which differs
    between ranks: a tensor-parallel engine must agree on one count (the minimum over ranks)
    before allocating, because every rank's block manager must hand out the same block ids.
    """
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    assert config.cache.memory_budget is not None, "the config validator requires one of them"
    return config.cache.memory_budget.bytes_given(free_bytes) // config.bytes_per_block_per_rank(tp)


@dataclass
class KVCacheTensors:
    """Per-layer K/V cache tensors, views into one allocation.

    storage: [num_tensors, 2, num_blocks, block_size, num_kv_heads, head_dim] (K at [:, 0],
             V at [:, 1]; an 8-bit cache's V blocks are stored token-major, ``[kv_heads,
             head_dim, block_size]`` each, and ``layer(i).value`` is the permuted view that
             reads them with the logical shape), the cache dtype; ``num_tensors`` is the
             model's layer count, or
             ``layout.group_size`` with KV groups. A latent cache (MLA) has one part,
             ``[num_tensors, 1, num_blocks, block_size, 1, latent_dim]``: a layer's K and V
             views are the same tensor.
             An int8 cache (:mod:`attention.token_scales`) has ``rows_per_block`` rows per
             block instead of ``block_size``: each block's values, then its per-token fp16
             scales; ``layer(i)`` hands out views of both.
    scales:  fp32 [num_layers, 2, num_kv_heads] dequantization scales of an fp8 cache, per
             model layer (None otherwise, int8 included: its scales are in the blocks).
    layout:  the model's KV groups when it has more than one (None: one table per sequence
             serves every layer, and tensor ``i`` is layer ``i``'s).
    tokens_per_block: the block size of an int8 cache (whose storage has more rows than
             tokens); None: ``storage.shape[3]``.
    key_centres: an int8 cache's key centring, fp32 [num_layers, num_kv_heads, head_dim]
             (:meth:`set_key_centres`), or None.
    rotation: fp32 [head_dim, head_dim] orthonormal, or None: every layer stores its K and V
             rotated by it (:mod:`attention.kv_rotation`, ``cache.kv_rotation: hadamard``);
             not with key centres, not for a latent cache. Moved to the cache's device.
    ``layer(i)`` hands out the same :class:`~attention.LayerCache` object every time (until
    :meth:`set_key_centres` replaces them).
    """

    storage: torch.Tensor
    scales: torch.Tensor | None = None
    layout: KVGroupLayout | None = None
    tokens_per_block: int | None = None
    key_centres: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    _layers: list[LayerCache] = field(init=False, repr=False)
    _groups: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        s = self.scales
        tensors = self.storage.shape[0]
        if self.layout is None:
            places = [(0, i) for i in range(tensors)]
        else:
            if not isinstance(self.layout, KVGroupLayout) or self.layout.group_size != tensors:
                raise InvalidArgumentError(
                    f"layout: a KV group layout of group_size {getattr(self.layout, 'group_size', '?')} for "
                    f"{tensors} layer tensors; allocate the cache with the same layout"
                )
            places = [self.layout.place(i) for i in range(self.layout.num_layers)]
        if s is not None and s.shape[0] != len(places):
            raise InvalidArgumentError(f"scales: {s.shape[0]} layers of scales for a model of {len(places)} layers")
        self._groups = [group for group, _ in places]
        self._check_rotation()
        two_parts = self.storage.shape[1] == 2
        token_major = two_parts and uses_token_major_values(self.storage.dtype)
        if self.storage.dtype == torch.int8:
            self._layers = [
                replace(self._int8_layer(i, t), rotation=self.rotation) for i, (_, t) in enumerate(places)
            ]
            if self.key_centres is not None:
                centres, self.key_centres = self.key_centres, None
                self.set_key_centres(centres)
            return
        if self.key_centres is not None:
            raise InvalidArgumentError(f"key_centres: key centring is built for the int8 cache, not {self.dtype}")
        self._layers = [
            LayerCache(
                self.storage[t, 0],
                # The same tensor for a latent cache (one part); an 8-bit V is token-major.
                token_major_view(self.storage[t, 1]) if token_major else self.storage[t, -1],
                index=i,
                k_scale=None if s is None else s[i, 0],
                # A latent cache's K and V views are one tensor: they share the K scale.
                v_scale=None if s is None else s[i, 1 if self.storage.shape[1] == 2 else 0],
                rotation=self.rotation,
            )
            for i, (_, t) in enumerate(places)
        ]

    def _check_rotation(self) -> None:
        """``rotation``: fp32-convertible [head_dim, head_dim], finite and orthonormal (checked
        on the host, once), for a cache of K and V parts without key centres."""
        if self.rotation is None:
            return
        d = int(self.storage.shape[-1])
        r = self.rotation
        if not isinstance(r, torch.Tensor) or tuple(r.shape) != (d, d) or not r.is_floating_point():
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            raise InvalidArgumentError(f"rotation: expected a floating-point [{d}, {d}] tensor, got {got}")
        if self.storage.shape[1] != 2:
            raise InvalidArgumentError("rotation: a latent (MLA) cache is stored unrotated; allocate it without one")
        if self.key_centres is not None:
            raise InvalidArgumentError("rotation: not with key_centres; keep one of them")
        host = r.detach().to("cpu", torch.float64)
        identity = torch.eye(d, dtype=torch.float64)
        if not bool(torch.isfinite(host).all()) or not torch.allclose(host @ host.T, identity, atol=1e-5):
            raise InvalidArgumentError(
                "rotation: not orthonormal (rotation @ rotation.T is not the identity); use "
                "attention.kv_rotation.hadamard_rotation"
            )
        self.rotation = r.detach().to(device=self.storage.device, dtype=torch.float32).contiguous()

    def _int8_layer(self, index: int, tensor: int) -> LayerCache:
        """Model layer ``index``'s views of an int8 cache's tensor ``tensor``: values and
        per-token scales of K and of V (:func:`attention.token_scales.layer_views`)."""
        if self.storage.shape[1] != 2 or self.tokens_per_block is None:
            raise InvalidArgumentError(
                "storage: an int8 cache has K and V parts and tokens_per_block; allocate it with allocate_kv_cache"
            )
        return layer_views(self.storage[tensor], self.tokens_per_block, index)

    def layer(self, index: int) -> LayerCache:
        """Model layer ``index``'s cache (what ``write_kv`` and ``attend`` take). Raises
        InvalidArgumentError for an index outside ``[0, num_layers)`` (no negative indexing: a
        layer counted from the end is a bug, not a request)."""
        return self._layers[require_int("layer", index, minimum=0, maximum=len(self._layers) - 1)]

    def group_of(self, index: int) -> int:
        """The KV group of model layer ``index`` (whose block tables it reads): 0 without groups."""
        return self._groups[require_int("layer", index, minimum=0, maximum=len(self._groups) - 1)]

    @property
    def key(self) -> list[torch.Tensor]:
        return [layer.key for layer in self._layers]

    @property
    def value(self) -> list[torch.Tensor]:
        return [layer.value for layer in self._layers]

    @property
    def num_layers(self) -> int:
        """The model's layers (what ``layer`` takes)."""
        return len(self._layers)

    @property
    def num_tensors(self) -> int:
        """Layer tensors of the allocation: ``num_layers``, or ``layout.group_size`` with KV groups."""
        return int(self.storage.shape[0])

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[2]

    @property
    def block_size(self) -> int:
        return self.tokens_per_block if self.tokens_per_block is not None else self.storage.shape[3]

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id (with KV groups: ``group_size`` layers' K/V)."""
        return self.nbytes // self.num_blocks

    def set_scales(self, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Set an fp8 cache's per-KV-head dequantization scales of ``layer`` (fp32
        [num_kv_heads] each, positive and finite), e.g. from a calibration run. Applies to K/V
        written from now on; set them before the first write. Raises InvalidArgumentError."""
        if self.scales is None:
            kind = "not fp8"
            if self.dtype == torch.int8:
                kind = "int8: its scales are per token, set as each row is written"
            raise InvalidArgumentError(f"set_scales: this cache is {kind}; it has no per-head scales")
        layer = require_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(scale, torch.Tensor) or scale.shape != self.scales.shape[2:]:
                raise InvalidArgumentError(f"{name}: expected a tensor of shape {list(self.scales.shape[2:])}")
            if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                raise InvalidArgumentError(f"{name}: every scale must be positive and finite")
        if self.storage.shape[1] == 1 and not torch.equal(k_scale.to(self.scales), v_scale.to(self.scales)):
            raise InvalidArgumentError(
                "k_scale, v_scale: a latent (MLA) cache stores K and V as one tensor with one scale per layer; "
                "pass the same scale for both"
            )
        self.scales[layer, 0].copy_(k_scale)
        self.scales[layer, 1].copy_(v_scale)

    def set_key_centres(self, centres: torch.Tensor) -> None:
        """Centre the keys of an int8 cache: from now on layer ``i``'s keys are stored less
        ``centres[i]`` (fp32-convertible ``[num_layers, num_kv_heads, head_dim]``, finite),
        e.g. the mean key of a calibration run (:func:`kvcache.memory.calibration.
        key_centres_from_cache`). A real model's keys carry a large per-channel bias; without
        it each row's int8 scale fits the row's own variation. Nothing is added back: every
        score of a query moves by the same ``q . centre``, which the softmax ignores (a backend
        refuses centred keys where it would not: a score cap, attention sinks).

        Set them before the first write (keys already stored stay as they were, and a query's
        shift would then differ between them); ``layer(i)`` hands out new LayerCache objects.
        Raises InvalidArgumentError, changing nothing, for another cache dtype or a bad tensor."""
        if self.dtype != torch.int8:
            raise InvalidArgumentError(
                f"set_key_centres: this cache is {self.dtype}; key centring is built for the int8 cache"
            )
        if self.rotation is not None:
            raise InvalidArgumentError(
                "set_key_centres: this cache stores K and V rotated (cache.kv_rotation); keep one of the two"
            )
        head = self._layers[0].key.shape[2:]
        want = [self.num_layers, *head]
        if not isinstance(centres, torch.Tensor) or list(centres.shape) != want:
            got = list(centres.shape) if isinstance(centres, torch.Tensor) else type(centres).__name__
            raise InvalidArgumentError(
                f"centres: expected a tensor of shape {want} (layers, KV heads, head_dim), got {got}"
            )
        if not centres.is_floating_point() or not bool(torch.isfinite(centres).all()):
            raise InvalidArgumentError("centres: expected finite floating-point values")
        self.key_centres = centres.to(device=self.device, dtype=torch.float32).contiguous()
        self._layers = [replace(layer, k_centre=self.key_centres[i]) for i, layer in enumerate(self._layers)]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's K and V (e.g. the pairs
        ``BlockManager.fork`` returns). Raises InvalidArgumentError, copying nothing, for an
        id outside the cache or a destination that is also a source or listed twice."""
        if isinstance(copies, (str, bytes)) or not isinstance(copies, Sequence):
            raise ArgumentTypeError(f"copies: expected a sequence of (src, dst) pairs, got {type(copies).__name__}")
        if not copies:
            return
        for i, pair in enumerate(copies):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise InvalidArgumentError(f"copies[{i}]: {pair!r:.40} is not a (src, dst) pair of block ids")
        src = [s for s, _ in copies]
        dst = [d for _, d in copies]
        n = self.num_blocks
        for b in src + dst:
            if type(b) is not int or not 0 <= b < n:
                raise InvalidArgumentError(f"copies: block {b!r:.20} is not a block id in [0, {n})")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise InvalidArgumentError("copies: destinations must be distinct and not also sources")
        index_src = torch.tensor(src, device=self.device)
        index_dst = torch.tensor(dst, device=self.device)
        self.storage[:, :, index_dst] = self.storage[:, :, index_src]


def allocate_kv_cache(
    config: KVCacheConfig,
    *,
    num_blocks: int | None = None,
    device: torch.device | str | None = None,
    fill: float | None = None,
    tp: TensorParallel | None = None,
    layout: KVGroupLayout | None = None,
) -> KVCacheTensors:
    """Allocate the cache tensors ``config`` describes.

    ``num_blocks`` and ``device`` override the config. ``tp``: allocate tensor-parallel rank
    ``tp.rank``'s share, ``[num_layers, 2, num_blocks, block_size, kv_heads_per_rank,
    head_dim]`` (:mod:`kvcache.parallel.heads`; its block count is ``num_blocks`` as given, which
    must be the same on every rank). ``fill`` initialises every element
    (tests poison the cache with NaN to prove nothing reads a slot that was never written;
    an int8 cache gets bytes 0x7E instead, whose per-token scales are NaN);
    by default the memory is left uninitialised, as in vLLM.
    ``layout``: the model's KV groups (default: ``config.kv_groups()``, from the model's
    ``window_pattern``); with groups the memory of ``num_blocks`` whole-model blocks holds
    ``num_blocks * num_layers // group_size`` block ids of ``group_size`` layers each (what
    ``kvcache plan`` reports as the groups' block ids).
    Raises CacheAllocationError when the device is missing or cannot hold the cache; the
    message gives the largest num_blocks that fits.
    """
    if num_blocks is not None:
        num_blocks = require_int("num_blocks", num_blocks, minimum=1)
    dev = resolve_device(config.cache.device if device is None else str(device))
    free = free_device_memory(dev)
    blocks = num_blocks if num_blocks is not None else num_blocks_for(config, free, tp)
    per_block = config.bytes_per_block_per_rank(tp)
    kv_heads = config.kv_heads_per_rank(tp)
    fits = free // per_block
    if blocks < 1:
        raise CacheAllocationError(
            f"cache.memory_budget: {config.cache.memory_budget} of {format_bytes(free)} free on "
            f"{dev} holds no block of {format_bytes(per_block)}; raise the budget"
        )
    if blocks > fits:
        raise _too_big(blocks, per_block, free, dev)
    m = config.model
    if layout is None:
        layout = config.kv_groups()
    elif not isinstance(layout, KVGroupLayout) or layout.num_layers != m.num_layers:
        raise InvalidArgumentError(
            f"layout: expected the KV groups of a {m.num_layers}-layer model, got {layout!r:.80}"
        )
    tensors = m.num_layers
    if layout is not None and layout.is_hybrid:
        tensors = layout.group_size
        blocks = blocks * m.num_layers // tensors  # the same memory, in ids of group_size layers
        if blocks > MAX_BLOCKS:
            raise CacheAllocationError(
                f"cache.num_blocks: with KV groups the cache would have {blocks} block ids of {tensors} layers, more "
                f"than block tables can name ({MAX_BLOCKS}); use fewer blocks"
            )
    else:
        layout = None
    latent = m.latent_dim  # MLA: one latent per token, its K and V views alias it
    info = dtype_info(config.cache.dtype)
    rows = info.rows_per_block(config.cache.block_size, m.head_dim)  # int8: + rows of scales
    shape = (tensors, 2, blocks, rows, kv_heads, m.head_dim) if latent is None else (
        tensors, 1, blocks, rows, 1, latent
    )
    dtype = torch_dtype(config.cache.dtype)
    try:
        storage = torch.empty(shape, dtype=dtype, device=dev)
    except torch.OutOfMemoryError:
        raise _too_big(blocks, per_block, free_device_memory(dev), dev) from None
    if fill is not None:
        # int8 holds no NaN: poison its bytes with 0x7E, which its fp16 scales read as NaN.
        storage.fill_(0x7E if info.token_scales and not math.isfinite(fill) else fill)
    scales = None
    if info.cache_only and not info.token_scales:
        scales = torch.full((m.num_layers, 2, kv_heads), config.cache.kv_scale, dtype=torch.float32, device=dev)
    tokens = config.cache.block_size if info.token_scales else None
    rotation = hadamard_rotation(m.head_dim) if config.cache.kv_rotation == "hadamard" else None
    return KVCacheTensors(storage, scales, layout, tokens, rotation=rotation)


def _too_big(blocks: int, per_block: int, free: int, device: torch.device) -> CacheAllocationError:
    return CacheAllocationError(
        f"cache.num_blocks: {blocks} blocks x {format_bytes(per_block)} = "
        f"{format_bytes(blocks * per_block)} does not fit in the {format_bytes(free)} free on "
        f"{device}; the largest num_blocks that fits is {free // per_block} "
        f"(or use memory_budget: 0.9)"
    )
