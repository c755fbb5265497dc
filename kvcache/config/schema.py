"""The cache configuration: frozen pydantic models, validated when the YAML is parsed.

Validation is static: it needs no GPU and allocates nothing. A config for ``device: cuda``
validates on a laptop; whether the device exists is checked when the cache tensors are
allocated. The chosen backend's own rules come from :mod:`attention.capabilities`, a plain
table, so ``backend: flash_attn`` with ``block_size: 32`` fails here, naming 256. Rules that
span fields live in :mod:`kvcache.config.rules`.

Types are strict: an int is an int (not ``true``, not ``32.0``). Every bound a value has is
also stated in the JSON schema (:func:`config_json_schema`), with each field's docstring as
its description.
"""

from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from attention.capabilities import BACKEND_NAMES, MultipleOf
from attention.dtypes import DTYPES
from attention.errors import ConfigProblem, InvalidArgumentError, quote
from kvcache.config.rules import (
    BLOCK_SIZE_RULE,
    COMPUTE_DTYPES,
    DEVICE_PATTERN,
    HEAD_DIM_RULE,
    MAX_BLOCKS,
    MAX_HEADS,
    MAX_LATENT,
    MAX_LAYERS,
    MAX_TOKENS,
    cross_field_problems,
    device_ok,
)
from kvcache.config.sizes import MAX_BYTES, SIZE_PATTERN, format_bytes, parse_bytes

__all__ = [
    "AttentionSection",
    "CacheSection",
    "ConfigProblem",
    "ConfigProblems",
    "DtypeName",
    "KVCacheConfig",
    "MemoryBudget",
    "ModelSection",
    "config_json_schema",
]

# The allowed names come from the one dtype table and the one backend table.
_BACKEND_CHOICES = ("auto", *BACKEND_NAMES)
if TYPE_CHECKING:
    from attention.spec import AttentionSpec
    from kvcache.blocks.groups import KVGroupLayout
    from kvcache.parallel.heads import TensorParallel

    DtypeName = str
    ComputeDtypeName = str
    BackendName = str
else:
    DtypeName = Literal[tuple(DTYPES)]
    ComputeDtypeName = Literal[COMPUTE_DTYPES]
    BackendName = Literal[_BACKEND_CHOICES]

# What a person may write for a size, for the JSON schema editors read.
_SIZE_SCHEMA = {"type": "string", "pattern": SIZE_PATTERN, "examples": ["40GiB", "512 MiB"]}
_BUDGET_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, _SIZE_SCHEMA, {"type": "null"}]}
)
_SWAP_SCHEMA = WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_BYTES}, _SIZE_SCHEMA]})


def _multiple_schema(rule: MultipleOf) -> dict[str, Any]:
    return {"multipleOf": rule.factor, "minimum": rule.factor, "maximum": rule.maximum}


class ConfigProblems(ValueError):
    """Raised by a model validator that found several cross-field problems at once."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = problems
        super().__init__("; ".join(f"{p.path}: {p.message}" for p in problems))


@functools.cache
def _attribute_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring under the field, read from this file.

    pydantic's ``use_attribute_docstrings`` does the same when each class is built, at ~10 ms
    a class; reading them only when a JSON schema is asked for keeps ``kvcache validate`` fast.
    """
    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}  # no source shipped: the schema goes without descriptions
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {
                field.target.id: " ".join(doc.value.value.split())
                for field, doc in zip(node.body, node.body[1:], strict=False)
                if isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            }
    return docs


def _describe_fields(schema: dict[str, Any], cls: type) -> None:
    """JSON-schema hook: each property's description is its field's docstring."""
    docs = _attribute_docs().get(cls.__name__, {})
    for name, prop in schema.get("properties", {}).items():
        if name in docs:
            prop.setdefault("description", docs[name])


_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, json_schema_extra=_describe_fields)


def _check_multiple(value: int, rule: MultipleOf, why: str) -> int:
    if value % rule.factor != 0 or value <= 0:
        options = " or ".join(str(v) for v in rule.nearest(value))
        raise ValueError(f"{quote(value)} is not a positive multiple of {rule.factor} ({why}); use {options}")
    if value > rule.maximum:
        raise ValueError(f"{quote(value)} is above the maximum {rule.maximum}; use {rule.maximum} or less")
    return value


