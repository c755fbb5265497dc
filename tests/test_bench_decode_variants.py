"""benchmarks/bench_decode.py's added launches: what each variant hands the backend (no GPU
needed to build a backend and ask it for its launch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.triton_kernels import default_decode_config, hopper_decode_config
from tests.bench_script import load_bench


def test_fused_combine_variants_keep_each_block_sizes_default_launch() -> None:
    bench = load_bench("bench_decode")
    named = {v.name: v for v in bench.fp8_variants()}
    for name, kv_dtype in (
        ("fp8 cache, fused combine", torch.float8_e4m3fn),
        ("int8 cache, fused combine", torch.int8),
        ("bf16 cache, fused combine", None),
    ):
        for block_size in (32, 256):
            config, _ = named[name].backend(block_size)._decode_launch(1, block_size)
            default = default_decode_config(bench.HEAD_DIM, bench.DTYPE, kv_dtype, block_size=block_size)
            assert config == dataclasses.replace(default, fused_combine=True), (name, block_size)


def test_query_register_variants_are_capped_so_the_hook_takes_them() -> None:
    bench = load_bench("bench_decode")
    chosen = bench.query_register_variants()
    assert len(chosen) == 3
    for variant in chosen:
        assert variant.fp8 and variant.config.maxnreg is not None, variant.name  # the hook's selector
        config, policy = variant.backend(32)._decode_launch(1, 32)
        assert config.maxnreg == variant.config.maxnreg
        # 223 registers (block 32) and 191 (block 256) hold two programs an SM; capped at 168, three
        assert policy.programs_per_sm == (3 if variant.config.maxnreg == 168 else 2), variant.name


def test_hopper_wgmma_variants_time_the_triton_kernel_and_the_two_tile_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Gluon decode kernel runs (here made to say so) the default is its 3-tile
    launch; the ``--hopper-wgmma`` variants are the Triton kernel's default launches and the
    Gluon kernel's 2-tile ring, scheduled for the programs an SM each fits."""
    import attention.triton_backend as backend_module

    monkeypatch.setattr(backend_module, "hopper_prefill_possible", lambda device: True)
    bench = load_bench("bench_decode")
    cuda = torch.device("cuda")
    chosen = {v.name: v for v in bench.hopper_wgmma_variants()}
    assert len(chosen) == 4
    for block_size in (32, 256):
        for fp8 in (True, False):
            kv = torch.float8_e4m3fn if fp8 else None
            default = bench.FP8_VARIANT if fp8 else bench.Variant("default")
            config, policy = default.backend(block_size)._decode_launch(1, block_size, cuda)
            assert config == hopper_decode_config(kv or bench.DTYPE) and policy.programs_per_sm == 2
            name = "fp8 cache" if fp8 else "bf16 cache"
            config, _ = chosen[f"{name}, triton kernel"].backend(block_size)._decode_launch(1, block_size, cuda)
            assert config == default_decode_config(bench.HEAD_DIM, bench.DTYPE, kv, block_size=block_size)
            ring = chosen[f"{name}, hopper wgmma, 2 stages, 3 an SM"]
            config, policy = ring.backend(block_size)._decode_launch(1, block_size, cuda)
            assert config.hopper_wgmma and config.num_stages == 2 and config == ring.config
            assert policy.programs_per_sm == 3 and config.block_n == (128 if fp8 else 64)
