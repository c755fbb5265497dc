"""Every error this project raises on purpose, in one hierarchy.

The base is :class:`KVCacheError`; each subclass also derives from the built-in exception a
caller would expect (``ValueError``, ``KeyError``, ``TypeError``, ``MemoryError``,
``ImportError``), so ``except ValueError`` keeps working. Messages name the argument or
field, the value, what was expected, and the fix. An operation that raises one of these has
changed nothing.

It lives in :mod:`attention` because that is the lower of the two packages; :mod:`kvcache`
re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ArgumentTypeError",
    "BackendUnavailableError",
    "CacheAllocationError",
    "ConfigError",
    "ConfigProblem",
    "IntegrityError",
    "InvalidArgumentError",
    "KVCacheError",
    "MetadataError",
    "OutOfBlocksError",
    "RankDivergenceError",
    "SequenceExistsError",
    "UnknownSequenceError",
    "UnsupportedSettingError",
]

#: Longest excerpt of a caller's value quoted in a message: a hostile or huge value must not
#: turn an error message into megabytes.
MAX_QUOTE = 80


def quote(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_QUOTE` characters."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not replace the real error
        text = f"<{type(value).__name__}>"
    if len(text) > MAX_QUOTE:
        text = text[: MAX_QUOTE - 15] + f"... ({len(text)} chars)"
    return text


class KVCacheError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument has a value the call cannot take; nothing was changed."""


class ArgumentTypeError(KVCacheError, TypeError):
    """An argument has the wrong type (a float or bool where a count is needed, ...);
    nothing was changed."""


class MetadataError(InvalidArgumentError):
    """Step metadata or a plan is inconsistent with itself or with the cache."""


class UnsupportedSettingError(InvalidArgumentError):
    """A backend refuses a setting (block size, head dim, dtype, device, feature)."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks for an all-or-nothing request; nothing was changed."""

    def __init__(self, requested: int, free: int, what: str = "allocate"):
        self.requested = requested
        self.free = free
        super().__init__(
            f"cannot {what}: {requested} blocks needed, {free} free; free or preempt a sequence, "
            f"or give the cache more blocks (cache.num_blocks / cache.memory_budget)"
        )


class UnknownSequenceError(KVCacheError, KeyError):
    """The sequence id has no block table; nothing was changed."""

    def __init__(self, seq_id: object, hint: str = "allocate it first"):
        self.seq_id = seq_id
        super().__init__(f"sequence {quote(seq_id)} is unknown; {hint}")

    def __str__(self) -> str:
        return str(self.args[0])


class SequenceExistsError(KVCacheError, ValueError):
    """The sequence id already has a block table (or is swapped out); nothing was changed."""

    def __init__(self, seq_id: object, where: str = "already has blocks"):
        self.seq_id = seq_id
        super().__init__(f"sequence {quote(seq_id)} {where}; free it first or use a new id")


class IntegrityError(KVCacheError, AssertionError):
    """``check_integrity`` found the bookkeeping inconsistent; the message lists each count."""


class RankDivergenceError(KVCacheError, RuntimeError):
    """Tensor-parallel ranks made different block-manager decisions (their step digests
    differ). Raised on every rank at the same step, before any rank runs the step's model, so
    no collective is left waiting. ``digests[r]`` is rank r's digest."""

    def __init__(self, digests: list[int], what: str = "block-manager decisions", step: int | None = None):
        self.step = step
        self.digests = list(digests)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        shown = ", ".join(f"rank {r}: {d & (2**64 - 1):016x}" for r, d in enumerate(digests[:8]))
        where = "" if step is None else f"step {step}: "
        super().__init__(
            f"{where}the tensor-parallel ranks disagree on the {what} (ranks {differ} differ from rank 0; "
            f"{shown}{', ...' if len(digests) > 8 else ''}); every rank must run the same scheduler on the same "
            f"requests, config and seed, and sample from the same logits"
        )


class CacheAllocationError(KVCacheError, MemoryError):
    """The device is missing or cannot hold the requested cache tensors."""


class BackendUnavailableError(KVCacheError, ImportError):
    """The backend's kernel library is not installed; the message names the pip command."""


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a config: the dotted field path ("" for the file itself), and a message
    that says why and the fix."""

    path: str
    message: str


class ConfigError(KVCacheError, ValueError):
    """A config could not be loaded. ``problems`` lists every problem found, in file order."""

    def __init__(self, source: str, problems: list[ConfigProblem], lines: dict[str, int] | None = None):
        self.source = source
        self._lines = lines or {}
        self.problems = sorted(problems, key=lambda p: self.line_of(p.path) or 0)
        super().__init__(self.format())

    def line_of(self, path: str) -> int | None:
        """The line of ``path``, or of its nearest written parent (a missing key's section)."""
        parts = path.split(".")
        while parts:
            line = self._lines.get(".".join(parts))
            if line is not None:
                return line
            parts.pop()
        return None

    def format(self) -> str:
        """One line per problem: ``file:line: path: message``."""
        out = []
        for p in self.problems:
            line = self.line_of(p.path)
            where = f"{self.source}:{line}" if line else self.source
            out.append(f"{where}: {p.path}: {p.message}" if p.path else f"{where}: {p.message}")
        return "\n".join(out)
