"""Token ids as callers pass them (lists, tuples, arrays, 1-D integer tensors), checked once
and turned into one form, so a tensor behaves exactly like the list it holds."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attention.checks import is_bool_scalar, require_int
from attention.errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    from kvcache.blocks.sequence import SequenceBlocks

__all__ = ["appended_ids", "prompt_length", "token_count", "token_list"]


def _from_array_like(token_ids: Any, name: str) -> list[int] | None:
    """A 1-D integer tensor / ndarray as a list of ints; None for anything else."""
    dtype = getattr(token_ids, "dtype", None)
    if dtype is None or not hasattr(token_ids, "tolist"):
        return None
    ndim = token_ids.dim() if callable(getattr(token_ids, "dim", None)) else getattr(token_ids, "ndim", None)
    if ndim != 1:
        raise InvalidArgumentError(f"{name}: expected a 1-D sequence of token ids, got {ndim} dimensions")
    if (
        getattr(dtype, "is_floating_point", False)
        or getattr(dtype, "is_complex", False)
        or str(dtype)
        in (
            "torch.bool",
            "bool",
        )
    ):
        raise ArgumentTypeError(f"{name}: expected integer token ids, got dtype {dtype}")
    kind = getattr(dtype, "kind", "i")  # numpy dtypes have a kind; torch ints pass above
    if kind not in "iu":
        raise ArgumentTypeError(f"{name}: expected integer token ids, got dtype {dtype}")
    values: list[int] = token_ids.tolist()
    return values


def token_list(token_ids: object, name: str = "token_ids") -> list[int]:
    """``token_ids`` as a list of Python ints: a list is checked and returned as it is (not
    copied: callers that keep it copy it), anything else is converted. Raises
    ArgumentTypeError for a string, a mapping, a non-sequence, or an element that is not an
    integer; InvalidArgumentError for a tensor that is not 1-D."""
    values: list[int] | None = token_ids if type(token_ids) is list else _from_array_like(token_ids, name)
    if values is None:
        if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, (Sequence, array)):
            raise ArgumentTypeError(
                f"{name}: expected a sequence of integer token ids (list, tuple, 1-D tensor), "
                f"got {type(token_ids).__name__}"
            )
        values = list(token_ids)
    try:
        array("q", values)  # C-speed check that every element is an integer that fits int64
        types = set(map(type, values))
        if bool in types:  # an int is an int; a bool is not
            raise TypeError
    except (TypeError, OverflowError):
        i, bad = next(
            (i, v)
            for i, v in enumerate(values)
            if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 63) <= v < 1 << 63
        )
        what = "out of int64 range" if isinstance(bad, int) and not isinstance(bad, bool) else type(bad).__name__
        raise ArgumentTypeError(
            f"{name}[{i}]: every token id must be an integer in int64 range; found {bad!r:.40} ({what})"
        ) from None
    if types - {int}:
        values = _plain_ints(values, name)
    return values


def _plain_ints(values: list[Any], name: str) -> list[int]:
    """``values`` (each an integer by ``array``'s check, Python bools refused before) as Python
    ints: numpy integer scalars and 0-d integer tensors (``list(tensor)`` gives those) are
    converted, so what is stored and published is plain ints. A bool scalar of torch or numpy,
    which also passes as an index, raises ArgumentTypeError."""
    for i, value in enumerate(values):
        if is_bool_scalar(value):
            raise ArgumentTypeError(
                f"{name}[{i}]: every token id must be an integer in int64 range; found {value!r:.40} (a bool)"
            )
    return [operator.index(value) for value in values]


def token_count(token_ids: object, name: str = "token_ids") -> int:
    """How many token ids ``token_ids`` holds, with the container rules of :func:`token_list`
    (1-D tensors and arrays, sequences, not strings) but without reading the elements, for
    callers that need only the length: a list and a tensor of the same ids count alike."""
    if type(token_ids) in (list, tuple):
        return len(token_ids)  # type: ignore[arg-type]
    if getattr(token_ids, "dtype", None) is not None and hasattr(token_ids, "tolist"):
        shape = tuple(getattr(token_ids, "shape", ()))
        if len(shape) != 1:
            raise InvalidArgumentError(f"{name}: expected a 1-D sequence of token ids, got {len(shape)} dimensions")
        return int(shape[0])
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, (Sequence, array)):
        raise ArgumentTypeError(
            f"{name}: expected a sequence of integer token ids (list, tuple, 1-D tensor), "
            f"got {type(token_ids).__name__}"
        )
    return len(token_ids)


#: The last prompt list ``prompt_length`` checked, and a copy of what it held then. A scheduler
#: asks ``can_allocate`` and then ``allocate`` with the same list: while the list holds what
#: it held, its ids need no second check (a list comparison instead of a type and range scan,
#: 5 us instead of 50 for 2k tokens). The copy is what is used then, so an element replaced in
#: place by an equal value of another type (1.0 for 1) cannot get in. Nothing mutates the copy.
_last_prompt: tuple[list[int], list[int]] | None = None


def prompt_length(num_tokens: object, token_ids: object, *, keep: bool) -> tuple[int, list[int] | None]:
    """A prompt given as a count and/or its token ids: ``(length, ids)``, the ids as a list
    when ``keep`` (prefix caching reads them), else None. Raises InvalidArgumentError /
    ArgumentTypeError naming the argument."""
    global _last_prompt
    tokens = None
    if token_ids is not None:
        if keep:
            last = _last_prompt
            if last is not None and token_ids is last[0] and token_ids == last[1]:
                tokens = last[1]  # our checked copy, equal to the list (can_allocate, then allocate)
            else:
                tokens = token_list(token_ids)
                if tokens is token_ids:
                    _last_prompt = (tokens, tokens[:])
            length = len(tokens)
        else:
            length = token_count(token_ids)
        if num_tokens is not None and require_int("num_tokens", num_tokens) != length:
            raise InvalidArgumentError(
                f"num_tokens: {num_tokens} disagrees with len(token_ids) = {length}; pass one of them"
            )
        num_tokens = length
    if num_tokens is None:
        raise InvalidArgumentError("num_tokens: pass num_tokens or token_ids")
    return require_int("num_tokens", num_tokens, minimum=1), tokens


def appended_ids(token_ids: object, n: int, seq: SequenceBlocks, seq_id: object, defer_ids: object) -> list[int] | None:
    """The checked ids of ``n`` tokens appended to sequence ``seq_id`` (record ``seq``): a list
    when its ids are kept (prefix-cached) and given now, else None (after checking their count
    when given). ``defer_ids``: the ids come later (``fill_token_ids``). Raises
    InvalidArgumentError / ArgumentTypeError naming the argument."""
    if not isinstance(defer_ids, bool):
        raise ArgumentTypeError(f"defer_ids: expected a bool, got {type(defer_ids).__name__}")
    if defer_ids and token_ids is not None:
        raise InvalidArgumentError("token_ids: given with defer_ids=True; pass the ids now or later, not both")
    keep = seq.token_ids is not None and not defer_ids
    new_ids = None
    if token_ids is not None:  # the ids themselves first: a bad id is named whatever the state
        checked = token_list(token_ids)
        if len(checked) != n:
            raise InvalidArgumentError(f"token_ids: {len(checked)} ids for n={n} new tokens")
        new_ids = checked if keep else None
    if seq.num_pending and not defer_ids:
        raise InvalidArgumentError(
            f"token_ids: sequence {seq_id!r:.60} still waits for {seq.num_pending} deferred id(s); "
            f"call fill_token_ids first (ids come in order)"
        )
    if keep and new_ids is None:
        raise InvalidArgumentError(
            f"token_ids: sequence {seq_id!r:.60} is prefix-cached, so append_slots needs the {n} new token ids"
        )
    return new_ids
