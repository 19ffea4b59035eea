"""Router top-k for mixtures of experts in one kernel: scores, top-k, renormalisation and
per-expert scales, per token.

A decode step of a 48-layer MoE model used to spend six or seven tiny kernels a layer here
(cast, softmax, topk, sum, divide, cast, gather-multiply); this is one. Per token row::

    logits [E] --softmax | sigmoid (fp32)--> scores [E]
    top_k times: pick the largest score (lowest id on ties), mask it       -> ids, weights [k]
    renormalise: weights / sum(weights)                  (when asked)
    round:       weights rounded to the logits' dtype    (Qwen3-MoE does)
    scale:       weights * expert_scale[ids]              (Gemma 4's per-expert scale)

``moe_route_ref`` is the torch twin with the same contract (``torch.topk``: ids in
descending score order); CPU serving runs it.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton

SCORINGS = {"softmax": 0, "sigmoid": 1}
# the widest router the kernel takes (one program holds a row of scores in registers)
MAX_KERNEL_EXPERTS = 4096


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [num_tokens, num_experts], any float dtype
    weights_ptr,  # [num_tokens, TOP_K]: fp32, or the logits' dtype when ROUND
    ids_ptr,  # [num_tokens, TOP_K] i32
    expert_scale_ptr,  # [num_experts]; read when HAS_EXPERT_SCALE
    num_experts,
    stride_logits_row,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,  # 0 softmax, 1 sigmoid
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_EXPERT_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= num_experts
    BLOCK_TOPK: tl.constexpr,  # power of two >= TOP_K
):
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    logits = tl.load(
        logits_ptr + row * stride_logits_row + offs_e, mask=e_mask, other=-float("inf")
    ).to(tl.float32)
    if SCORING == 0:
        exps = tl.exp(logits - tl.max(logits, axis=0))
        exps = tl.where(e_mask, exps, 0.0)
        scores = exps / tl.sum(exps, axis=0)
    else:
        scores = tl.sigmoid(logits)
    scores = tl.where(e_mask, scores, -1.0)  # below every real score (all are >= 0)
    offs_k = tl.arange(0, BLOCK_TOPK)
    picked = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        best_id = tl.min(tl.where(scores == best, offs_e, BLOCK_E), axis=0)  # lowest on ties
        picked = tl.where(offs_k == j, best, picked)
        picked_ids = tl.where(offs_k == j, best_id, picked_ids)
        scores = tl.where(offs_e == best_id, -2.0, scores)
    k_mask = offs_k < TOP_K
    if RENORMALIZE:
        picked = picked / tl.sum(tl.where(k_mask, picked, 0.0), axis=0)
    if ROUND:
        picked = picked.to(logits_ptr.dtype.element_ty).to(tl.float32)
    if HAS_EXPERT_SCALE:
        picked = picked * tl.load(expert_scale_ptr + picked_ids, mask=k_mask, other=0.0).to(
            tl.float32
        )
    out = row * TOP_K + offs_k
    tl.store(weights_ptr + out, picked.to(weights_ptr.dtype.element_ty), mask=k_mask)
    tl.store(ids_ptr + out, picked_ids, mask=k_mask)


def _check(logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"router scoring must be softmax or sigmoid, got {scoring!r}")
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(
            f"router logits {tuple(logits.shape)} cannot give top_k={top_k}: need "
            "[num_tokens, num_experts] with 1 <= top_k <= num_experts"
        )


def moe_route(
    logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    round_weights: bool = False,
    expert_scale: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, both ``[num_tokens, top_k]``: ids int32 in descending score
    order; weights fp32 (``round_weights``: rounded to the logits' dtype and returned in
    it) times ``expert_scale[ids]`` when given. One Triton program per token; routers wider
    than ``MAX_KERNEL_EXPERTS`` go to the reference. ValueError on a bad scoring or
    ``top_k``."""
    _check(logits, top_k, scoring)
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_KERNEL_EXPERTS:
        return moe_route_ref(logits, top_k, scoring, renormalize, round_weights, expert_scale)
    logits = logits.contiguous()
    weight_dtype = logits.dtype if round_weights else torch.float32
    weights = torch.empty(num_tokens, top_k, dtype=weight_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    scale = expert_scale.contiguous() if expert_scale is not None else weights
    _moe_route_kernel[(num_tokens,)](
        logits, weights, ids, scale, num_experts, logits.stride(0),
        TOP_K=top_k, SCORING=SCORINGS[scoring], RENORMALIZE=renormalize, ROUND=round_weights,
        HAS_EXPERT_SCALE=expert_scale is not None,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOPK=triton.next_power_of_2(top_k),
        num_warps=4 if num_experts <= 256 else 8,
    )  # fmt: skip
    return weights, ids


def moe_route_ref(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    round_weights: bool = False,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``moe_route`` (same contract; ids from ``torch.topk``, int64)."""
    _check(logits, top_k, scoring)
    scores = logits.float()
    scores = scores.softmax(dim=-1) if scoring == "softmax" else scores.sigmoid()
    weights, ids = torch.topk(scores, top_k, dim=-1)  # each [num_tokens, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_weights:
        weights = weights.to(logits.dtype)
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return weights, ids
