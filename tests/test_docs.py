"""The documentation says what the code does: the errors page matches the exception hierarchy,
every message quoted on the troubleshooting page is one the code raises, the CLI sessions
shown in the docs print what the CLI prints, and the API reference covers the public surface.

(The pages' Python blocks run in tests/test_readme_embedding.py; ``mkdocs build --strict``
runs in .ci/run.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import attention
import kvcache
from attention import errors

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```", re.MULTILINE | re.DOTALL)
BUILTINS = {"ValueError", "TypeError", "KeyError", "MemoryError", "ImportError", "AssertionError", "Exception"}


def _text_blocks(page: Path) -> list[str]:
    return TEXT_BLOCK.findall(page.read_text(encoding="utf-8"))


def _exception_classes() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name in errors.__all__
        if isinstance(cls := getattr(errors, name), type) and issubclass(cls, BaseException)
    }


# ---- errors.md -------------------------------------------------------------------------------


def test_every_error_is_reexported_by_kvcache() -> None:
    for name, cls in _exception_classes().items():
        assert getattr(kvcache, name) is cls, f"kvcache does not re-export {name}"


def test_errors_table_matches_the_hierarchy() -> None:
    rows = {}
    for line in (DOCS / "errors.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]) and cells[0] != "`exception`":
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[1]))
    classes = _exception_classes()
    assert set(rows) == set(classes), "docs/errors.md's table must list every exception of attention.errors"
    for name, bases in rows.items():
        assert bases == {b.__name__ for b in classes[name].__bases__}, f"docs/errors.md: {name} derives from"


def test_errors_tree_matches_the_hierarchy() -> None:
    tree = next(b for b in _text_blocks(DOCS / "errors.md") if b.startswith("KVCacheError"))
    classes = _exception_classes()
    parents: list[str] = []
    seen = set()
    for line in tree.splitlines():
        match = re.search(r"(\w+)(?: \((\w+)\))?$", line)
        assert match is not None, line
        name, builtin = match.groups()
        depth = 0 if line == name else (len(line) - len(line.lstrip("│├└─ "))) // 4
        parents[depth:] = [name]
        seen.add(name)
        bases = {b.__name__ for b in classes[name].__bases__}
        expected = ({parents[depth - 1]} if depth else {"Exception"}) | ({builtin} if builtin else set())
        assert bases == expected, f"docs/errors.md tree: {name} derives from {bases}, the tree says {expected}"
    assert seen == set(classes)


# ---- troubleshooting.md ----------------------------------------------------------------------


def _numbers(text: str) -> str:
    """Numbers that depend on the machine (free memory) or on nothing at all, made equal."""
    return re.sub(r"\d+(?:[.,]\d+)*", "N", text)


def _raised(action: Callable[[], object]) -> str:
    try:
        action()
    except kvcache.KVCacheError as err:
        return str(err)
    raise AssertionError(f"{action} raised nothing")


BAD_CONFIGS = {
    "bad.yaml": "model:\n  num_layers: 32\n  num_heads: 32\n  num_kv_heads: 8\n  head_dim: 128\n"
    "cache:\n  block_size: 48\n  dtype: bfloat16\n  num_blocks: 1024\n",
    "fa-32.yaml": "model:\n  num_layers: 32\n  num_heads: 32\n  num_kv_heads: 8\n  head_dim: 128\n"
    "cache:\n  block_size: 32\n  dtype: bfloat16\n  memory_budget: 0.9\nattention:\n  backend: flash_attn\n",
    "typo.yaml": "model:\n  num_layers: 32\n  num_heads: 32\n  num_kv_heads: 6\n  head_dim: 128\n"
    "cache:\n  block_sise: 32\n  dtype: bf16\n  memory_budget: 1.5\nattention:\n  backend: flash-attn\n",
    "fp8.yaml": "model:\n  num_layers: 32\n  num_heads: 32\n  num_kv_heads: 8\n  head_dim: 128\n"
    "  window_pattern: [true, false]\ncache:\n  block_size: 32\n  dtype: float8_e4m3\n",
    "int8.yaml": "model:\n  num_layers: 32\n  num_heads: 32\n  num_kv_heads: 8\n  head_dim: 96\n  dtype: bfloat16\n"
    "cache:\n  kv_rotation: hadamard\n  block_size: 32\n  dtype: int8\n  memory_budget: 0.9\n",
}


def _validate(names: list[str]) -> str:
    from kvcache import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cli.main(["validate", *names])
    return out.getvalue() + err.getvalue()


def _messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every message the troubleshooting page quotes, produced by the code."""
    from attention import AttentionSpec, StepCapacity
    from attention.capabilities import backend_info
    from attention.metadata_check import DeviceCheck
    from attention.reference import ReferenceBackend
    from kvcache import (
        MetadataBuilder,
        ScheduledRow,
        allocate_kv_cache,
        backend_for,
        load_config,
        manager_for,
    )
    from kvcache.step.graphs import DecodeGraphs

    for name, text in BAD_CONFIGS.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    yield _validate([*BAD_CONFIGS, "tiny"])

    config = load_config("tiny-cpu")
    cache = allocate_kv_cache(config)
    manager = manager_for(config, cache)
    yield _raised(lambda: manager.allocate("a", 1000))
    yield _raised(lambda: backend_for(config, "cpu", "triton"))
    yield _raised(lambda: backend_for(config, "cuda", "flash_attn"))
    yield _raised(lambda: attention.get_backend("reference", AttentionSpec(4, 2, 520)))
    with monkeypatch.context() as patch:
        patch.setattr("attention.registry.library_installed", lambda info: info.library is None)
        yield _raised(lambda: attention.get_backend("flash_attn", config.attention_spec()))
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield _raised(lambda: kvcache.resolve_device("cuda"))
    yield _raised(lambda: allocate_kv_cache(config, num_blocks=10**9))

    backend = backend_for(config, "cpu").backend
    manager.allocate("a", 40)
    builder = MetadataBuilder("cpu", capacity=StepCapacity(2, 16, 2), backend=backend)
    yield _raised(lambda: builder.plan(manager, [ScheduledRow("a", 5, start=38)]))
    yield _raised(lambda: builder.plan(manager, [ScheduledRow("a", 40, start=0)]))
    yield _raised(lambda: backend.plan(builder.build(manager, [ScheduledRow("a", 8, start=0)]), graph=True))
    yield _raised(lambda: manager.commit([ScheduledRow("a", 5, start=10)]))

    class GraphCapable(ReferenceBackend):  # a backend that allows capture, on the CPU
        @property
        def info(self):  # type: ignore[no-untyped-def]
            return backend_info("triton")

    capable = MetadataBuilder("cpu", capacity=StepCapacity(2, 16, 2), backend=GraphCapable(backend.spec))
    yield _raised(lambda: DecodeGraphs(capable, lambda ids, plan: ids))

    meta = MetadataBuilder("cpu").build(manager, [ScheduledRow("a", 40, start=0)])
    bad = dataclasses.replace(meta, block_tables=meta.block_tables.clone())
    bad.block_tables[0, 1] = 999
    check = DeviceCheck(bad.device)
    check.run(bad, manager.num_blocks)
    yield _raised(check.raise_if_violated)

    manager.allocator.incref(manager.sequence("a").blocks[0])
    yield _raised(manager.check_integrity)
    manager.allocator.release([manager.sequence("a").blocks[0]])

    cached = kvcache.BlockManager(8, 32, enable_prefix_caching=True)
    cached.allocate("p", token_ids=[1, 2, 3])
    yield _raised(lambda: cached.append_slots("p", 1))
    cached.append_slots("p", 1, defer_ids=True)
    yield _raised(lambda: cached.append_slots("p", 1, token_ids=[4]))
    fed = MetadataBuilder("cpu", backend=backend)
    fed.plan(manager, [ScheduledRow("a", 40, start=0)])  # one sampling row
    yield _raised(lambda: fed.plan(manager, [ScheduledRow("a", 1, start=39)], token_ids=[0], feed=[3]))
    from attention.rotary import RotaryTable

    short = RotaryTable(torch.zeros(4, backend.spec.head_dim))
    plan = backend.plan(MetadataBuilder("cpu").build(manager, [ScheduledRow("a", 40, start=0)]))
    t, spec = 40, backend.spec
    q = torch.zeros(t, spec.num_heads, spec.head_dim)
    kv = torch.zeros(t, spec.num_kv_heads, spec.head_dim)
    yield _raised(lambda: backend.rotary_write_kv(q, kv, kv, cache.layer(0), plan, short))
    stale = fed.plan(manager, [ScheduledRow("a", 40, start=0)])
    fed.plan(manager, [ScheduledRow("a", 40, start=0)])
    yield _raised(lambda: backend.write_kv(kv, kv, cache.layer(0), stale))
    yield _raised(lambda: manager.allocate("b", 2.5))
    yield _raised(lambda: manager.append_slots("zz", 1))
    yield _raised(lambda: manager.allocate("a", 4))


