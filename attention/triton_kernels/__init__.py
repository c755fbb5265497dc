"""Our paged-attention Triton kernels and their thin launch functions.

One concept per module:

- :mod:`.paging`:      device helpers shared by the attention kernels (block-table address
                       math, one online-softmax step);
- :mod:`.cache_write`: scatter new tokens' K/V into their cache slots;
- :mod:`.decode`:      flash-decoding (split-KV) for batches of one new token per row;
- :mod:`.prefill`:     FlashAttention-2 style varlen causal attention for prefill/extend.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its CPU
interpreter (``TRITON_INTERPRET=1``), so that variable must be set before this package is
first imported; :func:`kernels_interpreted` reports what was in effect then.
"""

from attention.triton_kernels.cache_write import write_kv_cache
from attention.triton_kernels.decode import (
    DECODE_SWEEP,
    DecodeConfig,
    SplitPolicy,
    choose_num_splits,
    default_decode_config,
    paged_decode,
    split_length,
)
from attention.triton_kernels.paging import interpreter_requested, kernels_interpreted
from attention.triton_kernels.prefill import (
    PREFILL_SWEEP,
    PrefillConfig,
    default_prefill_config,
    paged_prefill,
    prefill_tile_index,
)

__all__ = [
    "DECODE_SWEEP",
    "PREFILL_SWEEP",
    "DecodeConfig",
    "PrefillConfig",
    "SplitPolicy",
    "choose_num_splits",
    "default_decode_config",
    "default_prefill_config",
    "interpreter_requested",
    "kernels_interpreted",
    "paged_decode",
    "paged_prefill",
    "prefill_tile_index",
    "split_length",
    "write_kv_cache",
]
