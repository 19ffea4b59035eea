"""Weight-only int8 and int4 matmuls on CPUs: ``--quantization int8`` / ``int4``.

A decode step on a CPU reads every weight once per token and is bound by memory bandwidth;
fewer bytes per weight is the lever. Two formats, each a ``LinearMethod``
(``layers/linear.py``) installed after loading by ``quantize_for_cpu``:

* **int8** (``CpuInt8Method``): symmetric, one scale per output row;
  ``w ≈ q * scale``, ``q`` in -127..127. ``torch._weight_int8pack_mm``.
* **int4** (``CpuInt4Method``): asymmetric, one scale and zero per 32 inputs of a row (the
  layout of GGUF ``Q4_1``, which the embedded SmolLM2 ships in);
  ``w ≈ (q - 8) * scale + zero``, ``q`` in 0..15. ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

Both kernels take bf16 activations: ``x`` is rounded to bf16 for the product and the result
cast back to the model's dtype (float32 by default on CPU, so norms, residuals, attention and
the KV cache stay float32). The kernels win only for a few rows at a time: measured on a
2-core AMD EPYC (Zen 4), 30 SmolLM2 layers of distinct weights, the int4 kernel takes 4.8 ms
at 1 row and 14 ms at 8 (bf16 ``F.linear``: 19 and 23 ms, float32: 37 and 56 ms), but 1.9 s
at 256 rows (bf16: 0.16 s). So each layer keeps its dense ``weight`` as loaded, and a
product of more than ``MAX_QUANTIZED_ROWS`` rows (a prefill chunk) uses it, and so does
every product of a step that computes prompt tokens (``prompt_step``, set by the model
runner): a prompt is prefilled exactly as without quantisation and its first token is the
unquantised model's, also when the prefix cache leaves one prompt token to compute or the
prompt is short (before, such a step read the int4 weights, and on an AVX-512 Xeon the
README's question got "L'Étoile, ..." from a prefix-cache hit). Decode steps read the
packed weights, also the decodes of a step that prefills others: the model runner runs
them apart (``cpu_steps.split_mixed_step``). Not batch-invariant: a request recomputed
after preemption prefills what it had decoded, through the other path.

The LM head quantises to int8 in both formats (its logits are the most sensitive).
A layer whose shape a kernel cannot take (int4: inputs not a multiple of 32 or outputs not a
multiple of 16) falls back to int8.

Accuracy on the embedded SmolLM2 (float32 activations, ``docs/BENCHMARKS.md``): the README's
question is answered as in float32, on a Zen 4 (native bf16 products) and on a Zen 3 (AVX2,
bf16 emulated: 32 of 32 greedy tokens as float32, int4 decode 2.4× float32's speed); a bf16
model instead (``--dtype bfloat16``) flips that answer's first token, which float32 wins by
0.1 nats only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vtllm.worker.cpu_precision import cpu_flags
from vtllm.worker.layers.embedding import ParallelLMHead
from vtllm.worker.layers.linear import ColumnParallelLinear, LinearMethod, RowParallelLinear

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZE = 32
MAX_QUANTIZED_ROWS = 16  # above: the dense bf16 weight (see the module docstring)
_KERNEL_DTYPE = torch.bfloat16


_in_prompt_step = False  # set by ``prompt_step`` (one model runner per worker process)


@contextlib.contextmanager
def prompt_step(active: bool) -> Iterator[None]:
    """Inside, when ``active``: every quantised layer multiplies by its dense weight,
    however few rows (the step computes prompt tokens; see the module docstring)."""
    global _in_prompt_step
    previous, _in_prompt_step = _in_prompt_step, active
    try:
        yield
    finally:
        _in_prompt_step = previous


def _dense(x: torch.Tensor) -> bool:
    return _in_prompt_step or x.shape[0] > MAX_QUANTIZED_ROWS


def _rows_as_bf16(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)


class CpuInt8Method(LinearMethod):
    """``layer.qweight [out, in] int8`` times ``layer.qscale [out] bf16`` per output row."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if _dense(x):
            return F.linear(x, layer.weight)  # [num_tokens, out]
        y = torch._weight_int8pack_mm(_rows_as_bf16(x), layer.qweight, layer.qscale)
        return y if y.dtype == x.dtype else y.to(x.dtype)  # [num_tokens, out]


