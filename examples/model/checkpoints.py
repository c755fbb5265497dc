"""Real weights for :mod:`examples.model`: Hugging Face Llama, Qwen2, Mistral, Gemma-2, Gemma-3
and dense DeepSeek-V3 checkpoints.

    model = load_checkpoint("path/to/Qwen2.5-0.5B", device="cuda", dtype=torch.bfloat16)
    model = from_transformers(hf_model)            # shares the tensors of a loaded transformers model
    spec = shape_from_config(config).attention_spec("bfloat16")   # the sliding window included

A checkpoint directory holds ``config.json`` and safetensors weights: one
``model.safetensors``, or shards listed in ``model.safetensors.index.json``. Shards are read
lazily (``safetensors.safe_open`` maps the file; one tensor at a time is read, cast and copied
into a parameter already allocated on the target device in the target dtype), so an 8B
checkpoint needs its 16 GB once, on the device, and one tensor's worth of host memory.

Every name and shape is checked against the model before anything is allocated; a mismatch
raises ValueError listing each missing key, unused key and wrong shape.

Tensor parallelism (``tp=TensorParallel(size, rank)``): checkpoints hold the full tensors;
each rank keeps its share (:func:`examples.model.sharding.param_parts`), and :func:`load_checkpoint`
reads only that share from the file (a safetensors slice), so a rank never holds a whole
sharded tensor in host memory.

Imports are lazy: safetensors only for :func:`load_checkpoint` (``pip install
-e '.[hf]'`` in the checkout), transformers never (:func:`from_transformers` reads the model it is
given).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attention.dtypes import torch_dtype
from kvcache.parallel.heads import TensorParallel

from .hf_config import shape_from_config
from .llama import Llama, empty_llama
from .shape import LlamaShape
from .sharding import Part, param_parts

__all__ = [
    "checkpoint_files",
    "from_transformers",
    "load_checkpoint",
    "load_state_dict",
    "read_config",
    "transformers_names",
    "transformers_sources",
]


# ---- parameter names ---------------------------------------------------------------------

# Our module names -> transformers' names, inside ``model.layers.{i}.``.
_RENAMES = (
    ("attn_norm", "input_layernorm"),
    ("mlp_norm", "post_attention_layernorm"),
    ("attn.wo", "self_attn.o_proj"),
    ("mlp.w_down", "mlp.down_proj"),
    ("attn.q_norm", "self_attn.q_norm"),
    ("attn.k_norm", "self_attn.k_norm"),
    ("attn", "self_attn"),  # the rest of the attention (DeepSeek's latent projections) by their own names
)
#: The same for blocks with sandwich norms (Gemma-2, Gemma-3): four norms per block.
_SANDWICH_RENAMES = (
    ("attn_norm", "input_layernorm"),
    ("attn_post_norm", "post_attention_layernorm"),
    ("mlp_norm", "pre_feedforward_layernorm"),
    ("mlp_post_norm", "post_feedforward_layernorm"),
    *_RENAMES[2:],
)
#: Our fused modules -> the transformers modules of their parts, in order (see
#: :mod:`examples.model.sharding`).
_FUSED_SOURCES = {
    "attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class Source:
    """Where one transformers tensor goes: part ``part`` of our parameter ``param``."""

    param: str
    part: int


#: MLA's fused input projection (``LatentAttention.wqkv_a``): without and with a query LoRA.
_MLA_FUSED_SOURCES = {
    False: ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
    True: ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
}


def _transformers_names(name: str, shape: LlamaShape) -> list[str]:
    """transformers' keys of our parameter ``name``: one, or one per part of a fused one."""
    if name == "lm_head.weight":
        return [name]
    if name == "embed.weight":
        return ["model.embed_tokens.weight"]
    fused_sources = dict(_FUSED_SOURCES)
    if shape.mla is not None:
        fused_sources["attn.wqkv_a"] = _MLA_FUSED_SOURCES[shape.mla.q_lora_rank is not None]
    sandwich = shape.sandwich_norms
    for fused, sources in fused_sources.items():
        if f".{fused}." in name:
            return ["model." + name.replace(f".{fused}.", f".{source}.") for source in sources]
    for ours, theirs in _SANDWICH_RENAMES if sandwich else _RENAMES:
        if f".{ours}." in name:
            return ["model." + name.replace(f".{ours}.", f".{theirs}.")]
    return ["model." + name]  # layers.{i}.* and norm.weight


def transformers_sources(model: Llama) -> dict[str, Source]:
    """transformers' state-dict key -> where it goes in ``model``, for every parameter (a tied
    lm_head is the embedding, listed once)."""
    return {
        key: Source(name, part)
        for name, _ in model.named_parameters()
        for part, key in enumerate(_transformers_names(name, model.shape))
    }


