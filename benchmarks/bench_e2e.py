"""End-to-end serving on one GPU: our engine vs transformers' continuous batching, same
weights, same prompts, same run.

Model: Llama-3-8B-shaped (32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads, head_dim
128, vocab 128256, rope theta 500000), random bf16 weights drawn on the GPU (std
fan_in ** -0.5, seeded), one set shared by both engines: transformers' ``LlamaForCausalLM`` is
built on the meta device, allocated on the GPU and filled, and our model's parameters are the
same tensors (:func:`examples.model.checkpoints.from_transformers`, no copy).

Workload: 128 requests arriving at once, prompt lengths LogNormal(median 512, sigma 0.6)
capped at 2048, random token ids (seeded), 128 new tokens each, greedy, no EOS.

(a) ours: examples' scheduler + model runner, triton backend, CUDA graphs for decode steps,
    warmed up before timing; every step is timed with CUDA events (planning, GPU work and the
    argmax's sync; the GPU is idle when a step starts, so this is the step's wall time).
(b) transformers: ``model.continuous_batching_context_manager(...)`` (what ``generate_batch``
    wraps; its warm-up captures CUDA graphs before the timed part), ``paged|flash_attention_2``
    (falls back to ``paged|sdpa`` when flash-attn is missing), record_timestamps=True.

Reported: generated tokens/s over the whole run; our decode step time (median, p99) over
steps with only decode rows, and at the largest batch against the roofline
(weight bytes + K/V bytes the step reads) / device-to-device copy bandwidth measured in this
run; time to first token (median, p99) from submission; inter-token latency (transformers'
decode step as its requests see it); cold start: our first prefill step before any warm-up vs
the same step after it, the warm-up time, and the prefill phase of the run. Targets (printed
as pass/fail): our decode step at 128 rows <= 1.3x roofline; our throughput >= 8x
transformers'.

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

from attention import StepCapacity  # noqa: E402
from attention.checks import cdiv  # noqa: E402
from attention.dtypes import torch_dtype  # noqa: E402
from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.runner import ModelRunner  # noqa: E402
from examples.engine.scheduler import Request, Scheduler, make_preemption  # noqa: E402
from examples.model import (  # noqa: E402
    Llama,
    LlamaShape,
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
#: Targets from the issue.
ROOFLINE_TARGET = 1.3
SPEEDUP_TARGET = 8.0


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
    seed: int
    skip_transformers: bool
    hf_attention: str
    hf_timeout_s: float

    @property
    def shape(self) -> LlamaShape:
        return TINY if self.tiny else LLAMA3_8B

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
        seed=args.seed,
        skip_transformers=args.skip_transformers,
        hf_attention=args.hf_attention or ("paged|flash_attention_2" if on_cuda else "paged|sdpa"),
        hf_timeout_s=240.0,  # keeps the whole run under 8 minutes even if transformers is slow
    )
    if args.quick:
        s = replace(s, requests=32, new_tokens=32, max_running=32)
    if args.tiny:
        s = replace(
            s, requests=8, new_tokens=8, median_prompt=40, max_prompt=96, block_size=32, token_budget=64,
            max_running=8, hf_timeout_s=120.0,
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


# ---- the workload ------------------------------------------------------------------------


def make_prompts(s: Settings) -> list[list[int]]:
    rng = random.Random(s.seed)
    prompts = []
    for _ in range(s.requests):
        n = round(rng.lognormvariate(math.log(s.median_prompt), s.sigma))
        n = max(1, min(s.max_prompt, n))
        prompts.append([rng.randrange(s.shape.vocab_size) for _ in range(n)])
    return prompts


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
        _, logits = runner.step(scheduled, tokens)
        logits.argmax(dim=-1).tolist()
        return time.perf_counter() - start
    finally:
        for seq_id in ids:
            manager.free(seq_id, reason="aborted")


@dataclass
class StepRecord:
    rows: int
    tokens: int
    decode_only: bool
    seconds: float
    iter_seconds: float
    kv_tokens: int
    #: host time of runner.step (plan, staging, launches): the GPU waits for this part.
    host_seconds: float = 0.0


@dataclass
class OursRun:
    summary: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)


def serve_ours(model: Llama, prompts: list[list[int]], s: Settings, copy_gbps: float | None) -> OursRun:
    shape = model.shape
    bs = s.block_size
    peaks = [len(p) + s.new_tokens - 1 for p in prompts]
    longest = max(peaks)
    # Every request's peak at once (no preemption), plus room for the warm-up's rows.
    num_blocks = sum(cdiv(p, bs) for p in peaks) + 2 * cdiv(longest, bs) + 8
    config = cache_config_for(
        shape, block_size=bs, dtype=s.dtype, num_blocks=num_blocks, device=s.device, backend=s.backend
    )
    engine = engine_for(config, shape)
    capacity = StepCapacity(
        max_rows=s.max_running,
        max_tokens=max(s.token_budget, s.max_running),
        max_blocks_per_seq=cdiv(longest, bs),
    )
    runner = ModelRunner(
        model, engine.cache, engine.manager, engine.backend, capacity, use_graphs=s.graphs and engine.graphs_allowed
    )
    out: dict[str, Any] = {
        "backend": engine.backend.name,
        "cuda_graphs": runner.graphs is not None,
        "num_blocks": num_blocks,
        "block_size": bs,
        "token_budget": s.token_budget,
        "max_running": s.max_running,
        "cache_gib": engine.cache.nbytes / 2**30,
    }
    out["cold_first_prefill_step_s"] = _probe(runner, prompts, s.token_budget, s.device)
    print(f"  ours: first prefill step before warm-up {out['cold_first_prefill_step_s']:.2f} s", flush=True)
    report = runner.warmup(eager=True)  # on a CPU too: the same code path as on the GPU
    print(f"  ours: {report.line()}", flush=True)
    out["warmup_s"] = report.seconds
    out["warmup"] = {
        "eager_steps": report.eager_steps,
        "graphs": report.graphs,
        "kernel_variants": report.kernel_variants,
    }
    out["warm_first_prefill_step_s"] = _probe(runner, prompts, s.token_budget, s.device)

    manager = engine.manager
    requests = [Request(i, list(p), s.new_tokens) for i, p in enumerate(prompts)]
    scheduler = Scheduler(
        manager,
        requests,
        make_preemption("recompute", manager, engine.cache),
        token_budget=s.token_budget,
        max_running=s.max_running,
    )
    timer = Timer(s.device)
    steps: list[StepRecord] = []
    token_times: dict[int, list[float]] = {r.req_id: [] for r in requests}
    sync(s.device)
    t0 = time.perf_counter()
    step = 0
    while not scheduler.done:
        t_iter = time.perf_counter()
        batch = scheduler.schedule(step)
        if batch is None:
            raise RuntimeError("the scheduler is idle with every request already arrived")
        timer.start()
        t_host = time.perf_counter()
        plan, logits = runner.step(batch.rows, batch.token_ids)
        host_seconds = time.perf_counter() - t_host
        next_ids = logits.argmax(dim=-1)
        seconds = timer.stop()
        rows = plan.metadata.sampling_rows_host
        scheduler.finish_step(batch, dict(zip(rows, next_ids.tolist(), strict=True)))
        now = time.perf_counter() - t0
        for i in rows:
            token_times[batch.requests[i].req_id].append(now)
        decode_only = all(r.num_new == 1 for r in batch.rows)
        steps.append(
            StepRecord(
                rows=len(batch.rows),
                tokens=len(batch.token_ids),
                decode_only=decode_only,
                seconds=seconds,
                iter_seconds=time.perf_counter() - t_iter,
                kv_tokens=sum(plan.metadata.seq_lens_host) if decode_only else 0,
                host_seconds=host_seconds,
            )
        )
        step += 1
    wall = time.perf_counter() - t0
    manager.check_integrity()

    generated = sum(len(r.output) for r in requests)
    out.update(
        steps=len(steps),
        wall_s=wall,
        generated_tokens=generated,
        prompt_tokens=sum(len(p) for p in prompts),
        tokens_per_s=generated / wall,
        preemptions=scheduler.num_preemptions,
    )
    out.update(_latency(token_times))
    out.update(_step_stats(steps, model, s, copy_gbps))
    prefill_steps = [st for st in steps if not st.decode_only]
    out["prefill_steps"] = len(prefill_steps)
    out["prefill_steps_s"] = sum(st.seconds for st in prefill_steps)
    out["prefill_phase_s"] = max(times[0] for times in token_times.values())
    return OursRun(out, [r.output for r in requests])


def _latency(token_times: dict[int, list[float]]) -> dict[str, Any]:
    """TTFT and inter-token latency from per-request token times (seconds since submission)."""
    ttft = [times[0] for times in token_times.values() if times]
    itl = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    return {
        "ttft_median_s": median(ttft),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_median_ms": None if not itl else 1e3 * statistics.median(itl),
        "itl_p99_ms": None if not itl else 1e3 * (percentile(itl, 99) or 0.0),
    }


def _step_stats(steps: list[StepRecord], model: Llama, s: Settings, copy_gbps: float | None) -> dict[str, Any]:
    shape = model.shape
    itemsize = torch.empty((), dtype=torch_dtype(s.dtype)).element_size()
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize
    weights = weight_bytes(model)
    decode = [st for st in steps if st.decode_only]
    out: dict[str, Any] = {
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "decode_steps": len(decode),
        "decode_step_median_ms": None if not decode else 1e3 * statistics.median(st.seconds for st in decode),
        "decode_step_p99_ms": None if not decode else 1e3 * (percentile([st.seconds for st in decode], 99) or 0.0),
        "decode_iter_median_ms": None if not decode else 1e3 * statistics.median(st.iter_seconds for st in decode),
    }
    if not decode:
        return out
    widest = max(st.rows for st in decode)
    at = [st for st in decode if st.rows == widest]
    out["roofline_rows"] = widest
    out["roofline_steps"] = len(at)
    out["decode_step_at_rows_median_ms"] = 1e3 * statistics.median(st.seconds for st in at)
    out["decode_step_at_rows_p99_ms"] = 1e3 * (percentile([st.seconds for st in at], 99) or 0.0)
    # The step's host part (plan, staging, graph launch) runs before the GPU can start.
    out["decode_host_at_rows_median_ms"] = 1e3 * statistics.median(st.host_seconds for st in at)
    print(
        f"  ours: decode step at {widest} rows: {out['decode_step_at_rows_median_ms']:.2f} ms, of which host "
        f"(plan + launch) {out['decode_host_at_rows_median_ms']:.2f} ms",
        flush=True,
    )
    out["kv_bytes_at_rows_median"] = statistics.median(st.kv_tokens * kv_per_token for st in at)
    if copy_gbps:
        bw = copy_gbps * 1e9
        ratios = [st.seconds / ((weights + st.kv_tokens * kv_per_token) / bw) for st in at]
        out["roofline_median_ms"] = 1e3 * statistics.median((weights + st.kv_tokens * kv_per_token) / bw for st in at)
        out["roofline_ratio_median"] = statistics.median(ratios)
        out["roofline_ratio_p99"] = percentile(ratios, 99)
    return out


# ---- (b) transformers --------------------------------------------------------------------


@dataclass
class HFRun:
    summary: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)


def serve_transformers(hf: Any, prompts: list[list[int]], s: Settings, errors: dict[str, str]) -> HFRun:
    """transformers' continuous batching (5.17: ``ContinuousMixin.continuous_batching_context_manager``,
    the context manager ``generate_batch`` wraps), timed from ``add_requests`` to the last
    finished result; its warm-up (CUDA graph capture) runs before."""
    import transformers

    out: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        hf.set_attn_implementation(s.hf_attention)
    except Exception as err:  # flash-attn missing or refused: fall back, and say so
        errors["transformers.attn_implementation"] = f"{s.hf_attention}: {type(err).__name__}: {err}"
        hf.set_attn_implementation("paged|sdpa")
    out["attn_implementation"] = hf.config._attn_implementation

    gen_config = transformers.GenerationConfig(
        max_new_tokens=s.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cb_kwargs: dict[str, Any] = {"max_batch_tokens": s.token_budget}
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
        ids = manager.add_requests(inputs=prompts, max_new_tokens=s.new_tokens, record_timestamps=True)
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
    wall = last - t0
    failed = [rid for rid, r in results.items() if getattr(r, "error", None)]
    if failed:
        errors["transformers.requests"] = f"{len(failed)} requests failed, e.g. {results[failed[0]].error}"
    outputs = [list(results[rid].generated_tokens) for rid in ids]
    token_times = {
        i: [t - t0 for t in (results[rid].timestamps or [])] for i, rid in enumerate(ids)
    }
    generated = sum(len(o) for o in outputs)
    out.update(wall_s=wall, generated_tokens=generated, tokens_per_s=generated / wall if wall > 0 else None)
    out.update(_latency(token_times))
    out["prefill_phase_s"] = max((t[0] for t in token_times.values() if t), default=None)
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


def table(results: dict[str, Any], errors: dict[str, str]) -> str:
    ours = results.get("ours") or {}
    hf = results.get("transformers") or {}
    copy = results.get("copy_bandwidth") or {}
    ms = lambda v: None if v is None else 1e3 * v
    rows = [
        ("generated tokens/s", _fmt(ours.get("tokens_per_s"), "", 0), _fmt(hf.get("tokens_per_s"), "", 0)),
        ("wall time (s)", _fmt(ours.get("wall_s")), _fmt(hf.get("wall_s"))),
        ("warm-up (s)", _fmt(ours.get("warmup_s")), _fmt(hf.get("warmup_s"))),
        ("decode step median / p99 (ms)",
         f"{_fmt(ours.get('decode_step_median_ms'))} / {_fmt(ours.get('decode_step_p99_ms'))}", "-"),
        (f"decode step at {ours.get('roofline_rows', '?')} rows median (ms)",
         _fmt(ours.get("decode_step_at_rows_median_ms")), "-"),
        ("roofline at those rows (ms)", _fmt(ours.get("roofline_median_ms")), "-"),
        ("inter-token latency median / p99 (ms)",
         f"{_fmt(ours.get('itl_median_ms'))} / {_fmt(ours.get('itl_p99_ms'))}",
         f"{_fmt(hf.get('itl_median_ms'))} / {_fmt(hf.get('itl_p99_ms'))}"),
        ("TTFT median / p99 (ms)",
         f"{_fmt(ms(ours.get('ttft_median_s')), '', 0)} / {_fmt(ms(ours.get('ttft_p99_s')), '', 0)}",
         f"{_fmt(ms(hf.get('ttft_median_s')), '', 0)} / {_fmt(ms(hf.get('ttft_p99_s')), '', 0)}"),
        ("prefill phase (s, to the last first token)",
         _fmt(ours.get("prefill_phase_s")), _fmt(hf.get("prefill_phase_s"))),
        ("first prefill step cold / warm (s)",
         f"{_fmt(ours.get('cold_first_prefill_step_s'), '', 3)} / {_fmt(ours.get('warm_first_prefill_step_s'), '', 3)}",
         "-"),
    ]  # fmt: skip
    workload = results.get("workload") or {}
    lines = [
        f"workload: {workload.get('requests')} requests, {workload.get('prompt_tokens')} prompt tokens "
        f"(median {workload.get('prompt_median')}, max {workload.get('prompt_max')}), "
        f"{workload.get('new_tokens')} new tokens each",
        f"copy bandwidth: {_fmt(copy.get('gb_per_s'), ' GB/s', 0)} (read + write)",
    ]
    if ours:
        lines.append(
            f"ours: {ours.get('backend')} backend, CUDA graphs {'on' if ours.get('cuda_graphs') else 'off'}, "
            f"{ours.get('steps')} steps ({ours.get('prefill_steps')} with prefill rows, {ours.get('decode_steps')} "
            f"decode only), preemptions {ours.get('preemptions')}"
        )
    if "hf_attention" in results:
        lines.append(f"transformers attention: {results['hf_attention']}")
    if results.get("agreement"):
        a = results["agreement"]
        lines.append(
            f"same greedy tokens: first token {a['first_token_agreement']:.0%} of requests, "
            f"{a['identical_requests']} requests identical, mean common prefix {a['mean_common_prefix']:.1f} tokens"
        )
    width = max(len(r[0]) for r in rows)
    lines.append(f"{'metric':<{width}} | {'ours':>22} | {'transformers':>22}")
    lines.append(f"{'-' * width}-+-{'-' * 22}-+-{'-' * 22}")
    lines += [f"{name:<{width}} | {a:>22} | {b:>22}" for name, a, b in rows]
    for name, target in (results.get("targets") or {}).items():
        verdict = "PASS" if target.get("pass") else ("FAIL" if target.get("pass") is False else "n/a")
        lines.append(f"target {name}: {verdict} ({target.get('text')})")
    if errors:
        lines.append("errors: " + ", ".join(sorted(errors)) + " (tracebacks in the JSON)")
    return "\n".join(lines)


def targets(results: dict[str, Any], s: Settings) -> dict[str, Any]:
    ours = results.get("ours") or {}
    hf = results.get("transformers") or {}
    out: dict[str, Any] = {}
    ratio = ours.get("roofline_ratio_median")
    rows = ours.get("roofline_rows")
    out["decode_vs_roofline"] = {
        "value": ratio,
        "pass": None if ratio is None or rows != 128 else ratio <= ROOFLINE_TARGET,
        "text": (
            f"our decode step at {rows} rows = {_fmt(ratio)}x roofline; target <= {ROOFLINE_TARGET}x at 128 rows"
            + ("" if rows == 128 else " (no 128-row decode step in this run)")
        ),
    }
    a, b = ours.get("tokens_per_s"), hf.get("tokens_per_s")
    speedup = a / b if a and b else None
    out["throughput_vs_transformers"] = {
        "value": speedup,
        "pass": None if speedup is None else speedup >= SPEEDUP_TARGET,
        "text": f"ours / transformers generated tokens/s = {_fmt(speedup)}x; target >= {SPEEDUP_TARGET}x",
    }
    if s.tiny:
        for t in out.values():
            t["text"] += " (tiny model: not meaningful)"
    return out


# ---- main --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny model and workload (the same code path in seconds)")
    p.add_argument("--quick", action="store_true", help="32 requests x 32 new tokens")
    p.add_argument("--skip-transformers", action="store_true", help="serve with our engine only")
    p.add_argument("--out", help="JSON path (default benchmarks/results/e2e-<date>.json; none with --tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--backend", choices=("triton", "flash_attn", "reference"))
    p.add_argument("--block-size", type=int)
    p.add_argument("--token-budget", type=int, help="most tokens per step (both engines)")
    p.add_argument("--max-running", type=int, help="most rows per step (ours)")
    p.add_argument("--eager", action="store_true", help="ours without CUDA graphs")
    p.add_argument("--hf-attention", help="transformers attn_implementation (default paged|flash_attention_2 on cuda)")
    return p


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document (also printed as a table and written)."""
    args = _parser().parse_args(argv)
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
        model = from_transformers(hf)  # the same tensors: no copy
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

    prompts = make_prompts(s)
    lengths = [len(p) for p in prompts]
    results["workload"] = {
        "requests": len(prompts),
        "new_tokens": s.new_tokens,
        "prompt_tokens": sum(lengths),
        "prompt_median": statistics.median(lengths),
        "prompt_min": min(lengths),
        "prompt_max": max(lengths),
        "lognormal": {"median": s.median_prompt, "sigma": s.sigma, "cap": s.max_prompt},
        "seed": s.seed,
    }

    ours_run: OursRun | None = None
    if model is not None:
        m = model
        ours_run = part("ours", lambda: serve_ours(m, prompts, s, copy_gbps))
    results["ours"] = ours_run.summary if ours_run else None
    # Hand our cache and graphs back before transformers sizes its cache from free memory.
    gc.collect()
    if s.on_cuda:
        torch.cuda.empty_cache()
        results["free_gib_before_transformers"] = torch.cuda.mem_get_info()[0] / 2**30

    hf_run: HFRun | None = None
    if hf is not None and not s.skip_transformers:
        hf_run = part("transformers", lambda: serve_transformers(hf, prompts, s, errors))
        results["hf_attention"] = hf.config._attn_implementation
    results["transformers"] = hf_run.summary if hf_run else None
    if ours_run and hf_run:
        results["agreement"] = agreement(ours_run.outputs, hf_run.outputs)
    results["targets"] = targets(results, s)
    results["total_s"] = time.perf_counter() - started

    doc = {
        "header": {
            "date": datetime.date.today().isoformat(),
            "command": "python3 benchmarks/bench_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": asdict(s),
            "definitions": {
                "tokens_per_s": "generated tokens / wall time from submitting every request to the last token",
                "decode_step": "one step with only decode rows: plan + model + argmax + sync, CUDA events",
                "roofline": "(weight bytes, embedding table excluded, + K/V bytes of every row's seq_len) / copy bw",
                "ttft": "seconds from submitting every request (all at once) to the request's first token",
                "itl": "time between consecutive tokens of a request (transformers: its record_timestamps)",
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
    return 1 if doc["results"].get("ours") is None else 0


if __name__ == "__main__":
    sys.exit(main())
