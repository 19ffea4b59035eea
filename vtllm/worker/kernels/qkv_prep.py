"""From the fused qkv projection to attention's inputs in one kernel: per-head q/k RMSNorm
(optional), rotary on q and k, q written out and k/v stored in the paged cache.

A decode step used to run up to six kernels a layer for this (a copy and a norm for q, the
same for k, rotary, the cache write); at batch 1 each is a few microseconds of launch and
tail for a few hundred bytes. One program per (token, head)::

    qkv[t] = [ q_0 .. q_{H-1} | k_0 .. k_{KV-1} | v_0 .. v_{KV-1} ]   (head_dim each)
    head h < H:   q_out[t, h] = rope(norm_q(q_h))
    head H + j:   k_cache[slot] [j] = rope(norm_k(k_j)),  v_cache[slot] [j] = v_j
                  (nothing stored for slot -1: padding; FP8 caches quantised as in
                  ``reshape_and_cache.py``)

With ``input_stream`` (the MoE decode chain, ``models/moe_llama.py``) the projection was
of the residual stream times the input norm's weight, not of the normed stream: the kernel
computes that norm's ``1/rms`` from the stream row and multiplies q, k and v by it first
(rounded to the activation dtype), which finishes the norm after the projection instead of
before it (equal up to rounding: the norm is a per-row scalar times the weight).

The arithmetic is that of the kernels it replaces (equal to the unfused sequence up to the
fp32 summation order inside the norm and fused multiply-adds): the norm (``rms_norm.py``: Llama rounds before the weight, Gemma after)
rounds to the activation dtype, then the rotation (``rotary.py``, NeoX halves over the
first ``rotary_dim`` dims) runs in fp32 and rounds once. The rotation reads each lane's
partner (``d ± rotary_dim/2``) with a second load instead of shuffling registers.
``qkv_prep_ref`` is that unfused sequence of torch references.
"""

from __future__ import annotations

import torch

from vtllm.worker.kernels._triton import tl, triton
from vtllm.worker.kernels.reshape_and_cache import _check_scales, reshape_and_cache_ref
from vtllm.worker.kernels.rms_norm import rms_norm_ref
from vtllm.worker.kernels.rotary import rotary_embedding_ref

# NORM constexpr: no q/k norm, Llama/Qwen3 RMSNorm, Gemma RMSNorm (1 + w, or w for Gemma 4)
NO_NORM, LLAMA_NORM, GEMMA_NORM = 0, 1, 2


@triton.jit
def _normed(x, rstd, w_ptr, offs, mask, NORM: tl.constexpr, WEIGHT_OFFSET: tl.constexpr):
    """``x`` (activation dtype) normed with the row's ``rstd``, in the activation dtype,
    rounded exactly as ``_rms_norm_kernel`` rounds."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if NORM == 2:
        return (x.to(tl.float32) * rstd * (WEIGHT_OFFSET + w.to(tl.float32))).to(x.dtype)
    return (x.to(tl.float32) * rstd).to(x.dtype) * w.to(x.dtype)


@triton.jit
def stream_rstd(row_ptr, hidden, eps, HIDDEN_PAD: tl.constexpr):
    """The input RMSNorm's ``1/rms`` of one residual-stream row ``[hidden]`` (fp32
    scalar), computed as ``_rms_norm_kernel`` computes it."""
    offs = tl.arange(0, HIDDEN_PAD)
    row = tl.load(row_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(row * row, 0) / hidden + eps)


@triton.jit
def rotary_lanes(cos_sin_row_ptr, offs, HALF: tl.constexpr):
    """``(cos, sin, rotated)`` of each lane ``offs`` at one position's ``[cos | sin]``
    row: 1 and 0 on the lanes past ``2 * HALF`` (not rotated)."""
    rotated = offs < 2 * HALF
    lane = offs % HALF
    cos = tl.load(cos_sin_row_ptr + lane, mask=rotated, other=1.0)
    sin = tl.load(cos_sin_row_ptr + HALF + lane, mask=rotated, other=0.0)
    return cos, sin, rotated


@triton.jit
def prep_heads(
    x,  # [HEAD_DIM_PAD] or [rows, HEAD_DIM_PAD]: heads of the projection (activation dtype)
    x_partner,  # the same lanes' rotation partners (d ± HALF)
    input_rstd,  # fp32 scalar: the input norm's 1/rms (INPUT_RSTD), else unread
    norm_ptr,  # [HEAD_DIM] per-head norm weight (NORM)
    eps,
    cos,  # [HEAD_DIM_PAD] fp32 (rotary_lanes)
    sin,
    rotated,
    offs,  # [HEAD_DIM_PAD]
    partner,
    mask,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    INPUT_RSTD: tl.constexpr,
    AXIS: tl.constexpr,  # x's head_dim axis: 0 (one head) or 1 (rows of heads)
):
    """Heads as attention reads them: the input norm's 1/rms (``INPUT_RSTD``), the
    per-head norm (``NORM``), rotary; rounded to x's dtype after each step as the
    unfused kernels round (module docstring). Also ``paged_attention``'s fused prep."""
    if INPUT_RSTD:
        x = (x.to(tl.float32) * input_rstd).to(x.dtype)
        x_partner = (x_partner.to(tl.float32) * input_rstd).to(x.dtype)
    if NORM != 0:
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, AXIS, keep_dims=True) / HEAD_DIM + eps)
        x_partner = _normed(x_partner, rstd, norm_ptr, partner, mask, NORM, WEIGHT_OFFSET)
        x = _normed(x, rstd, norm_ptr, offs, mask, NORM, WEIGHT_OFFSET)
    sign = tl.where(offs < HALF, -1.0, 1.0)  # (x1 cos - x2 sin, x2 cos + x1 sin)
    out = x.to(tl.float32) * cos + sign * x_partner.to(tl.float32) * sin
    return tl.where(rotated, out, x.to(tl.float32)).to(x.dtype)


