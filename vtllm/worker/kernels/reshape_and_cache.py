"""Write this step's K/V into the paged cache, one slot per token.

Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; a request's token
``t`` goes to ``block_table[t // block_size] * block_size + t % block_size``. A slot of
``-1`` marks a padding token (e.g. a CUDA-graph batch padded up): it is not written.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token_id = tl.program_id(0)
    head_id = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token_id).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    slot_in_block = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + token_id * stride_k_token + head_id * stride_k_head + offs_d, mask=d_mask)
    v = tl.load(v_ptr + token_id * stride_v_token + head_id * stride_v_head + offs_d, mask=d_mask)
    k_dst = block_id * stride_kc_block + slot_in_block * stride_kc_slot + head_id * stride_kc_head
    v_dst = block_id * stride_vc_block + slot_in_block * stride_vc_slot + head_id * stride_vc_head
    tl.store(k_cache_ptr + k_dst + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(v_cache_ptr + v_dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding, skip
) -> None:
    """Store ``k[t]``/``v[t]`` at slot ``slot_mapping[t]`` of the caches, in place.

    k and v may be strided views (e.g. slices of a fused qkv output) as long as their
    last axis is contiguous; values are cast to the cache dtype. Slots must be distinct.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match"
        )
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache holds [{', '.join(map(str, k_cache.shape[2:]))}] per slot, "
            f"k has [{num_kv_heads}, {head_dim}] per token"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches need a contiguous last (head_dim) axis")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if head_dim <= 128 else 2,
    )


def reshape_and_cache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding, skip
) -> None:
    """Plain-torch ``reshape_and_cache`` (same contract)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()  # [num_kept]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep].to(v_cache.dtype))
