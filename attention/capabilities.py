"""What each attention backend supports, as plain data.

This module imports no kernel library, so the config validator can ask "does the chosen
backend take block_size 32?" on a laptop without triton or flash-attn installed, and a bad
combination fails when the YAML is parsed instead of at the first kernel call.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BACKEND_CAPABILITIES",
    "KV_LAYOUT_NHD",
    "BackendCapabilities",
    "CapabilityProblem",
    "MultipleOf",
    "capabilities_of",
]

# Every backend in this project stores K/V as [num_blocks, block_size, num_kv_heads, head_dim]
# ("NHD" per block): a token's heads are contiguous, which makes the cache write one
# contiguous store per token and is the layout flash-attn's paged API requires.
KV_LAYOUT_NHD = "NHD"

#: Dtype names as written in YAML, in the order we list them in messages.
ALL_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


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

    ``parameter`` is one of ``block_size``, ``head_dim``, ``dtype``, ``device``; the config
    layer maps it to the YAML field path.
    """

    parameter: str
    value: object
    reason: str
    fix: str


@dataclass(frozen=True)
class BackendCapabilities:
    """The declared limits of one backend. The config validator and the backend both read it."""

    name: str
    block_sizes: MultipleOf
    head_dims: MultipleOf
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]
    #: Lowest CUDA compute capability, checked when the backend is built on a real device.
    min_compute_capability: tuple[int, int] | None
    kv_layout: str
    #: Where the block-size rule comes from, quoted in error messages.
    block_size_origin: str
    #: The pip extra that installs the kernel library (None: nothing extra needed).
    pip_extra: str | None

    def problems(
        self, *, block_size: int, head_dim: int, dtype: str, device_type: str | None
    ) -> list[CapabilityProblem]:
        """Every reason this backend refuses the setting; empty when it is supported.

        ``device_type`` is "cpu", "cuda", or None when the device is chosen at run time.
        Does not touch any device.
        """
        found: list[CapabilityProblem] = []
        if not self.block_sizes.allows(block_size):
            options = " or ".join(str(v) for v in self.block_sizes.nearest(block_size))
            found.append(
                CapabilityProblem(
                    "block_size",
                    block_size,
                    f"backend {self.name} needs {self.block_sizes.describe()} "
                    f"({self.block_size_origin})",
                    f"use {options}",
                )
            )
        if not self.head_dims.allows(head_dim):
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
                    f"backend {self.name} supports {', '.join(self.dtypes)}",
                    f"use {' or '.join(self.dtypes)}",
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
        return found


BACKEND_CAPABILITIES: dict[str, BackendCapabilities] = {
    "reference": BackendCapabilities(
        name="reference",
        block_sizes=MultipleOf(32, 1024),
        head_dims=MultipleOf(8, 512),
        dtypes=ALL_DTYPES,
        devices=("cpu", "cuda"),
        min_compute_capability=None,
        kv_layout=KV_LAYOUT_NHD,
        block_size_origin="the project-wide rule",
        pip_extra=None,
    ),
    "triton": BackendCapabilities(
        name="triton",
        # Tokens are gathered per row through the block table, so any multiple of 32 works;
        # 32 keeps every tile of 32 tokens inside one block.
        block_sizes=MultipleOf(32, 1024),
        head_dims=MultipleOf(8, 256),
        dtypes=ALL_DTYPES,
        devices=("cuda",),
        min_compute_capability=(8, 0),
        kv_layout=KV_LAYOUT_NHD,
        block_size_origin="our kernels read tiles of 32 tokens",
        pip_extra="triton",
    ),
    "flash_attn": BackendCapabilities(
        name="flash_attn",
        block_sizes=MultipleOf(256, 1024),
        head_dims=MultipleOf(8, 256),
        dtypes=("float16", "bfloat16"),
        devices=("cuda",),
        min_compute_capability=(8, 0),
        kv_layout=KV_LAYOUT_NHD,
        block_size_origin=(
            'flash-attn 2 csrc/flash_attn/flash_api.cpp: "Paged KV cache block size must be '
            'divisible by 256"'
        ),
        pip_extra="flash-attn",
    ),
}


def capabilities_of(name: str) -> BackendCapabilities:
    """The declared capabilities of backend ``name``. Raises KeyError listing known names."""
    try:
        return BACKEND_CAPABILITIES[name]
    except KeyError:
        known = ", ".join(sorted(BACKEND_CAPABILITIES))
        raise KeyError(f"unknown attention backend {name!r}; known: {known}") from None
