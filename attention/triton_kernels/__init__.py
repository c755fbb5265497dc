"""Our paged-attention Triton kernels and their thin launch functions.

One concept per module:

- :mod:`.paging`:          device helpers shared by the attention kernels (block-table address
                           math, one online-softmax step);
- :mod:`.cache_write`:     scatter new tokens' K/V into their cache slots;
- :mod:`.rotary_write`:    rotary on Q and K, the cache write and the rotated Q in one kernel;
- :mod:`.latent_write`:    MLA's boundary: rotary on q_pe and k_pe, the latent into its slot
                           and the query assembled, in one kernel;
- :mod:`.decode_schedule`: host-side partition of decode rows into equal-token chunks (pure
                           Python; fixed grids for CUDA graphs);
- :mod:`.decode_kernels`:  the decode kernels (one program per chunk and KV head, combine);
- :mod:`.decode`:          their launch parameters, workspace and launcher;
- :mod:`.decode_hopper`:   the chunk kernel on Hopper in Gluon, the tokens as the warpgroup
                           MMA's M (fp8 and 16-bit caches; opt-in, ``DecodeConfig.hopper_wgmma``);
- :mod:`.prefill`:         FlashAttention-2 style varlen causal attention for prefill/extend;
- :mod:`.prefill_hopper`:  the same on Hopper in Gluon, warp-specialized (FlashAttention-3's
                           layout), for the common 16-bit case;
- :mod:`.dequantize_blocks`: a 16-bit copy of the blocks an fp8 prefill step reads, for it;
- :mod:`.metadata_check`:  the device-side metadata check as one kernel (no host sync);
- multi-head latent attention (DeepSeek's MLA): :mod:`.mla_decode` (absorbed decode, its
  launches and the split schedule), :mod:`.mla_balanced` (the length-balanced schedule planned
  on the host, its kernel and the merge), :mod:`.mla_tiles` (the tile loop those share),
  :mod:`.mla_decode_hopper` (decode for up to 16 heads on Hopper, in Gluon),
  :mod:`.mla_decode_hopper_ring` (its deeper-ring form, opt-in),
  :mod:`.mla_decode_hopper_split` (its split-warpgroup form, opt-in), :mod:`.mla_hopper_stores`
  (the stores they share),
  :mod:`.mla_prefill` and :mod:`.mla_prefill_hopper` (decompressed prefill / extend).

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its CPU
interpreter (``TRITON_INTERPRET=1``), so that variable must be set before this package is
first imported; :func:`kernels_interpreted` reports what was in effect then.
"""

from attention.triton_kernels.cache_write import write_kv_cache
from attention.triton_kernels.decode import (
    DECODE_SWEEP,
    FP8_KV_DTYPES,
    DecodeConfig,
    DecodeWorkspace,
    allocate_decode_workspace,
    check_decode_launch,
    decode_metadata,
    default_decode_config,
    hopper_decode_config,
    paged_decode,
)
from attention.triton_kernels.decode_schedule import (
    MAX_DECODE_QUERY_LEN,
    DecodePolicy,
    DecodeSchedule,
    max_decode_items,
    max_decode_partials,
    schedule_decode,
)
from attention.triton_kernels.paging import interpreter_requested, kernels_interpreted
from attention.triton_kernels.prefill import (
    PAD_TILE,
    PREFILL_SWEEP,
    PrefillConfig,
    default_prefill_config,
    max_prefill_tiles,
    paged_prefill,
    prefill_tile_index,
)
from attention.triton_kernels.rotary_write import rotary_write_kv

__all__ = [
    "DECODE_SWEEP",
    "FP8_KV_DTYPES",
    "MAX_DECODE_QUERY_LEN",
    "PAD_TILE",
    "PREFILL_SWEEP",
    "DecodeConfig",
    "DecodePolicy",
    "DecodeSchedule",
    "DecodeWorkspace",
    "PrefillConfig",
    "allocate_decode_workspace",
    "check_decode_launch",
    "decode_metadata",
    "default_decode_config",
    "default_prefill_config",
    "hopper_decode_config",
    "interpreter_requested",
    "kernels_interpreted",
    "max_decode_items",
    "max_decode_partials",
    "max_prefill_tiles",
    "paged_decode",
    "paged_prefill",
    "prefill_tile_index",
    "rotary_write_kv",
    "schedule_decode",
    "write_kv_cache",
]
