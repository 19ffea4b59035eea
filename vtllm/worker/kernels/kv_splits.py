"""Split-KV decode (flash-decoding): how many splits, their partials, and their merge.

With ``num_kv_splits > 1`` the paged-attention kernel (``paged_attention.py``) gives each
(query block, KV head) that many programs, each over a contiguous share of the key tiles.
Each writes, per row ``r`` (a (token, query head) pair) and split ``s``, the unnormalised
partial output ``o[r, s]`` with its running max ``m[r, s]`` (log2 domain) and sum
``l[r, s]``; the merge is exact::

    M = max_s m[r, s]        w_s = 2 ** (m[r, s] - M)     (empty splits: m = -inf, w = 0)
    out[r] = Σ_s w_s · o[r, s] / Σ_s w_s · l[r, s]

``_reduce_splits_kernel`` merges them in a second launch. (Merging in the attention
kernel instead, by the last split to finish, was measured slower at every batch, context
and split count tried: session 32, docs/BENCHMARKS.md.)
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton

# A decode-only batch with fewer (sequence, KV head) programs than this is split over
# the keys; roughly two waves on a 132-SM H100/H200 (MI300X has 304 CUs).
SPLIT_TARGET_PROGRAMS = 256
# Each split keeps at least this many keys. From the H100 sweep of session 32
# (attention_kernel.py --splits, device graphs): 128 keys a split was the best or within
# 2 % of it at batch 1 and 8, 160 to 8,192 keys, on the Qwen3-0.6B and -30B-A3B shapes
# (1,024 keys at batch 1: 2 splits 12.6 µs, 8 splits 7.4 µs); 512 split too little.
MIN_KEYS_PER_SPLIT = 128
MAX_KV_SPLITS = 32


def choose_num_kv_splits(
    num_tokens: int, num_seqs: int, num_kv_heads: int, max_seq_len: int | None
) -> int:
    """How many KV splits the launcher uses when not told: 1 unless decode-only and long.

    Split only when every sequence decodes one token, the (sequence, KV head) programs
    would not fill the GPU, and the longest sequence gives each split at least
    ``MIN_KEYS_PER_SPLIT`` keys. Without ``max_seq_len`` (unknown without a sync) never
    split. Returns a power of two.
    """
    if max_seq_len is None or num_tokens != num_seqs:
        return 1
    num_programs = num_seqs * num_kv_heads
    if num_programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    wanted = triton.next_power_of_2(-(-SPLIT_TARGET_PROGRAMS // num_programs))
    affordable = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    affordable = 1 << (affordable.bit_length() - 1)  # round down to a power of two
    return min(wanted, affordable, MAX_KV_SPLITS)


@triton.jit(do_not_specialize=["num_seqs"])  # step-sized: compile once
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS, HEAD_DIM_PAD] fp32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS] fp32, log2 domain
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_KV_SPLITS] fp32
    query_start_loc_ptr,  # [num_seqs + 1]
    num_seqs,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
):
    token_id = tl.program_id(0)
    head_id = tl.program_id(1)
    if token_id >= tl.load(query_start_loc_ptr + num_seqs):
        return  # a padding row: no partials were written for it
    offs_s = tl.arange(0, NUM_KV_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    first = (token_id.to(tl.int64) * tl.num_programs(1) + head_id) * NUM_KV_SPLITS
    split_max = tl.load(partial_max_ptr + first + offs_s)  # [NUM_KV_SPLITS]
    split_sum = tl.load(partial_sum_ptr + first + offs_s)  # [NUM_KV_SPLITS]
    global_max = tl.max(split_max, 0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weight = tl.math.exp2(split_max - global_max)  # [NUM_KV_SPLITS]; empty splits get 0
    split_out = tl.load(
        partial_out_ptr + (first + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    )  # [NUM_KV_SPLITS, HEAD_DIM_PAD]
    numerator = tl.sum(split_out * weight[:, None], 0)  # [HEAD_DIM_PAD]
    denominator = tl.sum(split_sum * weight, 0)
    out = numerator / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(
        out_ptr + token_id * stride_o_token + head_id * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def split_partials(
    num_tokens: int, num_heads: int, num_kv_splits: int, head_dim_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised fp32 partials of a split launch: outputs
    ``[num_tokens, num_heads, num_kv_splits, head_dim_pad]``, maxima and sums
    ``[num_tokens, num_heads, num_kv_splits]`` (every split writes its own, empty ones too)."""
    partial_out = torch.empty(
        num_tokens, num_heads, num_kv_splits, head_dim_pad, dtype=torch.float32, device=device
    )
    partial_max = torch.empty(
        num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=device
    )
    return partial_out, partial_max, torch.empty_like(partial_max)


def reduce_splits(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # from split_partials
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    num_seqs: int,
) -> None:
    """Merges the splits of every real token into ``out`` (padding rows are left alone)."""
    partial_out, partial_max, partial_sum = partials
    num_tokens, num_heads, num_kv_splits, head_dim_pad = partial_out.shape
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query_start_loc,
        num_seqs,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=out.shape[2],
        HEAD_DIM_PAD=head_dim_pad,
        NUM_KV_SPLITS=num_kv_splits,
        num_warps=4,
    )