class ModelSection(BaseModel):
    """The shape of the model whose keys and values the cache holds."""

    model_config = _STRICT

    num_layers: int = Field(ge=1, le=MAX_LAYERS)
    """Transformer layers; each layer has its own K and V cache."""
    num_heads: int = Field(ge=1, le=MAX_HEADS)
    """Query heads per layer."""
    num_kv_heads: int = Field(ge=1, le=MAX_HEADS)
    """Key/value heads per layer (GQA/MQA when fewer than num_heads); divides num_heads."""
    head_dim: int = Field(json_schema_extra=_multiple_schema(HEAD_DIM_RULE))
    """Channels per head: a positive multiple of 8, at most 512."""
    dtype: ComputeDtypeName | None = None
    """Compute dtype of queries and outputs; default: cache.dtype. Required when cache.dtype is
    a cache-only storage format (fp8)."""
    sliding_window: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    """Tokens each query sees, itself included (sliding-window attention); default: every
    earlier token."""
    window_pattern: tuple[bool, ...] | None = Field(default=None, max_length=MAX_LAYERS)
    """Per layer, whether it uses sliding_window (models that mix full and windowed layers);
    one entry per layer. Default: every layer does when sliding_window is set."""
    logit_softcap: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    """Cap c of the attention scores: scaled scores s become c * tanh(s / c) before the softmax
    (Gemma-2's attn_logit_softcapping, 50.0). Default: no cap."""
    attention_sinks: bool = False
    """Every layer has learned per-head sink logits in the softmax's denominator (gpt-oss);
    the engine passes them to attend(sinks=...). Not every backend has them."""
    kv_lora_rank: int | None = Field(default=None, ge=8, le=MAX_LATENT)
    """Multi-head latent attention (DeepSeek-V2/V3's MLA): the compressed K/V each token caches
    per layer (V3: 512). Give it with qk_rope_head_dim, qk_nope_head_dim and v_head_dim; the
    cache then holds kv_lora_rank + qk_rope_head_dim values per token and layer, shared by
    every head (num_kv_heads: 1), instead of K and V per KV head."""
    qk_rope_head_dim: int | None = Field(default=None, ge=2, le=MAX_LATENT)
    """MLA: the rotary part of each head's q and of the shared k (V3: 64), cached beside the
    latent."""
    qk_nope_head_dim: int | None = Field(default=None, ge=1, le=MAX_LATENT)
    """MLA: the non-rotary part of each head's q and k (V3: 128); head_dim is qk_nope_head_dim
    + qk_rope_head_dim."""
    v_head_dim: int | None = Field(default=None, ge=1, le=MAX_LATENT)
    """MLA: each head's value width (V3: 128)."""

    @field_validator("head_dim")
    @classmethod
    def _head_dim_rule(cls, value: int) -> int:
        return _check_multiple(value, HEAD_DIM_RULE, "vectorised loads of 16 bytes")

    @field_validator("window_pattern", mode="before")
    @classmethod
    def _pattern_from_list(cls, value: Any) -> Any:
        # YAML gives a list; the frozen config holds a tuple.
        return tuple(value) if isinstance(value, list) else value

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1: MHA; num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def latent_dim(self) -> int | None:
        """MLA: values cached per token and layer (``kv_lora_rank + qk_rope_head_dim``); None
        for K/V heads."""
        if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
            return None
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def values_per_token_layer(self) -> int:
        """Cache values one token takes in one layer: K and V of every KV head, or MLA's latent."""
        latent = self.latent_dim
        return 2 * self.num_kv_heads * self.head_dim if latent is None else latent


