"""benchmarks/bench_decode.py's added launches: what each variant hands the backend (no GPU
needed to build a backend and ask it for its launch)."""

from __future__ import annotations

import dataclasses

import torch

from attention.triton_kernels import default_decode_config
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


def test_hopper_wgmma_variants_schedule_for_the_programs_their_ring_fits() -> None:
    bench = load_bench("bench_decode")
    bf16_default, fp8_default, *chosen = bench.hopper_wgmma_variants()
    assert not bf16_default.fp8 and fp8_default.fp8
    for default in (bf16_default, fp8_default):
        assert default.config is None and default.hopper_decode is None and default.backend(32).hopper_decode is None
    assert all(v.backend(32).hopper_decode is False for v in bench.variants(sweep=True))  # the Triton kernel
    launches = [(v.fp8, c.block_n, c.num_stages, c.wave_fill, c.hopper_overlap, c.hopper_ws_loader)
                for v in chosen for c in [v.config]]  # fmt: skip
    assert launches == [
        (True, 128, 2, None, False, False), (True, 128, 2, 0.9, False, False), (True, 128, 3, None, False, False),
        (False, 64, 2, None, False, False), (False, 64, 3, None, False, False), (True, 128, 2, None, True, False),
        (True, 128, 3, None, True, False), (False, 64, 2, None, True, False), (False, 64, 3, None, True, False),
        (True, 128, 3, None, False, True), (False, 64, 3, None, False, True),
    ]  # fmt: skip
    assert all(("overlapped" in v.name) == v.config.hopper_overlap for v in chosen)
    assert all(("loader warp" in v.name) == v.config.hopper_ws_loader for v in chosen)
    for variant in chosen:
        for block_size in (32, 256):
            config, policy = variant.backend(block_size)._decode_launch(1, block_size)
            assert config.hopper_wgmma and config == variant.config
            # a ring of 2 tiles is 70 KiB of shared memory (three programs an SM), of 3 tiles 103 KiB (two)
            assert policy.programs_per_sm == {2: 3, 3: 2}[config.num_stages], variant.name
            assert policy.wave_fill == (variant.config.wave_fill or 0.0), variant.name
            assert policy.slot_share == (1.0 if variant.fp8 else 0.75), variant.name