class CpuInt4Method(LinearMethod):
    """``layer.qweight`` (the kernel's packed int4 layout of ``[out, in]``) with
    ``layer.qscale_zero [in / 32, out, 2] bf16`` (scale, zero) per group of 32 inputs."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if _dense(x):
            return F.linear(x, layer.weight)  # [num_tokens, out]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _rows_as_bf16(x).contiguous(), layer.qweight, INT4_GROUP_SIZE, layer.qscale_zero
        )
        return y if y.dtype == x.dtype else y.to(x.dtype)  # [num_tokens, out]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (``q [out, in] int8``, ``scale [out] bf16``, the dequantised
    ``q * scale [out, in] bf16``, for tests). The scale maps each row's largest magnitude
    to 127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(_KERNEL_DTYPE)  # [out]
    scale_f = scale.float()[:, None]
    q = torch.round(w / scale_f).clamp(-127, 127).to(torch.int8)
    return q, scale, (q.float() * scale_f).to(_KERNEL_DTYPE)


def int4_supported(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return in_features % INT4_GROUP_SIZE == 0 and out_features % 16 == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` → (``q [out, in] int32`` in 0..15, ``scale_zero [in / 32, out, 2]
    bf16``, the dequantised ``(q - 8) * scale + zero [out, in] bf16``, for tests).

    Per group of 32 inputs, ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``
    (both rounded to bf16 first, and ``q`` chosen against the rounded values), so a group
    that is already ``min + scale * k`` for integers ``k`` — a GGUF ``Q4_1`` block —
    comes back up to bf16 rounding of its scale and zero.
    """
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, groups]
    scale = ((high - low) / 15.0).clamp(min=1e-10).to(_KERNEL_DTYPE).float()
    zero = (low + 8.0 * scale).to(_KERNEL_DTYPE).float()
    q = torch.round((groups - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15)
    dense = ((q - 8.0) * scale[..., None] + zero[..., None]).view(out_features, in_features)
    scale_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    q = q.view(out_features, in_features).to(torch.int32)
    return q, scale_zero.to(_KERNEL_DTYPE), dense.to(_KERNEL_DTYPE)


def _install_int8(layer: nn.Module) -> None:
    q, scale, _ = quantize_int8(layer.weight.data)
    layer.register_buffer("qweight", q, persistent=False)
    layer.register_buffer("qscale", scale, persistent=False)
    layer.linear_method = CpuInt8Method()


def _install_int4(layer: nn.Module) -> None:
    q, scale_zero, _ = quantize_int4(layer.weight.data)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    layer.register_buffer("qweight", packed, persistent=False)
    layer.register_buffer("qscale_zero", scale_zero, persistent=False)
    layer.linear_method = CpuInt4Method()


def quantize_for_cpu(model: nn.Module, quantization: str) -> dict[str, int]:
    """Quantise every linear layer and the LM head of a loaded ``model`` in place.
    Returns how many layers got each format (``{"int4": 210, "int8": 1}``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: choose one of {QUANTIZATIONS}")
    counts: dict[str, int] = {"int4": 0, "int8": 0}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ParallelLMHead):
                _install_int8(module)
                counts["int8"] += 1
            elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
                if quantization == "int4" and int4_supported(module.weight):
                    _install_int4(module)
                    counts["int4"] += 1
                else:
                    _install_int8(module)
                    counts["int8"] += 1
    return counts


def fast_int4_cpu(cpuinfo: str | None = None) -> bool:
    """Whether the int4 decode kernel beats float32 here: an x86 CPU with AVX2 (every x86
    CPU since 2013; AVX-512 BF16 and AMX ones multiply the bf16 activations natively, AVX2
    ones emulate them and still win, below), read from ``/proc/cpuinfo`` (False where there
    is none, and on other architectures, where the kernel was not measured); ``cpuinfo``:
    that file's text instead."""
    return bool(cpu_flags(cpuinfo) & {"avx2", "avx512_bf16", "amx_bf16"})


def choose_quantization(
    requested: str | None, is_gpu: bool, hf_config: dict[str, Any], fast_int4: bool
) -> str:
    """``--quantization`` → the CPU weight-only format to serve: "none", "int8" or "int4".

    Unset (None): on a CPU where the int4 kernel pays (``fast_int4``: x86 with AVX2), a
    model converted from a GGUF whose linear weights are 4-bit (the embedded SmolLM2 is
    ``Q4_1``) decodes from 4 bits (int4); everything else is served as loaded. "fp8" is not a CPU format ("none"
    here: ``layers/fp8.py`` serves it). int8/int4 asked for on a GPU are refused.
    """
    if requested in QUANTIZATIONS:
        if is_gpu:
            raise ValueError(f"--quantization {requested} is a CPU format; on a GPU use fp8")
        return requested
    if requested is not None or is_gpu:
        return "none"
    gguf_types = hf_config.get("vtllm_gguf_linear_types") or []
    four_bit = bool(gguf_types) and all(t.startswith("Q4") for t in gguf_types)
    return "int4" if fast_int4 and four_bit else "none"