def test_troubleshooting_quotes_real_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    produced = {_numbers(line) for message in _messages(tmp_path, monkeypatch) for line in message.splitlines()}
    quoted = [line for block in _text_blocks(DOCS / "troubleshooting.md") for line in block.splitlines()]
    assert len(quoted) > 20
    missing = [line for line in quoted if _numbers(line) not in produced]
    assert not missing, "docs/troubleshooting.md quotes messages the code does not raise:\n" + "\n".join(missing)


# ---- CLI sessions shown in the docs ----------------------------------------------------------


def _sessions() -> Iterator[tuple[str, str, list[str], str]]:
    """(page, command, arguments, expected output) of each ``$ kvcache ...`` in a text block
    whose files all exist: in the repository, bundled, or one of BAD_CONFIGS."""
    from kvcache.config.loading import bundled_configs

    bundled = set(bundled_configs()) | set(BAD_CONFIGS)
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in _text_blocks(page):
            for session in re.split(r"^(?=\$ )", block, flags=re.MULTILINE):
                if not session.startswith("$ kvcache "):
                    continue
                command, _, output = session.partition("\n")
                args = shlex.split(command[2:])[1:]
                files = [a for a in args[1:] if not a.startswith("-") and not a[0].isdigit()]
                if all((ROOT / f).exists() or f in bundled for f in files):
                    yield str(page.relative_to(ROOT)), command, args, output


