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

At decode (up to ``MAX_FUSED_ROUTER_TOKENS`` tokens) ``moe_router_route`` also folds the
router's linear in: cdiv(E, block_n) programs each score a few experts for every token,
store the logits, and count themselves in on an int32 counter; the last to arrive routes
(the same row code) and resets the counter. A batch-1 layer of Qwen3-30B-A3B had spent
~5 µs in cuBLAS on the 0.5 MB router GEMV and ~3.3 µs in the routing kernel (H100
profile). Its twin is ``moe_route_ref(F.linear(x, gate_weight), ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtllm.worker.kernels._triton import arrival_counters, tl, triton

SCORINGS = {"softmax": 0, "sigmoid": 1}
# the widest router the kernel takes (one program holds a row of scores in registers)
MAX_KERNEL_EXPERTS = 4096


@triton.jit
def _route_row(
    logits,  # [BLOCK_E] fp32 (masked lanes -inf): one token's router logits
    weights_ptr,  # this token's TOP_K weights
    ids_ptr,  # this token's TOP_K ids (i32)
    expert_scale_ptr,
    round_like_ptr,  # ROUND: the weights are rounded to this pointer's dtype
    num_experts,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_EXPERT_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    PACKED_TOPK: tl.constexpr,
    RANK_TOPK: tl.constexpr = False,
):
    """Scores, top-k (lowest id on ties), renormalise, round, scale; store one row.

    PACKED_TOPK picks with one reduction a pick instead of two: a 64-bit key per expert,
    the score's bits above (every real score is >= 0, so the bits order as the floats
    do; masked lanes are negative) and ``BLOCK_E - 1 - id`` below, so the largest key is
    the best score at the lowest id. RANK_TOPK (over PACKED_TOPK) picks with no loop:
    each expert's rank is how many experts beat it (a higher score, or an equal one at a
    lower id), one reduction over a ``[BLOCK_E, BLOCK_E]`` comparison; the experts of rank
    < TOP_K are the picks, each stored at its rank, which is the order the loops give."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    if SCORING == 0:
        exps = tl.exp(logits - tl.max(logits, axis=0))
        exps = tl.where(e_mask, exps, 0.0)
        scores = exps / tl.sum(exps, axis=0)
    else:
        scores = tl.sigmoid(logits)
    scores = tl.where(e_mask, scores, -1.0)  # below every real score (all are >= 0)
    if RANK_TOPK:
        _store_ranked(scores, offs_e, e_mask, weights_ptr, ids_ptr, expert_scale_ptr,
                      round_like_ptr, TOP_K, RENORMALIZE, ROUND, HAS_EXPERT_SCALE)  # fmt: skip
        return
    offs_k = tl.arange(0, BLOCK_TOPK)
    picked = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    if PACKED_TOPK:
        keys = (scores.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e)
        for j in tl.static_range(TOP_K):
            best_key = tl.max(keys, axis=0)
            best_id = (BLOCK_E - 1 - (best_key & 0xFFFFFFFF)).to(tl.int32)
            best = (best_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            picked = tl.where(offs_k == j, best, picked)
            picked_ids = tl.where(offs_k == j, best_id, picked_ids)
            keys = tl.where(offs_e == best_id, -(1 << 62), keys)
    else:
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
        picked = picked.to(round_like_ptr.dtype.element_ty).to(tl.float32)
    if HAS_EXPERT_SCALE:
        picked = picked * tl.load(expert_scale_ptr + picked_ids, mask=k_mask, other=0.0).to(
            tl.float32
        )
    tl.store(weights_ptr + offs_k, picked.to(weights_ptr.dtype.element_ty), mask=k_mask)
    tl.store(ids_ptr + offs_k, picked_ids, mask=k_mask)


@triton.jit
def _store_ranked(
    scores,  # [BLOCK_E] fp32, masked lanes -1 (below every real score)
    offs_e,  # [BLOCK_E] expert ids
    e_mask,  # [BLOCK_E]
    weights_ptr,
    ids_ptr,
    expert_scale_ptr,
    round_like_ptr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_EXPERT_SCALE: tl.constexpr,
):
    """``_route_row``'s RANK_TOPK: the TOP_K best experts stored at their ranks."""
    other = scores[None, :]  # [1, BLOCK_E]: expert j
    mine = scores[:, None]  # [BLOCK_E, 1]: expert i
    beats = (other > mine) | ((other == mine) & (offs_e[None, :] < offs_e[:, None]))
    rank = tl.sum(beats.to(tl.int32), axis=1)  # [BLOCK_E]: experts that beat expert i
    chosen = e_mask & (rank < TOP_K)
    picked = tl.where(chosen, scores, 0.0)  # [BLOCK_E]
    if RENORMALIZE:
        picked = picked / tl.sum(picked, axis=0)
    if ROUND:
        picked = picked.to(round_like_ptr.dtype.element_ty).to(tl.float32)
    if HAS_EXPERT_SCALE:
        picked = picked * tl.load(expert_scale_ptr + offs_e, mask=chosen, other=0.0).to(tl.float32)
    tl.store(weights_ptr + rank, picked.to(weights_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + rank, offs_e.to(tl.int32), mask=chosen)


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
    logits = tl.load(
        logits_ptr + row * stride_logits_row + offs_e, mask=offs_e < num_experts,
        other=-float("inf"),
    ).to(tl.float32)  # fmt: skip
    _route_row(
        logits, weights_ptr + row * TOP_K, ids_ptr + row * TOP_K, expert_scale_ptr, logits_ptr,
        num_experts, TOP_K, SCORING, RENORMALIZE, ROUND, HAS_EXPERT_SCALE, BLOCK_E, BLOCK_TOPK,
        False,
    )  # fmt: skip


@triton.jit
def _input_rows(
    x_ptr, residual_ptr, residual_out_ptr, offs_t, t_mask, offs_k, hidden, stride_x_row,
    stride_residual_row, STORE_SUM, HAS_RESIDUAL: tl.constexpr,  # STORE_SUM: 0 or 1
):  # fmt: skip
    """x's [BLOCK_T, BLOCK_K] chunk, plus the residual (rounded to x's dtype, as the
    RMSNorm kernel adds it) when HAS_RESIDUAL; the sum stored where STORE_SUM."""
    mask = t_mask[:, None] & (offs_k < hidden)[None, :]
    rows = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_x_row + offs_k[None, :],
                   mask=mask, other=0.0)  # fmt: skip
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + offs_t[:, None].to(tl.int64) * stride_residual_row + offs_k[None, :],
            mask=mask, other=0.0,
        )  # fmt: skip
        rows = (rows.to(tl.float32) + residual.to(tl.float32)).to(rows.dtype)
        tl.store(residual_out_ptr + offs_t[:, None].to(tl.int64) * hidden + offs_k[None, :],
                 rows, mask=mask & ((offs_k * 0 + STORE_SUM) != 0)[None, :])  # fmt: skip
    return rows


