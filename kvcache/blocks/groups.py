"""KV groups: layers of one attention type (full, or a sliding window) that share block tables.

A model that interleaves windowed and full layers (Gemma-2 alternates them, Gemma-3 has five
windowed layers per full one, gpt-oss alternates) needs full-length K/V only in its full
layers; a windowed layer never reads behind its window. With one block table per sequence for
every layer, the windowed layers keep full-length K/V anyway. Grouping fixes that: each group
has its own table per sequence, and a windowed group releases the blocks behind its window as
its sequences advance, whatever the other groups hold.

Groups share one block pool (as vLLM's hybrid allocator does) rather than one pool each (as
TensorRT-LLM's per-window pools do): a fixed split between pools is wrong for some mix of
lengths (a short sequence needs as many windowed blocks as full ones, a long one far fewer),
while one pool lets each group take what its sequences need. To share a pool without wasting
memory, every group has the same number of layers, ``group_size``: a block id then stands for
the K/V of ``group_size`` layers, in whichever group holds it, and the cache has ``group_size``
layer tensors, the ``j``-th layer of every group stored in tensor ``j`` (layers of different
groups alias the same memory, at different block ids). Pages keep one size, so nothing is
inflated (vLLM's hybrid models with one inflated page size lose their prefix hits).

``group_size`` is the smallest count of layers of one type; a type whose count it does not
divide gets one last group with fewer layers (the tensors it leaves empty are padding).
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.checks import require_int
from attention.errors import InvalidArgumentError

__all__ = ["KVGroup", "KVGroupLayout", "group_layout"]


@dataclass(frozen=True)
class KVGroup:
    """One group: the model layers it holds, in order, and their window (None: full attention)."""

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVGroupLayout:
    """Every group of a model, and the layer tensors they share.

    groups:     full groups first, then windowed ones; each holds at most ``group_size`` layers.
    group_size: layer tensors of the cache (one block id holds this many layers' K/V).
    num_layers: the model's layers.
    """

    groups: tuple[KVGroup, ...]
    group_size: int
    num_layers: int

    @property
    def is_hybrid(self) -> bool:
        """Whether there is more than one group (else one table per sequence serves every layer)."""
        return len(self.groups) > 1

    def place(self, layer: int) -> tuple[int, int]:
        """``(group, tensor)`` of model layer ``layer``: its group's index, and the cache tensor
        that holds its K/V. Raises InvalidArgumentError for a layer outside the model."""
        layer = require_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise InvalidArgumentError(f"layer: {layer} is in no group")  # unreachable for a built layout

    def layer_blocks(self, blocks_in_use: int) -> int:
        """Layer-blocks (one layer's K/V of one block) that ``blocks_in_use`` block ids hold."""
        return blocks_in_use * self.group_size


def group_layout(num_layers: int, sliding_window: int | None, window_layers: tuple[bool, ...] | None) -> KVGroupLayout:
    """The groups of a model of ``num_layers`` layers where ``window_layers[i]`` says whether
    layer ``i`` attends to the last ``sliding_window`` tokens only (None: every layer does when
    a window is given). Raises InvalidArgumentError for a pattern of the wrong length or a
    pattern without a window."""
    num_layers = require_int("num_layers", num_layers, minimum=1)
    if sliding_window is not None:
        sliding_window = require_int("sliding_window", sliding_window, minimum=1)
    if window_layers is None:
        window_layers = (sliding_window is not None,) * num_layers
    elif len(window_layers) != num_layers:
        raise InvalidArgumentError(
            f"window_layers: {len(window_layers)} entries for {num_layers} layers; give one per layer"
        )
    elif sliding_window is None and any(window_layers):
        raise InvalidArgumentError("window_layers: windowed layers need sliding_window; give the window")
    full = tuple(i for i, windowed in enumerate(window_layers) if not windowed)
    windowed = tuple(i for i, w in enumerate(window_layers) if w)
    if not full or not windowed:
        only = KVGroup(tuple(range(num_layers)), sliding_window if windowed else None)
        return KVGroupLayout((only,), num_layers, num_layers)
    size = min(len(full), len(windowed))
    groups = [KVGroup(full[i : i + size], None) for i in range(0, len(full), size)]
    groups += [KVGroup(windowed[i : i + size], sliding_window) for i in range(0, len(windowed), size)]
    return KVGroupLayout(tuple(groups), size, num_layers)
