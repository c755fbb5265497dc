"""The config's limits and its cross-field rules, as plain data and plain functions.

A cross-field rule (``num_heads % num_kv_heads``, num_blocks xor memory_budget, the backend's
declared capabilities, ...) reads a flat mapping of dotted field paths to values and returns
every problem it finds. It checks the type and range of each value it reads and skips what it
cannot judge, so the same rules run in two places:

- in :class:`kvcache.config.schema.KVCacheConfig`'s model validator, on validated values;
- in :mod:`kvcache.config.loading`, on the raw values of a file whose fields failed validation (pydantic
  runs a model validator only when every field is valid), so a file's cross-field problems are
  reported in the same pass as its per-field ones.

Imports no pydantic and no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from attention.capabilities import BACKENDS, BackendInfo, MultipleOf
from attention.dtypes import DTYPES
from attention.errors import ConfigProblem, quote
from kvcache.config.sizes import MAX_BYTES, parse_bytes

__all__ = [
    "BLOCK_SIZE_RULE",
    "COMPUTE_DTYPES",
    "DEVICE_PATTERN",
    "HEAD_DIM_RULE",
    "MAX_BLOCKS",
    "MAX_HEADS",
    "MAX_LAYERS",
    "MAX_TOKENS",
    "cross_field_problems",
    "device_ok",
]

#: The project-wide block-size rule: every backend reads K/V in tiles of 32 tokens.
BLOCK_SIZE_RULE = MultipleOf(32, 1024)
#: Vectorised loads of 16 bytes need head_dim % 8 == 0.
HEAD_DIM_RULE = MultipleOf(8, 512)
MAX_LAYERS = 4096
MAX_HEADS = 1024
#: Largest MLA width (kv_lora_rank, a rotary or value head dim): V3's are 512, 64 and 128.
MAX_LATENT = 4096
#: Block ids are int32 in block tables (and slot ids int64), so the pool holds at most 2**31 - 1.
MAX_BLOCKS = 2**31 - 1
#: Token positions and lengths are int32 in step metadata.
MAX_TOKENS = 2**31 - 1
#: What ``cache.device`` may be: ASCII only, no whitespace, a device index of at most 3 digits.
#: Written for both Python's ``re`` (with fullmatch) and JSON schema (ECMA-262).
DEVICE_PATTERN = r"^(auto|cpu|cuda(:(0|[1-9][0-9]{0,2}))?)$"
_DEVICE = re.compile(DEVICE_PATTERN, re.ASCII)
#: Names a model may compute in (the dtype table's entries that are not cache-only formats).
COMPUTE_DTYPES: tuple[str, ...] = tuple(name for name, info in DTYPES.items() if not info.cache_only)

Values = Mapping[str, object]
"""Dotted field path -> value. A path is present when its section is; None: not given."""


def device_ok(value: object) -> bool:
    """Whether ``value`` is a device string the config takes."""
    return isinstance(value, str) and _DEVICE.fullmatch(value) is not None


def cross_field_problems(values: Values) -> list[ConfigProblem]:
    """Every cross-field problem in ``values``; empty when there is none. Never raises."""
    rules: tuple[Callable[[Values], list[ConfigProblem]], ...] = (
        _heads_divide,
        _one_size,
        _compute_dtype_given,
        _scale_fits_the_dtype,
        _kv_rotation,
        _window_pattern,
        _latent_attention,
        _backend_supports,
        _host_tier_needs_prefix_caching,
        _disk_tier_needs,
    )
    return [problem for rule in rules for problem in rule(values)]


def _count(values: Values, path: str, low: int, high: int) -> int | None:
    """``values[path]`` when it is an int (not a bool) in [low, high]; else None."""
    value = values.get(path)
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def _any_int(values: Values, path: str) -> int | None:
    value = values.get(path)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _size(values: Values, path: str) -> int | None:
    """``values[path]`` in bytes: a byte count in [0, MAX_BYTES], or a size as text (``16GiB``:
    a raw value, before validation parses it); None when it is neither (a bad value, reported
    by its field)."""
    value = values.get(path)
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError:
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES else None


def _name(values: Values, path: str, names: Mapping[str, object] | tuple[str, ...]) -> str | None:
    value = values.get(path)
    return value if isinstance(value, str) and value in names else None


def _bools(values: Values, path: str) -> tuple[bool, ...] | None:
    value = values.get(path)
    if isinstance(value, (list, tuple)) and all(isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _host_tier_needs_prefix_caching(values: Values) -> list[ConfigProblem]:
    space = _size(values, "cache.host_cache_space")
    if space is None or space <= 0 or values.get("cache.enable_prefix_caching") is True:
        return []
    return [
        ConfigProblem(
            "cache.host_cache_space",
            f"{space} bytes for a host tier of the prefix cache, but cache.enable_prefix_caching is off; "
            f"turn it on, or set host_cache_space to 0",
        )
    ]


def _disk_tier_needs(values: Values) -> list[ConfigProblem]:
    """A disk tier needs its space, its directory and a host tier to feed it. A size that cannot
    be judged (a bad value, reported by its field) raises nothing here."""
    space = _size(values, "cache.disk_cache_space")
    directory = values.get("cache.disk_cache_dir")
    if space is None or (space == 0 and directory is None):
        return []
    if space == 0:
        return [
            ConfigProblem(
                "cache.disk_cache_dir",
                "is given without cache.disk_cache_space; set disk_cache_space (e.g. 200GiB) or remove disk_cache_dir",
            )
        ]
    found = []
    if directory is None:
        found.append(
            ConfigProblem(
                "cache.disk_cache_space",
                f"{space} bytes for a disk tier, but cache.disk_cache_dir is not set; name a directory "
                f"(e.g. /mnt/nvme/kvcache), or set disk_cache_space to 0",
            )
        )
    if _size(values, "cache.host_cache_space") == 0:
        found.append(
            ConfigProblem(
                "cache.disk_cache_space",
                f"{space} bytes for a disk tier, but there is no host tier to feed it (cache.host_cache_space is "
                f"0); set host_cache_space (e.g. 16GiB), or set disk_cache_space to 0",
            )
        )
    return found


def _heads_divide(values: Values) -> list[ConfigProblem]:
    heads = _count(values, "model.num_heads", 1, MAX_HEADS)
    kv_heads = _count(values, "model.num_kv_heads", 1, MAX_HEADS)
    if heads is None or kv_heads is None or heads % kv_heads == 0:
        return []
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    close = sorted(sorted(divisors, key=lambda d: abs(d - kv_heads))[:2])
    return [
        ConfigProblem(
            "model.num_kv_heads",
            f"{kv_heads} does not divide num_heads {heads} (each KV head serves a whole group of "
            f"query heads); use {' or '.join(str(d) for d in close)}",
        )
    ]


def _one_size(values: Values) -> list[ConfigProblem]:
    if "cache.num_blocks" not in values or "cache.memory_budget" not in values:
        return []  # no cache section: its absence is reported on its own
    blocks = values["cache.num_blocks"] is not None
    budget = values["cache.memory_budget"] is not None
    if blocks and budget:
        return [ConfigProblem("cache.num_blocks", "both num_blocks and memory_budget are set; keep one of them")]
    if not blocks and not budget:
        return [
            ConfigProblem(
                "cache.num_blocks",
                "neither num_blocks nor memory_budget is set; add one, e.g. num_blocks: 1024 or memory_budget: 0.9",
            )
        ]
    return []


def _compute_dtype_given(values: Values) -> list[ConfigProblem]:
    cache_dtype = _name(values, "cache.dtype", DTYPES)
    if "model.dtype" not in values or values["model.dtype"] is not None:
        return []
    if cache_dtype is None or not DTYPES[cache_dtype].cache_only:
        return []
    return [
        ConfigProblem(
            "model.dtype",
            f"is required when cache.dtype is {cache_dtype}, a storage format for the cache only "
            f"(the model cannot compute in it); set model.dtype: {' or '.join(_preferred_compute())}",
        )
    ]


def _scale_fits_the_dtype(values: Values) -> list[ConfigProblem]:
    """cache.kv_scale is the starting scale of an fp8 cache; an int8 cache computes a scale per
    token as it writes, so a kv_scale set with it (to anything but the default, 1.0) would be
    silently ignored: refuse it."""
    cache_dtype = _name(values, "cache.dtype", DTYPES)
    scale = values.get("cache.kv_scale")
    if cache_dtype is None or not DTYPES[cache_dtype].token_scales or scale is None or scale == 1.0:
        return []
    return [
        ConfigProblem(
            "cache.kv_scale",
            f"is given with cache.dtype {cache_dtype}, which computes a scale per token and KV head as it "
            "writes; remove kv_scale",
        )
    ]


def _kv_rotation(values: Values) -> list[ConfigProblem]:
    """cache.kv_rotation rotates what an 8-bit cache quantizes: for a 16- or 32-bit cache it
    would only cost time; Sylvester's Hadamard matrix needs a power-of-two head_dim; a latent
    cache is read unrotated by the decompressed prefill."""
    if values.get("cache.kv_rotation") != "hadamard":
        return []
    found = []
    cache_dtype = _name(values, "cache.dtype", DTYPES)
    if cache_dtype is not None and not DTYPES[cache_dtype].cache_only:
        found.append(
            ConfigProblem(
                "cache.kv_rotation",
                f"hadamard with cache.dtype {cache_dtype}: the rotation helps an 8-bit cache's quantization "
                "(int8, float8_e4m3) and would only cost time here; remove kv_rotation",
            )
        )
    head_dim = _count(values, "model.head_dim", 1, MAX_LATENT)
    if head_dim is not None and head_dim & (head_dim - 1):
        found.append(
            ConfigProblem(
                "cache.kv_rotation",
                f"hadamard needs a power-of-two model.head_dim, got {head_dim}; remove kv_rotation",
            )
        )
    if values.get("model.kv_lora_rank") is not None:
        found.append(
            ConfigProblem(
                "cache.kv_rotation",
                "is not supported with latent attention (the latent is read unrotated by the decompressed "
                "prefill); remove it",
            )
        )
    return found


def _preferred_compute() -> list[str]:
    """The 16-bit compute dtypes, the usual partners of an fp8 cache."""
    return [name for name in ("bfloat16", "float16") if name in COMPUTE_DTYPES] or list(COMPUTE_DTYPES)


def _window_pattern(values: Values) -> list[ConfigProblem]:
    pattern = values.get("model.window_pattern")
    if not isinstance(pattern, (list, tuple)):
        return []
    found = []
    if values.get("model.sliding_window") is None:
        found.append(
            ConfigProblem(
                "model.window_pattern",
                "is given without model.sliding_window; set sliding_window (tokens each query sees, "
                "e.g. 4096) or remove window_pattern",
            )
        )
    layers = _count(values, "model.num_layers", 1, MAX_LAYERS)
    if layers is not None and len(pattern) != layers:
        found.append(
            ConfigProblem(
                "model.window_pattern",
                f"has {len(pattern)} {'entry' if len(pattern) == 1 else 'entries'} but num_layers is {layers}; "
                f"give one true/false per layer",
            )
        )
    return found


#: The MLA fields, given all together or not at all.
_LATENT_FIELDS = ("model.kv_lora_rank", "model.qk_rope_head_dim", "model.qk_nope_head_dim", "model.v_head_dim")


def _latent_attention(values: Values) -> list[ConfigProblem]:
    """MLA: all four sizes or none; one KV head; head_dim = nope + rope; an even rotary part;
    a latent the kernels can load (a multiple of 8); no window, cap or sinks (DeepSeek has none)."""
    given = {path: values.get(path) for path in _LATENT_FIELDS}
    if all(v is None for v in given.values()):
        return []
    missing = [path for path, v in given.items() if v is None]
    if missing:
        return [
            ConfigProblem(
                missing[0],
                "is missing; multi-head latent attention needs kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim "
                "and v_head_dim together (DeepSeek-V3: 512, 64, 128, 128)",
            )
        ]
    rank, rope, nope, v = (_count(values, path, 1, MAX_LATENT) for path in _LATENT_FIELDS)
    if rank is None or rope is None or nope is None or v is None:
        return []  # a bad value, reported by its field
    found = []
    if _count(values, "model.num_kv_heads", 2, MAX_HEADS) is not None:  # 0 or text: reported by the field
        found.append(
            ConfigProblem(
                "model.num_kv_heads",
                f"{quote(values.get('model.num_kv_heads'))} with latent attention; the cached latent is one KV head "
                "shared by every query head: use 1",
            )
        )
    head_dim = _count(values, "model.head_dim", 1, MAX_LATENT)
    if head_dim is not None and head_dim != nope + rope:
        found.append(
            ConfigProblem(
                "model.head_dim",
                f"{head_dim} with latent attention; it is qk_nope_head_dim + qk_rope_head_dim: use {nope + rope}",
            )
        )
    if rope % 2:
        found.append(ConfigProblem("model.qk_rope_head_dim", f"{rope} is odd; rotary pairs channels: use {rope + 1}"))
    if (rank + rope) % 8:
        found.append(
            ConfigProblem(
                "model.kv_lora_rank",
                f"{rank}: the latent (kv_lora_rank + qk_rope_head_dim = {rank + rope}) must be a multiple of 8 "
                f"for the kernels' loads; use {(rank + rope + 7) // 8 * 8 - rope}",
            )
        )
    for path in ("model.sliding_window", "model.logit_softcap"):
        if values.get(path) is not None:
            found.append(ConfigProblem(path, "is not supported with latent attention yet; remove it"))
    if values.get("model.attention_sinks") is True:
        found.append(ConfigProblem("model.attention_sinks", "is not supported with latent attention yet; remove it"))
    cache_dtype = _name(values, "cache.dtype", DTYPES)
    if cache_dtype is not None and DTYPES[cache_dtype].token_scales:
        found.append(
            ConfigProblem(
                "cache.dtype",
                f"{cache_dtype} (a scale per token and head) is not built for a latent cache; "
                "use float8_e4m3 or the model's dtype",
            )
        )
    return found


def _backend_supports(values: Values) -> list[ConfigProblem]:
    """The chosen backend's declared refusals, for every value it can judge.

    A value that cannot be judged (missing, or of the wrong type) is replaced by one the backend
    accepts, so it raises no refusal; its own problem is reported by its field.
    """
    name = _name(values, "attention.backend", BACKENDS)
    if name is None:
        return []  # auto (decided at run time), or an unknown name reported on its own
    info = BACKENDS[name]
    block_size = _any_int(values, "cache.block_size")
    head_dim = _any_int(values, "model.head_dim")
    compute_path = "cache.dtype" if values.get("model.dtype") is None else "model.dtype"
    compute = _name(values, compute_path, COMPUTE_DTYPES)
    device = values.get("cache.device")
    device_type = device.split(":")[0] if isinstance(device, str) and device_ok(device) and device != "auto" else None
    window = _count(values, "model.sliding_window", 1, MAX_TOKENS)
    pattern = _bools(values, "model.window_pattern")
    problems = info.problems(
        block_size=info.block_sizes.factor if block_size is None else block_size,
        head_dim=info.head_dims.factor if head_dim is None else head_dim,
        dtype=info.dtypes[0] if compute is None else compute,
        device_type=device_type,
        kv_cache_dtype=_name(values, "cache.dtype", DTYPES),
        sliding_window=window is not None and (pattern is None or any(pattern)),
        logit_softcap=values.get("model.logit_softcap") is not None,
        attention_sinks=values.get("model.attention_sinks") is True,
        latent_attention=values.get("model.kv_lora_rank") is not None,
    )
    paths = {
        "block_size": "cache.block_size",
        "head_dim": "model.head_dim",
        "dtype": compute_path,
        "kv_cache_dtype": "cache.dtype",
        "device": "cache.device",
        "sliding_window": "model.sliding_window",
        "logit_softcap": "model.logit_softcap",
        "attention_sinks": "model.attention_sinks",
        "latent_attention": "model.kv_lora_rank",
    }
    judged = {
        "block_size": block_size is not None,
        "head_dim": head_dim is not None,
        "dtype": compute is not None,
    }
    # The table reports only that a window or a latent is used: show the sizes instead.
    shown = {"sliding_window": window, "latent_attention": values.get("model.kv_lora_rank")}
    return [
        ConfigProblem(paths[p.parameter], f"{quote(shown.get(p.parameter, p.value))} is refused: {p.reason}; {p.fix}")
        for p in problems
        if judged.get(p.parameter, True) and not _said_already(p.parameter, p.value, info)
    ]


def _said_already(parameter: str, value: object, info: BackendInfo) -> bool:
    """Whether the field's own message already gives the backend's fix: the value breaks the
    project-wide rule, and every value that rule suggests instead suits the backend too
    (head_dim 30 on triton: "use 24 or 32" says it all; block_size 48 on flash_attn: it does not)."""
    rules: dict[str, tuple[MultipleOf, MultipleOf]] = {
        "block_size": (BLOCK_SIZE_RULE, info.block_sizes),
        "head_dim": (HEAD_DIM_RULE, info.head_dims),
    }
    if parameter not in rules or not isinstance(value, int):
        return False
    project, backend = rules[parameter]
    return not project.allows(value) and all(backend.allows(v) for v in project.nearest(value))
