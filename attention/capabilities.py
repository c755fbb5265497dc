"""The one backend table: what each attention backend is and what it supports, as plain data.

One entry per backend holds its name, where its class lives, the kernel library it needs and
the pip extra that installs it, its priority for ``auto``, and its declared limits. The config
validator, the CLI, the registry and the tests all derive from this table, so adding a backend
is one entry here (plus its module).

This module imports no torch and no kernel library, so the config validator can ask "does
the chosen backend take block_size 32?" on a laptop without triton or flash-attn, and a bad
combination fails when the YAML is parsed instead of at the first kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attention.dtypes import DTYPES

if TYPE_CHECKING:
    from attention.spec import AttentionSpec

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "BackendInfo",
    "CapabilityProblem",
    "MultipleOf",
    "backend_info",
]


@dataclass(frozen=True)
class MultipleOf:
    """A positive integer that is a multiple of ``factor`` and at most ``maximum``."""

    factor: int
    maximum: int

    def allows(self, value: int) -> bool:
        return 0 < value <= self.maximum and value % self.factor == 0

    def describe(self) -> str:
        return f"a multiple of {self.factor} up to {self.maximum}"

    def nearest(self, value: int) -> list[int]:
        """Up to two allowed values closest to ``value`` (for "use X or Y" fixes)."""
        below = min((value // self.factor) * self.factor, self.maximum)
        above = below + self.factor
        out = [v for v in (below, above) if self.allows(v)]
        return out or [self.factor]


@dataclass(frozen=True)
class CapabilityProblem:
    """One reason a backend refuses a setting.

    ``parameter`` is one of ``block_size``, ``head_dim``, ``dtype``, ``kv_cache_dtype``,
    ``device``, ``sliding_window``; the config layer maps it to the YAML field path.
    """

    parameter: str
    value: object
    reason: str
    fix: str


_COMPUTE_DTYPES = tuple(name for name, info in DTYPES.items() if not info.cache_only)


@dataclass(frozen=True)
class BackendInfo:
    """One backend: where it lives and what it declares it supports.

    module, class_name: the backend class, imported only when the backend is asked for.
    library:      the importable kernel library it needs (None: nothing beyond torch).
    pip_extra:    the extra of this package that installs that library.
    auto_priority: ``auto`` tries backends in increasing priority and takes the first that is
                  installed and accepts the setting.
    dtypes:       compute dtypes (query, output, and the cache unless kv_cache_dtypes says).
    kv_cache_dtypes: dtypes the K/V cache may be stored in.
    devices:      device types it runs on.
    min_compute_capability: lowest CUDA compute capability, checked on a real device.
    sliding_window: whether it runs sliding-window attention.
    logit_softcap: whether it caps attention scores (``cap * tanh(s / cap)``, Gemma-2).
    attention_sinks: whether it takes learned per-head sink logits (gpt-oss).
    tree_masks:   whether it takes per-token ancestor masks over a row's new tokens
                  (``AttentionMetadata.tree_masks``: draft trees of speculative decoding).
    cuda_graphs:  whether its per-layer calls can be captured in a CUDA graph (no host sync,
                  launch parameters fixed per batch bucket) for pure decode steps.
    mixed_cuda_graphs: whether steps with prefill rows can be captured too (launch
                  parameters fixed per bucket of rows and tokens).
    fused_rotary: whether ``rotary_write_kv`` is one kernel (rotary, cache write and the
                  rotated query together); otherwise it is composed from torch ops and
                  ``write_kv``, with the same results.
    block_size_origin: where the block-size rule comes from, quoted in error messages.
    """

    name: str
    module: str
    class_name: str
    library: str | None
    pip_extra: str | None
    auto_priority: int
    block_sizes: MultipleOf
    head_dims: MultipleOf
    dtypes: tuple[str, ...]
    kv_cache_dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    min_compute_capability: tuple[int, int] | None
    sliding_window: bool
    logit_softcap: bool
    attention_sinks: bool
    tree_masks: bool
    #: Multi-head latent attention (MLA) as MQA over the latent (``AttentionSpec.latent_attention``).
    latent_attention: bool
    cuda_graphs: bool
    mixed_cuda_graphs: bool
    fused_rotary: bool
    block_size_origin: str

    def spec_problems(
        self, spec: AttentionSpec, *, block_size: int, device_type: str | None, kv_cache_dtype: str | None = None
    ) -> list[CapabilityProblem]:
        """:meth:`problems` for ``spec`` (its head_dim, dtype and every switch it carries) in
        blocks of ``block_size`` on ``device_type``; ``kv_cache_dtype``: the cache's, when it
        is not the spec's own (None: the spec's)."""
        return self.problems(
            block_size=block_size,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype,
            device_type=device_type,
            sliding_window=spec.sliding_window is not None,
            logit_softcap=spec.logit_softcap is not None,
            attention_sinks=spec.attention_sinks,
            latent_attention=spec.latent_attention,
        )

    def problems(
        self,
        *,
        block_size: int,
        head_dim: int,
        dtype: str,
        device_type: str | None,
        kv_cache_dtype: str | None = None,
        sliding_window: bool = False,
        logit_softcap: bool = False,
        attention_sinks: bool = False,
        latent_attention: bool = False,
    ) -> list[CapabilityProblem]:
        """Every reason this backend refuses the setting; empty when it is supported
        (:meth:`spec_problems` for an :class:`~attention.spec.AttentionSpec`).

        ``device_type`` is "cpu", "cuda", or None when the device is chosen at run time;
        ``kv_cache_dtype`` None means the same as ``dtype``. Touches no device.
        """
        found: list[CapabilityProblem] = []
        if not self.block_sizes.allows(block_size):
            options = " or ".join(str(v) for v in self.block_sizes.nearest(block_size))
            found.append(
                CapabilityProblem(
                    "block_size",
                    block_size,
                    f"backend {self.name} needs {self.block_sizes.describe()} ({self.block_size_origin})",
                    f"use {options}",
                )
            )
        # A latent (MLA) is as wide as the model makes it (DeepSeek-V3: 576): a backend with
        # latent attention takes any multiple of 8 (the spec checks that); one without is
        # refused below for the latent itself.
        if not latent_attention and not self.head_dims.allows(head_dim):
            found.append(
                CapabilityProblem(
                    "head_dim",
                    head_dim,
                    f"backend {self.name} supports head_dim {self.head_dims.describe()}",
                    "pick another attention.backend (reference runs any head_dim)",
                )
            )
        if dtype not in self.dtypes:
            found.append(
                CapabilityProblem(
                    "dtype",
                    dtype,
                    f"backend {self.name} computes in {', '.join(self.dtypes)}",
                    f"use {' or '.join(self.dtypes)}",
                )
            )
        if kv_cache_dtype is not None and kv_cache_dtype != dtype and kv_cache_dtype not in self.kv_cache_dtypes:
            others = [b.name for b in BACKENDS.values() if kv_cache_dtype in b.kv_cache_dtypes]
            found.append(
                CapabilityProblem(
                    "kv_cache_dtype",
                    kv_cache_dtype,
                    f"backend {self.name} stores the KV cache in {', '.join(self.kv_cache_dtypes)} only",
                    f"use attention.backend {' or '.join(others)}" if others else "use the model's dtype",
                )
            )
        if device_type is not None and device_type not in self.devices:
            found.append(
                CapabilityProblem(
                    "device",
                    device_type,
                    f"backend {self.name} runs on {', '.join(self.devices)} only",
                    f"set cache.device to {self.devices[0]} or pick another attention.backend",
                )
            )
        if logit_softcap and not self.logit_softcap:
            found.append(
                CapabilityProblem(
                    "logit_softcap",
                    True,
                    f"backend {self.name} has no attention-score soft-capping",
                    "pick another attention.backend",
                )
            )
        if latent_attention and not self.latent_attention:
            found.append(
                CapabilityProblem(
                    "latent_attention",
                    True,
                    f"backend {self.name} has no latent attention (MLA) yet",
                    "use attention.backend reference",
                )
            )
        if attention_sinks and not self.attention_sinks:
            found.append(
                CapabilityProblem(
                    "attention_sinks",
                    True,
                    f"backend {self.name} has no attention sinks",
                    "use the triton or reference backend",
                )
            )
        if sliding_window and not self.sliding_window:
            found.append(
                CapabilityProblem(
                    "sliding_window",
                    True,
                    f"backend {self.name} has no sliding-window attention",
                    "pick another attention.backend",
                )
            )
        return found


BACKENDS: dict[str, BackendInfo] = {
    b.name: b
    for b in (
        BackendInfo(
            name="reference",
            module="attention.reference",
            class_name="ReferenceBackend",
            library=None,
            pip_extra=None,
            auto_priority=2,
            block_sizes=MultipleOf(32, 1024),
            head_dims=MultipleOf(8, 512),
            dtypes=_COMPUTE_DTYPES,
            kv_cache_dtypes=tuple(DTYPES),
            devices=("cpu", "cuda"),
            min_compute_capability=None,
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=True,
            tree_masks=True,
            latent_attention=True,
            cuda_graphs=False,
            mixed_cuda_graphs=False,
            fused_rotary=False,
            block_size_origin="the project-wide rule",
        ),
        BackendInfo(
            name="triton",
            module="attention.triton_backend",
            class_name="TritonBackend",
            library="triton",
            pip_extra="triton",
            # Fastest on the H200 in benchmarks/results/attention-*.json.
            auto_priority=0,
            # Tokens are gathered per row through the block table, so any multiple of 32 works;
            # 32 keeps every tile of 32 tokens inside one block.
            block_sizes=MultipleOf(32, 1024),
            head_dims=MultipleOf(8, 256),
            dtypes=_COMPUTE_DTYPES,
            # Every dtype: int8's per-token scales are read in the kernels (attention.token_scales).
            kv_cache_dtypes=tuple(DTYPES),
            devices=("cuda",),
            min_compute_capability=(8, 0),
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=True,
            tree_masks=True,
            latent_attention=True,
            cuda_graphs=True,
            mixed_cuda_graphs=True,
            fused_rotary=True,
            block_size_origin="our kernels read tiles of 32 tokens",
        ),
        BackendInfo(
            name="flash_attn",
            module="attention.flash_attn_backend",
            class_name="FlashAttnBackend",
            library="flash_attn",
            pip_extra="flash-attn",
            auto_priority=1,
            block_sizes=MultipleOf(256, 1024),
            head_dims=MultipleOf(8, 256),
            dtypes=("float16", "bfloat16"),
            kv_cache_dtypes=("float16", "bfloat16"),
            devices=("cuda",),
            min_compute_capability=(8, 0),
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=False,
            tree_masks=False,
            latent_attention=False,
            cuda_graphs=True,
            mixed_cuda_graphs=False,
            fused_rotary=False,
            block_size_origin=(
                'flash-attn 2 csrc/flash_attn/flash_api.cpp: "Paged KV cache block size must be divisible by 256"'
            ),
        ),
    )
}

#: Backend names in table order (the config's and the CLI's choices, with "auto").
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend_info(name: str) -> BackendInfo:
    """The table entry of backend ``name``. Raises KeyError listing the known names."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}") from None
