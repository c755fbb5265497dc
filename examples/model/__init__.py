"""The example model: a Llama-style decoder over the paged KV cache, and its real weights.

| module | what it holds |
| --- | --- |
| ``shape`` | :class:`LlamaShape`: every size and switch; a shape for a cache config |
| ``rotary`` | rotary frequencies (Llama-3 / linear scaling), cos/sin tables, the rotation |
| ``layers`` | RMSNorm, attention over the paged cache, the SwiGLU MLP, row-parallel linear |
| ``llama`` | :class:`Llama` (embedding, blocks, lm_head); random weights |
| ``sharding`` | the tensor-parallel share of each parameter |
| ``hf_config`` | a shape from a Hugging Face ``config.json`` (Llama, Qwen2, Mistral) |
| ``checkpoints`` | safetensors checkpoints and transformers models into :class:`Llama` |
"""

from examples.model.checkpoints import (
    checkpoint_files,
    from_transformers,
    load_checkpoint,
    load_state_dict,
    read_config,
    transformers_names,
)
from examples.model.hf_config import SUPPORTED_MODEL_TYPES, attention_spec_for, model_section_for, shape_from_config
from examples.model.layers import MLP, Attention, Block, RMSNorm, RowParallelLinear
from examples.model.llama import Llama, empty_llama, init_random_, random_llama
from examples.model.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin
from examples.model.shape import LlamaShape, RopeScaling, shape_for_cache
from examples.model.sharding import shard_parameter, shard_range

__all__ = [
    "MLP",
    "SUPPORTED_MODEL_TYPES",
    "Attention",
    "Block",
    "Llama",
    "LlamaShape",
    "RMSNorm",
    "RopeScaling",
    "RowParallelLinear",
    "apply_rotary",
    "attention_spec_for",
    "checkpoint_files",
    "empty_llama",
    "from_transformers",
    "init_random_",
    "load_checkpoint",
    "load_state_dict",
    "model_section_for",
    "random_llama",
    "read_config",
    "rope_inv_freq",
    "rotary_cos_sin",
    "shape_for_cache",
    "shape_from_config",
    "shard_parameter",
    "shard_range",
    "transformers_names",
]
