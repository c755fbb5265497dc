"""Kernel arguments that change from step to step are not specialised on.

Triton compiles a kernel once per specialization of its integer arguments (a value of 1, a
multiple of 16, anything else) unless the kernel lists them in ``do_not_specialize``. A size
that varies by step (tokens, rows of the block table, its width, scratch blocks) would then
compile a new kernel in the middle of serving whenever a step meets a class the warm-up did
not, stalling that step for the compile. This checks, in a fresh interpreter (the kernels
as compiled, not as the CPU interpreter wraps them), that every launched kernel lists its
per-step sizes."""

from __future__ import annotations

import json

import pytest

from tests.child_env import compile_report

#: Per kernel (module, name): its arguments whose value depends on the step.
PER_STEP: dict[tuple[str, str], set[str]] = {
    ("attention.triton_kernels.decode_kernels", "decode_items_kernel"): {
        "num_item_slots", "num_table_rows", "table_width", "num_q_tokens", "num_partial_slots", "stride_bt",
    },
    ("attention.triton_kernels.decode_kernels", "decode_combine_kernel"): {
        "num_row_slots", "num_q_tokens", "num_partial_slots",
    },
    ("attention.triton_kernels.decode_hopper", "_decode_hopper_kernel"): {
        "num_item_slots", "num_table_rows", "table_width", "num_q_tokens", "num_partial_slots", "stride_bt",
    },
    ("attention.triton_kernels.decode_hopper_ws", "_decode_hopper_ws_kernel"): {
        "num_item_slots", "num_table_rows", "table_width", "num_q_tokens", "num_partial_slots", "stride_bt",
    },
    ("attention.triton_kernels.prefill", "_prefill_kernel"): {"num_tokens", "table_width", "stride_bt", "max_tiles"},
    ("attention.triton_kernels.prefill_hopper", "_hopper_prefill_kernel"): {
        "num_tokens", "table_width", "stride_bt", "max_tiles",
    },
    ("attention.triton_kernels.rotary_write", "_rotary_write_kernel"): {"num_tokens"},
    ("attention.triton_kernels.rotary_write", "_value_runs_kernel"): {"num_tokens"},
    ("attention.triton_kernels.dequantize_blocks", "_dequantize_blocks_kernel"): {
        "num_scratch", "num_rows", "table_width", "stride_bt",
    },
    ("attention.triton_kernels.metadata_check", "_check_kernel"): {"num_tokens", "stride_bt", "num_rows"},
    ("attention.triton_kernels.mla_decode", "_mla_decode_kernel"): {"num_rows", "table_width"},
    ("attention.triton_kernels.mla_decode", "_mla_merge_kernel"): {"num_rows", "table_width", "splits"},
    ("attention.triton_kernels.mla_balanced", "_mla_balanced_kernel"): {
        "num_tokens", "num_slots", "num_rows", "table_width",
    },
    ("attention.triton_kernels.mla_balanced", "_mla_balanced_merge_kernel"): {"num_tokens", "num_slots", "token_base"},
    ("attention.triton_kernels.mla_decode_hopper", "_mla_hopper_kernel"): {
        "num_tokens", "num_slots", "num_rows", "table_width",
    },
    ("attention.triton_kernels.mla_prefill_hopper", "_mla_prefill_hopper_kernel"): {"num_items", "num_tokens"},
}  # fmt: skip

_SCRIPT = r"""
import importlib, json
wanted = json.loads(WANTED)
report = {}
for module, name in wanted:
    kernel = getattr(importlib.import_module(module), name, None)
    params = getattr(kernel, "params", None)
    report[f"{module}:{name}"] = None if params is None else {
        "params": [p.name for p in params], "unspecialised": [p.name for p in params if p.do_not_specialize]
    }
print(json.dumps(report))
"""


def test_per_step_sizes_are_not_specialised_on() -> None:
    pytest.importorskip("triton")
    wanted = json.dumps([list(key) for key in PER_STEP])
    report = compile_report(f"WANTED = {wanted!r}\n{_SCRIPT}")
    problems = []
    for (module, name), per_step in PER_STEP.items():
        kernel = report[f"{module}:{name}"]
        if kernel is None:  # a Gluon kernel where this Triton has no Gluon
            continue
        unknown = per_step - set(kernel["params"])
        assert not unknown, f"{name}: no arguments {sorted(unknown)} (renamed? update PER_STEP)"
        specialised = sorted(per_step - set(kernel["unspecialised"]))
        if specialised:
            problems.append(f"{module}.{name}: add {specialised} to do_not_specialize")
    assert not problems, "\n".join(problems)
