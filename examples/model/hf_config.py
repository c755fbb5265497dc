"""A model's shape from a Hugging Face config (``config.json`` or a transformers config
object): sizes, rotary scaling and sliding windows of Llama, Qwen2, Mistral, Gemma-2 and
Gemma-3 (text) models, and DeepSeek-V3's latent attention (dense layers only).

Every value is checked: a missing, non-numeric or out-of-range size (each is bounded, so a
hostile config cannot make the loader build a billion layers) raises ValueError naming the
key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention import AttentionSpec
from kvcache.config.schema import ModelSection

from .shape import LlamaShape, MLAShape, RopeScaling

__all__ = ["SUPPORTED_MODEL_TYPES", "attention_spec_for", "model_section_for", "shape_from_config"]

#: ``config.json``'s ``model_type`` values this loader reads.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text", "deepseek_v3")
_GEMMA = ("gemma2", "gemma3_text")
#: transformers' defaults for keys a config.json may leave out (its config classes' defaults).
_MISTRAL_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28

_MISSING = object()


def _reader(config: Mapping[str, Any] | Any) -> Any:
    """``get(key, default)`` over a config.json dict or a transformers config object."""
    if isinstance(config, Mapping):
        return lambda key, default=None: config.get(key, default)
    return lambda key, default=None: getattr(config, key, default)


#: Upper bounds of a config's sizes: a hostile config.json must not make the loader build a
#: billion layers (the largest released models stay far below each).
_LIMITS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 23,
    "head_dim": 1024,
    "sliding_window": 1 << 30,
    "max_window_layers": 1 << 20,
    "sliding_window_pattern": 1 << 20,
    "original_max_position_embeddings": 1 << 30,
    "max_position_embeddings": 1 << 30,
    "kv_lora_rank": 4096,
    "q_lora_rank": 1 << 17,
    "qk_rope_head_dim": 4096,
    "qk_nope_head_dim": 4096,
    "v_head_dim": 4096,
    "first_k_dense_replace": 1 << 20,
}


def _refuse(field: str, got: object, why: str) -> ValueError:
    return ValueError(f"{field}: {got!r} is not supported by the example model; {why}")


def _size(get: Any, key: str, default: object = _MISSING, *, minimum: int = 1) -> int:
    """The integer ``key`` of the config, in ``[minimum, _LIMITS[key]]``; ValueError naming
    the key for a missing (without ``default``), non-integer or out-of-range value."""
    value = get(key, None)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{key}: missing from the checkpoint config; config.json must give it")
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: {value!r:.60} is not an integer")
    if not minimum <= value <= _LIMITS[key]:
        raise ValueError(f"{key}: {value} is outside [{minimum}, {_LIMITS[key]}]")
    return value


def _number(get: Any, key: str, default: float, *, where: Mapping[str, Any] | None = None) -> float:
    """A positive finite float (from ``where`` when given, else the config)."""
    value = where.get(key, None) if where is not None else get(key, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
        raise ValueError(f"{key}: {value!r:.60} is not a positive finite number")
    return float(value)


def shape_from_config(config: Mapping[str, Any] | Any) -> LlamaShape:
    """The :class:`LlamaShape` of a checkpoint config: a ``config.json`` dict or a
    transformers ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` (read by key or
    attribute; transformers is not imported).

    Per model type, as transformers builds the model:
      llama:   ``attention_bias`` puts biases on q/k/v/o, ``mlp_bias`` on the MLP; no window.
      qwen2:   q/k/v always have biases, o_proj none; the window applies only with
               ``use_sliding_window``, to the layers ``layer_types`` marks
               ``sliding_attention`` (else to layers ``>= max_window_layers``).
      mistral: no biases; ``sliding_window`` (transformers' default 4096 when the key is
               absent, none when null) applies to every layer.
      deepseek_v3: multi-head latent attention (:class:`MLAShape`: ``kv_lora_rank``,
               ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``, ``q_lora_rank``,
               ``rope_interleave``), softmax scale ``(qk_nope_head_dim + qk_rope_head_dim) **
               -0.5``; dense MLPs only (``first_k_dense_replace`` >= the layer count: the
               example model has no mixture of experts); no attention bias.
      gemma2, gemma3_text: norms scaled by 1 + weight, embeddings by sqrt(hidden_size),
               sandwich norms, GeGLU (``gelu_pytorch_tanh``), softmax scale
               ``query_pre_attn_scalar ** -0.5``, ``attn_logit_softcapping`` and
               ``final_logit_softcapping`` (Gemma-2), q/k norms (Gemma-3); windowed layers
               from ``layer_types`` (else every other one from layer 0 for Gemma-2, five in
               six for Gemma-3); Gemma-3's windowed layers rotate with their own base
               (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``).
    Rotary: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x
    files), of type default, linear or llama3. Raises ValueError naming the field for
    anything else the model does not implement.
    """
    get = _reader(config)
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    gemma = model_type in _GEMMA
    if gemma:
        activation = get("hidden_activation") or get("hidden_act", "gelu_pytorch_tanh")
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise _refuse("hidden_activation", activation, "it needs 'gelu_pytorch_tanh'")
    elif get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", get("hidden_act"), "it needs 'silu'")
    heads = _size(get, "num_attention_heads")
    hidden = _size(get, "hidden_size")
    layers = _size(get, "num_hidden_layers")
    if model_type == "deepseek_v3":
        return _deepseek(get, heads, hidden, layers)
    kv_heads = _size(get, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}; each KV head serves "
            "a whole group of query heads"
        )
    head_dim = _size(get, "head_dim", 256 if gemma else hidden // heads if hidden >= heads else 0)
    if model_type == "llama" or gemma:
        qkv_bias = o_bias = bool(get("attention_bias", False))
        mlp_bias = bool(get("mlp_bias", False))
    else:
        qkv_bias, o_bias, mlp_bias = model_type == "qwen2", False, False
    window, window_layers = _window(model_type, get, layers)
    return LlamaShape(
        vocab_size=_size(get, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_size(get, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=_number(get, "rms_norm_eps", 1e-6),
        **(_gemma_rope(get) if model_type == "gemma3_text" else _rope(get)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=bool(get("tie_word_embeddings", gemma)),
        sliding_window=window,
        window_layers=window_layers,
        **(_gemma(get, model_type) if gemma else {}),
        max_positions=_max_positions(get),
    )


def _max_positions(get: Any) -> int | None:
    """``max_position_embeddings``, or None when the config leaves it out."""
    return None if get("max_position_embeddings") is None else _size(get, "max_position_embeddings")


def _deepseek(get: Any, heads: int, hidden: int, layers: int) -> LlamaShape:
    """DeepSeek-V3 with dense MLPs: latent attention, SwiGLU, no biases."""
    dense = _size(get, "first_k_dense_replace", layers, minimum=0)
    if dense < layers and get("n_routed_experts") not in (None, 0):
        raise _refuse(
            "first_k_dense_replace", dense, f"layers {dense}.. are mixtures of experts; it needs every layer dense "
            f"(first_k_dense_replace >= num_hidden_layers = {layers})"
        )
    if get("attention_bias", False):
        raise _refuse("attention_bias", True, "its latent attention has no biases")
    q_lora = get("q_lora_rank")
    mla = MLAShape(
        kv_lora_rank=_size(get, "kv_lora_rank"),
        qk_rope_head_dim=_size(get, "qk_rope_head_dim", minimum=2),
        qk_nope_head_dim=_size(get, "qk_nope_head_dim"),
        v_head_dim=_size(get, "v_head_dim"),
        q_lora_rank=None if q_lora is None else _size(get, "q_lora_rank"),
        rope_interleave=bool(get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim: {mla.qk_rope_head_dim} is odd; rotary pairs channels")
    return LlamaShape(
        vocab_size=_size(get, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_size(get, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        norm_eps=_number(get, "rms_norm_eps", 1e-6),
        **_rope(get),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        softmax_scale=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5,
        mla=mla,
        max_positions=_max_positions(get),
    )


def _optional_number(get: Any, key: str) -> float | None:
    """A positive finite float, or None when the key is absent or null."""
    return None if get(key) is None else _number(get, key, 1.0)


def _gemma(get: Any, model_type: str) -> dict[str, Any]:
    """The LlamaShape switches of Gemma-2 / Gemma-3."""
    return {
        "norm_offset": True,
        "embed_scale": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "softmax_scale": _number(get, "query_pre_attn_scalar", 256.0) ** -0.5,
        "logit_softcap": _optional_number(get, "attn_logit_softcapping"),
        "final_logit_softcap": _optional_number(get, "final_logit_softcapping"),
        "qk_norm": model_type == "gemma3_text",
    }


def _gemma_rope(get: Any) -> dict[str, Any]:
    """Gemma-3's two rotaries: the full layers' (rope_theta, rope_scaling) and the windowed
    layers' base (``local_rope_theta``), from per-layer-type ``rope_parameters`` or the 4.x keys."""
    params = get("rope_parameters")
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        full, local = params.get("full_attention"), params.get("sliding_attention")
        if not isinstance(full, Mapping) or not isinstance(local, Mapping):
            raise ValueError("rope_parameters: Gemma-3 needs 'full_attention' and 'sliding_attention' entries")
        if local.get("rope_type", "default") != "default":
            raise _refuse("rope_parameters.sliding_attention.rope_type", local.get("rope_type"), "it needs default")
        found = _rope(lambda key, default=None: full if key == "rope_parameters" else get(key, default))
        return {**found, "local_rope_theta": _number(get, "rope_theta", 10000.0, where=local)}
    return {**_rope(get), "local_rope_theta": _number(get, "rope_local_base_freq", 10000.0)}


def _rope(get: Any) -> dict[str, Any]:
    params = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters: {params!r:.60} is not a mapping")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse("rope_parameters", "per layer type", "it needs one set for every layer")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _number(get, "rope_theta", _number(get, "rope_theta", 10000.0), where=params)
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "it rotates every channel (1.0)")
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}

    def factor(key: str) -> float:
        if key not in params:
            raise ValueError(f"rope_parameters.{key}: missing for rope_type {kind!r}")
        return _number(get, key, 1.0, where=params)

    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": RopeScaling("linear", factor("factor"))}
    if kind == "llama3":
        original = params.get("original_max_position_embeddings")
        scaling = RopeScaling(
            "llama3",
            factor("factor"),
            factor("low_freq_factor"),
            factor("high_freq_factor"),
            _size(lambda key, default=None: original, "original_max_position_embeddings")
            if original is not None
            else _size(get, "max_position_embeddings"),
        )
        return {"rope_theta": theta, "rope_scaling": scaling}
    raise _refuse("rope_parameters.rope_type", kind, "it needs default, linear or llama3")


def _window(model_type: str, get: Any, layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, window_layers) in :class:`attention.AttentionSpec`'s terms."""
    if model_type == "llama":
        return None, None
    if model_type == "mistral":
        window = get("sliding_window", _MISSING)
        if window is _MISSING:
            return _MISTRAL_DEFAULT_WINDOW, None
        return (None if window is None else _size(get, "sliding_window")), None
    gemma = model_type in _GEMMA
    if get("sliding_window") is None or not (gemma or get("use_sliding_window", False)):
        return None, None
    window = _size(get, "sliding_window")
    types = get("layer_types")
    if types is not None:
        pattern = _layer_types(types, layers)
    elif model_type == "gemma2":
        pattern = tuple(i % 2 == 0 for i in range(layers))
    elif model_type == "gemma3_text":
        every = _size(get, "sliding_window_pattern", 6)
        pattern = tuple((i + 1) % every != 0 for i in range(layers))
    else:
        first = _size(get, "max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS, minimum=0)
        pattern = tuple(i >= first for i in range(layers))
    if not any(pattern):
        return None, None
    return window, None if all(pattern) else pattern


def _layer_types(types: Any, layers: int) -> tuple[bool, ...]:
    """Per layer, whether ``layer_types`` marks it ``sliding_attention``."""
    if not isinstance(types, (list, tuple)):
        raise ValueError(f"layer_types: {types!r:.60} is not a list")
    if len(types) != layers:
        raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers {layers}; give one per layer")
    unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if unknown:
        raise _refuse("layer_types", unknown[0], "it knows full_attention and sliding_attention")
    return tuple(t == "sliding_attention" for t in types)


def model_section_for(config: Mapping[str, Any] | Any) -> ModelSection:
    """The cache config's ``model`` section for a checkpoint config."""
    return shape_from_config(config).model_section()


def attention_spec_for(
    config: Mapping[str, Any] | Any, dtype: str = "bfloat16", kv_cache_dtype: str | None = None
) -> AttentionSpec:
    """The attention shape (heads, head_dim, window, per-layer window pattern) a backend
    serves for a checkpoint config, computing in ``dtype``."""
    return shape_from_config(config).attention_spec(dtype, kv_cache_dtype)
