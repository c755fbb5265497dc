"""Greedy decoding with continuous batching over the paged KV cache.

    python -m examples.decode_loop                          # tiny model on CPU, a few seconds
    python -m examples.decode_loop --workload shared-prefix # prefix caching on a shared prompt
    python -m examples.decode_loop --device cuda --backend auto --config configs/llama3-8b.yaml
    python -m examples.decode_loop --checkpoint path/to/Qwen2.5-0.5B   # real weights (safetensors)
    torchrun --nproc-per-node 2 -m examples.decode_loop --tp 2          # tensor parallel, 2 CPU processes (gloo)

A workload of requests with different prompt lengths arrives over time; the scheduler
(:mod:`examples.engine.scheduler`) admits, chunks, decodes, preempts and frees them, and each step
runs the model (:mod:`examples.model`, random weights from ``--seed``, or a Llama / Qwen2 /
Mistral / Gemma-2 / Gemma-3 checkpoint with ``--checkpoint``: then the config's ``model`` section is the
checkpoint's) once over every scheduled row. One step is: schedule -> build metadata once ->
``backend.plan`` once -> every layer writes K/V and attends -> sample on the device ->
``commit``; the host schedules step N+1 while the device runs step N and applies step N's
tokens after that (:mod:`examples.engine.loop`; ``--sequential`` turns the overlap off).

With ``--tp N`` under torchrun each process is one tensor-parallel rank: it holds its share of
the weights and of the KV heads (:mod:`kvcache.parallel.heads`), runs the same scheduler and block
manager on the same seeded requests as every other rank, and checks each step that all ranks
decided the same (:mod:`kvcache.parallel.agreement`). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch
from pydantic import ValidationError

from attention.capabilities import BACKEND_NAMES
from attention.dtypes import torch_dtype
from attention.errors import RankDivergenceError
from kvcache import KVCacheConfig, KVCacheError, load_config, resolve_device
from kvcache.config.sizes import parse_bytes

from .engine.distributed import ParallelRun, exit_process, start_parallel, stop_parallel
from .engine.loop import RunReport, format_summary, run_requests
from .engine.parts import engine_for
from .engine.scheduler import Scheduler, make_preemption
from .engine.workload import make_workload
from .model.llama import Llama, random_llama
from .model.shape import shape_for_cache

__all__ = ["RunReport", "format_summary", "main", "make_workload", "run_requests"]

#: A bundled config, found by name in a checkout and in an installed project alike.
DEFAULT_CONFIG = "tiny-cpu"
#: Example-only model sizes: the cache config describes attention only (and forbids extra keys).
VOCAB_SIZE = 256
#: Most requests a run may ask for: the workload is built up front and this example runs them
#: one process's worth at a time (a million would take hours even on the tiny model).
MAX_REQUESTS = 100_000
#: Most tokens in one step: the largest step buffers the metadata builder holds
#: (:class:`attention.StepCapacity`'s ``max_tokens``).
MAX_TOKEN_BUDGET = 1 << 24
#: The seeds torch's generators take.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _at_most(maximum: int, why: str) -> Callable[[str], int]:
    """An argparse type: an int in ``[1, maximum]``; ``why`` the reason for the bound."""

    def parse(text: str) -> int:
        value = _positive(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum {maximum:,} ({why})")
        return value

    return parse


def _seed(text: str) -> int:
    value = int(text)
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value} is out of range; use an integer in [-2**63, 2**64 - 1]")
    return value


def _draft(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 8:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 8] (0: no drafting)")
    return value


def _size(text: str) -> int:
    """A byte size such as 64MiB (or a plain byte count)."""
    if text.isdigit():
        return int(text)
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.decode_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="a cache config YAML, or a bundled name (default tiny-cpu)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="overrides cache.device")
    p.add_argument(
        "--backend",
        choices=("auto", *BACKEND_NAMES),
        help="overrides attention.backend",
    )
    p.add_argument("--num-blocks", type=_positive, help="overrides cache.num_blocks / cache.memory_budget")
    p.add_argument(
        "--preempt",
        choices=("recompute", "swap"),
        default="recompute",
        help="what a preempted request loses",
    )
    p.add_argument("--workload", choices=("default", "shared-prefix", "multi-turn"), default="default")
    p.add_argument(
        "--host-cache",
        metavar="SIZE",
        type=_size,
        help="overrides cache.host_cache_space: host memory for prefix blocks the device evicts "
        "(e.g. 64MiB; turns prefix caching on; 0: no host tier)",
    )
    p.add_argument(
        "--disk-cache",
        nargs=2,
        metavar=("DIR", "SIZE"),
        help="overrides cache.disk_cache_dir and cache.disk_cache_space: block files for prefix blocks the "
        "host tier evicts (e.g. /tmp/kv 256MiB; needs a host tier; SIZE 0: no disk tier)",
    )
    p.add_argument(
        "--requests",
        type=_at_most(MAX_REQUESTS, "the workload is built up front"),
        default=20,
        help=f"number of requests (default 20, at most {MAX_REQUESTS:,})",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seeds the weights and the workload")
    p.add_argument(
        "--token-budget",
        type=_at_most(MAX_TOKEN_BUDGET, "the most tokens a step's buffers hold"),
        default=64,
        help="most tokens per step (chunked prefill)",
    )
    p.add_argument("--log-every", type=_positive, default=5, help="progress line every N steps")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: run every step eagerly")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="no overlap: apply each step's tokens before scheduling the next (same tokens, slower)",
    )
    p.add_argument(
        "--draft",
        type=_draft,
        default=0,
        metavar="K",
        help="prompt-lookup decoding: up to K draft tokens per decode row (1-8), verified exactly, so the "
        "tokens are plain greedy decoding's",
    )
    p.add_argument(
        "--draft-max-rows",
        type=_positive,
        metavar="N",
        help="with --draft: draft only while at most N requests run (the loop overlaps steps otherwise); "
        "default: at any batch size",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="Llama/Qwen2/Mistral/Gemma-2/Gemma-3/dense DeepSeek-V3 checkpoint (config.json + safetensors) instead "
        "of random weights",
    )
    p.add_argument(
        "--no-kv-groups",
        action="store_true",
        help="a model mixing full and windowed layers keeps one block table for every layer (each layer holds "
        "the whole sequence's K/V; what --preempt swap and --host-cache need for such a model)",
    )
    p.add_argument("--quiet", action="store_true", help="print the summary only")
    p.add_argument(
        "--tp",
        type=_positive,
        default=1,
        help="tensor-parallel ranks: run under torchrun --nproc-per-node N with --tp N (default 1)",
    )
    p.add_argument(
        "--tokens-out",
        metavar="FILE",
        help="write every request's generated tokens (and each token's top-2 logit margin) as JSON (rank 0)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; returns the exit status (1: bad config, setting or checkpoint)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.draft and args.tokens_out:
        parser.error("--tokens-out records each token's logit margin, drafting none; drop --draft or --tokens-out")
    if args.draft_max_rows is not None and not args.draft:
        parser.error(f"--draft-max-rows {args.draft_max_rows}: needs --draft K (drafting is off)")
    if args.disk_cache is not None:
        try:
            args.disk_cache[1] = _size(args.disk_cache[1])
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument --disk-cache: SIZE {args.disk_cache[1]!r}: {err}")
    if args.tokens_out is not None:
        problem = _unwritable(args.tokens_out)
        if problem:  # found now, not after the whole run
            parser.error(f"argument --tokens-out: {args.tokens_out}: {problem}")
    try:
        config = load_config(args.config)
        run = start_parallel(args.tp, resolve_device(args.device or config.cache.device))
    except (KVCacheError, ValueError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    try:
        code = _run(args, config, run)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, as other tools do
        stop_parallel(run)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when exit flushes it
        return 1
    except BaseException:
        stop_parallel(run)
        raise
    stop_parallel(run, synchronize=True)
    return code


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written as a file (None: it can). Creates nothing."""
    if os.path.isdir(path):
        return "is a directory; give a file name, e.g. tokens.json"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"the directory {parent} does not exist; create it first"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"the directory {parent} is not writable"


