"""Runs of tokens whose token-major V the fused rotary + cache write stores coalesced
(:mod:`attention.triton_kernels.value_runs`): with the runs' second kernel the cache holds
exactly the bytes the token-by-token write leaves (fp8, int8 with its scales, a 16-bit
token-major V, a rotated basis), over prefill rows that start mid-block and cross into
non-adjacent blocks, decode tokens, padding, a slot outside the cache and a row whose slots
are all there but out of order.

Without a GPU this runs in Triton's CPU interpreter (tests/conftest.py), on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from attention.kv_rotation import hadamard_rotation
from attention.rotary import RotaryTable
from attention.triton_kernels.rotary_write import rotary_write_kv
from attention.triton_kernels.value_runs import value_run_length, value_runs_for
from attention.value_layout import token_major_view
from tests.paged_case import int8_layer

pytestmark = pytest.mark.kernel

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("block_size", "run"), [(32, 32), (64, 32), (256, 32), (96, 32), (16, 16), (48, 16), (80, 16), (8, 0), (24, 0)]
)
def test_run_length_is_the_largest_power_of_two_up_to_32_dividing_the_block(block_size: int, run: int) -> None:
    assert value_run_length(block_size) == run


def _slot_mapping(block_size: int, num_blocks: int, run: int) -> list[int]:
    """Rows of a mixed step: a prefill row from mid-block 3 into blocks 1 and 4, decode
    tokens, padding (-1), a slot past the cache, a row of whole runs from block 0, and a row
    holding block 6's first slots with two of them swapped (no run there). No slot twice."""
    bs = block_size
    slots = [3 * bs + 5 + i for i in range(bs - 5)] + [bs + i for i in range(bs)] + [4 * bs + i for i in range(11)]
    slots += [2 * bs + 3, 5 * bs + 1, -1, num_blocks * bs + 7, 4 * bs + 20]
    slots += [i for i in range(bs)] + [7 * bs + i for i in range(9)]  # block 0 from its start, then 7
    swapped = [6 * bs + i for i in range(run)]
    swapped[3], swapped[run - 2] = swapped[run - 2], swapped[3]
    return slots + swapped + [-1, -1]


def _runs(slots: list[int], run: int, num_slots: int) -> int:
    """How many runs the slot mapping holds (the module's definition, in Python)."""
    found = 0
    for lead in range(len(slots) - run + 1):
        first = slots[lead]
        whole = slots[lead : lead + run] == list(range(first, first + run))
        found += first >= 0 and first % run == 0 and first + run <= num_slots and whole
    return found


def _cache(kind: str, num_blocks: int, block_size: int, kvh: int, d: int, dev: str) -> tuple[torch.Tensor, dict]:
    """(every byte of the layer, the write's cache arguments), the bytes random."""
    gen = torch.Generator().manual_seed(11)
    if kind.startswith("int8"):
        storage, layer = int8_layer(num_blocks, block_size, kvh, d, dev)
        storage.copy_(torch.randint(-128, 128, storage.shape, generator=gen, dtype=torch.int8))
        return storage, {"k_cache": layer.key, "v_cache": layer.value, "k_scale": layer.k_scale,
                         "v_scale": layer.v_scale}  # fmt: skip
    dtype = FP8 if kind.startswith("fp8") else torch.bfloat16
    shape = (2, num_blocks, block_size, kvh, d * dtype.itemsize)
    storage = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    storage = storage.to(dev).view(dtype)
    args = {"k_cache": storage[0], "v_cache": token_major_view(storage[1])}
    if dtype == FP8:
        args["k_scale"] = torch.tensor([0.02, 0.05, 0.03][:kvh], device=dev)
        args["v_scale"] = torch.tensor([0.04, 0.01, 0.06][:kvh], device=dev)
    return storage, args


#: (kind, block_size, kv_heads, head_dim): every kind at runs of 32 and 16; three KV heads and
#: head_dim 32 (runs within a block of 64) unrotated (the rotated ones take ~15 s interpreted).
KINDS = ("fp8", "int8", "bf16", "fp8-rotated", "int8-rotated")
WRITES = [(kind, *shape) for kind in KINDS for shape in ((32, 2, 16), (16, 2, 16))]
WRITES += [(kind, 64, 3, 32) for kind in KINDS[:3]]


