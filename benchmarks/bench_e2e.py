"""End-to-end serving on one GPU: our engine vs transformers' continuous batching, same
weights, same prompts, same run, on two workloads.

Model: Llama-3-8B-shaped (32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads, head_dim
128, vocab 128256, rope theta 500000), random bf16 weights drawn on the GPU (std
fan_in ** -0.5, seeded), one set shared by both engines: transformers' ``LlamaForCausalLM`` is
built on the meta device, allocated on the GPU and filled, and our model takes the same
tensors (:func:`examples.model.checkpoints.from_transformers`: shared, except the fused q/k/v
and gate/up projections, which are copies). ``--model deepseek-v2-lite``: latent attention
(:data:`DEEPSEEK_V2_LITE`: 16 heads over a 576-wide latent, 27 layers, dense MLPs), our engine
only (``--skip-transformers``).

Workloads (prompt lengths LogNormal(median 512, sigma 0.6) capped at 2048, random token ids,
128 new tokens each, greedy, no EOS):
- ``burst``: 128 requests arriving at once (a batch job: after the prefills, pure decode
  steps at 128 rows);
- ``poisson``: 256 requests arriving as a Poisson process at ``--poisson-rate`` requests/s
  (default 32) with a latency-oriented token budget of ``--poisson-budget`` tokens per step
  (default 256, for both engines), so prompts are prefilled in chunks beside the decode
  rows and most steps are mixed, as a server's are. (At 512-token prompts, 64 or more running
  rows need about 40k prompt tokens/s, 650 TFLOP/s of prefill on an 8B model: more than the
  GPU has beside decoding; ``--poisson-rate 64 --poisson-budget 8192`` shows that regime.)

(a) ours: examples' scheduler + model runner, triton backend, CUDA graphs for decode and mixed steps,
    steps overlapped with the host (``StepPipeline``; ``--sequential`` turns it off), warmed
    up once before timing. Per iteration: its period (wall time between two launches: the
    cadence tokens come at) and its host work (schedule + plan + launch, waits excluded).
(b) transformers: ``model.continuous_batching_context_manager(...)`` (what ``generate_batch``
    wraps; its warm-up captures CUDA graphs before the timed part), ``paged|flash_attention_2``
    (falls back to ``paged|sdpa`` when flash-attn is missing), record_timestamps=True; the
    Poisson requests are added at their arrival times from a second thread.

Reported per workload: generated tokens/s; time to first token (median, p99) from each
request's arrival; inter-token latency (median, p99); our pure-decode iteration at the
largest batch against the roofline (weight bytes + K/V bytes the step reads) / device-to-device
copy bandwidth measured in this run, and our mixed iterations (prefill + decode rows). With
``--profile`` (default on CUDA) a window of iterations of each workload is re-run under
torch.profiler: GPU time per iteration by kernel class (gemm, attention, boundary, elementwise,
copy; ``step_profile.py``) and the wall time left, which is host work the GPU waited for.
``--profile-prefill`` profiles the burst's first iterations too (its prompts' prefill and
mixed steps, eager with latent attention), in a third serve of that workload. Cold start: our
first prefill step before any warm-up vs after it, and the warm-up time.

``--kv-cache-dtype float8_e4m3`` serves ours from an fp8 cache (unit scales, V token-major as
``kvcache`` allocates it; compute stays bf16), ``--kv-cache-dtype int8`` from an int8 cache
with a scale per token and head: with ``--profile``, the attention class of the
per-iteration breakdown against a bf16 run gives the end-to-end attention time they buy.
``--kv-rotation hadamard`` stores that cache's K and V rotated (``cache.kv_rotation``): against
the same run without it, what the rotation around the kernels costs.

Every part runs in its own try/except: a failure is recorded under ``errors`` in the JSON and
the rest still runs. A table is printed last; the JSON goes to ``--out``.

Run (from the project root, on the GPU machine; ../shared/device/stage.sh first):
    source .device-extras/activate.sh && python3 benchmarks/bench_e2e.py --out e2e.json
    python3 benchmarks/bench_e2e.py --quick --skip-transformers     # fewer requests, ours only
    python benchmarks/bench_e2e.py --device cpu --tiny               # the same code path, tiny model, CPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import itertools
import json
import math
import platform
import random
import statistics
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by file path (the tests): common.py is beside this file
    sys.path.insert(0, str(HERE))

# common puts this checkout first on sys.path: the project is imported from source.
from common import RESULTS, package_version  # noqa: E402
from step_profile import KernelBreakdown, attention_parts_text, breakdown  # noqa: E402

from attention import StepCapacity  # noqa: E402
from attention.checks import cdiv  # noqa: E402
from attention.dtypes import torch_dtype  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.compile_watch import CompileWatch, describe_compiles  # noqa: E402
from examples.engine.loop import StepPipeline  # noqa: E402
from examples.engine.runner import LaunchedStep, ModelRunner  # noqa: E402
from examples.engine.scheduler import Request, Scheduler, StepBatch, make_preemption  # noqa: E402
from examples.model import (  # noqa: E402
    Llama,
    LlamaShape,
    MLAShape,
    empty_llama,
    from_transformers,
    init_random_,
)
from kvcache import ScheduledRow  # noqa: E402

LLAMA3_8B = LlamaShape(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    norm_eps=1e-5,
)
TINY = LlamaShape(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
#: DeepSeek-V2-Lite's attention (arXiv:2405.04434; its config.json: 16 heads over a latent of
#: kv_lora_rank 512 + 64 rotary values, qk_nope 128, v_head 128, no q LoRA) and sizes (27 layers,
#: hidden 2048, vocab 102400), with every MLP dense at the first layer's width (10944): the
#: latent cache of DeepSeek-V3 at 8-way tensor parallelism (16 heads a rank) on one GPU.
#: The rotary is plain (no YaRN scaling): random weights.
DEEPSEEK_V2_LITE = LlamaShape(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    num_layers=27,
    num_heads=16,
    num_kv_heads=1,
    head_dim=192,
    norm_eps=1e-6,
    mla=MLAShape(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
)
TINY_MLA = LlamaShape(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=24,
    mla=MLAShape(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
)
#: ``--model`` choices: (the shape, its ``--tiny`` stand-in).
MODELS = {"llama3-8b": (LLAMA3_8B, TINY), "deepseek-v2-lite": (DEEPSEEK_V2_LITE, TINY_MLA)}
#: Targets (issue "The serving loop at the roofline"), checked on the 8B shape at 128 rows.
ROOFLINE_TARGET = 1.25
ITL_TARGET = 0.65
THROUGHPUT_TARGET = 1.4
MIXED_TARGET = 1.4
ELEMENTWISE_TARGET_MS = 0.6
GEMM_BANDWIDTH_TARGET = 0.85
HOST_WAIT_TARGET_MS = 0.3


@dataclass(frozen=True)
class Settings:
    device: str
    tiny: bool
    requests: int
    new_tokens: int
    median_prompt: int
    sigma: float
    max_prompt: int
    block_size: int
    token_budget: int
    max_running: int
    backend: str
    dtype: str
    graphs: bool
    overlap: bool
    seed: int
    skip_transformers: bool
    hf_attention: str
    hf_timeout_s: float
    poisson_requests: int
    poisson_rate: float
    poisson_budget: int
    profile: bool
    workloads: tuple[str, ...]
    profile_prefill: bool = False  # also profile the burst's first (prefill / mixed) iterations
    kv_cache_dtype: str | None = None  # None: the compute dtype; float8_e4m3 or int8: an 8-bit cache
    kv_rotation: str = "none"  # hadamard: that 8-bit cache stores K and V rotated
    hopper_decode: str | None = None  # one-token rows on the Gluon kernel: HOPPER_DECODE's words; None: the default
    decode_launch: str | None = None  # "n128 w4 s3 p3": a fixed decode launch (parse_decode_launch)
    hopper_decode_overlap: bool | None = None  # the Gluon decode kernel's overlapped loop (None: default)
    hopper_decode_ws_loader: bool | None = None  # the Gluon decode kernel's loader warp (None: default)
    direct_decode_graphs: bool | None = None  # graph buckets also captured without the decode combine (None: default)
    graph_dequant_prefill: bool | None = None  # graph steps' 8-bit prefill rows over a 16-bit copy (None: default)
    value_runs: bool | None = None  # token-major V of prefill rows written in coalesced runs (None: default)
    latent_mixed_graphs: bool | None = None  # latent attention: steps with prefill rows captured too (None: default)
    hopper_mla_fused_merge: bool | None = None  # the Hopper MLA decode kernel merges split tokens (None: default)
    model: str = "llama3-8b"  # a key of MODELS

    @property
    def cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    @property
    def shape(self) -> LlamaShape:
        full, tiny = MODELS[self.model]
        return tiny if self.tiny else full

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def settings_from(args: argparse.Namespace) -> Settings:
    on_cuda = args.device.startswith("cuda")
    s = Settings(
        device=args.device,
        tiny=args.tiny,
        requests=128,
        new_tokens=128,
        median_prompt=512,
        sigma=0.6,
        max_prompt=2048,
        block_size=256,
        token_budget=8192,
        max_running=128,
        backend="triton" if on_cuda else "reference",
        dtype="bfloat16" if on_cuda else "float32",
        graphs=on_cuda and not args.eager,
        overlap=not args.sequential,
        seed=args.seed,
        skip_transformers=args.skip_transformers,
        hf_attention=args.hf_attention or ("paged|flash_attention_2" if on_cuda else "paged|sdpa"),
        hf_timeout_s=150.0,  # keeps the whole run under 10 minutes even if transformers is slow
        poisson_requests=256,
        poisson_rate=args.poisson_rate,
        poisson_budget=args.poisson_budget,
        profile=on_cuda if args.profile is None else args.profile,
        workloads=tuple(args.workloads.split(",")),
        profile_prefill=args.profile_prefill,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_rotation=args.kv_rotation,
        hopper_decode=args.hopper_decode,
        decode_launch=args.decode_launch,
        **{name: getattr(args, name) for name in BACKEND_SWITCHES},
        model=args.model,
    )
    if args.quick:
        s = replace(s, requests=32, new_tokens=32, max_running=32, poisson_requests=64)
    if args.tiny:
        s = replace(
            s, requests=8, new_tokens=8, median_prompt=40, max_prompt=96, block_size=32, token_budget=64,
            max_running=8, hf_timeout_s=120.0, poisson_requests=8, poisson_rate=200.0, poisson_budget=32,
        )  # fmt: skip
    overrides = {
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "backend": args.backend,
        "block_size": args.block_size,
        "token_budget": args.token_budget,
    }
    s = replace(s, **{k: v for k, v in overrides.items() if v is not None})
    if args.requests is not None and args.max_running is None:
        s = replace(s, max_running=min(s.max_running, s.requests))
    if args.max_running is not None:
        s = replace(s, max_running=args.max_running)
    return s


# ---- small helpers -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Timer:
    """Seconds of device work between start() and stop(): CUDA events on a GPU (the caller
    syncs in between anyway), a perf_counter elsewhere."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self._t = 0.0
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end)) / 1e3
        return time.perf_counter() - self._t


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("triton", "transformers", "flash-attn", "flash_attn", "safetensors"):
        version = package_version(dist)
        if version is not None:
            out[dist] = version
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["device"] = props.name
        out["sms"] = props.multi_processor_count
        out["memory_gib"] = round(props.total_memory / 2**30, 1)
    return out


