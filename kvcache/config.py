"""The cache configuration: frozen pydantic models, validated when the YAML is parsed.

Validation is static: it needs no GPU and allocates nothing. A config for ``device: cuda``
validates on a laptop; whether the device exists is checked when the cache tensors are
allocated. The chosen backend's own rules come from :mod:`attention.capabilities`, a plain
table, so ``backend: flash_attn`` with ``block_size: 32`` fails here, naming 256.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from attention.capabilities import BACKEND_NAMES, BACKENDS, MultipleOf
from attention.dtypes import DTYPES
from attention.errors import ConfigProblem
from attention.spec import AttentionSpec
from kvcache.sizes import format_bytes, parse_bytes

__all__ = [
    "AttentionSection",
    "CacheSection",
    "ConfigProblem",
    "ConfigProblems",
    "DtypeName",
    "KVCacheConfig",
    "MemoryBudget",
    "ModelSection",
]

# The allowed names come from the one dtype table and the one backend table.
if TYPE_CHECKING:
    DtypeName = str
    BackendName = str
else:
    DtypeName = Literal[tuple(DTYPES)]
    BackendName = Literal[("auto", *BACKEND_NAMES)]
#: The project-wide block-size rule: every backend reads K/V in tiles of 32 tokens.
BLOCK_SIZE_RULE = MultipleOf(32, 1024)
HEAD_DIM_RULE = MultipleOf(8, 512)
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# What a person may write for a size, for the JSON schema editors read.
_SIZE_SCHEMA = {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|B)\s*$", "examples": ["40GiB"]}
_BUDGET_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, _SIZE_SCHEMA, {"type": "null"}]}
)
_SWAP_SCHEMA = WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, _SIZE_SCHEMA]})


class ConfigProblems(ValueError):
    """Raised by a model validator that found several cross-field problems at once."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = problems
        super().__init__("; ".join(f"{p.path}: {p.message}" for p in problems))


_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)


def _check_multiple(value: int, rule: MultipleOf, why: str) -> int:
    if value % rule.factor != 0 or value <= 0:
        options = " or ".join(str(v) for v in rule.nearest(value))
        raise ValueError(f"{value} is not a positive multiple of {rule.factor} ({why}); use {options}")
    if value > rule.maximum:
        raise ValueError(f"{value} is above the maximum {rule.maximum}; use {rule.maximum} or less")
    return value


class ModelSection(BaseModel):
    """The shape of the model whose keys and values the cache holds."""

    model_config = _STRICT

    num_layers: int = Field(ge=1, le=4096)
    """Transformer layers; each layer has its own K and V cache."""
    num_heads: int = Field(ge=1, le=1024)
    """Query heads per layer."""
    num_kv_heads: int = Field(ge=1, le=1024)
    """Key/value heads per layer (GQA/MQA when fewer than num_heads)."""
    head_dim: int
    """Channels per head: a positive multiple of 8, at most 512."""

    @field_validator("head_dim")
    @classmethod
    def _head_dim_rule(cls, value: int) -> int:
        return _check_multiple(value, HEAD_DIM_RULE, "vectorised loads of 16 bytes")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.num_heads % self.num_kv_heads != 0:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            close = sorted(divisors, key=lambda d: abs(d - self.num_kv_heads))[:2]
            raise ConfigProblems(
                [
                    ConfigProblem(
                        "num_kv_heads",
                        f"{self.num_kv_heads} does not divide num_heads {self.num_heads} "
                        f"(each KV head serves a whole group of query heads); "
                        f"use {' or '.join(str(d) for d in sorted(close))}",
                    )
                ]
            )
        return self

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1: MHA; num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class MemoryBudget:
    """How much memory the cache may take: a fraction of free device memory, or bytes."""

    fraction: float | None = None
    num_bytes: int | None = None

    def bytes_given(self, free_bytes: int) -> int:
        """The budget in bytes when ``free_bytes`` are free on the device."""
        if self.num_bytes is not None:
            return self.num_bytes
        assert self.fraction is not None, "a MemoryBudget holds a fraction or a byte count"
        return int(self.fraction * free_bytes)

    def __str__(self) -> str:
        if self.num_bytes is not None:
            return format_bytes(self.num_bytes)
        return f"{self.fraction:g} of free device memory"