def transformers_names(model: Llama) -> dict[str, str]:
    """transformers' state-dict key -> our parameter name (several keys name a fused one)."""
    return {key: source.param for key, source in transformers_sources(model).items()}


def _ignored(key: str, shape: LlamaShape) -> bool:
    """Keys a checkpoint may carry that the model has no parameter for."""
    return key.endswith("rotary_emb.inv_freq") or (shape.tie_word_embeddings and key == "lm_head.weight")


def _full_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Our parameters' full (unsharded) shapes, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        full = Llama(shape)
    return {name: tuple(p.shape) for name, p in full.named_parameters()}


def _layout(model: Llama) -> dict[str, tuple[Source, Part]]:
    """transformers' key -> (its source, the part with rank ``model.tp``'s share)."""
    full = _full_shapes(model.shape)
    parts = {name: param_parts(name, full[name], model.shape, model.tp) for name in full}
    return {key: (src, parts[src.param][src.part]) for key, src in transformers_sources(model).items()}


def _expected_shape(full: tuple[int, ...], part: Part) -> tuple[int, ...]:
    """The full transformers tensor of ``part`` (a fused part is a slice of our parameter)."""
    return tuple(part.full if d == part.dim else n for d, n in enumerate(full))


def _problems(model: Llama, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Problems of a full (unsharded) state dict's ``shapes`` for ``model`` (which may be a
    rank's share: it is compared with the full model's shapes)."""
    full = _full_shapes(model.shape)
    layout = _layout(model)
    found = [f"missing {key}" for key in layout if key not in shapes]
    found += [f"unused {key}" for key in shapes if key not in layout and not _ignored(key, model.shape)]
    for key, (src, part) in layout.items():
        want = _expected_shape(full[src.param], part)
        if key in shapes and tuple(shapes[key]) != want:
            found.append(f"{key}: expected shape {list(want)}, got {list(shapes[key])}")
    return found


def _share(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """The rank's share of a part's full tensor (the tensor itself when it keeps all of it)."""
    if (part.start, part.length) == (0, part.full):
        return tensor
    return tensor.narrow(part.dim, part.start, part.length)


def load_state_dict(model: Llama, state_dict: Mapping[str, torch.Tensor], *, share: bool = False) -> None:
    """Put a transformers ``*ForCausalLM`` state dict (full tensors) into ``model`` (a
    tensor-parallel model takes its rank's share of each).

    share=False: copy into the existing parameters (cast to their dtype and device).
    share=True:  make the state dict's tensors the parameters (no copy: both models then use
                 the same memory; dtype and device are the tensors'). A fused parameter
                 (q/k/v, gate/up, MLA's q and kv_a) and a rank's share of a row-parallel
                 weight (columns) are not one tensor of the source and are copied.
    Raises ValueError listing missing keys, unused keys and shape mismatches; changes
    nothing then.
    """
    problems = _problems(model, {k: tuple(v.shape) for k, v in state_dict.items()})
    if problems:
        raise ValueError("state_dict does not fit the model: " + "; ".join(problems))
    params = dict(model.named_parameters())
    pieces: dict[str, list[tuple[Part, torch.Tensor]]] = {}
    for key, (src, part) in _layout(model).items():
        pieces.setdefault(src.param, []).append((part, _share(state_dict[key], part)))
    with torch.no_grad():
        for name, parts in pieces.items():
            if share:
                tensors = [t for _, t in sorted(parts, key=lambda p: p[0].offset)]
                joined = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=parts[0][0].dim)
                module_name, _, attr = name.rpartition(".")
                shared = nn.Parameter(joined.detach().contiguous(), requires_grad=False)
                setattr(model.get_submodule(module_name), attr, shared)
            else:
                for part, tensor in parts:
                    params[name].narrow(part.dim, part.offset, part.length).copy_(tensor)
    if share:
        model.tie_weights()


def from_transformers(
    model: nn.Module,
    *,
    share: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp: TensorParallel | None = None,
) -> Llama:
    """Our model with the weights of a transformers ``LlamaForCausalLM`` /
    ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` / ``Gemma2ForCausalLM`` /
    ``Gemma3ForCausalLM`` / ``DeepseekV3ForCausalLM`` (dense layers); with ``tp``, that rank's share.

    share=True (default): the same tensors, no copy (``dtype``/``device`` must be None).
    share=False: a copy in ``dtype`` on ``device`` (default: the source's).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    shape = shape_from_config(config)
    state = model.state_dict()
    if share:
        if dtype is not None or device is not None:
            raise ValueError("dtype/device: a shared model keeps the source's tensors; pass share=False to convert")
        with torch.device("meta"):
            ours = Llama(shape, tp)
        load_state_dict(ours, state, share=True)
        return ours.eval()
    first = next(iter(state.values()))
    ours = empty_llama(shape, dtype=dtype or first.dtype, device=device or first.device, tp=tp)
    load_state_dict(ours, state)
    return ours


# ---- checkpoint directories --------------------------------------------------------------


#: The largest config.json or index.json read (real ones are a few KiB; an index of a
#: thousand-shard checkpoint is a few MiB).
MAX_JSON_BYTES = 64 << 20


def _read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``file``; ValueError naming the file when it is too large, not
    JSON (truncated, say) or not an object."""
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{file}: {size} bytes; a {what} over {MAX_JSON_BYTES} bytes is not read")
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not a readable {what} ({err}); is the file truncated?") from err
    if not isinstance(value, dict):
        raise ValueError(f"{file}: a {what} holds a JSON object, got {type(value).__name__}")
    return value


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory. Raises FileNotFoundError naming the file,
    ValueError naming it when it is not a JSON object."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no config.json; a checkpoint directory holds config.json and *.safetensors")
    return _read_json(file, "config.json")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards ``model.safetensors.index.json``
    lists (in order), else ``model.safetensors``, else every ``*.safetensors``. A shard the
    index names must be a file directly in the directory (no path outside it); ValueError
    naming the index otherwise, FileNotFoundError naming a missing shard."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
        files = []
        for name in dict.fromkeys(weight_map.values()):
            if Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(
                    f"{index}: shard {name!r:.100} is not a file name in the checkpoint directory; an index may "
                    "only name files beside it"
                )
            shard = root / name
            if not shard.is_file():
                raise FileNotFoundError(f"{shard}: listed in {index.name} but missing")
            files.append(shard)
        return files
    single = root / "model.safetensors"
    files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root}: no *.safetensors weights (only safetensors checkpoints are read; convert "
            f"pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError(
            "loading a checkpoint needs the safetensors package; run: pip install -e '.[hf]' in the project checkout"
        ) from err
    return safe_open


def _tensors(
    files: list[Path], ranges: Mapping[str, tuple[int, int, int] | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, CPU tensor) for the keys of ``ranges``, one shard open at a time, one tensor read
    at a time; a key with a ``(dim, start, length)`` range is read only there."""
    safe_open = _safe_open()
    for file in files:
        with _unreadable_named(file), safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if key not in ranges:
                    continue
                where = ranges[key]
                if where is None:
                    tensor = f.get_tensor(key)
                else:
                    dim, start, length = where
                    index = (slice(None),) * dim + (slice(start, start + length),)
                    tensor = f.get_slice(key)[index]
                yield key, tensor


@contextlib.contextmanager
def _unreadable_named(file: Path) -> Iterator[None]:
    """A safetensors error (a truncated file, a header that claims more bytes than the file
    has, a tensor past its end) as ValueError naming ``file``; safetensors' own messages name
    no file."""
    try:
        yield
    except Exception as err:
        raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from err


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp: TensorParallel | None = None,
) -> Llama:
    """Our model with the weights of a checkpoint directory, on ``device`` in ``dtype``
    (default: the checkpoint's ``dtype`` / ``torch_dtype``, else float32); with ``tp``, that
    rank's share (read from the file alone).

    Checks every name and shape from the shard headers first (ValueError listing the
    problems, before any allocation), then allocates the model once on the device and
    fills it shard by shard. Raises ImportError naming the pip extra without safetensors.
    """
    config = read_config(path)
    shape = shape_from_config(config)
    files = checkpoint_files(path)
    safe_open = _safe_open()
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with _unreadable_named(file), safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118
                shapes[key] = tuple(f.get_slice(key).get_shape())
    if dtype is None:
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
        dtype = torch_dtype(name)
    with torch.device("meta"):
        probe = Llama(shape)  # names and shapes only
    problems = _problems(probe, shapes)
    if problems:
        raise ValueError(f"{path}: the checkpoint does not fit the model: " + "; ".join(problems))
    model = empty_llama(shape, dtype=dtype, device=device, tp=tp)
    params = dict(model.named_parameters())
    layout = _layout(model)
    ranges = {
        key: None if (part.start, part.length) == (0, part.full) else (part.dim, part.start, part.length)
        for key, (_, part) in layout.items()
    }
    with torch.no_grad():
        for key, tensor in _tensors(files, ranges):
            src, part = layout[key]
            params[src.param].narrow(part.dim, part.offset, part.length).copy_(tensor)
    return model