def copy_bandwidth(device: str) -> dict[str, Any]:
    """Device-to-device copy bandwidth: bytes read + written / time of a large ``copy_``
    (median of 10 after 3 warm-ups)."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        timer.start()
        dst.copy_(src)
        times.append(timer.stop())
    t = statistics.median(times)
    del src, dst
    return {"bytes": 2 * n, "seconds": t, "gb_per_s": 2 * n / t / 1e9}


# ---- the model ---------------------------------------------------------------------------


def paged_attention_name(name: str, transformers_version: str) -> str:
    """The ``attn_implementation`` to give transformers for continuous batching: ``name`` as
    given (``paged|sdpa``, ``paged|flash_attention_2``) before 5.23; from 5.23 without the
    ``paged|`` prefix, which transformers deprecated there (a warning; it plans to refuse it),
    except ``paged|eager``, which keeps it."""
    parts = transformers_version.split(".")
    major, minor = (int(p) if p.isdigit() else 0 for p in [*parts, "0", "0"][:2])
    if (major, minor) >= (5, 23) and name.startswith("paged|") and name != "paged|eager":
        return name.removeprefix("paged|")
    return name


def build_transformers_model(shape: LlamaShape, *, device: str, dtype: torch.dtype, seed: int) -> Any:
    """transformers' ``LlamaForCausalLM`` of ``shape``, built on the meta device, allocated
    on ``device`` in ``dtype`` (never in host memory) and filled by :func:`init_random_`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.norm_eps,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    causal_lm: Any = transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = causal_lm(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    init_random_(model, seed=seed)
    # The rotary tables are non-persistent buffers that to_empty left uninitialised (and a
    # dtype cast would have rounded to bf16): rebuild them in float32.
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config=model.config).to(device))
    return model.eval()


