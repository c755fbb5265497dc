"""A Llama-style decoder whose attention reads and writes the paged KV cache.

Short on purpose: embedding, ``num_layers`` x (RMSNorm, rotary GQA attention, RMSNorm,
SwiGLU MLP), final RMSNorm, lm_head. The only unusual part is attention: every layer writes
the step's new K/V into its own cache tensors through ``backend.write_kv`` and attends over
the whole paged history with ``backend.attend``, reusing the one :class:`StepPlan` the caller
made for the step.

The math follows transformers' ``LlamaForCausalLM`` (rotary with the rotate-half convention,
RMSNorm in float32, softmax scale ``head_dim ** -0.5``), so its weights load unchanged and
both produce the same tokens. The few ways Qwen2 and Mistral differ are fields of
:class:`LlamaShape`: biases on the q/k/v projections, tied embeddings, a sliding window (which
only the attention backend sees, through :meth:`LlamaShape.attention_spec`). Reading
checkpoints and their configs lives in :mod:`examples.checkpoints`.

Tensor parallelism (Megatron-style, :class:`kvcache.parallel.TensorParallel`): ``wq``/``wk``/
``wv`` are split by head (column-parallel: a rank keeps the rows of its query heads and of its
KV heads, a KV head copied to several ranks when there are more ranks than KV heads), ``wo``
is split by its input columns (row-parallel: partial outputs summed by one all-reduce, its
bias added once after the sum); likewise the MLP's gate/up (column) and down (row, one
all-reduce). Embedding, norms and lm_head are replicated: every rank computes the full logits
from the same all-reduced hidden state, so every rank samples the same token with no further
communication (vocab-parallel embedding/lm_head would save their memory at the cost of two
more collectives). :func:`shard_parameter` cuts a full tensor to a rank's share, so random
weights (:func:`random_llama`) and checkpoints (:mod:`examples.checkpoints`) load the same
full weights on every tensor-parallel size.

Shapes: ``T`` is the step's number of new tokens (all rows together), ``B`` its number of
rows, ``H``/``KVH`` query/KV heads, ``D`` the head dim (heads per rank, when sharded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attention import AttentionBackend, AttentionSpec, LayerCache, StepPlan
from attention.errors import InvalidArgumentError
from kvcache import KVCacheTensors
from kvcache.collective import Collective
from kvcache.config import ModelSection
from kvcache.parallel import TensorParallel, rank_spec

__all__ = [
    "Llama",
    "LlamaShape",
    "RopeScaling",
    "RowParallelLinear",
    "empty_llama",
    "init_random_",
    "random_llama",
    "shape_for_cache",
    "shard_parameter",
    "shard_range",
]

#: Sums a tensor over the tensor-parallel ranks, in place, and returns it.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies stretched for long context (transformers' ``rope_parameters``).

    kind ``linear``: every frequency divided by ``factor``. kind ``llama3`` (Llama 3.1+):
    low frequencies divided by ``factor``, high ones kept, the band between interpolated,
    with the band edges at ``original_max_position_embeddings / {low,high}_freq_factor``.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaShape:
    """Every size and switch the model needs. The attention part must match the cache
    config's ``model`` section; vocab and MLP sizes are the model's own business.

    qkv_bias / o_bias / mlp_bias: biases on those projections (Qwen2: q/k/v only).
    tie_word_embeddings: lm_head is the embedding matrix (one tensor).
    sliding_window, window_layers: as in :class:`attention.AttentionSpec` (Mistral: every
    layer windowed; Qwen2: per layer). Only the attention backend reads them.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None

    def check_cache(self, model: ModelSection) -> None:
        """Raise ValueError naming the field when the cache was sized for another model."""
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            ours, theirs = getattr(self, name), getattr(model, name)
            if ours != theirs:
                raise ValueError(
                    f"model.{name}: the cache config says {theirs} but the model has {ours}; "
                    f"use a cache config whose model section matches the weights"
                )

    def model_section(self) -> ModelSection:
        """The cache config's ``model`` section for this model."""
        return ModelSection(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def check_tp(self, tp: TensorParallel) -> None:
        """Raise InvalidArgumentError when the model does not split over ``tp.size`` ranks
        (heads, see :mod:`kvcache.parallel`; the MLP width must divide evenly too)."""
        tp.check_heads(self.num_heads, self.num_kv_heads)
        if self.intermediate_size % tp.size:
            raise InvalidArgumentError(
                f"tensor-parallel size {tp.size}: intermediate_size {self.intermediate_size} does not split evenly "
                f"over {tp.size} ranks; use a size that divides it"
            )

    def attention_spec(
        self, dtype: str, kv_cache_dtype: str | None = None, *, tp: TensorParallel | None = None
    ) -> AttentionSpec:
        """The attention shape a backend serves for this model, window included; with ``tp``,
        the shape of that rank's heads.

        ``KVCacheConfig.attention_spec()`` cannot carry the window (the config's ``model``
        section has no field for it), so build the backend from this spec instead.
        """
        spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype if kv_cache_dtype != dtype else None,
            sliding_window=self.sliding_window,
            window_layers=self.window_layers,
        )
        return spec if tp is None else rank_spec(spec, tp)


