"""A prefix-aware router over two engines, fed by their KV events.

    python -m examples.router                 # tiny model on CPU, two engines, a few seconds

Each engine's block manager publishes what its prefix cache stores and removes
(:mod:`kvcache.blocks.events`). The router subscribes to both, keeps the set of block digests
each engine holds, and sends a request to the engine holding the longest run of the prompt's
leading blocks (:func:`kvcache.block_digests`), the less loaded one on a tie, as vLLM's and
Dynamo's KV-aware routers do. It never looks inside an engine: the events are all it knows,
so it would work the same across processes.

The workload is multi-turn chat: conversations whose turns extend the previous turn's prompt
over a shared system prompt. It runs once routed by prefix and once round-robin, on fresh
engines with the same weights, and prints how many prompt tokens each policy found cached.
After every turn the router's view is checked against each engine's actual index.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcache import AllCleared, BlockManager, BlockRemoved, BlockStored, KVEvent, block_digests, load_config

from .engine.loop import run_requests
from .engine.parts import Engine, engine_for
from .engine.scheduler import Request, make_preemption
from .engine.workload import make_workload
from .model.llama import Llama, random_llama
from .model.shape import shape_for_cache

__all__ = ["EngineView", "PrefixRouter", "main"]

VOCAB_SIZE = 256


@dataclass
class EngineView:
    """What the router knows of one engine: the digests its device tier holds (from events)."""

    name: str
    held: set[bytes] = field(default_factory=set)
    #: Requests routed here and not yet run (the tie-break).
    queued: int = 0

    def on_event(self, event: KVEvent) -> None:
        if event.tier != "device":
            return
        if isinstance(event, BlockStored):
            self.held.add(event.digest)
        elif isinstance(event, BlockRemoved):
            self.held.discard(event.digest)
        elif isinstance(event, AllCleared):
            self.held.clear()

    def cached_blocks(self, digests: Sequence[bytes]) -> int:
        """Leading blocks of a prompt (its digests, in order) this engine holds."""
        n = 0
        for digest in digests:
            if digest not in self.held:
                break
            n += 1
        return n


class PrefixRouter:
    """Picks an engine per request from the engines' KV events."""

    def __init__(self, managers: dict[str, BlockManager], block_size: int):
        self.block_size = block_size
        self.views = {name: EngineView(name) for name in managers}
        for name, manager in managers.items():
            manager.kv_events.subscribe(self.views[name].on_event)  # replays what it holds now

    def route(self, prompt: list[int], extra_key: object = None) -> str:
        digests = block_digests(prompt, self.block_size, extra_key)
        best = max(self.views.values(), key=lambda v: (v.cached_blocks(digests), -v.queued))
        best.queued += 1
        return best.name


def _engines(config_name: str, seed: int) -> tuple[Llama, dict[str, Engine]]:
    config = load_config(config_name)
    shape = shape_for_cache(config.model, vocab_size=VOCAB_SIZE)
    engines = {name: engine_for(config, shape, prefix_caching=True) for name in ("engine-0", "engine-1")}
    model = random_llama(shape, seed=seed, dtype=torch.float32, device="cpu")
    return model, engines


def serve(policy: str, turns: list[list[Request]], config_name: str, seed: int) -> dict[str, int]:
    """Run ``turns`` (lists of requests; a turn starts when the previous one has finished)
    on two fresh engines, routed by ``policy`` ("prefix" or "round-robin")."""
    model, engines = _engines(config_name, seed)
    block_size = next(iter(engines.values())).manager.block_size
    managers = {name: e.manager for name, e in engines.items() if isinstance(e.manager, BlockManager)}
    if len(managers) != len(engines):
        raise ValueError(f"{config_name}: a model with KV groups publishes no block events yet; route another model")
    router = PrefixRouter(managers, block_size)
    names = list(engines)
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
    for t, turn in enumerate(turns):
        routed: dict[str, list[Request]] = {name: [] for name in names}
        for i, req in enumerate(turn):
            name = router.route(req.prompt) if policy == "prefix" else names[(t + i) % len(names)]
            routed[name].append(req)
        for name, reqs in routed.items():
            engine = engines[name]
            if reqs:
                run_requests(
                    model, reqs, manager=engine.manager, cache=engine.cache, backend=engine.backend,
                    preemption=make_preemption("recompute", engine.manager, engine.cache), token_budget=64,
                )  # fmt: skip
            router.views[name].queued = 0
            assert engine.manager.prefix_cache is not None
            actual = {key.digest for key in engine.manager.prefix_cache.held_keys()}
            if router.views[name].held != actual:
                raise AssertionError(f"{name}: the router's view differs from the engine's index after turn {t}")
        totals["prompt_tokens"] += sum(len(r.prompt) for r in turn)
        totals["cached_tokens"] += sum(r.cached_tokens for r in turn)
        totals["generated_tokens"] += sum(len(r.output) for r in turn)
    return totals


def conversation_turns(num_turns: int, seed: int, block_size: int) -> list[list[Request]]:
    """The decode loop's multi-turn workload (4 conversations), grouped by turn, as fresh
    request objects."""
    flat = make_workload("multi-turn", num_turns * 4, seed=seed, block_size=block_size, vocab_size=VOCAB_SIZE)
    return [
        [Request(r.req_id, list(r.prompt), r.max_new_tokens) for r in flat[t * 4 : (t + 1) * 4]]
        for t in range(num_turns)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.router", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny-cpu", help="a cache config YAML, or a bundled name (default tiny-cpu)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    block_size = load_config(args.config).cache.block_size
    results = {}
    for policy in ("prefix", "round-robin"):
        turns = conversation_turns(args.turns, args.seed, block_size)
        results[policy] = serve(policy, turns, args.config, args.seed)
    print(f"{'routing':12} {'prompt tokens':>14} {'cached':>8} {'hit rate':>9} {'generated':>10}")
    for policy, r in results.items():
        rate = r["cached_tokens"] / max(r["prompt_tokens"], 1)
        print(f"{policy:12} {r['prompt_tokens']:14d} {r['cached_tokens']:8d} {rate:9.1%} {r['generated_tokens']:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
