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

Three optional stages fold a decode layer's small kernels into its GEMVs (one row's
worth of work each, repeated by every program: a few KB read from L2), each rounded
exactly as the separate kernel it replaces rounds, so that a fused chain gives the same
bits as the unfused one up to the order of the RMS sum:

* ``norm_weight``: x is first RMS-normalised, Llama style (``kernels/rms_norm.py``:
  ``(x * rstd).to(dtype) * weight``), the norm before q/k/v and before gate/up;
* ``silu_and_mul``: x is the gate|up output ``[M, 2K]`` and the product takes
  ``silu(gate) * up`` rounded to x's dtype (``kernels/activation.py``), before down;
* ``residual``: the rounded output plus ``residual [M, N]``, rounded again (the residual
  add of ``rms_norm``), after o and down.

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
# split K never won (it adds a pass over fp32 partials for programs that are already many).
# The last two from session 42's sweep, which added 2-output and 2048/4096-wide K tiles
# (H100, one row): on the Qwen3-0.6B shape qkv 6.16 -> 5.37 us (2 x 1024), o 4.84 -> 4.07
# (2 x 2048), gate/up 7.08 -> 6.87; on Qwen3-30B-A3B's o 9.24 -> 8.37 (2 x 2048; cuBLAS
# 10.05). Not 4 x 4096 (down 5.86 -> 5.11 at one row): compiled for sm_90 (Triton 3.6)
# it takes 127 registers a thread at one row and 226 at four, where every candidate here
# takes at most 105 at four (no spills in any), so at 2-4 rows it runs half as many
# programs an SM or fewer; start-up times one row only.
CANDIDATE_TILES = (
    GemvTiles(4, 1024, 4),
    GemvTiles(8, 1024, 4),
    GemvTiles(4, 1024, 8),
    GemvTiles(4, 512, 4),
    GemvTiles(16, 512, 8),
    GemvTiles(2, 1024, 4),
    GemvTiles(2, 2048, 4),
)


