"""Fused mixture-of-experts MLP: ``sum_j w_j * down_e(act(gate_e(x)) * up_e(x))`` over each
token's top-k experts ``e = topk_ids[t, j]`` with routing weights ``w_j = topk_weights[t, j]``.

Each (token, j) is a *pair*, numbered ``pair_id = t * top_k + j``. ``fused_moe`` picks one
of two paths by how many pairs each expert gets on average:

* **per-pair GEMV** (decode, ``P <= E``: most experts see at most one pair):
  ``fused_moe_decode.py``, two kernels a layer, no sort, no padded rows, the weighted sum
  inside the down kernel.
* **grouped GEMM** (prefill and large batches, this module): pairs are sorted by expert and
  each expert's run padded to a multiple of ``BLOCK_M`` (``moe_align.py``, 3 kernels), so
  every M-block of the sorted list belongs to one expert and is one ``tl.dot`` tile against
  that expert's weights::

      sorted_pair_ids: [ e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | e5 pad pad pad | unused.. ]
      block_expert_ids:[     0        |      2      |       2        |       5        | ...      ]

      x [T, H] --(w13: gate|up, act(gate) * up fused in the epilogue)--> inter [T*k, I]
      inter    --(w2: down, times the pair's routing weight)-----------> out   [T*k, H]
      out.view(T, k, H).sum(1) in fp32                                -> y     [T, H]

  The grid is sized for the worst case, ``cdiv(P, BLOCK_M) + min(E, P)`` blocks, and blocks
  past ``num_padded`` return at once: no host sync, CUDA-graph safe.

Weight layout is the HF one: ``w13 [E, 2*I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``. The intermediate is stored in x's dtype (rounded once after the fp32
activation); accumulation is fp32; fp32 inputs use IEEE fp32 dots (no TF32). FP8 experts
(e4m3 weights with ``ExpertScales``): ``moe_common``. ``fused_moe_ref`` dequantises and runs
a plain-torch loop over the experts. ``ACTIVATIONS`` has GELU(tanh) for Gemma 4's experts.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import max_shared_memory, tl, triton
from vtllm.worker.kernels.fp8_matmul import check_scale_block, dequantize_ref
from vtllm.worker.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref
from vtllm.worker.kernels.fused_moe_decode import moe_decode, moe_decode_into_stream
from vtllm.worker.kernels.moe_align import align_pairs_by_expert
from vtllm.worker.kernels.moe_common import (
    ACTIVATIONS,
    ExpertScales,
    block_scales,
    gate_activation,
    scale_args,
)

__all__ = ["ACTIVATIONS", "ExpertScales", "align_pairs_by_expert", "fused_moe", "fused_moe_ref"]


@triton.jit
def _dot(a, w, acc, A_FP8: tl.constexpr):
    """``acc + a @ w`` in fp32: e4m3 operands on the fp8 tensor-core path, others with
    IEEE fp32 products where they are fp32 (no TF32)."""
    if A_FP8:
        return tl.dot(a, w, acc)
    return tl.dot(a, w, acc, input_precision="ieee")


@triton.jit(do_not_specialize=["num_pairs"])  # step-sized: compile once
def _fused_moe_gemm_kernel(
    out_ptr,  # [num_pairs, n]
    a_ptr,  # [num_pairs // A_PAIRS_PER_ROW, k]: tokens (first GEMM) or the intermediate
    w_ptr,  # [num_experts, n * (2 if GATED else 1), k]
    scale_ptr,  # fp32 [E, rows] (W_SCALE 1) or [E, cdiv(rows, SCALE_BLOCK_N), cdiv(k, bk)] (2)
    a_scale_ptr,  # fp32 [a rows] (W_SCALE 1) or [a rows, cdiv(k, bk)] (2); read when A_FP8
    pair_weights_ptr,  # [num_pairs] fp32 / bf16 / fp16; read when MUL_WEIGHT
    sorted_pair_ids_ptr,  # [max_blocks * BLOCK_M] i32; padding holds num_pairs
    block_expert_ids_ptr,  # [max_blocks] i32
    num_padded_ptr,  # [1] i32: used length of sorted_pair_ids
    n,
    k,
    num_pairs,
    stride_a_row,
    stride_out_row,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    stride_a_scale_row,
    A_PAIRS_PER_ROW: tl.constexpr,  # top_k when a holds tokens, 1 when it holds pairs
    GATED: tl.constexpr,  # w holds gate rows then up rows: out = act(a @ gate) * (a @ up)
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,  # out *= the pair's routing weight
    W_SCALE: tl.constexpr,  # 0: plain weights; FP8 with 1: per-row, 2: block scales
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    A_FP8: tl.constexpr,  # a is e4m3 too (FP8 weights only): fp8 x fp8 dots, a's scales
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m)  # [BLOCK_M]
    pair_mask = pair_ids < num_pairs
    a_rows = (pair_ids // A_PAIRS_PER_ROW).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_row + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = (  # [BLOCK_K, BLOCK_N]: w[expert, n, k] read transposed
        w_ptr + expert * stride_w_expert + offs_n[None, :].to(tl.int64) * stride_w_row
    ) + offs_k[:, None]
    scale_base = scale_ptr + expert * stride_scale_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_scale_ptrs = a_scale_ptr + a_rows * stride_a_scale_row  # [BLOCK_M]
    for k0 in range(0, k, BLOCK_K):
        k_mask = offs_k + k0 < k
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        # e4m3 weights become a's dtype: bf16 / fp16 (exact), or stay e4m3 with A_FP8
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(a_ptr.dtype.element_ty)
        if GATED:
            w_up = tl.load(w_ptrs + n * stride_w_row, mask=w_mask, other=0.0)
            w_up = w_up.to(a_ptr.dtype.element_ty)
        if W_SCALE == 2:
            scale = block_scales(
                scale_base, offs_n, k0, n_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K
            )[None, :]  # [1, BLOCK_N]
            if GATED:
                scale_up = block_scales(
                    scale_base,
                    offs_n + n,
                    k0,
                    n_mask,
                    stride_scale_row,
                    SCALE_BLOCK_N,
                    SCALE_BLOCK_K,
                )[None, :]
            if A_FP8:
                a_scale = tl.load(a_scale_ptrs + k0 // SCALE_BLOCK_K, mask=pair_mask, other=0.0)[
                    :, None
                ]  # [BLOCK_M, 1]
                scale = a_scale * scale
                if GATED:
                    scale_up = a_scale * scale_up
            acc += _dot(a, w, tl.zeros_like(acc), A_FP8) * scale
            if GATED:
                acc_up += _dot(a, w_up, tl.zeros_like(acc_up), A_FP8) * scale_up
        else:
            acc = _dot(a, w, acc, A_FP8)
            if GATED:
                acc_up = _dot(a, w_up, acc_up, A_FP8)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        row_scale = tl.load(scale_base + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED:
            row_scale_up = tl.load(scale_base + n + offs_n, mask=n_mask, other=0.0)[None, :]
        if A_FP8:
            a_scale = tl.load(a_scale_ptrs, mask=pair_mask, other=0.0)[:, None]  # [BLOCK_M, 1]
            row_scale = a_scale * row_scale
            if GATED:
                row_scale_up = a_scale * row_scale_up
        acc = acc * row_scale
        if GATED:
            acc_up = acc_up * row_scale_up
    if GATED:
        acc = gate_activation(acc, ACTIVATION) * acc_up
    if MUL_WEIGHT:
        weights = tl.load(pair_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        weights = weights.to(tl.float32)
        acc = acc * weights[:, None]
    out_ptrs = out_ptr + pair_ids.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


def _gemm_tiles(
    num_pairs: int,
    num_experts: int,
    gated: bool,
    fp8_activations: bool = False,
    block_scales: bool = False,
) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMM by the mean
    number of pairs per expert; ``gated``: the gate/up GEMM (two weight tiles a K step).
    BLOCK_M is the gate/up's (one alignment serves both GEMMs). From an H200 sweep at a
    Qwen3-30B-A3B layer (``fused_moe_kernel.py --sweep-gemm``, graph-timed, 2026-12-03):
    64 tokens 393 → 380 µs, 256 tokens 589 → 475 (gate/up) and → 555 (down) µs, 1024
    tokens 785 → 653 / 721 µs, 8192 tokens 3,419 → 3,252 / 2,633 µs (each GEMM's change
    measured with the other at the old default).

    e4m3 activations (``fp8_activations``, w8a8; ``block_scales``: 128x128 weight blocks)
    take 128-wide K steps where the H200 sweep of 2026-12-06 (``--sweep-gemm --fp8
    [--block-scales]``, same layer) found them faster, each GEMM with the other at the
    bf16 tiles: 256 tokens, row scales gate/up 238.6 → 210.0 µs and down → 227.6, block
    scales 314.7 → 255.5 and → 284.0; 8192 tokens, row scales down 1,338.9 → 1,261.1
    (gate/up: no 64-row tile was faster), block scales 2,526.2 → 2,054.4 and → 2,241.6."""
    if num_pairs <= 4 * num_experts:  # decode-sized batches: 16-row tiles, K 128
        return 16, 128, 128, 4, 3
    if num_pairs <= 128 * num_experts:
        if fp8_activations:
            return (64, 64, 128, 4, 3) if gated else (64, 128, 128, 8, 3)
        return (64, 64, 64, 4, 3) if gated else (64, 128, 64, 4, 3)
    if fp8_activations and block_scales:
        return (64, 64, 128, 4, 3) if gated else (64, 128, 128, 8, 3)
    if fp8_activations:
        return (64, 128, 64, 8, 4) if gated else (64, 128, 128, 4, 3)
    return (64, 128, 64, 8, 4) if gated else (64, 128, 64, 8, 3)


