"""Pairs grouped by expert for the grouped-GEMM MoE path, in three small kernels.

``fused_moe``'s grouped GEMM needs the pairs (``pair_id = token * top_k + j``) sorted by
expert, each expert's run padded to a multiple of ``block_m``, and the expert of every
``block_m`` block (layout in ``fused_moe``'s docstring). The torch twin,
``align_pairs_by_expert_ref``, takes ~16 kernels (scatter-add, two cumsums, a stable
argsort, searchsorted, ...); on a GPU this is::

    _count_kernel   (grid: pair chunks)  counts[e] += pairs of chunk with expert e
    _layout_kernel  (one program)        padded starts (cursor), block_expert_ids, num_padded
    _scatter_kernel (grid: pair chunks)  dest = cursor[e]++ (one atomic per chunk and
                                         expert) + rank within the chunk

plus two fills (``counts = 0``, padding = ``num_pairs``). Within an expert, pairs are
ordered by chunk in the order the chunks' atomics land, and by pair id within a chunk: not
the reference's ascending order, which the grouped GEMM does not need (each row of a
``tl.dot`` tile is computed alone, and the down GEMM writes by pair id). Everything else —
padding, the block experts, ``num_padded``, the worst-case sizes — is the reference's
exactly. No host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton

# pairs per program of the count and scatter kernels (a [BLOCK_P, BLOCK_E] one-hot each)
_BLOCK_P = 64
# blocks per step of the layout kernel's loop
_BLOCK_B = 64


@triton.jit
def _one_hot(expert_ptr, start, num_pairs, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """(pair offsets [BLOCK_P], their experts [BLOCK_P], one-hot [BLOCK_P, BLOCK_E] int32)
    of the chunk at ``start`` (pairs past ``num_pairs`` hot nowhere)."""
    offs_p = start + tl.arange(0, BLOCK_P)
    p_mask = offs_p < num_pairs
    experts = tl.load(expert_ptr + offs_p, mask=p_mask, other=-1)
    hot = (experts[:, None] == tl.arange(0, BLOCK_E)[None, :]) & p_mask[:, None]
    return offs_p, experts, hot.to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])  # step-sized: compile once
def _count_kernel(
    expert_ptr,  # [num_pairs] i32
    counts_ptr,  # [BLOCK_E] i32, zeroed
    num_pairs,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    _, _, hot = _one_hot(expert_ptr, tl.program_id(0) * BLOCK_P, num_pairs, BLOCK_P, BLOCK_E)
    chunk_counts = tl.sum(hot, axis=0)  # [BLOCK_E]
    offs_e = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + offs_e, chunk_counts, mask=chunk_counts > 0)


@triton.jit(do_not_specialize=["max_blocks"])  # step-sized: compile once
def _layout_kernel(
    counts_ptr,  # [BLOCK_E] i32
    cursor_ptr,  # [BLOCK_E] i32: out, each expert's padded start
    block_expert_ids_ptr,  # [max_blocks] i32: out
    num_padded_ptr,  # [1] i32: out
    num_experts,
    max_blocks,
    block_m,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e)  # [BLOCK_E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E]
    tl.store(cursor_ptr + offs_e, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, max_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        starts = offs_b * block_m  # [BLOCK_B]
        # the expert of a block = how many experts' padded runs end at or before it
        expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), axis=1)
        expert = tl.minimum(expert, num_experts - 1)
        tl.store(block_expert_ids_ptr + offs_b, expert, mask=offs_b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])  # step-sized: compile once
def _scatter_kernel(
    expert_ptr,  # [num_pairs] i32
    cursor_ptr,  # [BLOCK_E] i32: each expert's next free slot
    sorted_pair_ids_ptr,  # [max_blocks * block_m] i32, filled with num_pairs
    num_pairs,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    offs_p, experts, hot = _one_hot(
        expert_ptr, tl.program_id(0) * BLOCK_P, num_pairs, BLOCK_P, BLOCK_E
    )
    chunk_counts = tl.sum(hot, axis=0)  # [BLOCK_E]
    offs_e = tl.arange(0, BLOCK_E)
    # one atomic per expert of the chunk: this chunk's slots are base .. base + count - 1
    base = tl.atomic_add(cursor_ptr + offs_e, chunk_counts, mask=chunk_counts > 0)
    pair_base = tl.sum(hot * base[None, :], axis=1)  # [BLOCK_P]: base of the pair's expert
    # rank within the chunk: earlier pairs of the chunk with the same expert
    local = tl.arange(0, BLOCK_P)
    same = (experts[:, None] == experts[None, :]) & (local[None, :] < local[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)  # [BLOCK_P]
    p_mask = offs_p < num_pairs
    tl.store(sorted_pair_ids_ptr + pair_base + rank, offs_p.to(tl.int32), mask=p_mask)


def _worst_case_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_pairs_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pair_ids, block_expert_ids, num_padded)``: ``align_pairs_by_expert_ref``'s
    contract, except the order of pairs within an expert (module docstring)."""
    device = topk_ids.device
    pair_experts = topk_ids.flatten().to(torch.int32).contiguous()  # [num_pairs]
    num_pairs = pair_experts.numel()
    max_blocks = _worst_case_blocks(num_pairs, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    counts = torch.zeros(block_e, dtype=torch.int32, device=device)
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    sorted_pair_ids = torch.full(
        (max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    chunks = (triton.cdiv(num_pairs, _BLOCK_P),)
    _count_kernel[chunks](pair_experts, counts, num_pairs, BLOCK_P=_BLOCK_P, BLOCK_E=block_e)
    _layout_kernel[(1,)](
        counts, cursor, block_expert_ids, num_padded, num_experts, max_blocks, block_m,
        BLOCK_E=block_e, BLOCK_B=_BLOCK_B,
    )  # fmt: skip
    _scatter_kernel[chunks](
        pair_experts, cursor, sorted_pair_ids, num_pairs, BLOCK_P=_BLOCK_P, BLOCK_E=block_e
    )
    return sorted_pair_ids, block_expert_ids, num_padded


def align_pairs_by_expert_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pair_ids, block_expert_ids, num_padded)`` for the grouped GEMM: pair ids
    grouped by expert (stable: ascending within an expert), each expert's run padded with
    ``num_pairs`` to a multiple of ``block_m``; the expert of each ``block_m`` block; the
    used length as a 1-element tensor. Sized for the worst case (``cdiv(P, block_m) +
    min(E, P)`` blocks) so that nothing waits on the device."""
    device = topk_ids.device
    expert_of_pair = topk_ids.flatten().long()  # [num_pairs]
    num_pairs = expert_of_pair.numel()
    max_blocks = _worst_case_blocks(num_pairs, num_experts, block_m)
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