@triton.jit
def _moe_router_route_kernel(
    x_ptr,  # [num_tokens, hidden]
    gate_ptr,  # [num_experts, hidden], x's dtype
    logits_ptr,  # [num_tokens, num_experts] scratch in x's dtype (the router's output)
    weights_ptr,  # [num_tokens, TOP_K]: fp32, or x's dtype when ROUND
    ids_ptr,  # [num_tokens, TOP_K] i32
    expert_scale_ptr,  # [num_experts]; read when HAS_EXPERT_SCALE
    arrivals_ptr,  # [1] i32: 0 between launches (the last program resets it)
    residual_ptr,  # [num_tokens, hidden]; read when HAS_RESIDUAL
    norm_weight_ptr,  # [hidden]; read when NORM
    normed_out_ptr,  # [num_tokens, hidden]: NORM's output, written by program 0
    residual_out_ptr,  # [num_tokens, hidden]: x + residual, written by program 0
    num_tokens,
    num_experts,
    hidden,
    stride_x_row,
    stride_residual_row,
    stride_gate_row,
    eps,
    TOP_K: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_EXPERT_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    NORM: tl.constexpr,  # score RMSNorm(x [+ residual]) (Llama rounding), not x
    HAS_RESIDUAL: tl.constexpr,
    PACKED_TOPK: tl.constexpr,  # _route_row's one-reduction top-k
    RANK_TOPK: tl.constexpr,  # _route_row's loop-free top-k
    BLOCK_T: tl.constexpr,  # power of two >= num_tokens
    BLOCK_N: tl.constexpr,  # experts a program scores
    BLOCK_K: tl.constexpr,
):
    """Program p scores experts [p*BLOCK_N, (p+1)*BLOCK_N) for every token (fp32
    accumulation, logits rounded to x's dtype as the router linear's output is), then
    counts itself in; the last program to arrive routes every token from the logits.
    With NORM every program first normalises the rows itself (a pass over x for the sum
    of squares), and program 0 also stores the normed rows and the residual sum."""
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_experts
    rstd = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if NORM:
        sum_sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            rows = _input_rows(x_ptr, residual_ptr, residual_out_ptr, offs_t, t_mask, offs_k,
                               hidden, stride_x_row, stride_residual_row, (pid == 0).to(tl.int32),
                               HAS_RESIDUAL).to(tl.float32)  # fmt: skip
            sum_sq += tl.sum(rows * rows, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / hidden + eps)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        w = tl.load(
            gate_ptr + offs_n[:, None].to(tl.int64) * stride_gate_row + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :], other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]  # fmt: skip
        rows = _input_rows(x_ptr, residual_ptr, residual_out_ptr, offs_t, t_mask, offs_k,
                           hidden, stride_x_row, stride_residual_row, 0,
                           HAS_RESIDUAL)  # [BLOCK_T, BLOCK_K], x's dtype  # fmt: skip
        if NORM:  # RMSNorm as rms_norm.py rounds it: (h * rstd).to(dtype) * weight
            norm_w = tl.load(norm_weight_ptr + offs_k, mask=k_mask, other=0.0)
            rows = (rows.to(tl.float32) * rstd[:, None]).to(rows.dtype) * norm_w.to(rows.dtype)
            out_offs = offs_t[:, None].to(tl.int64) * hidden + offs_k[None, :]
            tl.store(normed_out_ptr + out_offs, rows,
                     mask=t_mask[:, None] & (k_mask & (offs_k * 0 + pid == 0))[None, :])  # fmt: skip
        x = rows.to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_T, BLOCK_N]
    tl.store(
        logits_ptr + offs_t[:, None] * num_experts + offs_n[None, :],
        acc.to(logits_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :],
    )  # fmt: skip
    tl.debug_barrier()  # every thread's logits stored before the release below
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:  # the others' logits are visible: route
        offs_e = tl.arange(0, BLOCK_E)
        for t in range(num_tokens):
            logits = tl.load(
                logits_ptr + t * num_experts + offs_e, mask=offs_e < num_experts,
                other=-float("inf"), volatile=True,
            ).to(tl.float32)  # fmt: skip
            _route_row(
                logits, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, expert_scale_ptr,
                logits_ptr, num_experts, TOP_K, SCORING, RENORMALIZE, ROUND,
                HAS_EXPERT_SCALE, BLOCK_E, BLOCK_TOPK, PACKED_TOPK, RANK_TOPK,
            )  # fmt: skip
        tl.atomic_xchg(arrivals_ptr, 0)  # ready for the next launch (and graph replay)


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


