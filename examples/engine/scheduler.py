"""A small continuous-batching scheduler over :class:`kvcache.BlockManager`.

Each step the scheduler picks which tokens run, and the block manager is asked before any
block is taken (check, then act):

1. requests whose arrival step has come join the waiting queue;
2. running requests go first, oldest admission first: a decode row (one token, after
   ``append_slots``) or the next chunk of an unfinished prompt. When a decode row needs a
   block and none is free, the most recently admitted running request is preempted
   (possibly the one asking) until it fits;
3. waiting requests are admitted from the front while ``can_allocate`` allows, each with the
   whole prompt's slots (``allocate`` reports the leading tokens the prefix cache already
   holds; their prefill is skipped).

A step never schedules more than ``token_budget`` tokens, so a long prompt is prefilled in
chunks across several steps while other requests keep decoding.

After the forward pass :meth:`Scheduler.finish_step` records what was computed (``commit``),
appends the sampled token of every row that reached the end of what is known, and frees
finished requests.

Overlap: the scheduler may plan step N+1 before step N's tokens are known (the loop applies
step N's results after launching N+1). A request whose row in step N samples then has one
token *in flight*: step N+1 gives it a decode row whose input is fed on the device from step
N's samples (``StepBatch.feed``), reserves its slot with ``append_slots(..., defer_ids=True)``,
and ``finish_step`` gives the manager the id once known (``fill_token_ids``). A request whose
last token is in flight is not scheduled again. Before preempting anyone the scheduler drains
(``drain``: the loop applies the step in flight), so a preempted request never has a token in
flight.

Preemption is a strategy (:class:`Preemption`): ``recompute`` frees the victim's blocks and
later prefills prompt + generated tokens again; ``swap`` copies the victim's blocks to host
memory (:class:`kvcache.SwapSpace`) and brings them back on resume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from attention.errors import ArgumentTypeError, InvalidArgumentError, SequenceExistsError, quote
from kvcache import AnyBlockManager, BlockManager, HybridBlockManager, KVCacheTensors, ScheduledRow, SwapSpace, preempt

from .drafting import NgramIndex, accepted_tokens
from .request_checks import check_fits_runner, check_request

__all__ = [
    "PREEMPTION_MODES",
    "Preemption",
    "RecomputePreemption",
    "Request",
    "Scheduler",
    "StepBatch",
    "SwapPreemption",
    "make_preemption",
]


@dataclass(eq=False)
class Request:
    """One generation request and its progress. ``eq=False``: compared by identity."""

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    #: The step at which the request arrives (it cannot be admitted before).
    arrival_step: int = 0
    #: Tokens generated so far (known on the host).
    output: list[int] = field(default_factory=list)
    #: Leading tokens whose K/V is in the cache or queued to be written by a launched step.
    num_computed: int = 0
    #: Tokens sampled on the device whose ids the host does not know yet (one per step in flight).
    in_flight: int = 0
    #: The sampling row (in its step) of the last token sampled for it: what the next step
    #: feeds to its decode row while that token is in flight.
    sample_row: int = -1
    #: Whether the manager holds a slot for the in-flight token with its id deferred.
    deferred_slot: bool = False
    #: Whether it was preempted and waits to resume (vs. never admitted).
    preempted: bool = False
    num_preemptions: int = 0
    #: Prompt tokens the prefix cache supplied, summed over admissions.
    cached_tokens: int = 0
    finish_step: int | None = None
    #: Teacher forcing: the tokens to append instead of the sampled ones (the logits are still
    #: the model's own at each position), e.g. another run's output, to compare distributions
    #: position by position. Needs the sequential loop (``overlap=False``): an overlapped step
    #: feeds the sampled token on the device.
    forced: list[int] | None = None
    #: Prompt lookup (a scheduler with ``draft_tokens``): the n-grams of its text, and the
    #: drafts its row in the step being run carries after its last sampled token.
    ngrams: NgramIndex | None = None
    drafts: list[int] = field(default_factory=list)
    #: Draft tokens proposed and accepted so far.
    drafted: int = 0
    accepted: int = 0
    #: Token ids that end the request once generated (an end-of-sequence token, say): the
    #: output ends with the first of them, as ``generate(eos_token_id=...)`` does.
    stop_token_ids: frozenset[int] = frozenset()
    #: Whether it generated a stop token (nothing more is appended; a row an overlapped loop
    #: scheduled before the stop token was known is computed and its token discarded).
    stopped: bool = False

    @property
    def tokens(self) -> list[int]:
        """Prompt then generated tokens: every id known on the host."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, the in-flight one included."""
        return len(self.prompt) + len(self.output) + self.in_flight

    @property
    def is_finished(self) -> bool:
        return self.stopped or len(self.output) >= self.max_new_tokens

    @property
    def fully_sampled(self) -> bool:
        """Its last token is sampled (perhaps still in flight), or it stopped: nothing more
        to schedule."""
        return self.stopped or len(self.output) + self.in_flight >= self.max_new_tokens

    def kept_output(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Of generated ``tokens``, those the request keeps: within ``max_new_tokens``, up to
        and including the first stop token; and whether one was. Changes nothing."""
        kept = tokens[: self.max_new_tokens - len(self.output)]
        for j, token in enumerate(kept):
            if token in self.stop_token_ids:
                return kept[: j + 1], True
        return kept, False

    def append_output(self, tokens: list[int]) -> list[int]:
        """Append :meth:`kept_output` of ``tokens`` (setting :attr:`stopped` at a stop
        token); returns the tokens appended."""
        kept, stops = self.kept_output(tokens)
        self.output.extend(kept)
        if self.ngrams is not None:
            self.ngrams.extend(kept)
        self.stopped = self.stopped or stops
        return kept

    def tokens_at(self, start: int, end: int) -> list[int]:
        """The known ids of positions ``[start, end)`` (without copying the whole sequence)."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]

    @property
    def peak_tokens(self) -> int:
        """Most tokens it ever holds slots for: the last sampled token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1


# ---- preemption strategies ---------------------------------------------------------------


class Preemption(ABC):
    """How a running request gives its blocks back when the pool runs out, and how it
    gets them back. The scheduler picks the victim and keeps the queues; the strategy only
    moves blocks (and K/V).

    A swap strategy maps onto :class:`kvcache.SwapSpace`: ``create`` builds the space from
    ``cache.swap_space`` bytes, ``evict`` is ``manager.preempt(id, "swap", space)`` (or
    recompute when the host pool is full), ``can_resume``/``resume`` are
    ``can_swap_in``/``swap_in`` keeping ``req.num_computed``, and ``begin_step`` polls.
    """

    name: ClassVar[str]

    @classmethod
    def create(cls, manager: AnyBlockManager, cache: KVCacheTensors, swap_space_bytes: int) -> Preemption:
        """Build the strategy for a run; strategies that move K/V keep ``cache``."""
        return cls()

    def begin_step(self) -> None:
        """Called at the start of every :meth:`Scheduler.schedule` (a swap strategy returns
        the device blocks whose copy to the host has finished). Recompute has nothing to do."""
        return None

    @abstractmethod
    def evict(self, req: Request, manager: AnyBlockManager) -> None:
        """Take ``req``'s blocks back. The scheduler then requeues it at the front of the
        waiting queue with ``req.preempted`` set."""

    @abstractmethod
    def can_resume(self, req: Request, manager: AnyBlockManager) -> bool:
        """Whether :meth:`resume` would succeed now. Changes nothing."""

    @abstractmethod
    def resume(self, req: Request, manager: AnyBlockManager) -> None:
        """Give ``req`` blocks again and set ``req.num_computed`` to the tokens whose K/V is
        already in them."""

    def discard(self, req: Request, manager: AnyBlockManager) -> None:
        """Give back whatever ``req`` holds, on the device or (swapped out) on the host: its
        run was abandoned (:meth:`Scheduler.abort`). Nothing to do for a request holding none."""
        if req.req_id in manager:
            manager.free(req.req_id, reason="aborted")


def admit(req: Request, manager: AnyBlockManager, tokens: list[int] | None = None) -> None:
    """Allocate slots for everything ``req`` knows (prompt + generated), or for its first
    ``tokens`` (a prefix of ``req.tokens``: the rest is reserved chunk by chunk as it is
    scheduled); start after what the prefix cache already holds."""
    cached = manager.allocate(req.req_id, token_ids=req.tokens if tokens is None else tokens)
    req.num_computed = cached
    req.cached_tokens += cached


class RecomputePreemption(Preemption):
    """Drop the victim's K/V; on resume prefill prompt + generated tokens again.

    Costs compute, needs no host memory. With prefix caching the freed full blocks stay
    indexed, so a resume often finds most of them still cached.
    """

    name = "recompute"

    def evict(self, req: Request, manager: AnyBlockManager) -> None:
        manager.free(req.req_id, reason="preempted")  # frees the blocks; counted by the manager
        req.num_computed = 0

    def can_resume(self, req: Request, manager: AnyBlockManager) -> bool:
        return manager.can_allocate(token_ids=req.tokens)

    def resume(self, req: Request, manager: AnyBlockManager) -> None:
        admit(req, manager)


class SwapPreemption(Preemption):
    """Copy the victim's K/V to a host block pool; on resume copy it back, so nothing is
    recomputed. When the host pool is full the victim is recomputed instead."""

    name = "swap"

    def __init__(self, space: SwapSpace):
        self.space = space
        self._on_host: set[int] = set()

    @classmethod
    def create(cls, manager: AnyBlockManager, cache: KVCacheTensors, swap_space_bytes: int) -> Preemption:
        if not isinstance(manager, BlockManager):
            raise ValueError(
                "--preempt swap: a model with KV groups (full and windowed layers) has no swap space yet; "
                "use --preempt recompute, or --no-kv-groups (engine_for(..., kv_groups=False))"
            )
        if swap_space_bytes <= 0:
            raise ValueError(
                "--preempt swap: cache.swap_space is 0; set it in the config (e.g. swap_space: 256KiB) "
                "or use --preempt recompute"
            )
        return cls(SwapSpace.for_bytes(manager, cache, swap_space_bytes))

    def begin_step(self) -> None:
        self.space.poll()

    def evict(self, req: Request, manager: AnyBlockManager) -> None:
        if not self.space.can_swap_out(req.req_id):
            preempt(self.space.manager, req.req_id, "recompute")
            req.num_computed = 0
            return
        preempt(self.space.manager, req.req_id, "swap", self.space)
        # The scheduler asks can_append right after an eviction, and on CUDA the device blocks
        # return to the pool only once the copy has read them: wait for it on this rare path.
        self.space.synchronize()
        self._on_host.add(req.req_id)

    def can_resume(self, req: Request, manager: AnyBlockManager) -> bool:
        if req.req_id in self._on_host:
            # The swapped blocks, plus room for tokens sampled but not yet given slots.
            return manager.allocator.can_allocate(manager.blocks_for(req.num_tokens))
        return manager.can_allocate(token_ids=req.tokens)

    def resume(self, req: Request, manager: AnyBlockManager) -> None:
        if req.req_id not in self._on_host:
            admit(req, manager)
            return
        self.space.swap_in(req.req_id)  # req.num_computed is unchanged: its K/V is back
        self._on_host.discard(req.req_id)
        reserved = manager.num_tokens(req.req_id)
        if req.num_tokens > reserved:  # the token sampled just before the swap out
            manager.append_slots(req.req_id, req.num_tokens - reserved, token_ids=req.tokens[reserved:])

    def discard(self, req: Request, manager: AnyBlockManager) -> None:
        if req.req_id in self._on_host:
            self.space.synchronize()  # the copy out may still read the device blocks
            self.space.drop(req.req_id)
            self._on_host.discard(req.req_id)
            return
        super().discard(req, manager)


#: ``--preempt`` modes this example implements.
PREEMPTION_MODES: dict[str, type[Preemption]] = {"recompute": RecomputePreemption, "swap": SwapPreemption}


def make_preemption(
    mode: str, manager: AnyBlockManager, cache: KVCacheTensors, swap_space_bytes: int = 0
) -> Preemption:
    """The strategy for ``--preempt mode``. Raises ValueError naming the modes available."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"--preempt: {mode!r} is not a mode; use {', '.join(PREEMPTION_MODES)}")
    return PREEMPTION_MODES[mode].create(manager, cache, swap_space_bytes)


# ---- the scheduler -----------------------------------------------------------------------


@dataclass
class StepBatch:
    """One step's work. ``rows[i]`` belongs to ``requests[i]``; ``token_ids`` are all rows'
    new tokens, concatenated in row order (the model's input; 0 stands for a fed token).

    feed:     per row, -1 or the previous step's sampling row whose token is this row's
              input (``MetadataBuilder.plan(feed=...)``).
    drafts:   per row, the draft tokens it carries after its last sampled token (empty for
              most rows): the step needs the model's greedy token at each of its positions.
    sampling: per row, whether it reaches the end of its sequence, so its logits give the
              next token (a prompt chunk short of the end does not); sampling rows come in
              row order, as the metadata's ``sampling_rows_host``.
    num_sampling: how many of ``sampling`` are True (the next sampling row's index).
    """

    step: int
    rows: list[ScheduledRow]
    requests: list[Request]
    token_ids: list[int]
    feed: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    num_sampling: int = 0

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption of the newest request."""

    def __init__(
        self,
        manager: AnyBlockManager,
        requests: Iterable[Request],
        preemption: Preemption,
        *,
        token_budget: int = 64,
        max_running: int = 16,
        draft_tokens: int = 0,
        copy_blocks: Callable[[list[tuple[int, int]]], None] | None = None,
        vocab_size: int | None = None,
        max_positions: int | None = None,
        max_request_tokens: int | None = None,
    ):
        """``token_budget``: most tokens in one step; ``max_running``: most rows in one step.
        ``draft_tokens``: prompt-lookup drafts per decode row (:mod:`.drafting`; 0: none),
        proposed while :attr:`drafting` is set, for requests whose last token is known (none
        in flight: the loop applies the step before a drafting step first); ``copy_blocks``
        performs the block copies a rollback may return. ``vocab_size``: the model's, so a
        request's token ids are checked against it (None: only that they are >= 0; a
        :class:`~examples.engine.loop.StepPipeline` sets it from its model when unset);
        ``max_positions``: the model's position limit, if it has one (prompt + new tokens).
        ``max_request_tokens``: the most tokens a request's sequence may reach in the runner
        that serves it (its block tables' columns times the block size; a
        :class:`~examples.engine.loop.StepPipeline` sets it from its runner when unset).

        Every request is checked first (:meth:`submit`'s checks: its fields, an id of its own,
        a pool it fits); a bad one raises a typed error naming it, and nothing is changed.
        """
        if token_budget < 1 or max_running < 1:
            raise ValueError(f"token_budget ({token_budget}) and max_running ({max_running}) must be at least 1")
        if not 0 <= draft_tokens <= 8:
            raise ValueError(f"draft_tokens: {draft_tokens} must be in [0, 8]")
        self.manager = manager
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.max_request_tokens = max_request_tokens
        requests = list(requests)
        ids: set[int] = set()
        for req in requests:  # before anything changes, the manager's window lag included
            self._check_new(req, ids)
            ids.add(req.req_id)
        self.draft_tokens = draft_tokens
        #: Whether this step proposes drafts (the loop turns it off for large batches).
        self.drafting = True
        self.copy_blocks = copy_blocks
        #: Reserve a prompt chunk by chunk (KV groups: see :meth:`_first_reservation`).
        self._per_chunk = isinstance(manager, HybridBlockManager)
        if draft_tokens > manager.window_lag:
            # A sliding window must keep what the query after a rollback of every draft sees.
            manager.window_lag = draft_tokens
        self.preemption = preemption
        self.token_budget = token_budget
        self.max_running = max_running
        self.pending = deque(sorted(requests, key=lambda r: r.arrival_step))  # not yet arrived
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self.peak_blocks = 0
        #: Applies the step in flight, if any (set by an overlapped loop): called before a
        #: preemption, so no request is preempted with a token in flight.
        self.drain: Callable[[], None] | None = None

    def submit(self, req: Request) -> None:
        """A request arriving now (an online server's entry point; requests given at
        construction arrive at their ``arrival_step``).

        The whole request is checked here, so a bad one never reaches a step (where it would
        fail after the running requests' rows were recorded): its fields
        (:func:`~examples.engine.request_checks.check_request`, token ids against
        ``vocab_size``), an id no pending, waiting or running request has and the block
        manager does not hold, a peak length the runner's block tables
        (``max_request_tokens``) and the whole pool can hold. Raises
        ArgumentTypeError or InvalidArgumentError (a ValueError) naming the request and the
        field; nothing is changed then."""
        live = {r.req_id for queue in (self.pending, self.waiting, self.running) for r in queue}
        self._check_new(req, live)
        self.waiting.append(req)

    def _check_new(self, req: Request, taken: set[int]) -> None:
        """Raise unless ``req`` can join: a valid request (``check_request``) whose id is not
        in ``taken`` nor held by the manager, and that fits in the whole pool and in the
        runner's sequences (``max_request_tokens``)."""
        if not isinstance(req, Request):
            raise ArgumentTypeError(f"request: expected a Request, got {type(req).__name__} {quote(req)}")
        check_request(req, vocab_size=self.vocab_size, max_positions=self.max_positions)
        if req.req_id in taken:
            raise InvalidArgumentError(
                f"request {req.req_id}: req_id: {req.req_id} is already taken by another request of this scheduler; "
                f"give each request an id of its own (an id is free again once its request finished)"
            )
        table = self.manager if isinstance(self.manager, BlockManager) else self.manager.groups[0]
        try:
            table.check_new_id(req.req_id)  # held, or swapped out, by someone else
        except SequenceExistsError as err:
            raise InvalidArgumentError(f"request {req.req_id}: req_id: in the block manager, {err}") from None
        need = self.manager.blocks_for(req.peak_tokens)
        if need > self.manager.num_blocks:
            raise InvalidArgumentError(
                f"request {req.req_id}: {len(req.prompt)} prompt + {req.max_new_tokens} new "
                f"tokens need {need} blocks but the pool has {self.manager.num_blocks}; "
                f"give the cache more blocks or shorten the request"
            )
        check_fits_runner(req, self.max_request_tokens)

    def abort(self) -> list[Request]:
        """Give back every block the unfinished requests hold (on the device, or swapped out
        to the host) and empty the queues: what a caller does when a run fails midway, so the
        manager can serve later requests (with the same ids, too). Returns the requests
        dropped (pending, waiting and running), their outputs as far as they got. The caller
        makes sure no launched step still writes their blocks."""
        dropped = [*self.running, *self.waiting, *self.pending]
        for req in dropped:
            self.preemption.discard(req, self.manager)
        self.running, self.waiting, self.pending = [], deque(), deque()
        return dropped

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def next_arrival(self) -> int | None:
        """The arrival step of the next request not yet arrived (None: all arrived)."""
        return self.pending[0].arrival_step if self.pending else None

    def schedule(self, step: int) -> StepBatch | None:
        """Pick this step's rows, reserving their slots. None when nothing can run (the
        caller skips ahead to :meth:`next_arrival`)."""
        self.preemption.begin_step()
        while self.pending and self.pending[0].arrival_step <= step:
            self.waiting.append(self.pending.popleft())
        batch = StepBatch(step, [], [], [])
        budget = self.token_budget
        preemptions_before = self.num_preemptions
        for req in list(self.running):
            if budget == 0:
                break
            # A victim of a preemption above left ``running`` (a list scan per row would make
            # the step quadratic in its rows); running requests are never marked preempted.
            if req.preempted or req.fully_sampled:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            reserved = self.manager.num_tokens(req.req_id)
            extra = req.num_computed + n - reserved  # decode: the sampled token needs a slot
            if self._per_chunk and req.num_computed + n < req.num_tokens:
                extra += 1  # a chunk short of the prompt's end must not end the reservation
            drafts = self._drafts(req, n, budget, extra)
            if drafts:
                known = req.tokens_at(reserved, req.num_tokens)
                self.manager.append_slots(req.req_id, len(known) + len(drafts), token_ids=known + drafts)
                budget -= self._add(batch, req, n + len(drafts), drafts)
                continue
            if extra > 0:
                if not self._make_room(req, extra):
                    continue
                known = req.tokens_at(reserved, reserved + extra)  # a drain may have made it known
                if len(known) == extra:
                    self.manager.append_slots(req.req_id, extra, token_ids=known)
                else:  # the sampled token is in flight: its id comes later
                    self.manager.append_slots(req.req_id, extra, defer_ids=True)
                    req.deferred_slot = True
            budget -= self._add(batch, req, n)
        # Admitting after a preemption would only hand the freed blocks to a newer request.
        preempted = self.num_preemptions > preemptions_before
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.preempted:
                if not self.preemption.can_resume(req, self.manager):
                    break
                self.preemption.resume(req, self.manager)
                req.preempted = False
            else:
                tokens = self._first_reservation(req, budget)
                if not self.manager.can_allocate(token_ids=tokens):
                    break
                admit(req, self.manager, tokens)
            self.running.append(self.waiting.popleft())
            budget -= self._add(batch, req, min(req.num_tokens - req.num_computed, budget))
        if not batch.rows and self.waiting and not self.running:
            raise RuntimeError(
                f"request {self.waiting[0].req_id} cannot be admitted into an empty pool of "
                f"{self.manager.num_blocks} blocks ({self.manager.num_free_blocks} free)"
            )
        self.peak_blocks = max(self.peak_blocks, self.manager.allocator.num_used)
        return batch if batch.rows else None

    def finish_step(
        self,
        batch: StepBatch,
        next_tokens: Mapping[int, int],
        verified: Mapping[int, list[int]] | None = None,
    ) -> list[Request]:
        """Record that ``batch`` ran: ``manager.commit`` marks exactly the tokens each row
        computed. ``next_tokens[i]`` is row i's sampled token (only rows that sample have one);
        ``verified[i]``, for a row carrying drafts, the model's greedy token after each of its
        positions. Returns the requests that finished.

        A request that generated a stop token while a later row of it was in flight (an
        overlapped loop scheduled it before the token was known) finishes when that row's
        step is applied: the row's token is discarded, and its blocks are freed only then,
        after the device is done with them."""
        self.manager.commit(batch.rows)
        done: list[Request] = []
        for i, req in enumerate(batch.requests):
            if batch.sampling[i]:
                drafts = batch.drafts[i] if batch.drafts else []
                if drafts:
                    if verified is None or i not in verified:
                        raise ValueError(f"verified: row {i} carries drafts but has no greedy tokens")
                    self._take_back(req, batch.rows[i], drafts, verified[i])
                    if req.is_finished:
                        self._finish(req, batch, done)
                    continue
                req.in_flight -= 1
                if req.stopped:  # scheduled before its stop token was known: discarded
                    if req.in_flight == 0:
                        self._finish(req, batch, done)
                    continue
                token = int(next_tokens[i]) if req.forced is None else req.forced[len(req.output)]
                req.append_output([token])
                if req.deferred_slot:
                    self.manager.fill_token_ids(req.req_id, [token])
                    req.deferred_slot = False
                if req.is_finished and req.in_flight == 0:
                    self._finish(req, batch, done)
        if done:  # one pass over the running list, not one per finished request
            gone = set(done)
            self.running = [r for r in self.running if r not in gone]
        return done

    def _finish(self, req: Request, batch: StepBatch, done: list[Request]) -> None:
        """Free ``req``'s blocks and record it in ``done`` (:meth:`finish_step` then drops
        ``done`` from the running list)."""
        self.manager.free(req.req_id)
        req.finish_step = batch.step
        self.finished.append(req)
        done.append(req)

    def _drafts(self, req: Request, n: int, budget: int, extra: int) -> list[int]:
        """Prompt-lookup drafts for ``req``'s decode row of ``n`` tokens, if any fit: the
        budget, its remaining tokens and the free blocks (a draft never preempts anyone)."""
        if not (self.draft_tokens and self.drafting) or n != 1 or req.in_flight or req.deferred_slot:
            return []
        if req.forced is not None:
            return []
        room = min(self.draft_tokens, budget - 1, req.max_new_tokens - len(req.output) - 1)
        if room <= 0:
            return []
        if req.ngrams is None:
            req.ngrams = NgramIndex()
            req.ngrams.extend(req.tokens)
        drafts = req.ngrams.propose(room)
        if drafts and not self.manager.can_append(req.req_id, max(extra, 0) + len(drafts)):
            return []
        return drafts

    def _take_back(self, req: Request, row: ScheduledRow, drafts: list[int], greedy: list[int]) -> None:
        """Apply a verified row: append the drafts the model agrees with and its own next
        token; take the other drafts' slots back (the K/V past the last agreed draft)."""
        new = accepted_tokens(drafts, greedy)
        req.drafted += len(drafts)
        req.accepted += len(new) - 1
        new, _ = req.kept_output(new)  # within max_new_tokens, up to a stop token
        start = row.start if row.start is not None else req.num_computed - row.num_new
        keep = start + len(new)  # the last sampled token and the agreed drafts have K/V
        copies = self.manager.truncate(req.req_id, keep)
        if copies:  # only when the new last block is shared (a prefix hit or a fork)
            if self.copy_blocks is None:
                raise RuntimeError("a rollback returned block copies; give the scheduler copy_blocks")
            self.copy_blocks(copies)
        req.append_output(new)
        req.in_flight -= 1
        req.num_computed = keep
        req.drafts = []

    # ---- internals ---------------------------------------------------------------------

    def _first_reservation(self, req: Request, budget: int) -> list[int]:
        """The tokens a new request reserves at admission: all it knows, or with KV groups
        only the cached run and this step's chunk (each later chunk reserves its own slots
        when scheduled, so a windowed group never holds more than its window and a chunk;
        reserving a long prompt at once would take its every block in every group)."""
        tokens, manager = req.tokens, self.manager
        if not isinstance(manager, HybridBlockManager):
            return tokens
        cached = manager.cached_tokens(token_ids=tokens)
        end = cached + min(len(tokens) - cached, budget)
        # A row samples when it reaches the end of the reservation: a first chunk short of the
        # prompt's end reserves one token more, so it does not.
        return tokens[: end + 1 if end < len(tokens) else end]

    def _add(self, batch: StepBatch, req: Request, n: int, drafts: list[int] | None = None) -> int:
        start = req.num_computed
        batch.rows.append(ScheduledRow(req.req_id, n, start=start))
        batch.requests.append(req)
        batch.drafts.append(drafts or [])
        req.drafts = drafts or []
        if drafts:  # the last sampled token (known: no overlap with drafting), then the drafts
            batch.token_ids.extend(req.tokens_at(start, start + n - len(drafts)) + drafts)
            batch.feed.append(-1)
            req.sample_row = batch.num_sampling
            batch.num_sampling += 1
            req.in_flight += 1
            batch.sampling.append(True)
            req.num_computed = start + n
            return n
        known = req.tokens_at(start, start + n)
        fed = len(known) < n  # the last token is in flight: read it from the device
        batch.token_ids.extend(known + [0] * (n - len(known)))
        batch.feed.append(req.sample_row if fed else -1)
        samples = start + n == req.num_tokens
        if samples:
            req.sample_row = batch.num_sampling
            batch.num_sampling += 1
            req.in_flight += 1
        batch.sampling.append(samples)
        req.num_computed = start + n
        return n

    def _make_room(self, req: Request, extra: int) -> bool:
        """Preempt the newest running requests until ``req`` can take ``extra`` more slots
        (after applying the step in flight, which may free blocks and leaves no token in
        flight). False when ``req`` itself had to go, or when applying that step ended it (a
        stop token): nothing is left to schedule for it then (finished, its blocks freed)."""
        if self.manager.can_append(req.req_id, extra):  # the common case: one check
            return True
        if self.drain is not None:
            self.drain()
            if req.fully_sampled:
                return False
        while not self.manager.can_append(req.req_id, extra):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.preemption.evict(req, self.manager)
        self.running.remove(req)
        req.preempted = True
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Front of the queue: it was admitted before everything still waiting.
        self.waiting.appendleft(req)
