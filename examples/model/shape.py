"""The model's sizes and switches (:class:`LlamaShape`), and a shape that fits a cache config.

The attention part must match the cache config's ``model`` section; vocabulary and MLP sizes
are the model's own. Reading a shape from a Hugging Face ``config.json`` lives in
:mod:`examples.model.hf_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention import AttentionSpec
from attention.errors import InvalidArgumentError
from kvcache.config.schema import ModelSection
from kvcache.parallel.heads import TensorParallel, rank_spec

__all__ = ["LlamaShape", "MLAShape", "RopeScaling", "shape_for_cache"]


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
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3): what a layer caches per token is one
    latent of ``kv_lora_rank + qk_rope_head_dim`` values shared by every head, not K and V.

    kv_lora_rank:     the compressed K/V (``kv_a_proj_with_mqa`` then ``kv_a_layernorm``).
    qk_rope_head_dim: the rotary part of q and k (k's is shared by every head).
    qk_nope_head_dim: the non-rotary part of each head's q and k (k's from ``kv_b_proj``).
    v_head_dim:       each head's value width (from ``kv_b_proj``).
    q_lora_rank:      q through a low-rank projection and a norm (V3: 1536); None: one projection.
    rope_interleave:  the rotary channels come in interleaved pairs (DeepSeek's layout).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LlamaShape:
    """Every size and switch the model needs. The attention part must match the cache
    config's ``model`` section; vocab and MLP sizes are the model's own business.

    qkv_bias / o_bias / mlp_bias: biases on those projections (Qwen2: q/k/v only).
    tie_word_embeddings: lm_head is the embedding matrix (one tensor).
    sliding_window, window_layers: as in :class:`attention.AttentionSpec` (Mistral: every
    layer windowed; Qwen2, Gemma-2 and Gemma-3: per layer). Only the attention backend reads them.

    What Gemma-2 and Gemma-3 change (all off for Llama):
    norm_offset:   norms scale by ``1 + weight``, in float32, then round.
    embed_scale:   embeddings are multiplied by ``sqrt(hidden_size)`` (in the model's dtype).
    sandwich_norms: each block normalises its attention and MLP outputs too, before the
                   residual add (``post_attention`` / ``post_feedforward`` norms).
    mlp_activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, tanh-approximated GELU).
    softmax_scale: the scale of q.k (Gemma: ``query_pre_attn_scalar ** -0.5``); None:
                   ``head_dim ** -0.5``.
    logit_softcap: attention scores capped to ``c * tanh(s / c)`` (Gemma-2: 50).
    final_logit_softcap: the output logits capped the same way (Gemma-2: 30).
    qk_norm:       q and k normalised per head before rotary (Gemma-3).
    local_rope_theta: rotary base of the windowed layers (Gemma-3: 10,000, no scaling); the
                   full layers use ``rope_theta`` and ``rope_scaling``. None: one rotary for all.

    mla: multi-head latent attention (DeepSeek): the cache holds one latent per token and
    layer, which the attention spec serves as one KV head of ``mla.latent_dim`` channels (the
    shape's ``num_kv_heads`` is 1 and ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``,
    as in the config): each head's query is absorbed into the latent space (its non-rotary
    part times ``kv_b_proj``'s key half) and attends over the latents, whose first
    ``kv_lora_rank`` values are also the values (``kv_b_proj``'s value half maps them back
    after attention).
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
    norm_offset: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    softmax_scale: float | None = None
    logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    qk_norm: bool = False
    local_rope_theta: float | None = None
    mla: MLAShape | None = None
    #: The most positions the model was trained for (a checkpoint's
    #: ``max_position_embeddings``): the engine refuses a request whose prompt and new tokens
    #: exceed it. None: no limit known (random weights, or a config without the key).
    max_positions: int | None = None

    @property
    def rotary_dim(self) -> int:
        """Channels the rotary rotates: the head (or, with MLA, the rotary part of q and k)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` attends to the last ``sliding_window`` tokens only."""
        if self.sliding_window is None:
            return False
        return self.window_layers is None or self.window_layers[layer]

    def check_cache(self, model: ModelSection) -> None:
        """Raise ValueError naming the field when the cache was sized for another model (a
        section without a window fits a windowed model too: older configs have none)."""
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            ours, theirs = getattr(self, name), getattr(model, name)
            if ours != theirs:
                raise ValueError(
                    f"model.{name}: the cache config says {theirs} but the model has {ours}; "
                    f"use a cache config whose model section matches the weights"
                )

    def model_section(self) -> ModelSection:
        """The cache config's ``model`` section for this model: its attention shape, sliding
        window and window pattern (so the config's KV groups and ``kvcache plan`` are the
        model's) and score cap."""
        return ModelSection(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sliding_window=self.sliding_window,
            window_pattern=self.window_layers if self.sliding_window is not None else None,
            logit_softcap=self.logit_softcap,
            kv_lora_rank=None if self.mla is None else self.mla.kv_lora_rank,
            qk_rope_head_dim=None if self.mla is None else self.mla.qk_rope_head_dim,
            qk_nope_head_dim=None if self.mla is None else self.mla.qk_nope_head_dim,
            v_head_dim=None if self.mla is None else self.mla.v_head_dim,
        )

    def check_tp(self, tp: TensorParallel) -> None:
        """Raise InvalidArgumentError when the model does not split over ``tp.size`` ranks
        (heads, see :mod:`kvcache.parallel.heads`; the MLP width must divide evenly too)."""
        # MLA: the one latent "KV head" is replicated on every rank (each keeps the whole
        # latent cache), the query heads are split.
        tp.check_heads(self.num_heads, 1 if self.mla is not None else self.num_kv_heads)
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

        It carries what the config's ``model`` section has no field for (Gemma's softmax
        scale), so build the backend from this spec. With MLA it is MQA over the latent: one
        KV head of ``mla.latent_dim`` channels (``latent_attention``), scaled as the
        uncompressed q . k.
        """
        if self.mla is not None:
            spec = AttentionSpec(
                num_heads=self.num_heads,
                num_kv_heads=1,
                head_dim=self.mla.latent_dim,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype if kv_cache_dtype != dtype else None,
                softmax_scale=(self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5,
                latent_rank=self.mla.kv_lora_rank,
            )
            return spec if tp is None else rank_spec(spec, tp)
        spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype if kv_cache_dtype != dtype else None,
            sliding_window=self.sliding_window,
            window_layers=self.window_layers,
            softmax_scale=self.softmax_scale,
            logit_softcap=self.logit_softcap,
        )
        return spec if tp is None else rank_spec(spec, tp)


def shape_for_cache(model: ModelSection, *, vocab_size: int = 256, intermediate_size: int | None = None) -> LlamaShape:
    """A model shape that fits a cache config's ``model`` section.

    The cache config describes only attention (it forbids other keys), so the vocabulary and
    MLP width are example-only choices made here. The MLP defaults to ~8/3 of the hidden
    size rounded up to a multiple of 32, Llama's usual ratio. The section's sliding window,
    window pattern and score cap are the model's. Raises ValueError for attention sinks
    (learned per-head logits this example model does not have).
    """
    if model.attention_sinks:
        raise ValueError(
            "model.attention_sinks: the example model has no learned sink logits; serve a config without them"
        )
    hidden = model.num_heads * model.head_dim
    if intermediate_size is None:
        intermediate_size = -(-8 * hidden // 3 // 32) * 32
    mla = None
    if model.kv_lora_rank is not None and model.qk_rope_head_dim is not None:
        mla = MLAShape(
            kv_lora_rank=model.kv_lora_rank,
            qk_rope_head_dim=model.qk_rope_head_dim,
            qk_nope_head_dim=model.qk_nope_head_dim or model.head_dim - model.qk_rope_head_dim,
            v_head_dim=model.v_head_dim or model.head_dim,
        )
    return LlamaShape(
        mla=mla,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        sliding_window=model.sliding_window,
        window_layers=model.window_pattern,
        logit_softcap=model.logit_softcap,
    )