@dataclass(frozen=True)
class MemoryBudget:
    """How much memory the cache may take: a fraction of free device memory, or bytes.
    Exactly one of the two is given (raises InvalidArgumentError otherwise)."""

    fraction: float | None = None
    num_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.num_bytes is None):
            raise InvalidArgumentError("MemoryBudget: give fraction or num_bytes, exactly one of them")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise InvalidArgumentError(f"MemoryBudget.fraction: {quote(self.fraction)} is not in (0, 1]")
        if self.num_bytes is not None and not 0 < self.num_bytes <= MAX_BYTES:
            raise InvalidArgumentError(
                f"MemoryBudget.num_bytes: {quote(self.num_bytes)} is not in [1, {MAX_BYTES}] (1 PiB)"
            )

    def bytes_given(self, free_bytes: int) -> int:
        """The budget in bytes when ``free_bytes`` are free on the device: ``num_bytes``, or
        ``fraction`` of ``free_bytes`` rounded down, computed exactly with the fraction as it is
        written (0.7 of 90 GiB is 63 GiB to the byte; ``0.7 * free_bytes`` in floats is a byte
        short, and a block short when the budget is a whole number of blocks)."""
        if self.num_bytes is not None:
            return self.num_bytes
        assert self.fraction is not None, "__post_init__ requires a fraction or a byte count"
        return math.floor(Fraction(repr(self.fraction)) * free_bytes)

    def __str__(self) -> str:
        if self.num_bytes is not None:
            return format_bytes(self.num_bytes)
        return f"{self.fraction:g} of free device memory"


_BUDGET_FIX = "write a fraction such as 0.9, or a size with a unit such as 40GiB"
_SWAP_FIX = "write a size such as 4GiB, or 0 for no swap"
_HOST_CACHE_FIX = "write a size such as 16GiB, or 0 for no host tier"
_DISK_CACHE_FIX = "write a size such as 200GiB, or 0 for no disk tier"
#: The longest disk_cache_dir taken (Linux's PATH_MAX).
MAX_PATH_CHARS = 4096


