"""KV events: what a cache tier stores and removes, for routers and other engines.

A router that sends each request to the engine holding the longest prefix of it needs to
know what every engine holds (vLLM and SGLang publish such events; Dynamo and llm-d route on
them). The block manager's prefix cache publishes, per tier:

* :class:`BlockStored`: a full block's K/V became available under its key: the key's stable
  digest, its parent's digest (None for a first block), its token ids and its salt;
* :class:`BlockRemoved`: that K/V is gone (evicted, or rewritten after a truncation);
* :class:`AllCleared`: every block of the tier is gone (``reset_prefix_cache``).

A block computed twice (two requests admitted together) is stored once; when one copy is
evicted and the other takes over, nothing is published: the tier still holds the content.

Every event has a sequence number, one more than the last event published. Nothing is
published, and no digest computed, while no one subscribes; so a consumer sees no gap unless
its buffer overflowed. A consumer subscribes with a callback (called synchronously, inside the
manager call that caused the event) or without one (events wait in a bounded buffer for
:meth:`Subscription.poll`). With ``replay`` (the default), a new subscriber first gets the
tier's current contents as :class:`BlockStored` events marked ``replayed``, numbered with the
last number published before it subscribed: the state as of that number; live events follow
from the next one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attention.checks import require_int
from attention.errors import ArgumentTypeError

if TYPE_CHECKING:
    from kvcache.blocks.prefix_cache import BlockKey

__all__ = ["AllCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventStream", "Subscription"]

#: The tier of the block manager's own pool (GPU memory on a GPU, else wherever the cache is).
DEVICE_TIER = "device"


@dataclass(frozen=True)
class BlockStored:
    """A full block's K/V is held in ``tier`` under ``digest`` (16 bytes; :mod:`kvcache.blocks.digest`)."""

    seq: int
    tier: str
    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_key: Hashable
    replayed: bool = False


@dataclass(frozen=True)
class BlockRemoved:
    """The K/V under ``digest`` is no longer held in ``tier``."""

    seq: int
    tier: str
    digest: bytes


@dataclass(frozen=True)
class AllCleared:
    """Nothing is held in ``tier`` any more."""

    seq: int
    tier: str


KVEvent = BlockStored | BlockRemoved | AllCleared


class Subscription:
    """One consumer of a :class:`KVEventStream`.

    Without a callback, events wait in a buffer of ``capacity`` events; when it is full the
    oldest are dropped and counted in :attr:`lost` (resubscribe with replay to resynchronise).
    A callback that raises is unsubscribed (the manager call that published carries on); the
    exception is kept in :attr:`error`.
    """

    def __init__(self, stream: KVEventStream, callback: Callable[[KVEvent], object] | None, capacity: int):
        self._stream = stream
        self._callback = callback
        self._buffer: deque[KVEvent] = deque()
        self._capacity = capacity
        #: Events dropped because the buffer was full.
        self.lost = 0
        #: The exception a callback raised (it is unsubscribed then).
        self.error: BaseException | None = None

    def _deliver(self, event: KVEvent) -> None:
        if self._callback is None:
            if len(self._buffer) >= self._capacity:
                self._buffer.popleft()
                self.lost += 1
            self._buffer.append(event)
            return
        try:
            self._callback(event)
        except Exception as err:  # a consumer's bug must not break the manager's call
            self.error = err
            self.close()

    def poll(self, max_events: int | None = None) -> list[KVEvent]:
        """The buffered events, oldest first (at most ``max_events``), removed from the buffer."""
        count = len(self._buffer)
        if max_events is not None:
            count = min(count, require_int("max_events", max_events, minimum=0))
        return [self._buffer.popleft() for _ in range(count)]

    def __iter__(self) -> Iterator[KVEvent]:
        """Drain the buffer, oldest first (stops when it is empty; does not wait)."""
        while self._buffer:
            yield self._buffer.popleft()

    @property
    def closed(self) -> bool:
        return self not in self._stream._subscribers

    def close(self) -> None:
        """Stop receiving events (buffered ones stay readable)."""
        if self in self._stream._subscribers:
            self._stream._subscribers.remove(self)


class KVEventStream:
    """The events of one block manager's tiers. ``contents`` gives the keys each tier holds
    now, for replays: ``{tier: keys}``."""

    def __init__(self, contents: Callable[[], Mapping[str, Iterable[BlockKey]]]):
        self._contents = contents
        self._subscribers: list[Subscription] = []
        #: The number of the last event published (0: none yet).
        self.last_seq = 0

    @property
    def active(self) -> bool:
        """Whether anyone subscribes (publishers skip all work otherwise)."""
        return bool(self._subscribers)

    def subscribe(
        self,
        callback: Callable[[KVEvent], object] | None = None,
        *,
        replay: bool = True,
        capacity: int = 1 << 16,
    ) -> Subscription:
        """A new consumer: ``callback(event)`` for each event, or a buffer of ``capacity``
        events to :meth:`Subscription.poll`. ``replay``: first the current contents (see the
        module docstring)."""
        if callback is not None and not callable(callback):
            raise ArgumentTypeError(f"callback: expected a callable or None, got {type(callback).__name__}")
        if not isinstance(replay, bool):
            raise ArgumentTypeError(f"replay: expected a bool, got {type(replay).__name__}")
        sub = Subscription(self, callback, require_int("capacity", capacity, minimum=1))
        self._subscribers.append(sub)
        if replay:
            for tier, keys in self._contents().items():
                for key in _parents_first(keys):
                    sub._deliver(_stored(self.last_seq, tier, key, replayed=True))
                    if sub.closed:
                        return sub
        return sub

    def stored(self, tier: str, key: BlockKey) -> None:
        if self._subscribers:
            self._publish(_stored(self.last_seq + 1, tier, key))

    def removed(self, tier: str, key: BlockKey) -> None:
        if self._subscribers:
            self._publish(BlockRemoved(self.last_seq + 1, tier, key.digest))

    def cleared(self, tier: str) -> None:
        if self._subscribers:
            self._publish(AllCleared(self.last_seq + 1, tier))

    def _publish(self, event: KVEvent) -> None:
        self.last_seq = event.seq
        for sub in list(self._subscribers):
            sub._deliver(event)


def _stored(seq: int, tier: str, key: BlockKey, *, replayed: bool = False) -> BlockStored:
    parent = None if key.parent is None else key.parent.digest
    return BlockStored(seq, tier, key.digest, parent, key.tokens, key.extra, replayed)


def _parents_first(keys: Iterable[BlockKey]) -> list[BlockKey]:
    """``keys`` ordered by their depth in the chain, so a parent comes before its children."""
    depth: dict[int, int] = {}

    def depth_of(key: BlockKey) -> int:
        walk = []
        node: BlockKey | None = key
        while node is not None and id(node) not in depth:
            walk.append(node)
            node = node.parent
        base = -1 if node is None else depth[id(node)]
        for link in reversed(walk):
            base += 1
            depth[id(link)] = base
        return depth[id(key)]

    return sorted(keys, key=depth_of)
