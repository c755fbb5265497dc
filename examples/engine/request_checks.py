"""Checks of a :class:`~examples.engine.scheduler.Request` before a scheduler takes it.

A request is checked whole when it is handed over (``Scheduler(requests)``,
:meth:`Scheduler.submit`, ``run_requests``), so a bad one is refused there, with nothing
changed, instead of failing inside a step after the other running requests' rows were
recorded (which would leave every later step unable to run). Each error names the request,
the field, the value and the fix; none of these checks changes anything.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from attention.errors import ArgumentTypeError, InvalidArgumentError, quote

if TYPE_CHECKING:
    from .scheduler import Request

__all__ = ["check_fits_runner", "check_request", "check_token_ids"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(who: str, name: str, tokens: object, vocab_size: int | None) -> None:
    """Raise unless ``tokens`` is a list of ints in ``[0, vocab_size)`` (``[0, ...)`` when
    ``vocab_size`` is None). ``who`` ("request 3") and ``name`` ("prompt") start the message.

    ArgumentTypeError for a non-list (a tuple, a tensor, a string) or a non-int element;
    InvalidArgumentError for an id outside the vocabulary."""
    if not isinstance(tokens, list):
        raise ArgumentTypeError(
            f"{who}: {name}: expected a list of int token ids, got {type(tokens).__name__} {quote(tokens)}; "
            f"pass list({name}) (a tensor: {name}.tolist())"
        )
    # The common case in one pass each: every element a plain int, all within the vocabulary.
    if all(type(t) is int for t in tokens) and (
        not tokens or (min(tokens) >= 0 and (vocab_size is None or max(tokens) < vocab_size))
    ):
        return
    vocab = "(token ids are >= 0)" if vocab_size is None else f"[0, {vocab_size}) (vocab_size {vocab_size})"
    for i, token in enumerate(tokens):
        if not _is_int(token):
            raise ArgumentTypeError(
                f"{who}: {name}[{i}]: expected an int token id, got {type(token).__name__} {quote(token)}"
            )
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidArgumentError(
                f"{who}: {name}[{i}]: token id {token} is outside the model's vocabulary {vocab}; "
                f"give ids the model's tokenizer produced"
            )


def check_request(req: Request, *, vocab_size: int | None = None, max_positions: int | None = None) -> None:
    """Raise unless ``req`` can be scheduled; changes nothing.

    - ``req_id``: an int (it names the request's sequence in the block manager);
    - ``prompt``: a non-empty list of ints in ``[0, vocab_size)``;
    - ``max_new_tokens``: an int >= 1;
    - ``arrival_step``: an int;
    - ``stop_token_ids``: a collection of ints (a set, say; not a lone int or a string);
    - ``forced``: None, or a list of at least ``max_new_tokens`` ids in ``[0, vocab_size)``;
    - ``len(prompt) + max_new_tokens <= max_positions`` when the model has a position limit.

    ``vocab_size`` None: ids are only checked to be >= 0. Raises ArgumentTypeError for a
    wrong type, InvalidArgumentError for a wrong value; each names the request and the field.
    Whether the request is new to the scheduler and fits its pool is the scheduler's check.
    """
    if not _is_int(req.req_id):
        raise ArgumentTypeError(
            f"request {quote(req.req_id)}: req_id: expected an int, got {type(req.req_id).__name__}; "
            f"number requests with ints"
        )
    who = f"request {req.req_id}"
    check_token_ids(who, "prompt", req.prompt, vocab_size)
    if not req.prompt:
        raise InvalidArgumentError(
            f"{who}: prompt: is empty; a request needs at least one prompt token (a BOS token, say)"
        )
    if not _is_int(req.max_new_tokens):
        raise ArgumentTypeError(
            f"{who}: max_new_tokens: expected an int >= 1, got {type(req.max_new_tokens).__name__} "
            f"{quote(req.max_new_tokens)}"
        )
    if req.max_new_tokens < 1:
        raise InvalidArgumentError(
            f"{who}: max_new_tokens: {req.max_new_tokens} is below the minimum 1; ask for at least one token"
        )
    if not _is_int(req.arrival_step):
        raise ArgumentTypeError(
            f"{who}: arrival_step: expected an int (a step number), got {type(req.arrival_step).__name__} "
            f"{quote(req.arrival_step)}"
        )
    stops = req.stop_token_ids
    if isinstance(stops, (str, bytes)) or not isinstance(stops, Collection):
        raise ArgumentTypeError(
            f"{who}: stop_token_ids: expected a collection of int token ids, got {type(stops).__name__} "
            f"{quote(stops)}; pass a set, e.g. frozenset({{{quote(stops)}}})"
        )
    for token in stops:
        if not _is_int(token):
            raise ArgumentTypeError(
                f"{who}: stop_token_ids: expected int token ids, got {type(token).__name__} {quote(token)}"
            )
    if req.forced is not None:
        check_token_ids(who, "forced", req.forced, vocab_size)
        if len(req.forced) < req.max_new_tokens:
            raise InvalidArgumentError(
                f"{who}: forced: {len(req.forced)} forced tokens for {req.max_new_tokens} new tokens; "
                f"give one per new token"
            )
    if max_positions is not None and len(req.prompt) + req.max_new_tokens > max_positions:
        raise InvalidArgumentError(
            f"{who}: {len(req.prompt)} prompt + {req.max_new_tokens} new tokens exceed the model's "
            f"{max_positions} positions (max_position_embeddings); shorten the prompt or lower max_new_tokens"
        )


def check_fits_runner(req: Request, max_request_tokens: int | None) -> None:
    """Raise InvalidArgumentError when ``req`` would outgrow a runner whose sequences hold at
    most ``max_request_tokens`` tokens (None: no limit); changes nothing. A runner's block
    tables have ``StepCapacity.max_blocks_per_seq`` columns, fixed when its step buffers (and
    CUDA graphs) are built, so a longer request would fail inside a step."""
    if max_request_tokens is not None and req.peak_tokens > max_request_tokens:
        raise InvalidArgumentError(
            f"request {req.req_id}: {len(req.prompt)} prompt + {req.max_new_tokens} new tokens reach "
            f"{req.peak_tokens} tokens but the runner's sequences hold at most {max_request_tokens} "
            f"(StepCapacity.max_blocks_per_seq x block_size); shorten the request or build the runner "
            f"with a larger max_blocks_per_seq"
        )