@pytest.mark.parametrize(("kind", "block_size", "kvh", "d"), WRITES)
def test_runs_store_the_bytes_the_token_by_token_write_stores(
    kind: str, block_size: int, kvh: int, d: int, triton_device: str
) -> None:
    dev, num_blocks = triton_device, 8
    run = value_run_length(block_size)
    slot_list = _slot_mapping(block_size, num_blocks, run)
    assert _runs(slot_list, run, num_blocks * block_size) >= 2, "the case holds runs"
    assert len({s for s in slot_list if s >= 0}) == sum(s >= 0 for s in slot_list)
    slots = torch.tensor(slot_list, device=dev)
    tokens = len(slot_list)
    gen = torch.Generator().manual_seed(block_size + d)
    query = torch.randn(tokens, 2 * kvh, d, generator=gen).to(torch.bfloat16).to(dev)
    key = torch.randn(tokens, kvh, d, generator=gen).to(torch.bfloat16).to(dev)
    value = (torch.randn(tokens, kvh, d, generator=gen) * 3).to(torch.bfloat16).to(dev)
    table = RotaryTable.build(1.0 / 500.0 ** (torch.arange(0, d, 2, device=dev).float() / d), 512)
    positions = torch.arange(tokens, device=dev) * 3 % 512
    rotation = hadamard_rotation(d, device=dev).to(torch.bfloat16) if kind.endswith("rotated") else None
    results = []
    for runs in (False, True):
        storage, cache = _cache(kind, num_blocks, block_size, kvh, d, dev)
        assert value_runs_for(cache["v_cache"]) == run, "the V cache takes runs"
        q = rotary_write_kv(query, key, value, slot_mapping=slots, **cache, **_rest(positions, table, rotation, runs))
        results.append((q, storage))
    (q_token, token_bytes), (q_runs, run_bytes) = results
    assert torch.equal(q_token, q_runs)
    same = token_bytes.view(torch.uint8) == run_bytes.view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} bytes differ"
    fresh, _ = _cache(kind, num_blocks, block_size, kvh, d, dev)
    assert not torch.equal(fresh.view(torch.uint8)[1], run_bytes.view(torch.uint8)[1]), "V was written"


def _rest(positions: torch.Tensor, table: RotaryTable, rotation: torch.Tensor | None, runs: bool | None) -> dict:
    return {"positions": positions, "cos_sin": table.cos_sin, "rotation": rotation, "value_runs": runs}


def test_runs_need_a_token_major_value_and_enough_tokens(triton_device: str) -> None:
    """A contiguous V takes no runs (value_runs=True is then a no-op, not an error), and by
    default a step of fewer tokens than a run launches none: the bytes match either way."""
    dev = triton_device
    storage = torch.randn(2, 4, 32, 2, 16, device=dev).to(torch.bfloat16)
    assert value_runs_for(storage[1]) == 0 and value_runs_for(token_major_view(storage[1])) == 32
    slots = torch.arange(40, device=dev)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(40, 4, 16, generator=gen).to(torch.bfloat16).to(dev)
    key, value = (torch.randn(40, 2, 16, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2))
    table = RotaryTable.build(1.0 / 500.0 ** (torch.arange(0, 16, 2, device=dev).float() / 16), 64)
    positions = torch.arange(40, device=dev)
    written = []
    for runs in (None, True):
        cache = storage.clone()
        rotary_write_kv(query, key, value, cache[0], cache[1], slots, positions, table.cos_sin, value_runs=runs)
        written.append(cache)
    assert torch.equal(written[0], written[1])
    assert torch.equal(written[0][1].reshape(-1, 2, 16)[:40], value)


@pytest.mark.parametrize(
    ("kind", "tokens", "runs", "launched"),
    [("fp8", 40, None, True), ("fp8", 20, None, False), ("fp8", 40, False, False), ("int8", 40, None, False),
     ("int8", 40, True, True), ("bf16", 40, None, True)],
)  # fmt: skip
def test_which_writes_launch_the_runs_kernel(
    kind: str, tokens: int, runs: bool | None, launched: bool, triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (None) a step of at least a run's tokens into a token-major V launches the
    runs kernel, except into an int8 cache (there it measured slower than token by token);
    True launches it there too, False never."""
    import attention.triton_kernels.rotary_write as module

    grids: list[tuple[int, ...]] = []

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(module, "_value_runs_kernel", Spy())
    dev = triton_device
    _, cache = _cache(kind, 4, 32, 2, 16, dev)
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(tokens, 4, 16, generator=gen).to(torch.bfloat16).to(dev)
    key, value = (torch.randn(tokens, 2, 16, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2))
    table = RotaryTable.build(1.0 / 500.0 ** (torch.arange(0, 16, 2, device=dev).float() / 16), 64)
    slots, positions = torch.arange(tokens, device=dev), torch.arange(tokens, device=dev)
    rotary_write_kv(query, key, value, slot_mapping=slots, **cache, **_rest(positions, table, None, runs))
    assert grids == ([(2, 2)] if launched else [])