def shape_for_cache(
    model: ModelSection, *, vocab_size: int = 256, intermediate_size: int | None = None
) -> LlamaShape:
    """A model shape that fits a cache config's ``model`` section.

    The cache config describes only attention (it forbids other keys), so the vocabulary and
    MLP width are example-only choices made here. The MLP defaults to ~8/3 of the hidden
    size rounded up to a multiple of 32, Llama's usual ratio.
    """
    hidden = model.num_heads * model.head_dim
    if intermediate_size is None:
        intermediate_size = -(-8 * hidden // 3 // 32) * 32
    return LlamaShape(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )


# ---- the model ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, with the statistics in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] -> [T, dim], same dtype."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
) -> torch.Tensor:
    """float32 [head_dim / 2]: frequency ``i`` is ``theta ** (-2i / head_dim)``, then scaled.

    Computed with device ops only (no host copy), so it can run inside a CUDA graph capture.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths past the low-frequency edge are stretched by `factor`, those
    # under the high-frequency edge kept, the band between interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / scaling.high_freq_factor) * ~(wavelen > old_len / scaling.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions`` (int [T]): each float32 [T, 1, head_dim].

    The table repeats the half-width angles twice, which pairs channel ``j`` with
    ``j + head_dim/2`` (the rotate-half convention).
    """
    angles = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    table = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
    return table.cos(), table.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, D] by the angles in cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the tensor-parallel ranks: each
    rank multiplies its slice of the input by its columns of the weight, one all-reduce sums
    the partial outputs, then the (full, replicated) bias is added once.

    With one rank it is exactly ``nn.Linear``. Sharded, it refuses to run before
    :meth:`Llama.connect` gives it the all-reduce (a partial sum would be silently wrong).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, sharded: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.sharded = sharded
        self.all_reduce: AllReduce | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features of this rank] -> [T, out_features], the same on every rank."""
        if not self.sharded:
            return super().forward(x)
        if self.all_reduce is None:
            raise RuntimeError("a tensor-parallel model needs its all-reduce: call model.connect(collective) first")
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class Attention(nn.Module):
    """GQA attention over the paged cache: write this step's K/V, then attend causally.
    Sharded, it holds this rank's query heads and KV heads only."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        shard = tp.shard(shape.num_heads, shape.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            len(shard.query_heads),
            len(shard.kv_heads),
            shape.head_dim,
        )
        hidden, q_dim, kv_dim = shape.hidden_size, self.num_heads * shape.head_dim, self.num_kv_heads * shape.head_dim
        self.wq = nn.Linear(hidden, q_dim, bias=shape.qkv_bias)
        self.wk = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.wv = nn.Linear(hidden, kv_dim, bias=shape.qkv_bias)
        self.wo = RowParallelLinear(q_dim, hidden, bias=shape.o_bias, sharded=tp.is_sharded)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerCache,
        backend: AttentionBackend,
        plan: StepPlan,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, D]; layer: this layer's cache. Returns [T, hidden]."""
        t = x.shape[0]
        q = apply_rotary(self.wq(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(t, self.num_kv_heads, self.head_dim)
        # The cache holds K after rotary, so cached positions never need rotating again.
        backend.write_kv(k, v, layer, plan)
        out = backend.attend(q, layer, plan)  # [T, H, D]
        return self.wo(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. Sharded, it holds this rank's
    ``intermediate_size / tp.size`` channels."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        width = shape.intermediate_size // tp.size
        self.w_gate = nn.Linear(shape.hidden_size, width, bias=shape.mlp_bias)
        self.w_up = nn.Linear(shape.hidden_size, width, bias=shape.mlp_bias)
        self.w_down = RowParallelLinear(width, shape.hidden_size, bias=shape.mlp_bias, sharded=tp.is_sharded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel):
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.attn = Attention(shape, tp)
        self.mlp_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = MLP(shape, tp)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerCache,
        backend: AttentionBackend,
        plan: StepPlan,
    ) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; the cache arguments are as in :class:`Attention`."""
        h = h + self.attn(self.attn_norm(h), cos, sin, layer, backend, plan)
        return h + self.mlp(self.mlp_norm(h))


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
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
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
    ) -> torch.Tensor:
        """Run one step; return the logits the step needs.

        token_ids: int64 [T], the new tokens of every row in row order (as in the metadata).
        cache:     per-layer K/V in the cache dtype (this rank's KV heads).
        plan:      ``backend.plan(metadata)`` for this step, shared by every layer.
        Returns float [len(metadata.logits_indices), vocab_size]: row
        ``metadata.sampling_rows_host[j]``'s next-token logits are row j (then padding rows);
        the full vocabulary, the same on every tensor-parallel rank.
        """
        meta = plan.metadata
        s = self.shape
        inv_freq = rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling, meta.positions.device)
        cos, sin = rotary_cos_sin(meta.positions, inv_freq)
        h = self.embed(token_ids)  # [T, hidden]
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layer(index), backend, plan)
        return self.lm_head(self.norm(h[meta.logits_indices]))


# ---- tensor-parallel shares --------------------------------------------------------------

#: Sharded modules (suffix of the parameter's module path) -> (what is split, weight dim).
#: Dim 0 is column-parallel (output features; the bias is split with them), dim 1
#: row-parallel (input features; the bias stays whole). Everything else is replicated.
_SHARDED: dict[str, tuple[str, int]] = {
    "attn.wq": ("query heads", 0),
    "attn.wk": ("kv heads", 0),
    "attn.wv": ("kv heads", 0),
    "attn.wo": ("query heads", 1),
    "mlp.w_gate": ("mlp", 0),
    "mlp.w_up": ("mlp", 0),
    "mlp.w_down": ("mlp", 1),
}


def shard_range(name: str, shape: LlamaShape, tp: TensorParallel) -> tuple[int, int, int] | None:
    """Where rank ``tp.rank``'s share of the full parameter ``name`` (our parameter name,
    e.g. ``layers.0.attn.wq.weight``) lies: ``(dim, start, length)``, or None when the rank
    keeps the whole tensor (replicated parameters, and everything with one rank).

    wq: the rows of the rank's query heads; wk/wv: the rows of its KV heads (the same rows on
    every rank sharing a replicated KV head); wo: the columns of its query heads; gate/up:
    its rows of the MLP width; down: its columns. Biases follow their rows; wo's and down's
    bias (added after the all-reduce) stay whole.
    """
    module, _, kind = name.rpartition(".")
    rule = next((r for suffix, r in _SHARDED.items() if module.endswith(suffix)), None)
    if rule is None or not tp.is_sharded:
        return None
    split, dim = rule
    if kind == "bias" and dim == 1:
        return None
    if split == "mlp":
        width = shape.intermediate_size // tp.size
        return dim, tp.rank * width, width
    heads = tp.shard(shape.num_heads, shape.num_kv_heads)
    owned = heads.query_heads if split == "query heads" else heads.kv_heads
    d = shape.head_dim
    return (0 if kind == "bias" else dim), owned.start * d, len(owned) * d


def shard_parameter(name: str, full: torch.Tensor, shape: LlamaShape, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s share of the full parameter ``name`` (see :func:`shard_range`): a
    view of ``full``, or ``full`` itself when the rank keeps it whole."""
    where = shard_range(name, shape, tp)
    return full if where is None else full.narrow(*where)


# ---- random weights ----------------------------------------------------------------------


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
