"""Fused RMSNorm with an optional residual add, one program per row.

Rounding follows the Hugging Face models the reference layers match:

* residual add in the activation dtype (``h = x + residual``, rounded), the norm read
  from the rounded ``h``;
* Llama: ``weight * (h * rstd).to(dtype)`` (``layers/norm.py``);
* Gemma (``gemma=True``): ``(h * rstd * (1 + weight)).to(dtype)`` with all math in fp32;
  Gemma 4 (``gemma=True, weight_offset=0.0``): ``(h * rstd * weight).to(dtype)``, the same
  fp32 product without the ``1 +``.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden_size]
    residual_out_ptr,  # [num_rows, hidden_size]; written when HAS_RESIDUAL
    x_ptr,  # [num_rows, hidden_size]
    residual_ptr,  # [num_rows, hidden_size]; read when HAS_RESIDUAL
    weight_ptr,  # [hidden_size]
    stride_out_row,
    stride_residual_out_row,
    stride_x_row,
    stride_residual_row,
    hidden_size,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,  # GEMMA only: 1.0 (Gemma 1-3) or 0.0 (Gemma 4)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0)  # [BLOCK]
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out_row + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden_size + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if GEMMA:
        out = x32 * rstd * (WEIGHT_OFFSET + weight.to(tl.float32))
    else:
        out = (x32 * rstd).to(x.dtype) * weight.to(x.dtype)
    tl.store(out_ptr + row * stride_out_row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden_size]
    gemma: bool = False,
    weight_offset: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(normed, new_residual)``: RMSNorm of ``x + residual`` (or of ``x``).

    ``new_residual`` is ``x + residual`` in x's dtype, or ``None`` without a residual.
    ``gemma`` scales by ``weight_offset + weight`` in fp32 before rounding instead of by
    ``weight`` after it (``weight_offset`` 1.0: Gemma 1-3; 0.0: Gemma 4). Leading axes are
    flattened into rows (e.g. ``[num_tokens, num_heads, head_dim]`` for a per-head
    q/k norm); the last axis must be contiguous. Outputs are new tensors in x's dtype.
    """
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight {tuple(weight.shape)} for hidden size {hidden_size}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} but x {tuple(x.shape)}")
    rows = x.reshape(-1, hidden_size)  # [num_rows, hidden_size], a view when possible
    residual_rows = None if residual is None else residual.reshape(-1, hidden_size)
    if rows.stride(-1) != 1 or (residual_rows is not None and residual_rows.stride(-1) != 1):
        raise ValueError("x and residual need a contiguous last axis")
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [num_rows, hidden_size]
    residual_out = None if residual is None else torch.empty_like(out)
    block = triton.next_power_of_2(hidden_size)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            out if residual_out is None else residual_out,
            rows,
            rows if residual_rows is None else residual_rows,
            weight,
            out.stride(0),
            out.stride(0),
            rows.stride(0),
            rows.stride(0) if residual_rows is None else residual_rows.stride(0),
            hidden_size,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            GEMMA=gemma,
            WEIGHT_OFFSET=float(weight_offset),
            num_warps=min(16, max(1, block // 512)),
        )
    new_residual = None if residual_out is None else residual_out.view(x.shape)
    return out.view(x.shape), new_residual


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden_size]
    gemma: bool = False,
    weight_offset: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch ``rms_norm`` (same contract)."""
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        out = (normed * (weight_offset + weight.float())).to(dtype)
    else:
        out = normed.to(dtype) * weight.to(dtype)
    return out, (x if residual is not None else None)
