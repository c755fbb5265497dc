"""examples.engine.compile_watch: recording Triton JIT compiles after a warm-up."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from examples.engine import compile_watch
from examples.engine.compile_watch import CompileWatch, describe_compiles

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fire(
    runtime: Any, name: str, signature: str, attrs: dict[Any, Any] | None = None, key: tuple[Any, ...] = ()
) -> None:
    """Call the installed hook as Triton's JIT does after a compile (``attrs``: the
    specialization attributes, which Triton 3.6 passes in ``compile["configs"]``; ``key``: the
    kernel cache's key)."""
    runtime.jit_post_compile_hook(
        key=key, repr=signature, fn=SimpleNamespace(name=name),
        compile={} if attrs is None else {"configs": [attrs]}, is_manual_warmup=False, already_compiled=False,
    )  # fmt: skip


def test_the_watch_records_compiles_chains_the_previous_hook_and_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    earlier: list[str] = []
    runtime = SimpleNamespace(jit_post_compile_hook=lambda **kw: earlier.append(kw["fn"].name))
    monkeypatch.setattr(compile_watch, "_runtime_knobs", lambda: runtime)
    before = runtime.jit_post_compile_hook
    with CompileWatch() as watch:
        assert watch.available and runtime.jit_post_compile_hook is not before
        _fire(runtime, "_decode_kernel", "_decode_kernel[num_warps=4](q: *bf16, n: i32)",
              {(0,): [["tt.divisibility", 16]]})  # fmt: skip
        _fire(runtime, "_combine_kernel", "_combine_kernel[num_warps=4](o: *fp32)")
        _fire(runtime, "_merge", "_merge[num_warps=4](o: *fp32)", key=("*fp32", "D"))
    assert runtime.jit_post_compile_hook is before
    assert watch.names() == ["_decode_kernel", "_combine_kernel", "_merge"]
    assert earlier == ["_decode_kernel", "_combine_kernel", "_merge"]  # the hook that was there still ran
    summary = watch.summary()
    assert summary["available"] and summary["count"] == 3
    signature = "_decode_kernel[num_warps=4](q: *bf16, n: i32)"
    attrs = "{(0,): [['tt.divisibility', 16]]}"  # which arguments Triton specialized
    assert summary["compiles"][0] == {"name": "_decode_kernel", "signature": signature, "attrs": attrs}
    assert summary["compiles"][1]["attrs"] == ""  # a Triton that passes none
    assert summary["compiles"][2]["attrs"] == "key=('*fp32', 'D')"
    _fire(runtime, "_after", "")  # outside the watch: not recorded
    assert watch.names() == ["_decode_kernel", "_combine_kernel", "_merge"]


def test_a_qualified_kernel_name_is_kept_as_the_function_s_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton names a kernel defined in a function or a module by its qualified name; the
    watch records the name the source and a profile show."""
    runtime = SimpleNamespace(jit_post_compile_hook=None)
    monkeypatch.setattr(compile_watch, "_runtime_knobs", lambda: runtime)
    with CompileWatch() as watch:
        _fire(runtime, "test_x.<locals>._watched_fill", "_watched_fill[num_warps=4](out: *fp32)")
        _fire(runtime, "attention.triton_kernels.decode._decode_kernel", "")
    assert watch.names() == ["_watched_fill", "_decode_kernel"]


def test_compiles_described_for_a_log_line() -> None:
    names = ["_decode_kernel", "_combine_kernel", "_decode_kernel"]
    assert describe_compiles([]) == "none" and describe_compiles([], after_warmup=True) == "none"
    assert describe_compiles(names) == "3 (_decode_kernel x2, _combine_kernel x1)"
    assert describe_compiles(names, after_warmup=True) == (
        "3 (_decode_kernel x2, _combine_kernel x1); the warm-up missed them"
    )


def test_without_the_hook_the_watch_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_watch, "_runtime_knobs", lambda: None)
    with CompileWatch() as watch:
        pass
    assert not watch.available and watch.summary() == {"available": False, "count": 0, "compiles": []}


def test_the_installed_triton_has_the_hook() -> None:
    """The Triton this project pins exposes ``knobs.runtime.jit_post_compile_hook``: the watch
    is live, installs itself and restores what was there."""
    pytest.importorskip("triton")
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook
    with CompileWatch() as watch:
        assert watch.available
        assert knobs.runtime.jit_post_compile_hook == watch._hook
    assert knobs.runtime.jit_post_compile_hook is before


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_first_launch_and_a_new_specialization_are_recorded() -> None:
    """On a GPU: a kernel's first launch compiles (recorded), the same launch again does not,
    and an integer argument equal to 1 where it was not is a specialization of its own."""
    import triton
    import triton.language as tl

    @triton.jit
    def _watched_fill(out_ptr, n, value):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, 128)
        tl.store(out_ptr + offsets, tl.full([128], value, tl.float32), mask=offsets < n)

    out = torch.zeros(128, device="cuda")
    with CompileWatch() as watch:
        _watched_fill[(1,)](out, 100, 3.0)
        _watched_fill[(1,)](out, 100, 3.0)
        first = watch.names().count("_watched_fill")
        _watched_fill[(1,)](out, 1, 5.0)
    torch.cuda.synchronize()
    assert first == 1, watch.compiles
    assert watch.names().count("_watched_fill") == 2, watch.compiles
    assert out[0].item() == 5.0 and out[1].item() == 3.0
