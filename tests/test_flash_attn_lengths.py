"""The flash_attn backend takes its K lengths from the checked device lengths, not the host's.

The device check (attention.metadata_check) validates block-table entries below each row's
device length. A device length corrupted to a shorter valid value hides the entries past it
from the check, and flash-attn trusts its table: if it read over the host's lengths it would
dereference them. So at a plan's first attend the backend recomputes flash-attn's lengths
from ``metadata.seq_lens`` (tests/test_backend_metadata_fuzz.py runs this against the real
library on a GPU, with such lengths planted). Without flash-attn, these tests load the
backend over a stand-in module that records the lengths each call is given.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.paged_case import make_case, make_spec

BACKEND_FILE = Path(__file__).resolve().parents[1] / "attention" / "flash_attn_backend.py"


def _backend_module(monkeypatch: pytest.MonkeyPatch, calls: dict[str, list[torch.Tensor]]) -> Any:
    """attention/flash_attn_backend.py loaded under a private name over a stand-in
    ``flash_attn`` whose two functions record the lengths they get and return zeros."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: tests/test_backend_metadata_fuzz.py runs the library itself")
    stand_in = types.ModuleType("flash_attn")

    def with_kvcache(q: torch.Tensor, *args: Any, cache_seqlens: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.setdefault("cache_seqlens", []).append(cache_seqlens.clone())
        return torch.zeros_like(q)

    def varlen(q: torch.Tensor, *args: Any, cu_seqlens_k: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.setdefault("cu_seqlens_k", []).append(cu_seqlens_k.clone())
        return torch.zeros_like(q)

    stand_in.flash_attn_with_kvcache = with_kvcache  # type: ignore[attr-defined]
    stand_in.flash_attn_varlen_func = varlen  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)
    spec = importlib.util.spec_from_file_location("_flash_attn_backend_with_stand_in", BACKEND_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rows", [[(53, 1), (300, 1)], [(53, 4), (300, 1)]], ids=["decode", "varlen"])
def test_lengths_come_from_the_device_at_the_first_attend(monkeypatch: pytest.MonkeyPatch, rows) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, list[torch.Tensor]] = {}
    module = _backend_module(monkeypatch, calls)
    spec = make_spec(2, 1, 16, torch.float16)
    case = make_case(rows, spec, block_size=256, device="cpu", pad_to=3)
    backend = module.FlashAttnBackend(spec)
    # The stand-in runs on the CPU, which the backend refuses (its library is CUDA-only).
    monkeypatch.setattr(backend, "_device_type_for_checks", lambda device_type: "cuda")
    plan = backend.plan(case.meta)
    host = list(case.meta.seq_lens_host)
    case.meta.seq_lens[1] = 20  # after the plan: as corruption (or the device check) would change it
    out = torch.empty_like(case.query)
    backend.attend(case.query, case.layer, plan, out=out)
    case.meta.seq_lens[1] = 21  # a later layer of the same step: the lengths stay the step's
    backend.attend(case.query, case.layer, plan, out=out)
    if "cache_seqlens" in calls:  # decode: padding rows read one token
        first, second = calls["cache_seqlens"]
        assert first.tolist() == [host[0], 20, 1] and torch.equal(first, second)
    else:  # varlen: cumulative lengths of the real rows
        first, second = calls["cu_seqlens_k"]
        assert first.tolist() == [0, host[0], host[0] + 20] and torch.equal(first, second)
    assert host[1] != 20, "the host's length would have been read otherwise"
