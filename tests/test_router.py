"""The example router (``examples.router``): it knows each engine's cache only from KV
events, its view matches the engine's index after every turn, and routing by prefix finds
more cached prompt tokens than round-robin on multi-turn chat."""

from __future__ import annotations

import pytest
import torch

from examples.router import EngineView, PrefixRouter, conversation_turns, main, serve
from kvcache import BlockManager, block_digests


def test_prefix_routing_finds_more_cached_tokens_than_round_robin() -> None:
    results = {
        policy: serve(policy, conversation_turns(4, 0, 32), "tiny-cpu", 0) for policy in ("prefix", "round-robin")
    }
    assert results["prefix"]["prompt_tokens"] == results["round-robin"]["prompt_tokens"]
    assert results["prefix"]["cached_tokens"] > results["round-robin"]["cached_tokens"]


def test_the_router_sends_a_prompt_where_its_prefix_is_and_follows_evictions() -> None:
    a, b = BlockManager(4, 4, enable_prefix_caching=True), BlockManager(4, 4, enable_prefix_caching=True)
    prompt = list(range(9))
    b.allocate("x", token_ids=prompt)
    b.mark_computed("x", 9)
    router = PrefixRouter({"a": a, "b": b}, 4)  # b's blocks arrive as a replay
    assert router.route(prompt) == "b"
    assert router.views["b"].cached_blocks(block_digests(prompt, 4)) == 2
    b.free("x")
    b.allocate("y", 16)  # evicts both cached blocks: the router hears of it
    assert router.views["b"].held == set()
    assert router.route(prompt) == "a"  # no prefix anywhere: the less loaded engine


def test_a_view_follows_a_reset() -> None:
    view = EngineView("e")
    m = BlockManager(4, 4, enable_prefix_caching=True)
    m.kv_events.subscribe(view.on_event)
    m.allocate("x", token_ids=list(range(5)))
    m.mark_computed("x", 5)
    assert len(view.held) == 1
    m.reset_prefix_cache()
    assert view.held == set()


def test_cli_prints_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["--turns", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # the example runs on one thread
    out = capsys.readouterr().out
    assert "prefix" in out and "round-robin" in out
