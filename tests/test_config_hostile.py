"""Hostile config input: whatever a file holds, loading ends quickly in a config or a ConfigError.

The first half replays what a hostile tester found (alias bombs, deep nesting, huge numbers,
duplicate keys, FIFOs and devices, ...); the second half fuzzes ``parse_config``,
``load_config`` and the CLI with hypothesis. Every test runs under an alarm, so a hang fails
the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import signal
import string
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import ConfigError, load_config, parse_config
from kvcache.cli import main
from kvcache.config import safe_yaml
from kvcache.config.rules import MAX_BLOCKS
from kvcache.config.safe_yaml import MAX_DEPTH, MAX_FILE_BYTES
from kvcache.config.schema import KVCacheConfig
from kvcache.config.sizes import MAX_BYTES

GOOD = """\
model: {num_layers: 2, num_heads: 4, num_kv_heads: 2, head_dim: 16}
cache: {block_size: 32, dtype: float32, num_blocks: 8, device: cpu}
attention: {backend: reference}
"""
#: Seconds one hostile input may take, at most (they take milliseconds).
FAST = 1.0


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """Fail a test that runs past 30 s instead of letting it hang CI (POSIX only)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def _timeout(signum: int, frame: object) -> None:
        raise TimeoutError("the test ran past 30 s: loading hangs")

    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _check_outcome(text: str) -> KVCacheConfig | ConfigError:
    """Parse ``text``: a config, or a ConfigError whose message is short and names no bug.
    Any other exception fails the calling test."""
    try:
        return parse_config(text, source="fuzz.yaml")
    except ConfigError as err:
        _check_message(err)
        return err


def _check_message(err: ConfigError) -> None:
    message = str(err)
    assert "bug in kvcache" not in message, message
    assert "Traceback" not in message
    lines = message.splitlines()
    assert 1 <= len(lines) <= 51, f"{len(lines)} lines"
    assert all(len(line) <= 600 for line in lines), max(lines, key=len)[:300]


def _refused(text: str, *words: str, limit: float = FAST) -> str:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="bad.yaml")
    assert time.perf_counter() - start < limit
    _check_message(info.value)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    return message


# --- what the hostile tester found ---------------------------------------------------------


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\nmodel: *a{levels - 1}\n"


def test_alias_bomb_is_refused_at_once() -> None:
    text = _alias_bomb()
    assert len(text) < 1000  # 9**9 = 387 million nodes when expanded
    message = _refused(text, "bad.yaml:2:", "alias", "*a0", "write the value out")
    assert len(message) < 200


def test_recursive_anchor_is_refused() -> None:
    _refused("a: &a [*a]\n", "bad.yaml:1:", "alias")
    _refused("model: &m {num_layers: *m}\n", "alias")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 490, 600, 5_000])
def test_deep_flow_nesting_is_refused(depth: int) -> None:
    # Ours says "nests deeper than 16 levels"; past 1000 levels on one line, libyaml's scanner
    # stops first ("exceeded maximum nesting depth").
    _refused("[" * depth + "]" * depth, "bad.yaml:1:", "nest")
    _refused("model: " + "{a: " * depth + "1" + "}" * depth, "bad.yaml:1:", "nest")


def test_deep_block_nesting_is_refused() -> None:
    text = "".join(" " * i + f"k{i}:\n" for i in range(300)) + " " * 300 + "v\n"
    _refused(text, "deeper than 16 levels")
    _refused("".join("  " * i + "-\n" for i in range(100)) + "  " * 100 + "x\n", "deeper")


def test_nesting_up_to_the_cap_is_parsed() -> None:
    depth = MAX_DEPTH - 1  # inside the top-level mapping
    message = _refused(GOOD + "extra: " + "[" * depth + "]" * depth + "\n")
    assert "extra: unknown key" in message


def test_too_many_values_are_refused() -> None:
    _refused("model: [" + ",".join(["1"] * 20_000) + "]\n", "holds more than 10,000 values")
    _refused(GOOD + "".join(f"k{i}: {i}\n" for i in range(5100)), "holds more than 10,000 values")


def test_the_largest_real_config_is_fast() -> None:
    pattern = ", ".join(["true", "false"] * 2048)
    text = GOOD.replace("num_layers: 2", "num_layers: 4096").replace(
        "head_dim: 16", f"head_dim: 16, sliding_window: 4096, window_pattern: [{pattern}]")
    start = time.perf_counter()
    config = parse_config(text)
    assert time.perf_counter() - start < FAST
    assert config.model.window_pattern is not None and len(config.model.window_pattern) == 4096