class CacheSection(BaseModel):
    """How the KV cache is laid out and where it lives."""

    model_config = _STRICT

    block_size: int
    """Tokens per block (the page size): a positive multiple of 32, at most 1024, and what the
    chosen backend needs (flash_attn: a multiple of 256)."""
    dtype: DtypeName = "bfloat16"
    """Element type of the K/V cache tensors."""
    num_blocks: int | None = Field(default=None, ge=1)
    """Blocks in the pool. Give this or memory_budget, not both."""
    memory_budget: Annotated[MemoryBudget | None, _BUDGET_SCHEMA] = None
    """Memory for the cache: a fraction of free device memory in (0, 1] such as 0.9, or a size
    such as 40GiB. Give this or num_blocks, not both."""
    device: str = "auto"
    """Where the cache lives: auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    enable_prefix_caching: bool = False
    """Reuse the K/V of full blocks whose tokens (and every token before them) match."""
    swap_space: Annotated[int, _SWAP_SCHEMA] = 0
    """Pinned host memory for swapped-out blocks, as a size such as 4GiB (0: no swap)."""

    @field_validator("block_size")
    @classmethod
    def _block_size_rule(cls, value: int) -> int:
        return _check_multiple(value, BLOCK_SIZE_RULE, "the kernel tile")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _parse_budget(cls, value: Any) -> Any:
        if value is None or isinstance(value, MemoryBudget):
            return value
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a budget; write a fraction such as 0.9 or a size such as 40GiB")
        if isinstance(value, (int, float)):
            if 0 < value <= 1:
                return MemoryBudget(fraction=float(value))
            raise ValueError(
                f"{value} is not a fraction in (0, 1]; write a fraction such as 0.9, "
                f"or a size with a unit such as 40GiB"
            )
        if isinstance(value, str):
            num_bytes = parse_bytes(value)
            if num_bytes <= 0:
                raise ValueError(f"{value!r} is empty; write a positive size such as 40GiB")
            return MemoryBudget(num_bytes=num_bytes)
        raise ValueError(f"{value!r} is not a budget; write a fraction such as 0.9 or a size such as 40GiB")

    @field_validator("swap_space", mode="before")
    @classmethod
    def _parse_swap(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_bytes(value)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{value} is negative; write a size such as 4GiB, or 0 for no swap")
        return value

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N (e.g. cuda:0)")
        return value

    @model_validator(mode="after")
    def _one_size(self) -> CacheSection:
        if (self.num_blocks is None) == (self.memory_budget is None):
            both = self.num_blocks is not None
            raise ConfigProblems(
                [
                    ConfigProblem(
                        "num_blocks",
                        ("both num_blocks and memory_budget are set; keep one of them"
                         if both else
                         "neither num_blocks nor memory_budget is set; add one, "
                         "e.g. num_blocks: 1024 or memory_budget: 0.9"),
                    )
                ]
            )
        return self

    @property
    def device_type(self) -> str | None:
        """"cpu" or "cuda"; None for auto (decided when tensors are allocated)."""
        return None if self.device == "auto" else self.device.split(":")[0]

    @property
    def itemsize(self) -> int:
        """Bytes per K/V element."""
        return DTYPES[self.dtype].itemsize


class AttentionSection(BaseModel):
    """Which paged-attention backend reads the cache."""

    model_config = _STRICT

    backend: BackendName = "auto"
    """auto (fastest available for the device and config), reference, triton or flash_attn."""


class KVCacheConfig(BaseModel):
    """A whole cache config file: ``model``, ``cache`` and ``attention`` sections."""

    model_config = _STRICT

    model: ModelSection
    """The model's attention shape."""
    cache: CacheSection
    """The cache's layout, size and device."""
    attention: AttentionSection = AttentionSection()
    """The attention backend."""

    @model_validator(mode="after")
    def _backend_supports(self) -> KVCacheConfig:
        if self.attention.backend == "auto":
            return self
        caps = BACKENDS[self.attention.backend]
        paths = {
            "block_size": "cache.block_size",
            "head_dim": "model.head_dim",
            "dtype": "cache.dtype",
            "device": "cache.device",
        }
        problems = [
            ConfigProblem(paths[p.parameter], f"{p.value} is refused: {p.reason}; {p.fix}")
            for p in caps.problems(
                block_size=self.cache.block_size,
                head_dim=self.model.head_dim,
                dtype=self.cache.dtype,
                device_type=self.cache.device_type,
            )
        ]
        if problems:
            raise ConfigProblems(problems)
        return self

    @property
    def bytes_per_block(self) -> int:
        """2 (K and V) x layers x block_size x kv_heads x head_dim x itemsize."""
        m = self.model
        return 2 * m.num_layers * self.cache.block_size * m.num_kv_heads * m.head_dim * self.cache.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token takes across all layers."""
        return self.bytes_per_block // self.cache.block_size

    def attention_spec(self) -> AttentionSpec:
        """The attention shape the backend serves, from the ``model`` and ``cache`` sections."""
        m = self.model
        compute = getattr(m, "dtype", None) or self.cache.dtype
        window = getattr(m, "sliding_window", None)
        pattern = getattr(m, "window_pattern", None)
        return AttentionSpec(
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=compute,
            kv_cache_dtype=self.cache.dtype if self.cache.dtype != compute else None,
            sliding_window=window,
            window_layers=tuple(pattern) if pattern is not None else None,
        )
