"""The example serving engine: the parts a serving loop runs, and the loop.

| module | what it holds |
| --- | --- |
| ``parts`` | :func:`engine_for`: backend, cache tensors and block manager for a model |
| ``scheduler`` | continuous batching: admission, chunked prefill, decode, preemption |
| ``request_checks`` | a request's checks before a scheduler takes it (fields, vocabulary, positions) |
| ``runner`` | one model step over the paged cache: plan once, graphs or eager |
| ``loop`` | :func:`run_requests`: schedule -> step -> sample -> commit, and its report |
| ``workload`` | seeded requests arriving over time |
| ``distributed`` | a tensor-parallel group from torchrun's environment |

The names of ``parts`` are also found here (``from examples.engine import engine_for``), as
they were when the engine was one module.
"""

from .parts import Engine, cache_config_for, engine_for

__all__ = ["Engine", "cache_config_for", "engine_for"]