@triton.jit
def _gemv_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]; [M, 2 * K] (gate | up) with SILU_AND_MUL
    w_ptr,  # [N, K]
    row_scale_ptr,  # [N] fp32, read when ROW_SCALE
    norm_weight_ptr,  # [K], read when NORM
    residual_ptr,  # [M, N], read when RESIDUAL
    M,
    N,
    K,
    stride_x_row,
    stride_out_row,
    stride_w_row,
    stride_residual_row,
    eps,
    BLOCK_M: tl.constexpr,  # power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_SCALE: tl.constexpr,  # multiply output column n by row_scale[n] (FP8 weights)
    NORM: tl.constexpr,  # RMS-normalise x (weight norm_weight) before the product
    SILU_AND_MUL: tl.constexpr,  # x holds gate | up: the product takes silu(gate) * up
    RESIDUAL: tl.constexpr,  # add residual to the rounded output
    USE_GDC: tl.constexpr,  # launched with programmatic dependent launch (CUDA, sm90+)
):
    pid_n = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_x_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w_row + offs_k[None, :]  # [N, K]
    if USE_GDC:
        # the weights are no kernel's output: the first tile streams in while the previous
        # kernel finishes; everything the previous kernels wrote (x, residual) is read, and
        # everything is written, only after the wait
        w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:  # each row's 1 / rms over its K inputs
        sum_sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x_mask = m_mask[:, None] & (offs_k[None, :] + k0 < K)
            x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps)  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        if SILU_AND_MUL:
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(dtype)
        if NORM:
            norm_weight = tl.load(norm_weight_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            # (x * rstd).to(dtype) * weight in dtype: the product of two 16-bit floats is
            # exact in fp32, so one rounding of it is the 16-bit multiply
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            x = (normed * norm_weight.to(tl.float32)[None, :]).to(dtype)
        x = x.to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        if USE_GDC:
            if k0 == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ROW_SCALE:
        acc *= tl.load(row_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        residual_ptrs = residual_ptr + offs_m[:, None] * stride_residual_row + offs_n[None, :]
        residual = tl.load(residual_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + residual).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_out_row + offs_n[None, :], y, mask=out_mask)


def gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_and_mul), M <= MAX_GEMV_ROWS
    weight: torch.Tensor,  # [N, K]; FP8 with row_scale
    tiles: GemvTiles,
    row_scale: torch.Tensor | None = None,  # [N] fp32: weight row n is weight[n] * row_scale[n]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMS-normalise x first
    norm_eps: float = 1e-6,
    silu_and_mul: bool = False,  # x is gate | up: multiply by silu(gate) * up
    residual: torch.Tensor | None = None,  # [M, N]: added to the rounded output
    pdl: bool = False,  # programmatic dependent launch (CUDA sm90+ only; see below)
) -> torch.Tensor:
    """``x @ weight.T`` (with ``row_scale``: ``x @ (weight * row_scale[:, None]).T``) as
    ``[M, N]`` in x's dtype (fp32 accumulation, rounded once), with the optional stages
    of the module docstring (``gemv_ref`` spells them out). ValueError for more than
    ``MAX_GEMV_ROWS`` rows or shapes that disagree.

    ``pdl``: launch with programmatic dependent launch, so that on Hopper the kernel can
    start, and fetch its first weight tile, while the kernel before it in the stream (or
    graph) finishes; it waits for that kernel before reading x or the residual. With
    ``VT_DECODE_PDL=auto`` (off by default) the fused decode chain takes it where start-up
    timing says it pays (``layers/small_batch.py``); ``benchmarks/gemv_kernel.py --pdl``
    measures it."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if silu_and_mul:
        k //= 2
    if num_rows > MAX_GEMV_ROWS or weight.shape[1] != k or x.shape[1] != k * (1 + silu_and_mul):
        raise ValueError(
            f"gemv takes at most {MAX_GEMV_ROWS} rows and matching K: x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}{' (x holds gate | up)' if silu_and_mul else ''}"
        )
    if row_scale is not None and row_scale.shape != (n,):
        raise ValueError(f"row_scale {tuple(row_scale.shape)} for a weight of {n} rows")
    if norm_weight is not None and silu_and_mul:
        raise ValueError("gemv normalises x or takes silu(gate) * up, not both")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} for K = {k}")
    if residual is not None and residual.shape != (num_rows, n):
        raise ValueError(f"residual {tuple(residual.shape)} for an output of {(num_rows, n)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    scale = out if row_scale is None else row_scale.float().contiguous()  # unread without
    residual = out if residual is None else residual.contiguous()
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        out, x, weight, scale, out if norm_weight is None else norm_weight, residual,
        num_rows, n, k, x.stride(0), out.stride(0), weight.stride(0), residual.stride(0),
        norm_eps, BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, ROW_SCALE=row_scale is not None, NORM=norm_weight is not None,
        SILU_AND_MUL=silu_and_mul, RESIDUAL=residual is not out, USE_GDC=pdl,
        num_warps=tiles.num_warps, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    silu_and_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin: the separate steps ``gemv`` fuses — the activation's and the
    norm's reference kernels, ``F.linear`` (what the layer runs when the kernel does not
    win), the residual add; a scaled weight is dequantised in fp32 and rounded once to
    x's dtype first."""
    from vtllm.worker.kernels.activation import silu_and_mul_ref
    from vtllm.worker.kernels.rms_norm import rms_norm_ref

    if silu_and_mul:
        x = silu_and_mul_ref(x)
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, norm_eps)[0]
    if row_scale is not None:
        weight = (weight.float() * row_scale.float()[:, None]).to(x.dtype)
    out = F.linear(x, weight)
    if residual is not None:
        out = (out.float() + residual.float()).to(out.dtype)
    return out
