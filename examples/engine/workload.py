"""The example's workloads: seeded requests arriving over time."""

from __future__ import annotations

import random

from .scheduler import Request

__all__ = ["make_workload"]


def make_workload(kind: str, num_requests: int, *, seed: int, block_size: int, vocab_size: int) -> list[Request]:
    """Seeded requests arriving over time, with prompt lengths and max_new_tokens varying.

    ``default``: the first prompts have the lengths that break paged caches (1, exactly one
    and two blocks, one past a block boundary), the rest are random up to ~3 blocks.
    ``shared-prefix``: every prompt is one long common system prompt (3 blocks and a bit)
    followed by a short user part, the case prefix caching is for.
    ``multi-turn``: conversations over a shared system prompt (2 blocks); each turn's prompt
    is the previous turn's prompt, a reply and a new user message, so it extends it. The reply
    is seeded tokens, not the model's output, so the workload is fixed in advance. Turns of one
    conversation arrive far apart and conversations interleave: by the next turn, a small pool
    has evicted the earlier turns, the case a host tier is for.
    """
    if kind == "multi-turn":
        return _multi_turn(num_requests, seed=seed, block_size=block_size, vocab_size=vocab_size)
    rng = random.Random(seed)
    edge = [1, block_size, 5, 2 * block_size, block_size + 1, 3 * block_size + 1, block_size - 1]
    system = [rng.randrange(vocab_size) for _ in range(3 * block_size + 7)]
    requests, arrival = [], 0
    for i in range(num_requests):
        if kind == "shared-prefix":
            prompt = system + [rng.randrange(vocab_size) for _ in range(rng.randint(1, block_size + 8))]
        else:
            length = edge[i] if i < len(edge) else rng.randint(2, 3 * block_size + 8)
            prompt = [rng.randrange(vocab_size) for _ in range(length)]
        requests.append(Request(i, prompt, max_new_tokens=rng.randint(4, 40), arrival_step=arrival))
        arrival += rng.choice((0, 0, 1, 2, 3))
    return requests


def _multi_turn(num_requests: int, *, seed: int, block_size: int, vocab_size: int) -> list[Request]:
    """``num_requests`` turns: 4 conversations, ceil(n / 4) turns each (see make_workload)."""
    rng = random.Random(seed)
    conversations = 4
    system = [rng.randrange(vocab_size) for _ in range(2 * block_size)]
    history = [
        system + [rng.randrange(vocab_size) for _ in range(rng.randint(4, block_size))] for _ in range(conversations)
    ]
    requests: list[Request] = []
    for i in range(num_requests):
        turn, conv = divmod(i, conversations)
        if turn:
            reply = [rng.randrange(vocab_size) for _ in range(rng.randint(8, block_size))]
            user = [rng.randrange(vocab_size) for _ in range(rng.randint(4, block_size // 2))]
            history[conv] = history[conv] + reply + user
        arrival = turn * 40 + conv * 3
        requests.append(Request(i, list(history[conv]), max_new_tokens=rng.randint(4, 12), arrival_step=arrival))
    return requests
