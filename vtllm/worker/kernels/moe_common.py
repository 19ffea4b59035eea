"""What the fused-MoE kernels share (``fused_moe.py``: grouped GEMM; ``fused_moe_decode.py``:
the decode path): the gate activations, FP8 expert scales and their modes.

FP8 experts (e4m3 weights, fp32 scales; the kernels' ``W_SCALE`` constexpr): each weight
tile is converted to the activation dtype (exact) and dotted in fp32; per-row scales
``[E, rows]`` (per-expert per-tensor or per-channel) multiply the accumulators once after the
K loop, before the activation; block scales ``[E, cdiv(rows, bn), cdiv(k, bk)]`` (128×128:
DeepSeek / Qwen3-FP8) multiply each K tile's partial product (``BLOCK_K`` divides ``bk``).
Gate and up rows keep their own scales (``w13`` up rows start at row ``I``, a multiple of
``bn``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtllm.worker.kernels._triton import tl, triton
from vtllm.worker.kernels.fp8_matmul import dequantize_ref

# name → constexpr code of the gate activation (``silu``: SwiGLU; ``gelu_tanh``: GeGLU)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# W_SCALE constexpr: plain weights, FP8 with per-row scales, FP8 with block scales
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2
# the constexprs of plain (unscaled) weights
PLAIN_WEIGHTS = dict(W_SCALE=NO_SCALE, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1)


@triton.jit
def gate_activation(gate, ACTIVATION: tl.constexpr):
    """fp32 ``act(gate)``; GELU(tanh) through ``0.5 * (1 + tanh(u)) == sigmoid(2u)``."""
    if ACTIVATION == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        return gate * tl.sigmoid(2.0 * inner)
    return gate * tl.sigmoid(gate)


@triton.jit
def block_scales(scale_base, rows, k0, row_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K):
    """fp32 ``[len(rows)]``: the block scales of weight ``rows`` at K offset ``k0``."""
    block_rows = (rows // SCALE_BLOCK_N).to(tl.int64) * stride_scale_row
    return tl.load(scale_base + block_rows + k0 // SCALE_BLOCK_K, mask=row_mask, other=0.0)


@dataclass(frozen=True)
class ExpertScales:
    """FP8 expert weights' fp32 scales: ``block`` None = per row, ``scale [E, rows]``;
    else ``(bn, bk)`` blocks, ``scale [E, cdiv(rows, bn), cdiv(k, bk)]``."""

    scale: torch.Tensor
    block: tuple[int, int] | None

    def kernel_args(self, block_k: int) -> tuple[tuple, dict, int]:
        """(strides, constexprs, BLOCK_K clipped to the scale block)."""
        if self.block is None:
            strides = (self.scale.stride(0), 0)
            return strides, dict(W_SCALE=ROW_SCALE, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1), block_k
        strides = (self.scale.stride(0), self.scale.stride(1))
        constexprs = dict(
            W_SCALE=BLOCK_SCALE, SCALE_BLOCK_N=self.block[0], SCALE_BLOCK_K=self.block[1]
        )
        return strides, constexprs, min(block_k, self.block[1])

    def dequantize(self, w: torch.Tensor, expert: int) -> torch.Tensor:
        """fp32 ``[rows, k]`` of one expert."""
        block = self.block or (1, w.shape[-1])
        scale = self.scale[expert] if self.block else self.scale[expert][:, None]
        return dequantize_ref(w[expert], scale, block, torch.float32)


def scale_args(scales: ExpertScales | None, fallback: torch.Tensor, block_k: int) -> tuple:
    """(scale pointer, its two strides, constexprs, BLOCK_K) for a kernel launch: the FP8
    scales' or, for plain weights, ``fallback`` (any fp32 tensor; never read)."""
    if scales is None:
        return fallback, (0, 0), PLAIN_WEIGHTS, block_k
    strides, constexprs, block_k = scales.kernel_args(block_k)
    return scales.scale, strides, constexprs, block_k
