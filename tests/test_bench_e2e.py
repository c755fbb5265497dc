"""The end-to-end benchmark's code path on CPU: ``--device cpu --tiny`` serves a tiny model
with our engine and with transformers' continuous batching, and writes the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.bench_script import load_bench

pytest.importorskip("transformers")



def _bench() -> ModuleType:
    module: ModuleType = load_bench("bench_e2e")
    return module


def test_tiny_cpu_run_serves_both_engines_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    threads = torch.get_num_threads()
    try:
        doc = _bench().run(["--device", "cpu", "--tiny", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the tiny CPU run uses one thread
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc, default=str))
    results, errors = doc["results"], doc["errors"]
    assert not any(name.startswith(("ours", "model")) for name in errors), errors
    warmup = results["ours_engine"]["warmup"]
    assert warmup["eager_steps"] >= 8, "the eager warm-up steps run on CPU too"
    assert warmup["graphs"] == 0 and 0.0 <= warmup["capture_s"] <= results["ours_engine"]["warmup_s"], warmup
    assert results["model"]["shared_with_transformers"]
    sections = results["workloads"]
    assert set(sections) == {"burst", "poisson"}
    for name, section in sections.items():
        ours, workload = section["ours"], section["workload"]
        assert ours["generated_tokens"] == workload["requests"] * workload["new_tokens"], name
        assert ours["preemptions"] == 0 and ours["decode_steps"] > 0 and ours["ttft_median_s"] > 0
        if "transformers" not in errors and f"transformers.{name}" not in errors:
            # Same weights, float32 on both sides: the same greedy tokens for every request.
            assert section["agreement"]["identical_requests"] == workload["requests"], (name, section["agreement"])
            assert section["transformers"]["tokens_per_s"] > 0
    burst = sections["burst"]["ours"]
    assert burst["roofline_median_ms"] > 0 and burst["decode_iter_at_rows_median_ms"] > 0
    assert sections["poisson"]["workload"]["arrivals_s"][1] > 0, "the Poisson requests arrive over time"
    assert "generated tokens/s" in printed and "target burst_throughput_vs_transformers" in printed
    assert "eager warm-up steps, no CUDA graphs," in printed, "a CPU run says it has no graphs"
    assert printed.rstrip().endswith(f"wrote {out}")


def test_kernel_classes() -> None:
    _bench()  # first: benchmarks/ is on sys.path once bench_e2e is loaded
    from step_profile import classify

    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify("decode_items_kernel") == "attention"
    assert classify("_prefill_kernel") == "attention"
    for ours in ("_decode_hopper_kernel", "_decode_hopper_ws_kernel", "_hopper_prefill_kernel", "_mla_hopper_kernel",
                 "_mla_balanced_merge_kernel", "_mla_prefill_hopper_kernel", "_dequantize_blocks_kernel",
                 "decode_combine_kernel"):  # fmt: skip
        assert classify(ours) == "attention", ours
    assert classify("_rotary_write_kernel") == "boundary" and classify("_value_runs_kernel") == "boundary"
    assert classify("_latent_boundary_kernel") == "boundary"
    assert classify("_rms_norm_kernel") == "elementwise"
    assert classify("Memcpy HtoD (Pinned -> Device)") == "copy"


def test_profile_splits_attention_into_its_parts() -> None:
    """The attention class is summed by part too (decode chunks, combine, prefill with its
    block dequantization, MLA, flash-attn), in the JSON and, with two or more parts, in the
    printed line."""
    _bench()  # puts benchmarks/ on the import path
    from step_profile import attention_part, breakdown

    parts = {"decode_items_kernel": "decode", "_decode_hopper_kernel": "decode", "_decode_hopper_ws_kernel": "decode",
             "decode_combine_kernel": "combine",
             "_prefill_kernel": "prefill", "_hopper_prefill_kernel": "prefill", "_dequantize_blocks_kernel": "prefill",
             "_mla_prefill_hopper_kernel": "mla", "_mla_balanced_merge_kernel": "mla",
             "flash_fwd_splitkv_kernel": "flash-attn"}  # fmt: skip
    for name, part in parts.items():
        assert attention_part(name) == part, name

    class Span:  # torch.profiler's time range, in us
        def __init__(self, start: float, us: float) -> None:
            self.start, self.end = start, start + us

        def elapsed_us(self) -> float:
            return self.end - self.start

    class Event:
        device_type = "DeviceType.CUDA"

        def __init__(self, name: str, us: float, start: float) -> None:
            self.name, self.time_range = name, Span(start, us)

    def laid_out(kernels: list[tuple[str, float]]) -> list[Event]:
        """One kernel after the other."""
        starts = [sum(us for _, us in kernels[:i]) for i in range(len(kernels))]
        return [Event(name, us, start) for (name, us), start in zip(kernels, starts, strict=True)]

    events = laid_out([("decode_items_kernel", 300.0), ("decode_combine_kernel", 20.0), ("_prefill_kernel", 80.0),
                       ("nvjet_tst_128x256", 500.0)])  # fmt: skip
    result = breakdown(events, iterations=2)
    assert result.ms["attention"] == pytest.approx(0.2) and result.ms["gemm"] == pytest.approx(0.25)
    assert result.attention_ms == pytest.approx({"decode": 0.15, "combine": 0.01, "prefill": 0.04})
    assert "attention 0.20 (decode 0.15, prefill 0.04, combine 0.01)" in result.line()
    assert result.as_json()["attention_ms_per_iteration"] == {"combine": 0.01, "decode": 0.15, "prefill": 0.04}
    assert breakdown(events[:1], iterations=1).line().endswith("attention 0.30")  # one part: no split
    # A dependent launch (the MLA merge) starts while the kernel before it runs: the overlap
    # counts once, and a GEMM beside it (another stream) is not clipped.
    pdl = [Event("_mla_hopper_kernel", 50.0, 0.0), Event("_mla_balanced_merge_kernel", 30.0, 35.0),
           Event("nvjet_tst_128x256", 100.0, 10.0)]  # fmt: skip
    result = breakdown(pdl, iterations=1)
    assert result.ms["attention"] == pytest.approx(0.065) and result.ms["gemm"] == pytest.approx(0.1)


def test_transformers_gets_the_paged_attention_name_its_version_takes() -> None:
    """transformers 5.23 deprecated the ``paged|`` prefix (a FutureWarning, and a planned
    refusal) except for ``paged|eager``; older versions need it for continuous batching."""
    name = _bench().paged_attention_name
    assert name("paged|sdpa", "5.17.0") == "paged|sdpa"
    assert name("paged|flash_attention_2", "4.57.1") == "paged|flash_attention_2"
    assert name("paged|sdpa", "5.25.0") == "sdpa"
    assert name("paged|flash_attention_2", "5.23.0.dev0") == "flash_attention_2"
    assert name("paged|eager", "5.25.0") == "paged|eager"
    assert name("sdpa", "5.25.0") == "sdpa"


@pytest.mark.parametrize(
    ("cache_dtype", "scale_bytes", "rotation"),
    [("float8_e4m3", 0, "none"), ("int8", 2, "none"), ("int8", 2, "hadamard")],
)
def test_tiny_cpu_run_over_an_8bit_cache(cache_dtype: str, scale_bytes: int, rotation: str) -> None:
    """``--kv-cache-dtype float8_e4m3`` / ``int8``: our engine serves from an 8-bit cache
    (compute stays in the model dtype) and the roofline counts one byte per cached value, plus
    int8's fp16 scale per token and KV head; ``--kv-rotation hadamard`` stores it rotated."""
    threads = torch.get_num_threads()
    try:
        args = ["--device", "cpu", "--tiny", "--skip-transformers", "--workloads", "burst"]
        doc = _bench().run([*args, "--kv-cache-dtype", cache_dtype, "--kv-rotation", rotation])
    finally:
        torch.set_num_threads(threads)
    results, errors = doc["results"], doc["errors"]
    assert not any(name.startswith(("ours", "model")) for name in errors), errors
    assert results["ours_engine"]["cache_dtype"] == cache_dtype
    assert results["ours_engine"]["kv_rotation"] == rotation
    burst = results["workloads"]["burst"]
    assert burst["ours"]["generated_tokens"] == burst["workload"]["requests"] * burst["workload"]["new_tokens"]
    shape = results["model"]["shape"]
    per_head = shape["head_dim"] + scale_bytes
    assert burst["ours"]["kv_bytes_per_token"] == 2 * shape["num_layers"] * shape["num_kv_heads"] * per_head


