"""Write this step's K/V into the paged cache, one slot per token.

Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; a request's token
``t`` goes to ``block_table[t // block_size] * block_size + t % block_size``. A slot of
``-1`` marks a padding token (e.g. a CUDA-graph batch padded up): it is not written.

An FP8 cache (``--kv-cache-dtype fp8``, see ``worker/kv_cache_dtype.py``) stores
``e4m3(clamp(x / scale, ±max))`` with the layer's ``k_scale`` / ``v_scale``: saturating,
so an outlier becomes ±max instead of inf/NaN.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton
from vtllm.worker.kv_cache_dtype import is_fp8, quantize_fp8_ref


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    k_scale_ptr,  # [] fp32, read when QUANTIZE
    v_scale_ptr,  # [] fp32, read when QUANTIZE
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
    QUANTIZE: tl.constexpr,  # FP8 cache: divide by the scale, saturate at FP8_MAX
    FP8_MAX: tl.constexpr,
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
    if QUANTIZE:
        # div_rn: IEEE division, as torch's reference (plain ``/`` may be approximate)
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + k_dst + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(v_cache_ptr + v_dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding, skip
    k_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
) -> None:
    """Store ``k[t]``/``v[t]`` at slot ``slot_mapping[t]`` of the caches, in place.

    k and v may be strided views (e.g. slices of a fused qkv output) as long as their
    last axis is contiguous; values are cast to the cache dtype. Slots must be distinct.
    An FP8 cache needs ``k_scale`` and ``v_scale`` (device scalars) and stores
    ``e4m3(clamp(x / scale, ±max))``; other caches ignore them.
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
    quantize = _check_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quantize else slot_mapping,  # unread without QUANTIZE
        v_scale if quantize else slot_mapping,
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
        QUANTIZE=quantize,
        FP8_MAX=torch.finfo(k_cache.dtype).max if quantize else 0.0,
        num_warps=1 if head_dim <= 128 else 2,
    )


def _check_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Whether the cache is FP8 (and so quantised on write); ValueError when an FP8 cache
    comes without its scales."""
    if not is_fp8(k_cache.dtype):
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale")
    if k_scale.numel() != 1 or v_scale.numel() != 1:
        raise ValueError("k_scale and v_scale must be one number each (per-tensor scales)")
    return True


def reshape_and_cache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding, skip
    k_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain-torch ``reshape_and_cache`` (same contract)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()  # [num_kept]
    k, v = k[keep], v[keep]  # [num_kept, num_kv_heads, head_dim]
    if _check_scales(k_cache, k_scale, v_scale):
        # index_copy_ has no fp8 kernels: quantise, then copy the bytes
        k = quantize_fp8_ref(k, k_scale, k_cache.dtype).view(torch.uint8)
        v = quantize_fp8_ref(v, v_scale, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