@triton.jit
def _qkv_prep_kernel(
    q_out_ptr,  # [num_tokens, num_heads, HEAD_DIM] contiguous
    qkv_ptr,  # [num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM], last axis contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,
    q_norm_ptr,  # [HEAD_DIM]; read when NORM
    k_norm_ptr,
    positions_ptr,  # [num_tokens]
    cos_sin_cache_ptr,  # [max_position, 2 * HALF] fp32: cos | sin
    slot_mapping_ptr,  # [num_tokens]; -1 = padding
    k_scale_ptr,  # [] fp32, read when QUANTIZE
    v_scale_ptr,
    stream_ptr,  # [num_tokens, hidden], read when INPUT_RSTD
    stride_qkv_token,
    stride_cache_pos,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_stream_token,
    num_heads,
    num_kv_heads,
    eps,
    hidden,
    input_eps,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    NORM: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INPUT_RSTD: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,  # power of two >= hidden (INPUT_RSTD only)
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < num_heads
    offs = tl.arange(0, HEAD_DIM_PAD)
    mask = offs < HEAD_DIM
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)  # the other half's lane
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin, rotated = rotary_lanes(cos_sin_cache_ptr + pos * stride_cache_pos, offs, HALF)
    row = qkv_ptr + token * stride_qkv_token + head * HEAD_DIM  # q heads, then k heads
    x = tl.load(row + offs, mask=mask, other=0.0)  # [HEAD_DIM_PAD]
    x_partner = tl.load(row + partner, mask=mask & rotated, other=0.0)
    input_rstd = 1.0
    if INPUT_RSTD:
        input_rstd = stream_rstd(
            stream_ptr + token * stride_stream_token, hidden, input_eps, HIDDEN_PAD
        )
    if is_q:
        out = prep_heads(
            x, x_partner, input_rstd, q_norm_ptr, eps, cos, sin, rotated, offs, partner, mask,
            HEAD_DIM, HALF, NORM, WEIGHT_OFFSET, INPUT_RSTD, 0,
        )  # fmt: skip
    else:
        out = prep_heads(
            x, x_partner, input_rstd, k_norm_ptr, eps, cos, sin, rotated, offs, partner, mask,
            HEAD_DIM, HALF, NORM, WEIGHT_OFFSET, INPUT_RSTD, 0,
        )  # fmt: skip
    if is_q:
        tl.store(q_out_ptr + (token * num_heads + head) * HEAD_DIM + offs, out, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - num_heads
            block_id = slot // BLOCK_SIZE
            slot_in_block = slot % BLOCK_SIZE
            v_row = qkv_ptr + token * stride_qkv_token + (head + num_kv_heads) * HEAD_DIM
            v = tl.load(v_row + offs, mask=mask, other=0.0)
            if INPUT_RSTD:
                v = (v.to(tl.float32) * input_rstd).to(v.dtype)
            k_dst = block_id * stride_kc_block + slot_in_block * stride_kc_slot
            v_dst = block_id * stride_vc_block + slot_in_block * stride_vc_slot
            k_dst += kv_head * stride_kc_head
            v_dst += kv_head * stride_vc_head
            if QUANTIZE:
                k = tl.clamp(tl.div_rn(out.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX, FP8_MAX)
                v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX, FP8_MAX)
            else:
                k = out
            tl.store(k_cache_ptr + k_dst + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + v_dst + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def norm_kind(q_norm: torch.Tensor | None, gemma_norm: bool) -> int:
    """The kernels' NORM constexpr for these q/k norm arguments."""
    return NO_NORM if q_norm is None else GEMMA_NORM if gemma_norm else LLAMA_NORM


def check_inputs(
    qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, k_cache, slots, stream
) -> None:
    """ValueError naming what disagrees among ``qkv_prep``'s inputs (also
    ``paged_attention``'s fused prep)."""
    num_tokens = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(
            f"qkv {tuple(qkv.shape)}: expected [num_tokens, {width}] with a contiguous last "
            f"axis for {num_heads} q heads + 2 x {num_kv_heads} kv heads of {head_dim}"
        )
    if positions.shape != (num_tokens,) or slots.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} / slot_mapping {tuple(slots.shape)} for "
            f"{num_tokens} tokens"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache holds [{', '.join(map(str, k_cache.shape[2:]))}] per slot, the layer "
            f"[{num_kv_heads}, {head_dim}]"
        )
    if stream is not None and (
        stream.dim() != 2
        or stream.shape[0] != qkv.shape[0]
        or stream.stride(-1) != 1
        or stream.dtype != qkv.dtype
    ):
        raise ValueError(
            f"input_stream {tuple(stream.shape)} {stream.dtype}: expected [{qkv.shape[0]}, "
            f"hidden] {qkv.dtype} with a contiguous last axis (one row per qkv row)"
        )