def test_poisson_alone_probes_its_first_step_at_its_own_token_budget() -> None:
    """``--workloads poisson``: the runner's capacity then holds the Poisson budget only (smaller
    than the burst's), so the cold / warm first-step probes must schedule within it."""
    threads = torch.get_num_threads()
    try:
        doc = _bench().run(["--device", "cpu", "--tiny", "--skip-transformers", "--workloads", "poisson"])
    finally:
        torch.set_num_threads(threads)
    results, errors = doc["results"], doc["errors"]
    assert not any(name.startswith(("ours", "model")) for name in errors), errors
    assert results["ours_engine"]["cold_first_prefill_step_s"] > 0
    poisson = results["workloads"]["poisson"]
    assert poisson["ours"]["generated_tokens"] == poisson["workload"]["requests"] * poisson["workload"]["new_tokens"]


@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3"])
def test_tiny_cpu_run_of_the_latent_attention_model(cache_dtype: str | None) -> None:
    """``--model deepseek-v2-lite`` (its ``--tiny`` stand-in): our engine serves a model of
    latent attention from a latent cache (bf16 here float32, or fp8), and the roofline counts
    one latent (kv_lora_rank + rotary values) a token and layer."""
    threads = torch.get_num_threads()
    try:
        args = ["--device", "cpu", "--tiny", "--skip-transformers", "--workloads", "burst"]
        args += ["--model", "deepseek-v2-lite"]
        doc = _bench().run([*args, *(["--kv-cache-dtype", cache_dtype] if cache_dtype else [])])
    finally:
        torch.set_num_threads(threads)
    results, errors = doc["results"], doc["errors"]
    assert not any(name.startswith(("ours", "model")) for name in errors), errors
    shape = results["model"]["shape"]
    assert shape["mla"] is not None and shape["num_kv_heads"] == 1
    burst = results["workloads"]["burst"]
    assert burst["ours"]["generated_tokens"] == burst["workload"]["requests"] * burst["workload"]["new_tokens"]
    latent = shape["mla"]["kv_lora_rank"] + shape["mla"]["qk_rope_head_dim"]
    itemsize = 1 if cache_dtype else 4
    assert burst["ours"]["kv_bytes_per_token"] == shape["num_layers"] * latent * itemsize


