"""The example model: a Llama-style decoder over the paged KV cache, and its real weights.

| module | what it holds |
| --- | --- |
| ``shape`` | :class:`LlamaShape`: every size and switch; a shape for a cache config |
| ``rotary`` | rotary frequencies (Llama-3 / linear scaling) |
| ``ops`` | RMSNorm (with the residual add) and SiLU x up; ``triton_ops``: their kernels |
| ``layers`` | RMSNorm, attention over the paged cache, the SwiGLU MLP, row-parallel linear |
| ``latent_attention`` | DeepSeek's multi-head latent attention (MLA) over a latent cache, absorbed |
| ``llama`` | :class:`Llama` (embedding, blocks, lm_head); random weights |
| ``sharding`` | the tensor-parallel share of each parameter |
| ``hf_config`` | a shape from a ``config.json`` (Llama, Qwen2, Mistral, Gemma-2/3, dense DeepSeek-V3) |
| ``checkpoints`` | safetensors checkpoints and transformers models into :class:`Llama` |
"""

from .checkpoints import (
    checkpoint_files,
    from_transformers,
    load_checkpoint,
    load_state_dict,
    read_config,
    transformers_names,
)
from .hf_config import SUPPORTED_MODEL_TYPES, attention_spec_for, model_section_for, shape_from_config
from .latent_attention import LatentAttention
from .layers import MLP, Attention, Block, RMSNorm, RowParallelLinear
from .llama import Llama, empty_llama, init_random_, random_llama
from .rotary import rope_inv_freq
from .shape import LlamaShape, MLAShape, RopeScaling, shape_for_cache
from .sharding import param_parts, shard_parameter

__all__ = [
    "MLP",
    "SUPPORTED_MODEL_TYPES",
    "Attention",
    "Block",
    "LatentAttention",
    "Llama",
    "LlamaShape",
    "MLAShape",
    "RMSNorm",
    "RopeScaling",
    "RowParallelLinear",
    "attention_spec_for",
    "checkpoint_files",
    "empty_llama",
    "from_transformers",
    "init_random_",
    "load_checkpoint",
    "load_state_dict",
    "model_section_for",
    "param_parts",
    "random_llama",
    "read_config",
    "rope_inv_freq",
    "shape_for_cache",
    "shape_from_config",
    "shard_parameter",
    "transformers_names",
]
