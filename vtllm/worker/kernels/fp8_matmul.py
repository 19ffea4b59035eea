"""FP8 (e4m3) weight matmul: ``y = x @ dequant(w)^T``, the weight stored in FP8 with fp32
scales over blocks of it, dequantised inside the kernel (x stays in its own dtype).

Scale layout, one fp32 per ``block_n × block_k`` block of the ``[N, K]`` weight::

    w_fp8 [N, K]                          scale [ceil(N / bn), ceil(K / bk)]
          k: 0 ..bk.. ..2bk..  K
    n: 0  ┌────────┬────────┬──┐          ┌─────┬─────┬─────┐
          │  s00   │  s01   │  │          │ s00 │ s01 │ s02 │
    bn    ├────────┼────────┼──┤          ├─────┼─────┼─────┤
          │  s10   │  s11   │  │          │ s10 │ s11 │ s12 │
    N     └────────┴────────┴──┘          └─────┴─────┴─────┘

    w[n, k] = w_fp8[n, k] * scale[n // bn, k // bk]

128 × 128 blocks are the DeepSeek / Qwen3-FP8 layout (``weight_scale_inv``); per-output-
channel scales (``weight_scale [N]``, also a per-tensor scale repeated) are the case
``block = (1, K)``, ``scale [N, 1]``.

The kernel: one program per ``BLOCK_M × BLOCK_N`` output tile (16 rows at decode sizes,
``tl.dot``'s minimum; a GEMV variant without ``tl.dot`` measured slower on the H200). Its K
loop loads an FP8 weight tile and converts it to x's dtype (exact: e4m3 values fit in fp16,
bf16 and fp32), then dots in fp32. Block scales multiply each K tile's partial product
(``BLOCK_K`` divides ``block_k``, so a tile lies in one scale block); per-row scales multiply
the accumulator once, after the loop. ``fp8_matmul_ref`` dequantises the whole weight and
calls ``F.linear``: the CPU path and the tests' oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vtllm.worker.kernels._triton import num_sms, tl, triton


@triton.jit(do_not_specialize=["m"])  # step-sized: compile once
def _fp8_matmul_kernel(
    out_ptr,  # [m, n], x's dtype
    x_ptr,  # [m, k]
    w_ptr,  # [n, k] fp8 (e4m3fn, or e4m3fnuz on MI300)
    scale_ptr,  # [cdiv(n, SCALE_BLOCK_N), cdiv(k, SCALE_BLOCK_K)] fp32; [n, 1] when PER_ROW
    m,
    n,
    k,
    stride_x_row,
    stride_out_row,
    stride_w_row,
    stride_scale_row,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,  # a multiple of BLOCK_K (unused when PER_ROW)
    PER_ROW: tl.constexpr,  # one scale per output row, applied after the K loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < m
    n_mask = offs_n < n
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x_row + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w_row + offs_k[:, None]  # [BK, BN]
    scale_rows = scale_ptr + (offs_n // SCALE_BLOCK_N).to(tl.int64) * stride_scale_row  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = offs_k + k0 < k
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w = w.to(x_ptr.dtype.element_ty)  # exact
        if PER_ROW:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            scale = tl.load(scale_rows + k0 // SCALE_BLOCK_K, mask=n_mask, other=0.0)  # [BN]
            acc += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PER_ROW:
        acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Tiles:
    """A launch configuration of ``_fp8_matmul_kernel`` (``BLOCK_K`` must divide a block
    scale's ``block_k``); ``num_stages`` None = Triton's default."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int | None = None


def _tiles(m: int, n: int, block: tuple[int, int], per_row: bool, device: torch.device) -> Tiles:
    """Decode (m <= 16) is weight-bandwidth bound. Measured on an H200 at one token
    (``benchmarks/fp8_decode.py --sweep 1``, Qwen3-30B-A3B's qkv 2048→5120 and o 4096→2048):
    32-wide N tiles when that still gives every SM a program, else 16-wide tiles with a
    longer K step, five stages in flight (qkv 12.1 → 9.3 µs, o 15.2 → 11.0 µs). Prefill:
    the widest N tile that starts two programs per SM."""
    if m <= 16:
        sms = num_sms(device)
        block_n = 32 if triton.cdiv(n, 32) >= sms else 16
        block_k = 128 if block_n == 32 else 256
        if not per_row:
            block_k = min(block_k, block[1])
        return Tiles(16, block_n, block_k, num_warps=4, num_stages=5)
    block_n = 16
    for candidate in (64, 32):
        if triton.cdiv(m, 64) * triton.cdiv(n, candidate) >= 2 * num_sms(device):
            block_n = candidate
            break
    return Tiles(64, block_n, 64 if per_row else min(64, block[1]))


def check_scale_block(block: tuple[int, int], per_row: bool) -> None:
    """Block scales need ``block_k`` a power of two >= 16 (a K tile lies in one block)."""
    if per_row:
        return
    block_k = block[1]
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"FP8 block scales need a power-of-two block_k >= 16, got {block}")


def fp8_matmul(
    x: torch.Tensor,  # [m, k], fp16 / bf16 / fp32
    w: torch.Tensor,  # [n, k] fp8
    scale: torch.Tensor,  # [cdiv(n, bn), cdiv(k, bk)] fp32
    block: tuple[int, int],  # (bn, bk); (1, k) = per output row
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """``x @ dequant(w, scale, block)^T`` as ``[m, n]`` in x's dtype (no bias); ``tiles``
    overrides the launch configuration (benchmarks). Raises ValueError when the scale's
    shape does not match ``w`` and ``block``, or ``tiles.block_k`` does not divide it."""
    m, k = x.shape
    n = w.shape[0]
    per_row = block == (1, k)
    expected = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if w.shape[1] != k or tuple(scale.shape) != expected:
        raise ValueError(
            f"fp8_matmul shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, scale "
            f"{tuple(scale.shape)} (expected {expected} for block {block})"
        )
    check_scale_block(block, per_row)
    x, w, scale = x.contiguous(), w.contiguous(), scale.float().contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    strides = (x.stride(0), out.stride(0), w.stride(0), scale.stride(0))
    scale_args = dict(SCALE_BLOCK_N=block[0], SCALE_BLOCK_K=block[1], PER_ROW=per_row)
    tiles = tiles or _tiles(m, n, block, per_row, x.device)
    if not per_row and block[1] % tiles.block_k:
        raise ValueError(f"BLOCK_K {tiles.block_k} does not divide the scale block {block}")
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    stages = {} if tiles.num_stages is None else {"num_stages": tiles.num_stages}
    _fp8_matmul_kernel[grid](
        out, x, w, scale, m, n, k, *strides, **scale_args,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, **stages,
    )  # fmt: skip
    return out


def dequantize_ref(
    w: torch.Tensor,  # [n, k] fp8
    scale: torch.Tensor,  # [cdiv(n, bn), cdiv(k, bk)]
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``w_fp8 * scale`` broadcast over the blocks, computed in fp32, rounded once to
    ``dtype``: ``[n, k]``."""
    n, k = w.shape
    full_scale = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return (w.float() * full_scale[:, :k]).to(dtype)


def fp8_matmul_ref(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Plain-torch ``fp8_matmul`` (same contract): the dequantised weight through
    ``F.linear`` in x's dtype."""
    return F.linear(x, dequantize_ref(w, scale, block, x.dtype))  # [m, n]