def test_huge_size_string_is_a_clean_error() -> None:
    message = _refused(GOOD.replace("num_blocks: 8", "memory_budget: " + "9" * 400 + "GiB"),
                       "cache.memory_budget", "is not a size", "40GiB")
    assert "Overflow" not in message and len(message) < 300


@pytest.mark.parametrize("number", ["9" * 5000, "0x" + "f" * 5000, "1" + "0" * 41, "1." + "0" * 60,
                                    ":".join(["59"] * 500)])
def test_huge_numbers_are_refused(number: str) -> None:
    _refused(GOOD.replace("num_blocks: 8", f"num_blocks: {number}"), "characters is refused", "at most 40")


def test_duplicate_keys_are_refused_naming_both_lines() -> None:
    text = "model:\n  num_layers: 2\n  num_heads: 4\n  num_layers: 3\n  num_kv_heads: 2\n  head_dim: 16\n"
    text += "cache: {block_size: 32, num_blocks: 8}\n"
    _refused(text, "bad.yaml:4: model.num_layers: is given twice (lines 2 and 4); keep one of them")
    _refused(GOOD.replace("num_blocks: 8", "num_blocks: 8, num_blocks: 9"), "cache.num_blocks", "twice")


def test_duplicate_sections_are_refused() -> None:
    _refused(GOOD + "cache: {block_size: 64, num_blocks: 8}\n", "bad.yaml:4: cache: is given twice (lines 2 and 4)")


def test_duplicates_inside_lists_are_refused() -> None:
    _refused(GOOD + "extra: [{a: 1, a: 2}]\n", "extra.0.a", "twice")


@pytest.mark.parametrize(
    "device",
    ['"cuda:0\\n"', '"cpu\\n"', '"cuda:\\u0661"', '"cuda:\\uff11"', '" cuda"', '"cuda: 0"', '"CUDA"',
     '"cuda:1234"', '"cuda:01"', "cuda:-1", '"cuda:\\0"', "[cuda]", "0"],
)
def test_device_strings_are_strict_ascii(device: str) -> None:
    _refused(GOOD.replace("device: cpu", f"device: {device}"), "cache.device")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:15", "cuda:999"])
def test_device_strings_that_pass(device: str) -> None:
    assert parse_config(GOOD.replace("device: cpu", f"device: {device}")).cache.device == device


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("num_blocks", "1" + "0" * 30, ["cache.num_blocks", "at most 2147483647"]),
        ("num_blocks", str(MAX_BLOCKS + 1), ["cache.num_blocks", "at most 2147483647"]),
        ("swap_space", "1" + "0" * 30, ["cache.swap_space", "more than 1.00 PiB"]),
        ("swap_space", "2PiB", ["cache.swap_space", "more than 1.00 PiB"]),
        ("swap_space", "4EiB", ["cache.swap_space", "not a size"]),
        ("swap_space", "1025TiB", ["cache.swap_space", "more than 1.00 PiB"]),
        ("memory_budget", "1025TiB", ["cache.memory_budget", "more than 1.00 PiB"]),
        ("memory_budget", "1e400", ["cache.memory_budget", "inf", "(0, 1]"]),  # YAML 1.2 float: inf
        ("memory_budget", ".inf", ["cache.memory_budget", "inf", "(0, 1]"]),
        ("memory_budget", ".nan", ["cache.memory_budget", "nan", "(0, 1]"]),
        ("swap_space", "-1", ["cache.swap_space", "negative"]),
        ("swap_space", "4.0", ["cache.swap_space", "not a size"]),
        ("swap_space", "true", ["cache.swap_space", "not a size"]),
    ],
)
def test_sizes_and_counts_have_machine_bounds(field: str, value: str, words: list[str]) -> None:
    size = "" if field in ("num_blocks", "memory_budget") else "num_blocks: 8, "
    text = GOOD.replace("num_blocks: 8, ", size + f"{field}: {value}, ")
    _refused(text, *words)


