"""The ``kvcache`` command: ``validate``, ``plan`` and ``schema``.

Exit status: 0 on success, 1 when a config is invalid or a plan cannot be made, 2 for bad
command-line usage. Problems are printed one per line, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvcache.config import KVCacheConfig
from kvcache.loading import ConfigError, load_config
from kvcache.planning import plan_capacity
from kvcache.sizes import format_bytes, parse_bytes

__all__ = ["main"]


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            config = load_config(path)
        except ConfigError as err:
            failed += 1
            print(err.format(), file=sys.stderr)
            continue
        print(f"{path}: ok ({config.attention.backend} backend, block_size {config.cache.block_size}, "
              f"{format_bytes(config.bytes_per_block)} per block)")
    if failed:
        print(f"{failed} of {len(args.files)} file(s) invalid", file=sys.stderr)
    return 1 if failed else 0


def _plan(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as err:
        print(err.format(), file=sys.stderr)
        return 1
    try:
        free = parse_bytes(args.memory) if args.memory is not None else None
        plan = plan_capacity(config, free, args.max_seq_len)
    except ValueError as err:
        print(f"{args.file}: {err}", file=sys.stderr)
        return 1
    m = config.model
    print(f"{args.file}: {m.num_layers} layers x {m.num_kv_heads} KV heads x head_dim {m.head_dim}, "
          f"{config.cache.dtype}, budget {config.cache.memory_budget or f'{config.cache.num_blocks} blocks'}")
    rows = plan.lines()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if not plan.fits:
        print(f"  warning: {format_bytes(plan.cache_bytes)} exceeds the {format_bytes(plan.free_bytes or 0)} "
              f"assumed free; lower cache.num_blocks", file=sys.stderr)
        return 1
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(KVCacheConfig.model_json_schema(), indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache", description="Paged KV-cache configs: validate and plan.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check config files; print every problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(run=_validate)
    plan = sub.add_parser("plan", help="print blocks, tokens and sequences a config holds")
    plan.add_argument("file", metavar="FILE")
    plan.add_argument("--memory", help="device memory free for the cache, e.g. 80GiB")
    plan.add_argument("--max-seq-len", type=int, help="also print how many sequences of N tokens fit")
    plan.set_defaults(run=_plan)
    schema = sub.add_parser("schema", help="print the config's JSON schema (for editors)")
    schema.set_defaults(run=_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
