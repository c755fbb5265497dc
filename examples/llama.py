"""A Llama-style decoder whose attention reads and writes the paged KV cache.

Short on purpose: embedding, ``num_layers`` x (RMSNorm, rotary GQA attention, RMSNorm,
SwiGLU MLP), final RMSNorm, lm_head. The only unusual part is attention: every layer writes
the step's new K/V into its own cache tensors through ``backend.write_kv`` and attends over
the whole paged history with ``backend.attend``, reusing the one :class:`StepPlan` the caller
made for the step.

The math follows transformers' ``LlamaForCausalLM`` (rotary with the rotate-half convention,
RMSNorm in float32, softmax scale ``head_dim ** -0.5``), so its weights load unchanged
(:func:`load_transformers_weights`) and both produce the same tokens.

Shapes: ``T`` is the step's number of new tokens (all rows together), ``B`` its number of
rows, ``H``/``KVH`` query/KV heads, ``D`` the head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention import AttentionBackend, LayerCache, StepPlan
from kvcache import KVCacheTensors
from kvcache.config import ModelSection

__all__ = [
    "Llama",
    "LlamaShape",
    "load_transformers_weights",
    "random_llama",
    "shape_for_cache",
    "shape_from_transformers",
]


@dataclass(frozen=True)
class LlamaShape:
    """Every size the model needs. The attention part must match the cache config's
    ``model`` section; vocab and MLP sizes are the model's own business."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def check_cache(self, model: ModelSection) -> None:
        """Raise ValueError naming the field when the cache was sized for another model."""
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            ours, theirs = getattr(self, name), getattr(model, name)
            if ours != theirs:
                raise ValueError(
                    f"model.{name}: the cache config says {theirs} but the model has {ours}; "
                    f"use a cache config whose model section matches the weights"
                )


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


def shape_from_transformers(config: Any) -> LlamaShape:
    """The shape of a transformers ``LlamaConfig`` (read by attribute; transformers is not
    imported). Raises ValueError for features this small model leaves out."""
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    refused = {
        "rope_parameters.rope_type": (rope_type, "default"),
        "hidden_act": (getattr(config, "hidden_act", "silu"), "silu"),
        "attention_bias": (getattr(config, "attention_bias", False), False),
        "mlp_bias": (getattr(config, "mlp_bias", False), False),
    }
    for name, (got, want) in refused.items():
        if got != want:
            raise ValueError(
                f"{name}: {got!r} is not supported by examples.llama; it needs {want!r}"
            )
    heads = config.num_attention_heads
    return LlamaShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        # transformers 5 keeps theta in rope_parameters; 4.x had a rope_theta attribute.
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        norm_eps=config.rms_norm_eps,
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


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions`` (int [T]): each float32 [T, 1, head_dim].

    Frequency ``i`` is ``theta ** (-2i / head_dim)``; the table repeats the half-width angles
    twice, which pairs channel ``j`` with ``j + head_dim/2`` (the rotate-half convention).
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    angles = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    table = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
    return table.cos(), table.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, D] by the angles in cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """GQA attention over the paged cache: write this step's K/V, then attend causally."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        self.wq = nn.Linear(shape.hidden_size, shape.num_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=False)
        self.wv = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=False)
        self.wo = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=False)

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
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.w_gate = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.w_up = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.w_down = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = MLP(shape)

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
    """The decoder. Call it once per step with every scheduled row's new tokens."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def forward(
        self,
        token_ids: torch.Tensor,
        cache: KVCacheTensors,
        backend: AttentionBackend,
        plan: StepPlan,
    ) -> torch.Tensor:
        """Run one step; return the logits the step needs.

        token_ids: int64 [T], the new tokens of every row in row order (as in the metadata).
        cache:     per-layer K/V in the cache dtype.
        plan:      ``backend.plan(metadata)`` for this step, shared by every layer.
        Returns float [len(metadata.logits_indices), vocab_size]: row
        ``metadata.sampling_rows_host[j]``'s next-token logits are row j (then padding rows).
        """
        meta = plan.metadata
        cos, sin = rotary_cos_sin(meta.positions, self.shape.head_dim, self.shape.rope_theta)
        h = self.embed(token_ids)  # [T, hidden]
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.layer(index), backend, plan)
        return self.lm_head(self.norm(h[meta.logits_indices]))


# ---- weights -----------------------------------------------------------------------------


def random_llama(
    shape: LlamaShape,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Llama:
    """A model with seeded random weights (the global RNG is left alone).

    Projections are drawn with std ``fan_in ** -0.5`` so activations keep unit scale: then
    attention scores are O(1), attention is far from uniform, and a wrong position or a
    wrong cache slot changes the output (tiny weights would hide such bugs).
    """
    with torch.device("meta"):
        model = Llama(shape)  # no memory, no RNG use; filled below
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "embed.weight":
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
    return model.to(device=device, dtype=dtype).eval()


# Our parameter names -> transformers' names, inside ``model.layers.{i}.``.
_RENAMES = (
    ("attn_norm", "input_layernorm"),
    ("mlp_norm", "post_attention_layernorm"),
    ("attn.wq", "self_attn.q_proj"),
    ("attn.wk", "self_attn.k_proj"),
    ("attn.wv", "self_attn.v_proj"),
    ("attn.wo", "self_attn.o_proj"),
    ("mlp.w_gate", "mlp.gate_proj"),
    ("mlp.w_up", "mlp.up_proj"),
    ("mlp.w_down", "mlp.down_proj"),
)


def _transformers_name(name: str) -> str:
    """Our parameter name -> the key of a transformers ``LlamaForCausalLM`` state dict."""
    if name == "lm_head.weight":
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    for ours, theirs in _RENAMES:
        name = name.replace(f".{ours}.", f".{theirs}.")
    return "model." + name  # layers.{i}.* and norm.weight


def load_transformers_weights(model: Llama, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a transformers ``LlamaForCausalLM`` state dict into ``model`` (cast to its dtype).

    A missing ``lm_head.weight`` (tied embeddings) takes the embedding matrix. Raises
    ValueError listing missing keys, unused keys and shape mismatches; copies nothing then.
    """
    params = dict(model.named_parameters())
    wanted = {_transformers_name(name): name for name in params}
    source = dict(state_dict)
    if "lm_head.weight" not in source and "model.embed_tokens.weight" in source:
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    problems = [f"missing {key}" for key in wanted if key not in source]
    problems += [
        f"unused {key}"
        for key in source
        if key not in wanted and not key.endswith("rotary_emb.inv_freq")
    ]
    problems += [
        f"{key}: expected shape {list(params[ours].shape)}, got {list(source[key].shape)}"
        for key, ours in wanted.items()
        if key in source and source[key].shape != params[ours].shape
    ]
    if problems:
        raise ValueError("state_dict does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for key, ours in wanted.items():
            params[ours].copy_(source[key])
