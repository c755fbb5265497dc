"""Ahead-of-time sm_90 compiles of Gluon kernels without a GPU, for the compile tests' child
scripts (tests/test_prefill_hopper_compile.py, tests/test_mla_prefill_hopper_compile.py)."""

from __future__ import annotations

from typing import Any


def compile_sm90(
    fn: Any,
    descs: dict[str, Any],
    consts: dict[str, Any],
    elem: str,
    num_warps: int = 4,
    types: dict[str, str] | None = None,
) -> Any:
    """Compile the Gluon kernel ``fn`` for sm_90: ``descs`` the host TMA descriptors by argument
    name, ``consts`` the constexpr arguments, ``elem`` the pointer type of ``out_ptr`` (other
    ``*_ptr`` arguments are int32, ``qk_scale`` and ``scale_log2`` fp32, the rest int32 scalars,
    unless ``types`` names an argument's type)."""
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
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps})
