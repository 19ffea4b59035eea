"""Gated activations over a fused gate|up projection: ``act(x[:, :d]) * x[:, d:]``.

``silu_and_mul`` is SwiGLU (Llama, Qwen, Mistral); ``gelu_tanh_and_mul`` is GeGLU with
the tanh approximation of GELU (Gemma). Math in fp32, rounded once to x's dtype.

GELU(tanh) is written through the sigmoid, ``0.5 * (1 + tanh(u)) == sigmoid(2u)``,
because ``tanh`` lives only in the per-vendor libdevice modules, not in core Triton.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton

_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(
    out_ptr,  # [num_tokens, d]
    x_ptr,  # [num_tokens, 2 * d]: gate | up
    stride_out_token,
    stride_x_token,
    d,
    BLOCK: tl.constexpr,
    USE_GELU_TANH: tl.constexpr,
):
    token_id = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    row = x_ptr + token_id * stride_x_token
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + d + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        activated = gate * tl.sigmoid(2.0 * inner)
    else:
        activated = gate * tl.sigmoid(gate)
    out = activated * up
    tl.store(
        out_ptr + token_id * stride_out_token + offs, out.to(out_ptr.dtype.element_ty), mask=mask
    )


def _act_and_mul(x: torch.Tensor, use_gelu_tanh: bool) -> torch.Tensor:
    num_tokens, two_d = x.shape
    if two_d % 2:
        raise ValueError(f"the last axis of x holds gate and up, so it must be even, got {two_d}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last axis")
    d = two_d // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)  # [num_tokens, d]
    if num_tokens:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _act_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            out,
            x,
            out.stride(0),
            x.stride(0),
            d,
            BLOCK=block,
            USE_GELU_TANH=use_gelu_tanh,
            num_warps=4,
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]``: ``[num_tokens, 2 * d]`` → ``[num_tokens, d]``."""
    return _act_and_mul(x, use_gelu_tanh=False)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``silu_and_mul`` (same contract)."""
    gate, up = x.float().chunk(2, dim=-1)  # each [num_tokens, d]
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[:, :d]) * x[:, d:]``: ``[num_tokens, 2 * d]`` → ``[num_tokens, d]``."""
    return _act_and_mul(x, use_gelu_tanh=True)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch ``gelu_tanh_and_mul`` (same contract)."""
    gate, up = x.float().chunk(2, dim=-1)  # each [num_tokens, d]
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
