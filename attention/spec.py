"""The attention shape a backend serves: given once per model, before any step.

With the shape known up front, :meth:`AttentionBackend.plan` can decide everything a step
needs (split counts, work lists, tile indices, kernel configurations) once, and per-layer
calls only launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attention.checks import require_int
from attention.dtypes import DTYPES
from attention.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["AttentionSpec"]


@dataclass(frozen=True)
class AttentionSpec:
    """What every layer's attention looks like (the same for every layer of a model, except
    which layers use the sliding window).

    num_heads:      query heads (per tensor-parallel rank, when sharded).
    num_kv_heads:   key/value heads; divides num_heads (query head h reads KV head
                    ``h // (num_heads // num_kv_heads)``).
    head_dim:       channels per head, a positive multiple of 8.
    dtype:          compute dtype of queries and outputs (a name of :data:`attention.dtypes.DTYPES`).
    kv_cache_dtype: storage dtype of the K/V cache; None: the same as ``dtype``.
    sliding_window: tokens each query sees, itself included (Mistral's ``sliding_window``);
                    None: every earlier token.
    window_layers:  per layer, whether it uses the window (models that mix full and windowed
                    layers); None: every layer does when ``sliding_window`` is set.
    softmax_scale:  scale of q.k; None: ``head_dim ** -0.5``.
    logit_softcap:  cap c of the scaled scores s before the softmax: ``c * tanh(s / c)``
                    (Gemma-2's ``attn_logit_softcapping``); None: no cap.
    attention_sinks: every layer has a learned per-head sink logit that joins the softmax's
                    denominator and attends to nothing (gpt-oss); ``attend`` then takes the
                    layer's ``sinks``.
    latent_rank:    multi-head latent attention (DeepSeek's MLA) served as MQA over the
                    latent: one KV head (``num_kv_heads`` 1) whose key is a token's cached
                    latent and whose values are its first ``latent_rank`` channels (DeepSeek's
                    ``kv_lora_rank``; the cache holds one tensor, a layer's K and V views alias
                    it; the caller absorbs the projections). ``attend`` then defines only the
                    first ``latent_rank`` output channels. None: ordinary K/V heads.
    Raises InvalidArgumentError / ArgumentTypeError naming the field.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kv_cache_dtype: str | None = None
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    softmax_scale: float | None = None
    logit_softcap: float | None = None
    attention_sinks: bool = False
    latent_rank: int | None = None

    def __post_init__(self) -> None:
        require_int("num_heads", self.num_heads, minimum=1)
        require_int("num_kv_heads", self.num_kv_heads, minimum=1)
        require_int("head_dim", self.head_dim, minimum=8)
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}; "
                f"each KV head serves a whole group of query heads"
            )
        if self.head_dim % 8:
            raise InvalidArgumentError(
                f"head_dim: {self.head_dim} is not a multiple of 8; use {self.head_dim // 8 * 8 or 8}"
            )
        compute = [n for n, info in DTYPES.items() if not info.cache_only]
        if self.dtype not in compute:
            raise InvalidArgumentError(f"dtype: {self.dtype!r} is not a compute dtype; use one of {', '.join(compute)}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in DTYPES:
            raise InvalidArgumentError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is unknown; use one of {', '.join(DTYPES)} (or None)"
            )
        if self.sliding_window is not None:
            require_int("sliding_window", self.sliding_window, minimum=1)
        if self.window_layers is not None:
            if self.sliding_window is None:
                raise InvalidArgumentError("window_layers: given without sliding_window; set sliding_window too")
            if not isinstance(self.window_layers, tuple) or not all(isinstance(w, bool) for w in self.window_layers):
                raise ArgumentTypeError("window_layers: expected a tuple of bools, one per layer")
        if self.softmax_scale is not None:
            if isinstance(self.softmax_scale, bool) or not isinstance(self.softmax_scale, (int, float)):
                raise ArgumentTypeError(f"softmax_scale: expected a number, got {type(self.softmax_scale).__name__}")
            if not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
                raise InvalidArgumentError(f"softmax_scale: {self.softmax_scale} must be a finite positive number")
        if self.latent_rank is not None:
            require_int("latent_rank", self.latent_rank, minimum=1, maximum=self.head_dim - 1)
            if self.num_kv_heads != 1:
                raise InvalidArgumentError(
                    f"num_kv_heads: {self.num_kv_heads} with latent_rank; the latent is one KV head, use 1"
                )
            if DTYPES[self.cache_dtype].token_scales:
                raise InvalidArgumentError(
                    f"kv_cache_dtype: {self.cache_dtype} (a scale per token and head) is not built for a latent "
                    "cache; use float8_e4m3 or None"
                )
        if not isinstance(self.attention_sinks, bool):
            raise ArgumentTypeError(f"attention_sinks: expected a bool, got {type(self.attention_sinks).__name__}")
        if self.logit_softcap is not None:
            if isinstance(self.logit_softcap, bool) or not isinstance(self.logit_softcap, (int, float)):
                raise ArgumentTypeError(f"logit_softcap: expected a number, got {type(self.logit_softcap).__name__}")
            if not (math.isfinite(self.logit_softcap) and self.logit_softcap > 0):
                raise InvalidArgumentError(f"logit_softcap: {self.logit_softcap} must be a finite positive number")

    @property
    def latent_attention(self) -> bool:
        """Whether this is MLA over a latent cache (``latent_rank`` given)."""
        return self.latent_rank is not None

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def cache_dtype(self) -> str:
        """The K/V cache's storage dtype name."""
        return self.kv_cache_dtype or self.dtype

    @property
    def quantized_cache(self) -> bool:
        """Whether the cache stores a scaled format (fp8, int8) that kernels must dequantize."""
        return DTYPES[self.cache_dtype].cache_only

    @property
    def token_scaled_cache(self) -> bool:
        """Whether the cache is int8 with a scale per (token, KV head) stored in its blocks
        (:mod:`attention.token_scales`) rather than fp8 with per-KV-head scales."""
        return DTYPES[self.cache_dtype].token_scales

    @property
    def scale(self) -> float:
        """The softmax scale in use."""
        return float(self.softmax_scale) if self.softmax_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.window_layers is None:
            return self.sliding_window
        if not 0 <= layer < len(self.window_layers):
            raise InvalidArgumentError(
                f"layer: {layer} is outside window_layers, which covers {len(self.window_layers)} layers"
            )
        return self.sliding_window if self.window_layers[layer] else None

    @property
    def has_full_layers(self) -> bool:
        """Whether some layer attends to every earlier token."""
        return self.sliding_window is None or (self.window_layers is not None and not all(self.window_layers))