class CacheSection(BaseModel):
    """How the KV cache is laid out and where it lives."""

    model_config = _STRICT

    block_size: int = Field(json_schema_extra=_multiple_schema(BLOCK_SIZE_RULE))
    """Tokens per block (the page size): a positive multiple of 32, at most 1024, and what the
    chosen backend needs (flash_attn: a multiple of 256)."""
    dtype: DtypeName = "bfloat16"
    """Element type of the K/V cache tensors."""
    num_blocks: int | None = Field(default=None, ge=1, le=MAX_BLOCKS)
    """Blocks in the pool, at most 2**31 - 1 (block ids are int32). Give this or memory_budget,
    not both."""
    memory_budget: Annotated[MemoryBudget | None, _BUDGET_SCHEMA] = None
    """Memory for the cache: a fraction of free device memory in (0, 1] such as 0.9, or a size
    such as 40GiB (at most 1 PiB; units in any case). Give this or num_blocks, not both."""
    device: str = Field(default="auto", json_schema_extra={"pattern": DEVICE_PATTERN})
    """Where the cache lives: auto (cuda when present, else cpu), cpu, cuda or cuda:N."""
    enable_prefix_caching: bool = False
    """Reuse the K/V of full blocks whose tokens (and every token before them) match."""
    swap_space: Annotated[int, _SWAP_SCHEMA] = 0
    """Pinned host memory for swapped-out blocks: a size such as 4GiB, or a byte count, at most
    1 PiB (0: no swap)."""
    host_cache_space: Annotated[int, _SWAP_SCHEMA] = 0
    """Pinned host memory for the prefix cache's host tier: cached blocks the device pool evicts
    are kept there and come back on a hit (a size such as 16GiB, or a byte count, at most 1 PiB;
    0: no host tier). Needs enable_prefix_caching."""
    disk_cache_space: Annotated[int, _SWAP_SCHEMA] = 0
    """Disk space for the prefix cache's disk tier: blocks the host tier evicts are written to
    files under disk_cache_dir (each with a checksum: a damaged file is recomputed, never
    served) and come back on a hit (a size such as 200GiB, or a byte count, at most 1 PiB; 0: no
    disk tier). Needs host_cache_space and disk_cache_dir."""
    disk_cache_dir: str | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS)
    """Directory of the disk tier's block files (created if missing; the files of an earlier
    run of the same layout are deleted at start). Use a local disk; give disk_cache_space too."""
    kv_scale: float = Field(default=1.0, gt=0, le=1e6, allow_inf_nan=False)
    """For an fp8 cache (dtype float8_e4m3): the dequantization scale every layer and KV head
    starts with (a stored value times the scale is the real K/V; float8_e4m3 holds up to 448
    times it). Per-layer, per-head scales can be set later with KVCacheTensors.set_scales."""

    kv_rotation: Literal["none", "hadamard"] = "none"
    """For an 8-bit cache (int8, float8_e4m3): store K and V in a rotated basis (hadamard:
    QuaRot's randomized Hadamard rotation of the head dimension, which needs a power-of-two
    head_dim), so a key's few large channels no longer set every channel's step; attention
    rotates the query alike and its output back, so results are unchanged but for rounding.
    Not with a latent (MLA) cache."""

    @field_validator("block_size")
    @classmethod
    def _block_size_rule(cls, value: int) -> int:
        return _check_multiple(value, BLOCK_SIZE_RULE, "the kernel tile")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _parse_budget(cls, value: Any) -> Any:
        if value is None or isinstance(value, MemoryBudget):
            return value
        if isinstance(value, str):
            num_bytes = parse_bytes(value)
            if num_bytes <= 0:
                raise ValueError(f"{quote(value)} is empty; write a positive size such as 40GiB")
            return MemoryBudget(num_bytes=num_bytes)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if 0 < value <= 1:
                return MemoryBudget(fraction=float(value))
            raise ValueError(f"{quote(value)} is not a fraction in (0, 1]; {_BUDGET_FIX}")
        raise ValueError(f"{quote(value)} is not a budget; {_BUDGET_FIX}")

    @field_validator("swap_space", "host_cache_space", "disk_cache_space", mode="before")
    @classmethod
    def _parse_host_size(cls, value: Any, info: ValidationInfo) -> Any:
        fix = {"swap_space": _SWAP_FIX, "host_cache_space": _HOST_CACHE_FIX}.get(info.field_name or "", _DISK_CACHE_FIX)
        if isinstance(value, str):
            return parse_bytes(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{quote(value)} is not a size; {fix}")
        if value < 0:
            raise ValueError(f"{quote(value)} is negative; {fix}")
        if value > MAX_BYTES:
            raise ValueError(f"{quote(value)} bytes is more than {format_bytes(MAX_BYTES)}; {fix}")
        return value

    @field_validator("disk_cache_dir")
    @classmethod
    def _directory_form(cls, value: str | None) -> str | None:
        if value is not None and ("\x00" in value or not value.strip()):
            raise ValueError(f"{quote(value)} is not a directory path; write a path such as /mnt/nvme/kvcache")
        return value

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if not device_ok(value):
            raise ValueError(f"{quote(value)} is not a device; use auto, cpu, cuda or cuda:N (e.g. cuda:0)")
        return value

    @property
    def device_type(self) -> str | None:
        """ "cpu" or "cuda"; None for auto (decided when tensors are allocated)."""
        return None if self.device == "auto" else self.device.split(":")[0]

    @property
    def itemsize(self) -> int:
        """Bytes per K/V element."""
        return DTYPES[self.dtype].itemsize


class AttentionSection(BaseModel):
    """Which paged-attention backend reads the cache."""

    model_config = _STRICT

    backend: BackendName = "auto"
    """auto (fastest available for the device and config), or a backend of the table:
    reference, triton, flash_attn."""


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
    def _cross_field_rules(self) -> KVCacheConfig:
        problems = cross_field_problems(self.flat_values())
        if problems:
            raise ConfigProblems(problems)
        return self

    def flat_values(self) -> dict[str, object]:
        """Dotted field path -> value, for every field of every section."""
        return {
            f"{name}.{field}": getattr(section, field)
            for name in type(self).model_fields
            for section in (getattr(self, name),)
            for field in type(section).model_fields
        }

    @property
    def compute_dtype(self) -> str:
        """The dtype queries and outputs are computed in: model.dtype, else cache.dtype."""
        return self.model.dtype or self.cache.dtype

    @property
    def bytes_per_block(self) -> int:
        """2 (K and V) x layers x block_size x kv_heads x head_dim x itemsize (MLA: layers x
        block_size x the latent's values x itemsize); an int8 cache's blocks also hold their
        per-token scales (:mod:`attention.token_scales`)."""
        m = self.model
        return m.num_layers * self._rows_per_block * m.values_per_token_layer * self.cache.itemsize

    @property
    def _rows_per_block(self) -> int:
        """Token rows one block takes: block_size, plus an int8 cache's rows of scales."""
        return DTYPES[self.cache.dtype].rows_per_block(self.cache.block_size, self.model.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token takes across all layers."""
        return self.bytes_per_block // self.cache.block_size

    def kv_heads_per_rank(self, tp: TensorParallel | None = None) -> int:
        """KV heads each tensor-parallel rank's cache holds (all of them without ``tp``).
        Raises InvalidArgumentError when the heads do not split over ``tp.size`` ranks."""
        m = self.model
        if tp is None:
            return m.num_kv_heads
        tp.check_heads(m.num_heads, m.num_kv_heads)
        return tp.kv_heads_per_rank(m.num_kv_heads)

    def bytes_per_block_per_rank(self, tp: TensorParallel | None = None) -> int:
        """:attr:`bytes_per_block` of one tensor-parallel rank's cache: its KV heads only
        (the same on every rank; more than ``bytes_per_block / tp.size`` when KV heads are
        replicated)."""
        m = self.model
        if m.latent_dim is not None:  # MLA: every rank holds the whole latent (one per token)
            return self.bytes_per_block
        return 2 * m.num_layers * self._rows_per_block * self.kv_heads_per_rank(tp) * m.head_dim * self.cache.itemsize

    def bytes_per_token_per_rank(self, tp: TensorParallel | None = None) -> int:
        """K/V bytes one token takes in one rank's cache, across all layers."""
        return self.bytes_per_block_per_rank(tp) // self.cache.block_size

    def kv_groups(self) -> KVGroupLayout | None:
        """The model's KV groups when its ``window_pattern`` mixes full and windowed layers
        (:mod:`kvcache.blocks.groups`); None when one table per sequence serves every layer."""
        from kvcache.blocks.groups import group_layout

        m = self.model
        if m.sliding_window is None or m.window_pattern is None:
            return None
        layout = group_layout(m.num_layers, m.sliding_window, m.window_pattern)
        return layout if layout.is_hybrid else None

    def attention_spec(self, tp: TensorParallel | None = None) -> AttentionSpec:
        """The attention shape the backend serves, from the ``model`` and ``cache`` sections;
        with ``tp``, the shape of that rank's heads (:func:`kvcache.parallel.heads.rank_spec`)."""
        from attention.spec import AttentionSpec  # only when a backend is built: the CLI never needs it

        m = self.model
        compute = self.compute_dtype
        spec = AttentionSpec(
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=compute,
            kv_cache_dtype=self.cache.dtype if self.cache.dtype != compute else None,
            sliding_window=m.sliding_window,
            window_layers=m.window_pattern,
            logit_softcap=m.logit_softcap,
            attention_sinks=m.attention_sinks,
        )
        if m.latent_dim is not None and m.qk_nope_head_dim is not None:
            # MLA as MQA over the latent: one KV head as wide as the latent, the scale of the
            # uncompressed q.k (nope + rope channels).
            spec = replace(
                spec,
                num_kv_heads=1,
                head_dim=m.latent_dim,
                softmax_scale=(m.qk_nope_head_dim + (m.qk_rope_head_dim or 0)) ** -0.5,
                latent_rank=m.kv_lora_rank,
            )
        if tp is None:
            return spec
        from kvcache.parallel.heads import rank_spec

        return rank_spec(spec, tp)


def config_json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (draft 2020-12), for editors: every bound, pattern and
    enumeration the validator checks field by field, and each field's docstring."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **KVCacheConfig.model_json_schema()}
