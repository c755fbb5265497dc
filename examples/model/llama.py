"""A Llama-style decoder whose attention reads and writes the paged KV cache.

Short on purpose: embedding, ``num_layers`` x (RMSNorm, rotary GQA attention, RMSNorm,
SwiGLU MLP), final RMSNorm, lm_head. The only unusual part is attention: every layer writes
the step's new K/V into its own cache tensors through ``backend.rotary_write_kv`` and attends
over the whole paged history with ``backend.attend``, reusing the one :class:`StepPlan` the
caller made for the step.

The math follows transformers' ``LlamaForCausalLM`` (rotary with the rotate-half convention,
RMSNorm in float32, softmax scale ``head_dim ** -0.5``), so its weights load unchanged and
both produce the same tokens. The ways Qwen2, Mistral, Gemma-2 and Gemma-3 differ are fields of
:class:`LlamaShape`: biases on the q/k/v projections, tied embeddings, a sliding window, a
softmax scale and score soft-capping (which only the attention backend sees, through
:meth:`LlamaShape.attention_spec`); Gemma's norms (scaled by ``1 + weight``, four a block,
q/k norms), GeGLU, the scaled embedding, capped logits and a rotary base of the windowed
layers' own. Reading checkpoints and their configs lives in :mod:`examples.model.checkpoints`.

Written the way a serving engine writes it: q/k/v are one projection (``wqkv``) and so are
the MLP's gate and up (``w_gate_up``); rotary, the cache write and the rotated query are one
backend call (``rotary_write_kv``, with a cos/sin table built once); each residual add runs
inside the next RMSNorm, and SiLU x up is one op (:mod:`examples.model.ops`: one kernel each
on a GPU).

Tensor parallelism (Megatron-style, :class:`kvcache.parallel.heads.TensorParallel`): ``wqkv``
is split by head (column-parallel: a rank keeps the rows of its query heads and of its KV
heads, a KV head copied to several ranks when there are more ranks than KV heads), ``wo`` is
split by its input columns (row-parallel: partial outputs summed by one all-reduce, its bias
added once after the sum); likewise the MLP's gate_up (column) and down (row, one
all-reduce). Embedding, norms and lm_head are replicated: every rank computes the full logits
from the same all-reduced hidden state, so every rank samples the same token with no further
communication (vocab-parallel embedding/lm_head would save their memory at the cost of two
more collectives). :func:`shard_parameter` cuts a full tensor to a rank's share, so random
weights (:func:`random_llama`) and checkpoints (:mod:`examples.model.checkpoints`) load the same
full weights on every tensor-parallel size.

Shapes: ``T`` is the step's number of new tokens (all rows together), ``B`` its number of
rows, ``H``/``KVH`` query/KV heads, ``D`` the head dim (heads per rank, when sharded).
"""

from __future__ import annotations

import torch
from torch import nn

from attention import AttentionBackend, StepPlan
from attention.checks import same_device
from attention.errors import InvalidArgumentError
from attention.rotary import RotaryTable
from kvcache import KVCacheTensors
from kvcache.parallel.collective import Collective
from kvcache.parallel.heads import TensorParallel

from .layers import Block, RMSNorm, RowParallelLinear
from .rotary import rope_inv_freq
from .shape import LlamaShape
from .sharding import shard_parameter

__all__ = ["Llama", "empty_llama", "init_random_", "random_llama"]