def test_largest_sizes_that_pass() -> None:
    for size in ("1024TiB", "1pib", "1125899906842624B"):
        text = GOOD.replace("device: cpu", f"device: cpu, swap_space: {size}")
        assert parse_config(text).cache.swap_space == MAX_BYTES
    text = GOOD.replace("num_blocks: 8", f"num_blocks: {MAX_BLOCKS}")
    assert parse_config(text).cache.num_blocks == MAX_BLOCKS


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (GOOD.replace("head_dim: 16", "head_dim: true"), ["model.head_dim", "True", "whole number"]),
        (GOOD.replace("block_size: 32", "block_size: 32.0"), ["cache.block_size", "32.0", "whole number"]),
        (GOOD.replace("num_blocks: 8", "num_blocks: '8'"), ["cache.num_blocks", "'8'", "whole number"]),
        (GOOD.replace("device: cpu", "device: cpu, enable_prefix_caching: 1"), ["true or false"]),
        (GOOD.replace("reference", "[reference]"), ["attention.backend"]),
        (GOOD + "extra: !!python/object:os.system [echo]\n", ["bad.yaml:4:", "tag"]),
        (GOOD + "extra: !!binary aGk=\n", ["extra: unknown key"]),
        (GOOD + "extra: 2001-12-14 21:59:43.10 -99:00\n", ["bad.yaml:4:", "cannot be read"]),
        (GOOD + "<<: {a: 1}\n", ["merge key"]),
        (GOOD + "? [a, b]\n: 1\n", ["a key must be a name"]),
        (GOOD + "1: x\n", ["bad.yaml:4: 1:", "not a key name"]),
        (GOOD + "null: x\n", ["not a key name"]),
        (GOOD + "k" * 1000 + ": x\n", ["unknown key", "(1002 chars)"]),
        (GOOD + "k" * 5000 + ": x\n", ["bad.yaml:4:", "not valid YAML"]),  # libyaml: keys < 1024 chars
        (GOOD + "---\n" + GOOD, ["bad.yaml:4:", "single document"]),
        (GOOD + "\x00", ["#x0000", "remove it"]),
        (GOOD + "\t x: [", ["not valid YAML"]),
        ("model: \ud800\n", ["not valid text"]),
    ],
)
def test_odd_values_get_clean_messages(text: str, words: list[str]) -> None:
    _refused(text, *words)


@pytest.mark.parametrize(
    "text",
    [_alias_bomb(), "a: &a [*a]\n", "[" * 2_000 + "]" * 2_000, "".join(" " * i + f"k{i}:\n" for i in range(300)),
     GOOD.replace("num_blocks: 8", "num_blocks: " + "9" * 5000), GOOD + "cache: {}\n",
     GOOD + "extra: 2001-12-14 21:59:43.10 -99:00\n", GOOD + "\x00", "model: \ud800\n"],
    ids=["bomb", "recursive", "deep-flow", "deep-block", "big-int", "duplicate", "timestamp", "nul", "surrogate"],
)
def test_the_pure_python_yaml_loader_is_as_safe(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """Without libyaml (its C extension is optional), the same inputs end the same way (about 10x
    slower: the limit is looser)."""
    monkeypatch.setattr(safe_yaml, "_Loader", safe_yaml._PyLoader)
    _refused(text, limit=5 * FAST)
    assert parse_config(GOOD).cache.num_blocks == 8


def test_a_file_with_thousands_of_problems_lists_fifty() -> None:
    text = GOOD + "".join(f"junk{i}: {i}\n" for i in range(3000))
    message = _refused(text, "has 3000 problems; the first 50 by line follow")
    assert len(message.splitlines()) == 51


# --- files -----------------------------------------------------------------------------------


def _refused_file(path: str | Path, *words: str) -> str:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.perf_counter() - start < FAST
    _check_message(info.value)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"
    return str(info.value)


def test_big_file_is_refused_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(GOOD + "# " + "x" * (5 * 1024 * 1024) + "\n")
    _refused_file(big, "5,", "bytes; a config is at most 64 KiB")


def test_file_at_the_cap_is_read(tmp_path: Path) -> None:
    path = tmp_path / "padded.yaml"
    path.write_text(GOOD + "#" * (MAX_FILE_BYTES - len(GOOD) - 1) + "\n")
    assert path.stat().st_size == MAX_FILE_BYTES
    assert load_config(path).cache.num_blocks == 8


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    _refused_file(fifo, "is a FIFO, not a regular file")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_devices_are_refused(tmp_path: Path) -> None:
    _refused_file("/dev/zero", "character device")
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    _refused_file(link, "character device")


def test_directory_missing_and_odd_paths(tmp_path: Path) -> None:
    _refused_file(tmp_path, "is a directory")
    _refused_file(tmp_path / "nope.yaml", "no such file")
    _refused_file(tmp_path / "nope" / "x.yaml", "no such file")
    _refused_file(str(tmp_path / "a\x00b.yaml"), "not a usable path")


def test_binary_and_non_utf8_files(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.encode() + b"# caf\xe9\n")
    _refused_file(path, "not UTF-8", "line 4")
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ConfigError):
        load_config(path)
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())  # a byte-order mark is fine
    assert load_config(path).cache.block_size == 32


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_validate_goes_on_after_every_kind_of_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    huge = tmp_path / "huge.yaml"
    huge.write_text(GOOD.replace("num_blocks: 8", "memory_budget: " + "9" * 400 + "GiB"))
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    files = [str(bomb), str(huge), str(fifo), "/dev/zero", str(tmp_path / "missing.yaml"), str(good)]
    assert main(["validate", *files]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == f"{good}: ok (reference backend, block_size 32, 16.00 KiB per block)"
    assert "5 of 6 file(s) invalid" in err
    for path in files[:-1]:
        assert path in err


# --- fuzzing ---------------------------------------------------------------------------------

FUZZ = settings(max_examples=120, deadline=int(FAST * 1000), suppress_health_check=[HealthCheck.too_slow])
KEYS = ["model", "cache", "attention", "num_layers", "num_heads", "num_kv_heads", "head_dim", "dtype",
        "block_size", "num_blocks", "memory_budget", "device", "swap_space", "backend", "sliding_window",
        "window_pattern", "enable_prefix_caching", "a", "<<", "? x"]

_scalars = st.one_of(
    st.integers(min_value=-(10**60), max_value=10**60).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: json.dumps(f).replace("Infinity", ".inf")
                                                       .replace("NaN", ".nan")),
    st.sampled_from(["true", "no", "on", "~", "null", "''", "-", "1_000", "0o17", "0x1F", "1:30", ".5",
                     "2001-12-14", "!!str 3", "!!binary aGk=", "!!python/name:os.system", "!!float 1",
                     "!!set {a}", "&a 1", "*a", "*nope", "|\n  x", "32", "256", "16", "bfloat16", "fp16",
                     "cuda:0", "cuda:\u0661", "40GiB", "4gib", "0B", "0.9", "1.5", "flash_attn", "auto"]),
    st.text(alphabet=string.printable + "\u0661\u00e9\ud7ff\u2028\x85", max_size=30).map(json.dumps),
    st.builds(lambda d, u: f"{d}{u}", st.text(alphabet="0123456789.", min_size=1, max_size=25),
              st.sampled_from(["B", "kb", "MiB", "GIB", "tib", "PiB", " GiB", "x"])),
)