def weight_bytes(model: Llama) -> int:
    """Bytes a decode step reads of the weights: every parameter, except the embedding table
    (only the step's rows are gathered) unless lm_head is that table."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed.weight" and not model.shape.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


# ---- the workloads -----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Prompts, their arrival times (seconds after the start; all 0 for a burst) and the most
    tokens one step may take (both engines)."""

    name: str
    prompts: list[list[int]]
    arrivals: list[float]
    token_budget: int

    def describe(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        return {
            "requests": len(self.prompts),
            "prompt_tokens": sum(lengths),
            "prompt_median": statistics.median(lengths),
            "prompt_min": min(lengths),
            "prompt_max": max(lengths),
            "arrivals_s": [round(min(self.arrivals), 3), round(max(self.arrivals), 3)],
            "token_budget": self.token_budget,
        }


def make_prompts(s: Settings, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n = round(rng.lognormvariate(math.log(s.median_prompt), s.sigma))
        n = max(1, min(s.max_prompt, n))
        prompts.append([rng.randrange(s.shape.vocab_size) for _ in range(n)])
    return prompts


def make_workloads(s: Settings) -> dict[str, Workload]:
    burst = Workload("burst", make_prompts(s, s.requests, s.seed), [0.0] * s.requests, s.token_budget)
    rng = random.Random(s.seed + 1)
    arrivals, t = [], 0.0
    for _ in range(s.poisson_requests):
        arrivals.append(t)
        t += rng.expovariate(s.poisson_rate)
    poisson = Workload("poisson", make_prompts(s, s.poisson_requests, s.seed + 2), arrivals, s.poisson_budget)
    return {w.name: w for w in (burst, poisson) if w.name in s.workloads}


# ---- (a) ours ----------------------------------------------------------------------------


def _first_step_rows(prompts: list[list[int]], budget: int) -> list[tuple[int, int]]:
    """(prompt index, tokens) of the first step the scheduler would run: prompts in order,
    the last one cut to the token budget."""
    rows, left = [], budget
    for i, p in enumerate(prompts):
        if left == 0:
            break
        n = min(len(p), left)
        rows.append((i, n))
        left -= n
    return rows


def _probe(runner: ModelRunner, prompts: list[list[int]], budget: int, device: str) -> float:
    """Seconds of the workload's first prefill step, run on throw-away sequences."""
    manager = runner.manager
    rows = _first_step_rows(prompts, budget)
    ids = [("__probe__", i) for i, _ in rows]
    for seq_id, (_, n) in zip(ids, rows, strict=True):
        manager.allocate(seq_id, n)
    try:
        scheduled = [ScheduledRow(seq_id, n, start=0) for seq_id, (_, n) in zip(ids, rows, strict=True)]
        tokens = [t for i, n in rows for t in prompts[i][:n]]
        sync(device)
        start = time.perf_counter()
        runner.launch(scheduled, tokens).tokens()
        return time.perf_counter() - start
    finally:
        for seq_id in ids:
            manager.free(seq_id, reason="aborted")


@dataclass
class OurEngine:
    """Our engine, built and warmed up once, serving every workload in turn."""

    model: Llama
    runner: ModelRunner
    summary: dict[str, Any]


_LAUNCH_FIELDS = {
    "n": "block_n",
    "w": "num_warps",
    "s": "num_stages",
    "p": "programs_per_sm",
    "c": "fused_combine",
    "h": "slot_share",
    "k": "combine_num_warps",
}


def parse_decode_launch(text: str) -> Any:
    """``--decode-launch``: a DecodeConfig from words ``n<tokens a tile> w<warps> s<stages>``
    and optionally ``p<programs an SM>``, ``c1`` (split rows merged by the last of their
    programs, no combine launch; ``c0`` the default), ``h<percent>`` (the slot share:
    ``h100`` is 1.0; none: the policy's 0) and ``k<warps>`` (the combine kernel's warps,
    default 4), e.g. ``n128 w4 s4 p2 h100 k2``; ValueError naming the word."""
    from attention.triton_kernels import DecodeConfig

    values: dict[str, int] = {}
    for word in text.split():
        field = _LAUNCH_FIELDS.get(word[:1])
        bad_flag = field == "fused_combine" and word[1:] not in ("0", "1")
        if field is None or not word[1:].isdigit() or field in values or bad_flag:
            raise ValueError(
                f"--decode-launch: {word!r} in {text!r}; words are n<tile> w<warps> s<stages> [p<per SM>] [c0|c1] "
                f"[h<slot share %>] [k<combine warps>]"
            )
        values[field] = int(word[1:])
    words = {"n": "n<tile>", "w": "w<warps>", "s": "s<stages>"}
    missing = [word for k, word in words.items() if _LAUNCH_FIELDS[k] not in values]
    if missing:
        raise ValueError(f"--decode-launch: {text!r} lacks {', '.join(missing)}")
    return DecodeConfig(
        block_n=values["block_n"],
        num_warps=values["num_warps"],
        num_stages=values["num_stages"],
        programs_per_sm=values.get("programs_per_sm"),
        fused_combine=bool(values.get("fused_combine", 0)),
        slot_share=values["slot_share"] / 100 if "slot_share" in values else None,
        combine_num_warps=values.get("combine_num_warps", 4),
    )


#: ``--hopper-decode``'s words: TritonBackend's ``hopper_decode``.
HOPPER_DECODE: dict[str, bool | None] = {"always": True, "never": False, "auto": None}

#: TritonBackend's on/off switches, each a ``--[no-]<name>`` flag (None, left out: the
#: backend's default), with the flag's help.
BACKEND_SWITCHES: dict[str, str] = {
    "hopper_decode_overlap": "where decode rows take the Gluon kernel, its overlapped loop (a tile's S MMAs and "
    "softmax while the previous tile's P V MMAs run; default: the backend's, off)",
    "hopper_decode_ws_loader": "where decode rows take the Gluon kernel's loop in turn, its TMA loads in a loader "
    "warp (default: the backend's, on)",
    "direct_decode_graphs": "graph buckets captured also without the decode combine (default: the backend's, on)",
    "graph_dequant_prefill": "with an 8-bit cache: graph steps' prefill rows on the Hopper kernel over a 16-bit copy "
    "of their blocks (default: the backend's, off)",
    "value_runs": "with an fp8 cache: prefill rows' token-major V written in coalesced runs (default: the "
    "backend's, on)",
    "latent_mixed_graphs": "with latent attention (--model deepseek-v2-lite): steps with prefill rows up to the "
    "graph token limit captured too, every row absorbed (default: the backend's, on; off: eager, long rows "
    "decompressed)",
    "hopper_mla_fused_merge": "with latent attention on an sm_90 GPU: the Hopper MLA decode kernel merges the tokens "
    "split across its programs itself, no merge launch (default: the backend's, off)",
}


def _triton_backend(shape: LlamaShape, config: Any, **knobs: Any) -> Any:
    """The triton backend for ``config``'s cache with tuning knobs: ``hopper_decode``
    (``--hopper-decode [always|never|auto]``: on an sm_90 GPU one-token decode rows
    on the Gluon kernel of ``attention/triton_kernels/decode_hopper.py``),
    ``hopper_decode_overlap`` (``--[no-]hopper-decode-overlap``; that kernel's overlapped loop, off
    by default), ``hopper_decode_ws_loader`` (``--[no-]hopper-decode-ws-loader``; its loads in a
    loader warp, on by default), ``direct_decode_graphs`` (``--[no-]direct-decode-graphs``; on by default),
    ``graph_dequant_prefill`` (``--[no-]graph-dequant-prefill``; off by default),
    ``value_runs`` (``--[no-]value-runs``; on by default), ``latent_mixed_graphs``
    (``--[no-]latent-mixed-graphs``; on by default) and ``decode_config`` (``--decode-launch``:
    every decode row on that launch; the burst has no rows of several new tokens)."""
    from attention.triton_backend import TritonBackend

    return TritonBackend(shape.attention_spec(config.compute_dtype, config.cache.dtype), **knobs)


def build_ours(model: Llama, workloads: dict[str, Workload], s: Settings) -> OurEngine:
    shape = model.shape
    bs = s.block_size
    peaks = {
        name: [len(p) + s.new_tokens - 1 for p in w.prompts] for name, w in workloads.items()
    }  # every request's peak at once: no preemption in any workload
    longest = max(max(v) for v in peaks.values())
    num_blocks = max(sum(cdiv(p, bs) for p in v) for v in peaks.values()) + 2 * cdiv(longest, bs) + 8
    config = cache_config_for(
        shape, block_size=bs, dtype=s.cache_dtype, num_blocks=num_blocks, device=s.device, backend=s.backend,
        compute_dtype=s.dtype if s.kv_cache_dtype else None, kv_rotation=s.kv_rotation,
    )  # fmt: skip
    knobs: dict[str, Any] = {}
    if s.hopper_decode is not None:
        knobs["hopper_decode"] = HOPPER_DECODE[s.hopper_decode]
    if s.decode_launch is not None:
        knobs["decode_config"] = parse_decode_launch(s.decode_launch)
    knobs.update({name: getattr(s, name) for name in BACKEND_SWITCHES if getattr(s, name) is not None})
    backend = _triton_backend(shape, config, **knobs) if knobs else None
    engine = engine_for(config, shape, backend=backend)
    capacity = StepCapacity(
        max_rows=s.max_running,
        max_tokens=max(*(w.token_budget for w in workloads.values()), s.max_running),
        max_blocks_per_seq=cdiv(longest, bs),
    )
    runner = ModelRunner(
        model, engine.cache, engine.manager, engine.backend, capacity, use_graphs=s.graphs and engine.graphs_allowed
    )
    out: dict[str, Any] = {
        "backend": engine.backend.name,
        "cache_dtype": s.cache_dtype,
        "kv_rotation": s.kv_rotation,
        "hopper_decode": s.hopper_decode,
        "decode_launch": s.decode_launch,
        **{name: getattr(s, name) for name in BACKEND_SWITCHES},
        "fused_rotary": engine.backend.info.fused_rotary,
        "cuda_graphs": runner.graphs is not None,
        "overlap": s.overlap,
        "num_blocks": num_blocks,
        "block_size": bs,
        "token_budget": s.token_budget,
        "max_running": s.max_running,
        "cache_gib": engine.cache.nbytes / 2**30,
    }
    first = next(iter(workloads.values()))  # probed at its own token budget (the runner's capacity)
    out["cold_first_prefill_step_s"] = _probe(runner, first.prompts, first.token_budget, s.device)
    print(f"  ours: first prefill step before warm-up {out['cold_first_prefill_step_s']:.2f} s", flush=True)
    report = runner.warmup(eager=True)  # on a CPU too: the same code path as on the GPU
    print(f"  ours: {report.line()}", flush=True)
    out["warmup_s"] = report.seconds
    out["warmup"] = {
        "eager_steps": report.eager_steps,
        "graphs": report.graphs,
        "capture_s": report.capture_seconds,
        "kernel_variants": report.kernel_variants,
    }
    out["warm_first_prefill_step_s"] = _probe(runner, first.prompts, first.token_budget, s.device)
    return OurEngine(model, runner, out)


@dataclass
class IterRecord:
    """One iteration of the loop (one launched step)."""

    rows: int
    tokens: int
    prefill_rows: int
    #: Wall seconds since the previous launch: the cadence tokens come at.
    period_s: float
    #: Host seconds of schedule + plan + launch (waits for the device excluded).
    host_s: float
    #: Tokens of K/V the step's rows read (every row's seq_len).
    kv_tokens: int

    @property
    def decode_only(self) -> bool:
        return self.prefill_rows == 0


@dataclass
class Served:
    requests: list[Request]
    iterations: list[IterRecord]
    token_times: dict[int, list[float]]
    arrivals: dict[int, float]
    wall_s: float
    preemptions: int
    profile: KernelBreakdown | None = None
    #: Steps of this run replayed from CUDA graphs, by kind ("decode", "mixed").
    graph_replays: dict[str, int] | None = None


def serve(
    engine: OurEngine,
    workload: Workload,
    s: Settings,
    *,
    profile_window: tuple[int, int] | None = None,
) -> Served:
    """Serve ``workload`` (requests submitted at their arrival times) with the overlapped loop.
    ``profile_window`` (first iteration, count): run those iterations under torch.profiler
    (after a sync, so the window starts with an idle GPU), then stop the run there."""
    runner = engine.runner
    manager = runner.manager
    requests = [Request(i, list(p), s.new_tokens) for i, p in enumerate(workload.prompts)]
    order = sorted(range(len(requests)), key=lambda i: workload.arrivals[i])
    pending = deque((workload.arrivals[i], requests[i]) for i in order)
    preemption = make_preemption("recompute", manager, runner.cache)
    scheduler = Scheduler(manager, [], preemption, token_budget=workload.token_budget, max_running=s.max_running)
    token_times: dict[int, list[float]] = {r.req_id: [] for r in requests}
    arrived: dict[int, float] = {}
    replays_before = dict(runner.graphs.replays) if runner.graphs is not None else None
    t0 = time.perf_counter()

    def record(batch: StepBatch, launched: LaunchedStep, tokens: list[int]) -> None:
        now = time.perf_counter() - t0
        for i in launched.plan.metadata.sampling_rows_host:
            token_times[batch.requests[i].req_id].append(now)

    pipeline = StepPipeline(runner, scheduler, overlap=s.overlap, on_result=record)
    iterations: list[IterRecord] = []
    profiler: Any = None
    profile_start = 0.0
    result_profile: KernelBreakdown | None = None
    last_launch: float | None = None
    step = 0
    sync(s.device)
    t0 = time.perf_counter()
    while pending or not scheduler.done:
        if profile_window is not None and len(iterations) == profile_window[0] and profiler is None:
            sync(s.device)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
            profile_start = time.perf_counter()
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            t, req = pending.popleft()
            arrived[req.req_id] = t
            scheduler.submit(req)
        t_host = time.perf_counter()
        batch = scheduler.schedule(step)
        scheduled_s = time.perf_counter() - t_host
        if batch is None:
            if pipeline.busy:
                pipeline.drain()
                continue
            if pending:  # idle until the next arrival
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
                continue
            break
        launch_at = time.perf_counter()
        pipeline.submit(batch)
        prefill_rows = sum(1 for r in batch.rows if r.num_new > 1)
        iterations.append(
            IterRecord(
                rows=len(batch.rows),
                tokens=len(batch.token_ids),
                prefill_rows=prefill_rows,
                period_s=0.0 if last_launch is None else launch_at - last_launch,
                host_s=scheduled_s + pipeline.launch_seconds,
                kv_tokens=sum(r.start + r.num_new for r in batch.rows if r.start is not None),
            )
        )
        last_launch = launch_at
        step += 1
        if profiler is not None and profile_window is not None and len(iterations) == sum(profile_window):
            sync(s.device)
            wall = time.perf_counter() - profile_start
            profiler.__exit__(None, None, None)
            result_profile = breakdown(profiler.events(), profile_window[1], wall)
            break
    pipeline.drain()
    wall = time.perf_counter() - t0
    if result_profile is not None and iterations[-1].decode_only and runner.graphs is not None:
        result_profile.replay_ms = _replay_ms(runner, s)
    if result_profile is not None:  # stopped in the middle: give every block back
        for req in scheduler.running:
            manager.free(req.req_id, reason="aborted")
    manager.check_integrity()
    replays = None
    if runner.graphs is not None and replays_before is not None:
        replays = {kind: n - replays_before[kind] for kind, n in runner.graphs.replays.items()}
    return Served(
        requests, iterations, token_times, arrived, wall, scheduler.num_preemptions, result_profile, replays
    )


def _replay_ms(runner: ModelRunner, s: Settings, repeats: int = 20) -> float:
    """Milliseconds of one replay of the last step's CUDA graph, replayed back to back with
    nothing planned in between: the step's GPU time, gaps between its kernels included."""
    assert runner.graphs is not None, "called for graph steps only"
    for _ in range(3):
        runner.graphs.replay_last()
    timer = Timer(s.device)
    timer.start()
    for _ in range(repeats):
        runner.graphs.replay_last()
    return 1e3 * timer.stop() / repeats


def ours_summary(served: Served, model: Llama, s: Settings, copy_gbps: float | None) -> dict[str, Any]:
    generated = sum(len(r.output) for r in served.requests)
    out: dict[str, Any] = {
        "steps": len(served.iterations),
        "wall_s": served.wall_s,
        "generated_tokens": generated,
        "prompt_tokens": sum(len(r.prompt) for r in served.requests),
        "tokens_per_s": generated / served.wall_s,
        "preemptions": served.preemptions,
        "graph_replays": served.graph_replays,
    }
    out.update(_latency(served.token_times, served.arrivals))
    out.update(_iteration_stats(served.iterations, model, s, copy_gbps))
    out["slowest_iterations"] = slowest_iterations(served.iterations)
    return out


def slowest_iterations(iterations: Sequence[IterRecord], count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` iterations with the longest periods (the first has none), slowest first:
    where a p99 comes from (a compile, a capture, a long prefill)."""
    timed = sorted(range(1, len(iterations)), key=lambda i: iterations[i].period_s, reverse=True)[:count]
    return [
        {
            "iteration": i,
            "rows": iterations[i].rows,
            "tokens": iterations[i].tokens,
            "prefill_rows": iterations[i].prefill_rows,
            "period_ms": 1e3 * iterations[i].period_s,
            "host_ms": 1e3 * iterations[i].host_s,
        }
        for i in timed
    ]


def _latency(token_times: dict[int, list[float]], arrivals: dict[int, float] | None = None) -> dict[str, Any]:
    """TTFT (from each request's arrival) and inter-token latency from per-request token
    times (seconds since the start)."""
    ttft = [times[0] - (arrivals or {}).get(rid, 0.0) for rid, times in token_times.items() if times]
    itl = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    return {
        "ttft_median_s": median(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_median_ms": None if not itl else 1e3 * statistics.median(itl),
        "itl_p99_ms": None if not itl else 1e3 * (percentile(itl, 99) or 0.0),
    }


def _iteration_stats(
    iterations: list[IterRecord], model: Llama, s: Settings, copy_gbps: float | None
) -> dict[str, Any]:
    shape = model.shape
    itemsize = torch.empty((), dtype=torch_dtype(s.cache_dtype)).element_size()
    # An int8 cache reads each token's fp16 scale per KV head of K and V besides the values.
    scale_bytes = 2 if s.cache_dtype == "int8" else 0
    if shape.mla is not None:  # one latent a token and layer, shared by K and V
        kv_per_token = shape.num_layers * shape.mla.latent_dim * itemsize
    else:
        kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * (shape.head_dim * itemsize + scale_bytes)
    weights = weight_bytes(model)
    timed = iterations[1:]  # the first has no period
    decode = [it for it in timed if it.decode_only]
    mixed = [it for it in timed if not it.decode_only and it.prefill_rows < it.rows]
    ms = lambda values: None if not values else 1e3 * statistics.median(values)
    out: dict[str, Any] = {
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "decode_steps": len(decode),
        "mixed_steps": len(mixed),
        "prefill_steps": sum(1 for it in iterations if not it.decode_only),
        "decode_iter_median_ms": ms([it.period_s for it in decode]),
        "mixed_iter_median_ms": ms([it.period_s for it in mixed]),
        "decode_host_median_ms": ms([it.host_s for it in decode]),
        "mixed_host_median_ms": ms([it.host_s for it in mixed]),
        "mixed_rows_median": None if not mixed else statistics.median(it.rows for it in mixed),
    }
    if out["decode_iter_median_ms"] and out["mixed_iter_median_ms"]:
        out["mixed_vs_decode_iter"] = out["mixed_iter_median_ms"] / out["decode_iter_median_ms"]
    if not decode:
        return out
    widest = max(it.rows for it in decode)
    at = [it for it in decode if it.rows == widest]
    out["roofline_rows"] = widest
    out["roofline_steps"] = len(at)
    out["decode_iter_at_rows_median_ms"] = ms([it.period_s for it in at])
    out["decode_iter_at_rows_p99_ms"] = 1e3 * (percentile([it.period_s for it in at], 99) or 0.0)
    out["decode_host_at_rows_median_ms"] = ms([it.host_s for it in at])
    out["kv_bytes_at_rows_median"] = statistics.median(it.kv_tokens * kv_per_token for it in at)
    if copy_gbps:
        bw = copy_gbps * 1e9
        floors = [(weights + it.kv_tokens * kv_per_token) / bw for it in at]
        out["roofline_median_ms"] = 1e3 * statistics.median(floors)
        out["roofline_ratio_median"] = statistics.median(it.period_s / f for it, f in zip(at, floors, strict=True))
    return out


def profile_summary(
    bd: KernelBreakdown, model: Llama, copy_gbps: float | None, *, decode: bool = True
) -> dict[str, Any]:
    """The breakdown as JSON, printed; ``decode``: the window is decode iterations, whose GEMMs
    read every weight once (their rate against the copy bandwidth is added)."""
    out = bd.as_json()
    gemm_ms = bd.ms.get("gemm")
    if decode and gemm_ms and copy_gbps:
        # Every weight matrix is read once per iteration (the embedding is gathered, not read).
        out["gemm_fraction_of_copy_bw"] = weight_bytes(model) / (gemm_ms * 1e-3) / (copy_gbps * 1e9)
    print(f"  profile: {bd.line()}", flush=True)
    return out


# ---- (b) transformers --------------------------------------------------------------------


@dataclass
class HFRun:
    summary: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)


def serve_transformers(hf: Any, workload: Workload, s: Settings, errors: dict[str, str]) -> HFRun:
    """transformers' continuous batching (``continuous_batching_context_manager``, the context
    manager ``generate_batch`` wraps), timed from the first arrival to the last finished
    result; its warm-up (CUDA graph capture) runs before. Requests are added at their arrival
    times (a thread), all at once for a burst."""
    import threading

    import transformers

    prompts = workload.prompts
    out: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        hf.set_attn_implementation(paged_attention_name(s.hf_attention, transformers.__version__))
    except Exception as err:  # flash-attn missing or refused: fall back, and say so
        errors["transformers.attn_implementation"] = f"{s.hf_attention}: {type(err).__name__}: {err}"
        hf.set_attn_implementation(paged_attention_name("paged|sdpa", transformers.__version__))
    out["attn_implementation"] = hf.config._attn_implementation

    gen_config = transformers.GenerationConfig(
        max_new_tokens=s.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cb_kwargs: dict[str, Any] = {"max_batch_tokens": workload.token_budget}
    if s.tiny:
        # flash-attn's paged decode needs pages of a multiple of 256 tokens (transformers'
        # default); on CPU the tiny run keeps ours.
        cb_kwargs.update(block_size=256 if s.on_cuda else s.block_size, num_blocks=64)
    cb_config = transformers.ContinuousBatchingConfig(**cb_kwargs)
    extra: dict[str, Any] = {}
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        extra["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=s.new_tokens,
            num_requests=len(prompts),
        )
    except ImportError:  # older layouts: the manager sizes itself without hints
        pass

    entered = time.perf_counter()
    results: dict[str, Any] = {}
    ids = [f"req-{i}" for i in range(len(prompts))]
    with hf.continuous_batching_context_manager(
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=60,
        warmup=True,
        **extra,
    ) as manager:
        out["warmup_s"] = time.perf_counter() - entered
        resolved = getattr(manager, "continuous_batching_config", None)
        if resolved is not None:
            out["cb_config"] = {
                k: repr(getattr(resolved, k, None))
                for k in (
                    "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
                    "max_blocks_per_request", "use_cuda_graph", "use_async_batching",
                )
            }  # fmt: skip
        t0 = time.perf_counter()

        def submit_all() -> None:
            for i in sorted(range(len(prompts)), key=lambda j: workload.arrivals[j]):
                delay = workload.arrivals[i] - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
                manager.add_request(prompts[i], request_id=ids[i], max_new_tokens=s.new_tokens, record_timestamps=True)

        adder = threading.Thread(target=submit_all, name="poisson-arrivals", daemon=True)
        adder.start()
        last = t0
        try:
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"transformers' generation thread stopped ({len(results)}/{len(ids)} done)")
                    if time.perf_counter() - t0 > s.hf_timeout_s:
                        raise TimeoutError(f"{len(results)}/{len(ids)} requests done after {s.hf_timeout_s:.0f} s")
                    continue
                if result.is_finished():
                    results[result.request_id] = result
                    last = time.perf_counter()
        except BaseException:
            try:
                manager.stop(block=True, timeout=30, hard_stop=True)
            except Exception as err:
                errors["transformers.stop"] = f"{type(err).__name__}: {err}"
            raise
        adder.join(timeout=5)
    wall = last - t0
    failed = [rid for rid, r in results.items() if getattr(r, "error", None)]
    if failed:
        errors["transformers.requests"] = f"{len(failed)} requests failed, e.g. {results[failed[0]].error}"
    outputs = [list(results[rid].generated_tokens) for rid in ids]
    token_times = {i: [t - t0 for t in (results[rid].timestamps or [])] for i, rid in enumerate(ids)}
    generated = sum(len(o) for o in outputs)
    out.update(wall_s=wall, generated_tokens=generated, tokens_per_s=generated / wall if wall > 0 else None)
    out.update(_latency(token_times, dict(enumerate(workload.arrivals))))
    return HFRun(out, outputs)


# ---- comparison, table -------------------------------------------------------------------


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How far the two engines' greedy tokens agree (bf16: near-ties part them eventually)."""
    first = sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return {
        "first_token_agreement": first / max(len(ours), 1),
        "identical_requests": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "mean_common_prefix": statistics.mean(prefixes) if prefixes else 0.0,
    }


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def _workload_rows(ours: dict[str, Any], hf: dict[str, Any]) -> list[tuple[str, str, str]]:
    ms = lambda v: None if v is None else 1e3 * v
    replays = ours.get("graph_replays") or {}
    return [
        ("generated tokens/s", _fmt(ours.get("tokens_per_s"), "", 0), _fmt(hf.get("tokens_per_s"), "", 0)),
        ("wall time (s)", _fmt(ours.get("wall_s")), _fmt(hf.get("wall_s"))),
        ("inter-token latency median / p99 (ms)",
         f"{_fmt(ours.get('itl_median_ms'))} / {_fmt(ours.get('itl_p99_ms'))}",
         f"{_fmt(hf.get('itl_median_ms'))} / {_fmt(hf.get('itl_p99_ms'))}"),
        ("TTFT median / p99 (ms)",
         f"{_fmt(ms(ours.get('ttft_median_s')), '', 0)} / {_fmt(ms(ours.get('ttft_p99_s')), '', 0)}",
         f"{_fmt(ms(hf.get('ttft_median_s')), '', 0)} / {_fmt(ms(hf.get('ttft_p99_s')), '', 0)}"),
        (f"decode iteration at {ours.get('roofline_rows', '?')} rows median (ms)",
         _fmt(ours.get("decode_iter_at_rows_median_ms")), "-"),
        ("roofline at those rows (ms)", _fmt(ours.get("roofline_median_ms")), "-"),
        ("decode / mixed iteration median (ms)",
         f"{_fmt(ours.get('decode_iter_median_ms'))} / {_fmt(ours.get('mixed_iter_median_ms'))}", "-"),
        ("host work per decode / mixed iteration (ms)",
         f"{_fmt(ours.get('decode_host_median_ms'))} / {_fmt(ours.get('mixed_host_median_ms'))}", "-"),
        ("steps: decode only / mixed / with prefill",
         f"{ours.get('decode_steps', '-')} / {ours.get('mixed_steps', '-')} / {ours.get('prefill_steps', '-')}", "-"),
        ("steps replayed from graphs: decode / mixed",
         f"{replays.get('decode', '-')} / {replays.get('mixed', '-')}" if replays else "off", "-"),
    ]  # fmt: skip


def table(results: dict[str, Any], errors: dict[str, str]) -> str:
    copy = results.get("copy_bandwidth") or {}
    engine = results.get("ours_engine") or {}
    lines = [f"copy bandwidth: {_fmt(copy.get('gb_per_s'), ' GB/s', 0)} (read + write)"]
    if engine:
        lines.append(
            f"ours: {engine.get('backend')} backend, CUDA graphs {'on' if engine.get('cuda_graphs') else 'off'}, "
            f"overlap {'on' if engine.get('overlap') else 'off'}, warm-up {_fmt(engine.get('warmup_s'))} s "
            f"({(engine.get('warmup') or {}).get('graphs', '-')} graphs in "
            f"{_fmt((engine.get('warmup') or {}).get('capture_s'))} s), "
            f"first prefill step cold / warm {_fmt(engine.get('cold_first_prefill_step_s'), '', 3)} / "
            f"{_fmt(engine.get('warm_first_prefill_step_s'), '', 3)} s"
        )
    if "hf_attention" in results:
        lines.append(f"transformers attention: {results['hf_attention']}")
    for name, section in (results.get("workloads") or {}).items():
        ours = section.get("ours") or {}
        hf = section.get("transformers") or {}
        w = section.get("workload") or {}
        lines.append("")
        lines.append(
            f"== {name}: {w.get('requests')} requests, {w.get('prompt_tokens')} prompt tokens (median "
            f"{w.get('prompt_median')}, max {w.get('prompt_max')}), arrivals over {w.get('arrivals_s')} s"
        )
        if section.get("agreement"):
            a = section["agreement"]
            lines.append(
                f"same greedy tokens: first token {a['first_token_agreement']:.0%} of requests, "
                f"{a['identical_requests']} requests identical, mean common prefix {a['mean_common_prefix']:.1f}"
            )
        for label in ("profile", "prefill_profile"):
            if section.get(label):
                p = section[label]
                split = attention_parts_text(p.get("attention_ms_per_iteration") or {})
                classes = ", ".join(
                    f"{k} {v:.2f}{split if k == 'attention' else ''}" for k, v in p["ms_per_iteration"].items()
                )
                gemm_rate = p.get("gemm_fraction_of_copy_bw")
                lines.append(
                    f"{label.replace('_', ' ')} ({p['iterations']} iterations, ms each): GPU "
                    f"{p['gpu_ms_per_iteration']:.2f} = {classes}; wall {_fmt(p['wall_ms_per_iteration'])}, "
                    f"no kernel running {_fmt(p['gpu_idle_ms_per_iteration'])}, graph replay "
                    f"{_fmt(p.get('graph_replay_ms'))}, host wait {_fmt(p.get('host_wait_ms_per_iteration'))}"
                    + (f"; GEMMs at {_fmt(gemm_rate)} of copy bandwidth" if gemm_rate is not None else "")
                )
        rows = _workload_rows(ours, hf)
        width = max(len(r[0]) for r in rows)
        lines.append(f"{'metric':<{width}} | {'ours':>22} | {'transformers':>22}")
        lines.append(f"{'-' * width}-+-{'-' * 22}-+-{'-' * 22}")
        lines += [f"{label:<{width}} | {a:>22} | {b:>22}" for label, a, b in rows]
    lines.append("")
    for name, target in (results.get("targets") or {}).items():
        verdict = "PASS" if target.get("pass") else ("FAIL" if target.get("pass") is False else "n/a")
        lines.append(f"target {name}: {verdict} ({target.get('text')})")
    if errors:
        lines.append("errors: " + ", ".join(sorted(errors)) + " (tracebacks in the JSON)")
    return "\n".join(lines)


def _target(value: float | None, limit: float, at_most: bool, text: str, valid: bool = True) -> dict[str, Any]:
    passed = None if value is None or not valid else (value <= limit if at_most else value >= limit)
    return {"value": value, "pass": passed, "text": text}


def compiles_line(watch: CompileWatch) -> str:
    """One line: the kernels compiled while serving a workload (after the warm-up), by name."""
    if not watch.available:
        return "kernels compiled while serving: unknown (no Triton JIT hook)"
    return f"kernels compiled while serving: {describe_compiles(watch.names(), after_warmup=True)}"


def targets(results: dict[str, Any], s: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sections = results.get("workloads") or {}
    for name, section in sections.items():
        watched = (section.get("ours") or {}).get("compiles_while_serving") or {}
        if watched.get("available"):
            out[f"{name}_compiles_while_serving"] = _target(
                watched["count"], 0, True, f"{name}: {watched['count']} kernel compiles after the warm-up; target 0"
            )
    burst = (sections.get("burst") or {}).get("ours") or {}
    rows = burst.get("roofline_rows")
    ratio = burst.get("roofline_ratio_median")
    out["decode_iteration_vs_roofline"] = _target(
        ratio, ROOFLINE_TARGET, True,
        f"burst decode iteration at {rows} rows = {_fmt(ratio)}x roofline; target <= {ROOFLINE_TARGET}x at 128 rows",
        valid=rows == 128,
    )  # fmt: skip
    profile = (sections.get("burst") or {}).get("profile") or {}
    elementwise = (profile.get("ms_per_iteration") or {}).get("elementwise")
    boundary = (profile.get("ms_per_iteration") or {}).get("boundary", 0.0)
    small = None if elementwise is None else elementwise + boundary
    out["elementwise_per_step"] = _target(
        small, ELEMENTWISE_TARGET_MS, True,
        f"elementwise + boundary kernels {_fmt(small)} ms per decode iteration; target <= {ELEMENTWISE_TARGET_MS} ms",
    )  # fmt: skip
    gemm = profile.get("gemm_fraction_of_copy_bw")
    out["gemm_bandwidth"] = _target(
        gemm,
        GEMM_BANDWIDTH_TARGET,
        False,
        f"GEMMs at {_fmt(gemm)} of copy bandwidth; target >= {GEMM_BANDWIDTH_TARGET}",
    )
    wait = profile.get("host_wait_ms_per_iteration")
    gaps = profile.get("gpu_idle_ms_per_iteration")
    out["host_wait_per_decode_iteration"] = _target(
        wait,
        HOST_WAIT_TARGET_MS,
        True,
        f"the GPU waited {_fmt(wait)} ms per decode iteration for the host (wall - graph replay; no kernel "
        f"running {_fmt(gaps)} ms, gaps between kernels included); target <= {HOST_WAIT_TARGET_MS}",
    )
    for name, section in sections.items():
        ours, hf = section.get("ours") or {}, section.get("transformers") or {}
        a, b = ours.get("itl_median_ms"), hf.get("itl_median_ms")
        itl = a / b if a and b else None
        out[f"{name}_itl_vs_transformers"] = _target(
            itl, ITL_TARGET, True, f"{name}: ours / transformers ITL median = {_fmt(itl)}; target <= {ITL_TARGET}"
        )
        a, b = ours.get("tokens_per_s"), hf.get("tokens_per_s")
        speed = a / b if a and b else None
        out[f"{name}_throughput_vs_transformers"] = _target(
            speed, THROUGHPUT_TARGET, False,
            f"{name}: ours / transformers tokens/s = {_fmt(speed)}x; target >= {THROUGHPUT_TARGET}x",
        )  # fmt: skip
    poisson = (sections.get("poisson") or {}).get("ours") or {}
    mixed = poisson.get("mixed_iter_median_ms")
    pure = burst.get("decode_iter_at_rows_median_ms") or poisson.get("decode_iter_median_ms")
    rel = mixed / pure if mixed and pure else None
    out["mixed_vs_pure_decode"] = _target(
        rel, MIXED_TARGET, True,
        f"poisson mixed iteration median / pure decode iteration = {_fmt(rel)}; target <= {MIXED_TARGET}",
    )  # fmt: skip
    if s.tiny:
        for t in out.values():
            t["text"] += " (tiny model: not meaningful)"
            t["pass"] = None
    return out


# ---- main --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model and workloads (the same code path in seconds)")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="llama3-8b",
        help="the model's shape (random weights): llama3-8b (default), or deepseek-v2-lite (latent attention, 16 "
        "heads, dense MLPs; our engine only: needs --skip-transformers)",
    )
    p.add_argument("--quick", action="store_true", help="32 requests x 32 new tokens (64 in the Poisson workload)")
    p.add_argument("--skip-transformers", action="store_true", help="serve with our engine only")
    p.add_argument("--out", help="JSON path (default benchmarks/results/e2e-<date>.json; none with --tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, help="requests of the burst workload")
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--backend", choices=("triton", "flash_attn", "reference"))
    p.add_argument("--block-size", type=int)
    p.add_argument(
        "--kv-cache-dtype",
        choices=("float8_e4m3", "int8"),
        help="our engine's KV cache in fp8 (unit scales) or int8 (per-token scales); compute stays in the model dtype",
    )
    p.add_argument(
        "--kv-rotation",
        choices=("none", "hadamard"),
        default="none",
        help="with --kv-cache-dtype: store K and V rotated (cache.kv_rotation)",
    )
    p.add_argument(
        "--hopper-decode",
        nargs="?",
        const="always",
        choices=sorted(HOPPER_DECODE),
        help="one-token decode rows on the Gluon kernel of warpgroup MMAs (sm_90): always where it applies (the word "
        "left out), never (the Triton kernel), or auto (a 16-bit cache, and fp8 in blocks under 128 tokens under "
        "bf16 queries); "
        "TritonBackend(hopper_decode=True / False / None); default: the backend's (auto)",
    )
    p.add_argument(
        "--decode-launch",
        help='a fixed decode launch for the triton backend, e.g. "n128 w4 s3 p3" (tile, warps, stages, programs an SM)',
    )
    for name, text in BACKEND_SWITCHES.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{text}; TritonBackend({name}=...)",
        )
    p.add_argument("--token-budget", type=int, help="most tokens per step (both engines)")
    p.add_argument("--max-running", type=int, help="most rows per step (ours)")
    p.add_argument("--eager", action="store_true", help="ours without CUDA graphs")
    p.add_argument("--sequential", action="store_true", help="ours without overlap (each step's tokens first)")
    p.add_argument("--poisson-rate", type=float, default=32.0, help="Poisson arrivals per second (default 32)")
    p.add_argument("--poisson-budget", type=int, default=256, help="tokens per step in the Poisson workload")
    p.add_argument("--workloads", default="burst,poisson", help="comma-separated: burst, poisson")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="re-run a window of iterations under torch.profiler (default: on CUDA)")  # fmt: skip
    p.add_argument("--profile-prefill", action="store_true",
                   help="also profile the burst's first (prefill and mixed) iterations, in one more serve")  # fmt: skip
    p.add_argument("--hf-attention", help="transformers attn_implementation (default paged|flash_attention_2 on cuda)")
    return p


#: Profiled iterations (first, count): the burst's decode phase, the Poisson run's steady state.
PROFILE_WINDOWS = {"burst": (24, 30), "poisson": (160, 30)}
#: With ``--profile-prefill``: the burst's first iterations, its prompts' prefill and mixed steps
#: (81k prompt tokens in steps of up to 8,192).
PREFILL_PROFILE_WINDOWS = {"burst": (0, 8)}


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document (also printed as a table and written)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hopper_decode is not None and args.backend not in (None, "triton"):
        parser.error(f"--hopper-decode: a choice of the triton backend, not of --backend {args.backend}")
    if args.profile_prefill and not args.device.startswith("cuda"):
        parser.error(f"--profile-prefill: the profile times CUDA kernels; not on --device {args.device}")
    for name in BACKEND_SWITCHES:
        if getattr(args, name) is not None and args.backend not in (None, "triton"):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag}: a choice of the triton backend, not of --backend {args.backend}")
    if args.decode_launch is not None:
        if args.hopper_decode is not None or args.backend not in (None, "triton"):
            parser.error("--decode-launch: the Triton kernel's launch; drop --hopper-decode and --backend")
        try:
            parse_decode_launch(args.decode_launch)
        except ValueError as err:
            parser.error(str(err))
    if MODELS[args.model][0].mla is not None and not args.skip_transformers:
        parser.error(f"--model {args.model}: transformers' continuous batching is not compared on latent attention; "
                     "add --skip-transformers")  # fmt: skip
    if args.kv_rotation != "none" and args.kv_cache_dtype is None:
        parser.error("--kv-rotation: rotates an 8-bit cache's K and V; give --kv-cache-dtype int8 or float8_e4m3")
    s = settings_from(args)
    if s.tiny and not s.on_cuda:
        # Tiny matrices: with several OpenMP threads each CPU GEMM pays a thread wake-up
        # (~30 ms per call measured on a 2-core machine) that dwarfs the work.
        torch.set_num_threads(1)
    errors: dict[str, str] = {}
    results: dict[str, Any] = {}

    def part(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            value = fn()
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"[{name}] failed:\n{errors[name]}", file=sys.stderr, flush=True)
            return None
        print(f"[{name}] done in {time.perf_counter() - start:.1f} s", flush=True)
        return value

    started = time.perf_counter()
    results["env"] = part("env", versions)
    copy = part("copy_bandwidth", lambda: copy_bandwidth(s.device))
    results["copy_bandwidth"] = copy
    copy_gbps = copy["gb_per_s"] if copy else None
    dtype = torch_dtype(s.dtype)

    hf: Any = None
    model: Llama | None = None
    build: dict[str, Any] = {}

    def build_shared() -> None:
        nonlocal hf, model
        t = time.perf_counter()
        hf = build_transformers_model(s.shape, device=s.device, dtype=dtype, seed=s.seed)
        model = from_transformers(hf)  # the same tensors, but for the fused projections
        sync(s.device)
        build["seconds"] = time.perf_counter() - t
        build["shared_with_transformers"] = model.embed.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    def build_ours_only() -> None:
        nonlocal model
        t = time.perf_counter()
        model = empty_llama(s.shape, dtype=dtype, device=s.device)
        init_random_(model, seed=s.seed)
        sync(s.device)
        build["seconds"] = time.perf_counter() - t
        build["shared_with_transformers"] = False

    if not s.skip_transformers:
        part("model.transformers", build_shared)
    if model is None:
        part("model.ours", build_ours_only)
    if model is not None:
        build["parameters"] = sum(p.numel() for p in model.parameters())
        build["weight_bytes_per_step"] = weight_bytes(model)
    results["model"] = {"shape": asdict(s.shape), "dtype": s.dtype, **build}

    workloads = make_workloads(s)
    sections: dict[str, dict[str, Any]] = {
        name: {"workload": {**w.describe(), "new_tokens": s.new_tokens}} for name, w in workloads.items()
    }
    results["workloads"] = sections
    outputs: dict[str, list[list[int]]] = {}
    engine: OurEngine | None = None
    if model is not None:
        m = model
        engine = part("ours.build", lambda: build_ours(m, workloads, s))
    results["ours_engine"] = engine.summary if engine else None
    if engine is not None and model is not None:
        for name, w in workloads.items():
            serve_it = functools.partial(serve, engine, w, s)
            with CompileWatch() as watch:  # after the warm-up, nothing should compile
                served = part(f"ours.{name}", serve_it)
            if served is not None:
                sections[name]["ours"] = ours_summary(served, model, s, copy_gbps)
                sections[name]["ours"]["compiles_while_serving"] = watch.summary()
                outputs[name] = [r.output for r in served.requests]
                print(f"  ours: {compiles_line(watch)}", flush=True)
                slow = ", ".join(
                    f"#{it['iteration']} {it['period_ms']:.1f} ms ({it['rows']} rows, {it['prefill_rows']} prefill, "
                    f"host {it['host_ms']:.1f} ms)"
                    for it in sections[name]["ours"]["slowest_iterations"]
                )
                print(f"  ours: slowest iterations: {slow}", flush=True)
            if s.profile and name in PROFILE_WINDOWS:
                profiled = part(
                    f"ours.{name}.profile", functools.partial(serve_it, profile_window=PROFILE_WINDOWS[name])
                )
                if profiled is not None and profiled.profile is not None:
                    sections[name]["profile"] = profile_summary(profiled.profile, model, copy_gbps)
            if s.profile_prefill and name in PREFILL_PROFILE_WINDOWS:
                window = PREFILL_PROFILE_WINDOWS[name]
                profiled = part(f"ours.{name}.prefill_profile", functools.partial(serve_it, profile_window=window))
                if profiled is not None and profiled.profile is not None:
                    summary = profile_summary(profiled.profile, model, copy_gbps, decode=False)
                    sections[name]["prefill_profile"] = summary
    # Hand our cache and graphs back before transformers sizes its cache from free memory.
    engine = None
    gc.collect()
    if s.on_cuda:
        torch.cuda.empty_cache()
        results["free_gib_before_transformers"] = torch.cuda.mem_get_info()[0] / 2**30

    if hf is not None and not s.skip_transformers:
        for name, w in workloads.items():
            hf_run = part(f"transformers.{name}", functools.partial(serve_transformers, hf, w, s, errors))
            if hf_run is not None:
                sections[name]["transformers"] = hf_run.summary
                if name in outputs:
                    sections[name]["agreement"] = agreement(outputs[name], hf_run.outputs)
        results["hf_attention"] = hf.config._attn_implementation
    results["targets"] = targets(results, s)
    results["total_s"] = time.perf_counter() - started

    doc = {
        "header": {
            "date": datetime.date.today().isoformat(),
            "command": "python3 benchmarks/bench_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": asdict(s),
            "definitions": {
                "tokens_per_s": "generated tokens / wall time from the first arrival to the last token",
                "iteration": "one launched step of our loop; its period is the wall time since the previous launch "
                "(overlapped: the step's host work and the previous step's device work run at the same time)",
                "host work": "schedule + plan + launch of an iteration on the host, waits for the device excluded",
                "roofline": "(weight bytes, embedding table excluded, + K/V bytes of every row's seq_len) / copy bw",
                "ttft": "seconds from a request's arrival to its first token",
                "itl": "time between consecutive tokens of a request as the host learns them "
                "(transformers: its record_timestamps)",
                "profile": "a window of iterations re-run under torch.profiler (CUDA activity only), after a sync: "
                "kernel time per iteration by class, and the wall time per iteration no kernel covers",
                "prefill_profile": "the same over the burst's first iterations (prefill and mixed steps)",
                "cold_first_prefill_step": "the workload's first prefill step before any warm-up (compiles included)",
            },
        },
        "results": results,
        "errors": errors,
    }
    out = args.out
    if out is None and not s.tiny:
        out = str(RESULTS / f"e2e-{doc['header']['date']}.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print()
    print(table(results, errors))
    if out:
        print(f"wrote {out}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    doc = run(argv)
    ok = all((section.get("ours") is not None) for section in doc["results"].get("workloads", {}).values())
    return 0 if ok and doc["results"].get("workloads") else 1


if __name__ == "__main__":
    sys.exit(main())