class Llama(nn.Module):
    """The decoder. Call it once per step with every scheduled row's new tokens.

    tp: this process's rank of a tensor-parallel group (default: one rank, nothing sharded).
    A sharded model holds its rank's share of each weight (:func:`shard_parameter`) and needs
    :meth:`connect` before it runs. Raises InvalidArgumentError when the shape does not split
    over ``tp.size`` ranks.
    """

    def __init__(self, shape: LlamaShape, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or TensorParallel()
        shape.check_tp(tp)
        self.shape = shape
        self.tp = tp
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape, tp) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps, offset=shape.norm_offset)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self._rotary: RotaryTable | None = None
        self._local_rotary: RotaryTable | None = None
        self.tie_weights()

    def connect(self, collective: Collective) -> None:
        """Give the row-parallel layers the group's all-reduce (the collective's rank and size
        must be this model's; with one rank there is nothing to connect)."""
        if (collective.rank, collective.size) != (self.tp.rank, self.tp.size):
            raise InvalidArgumentError(
                f"collective: rank {collective.rank} of {collective.size}, but the model was built for rank "
                f"{self.tp.rank} of {self.tp.size}"
            )
        for module in self.modules():
            if isinstance(module, RowParallelLinear):
                module.all_reduce = collective.all_reduce if self.tp.is_sharded else None

    def tie_weights(self) -> None:
        """With tied embeddings, make lm_head's weight the embedding's (one Parameter). Moving
        a model between device types (``to_empty`` from meta) makes new Parameters, which
        unties them: call this after."""
        if self.shape.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        token_ids: torch.Tensor,
        cache: KVCacheTensors,
        backend: AttentionBackend,
        plan: StepPlan,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step; return the logits the step needs.

        token_ids: int64 [T], the new tokens of every row in row order (as in the metadata).
        cache:     per-layer K/V in the cache dtype (this rank's KV heads).
        plan:      ``backend.plan(metadata)`` for this step, shared by every layer (with KV
                   groups, each layer takes ``plan.group(cache.group_of(layer))``).
        Returns float [len(metadata.logits_indices), vocab_size]: row
        ``metadata.sampling_rows_host[j]``'s next-token logits are row j (then padding rows);
        the full vocabulary, the same on every tensor-parallel rank. ``logits_rows`` (int64
        [k], token rows): return those rows' logits instead (a verifier needs every position
        of a row carrying draft tokens).
        """
        meta = plan.metadata
        longest = max(meta.seq_lens_host, default=1)
        rotary = self.rotary_table(longest, meta.positions.device)
        local = self.rotary_table(longest, meta.positions.device, local=True)
        residual = self.embed(token_ids)  # [T, hidden]
        if self.shape.embed_scale:
            residual = residual * torch.tensor(self.shape.hidden_size**0.5, dtype=residual.dtype)
        delta: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            table = local if self.shape.is_windowed(index) else rotary
            layer_plan = plan.group(cache.group_of(index)) if plan.groups else plan  # its KV group's tables
            delta, residual = layer(delta, residual, cache.layer(index), backend, layer_plan, table)
        rows = meta.logits_indices if logits_rows is None else logits_rows
        if delta is None:  # no layers
            logits = self.lm_head(self.norm(residual[rows]))
        else:
            logits = self.lm_head(self.norm.add(delta[rows], residual[rows])[0])
        cap = self.shape.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rotary_table(self, max_positions: int, device: torch.device, *, local: bool = False) -> RotaryTable:
        """The model's rotary cos/sin table on ``device``, covering at least ``max_positions``
        positions: built once, and again (larger) only when a longer sequence asks. A CUDA
        graph reads the table it was captured with, so an engine asks for its longest length
        before capturing (``ModelRunner`` does). ``local``: the windowed layers' table (its
        own base when ``local_rope_theta`` is set, else the same table)."""
        s = self.shape
        if local and s.local_rope_theta is None:
            local = False
        table = self._local_rotary if local else self._rotary
        if table is None or table.max_positions < max_positions or not same_device(table.device, device):
            size = max(max_positions, table.max_positions if table is not None else 0)
            if local:
                assert s.local_rope_theta is not None, "checked above"
                inv_freq = rope_inv_freq(s.rotary_dim, s.local_rope_theta, None, device)
            else:
                inv_freq = rope_inv_freq(s.rotary_dim, s.rope_theta, s.rope_scaling, device)
            table = RotaryTable.build(inv_freq, size)
            if local:
                self._local_rotary = table
            else:
                self._rotary = table
        return table


def empty_llama(
    shape: LlamaShape, *, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel | None = None
) -> Llama:
    """A model with uninitialised weights allocated once, directly in ``dtype`` on ``device``
    (no float32 copy first: an 8B model takes 16 GB in bf16, not 32 + 16); with ``tp``, that
    rank's share only."""
    with torch.device("meta"):
        model = Llama(shape, tp)  # no memory, no RNG use
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model.eval()


def init_random_(model: nn.Module, *, seed: int) -> None:
    """Fill every parameter in place from a seeded generator on the parameters' device
    (the global RNG is left alone; an 8B model never passes through host memory).

    Norm weights 1, biases 0, embeddings N(0, 1), every matrix N(0, fan_in ** -0.5): then
    activations keep unit scale, attention scores are O(1), attention is far from uniform,
    and a wrong position or a wrong cache slot changes the output (tiny weights would hide
    such bugs). Works on transformers' models as well (by parameter name and shape).
    """
    gen: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:  # norm weights (ours: *_norm.weight; transformers: *layernorm.weight)
                param.fill_(1.0)
            elif "embed" in name:
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)


def random_llama(
    shape: LlamaShape,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel | None = None,
) -> Llama:
    """A model with seeded random weights (see :func:`init_random_`), drawn on the CPU in
    float32 and then moved, so the same seed gives the same weights on every device.

    With ``tp``, the full weights are drawn (the same as with one rank) and the rank keeps its
    share, so every tensor-parallel size runs the same model (each rank holds the full model
    in host memory for a moment)."""
    model = empty_llama(shape, dtype=torch.float32, device="cpu")
    init_random_(model, seed=seed)
    if tp is not None and tp.is_sharded:
        full, model = model, empty_llama(shape, dtype=torch.float32, device="cpu", tp=tp)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in full.named_parameters():
                params[name].copy_(shard_parameter(name, tensor, shape, tp))
    model = model.to(device=device, dtype=dtype)
    model.tie_weights()
    return model.eval()
