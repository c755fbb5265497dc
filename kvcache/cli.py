"""The ``kvcache`` command: ``validate``, ``plan``, ``schema`` and ``list-configs``.

Exit status: 0 on success (also when the reader of a pipe leaves early: ``kvcache schema |
head``), 1 when a config is invalid or a plan holds nothing, 2 for bad command-line usage.
Problems are printed one per line, never as a traceback. A config is a file path or the name
of a bundled config (``kvcache validate tiny-cpu``; a near miss gets a "did you mean").
``kvcache --version`` prints the installed version; ``python -m kvcache`` is the same command.

Startup is kept short: no torch is imported, and pydantic and YAML only by the commands that
read a config.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvcache.config.rules import MAX_TOKENS
from kvcache.config.sizes import parse_bytes

__all__ = ["main"]


def _validate(args: argparse.Namespace) -> int:
    from kvcache.config.loading import ConfigError, load_config
    from kvcache.config.safe_read import printable
    from kvcache.config.sizes import format_bytes

    failed = 0
    for name in args.files:
        try:
            config = load_config(name)
        except ConfigError as err:
            failed += 1
            print(err.format(), file=sys.stderr)
            continue
        print(
            f"{printable(name)}: ok ({config.attention.backend} backend, block_size {config.cache.block_size}, "
            f"{format_bytes(config.bytes_per_block)} per block)"
        )
    total = len(args.files)
    if failed:
        print(f"{failed} of {total} file(s) invalid", file=sys.stderr)
    elif total > 1:
        print(f"all {total} files ok")
    return 1 if failed else 0


def _plan(args: argparse.Namespace) -> int:
    from kvcache.config.loading import ConfigError, load_config
    from kvcache.config.planning import plan_capacity
    from kvcache.config.safe_read import printable

    try:
        config = load_config(args.file)
    except ConfigError as err:
        print(err.format(), file=sys.stderr)
        return 1
    try:
        plan = plan_capacity(config, args.memory, args.max_seq_len, args.tp)
    except ValueError as err:
        print(f"{printable(args.file)}: {err}", file=sys.stderr)
        return 1
    m = config.model
    heads = f"{m.num_kv_heads} KV heads x head_dim {m.head_dim}"
    if m.latent_dim is not None:
        heads = f"a latent of {m.latent_dim} (kv_lora_rank {m.kv_lora_rank} + rope {m.qk_rope_head_dim}) per token"
    print(
        f"{printable(args.file)}: {m.num_layers} layers x {heads}, "
        f"{config.cache.dtype}, budget {config.cache.memory_budget or f'{config.cache.num_blocks} blocks'}"
    )
    if args.memory is not None and config.cache.num_blocks is not None:
        print(
            f"  note: the config fixes num_blocks ({config.cache.num_blocks}); --memory only decides whether "
            "they fit (set cache.memory_budget instead of num_blocks to size the cache from memory)"
        )
    rows = plan.lines()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    problems = plan.problems()
    for problem in problems:
        print(f"{printable(args.file)}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _schema(args: argparse.Namespace) -> int:
    import json

    from kvcache.config.schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


def _list_configs(args: argparse.Namespace) -> int:
    from kvcache.config.bundled import bundled_configs

    configs = bundled_configs()
    if not configs:
        print("no bundled configs found (is the package installed completely?)", file=sys.stderr)
        return 1
    width = max(len(name) for name in configs)
    for name, path in configs.items():
        print(f"{name:<{width}}  {_summary(path)}")
    return 0


def _summary(path: os.PathLike[str]) -> str:
    """The first sentence of a bundled config's leading comment (it says what the config is for)."""
    words: list[str] = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            if not line.startswith("#"):
                break
            words += line.lstrip("#").split()
    text = " ".join(words)
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _seq_len(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and 1 <= int(text) <= MAX_TOKENS):
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a whole number of tokens in [1, {MAX_TOKENS}]")
    return int(text)


def _tp_size(text: str) -> int:
    from kvcache.parallel.heads import MAX_TP_SIZE

    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= MAX_TP_SIZE):
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a whole number of ranks in [1, {MAX_TP_SIZE}]")
    return int(text)


def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paged-kvcache")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e . in the checkout)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="Paged KV-cache configs: validate and plan. CONFIG is a YAML file "
        "or the name of a bundled config (see list-configs).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check configs; print every problem, then a summary")
    validate.add_argument("files", nargs="+", metavar="CONFIG")
    validate.set_defaults(run=_validate)
    plan = sub.add_parser("plan", help="print blocks, tokens and sequences a config holds")
    plan.add_argument("file", metavar="CONFIG")
    plan.add_argument("--memory", type=_memory, help="device memory free for the cache, e.g. 80GiB")
    plan.add_argument("--max-seq-len", type=_seq_len, help="also print how many sequences of N tokens fit")
    plan.add_argument(
        "--tp",
        type=_tp_size,
        default=1,
        metavar="N",
        help="tensor-parallel ranks: print per-rank memory and capacity (default 1)",
    )
    plan.set_defaults(run=_plan)
    schema = sub.add_parser("schema", help="print the config's JSON schema (for editors)")
    schema.set_defaults(run=_schema)
    listing = sub.add_parser("list-configs", help="list the bundled configs, usable by name")
    listing.set_defaults(run=_list_configs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (argparse exits 2 itself on bad usage)."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvcache schema | head`: the reader left; nothing went wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