def qkv_prep(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,  # [num_tokens]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] fp32, cos | sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding
    q_norm: torch.Tensor | None = None,  # [head_dim]: per-head RMSNorm weights, or None
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
    weight_offset: float = 1.0,  # gemma_norm only: the scale is weight_offset + w
    k_scale: torch.Tensor | None = None,  # [] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None,
    input_stream: torch.Tensor | None = None,  # [num_tokens, hidden]: 1/rms of its rows first
    input_eps: float = 1e-6,  # the input norm's eps (with input_stream)
) -> torch.Tensor:
    """q ``[num_tokens, num_heads, head_dim]`` (new, contiguous), normed and rotated; k
    (normed, rotated) and v stored at their slots of the caches; qkv is not modified. Same
    contract as ``qkv_prep_ref``. ValueError on shapes that disagree or an FP8 cache without scales."""
    check_inputs(
        qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, k_cache,
        slot_mapping, input_stream,
    )  # fmt: skip
    quantize = _check_scales(k_cache, k_scale, v_scale)
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    norm = norm_kind(q_norm, gemma_norm)
    unread = cos_sin_cache  # any pointer for the arguments a constexpr leaves unread
    stream = qkv if input_stream is None else input_stream
    hidden = stream.shape[1]
    _qkv_prep_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, qkv, k_cache, v_cache,
        q_norm if q_norm is not None else unread, k_norm if k_norm is not None else unread,
        positions, cos_sin_cache, slot_mapping,
        k_scale if quantize else unread, v_scale if quantize else unread, stream,
        qkv.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stream.stride(0),
        num_heads, num_kv_heads, eps, hidden, input_eps,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        HALF=cos_sin_cache.shape[1] // 2, NORM=norm, WEIGHT_OFFSET=weight_offset,
        BLOCK_SIZE=k_cache.shape[1], QUANTIZE=quantize,
        FP8_MAX=torch.finfo(k_cache.dtype).max if quantize else 0.0,
        INPUT_RSTD=input_stream is not None, HIDDEN_PAD=triton.next_power_of_2(hidden),
        num_warps=1 if head_dim <= 128 else 2,
    )  # fmt: skip
    return q


def qkv_prep_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    gemma_norm: bool = False,
    weight_offset: float = 1.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    input_stream: torch.Tensor | None = None,
    input_eps: float = 1e-6,
) -> torch.Tensor:
    """Plain-torch ``qkv_prep`` (same contract): the unfused norm, rotary and cache write."""
    check_inputs(
        qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, k_cache,
        slot_mapping, input_stream,
    )  # fmt: skip
    num_tokens = qkv.shape[0]
    if input_stream is not None:  # the input norm's 1/rms, as rms_norm computes it
        stream = input_stream.float()
        rstd = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + input_eps)  # [num_tokens, 1]
        qkv = (qkv.float() * rstd).to(qkv.dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim).clone()  # qkv itself is left as it was
    k = k.reshape(num_tokens, num_kv_heads, head_dim).clone()
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q = rms_norm_ref(q, q_norm, eps, gemma=gemma_norm, weight_offset=weight_offset)[0]
        k = rms_norm_ref(k, k_norm, eps, gemma=gemma_norm, weight_offset=weight_offset)[0]
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
