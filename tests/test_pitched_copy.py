"""copy_rows: row-strided tensors between pinned host memory and the device in one
cudaMemcpy2DAsync. The argument checks run everywhere; the copies need a CUDA device."""

from __future__ import annotations

import pytest
import torch

from attention.errors import InvalidArgumentError
from kvcache.memory.pitched_copy import copy_rows, pitched_copies_available

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_mismatched_tensors_are_refused_before_any_copy() -> None:
    a, b = torch.zeros(4, 8), torch.zeros(4, 9)
    with pytest.raises(InvalidArgumentError, match="one shape and one dtype"):
        copy_rows(a, b, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="one shape and one dtype"):
        copy_rows(a, a.double(), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t[:, ::2],  # rows not contiguous
        lambda t: t.t(),  # rows not contiguous
        lambda t: t.as_strided((4, 8), (4, 1)),  # rows overlap
        lambda t: t[0],  # one dimension: no rows
    ],
    ids=["strided-row", "transposed", "overlapping", "1d"],
)
def test_tensors_without_contiguous_separate_rows_are_refused(view) -> None:  # type: ignore[no-untyped-def]
    t = view(torch.zeros(8, 8))
    with pytest.raises(InvalidArgumentError, match="rows"):
        copy_rows(t, t.clone(), None)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_copies_say_they_are_unavailable() -> None:
    assert not pitched_copies_available()
    with pytest.raises(RuntimeError, match="pitched_copies_available"):
        copy_rows(torch.zeros(2, 3), torch.zeros(2, 3), None)  # type: ignore[arg-type]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["to_host", "to_device", "device_to_device"])
def test_strided_rows_arrive_bit_identical(direction: str) -> None:
    assert pitched_copies_available()
    torch.manual_seed(0)
    device_storage = torch.randn(6, 2, 37, 32, 3, 64, device="cuda").to(torch.bfloat16)  # an odd block count
    rows = device_storage.flatten(0, 1)  # [12, 37, ...]
    host = torch.zeros(5, 12, 32, 3, 64, dtype=torch.bfloat16, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    if direction == "to_host":
        copy_rows(host[3], rows[:, 29], stream)
        stream.synchronize()
        assert torch.equal(host[3], rows[:, 29].cpu()) and not host[2].any() and not host[4].any()
    elif direction == "to_device":
        source = torch.randn(12, 32, 3, 64).to(torch.bfloat16).pin_memory()
        before = device_storage.clone()
        copy_rows(rows[:, 11], source, stream)
        stream.synchronize()
        assert torch.equal(rows[:, 11].cpu(), source)
        before.flatten(0, 1)[:, 11] = rows[:, 11]
        assert torch.equal(device_storage, before)  # no other block touched
    else:
        before = device_storage.clone()
        copy_rows(rows[:, 0], rows[:, 36], stream)
        stream.synchronize()
        assert torch.equal(rows[:, 0], before.flatten(0, 1)[:, 36])
        assert torch.equal(rows[:, 1:], before.flatten(0, 1)[:, 1:])
