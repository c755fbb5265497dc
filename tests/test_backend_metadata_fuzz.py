"""Hostile step metadata against every backend under test (hypothesis).

A valid step is built by ``MetadataBuilder(device, device_check=True)`` over a NaN-bordered
cache, then its device tensors are corrupted at random (tests/hostile_metadata.py). Two paths:

- checked: the builder's device check (``DeviceCheck.run``) checks and repairs the metadata in
  place, then the backend writes and attends. The check is the Triton kernel, except with the
  reference backend: there it is its plain-torch twin, the one a deployment without Triton
  runs. No exception but the project's own (KVCacheError); nothing written outside the cache
  (the NaN border blocks keep their bits) or outside ``out``; no token writes a slot of another
  row; and ``raise_if_violated`` raises a MetadataError naming one of the problems planted.
- unchecked: the backend gets the corrupted metadata as it is. The reference checks on the
  host and raises MetadataError; our kernels clamp block ids, lengths and query rows
  themselves. Either way no crash, nothing written outside the cache or ``out``, and nothing
  raised but a KVCacheError. Kernel backends run this path in a child process, so a crash is
  a test failure that names the example. (flash-attn trusts its metadata: only the checked
  path applies to it.)

Triton's CPU interpreter does not catch out-of-bounds reads (unless one leaves the process's
memory, which kills it), so the assertions are on writes and on the process surviving. The
device check itself is tests/test_metadata_check.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from attention import BACKENDS, StepPlan
from attention.errors import KVCacheError, MetadataError
from attention.metadata_check import VIOLATIONS
from tests.hostile_metadata import FAR, Step, corrupt, hostile_case, steps
from tests.paged_case import BACKENDS_UNDER_TEST, PagedCase, UnderTest

ROOT = Path(__file__).resolve().parents[1]
# Each example runs a few interpreter launches (~0.1-0.3 s); the unshrunk failing example is small
# enough to read, and shrinking one would take minutes on a 2-core machine.
FUZZ = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
#: Backends whose own calls stay inside their tensors whatever the device metadata says (the
#: reference by checking on the host, triton by clamping in its kernels).
UNCHECKED_SAFE = {"reference", "triton"}
# The interpreter's numpy warns when a kernel reads the NaN border (unchecked metadata).
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN == NaN in comparisons."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _block_owners(case: PagedCase) -> dict[int, int]:
    """block id -> the real row whose block table holds it (from the valid metadata)."""
    meta, bs = case.meta, case.meta.block_size
    tables = meta.block_tables.tolist()
    return {tables[row][col]: row for row, s in enumerate(meta.seq_lens_host) for col in range(-(-s // bs))}


def _token_rows(case: PagedCase) -> list[int]:
    """The row of each of the step's tokens (padding rows included), from the host lengths."""
    meta = case.meta
    lens = list(meta.query_lens_host) + [1] * (meta.padded_batch - meta.batch)
    return [row for row, n in enumerate(lens) for _ in range(n)]


def _write_and_attend(under: UnderTest, case: PagedCase, plan: StepPlan) -> torch.Tensor:
    """write_kv then attend into an ``out`` with a canary row before and after; returns the
    canaried storage. Each call may raise only the project's own errors."""
    backend = under.make(case.spec)
    t, h, d = case.query.shape
    out_store = torch.full((t + 2, h, d), 7.0, dtype=case.query.dtype, device=case.query.device)
    with contextlib.suppress(KVCacheError):
        backend.write_kv(case.new_key, case.new_value, case.layer, plan)
    with contextlib.suppress(KVCacheError):
        backend.attend(case.query, case.layer, plan, out=out_store[1:-1])
    if case.query.is_cuda:
        torch.cuda.synchronize()
    return out_store


def _assert_nothing_outside(case: PagedCase, before: torch.Tensor, out_store: torch.Tensor, planted: object) -> None:
    storage = _bits(case.storage)
    assert torch.equal(storage[:, 0], _bits(before)[:, 0]), f"a write landed before the cache ({planted})"
    assert torch.equal(storage[:, -1], _bits(before)[:, -1]), f"a write landed after the cache ({planted})"
    assert (out_store[0] == 7.0).all() and (out_store[-1] == 7.0).all(), f"a write landed outside out ({planted})"


# ---- checked: repaired by the device check, then run ---------------------------------------