def fit_shared_memory(
    tiles: tuple[int, ...], element_size: int, gated: bool, limit: int
) -> tuple[int, ...]:
    """``tiles`` (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) with fewer stages, then a
    narrower BLOCK_K, until the pipeline's buffers fit ``limit`` bytes: per stage an A tile
    and one (two when ``gated``) weight tiles, plus the output tile (Triton's count on an
    H200 for the fp32 gate/up at 64×128×64, 4 stages: 3 × 80 KiB + 32 KiB). The bf16 tiles
    of ``_gemm_tiles`` fit an H200 as they are; fp32 ones and ROCm's 64 KiB LDS shrink."""
    block_m, block_n, block_k, warps, stages = tiles

    def needed(block_k: int, stages: int) -> int:
        per_stage = block_m * block_k + (2 if gated else 1) * block_k * block_n
        return (stages * per_stage + block_m * block_n) * element_size

    while needed(block_k, stages) > limit and stages > 2:
        stages -= 1
    while needed(block_k, stages) > limit and block_k > 16:
        block_k //= 2
    return block_m, block_n, block_k, warps, stages


def _launch_gemm(
    out: torch.Tensor,  # [num_pairs, n]
    a: torch.Tensor,  # [num_a_rows, k]
    w: torch.Tensor,  # [E, n or 2n, k]
    scales: ExpertScales | None,
    pair_weights: torch.Tensor,  # [num_pairs]
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    a_pairs_per_row: int,
    gated: bool,
    activation: int,
    fp8_activations: bool,
) -> None:
    """One grouped GEMM: gate/up (``gated``, a holds tokens) or down (times the pair's
    routing weight, a holds the pairs' intermediate). ``fp8_activations`` (FP8 ``w``
    only): ``a`` is quantised here, one scale a row or, with block scales, a K block."""
    num_pairs, n = out.shape
    a_scale = pair_weights  # never read without fp8_activations
    if fp8_activations:
        a, a_scale = quantize_fp8(a, w.dtype, None if scales.block is None else scales.block[1])
    sorted_pair_ids, block_expert_ids, num_padded, block_m = alignment
    block_scales = scales is not None and scales.block is not None
    tiles = _gemm_tiles(num_pairs, w.shape[0], gated, fp8_activations, block_scales)
    tiles = (block_m, *tiles[1:])
    limit = max_shared_memory(out.device)
    _, block_n, block_k, num_warps, num_stages = fit_shared_memory(
        tiles, a.element_size(), gated, limit
    )
    scale, scale_strides, constexprs, block_k = scale_args(scales, pair_weights, block_k)
    grid = (block_expert_ids.numel(), triton.cdiv(n, block_n))
    _fused_moe_gemm_kernel[grid](
        out, a, w, scale, a_scale, pair_weights, sorted_pair_ids, block_expert_ids, num_padded,
        n, a.shape[1], num_pairs, a.stride(0), out.stride(0), w.stride(0), w.stride(1),
        *scale_strides, a_scale.stride(0), A_PAIRS_PER_ROW=a_pairs_per_row, GATED=gated,
        ACTIVATION=activation, MUL_WEIGHT=not gated, **constexprs, A_FP8=fp8_activations,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k], any float dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k], expert ids in [0, num_experts)
    activation: str = "silu",
    path: str = "auto",
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum per token, ``[num_tokens, hidden]`` in x's dtype.

    ``path``: ``auto`` (GEMV when ``num_tokens * top_k <= num_experts``, else grouped GEMM),
    ``gemv`` or ``gemm``. FP8 ``w13`` / ``w2`` come with their ``ExpertScales``; with
    ``fp8_activations`` the grouped GEMMs also quantise their inputs to e4m3 (``fp8_quant``:
    per token, or per 128-wide K block with block scales) and dot e4m3 by e4m3 (w8a8, as
    vLLM's FP8 MoE does: no weight-tile conversion, the tensor cores' fp8 rate for
    prefill-sized GEMMs); ignored for plain weights and on the GEMV path, which reads the
    e4m3 weights as they are. Raises ValueError on inconsistent shapes.
    """
    if path not in ("auto", "gemv", "gemm"):
        raise ValueError(f"path must be auto, gemv or gemm, got {path!r}")
    x, w13, w2, pair_weights, pair_experts = _checked_pairs(
        x, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales
    )
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    num_pairs = pair_weights.numel()
    if num_pairs == 0:
        return torch.zeros_like(x)
    use_gemv = path == "gemv" or (path == "auto" and num_pairs <= num_experts)
    act = ACTIVATIONS[activation]
    if use_gemv:
        return moe_decode(x, w13, w2, pair_weights, pair_experts, act, w13_scales, w2_scales)
    block_m = _gemm_tiles(num_pairs, num_experts, True)[0]
    alignment = (*align_pairs_by_expert(topk_ids, num_experts, block_m), block_m)
    inter_out = torch.empty(num_pairs, w2.shape[2], dtype=x.dtype, device=x.device)  # [P, I]
    w8a8 = fp8_activations and w13_scales is not None and w2_scales is not None
    _launch_gemm(inter_out, x, w13, w13_scales, pair_weights, alignment, top_k, True, act, w8a8)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    _launch_gemm(pair_out, inter_out, w2, w2_scales, pair_weights, alignment, 1, False, act, w8a8)
    # the weighted pairs of a token summed in fp32 (no fp32 copy of pair_out), rounded once
    return pair_out.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_into_stream(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream
    next_norm_weight: torch.Tensor | None,  # [hidden]: the next layer's RMSNorm weight
    activation: str = "silu",
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_moe`` on the decode path with the residual add (and the next norm's weight)
    in the down kernel's epilogue: ``(stream, scaled)`` as ``moe_decode_into_stream``
    returns them. Only for ``num_tokens * top_k <= num_experts`` (the decode path's
    condition); ValueError otherwise and on inconsistent shapes."""
    x, w13, w2, pair_weights, pair_experts = _checked_pairs(
        x, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales
    )
    if not 0 < pair_weights.numel() <= w13.shape[0]:
        raise ValueError(
            f"{pair_weights.numel()} (token, expert) pairs: the decode path takes 1 to "
            f"{w13.shape[0]} (the number of experts); run fused_moe and add the residual"
        )
    return moe_decode_into_stream(
        x, w13, w2, pair_weights, pair_experts, ACTIVATIONS[activation], residual,
        next_norm_weight, w13_scales, w2_scales,
    )  # fmt: skip