def test_cli_sessions_print_what_the_docs_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcache import cli

    for name, text in BAD_CONFIGS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    sessions = list(_sessions())
    assert len(sessions) >= 4
    for page, command, args, expected in sessions:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(args)
        assert (out.getvalue() + err.getvalue()).rstrip() == expected.rstrip(), f"{page}: {command}"


def test_readme_cli_lines_run_from_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ``.venv/bin/kvcache ...`` lines work as written (globs expanded as a shell
    would, from the repository root)."""
    from kvcache import cli

    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = re.findall(r"^\.venv/bin/kvcache (.*?)(?:\s+#.*)?$", readme, flags=re.MULTILINE)
    assert lines
    for line in lines:
        args = [g for a in shlex.split(line.split("|")[0].split(">")[0]) for g in (sorted(glob.glob(a)) or [a])]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(args) == 0, f"README.md: .venv/bin/kvcache {line}"


# ---- the API reference -----------------------------------------------------------------------


def _directives() -> dict[str, list[str] | None]:
    """module -> its ``members:`` list (None: all public members) over docs/reference/*.md."""
    found: dict[str, list[str] | None] = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, flags=re.MULTILINE):
            members = re.findall(r"^        - (\w+)$", match.group(2), flags=re.MULTILINE)
            module = match.group(1)
            if not members or (module in found and found[module] is None):
                found[module] = None  # every public member
            else:
                found[module] = [*(found.get(module) or []), *members]
    return found


@pytest.mark.parametrize("package", [kvcache, attention], ids=lambda p: p.__name__)
def test_api_reference_covers_the_public_surface(package: object) -> None:
    directives = _directives()
    homes: dict[str, str] = package._HOME  # type: ignore[attr-defined]
    missing = []
    for name, module in homes.items():
        if module not in directives:
            missing.append(f"{name} ({module}: no '::: {module}' in docs/reference)")
        elif directives[module] is not None and name not in directives[module]:  # type: ignore[operator]
            missing.append(f"{name} (not among the members of '::: {module}')")
    assert not missing, "the API reference leaves out:\n" + "\n".join(missing)
