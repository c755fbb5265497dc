"""Prompt-lookup drafting: guess a request's next tokens from its own text, verify them exactly.

Speculative decoding with no second model (the "prompt lookup" / n-gram proposer of vLLM and
transformers' ``prompt_lookup_num_tokens``): when the last ``n`` tokens of a sequence occurred
before in it, the tokens that followed then are proposed as the next ones. Rewriting, quoting
or summarising a prompt repeats much of it, so many proposals are right.

A step then computes the last sampled token and the ``k`` drafts in one row; the model's greedy
token at each of the row's positions says how many drafts it agrees with. The agreed drafts,
and the model's own token after them, are appended; the rest are taken back
(``BlockManager.truncate``). Every appended token is the model's greedy choice given the tokens
before it, so the output equals plain greedy decoding's (up to the rounding of computing
several positions in one row).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramIndex", "accepted_tokens"]


class NgramIndex:
    """Where each n-gram (``1 <= n <= max_n``) of a growing token list last ended, updated in
    O(max_n) per appended token, so a proposal costs O(max_n + k), not a scan of the text."""

    def __init__(self, max_n: int = 3):
        if max_n < 1:
            raise ValueError(f"max_n: {max_n} must be at least 1")
        self.max_n = max_n
        self.tokens: list[int] = []
        #: n-gram -> the position just after its latest occurrence that has a token after it.
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the indexed text."""
        for token in tokens:
            end = len(self.tokens)  # an n-gram ending at end - 1 is now followed by ``token``
            for n in range(1, self.max_n + 1):
                if end - n < 0:
                    break
                self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix n-gram's latest earlier
        occurrence (longest n first); empty when no suffix occurred before."""
        if k <= 0:
            return []
        text = self.tokens
        for n in range(min(self.max_n, len(text) - 1), 0, -1):
            start = self._next.get(tuple(text[-n:]))
            if start is not None:
                return text[start : start + k]
        return []


def accepted_tokens(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """The tokens a verified row appends: the leading drafts the model agrees with, then its
    own token after them. ``greedy[j]`` is the model's token after the row's ``j``-th position
    (the row is the last sampled token, then the drafts: ``len(greedy) == len(drafts) + 1``)."""
    if len(greedy) != len(drafts) + 1:
        raise ValueError(f"greedy: {len(greedy)} tokens for a row of {len(drafts)} drafts (expected one more)")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return [*drafts[:accepted], greedy[accepted]]