def _checked_pairs(x, w13, w2, topk_weights, topk_ids, w13_scales, w2_scales) -> tuple:
    """``(x, w13, w2, pair_weights [P], pair_experts [P] i32)``, contiguous, after the
    shape checks ``fused_moe`` documents."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    if (
        w13_hidden != hidden
        or two_inter % 2
        or w2.shape != (num_experts, hidden, inter)
        or topk_weights.shape != topk_ids.shape
        or topk_ids.shape[0] != num_tokens
    ):
        raise ValueError(
            f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, topk_ids {tuple(topk_ids.shape)}, "
            f"topk_weights {tuple(topk_weights.shape)}"
        )
    for scales in (w13_scales, w2_scales):
        if scales is not None and scales.block is not None:
            check_scale_block(scales.block, per_row=False)
    num_pairs = topk_ids.numel()
    pair_weights = topk_weights.reshape(num_pairs)  # [num_pairs], read as fp32 in the kernels
    if pair_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        pair_weights = pair_weights.float()
    pair_weights = pair_weights.contiguous()  # bf16 weights (Qwen3-MoE rounds) cost no copy
    pair_experts = topk_ids.reshape(num_pairs).to(torch.int32).contiguous()  # [num_pairs]
    return x.contiguous(), w13.contiguous(), w2.contiguous(), pair_weights, pair_experts


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """Plain-torch ``fused_moe`` (same contract): a loop over the experts that were hit,
    fp32 math with the intermediate rounded to x's dtype, as the kernels do; FP8 experts
    dequantised to fp32 first, and with ``fp8_activations`` each GEMM's input rows
    quantised and dequantised as the w8a8 kernels quantise them."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    act = ACTIVATIONS[activation]
    w8a8 = fp8_activations and w13_scales is not None and w2_scales is not None

    def as_w8a8_input(rows: torch.Tensor, scales: ExpertScales, fp8_dtype: torch.dtype):
        group = rows.shape[1] if scales.block is None else scales.block[1]
        codes, scale = quantize_fp8_ref(rows, fp8_dtype, group)
        return dequantize_ref(codes, scale, (1, group), torch.float32)

    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        rows = x[token_idx].float()  # [n_e, hidden]
        if w8a8:
            rows = as_w8a8_input(x[token_idx], w13_scales, w13.dtype)
        w13_e = w13[expert].float() if w13_scales is None else w13_scales.dequantize(w13, expert)
        w2_e = w2[expert].float() if w2_scales is None else w2_scales.dequantize(w2, expert)
        gate_up = rows @ w13_e.t()  # [n_e, 2 * inter]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if act == ACTIVATIONS["gelu_tanh"]:
            activated = torch.nn.functional.gelu(gate, approximate="tanh")
        else:
            activated = torch.nn.functional.silu(gate)
        inter_rows = (activated * up).to(x.dtype).float()  # [n_e, inter]
        if w8a8:
            inter_rows = as_w8a8_input(inter_rows.to(x.dtype), w2_scales, w2.dtype)
        down = inter_rows @ w2_e.t()  # [n_e, hidden]
        weights = topk_weights[token_idx, slot_idx].float()[:, None]
        acc.index_add_(0, token_idx, (down * weights).to(x.dtype).float())
    return acc.to(x.dtype)
