"""Dense ``y = x W^T`` for a few rows (decode batches of 1–4): a GEMV, beside ``F.linear``.

At one token a linear layer reads its whole weight to make one row; the library GEMM
(cuBLAS / hipBLASLt) runs these small products at a fraction of the memory bandwidth —
on an H200, Qwen3-0.6B's four linears a layer take ~27 µs where their 31 MB could stream
in ~7 µs (profile in docs/BENCHMARKS.md). Here one program owns ``BLOCK_N`` outputs of
every row: it streams its ``[BLOCK_N, BLOCK_K]`` weight tiles once, multiplies them with
the ``BLOCK_M`` rows of x in fp32 (``tl.sum``, no tensor cores: at this size the product
is free and the tiles' bytes are all that matters), and rounds once::

    x [M, K] (M <= 4)  ·  W [N, K]  ->  y [M, N]      one program per BLOCK_N outputs

An FP8 (e4m3) weight with one fp32 scale per output row (``--quantization fp8``, or a
checkpoint's per-channel ``weight_scale``) reads one byte an element: the tile is
converted to fp32 (exact) and the row's scale multiplies its sum once, after the K loop.

Which of the two is faster depends on the shape and the device, so nothing here decides:
``layers/small_batch.py`` times both for each of a model's weight shapes at start-up and
installs this kernel only where it wins. ``gemv_ref`` is the torch twin (``F.linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vtllm.worker.kernels._triton import tl, triton

# the most rows the kernel takes (a decode batch up to this size)
MAX_GEMV_ROWS = 4


@dataclass(frozen=True)
class GemvTiles:
    """A launch configuration of ``_gemv_kernel``."""

    block_n: int
    block_k: int
    num_warps: int


# configurations tried at start-up (small_batch.py), from a sweep of 4-32 outputs by
# 256-1024 K a program, 4/8 warps, split K 1-8 (benchmarks/gemv_kernel.py --sweep, H100,
# Qwen3-0.6B / Llama-3-8B / Qwen3-30B-A3B shapes at one row): 4 x 1024 with 4 warps was
# the fastest on 12 of 13 shapes (many programs, each with 8 KB of one load in flight);
# split K never won (it adds a pass over fp32 partials for programs that are already many)
CANDIDATE_TILES = (
    GemvTiles(4, 1024, 4),
    GemvTiles(8, 1024, 4),
    GemvTiles(4, 1024, 8),
    GemvTiles(4, 512, 4),
    GemvTiles(16, 512, 8),
)


@triton.jit
def _gemv_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    row_scale_ptr,  # [N] fp32, read when ROW_SCALE
    M,
    N,
    K,
    stride_x_row,
    stride_out_row,
    stride_w_row,
    BLOCK_M: tl.constexpr,  # power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_SCALE: tl.constexpr,  # multiply output column n by row_scale[n] (FP8 weights)
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_x_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w_row + offs_k[None, :]  # [N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ROW_SCALE:
        acc *= tl.load(row_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_GEMV_ROWS
    weight: torch.Tensor,  # [N, K]; FP8 with row_scale
    tiles: GemvTiles,
    row_scale: torch.Tensor | None = None,  # [N] fp32: weight row n is weight[n] * row_scale[n]
) -> torch.Tensor:
    """``x @ weight.T`` (with ``row_scale``: ``x @ (weight * row_scale[:, None]).T``) as
    ``[M, N]`` in x's dtype (fp32 accumulation, rounded once). ValueError for more than
    ``MAX_GEMV_ROWS`` rows or shapes that disagree."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_GEMV_ROWS or weight.shape[1] != k:
        raise ValueError(
            f"gemv takes at most {MAX_GEMV_ROWS} rows and matching K: x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if row_scale is not None and row_scale.shape != (n,):
        raise ValueError(f"row_scale {tuple(row_scale.shape)} for a weight of {n} rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    scale = out if row_scale is None else row_scale.float().contiguous()  # unread without
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        out, x, weight, scale, num_rows, n, k, x.stride(0), out.stride(0), weight.stride(0),
        BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, ROW_SCALE=row_scale is not None, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch twin: ``F.linear`` (what the layer runs when the kernel does not win); a
    scaled weight is dequantised in fp32 and rounded once to x's dtype first."""
    if row_scale is not None:
        weight = (weight.float() * row_scale.float()[:, None]).to(x.dtype)
    return F.linear(x, weight)