def _flow(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    lists = st.lists(children, max_size=5).map(lambda items: "[" + ", ".join(items) + "]")
    pairs = st.lists(st.tuples(st.sampled_from(KEYS), children), max_size=5)
    maps = pairs.map(lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}")
    deep = st.integers(min_value=0, max_value=3000).map(lambda n: "[" * n + "]" * n)
    return st.one_of(lists, maps, deep)


_values = st.recursive(_scalars, _flow, max_leaves=20)


@st.composite
def _configs(draw: st.DrawFn) -> str:
    """GOOD with some of its values replaced, and some keys added (duplicates included)."""
    lines = GOOD.splitlines()
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        inner = lines[i][lines[i].index("{") + 1: -1].split(", ")
        j = draw(st.integers(min_value=0, max_value=len(inner) - 1))
        key = inner[j].split(":")[0]
        if draw(st.booleans()):
            inner[j] = f"{key}: {draw(_values)}"
        else:
            inner.insert(j, f"{draw(st.sampled_from(KEYS))}: {draw(_values)}")
        lines[i] = lines[i][: lines[i].index("{")] + "{" + ", ".join(inner) + "}"
    if draw(st.booleans()):
        lines.append(f"{draw(st.sampled_from(KEYS))}: {draw(_values)}")
    return "\n".join(lines) + "\n"


@FUZZ
@given(_configs())
def test_fuzz_mutated_configs(text: str) -> None:
    outcome = _check_outcome(text)
    if isinstance(outcome, KVCacheConfig):
        assert outcome.cache.num_blocks is None or 1 <= outcome.cache.num_blocks <= MAX_BLOCKS
        assert outcome.cache.swap_space <= MAX_BYTES


@FUZZ
@given(_values)
def test_fuzz_yaml_values(text: str) -> None:
    _check_outcome(text)
    _check_outcome(f"model: {text}\ncache: {text}\n")


@FUZZ
@given(st.text(max_size=3000))
def test_fuzz_any_text(text: str) -> None:
    _check_outcome(text)


@settings(max_examples=60, deadline=int(FAST * 1000), suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=2000), _configs().map(str.encode)), min_size=1, max_size=3))
def test_fuzz_files_through_the_cli(tmp_path: Path, contents: list[bytes]) -> None:
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"f{i}.yaml"
        path.write_bytes(content)
        paths.append(str(path))
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    code = main(["validate", *paths, str(good)])
    assert code in (0, 1)
    for name in paths:
        try:
            load_config(name)
        except ConfigError as err:
            _check_message(err)