def _config_problems(err: ValidationError) -> str:
    """A pydantic error as ``field: message`` parts on one line (no pydantic dump)."""
    parts = []
    for e in err.errors(include_url=False):
        where = ".".join(str(part) for part in e["loc"])
        message = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _run(args: argparse.Namespace, config: KVCacheConfig, run: ParallelRun) -> int:
    tp, device = run.tp, run.device
    lead = tp.rank == 0
    say = print if lead and not args.quiet else (lambda *_: None)
    where = f"rank {tp.rank}: " if tp.is_sharded else ""
    doing = "reading the config"  # what failed, for an error that does not say (out of memory)
    try:
        dtype_name = config.attention_spec().dtype
        model: Llama | None = None
        if args.checkpoint:
            from .model.checkpoints import load_checkpoint

            doing = f"loading --checkpoint {args.checkpoint}"
            model = load_checkpoint(args.checkpoint, dtype=torch_dtype(dtype_name), device=device, tp=tp)
            shape = model.shape
            # The cache holds this model's K/V: its model section is the checkpoint's.
            config = KVCacheConfig.model_validate(
                {**config.model_dump(), "model": shape.model_section().model_dump()}, strict=False
            )
        else:
            shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
        if device.type == "cpu" and shape.hidden_size <= 1024:
            # Tiny matrices: one thread is fastest, and torch's default of one per core is
            # dozens of times slower when another process shares the cores.
            torch.set_num_threads(1)
        # The shared-prefix and multi-turn workloads exist to show prefix caching: turn it on for them.
        turned_on = args.workload in ("shared-prefix", "multi-turn") and not config.cache.enable_prefix_caching
        if turned_on or args.host_cache is not None or args.disk_cache is not None:
            doing = "--host-cache / --disk-cache"
            cache_section = {**config.cache.model_dump(), "enable_prefix_caching": True}
            if args.host_cache is not None:
                cache_section["host_cache_space"] = args.host_cache
            if args.disk_cache is not None:
                directory, size = args.disk_cache
                # SIZE 0 means no disk tier, as --host-cache 0 means no host tier.
                cache_section["disk_cache_dir"] = directory if size else None
                cache_section["disk_cache_space"] = size
            config = KVCacheConfig.model_validate({**config.model_dump(), "cache": cache_section}, strict=False)
        doing = "building the cache" + (f" (--disk-cache {args.disk_cache[0]})" if config.cache.disk_cache_dir else "")
        engine = engine_for(
            config,
            shape,
            device=device,
            num_blocks=args.num_blocks,
            backend=args.backend,
            prefix_caching=True if turned_on else None,
            tp=tp,
            collective=run.collective,
            kv_groups=not args.no_kv_groups,
        )
        reason = f"{args.backend} (--backend)" if args.backend and args.backend != "auto" else engine.reason
        cache, manager = engine.cache, engine.manager
        prefix_caching = manager.prefix_cache is not None
        preemption = make_preemption(args.preempt, manager, cache, config.cache.swap_space)
        use_graphs = engine.graphs_allowed and not args.eager
        if model is None:
            doing = "drawing the random weights"
            model = random_llama(shape, seed=args.seed, dtype=torch_dtype(dtype_name), device=device, tp=tp)
        model.connect(run.collective)
    except ValidationError as err:  # a command-line override the config refuses
        print(f"{where}error: {doing}: {_config_problems(err)}", file=sys.stderr)
        return 1
    except (KVCacheError, ValueError, ImportError) as err:
        print(f"{where}error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file or directory the flags name
        print(f"{where}error: {doing}: {err}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as err:  # torch's out of memory, which names no flag
        print(
            f"{where}error: {doing}: {_first_line(err)}; ask for less memory (--num-blocks, --host-cache, a smaller "
            f"config)",
            file=sys.stderr,
        )
        return 1
    m, block_size = config.model, config.cache.block_size
    requests = make_workload(
        args.workload,
        args.requests,
        seed=args.seed,
        block_size=block_size,
        vocab_size=shape.vocab_size,
    )

    need = max(manager.blocks_for(r.peak_tokens) for r in requests)
    if need > manager.num_blocks:  # the scheduler would refuse it: say so in one line, with the fix
        longest = max(requests, key=lambda r: r.peak_tokens)
        print(
            f"{where}error: --num-blocks / cache size: request {longest.req_id} needs {need} blocks "
            f"({longest.peak_tokens} tokens at block_size {manager.block_size}) but the cache has "
            f"{manager.num_blocks}; give the cache at least {need} blocks",
            file=sys.stderr,
        )
        return 1
    limit = shape.max_positions
    longest = max(requests, key=lambda r: len(r.prompt) + r.max_new_tokens)
    if limit is not None and len(longest.prompt) + longest.max_new_tokens > limit:  # run_requests would refuse it
        print(
            f"{where}error: --checkpoint: the model has {limit} positions (max_position_embeddings) but request "
            f"{longest.req_id} of the {args.workload} workload needs {len(longest.prompt) + longest.max_new_tokens} "
            f"({len(longest.prompt)} prompt + {longest.max_new_tokens} new tokens); serve a model with more positions",
            file=sys.stderr,
        )
        return 1
    lengths = [len(r.prompt) for r in requests]
    heads = f"({m.num_kv_heads} KV), head_dim {m.head_dim}"
    if m.latent_dim is not None:
        heads = f"over a latent of {m.latent_dim} per token (MLA)"
    say(f"config: {_shown(args.config)}: {m.num_layers} layers, {m.num_heads} heads {heads}, {dtype_name} on {device}")
    if tp.is_sharded:
        spec = engine.spec
        say(
            f"tensor parallel: {tp.size} ranks over {run.backend}; per rank {spec.num_heads} query heads, "
            f"{spec.num_kv_heads} KV head(s), {cache.bytes_per_block:,} bytes per block"
        )
    say(f"backend: {reason}")
    say(
        f"cache: {cache.num_blocks} blocks x {block_size} tokens; prefix caching "
        f"{'on' if prefix_caching else 'off'}{' (for this workload)' if turned_on else ''}; "
        f"preempt: {args.preempt}; CUDA graphs: {'on' if use_graphs else 'off'}"
    )
    say(
        f"workload: {args.workload}, {len(requests)} requests, prompts {min(lengths)}-"
        f"{max(lengths)} tokens, arriving over steps 0-{requests[-1].arrival_step}"
    )

    def progress(step: int, s: Scheduler, elapsed: float, generated: int) -> None:
        if step % args.log_every == 0 or s.done:
            used = manager.num_blocks - manager.num_free_blocks
            say(
                f"step {step:4d} | running {len(s.running):2d} waiting {len(s.waiting):2d} "
                f"finished {len(s.finished):2d} | blocks {used:3d}/{manager.num_blocks} | "
                f"{generated / max(elapsed, 1e-9):7.1f} tok/s | preempted {s.num_preemptions}"
            )

    try:
        report = run_requests(
            model,
            requests,
            manager=manager,
            cache=cache,
            backend=engine.backend,
            preemption=preemption,
            token_budget=args.token_budget,
            use_graphs=use_graphs,
            overlap=not args.sequential,
            record_margins=args.tokens_out is not None,
            draft_tokens=args.draft,
            draft_max_rows=args.draft_max_rows,
            on_step=progress,
            on_warmup=lambda report: say(report.line()),
            collective=run.collective,
        )
    except RankDivergenceError as err:  # raised on every rank at the same step: all exit cleanly
        print(f"{where}error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise
    except (KVCacheError, ValueError, OSError, RuntimeError, MemoryError) as err:
        stop_parallel(run)  # this rank alone may have failed: no barrier the others would not reach
        print(f"{where}error: {type(err).__name__}: {_first_line(err)}", file=sys.stderr)
        return 1
    if not lead:
        return 0
    if args.tokens_out:
        try:
            _write_tokens(args.tokens_out, report)
        except OSError as err:  # checked before the run; the directory may have gone since
            print(f"error: --tokens-out {args.tokens_out}: {err.strerror or err}", file=sys.stderr)
            return 1
    print("summary")
    for line in format_summary(report):
        print(f"  {line}")
    return 0


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (torch's errors append C++ stack frames)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _write_tokens(path: str, report: RunReport) -> None:
    """``{"tp": N, "tokens": {req_id: [...]}, "margins": {req_id: [...]}}`` (req ids as strings)."""
    data = {
        "tp": report.tp_size,
        "tokens": {str(r.req_id): r.output for r in report.requests},
        "margins": {str(k): v for k, v in report.margins.items()},
    }
    with open(path, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    exit_process(main())
