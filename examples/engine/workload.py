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
    """
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
