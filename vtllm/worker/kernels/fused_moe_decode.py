"""The fused-MoE decode path: two kernels a layer when most experts see at most one pair.

For ``num_tokens * top_k <= num_experts`` (``fused_moe.fused_moe`` chooses; the contract
and the pair numbering are its): no sort and no padded rows. One program per (pair, N tile)
reads its expert's gate and up rows and writes ``act(gate) * up`` (pairs that share an
expert read it again, mostly from L2); then one program per (token, N tile) reads the down
rows of all the token's k experts at once (a ``[k, BLOCK_N, BLOCK_K]`` tile per K step) and
writes the routing-weighted sum straight to ``y`` (fp32 sum, rounded once)::

    x [T, H] --(gate/up GEMV, act(gate) * up)--------------> inter [T*k, I]
    inter    --(down GEMV of the k experts, weighted sum)--> y     [T, H]

Launch configurations come from an H200 sweep (``benchmarks/fused_moe_kernel.py --sweep``).
FP8 experts as in ``moe_common``.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import num_sms, tl, triton
from vtllm.worker.kernels.moe_common import (
    ExpertScales,
    block_scales,
    gate_activation,
    scale_args,
)


@triton.jit
def _fused_moe_gemv_kernel(
    out_ptr,  # [num_pairs, n]: act(gate) * up
    a_ptr,  # [num_pairs // TOP_K, k]: the tokens
    w_ptr,  # [num_experts, 2 * n, k]: gate rows, then up rows
    scale_ptr,  # fp32 [E, rows] (W_SCALE 1) or [E, cdiv(rows, SCALE_BLOCK_N), cdiv(k, bk)] (2)
    pair_expert_ids_ptr,  # [num_pairs] i32: topk_ids flattened
    n,
    k,
    stride_a_row,
    stride_out_row,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A program owns one pair's ``BLOCK_N`` intermediate outputs: its expert's gate and up
    rows against the pair's token, fp32 dot, the activation, rounded once."""
    pair_id = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(pair_expert_ids_ptr + pair_id).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + (pair_id // TOP_K) * stride_a_row
    w_ptrs = (  # [BLOCK_N, BLOCK_K]
        w_ptr + expert * stride_w_expert + offs_n[:, None].to(tl.int64) * stride_w_row
    ) + offs_k[None, :]
    scale_base = scale_ptr + expert * stride_scale_expert
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = offs_k + k0 < k
        a = tl.load(a_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        w_up = tl.load(w_ptrs + n * stride_w_row, mask=w_mask, other=0.0).to(tl.float32)
        part = tl.sum(w * a[None, :], axis=1)
        part_up = tl.sum(w_up * a[None, :], axis=1)
        if W_SCALE == 2:
            part *= block_scales(
                scale_base, offs_n, k0, n_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K
            )
            part_up *= block_scales(
                scale_base, offs_n + n, k0, n_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K
            )
        acc += part
        acc_up += part_up
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc = acc * tl.load(scale_base + offs_n, mask=n_mask, other=0.0)
        acc_up = acc_up * tl.load(scale_base + n + offs_n, mask=n_mask, other=0.0)
    acc = gate_activation(acc, ACTIVATION) * acc_up
    tl.store(out_ptr + pair_id * stride_out_row + offs_n, acc.to(out_ptr.dtype.element_ty), n_mask)


@triton.jit
def _fused_moe_down_sum_kernel(
    out_ptr,  # [num_tokens, n]
    a_ptr,  # [num_tokens * TOP_K, k]: the pairs' intermediate
    w_ptr,  # [num_experts, n, k]
    scale_ptr,  # as in the gate/up kernel
    pair_weights_ptr,  # [num_pairs] fp32 / bf16 / fp16
    pair_expert_ids_ptr,  # [num_pairs] i32
    residual_ptr,  # [num_tokens, n], read when RESIDUAL
    scaled_out_ptr,  # [num_tokens, n], written when SCALED_OUT
    norm_weight_ptr,  # [n], read when SCALED_OUT
    n,
    k,
    stride_a_row,
    stride_out_row,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    TOP_K: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,  # power of two >= TOP_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SCALED_OUT: tl.constexpr,
):
    """Decode path's down projection and weighted sum in one: a program owns one token's
    ``BLOCK_N`` outputs and reads all ``TOP_K`` experts' rows at once (a
    ``[TOP_K, BLOCK_N, BLOCK_K]`` tile per K step), so no per-pair output is stored.
    ``RESIDUAL``: the rounded sum plus the residual row, rounded again (the residual add
    of ``rms_norm``); ``SCALED_OUT``: that output times the next norm's weight, rounded,
    stored as well (``moe_decode_into_stream``)."""
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_j = tl.arange(0, BLOCK_TOPK)
    j_mask = offs_j < TOP_K
    pairs = token * TOP_K + offs_j  # [J]
    experts = tl.load(pair_expert_ids_ptr + pairs, mask=j_mask, other=0).to(tl.int64)
    weights = tl.load(pair_weights_ptr + pairs, mask=j_mask, other=0.0).to(tl.float32)  # [J]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (  # [J, BLOCK_N, BLOCK_K]
        w_ptr
        + experts[:, None, None] * stride_w_expert
        + offs_n[None, :, None].to(tl.int64) * stride_w_row
        + offs_k[None, None, :]
    )
    a_ptrs = a_ptr + pairs[:, None] * stride_a_row + offs_k[None, :]  # [J, BLOCK_K]
    scale_base = scale_ptr + experts * stride_scale_expert  # [J]
    jn_mask = j_mask[:, None] & n_mask[None, :]  # [J, BLOCK_N]
    acc = tl.zeros((BLOCK_TOPK, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = offs_k + k0 < k
        a = tl.load(a_ptrs, mask=j_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=jn_mask[:, :, None] & k_mask[None, None, :], other=0.0)
        part = tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)  # [J, BLOCK_N]
        if W_SCALE == 2:
            block_rows = (offs_n // SCALE_BLOCK_N).to(tl.int64) * stride_scale_row
            part *= tl.load(
                scale_base[:, None] + block_rows[None, :] + k0 // SCALE_BLOCK_K,
                mask=jn_mask,
                other=0.0,
            )
        acc += part
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc *= tl.load(scale_base[:, None] + offs_n[None, :], mask=jn_mask, other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0)  # [BLOCK_N]: the weighted sum, fp32
    out = out.to(out_ptr.dtype.element_ty)
    row = token * stride_out_row + offs_n
    if RESIDUAL:
        residual = tl.load(residual_ptr + row, mask=n_mask, other=0.0)
        out = (out.to(tl.float32) + residual.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row, out, mask=n_mask)
    if SCALED_OUT:
        weight = tl.load(norm_weight_ptr + offs_n, mask=n_mask, other=0.0)
        scaled = (out.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(scaled_out_ptr + row, scaled, mask=n_mask)


def _gemv_tiles(
    num_pairs: int, n: int, k: int, device: torch.device, weight_bytes: int = 2
) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV over weights of ``weight_bytes``
    an element: the widest N tile (64, 32) that still gives every SM two programs, else 8
    outputs by up to 1,024 K with 4 warps (16-bit weights) or by up to 512 K with 8 warps
    (FP8). At batch 1 (8 pairs) a 64-wide tile would start only 96 programs for a
    768-wide expert and leave most of the SMs idle; the narrow tile starts 768. From the
    one-token sweep (``fused_moe_kernel.py --sweep [--fp8]``, Qwen3-30B-A3B layer, H100,
    2026-12-06): bf16 experts 37.95-38.38 µs with session 21's 16 x 256 / 8 warps, 34.53 µs
    with 8 x 1024 / 4 warps (and 29.4-30.1 µs with the down tiles below as well); FP8
    21.6 µs with 8 x 1024 / 4 warps, 19.3 µs with 8 x 512 / 8 warps."""
    for block_n in (64, 32):
        if num_pairs * triton.cdiv(n, block_n) >= 2 * num_sms(device):
            return block_n, 128, 4
    if weight_bytes == 1:
        return 8, min(512, triton.next_power_of_2(k)), 8
    return 8, min(1024, triton.next_power_of_2(k)), 4


def _down_sum_tiles(num_tokens: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the down-and-sum kernel: the widest N tile (32,
    16) that gives every SM two programs, else 2 outputs by up to 256 K with 8 warps (one
    token: 2,048 outputs in 1,024 programs; same sweep: 8 x 128, session 21's choice,
    37.95-38.38 µs for the layer, 2 x 256 34.26 µs)."""
    for block_n in (32, 16):
        if num_tokens * triton.cdiv(n, block_n) >= 2 * num_sms(device):
            return block_n, 128, 8
    return 2, min(256, triton.next_power_of_2(k)), 8


def moe_decode(
    x: torch.Tensor,  # [num_tokens, hidden], contiguous
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden], contiguous
    w2: torch.Tensor,  # [num_experts, hidden, inter], contiguous
    pair_weights: torch.Tensor,  # [num_pairs] fp32 / bf16 / fp16, contiguous
    pair_experts: torch.Tensor,  # [num_pairs] i32, contiguous
    activation: int,  # a ``moe_common.ACTIVATIONS`` code
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
) -> torch.Tensor:
    """``[num_tokens, hidden]`` in x's dtype: the decode path (module docstring) for
    ``num_pairs = num_tokens * top_k`` pairs; inputs already checked by ``fused_moe``."""
    inter_out = _gate_up(x, w13, pair_weights, pair_experts, activation, w13_scales)
    out = torch.empty_like(x)  # [T, H]
    _down_sum(out, inter_out, w2, pair_weights, pair_experts, w2_scales)
    return out


def moe_decode_into_stream(
    x: torch.Tensor,  # [num_tokens, hidden], contiguous
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_weights: torch.Tensor,
    pair_experts: torch.Tensor,
    activation: int,
    residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream the block adds to
    next_norm_weight: torch.Tensor | None,  # [hidden]: the next layer's RMSNorm weight
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``moe_decode`` with the residual add of the next norm in the down kernel's epilogue:
    ``(stream, scaled)`` where ``stream = (moe_decode(...) + residual)`` rounded (the
    residual stream after the block) and ``scaled = (stream * next_norm_weight)`` rounded,
    or None without a weight. ``scaled`` is the next layer's RMSNorm output before its
    ``1/rms``, a per-row scalar that ``qkv_prep``'s ``input_stream`` applies after the
    projection (``MoeLlamaForCausalLM``'s decode chain): one norm launch a layer fewer."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype}: expected the tokens' "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if next_norm_weight is not None and next_norm_weight.shape != (x.shape[1],):
        raise ValueError(
            f"next_norm_weight {tuple(next_norm_weight.shape)}: expected ({x.shape[1]},)"
        )
    inter_out = _gate_up(x, w13, pair_weights, pair_experts, activation, w13_scales)
    stream = torch.empty_like(x)  # [T, H]
    scaled = None if next_norm_weight is None else torch.empty_like(x)
    _down_sum(
        stream, inter_out, w2, pair_weights, pair_experts, w2_scales,
        residual.contiguous(), scaled, next_norm_weight,
    )  # fmt: skip
    return stream, scaled


def _gate_up(x, w13, pair_weights, pair_experts, activation, w13_scales) -> torch.Tensor:
    """The first kernel: ``[num_pairs, inter]``, act(gate) * up of each pair."""
    num_pairs, hidden, inter = pair_weights.numel(), x.shape[1], w13.shape[1] // 2
    top_k = num_pairs // x.shape[0]
    inter_out = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    block_n, block_k, num_warps = _gemv_tiles(
        num_pairs, inter, hidden, x.device, w13.element_size()
    )
    scale, scale_strides, constexprs, block_k = scale_args(w13_scales, pair_weights, block_k)
    _fused_moe_gemv_kernel[(num_pairs, triton.cdiv(inter, block_n))](
        inter_out, x, w13, scale, pair_experts, inter, hidden,
        x.stride(0), inter_out.stride(0), w13.stride(0), w13.stride(1), *scale_strides,
        TOP_K=top_k, ACTIVATION=activation, **constexprs,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return inter_out


def _down_sum(
    out, inter_out, w2, pair_weights, pair_experts, w2_scales,
    residual=None, scaled_out=None, norm_weight=None,
) -> None:  # fmt: skip
    """The second kernel into ``out`` ``[T, H]`` (contiguous, as ``residual`` and
    ``scaled_out``)."""
    (num_tokens, hidden), inter = out.shape, w2.shape[2]
    top_k = pair_weights.numel() // num_tokens
    block_n, block_k, num_warps = _down_sum_tiles(num_tokens, hidden, inter, out.device)
    scale, scale_strides, constexprs, block_k = scale_args(w2_scales, pair_weights, block_k)
    _fused_moe_down_sum_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        out, inter_out, w2, scale, pair_weights, pair_experts,
        out if residual is None else residual,
        out if scaled_out is None else scaled_out,
        out if norm_weight is None else norm_weight,
        hidden, inter, inter_out.stride(0), out.stride(0), w2.stride(0), w2.stride(1),
        *scale_strides, TOP_K=top_k, **constexprs, BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_N=block_n, BLOCK_K=block_k, RESIDUAL=residual is not None,
        SCALED_OUT=scaled_out is not None, num_warps=num_warps,
    )  # fmt: skip
