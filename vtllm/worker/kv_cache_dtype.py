"""The KV cache's element type (``--kv-cache-dtype``) and its FP8 quantisation.

``auto`` stores K and V in the model's dtype; ``bfloat16`` / ``float16`` / ``float32``
store them in that type (cast on write, cast back to the query's dtype on read);
``fp8`` (= ``fp8_e4m3``, vLLM's names) stores one byte per element, half of bf16:

* the type is the platform's e4m3 (``Platform.fp8_dtype``): OCP ``float8_e4m3fn``
  (max 448) on NVIDIA and ROCm gfx950 / gfx12 (RDNA4), ``float8_e4m3fnuz`` (max 240) on
  ROCm gfx942 (MI300), whose hardware converts only that variant;
* each attention layer has one ``k_scale`` and one ``v_scale`` (float32 scalars), with
  vLLM's and the Hugging Face checkpoints' meaning::

      cache = e4m3(clamp(x / scale, -max, max))      (saturating, round to nearest even)
      x     ≈ float(cache) * scale

* scales come from the checkpoint when it has them (``kv_scale_buffers`` lists the names
  read); otherwise they are 1.0, as in vLLM. That default is deliberate, not a
  placeholder: e4m3 keeps 3 mantissa bits, the same relative precision (≤ 2^-4) for every
  magnitude in its normal range [2^-6, max], so a scale only matters for values beyond
  ``max`` (they saturate) or far below 2^-6 (subnormals, coarser). Post-norm, post-rope K
  and V of the supported models sit well inside that range. No scale is ever computed
  from traffic, so outputs stay a pure function of the weights and the prompt.

Reads dequantise in the attention kernels (``kernels/paged_attention.py``): ``k_scale``
is folded into the softmax scale and ``v_scale`` into the output, so the inner loop only
converts fp8 to the dots' dtype, fp16 under bf16 queries (``FP8_FP16_OPERANDS``: one
instruction a pair) and the query's otherwise (exact: every e4m3 value is a bf16/fp16
value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vtllm.worker.platform import Platform

# --kv-cache-dtype values; vLLM's spellings as aliases (config.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
KV_CACHE_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
_PLAIN = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# checkpoint tensor suffix → the attention buffers it fills (per-tensor scales):
# HF / vLLM (``self_attn.k_scale``), vLLM's older combined ``kv_scale``, ModelOpt
# (``k_proj.k_scale``), compressed-tensors (``k_proj.output_scale``), vLLM's own module
# path (``self_attn.attn.k_scale``)
_SCALE_SUFFIXES: dict[str, tuple[str, ...]] = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
    ".self_attn.attn.k_scale": ("k_scale",),
    ".self_attn.attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",),
    ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, platform: Platform, attention_backend: str
) -> torch.dtype:
    """``--kv-cache-dtype`` → the cache's torch dtype on ``platform``.

    Raises ValueError (one line, naming the fix) for fp8 where it cannot run: on CPU,
    and under the padded-batch torch attention (``VT_ATTENTION_BACKEND=torch``), which
    reads caches without scales.
    """
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name == "auto":
        return model_dtype
    if name in _PLAIN:
        return _PLAIN[name]
    if name not in ("fp8", "fp8_e4m3"):
        raise ValueError(
            f"--kv-cache-dtype {name!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if not platform.is_gpu:
        raise ValueError(
            f"--kv-cache-dtype {name} needs a CUDA or ROCm GPU: the CPU attention reads "
            "bf16/fp16/fp32 caches only; drop --kv-cache-dtype (or pass auto) on CPU"
        )
    if attention_backend != "triton":
        raise ValueError(
            f"--kv-cache-dtype {name} needs the Triton attention kernels, but "
            f"VT_ATTENTION_BACKEND={attention_backend}; unset VT_ATTENTION_BACKEND or drop "
            "--kv-cache-dtype"
        )
    return platform.fp8_dtype


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> int:
    """K and V of one token, every layer, on one rank: ``2 × layers × heads × dim × bytes``
    (the per-layer scales are a few bytes per layer, not per token)."""
    element_bytes = torch.empty(0, dtype=kv_dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element_bytes


def register_kv_scales(attention: torch.nn.Module) -> None:
    """Give an attention layer its per-layer FP8 KV-cache scales ``k_scale`` / ``v_scale``:
    1.0 until the checkpoint's are loaded; unused by bf16/fp16/fp32 caches."""
    attention.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
    attention.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)


def kv_scale_buffers(checkpoint_name: str) -> list[str]:
    """The attention buffers (``model.layers.3.self_attn.k_scale``) a checkpoint tensor
    of per-layer KV scales fills; [] when the name is not a KV scale."""
    for suffix, targets in _SCALE_SUFFIXES.items():
        if checkpoint_name.endswith(suffix):
            module = checkpoint_name[: -len(suffix)] + ".self_attn"
            return [f"{module}.{target}" for target in targets]
    return []


def checked_kv_scale(loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's KV scale as a float32 scalar; ValueError for anything but one
    positive finite number (per-head scales are not supported)."""
    if loaded.numel() != 1:
        raise ValueError(
            f"a KV-cache scale of shape {tuple(loaded.shape)}: only per-tensor scales "
            "(one number per layer) are supported"
        )
    value = loaded.reshape(()).float()
    if not (torch.isfinite(value) and value > 0):
        raise ValueError(f"a KV-cache scale of {value.item()}: it must be positive and finite")
    return value


def quantize_fp8_ref(
    x: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """``e4m3(clamp(x / scale, ±max))`` in plain torch (the kernels' reference)."""
    limit = torch.finfo(fp8_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(fp8_dtype)


def dequantize_fp8_ref(
    x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float(x) * scale`` in ``dtype`` (fp32 by default)."""
    return (x.float() * scale).to(dtype)


def describe_kv_scales(attention_layers: list) -> str:
    """``k_scale 0.0213..0.0871, v_scale 1`` over the layers' buffers, for the log."""
    parts = []
    for name in ("k_scale", "v_scale"):
        values = torch.stack([getattr(layer, name) for layer in attention_layers]).cpu()
        low, high = float(values.min()), float(values.max())
        parts.append(f"{name} {low:g}" if low == high else f"{name} {low:g}..{high:g}")
    return ", ".join(parts)
