"""Dynamic FP8 quantisation of activations: one fp32 scale per row, or per group of a row.

``x [rows, k]`` becomes ``x_fp8 [rows, k]`` (e4m3: the platform's ``float8_e4m3fn`` or
MI300's ``float8_e4m3fnuz``) and ``scale [rows, cdiv(k, group)]`` with::

    scale[r, g] = max(amax(|x[r, g*group : (g+1)*group]|), 1e-12) * (1 / fp8_max)
    x_fp8[r, c] = clamp(x[r, c] / scale[r, c // group], ±fp8_max)      (round to nearest)

so ``x ≈ x_fp8 * scale`` group by group (``fp8_matmul.dequantize_ref`` with blocks
``(1, group)`` gives it back). ``group = k`` is vLLM's dynamic per-token scaling
(the partner of per-row weight scales); ``group = 128`` pairs with 128×128 block-scaled
weights (DeepSeek / Qwen3-FP8), whose K blocks then see one activation scale each.

The scale multiplies by the fp32 reciprocal of ``fp8_max``, as torch's CUDA ``tensor /
scalar`` does (it never divides by a scalar), so that the torch references here and in
``layers/fp8.py`` give the same scales on every device; the quotient is an IEEE division
(``div_rn``: Triton's fp32 ``/`` is the approximate one on CUDA), as torch's ``tensor /
tensor``.

One program per (row, group), two passes over the group (amax, then quantise) in
``BLOCK``-wide chunks: one launch where the torch reference takes about seven. Normal
values are rounded to e4m3's 3 mantissa bits in fp32 before the conversion (which is then
exact), so the result is torch's on any backend; Triton's interpreter, for one, drops the
carry when a conversion rounds up to the next power of two.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton

_MIN_SCALE_AMAX = 1e-12  # an all-zero group gets a tiny scale, not a division by zero


@triton.jit
def _round_to_e4m3(v, MIN_NORMAL: tl.constexpr):
    """fp32 ``v`` rounded to 3 mantissa bits, to nearest with ties to even, where
    ``|v| >= MIN_NORMAL`` (e4m3's smallest normal); smaller values are left as they are."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep sign, exponent, 3 bits
    return tl.where(tl.abs(v) >= MIN_NORMAL, bits.to(tl.float32, bitcast=True), v)


@triton.jit
def _quantize_fp8_kernel(
    out_ptr,  # [rows, k] e4m3
    scale_ptr,  # [rows, num_groups] fp32
    x_ptr,  # [rows, k]
    k,
    stride_x_row,
    stride_out_row,
    stride_scale_row,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,  # 1 / FP8_MAX, rounded to fp32
    FP8_MIN_NORMAL: tl.constexpr,
    MIN_SCALE_AMAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(0, GROUP, BLOCK):
        cols = start + chunk + offs
        mask = (chunk + offs < GROUP) & (cols < k)
        x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # bit for bit what the references compute (module docstring): a missed ulp moves codes
    # at e4m3 rounding ties
    scale = tl.maximum(tl.max(amax, 0), MIN_SCALE_AMAX) * INV_FP8_MAX
    for chunk in range(0, GROUP, BLOCK):
        cols = start + chunk + offs
        mask = (chunk + offs < GROUP) & (cols < k)
        x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
        quantized = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX), FP8_MIN_NORMAL)
        tl.store(
            out_ptr + row * stride_out_row + cols,
            quantized.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    tl.store(scale_ptr + row * stride_scale_row + group, scale)


def quantize_fp8(
    x: torch.Tensor,  # [rows, k], any float dtype, last dimension contiguous
    fp8_dtype: torch.dtype,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [rows, k], scale [rows, cdiv(k, group)] fp32)``; ``group`` None = the whole
    row (one scale a row). Raises ValueError on a non-positive group or a 1-D ``x``."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes [rows, k], got shape {tuple(x.shape)}")
    rows, k = x.shape
    group = k if group is None else group
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_groups = max(1, -(-k // group))
    out = torch.empty(rows, k, dtype=fp8_dtype, device=x.device)
    scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, scale
    block = min(1024, triton.next_power_of_2(max(group, 16)))
    _quantize_fp8_kernel[(rows, num_groups)](
        out,
        scale,
        x,
        k,
        x.stride(0),
        out.stride(0),
        scale.stride(0),
        FP8_MAX=float(torch.finfo(fp8_dtype).max),
        INV_FP8_MAX=1.0 / float(torch.finfo(fp8_dtype).max),
        FP8_MIN_NORMAL=float(torch.finfo(fp8_dtype).smallest_normal),
        MIN_SCALE_AMAX=_MIN_SCALE_AMAX,
        GROUP=group,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    return out, scale


def quantize_fp8_ref(
    x: torch.Tensor, fp8_dtype: torch.dtype, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``quantize_fp8`` (same contract and math)."""
    rows, k = x.shape
    group = k if group is None else group
    num_groups = max(1, -(-k // group))
    fp8_max = float(torch.finfo(fp8_dtype).max)
    padded = torch.zeros(rows, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    groups = padded.view(rows, num_groups, group)
    scale = groups.abs().amax(dim=-1).clamp(min=_MIN_SCALE_AMAX) * (1.0 / fp8_max)  # [rows, groups]
    quantized = (groups / scale[..., None]).clamp(-fp8_max, fp8_max)
    return quantized.view(rows, -1)[:, :k].to(fp8_dtype), scale
