"""Fused mixture-of-experts MLP: ``sum_j w_j * down_e(act(gate_e(x)) * up_e(x))`` over each
token's top-k experts ``e = topk_ids[t, j]`` with routing weights ``w_j = topk_weights[t, j]``.

Each (token, j) is a *pair*, numbered ``pair_id = t * top_k + j``. Two Triton kernels do the
work over pairs; on the grouped-GEMM path the weighted sum over a token's k pairs is a
``view(T, k, H).sum(1)`` (the decode path sums inside its down kernel, below)::

    x [T, H] --(w13: gate|up, act(gate) * up fused in the epilogue)--> inter [T*k, I]
    inter    --(w2: down, times the pair's routing weight)-----------> out   [T*k, H]
    out.view(T, k, H).sum(1)                                        -> y     [T, H]

Two paths, chosen by how many pairs each expert gets on average:

* **grouped GEMM** (prefill): pairs are sorted by expert and each expert's run padded to a
  multiple of ``BLOCK_M`` (``align_pairs_by_expert``), so every M-block of the sorted list
  belongs to one expert and is one ``tl.dot`` tile against that expert's weights::

      sorted_pair_ids: [ e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | e5 pad pad pad | unused.. ]
      block_expert_ids:[     0        |      2      |       2        |       5        | ...      ]

  The grid is sized for the worst case, ``cdiv(P, BLOCK_M) + min(E, P)`` blocks, and blocks
  past ``num_padded`` return at once: no host sync, CUDA-graph safe.
* **per-pair GEMV** (decode, ``P <= E``: most experts see at most one pair): one program per
  (pair, N tile) reads its expert's gate and up rows, with no sort and no padded rows (pairs
  that share an expert read it again, mostly from L2); then one program per (token, N tile)
  reads the down rows of all the token's k experts at once and writes the weighted sum
  straight to ``y`` (fp32 sum, rounded once): two kernels a layer, no per-pair output.

Weight layout is the HF one: ``w13 [E, 2*I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``. The intermediate is stored in x's dtype (rounded once after the fp32
activation); accumulation is fp32; fp32 inputs use IEEE fp32 dots (no TF32).

FP8 experts (e4m3 weights, fp32 scales; ``W_SCALE`` constexpr): each weight tile is
converted to the activation dtype (exact) and dotted in fp32; per-row scales
``[E, rows]`` (per-expert per-tensor or per-channel) multiply the accumulators once after the
K loop, before the activation; block scales ``[E, cdiv(rows, bn), cdiv(k, bk)]`` (128×128:
DeepSeek / Qwen3-FP8) multiply each K tile's partial product (``BLOCK_K`` divides ``bk``).
Gate and up rows keep their own scales (``w13`` up rows start at row ``I``, a multiple of
``bn``). ``fused_moe_ref`` dequantises (``fp8_matmul.dequantize_ref``) and runs its loop.

``ACTIVATIONS`` has GELU(tanh) for Gemma 4's experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vtllm.worker.kernels._triton import tl, triton
from vtllm.worker.kernels.fp8_matmul import check_scale_block, dequantize_ref

# name → constexpr code of the gate activation (``silu``: SwiGLU; ``gelu_tanh``: GeGLU)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# W_SCALE constexpr: plain weights, FP8 with per-row scales, FP8 with block scales
_NO_SCALE, _ROW_SCALE, _BLOCK_SCALE = 0, 1, 2


@triton.jit
def _gate_activation(gate, ACTIVATION: tl.constexpr):
    """fp32 ``act(gate)``; GELU(tanh) through ``0.5 * (1 + tanh(u)) == sigmoid(2u)``."""
    if ACTIVATION == 1:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        return gate * tl.sigmoid(2.0 * inner)
    return gate * tl.sigmoid(gate)


@triton.jit
def _block_scales(scale_base, rows, k0, row_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K):
    """fp32 ``[len(rows)]``: the block scales of weight ``rows`` at K offset ``k0``."""
    block_rows = (rows // SCALE_BLOCK_N).to(tl.int64) * stride_scale_row
    return tl.load(scale_base + block_rows + k0 // SCALE_BLOCK_K, mask=row_mask, other=0.0)


@triton.jit
def _fused_moe_gemm_kernel(
    out_ptr,  # [num_pairs, n]
    a_ptr,  # [num_pairs // A_PAIRS_PER_ROW, k]: tokens (first GEMM) or the intermediate
    w_ptr,  # [num_experts, n * (2 if GATED else 1), k]
    scale_ptr,  # fp32 [E, rows] (W_SCALE 1) or [E, cdiv(rows, SCALE_BLOCK_N), cdiv(k, bk)] (2)
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
    A_PAIRS_PER_ROW: tl.constexpr,  # top_k when a holds tokens, 1 when it holds pairs
    GATED: tl.constexpr,  # w holds gate rows then up rows: out = act(a @ gate) * (a @ up)
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,  # out *= the pair's routing weight
    W_SCALE: tl.constexpr,  # 0: plain weights; FP8 with 1: per-row, 2: block scales
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
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
    for k0 in range(0, k, BLOCK_K):
        k_mask = offs_k + k0 < k
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(a_ptr.dtype.element_ty)
        if W_SCALE == 2:
            scale = _block_scales(
                scale_base, offs_n, k0, n_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K
            )
            acc += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_ptrs + n * stride_w_row, mask=w_mask, other=0.0)
            w_up = w_up.to(a_ptr.dtype.element_ty)
            if W_SCALE == 2:
                scale_up = _block_scales(
                    scale_base,
                    offs_n + n,
                    k0,
                    n_mask,
                    stride_scale_row,
                    SCALE_BLOCK_N,
                    SCALE_BLOCK_K,
                )
                acc_up += tl.dot(a, w_up, input_precision="ieee") * scale_up[None, :]
            else:
                acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc = acc * tl.load(scale_base + offs_n, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_base + n + offs_n, mask=n_mask, other=0.0)[None, :]
    if GATED:
        acc = _gate_activation(acc, ACTIVATION) * acc_up
    if MUL_WEIGHT:
        weights = tl.load(pair_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        weights = weights.to(tl.float32)
        acc = acc * weights[:, None]
    out_ptrs = out_ptr + pair_ids.to(tl.int64)[:, None] * stride_out_row + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit
def _fused_moe_gemv_kernel(
    out_ptr,  # [num_pairs, n]
    a_ptr,  # [num_pairs // A_PAIRS_PER_ROW, k]
    w_ptr,  # [num_experts, n * (2 if GATED else 1), k]
    scale_ptr,  # as in the GEMM kernel
    pair_weights_ptr,  # [num_pairs] fp32 / bf16 / fp16; read when MUL_WEIGHT
    pair_expert_ids_ptr,  # [num_pairs] i32: topk_ids flattened
    n,
    k,
    stride_a_row,
    stride_out_row,
    stride_w_expert,
    stride_w_row,
    stride_scale_expert,
    stride_scale_row,
    A_PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    W_SCALE: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair_id = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(pair_expert_ids_ptr + pair_id).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + (pair_id // A_PAIRS_PER_ROW) * stride_a_row
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
        if W_SCALE == 2:
            scale = _block_scales(
                scale_base, offs_n, k0, n_mask, stride_scale_row, SCALE_BLOCK_N, SCALE_BLOCK_K
            )
            acc += tl.sum(w * a[None, :], axis=1) * scale
        else:
            acc += tl.sum(w * a[None, :], axis=1)
        if GATED:
            w_up = tl.load(w_ptrs + n * stride_w_row, mask=w_mask, other=0.0).to(tl.float32)
            if W_SCALE == 2:
                scale_up = _block_scales(
                    scale_base,
                    offs_n + n,
                    k0,
                    n_mask,
                    stride_scale_row,
                    SCALE_BLOCK_N,
                    SCALE_BLOCK_K,
                )
                acc_up += tl.sum(w_up * a[None, :], axis=1) * scale_up
            else:
                acc_up += tl.sum(w_up * a[None, :], axis=1)
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc = acc * tl.load(scale_base + offs_n, mask=n_mask, other=0.0)
        if GATED:
            acc_up = acc_up * tl.load(scale_base + n + offs_n, mask=n_mask, other=0.0)
    if GATED:
        acc = _gate_activation(acc, ACTIVATION) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pair_id).to(tl.float32)
    tl.store(out_ptr + pair_id * stride_out_row + offs_n, acc.to(out_ptr.dtype.element_ty), n_mask)


@triton.jit
def _fused_moe_down_sum_kernel(
    out_ptr,  # [num_tokens, n]
    a_ptr,  # [num_tokens * TOP_K, k]: the pairs' intermediate
    w_ptr,  # [num_experts, n, k]
    scale_ptr,  # as in the GEMM kernel
    pair_weights_ptr,  # [num_pairs] fp32 / bf16 / fp16
    pair_expert_ids_ptr,  # [num_pairs] i32
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
):
    """Decode path's down projection and weighted sum in one: a program owns one token's
    ``BLOCK_N`` outputs and reads all ``TOP_K`` experts' rows at once (a
    ``[TOP_K, BLOCK_N, BLOCK_K]`` tile per K step), so no per-pair output is stored."""
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
    out_ptrs = out_ptr + token * stride_out_row + offs_n
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def align_pairs_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pair_ids, block_expert_ids, num_padded)`` for the grouped GEMM (see the
    module docstring): pair ids grouped by expert (stable: ascending within an expert), each
    expert's run padded with ``num_pairs`` to a multiple of ``block_m``; the expert of each
    ``block_m`` block; the used length as a 1-element tensor. Sized for the worst case
    (``cdiv(P, block_m) + min(E, P)`` blocks) so that nothing waits on the device."""
    device = topk_ids.device
    expert_of_pair = topk_ids.flatten().long()  # [num_pairs]
    num_pairs = expert_of_pair.numel()
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))  # [E]
    padded_counts = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = padded_counts.cumsum(0)  # [E]
    order = torch.argsort(expert_of_pair, stable=True)  # [num_pairs]: pairs by expert
    sorted_experts = expert_of_pair[order]
    rank_in_expert = (
        torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    )
    dest = (padded_ends - padded_counts)[sorted_experts] + rank_in_expert  # [num_pairs]
    sorted_pair_ids = torch.full(
        (max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m  # [max_blocks]
    block_expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert_ids = block_expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = padded_ends[-1:].to(torch.int32)  # [1]
    return sorted_pair_ids, block_expert_ids, num_padded


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) / compute units (ROCm), asked through Triton's
    active driver (vendor-neutral); 1 off a GPU."""
    if device.type != "cuda":
        return 1
    from triton.runtime import driver as triton_driver

    driver = triton_driver.active
    index = device.index if device.index is not None else driver.get_current_device()
    return int(driver.utils.get_device_properties(index)["multiprocessor_count"])


def _gemv_tiles(num_pairs: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV: the widest N tile (64, 32, 16)
    that still gives every SM two programs. At batch 1 (8 pairs) a 64-wide tile would start
    only 96 programs for a 768-wide expert and leave most of an H200's 132 SMs idle; those
    16-wide tiles read K 256 at a time with 8 warps (H200 sweep, ``fused_moe_kernel.py
    --sweep``: the top-8 layer 50.1 → 44.4 µs)."""
    for block_n in (64, 32):
        if num_pairs * triton.cdiv(n, block_n) >= 2 * _num_sms(device):
            return block_n, 128, 4
    return 16, 256, 8


def _down_sum_tiles(num_tokens: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the down-and-sum kernel: the widest N tile (32 ..
    8) that gives every SM two programs (one token: 2048 outputs in 256 tiles of 8), K 128
    at a time with 8 warps (H200 sweep: the top-8 layer at one token 50.1 → 39.0 µs, at
    four 96.3 → 76.2 µs)."""
    for block_n in (32, 16):
        if num_tokens * triton.cdiv(n, block_n) >= 2 * _num_sms(device):
            return block_n, 128, 8
    return 8, 128, 8


def _gemm_tiles(num_pairs: int, num_experts: int, gated: bool) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMM by the mean
    number of pairs per expert; ``gated``: the gate/up GEMM (two weight tiles a K step).
    BLOCK_M is the gate/up's (one alignment serves both GEMMs). From an H200 sweep at a
    Qwen3-30B-A3B layer (``fused_moe_kernel.py --sweep-gemm``, graph-timed, 2026-12-03):
    64 tokens 393 → 380 µs, 256 tokens 589 → 475 (gate/up) and → 555 (down) µs, 1024
    tokens 785 → 653 / 721 µs, 8192 tokens 3,419 → 3,252 / 2,633 µs (each GEMM's change
    measured with the other at the old default)."""
    if num_pairs <= 4 * num_experts:  # decode-sized batches: 16-row tiles, K 128
        return 16, 128, 128, 4, 3
    if num_pairs <= 128 * num_experts:
        return (64, 64, 64, 4, 3) if gated else (64, 128, 64, 4, 3)
    return (64, 128, 64, 8, 4) if gated else (64, 128, 64, 8, 3)


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
            return strides, dict(W_SCALE=_ROW_SCALE, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1), block_k
        strides = (self.scale.stride(0), self.scale.stride(1))
        constexprs = dict(
            W_SCALE=_BLOCK_SCALE, SCALE_BLOCK_N=self.block[0], SCALE_BLOCK_K=self.block[1]
        )
        return strides, constexprs, min(block_k, self.block[1])

    def dequantize(self, w: torch.Tensor, expert: int) -> torch.Tensor:
        """fp32 ``[rows, k]`` of one expert."""
        block = self.block or (1, w.shape[-1])
        scale = self.scale[expert] if self.block else self.scale[expert][:, None]
        return dequantize_ref(w[expert], scale, block, torch.float32)


def _launch(
    out: torch.Tensor,  # [num_pairs, n]
    a: torch.Tensor,  # [num_a_rows, k]
    w: torch.Tensor,  # [E, n or 2n, k]
    scales: ExpertScales | None,
    topk_weights: torch.Tensor,  # [num_pairs] fp32
    topk_ids: torch.Tensor,  # [num_pairs] i32
    alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None,
    a_pairs_per_row: int,
    gated: bool,
    activation: int,
    mul_weight: bool,
) -> None:
    num_pairs, n = out.shape
    k = a.shape[1]
    common = dict(
        A_PAIRS_PER_ROW=a_pairs_per_row, GATED=gated, ACTIVATION=activation, MUL_WEIGHT=mul_weight
    )
    strides = (a.stride(0), out.stride(0), w.stride(0), w.stride(1))
    if alignment is None:
        block_n, block_k, num_warps = _gemv_tiles(num_pairs, n, out.device)
    else:
        _, block_n, block_k, num_warps, num_stages = _gemm_tiles(num_pairs, w.shape[0], gated)
    scale = topk_weights  # any fp32 pointer; never read without scales
    scale_strides, scale_constexprs = (
        (0, 0),
        dict(W_SCALE=_NO_SCALE, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1),
    )
    if scales is not None:
        scale = scales.scale
        scale_strides, scale_constexprs, block_k = scales.kernel_args(block_k)
    common |= scale_constexprs
    strides += scale_strides
    if alignment is None:
        grid = (num_pairs, triton.cdiv(n, block_n))
        _fused_moe_gemv_kernel[grid](
            out, a, w, scale, topk_weights, topk_ids, n, k, *strides,
            **common, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
        return
    sorted_pair_ids, block_expert_ids, num_padded, block_m = alignment
    grid = (block_expert_ids.numel(), triton.cdiv(n, block_n))
    _fused_moe_gemm_kernel[grid](
        out, a, w, scale, topk_weights, sorted_pair_ids, block_expert_ids, num_padded,
        n, k, num_pairs, *strides,
        **common, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


def _launch_down_sum(
    out: torch.Tensor,  # [num_tokens, n]
    inter: torch.Tensor,  # [num_pairs, k]
    w2: torch.Tensor,  # [E, n, k]
    scales: ExpertScales | None,
    pair_weights: torch.Tensor,  # [num_pairs] fp32
    pair_experts: torch.Tensor,  # [num_pairs] i32
) -> None:
    num_tokens, n = out.shape
    top_k = inter.shape[0] // num_tokens
    block_n, block_k, num_warps = _down_sum_tiles(num_tokens, n, out.device)
    scale, scale_strides = pair_weights, (0, 0)  # any fp32 pointer; unread without scales
    scale_constexprs = dict(W_SCALE=_NO_SCALE, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1)
    if scales is not None:
        scale = scales.scale
        scale_strides, scale_constexprs, block_k = scales.kernel_args(block_k)
    grid = (num_tokens, triton.cdiv(n, block_n))
    _fused_moe_down_sum_kernel[grid](
        out, inter, w2, scale, pair_weights, pair_experts,
        n, inter.shape[1], inter.stride(0), out.stride(0), w2.stride(0), w2.stride(1),
        *scale_strides, TOP_K=top_k, **scale_constexprs,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps,
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
) -> torch.Tensor:
    """The routed experts' weighted sum per token, ``[num_tokens, hidden]`` in x's dtype.

    ``path``: ``auto`` (GEMV when ``num_tokens * top_k <= num_experts``, else grouped GEMM),
    ``gemv`` or ``gemm``. FP8 ``w13`` / ``w2`` come with their ``ExpertScales``. Raises
    ValueError on inconsistent shapes.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
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
    if path not in ("auto", "gemv", "gemm"):
        raise ValueError(f"path must be auto, gemv or gemm, got {path!r}")
    for scales in (w13_scales, w2_scales):
        if scales is not None and scales.block is not None:
            check_scale_block(scales.block, per_row=False)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    pair_weights = topk_weights.reshape(num_pairs)  # [num_pairs], read as fp32 in the kernels
    if pair_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        pair_weights = pair_weights.float()
    pair_weights = pair_weights.contiguous()  # bf16 weights (Qwen3-MoE rounds) cost no copy
    pair_experts = topk_ids.reshape(num_pairs).to(torch.int32).contiguous()  # [num_pairs]
    use_gemv = path == "gemv" or (path == "auto" and num_pairs <= num_experts)
    alignment = None
    if not use_gemv:
        block_m = _gemm_tiles(num_pairs, num_experts, True)[0]
        alignment = (*align_pairs_by_expert(topk_ids, num_experts, block_m), block_m)
    act = ACTIVATIONS[activation]
    inter_out = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    _launch(
        inter_out, x, w13, w13_scales, pair_weights, pair_experts, alignment, top_k, True, act,
        False,
    )  # fmt: skip
    if use_gemv:  # down projection and the weighted sum over the k pairs in one kernel
        out = torch.empty_like(x)  # [T, H]
        _launch_down_sum(out, inter_out, w2, w2_scales, pair_weights, pair_experts)
        return out
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    _launch(
        pair_out, inter_out, w2, w2_scales, pair_weights, pair_experts, alignment, 1, False, act,
        True,
    )  # fmt: skip
    # the weighted pairs of a token summed in fp32 (no fp32 copy of pair_out), rounded once
    return pair_out.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_scales: ExpertScales | None = None,
    w2_scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Plain-torch ``fused_moe`` (same contract): a loop over the experts that were hit,
    fp32 math with the intermediate rounded to x's dtype, as the kernels do; FP8 experts
    dequantised to fp32 first."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    act = ACTIVATIONS[activation]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        rows = x[token_idx].float()  # [n_e, hidden]
        w13_e = w13[expert].float() if w13_scales is None else w13_scales.dequantize(w13, expert)
        w2_e = w2[expert].float() if w2_scales is None else w2_scales.dequantize(w2, expert)
        gate_up = rows @ w13_e.t()  # [n_e, 2 * inter]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if act == ACTIVATIONS["gelu_tanh"]:
            activated = torch.nn.functional.gelu(gate, approximate="tanh")
        else:
            activated = torch.nn.functional.silu(gate)
        inter_rows = (activated * up).to(x.dtype).float()  # [n_e, inter]
        down = inter_rows @ w2_e.t()  # [n_e, hidden]
        weights = topk_weights[token_idx, slot_idx].float()[:, None]
        acc.index_add_(0, token_idx, (down * weights).to(x.dtype).float())
    return acc.to(x.dtype)
