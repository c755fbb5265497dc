"""The one dtype table: every element type a config may name, as plain data.

Imports no torch, so the config validator and the CLI stay fast; :func:`torch_dtype` looks
the torch dtype up when a tensor is about to be made. Adding a dtype is one entry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DtypeInfo", "dtype_info", "dtype_name", "resolve_dtype_alias", "torch_dtype"]


@dataclass(frozen=True)
class DtypeInfo:
    """One element type.

    name:       as written in YAML (``cache.dtype``).
    torch_name: the attribute of ``torch`` holding it.
    itemsize:   bytes per element.
    aliases:    other spellings people write, accepted with a "did you mean".
    cache_only: a storage format for the KV cache only (fp8, int8): the model computes in
                another dtype, and values are scaled when written and read.
    token_scales: the scale is per (token, KV head), computed when the row is written and
                stored beside it in the block (int8, :mod:`attention.token_scales`); otherwise
                a cache-only format has fixed per-(layer, KV head) scales (fp8).
    """

    name: str
    torch_name: str
    itemsize: int
    aliases: tuple[str, ...] = ()
    cache_only: bool = False
    token_scales: bool = False

    def rows_per_block(self, block_size: int, head_dim: int) -> int:
        """Token rows (``kv_heads * head_dim`` elements each) one block of K or of V takes in
        memory: ``block_size``, plus for a ``token_scales`` format the rows that hold the
        block's per-token fp16 scales (two bytes per token and KV head), rounded up so that
        the rows added are a multiple of the largest power of two dividing ``block_size``
        elements: every block then starts where the kernels' aligned (16-byte) loads assume
        (for head_dim 64, 128 and 256 no rounding is needed)."""
        if not self.token_scales:
            return block_size
        extra = -(-2 * block_size // head_dim)
        align = block_size & -block_size
        unit = align // math.gcd(head_dim, align)  # extra * head_dim must be a multiple of align
        return block_size + -(-extra // unit) * unit


DTYPES: dict[str, DtypeInfo] = {
    d.name: d
    for d in (
        DtypeInfo("float16", "float16", 2, ("fp16", "half")),
        DtypeInfo("bfloat16", "bfloat16", 2, ("bf16",)),
        DtypeInfo("float32", "float32", 4, ("fp32", "float")),
        # OCP fp8 E4M3 (finite max 448), for the KV cache only; vLLM calls it "fp8_e4m3".
        DtypeInfo("float8_e4m3", "float8_e4m3fn", 1, ("fp8", "fp8_e4m3", "float8_e4m3fn"), cache_only=True),
        # int8 with one fp16 scale per (token, KV head), stored in the block beside the values
        # (LMDeploy's and TensorRT-LLM's per-token int8 KV formats are of this kind).
        DtypeInfo("int8", "int8", 1, ("i8",), cache_only=True, token_scales=True),
    )
}


def dtype_info(name: str) -> DtypeInfo:
    """The entry for ``name``. Raises KeyError listing the known names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def resolve_dtype_alias(text: str) -> str | None:
    """The table name an alias (``bf16``, ``half``, ...) stands for, or None."""
    lowered = text.lower()
    for info in DTYPES.values():
        if lowered == info.name or lowered in info.aliases:
            return info.name
    return None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of table entry ``name`` (imports torch)."""
    import torch

    result: torch.dtype = getattr(torch, dtype_info(name).torch_name)
    return result


def dtype_name(dtype: torch.dtype) -> str:
    """The table name of a torch dtype, or ``str(dtype)`` when it has none."""
    short = str(dtype).removeprefix("torch.")
    for info in DTYPES.values():
        if info.torch_name == short:
            return info.name
    return str(dtype)