@pytest.mark.parametrize("under", BACKENDS_UNDER_TEST)
@FUZZ
@given(step=steps(), data=st.data())
def test_checked_metadata_is_repaired_and_reported(under: UnderTest, step: Step, data: st.DataObject) -> None:
    case = hostile_case(under, step)
    window, builder = step.window, case.builder
    assert builder is not None and builder._check is not None, "make_case(device_check=True) keeps its builder"
    builder._check._use_triton = under.name != "reference"
    plan = under.make(case.spec).plan(case.meta)
    owner, token_row = _block_owners(case), _token_rows(case)
    codes, planted = corrupt(data, case, window)
    builder._check.run(case.meta, case.layer.num_blocks, window)
    before = case.storage.clone()
    out_store = _write_and_attend(under, case, plan)
    _assert_nothing_outside(case, before, out_store, planted)
    # Every slot that changed lies in a block of a row, and holds the K/V of one of that row's
    # own new tokens: no token wrote a slot of another row (nor a padding row's token any slot).
    kvh, d, bs = case.spec.num_kv_heads, case.spec.head_dim, case.meta.block_size
    slots = _bits(case.storage[:, 1:-1]).reshape(2, -1, kvh * d)  # [K/V, slot, kvh * d]
    new = _bits(torch.stack([case.new_key, case.new_value])).reshape(2, -1, kvh * d)  # [K/V, token, kvh * d]
    changed = (slots != _bits(before[:, 1:-1]).reshape(2, -1, kvh * d)).any(-1).any(0)
    for slot in changed.nonzero().flatten().tolist():
        row = owner.get(slot // bs)
        assert row is not None, f"slot {slot} was written, in block {slot // bs}, which no row holds ({planted})"
        writers = (new == slots[:, slot : slot + 1]).all(-1).all(0).nonzero().flatten().tolist()
        assert any(token_row[t] == row for t in writers), (
            f"slot {slot} of row {row} was written by token(s) {writers} of row(s) {[token_row[t] for t in writers]} "
            f"({planted})"
        )
    expected = "|".join(re.escape(VIOLATIONS[c]) for c in sorted(codes))
    with pytest.raises(MetadataError, match=rf"metadata checked on the device: row -?\d+.*: ({expected});"):
        builder.raise_if_violated()
    builder.raise_if_violated()  # reported once: the flag was cleared


# ---- unchecked: run as corrupted ----------------------------------------------------------


def _run_unchecked(under: UnderTest, case: PagedCase, planted: list[str]) -> None:
    print(f"running: {planted}", flush=True)  # a crash kills the process: the last line names it
    plan = under.make(case.spec).plan(case.meta)
    before = case.storage.clone()
    out_store = _write_and_attend(under, case, plan)
    _assert_nothing_outside(case, before, out_store, planted)


def unchecked_fuzz(name: str, device: str, block_size: int, examples: int) -> None:
    """The unchecked path for one backend, ``examples`` hypothesis examples (run in a child
    process for kernel backends)."""
    under = UnderTest(name, device, block_size)

    @settings(FUZZ, max_examples=examples)
    @given(step=steps(), data=st.data())
    def fuzz(step: Step, data: st.DataObject) -> None:
        case = hostile_case(under, step)
        _, planted = corrupt(data, case, step.window)
        _run_unchecked(under, case, [f"{step}", *planted])

    fuzz()


def far_lengths(name: str, device: str, block_size: int) -> None:
    """The unchecked path on a prefill row whose length, or query length, is far out of range
    (a billion, or -2**31, where ``seq_len - query_len`` overflows int32): a kernel trusting
    either reads a billion tokens away, or loops over them. Both key-tile layouts."""
    under = UnderTest(name, device, block_size)
    scenarios = [("seq_lens", 0, -FAR), ("query_start_loc", 1, FAR), ("query_start_loc", 0, -FAR)]
    scenarios += [("seq_lens", 0, -(2**31))]
    for field, index, value in scenarios:
        for dtype in (torch.float32, torch.float16):
            step = Step([(20, 10), (30, 1)], dtype=dtype)
            case = hostile_case(under, step)
            getattr(case.meta, field)[index] = value
            _run_unchecked(under, case, [f"{step}", f"{field}[{index}] = {value}"])


_TRUSTING = pytest.mark.skip(reason="reads the metadata as given; only the device check protects it")
_UNCHECKED = [
    p if p.values[0].name in UNCHECKED_SAFE else pytest.param(*p.values, id=p.id, marks=_TRUSTING)  # type: ignore[union-attr]
    for p in BACKENDS_UNDER_TEST
]


def _run_path(under: UnderTest, function: str, *args: int, timeout: float) -> None:
    """``function`` of this module for the backend: for a kernel backend in a child process,
    so a crash or a hang fails this test naming the example instead of ending the test run;
    for the reference (plain torch) here."""
    call_args = (under.name, under.device, under.block_size, *args)
    if BACKENDS[under.name].library is None:
        globals()[function](*call_args)
        return
    code = f"from tests.test_backend_metadata_fuzz import {function}; {function}{call_args!r}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as hung:
        out = hung.stdout.decode() if isinstance(hung.stdout, bytes) else hung.stdout or ""
        pytest.fail(f"{under.name} on {under.device}: no exit within {timeout:.0f} s, while {_last_example(out)}")
    rc = done.returncode
    if rc:
        died = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        pytest.fail(f"{under.name} on {under.device}: {died} while {_last_example(done.stdout)}\n{done.stderr[-3000:]}")


def _last_example(stdout: str) -> str:
    return ([line for line in stdout.splitlines() if line.startswith("running: ")] or ["(none started)"])[-1]


@pytest.mark.parametrize("under", _UNCHECKED)
def test_unchecked_metadata_writes_nothing_outside(under: UnderTest) -> None:
    _run_path(under, "unchecked_fuzz", FUZZ.max_examples, timeout=180)


@pytest.mark.parametrize("under", _UNCHECKED)
def test_unchecked_lengths_far_out_of_range(under: UnderTest) -> None:
    """The fuzz's far lengths, as fixed examples (a regression test)."""
    _run_path(under, "far_lengths", timeout=60)