def test_the_latent_attention_model_runs_without_transformers_only() -> None:
    with pytest.raises(SystemExit):
        _bench().run(["--device", "cpu", "--tiny", "--model", "deepseek-v2-lite"])


def test_kv_rotation_needs_an_8bit_cache() -> None:
    with pytest.raises(SystemExit):
        _bench().run(["--device", "cpu", "--tiny", "--kv-rotation", "hadamard"])


def test_hopper_decode_is_a_triton_backend_choice() -> None:
    """``--hopper-decode`` (always), ``never`` and ``auto`` name the backend's
    True / False / None; left out, the backend's default; refused with another backend or
    another word."""
    bench = _bench()
    for args in (["--hopper-decode"], ["--hopper-decode", "never"]):
        with pytest.raises(SystemExit):
            bench.run(["--device", "cuda", "--backend", "reference", *args])
    parser = bench._parser()
    for args, word in (([], None), (["--hopper-decode"], "always"), (["--hopper-decode", "auto"], "auto"),
                       (["--hopper-decode", "never"], "never")):  # fmt: skip
        assert bench.settings_from(parser.parse_args(args)).hopper_decode == word
    assert bench.HOPPER_DECODE == {"always": True, "never": False, "auto": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hopper-decode", "short-fp8-blocks"])


def test_direct_decode_graphs_is_a_triton_backend_choice() -> None:
    """``--[no-]direct-decode-graphs`` builds the triton backend with both graph variants or
    one; with another backend it is refused; left out, the backend's default (both) holds."""
    bench = _bench()
    from examples.engine import cache_config_for

    for flag in ("--direct-decode-graphs", "--no-direct-decode-graphs"):
        with pytest.raises(SystemExit):
            bench.run(["--device", "cuda", "--backend", "reference", flag])
    config = cache_config_for(bench.LLAMA3_8B, block_size=256, dtype="bfloat16", num_blocks=8, device="cpu",
                              backend="reference")  # fmt: skip
    assert bench._triton_backend(bench.LLAMA3_8B, config).graph_variants() == ("combine", "direct")
    backend = bench._triton_backend(bench.LLAMA3_8B, config, direct_decode_graphs=False)
    assert backend.graph_variants() == (None,)
    parser = bench._parser()
    assert bench.settings_from(parser.parse_args([])).direct_decode_graphs is None
    assert bench.settings_from(parser.parse_args(["--no-direct-decode-graphs"])).direct_decode_graphs is False


@pytest.mark.parametrize(
    ("name", "default"),
    [("graph_dequant_prefill", False), ("value_runs", True), ("hopper_decode_overlap", False),
     ("hopper_decode_ws_loader", True), ("latent_mixed_graphs", True)],
)  # fmt: skip
def test_backend_switches_reach_the_triton_backend(name: str, default: bool) -> None:
    """``--[no-]graph-dequant-prefill``, ``--[no-]value-runs``, ``--[no-]hopper-decode-overlap``
    and ``--[no-]latent-mixed-graphs`` reach the triton backend (left out: the backend's
    default, off, on, off and on); refused with another backend."""
    bench = _bench()
    from examples.engine import cache_config_for

    flag = "--" + name.replace("_", "-")
    for given in (flag, "--no-" + flag[2:]):
        with pytest.raises(SystemExit):
            bench.run(["--device", "cuda", "--backend", "reference", given])
    parser = bench._parser()
    assert getattr(bench.settings_from(parser.parse_args([])), name) is None
    assert getattr(bench.settings_from(parser.parse_args([flag])), name) is True
    assert getattr(bench.settings_from(parser.parse_args(["--no-" + flag[2:]])), name) is False
    config = cache_config_for(bench.LLAMA3_8B, block_size=256, dtype="float8_e4m3", num_blocks=8, device="cpu",
                              backend="reference", compute_dtype="bfloat16")  # fmt: skip
    assert getattr(bench._triton_backend(bench.LLAMA3_8B, config), name) is default
    assert getattr(bench._triton_backend(bench.LLAMA3_8B, config, **{name: not default}), name) is (not default)


@pytest.mark.parametrize(("cache_dtype", "tile"), [("float8_e4m3", 128), ("bfloat16", 64)])
def test_hopper_decode_backend_puts_one_token_rows_on_the_gluon_kernel(
    cache_dtype: str, tile: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the Gluon decode kernel could run (here made to say so), ``--hopper-decode``'s
    backend takes it at block 256 and ``--hopper-decode never``'s does not; the default
    (``auto``, the registry's backend) takes it for the bf16 cache and for fp8 under bf16
    queries alike."""
    bench = _bench()
    import attention.triton_backend as backend_module
    from attention.triton_backend import TritonBackend
    from examples.engine import cache_config_for

    monkeypatch.setattr(backend_module, "hopper_prefill_possible", lambda device: True)
    shape = bench.LLAMA3_8B  # head_dim 128: the Gluon kernel's
    config = cache_config_for(shape, block_size=256, dtype=cache_dtype, num_blocks=8, device="cpu",
                              backend="reference", compute_dtype="bfloat16")  # fmt: skip
    spec = shape.attention_spec("bfloat16", cache_dtype)
    cuda = torch.device("cuda")
    for word, gluon in (("always", True), ("auto", True), ("never", False)):
        backend = bench._triton_backend(shape, config, hopper_decode=bench.HOPPER_DECODE[word])
        assert backend.spec == spec
        launch, _ = backend._decode_launch(1, 256, cuda)
        assert launch.hopper_wgmma == gluon, word
        assert not gluon or launch.block_n == tile
        assert not launch.hopper_overlap
        assert launch.hopper_ws_loader == gluon  # the loader warp: on by default
    assert TritonBackend(spec)._decode_launch(1, 256, cuda)[0].hopper_wgmma
    overlapped = bench._triton_backend(shape, config, hopper_decode=True, hopper_decode_overlap=True)
    launch, _ = overlapped._decode_launch(1, 256, cuda)
    assert launch.hopper_wgmma and launch.hopper_overlap and not launch.hopper_ws_loader
    no_loader = bench._triton_backend(shape, config, hopper_decode=True, hopper_decode_ws_loader=False)
    launch, _ = no_loader._decode_launch(1, 256, cuda)
    assert launch.hopper_wgmma and not launch.hopper_ws_loader


def test_decode_launch_words_make_the_backends_launch() -> None:
    bench = _bench()
    from attention.triton_kernels import DecodeConfig
    from examples.engine import cache_config_for

    launch = bench.parse_decode_launch("n128 w4 s3 p3")
    assert launch == DecodeConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=3)
    assert bench.parse_decode_launch("s2 w8 n64").programs_per_sm is None
    assert bench.parse_decode_launch("n128 w4 s3 c1").fused_combine
    assert not bench.parse_decode_launch("n128 w4 s3 c0").fused_combine
    assert bench.parse_decode_launch("n128 w4 s4 p2 h75").slot_share == 0.75
    assert bench.parse_decode_launch("n128 w4 s4 k2").combine_num_warps == 2
    assert launch.slot_share is None
    shape = bench.LLAMA3_8B
    config = cache_config_for(shape, block_size=256, dtype="float8_e4m3", num_blocks=8, device="cpu",
                              backend="reference", compute_dtype="bfloat16")  # fmt: skip
    backend = bench._triton_backend(shape, config, decode_config=launch)
    config_256, policy = backend._decode_launch(1, 256)
    assert config_256 == launch and policy.programs_per_sm == 3


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("n128 w4", "s<stages>"),
        ("n128 w4 s3 x2", "'x2'"),
        ("n128 n64 w4 s3", "'n64'"),
        ("n100 w4 s3", "block_n"),
        ("n128 w4 s3 c2", "'c2'"),
        ("n128 w4 s3 h500", "slot_share"),
        ("n128 w4 s3 k3", "combine_num_warps"),
    ],
)
def test_bad_decode_launch_is_refused_naming_the_word(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _bench().parse_decode_launch(text)
    with pytest.raises(SystemExit):
        _bench().run(["--device", "cpu", "--tiny", "--decode-launch", text])


def test_slowest_iterations_name_the_longest_periods_but_the_first() -> None:
    bench = _bench()
    periods = [9.0, 0.010, 0.500, 0.020, 0.007]  # the first iteration has no period of its own
    its = [bench.IterRecord(rows=i + 1, tokens=10 * i, prefill_rows=i % 2, period_s=p, host_s=p / 2, kv_tokens=0)
           for i, p in enumerate(periods)]  # fmt: skip
    slow = bench.slowest_iterations(its, count=2)
    assert [s["iteration"] for s in slow] == [2, 3]
    assert slow[0] == {"iteration": 2, "rows": 3, "tokens": 20, "prefill_rows": 0, "period_ms": 500.0,
                       "host_ms": 250.0}  # fmt: skip
    assert bench.slowest_iterations(its[:1]) == []


def test_compiles_line_names_the_kernels_compiled_while_serving() -> None:
    bench = _bench()
    from examples.engine.compile_watch import CompileWatch, KernelCompile

    watch = CompileWatch(available=True)
    assert bench.compiles_line(watch).endswith("none")
    watch.compiles += [KernelCompile("_a", "", 0.0), KernelCompile("_b", "", 1.0), KernelCompile("_a", "", 2.0)]
    assert "3 (_a x2, _b x1)" in bench.compiles_line(watch)
    assert "unknown" in bench.compiles_line(CompileWatch())


def test_profile_prefill_is_a_cuda_option_printed_without_a_weight_rate() -> None:
    """``--profile-prefill`` sets the setting, is refused on a CPU device (the profile times CUDA
    kernels), and its section prints beside the decode profile, without the GEMMs' rate
    against the copy bandwidth (a prefill step's GEMMs are not weight reads)."""
    bench = _bench()
    parser = bench._parser()
    assert bench.settings_from(parser.parse_args(["--profile-prefill"])).profile_prefill
    assert not bench.settings_from(parser.parse_args([])).profile_prefill
    with pytest.raises(SystemExit):
        bench.run(["--device", "cpu", "--tiny", "--profile-prefill"])
    section = {"iterations": 8, "ms_per_iteration": {"gemm": 60.0, "attention": 4.0}, "gpu_ms_per_iteration": 70.0,
               "wall_ms_per_iteration": 71.0, "gpu_idle_ms_per_iteration": 1.0}  # fmt: skip
    results = {"workloads": {"burst": {"profile": {**section, "gemm_fraction_of_copy_bw": 0.7},
                                       "prefill_profile": section}}}  # fmt: skip
    text = bench.table(results, {})
    decode_line = next(line for line in text.splitlines() if line.startswith("profile ("))
    prefill_line = next(line for line in text.splitlines() if line.startswith("prefill profile ("))
    assert "GEMMs at 0.70 of copy bandwidth" in decode_line
    assert "GPU 70.00 = gemm 60.00, attention 4.00" in prefill_line and "GEMMs at" not in prefill_line


def test_host_profile_serves_a_workload_timed_then_under_cprofile(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/host_profile.py``: the tiny latent model's Poisson workload on CPU, its
    medians, then the two cProfile tables, the serving loop's ``serve`` among the top
    cumulative entries."""
    host_profile = load_bench("host_profile")
    threads = torch.get_num_threads()
    try:
        host_profile.main(["--requests", "4", "--top", "8", "--", "--device", "cpu", "--tiny", "--model",
                           "deepseek-v2-lite", "--workloads", "poisson"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "poisson: tokens_per_s" in printed and "mixed_host_median_ms" in printed
    assert printed.count("function calls") == 2 and "Ordered by: cumulative time" in printed
    cumulative = printed.split("Ordered by: cumulative time")[1]
    assert "bench_e2e.py" in cumulative and "(serve)" in cumulative
