"""Rotary position embedding (NeoX / rotate-half layout), applied to q and k in place.

The cos/sin cache holds one row per position, cos then sin::

    cos_sin_cache[pos] = [cos(pos * f_0) .. cos(pos * f_{r/2-1}) | sin(pos * f_0) .. ]
                          <------------- r/2 ------------->       <----- r/2 ----->

with ``r = rotary_dim <= head_dim`` (build it once with ``layers.rotary.cos_sin_table``). The first ``r`` dims of each head are rotated as halves,
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``; dims ``r..head_dim`` are untouched.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton


@triton.jit
def _rotate_heads(
    x_ptr,  # one token's [num_heads, head_dim] rows
    stride_head,
    num_heads,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    first = x_ptr + offs_h[:, None] * stride_head + offs_d[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cos_sin_cache_ptr,  # [max_position, rotary_dim]
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache_pos,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
):
    token_id = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token_id).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    cache_row = cos_sin_cache_ptr + pos * stride_cache_pos
    cos = tl.load(cache_row + offs_d, mask=offs_d < HALF, other=1.0).to(tl.float32)
    sin = tl.load(cache_row + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token_id * stride_q_token,
        stride_q_head,
        num_heads,
        cos,
        sin,
        HALF,
        HALF_PAD,
        Q_HEADS_PAD,
    )
    _rotate_heads(
        k_ptr + token_id * stride_k_token,
        stride_k_head,
        num_kv_heads,
        cos,
        sin,
        HALF,
        HALF_PAD,
        K_HEADS_PAD,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], cos | sin
) -> None:
    """Rotate the first ``rotary_dim`` dims of every q and k head by its token's position.

    q and k may be strided views of a fused qkv output (last axis contiguous). The math
    runs in fp32 and is rounded once to q's / k's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or positions.shape != (num_tokens,):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} "
            "disagree on num_tokens or head_dim"
        )
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last axis")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        HALF=rotary_dim // 2,
        HALF_PAD=triton.next_power_of_2(rotary_dim // 2),
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
    )


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], cos | sin
) -> None:
    """Plain-torch ``rotary_embedding`` (same contract)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # [num_tokens, rotary_dim]
    cos = cos_sin[:, None, :half]  # [num_tokens, 1, half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()  # [num_tokens, heads, half]
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