# decode batches up to this many tokens score and route in one launch
MAX_FUSED_ROUTER_TOKENS = 8
# the rank top-k compares every expert with every other in registers: up to this many
# (128 x 128 = 16K comparisons a program); wider routers take the packed top-k instead
MAX_RANK_TOPK_EXPERTS = 128


@dataclass(frozen=True)
class RouterTiles:
    """The fused router's launch: ``block_n`` experts a program (cdiv(E, block_n)
    programs), ``block_k`` of the hidden dim a step, ``num_warps``, and the last
    program's top-k with one reduction a pick (``packed_topk``), two, or by rank with no
    loop (``rank_topk``, over ``packed_topk``; routers of more than
    ``MAX_RANK_TOPK_EXPERTS`` experts take the packed top-k instead)."""

    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    packed_topk: bool = False  # one reduction a pick (``_route_row``)
    rank_topk: bool = False  # each expert's rank in one reduction, <= MAX_RANK_TOPK_EXPERTS


def _check_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, scoring: str) -> None:
    num_tokens, hidden = x.shape
    if num_tokens > MAX_FUSED_ROUTER_TOKENS:
        raise ValueError(
            f"the fused router takes up to {MAX_FUSED_ROUTER_TOKENS} tokens, got "
            f"{num_tokens}: route larger batches with moe_route on the router's logits"
        )
    if gate_weight.shape[1] != hidden or gate_weight.dtype != x.dtype:
        raise ValueError(
            f"router weight {tuple(gate_weight.shape)} {gate_weight.dtype} does not fit "
            f"hidden states {tuple(x.shape)} {x.dtype}: need [num_experts, {hidden}] in "
            f"{x.dtype}"
        )
    _check(x.new_empty(0, gate_weight.shape[0]), top_k, scoring)


