"""A model's shape from a Hugging Face config (``config.json`` or a transformers config
object): sizes, rotary scaling and sliding windows of Llama, Qwen2 and Mistral models.

Every value is checked: a missing, non-numeric or out-of-range size raises ValueError naming
the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention import AttentionSpec
from examples.model.shape import LlamaShape, RopeScaling
from kvcache.config.schema import ModelSection

__all__ = ["SUPPORTED_MODEL_TYPES", "attention_spec_for", "model_section_for", "shape_from_config"]

#: ``config.json``'s ``model_type`` values this loader reads.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
#: transformers' defaults for keys a config.json may leave out (its config classes' defaults).
_MISTRAL_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28

_MISSING = object()


def _reader(config: Mapping[str, Any] | Any) -> Any:
    """``get(key, default)`` over a config.json dict or a transformers config object."""
    if isinstance(config, Mapping):
        return lambda key, default=None: config.get(key, default)
    return lambda key, default=None: getattr(config, key, default)


def _refuse(field: str, got: object, why: str) -> ValueError:
    return ValueError(f"{field}: {got!r} is not supported by the example model; {why}")


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
    Rotary: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x
    files), of type default, linear or llama3. Raises ValueError naming the field for
    anything else the model does not implement.
    """
    get = _reader(config)
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", get("hidden_act"), "it needs 'silu'")
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    layers = int(get("num_hidden_layers"))
    if model_type == "llama":
        qkv_bias = o_bias = bool(get("attention_bias", False))
        mlp_bias = bool(get("mlp_bias", False))
    else:
        qkv_bias, o_bias, mlp_bias = model_type == "qwen2", False, False
    window, window_layers = _window(model_type, get, layers)
    return LlamaShape(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or hidden // heads),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        **_rope(get),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        sliding_window=window,
        window_layers=window_layers,
    )


def _rope(get: Any) -> dict[str, Any]:
    params = get("rope_parameters") or get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse("rope_parameters", "per layer type", "it needs one set for every layer")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "it rotates every channel (1.0)")
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": RopeScaling("linear", float(params["factor"]))}
    if kind == "llama3":
        scaling = RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings") or get("max_position_embeddings")),
        )
        return {"rope_theta": theta, "rope_scaling": scaling}
    raise _refuse("rope_parameters.rope_type", kind, "it needs default, linear or llama3")


def _window(model_type: str, get: Any, layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, window_layers) in :class:`attention.AttentionSpec`'s terms."""
    if model_type == "llama":
        return None, None
    if model_type == "mistral":
        window = get("sliding_window", _MISSING)
        return (_MISTRAL_DEFAULT_WINDOW if window is _MISSING else window), None
    if not get("use_sliding_window", False) or get("sliding_window") is None:
        return None, None
    window = int(get("sliding_window"))
    types = get("layer_types")
    if types is None:
        first = int(get("max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS))
        pattern = tuple(i >= first for i in range(layers))
    else:
        if len(types) != layers:
            raise ValueError(f"layer_types: {len(types)} entries for num_hidden_layers {layers}; give one per layer")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise _refuse("layer_types", unknown[0], "it knows full_attention and sliding_attention")
        pattern = tuple(t == "sliding_attention" for t in types)
    if not any(pattern):
        return None, None
    return window, None if all(pattern) else pattern


def model_section_for(config: Mapping[str, Any] | Any) -> ModelSection:
    """The cache config's ``model`` section for a checkpoint config."""
    return shape_from_config(config).model_section()


def attention_spec_for(
    config: Mapping[str, Any] | Any, dtype: str = "bfloat16", kv_cache_dtype: str | None = None
) -> AttentionSpec:
    """The attention shape (heads, head_dim, window, per-layer window pattern) a backend
    serves for a checkpoint config, computing in ``dtype``."""
    return shape_from_config(config).attention_spec(dtype, kv_cache_dtype)
