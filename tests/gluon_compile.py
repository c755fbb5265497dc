"""Ahead-of-time sm_90 compiles of Gluon kernels without a GPU, for the compile tests' child
scripts (tests/test_prefill_hopper_compile.py, tests/test_mla_prefill_hopper_compile.py, the
MLA decode ones), and what those tests read off a compiled kernel: its counts of warpgroup MMAs
and TMA loads, its register spills (ptxas) and the spills inside its MMA loop (cuobjdump)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def compile_sm90(
    fn: Any,
    descs: dict[str, Any],
    consts: dict[str, Any],
    elem: str,
    num_warps: int = 4,
    types: dict[str, str] | None = None,
    maxnreg: int | None = None,
) -> Any:
    """Compile the Gluon kernel ``fn`` for sm_90: ``descs`` the host TMA descriptors by argument
    name, ``consts`` the constexpr arguments, ``elem`` the pointer type of ``out_ptr`` (other
    ``*_ptr`` arguments are int32, ``qk_scale`` and ``scale_log2`` fp32, the rest int32 scalars,
    unless ``types`` names an argument's type); ``maxnreg``: the launch's register cap per
    thread (as the launch passes it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {}
    for name in fn.arg_names:
        if types and name in types:
            sig[name] = types[name]
        elif name in descs:
            sig[name] = mangle_type(descs[name])
        elif name in consts:
            sig[name] = "constexpr"
        elif name == "out_ptr":
            sig[name] = elem
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = "fp32" if name in ("qk_scale", "scale_log2") else "i32"
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options: dict[str, int] = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=options)


def kernel_report(kernel: Any) -> dict[str, int]:
    """A compiled kernel's shared memory (bytes), ``wgmma`` and ``tma_load`` counts (PTX),
    ``spills`` (the largest ptxas "bytes spill stores", -1 when ptxas said none), ``registers``
    (ptxas's "Used N registers" a thread, the largest) and
    ``loop_spill_ops`` (:func:`loop_spill_ops`). Its files go to a private temporary folder,
    so tests in parallel (``-n``) or two Triton versions at once don't overwrite each other's."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = kernel.asm["ptx"]
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory(prefix="gluon_compile_") as scratch:
        ptx_path = Path(scratch) / "kernel.ptx"
        ptx_path.write_text(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_path), "-o", os.devnull], capture_output=True,
                              text=True)  # fmt: skip
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    registers = [int(x) for x in re.findall(r"Used (\d+) registers", done.stderr)]
    return {
        "shared": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma_load": ptx.count("cp.async.bulk.tensor.2d.shared::"),
        "spills": max(spills, default=-1),
        "registers": max(registers, default=-1),
        "loop_spill_ops": loop_spill_ops(kernel.asm["cubin"], str(Path(ptxas).parent / "cuobjdump")),
    }


def sass_text(cubin: bytes, cuobjdump: str) -> str:
    """``cuobjdump -sass`` of a compiled kernel (through a private temporary file)."""
    with tempfile.TemporaryDirectory(prefix="gluon_compile_") as scratch:
        cubin_path = Path(scratch) / "kernel.cubin"
        cubin_path.write_bytes(cubin)
        return subprocess.run([cuobjdump, "-sass", str(cubin_path)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def loop_spill_ops(cubin: bytes, cuobjdump: str) -> int:
    """Local-memory loads and stores (STL / LDL) inside the innermost loop holding every HGMMA
    of the SASS (:func:`loop_op_count`). -1 without such a loop."""
    return loop_op_count(cubin, cuobjdump, r"\b(STL|LDL)\b")


def loop_op_count(cubin: bytes, cuobjdump: str, pattern: str) -> int:
    """Instructions matching the regular expression ``pattern`` inside the innermost loop holding
    every HGMMA of the SASS: the shortest backward branch from after the last HGMMA to before
    the first (a longer one is an outer loop or a wait's out-of-line retry). -1 without such a
    loop."""
    sass = sass_text(cubin, cuobjdump)
    code = []  # (address, instruction)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    mma = [a for a, ins in code if "HGMMA" in ins]
    loops = []
    for a, ins in code:
        m = re.search(r"BRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", ins)
        if mma and m and int(m.group(1), 16) <= mma[0] and a >= mma[-1]:
            loops.append((int(m.group(1), 16), a))
    if not loops:
        return -1
    lo, hi = min(loops, key=lambda span: span[1] - span[0])
    return sum(1 for a, ins in code if lo <= a <= hi and re.search(pattern, ins))