def _launch_router(
    x, gate_weight, top_k, scoring, renormalize, round_weights, expert_scale, tiles,
    residual=None, norm_weight=None, eps=0.0,
):  # fmt: skip
    """Allocate and launch ``_moe_router_route_kernel``: ``(weights, ids, normed,
    residual_sum)``, the last two None without ``norm_weight`` / ``residual``."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    tiles = tiles or RouterTiles()
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_weight = gate_weight.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    weight_dtype = x.dtype if round_weights else torch.float32
    weights = torch.empty(num_tokens, top_k, dtype=weight_dtype, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    normed = (
        torch.empty_like(x, memory_format=torch.contiguous_format)
        if norm_weight is not None
        else None
    )
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    residual_sum = torch.empty_like(normed) if residual is not None else None
    if num_tokens == 0:
        return weights, ids, normed, residual_sum
    scale = expert_scale.contiguous() if expert_scale is not None else weights
    block_t = triton.next_power_of_2(num_tokens)
    _moe_router_route_kernel[(triton.cdiv(num_experts, tiles.block_n),)](
        x, gate_weight, logits, weights, ids, scale, arrival_counters(x.device, 1),
        x if residual is None else residual,
        x if norm_weight is None else norm_weight,
        x if normed is None else normed,
        x if residual_sum is None else residual_sum,
        num_tokens, num_experts, hidden, x.stride(0),
        0 if residual is None else residual.stride(0), gate_weight.stride(0), eps,
        TOP_K=top_k, SCORING=SCORINGS[scoring], RENORMALIZE=renormalize, ROUND=round_weights,
        HAS_EXPERT_SCALE=expert_scale is not None,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOPK=triton.next_power_of_2(top_k),
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        PACKED_TOPK=tiles.packed_topk or tiles.rank_topk,
        RANK_TOPK=tiles.rank_topk and num_experts <= MAX_RANK_TOPK_EXPERTS,
        BLOCK_T=block_t, BLOCK_N=tiles.block_n,
        BLOCK_K=max(64, min(tiles.block_k, triton.next_power_of_2(hidden)) // block_t),
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return weights, ids, normed, residual_sum


def moe_router_route(
    x: torch.Tensor,  # [num_tokens, hidden]
    gate_weight: torch.Tensor,  # [num_experts, hidden], x's dtype
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    round_weights: bool = False,
    expert_scale: torch.Tensor | None = None,  # [num_experts]
    tiles: RouterTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route(x @ gate_weight.T, ...)`` in one launch for a decode step's few tokens:
    the router logits (fp32 accumulation, rounded to x's dtype like the linear's output)
    and the routing, with no logits round trip between two kernels. Same return contract
    as ``moe_route``. ValueError on more than ``MAX_FUSED_ROUTER_TOKENS`` tokens, on
    mismatched shapes or dtypes, or where ``moe_route`` refuses."""
    _check_router(x, gate_weight, top_k, scoring)
    if gate_weight.shape[0] > MAX_KERNEL_EXPERTS:
        logits = torch.nn.functional.linear(x, gate_weight)
        return moe_route(logits, top_k, scoring, renormalize, round_weights, expert_scale)
    weights, ids, _, _ = _launch_router(
        x, gate_weight, top_k, scoring, renormalize, round_weights, expert_scale, tiles
    )
    return weights, ids


def moe_norm_router_route(
    x: torch.Tensor,  # [num_tokens, hidden]: e.g. attention's output projection
    residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream
    norm_weight: torch.Tensor,  # [hidden]: the RMSNorm before the MoE block
    eps: float,
    gate_weight: torch.Tensor,  # [num_experts, hidden], x's dtype
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    round_weights: bool = False,
    tiles: RouterTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, ids, normed, x + residual)``: ``rms_norm(x, norm_weight, eps,
    residual)`` (Llama rounding) and ``moe_router_route`` of its output, one launch
    instead of two. ValueError as ``moe_router_route``."""
    _check_router(x, gate_weight, top_k, scoring)
    if residual.shape != x.shape or norm_weight.shape != (x.shape[1],):
        raise ValueError(
            f"residual {tuple(residual.shape)} and norm weight {tuple(norm_weight.shape)} "
            f"must match hidden states {tuple(x.shape)}"
        )
    if gate_weight.shape[0] > MAX_KERNEL_EXPERTS:
        from vtllm.worker.kernels.rms_norm import rms_norm

        normed, residual_sum = rms_norm(x, norm_weight, eps, residual)
        logits = torch.nn.functional.linear(normed, gate_weight)
        weights, ids = moe_route(logits, top_k, scoring, renormalize, round_weights)
        return weights, ids, normed, residual_sum
    return _launch_router(  # type: ignore[return-value]
        x, gate_weight, top_k, scoring, renormalize, round_weights, None, tiles,
        residual, norm_weight, eps,
    )  # fmt: skip


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
