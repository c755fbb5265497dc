"""The ``kvcache`` command: ``validate``, ``plan``, ``schema`` and ``list-configs``.

Exit status: 0 on success, 1 when a config is invalid, a plan holds nothing or the output
cannot be written (a full disk), 2 for bad command-line usage. A reader of a pipe that leaves
early (``kvcache schema | head``) changes nothing: the command goes on silently to its end and
its status is what it would have been (``kvcache validate *.yaml | head -1`` still exits 1 when
any config is invalid). Problems are printed one per line, never as a traceback; a name the
terminal's encoding cannot show is printed with backslash escapes. A config is a file path or
the name of a bundled config (``kvcache validate tiny-cpu``; a near miss gets a "did you
mean"). ``kvcache --version`` prints the installed version; ``python -m kvcache`` is the same
command.

Startup is kept short: no torch is imported, and pydantic and YAML only by the commands that
read a config.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

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
    from kvcache.config.safe_read import printable

    configs = bundled_configs()
    if not configs:
        print("no bundled configs found (is the package installed completely?)", file=sys.stderr)
        return 1
    names = {name: printable(name) for name in configs}
    width = max(len(shown) for shown in names.values())
    for name, path in configs.items():
        print(f"{names[name]:<{width}}  {_summary(path)}")
    return 0


def _summary(path: os.PathLike[str]) -> str:
    """The first sentence of a bundled config's leading comment (it says what the config is
    for), or ``(unreadable: why)`` for a file the config loader would refuse to read (not UTF-8,
    a directory, a device); read through that loader's safe reader, so it never blocks or raises."""
    from kvcache.config.safe_read import InputRefused, printable, read_config_text

    try:
        text = read_config_text(path)
    except InputRefused as refused:
        return f"(unreadable: {refused.message})"
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    summary = " ".join(words)
    end = summary.find(". ")
    return printable(summary if end < 0 else summary[: end + 1])


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


class _Output:
    """A text stream for ``print`` that never raises: the first OSError on it (EPIPE: the reader
    left; ENOSPC: a full disk) is kept in :attr:`error` and later output is dropped, so a command
    runs to its end and its exit status stays true. Text the stream's encoding cannot hold is
    written with backslash escapes. ``stream`` None (the descriptor was closed) drops everything."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        if self.stream is not None and self.error is None:
            try:
                try:
                    self.stream.write(text)
                except UnicodeEncodeError:  # a file name the terminal cannot show (PYTHONIOENCODING=ascii)
                    encoding = getattr(self.stream, "encoding", None) or "ascii"
                    self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
            except OSError as err:
                self._failed(err)
        return len(text)

    def flush(self) -> None:
        if self.stream is not None and self.error is None:
            try:
                self.stream.flush()
            except OSError as err:
                self._failed(err)

    def _failed(self, err: OSError) -> None:
        self.error = err
        # What the stream still buffers would fail again when Python flushes it at exit (and
        # print "Exception ignored"): point its descriptor at /dev/null.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno() if self.stream is not None else -1)
            finally:
                os.close(devnull)
        except (OSError, ValueError):  # no descriptor (a test's capture): nothing buffers at exit
            pass


def _status(code: int, out: _Output, err: _Output) -> int:
    """``code`` once both streams are flushed; at least 1 when output was lost for a reason
    other than a reader that left (a full disk, an I/O error), which is said on stderr."""
    out.flush()
    err.flush()
    lost = [(name, e) for name, e in (("stdout", out.error), ("stderr", err.error)) if e is not None]
    lost = [(name, e) for name, e in lost if not isinstance(e, BrokenPipeError)]
    if not lost:
        return code
    name, error = lost[0]
    err.write(f"kvcache: cannot write to {name}: {error.strerror or error}; the output is incomplete\n")
    err.flush()
    return code or 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (argparse exits 2 itself on bad usage). Output
    goes through :class:`_Output`: no error writing it becomes a traceback."""
    out, err = _Output(sys.stdout), _Output(sys.stderr)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # print() needs only write() and flush()
    try:
        args = _parser().parse_args(argv)
        code: int = args.run(args)
    except KeyboardInterrupt:
        code = 130
    except SystemExit as stop:  # argparse: --help, --version, bad usage
        raise SystemExit(_status(stop.code if isinstance(stop.code, int) else 2, out, err)) from None
    finally:
        sys.stdout, sys.stderr = saved
    return _status(code, out, err)


if __name__ == "__main__":
    sys.exit(main())
